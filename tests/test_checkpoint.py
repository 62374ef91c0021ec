"""The run state (grpo_kit.checkpoint): what a resumed run needs beyond the version, and reconcile."""

from __future__ import annotations

import json

from grpo_kit import checkpoint
from grpo_kit.adapters import AdapterStore


def _publish(store: AdapterStore, tmp_path, version: int, iteration: int, **meta) -> None:
    d = tmp_path / f"src{version}-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 1}))
    (d / "adapter_model.safetensors").write_bytes(b"x" * 10)
    store.publish_dir(str(d), version, meta={"iteration": iteration, **meta}, parent=version - 1)


def test_run_state_keeps_dynamic_sampling_and_the_batches_in_flight(tmp_path):
    store = AdapterStore(str(tmp_path / "store"))
    carry = [{"iteration": 3, "round": 1, "n": 6, "start": 2, "stop": 4, "group_id": 15, "version": 2}]
    state = {**checkpoint.fresh_state("abc"), "next_iteration": 4, "version": 3,
             **checkpoint.resume_fields([7, 12], carry, {4: (3, 8), 5: (3, None)})}
    checkpoint.save_state(store, state)
    back = checkpoint.load_state(store, "abc")
    assert back["groups_seen"] == [7, 12] and back["carry"] == carry
    assert back["pending"] == {"4": {"version": 3, "n": 8}, "5": {"version": 3, "n": None}}
    fresh = checkpoint.fresh_state("abc")
    assert (fresh["groups_seen"], fresh["carry"], fresh["pending"]) == ([0, 0], [], {})


def test_reconcile_drops_the_carry_a_folded_in_step_consumed(tmp_path):
    """The driver died after iteration 3's publish, before its run state: the state's carry went into
    iteration 3, and iteration 3's own carry was never written, so the resumed run starts without one."""
    store = AdapterStore(str(tmp_path / "store"))
    for v in (1, 2, 3):
        _publish(store, tmp_path, v, v - 1)
    carry = [{"iteration": 2, "round": 0, "n": 4, "start": 0, "stop": 2, "group_id": 1, "version": 1}]
    state = {**checkpoint.fresh_state("abc"), "next_iteration": 2, "version": 2,
             **checkpoint.resume_fields([3, 8], carry, {3: (2, 4)})}
    out = checkpoint.reconcile(state, store)
    assert (out["version"], out["next_iteration"], out["carry"]) == (3, 3, [])
    assert out["groups_seen"] == [3, 8]
    assert checkpoint.reconcile(state, AdapterStore(str(tmp_path / "empty")))["carry"] == carry  # nothing folded


def test_evaluation_settings_do_not_change_what_a_resumed_run_must_share():
    from grpo_kit import config, tasks

    cfg, task = config.profile("tiny"), tasks.resolve("synthetic")
    same = cfg.override(eval_samples=8, eval_temperature=0.7, eval_every=2, eval_sets={"more": "synthetic"},
                        eval_size=cfg.data.eval_size * 2, max_task_failures=7)  # review: these two refused a resume
    assert checkpoint.run_id_for(cfg, "x", task) == checkpoint.run_id_for(same, "x", task)
    assert checkpoint.run_id_for(cfg, "x", task) != checkpoint.run_id_for(cfg.override(n_digits=2), "x", task)  # training data


def test_reconcile_folds_in_the_unbroken_chain_and_deletes_a_version_past_a_gap(tmp_path):
    """v3 and v4 above the state's v2, then v6 past a gap (its parent v5 was taken back while the step
    that publishes v6 had just started): v3 and v4 are folded in, v6 is deleted (it was trained from
    weights the run no longer has) and its iteration trains again."""
    store = AdapterStore(str(tmp_path / "store"))
    for v in (1, 2, 3, 4, 6):
        _publish(store, tmp_path, v, v - 1)
    state = {**checkpoint.fresh_state("abc"), "next_iteration": 2, "version": 2}
    out = checkpoint.reconcile(state, store)
    assert (out["version"], out["next_iteration"]) == (4, 4)
    assert store.versions() == [1, 2, 3, 4]


def test_reconcile_stops_at_a_version_trained_from_a_parent_since_trained_anew(tmp_path):
    """A resumed run trained v3 again (the first v3 was taken back), then died before its run state;
    v4 in the store was published by a step that escaped the take-back, trained from the first v3.
    The chain above the state folds in the new v3 and stops there: v4 is deleted, as past a gap."""
    store = AdapterStore(str(tmp_path / "store"))
    for v in (1, 2):
        _publish(store, tmp_path, v, v - 1, parent_attempt=store.attempt(v - 1))
    _publish(store, tmp_path, 3, 2, parent_attempt=store.attempt(2))
    first_v3 = store.attempt(3)
    _publish(store, tmp_path, 4, 3, parent_attempt=first_v3)
    store.delete(3)
    _publish(store, tmp_path, 3, 2, parent_attempt=store.attempt(2))
    assert store.descends(3) and not store.descends(4) and store.descends(2)
    state = {**checkpoint.fresh_state("abc"), "next_iteration": 2, "version": 2}
    out = checkpoint.reconcile(state, store)
    assert (out["version"], out["next_iteration"]) == (3, 3)
    assert store.versions() == [1, 2, 3]
    store.delete(2)
    assert not store.descends(3)  # its parent is gone
    _publish(store, tmp_path, 5, 4)  # a version published before parent attempts were recorded
    assert store.descends(5)



def test_resume_against_a_store_without_the_run_refuses_and_deletes_nothing(tmp_path):
    """Review finding: resume=True with a mistyped store_url (no run state, no version) started over
    and deleted the run directory's records."""
    import pytest

    from grpo_kit.records import RunFiles

    files = RunFiles(tmp_path / "run")
    files.root.mkdir()
    lines = "".join(json.dumps({"iteration": i, "version": i + 1}) + "\n" for i in range(30))
    files.metrics.write_text(lines)
    files.summary.write_text("{}")
    with pytest.raises(FileNotFoundError, match="holds no run state and no version.*up to 29"):
        checkpoint.restore(AdapterStore(str(tmp_path / "wrong-store")), "rid", files, resume=True)
    assert files.metrics.read_text() == lines and files.summary.exists()  # a refused resume deletes nothing
    # a run that died in iteration 0 before its first publish resumes from scratch, as before
    files.metrics.write_text(json.dumps({"iteration": 0, "version": 1}) + "\n")
    state, records = checkpoint.restore(AdapterStore(str(tmp_path / "store")), "rid", files, resume=True)
    assert (state["next_iteration"], records) == (0, [])
    assert not files.summary.exists()  # review: a resumed run read as finished (notebook 04) until it ended


def test_records_of_versions_retention_pruned_are_not_rebuilt(tmp_path):
    """Review finding: resuming with a short metrics.jsonl (a new run_dir, or one cut at a bad line)
    rebuilt records from every version's manifest and crashed on the first one retention had pruned."""
    store = AdapterStore(str(tmp_path / "store"))
    for v in range(1, 8):
        _publish(store, tmp_path, v, iteration=v - 1, stats={"loss": float(v)})
    for v in range(1, 5):  # retention kept the last three
        store.delete(v)
    out = checkpoint.recovered_records(store, [], {"version": 7, "next_iteration": 7})
    assert [(r["iteration"], r["version"], r["loss"]) for r in out] == [(4, 5, 5.0), (5, 6, 6.0), (6, 7, 7.0)]


def test_versions_without_a_run_state_are_refused_and_kept(tmp_path):
    """Review finding: resume=True on a store with versions but no run state (a copy without state/)
    started from version 0, deleted every version reconcile could not chain from v1 (all of them,
    once retention had pruned v1) and rewrote metrics.jsonl empty."""
    import pytest

    from grpo_kit.records import RunFiles

    store = AdapterStore(str(tmp_path / "store"))
    for v in range(1, 8):
        _publish(store, tmp_path, v, iteration=v - 1)
    for v in range(1, 5):
        store.delete(v)
    files = RunFiles(tmp_path / "run")
    files.root.mkdir()
    lines = "".join(json.dumps({"iteration": i, "version": i + 1}) + "\n" for i in range(7))
    files.metrics.write_text(lines)
    with pytest.raises(FileNotFoundError, match=r"holds versions \[5, 6, 7\] and no run state.*Nothing was deleted"):
        checkpoint.restore(store, "rid", files, resume=True)
    assert store.versions() == [5, 6, 7] and files.metrics.read_text() == lines


def test_a_fresh_start_removes_the_previous_summary(tmp_path):
    """Review finding: a fresh run in a reused run_dir (its store elsewhere) kept the old summary.json,
    which load_run and the report then showed beside the new records."""
    from grpo_kit.records import RunFiles

    files = RunFiles(tmp_path / "run")
    files.root.mkdir()
    files.summary.write_text(json.dumps({"final_acc": 0.93}))
    checkpoint.restore(AdapterStore(str(tmp_path / "store")), "rid", files, resume=False)
    assert not files.summary.exists()


def test_a_resume_on_other_training_rows_is_refused(tmp_path):
    """Left from a review: the run id hashes the config and the task's description, not its rows, so
    a data file changed under the same task name resumed and drew other prompts than the run had."""
    import pytest

    from grpo_kit import data
    from grpo_kit.records import RunFiles

    pool = data.synthetic_problems(20, split="train", seed=0)
    edited = [*pool[:5], data.Problem(pool[5].id, pool[5].question, "999999"), *pool[6:]]
    digest = checkpoint.rows_digest(pool)
    assert digest == checkpoint.rows_digest(list(pool)) and digest != checkpoint.rows_digest(edited)
    assert digest != checkpoint.rows_digest(pool[::-1])  # the order is what the draws index
    store, files = AdapterStore(str(tmp_path / "store")), RunFiles(tmp_path / "run")
    files.root.mkdir()
    state, _ = checkpoint.restore(store, "rid", files, resume=False, train_rows=digest)
    assert state["train_rows"] == digest
    _publish(store, tmp_path, 1, iteration=0)
    with pytest.raises(ValueError, match="training rows differ"):
        checkpoint.restore(store, "rid", files, resume=True, train_rows=checkpoint.rows_digest(edited))
    assert store.versions() == [1]
    state, _ = checkpoint.restore(store, "rid", files, resume=True, train_rows=digest)
    assert (state["version"], state["train_rows"]) == (1, digest)
    # a run state written before the digest existed resumes, and keeps the digest from then on
    store.write_json(checkpoint.RUN_STATE, {k: v for k, v in state.items() if k != "train_rows"})
    state, _ = checkpoint.restore(store, "rid", files, resume=True, train_rows=digest)
    assert state["train_rows"] == digest
