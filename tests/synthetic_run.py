"""A synthetic run for the tests of the run record, the figures, the live widgets and the report
(and the browser test): metric records of a pipelined run and a run directory caught mid-write.

Not a test module: the test files import it (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go

NASTY = "<script>alert('x')</script> & 2 < 3"


def synthetic_records(n: int = 12, *, eval_every: int = 4, t0: float = 1_700_000_000.0) -> list[dict]:
    """Metric records of a pipelined run: generate(i + 1) overlaps train(i), eval every few iterations."""
    records = []
    for i in range(n):
        g0 = t0 + 10.0 * i
        spans = [
            {"name": "generate", "iteration": i, "start": g0, "end": g0 + 9.0},
            {"name": "train", "iteration": i, "start": g0 + 9.0, "end": g0 + 16.0},
            {"name": "publish", "iteration": i, "start": g0 + 16.0, "end": g0 + 16.5},
        ]
        evaluated = (i + 1) % eval_every == 0
        if evaluated:
            spans.append({"name": "eval", "iteration": i, "start": g0 + 16.5, "end": g0 + 19.0})
        records.append(
            {
                "iteration": i,
                "version": i + 1,
                "reward_mean": 0.2 + 0.05 * i,
                "reward_std": 0.3 - 0.01 * i,
                "unscorable": 0,
                "reward_components": {"answer": 0.2 + 0.05 * i, "short": 1.0 if i % 2 else None},
                "reward_errors": i % 3,
                "train_acc": 0.15 + 0.05 * i,
                "train_lenient_acc": 0.2 + 0.05 * i,
                "eval_acc": 0.25 + 0.0625 * i if evaluated else None,
                "eval_lenient_acc": 0.3 + 0.0625 * i if evaluated else None,
                "eval_pass_at_k": 0.4 + 0.05 * i if evaluated else None,  # eval_samples = k
                "eval_maj_acc": 0.3 + 0.05 * i if evaluated else None,
                "base_acc": 0.25,
                "loss": -0.01 * i,
                "ratio_mean": 1.0 + 0.001 * i,
                "ratio_std": 0.02,
                "ratio_min": 0.8 - 0.01 * i,
                "ratio_max": 1.2 + 0.01 * i,
                "is_mean": 1.0 - 0.001 * i,  # old_logp_source="trainer": the engine-mismatch weight
                "is_min": 0.5,
                "is_max": 3.5 + 0.1 * i,
                "is_capped_frac": 0.001 * i,
                "clip_frac_low": 0.01,
                "clip_frac_high": 0.02 + 0.001 * i,
                "clip_frac": 0.03 + 0.001 * i,
                "kl_mean": 1e-4 * i,
                "mismatch_kl": 2e-4 * i,
                "mismatch_far_frac": 0.001 * i,
                "sampled_nll": 1.5,
                "base_mismatch_kl": 1e-4 * i,
                "wrong_policy": None,
                "grad_norm": 0.5,
                "tokens": 4000 + i,
                "samples_nonzero_adv": 60,
                "staleness_max": min(i, 1),
                "staleness_mean": 0.5 if i else 0.0,
                "rejected_groups": i % 3,
                "kept_groups": 16 - i % 3,
                "usable_samples": 90,
                "usable_per_s": 9.5,
                "usable_share": 0.9 - 0.05 * i,
                "usable_cost_s": 0.2 + 0.01 * i,
                "usable_cost": (0.2 + 0.01 * i) * 2.0 / 3600,
                "dropped_groups": i % 4,
                "rollout_workers": 1 + (3 <= i < 7),
                "truncated": 2,
                "iter_s": 10.0,
                "gen_s": 9.0,
                "train_s": 7.0,
                "spans": spans,
            }
        )
    return records


END_REASONS = ("answered", "max_turns", "budget", "error")


def synthetic_episode_records(n: int = 12, **kw) -> list[dict]:
    """:func:`synthetic_records` of a multi-turn run: 96 episodes per batch that use more tools as
    the run goes, and evaluations that measure the episodes (the base model's in the first record)."""
    records = synthetic_records(n, **kw)
    for i, rec in enumerate(records):
        ends = {"end_answered": 60 + i, "end_max_turns": 20 - i % 5, "end_budget": 14 - i + i % 5, "end_error": 2}
        assert sum(ends.values()) == 96 and min(ends.values()) >= 0
        rec.update(episodes=96, turns_mean=1.5 + 0.1 * i, turns_max=3 + i % 2, tool_rate=0.4 + 0.05 * i,
                   tool_calls_mean=0.6 + 0.1 * i, tool_errors_mean=0.25 - 0.01 * i,
                   tool_errors_by_kind={"malformed": 20 - i, "timeout": 4} if i != 5 else {"malformed": 15},
                   model_tokens_mean=40.0 + i, env_tokens_mean=12.0 + 2 * i, env_tokens=96 * (12 + 2 * i), **ends)
        evs = [{"version": i + 1, "acc": rec["eval_acc"], "tool_rate": 0.5 + 0.04 * i, "turns_mean": 2.0,
                "tool_errors": 3}] if rec["eval_acc"] is not None else []
        if i == 0:
            evs.insert(0, {"version": 0, "acc": 0.25, "tool_rate": 0.125, "turns_mean": 1.0, "tool_errors": 9})
        if evs:
            rec["evals"] = evs
            rec["eval_version"] = evs[-1]["version"]
    return records


def episode_account(turn: str = "I will note it.", answer: str = "noted 4", **kw) -> dict:
    """A multi-turn sample's ``episode`` (``grpo_kit.episode.summary``'s keys): two model turns around a tool answer."""
    return {"turns": 2, "tool_calls": 1, "tool_errors": {"timeout": 1}, "end_reason": "answered", "model_tokens": 30,
            "env_tokens": 9, "env_reward": 1.0, "error": None,
            "messages": [{"role": "assistant", "content": turn}, {"role": "tool", "name": "note", "content": answer},
                         {"role": "assistant", "content": "#### 4"}], **kw}


def make_run(run_dir: Path, n: int = 12, *, partial_last_line: bool = True, episodes: bool = False) -> list[dict]:
    """A run directory as the loop writes it, caught mid-write: the last metrics line is half there.
    With ``episodes``: a multi-turn run's, whose samples carry their episodes (with :data:`NASTY`
    in a model turn and in a tool answer)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = synthetic_episode_records(n) if episodes else synthetic_records(n)
    lines = [json.dumps(r) for r in records]
    if partial_last_line:
        lines.append(json.dumps(synthetic_records(n + 1)[-1])[:57])
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))
    (run_dir / "config.json").write_text(
        json.dumps(
            {
                "model": {"model": "tiny", "dtype": "float32"},
                "sampling": {"group_size": 6, "prompts_per_step": 16},
                "loss": {"loss_type": "dapo", "clip_eps_high": 0.28},
            }
        )
    )
    (run_dir / "summary.json").write_text(
        json.dumps(
            {"acc_before": 0.25, "acc_after": 0.9375, "grpo_wall_s": 1234.5, "iterations": n, "kl_final": 0.0011}
        )
    )
    samples = [
        {
            "iteration": it,
            "prompt": f"What is {k} + {it}?",
            "completion": f"The answer is {k + it}",
            "reward": 1.0 if k % 2 else 0.0,
            "gold": str(k + it),
        }
        for it in (0, n - 1)
        for k in range(4)
    ]
    samples[-1]["completion"] = NASTY
    if episodes:
        for s in samples:
            s["episode"] = episode_account()
        samples[-1]["episode"] = episode_account(turn=NASTY, answer=NASTY.replace("alert", "steal"))
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return records


def names(fig: go.Figure) -> set[str]:
    return {t.name for t in fig.data}


def trace(fig: go.Figure, name: str):
    return next(t for t in fig.data if t.name == name)
