"""Batch execution: one papermill run of a notebook per grid point, the runs in parallel as Dask tasks.

:func:`sweep` expands a grid (``{"lr": [1e-3, 4e-3], "kl_beta": [0.0, 0.04]}``) into its points,
executes the notebook once per point with ``{**base_params, **point, "run_dir": <out_dir>/<name>}``
injected as papermill parameters, and collects every run's ``summary.json``: the notebook takes a
``run_dir`` parameter and leaves ``summary.json`` there, as the quickstart and the GSM8K notebook do.
The executed notebook goes to ``<out_dir>/<name>.ipynb``, beside its run directory ``<out_dir>/<name>/``;
the kernel runs in the notebook's directory, as in JupyterLab, so relative paths mean the same.

:func:`sweep_runs` does the same without a notebook: one ``loop.run`` per named point of config
overrides (each in a child interpreter, as a kernel would be), where a point's ``policy_loss`` or
``advantage`` may be a function from a notebook cell; :func:`compare_figure` draws such runs side by
side (held-out accuracy against GRPO wall time, the ratio's spread, clip fraction, mismatch KL).

Each execution is a Dask task: on the given client, or on a ``LocalCluster`` of ``max_parallel``
worker processes started for the sweep. Those are non-daemonic, as in :func:`grpo_kit.cluster.connect`:
the kernel papermill starts is an ordinary subprocess (it starts the run's own LocalCluster), but a
task is then also free to use multiprocessing itself. A tiny run keeps about two cores busy (its
rollout worker and its trainer worker), hence the default of one run per two cores.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dask
import plotly.graph_objects as go
from distributed import Client, LocalCluster, as_completed
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from .records import read_json, read_jsonl, run_files
from .series import own_evals

METRICS = ("acc_after", "kl_final", "clip_fraction", "grpo_wall_s")
"""summary.json keys :func:`sweep_figure` compares by default."""


class SweepError(RuntimeError):
    """Some grid points failed; ``results`` holds every point's result, the failed ones with ``error`` set."""

    def __init__(self, message: str, results: list[dict]):
        super().__init__(message)
        self.results = results


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the last axis varying fastest.

    >>> grid_points({"lr": [1e-3, 4e-3], "kl_beta": [0.0]})
    [{'lr': 0.001, 'kl_beta': 0.0}, {'lr': 0.004, 'kl_beta': 0.0}]
    """
    for key, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"grid[{key!r}] must be a non-empty list of values, got {values!r}")
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))]


def point_name(point: Mapping[str, Any]) -> str:
    """A file-name-safe name for a grid point.

    >>> point_name({"lr": 0.001, "kl_beta": 0.0, "loss_type": "dr_grpo"})
    'lr=0.001_kl_beta=0.0_loss_type=dr_grpo'
    """
    name = "_".join(f"{k}={v}" for k, v in point.items()) or "default"
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "-", name)


def run_point(notebook: str, output: str, params: dict[str, Any], cwd: str, kernel_name: str) -> dict[str, Any]:
    """Execute one notebook with papermill (the Dask task); returns the run's summary and timings.

    A cell that raises is reported in ``error`` (the executed notebook shows where); anything
    else (a kernel that dies, a missing notebook) fails the task.
    """
    import papermill as pm

    start = time.time()
    error = None
    summary_path = run_files(params["run_dir"]).summary
    summary_path.unlink(missing_ok=True)  # a previous sweep's must not pass for this run's
    try:
        pm.execute_notebook(notebook, output, parameters=params, kernel_name=kernel_name, cwd=cwd, progress_bar=False)
    except pm.PapermillExecutionError as e:
        error = f"{e.ename}: {e.evalue}"
    if error is None and not summary_path.is_file():
        error = f"the notebook finished but wrote no {summary_path}"
    summary = json.loads(summary_path.read_text()) if error is None else {}
    end = time.time()
    return {"summary": summary, "error": error, "start": start, "end": end, "wall_s": end - start}


def axis_order(value) -> tuple:
    """A sort key for an axis' values: numbers (ints and floats together) by value, then the rest
    by their text.

    >>> sorted([0.1, "b", 0, None, 0.04, 2], key=axis_order)
    [0, 0.04, 0.1, 2, None, 'b']
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (0, value, "") if number else (1, 0, str(value))


def default_parallelism() -> int:
    """One run per two CPU cores (a run's rollout and trainer workers each keep a core busy)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // 2)


def sweep(
    notebook: str | os.PathLike,
    grid: Mapping[str, Sequence[Any]],
    base_params: Mapping[str, Any] | None = None,
    out_dir: str | os.PathLike = "runs/sweep",
    *,
    client=None,
    max_parallel: int | None = None,
    kernel_name: str = "python3",
    raise_errors: bool = True,
) -> list[dict[str, Any]]:
    """Execute ``notebook`` once per grid point, at most ``max_parallel`` at a time, as Dask tasks.

    Returns one dict per point, in grid order: ``name``, ``point``, ``params`` (all injected
    parameters), ``notebook`` (the executed copy), ``run_dir``, ``summary`` (its summary.json),
    ``error`` (None, or the failing cell's exception), ``start``/``end``/``wall_s``. With
    ``raise_errors`` a failed point raises :class:`SweepError` once every point has finished.
    """
    notebook = Path(notebook).resolve()
    if not notebook.is_file():
        raise FileNotFoundError(f"no notebook {notebook}")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    points = grid_points(grid)
    names = [point_name(p) for p in points]
    if len(set(names)) < len(names):
        raise ValueError(f"grid points share a name: {names}")
    _refuse_trl_names({**(base_params or {}), **grid})
    stores = [{**(base_params or {}), **p}.get("store_url") for p in points]
    shared = sorted({u for u in stores if u is not None and stores.count(u) > 1})
    if shared:  # as sweep_runs refuses it (a review: the second point failed after the first's whole run)
        raise ValueError(f"store_url {shared[0]!r} is shared by several grid points: give each its own "
                         "(a grid axis), or none: each point's store is then in its run_dir")
    max_parallel = default_parallelism() if max_parallel is None else max_parallel
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
    jobs = [
        {
            "name": name,
            "point": point,
            "params": {**(base_params or {}), **point, "run_dir": str(out / name)},
            "notebook": str(out / f"{name}.ipynb"),
            "run_dir": str(out / name),
        }
        for name, point in zip(names, points, strict=True)
    ]

    def submit(client: Client, job: dict):
        return client.submit(
            run_point,
            str(notebook),
            job["notebook"],
            job["params"],
            str(notebook.parent),
            kernel_name,
            key=f"sweep-{job['name']}-{uuid.uuid4().hex[:8]}",
            pure=False,
        )

    results = _on_cluster(client, jobs, submit, max_parallel)
    failed = [r for r in results if r["error"]]
    if failed and raise_errors:
        lines = "\n".join(f"  {r['name']}: {r['error']} (see {r['notebook']})" for r in failed)
        raise SweepError(f"{len(failed)} of {len(results)} grid points failed:\n{lines}", results)
    return results


def _on_cluster(client, jobs: list[dict], submit, max_parallel: int) -> list[dict]:
    """:func:`_execute` on ``client``, or on a LocalCluster of non-daemonic workers started for it."""
    with dask.config.set({"distributed.worker.daemon": False}):
        own = client is None
        if own:
            cluster = LocalCluster(
                n_workers=min(max_parallel, len(jobs)),
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address="127.0.0.1:0",
                memory_limit=0,
            )
            client = Client(cluster)
        try:
            return _execute(client, jobs, submit, max_parallel)
        finally:
            if own:
                client.close()
                cluster.close()


def _execute(client: Client, jobs: list[dict], submit, max_parallel: int) -> list[dict]:
    """Submit the jobs (``submit(client, job)`` -> a future), keeping at most ``max_parallel`` in
    flight; results in job order."""
    waiting = list(enumerate(jobs))[::-1]
    running = as_completed()
    job_of = {}

    def launch() -> None:
        i, job = waiting.pop()
        fut = submit(client, job)
        job_of[fut.key] = i
        running.add(fut)

    for _ in range(min(max_parallel, len(jobs))):
        launch()
    results: list[dict] = [{}] * len(jobs)
    for fut in running:
        i = job_of[fut.key]
        if fut.status == "error":
            exc = fut.exception()
            res = {"summary": {}, "error": f"{type(exc).__name__}: {exc}", "start": None, "end": None, "wall_s": None}
        else:
            res = fut.result()
        results[i] = {**jobs[i], **res}
        if waiting:
            launch()
    return results


# ---------------------------------------------------------------- runs of configs (no notebook)


def run_config(spec: bytes, run_dir: str) -> dict[str, Any]:
    """One ``loop.run`` of a cloudpickled ``{"profile", "params", "policy_loss", "advantage"}`` (the
    Dask task of :func:`sweep_runs`), in a child interpreter as papermill's kernel would be: the run
    starts its own LocalCluster in that child's main thread. Its output goes to ``<run_dir>.log``;
    returns the run's summary, records and timings, ``error`` set when the child failed."""
    import subprocess
    import sys

    run_path = Path(run_dir)
    run_path.mkdir(parents=True, exist_ok=True)
    spec_path = run_path / "sweep_spec.pkl"
    spec_path.write_bytes(spec)
    log = run_path.with_name(run_path.name + ".log")
    files = run_files(run_dir)
    for old in (files.metrics, files.summary):  # a point runs afresh: a child that fails before its run
        old.unlink(missing_ok=True)  # clears them (a bad dataset) must not return an earlier sweep's
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "grpo_kit.sweep", str(spec_path)], stdout=out, stderr=subprocess.STDOUT, check=False
        )
    end = time.time()
    error = None
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        error = f"exit {proc.returncode}: {tail[-1] if tail else 'no output'} (see {log})"
    summary = read_json(files.summary) if error is None else {}
    if error is None and not summary:
        error = f"the run finished but wrote no {files.summary}"
    return {
        "summary": summary,
        "records": read_jsonl(files.metrics),
        "error": error,
        "start": start,
        "end": end,
        "wall_s": end - start,
        "log": str(log),
    }


def _refuse_trl_names(params: Mapping[str, Any]) -> None:
    """A notebook reads its config from the kit's field names (:func:`grpo_kit.config.overrides_in`):
    a TRL name (``learning_rate``) would be injected and never read, so every point would run alike."""
    from .config import flat_field_names
    from .trl_config import RENAMES

    trl = sorted(k for k in params if k in RENAMES and k not in set(flat_field_names()))
    if trl:
        raise ValueError(f"sweep parameter(s) {trl} are TRL's names, which a notebook does not read: use the kit's "
                         f"({', '.join(f'{k} -> {RENAMES[k]}' for k in trl)})")


def _run_spec(spec_path: str) -> None:
    """The child of :func:`run_config`: the run of one point."""
    import shutil

    import cloudpickle

    from . import algorithms, config, loop

    spec = cloudpickle.loads(Path(spec_path).read_bytes())
    for kind, (name, fn) in spec.get("registered", {}).items():
        algorithms.REGISTRIES[kind][name] = fn  # (the flags, zero_adv_is_zero and takes_unscorable, are on the function)
    cfg = config.profile(spec["profile"], **spec["params"])
    if cfg.run.store_url is None:
        shutil.rmtree(cfg.run.store_root, ignore_errors=True)  # a point is run afresh (a re-run sweep)
    loop.run(cfg, progress=False, policy_loss=spec["policy_loss"], advantage=spec["advantage"])


PLUGINS = ("policy_loss", "advantage")
"""Config fields a :func:`sweep_runs` point may set to a function instead of a name."""


def point_spec(profile: str, params: Mapping[str, Any]) -> tuple[dict, bytes]:
    """A :func:`sweep_runs` point checked (``config.profile``: a bad value stops here, before any run)
    and packed for :func:`run_config`: its parameters with each plug-in function by its name, and the
    cloudpickled spec. A plug-in function travels by value; so does one registered by name in this
    process (a notebook cell's ``register_policy_loss``), registered again in the run's child, which
    never ran the cell (a review: every such run died there, "policy_loss must be one of")."""
    import cloudpickle

    from . import algorithms, config

    params = dict(params)
    fns = {k: params.pop(k) for k in PLUGINS if callable(params.get(k))}
    named = {**params, **{k: algorithms.reference(fn) for k, fn in fns.items()}}
    config.profile(profile, **named)
    registered = {k: (params[k], algorithms.REGISTRIES[k][params[k]]) for k in PLUGINS
                  if isinstance(params.get(k), str) and params[k] in algorithms.REGISTRIES[k]}
    spec = {"profile": profile, "params": params, "policy_loss": fns.get("policy_loss"),
            "advantage": fns.get("advantage"), "registered": registered}
    return named, cloudpickle.dumps(spec)


def sweep_runs(
    runs: Mapping[str, Mapping[str, Any]],
    profile: str = "tiny",
    base_params: Mapping[str, Any] | None = None,
    out_dir: str | os.PathLike = "runs/sweep",
    *,
    client=None,
    max_parallel: int | None = None,
    raise_errors: bool = True,
    shared_cluster: bool = False,
) -> list[dict[str, Any]]:
    """One ``loop.run`` per named point, at most ``max_parallel`` at a time, as Dask tasks.

    ``shared_cluster``: the runs go one after another to ONE cluster of the profile's rollout and
    trainer workers, started here (each run still builds its own engines and trainer ranks; the
    worker processes and their imports are paid once), instead of a LocalCluster per run.

    ``runs`` maps a file-name-safe name to config overrides applied over ``base_params`` on
    ``profile`` (``{"gspo": {"policy_loss": "gspo"}, "rloo": {"advantage": "rloo"}}``); a point's
    ``policy_loss`` or ``advantage`` may be a function (a notebook cell's), which travels to the run by
    cloudpickle as ``loop.run(..., policy_loss=fn)`` takes it. Every point is validated before any
    runs. Returns what :func:`sweep` returns (``point`` with a function given as ``module:qualname``),
    plus each run's ``records`` (its ``metrics.jsonl``) and ``log`` (the run's output).
    """
    import cloudpickle

    from . import config

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = dict(base_params or {})
    jobs = []
    for name, overrides in runs.items():
        if not re.fullmatch(r"[A-Za-z0-9_.=+-]+", name or "") or re.fullmatch(r"\.+", name):
            raise ValueError(f"run name {name!r} is not file-name safe (letters, digits, _ . = + -; not only dots, "
                             "which name the output directory or its parent)")
        named, spec = point_spec(profile, {**base, **overrides, "run_dir": str(out / name)})
        jobs.append(
            {
                "name": name,
                "point": {k: named[k] for k in overrides},
                "params": named,
                "spec": spec,
                "run_dir": str(out / name),
            }
        )
    if not jobs:
        raise ValueError("runs is empty")
    stores = [config.profile(profile, **job["params"]).run.store_url for job in jobs]
    shared = sorted({u for u in stores if u is not None and stores.count(u) > 1})
    if shared:  # the runs would publish into one store (FileExistsError, or one run's versions in another's)
        raise ValueError(f"store_url {shared[0]!r} is shared by several runs: give each run its own (or none: "
                         "each run's store is then in its run_dir)")
    max_parallel = default_parallelism() if max_parallel is None else max_parallel
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
    grpo_client = None
    if shared_cluster:  # one run at a time per cluster (a run registers its engines on every rollout worker)
        from . import cluster

        c = config.profile(profile, **jobs[0]["params"]).cluster
        shape = ("n_rollout_workers", "world_size", "n_reward_workers", "n_eval_workers", "threads_per_worker")
        differ = {k for job in jobs for k in shape
                  if getattr(config.profile(profile, **job["params"]).cluster, k) != getattr(c, k)}
        if differ:  # one cluster serves every run: a run that asks for another shape would not get it
            raise ValueError(f"shared_cluster: the runs differ in {sorted(differ)}; give them one cluster shape "
                             "(base_params), or run without shared_cluster")
        grpo_client = cluster.connect(
            n_rollout_workers=c.n_rollout_workers,
            n_trainer_workers=c.world_size,
            n_reward_workers=c.n_reward_workers,
            n_eval_workers=c.n_eval_workers,
            threads_per_worker=c.threads_per_worker,
            quiet=True,
        )
        max_parallel = 1
        for job in jobs:
            spec = cloudpickle.loads(job["spec"])
            spec["params"]["scheduler_address"] = grpo_client.scheduler.address
            job["spec"] = cloudpickle.dumps(spec)

    def submit(client: Client, job: dict):
        return client.submit(
            run_config, job["spec"], job["run_dir"], key=f"run-{job['name']}-{uuid.uuid4().hex[:8]}", pure=False
        )

    try:
        results = _on_cluster(client, jobs, submit, max_parallel)
    finally:
        if grpo_client is not None:
            cluster.shutdown(grpo_client)
    for r in results:
        r.pop("spec", None)
        r.setdefault("records", [])
    failed = [r for r in results if r["error"]]
    if failed and raise_errors:
        lines = "\n".join(f"  {r['name']}: {r['error']}" for r in failed)
        raise SweepError(f"{len(failed)} of {len(results)} runs failed:\n{lines}", results)
    return results


def accuracy_curve(records: Sequence[Mapping[str, Any]], acc_before: float | None = None) -> list[tuple[float, float]]:
    """``(GRPO wall seconds, held-out accuracy)`` of a run: each evaluation at the loop's wall time of
    the iteration it finished in (the final one lands on the last record), the base model's at 0.
    Two evaluations can finish in one iteration (a lagging one beside the final): the record's
    ``evals`` holds both, in version order here (its ``eval_acc`` only the last; until 2026-12-03 the
    earlier was lost, and :func:`time_to` could miss the version that first reached a target)."""
    pts = [(0.0, acc_before)] if _is_num(acc_before) else []
    for r in records:
        if not _is_num(r.get("grpo_wall_s")):
            continue
        evs = sorted(own_evals(r), key=lambda ev: ev["version"])
        accs = [ev.get("acc") for ev in evs] if evs else [r.get("eval_acc")]
        pts += [(r["grpo_wall_s"], a) for a in accs if _is_num(a)]
    return pts


def time_to(records: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """The GRPO wall time at which a run's held-out accuracy first reached ``target`` (None: never)."""
    return next((t for t, acc in accuracy_curve(records) if acc >= target), None)


COMPARE_SERIES = ("ratio_std", "clip_frac", "mismatch_kl")
"""Per-iteration record keys :func:`compare_figure` draws beside the accuracy curve."""


def compare_figure(results: Sequence[Mapping[str, Any]], series_keys: Sequence[str] = COMPARE_SERIES) -> go.Figure:
    """Runs of :func:`sweep_runs` side by side: held-out accuracy against GRPO wall time, then one
    panel per record key against the iteration; one color per run, failed runs left out."""
    ok = [r for r in results if not r.get("error")]
    titles = ["held-out accuracy vs GRPO wall time (s)", *(f"{k} per iteration" for k in series_keys)]
    fig = make_subplots(rows=1, cols=len(titles), subplot_titles=titles, horizontal_spacing=0.06)
    palette = qualitative.Plotly
    for g, r in enumerate(ok):
        color, recs = palette[g % len(palette)], r.get("records") or []
        curve = accuracy_curve(recs, r["summary"].get("acc_before"))
        acc_xy = tuple(list(c) for c in zip(*curve, strict=True)) if curve else ([], [])
        lines = [acc_xy] + [
            (
                [rec.get("iteration") for rec in recs if _is_num(rec.get(k))],
                [rec[k] for rec in recs if _is_num(rec.get(k))],
            )
            for k in series_keys
        ]
        for col, (xs, ys) in enumerate(lines):
            fig.add_trace(
                go.Scatter(
                    x=list(xs),
                    y=list(ys),
                    mode="lines+markers",
                    name=r["name"],
                    legendgroup=r["name"],
                    showlegend=col == 0,
                    marker=dict(color=color, size=6),
                    line=dict(color=color),
                ),
                row=1,
                col=col + 1,
            )
    return panel_layout(fig, f"{len(ok)} of {len(results)} runs", len(titles))


def table(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per grid point (its values, its summary, its error), for a DataFrame."""
    return [{"name": r["name"], **r["point"], **r["summary"], "error": r["error"]} for r in results]


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _axis_value(v: Any) -> Any:
    return v if _is_num(v) else str(v)


def sweep_figure(
    results: Sequence[Mapping[str, Any]],
    x: str,
    color: str | None = None,
    metrics: Sequence[str] = METRICS,
) -> go.Figure:
    """One panel per summary metric against grid axis ``x``, one line per value of axis ``color``.

    Failed points and missing values are left out. A positive numeric ``x`` spanning a factor of
    ten or more gets a log axis.
    """
    ok = [r for r in results if not r.get("error")]
    groups: dict[str, tuple[Any, list[Mapping[str, Any]]]] = {}  # by the value's JSON: a list (``stop``) is a value
    for r in ok:
        value = r["point"].get(color) if color else None
        groups.setdefault(json.dumps(value, sort_keys=True, default=str), (value, []))[1].append(r)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=list(metrics), horizontal_spacing=0.07)
    palette = qualitative.Plotly
    for g, (value, rows) in enumerate(sorted(groups.values(), key=lambda vr: axis_order(vr[0]))):
        rows = sorted(rows, key=lambda r: axis_order(r["point"].get(x)))
        name = f"{color}={value}" if color else "runs"
        for m, metric in enumerate(metrics):
            pts = [(r["point"].get(x), r["summary"].get(metric), r["name"]) for r in rows]
            pts = [p for p in pts if _is_num(p[1]) and math.isfinite(p[1])]
            fig.add_trace(
                go.Scatter(
                    x=[_axis_value(p[0]) for p in pts],
                    y=[p[1] for p in pts],
                    text=[p[2] for p in pts],
                    mode="lines+markers",
                    name=name,
                    legendgroup=name,
                    showlegend=m == 0,
                    marker=dict(color=palette[g % len(palette)], size=9),
                    line=dict(color=palette[g % len(palette)]),
                    hovertemplate=f"%{{text}}<br>{metric}: %{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=m + 1,
            )
    xs = [r["point"].get(x) for r in ok]
    numeric = bool(xs) and all(_is_num(v) for v in xs)
    log = numeric and min(xs) > 0 and max(xs) / min(xs) >= 10
    fig.update_xaxes(title_text=x, type="log" if log else None)
    return panel_layout(fig, f"Sweep: {len(ok)} of {len(results)} runs" + (f", by {color}" if color else ""), len(metrics))


if __name__ == "__main__":  # run_config's child: python -m grpo_kit.sweep <spec.pkl>
    import sys

    _run_spec(sys.argv[1])


def panel_layout(fig: go.Figure, title: str, panels: int) -> go.Figure:
    """The sweep figures' shared layout: ``panels`` side by side, 330 px each, the legend above."""
    fig.update_layout(
        title=title,
        template="plotly_white",
        height=380,
        width=max(600, 330 * panels),
        legend=dict(orientation="h", yanchor="bottom", y=1.1, xanchor="right", x=1),
        margin=dict(l=50, r=30, t=90, b=50),
    )
    return fig
