"""Experiment trackers (``report_to``): what each real library was given, read back through its own
reader (TensorBoard's EventAccumulator, MlflowClient, trackio's SQLite store, W&B's offline run file
decoded with W&B's protobuf records), after one real tiny run on a LocalCluster with every tracker
on, and after records fed to the trackers directly.
"""

from __future__ import annotations

import glob
import json
import struct
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from grpo_kit import config, loop, records, trackers
from grpo_kit.trackers import RunInfo, Tracker, TrackerSet

pytestmark = pytest.mark.timeout(300)

CLUSTER_SHAPE = {"n_rollout_workers": 1, "n_trainer_workers": 1}
"""The ``client`` fixture's cluster here: one rollout worker, one trainer."""

BUILT_IN = ("tensorboard", "mlflow", "wandb", "trackio")


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """Every tracker offline, writing nowhere but a temporary directory."""
    home = tmp_path_factory.mktemp("tracker-home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_PROJECT", "MLFLOW_TRACKING_URI",
                    "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"):
            mp.delenv(var, raising=False)
        mp.setenv("NETRC", str(home / "netrc"))  # no wandb login here
        for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            mp.setenv(var, str(home / var.lower()))
        mp.setenv("TRACKIO_DIR", str(home / "trackio"))  # read when trackio is first imported
        yield home


class Recorder(Tracker):
    """A user's own tracker: keeps every call."""

    def __init__(self):
        self.calls = []

    def on_start(self, run):
        self.calls.append(("start", run))

    def on_log(self, scalars, step):
        self.calls.append(("log", dict(scalars), step))

    def on_table(self, rows, step):
        self.calls.append(("table", list(rows), step))

    def on_end(self, report):
        self.calls.append(("end", report))


class Broken(Tracker):
    """Raises on every record."""

    def on_log(self, scalars, step):
        raise ConnectionError("tracker server unreachable")


class NeedsMissingPackage(Tracker):
    def on_start(self, run):
        import grpo_kit_no_such_tracker_package  # noqa: F401


@pytest.fixture(scope="module")
def tracked_run(tracker_env, tmp_path_factory, client):
    """ONE real tiny run with every built-in tracker, a user's tracker, a failing one and one whose
    package is missing; the warnings it raised."""
    seen = []
    trackers.register_tracker("recorder", lambda: seen.append(Recorder()) or seen[-1])
    trackers.register_tracker("broken", Broken)
    trackers.register_tracker("missing", NeedsMissingPackage)
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    cfg = config.profile("tiny", engine="hf", iterations=2, eval_every=2, eval_size=2, prompts_per_step=2, group_size=2,
                         max_new_tokens=8, world_size=1, run_dir=str(run_dir), collective_timeout_s=30, lr=1e-3,
                         report_to=",".join(BUILT_IN) + ",recorder,broken,missing")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = loop.run(cfg, client=client, progress=False)
    yield res, cfg, seen[0], [str(w.message) for w in caught if "report_to" in str(w.message)]
    for name in ("recorder", "broken", "missing"):
        trackers.TRACKERS.pop(name)


def _samples(run_dir: Path) -> list[dict]:
    return records.read_jsonl(records.run_files(run_dir).samples)


def _logged_steps(res, key: str) -> dict[int, float]:
    return {r["iteration"]: r[key] for r in res.records if r.get(key) is not None}


def test_a_stopped_and_resumed_run_reaches_a_tracker_once_per_iteration(tmp_path, client, monkeypatch):
    """Review findings: the samples went to the trackers before the commit (a run that failed between
    the two, then resumed, sent an iteration's rows twice), and a callback that stopped the run
    after a commit left that iteration's scalars unlogged for good. Session 1 is stopped by a
    callback at iteration 1; session 2 fails writing iteration 2's run state; session 3 finishes."""
    from grpo_kit import checkpoint

    seen = []
    monkeypatch.setitem(trackers.TRACKERS, "recorder", lambda: seen.append(Recorder()) or seen[-1])
    cfg = config.profile("tiny", engine="hf", iterations=4, eval_every=0, prompts_per_step=2, group_size=2,
                         max_new_tokens=8, world_size=1, run_dir=str(tmp_path / "run"), collective_timeout_s=30,
                         report_to="recorder")

    def stop_at_1(rec):
        if rec["iteration"] == 1:
            raise KeyboardInterrupt("stopped by a callback")

    with pytest.raises(KeyboardInterrupt):
        loop.run(cfg, client=client, progress=False, callbacks=[stop_at_1])
    save = checkpoint.save_state

    def fail_at_2(store, state):
        if state["next_iteration"] == 3:
            raise OSError("the store is unreachable")
        save(store, state)

    monkeypatch.setattr(checkpoint, "save_state", fail_at_2)
    with pytest.raises(OSError, match="unreachable"):
        loop.run(cfg, client=client, progress=False, resume=True)
    monkeypatch.setattr(checkpoint, "save_state", save)
    res = loop.run(cfg, client=client, progress=False, resume=True)
    assert [r["iteration"] for r in res.records] == [0, 1, 2, 3] and len(seen) == 3
    steps = [c[2] for rec in seen for c in rec.calls if c[0] == "log"]
    assert steps == [0, 1, 2, 3], steps
    rows = [row for rec in seen for c in rec.calls if c[0] == "table" for row in c[1]]
    assert rows == trackers.table_rows(_samples(cfg.run.run_dir))  # every committed sample, once
    assert sorted({r["iteration"] for r in rows}) == [0, 1, 2, 3]


# ---------------------------------------------------------------- the run, read back per library


def test_the_run_goes_on_past_a_failing_tracker_and_a_missing_package(tracked_run):
    res, cfg, rec, warned = tracked_run
    assert [r["iteration"] for r in res.records] == [0, 1]  # the run finished
    assert len([w for w in warned if "'broken'" in w]) == 1, warned  # warned once, then dropped
    assert "ConnectionError" in next(w for w in warned if "'broken'" in w)
    missing = [w for w in warned if "'missing'" in w]
    assert len(missing) == 1 and "pip install grpo_kit_no_such_tracker_package" in missing[0]
    assert not [w for w in warned if any(f"'{n}'" in w for n in BUILT_IN)], warned  # every real one worked


def test_a_users_tracker_gets_the_run(tracked_run):
    res, cfg, rec, _ = tracked_run
    kinds = [c[0] for c in rec.calls]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("start") == kinds.count("end") == 1
    run = rec.calls[0][1]
    assert run.run_dir == Path(cfg.run.run_dir) and run.params["lr"] == 1e-3 and run.params["report_to"] == cfg.run.report_to
    logs = [c for c in rec.calls if c[0] == "log"]
    assert [s for _, _, s in logs[:2]] == [0, 1]
    for (_, scalars, step), r in zip(logs, res.records, strict=False):
        assert step == r["iteration"]
        assert scalars["reward_mean"] == pytest.approx(r["reward_mean"]) and scalars["loss"] == pytest.approx(r["loss"])
    # the final evaluation (after the last record) reached the tracker at the last step
    last_eval = res.records[-1]["eval_acc"]
    assert last_eval is not None
    assert any(c[2] == 1 and c[1].get("eval_acc") == last_eval for c in logs)
    rows = [row for c in rec.calls if c[0] == "table" for row in c[1]]
    assert rows == trackers.table_rows(_samples(cfg.run.run_dir))  # every sampled completion, once
    report = rec.calls[-1][1]
    assert report == records.run_files(cfg.run.run_dir).report and "<html" in report.read_text()[:500].lower()


def test_a_failed_report_upload_still_ends_the_mlflow_run(tracker_env, tmp_path):
    """Review finding: an upload that raised in ``on_end`` left the MLflow run RUNNING."""
    from mlflow.tracking import MlflowClient

    t = trackers.MLflowTracker()
    t.on_start(RunInfo.for_run(tmp_path, {"lr": 1.0}))
    with pytest.raises(Exception):  # noqa: B017 - whichever error MLflow raises for a missing file
        t.on_end(tmp_path / "no-such-report.html")
    assert MlflowClient(tracking_uri=t.client.tracking_uri).get_run(t.run_id).info.status == "FINISHED"


def test_wandb_reads_the_netrc_wandb_reads(tracker_env, tmp_path, monkeypatch):
    """Review finding: ``$NETRC`` was ignored and a base URL's trailing slash kept in the host, so a
    logged-in user logged offline (and the tests' isolation from ``~/.netrc`` did not hold)."""
    from grpo_kit.trackers import wandb_key_set

    rc = tmp_path / "netrc"
    rc.write_text("machine api.wandb.ai\n  login user\n  password k\nmachine wandb.example.org\n  login user\n  password k\n")
    rc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(rc))
    assert wandb_key_set()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org/")
    assert wandb_key_set()
    monkeypatch.setenv("WANDB_BASE_URL", "https://other.example.org")
    assert not wandb_key_set()
    monkeypatch.setenv("NETRC", str(tmp_path / "empty"))
    monkeypatch.delenv("WANDB_BASE_URL")
    assert not wandb_key_set()


def test_tensorboard_reads_back(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    res, cfg, _, _ = tracked_run
    ea = EventAccumulator(str(Path(cfg.run.run_dir) / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    for key in ("reward_mean", "loss", "usable_share"):
        got = {e.step: e.value for e in ea.Scalars(key)}
        assert got == pytest.approx(_logged_steps(res, key), rel=1e-6), key
    assert {e.step: e.value for e in ea.Scalars("eval_acc")}[1] == pytest.approx(res.records[-1]["eval_acc"])
    content = ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["lr"].number_value == pytest.approx(1e-3) and hp["engine"].string_value == "hf"
    text = " ".join(t.tensor_proto.string_val[0].decode() for t in ea.Tensors("completions/text_summary"))
    assert all(trackers.markdown_table([s], ["completion"]).splitlines()[-1] in text for s in _samples(cfg.run.run_dir))


def test_mlflow_reads_back(tracked_run):
    from mlflow.tracking import MlflowClient

    res, cfg, _, _ = tracked_run
    store = Path(cfg.run.run_dir) / "mlruns"
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(trackers.PROJECT).experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.001" and run.data.params["engine"] == "hf"
    for key in ("reward_mean", "loss"):
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx(_logged_steps(res, key)), key
    files = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    tables = [json.loads(Path(client.download_artifacts(run.info.run_id, f)).read_text()) for f in sorted(files)]
    rows = [dict(zip(t["columns"], row, strict=True)) for t in tables for row in t["data"]]
    assert rows == trackers.table_rows(_samples(cfg.run.run_dir))  # the gold answers stay strings
    report = Path(client.download_artifacts(run.info.run_id, "report.html"))
    assert report.read_bytes() == records.run_files(cfg.run.run_dir).report.read_bytes()


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``) as W&B's own protobuf ``Record`` s. wandb
    0.30 ships no Python reader of the file (its ``datastore`` module went to the Go core): the
    framing (a ``:W&B`` header, then LevelDB log blocks of 32 KiB with 7-byte chunk headers) is read
    here; each record is decoded by ``wandb.proto.wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0:
            break
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST
            out.append(wandb_internal_pb2.Record.FromString(buf))
            buf = b""
    return out


def test_wandb_reads_back_offline(tracked_run):
    res, cfg, rec, _ = tracked_run
    run_id = rec.calls[0][1].id
    (path,) = glob.glob(str(Path(cfg.run.run_dir) / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    recs = wandb_records(Path(path))
    history: dict[int, dict] = {}
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            history.setdefault(r.history.step.num, {}).update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    for key in ("reward_mean", "loss"):
        assert {s: h[key] for s, h in history.items() if key in h} == pytest.approx(_logged_steps(res, key)), key
    assert history[1]["eval_acc"] == pytest.approx(res.records[-1]["eval_acc"])
    config_items = {i.key: json.loads(i.value_json) for r in recs if r.WhichOneof("record_type") == "run"
                    for i in r.run.config.update}
    assert config_items["lr"] == 1e-3 and config_items["engine"] == "hf"
    tables = sorted(glob.glob(str(Path(path).parent / "files" / "media" / "table" / "completions_*.table.json")))
    rows = [dict(zip(t["columns"], row, strict=True)) for f in tables for t in [json.loads(Path(f).read_text())]
            for row in t["data"]]
    assert sorted(rows, key=json.dumps) == sorted(trackers.table_rows(_samples(cfg.run.run_dir)), key=json.dumps)
    arts = [r.artifact for r in recs if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "report"]
    assert [a.name for a in arts] == [f"report-{run_id}"] and [m.path for m in arts[0].manifest.contents] == ["report.html"]


def test_trackio_reads_back(tracked_run):
    from trackio import cas
    from trackio.sqlite_storage import SQLiteStorage

    res, cfg, rec, _ = tracked_run
    info = rec.calls[0][1]
    name = f"{info.name}-{info.id}"
    logs = SQLiteStorage.get_logs(trackers.PROJECT, run=name)
    for key in ("reward_mean", "loss"):
        assert {int(x["step"]): x[key] for x in logs if key in x} == pytest.approx(_logged_steps(res, key)), key
    conf = SQLiteStorage.get_run_config(trackers.PROJECT, run=name)
    assert conf["lr"] == 1e-3 and conf["engine"] == "hf"
    rows = [row for x in logs if "completions" in x for row in x["completions"]["_value"]]
    assert rows == trackers.table_rows(_samples(cfg.run.run_dir))
    (art,) = SQLiteStorage.get_run_artifacts(trackers.PROJECT, name, None)["output"]
    manifest = SQLiteStorage.get_artifact_manifest(trackers.PROJECT, "report", f"v{art['version']}")
    assert manifest["producer_run_name"] == name
    (entry,) = manifest["manifest"]
    assert entry["path"] == "report.html"
    blob = cas.blob_path(trackers.PROJECT, entry["digest"])
    assert blob.read_bytes() == records.run_files(cfg.run.run_dir).report.read_bytes()


# ---------------------------------------------------------------- records fed to the trackers directly


def _record(it: int, **kw) -> dict:
    return {"iteration": it, "version": it + 1, "reward_mean": 0.1 * it, "loss": 1.0 - 0.1 * it, "kl_mean": None,
            "reward_components": {"fmt": 0.5}, "spans": [], "t_iter_start": 1.7e9, **kw}


def _sample(it: int, i: int) -> dict:
    return {"iteration": it, "prompt": f"p{i}", "completion": f"c{it}-{i} | <b>x</b>\n####", "reward": 0.5 * i,
            "gold": "7", "version": it}


def test_a_nonfinite_value_inside_a_dict_or_an_evaluation_is_marked():
    """Review finding: NaN inside reward_components or an evaluation was dropped without the marker."""
    from grpo_kit.trackers import eval_scalars, record_scalars

    nan = float("nan")
    out = record_scalars({"iteration": 1, "reward_components": {"fmt": 1.0, "correct": nan}})
    assert out == {"reward_components/fmt": 1.0, "nonfinite/reward_components/correct": 1.0}
    assert eval_scalars([{"version": 2, "acc": nan, "pass_at": {"4": float("inf")}}]) == {
        "eval/version": 2.0, "nonfinite/eval/acc": 1.0, "nonfinite/eval/pass_at/4": 1.0}


def test_config_takes_a_list_or_a_comma_string():
    assert config.profile("tiny").run.report_to == ()
    assert config.profile("tiny", report_to="tensorboard, mlflow").run.report_to == ("tensorboard", "mlflow")
    assert config.profile("tiny", report_to=["wandb", "none"]).run.report_to == ("wandb",)
    assert config.profile("tiny", report_to="none").run.report_to == ()
    cfg = config.profile("tiny", report_to="trackio,wandb")
    assert config.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown tracker"):
        TrackerSet.for_names(["tensorbored"])
    assert trackers.resolve(["all"]) == list(trackers.TRACKERS)


def test_an_unknown_tracker_fails_before_any_cluster(tmp_path, monkeypatch):
    from grpo_kit import cluster

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: pytest.fail("a cluster was started"))
    cfg = config.profile("tiny", report_to="tensorboard,wandbb", run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="wandbb"):
        loop.run(cfg, progress=False)


def test_tables_are_bounded_and_sent_at_evaluations_and_the_end(tmp_path):
    rec = Recorder()
    ts = TrackerSet({"r": rec})
    ts.start(RunInfo.for_run(tmp_path, {"lr": 1.0}))
    for it in range(20):
        ts.add_samples([_sample(it, i) for i in range(3)])
        ts.on_record(_record(it, evals=[{"version": it, "acc": 0.5, "start": 0.0, "end": 1.0}] if it == 3 else []))
    ts.on_eval([{"version": 20, "acc": 0.75, "lenient_acc": 0.8}], 19)
    ts.add_samples([_sample(19, 3)])
    ts.end(tmp_path / "report.html")
    ts.end(None)  # a second end does nothing
    tables = [(len(c[1]), c[2]) for c in rec.calls if c[0] == "table"]
    # at the evaluation (iteration 3, its rows and the three before), when TABLE_ROWS rows waited (16
    # iterations later; none left for the final evaluation), and what is left at the end
    assert tables == [(12, 3), (trackers.TABLE_ROWS, 19), (1, 19)]
    sent = [row for c in rec.calls if c[0] == "table" for row in c[1]]
    assert [(r["iteration"], r["prompt"]) for r in sent] == [(it, f"p{i}") for it in range(20) for i in range(3)] + [(19, "p3")]
    assert sent[0]["completion"] == _sample(0, 0)["completion"] and set(sent[0]) == set(trackers.TABLE_COLUMNS)
    assert [c[0] for c in rec.calls].count("end") == 1 and rec.calls[-1] == ("end", tmp_path / "report.html")
    logs = [c for c in rec.calls if c[0] == "log"]
    assert [c[2] for c in logs] == [*range(20), 19]
    assert logs[3][1]["eval_acc"] == 0.5 and "eval_acc" not in logs[4][1] and "t_iter_start" not in logs[0][1]
    assert logs[-1][1] == {"eval/version": 20.0, "eval/acc": 0.75, "eval/lenient_acc": 0.8, "eval_acc": 0.75,
                           "eval_version": 20.0, "eval_lenient_acc": 0.8}
    assert logs[0][1]["reward_components/fmt"] == 0.5 and "kl_mean" not in logs[0][1]


def test_another_eval_sets_results_never_pass_for_the_tasks_own():
    """Review finding: an ``eval_sets`` result (``evals.collect`` marks it ``set``) overwrote
    ``eval_acc`` and ``base_acc``; pass@k (a dict) never reached a tracker."""
    res = [{"version": 0, "acc": 0.2, "iteration": 0}, {"version": 0, "acc": 0.9, "set": "math500", "iteration": 0},
           {"version": 4, "acc": 0.4, "lenient_acc": 0.5, "samples": 4, "pass_at": {"1": 0.4, "4": 0.7}, "maj_acc": 0.45},
           {"version": 4, "acc": 0.95, "lenient_acc": 0.97, "set": "math500"}]
    out = trackers.eval_scalars(res)
    assert (out["base_acc"], out["eval_acc"], out["eval_lenient_acc"], out["eval/acc"]) == (0.2, 0.4, 0.5, 0.4)
    assert (out["eval/math500/acc"], out["eval/math500/lenient_acc"]) == (0.95, 0.97)
    assert (out["eval/pass_at/4"], out["eval_pass_at_k"], out["eval_maj_acc"]) == (0.7, 0.7, 0.45)
    from grpo_kit import evals

    rec = {"iteration": 4, "spans": []}
    for r in res:
        evals.attach(rec, dict(r, iteration=4, start=0.0, end=1.0))
    assert {k: trackers.record_scalars(rec)[k] for k in ("eval_acc", "eval_pass_at_k")} == {"eval_acc": rec["eval_acc"], "eval_pass_at_k": rec["eval_pass_at_k"]}


class OnlyLogs:
    """A tracker that is not a Tracker subclass and has one hook."""

    def __init__(self):
        self.steps = []

    def on_log(self, scalars, step):
        self.steps.append(step)


def test_a_failing_tracker_warns_once_and_the_others_go_on(tmp_path):
    rec, plain = Recorder(), OnlyLogs()
    ts = TrackerSet({"broken": Broken(), "r": rec, "plain": plain})
    ts.start(RunInfo.for_run(tmp_path, {}))
    with pytest.warns(RuntimeWarning, match="'broken' failed in on_log") as caught:
        for it in range(3):
            ts.on_record(_record(it))
    assert len([w for w in caught if "broken" in str(w.message)]) == 1
    ts.end(None)
    assert list(ts.active) == ["r", "plain"] and [c[2] for c in rec.calls if c[0] == "log"] == [0, 1, 2]
    assert plain.steps == [0, 1, 2]


def test_a_missing_library_warns_once_and_the_run_goes_on(tmp_path, tracker_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    rec = Recorder()
    ts = TrackerSet.for_names(["wandb"])
    ts.active["r"] = rec
    with pytest.warns(RuntimeWarning, match=r"'wandb' failed in on_start.*ModuleNotFoundError.*pip install wandb"):
        ts.start(RunInfo.for_run(tmp_path, {}))
    ts.on_record(_record(0))
    ts.end(None)
    assert list(ts.active) == ["r"] and [c[0] for c in rec.calls] == ["start", "log", "end"]


def test_records_fed_to_the_real_trackers_read_back(tmp_path, tracker_env):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trackio.sqlite_storage import SQLiteStorage

    report = tmp_path / "report.html"
    report.write_text("<html>report</html>")
    names = ["tensorboard", "mlflow", "trackio", "wandb"]
    ts = TrackerSet.for_names(names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = RunInfo.for_run(tmp_path, {"lr": 0.5, "stop": ("\n",), "store_url": None})
        ts.start(info)
        ts.on_record(_record(0))
        ts.end(report)
        # a resumed session continues the same tracker runs
        again = RunInfo.for_run(tmp_path, {"lr": 0.5, "stop": ("\n",), "store_url": None}, resumed=True)
        assert again.id == info.id and again.resumed
        ts = TrackerSet.for_names(names)
        ts.start(again)
        ts.add_samples([_sample(1, 0)])
        ts.on_record(_record(1))
        ts.end(report)
    assert not [str(w.message) for w in caught if "report_to" in str(w.message)]  # none of them failed
    assert list(ts.active) == names
    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    assert {e.step: e.value for e in ea.Scalars("loss")} == pytest.approx({0: 1.0, 1: 0.9})
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(trackers.PROJECT).experiment_id])
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == pytest.approx({0: 1.0, 1: 0.9})
    assert run.data.params["stop"] == '["\\n"]' and run.data.params["store_url"] == "null"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["completions", "report.html"]
    (table,) = client.list_artifacts(run.info.run_id, "completions")
    assert table.path == "completions/0001-iteration-1.json"
    logs = SQLiteStorage.get_logs(trackers.PROJECT, run=f"{info.name}-{info.id}")
    assert {int(x["step"]): x["loss"] for x in logs if "loss" in x} == pytest.approx({0: 1.0, 1: 0.9})
    # W&B offline: each session is its own offline-run directory under the same run id (suffixed "-1"
    # when both start in the same second), which `wandb sync` uploads into that one run
    sessions = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{info.id}*"))
    assert len(sessions) == 2
    losses = []
    for d in sessions:
        recs = wandb_records(Path(d) / f"run-{info.id}.wandb")
        assert {r.run.run_id for r in recs if r.WhichOneof("record_type") == "run"} == {info.id}
        losses.append({r.history.step.num: json.loads(i.value_json) for r in recs
                       if r.WhichOneof("record_type") == "history" for i in r.history.item
                       if (i.key or "/".join(i.nested_key)) == "loss"})
    assert sorted(losses, key=min) == [pytest.approx({0: 1.0}), pytest.approx({1: 0.9})]


def test_a_failed_run_is_marked_failed_in_mlflow_and_wandb(tmp_path, tracker_env):
    """Review finding: a failed run ended FINISHED in MLflow (set_terminated's default) and with exit
    code 0 in W&B; an interrupted one is KILLED in MLflow."""
    from mlflow.tracking import MlflowClient

    statuses = {}
    for name, error in (("failed", RuntimeError("boom")), ("stopped", KeyboardInterrupt())):
        ts = TrackerSet.for_names(["mlflow", "wandb"])
        info = RunInfo.for_run(tmp_path / name, {"lr": 0.5})
        ts.start(info)
        ts.on_record(_record(0))
        ts.end(error=error)
        assert list(ts.active) == ["mlflow", "wandb"]  # neither failed
        client = MlflowClient(tracking_uri=(tmp_path / name / "mlruns").resolve().as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name(trackers.PROJECT).experiment_id])
        (session,) = glob.glob(str(tmp_path / name / "wandb" / f"offline-run-*-{info.id}*"))
        exits = [r.exit.exit_code for r in wandb_records(Path(session) / f"run-{info.id}.wandb")
                 if r.WhichOneof("record_type") == "exit"]
        statuses[name] = (run.info.status, exits)
    assert statuses == {"failed": ("FAILED", [1]), "stopped": ("KILLED", [1])}


def test_a_tracker_dropped_for_failing_is_closed_once():
    """Review finding: a tracker that raised was dropped without on_end (a TensorBoard writer left
    open, an MLflow run left RUNNING)."""

    class FailsThenCloses(Recorder):
        def on_log(self, scalars, step):
            raise ConnectionError("down")

    bad, good = FailsThenCloses(), Recorder()
    ts = TrackerSet({"bad": bad, "good": good})
    ts.start(RunInfo.for_run(Path(tempfile.mkdtemp()), {}))
    with pytest.warns(RuntimeWarning, match="'bad' failed in on_log"):
        ts.on_record(_record(0))
    ts.on_record(_record(1))
    ts.end(None)
    assert [c[0] for c in bad.calls] == ["start", "end"] and [c[0] for c in good.calls] == ["start", "log", "log", "end"]
