"""Pipelined against sequential GRPO on the tiny profile, side by side in one run.

    python bench/pipelining.py [--iterations 12] [--warmup 2] [--prompts-per-step 16] [--group-size 6]

One LocalCluster with one rollout worker and one trainer worker, each pinned to its own core
(on 2 cores: one each, one thread each, in both modes), as a GPU cluster gives them disjoint GPUs,
so the overlap measures scheduling rather than two jobs sharing cores. The same work (same seeds,
same prompts) runs sequentially and then pipelined; the first ``--warmup`` iterations of each are
not measured (engine start, model load).

Figures (means over the measured iterations):
- P1 = pipelined iteration time / max(generation, training)             (target <= 1.05)
- P2 = (sequential / pipelined) / ((generation + training) / max(...))   (target >= 90%)
- P3 = share of the pipelined iteration outside generation and training compute:
       dispatch, publish, fetch, serialization                           (target <= 3%)
- gang overhead = (driver-measured training step - rank compute - publish) / rank compute: the warm
  gang's per-step cost of dispatch, batch transfer, state check and stats return (target <= 10%)
- p1_lockstep_floor = mean over iterations of max(generation of batch i+1, training of batch i),
  the pair that runs side by side, over max(generation, training): P1's floor when the two sides
  are balanced and jitter; fixed_cost_share = the pipelined iteration beyond that mean, as a share
  of it (what dispatch, publish and the driver's own work cost)
- trainer_idle_s, rollout_idle_s = pipelined medians of the trainer's idle time from one step's end
  to the next one's start, and of the rollout worker's between batches (from the records' spans)
- the pipelined figures above are the default's, where each training step is submitted with its
  batch's generation (``RunConfig.train_ahead=True``); the same figures with each step submitted in
  its turn, after the driver has read the batch's summaries (``train_ahead=False``), end in
  ``_in_turn``. With ``--repeats R`` the two pipelined runs alternate R times (ahead first, then in
  turn first, ...). P1, P2, P3, the lockstep floor, the fixed-cost share and the gang's share are
  each run's own (its iteration over its own generation and training), then the median over
  repeats (``*_runs`` lists every run's P1 and P3); the seconds printed are per-quantity medians.
  (Until 2026-12-03 the ratios were taken of those per-quantity medians, which mixes runs: where
  generation and training take turns being the longer side, that inflates P1 and P3, e.g. runs of
  P1 1.036, 1.037 and 1.038 gave 1.077.) The load average before and after is printed.
- driver_payload_bytes = token payload through the driver per iteration: the pickled size of every
  list of numbers held in a record (token ids, log-probs in a rollout dict or a trainer sample) in
  what the driver gathers from workers, scatters to them, or puts in a task's arguments, summed over both modes' iterations and divided by their number.
  The client's methods are wrapped to keep references; sizes are taken after the runs, off the clock.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time

from grpo_kit import cluster, config, loop


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


class PayloadCounter:
    """Keeps what passes through the client's ``gather``, ``scatter`` and ``submit`` (references only,
    so the runs are not slowed down); :meth:`token_bytes` sizes the numeric lists in it afterwards."""

    def __init__(self, client):
        self.seen: list = []
        for name in ("gather", "scatter", "submit"):
            setattr(client, name, self._wrap(getattr(client, name), name == "gather"))

    def _wrap(self, fn, returns_data: bool):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.seen.append(out if returns_data else (args, kwargs))
            return out

        return wrapped

    def token_bytes(self) -> int:
        return sum(_numeric_list_bytes(x) for x in self.seen)


def _numeric_list_bytes(x, in_record: bool = False) -> int:
    """Pickled bytes of the non-empty lists of numbers held as fields of records (dict values, tuple
    items): token ids and log-probs, in a rollout dict or a trainer sample."""
    if in_record and isinstance(x, list) and x and all(type(v) in (int, float) for v in x):
        return len(pickle.dumps(x, protocol=5))
    if isinstance(x, dict):
        return sum(_numeric_list_bytes(v, True) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_numeric_list_bytes(v, isinstance(x, tuple)) for v in x)
    return 0


def measure(client, mode: str, args, root: str, train_ahead: bool = True, tag: str = "") -> dict:
    cfg = config.profile(
        "tiny",
        engine=args.engine,
        iterations=args.warmup + args.iterations,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        pipelined=mode == "pipelined",
        train_ahead=train_ahead,
        eval_every=0,
        run_dir=os.path.join(root, f"{mode}{tag}"),
        seed=args.seed,
    )
    res = loop.run(cfg, client=client, progress=False)
    recs = res.records[args.warmup :]
    gen = _mean([r["gen_s"] for r in recs])
    train = _mean([r["train_compute_s"] for r in recs])
    step = _mean([r["train_s"] for r in recs])
    # wall time per iteration: start to start across the measured block, so everything on the
    # driver's critical path (dispatch, records, checkpoint writes) is in it
    wall = (recs[-1]["t_iter_start"] - recs[0]["t_iter_start"]) / (len(recs) - 1)
    return {"mode": mode, "iter_s": wall, "gen_s": gen, "train_compute_s": train, "train_step_s": step,
            "publish_s": _mean([r["publish_s"] + r["checkpoint_s"] for r in recs]),
            "reward_mean": _mean([r["reward_mean"] for r in recs]), "pair_max_s": lockstep_floor(recs), **idle_gaps(recs)}


def lockstep_floor(recs: list[dict]) -> float:
    """Mean over iterations of max(generation of batch i+1, training of batch i): the two that run
    side by side in a pipelined iteration (batch i+2 needs the version batch i's step publishes, so
    the pair moves in lockstep). The iteration cannot beat it whatever the fixed costs; above
    max(mean generation, mean training) when the two sides are balanced and each jitters."""
    pairs = [max(b["gen_s"], a["train_compute_s"]) for a, b in zip(recs, recs[1:], strict=False)]
    return _mean(pairs) if pairs else float("nan")


def _median_run(runs: list[dict]) -> dict:
    """Per-quantity medians over repeated runs of one mode (seconds to print; ratios are per run: :func:`run_figures`)."""
    return {k: (statistics.median(r[k] for r in runs) if isinstance(v, float) else v) for k, v in runs[0].items()}


def run_figures(run: dict, seq: dict) -> dict:
    """One pipelined run's P1, P2, P3, lockstep floor, fixed-cost share and gang share, from its own
    iteration, generation and training (``seq``: the sequential run, for P2's ideal)."""
    longest = max(run["gen_s"], run["train_compute_s"])
    ideal = (seq["gen_s"] + seq["train_compute_s"]) / max(seq["gen_s"], seq["train_compute_s"])
    return {"p1": run["iter_s"] / longest, "p2": (seq["iter_s"] / run["iter_s"]) / ideal,
            "p3": max(0.0, run["iter_s"] - longest) / run["iter_s"], "floor": run["pair_max_s"] / longest,
            "fixed": max(0.0, run["iter_s"] - run["pair_max_s"]) / run["iter_s"],
            "gang": (run["train_step_s"] - run["train_compute_s"] - run["publish_s"]) / run["train_compute_s"]}


def median_figures(runs: list[dict], seq: dict) -> dict:
    """The median over ``runs`` of each of :func:`run_figures`, and each run's P1 and P3 (``p1_runs``, ``p3_runs``).

    >>> seq = {"gen_s": 1.0, "train_compute_s": 1.0, "iter_s": 2.0}
    >>> runs = [{"gen_s": g, "train_compute_s": t, "iter_s": i, "pair_max_s": i, "train_step_s": t, "publish_s": 0.0}
    ...         for g, t, i in ((1.0, 0.9, 1.036), (0.9, 1.0, 1.037), (0.95, 0.95, 0.986))]
    >>> {k: round(v, 3) for k, v in median_figures(runs, seq).items() if k in ("p1", "p3")}  # mixed: 1.036 / 0.95 = 1.09
    {'p1': 1.037, 'p3': 0.036}
    """
    each = [run_figures(r, seq) for r in runs]
    return {**{k: statistics.median(f[k] for f in each) for k in each[0]},
            "p1_runs": [f["p1"] for f in each], "p3_runs": [f["p3"] for f in each]}


def idle_gaps(recs: list[dict]) -> dict:
    """Medians over consecutive iterations of the time the trainer (rank 0) sat idle between one
    step's end (its publish) and the next step's start, and the rollout worker between one batch's
    last chunk and the next batch's first, from the records' spans: the fixed costs in the iteration
    (dispatch round trips, the driver's own work) and, on the side that is not the bottleneck, waiting."""
    def span(r, name, pick, key):
        return pick(s[key] for s in r["spans"] if s["name"] == name)

    trainer = [span(b, "train", min, "start") - span(a, "publish", max, "end") for a, b in zip(recs, recs[1:], strict=False)]
    rollout = [span(b, "generate", min, "start") - span(a, "generate", max, "end") for a, b in zip(recs, recs[1:], strict=False)]
    return {"trainer_idle_s": statistics.median(trainer) if trainer else float("nan"),
            "rollout_idle_s": statistics.median(rollout) if rollout else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=12, help="measured iterations per mode")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured iterations per mode")
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="alternated pairs of pipelined runs (ahead / in turn)")
    args = ap.parse_args()

    client = cluster.connect(n_rollout_workers=1, n_trainer_workers=1, threads_per_worker=1, pin_cpus=True, quiet=True)
    try:
        affinity = client.run(lambda: sorted(os.sched_getaffinity(0)))
        roles = {a: r for r in (cluster.ROLLOUT, cluster.TRAINER) for a in cluster.workers_with(client, r)}
        print("CPU allocation (pinned, one thread each):")
        for addr, cpus in sorted(affinity.items()):
            print(f"  {roles.get(addr, '?'):8s} {addr}: cpus {cpus}")
        counter = PayloadCounter(client)
        with tempfile.TemporaryDirectory(prefix="grpo-bench-") as root:
            t0, load0 = time.time(), os.getloadavg()
            seq = measure(client, "sequential", args, root)
            runs = {True: [], False: []}
            for rep in range(args.repeats):
                for ahead in (True, False) if rep % 2 == 0 else (False, True):
                    runs[ahead].append(measure(client, "pipelined", args, root, train_ahead=ahead, tag=f"-{ahead}-{rep}"))
            pipe, turn = (_median_run(runs[a]) for a in (True, False))  # the default: ahead
            elapsed, load1 = time.time() - t0, os.getloadavg()
        # the sequential run and 2 x repeats pipelined runs, each of warmup + iterations
        payload = counter.token_bytes() / ((1 + 2 * args.repeats) * (args.warmup + args.iterations))
    finally:
        cluster.shutdown(client)

    # generation and training compute per iteration (medians, to print); the ratios are each run's own
    gen, train = pipe["gen_s"], pipe["train_compute_s"]
    ideal = (seq["gen_s"] + seq["train_compute_s"]) / max(seq["gen_s"], seq["train_compute_s"])
    fig, fig_turn = median_figures(runs[True], seq), median_figures(runs[False], seq)
    p1, p2, p3 = fig["p1"], fig["p2"], fig["p3"]
    # the gang's own cost per step: dispatch, scatter, state check, stats return (publish is in P3)
    gang = fig["gang"]
    print(f"\nbatch: {args.prompts_per_step} prompts x {args.group_size} completions, engine {args.engine}; "
          f"{args.iterations} measured + {args.warmup} warm-up iterations per mode ({elapsed:.0f}s in all)")
    print(f"{'mode':12s} {'iter_s':>8s} {'gen_s':>8s} {'train_s':>8s} {'step_s':>8s} {'publish_s':>9s}")
    for m in (seq, pipe):
        print(f"{m['mode']:12s} {m['iter_s']:8.3f} {m['gen_s']:8.3f} {m['train_compute_s']:8.3f} "
              f"{m['train_step_s']:8.3f} {m['publish_s']:9.3f}")
    print(f"gen/train balance: {gen / train:.2f}; ideal speedup (gen+train)/max = {ideal:.3f}; "
          f"measured speedup = {seq['iter_s'] / pipe['iter_s']:.3f}")
    print(f"P1 pipelined / max(gen, train)      = {p1:.3f}  (target <= 1.05)")
    print(f"P2 speedup as share of the ideal    = {p2:.1%}  (target >= 90%)")
    print(f"P3 overhead share of the iteration  = {p3:.1%}  (target <= 3%)")
    floor, fixed = fig["floor"], fig["fixed"]
    print(f"lockstep floor of P1                = {floor:.3f}  (mean of max(gen of batch i+1, training of batch i) / "
          f"max of the means: what jitter alone costs); the iteration beyond it: {fixed:.1%} (the fixed costs)")
    print(f"gang per-step overhead over compute = {gang:.1%}  (target <= 10%)")
    print(f"token payload through the driver    = {payload:,.0f} bytes per iteration")
    print(f"pipelined, medians between iterations: trainer idle {pipe['trainer_idle_s'] * 1e3:.1f} ms from one step's "
          f"end to the next's start, rollout worker idle {pipe['rollout_idle_s'] * 1e3:.1f} ms between batches")
    p1_turn, p3_turn = fig_turn["p1"], fig_turn["p3"]
    print(f"each run's P1 (ahead) {', '.join(f'{x:.3f}' for x in fig['p1_runs'])}; P3 "
          f"{', '.join(f'{x:.1%}' for x in fig['p3_runs'])}")
    print(f"steps submitted ahead (train_ahead=True, default): iteration {pipe['iter_s']:.3f} s, P1 {p1:.3f}, "
          f"P3 {p3:.1%}, trainer idle {pipe['trainer_idle_s'] * 1e3:.1f} ms; in their turn (train_ahead=False): "
          f"iteration {turn['iter_s']:.3f} s, P1 {p1_turn:.3f}, P3 {p3_turn:.1%}, trainer idle "
          f"{turn['trainer_idle_s'] * 1e3:.1f} ms (medians over {args.repeats} alternated pair(s))")
    print(f"load average (1 min) before {load0[0]:.2f}, after {load1[0]:.2f}")
    print(json.dumps({
        "sequential_iter_s": round(seq["iter_s"], 4),
        "pipelined_iter_s": round(pipe["iter_s"], 4),
        "gen_s": round(gen, 4),
        "train_s": round(train, 4),
        "p1_efficiency": round(p1, 4),
        "p2_share_of_ideal": round(p2, 4),
        "p3_overhead_share": round(p3, 4),
        "p1_runs": [round(x, 4) for x in fig["p1_runs"]],
        "p3_runs": [round(x, 4) for x in fig["p3_runs"]],
        "gang_overhead_share": round(gang, 4),
        "driver_payload_bytes": round(payload),
        "p1_lockstep_floor": round(floor, 4),
        "fixed_cost_share": round(fixed, 4),
        "trainer_idle_s": round(pipe["trainer_idle_s"], 4),
        "rollout_idle_s": round(pipe["rollout_idle_s"], 4),
        "pipelined_in_turn_iter_s": round(turn["iter_s"], 4),
        "p1_efficiency_in_turn": round(p1_turn, 4),
        "p3_overhead_share_in_turn": round(p3_turn, 4),
        "trainer_idle_s_in_turn": round(turn["trainer_idle_s"], 4),
        "repeats": args.repeats,
        "load_average": [round(load0[0], 2), round(load1[0], 2)],
    }))


if __name__ == "__main__":
    main()
