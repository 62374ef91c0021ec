"""Dynamic sampling and usable-sample accounting: the pure selection, then the driver on a real
LocalCluster (worker processes, a DDP gang of 2, the HF engine)."""

from __future__ import annotations

import json

import pytest

from grpo_kit import checkpoint, config, loop, tasks
from grpo_kit.adapters import AdapterStore
from grpo_kit.sampling import Group, extra_prompts, select_groups, usable_cost, usable_samples

pytestmark = pytest.mark.timeout(600)


def g(rewards, version=0):
    return Group(tuple(rewards), version, tokens=10 * len(rewards))


SPREAD, FLAT = (1.0, 0.0, 0.0), (0.0, 0.0, 0.0)


def test_unscorable_completions_have_no_part_in_spread_or_usable_samples():
    assert not g((1.0, None, 1.0)).has_spread and not g((None, 1.0, None)).has_spread and not g((None,) * 3).has_spread
    assert g((1.0, None, 0.0)).has_spread
    assert usable_samples([g((1.0, None, 0.0)), g((None, 1.0, None)), g(SPREAD)]) == 2 + 3


@pytest.mark.parametrize(
    ("carried", "fresh", "want", "train", "carry", "dropped", "expired"),
    [
        # only zero-spread groups: nothing to train, all dropped
        ([], [FLAT, (1.0, 1.0, 1.0), FLAT], 3, 0, 0, 3, 0),
        # all but one group dropped: the one usable group is trained alone
        ([], [FLAT, FLAT, SPREAD, FLAT], 4, 1, 0, 3, 0),
        # a surplus usable group is carried to the next batch
        ([], [SPREAD, FLAT, SPREAD, SPREAD], 2, 2, 1, 1, 0),
        # carried groups go first; a fractional spread (lenient credit) counts as spread
        ([SPREAD], [(0.5, 0.0, 0.5), FLAT], 2, 2, 0, 1, 0),
    ],
)
def test_select_groups_table(carried, fresh, want, train, carry, dropped, expired):
    sel = select_groups([g(r) for r in carried], [g(r) for r in fresh], want, version=0, max_staleness=1)
    assert (len(sel.train), len(sel.carry), sel.dropped, sel.expired) == (train, carry, dropped, expired)
    assert all(x.has_spread for x in sel.train + sel.carry)
    if carried:
        assert sel.train[0].rewards == carried[0]


def test_select_groups_respects_staleness():
    # trainer at version 3, bound 1: a version-1 group is too old now; a version-2 surplus would be 2
    # behind at the next step, so it expires instead of being carried
    sel = select_groups([g(SPREAD, 1)], [g(SPREAD, 2), g(SPREAD, 2), g(SPREAD, 3)], want=1, version=3, max_staleness=1)
    assert [x.version for x in sel.train] == [2]
    assert [x.version for x in sel.carry] == [3]
    assert sel.expired == 2 and sel.dropped == 0


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_carry_rule_is_exact_for_every_depth(k):
    """A group carried at trainer version v is trained at the next step, at v + 1 (surplus exists only
    when this step trains): it is carried exactly when it will be within max_staleness then, so no
    group is ever trained more than k behind, and none that would be within k expires. With
    pace, a pipelined batch of depth d <= k arrives d behind, so its surplus is carried iff d < k."""
    v = 10
    for depth in range(k + 1):
        fresh = [g(SPREAD, v - depth) for _ in range(3)] + [g(SPREAD, v)]  # the pipelined batch, an extra round
        sel = select_groups([], fresh, want=1, version=v, max_staleness=k)
        assert [x.version for x in sel.train] == [v - depth]  # the oldest goes first
        want_carry = [x.version for x in fresh[1:] if v + 1 - x.version <= k]
        assert [x.version for x in sel.carry] == want_carry
        assert sel.expired == 3 - len(want_carry)
        nxt = select_groups(sel.carry, [g(SPREAD, v + 1 - depth)], want=4, version=v + 1, max_staleness=k)
        assert nxt.expired == 0 and all(v + 1 - x.version <= k for x in nxt.train)
        assert {id(x) for x in sel.carry} <= {id(x) for x in nxt.train}  # carried groups are trained at v + 1
        assert [x.version for x in nxt.train] == sorted(x.version for x in nxt.train)  # the oldest first


def test_counting_helpers():
    assert usable_samples([g(SPREAD), g(FLAT), g((2.0, 1.0))]) == 5
    assert extra_prompts(3, 0.25, 16) == 12 and extra_prompts(3, 0.01, 16) == 16 and extra_prompts(20, 1.0, 16) == 16
    assert usable_cost(10.0, 4) == (2.5, None)
    assert usable_cost(3600.0, 1, price_per_hour=3.0) == (3600.0, 3.0)


def test_config_fields():
    cfg = config.profile("tiny", dynamic_sampling=True, max_gen_batches=2, price_per_hour=1.5)
    assert cfg.sampling.dynamic_sampling and cfg.sampling.max_gen_batches == 2 and cfg.run.price_per_hour == 1.5
    with pytest.raises(ValueError, match="max_gen_batches"):
        config.profile("tiny", max_gen_batches=0)
    with pytest.raises(ValueError, match="price_per_hour"):
        config.profile("tiny", price_per_hour=-1.0)
    # the price only changes the report: a resumed run may set another
    task = tasks.for_config(cfg)
    assert checkpoint.run_id_for(cfg, "x", task) == checkpoint.run_id_for(cfg.override(price_per_hour=0.0), "x", task)


# ----------------------------------------------------------------- the driver


def _cfg(tmp_path, name, **kw):
    base = dict(engine="hf", iterations=3, eval_every=0, eval_size=16, prompts_per_step=4, group_size=4,
                max_new_tokens=40, run_dir=str(tmp_path / name), collective_timeout_s=30, lr=1e-3, world_size=2)
    base.update(kw)
    return config.profile("tiny", **base)


def _trained(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dynamic_sampling_trains_only_usable_groups_in_ddp(tmp_path, client):
    """kl_beta=0 and a DDP gang of 2: the trainer gets usable groups only (so a rank whose shard
    held zero-spread rows would have skipped them; here each shard holds usable rows only), every
    group is accounted for, and the records carry the usable-sample cost."""
    cfg = _cfg(tmp_path, "dyn", iterations=4, dynamic_sampling=True, max_gen_batches=3, kl_beta=0.0,
               price_per_hour=2.0)
    res = loop.run(cfg, client=client, progress=False)
    recs = res.records
    assert [r["iteration"] for r in recs] == [0, 1, 2, 3]
    carried = 0
    for r in recs:
        assert r["carried_in_groups"] == carried
        # every group generated or carried in is trained, dropped, carried on or expired, once
        assert (r["carried_in_groups"] + r["generated_groups"]
                == r["trained_groups"] + r["dropped_groups"] + r["carried_out_groups"] + r["expired_groups"])
        assert r["dropped_groups"] == r["zero_spread_groups"]
        # at least one prompt (a batch over-samples for what the groups carried into it leave), at most
        # max_gen_batches x prompts_per_step
        assert r["gen_batches"] >= 1 and 1 <= r["generated_groups"] <= 3 * 4
        assert r["trained_groups"] <= cfg.sampling.prompts_per_step
        assert r["usable_samples"] == r["trained_groups"] * cfg.sampling.group_size  # only usable groups trained
        if r["trained_groups"]:
            assert r["samples_nonzero_adv"] > 0 and r["tokens"] > 0
            assert r["usable_cost_s"] == pytest.approx((r["gen_device_s"] + r["train_device_s"]) / r["usable_samples"])
            assert r["usable_cost"] == pytest.approx(r["usable_cost_s"] * 2.0 / 3600)
        assert r["rollout_workers"] == 1 and r["staleness_max"] <= cfg.run.max_staleness
        carried = r["carried_out_groups"]
    assert sum(r["trained_groups"] for r in recs) > 0
    steps = sum(1 for r in recs if r["trained_groups"])
    assert recs[-1]["version"] == steps and AdapterStore(cfg.run.store_root).versions() == list(range(1, steps + 1))


def test_dynamic_sampling_with_only_zero_spread_groups_skips_the_step(tmp_path, client):
    # one new token: every completion is truncated and scores 0, so no group ever has spread
    cfg = _cfg(tmp_path, "flat", iterations=3, dynamic_sampling=True, max_gen_batches=2, max_new_tokens=1)
    res = loop.run(cfg, client=client, progress=False)
    # batch 0 was submitted before any share was known: 4 prompts, then 4 more; the next batches are
    # submitted after the selection, so over-sampled to the bound in the pipelined slot (nothing was usable)
    assert [r["gen_batches"] for r in res.records] == [2, 1, 1]
    for r in res.records:
        assert r["trained_groups"] == 0 and r["usable_samples"] == 0
        assert r["dropped_groups"] == r["generated_groups"] == 2 * cfg.sampling.prompts_per_step
        assert r["usable_share"] == 0 and r["usable_cost_s"] is None and r["loss"] is None
    assert res.records[-1]["version"] == 0 and AdapterStore(cfg.run.store_root).versions() == []


def test_usable_records_without_dynamic_sampling(tmp_path, client):
    cfg = _cfg(tmp_path, "plain", iterations=2)
    res = loop.run(cfg, client=client, progress=False)
    for r in res.records:
        assert r["gen_batches"] == 1 and r["dropped_groups"] == 0 and r["trained_groups"] == r["generated_groups"] == 4
        assert r["usable_samples"] == (4 - r["zero_spread_groups"]) * 4
        assert r["usable_share"] == pytest.approx(r["usable_samples"] / 16)
        assert 0 <= r["usable_tokens"] <= r["tokens"] and r["usable_cost"] is None
        assert (r["usable_tokens"] > 0) == (r["usable_samples"] > 0)
        assert r["train_device_s"] == pytest.approx(2 * r["train_s"]) and r["gen_device_s"] > 0


def test_pipelined_surplus_is_carried_and_its_version_kept(tmp_path, client):
    """max_staleness=2 with a pipeline one batch deep: the pipelined batch arrives one version behind,
    so its surplus usable groups are carried (two behind at the next step) and none expires. With
    retention keeping only the last 2 versions, a carried group's adapter version is still in the
    store when the group is trained (Dask recomputes a lost chunk from it)."""
    cfg = _cfg(tmp_path, "kept", iterations=6, dynamic_sampling=True, max_gen_batches=3, max_staleness=2,
               pipeline_depth=1, keep_versions=2, keep_every=0)
    store = AdapterStore(cfg.run.store_root)
    in_store = []
    res = loop.run(cfg, client=client, callbacks=[lambda rec: in_store.append(store.versions())], progress=False)
    recs = res.records
    assert sum(r["carried_out_groups"] for r in recs) > 0  # the pipelined batch's surplus was carried
    assert [r["expired_groups"] for r in recs] == [0] * len(recs)
    checked = 0
    for prev, r in zip(recs[:-1], recs[1:], strict=True):
        assert r["carried_in_groups"] == prev["carried_out_groups"]
        oldest = r["version"] - 1 - r["staleness_max"] if r["trained_groups"] else None
        assert r["staleness_max"] <= 2
        if r["carried_in_groups"] and oldest:  # version 0 is the base model, never pruned
            assert oldest in in_store[prev["iteration"]], (r["iteration"], oldest, in_store[prev["iteration"]])
            checked += 1
    assert checked, "no carried group of an adapter version >= 1 was trained"


def test_an_over_sampled_round_larger_than_the_pool_takes_the_whole_pool():
    """Review finding: at a usable share of 0 the over-sampled draw (up to prompts_per_step *
    max_gen_batches) could exceed a small dataset, and random.sample raised mid-run."""
    cfg = config.profile("tiny", prompts_per_step=8, max_gen_batches=3, dynamic_sampling=True)
    pool = list(range(20))
    assert sorted(loop.iteration_problems(cfg, pool, 3, 1, n=24)) == pool
    assert len(loop.iteration_problems(cfg, pool, 3, 1, n=5)) == 5
