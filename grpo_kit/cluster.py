"""Dask dispatch: the cluster, worker roles, warm rollout engines, and the gang-scheduled trainer.

Roles are Dask worker *resources*: a worker advertising ``rollout=1`` hosts a warm engine, one
advertising ``trainer=1`` hosts a trainer rank. :func:`connect` starts a ``LocalCluster`` whose
workers carry those resources (non-daemonic processes, so a vLLM engine or a process group can
live inside them), or connects to an existing scheduler whose workers were started with
``--resources rollout=1`` / ``--resources trainer=1`` (dask-jobqueue: ``worker_extra_args``;
dask-kubernetes: the worker command's args).

- Rollout, reward and eval are ordinary Dask tasks: rollout and eval need ``rollout=1`` (reward
  tasks need ``reward=1`` where workers advertise it, else none), so Dask
  places them on engine workers and re-runs them elsewhere if a worker dies (Dask's own
  recomputation of lost tasks, plus ``retries`` for raised errors). The engine is worker-resident
  (:class:`EnginePlugin`): built on first use, then reused; only adapters are fetched per version.
- Training is a gang (:class:`TrainerGang`): ``world_size`` rank tasks pinned to distinct trainer
  workers, rendezvous at rank 0's host on a free port, bounded timeouts. If a rank fails, the
  gang is re-formed from the store's last version, up to ``max_restarts`` times.
- The driver stays out of the data path: it gathers :func:`summary_task`'s view of each scored
  chunk (rewards, counts, texts; no token ids or log-probs) and hands the gang the scored chunks'
  futures (:class:`RolloutBatch`); each rank task fetches them from the rollout workers itself.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, replace

import dask
import torch
from distributed import Client, Nanny, WorkerPlugin, get_worker, wait

from .adapters import AdapterStore
from .config import Config
from .data import DEFAULT_INSTRUCTION, Problem
from .loss import group_advantages
from .prompts import PromptFormat
from .rollout import RolloutSummary
from .tasks import Scorer
from .trainer import RankSpec, teardown, train_rank, warm

log = logging.getLogger(__name__)

ENGINE_PLUGIN = "grpo-kit-engine"
THREADS_PLUGIN = "grpo-kit-threads"
ROLLOUT, TRAINER, REWARD = "rollout", "trainer", "reward"


# ----------------------------------------------------------------------------- the cluster


def connect(
    address: str | None = None,
    *,
    n_rollout_workers: int = 1,
    n_trainer_workers: int = 1,
    n_reward_workers: int = 0,
    threads_per_worker: int = 1,
    pin_cpus: bool = False,
    security=None,
    quiet: bool = False,
) -> Client:
    """A Dask client: to ``address`` if given, else to a new ``LocalCluster`` on 127.0.0.1.

    The local cluster has ``n_rollout_workers`` workers with ``rollout=1`` and
    ``n_trainer_workers`` with ``trainer=1`` (and ``n_reward_workers`` with ``reward=1``: scoring
    apart from generation), each a non-daemonic process with
    ``threads_per_worker`` torch/OpenMP threads. ``pin_cpus`` gives each worker its own cores
    (round-robin over this process's CPUs), as a GPU cluster gives roles disjoint devices.
    ``security`` (a ``distributed.Security``) is passed through for TLS clusters.
    """
    # before the client: its stream to the scheduler reads it (LOG_NOTE)
    dask.config.set({"distributed.admin.low-level-log-length": LOW_LEVEL_LOG_LENGTH})
    if address:
        client = Client(address, security=security)
        if not quiet:
            print(f"connected to {address}; dashboard: {client.dashboard_link}")
        return client
    from distributed import LocalCluster

    # Nannies read this when they (re)start a worker: engines and process groups spawn children.
    # The statistical profiler is off (PROFILER_NOTE); workers, nannies and the scheduler read it at start.
    dask.config.set({"distributed.worker.daemon": False, "distributed.worker.profile.enabled": False})
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    gpus = _visible_gpus()
    cluster = LocalCluster(
        n_workers=0,
        threads_per_worker=threads_per_worker,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
        silence_logs=logging.ERROR,
    )
    roles = ([(ROLLOUT, i) for i in range(n_rollout_workers)] + [(TRAINER, i) for i in range(n_trainer_workers)]
             + [(REWARD, i) for i in range(n_reward_workers)])
    for k, (role, i) in enumerate(roles):
        mine = [cpus[(k * threads_per_worker + j) % len(cpus)] for j in range(threads_per_worker)] if pin_cpus else cpus
        env = {
            "OMP_NUM_THREADS": str(threads_per_worker),
            "MKL_NUM_THREADS": str(threads_per_worker),
            "GRPO_KIT_CPUS": ",".join(map(str, mine)) if pin_cpus else "",
            "GRPO_KIT_THREADS": str(threads_per_worker),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine)) if pin_cpus else "auto",
            "TOKENIZERS_PARALLELISM": "false",
            "GRPO_KIT_OWN_PGRP": "1",  # see ThreadsPlugin: a kernel interrupt must not reach the workers
        }
        if gpus:  # one device per worker, round-robin, as a GPU cluster gives each role its own
            env["CUDA_VISIBLE_DEVICES"] = gpus[k % len(gpus)]
        cluster.worker_spec[f"{role}-{i}"] = {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "resources": {role: 1},
                "host": "127.0.0.1",
                "env": env,
                "memory_limit": 0,
                "silence_logs": logging.ERROR,
            },
        }
    cluster.scale(len(roles))
    client = Client(cluster)
    client.wait_for_workers(len(roles), timeout=120)
    client.register_plugin(ThreadsPlugin(), name=THREADS_PLUGIN)
    if not quiet:
        extra = f" + {n_reward_workers} reward" if n_reward_workers else ""
        print(f"LocalCluster: {n_rollout_workers} rollout + {n_trainer_workers} trainer{extra} workers; "
              f"dashboard: {client.dashboard_link}")
    return client


def scale_rollout(client: Client, n: int, timeout: float = 120) -> list[str]:
    """Grow or shrink the rollout role of a :func:`connect` ``LocalCluster`` to ``n`` workers; the
    trainer workers are untouched. New workers copy ``rollout-0``'s spec (and get the registered
    plugins: the engine warms before the worker takes rollout tasks); removed ones, the newest first,
    are retired gracefully (their running tasks are recomputed elsewhere if lost). Returns the rollout
    workers' addresses once ``n`` of them advertise the role (a joining one only once it is warm)."""
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
    while len(names) < n:
        spec[f"{ROLLOUT}-{nxt}"] = {"cls": template["cls"], "options": dict(template["options"])}
        names.append(f"{ROLLOUT}-{nxt}")
        nxt += 1
    while len(names) > n:
        del spec[names.pop()]
    cluster.scale(len(spec))  # no count change: applies the edited specs (SpecCluster._correct_state)
    deadline = time.time() + timeout
    while True:
        found = workers_with(client, ROLLOUT, warming=True)
        if (len(found) == n and workers_with(client, ROLLOUT) == found
                and all(a is True for a in client.run(engine_ready, workers=found, on_error="return").values())):
            return found
        if time.time() > deadline:
            raise TimeoutError(f"the rollout role has {len(found)} workers, not {n}, after {timeout:.0f}s")
        time.sleep(0.2)


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


def workers_with(client: Client, resource: str, warming: bool = False) -> list[str]:
    """Addresses of the workers that advertise ``resource``, sorted; ``warming`` adds those that hold it
    at 0 for now (a rollout worker whose engine is being built, :class:`EnginePlugin`)."""
    info = client.scheduler_info(n_workers=-1)["workers"] if _accepts_n_workers(client) else client.scheduler_info()["workers"]
    return sorted(a for a, w in info.items() if w.get("resources", {}).get(resource) or
                  (warming and resource in w.get("resources", {})))


def _accepts_n_workers(client: Client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


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


# ----------------------------------------------------------------------------- rollout engines


class EnginePlugin(WorkerPlugin):
    """A warm rollout engine in each rollout worker, reused across tasks.

    Registered with ``client.register_plugin``, so the scheduler also installs it on every worker that
    joins later. On a rollout worker, :meth:`setup` builds the engine in a background thread with the
    worker's ``rollout`` resource set to 0, and restores it when the engine is built and has sampled
    once: a worker that joins mid-run gets no rollout task until it is warm (the elastic fleet).
    """

    def __init__(self, kind: str, model_path: str, store_root: str, storage_options: dict | None, engine_kwargs: dict):
        self.kind, self.model_path = kind, model_path
        self.store_root, self.storage_options = store_root, storage_options
        self.engine_kwargs = engine_kwargs
        self._engine = None

    def setup(self, worker):
        import threading

        self._engine = None
        self._lock = threading.Lock()
        self.warm = threading.Event()  # set once the worker's engine is built and has sampled
        self.warm_s = 0.0  # seconds that took (build included)
        amount = worker.state.total_resources.get(ROLLOUT, 0)
        if amount:
            worker.loop.add_callback(self._warm_gated, worker, amount)
        else:
            self.warm.set()

    async def _warm_gated(self, worker, amount: float) -> None:
        import asyncio

        await worker.set_resources(**{ROLLOUT: 0})
        try:
            self.warm_s = await asyncio.to_thread(warm_engine, engine=self.engine)
        except Exception:  # the first task raises the same error where a driver sees it
            log.exception("building the rollout engine failed on %s", worker.address)
        finally:
            self.warm.set()
            if worker.status.name in ("running", "paused"):  # not when the worker closed meanwhile
                await worker.set_resources(**{ROLLOUT: amount})

    def engine(self):
        with self._lock:  # a task that arrives during the warm-up waits for it, never builds twice
            if self._engine is None:
                store = AdapterStore(self.store_root, self.storage_options)
                self._engine = build_engine(self.kind, self.model_path, store, **self.engine_kwargs)
            return self._engine

    def teardown(self, worker):
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def build_engine(kind: str, model_path: str, store: AdapterStore | None, **kw):
    """A rollout engine: ``"vllm"`` (VLLMEngine) or ``"hf"`` (HFEngine)."""
    if kind == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine(model_path, store=store, **kw)
    if kind == "hf":
        from .rollout import HFEngine

        kw = {k: v for k, v in kw.items() if k in ("dtype", "max_model_len", "prompt_format", "stop")}
        return HFEngine(model_path, store=store, **kw)
    raise ValueError(f"unknown engine {kind!r}")


def register_engines(client: Client, cfg: Config, model_path: str, store_root: str | None = None,
                     storage_options: dict | None = None, instruction: str = DEFAULT_INSTRUCTION) -> None:
    """Register the run's engine on every rollout worker (built there on first use). ``instruction``
    is the task's answer-format instruction (``cfg.prompt.instruction`` overrides it)."""
    kw = {"dtype": cfg.model.dtype, "max_model_len": cfg.model.max_model_len,
          "prompt_format": prompt_format(cfg, instruction),
          "stop": cfg.sampling.stop}
    if cfg.sampling.engine == "vllm":
        kw["max_lora_rank"] = cfg.lora.lora_r  # the engine rounds it up to a rank vLLM accepts
        kw["seed"] = cfg.run.seed
        kw["gpu_memory_utilization"] = cfg.sampling.gpu_memory_utilization
        kw["kv_cache_bytes"] = cfg.sampling.kv_cache_bytes
        kw["max_batch_seqs"] = engine_batch_seqs(cfg)
        kw["lora_mode"] = cfg.sampling.lora_mode
    plugin = EnginePlugin(cfg.sampling.engine, model_path, store_root or cfg.run.store_root, storage_options, kw)
    client.register_plugin(ThreadsPlugin(), name=THREADS_PLUGIN)  # also on clusters connect() did not start
    client.register_plugin(plugin, name=ENGINE_PLUGIN)


MAX_ENGINE_SEQS = 256
"""Cap on the sequences one engine runs at once (vLLM's ``max_num_seqs``); larger evaluations queue."""


def engine_batch_seqs(cfg: Config) -> int:
    """The largest batch one rollout worker is sent: its share of a generation batch or the held-out
    set, capped at :data:`MAX_ENGINE_SEQS`. The CPU engine sizes its KV cache for it.

    >>> from grpo_kit.config import profile
    >>> engine_batch_seqs(profile("tiny", eval_size=64)), engine_batch_seqs(profile("tiny", n_rollout_workers=2, eval_size=8))
    (96, 48)
    """
    s = cfg.sampling
    chunk = -(-s.prompts_per_step // max(1, min(cfg.cluster.n_rollout_workers, s.prompts_per_step))) * s.group_size
    return min(MAX_ENGINE_SEQS, max(chunk, cfg.data.eval_size if cfg.run.eval_every else 1))


def engine_ready(dask_worker) -> bool:
    """Whether this worker is ready for rollout tasks: no engine registered, or its engine warm
    (``client.run(engine_ready)``)."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    return plugin is None or (plugin.warm.is_set() and bool(dask_worker.state.total_resources.get(ROLLOUT)))


def _engine():
    plugin = get_worker().plugins.get(ENGINE_PLUGIN)
    if plugin is None:
        raise RuntimeError("no engine registered on this worker (call cluster.register_engines first)")
    return plugin.engine()


def rollout_task(problems: list[dict], n: int, version: int, max_new_tokens: int, temperature: float, seed: int,
                 group_offset: int, iteration: int) -> dict:
    """Generate ``n`` completions for each problem with the worker's warm engine."""
    t0 = time.time()
    probs = [Problem(**p) for p in problems]
    outs = _engine().generate(probs, n, version, max_new_tokens=max_new_tokens, temperature=temperature,
                              seed=seed, group_offset=group_offset)
    for r in outs:
        r.iteration = iteration
    return {"rollouts": [r.to_dict() for r in outs], "start": t0, "end": time.time(), "worker": get_worker().address}


WARM_PROBLEM = Problem(id="warm-up", question="1 + 1 = ?", gold="2")


def warm_engine(n: int = 4, max_new_tokens: int = 8, engine=None) -> float:
    """Build this worker's engine and sample once from the base model (a task run before the first
    batch: first calls pay one-off kernel set-up); returns the seconds it took, plus those of the
    plugin's own warm-up when it built the engine first. ``engine``: a callable returning the engine
    (default: the registered plugin's)."""
    t0 = time.time()
    (engine or _engine)().generate([WARM_PROBLEM], n, 0, max_new_tokens=max_new_tokens, seed=0)
    plugin = None if engine else get_worker().plugins.get(ENGINE_PLUGIN)
    return time.time() - t0 + (plugin.warm_s if plugin is not None else 0.0)


def warm_up(client: Client, gang: TrainerGang, version: int, key: str) -> dict:
    """Build every rollout worker's engine and every gang rank's policy (at ``version``), concurrently,
    before the first iteration. Each task prefers its worker; if that worker leaves, another of the
    role runs it, so nothing waits on a dead worker. A failed build raises here, before any batch.
    Returns the seconds each part took on its worker."""
    rollout = wait_until_warm(client)
    futures = {
        f"engine {w}": client.submit(warm_engine, workers=[w], allow_other_workers=True, resources={ROLLOUT: 1},
                                     key=f"{key}-warm-engine-{i}", pure=False)
        for i, w in enumerate(rollout)
    }
    for spec, w in zip(gang._specs(), gang.workers, strict=True):
        futures[f"trainer rank {spec.rank}"] = client.submit(
            warm, spec, version, workers=[w], allow_other_workers=True, resources={TRAINER: 1},
            key=f"{key}-warm-trainer-{spec.rank}", pure=False,
        )
    return dict(zip(futures, client.gather(list(futures.values())), strict=True))


def wait_until_warm(client: Client, timeout: float = 900) -> list[str]:
    """Wait until no rollout worker is still building its engine (:class:`EnginePlugin` holds its
    ``rollout`` resource at 0 meanwhile); returns the rollout workers. (A task pinned to a worker that
    lacks a resource, with ``allow_other_workers``, may otherwise be sent to a worker without the role.)"""
    deadline = time.time() + timeout
    while True:
        warm, all_ = workers_with(client, ROLLOUT), workers_with(client, ROLLOUT, warming=True)
        if warm == all_ or time.time() > deadline:
            return warm
        time.sleep(0.1)


def prompt_format(cfg: Config, instruction: str = DEFAULT_INSTRUCTION) -> PromptFormat:
    """The run's prompt format; ``instruction`` is the task's, used unless ``cfg.prompt.instruction`` is set."""
    p = cfg.prompt
    return PromptFormat(instruction=instruction if p.instruction is None else p.instruction,
                        system_prompt=p.system_prompt, chat_template=p.chat_template)


def reward_task(result: dict, problems: list[dict], group_offset: int, scorer: Scorer) -> dict:
    """Score rollouts as soon as they complete, with the task's reward functions (``scorer``).
    A reward function that fails scores 0 with its reason (``reward_errors`` counts it)."""
    t0 = time.time()
    probs = [Problem(**p) for p in problems]
    rows = result["rollouts"]
    scores = scorer.score_problems([probs[r["group_id"] - group_offset] for r in rows], [r["text"] for r in rows])
    for r, sc in zip(rows, scores, strict=True):
        r["reward"], r["reward_reason"] = sc.reward, sc.reason
        r["correct"], r["lenient_correct"] = sc.correct, sc.lenient_correct
        r["reward_components"], r["reward_errors"] = sc.components, sc.errors
    result["reward_start"], result["reward_end"] = t0, time.time()
    result["reward_worker"] = get_worker().address
    return result


def summary_task(scored: dict) -> dict:
    """What the driver gathers of a scored chunk (:func:`reward_task`'s result): each rollout's
    :meth:`~grpo_kit.rollout.RolloutSummary.of` and the chunk's timings. The token ids and log-probs
    stay in the scored chunk, on its worker, until the trainer ranks fetch it (:func:`train_rank_on`)."""
    return {**{k: v for k, v in scored.items() if k != "rollouts"},
            "rollouts": [RolloutSummary.of(r) for r in scored["rollouts"]]}


def eval_task(problems: list[dict], version: int, max_new_tokens: int, scorer: Scorer) -> dict:
    """Greedy held-out accuracy of adapter ``version`` (0 = the base model) by the task's rule:
    strict (``acc``; for the arithmetic tasks the ``####`` form and the right value) and lenient
    (``lenient_acc``; there, the right value by any rule)."""
    t0 = time.time()
    probs = [Problem(**p) for p in problems]
    outs = _engine().greedy(probs, version, max_new_tokens=max_new_tokens)
    results = scorer.score_problems(probs, [r.text for r in outs])
    correct = [res.correct for res in results]
    return {
        "version": version,
        "acc": sum(correct) / max(1, len(correct)),
        "lenient_acc": sum(res.lenient_correct for res in results) / max(1, len(results)),
        "n": len(correct),
        "truncated": sum(r.truncated for r in outs),
        "reward_errors": sum(res.errors for res in results),
        "start": t0,
        "end": time.time(),
    }


def problem_dict(p: Problem) -> dict:
    return {"id": p.id, "question": p.question, "gold": p.gold, "solution": None, "columns": dict(p.columns)}


# ----------------------------------------------------------------------------- the trainer gang


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous started right after)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _wait_first_error(futures, timeout: float, alive=None):
    """Wait until all futures finish, one fails, ``alive()`` turns False, or ``timeout`` passes.

    Returns (finished futures, error or None). Dask's ``wait`` has no FIRST_EXCEPTION mode.
    """
    deadline = time.time() + timeout
    pending = set(futures)
    while pending:
        left = deadline - time.time()
        if left <= 0:
            return set(futures) - pending, TimeoutError(f"not finished within {timeout:.0f}s")
        try:
            done, pending = wait(list(pending), timeout=min(left, 1.0), return_when="FIRST_COMPLETED")
        except TimeoutError:
            if alive is not None and not alive():
                return set(futures) - pending, RuntimeError("a trainer worker of the gang left the cluster")
            continue
        pending = set(pending)
        for f in done:
            if f.status == "error":
                return set(futures) - pending, f.exception()
    return set(futures), None


def run_bounded(client: Client, fn, workers: list[str], timeout: float) -> dict:
    """``client.run(fn)`` on ``workers``, bounded: workers that have not answered in ``timeout``
    seconds (e.g. stuck destroying a process group under a collective) are restarted by their
    nannies (``Client.restart_workers``) and reported as failed."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(client.run, fn, workers=workers, on_error="return")
    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        log.warning("%s did not return within %.0fs on %s; restarting those workers", fn.__name__, timeout, workers)
        client.restart_workers(workers, timeout=max(60.0, timeout), raise_for_error=False)
        return {w: TimeoutError(f"{fn.__name__} timed out") for w in workers}
    finally:
        pool.shutdown(wait=False)


def local_ranks(workers: list[str]) -> list[int]:
    """Each worker's index among the listed workers on the same host (its GPU on a multi-GPU node).

    >>> local_ranks(["tcp://10.0.0.1:4001", "tcp://10.0.0.2:4001", "tcp://10.0.0.1:4002"])
    [0, 0, 1]
    """
    seen: dict[str, int] = {}
    out = []
    for w in workers:
        host = w.split("://")[-1].rsplit(":", 1)[0]
        out.append(seen.get(host, 0))
        seen[host] = out[-1] + 1
    return out


@dataclass(frozen=True)
class RolloutBatch:
    """One training batch, by reference: the scored chunks stay where they are (Dask futures of
    :func:`reward_task`), and ``picks`` names the samples in training order."""

    scored: list
    """Futures of the scored chunks (``{"rollouts": [Rollout.to_dict() + reward fields], ...}``)."""
    picks: list[tuple[int, int]]
    """``(chunk index, rollout index)`` of each sample, whole groups of ``group_size`` in a row."""
    group_size: int

    def __len__(self) -> int:
        return len(self.picks)


def batch_samples(scored: list[dict], picks: list[tuple[int, int]], group_size: int, adv_scale: str) -> list[tuple]:
    """The trainer's samples ``(prompt_ids, completion_ids, logprobs, adv)`` for ``picks``. The
    advantages come from the rewards in ``scored``, as the driver computes them for its records:
    tokens and rewards always come from the same computation, even if Dask had to recompute a chunk
    whose worker died after the driver read its summary.

    >>> chunk = {"rollouts": [{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-0.5], "reward": r} for r in (1.0, 0.0)]}
    >>> batch_samples([chunk], [(0, 1), (0, 0)], 2, "none")
    [([1], [2], [-0.5], -0.5), ([1], [2], [-0.5], 0.5)]
    """
    rows = [scored[c]["rollouts"][i] for c, i in picks]
    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    adv = group_advantages(rewards, group_size, scale=adv_scale).tolist() if rows else []
    return [(r["prompt_ids"], r["completion_ids"], r["logprobs"], a) for r, a in zip(rows, adv, strict=True)]


def train_rank_on(spec: RankSpec, scored: list[dict], picks: list[tuple[int, int]], group_size: int, version: int,
                  iteration: int) -> dict:
    """One rank's part of a training step on a :class:`RolloutBatch` (a Dask task: ``scored`` arrives
    from the workers that hold it, never through the driver)."""
    return train_rank(spec, batch_samples(scored, picks, group_size, spec.loss.adv_scale), version, iteration)


class GangFailed(RuntimeError):
    """The trainer gang failed more often than ``max_restarts`` allows."""


class TrainerGang:
    """``world_size`` rank tasks pinned to distinct trainer workers, re-formed after a failure."""

    def __init__(self, client: Client, spec: RankSpec, *, max_restarts: int = 2, step_timeout_s: float = 3600):
        self.client, self.base_spec = client, spec
        self.max_restarts, self.step_timeout_s = max_restarts, step_timeout_s
        self.restarts = 0
        # unique across gangs and runs: a worker never mistakes a new gang for the one it is in
        self.gang_id = int.from_bytes(os.urandom(4), "little") << 8
        self.workers: list[str] = []
        self._form()

    def _form(self, candidates: list[str] | None = None) -> None:
        ws = self.base_spec.world_size
        self.workers = (candidates or wait_for_role(self.client, TRAINER, ws))[:ws]
        self.gang_id += 1
        self.init_method = None
        if ws > 1:
            port = self.client.run(free_port, workers=[self.workers[0]])[self.workers[0]]
            host = self.workers[0].split("://")[-1].rsplit(":", 1)[0]
            self.init_method = f"tcp://{host}:{port}"

    def _specs(self) -> list[RankSpec]:
        local = local_ranks(self.workers)
        return [replace(self.base_spec, rank=r, gang_id=self.gang_id, init_method=self.init_method, local_rank=local[r])
                for r in range(self.base_spec.world_size)]

    def _alive(self) -> bool:
        return set(self.workers) <= set(workers_with(self.client, TRAINER))

    def step(self, batch: RolloutBatch, version: int, iteration: int, store: AdapterStore) -> dict:
        """Train on ``batch`` from ``version``; returns rank 0's stats (identical on all ranks).
        Every rank task fetches the batch's scored chunks from the workers that hold them."""
        while True:
            futures = [
                self.client.submit(train_rank_on, spec, batch.scored, batch.picks, batch.group_size, version, iteration,
                                   workers=[w], allow_other_workers=False,
                                   key=f"{self.base_spec.run_id}-train-{iteration}-g{self.gang_id}-r{spec.rank}")
                for spec, w in zip(self._specs(), self.workers, strict=True)
            ]
            _, error = _wait_first_error(futures, self.step_timeout_s, alive=self._alive)
            if error is None:
                results = [f.result() for f in futures]
                sums = [r["param_checksum"] for r in results]
                if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
                    raise RuntimeError(f"trainer ranks diverged at iteration {iteration}: parameter sums {sums}")
                return {**results[0], "ranks": results}
            self.client.cancel(futures)
            self.restarts += 1
            if store.exists(version + 1):
                # Rank 0 published before the failure surfaced: the step is done, the gang is not.
                log.warning("trainer gang failed after publishing v%d (%s); re-forming", version + 1, error)
                self.reset()
                meta = store.manifest(version + 1).get("meta", {})
                return {**meta.get("stats", {}), "recovered": True}
            log.warning("trainer gang failed at iteration %d (%s); restart %d of %d", iteration, error,
                        self.restarts, self.max_restarts)
            if self.restarts > self.max_restarts:
                raise GangFailed(
                    f"trainer gang failed {self.restarts} times (max_restarts={self.max_restarts}); last error at "
                    f"iteration {iteration}: {error!r}"
                ) from error
            self.reset()

    def reset(self, timeout: float = 120) -> None:
        """Tear the process group down on every live trainer and form a new gang.

        Waits until ``world_size`` trainer workers answer (a killed one is restarted by its
        nanny under a new address; the scheduler may list the dead one for a moment).
        """
        deadline = time.time() + timeout
        while True:
            live = workers_with(self.client, TRAINER)
            answers = run_bounded(self.client, teardown, live, self.base_spec.timeout_s) if live else {}
            ok = sorted(w for w, a in answers.items() if a is True)
            if len(ok) >= self.base_spec.world_size:
                break
            if time.time() > deadline:
                raise GangFailed(f"only {len(ok)} of {self.base_spec.world_size} trainer workers came back within {timeout:.0f}s")
            time.sleep(0.5)
        self._form(ok)

    def close(self) -> None:
        live = workers_with(self.client, TRAINER)
        if live:
            run_bounded(self.client, teardown, live, self.base_spec.timeout_s)
