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
                "reward_components": {"answer": 0.2 + 0.05 * i, "short": 1.0 if i % 2 else None},
                "reward_errors": i % 3,
                "train_acc": 0.15 + 0.05 * i,
                "train_lenient_acc": 0.2 + 0.05 * i,
                "eval_acc": 0.25 + 0.0625 * i if evaluated else None,
                "eval_lenient_acc": 0.3 + 0.0625 * i if evaluated else None,
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


def make_run(run_dir: Path, n: int = 12, *, partial_last_line: bool = True) -> list[dict]:
    """A run directory as the loop writes it, caught mid-write: the last metrics line is half there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = synthetic_records(n)
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
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return records


def names(fig: go.Figure) -> set[str]:
    return {t.name for t in fig.data}


def trace(fig: go.Figure, name: str):
    return next(t for t in fig.data if t.name == name)
