"""Dask dispatch: the cluster and its worker roles.

Roles are Dask worker *resources*: a worker advertising ``rollout=1`` hosts a warm engine, one
advertising ``trainer=1`` hosts a trainer rank (``reward=1``: a scoring worker; ``eval=1``: an
evaluation worker with its own engine). :func:`connect` starts a
``LocalCluster`` whose workers carry those resources (non-daemonic processes, so a vLLM engine or a
process group can live inside them), or connects to an existing scheduler whose workers were started
with ``--resources rollout=1`` / ``--resources trainer=1`` (dask-jobqueue: ``worker_extra_args``;
dask-kubernetes: the worker command's args). :class:`ThreadsPlugin` sets every worker up (threads,
CPU affinity, malloc, no task profiler); :func:`workers_with` and :func:`wait_for_role` find the roles;
:func:`shutdown` closes a client and its cluster.

What runs on the workers is elsewhere: the worker-resident rollout engine and the rollout, reward,
summary and eval tasks in :mod:`grpo_kit.remote`; the gang-scheduled trainer in :mod:`grpo_kit.gang`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import warnings

import dask
from distributed import Client, Nanny, WorkerPlugin

log = logging.getLogger(__name__)

ENGINE_PLUGIN = "grpo-kit-engine"
THREADS_PLUGIN = "grpo-kit-threads"
ROLLOUT, TRAINER, REWARD, EVAL = "rollout", "trainer", "reward", "eval"


# ----------------------------------------------------------------------------- the cluster

WORKER_PRELOAD = ("torch", "transformers", "peft", "vllm", "grpo_kit.remote", "grpo_kit.vllm_engine",
                  "grpo_kit.train_step")
"""What the workers of a :func:`connect` ``LocalCluster`` have imported before they start
(``worker_start="forkserver"``): imported once, in the forkserver process the workers are forked
from, instead of in every worker (vLLM alone takes about 15 s to import on 2 cores). Modules that
are not installed are skipped."""

WORKER_STARTS = ("forkserver", "spawn")
"""How :func:`connect` starts its local workers (Dask's ``distributed.worker.multiprocessing-method``)."""


def use_worker_start(method: str, preload: tuple[str, ...] = WORKER_PRELOAD) -> str:
    """Make Dask start this process's local worker processes with ``method`` and return the method used.

    ``"forkserver"``: one server process imports ``distributed`` and ``preload`` once, and every
    worker (and every worker a nanny restarts after a crash) is forked from it, so it starts with
    those modules imported: measured on 2 cores, a cluster of three workers was up with vLLM imported
    in 25 s the first time and 0.8 s after, against 44 s each time with ``"spawn"``. The server is
    started by the first worker and lives as long as this process; it holds the working directory,
    ``sys.path`` and environment of that moment (:func:`connect` hands each worker this process's
    environment as it is when the worker is specified, so later changes still reach new clusters; a
    variable removed since the server started stays). It is where Dask's own test suite starts
    workers. ``"spawn"``: a fresh interpreter per worker (Dask's default); on platforms without
    ``forkserver`` that is what is used."""
    if method not in WORKER_STARTS:
        raise ValueError(f"worker_start must be one of {WORKER_STARTS}, got {method!r}")
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        method = "spawn"
    dask.config.set({"distributed.worker.multiprocessing-method": method})
    if method == "forkserver":
        from distributed.utils import get_mp_context

        get_mp_context()  # Dask sets its own preload list once; ours (a superset) replaces it before the server starts
        multiprocessing.get_context("forkserver").set_forkserver_preload(["distributed", *preload])
    return method


def local_cluster_class() -> type:
    """``LocalCluster`` whose nannies are never closed because their worker left the scheduler.

    Dask's ``SpecCluster`` closes the nanny (the spec's ``Nanny`` object) of a worker that has not
    re-registered ``distributed.deploy.lost-worker-timeout`` (15 s) after it left, and nothing
    starts it again: a worker that is killed and takes longer than that to come back (a loaded CPU,
    an engine build) is then lost for the run, and ``Client.restart_workers`` or a wait for the role
    times out (seen on fresh clones: "Closing Nanny ... Reason: nanny-close"). A local nanny
    restarts its own worker, so here the cluster only tracks the scheduler's view of workers (the
    base ``Cluster``'s bookkeeping) and leaves its nannies alone. Clusters of jobs (Slurm) keep
    Dask's rule: there an ended job is replaced (``grpo_kit.slurm``).
    """
    from distributed import LocalCluster
    from distributed.deploy.cluster import Cluster

    class NannyLocalCluster(LocalCluster):
        def _update_worker_status(self, op, msg):  # overrides SpecCluster's close of lost workers' nannies
            Cluster._update_worker_status(self, op, msg)

    return NannyLocalCluster


def connect(
    address: str | None = None,
    *,
    n_rollout_workers: int = 1,
    n_trainer_workers: int = 1,
    n_reward_workers: int = 0,
    n_eval_workers: int = 0,
    threads_per_worker: int = 1,
    pin_cpus: bool = False,
    security=None,
    worker_start: str = "forkserver",
    quiet: bool = False,
) -> Client:
    """A Dask client: to ``address`` if given, else to a new ``LocalCluster`` on 127.0.0.1.

    The local cluster has ``n_rollout_workers`` workers with ``rollout=1`` and
    ``n_trainer_workers`` with ``trainer=1`` (and ``n_reward_workers`` with ``reward=1``: scoring
    apart from generation; ``n_eval_workers`` with ``eval=1``: evaluation on engines of its own), each a non-daemonic process with
    ``threads_per_worker`` torch/OpenMP threads. ``pin_cpus`` gives each worker its own cores
    (round-robin over this process's CPUs), as a GPU cluster gives roles disjoint devices.
    ``security`` (a ``distributed.Security``) is passed through for TLS clusters. ``worker_start``:
    how the local workers are started (:func:`use_worker_start`: forked from a server that has
    imported torch, transformers and vLLM once, or spawned afresh).
    """
    # before the client: its stream to the scheduler reads it (LOG_NOTE)
    dask.config.set({"distributed.admin.low-level-log-length": LOW_LEVEL_LOG_LENGTH})
    if address:
        client = Client(address, security=security)
        if not quiet:
            print(f"connected to {address}; dashboard: {client.dashboard_link}")
        return client
    # Nannies read this when they (re)start a worker: engines and process groups spawn children.
    # The statistical profiler is off (PROFILER_NOTE); workers, nannies and the scheduler read it at start.
    dask.config.set({"distributed.worker.daemon": False, "distributed.worker.profile.enabled": False})
    use_worker_start(worker_start)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    gpus = _visible_gpus()
    roles = ([(ROLLOUT, i) for i in range(n_rollout_workers)] + [(TRAINER, i) for i in range(n_trainer_workers)]
             + [(REWARD, i) for i in range(n_reward_workers)] + [(EVAL, i) for i in range(n_eval_workers)])
    if gpus and len(gpus) > 1 and len(roles) > len(gpus):  # before the cluster starts: a warning turned error leaks nothing
        warnings.warn(f"{len(roles)} workers on {len(gpus)} GPUs: workers share devices round-robin "
                      f"({', '.join(f'{r}-{i}' for r, i in roles)} on {', '.join(gpus[k % len(gpus)] for k in range(len(roles)))}); "
                      "an engine sized by gpu_memory_utilization may not fit beside a trainer rank", RuntimeWarning, stacklevel=2)
    cluster = local_cluster_class()(
        n_workers=0,
        threads_per_worker=threads_per_worker,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
        silence_logs=logging.ERROR,
    )
    for k, (role, i) in enumerate(roles):
        cluster.worker_spec[f"{role}-{i}"] = {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "resources": {role: 1},
                "host": "127.0.0.1",
                "env": worker_env(k, threads_per_worker, cpus if pin_cpus else None, gpus),
                "memory_limit": 0,
                "silence_logs": logging.ERROR,
            },
        }
    client = None
    try:
        cluster.scale(len(roles))
        client = Client(cluster)
        client.wait_for_workers(len(roles), timeout=120)
        client.register_plugin(ThreadsPlugin(), name=THREADS_PLUGIN)
    except BaseException:  # a cluster that did not come up is closed, not left running (a re-run notebook cell)
        if client is not None:
            client.close()
        cluster.close()
        raise
    if not quiet:
        extra = (f" + {n_reward_workers} reward" if n_reward_workers else "") + (f" + {n_eval_workers} eval" if n_eval_workers else "")
        print(f"LocalCluster: {n_rollout_workers} rollout + {n_trainer_workers} trainer{extra} workers; "
              f"dashboard: {client.dashboard_link}")
    return client


def scale_rollout(client: Client, n: int, timeout: float = 120) -> list[str]:
    """Grow or shrink the rollout role of a :func:`connect` ``LocalCluster`` to ``n`` workers; the
    trainer workers are untouched. New workers copy ``rollout-0``'s spec (and get the registered
    plugins: each builds its engine as it joins); removed ones, the newest first, are retired
    gracefully (their running tasks are recomputed elsewhere if lost). Returns the rollout workers'
    addresses once there are ``n`` of them and every engine is warm (:func:`engine_ready`)."""
    cluster = client.cluster
    if cluster is None or not hasattr(cluster, "worker_spec"):
        raise TypeError("scale_rollout needs a SpecCluster started by cluster.connect(); scale other clusters "
                        "with their own tools (dask-jobqueue: cluster.scale(jobs=...))")
    if n < 1:
        raise ValueError(f"the rollout role needs at least one worker, got n={n}")
    spec = cluster.worker_spec
    names = sorted((k for k in spec if str(k).startswith(f"{ROLLOUT}-")), key=lambda k: int(str(k).rsplit("-", 1)[1]))
    if not names:
        raise ValueError("this cluster has no rollout-<i> worker spec to copy")
    template, nxt = spec[names[0]], int(str(names[-1]).rsplit("-", 1)[1]) + 1
    env0 = template["options"].get("env") or {}
    threads = int(env0.get("GRPO_KIT_THREADS") or 1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    gpus = _visible_gpus()
    while len(names) < n:  # the first free slot's device and cores, as connect placed the first workers
        opts = dict(template["options"])
        if env0:
            opts["env"] = worker_env(free_slot(spec), threads, cpus if env0.get("GRPO_KIT_CPUS") else None, gpus)
        spec[f"{ROLLOUT}-{nxt}"] = {"cls": template["cls"], "options": opts}
        names.append(f"{ROLLOUT}-{nxt}")
        nxt += 1
    if len(gpus) > 1 and len(spec) > len(gpus):
        warnings.warn(f"{len(spec)} workers on {len(gpus)} GPUs: the rollout workers share devices round-robin with "
                      "the others; an engine sized by gpu_memory_utilization may not fit", RuntimeWarning, stacklevel=2)
    while len(names) > n:
        del spec[names.pop()]
    cluster.scale(len(spec))  # no count change: applies the edited specs (SpecCluster._correct_state)
    deadline = time.time() + timeout
    while True:
        found = workers_with(client, ROLLOUT)
        if len(found) == n and warm_workers(client, found) == found:
            return found
        if time.time() > deadline:
            raise TimeoutError(f"the rollout role has {len(found)} workers, not {n}, after {timeout:.0f}s")
        time.sleep(0.2)


def free_slot(spec: dict) -> int:
    """The lowest worker slot (``worker_env``'s ``k``, recorded as ``GRPO_KIT_SLOT``) no worker of a
    :func:`connect` cluster's ``spec`` holds: after :func:`scale_rollout` shrank the cluster,
    ``len(spec)`` is a slot still in use (a new worker there shared a device with the trainer while
    others sat idle).

    >>> free_slot({"rollout-0": {"options": {"env": {"GRPO_KIT_SLOT": "0"}}},
    ...            "trainer-0": {"options": {"env": {"GRPO_KIT_SLOT": "2"}}}})
    1
    """
    used = set()
    for i, entry in enumerate(spec.values()):
        slot = ((entry.get("options") or {}).get("env") or {}).get("GRPO_KIT_SLOT")
        used.add(int(slot) if slot is not None else i)
    return next(k for k in range(len(used) + 1) if k not in used)


def worker_env(k: int, threads: int, cpus: list[int] | None, gpus: list[str]) -> dict[str, str]:
    """The environment of the worker in slot ``k`` of a :func:`connect` cluster: ``threads`` torch/OpenMP
    threads, pinned to its own cores round-robin over ``cpus`` (None: not pinned), and device
    ``gpus[k % len(gpus)]`` where there are GPUs."""
    mine = [cpus[(k * threads + j) % len(cpus)] for j in range(threads)] if cpus else []
    env = {
        **os.environ,  # as a spawned worker would inherit it (a forked one has the forkserver's)
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "GRPO_KIT_CPUS": ",".join(map(str, mine)),
        "GRPO_KIT_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine)) if mine else "auto",
        "TOKENIZERS_PARALLELISM": "false",
        "GRPO_KIT_OWN_PGRP": "1",  # see ThreadsPlugin: a kernel interrupt must not reach the workers
        "GRPO_KIT_SLOT": str(k),
    }
    if gpus:  # one device per worker, round-robin, as a GPU cluster gives each role its own
        env["CUDA_VISIBLE_DEVICES"] = gpus[k % len(gpus)]
    return env


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD_BYTES = 128 << 20
MMAP_THRESHOLD_BYTES = 32 << 20


def tune_malloc() -> bool:
    """Raise glibc's trim and mmap thresholds in this process; True if applied.

    Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536`` (config
    ``distributed.nanny.pre-spawn-environ``). Setting any threshold turns glibc's adaptive mmap
    threshold off, so every tensor over 128 KiB is mmapped and unmapped again, page faults included:
    a tiny-profile training step measured 0.8 s in a nanny worker against 0.37 s outside one
    (1 thread). Raising both thresholds at run time, which works on any cluster, restored 0.39 s.
    Freed memory up to ``TRIM_THRESHOLD_BYTES`` may stay with the process. No-op off glibc.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


LOW_LEVEL_LOG_LENGTH = 50
"""Dask's ``distributed.admin.low-level-log-length`` on clusters :func:`connect` starts or joins (LOG_NOTE)."""

LOG_NOTE = """Each Dask batched stream (client to scheduler, scheduler to each worker) keeps its last
``distributed.admin.low-level-log-length`` (default 1000) payloads under 1 MB for debugging. A
training step's task carries its batch (96 samples of the tiny profile: ~0.35 MB), so the driver
(client and a LocalCluster's scheduler) held the last 1000 batches twice: ~31 MB more per 100
iterations for the first 1000 iterations, then several hundred MB. :func:`connect` sets the length
to :data:`LOW_LEVEL_LOG_LENGTH` in the driver's process (and so for a LocalCluster's workers); a
remote scheduler reads its own configuration (set it there for big batches under 1 MB)."""

PROFILER_NOTE = """Dask's statistical profiler samples every worker thread's stack every 10 ms and keeps
a call tree per second for the last ``distributed.admin.low-level-log-length`` (1000) seconds. A
vLLM or torch step has deep, varied stacks: on the tiny profile the trees grew a rollout worker by
about 0.5 MB per iteration (48 MB per 100 iterations, 300-iteration soak) and would keep growing for
1000 s before levelling off (at several hundred MB), and sampling costs the task's thread the GIL.
The kit turns it off: :func:`connect` sets ``distributed.worker.profile.enabled: False`` before it
starts a cluster, and :class:`ThreadsPlugin` stops it on workers of any cluster
(:func:`stop_task_profiler`). Dask's dashboard then shows no profile page."""


def stop_task_profiler(worker) -> bool:
    """Stop ``worker``'s statistical task profiler and drop its history (:data:`PROFILER_NOTE`);
    True if it was running."""
    running = False
    for name in ("profile", "profile-cycle"):
        pc = worker.periodic_callbacks.pop(name, None)
        if pc is not None:
            pc.stop()
            running = True
    for attr in ("profile_history", "profile_keys_history", "profile_keys"):
        held = getattr(worker, attr, None)
        if held is not None:
            held.clear()
    return running


class ThreadsPlugin(WorkerPlugin):
    """Applies the CPU affinity and torch thread count a worker was started with, and
    :func:`tune_malloc`, and stops Dask's task profiler (:func:`stop_task_profiler`). Registered on
    every cluster a run uses (local or remote).

    A worker that :func:`connect` started in a notebook's kernel also leaves the kernel's process
    group: Jupyter interrupts a kernel by signalling its whole process group, and SIGINT would
    otherwise kill the worker processes (and their vLLM engines) along with the cell."""

    def setup(self, worker):
        if os.environ.get("GRPO_KIT_OWN_PGRP") == "1" and hasattr(os, "setpgrp"):
            os.setpgrp()  # the engine processes it starts from here on follow it
        worker.grpo_kit_malloc_tuned = tune_malloc()
        stop_task_profiler(worker)
        cpus = os.environ.get("GRPO_KIT_CPUS")
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        threads = os.environ.get("GRPO_KIT_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))


def worker_resources(client: Client) -> dict[str, dict[str, float]]:
    """Every worker's address and the resources it advertises, asked of the scheduler itself.

    Not ``client.scheduler_info()``: that returns the client's cached identity, which the client's
    own periodic refresh (``distributed.client.scheduler-info-interval``) overwrites with one that
    lists no workers, so a call racing the refresh can read an empty cluster."""
    return client.run_on_scheduler(
        lambda dask_scheduler: {a: dict(ws.resources) for a, ws in dask_scheduler.workers.items()})


def workers_with(client: Client, resource: str) -> list[str]:
    """Addresses of the workers that advertise ``resource``, sorted."""
    return sorted(a for a, res in worker_resources(client).items() if res.get(resource))


def shutdown(client: Client) -> None:
    """Close ``client`` and the cluster it started or was given as ``client.cluster`` (a
    ``LocalCluster`` from :func:`connect`, a ``SLURMCluster`` from :func:`grpo_kit.slurm.slurm_cluster`);
    a client connected to a scheduler address has none, and only the client closes."""
    cluster = client.cluster
    client.close()
    if cluster is not None:
        cluster.close()


def wait_for_role(client: Client, resource: str, n: int, timeout: float = 120) -> list[str]:
    deadline = time.time() + timeout
    while True:
        found = workers_with(client, resource)
        if len(found) >= n:
            return found
        if time.time() > deadline:
            raise TimeoutError(
                f"needed {n} workers with resource {resource!r}, found {len(found)}; start workers with "
                f"'--resources {resource}=1' (dask-jobqueue: worker_extra_args)"
            )
        time.sleep(0.2)


def engine_ready(dask_worker, registered: bool = False) -> bool:
    """Whether this worker is ready for rollout tasks: its engine warm, or none installed on it and
    ``registered`` False (no run registered one on the cluster). ``client.run(engine_ready, ...)``."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    return not registered if plugin is None else plugin.warm.is_set()


def warm_workers(client: Client, workers: list[str]) -> list[str]:
    """Those of ``workers`` whose engine is warm (:func:`engine_ready`), sorted. A worker that left
    meanwhile is not warm; any other error in the check is raised, not read as "not warm yet"."""
    if not workers:
        return []
    ready = client.run(engine_ready, workers=workers, on_error="return", registered=engine_registered(client))
    for addr, ok in ready.items():
        if isinstance(ok, Exception) and not isinstance(ok, OSError):  # OSError: the worker is gone
            raise RuntimeError(f"checking whether the engine on {addr} is warm failed: {ok!r}") from ok
    return sorted(a for a, ok in ready.items() if ok is True)


def engine_registered(client: Client) -> bool:
    """Whether a run registered its engine plugin on this cluster (new workers then get it too)."""
    return client.run_on_scheduler(lambda dask_scheduler: ENGINE_PLUGIN in dask_scheduler.worker_plugins)

