"""Checkpoint and resume of a run: the run state in the adapter store, and what a resumed run continues from.

After every iteration the trainer's rank 0 publishes adapter ``v+1`` and its optimizer state to the
store, then the driver writes the run state (``state/run.json`` in the store: next iteration,
version, base accuracy, evaluations, wall time, and what the batches in flight and dynamic
sampling's carry-over were: :func:`resume_fields`; :func:`save_state`). :func:`restore` is where a run
starts: afresh (the run directory's record files removed), or with ``resume=True`` at the next
unfinished iteration. An iteration whose adapter was published but whose run state was not (the
driver died in between) is recognised from the adapter's manifest and not repeated
(:func:`reconcile`); its record, if it was never written, is rebuilt from the manifest's trainer
statistics (:func:`recovered_records`). A resumed run must share the original's configuration
(:func:`run_id_for`).
"""

from __future__ import annotations

import hashlib
import json

from .adapters import AdapterStore
from .config import Config
from .records import MetricsRecord, RunFiles, read_jsonl, trim_jsonl, write_jsonl
from .retention import delete_version
from .tasks import Task

RUN_STATE = "run"
"""The run state's name in the store (``AdapterStore.write_json``)."""


def restore(store: AdapterStore, run_id: str, files: RunFiles, resume: bool,
            train_rows: str | None = None) -> tuple[dict, list[MetricsRecord]]:
    """The run state to start from and the records of the finished iterations, with the store and the
    run directory made consistent with them (the state written, records of unfinished iterations
    dropped, recovered ones added). Without ``resume`` a store that already holds versions is an error.
    ``train_rows`` (:func:`rows_digest` of the training pool) is kept in the state; a resumed run whose
    pool differs (the data file changed under the same task name and config) is refused."""
    state = load_state(store, run_id) if resume else None
    if state is not None and train_rows is not None and state.get("train_rows") not in (None, train_rows):
        raise ValueError(
            "resume=True but the training rows differ from the run's (the task's data changed under the same name "
            "and configuration), so the resumed iterations would draw other prompts than the run did. Nothing was "
            "deleted; restore the data, or start a fresh run_dir / store_url")
    if state is None and resume and store.latest() is not None:
        # every run writes its state before it trains, so versions without one are another run's, or
        # a copy that lost state/: adopting them would delete those reconcile cannot chain from v1
        # and rewrite the records empty
        raise FileNotFoundError(
            f"resume=True, but the adapter store {store.root} holds versions {store.versions()[:5]} and no run "
            f"state ({RUN_STATE!r} under state/), so what they were trained by cannot be checked. Nothing was "
            "deleted; restore the store's state/ directory, or use a fresh run_dir / store_url")
    if state is None and resume:
        done = sorted({r["iteration"] for r in read_jsonl(files.metrics, stop_at_bad_line=True) if r.get("iteration", 0) > 0})
        if done:  # a run that died in iteration 0 has nothing past it: these came from a store not found now
            raise FileNotFoundError(
                f"resume=True, but the adapter store {store.root} holds no run state and no version, while "
                f"{files.metrics} records iterations up to {done[-1]}: is store_url (or run_dir) the one the "
                "run used? Nothing was deleted; pass resume=False to start that run_dir afresh")
    if state is None:
        if store.latest() is not None:
            raise FileExistsError(
                f"the adapter store {store.root} already holds versions {store.versions()[:5]}...; "
                "pass resume=True to continue that run, or use a fresh run_dir / store_url"
            )
        for p in (files.metrics, files.samples, files.rollouts, files.summary):
            p.unlink(missing_ok=True)
        state = fresh_state(run_id)
    files.summary.unlink(missing_ok=True)  # a resumed run is not finished until it ends again (notebook 04 reads it)
    state = reconcile(state, store)
    if train_rows is not None:
        state["train_rows"] = train_rows
    save_state(store, state)
    records = [r for r in read_jsonl(files.metrics, stop_at_bad_line=True) if r["iteration"] < state["next_iteration"]]
    records += recovered_records(store, records, state)
    write_jsonl(files.metrics, records)
    for p in (files.samples, files.rollouts):  # drop lines of unfinished iterations
        trim_jsonl(p, lambda r: r["iteration"] < state["next_iteration"])
    return state, records


def save_state(store: AdapterStore, state: dict) -> None:
    """Write the run state (after an iteration's adapter was published, and at the end)."""
    store.write_json(RUN_STATE, state)


def rebuilt_tail(records: list[MetricsRecord]) -> list[MetricsRecord]:
    """The records :func:`restore` rebuilt from the store after the last record the run wrote (the
    trailing ``recovered`` ones): the trackers never got them (``loop.run`` sends them on resume)."""
    n = len(records)
    while n and records[n - 1].get("recovered"):
        n -= 1
    return records[n:]


def run_id_for(cfg: Config, store_root: str, task: Task) -> str:
    """Identifies what a resumed run must share: everything but the length, paths and evaluation
    settings (cadence, samples, size, extra sets) and the retry budget."""
    d = {**cfg.to_dict(), "task": task.describe()}
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("iterations", "run_dir", "store_url", "eval_every",
                                                         "eval_samples", "eval_temperature",
                                                         "price_per_hour", "keep_versions", "keep_every",
                                                         "rollouts_every", "report_to", "max_task_failures")}
    d["data"] = {k: v for k, v in d["data"].items() if k not in ("eval_sets", "eval_size")}  # evaluated, not trained
    d.pop("cluster")
    blob = json.dumps(d, sort_keys=True) + store_root
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def rows_digest(problems) -> str:
    """A digest of a pool of :class:`~grpo_kit.data.Problem` rows: ids, prompts, golds and columns, in order."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.id, p.question, p.gold, p.messages, p.columns], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def fresh_state(run_id: str) -> dict:
    return {"run_id": run_id, "next_iteration": 0, "version": 0, "base_acc": None, "grpo_wall_s": 0.0, "evals": [],
            **resume_fields([0, 0], [], {})}


def resume_fields(groups_seen: list[int], carry: list[dict], pending: dict[int, tuple[int, int | None]]) -> dict:
    """The run state's part that makes a resumed run draw and train what the uninterrupted run would:
    dynamic sampling's running counts (``groups_seen``: usable and all groups generated so far, which
    size the over-sampling), its carried groups (``carry``: each group's chunk as the
    driver's ``chunk_specs`` describes it, with its group id and adapter version; a resumed run
    regenerates those chunks), and the batches in flight (``pending``: iteration -> (version, prompt
    count) they were submitted with)."""
    return {"groups_seen": list(groups_seen), "carry": list(carry),
            "pending": {str(j): {"version": v, "n": n} for j, (v, n) in sorted(pending.items())}}


def load_state(store: AdapterStore, run_id: str) -> dict | None:
    try:
        state = store.read_json(RUN_STATE)
    except FileNotFoundError:
        return None
    if state.get("run_id") != run_id:
        raise ValueError(
            f"resume=True but the store's run state belongs to another configuration (run_id {state.get('run_id')} "
            f"!= {run_id}); resume with the same config, and the store where the run wrote it (the id covers "
            f"the store's root, now {store.root}: a run directory or store moved or renamed since cannot resume "
            "there), or start a fresh run_dir"
        )
    return state


def committed_version(store: AdapterStore) -> int | None:
    """The version a resumed run would continue from, without changing the store: the run state's
    version and the unbroken chain of versions published above it (:func:`reconcile` folds those in
    and deletes the rest); the store's latest version where no run state was written (None: none)."""
    try:
        v = store.read_json(RUN_STATE)["version"]
    except FileNotFoundError:
        return store.latest()
    while store.exists(v + 1) and store.descends(v + 1):
        v += 1
    return v


def reconcile(state: dict, store: AdapterStore) -> dict:
    """Fold in the steps that published their adapters but whose run state was never written (a driver
    that died in between), along the unbroken chain of versions above the state's. A version past a
    gap in that chain (its parent was taken back by a stopping driver, :meth:`TrainerGang.withdraw`,
    while a step its fence could not stop published it: the driver was killed outright, or its wait
    timed out) was trained from weights the run no longer has: it is deleted, and its iteration
    trained again. So is a version trained from another attempt
    of the version below it (:meth:`AdapterStore.descends`: that one was taken back and trained anew)."""
    v = state["version"] + 1
    while store.exists(v) and store.descends(v):
        meta = store.manifest(v).get("meta", {})
        # the folded-in step consumed the carry the state names, and its own carry was never written
        state = {**state, "version": v, "next_iteration": max(state["next_iteration"], meta.get("iteration", -1) + 1),
                 "carry": []}
        v += 1
    for orphan in [x for x in store.versions() if x > state["version"]]:
        delete_version(store, orphan)
    return state


STAT_KEYS = {"loss": "loss", "ratio_mean": "ratio_mean", "ratio_std": "ratio_std", "ratio_min": "ratio_min",
              "ratio_max": "ratio_max", "clip_low": "clip_frac_low", "clip_high": "clip_frac_high",
              "clip_frac": "clip_frac", "kl": "kl_mean", "grad_norm": "grad_norm", "tokens": "tokens"}


def recovered_records(store: AdapterStore, records: list[dict], state: dict) -> list[dict]:
    """Records of iterations whose adapter was published but whose record was never written (the
    driver stopped in between, e.g. a kernel interrupt): rebuilt from the adapters' manifests (the
    trainer's statistics; no rewards or timings), marked ``recovered``."""
    have = {r["iteration"] for r in records}
    last = max((r["version"] for r in records), default=0)
    out = []
    present = set(store.versions())  # retention may have pruned some: their records cannot be rebuilt
    for v in range(last + 1, state["version"] + 1):
        if v not in present:
            continue
        meta = store.manifest(v).get("meta", {})
        it = meta.get("iteration")
        if it is None or it in have or it >= state["next_iteration"]:
            continue
        stats = meta.get("stats", {})
        out.append({"iteration": it, "version": v, "recovered": True, "reward_mean": None, "eval_acc": None,
                    **{key: stats.get(k) for k, key in STAT_KEYS.items()}})
    return out
