"""grpo_kit.publish: a step's commit to the store, through the rank task on the tiny model in this
process (world size 1): an orphan trained from a taken-back version is replaced, never adopted; a
step whose version was taken back publishes nothing; a legit retry adopts; a failed publish leaves no
optimizer state unless its manifest landed; a step of a gang a stopping driver fenced publishes
nothing. (Every rank adopting, world size 2: tests/test_trainer.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import make_samples, make_spec  # pytest puts tests/ on sys.path

from grpo_kit import publish, retention, tiny, trainer
from grpo_kit.adapters import AdapterStore, VersionNotFoundError


@pytest.fixture(scope="module")
def tiny_path():
    return str(tiny.ensure_tiny_model())


def test_a_version_trained_from_a_taken_back_parent_is_replaced_not_adopted(tiny_path, tmp_path):
    """A step can escape a stopping driver's take-back (the driver's wait for it timed out, or the
    driver was killed outright; the fence stops the ordinary race, see the next test) and publish v2
    from a v1 the driver deleted. A run resumed on the same workers trains
    v1 again; its step from that v1 used to meet the orphan v2 and adopt it (weights trained from a v1
    the run no longer has). Now the orphan is deleted and the step's own update published; a step
    whose v1 is gone or was replaced while it ran publishes nothing; a legit retry still adopts."""
    spec = make_spec(tiny_path, str(tmp_path / "store"), lr=1e-2)
    store = AdapterStore(spec.store_root)
    trainer.train_rank(spec, make_samples(tiny_path), 0, 0)
    old_v1 = store.attempt(1)
    state = trainer.get_state(spec)
    assert state.attempt == (1, old_v1)
    # the driver took v1 back: a step from it fails, publishing nothing
    retention.delete_version(store, 1)
    with pytest.raises(VersionNotFoundError):
        trainer.train_rank(spec, make_samples(tiny_path), 1, 1)
    assert store.versions() == []
    # a step that escaped published v2 from the old v1 before it was deleted
    store.publish(state.model, 1, meta={"parent_attempt": None}, attempt=old_v1)
    escaped = trainer.train_rank(spec, make_samples(tiny_path), 1, 1)
    orphan = store.manifest(2, fresh=True)
    assert not escaped["adopted"] and orphan["meta"]["parent_attempt"] == old_v1
    retention.delete_version(store, 1)

    # the resumed run, on the same worker: iteration 0 again (v1 anew), then the step from the new v1
    trainer.train_rank(spec, make_samples(tiny_path, flip=True), 0, 0)
    new_v1 = store.attempt(1)
    assert new_v1 != old_v1 and not store.descends(2)
    res = trainer.train_rank(spec, make_samples(tiny_path), 1, 1)
    v2 = store.manifest(2, fresh=True)
    assert not res["adopted"] and v2["attempt"] != orphan["attempt"] and v2["meta"]["parent_attempt"] == new_v1
    assert store.descends(2) and store.versions() == [1, 2] and state.attempt == (2, v2["attempt"])
    assert not store.state_exists(orphan["meta"]["optimizer_state"]) and store.state_exists(v2["meta"]["optimizer_state"])
    assert orphan["meta"]["optimizer_state"] not in state.saved_states
    fetched = load_file(str(Path(store.fetch(2)) / "adapter_model.safetensors"))
    mine = {k: v for k, v in state.model.named_parameters() if v.requires_grad}
    assert len(fetched) == len(mine) and all(torch.equal(fetched[k], mine[_param_name(k, mine)]) for k in fetched)

    # an escaped step that trained from the old v1 and reaches its publish only now publishes nothing
    with pytest.raises(RuntimeError, match="v1 was taken back and trained again"):
        publish.publish_step(state, 1, 1, {}, old_v1)
    assert store.attempt(2) == v2["attempt"] and store.versions() == [1, 2]
    # and a process whose memory still holds the old v1 reloads the store's before it trains
    state.version, state.attempt = 1, (1, old_v1)
    state.sync_to(1)
    assert state.attempt == (1, new_v1)

    # a legit retry of the step from v1 (its earlier attempt committed v2 first): adopts v2
    retry = trainer.train_rank(spec, make_samples(tiny_path, flip=True), 1, 1)
    assert retry["adopted"] and store.attempt(2) == v2["attempt"] and state.attempt == (2, v2["attempt"])
    assert sorted(store.fs.find(f"{store.path}/state/optimizer")) == sorted(
        f"{store.path}/state/{n}.pt" for n in state.saved_states)  # no state left behind


def test_a_failed_publish_deletes_its_optimizer_state_unless_its_manifest_landed(tiny_path, tmp_path, monkeypatch):
    """The optimizer state is saved before the adapter's manifest; a publish that raises leaves it
    behind unless that manifest landed anyway (an S3 PUT whose reply was lost): then the state is
    part of the committed version and must stay."""
    spec = make_spec(tiny_path, str(tmp_path / "store"), lr=1e-2)
    store = AdapterStore(spec.store_root)
    state = trainer.get_state(spec)
    states = lambda: store.fs.find(f"{store.path}/state/optimizer")  # noqa: E731

    def unreachable(*a, **k):
        raise OSError("store unreachable")

    monkeypatch.setattr(state.store, "publish", unreachable)
    with pytest.raises(OSError, match="unreachable"):
        trainer.train_rank(spec, make_samples(tiny_path), 0, 0)
    assert states() == [] and store.versions() == []

    real = AdapterStore.publish

    def lands_then_raises(self, *a, **k):
        real(self, *a, **k)
        raise TimeoutError("the reply was lost")

    monkeypatch.setattr(state.store, "publish", lands_then_raises.__get__(state.store))
    with pytest.raises(TimeoutError):
        trainer.train_rank(spec, make_samples(tiny_path), 0, 0)
    assert store.versions() == [1]
    assert store.state_exists(store.manifest(1)["meta"]["optimizer_state"])


def test_a_step_of_a_fenced_gang_publishes_nothing_and_counts_only_while_it_publishes(tiny_path, tmp_path,
                                                                                      monkeypatch):
    """A stopping driver fences its gang (publish.fence) after cancelling its steps: a step of that
    gang a worker had begun anyway raises Withdrawn at its publish, writing neither optimizer state
    nor adapter; another gang (a resumed run's) publishes as before. Rank 0 counts in
    trainer.publishes_running from just before its fence read to the end of its publish, not before."""
    spec = make_spec(tiny_path, str(tmp_path / "store"), lr=1e-2)
    store = AdapterStore(spec.store_root)
    seen = []
    real, real_step = publish.fenced, trainer.grpo_step

    def spy(st, gang_id):
        seen.append(("fence read", trainer.publishes_running(gang_id)))
        return real(st, gang_id)

    def step_spy(*a, **k):
        seen.append(("step", trainer.publishes_running(spec.gang_id)))
        return real_step(*a, **k)

    assert not publish.fenced(store, spec.gang_id)
    publish.fence(store, spec.gang_id + 1)
    publish.fence(store, spec.gang_id)
    assert publish.fenced(store, spec.gang_id) and publish.fenced(store, spec.gang_id + 1)
    monkeypatch.setattr(publish, "fenced", spy)  # publish_step reads it from its module
    monkeypatch.setattr(trainer, "grpo_step", step_spy)
    with pytest.raises(publish.Withdrawn, match=f"gang {spec.gang_id}"):
        trainer.train_rank(spec, make_samples(tiny_path), 0, 0)
    assert seen == [("step", 0), ("fence read", 1)] and trainer.publishes_running(spec.gang_id) == 0
    assert store.versions() == [] and not store.fs.exists(f"{store.path}/state/optimizer")
    other = dataclasses.replace(spec, gang_id=spec.gang_id + 2)
    trainer.train_rank(other, make_samples(tiny_path), 0, 0)
    assert store.versions() == [1] and trainer.publishes_running(other.gang_id) == 0
    for k in range(40):  # only the newest 32 gangs are kept
        publish.fence(store, 10_000 + k)
    assert not publish.fenced(store, spec.gang_id) and publish.fenced(store, 10_039)


def _param_name(saved: str, params: dict) -> str:
    """The live parameter a saved adapter tensor belongs to (PEFT drops the adapter name on save)."""
    (name,) = [k for k in params if k.replace(".default", "") == saved]
    return name
