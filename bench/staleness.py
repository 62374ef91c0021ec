"""Staleness study on the tiny profile: pipeline depth K and the off-policy correction, side by side.

    python bench/staleness.py [--ks 0 1 2 4] [--iterations 40] [--target 0.9] [--eval-every 4]

For each K in ``--ks`` (``max_staleness = K``, paced: K batches generated ahead, each trained K
versions after the adapter that sampled it) and each correction setting, one run of the same work
(same seeds and prompts) on one LocalCluster (one rollout worker, one trainer worker):

- ``ppo``: the PPO ratio against the engine's sampling log-probs (the kit's default), clipped;
- ``tis``: TRL's semantics, the trainer's own old log-probs, the sampling policy corrected by a
  token-level truncated importance weight (cap 2);
- ``mask``: the same with TRL's default sequence-level mask (cap 3).

K = 0 is sequential (on-policy: every correction is the identity there, so it runs once). Reports
per run the learning curve (held-out greedy accuracy every ``--eval-every`` iterations), the final
accuracy, the GRPO wall time to ``--target``, the policy-ratio spread, the clip fraction, the share
of tokens whose mismatch weight was capped, and rejected groups. The last line is JSON with keys
such as ``k0_final_acc``, ``k4_final_acc``, ``k4_tis_final_acc`` and ``k4_tis_time_to_target_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from grpo_kit import cluster, config, loop

CORRECTIONS = {
    "ppo": {"old_logp_source": "engine"},
    "tis": {"old_logp_source": "trainer", "importance_sampling_mode": "token_truncate", "importance_sampling_cap": 2.0},
    "mask": {"old_logp_source": "trainer", "importance_sampling_mode": "sequence_mask", "importance_sampling_cap": 3.0},
}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def one_run(client, k: int, correction: str, args, root: str) -> dict:
    cfg = config.profile(
        "tiny", iterations=args.iterations, eval_every=args.eval_every, max_staleness=k, pipelined=k > 0,
        run_dir=os.path.join(root, f"k{k}-{correction}"), seed=args.seed, **CORRECTIONS[correction],
    )
    res = loop.run(cfg, client=client, progress=False)
    # each evaluation at the record that produced the version it evaluated (not the later one it finished
    # in: how much later depends on K), so time and iterations to target are the version's
    producer: dict = {}
    for r in res.records:
        producer.setdefault(r["version"], r)
    curve = sorted((p["iteration"], p["grpo_wall_s"], r["eval_acc"]) for r in res.records if r.get("eval_acc") is not None
                   for p in [producer.get(r.get("eval_version"), r)])
    hit = next(((it, wall) for it, wall, acc in curve if acc >= args.target), None)
    recs = res.records
    return {
        "k": k,
        "correction": correction,
        "final_acc": res.summary["acc_after"],
        "acc_before": res.summary["acc_before"],
        "time_to_target_s": hit[1] if hit else None,
        "iterations_to_target": hit[0] + 1 if hit else None,
        "grpo_wall_s": res.summary["grpo_wall_s"],
        "ratio_std": _mean([r["ratio_std"] for r in recs]),
        "ratio_min": min((r["ratio_min"] for r in recs if r["ratio_min"] is not None), default=None),  # None: nothing trained
        "ratio_max": max((r["ratio_max"] for r in recs if r["ratio_max"] is not None), default=None),  # None: nothing trained
        "clip_frac": _mean([r["clip_frac"] for r in recs]),
        "is_capped_frac": _mean([r["is_capped_frac"] for r in recs]),
        "staleness_mean": _mean([r["staleness_mean"] for r in recs]),
        "staleness_max": max((r["staleness_max"] for r in recs), default=None),
        "rejected_groups": res.summary["rejected_groups"],
        "curve": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.9, help="held-out accuracy for the time-to-target figure")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    client = cluster.connect(n_rollout_workers=1, n_trainer_workers=1, quiet=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-staleness-") as root:
            for k in args.ks:
                for corr in (["ppo"] if k == 0 else args.corrections):
                    row = one_run(client, k, corr, args, root)
                    rows.append(row)
                    ttt = f"{row['time_to_target_s']:.1f} s" if row["time_to_target_s"] is not None else "not reached"
                    print(
                        f"K={k} {corr:5s} final acc {row['final_acc']:.3f} (from {row['acc_before']:.3f}); "
                        f"time to {args.target:.2f}: {ttt}; ratio std {row['ratio_std']:.2e} "
                        f"[{row['ratio_min']:.3f}, {row['ratio_max']:.3f}], clip {row['clip_frac']:.4f}, "
                        f"capped {row['is_capped_frac'] if row['is_capped_frac'] is not None else '-'}, "
                        f"rejected {row['rejected_groups']}; curve {[round(a, 3) for _, _, a in row['curve']]}",
                        flush=True,
                    )
    finally:
        cl = client.cluster
        client.close()
        cl.close()
    out = {"iterations": args.iterations, "target": args.target}
    for row in rows:
        name = f"k{row['k']}" + ("" if row["correction"] == "ppo" else f"_{row['correction']}")
        out[f"{name}_final_acc"] = row["final_acc"]
        out[f"{name}_time_to_target_s"] = row["time_to_target_s"]
        out[f"{name}_capped_frac"] = row["is_capped_frac"]
        out[f"{name}_clip_frac"] = row["clip_frac"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
