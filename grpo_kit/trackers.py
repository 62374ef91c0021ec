"""Experiment trackers: what a run records, sent to trackio, TensorBoard, MLflow or Weights & Biases
(``report_to=``, TRL's name), or to a tracker of your own.

A tracker is an object with up to four hooks (:class:`Tracker` has them all, doing nothing). The driver calls
them through a :class:`TrackerSet`, which turns each record into scalars, gathers the sampled
completions into tables and keeps a failing tracker from failing the run: the first exception a
tracker raises (its package missing, a key refused, the network down) is one warning, and the run
goes on without that tracker.

- ``on_start(run)``: :class:`RunInfo` (the run's name, a stable id, its directory, the flat config as
  ``params``, whether it resumed).
- ``on_log(scalars, step)``: ``{name: float}`` of one record (every number it holds; a dict of numbers
  such as ``reward_components`` as ``reward_components/<name>``; each evaluation that finished as
  ``eval/<field>``), the iteration as step.
- ``on_table(rows, step)``: the sampled completions (the three per iteration of ``samples.jsonl``,
  columns :data:`TABLE_COLUMNS`) since the previous table, sent when an evaluation finishes, every
  :data:`TABLE_ROWS` rows and at the end.
- ``on_end(report)``: the run's HTML report (written at the end when a tracker is on; None when the
  run failed or the report could not be written).

A tracker of your own is the same few lines::

    class Printer(trackers.Tracker):
        def on_log(self, scalars, step):
            print(step, scalars.get("reward_mean"))

    trackers.register_tracker("printer", Printer)
    loop.run(config.profile("tiny", report_to="printer,tensorboard"))

The built-in trackers log offline unless told otherwise: ``tensorboard`` writes event files to
``<run_dir>/tensorboard``; ``mlflow`` a file store at ``<run_dir>/mlruns`` (``MLFLOW_TRACKING_URI``
names another); ``wandb`` runs in ``<run_dir>/wandb``, offline unless an API key is set (or
``WANDB_MODE`` says otherwise), and falls back to offline when it cannot reach the server;
``trackio`` its local store (``TRACKIO_DIR``, by default ``~/.cache/huggingface/trackio``).
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TABLE_COLUMNS = ("iteration", "version", "prompt", "completion", "reward", "gold")
"""The columns of a completions table (a :class:`~grpo_kit.records.Sample` 's fields)."""
TABLE_ROWS = 48
"""A completions table holds at most this many rows (16 iterations' samples)."""
PROJECT = "grpo-kit"
"""The project (wandb, trackio) or experiment (mlflow) runs are logged under unless a tracker is told another."""
NOT_SCALARS = frozenset({"iteration", "t_iter_start", "t_iter_end"})
"""Record keys that are not logged as scalars: the step itself, and Unix times (a float32 tracker
would round them to minutes)."""


@dataclass(frozen=True)
class RunInfo:
    """What a tracker learns of the run when it starts."""

    name: str
    """The run's name: its directory's name."""
    id: str
    """An id kept across resumed sessions of the run (``<run_dir>/trackers.json``)."""
    run_dir: Path
    """The run directory: offline trackers write under it."""
    params: dict = field(default_factory=dict)
    """The flat config (:meth:`~grpo_kit.config.Config.flat`): the run's parameters."""
    resumed: bool = False
    """The run resumed an earlier one (``loop.run(..., resume=True)``): continue the tracker's run."""

    @classmethod
    def for_run(cls, run_dir: str | os.PathLike, params: Mapping[str, Any], resumed: bool = False) -> RunInfo:
        """The run's info; a fresh run gets a new id (written to ``trackers.json``), a resumed one
        reads it back."""
        run_dir = Path(run_dir)
        path = run_dir / "trackers.json"
        saved = {}
        if resumed and path.is_file():
            try:
                saved = json.loads(path.read_text())
            except json.JSONDecodeError:
                saved = {}
        run_id = saved.get("id") or os.urandom(6).hex()
        if not saved:
            run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"id": run_id}))
        return cls(run_dir.resolve().name, run_id, run_dir, dict(params), bool(saved))


class Tracker:
    """A tracker's hooks; override those you need (each does nothing here)."""

    def on_start(self, run: RunInfo) -> None:
        """The run starts (or resumes)."""

    def on_log(self, scalars: dict[str, float], step: int) -> None:
        """One record's scalars (and finished evaluations'), at ``step`` (the iteration)."""

    def on_table(self, rows: list[dict], step: int) -> None:
        """Sampled completions since the previous table (at most :data:`TABLE_ROWS`)."""

    def on_failure(self, error: BaseException) -> None:
        """The run failed or was interrupted (called just before :meth:`on_end`, which gets no report)."""

    def on_end(self, report: Path | None) -> None:
        """The run ended; ``report`` is its HTML report (None if there is none)."""


TRACKERS: dict[str, Callable[[], Tracker]] = {}
"""Tracker factories by name (``report_to`` names them)."""


def register_tracker(name: str, factory: Callable[[], Tracker] | None = None):
    """Register ``factory`` (a :class:`Tracker` subclass or any callable returning a tracker) as
    ``report_to`` name ``name``; without ``factory``, a decorator. A name registered again is replaced."""
    if factory is None:
        return lambda f: register_tracker(name, f)
    if not name or "," in name or name.lower() in ("all", "none"):
        raise ValueError(f"a tracker name must be non-empty, without commas, and not 'all' or 'none': {name!r}")
    TRACKERS[name] = factory
    return factory


def resolve(names: Iterable[str]) -> list[str]:
    """``report_to`` names checked against the registry (``"all"``: every registered tracker).

    >>> resolve(["tensorboard", "all"]) == list(TRACKERS)
    True
    """
    names = list(names)
    if any(n.lower() == "all" for n in names):
        return list(TRACKERS)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {unknown}; registered: {sorted(TRACKERS)} "
                         "(grpo_kit.trackers.register_tracker adds one)")
    return names


# ---------------------------------------------------------------- records -> scalars and rows


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Every number of a record (a dict of numbers flattened as ``key/name``), with the evaluations
    that finished during it (:func:`eval_scalars`); a NaN or infinite value (a diverged loss or
    gradient norm) as ``nonfinite/<key>`` = 1, so that a curve that stops says why.

    >>> record_scalars({"iteration": 3, "loss": 0.5, "loss_x": None, "recovered": False, "grad_norm": float("inf"),
    ...                 "reward_components": {"fmt": 1.0}, "spans": [{"name": "train"}]})
    {'loss': 0.5, 'recovered': 0.0, 'nonfinite/grad_norm': 1.0, 'reward_components/fmt': 1.0}
    """
    out: dict[str, float] = {}
    for k, v in record.items():
        if k in NOT_SCALARS:
            continue
        if isinstance(v, Mapping):
            out.update(_nested(k, v))
        elif (x := _number(v)) is not None:
            out[k] = x
        elif isinstance(v, float):  # NaN or inf: not every tracker plots them
            out[f"nonfinite/{k}"] = 1.0
    return {**out, **eval_scalars(record.get("evals") or [])}


def _nested(key: str, values: Mapping) -> dict[str, float]:
    """A dict of numbers as ``<key>/<name>``, a NaN or infinite one as ``nonfinite/<key>/<name>`` = 1."""
    out = {}
    for name, v in values.items():
        if (x := _number(v)) is not None:
            out[f"{key}/{name}"] = x
        elif isinstance(v, float):
            out[f"nonfinite/{key}/{name}"] = 1.0
    return out


def eval_scalars(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Evaluation results as scalars: each number as ``eval/<field>`` (``eval/<set>/<field>`` for
    another eval set's, :attr:`~grpo_kit.config.DataConfig.eval_sets`; a dict of numbers such as
    ``pass_at`` as ``eval/pass_at/<k>``), the newest version's last; and, for the task's own set, as a
    record names them (:func:`grpo_kit.evals.attach`), ``base_acc`` for the base model's and
    ``eval_acc``/``eval_lenient_acc``/``eval_version`` (``eval_pass_at_k``/``eval_maj_acc`` when
    sampled) for a trained version's.

    >>> eval_scalars([{"version": 0, "acc": 0.25, "start": 1.0}, {"version": 2, "acc": 0.5},
    ...               {"version": 2, "acc": 0.9, "set": "math500"}])
    {'eval/version': 2.0, 'eval/acc': 0.5, 'base_acc': 0.25, 'eval_acc': 0.5, 'eval_version': 2.0, 'eval/math500/version': 2.0, 'eval/math500/acc': 0.9}
    """
    out: dict[str, float] = {}
    for res in sorted(results, key=lambda r: r.get("version", 0)):
        own = not isinstance(res.get("set"), str)
        prefix = "eval/" if own else f"eval/{res['set']}/"
        for k, v in res.items():
            if k in ("iteration", "start", "end", "set"):
                continue
            if isinstance(v, Mapping):
                out.update(_nested(prefix + k, v))
            elif (x := _number(v)) is not None:
                out[prefix + k] = x
            elif isinstance(v, float):
                out[f"nonfinite/{prefix}{k}"] = 1.0
        if not own or _number(res.get("acc")) is None:
            continue
        if res.get("version") == 0:
            out["base_acc"] = float(res["acc"])
            continue
        out.update({"eval_acc": float(res["acc"]), "eval_version": float(res["version"])})
        if _number(res.get("lenient_acc")) is not None:
            out["eval_lenient_acc"] = float(res["lenient_acc"])
        if isinstance(res.get("pass_at"), Mapping) and _number(res["pass_at"].get(str(res.get("samples")))) is not None:
            out["eval_pass_at_k"] = float(res["pass_at"][str(res["samples"])])
        if _number(res.get("maj_acc")) is not None:
            out["eval_maj_acc"] = float(res["maj_acc"])
    return out


def table_rows(samples: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Completions-table rows (:data:`TABLE_COLUMNS`) of ``samples.jsonl`` entries."""
    return [{c: s.get(c) for c in TABLE_COLUMNS} for s in samples]


def param_values(params: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """Parameters as trackers that take only scalars want them: lists, tuples, dicts and None as JSON.

    >>> param_values({"lr": 1e-3, "stop": ("\\n",), "store_url": None})
    {'lr': 0.001, 'stop': '["\\\\n"]', 'store_url': 'null'}
    """
    return {k: v if isinstance(v, (str, int, float, bool)) else json.dumps(v) for k, v in params.items()}


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    """Rows as a Markdown table (what TensorBoard's text tab renders); cells escaped.

    >>> print(markdown_table([{"a": "x|y", "b": "1\\n2"}], ["a", "b"]))
    | a | b |
    |---|---|
    | x\\|y | 1<br>2 |
    """
    def cell(v):
        return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- what the driver calls


class TrackerSet:
    """The trackers of one run, called by the driver; a tracker that raises is warned about once and
    dropped. Empty (``TrackerSet()``), every call does nothing."""

    def __init__(self, trackers: Mapping[str, Tracker] | None = None):
        self.active: dict[str, Tracker] = dict(trackers or {})
        self.rows: list[dict] = []
        self.step = -1
        self.started = self.ended = False

    @classmethod
    def for_names(cls, names: Iterable[str]) -> TrackerSet:
        """The trackers ``names`` (``report_to``) name; an unknown name raises at once, a factory that
        fails (e.g. its package is missing) warns and is left out."""
        out = cls()
        for name in resolve(names):
            try:
                out.active[name] = TRACKERS[name]()
            except Exception as e:  # noqa: BLE001 - a tracker never fails the run
                _warn(name, "could not be created", e)
        return out

    def __bool__(self) -> bool:
        return bool(self.active)

    def call(self, hook: str, *args) -> None:
        """``hook(*args)`` on every active tracker that has it; one that raises is warned about and dropped."""
        for name, tracker in list(self.active.items()):
            fn = getattr(tracker, hook, None)
            if fn is None:  # a hook a tracker leaves out (it need not subclass Tracker)
                continue
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never fails the run
                _warn(name, f"failed in {hook}", e)
                del self.active[name]
                if hook not in ("on_start", "on_end") and callable(getattr(tracker, "on_end", None)):
                    try:  # closed, best effort: a TensorBoard writer flushed, an MLflow run not left RUNNING
                        tracker.on_end(None)
                    except Exception:  # noqa: BLE001, S110 - it failed already; the warning said so
                        pass

    def start(self, run: RunInfo) -> None:
        self.started = True
        self.call("on_start", run)

    def start_run(self, run_dir: str | os.PathLike, params: Mapping[str, Any], resumed: bool = False) -> None:
        """:meth:`start` with the run's :class:`RunInfo` (none is made, nor ``trackers.json`` written,
        without a tracker)."""
        if self.active:
            self.start(RunInfo.for_run(run_dir, params, resumed))

    def add_samples(self, samples: Iterable[Mapping[str, Any]]) -> None:
        """Completions for the next table (the driver's ``samples.jsonl`` entries)."""
        if self.active:
            self.rows += table_rows(samples)

    def on_record(self, record: Mapping[str, Any]) -> None:
        """A committed record: its scalars at its iteration; the completions table when an evaluation
        finished or :data:`TABLE_ROWS` rows are waiting."""
        if not self.active:
            return
        self.step = int(record["iteration"])
        self.call("on_log", record_scalars(record), self.step)
        if record.get("evals") or len(self.rows) >= TABLE_ROWS:
            self.flush_table()

    def on_eval(self, results: Sequence[Mapping[str, Any]], step: int) -> None:
        """Evaluations that finished after the last record was logged (the final one), at ``step``."""
        if self.active and results:
            self.step = max(self.step, step)
            self.call("on_log", eval_scalars(results), step)
            self.flush_table()

    def flush_table(self) -> None:
        while self.rows and self.active:
            rows, self.rows = self.rows[:TABLE_ROWS], self.rows[TABLE_ROWS:]
            self.call("on_table", rows, max(self.step, max(int(r["iteration"]) for r in rows)))

    def end(self, report: Path | None = None, error: BaseException | None = None) -> None:
        """The last table, ``on_failure(error)`` when the run failed or was interrupted, and ``on_end``
        (once; a second call, or one before :meth:`start`, does nothing)."""
        if self.ended or not self.started:
            return
        self.ended = True
        self.flush_table()
        if error is not None:
            self.call("on_failure", error)
        self.call("on_end", report)

    def finish_run(self, run_dir: str | os.PathLike) -> Path | None:
        """The end of a run that completed: its HTML report is written and handed to the trackers."""
        report = None
        if self.active and self.started and not self.ended:
            from .report import write_report

            try:
                report = write_report(run_dir)
            except Exception as e:  # noqa: BLE001 - the report is a tracker's artifact here, not the run
                warnings.warn(f"report_to: the HTML report could not be written for the trackers: {e!r}", stacklevel=2)
        self.end(report)
        return report


def _warn(name: str, what: str, e: BaseException) -> None:
    hint = f" (pip install {e.name})" if isinstance(e, ImportError) and e.name else ""
    warnings.warn(f"report_to: tracker {name!r} {what} and is off for the rest of this run: "
                  f"{type(e).__name__}: {e}{hint}", RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------- the built-in trackers


class TensorBoardTracker(Tracker):
    """Event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>/tensorboard``): the
    scalars, the config in the HParams tab, the completions in the Text tab. No artifacts: the
    report's path is a text entry."""

    def __init__(self, log_dir: str | os.PathLike | None = None):
        self.log_dir = log_dir

    def on_start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(self.log_dir or run.run_dir / "tensorboard"))
        if not run.resumed:
            for summary in hparams(param_values(run.params), {}):
                self.writer.file_writer.add_summary(summary)

    def on_log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def on_table(self, rows: list[dict], step: int) -> None:
        self.writer.add_text("completions", markdown_table(rows), step)

    def on_end(self, report: Path | None) -> None:
        if report is not None:
            self.writer.add_text("report", f"HTML report: `{report}`")
        self.writer.close()


_MLFLOW_KEY = re.compile(r"[^0-9A-Za-z_\-. /]")


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: characters it refuses become ``_``, and the path is normalized
    (no leading, trailing or doubled ``/``: MLflow refuses those, which would drop the tracker).

    >>> mlflow_key("reward_components//lead/"), mlflow_key("eval/pass@k")
    ('reward_components/lead', 'eval/pass_k')
    """
    return "/".join(part for part in _MLFLOW_KEY.sub("_", key).split("/") if part) or "_"


class MLflowTracker(Tracker):
    """An MLflow run: metrics, params, the completions tables (``mlflow.log_table``: one file each in
    ``completions/``) and ``report.html`` as artifacts. The tracking URI is ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a file
    store at ``<run_dir>/mlruns`` (MLflow keeps that backend in maintenance mode and asks for
    ``MLFLOW_ALLOW_FILE_STORE=true``, set here unless already set)."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = PROJECT):
        self.tracking_uri, self.experiment = tracking_uri, experiment

    def on_start(self, run: RunInfo) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run.run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per table otherwise
        self.client = client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment)
        found = client.search_runs([exp_id], f"tags.`grpo_kit.id` = '{run.id}'") if run.resumed else []
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(exp_id, run_name=run.name, tags={"grpo_kit.id": run.id}).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in param_values(run.params).items()]
            client.log_batch(self.run_id, params=params)

    def on_log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, ts, step)
                                                    for k, v in scalars.items()])

    def on_table(self, rows: list[dict], step: int) -> None:
        data = {c: [r[c] for r in rows] for c in TABLE_COLUMNS}
        # a file per table: log_table appends to an existing one by reading it back through pandas,
        # which reads the whole table each time and turns a string such as a gold "1718" into a number
        self.tables = getattr(self, "tables", 0) + 1
        with warnings.catch_warnings():  # pandas' deprecation notes from inside mlflow
            warnings.simplefilter("ignore")
            self.client.log_table(self.run_id, data, f"completions/{self.tables:04d}-iteration-{step}.json")

    def on_failure(self, error: BaseException) -> None:
        self.status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"

    def on_end(self, report: Path | None) -> None:
        try:
            if report is not None:
                self.client.log_artifact(self.run_id, str(report))
        finally:  # an upload that fails must not leave the run RUNNING
            self.client.set_terminated(self.run_id, status=getattr(self, "status", "FINISHED"))


def wandb_key_set() -> bool:
    """Whether wandb has an API key: ``WANDB_API_KEY``, or ``wandb login``'s entry for the base URL's
    host in the netrc file wandb reads (``$NETRC``, else ``~/.netrc``)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    host = urllib.parse.urlsplit(url if "//" in url else f"//{url}").netloc
    try:
        return bool(netrc.netrc(os.environ.get("NETRC") or None).authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


class RunLogTracker(Tracker):
    """wandb's run API, which trackio copies: ``self.run.log`` for scalars, ``self.lib.Table`` for the
    completions table (``on_start`` sets ``self.lib`` and ``self.run``)."""

    def on_log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def on_table(self, rows: list[dict], step: int) -> None:
        table = self.lib.Table(columns=list(TABLE_COLUMNS), data=[[r[c] for c in TABLE_COLUMNS] for r in rows])
        self.run.log({"completions": table}, step=step)


class WandbTracker(RunLogTracker):
    """A Weights & Biases run in ``<run_dir>/wandb``: metrics, config, a ``completions`` table and the
    report as a ``report`` artifact. Offline (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it
    later) unless an API key is set (``WANDB_API_KEY``, or ``wandb login``'s netrc entry) or
    ``WANDB_MODE`` says otherwise; an online start that fails (no network) warns and goes offline."""

    def __init__(self, project: str | None = None, entity: str | None = None):
        self.project, self.entity = project, entity

    def on_start(self, run: RunInfo) -> None:
        import wandb

        self.lib = self.wandb = wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_key_set() else "offline")
        kw = dict(project=self.project or os.environ.get("WANDB_PROJECT", PROJECT), entity=self.entity, name=run.name,
                  id=run.id, resume="allow" if run.resumed else None, dir=str(run.run_dir), config=run.params)
        try:
            self.run = wandb.init(mode=mode, **kw)
        except Exception as e:  # noqa: BLE001 - no network, a refused key: log offline instead
            if mode == "offline":
                raise
            warnings.warn(f"report_to: wandb could not start {mode} ({type(e).__name__}: {str(e)[:200]}); "
                          f"logging offline to {run.run_dir / 'wandb'} instead", RuntimeWarning, stacklevel=2)
            wandb.teardown()  # the failed start still holds the run's id
            self.run = wandb.init(mode="offline", **kw)

    def on_end(self, report: Path | None) -> None:
        try:
            if report is not None:
                art = self.wandb.Artifact(f"report-{self.run.id}", type="report")
                art.add_file(str(report))
                self.run.log_artifact(art)
        finally:  # an upload that fails must not leave the run unfinished
            self.run.finish(exit_code=getattr(self, "exit_code", None))

    def on_failure(self, error: BaseException) -> None:
        self.exit_code = 1  # the run shows as failed


class TrackioTracker(RunLogTracker):
    """A trackio run in its local store (``trackio show --project grpo-kit``): metrics, config, a
    ``completions`` table and the report as a ``report`` artifact."""

    def __init__(self, project: str = PROJECT):
        self.project = project

    def on_start(self, run: RunInfo) -> None:
        import trackio

        self.lib = trackio
        self.run = trackio.init(project=self.project, name=f"{run.name}-{run.id}", config=run.params,
                                resume="allow" if run.resumed else "never", embed=False)

    def on_end(self, report: Path | None) -> None:
        try:
            if report is not None:
                self.run.log_artifact(str(report), name="report", type="report")
        finally:
            self.run.finish()


register_tracker("trackio", TrackioTracker)
register_tracker("tensorboard", TensorBoardTracker)
register_tracker("mlflow", MLflowTracker)
register_tracker("wandb", WandbTracker)
