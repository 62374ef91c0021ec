"""GRPO on a real pretrained chat model: SmolLM2-135M-Instruct, the ``smol`` profile, on a LocalCluster.

    python bench/real_model.py [--iterations N] [--budget-s S] [--run-dir DIR] [name=value ...]

Runs the pipelined loop with the ``smol`` profile (2-digit sums in chat form, scored strictly as
``#### <n>`` and leniently by the last number) and reports held-out greedy accuracy on the fixed
held-out questions before and after, strict and lenient, with the learning curve. ``--budget-s``
stops the run at the first iteration boundary past that much GRPO wall time (checked from the
metrics callback); overrides such as ``lr=5e-5`` go to the profile. Ends with one JSON line, also
written to ``<run_dir>/summary.json`` beside the run's metrics.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from grpo_kit import config, loop, records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=None, help="iterations (default: the profile's)")
    ap.add_argument("--budget-s", type=float, default=1200.0, help="stop after this much GRPO wall time")
    ap.add_argument("--run-dir", default="runs/real_model")
    ap.add_argument("overrides", nargs="*", help="profile overrides, name=value")
    args = ap.parse_args()

    over = config.parse_overrides(args.overrides)
    if args.iterations is not None:
        over["iterations"] = args.iterations
    cfg = config.profile("smol", run_dir=args.run_dir, **over)
    shutil.rmtree(args.run_dir, ignore_errors=True)

    t0 = time.time()
    curve = []

    def on_record(rec: dict) -> None:
        if rec.get("eval_acc") is not None:
            curve.append((rec["iteration"], rec["grpo_wall_s"], rec["eval_acc"], rec.get("eval_lenient_acc")))
            print(f"  iteration {rec['iteration']:3d}  wall {rec['grpo_wall_s']:6.0f} s  held-out strict "
                  f"{rec['eval_acc']:.3f}  lenient {rec.get('eval_lenient_acc') or 0:.3f}", flush=True)
        if rec["grpo_wall_s"] > args.budget_s:
            raise BudgetSpent(rec["iteration"])

    try:
        result = loop.run(cfg, callbacks=[on_record])
        summary = result.summary
    except BudgetSpent as stop:
        # the budget ends the run at an iteration boundary; resume evaluates the last adapter
        print(f"budget of {args.budget_s:.0f} s spent after iteration {stop.iteration}; final evaluation", flush=True)
        summary = loop.run(cfg.override(iterations=stop.iteration + 1), resume=True).summary

    out = {
        "model": cfg.model.model,
        "profile": cfg.profile,
        "strict_acc_before": summary["acc_before"],
        "strict_acc_after": summary["acc_after"],
        "lenient_acc_before": summary["lenient_acc_before"],
        "lenient_acc_after": summary["lenient_acc_after"],
        "grpo_wall_s": summary["grpo_wall_s"],
        "iterations": summary["iterations"],
        "eval_size": cfg.data.eval_size,
        "curve": curve,
        "total_s": time.time() - t0,
    }
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    records.run_files(args.run_dir).summary.write_text(json.dumps({**summary, **out}, indent=1))
    print(json.dumps(out), flush=True)


class BudgetSpent(Exception):
    def __init__(self, iteration: int):
        super().__init__(f"budget spent after iteration {iteration}")
        self.iteration = iteration


if __name__ == "__main__":
    sys.exit(main())
