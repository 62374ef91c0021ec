"""What the driver measures in one iteration: the assembled batch, the trainer's step, and the metrics
record built from them (its keys and their meaning: :class:`grpo_kit.records.MetricsRecord`).

:func:`iteration_record` is a pure function of a :class:`Batch` (what generation delivered: every
chunk's summary, the groups generated and those picked for training, their version lags) and a
:class:`Step` (the trainer gang's statistics and timings); the driver (:mod:`grpo_kit.loop`) adds the
evaluations that finish and the loop's wall time when it commits the iteration. A multi-turn run's
record adds its episodes' counts (:func:`episode_metrics`); a single-turn run's has none of those keys.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from .config import Config
from .episode import END_REASONS
from .records import MetricsRecord
from .rollout import RolloutSummary
from .sampling import Group, usable_cost, usable_samples
from .series import series


@dataclass
class Batch:
    """One iteration's batch, assembled by the driver from its rollout chunks."""

    iteration: int
    """The iteration it belongs to."""
    rollout_version: int
    """The oldest adapter version the batch's rollouts were sampled from: the version it was submitted
    with, unless a chunk took a newer one when it started (``staleness_policy="discard"``) or dynamic
    sampling's extra rounds sampled at a later version."""
    results: list[dict]
    """Every chunk's summary (``remote.summary_task``), all dynamic-sampling rounds included."""
    rollouts: list[RolloutSummary]
    """The completions' summaries (group, then sample): with dynamic sampling every round's, the
    zero-spread groups not trained included and carried-in groups not, so ``reward_mean``,
    ``train_acc``, ``truncated`` and the samples describe what was generated for the iteration."""
    generated: list[Group]
    """Every group generated for the iteration."""
    picked: list[Group]
    """The groups to train on (all generated ones, or dynamic sampling's usable ones)."""
    lags: list[int]
    """Version lag of each picked group (trainer version minus generating version)."""
    rejected: int
    """Groups dropped as too stale and generated again."""
    dyn: dict | None
    """Dynamic sampling's counts (``gen_batches``, ``dropped_groups``, ...); None without it."""
    t_iter: float
    """Unix time the iteration started."""
    t_gen_done: float
    """Unix time the batch was in."""
    task_resubmits: int = 0
    """Tasks resubmitted after ``KilledWorker`` since the previous record (``remote.TaskRetries``)."""
    discarded: list[dict] = field(default_factory=list)
    """The chunk summaries of a batch dropped as too stale (its device time counts in the cost)."""


@dataclass
class Step:
    """The trainer gang's step on a batch."""

    stats: dict
    """The gang's statistics (``{}`` when nothing was trained); ``ranks`` holds each rank's timings."""
    trained: bool
    """Whether the batch held anything to train on (a new adapter version was published)."""
    t_train: float
    """Unix time the step started."""
    t_train_end: float
    """Unix time it returned."""


def iteration_record(cfg: Config, batch: Batch, step: Step, version: int, base_acc: float | None,
                     gang_restarts: int) -> MetricsRecord:
    """The metrics record of an iteration (``version``: the trainer's version after the step); its
    evaluation keys are None until the driver attaches the evaluations that finished."""
    it, results, rollouts, picked, generated = batch.iteration, batch.results, batch.rollouts, batch.picked, batch.generated
    lags, rejected, t_iter, t_gen_done = batch.lags, batch.rejected, batch.t_iter, batch.t_gen_done
    stats, t_train, t_train_end = step.stats, step.t_train, step.t_train_end
    lag, n_groups = max(lags), len(picked)
    gen_spans = [{"name": "generate", "iteration": it, "start": r["start"], "end": r["end"]} for r in results]
    spans = list(gen_spans)
    ranks = stats.get("ranks", [])
    if ranks:
        r0 = ranks[0]
        spans.append({"name": "train", "iteration": it, "start": r0["start"], "end": r0["start"] + r0["prepare_s"] + r0["compute_s"]})
        spans.append({"name": "publish", "iteration": it, "start": r0["end"] - r0["publish_s"] - r0["checkpoint_s"],
                      "end": r0["end"]})
    n_rollouts = len(rollouts)
    usable = usable_samples(picked)
    rewards = [r.reward for r in rollouts if r.reward is not None]  # unscorable ones have none
    iter_end = time.time()
    gen_s = max(r["end"] for r in results) - min(r["start"] for r in results)
    # device-seconds: each rollout task's time on its worker, and the gang's wall time on every rank
    gen_device_s = sum(r["end"] - r["start"] for r in [*results, *batch.discarded])  # a discarded batch cost too
    train_device_s = (t_train_end - t_train) * cfg.cluster.world_size if step.trained else 0.0
    cost_s, cost = usable_cost(gen_device_s + train_device_s, usable, cfg.run.price_per_hour)
    dyn = batch.dyn or {"gen_batches": 1, "dropped_groups": 0, "carried_in_groups": 0, "carried_out_groups": 0,
                        "expired_groups": 0}
    return {
            "iteration": it,
            "version": version,
            "rollout_version": batch.rollout_version,
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "reward_std": statistics.stdev(rewards) if len(rewards) > 1 else None,
            "unscorable": n_rollouts - len(rewards),
            "train_acc": sum(bool(r.correct) for r in rollouts) / max(1, n_rollouts),
            "train_lenient_acc": sum(bool(r.lenient_correct) for r in rollouts) / max(1, n_rollouts),
            "reward_components": component_means(rollouts),
            "reward_errors": sum(r.reward_errors for r in rollouts),
            "reward_metrics": reward_metric_means(results),
            "reward_s": sum(res["reward_end"] - res["reward_start"] for res in results),
            "reward_workers": len({res["reward_worker"] for res in results}),
            "eval_acc": None,
            "eval_lenient_acc": None,
            "base_acc": base_acc,
            "loss": stats.get("loss"),
            # None, never NaN, where the step trained no token (no group with reward spread, kl_beta=0)
            "ratio_mean": finite(stats.get("ratio_mean")),
            "ratio_std": finite(stats.get("ratio_std")),
            "ratio_min": finite(stats.get("ratio_min")),
            "ratio_max": finite(stats.get("ratio_max")),
            "clip_frac_low": finite(stats.get("clip_low")),
            "clip_frac_high": finite(stats.get("clip_high")),
            "clip_frac": finite(stats.get("clip_frac")),
            "kl_mean": finite(stats.get("kl")),
            "is_mean": finite(stats.get("is_mean")),
            "is_min": finite(stats.get("is_min")),
            "is_max": finite(stats.get("is_max")),
            "is_capped_frac": finite(stats.get("is_capped_frac")),
            "mismatch_kl": finite(stats.get("mismatch_kl")),
            "mismatch_far_frac": finite(stats.get("mismatch_far_frac")),
            "sampled_nll": finite(stats.get("sampled_nll")),
            "base_mismatch_kl": finite(stats.get("base_mismatch_kl")),
            # the oldest version the batch claims: the trainer's before the step, minus the largest lag
            "wrong_policy": wrong_policy(finite(stats.get("mismatch_kl")), finite(stats.get("base_mismatch_kl")),
                                         version - step.trained - lag, lag),
            "grad_norm": stats.get("grad_norm"),
            "tokens": stats.get("tokens"),
            "samples_nonzero_adv": stats.get("samples_nonzero_adv"),
            "staleness_max": lag,
            "staleness_mean": sum(lags) / len(lags),
            "rejected_groups": rejected,
            "kept_groups": n_groups,
            "generated_groups": len(generated),
            "zero_spread_groups": sum(not g.has_spread for g in generated),
            "all_zero_spread": bool(generated) and not any(g.has_spread for g in generated),
            "usable_samples": usable,
            "usable_tokens": sum(g.tokens for g in picked if g.has_spread),
            "usable_share": usable_samples(generated) / max(1, n_rollouts),
            "usable_per_s": usable / max(1e-9, iter_end - t_iter),
            "usable_cost_s": cost_s,
            "usable_cost": cost,
            "gen_device_s": gen_device_s,
            "train_device_s": train_device_s,
            "rollout_workers": len({r.get("worker") for r in results}),
            "trained_groups": len(picked),
            **dyn,
            "truncated": sum(r.truncated for r in rollouts),
            "completion_tokens": sum(r.completion_tokens for r in rollouts),
            "gen_s": gen_s,
            "gen_wait_s": t_gen_done - t_iter,
            "train_s": t_train_end - t_train,
            "train_compute_s": ranks[0]["compute_s"] if ranks else None,
            "publish_s": ranks[0]["publish_s"] if ranks else None,
            "checkpoint_s": ranks[0]["checkpoint_s"] if ranks else None,
            "prepare_s": ranks[0]["prepare_s"] if ranks else None,
            "gang_restarts": gang_restarts,
            "task_resubmits": batch.task_resubmits,
            "t_iter_start": t_iter,
            "t_iter_end": iter_end,
            "iter_s": iter_end - t_iter,
            "spans": spans,
            **episode_metrics(rollouts),
        }


def episode_metrics(rollouts: list[RolloutSummary]) -> dict:
    """The batch's multi-turn episode counts (:attr:`~grpo_kit.rollout.Scored.episode`), per episode
    where they are means; ``{}`` when no completion is an episode (a single-turn run's record has
    none of these keys). An end reason outside :data:`~grpo_kit.episode.END_REASONS` is counted in none."""
    eps = [r.episode for r in rollouts if r.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    kinds: dict[str, int] = {}
    for e in eps:
        for kind, c in (e.get("tool_errors") or {}).items():
            kinds[kind] = kinds.get(kind, 0) + c
    env_tokens = sum(e.get("env_tokens") or 0 for e in eps)
    return {
        "episodes": n,
        "turns_mean": sum(e.get("turns") or 0 for e in eps) / n,
        "turns_max": max(e.get("turns") or 0 for e in eps),
        "tool_rate": sum((e.get("tool_calls") or 0) > 0 for e in eps) / n,
        "tool_calls_mean": sum(e.get("tool_calls") or 0 for e in eps) / n,
        "tool_errors_mean": sum(kinds.values()) / n,
        "tool_errors_by_kind": kinds,
        "model_tokens_mean": sum(e.get("model_tokens") or 0 for e in eps) / n,
        "env_tokens_mean": env_tokens / n,
        "env_tokens": env_tokens,
        **{f"end_{reason}": sum(e.get("end_reason") == reason for e in eps) for reason in END_REASONS},
    }


def component_means(rollouts: list[RolloutSummary]) -> dict:
    """Mean score of each reward component over the batch (completions where it applied)."""
    out: dict = {}
    for name in (rollouts[0].reward_components or {}) if rollouts else ():
        vals = [r.reward_components[name] for r in rollouts if r.reward_components and r.reward_components.get(name) is not None]
        out[name] = sum(vals) / len(vals) if vals else None
    return out


def reward_metric_means(results: list[dict]) -> dict[str, float]:
    """Each ``log_metric`` name's mean over every value the reward functions logged for the batch's
    chunks (all dynamic-sampling rounds; TRL averages the same way over a logging step)."""
    values: dict[str, list[float]] = {}
    for res in results:
        for name, vs in (res.get("reward_metrics") or {}).items():
            values.setdefault(name, []).extend(vs)
    return {name: sum(vs) / len(vs) for name, vs in values.items() if vs}


WRONG_POLICY_MIN_KL = 1e-3
"""Below this ``mismatch_kl`` (mean k3 nats per token) the engine is as close to the trainer as
:func:`wrong_policy` needs to say nothing, whatever it is closer to."""
WRONG_POLICY_RATIO = 0.25
""":func:`wrong_policy` flags a batch whose engine/base KL is below this share of its engine/trainer KL."""


class WrongPolicyWarning(UserWarning):
    """Rollouts look sampled from another policy than the adapter version they claim (:func:`wrong_policy`)."""


def wrong_policy(mismatch_kl: float | None, base_mismatch_kl: float | None, claimed_version: int,
                 lag: int) -> str | None:
    """Why a trained batch looks sampled from the base model rather than the adapter version it claims,
    or None. The failure elsewhere (verl#3821, unsloth#8701): the engine silently samples without
    the adapter, and training goes on, on the wrong samples.

    The criterion: the engine's log-probs of the sampled tokens are much closer to the base model's
    than to the trainer's policy, ``base_mismatch_kl < WRONG_POLICY_RATIO * mismatch_kl`` (both the k3
    KL from the engine, over the trained tokens), where the engine is measurably far from the trainer
    (``mismatch_kl >= WRONG_POLICY_MIN_KL``). It is decided only where it cannot be the honest case:
    the claimed version is >= 1 (version 0 IS the base model) and at least as many updates from the
    base as the trainer is from it (``lag <= claimed_version``: an honest stale batch of an early
    version could be closer to the base than to a trainer several updates ahead). It needs the base
    model's log-probs, which the step computes with ``kl_beta > 0`` only (None otherwise: not decided).
    """
    if mismatch_kl is None or base_mismatch_kl is None or claimed_version < 1 or lag > claimed_version:
        return None
    if mismatch_kl < WRONG_POLICY_MIN_KL or base_mismatch_kl >= WRONG_POLICY_RATIO * mismatch_kl:
        return None
    return (f"the engine's log-probs of the sampled tokens match the base model's (KL {base_mismatch_kl:.2e}) far "
            f"better than the trainer's policy (KL {mismatch_kl:.2e}), {lag} update(s) after version "
            f"{claimed_version}: the batch looks sampled from the base model, not from the adapter it claims "
            f"(is the engine applying the LoRA?)")


def wrong_policy_warning(rec: MetricsRecord, previous: MetricsRecord | None) -> str | None:
    """The warning text for ``rec``, once per occurrence: when it is flagged (``wrong_policy``) and
    the previous record was not; a run of flagged iterations warns at its first (every record keeps
    its flag)."""
    if not rec.get("wrong_policy") or (previous is not None and previous.get("wrong_policy")):
        return None
    return f"iteration {rec['iteration']} (rollout version {rec['rollout_version']}): {rec['wrong_policy']}"


def finite(x):
    """``x``, or None for NaN (a statistic that was not computed)."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def run_summary(state: dict, records: list[MetricsRecord], gang_restarts: int, startup_s: float | None,
                warm_up_s: dict, preflight: dict | None) -> dict:
    """A finished run's ``summary.json``: accuracy before and after (the final version's evaluation),
    means over the iterations that measured them (a step that trained no token measured no ratio;
    a record written by an older kit may hold NaN there), and where the time went before the first
    one. Valid JSON: None, never NaN, where nothing was measured."""
    final_version = state["version"]
    ratios, clips, kls = (series(records, k)[1] for k in ("ratio_mean", "clip_frac", "kl_mean"))
    mine = [e for e in state["evals"] if "set" not in e]  # the task's own held-out set (others: eval_sets below)
    evs = [e for e in mine if e["version"] == final_version]
    base = [e for e in mine if e["version"] == 0]
    # multi-turn runs' evaluations measure the episodes too; a single-turn run's summary has no such keys
    episodes = {f"{k}_{when}": (es[-1].get(k) if es else None)
                for k in ("tool_rate", "turns_mean") for when, es in (("before", base), ("after", evs))
                } if any("tool_rate" in e for e in state["evals"]) else {}
    # sampled evaluations (eval_samples = k): pass@1..k, avg@k and maj@k before and after; else no such keys
    sampled = {f"{k}_{when}": (es[-1].get(k) if es else None)
               for k in ("pass_at", "avg_acc", "maj_acc") for when, es in (("before", base), ("after", evs))
               } if any("pass_at" in e for e in state["evals"]) else {}
    return {
        "acc_before": state["base_acc"],
        "acc_after": evs[-1]["acc"] if evs else None,
        "lenient_acc_before": state.get("base_lenient_acc"),
        "lenient_acc_after": evs[-1].get("lenient_acc") if evs else None,
        "grpo_wall_s": state["grpo_wall_s"],
        "iterations": state["next_iteration"],
        "final_version": final_version,
        "ratio_mean": sum(ratios) / len(ratios) if ratios else None,
        "clip_fraction": sum(clips) / len(clips) if clips else None,
        "kl_final": kls[-1] if kls else None,
        "rejected_groups": sum(r.get("rejected_groups") or 0 for r in records),  # recovered records lack it
        "wrong_policy_iterations": sum(bool(r.get("wrong_policy")) for r in records),
        "truncated": sum(r.get("truncated") or 0 for r in records),
        "recovered_records": sum(bool(r.get("recovered")) for r in records),
        "gang_restarts": gang_restarts,
        "startup_s": startup_s,
        "warm_up_s": warm_up_s,
        "preflight": preflight,
        **episodes,
        **sampled,
        **eval_sets_summary(state["evals"], final_version),
    }


def eval_sets_summary(evals: list[dict], final_version: int) -> dict:
    """``{"eval_sets": {name: {acc_before, acc_after, ...}}}`` for the results of ``DataConfig.eval_sets``
    (the base model's and the final version's; pass@k, avg@k and maj@k where sampled); ``{}`` without any."""
    names = list(dict.fromkeys(e["set"] for e in evals if "set" in e))
    if not names:
        return {}
    keys = ("acc", "lenient_acc", "pass_at", "avg_acc", "maj_acc")
    out = {}
    for name in names:
        es = [e for e in evals if e.get("set") == name]
        when = {"before": [e for e in es if e["version"] == 0], "after": [e for e in es if e["version"] == final_version]}
        out[name] = {f"{k}_{w}": (got[-1].get(k) if got else None) for k in keys for w, got in when.items()
                     if k in ("acc", "lenient_acc") or any(k in e for e in es)}
    return {"eval_sets": out}
