"""Soak: a long tiny-profile run, watching memory, disk and iteration time for growth.

    python bench/soak.py [--iterations 2000] [--warmup N] [--sample-every 10] [--engine vllm]

One LocalCluster (one rollout worker, one trainer worker), ``eval_every=0``. Every
``--sample-every`` iterations a loop callback samples the RSS of each role's process and its child
processes (the driver, the scheduler, each rollout and trainer worker; vLLM may run an engine core
in a child), the size of the run's temp directory (``TMPDIR`` points the whole cluster at a private
one: fetched adapters, anything vLLM or torch writes), the run directory (without the store) and the
adapter store. Every iteration's wall time is the step of the loop's ``grpo_wall_s``.

Figures (the last line is JSON):
- ``rss_slope_mb_per_100_it``: per role, the Theil-Sen slope (median of pairwise slopes, robust to
  a garbage-collection spike) of RSS against iteration after ``--warmup``          (goal <= 5)
- ``tmp_growth_mb``: temp directory at the end minus after warm-up                  (bounded)
- ``run_dir_mb``, ``store_mb``: at the end (bounded by the retention policy)
- ``iter_time_drift``: median wall time of the last 100 iterations / of the first 100 after warm-up,
  minus 1                                                                           (goal <= 5%)
- ``live_update_ms``: one ``LivePlots`` record update (in-place figure refresh) against the length
  of the history (the run's records repeated up to 10,000); ``live_update_ms_at_end`` is the
  10,000-point figure                                                               (goal <= 50 ms)
- ``report_mb``: the HTML report of the run (``grpo_kit.report.write_report``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROLES = ("driver", "scheduler", "rollout", "trainer")


def tree_rss_mb(children: bool = True) -> float:
    """RSS of this process and (``children``) all its descendants, MB (a ``client.run`` function)."""
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True) if children else ():
        try:
            total += child.memory_info().rss
        except psutil.Error:  # exited meanwhile
            pass
    return total / 2**20


def _pid_rss(children: bool) -> tuple[int, float]:
    return os.getpid(), tree_rss_mb(children)


def dir_mb(path: str) -> float:
    """Bytes under ``path`` (files only, links not followed), MB; 0 for a missing path."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:  # removed meanwhile (an evicted adapter, a temp file)
                pass
    return total / 2**20


def theil_sen(xs: list[float], ys: list[float]) -> float:
    """Median of the slopes between every pair of points (Theil-Sen): a line fit that a few
    outliers do not move.

    >>> theil_sen([0, 1, 2, 3, 4], [0, 2, 4, 100, 8])
    2.0
    """
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return statistics.median(slopes) if slopes else float("nan")


class Sampler:
    """A loop callback: every ``every`` iterations, RSS per role and directory sizes."""

    def __init__(self, client, run_dir: str, store_dir: str, tmp_dir: str, every: int, out: str | None = None):
        from grpo_kit import cluster

        self.client, self.every = client, every
        self.run_dir, self.store_dir, self.tmp_dir = run_dir, store_dir, tmp_dir
        self.roles = {w: cluster.ROLLOUT for w in cluster.workers_with(client, cluster.ROLLOUT)}
        self.roles.update({w: cluster.TRAINER for w in cluster.workers_with(client, cluster.TRAINER)})
        self.out = out  # every sample is appended here as it is taken (a long run can be read while it runs)
        self.samples: list[dict] = []
        self.walls: list[tuple[int, float]] = []

    def sample(self, iteration: int) -> dict:
        # the driver's children are the LocalCluster's workers, measured on their own below
        rss = {"driver": tree_rss_mb(children=False)}
        sched_pid, sched_mb = self.client.run_on_scheduler(_pid_rss, False)
        if sched_pid != os.getpid():  # a LocalCluster's scheduler lives in the driver's process
            rss["scheduler"] = sched_mb
        for addr, mb in self.client.run(tree_rss_mb, workers=list(self.roles)).items():
            role = self.roles[addr]
            rss[role] = rss.get(role, 0.0) + mb  # several workers of a role: their sum
        store = dir_mb(self.store_dir)
        s = {"iteration": iteration, "t": time.time(), "rss_mb": rss, "tmp_mb": dir_mb(self.tmp_dir),
             "run_dir_mb": dir_mb(self.run_dir) - store, "store_mb": store}
        self.samples.append(s)
        if self.out:
            with open(self.out, "a") as f:
                f.write(json.dumps({**s, "walls": self.walls[-self.every:]}) + "\n")
        return s

    def __call__(self, rec: dict) -> None:
        self.walls.append((rec["iteration"], rec["grpo_wall_s"]))
        if rec["iteration"] % self.every == 0:
            self.sample(rec["iteration"])


def iteration_times(walls: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(iteration, seconds) from consecutive ``grpo_wall_s`` values."""
    return [(it, w - w0) for (_, w0), (it, w) in zip(walls, walls[1:], strict=False)]


def live_update_ms(records: list[dict], lengths: list[int], repeats: int = 5) -> dict[int, float]:
    """Median ms of one ``LivePlots`` record update at each history length (the run's records
    repeated, iterations and times shifted, to reach lengths beyond the run)."""
    from grpo_kit.widgets import LivePlots

    span = records[-1]["iteration"] + 1
    dt = records[-1]["t_iter_end"] - records[0]["t_iter_start"]

    def synth(n: int) -> list[dict]:
        out = []
        for k in range(n):
            src = records[k % len(records)]
            rep = k // len(records)
            shift = rep * dt
            r = dict(src, iteration=src["iteration"] + rep * span)
            r["spans"] = [dict(s, iteration=r["iteration"], start=s["start"] + shift, end=s["end"] + shift)
                          for s in src.get("spans", [])]
            out.append(r)
        return out

    out = {}
    for n in lengths:
        hist = synth(n + repeats)
        live = LivePlots(hist[:n], live=True)
        times = []
        for r in hist[n:]:
            t0 = time.perf_counter()
            live(r)
            times.append((time.perf_counter() - t0) * 1e3)
        out[n] = statistics.median(times)
    return out


def summarize(sampler: Sampler, warmup: int, live_ms: dict[int, float], report_mb: float | None) -> dict:
    after = [s for s in sampler.samples if s["iteration"] >= warmup]
    slopes = {}
    for role in ROLES:
        pts = [(s["iteration"], s["rss_mb"][role]) for s in after if role in s["rss_mb"]]
        if len(pts) >= 2:
            slopes[role] = round(100 * theil_sen([p[0] for p in pts], [p[1] for p in pts]), 2)
    times = [t for it, t in iteration_times(sampler.walls) if it >= warmup]
    first, last = times[:100], times[-100:]
    first_s, end_s = (after[0], after[-1]) if after else (sampler.samples[0], sampler.samples[-1])
    return {
        "iterations": sampler.walls[-1][0] + 1 if sampler.walls else 0,
        "warmup": warmup,
        "rss_slope_mb_per_100_it": slopes,
        "rss_mb_after_warmup": {k: round(v) for k, v in first_s["rss_mb"].items()},
        "rss_mb_at_end": {k: round(v) for k, v in end_s["rss_mb"].items()},
        "tmp_growth_mb": round(end_s["tmp_mb"] - first_s["tmp_mb"], 2),
        "tmp_mb": round(end_s["tmp_mb"], 2),
        "run_dir_mb": round(end_s["run_dir_mb"], 2),
        "store_mb": round(end_s["store_mb"], 2),
        "iter_s_first_100": round(statistics.median(first), 4) if first else None,
        "iter_s_last_100": round(statistics.median(last), 4) if last else None,
        "iter_time_drift": round(statistics.median(last) / statistics.median(first) - 1, 4) if first else None,
        "live_update_ms": {str(k): round(v, 1) for k, v in live_ms.items()},
        "live_update_ms_at_end": round(live_ms[max(live_ms)], 1) if live_ms else None,
        "report_mb": None if report_mb is None else round(report_mb, 2),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=None, help="iterations not fitted (default: 10%%, at least 50)")
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--live-points", type=int, nargs="*", default=[1000, 2000, 5000, 10000])
    ap.add_argument("--root", default=None, help="where the run and its temp directory go (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    ap.add_argument("--samples-out", default=None, help="append every sample as a JSON line here as it is taken")
    ap.add_argument("overrides", nargs="*", help="config overrides, FIELD=VALUE (config.parse_overrides: a Python "
                    "literal or a bare string; e.g. keep_versions=20 engine=hf); they win over this script's own")
    args = ap.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else max(50, args.iterations // 10)

    root = args.root or tempfile.mkdtemp(prefix="grpo-soak-")
    tmp_dir = os.path.join(root, "tmp")
    os.makedirs(tmp_dir, exist_ok=True)
    # before anything asks for a temp dir: the workers inherit it, and this process uses it too
    os.environ["TMPDIR"] = tempfile.tempdir = tmp_dir

    from grpo_kit import cluster, config, loop, report

    cfg = config.profile("tiny", **{"engine": args.engine, "iterations": args.iterations, "eval_every": 0,
                                    "run_dir": os.path.join(root, "run"), **config.parse_overrides(args.overrides)})
    client = cluster.connect(n_rollout_workers=1, n_trainer_workers=1, quiet=True)
    try:
        holder: dict = {}

        def first(rec):  # the sampler needs the workers, which exist once the loop runs
            if "s" not in holder:
                holder["s"] = Sampler(client, cfg.run.run_dir, cfg.run.store_root, tmp_dir, args.sample_every,
                                      args.samples_out)
            holder["s"](rec)

        t0 = time.time()
        res = loop.run(cfg, client=client, callbacks=[first], progress=False)
        wall = time.time() - t0
        sampler = holder["s"]
        sampler.sample(args.iterations - 1)
    finally:
        cluster.shutdown(client)
    report_path = report.write_report(cfg.run.run_dir)
    report_mb = os.path.getsize(report_path) / 2**20
    live_ms = live_update_ms(res.records, args.live_points)
    out = summarize(sampler, warmup, live_ms, report_mb)
    out["wall_s"] = round(wall, 1)
    out["load_avg"] = os.getloadavg()
    if not args.keep:
        subprocess.run(["rm", "-rf", root], check=False)
    for s in sampler.samples[:: max(1, len(sampler.samples) // 20)]:
        print(s["iteration"], {k: round(v) for k, v in s["rss_mb"].items()}, f"tmp {s['tmp_mb']:.1f}",
              f"run {s['run_dir_mb']:.1f}", f"store {s['store_mb']:.1f}", file=sys.stderr)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
