"""Pre-flight fabric check: an all-reduce sweep over message sizes across the trainer ranks.

Each rank is a task pinned to its own trainer worker (as the trainer gang's ranks are); they form a
process group (gloo on CPU, NCCL on GPU) at rank 0's host, all-reduce float32 tensors of each size,
and report, as nccl-tests does for all-reduce:

- ``algbw = bytes / t`` (t: the slowest rank's mean time per all-reduce)
- ``busbw = algbw * 2 (n - 1) / n`` (what each link carries in a ring; comparable across ``n``)

A floor on the peak bus bandwidth turns a slow fabric into a warning or an error before any
training starts. Standalone: ``python -m grpo_kit.preflight [--scheduler ADDRESS]`` (no address: a
LocalCluster with two trainer workers) prints one line per size, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from .config import parse_sizes  # noqa: F401 - where the CLI and the driver read it

log = logging.getLogger(__name__)

DEFAULT_SIZES = tuple(1024 * 4**i for i in range(10))
"""1 KiB, 4 KiB, ..., 256 MiB."""


class FabricTooSlow(RuntimeError):
    """The trainer ranks' all-reduce bus bandwidth is below the configured floor."""


class SweepFailed(RuntimeError):
    """A rank of the sweep failed, or its trainer worker left the cluster: the sweep stopped at
    once (its other ranks cancelled). A run re-forms its trainer gang and sweeps again
    (:func:`sweep_gang`), as it does after a failed training step."""


STUCK_GRACE_S = 5.0
"""After a rank failed, seconds the other ranks get to finish (a gloo peer that lost its partner
mid-collective fails at once) before their workers are restarted: one stuck in the rendezvous would
wait out the group's timeout and hold its worker's thread, so the next sweep would queue behind it."""


@dataclass
class PreflightResult:
    world_size: int
    """Ranks in the sweep (one trainer worker each)."""
    backend: str
    """``gloo`` or ``nccl``."""
    sizes: list[int]
    """Message sizes in bytes (float32 tensors of ``size // 4`` elements)."""
    time_s: list[float]
    """Mean seconds per all-reduce at each size (the slowest rank's)."""
    algbw_gbps: list[float]
    """Algorithm bandwidth, GB/s (1e9 bytes): ``size / time_s``."""
    busbw_gbps: list[float]
    """Bus bandwidth, GB/s: ``algbw * 2 (n - 1) / n``."""
    min_busbw_gbps: float = 0.0
    """The floor the peak bus bandwidth was held to (0: none)."""
    workers: list[str] = field(default_factory=list)
    """The trainer workers, in rank order."""

    @property
    def busbw_peak_gbps(self) -> float:
        return max(self.busbw_gbps, default=0.0)

    @property
    def ok(self) -> bool:
        return self.busbw_peak_gbps >= self.min_busbw_gbps

    def to_dict(self) -> dict:
        return {**asdict(self), "busbw_peak_gbps": self.busbw_peak_gbps, "ok": self.ok}

    def summary(self) -> dict:
        """What a run records (``summary["preflight"]``): sizes and bus bandwidths, rounded."""
        return {"world_size": self.world_size, "backend": self.backend, "sizes": self.sizes,
                "busbw_gbps": [round(b, 4) for b in self.busbw_gbps], "busbw_peak_gbps": round(self.busbw_peak_gbps, 4),
                "min_busbw_gbps": self.min_busbw_gbps, "ok": self.ok}

    def table(self) -> str:
        rows = [f"{'size':>12} {'time (us)':>12} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
        for s, t, a, b in zip(self.sizes, self.time_s, self.algbw_gbps, self.busbw_gbps, strict=True):
            rows.append(f"{s:>12} {t * 1e6:>12.1f} {a:>11.3f} {b:>11.3f}")
        return "\n".join(rows)


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus factor ``2 (n - 1) / n``.

    >>> bus_factor(2), bus_factor(8)
    (1.0, 1.75)
    """
    return 2 * (world_size - 1) / world_size


def iterations_for(size: int, budget_bytes: int = 256 << 20, lo: int = 3, hi: int = 50) -> int:
    """Timed all-reduces at ``size``: enough to move ``budget_bytes``, between ``lo`` and ``hi``.

    >>> iterations_for(1024), iterations_for(256 << 20)
    (50, 3)
    """
    return max(lo, min(hi, budget_bytes // max(1, size)))


def sweep_rank(rank: int, world_size: int, init_method: str, sizes: list[int], local_rank: int = 0,
               timeout_s: float = 120.0) -> list[float]:
    """One rank of the sweep (a Dask task on a trainer worker): forms its own process group, times
    the all-reduces, tears the group down. Returns the slowest rank's mean seconds per size."""
    from . import trainer

    trainer.teardown()  # a group left by an earlier gang in this process (the kit owns the default group)
    device = trainer.rank_device(local_rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist = torch.distributed
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    out = []
    try:
        for size in sizes:
            x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            n = iterations_for(size)
            dist.all_reduce(x)  # warm-up: buffers, connections; and a check that it sums
            if x[0].item() != world_size:
                raise RuntimeError(f"all-reduce of ones across {world_size} ranks gave {x[0].item()}")
            if backend == "nccl":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            if backend == "nccl":
                torch.cuda.synchronize()
            dt = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            out.append(float(dt.item()))
            del x
    finally:
        dist.destroy_process_group()
    return out


def run_preflight(client, workers: list[str] | None = None, sizes=DEFAULT_SIZES, *, min_busbw_gbps: float = 0.0,
                  on_slow: str = "warn", timeout_s: float = 300.0) -> PreflightResult:
    """The all-reduce sweep across ``workers`` (default: every worker advertising ``trainer=1``).

    Below ``min_busbw_gbps`` (peak bus bandwidth), ``on_slow="warn"`` warns and ``"error"`` raises
    :class:`FabricTooSlow`. Run it between runs, never while a run's gang holds a process group.
    A rank that fails, or a worker that leaves, stops the sweep at once with :class:`SweepFailed`
    (the other ranks cancelled, and their workers restarted if still stuck after
    :data:`STUCK_GRACE_S`); ``timeout_s`` (the process group's) plus a minute bounds the rest.
    """
    from distributed import wait

    from .cluster import TRAINER, workers_with
    from .gang import free_port, local_ranks, present, wait_first_error

    if on_slow not in ("warn", "error"):
        raise ValueError(f"on_slow must be 'warn' or 'error', got {on_slow!r}")
    workers = list(workers or workers_with(client, TRAINER))
    n, sizes = len(workers), [int(s) for s in sizes]
    if n < 2:
        raise ValueError(f"the sweep needs at least 2 trainer workers, found {n}")
    port = client.run(free_port, workers=[workers[0]])[workers[0]]
    host = workers[0].split("://")[-1].rsplit(":", 1)[0]
    init_method, local = f"tcp://{host}:{port}", local_ranks(workers)
    futures = [client.submit(sweep_rank, r, n, init_method, sizes, local[r], timeout_s, workers=[w],
                             allow_other_workers=False, pure=False, key=f"preflight-{port}-r{r}")
               for r, w in enumerate(workers)]
    done, error = wait_first_error(futures, timeout_s + 60, alive=lambda: present(client, workers))
    if isinstance(error, TimeoutError):
        client.cancel(futures)
        raise TimeoutError(f"the all-reduce sweep did not finish within {timeout_s + 60:.0f}s on {workers}")
    if error is not None:
        live = set(workers_with(client, TRAINER))
        running = [f for f, w in zip(futures, workers, strict=True) if f not in done and w in live]
        if running:
            try:
                with client.as_current():  # wait looks a client up: this one, default or not
                    wait(running, timeout=STUCK_GRACE_S)
            except TimeoutError:
                pass
        stuck = [w for f, w in zip(futures, workers, strict=True) if f in running and f.status == "pending"]
        client.cancel(futures)
        if stuck:  # in the rendezvous or a collective with a departed peer: their threads would stay busy
            log.warning("restarting trainer workers %s, stuck in the sweep after a rank failed", stuck)
            client.restart_workers(stuck, timeout=max(60.0, timeout_s), raise_for_error=False)
        raise SweepFailed(f"the all-reduce sweep on {workers} failed: {error!r}") from error
    times = client.gather(futures)[0]  # identical on every rank (all-reduced MAX)
    dev = client.run(lambda: torch.cuda.is_available(), workers=[workers[0]])[workers[0]]
    algbw = [s / t / 1e9 for s, t in zip(sizes, times, strict=True)]
    res = PreflightResult(world_size=n, backend="nccl" if dev else "gloo", sizes=sizes, time_s=times,
                          algbw_gbps=algbw, busbw_gbps=[a * bus_factor(n) for a in algbw],
                          min_busbw_gbps=min_busbw_gbps, workers=workers)
    if not res.ok:
        msg = (f"all-reduce bus bandwidth across {n} trainer ranks peaks at {res.busbw_peak_gbps:.3f} GB/s, below the "
               f"floor of {min_busbw_gbps} GB/s (ClusterConfig.preflight_min_busbw_gbps): check the fabric "
               f"(interfaces, NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME) before training")
        if on_slow == "error":
            raise FabricTooSlow(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return res


def sweep_gang(gang, sizes=DEFAULT_SIZES, *, min_busbw_gbps: float = 0.0, on_slow: str = "warn",
               timeout_s: float = 300.0) -> PreflightResult:
    """:func:`run_preflight` across a run's trainer gang (:class:`grpo_kit.gang.TrainerGang`). A lost
    rank (:class:`SweepFailed`) is recovered as a failed training step is
    (:meth:`~grpo_kit.gang.TrainerGang.recover`: counted in ``gang_restarts``, the gang re-formed,
    :class:`~grpo_kit.gang.GangFailed` past ``max_restarts``), and the sweep runs again on the new
    gang. A slow fabric (:class:`FabricTooSlow`) is not retried."""
    while True:
        try:
            return run_preflight(gang.client, gang.workers, sizes, min_busbw_gbps=min_busbw_gbps, on_slow=on_slow,
                                 timeout_s=timeout_s)
        except SweepFailed as e:
            gang.recover(e, "the pre-flight sweep")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m grpo_kit.preflight", description=__doc__.split("\n\n")[0])
    p.add_argument("--scheduler", help="Dask scheduler address (default: a LocalCluster with --world-size trainer workers)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: every trainer worker; local: 2)")
    p.add_argument("--sizes", default="1K:256M", help="message sizes: LO:HI in powers of 4, or a comma list (default 1K:256M)")
    p.add_argument("--min-busbw-gbps", type=float, default=0.0, help="floor on the peak bus bandwidth, GB/s")
    p.add_argument("--on-slow", choices=("warn", "error"), default="warn")
    p.add_argument("--tls-ca-file")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    a = p.parse_args(argv)
    from .cluster import TRAINER, connect, shutdown, wait_for_role

    security = None
    if a.tls_ca_file:
        from distributed import Security

        security = Security(tls_ca_file=a.tls_ca_file, tls_client_cert=a.tls_cert, tls_client_key=a.tls_key,
                            require_encryption=True)
    client = connect(a.scheduler, n_rollout_workers=0, n_trainer_workers=a.world_size or 2, security=security,
                     quiet=True)
    try:
        workers = wait_for_role(client, TRAINER, a.world_size or 2)
        workers = workers[: a.world_size] if a.world_size else workers
        res = run_preflight(client, workers, parse_sizes(a.sizes), min_busbw_gbps=a.min_busbw_gbps, on_slow=a.on_slow)
    finally:
        shutdown(client)
    print(res.table())
    d = res.to_dict()
    print(json.dumps({k: d[k] for k in ("world_size", "backend", "sizes", "time_s", "algbw_gbps", "busbw_gbps",
                                        "busbw_peak_gbps", "min_busbw_gbps", "ok")}))
    return d


if __name__ == "__main__":
    main()
