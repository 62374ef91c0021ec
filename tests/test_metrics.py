"""grpo_kit.metrics: the iteration record and the run summary, with a step that trained no token."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_kit.config import Config
from grpo_kit.loss import LossStats, group_advantages, grpo_loss
from grpo_kit.metrics import Batch, Step, iteration_record, run_summary
from grpo_kit.rollout import RolloutSummary
from grpo_kit.sampling import Group

f64 = torch.float64
T = 4  # completion tokens per row
TRAINER_KEYS = ("ratio_mean", "ratio_std", "ratio_min", "ratio_max", "clip_frac_low", "clip_frac_high", "clip_frac",
                "kl_mean", "is_mean", "is_min", "is_max", "is_capped_frac")


def strict_json(text: str):
    """``json.loads`` that refuses NaN and Infinity, as jq and browsers do."""

    def refuse(const):
        raise ValueError(f"{const} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _batch(it: int, rewards: list[list[float]]) -> Batch:
    rollouts = [RolloutSummary(prompt_id=f"p{g}", group_id=g, sample_idx=i, version=it, finish_reason="stop",
                               text="#### 1", gold="2", prompt_tokens=5, completion_tokens=T, reward=r,
                               correct=False, lenient_correct=False)
                for g, rs in enumerate(rewards) for i, r in enumerate(rs)]
    groups = [Group(tuple(rs), it, tokens=T * len(rs)) for rs in rewards]
    t = 1000.0 + 10 * it
    results = [{"start": t, "end": t + 1, "reward_start": t + 1, "reward_end": t + 1.5, "reward_worker": "w0",
                "worker": "w0"}]
    return Batch(it, it, results, rollouts, groups, groups, [0] * len(groups), 0, None, t, t + 2)


def _trainer_stats(rewards: list[list[float]], seed: int) -> dict:
    """What the trainer reports with kl_beta=0: the loss over the rows with an advantage only."""
    flat = torch.tensor([r for rs in rewards for r in rs], dtype=f64)
    adv = group_advantages(flat, len(rewards[0]))
    keep = adv != 0
    gen = torch.Generator().manual_seed(seed)
    n = int(keep.sum())
    logp = -torch.rand(n, T, generator=gen, dtype=f64)
    old = logp + 0.3 * torch.randn(n, T, generator=gen, dtype=f64)
    stats = LossStats.empty(kl=False)
    if n:
        stats = stats + grpo_loss(logp, old, None, adv[keep], torch.ones(n, T, dtype=torch.bool))[1]
    s = stats.summary()
    return {"loss": 0.0, **s, "grad_norm": 0.0, "tokens": float(len(flat) * T), "tokens_trained": s["tokens"],
            "samples": float(len(flat)), "samples_nonzero_adv": float(n)}


def _records(iterations: list[list[list[float]]]) -> list[dict]:
    recs = []
    for it, rewards in enumerate(iterations):
        t = 1000.0 + 10 * it + 2
        step = Step(_trainer_stats(rewards, seed=it), True, t, t + 1)
        recs.append(iteration_record(Config(), _batch(it, rewards), step, it + 1, None, 0))
    return recs


SPREAD = [[1.1, 0.1, 0.1, 1.1, 0.1, 0.1], [0.0, 1.1, 0.1, 0.1, 0.0, 0.1]]
# formatted but wrong answers under format_bonus=0.1, and no answers: no group with reward spread
NO_SPREAD = [[0.1] * 6, [0.0] * 6]


def test_a_step_that_trained_nothing_records_none_and_the_summary_is_json(tmp_path):
    records = _records([SPREAD, NO_SPREAD, SPREAD])
    empty = records[1]
    assert empty["samples_nonzero_adv"] == 0 and empty["zero_spread_groups"] == 2
    assert all(empty[k] is None for k in TRAINER_KEYS), {k: empty[k] for k in TRAINER_KEYS}
    for rec in records:
        json.dumps(rec, allow_nan=False)  # a metrics.jsonl line jq can read
    trained = [records[0], records[2]]
    assert all(isinstance(r["ratio_mean"], float) and r["ratio_mean"] != 1.0 for r in trained)

    state = {"version": 3, "base_acc": 0.1, "evals": [], "grpo_wall_s": 12.0, "next_iteration": 3}
    summary = run_summary(state, records, 0, None, {}, None)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary, indent=1))  # as the loop writes it
    back = strict_json(path.read_text())
    # the means are over the iterations that measured something
    assert back["ratio_mean"] == pytest.approx(sum(r["ratio_mean"] for r in trained) / 2, rel=1e-12)
    assert back["clip_fraction"] == pytest.approx(sum(r["clip_frac"] for r in trained) / 2, rel=1e-12)
    assert back["kl_final"] is None  # kl_beta=0: never measured


def test_records_holding_nan_average_what_was_measured():
    """A metrics.jsonl written before empty steps recorded None holds NaN there (``json.loads``
    reads it back); a resumed run's summary averages the numbers only."""
    records = _records([SPREAD, SPREAD])
    nan_rec = {**records[1], "iteration": 2, "ratio_mean": math.nan, "clip_frac": math.nan, "kl_mean": math.nan}
    old = json.loads(json.dumps(nan_rec))
    state = {"version": 3, "base_acc": None, "evals": [], "grpo_wall_s": 12.0, "next_iteration": 3}
    summary = run_summary(state, [*records, old], 0, None, {}, None)
    strict_json(json.dumps(summary))
    assert summary["ratio_mean"] == pytest.approx((records[0]["ratio_mean"] + records[1]["ratio_mean"]) / 2, rel=1e-12)
    assert summary["clip_fraction"] == pytest.approx((records[0]["clip_frac"] + records[1]["clip_frac"]) / 2, rel=1e-12)


def test_a_run_that_never_trained_summarizes_none():
    records = _records([NO_SPREAD, NO_SPREAD])
    summary = run_summary({"version": 0, "base_acc": 0.0, "evals": [], "grpo_wall_s": 1.0, "next_iteration": 2},
                          records, 0, None, {}, None)
    assert (summary["ratio_mean"], summary["clip_fraction"], summary["kl_final"]) == (None, None, None)
    strict_json(json.dumps(summary))


# ---------------------------------------------------------------- multi-turn episodes

EPISODE_KEYS = {"episodes", "turns_mean", "turns_max", "tool_rate", "tool_calls_mean", "tool_errors_mean",
                "tool_errors_by_kind", "model_tokens_mean", "env_tokens_mean", "env_tokens", "end_answered",
                "end_max_turns", "end_budget", "end_error"}


def _episode(turns: int, tool_calls: int, end: str, errors: dict | None = None, model: int = 10, env: int = 0) -> dict:
    """A rollout's ``episode`` as grpo_kit.episode.summary writes it."""
    return {"turns": turns, "tool_calls": tool_calls, "tool_errors": errors or {}, "end_reason": end,
            "model_tokens": model, "env_tokens": env, "env_reward": float(tool_calls), "error": None,
            "messages": [{"role": "assistant", "content": "x"}] * turns}


def _episode_record(episodes: list[dict]) -> dict:
    batch = _batch(0, [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert len(batch.rollouts) == len(episodes)
    for r, ep in zip(batch.rollouts, episodes, strict=True):
        r.episode, r.completion_tokens = ep, ep.get("model_tokens", 0)
    stats = _trainer_stats([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], seed=0)
    return iteration_record(Config(), batch, Step(stats, True, 1003.0, 1004.0), 1, None, 0)


def test_a_multi_turn_batch_records_its_episodes():
    eps = [_episode(1, 0, "answered", model=7),  # answered at once: no tool
           _episode(3, 2, "max_turns", {"malformed": 1}, model=30, env=20),
           _episode(2, 1, "answered", model=12, env=9),
           _episode(2, 4, "budget", {"timeout": 2, "malformed": 1}, model=64, env=31),
           _episode(1, 0, "error", model=0),  # reset raised: nothing sampled
           _episode(3, 3, "max_turns", model=25, env=16)]
    rec = _episode_record(eps)
    assert EPISODE_KEYS <= set(rec)
    assert rec["episodes"] == 6 and rec["turns_max"] == 3
    assert rec["turns_mean"] == pytest.approx(12 / 6)
    assert rec["tool_rate"] == pytest.approx(4 / 6)  # four episodes called a tool
    assert rec["tool_calls_mean"] == pytest.approx(10 / 6)
    assert rec["tool_errors_by_kind"] == {"malformed": 2, "timeout": 2}
    assert rec["tool_errors_mean"] == pytest.approx(4 / 6)
    assert rec["model_tokens_mean"] == pytest.approx(138 / 6) and rec["completion_tokens"] == 138
    assert rec["env_tokens"] == 76 and rec["env_tokens_mean"] == pytest.approx(76 / 6)
    assert (rec["end_answered"], rec["end_max_turns"], rec["end_budget"], rec["end_error"]) == (2, 2, 1, 1)
    json.dumps(rec, allow_nan=False)
    assert not EPISODE_KEYS & set(_records([SPREAD])[0])  # a single-turn record is as it was


def test_an_episode_with_missing_counts_is_counted_as_none():
    """A rollout written by an older kit may lack counts, and a hostile or buggy environment's end
    reason may be none of the four: nothing raises, no count is invented."""
    eps = [_episode(2, 1, "answered"), {"turns": 1, "end_reason": "exploded"}, *(_episode(1, 0, "answered"),) * 4]
    rec = _episode_record(eps)
    assert rec["episodes"] == 6 and rec["turns_mean"] == pytest.approx(7 / 6)
    assert rec["end_answered"] == 5 and rec["end_max_turns"] + rec["end_budget"] + rec["end_error"] == 0
    assert rec["tool_errors_by_kind"] == {} and rec["tool_errors_mean"] == 0


def test_the_summary_has_the_tool_rate_before_and_after_where_evals_measured_it():
    records = _records([SPREAD, SPREAD])
    evals = [{"version": 0, "acc": 0.1, "tool_rate": 0.25, "turns_mean": 1.0, "tool_errors": 3},
             {"version": 1, "acc": 0.2, "tool_rate": 0.5, "turns_mean": 1.5, "tool_errors": 1},
             {"version": 2, "acc": 0.3, "tool_rate": 0.75, "turns_mean": 2.5, "tool_errors": 0}]
    state = {"version": 2, "base_acc": 0.1, "evals": evals, "grpo_wall_s": 1.0, "next_iteration": 2}
    summary = run_summary(state, records, 0, None, {}, None)
    assert (summary["tool_rate_before"], summary["tool_rate_after"]) == (0.25, 0.75)
    assert (summary["turns_mean_before"], summary["turns_mean_after"]) == (1.0, 2.5)
    no_final = run_summary({**state, "evals": evals[:2]}, records, 0, None, {}, None)  # the final eval never came
    assert no_final["tool_rate_before"] == 0.25 and no_final["tool_rate_after"] is None
    strict_json(json.dumps(no_final))
    single = run_summary({**state, "evals": [{k: e[k] for k in ("version", "acc")} for e in evals]}, records, 0, None,
                         {}, None)
    assert not [k for k in single if k.startswith(("tool_rate", "turns_mean"))]  # a single-turn run's summary


def test_the_summary_has_pass_at_k_and_maj_at_k_only_where_evals_sampled():
    records = _records([SPREAD, SPREAD])
    sampled = {"samples": 4, "temperature": 1.0}
    evals = [{"version": 0, "acc": 0.1, **sampled, "pass_at": {"1": 0.2, "2": 0.3, "4": 0.4}, "avg_acc": 0.2, "maj_acc": None},
             {"version": 2, "acc": 0.3, **sampled, "pass_at": {"1": 0.5, "2": 0.6, "4": 0.8}, "avg_acc": 0.5, "maj_acc": 0.6}]
    state = {"version": 2, "base_acc": 0.1, "evals": evals, "grpo_wall_s": 1.0, "next_iteration": 2}
    summary = run_summary(state, records, 0, None, {}, None)
    assert summary["pass_at_before"] == {"1": 0.2, "2": 0.3, "4": 0.4} and summary["pass_at_after"]["4"] == 0.8
    assert (summary["avg_acc_before"], summary["avg_acc_after"]) == (0.2, 0.5)
    assert (summary["maj_acc_before"], summary["maj_acc_after"]) == (None, 0.6)
    strict_json(json.dumps(summary))
    greedy = run_summary({**state, "evals": [{k: e[k] for k in ("version", "acc")} for e in evals]}, records, 0, None,
                         {}, None)
    assert not [k for k in greedy if k.startswith(("pass_at", "avg_acc", "maj_acc"))]  # eval_samples=0


def test_other_eval_sets_are_summarized_apart_from_the_tasks_own():
    records = _records([SPREAD, SPREAD])
    evals = [{"version": 0, "acc": 0.1}, {"version": 0, "acc": 0.7, "set": "gsm8k", "lenient_acc": 0.8},
             {"version": 2, "acc": 0.3}, {"version": 2, "acc": 0.9, "set": "gsm8k", "lenient_acc": 1.0}]
    state = {"version": 2, "base_acc": 0.1, "evals": evals, "grpo_wall_s": 1.0, "next_iteration": 2}
    summary = run_summary(state, records, 0, None, {}, None)
    assert summary["acc_after"] == 0.3  # never the other set's result of the same version
    assert summary["eval_sets"] == {"gsm8k": {"acc_before": 0.7, "acc_after": 0.9,
                                              "lenient_acc_before": 0.8, "lenient_acc_after": 1.0}}
    assert "eval_sets" not in run_summary({**state, "evals": evals[::2]}, records, 0, None, {}, None)


# ----------------------------------------------------------------------------- the wrong-policy warning


@pytest.mark.parametrize(
    ("mismatch_kl", "base_kl", "claimed", "lag", "flagged"),
    [
        (0.05, 1e-7, 3, 0, True),  # sampled from the base: the engine is the base model, far from the policy
        (0.05, 0.01, 3, 1, True),  # closer to the base by 5x (a partly applied adapter reads the same)
        (2e-7, 0.05, 3, 0, False),  # on-policy: the engine is the trainer, far from the base
        (0.05, 0.05, 3, 1, False),  # stale, as far from the base as from the trainer: honest
        (5e-4, 1e-7, 3, 0, False),  # too close to the trainer to tell (the adapter has barely moved)
        (0.05, 1e-7, 0, 0, False),  # version 0 is the base model: nothing to tell apart
        (0.05, 1e-7, 1, 2, False),  # an early version, two updates behind: an honest batch can look like this
        (0.05, None, 3, 0, False),  # kl_beta == 0: no base log-probs, not decided
        (None, None, 3, 0, False),  # nothing trained
    ],
)
def test_wrong_policy_criterion(mismatch_kl, base_kl, claimed, lag, flagged):
    from grpo_kit.metrics import wrong_policy

    reason = wrong_policy(mismatch_kl, base_kl, claimed, lag)
    assert (reason is not None) is flagged
    if flagged:
        assert "base model" in reason and f"version {claimed}" in reason


def test_wrong_policy_warns_once_per_run_of_flagged_iterations():
    from grpo_kit.metrics import wrong_policy_warning

    flags = [None, "x", "x", None, "y", None]
    recs = [{"iteration": i, "rollout_version": i, "wrong_policy": f} for i, f in enumerate(flags)]
    msgs = [wrong_policy_warning(r, recs[i - 1] if i else None) for i, r in enumerate(recs)]
    assert [m is not None for m in msgs] == [False, True, False, False, True, False]
    assert msgs[1].startswith("iteration 1 (rollout version 1): x") and msgs[4].endswith(": y")


@pytest.fixture(scope="module")
def tiny_v1(tmp_path_factory):
    """The tiny model's path, a store holding a non-trivial adapter as version 1, and that policy as
    the trainer holds it (trainable)."""
    from grpo_kit import tiny
    from grpo_kit.adapters import AdapterStore
    from grpo_kit.testing import perturbed_adapter

    path = str(tiny.ensure_tiny_model())
    store = AdapterStore(str(tmp_path_factory.mktemp("store")))
    model = perturbed_adapter(path, seed=1)
    store.publish(model, 1)
    return path, store, model


@pytest.mark.parametrize("sampled_from", [0, 1])
def test_a_batch_sampled_from_the_base_while_claiming_version_1_is_flagged(tiny_v1, sampled_from):
    """The real case on the tiny model: the HF engine samples at version 0 (the base) or 1, the trainer's
    step holds version 1 (kl_beta > 0, so it computes the base log-probs too); the record's criterion
    flags the base-sampled batch, claimed as version 1, and not the honest one."""
    from grpo_kit import data
    from grpo_kit.config import LossConfig, OptimConfig
    from grpo_kit.hf_engine import HFEngine
    from grpo_kit.metrics import wrong_policy
    from grpo_kit.train_step import collate, grpo_step

    path, store, model = tiny_v1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: spinning OpenMP workers on a shared CPU cost more than they give
    try:
        engine = HFEngine(path, store=store)
        rollouts = engine.generate(data.synthetic_problems(4, split="train", seed=0), 4, sampled_from,
                                   max_new_tokens=24, seed=1)
        engine.close()
        batch = collate([(r.prompt_ids, r.completion_ids, r.logprobs, (-1.0) ** i, r.mask)
                         for i, r in enumerate(rollouts)], pad_id=0)
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, LossConfig(kl_beta=0.02),
                          OptimConfig())
    finally:
        torch.set_num_threads(threads)
    reason = wrong_policy(stats["mismatch_kl"], stats["base_mismatch_kl"], claimed_version=1, lag=0)
    if sampled_from == 0:  # the engine's log-probs are the base model's, to float rounding
        assert stats["base_mismatch_kl"] < 1e-6 < 1e-3 < stats["mismatch_kl"]
        assert reason is not None and "sampled from the base model" in reason
    else:  # on-policy: the engine's log-probs are the trainer's
        assert stats["mismatch_kl"] < 1e-6 < 1e-3 < stats["base_mismatch_kl"]
        assert reason is None
