"""Adapter-store retention (grpo_kit.retention): the policy, deletion, and a pruned run that resumes."""

from __future__ import annotations

import json

import pytest

from grpo_kit import cluster as cl
from grpo_kit import config, loop, retention
from grpo_kit.adapters import AdapterStore, VersionNotFoundError


def _publish(store: AdapterStore, tmp_path, version: int) -> None:
    d = tmp_path / f"src{version}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 1}))
    (d / "adapter_model.safetensors").write_bytes(b"x" * 100)
    state = f"optimizer/v{version:06d}-a"
    store.save_state(state, {"step": version})
    store.publish_dir(str(d), version, meta={"optimizer_state": state}, parent=version - 1)


def test_policy_keeps_the_last_n_every_kth_and_the_latest():
    kept = [v for v in range(1, 101) if retention.kept(v, 100, 5, 25)]
    assert kept == [25, 50, 75, 96, 97, 98, 99, 100]
    assert retention.kept(100, 100, 1, 0)  # the latest always
    assert all(retention.kept(v, 100, 0, 7) for v in range(1, 101))  # 0: retention off


def test_pruner_deletes_versions_and_their_optimizer_states(tmp_path):
    store = AdapterStore(str(tmp_path / "store"))
    pruner = retention.Pruner(store, keep_versions=3, keep_every=4)
    for v in range(1, 11):
        _publish(store, tmp_path, v)
        pruner.after_commit(v, protect={5} if v < 10 else ())  # a batch in flight holds v5 until the end
    assert store.versions() == [4, 8, 9, 10]
    assert sorted(pruner.deleted) == [1, 2, 3, 5, 6, 7]
    with pytest.raises(FileNotFoundError):
        store.load_state("optimizer/v000006-a")
    assert store.load_state("optimizer/v000010-a") == {"step": 10}  # resume needs it
    with pytest.raises(VersionNotFoundError):
        store.fetch(6)
    assert not (tmp_path / "store" / "adapters" / "v000006").exists()
    store.delete(6)  # deleting a missing version is a no-op


def test_sweep_prunes_what_a_crash_left(tmp_path):
    store = AdapterStore(str(tmp_path / "store"))
    for v in range(1, 8):
        _publish(store, tmp_path, v)
    retention.Pruner(store, keep_versions=2, keep_every=0).sweep(7)
    assert store.versions() == [6, 7]


def test_a_failed_deletion_warns_and_is_retried_and_a_sweep_removes_what_it_left(tmp_path, monkeypatch):
    """Review finding: one storage error in a deletion (an S3 503) ended the run, and the version,
    its manifest already gone, left its files and optimizer state in the store for good (neither
    later commits nor a resumed run's sweep saw it)."""
    store = AdapterStore(str(tmp_path / "store"))
    pruner = retention.Pruner(store, keep_versions=2, keep_every=0)
    real_rm = store.fs.rm
    failing = {"n": 1}

    def flaky_rm(path, *a, **k):
        if failing["n"] and "v000001" in str(path):
            failing["n"] -= 1
            raise OSError("503 SlowDown")
        return real_rm(path, *a, **k)

    monkeypatch.setattr(store.fs, "rm", flaky_rm)
    for v in (1, 2, 3):
        _publish(store, tmp_path, v)
    with pytest.warns(RuntimeWarning, match="could not delete adapter v1"):
        pruner.after_commit(3)
    assert store.versions() == [2, 3] and store.unpublished() == [1]  # the manifest went first
    assert store.state_exists("optimizer/v000001-a")
    _publish(store, tmp_path, 4)
    pruner.after_commit(4)  # retried: the files and the optimizer state its manifest had named
    assert store.unpublished() == [] and not store.state_exists("optimizer/v000001-a")
    assert store.versions() == [3, 4] and sorted(pruner.deleted) == [1, 2]

    # a crash between the two: a resumed run's sweep removes the files of a version without a manifest
    for v in (5, 6):
        _publish(store, tmp_path, v)
    store.fs.rm_file(f"{store.path}/adapters/v000005/manifest.json")
    assert store.unpublished() == [5]
    retention.Pruner(store, keep_versions=2, keep_every=0).sweep(6)
    assert store.unpublished() == [] and store.versions() == [6]


def test_pruning_removes_every_attempts_files(tmp_path, monkeypatch):
    """A version two publish attempts wrote to (the loser crashed after its uploads, before its
    manifest) is pruned whole: the committed attempt's files and the loser's leftovers."""
    store = AdapterStore(str(tmp_path / "store"))
    for v in range(1, 5):
        _publish(store, tmp_path, v)
    monkeypatch.setattr(store, "exists", lambda version: False)  # the loser checked before v1 landed

    def crash(*args, **kwargs):  # the loser dies before its manifest
        raise RuntimeError("crash")

    monkeypatch.setattr(store, "_write_bytes", crash)
    with pytest.raises(RuntimeError, match="crash"):
        store.publish_dir(str(tmp_path / "src1"), 1)
    monkeypatch.undo()
    v1 = tmp_path / "store" / "adapters" / "v000001"
    assert len([p for p in v1.rglob("*") if p.is_file()]) == 5  # manifest, and two attempts' two files
    retention.Pruner(store, keep_versions=2, keep_every=0).sweep(4)
    assert store.versions() == [3, 4] and not v1.exists()


def test_keep_versions_must_exceed_the_pipeline_depth():
    with pytest.raises(ValueError, match="pipeline depth"):
        config.profile("tiny", keep_versions=1, max_staleness=1)
    config.profile("tiny", keep_versions=0, max_staleness=3)  # retention off: any depth


class _Stop(Exception):
    pass


@pytest.mark.timeout(900)
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_pruned_run_resumes_and_ends_like_an_unpruned_one(tmp_path, multi_turn):
    """A run keeping the last 2 versions and every 3rd dies after iteration 4, resumes, and finishes:
    the store holds exactly what the policy says, and the resumed run trained from the latest
    version and its optimizer state (the same final weights as a run that kept everything). With
    multi-turn episodes too (issue 24: retention keeps its guarantees; a review found no test)."""
    import torch
    from safetensors.torch import load_file

    from grpo_kit import testing, trainer

    kw = dict(engine="hf", eval_every=0, eval_size=8, prompts_per_step=2, group_size=4, max_new_tokens=16,
              collective_timeout_s=30, lr=1e-3, iterations=7, rollouts_every=2)
    if multi_turn:
        kw.update(max_turns=3, max_turn_tokens=12, max_episode_tokens=60)
    task = testing.notes_task() if multi_turn else None
    pruned = config.profile("tiny", run_dir=str(tmp_path / "pruned"), keep_versions=2, keep_every=3, **kw)
    full = config.profile("tiny", run_dir=str(tmp_path / "full"), keep_versions=0, **kw)
    client = cl.connect(n_rollout_workers=1, n_trainer_workers=1, quiet=True)
    try:
        def die(rec):
            if rec["iteration"] == 4:
                raise _Stop

        with pytest.raises(_Stop):
            loop.run(pruned, client=client, callbacks=[die], progress=False, task=task)
        store = AdapterStore(pruned.run.store_root)
        assert store.versions() == [3, 4, 5]
        # as after a restart: the trainer reloads v5's adapter and optimizer state from the store
        client.run(trainer.drop_state, workers=cl.workers_with(client, cl.TRAINER))
        res = loop.run(pruned, client=client, resume=True, progress=False, task=task)
        assert [r["iteration"] for r in res.records] == list(range(7))
        assert store.versions() == [3, 6, 7]
        opt = store.manifest(7)["meta"]["optimizer_state"]
        assert store.load_state(opt)
        loop.run(full, client=client, progress=False, task=task)
        assert AdapterStore(full.run.store_root).versions() == list(range(1, 8))
    finally:
        cl.shutdown(client)
    wa = load_file(f"{AdapterStore(full.run.store_root).fetch(7)}/adapter_model.safetensors")
    wb = load_file(f"{store.fetch(7)}/adapter_model.safetensors")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0), k
    rows = [json.loads(line) for line in (tmp_path / "pruned" / "rollouts.jsonl").open()]
    assert {r["iteration"] for r in rows} == {0, 2, 4, 6}  # rollouts_every=2
    if multi_turn:  # the run did play episodes of more than one turn
        assert any(r["episode"]["turns"] >= 2 for r in rows)
