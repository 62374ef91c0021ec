"""The built-in objectives side by side: policy losses and advantage estimators, same prompts and seeds.

    python bench/algorithms.py [--profiles tiny smol] [--algorithms grpo gspo cispo rloo reinforce_pp dr_grpo]
                               [--iterations N] [--eval-every K] [--target 0.9] [--engine hf] [--max-parallel P]
                               [--set field=value ...] [--out-dir DIR]

One run per algorithm and profile, each a Dask task of :func:`grpo_kit.sweep.sweep_runs` (a
``loop.run`` in a child interpreter with its own LocalCluster); every run of a profile has the same
seed, so the same prompts in the same order and the same LoRA init. An algorithm is a policy loss
and an advantage estimator (:data:`ALGORITHMS`): ``grpo`` is the kit's default (clipped token ratio,
group-std advantages); ``gspo`` and ``cispo`` change the loss, ``rloo``, ``reinforce_pp`` and
``dr_grpo`` the advantages. Each profile's own hyperparameters apply (``--set`` overrides any).

Reports per run the held-out accuracy curve, the final held-out accuracy, the GRPO wall time until
held-out accuracy first reached ``--target`` (the loop's own clock: engine start-up excluded), and
means over the iterations of the ratio's spread (``ratio_std``), the clip fraction and the
engine/trainer mismatch KL. The last line is JSON with keys such as ``tiny_gspo_final_acc``,
``tiny_gspo_time_to_target_s`` (null, and ``tiny_gspo_time_to_target_why`` says why, when the target
was not reached), ``tiny_gspo_ratio_std``, ``tiny_gspo_clip_frac``, ``tiny_gspo_mismatch_kl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from grpo_kit import algorithms, config, records, sweep

ALGORITHMS = algorithms.PRESETS
"""Algorithm name -> config overrides (``grpo_kit.algorithms.PRESETS``)."""


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and x is not None]
    return statistics.fmean(xs) if xs else None


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def row_of(profile: str, algorithm: str, result: dict, target: float) -> dict:
    """One run's numbers (see the module docstring)."""
    recs, summary = result["records"], result["summary"]
    if result["error"]:
        return {
            "profile": profile,
            "algorithm": algorithm,
            "error": result["error"],
            "final_acc": None,
            "time_to_target_s": None,
            "why": f"the run failed: {result['error']}",
            "curve": [],
        }
    hit = sweep.time_to(recs, target)
    curve = sweep.accuracy_curve(recs, summary.get("acc_before"))
    best = max((a for _, a in curve[1:]), default=None)
    why = (
        None
        if hit is not None
        else (
            f"not reached in {summary['iterations']} iterations (best {best:.3f} of {len(curve) - 1} evaluations)"
            if best is not None
            else "no evaluation after training"
        )
    )
    return {
        "profile": profile,
        "algorithm": algorithm,
        "error": None,
        "final_acc": summary["acc_after"],
        "acc_before": summary["acc_before"],
        "time_to_target_s": hit,
        "why": why,
        "grpo_wall_s": summary["grpo_wall_s"],
        "iterations": summary["iterations"],
        "ratio_std": _mean([r.get("ratio_std") for r in recs]),
        "clip_frac": _mean([r.get("clip_frac") for r in recs]),
        "mismatch_kl": _mean([r.get("mismatch_kl") for r in recs]),
        "wrong_policy_iterations": sum(bool(r.get("wrong_policy")) for r in recs),
        "curve": curve,
    }


def finished(run_dir: str) -> dict:
    """A run directory read back as :func:`grpo_kit.sweep.sweep_runs` reports it (``--report-only``)."""
    run = records.load_run(run_dir)
    error = None if run["summary"] else f"no summary.json in {run_dir} (not run, or cut short)"
    return {"records": run["records"], "summary": run["summary"], "error": error, "wall_s": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=["tiny", "smol"], choices=["tiny", "smol"])
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--iterations", type=int, default=None, help="iterations per run (default: the profile's)")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out evaluation every k iterations")
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="held-out accuracy for the time-to-target figure (default: 0.9 tiny, 0.5 smol)",
    )
    ap.add_argument("--engine", default=None, choices=["hf", "vllm"], help="rollout engine (default: the profile's)")
    ap.add_argument("--max-parallel", type=int, default=None, help="runs at once (default: one per two cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None, help="keep the run directories here (default: a temporary one)")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the runs already in --out-dir (a study cut short: the runs that finished)",
    )
    ap.add_argument(
        "--own-clusters",
        action="store_true",
        help="a LocalCluster per run, --max-parallel at a time (default: the runs one after another on "
        "one cluster started once; GRPO wall time excludes start-up either way)",
    )
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="config overrides for every run (a Python literal, or a bare string)",
    )
    args = ap.parse_args()

    base = {"seed": args.seed}
    for name, value in (("iterations", args.iterations), ("eval_every", args.eval_every), ("engine", args.engine)):
        if value is not None:
            base[name] = value
    base.update(config.parse_overrides(args.set))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as tmp:
        root = args.out_dir or tmp
        for profile in args.profiles:
            target = args.target if args.target is not None else {"tiny": 0.9, "smol": 0.5}[profile]
            runs = {a: ALGORITHMS[a] for a in args.algorithms}
            if args.report_only:
                if not args.out_dir:
                    ap.error("--report-only reads --out-dir")
                results = [finished(f"{root}/{profile}/{a}") for a in args.algorithms]
            else:
                results = sweep.sweep_runs(
                    runs,
                    profile,
                    base,
                    f"{root}/{profile}",
                    max_parallel=args.max_parallel,
                    raise_errors=False,
                    shared_cluster=not args.own_clusters,
                )
            for algorithm, res in zip(args.algorithms, results, strict=True):
                row = {**row_of(profile, algorithm, res, target), "target": target}
                rows.append(row)
                if row["error"]:
                    print(f"{profile} {algorithm}: FAILED {row['error']}", flush=True)
                    continue
                ttt = f"{row['time_to_target_s']:.1f} s" if row["time_to_target_s"] is not None else row["why"]
                print(
                    f"{profile} {algorithm:12s} final acc {_fmt(row['final_acc'], '.3f')} (from "
                    f"{_fmt(row['acc_before'], '.3f')}); time to {target:.2f}: {ttt}; GRPO {row['grpo_wall_s']:.1f} s "
                    f"(task {_fmt(res['wall_s'], '.0f')} s); ratio std {_fmt(row['ratio_std'], '.2e')}, clip "
                    f"{_fmt(row['clip_frac'], '.4f')}, mismatch KL {_fmt(row['mismatch_kl'], '.2e')}, "
                    f"wrong-policy iterations {row['wrong_policy_iterations']}; "
                    f"curve {[(round(t, 1), round(a, 3)) for t, a in row['curve']]}",
                    flush=True,
                )
    out = {"iterations": args.iterations, "seed": args.seed}
    for row in rows:
        key = f"{row['profile']}_{row['algorithm']}"
        out[f"{row['profile']}_target"] = row["target"]
        out[f"{key}_iterations"] = row.get("iterations")
        out[f"{key}_final_acc"] = row["final_acc"]
        out[f"{key}_time_to_target_s"] = row["time_to_target_s"]
        if row["time_to_target_s"] is None:
            out[f"{key}_time_to_target_why"] = row["why"]
        for k in ("ratio_std", "clip_frac", "mismatch_kl"):
            out[f"{key}_{k}"] = row.get(k)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
