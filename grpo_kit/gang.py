"""The trainer gang: ``world_size`` rank tasks pinned to distinct trainer workers, re-formed after a failure.

Training is a gang (:class:`TrainerGang`): rank tasks pinned to distinct trainer workers,
rendezvous at rank 0's host on a free port, bounded timeouts. If a rank fails, the gang is
re-formed from the store's last version, up to ``max_restarts`` times. A step's batch travels by
reference (:class:`RolloutBatch`: futures of the scored chunks on the rollout workers); each rank
task fetches it and takes the advantages from its rewards (:func:`batch_samples`), then runs
:func:`grpo_kit.trainer.train_rank`.

A step is submitted (:meth:`TrainerGang.submit`) and then waited for (:meth:`TrainerGang.finish`).
The driver may submit a step before the one before it ends (``after=``): each rank task then depends
on the same rank's task of that step, so it starts on its worker as soon as that step and its own
batch are done, with no round trip through the driver in between. A step submitted to a gang that
was re-formed since (a failure of an earlier step) is submitted again when it is waited for.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from distributed import Client, wait
from distributed.scheduler import KilledWorker

from . import algorithms
from .adapters import AdapterStore
from .cluster import TRAINER, wait_for_role, workers_with
from .loss import group_advantages
from .publish import fence, optimizer_state_name
from .retention import OPTIMIZER_STATE_KEY, delete_version
from .sampling import Group
from .trainer import RankSpec, publishes_running, teardown, train_rank

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous started right after)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def wait_first_error(futures, timeout: float, alive=None):
    """Wait until all futures finish, one fails, ``alive()`` turns False, or ``timeout`` passes.

    Returns (finished futures, error or None). Dask's ``wait`` has no FIRST_EXCEPTION mode (its
    ``return_when`` takes ALL_COMPLETED and FIRST_COMPLETED only), so this waits for the first
    completion, one second at a time, and checks ``alive()`` between waits: a task pinned to a
    worker that left never completes (see :func:`present`).
    """
    deadline = time.time() + timeout
    pending = set(futures)
    while pending:
        left = deadline - time.time()
        if left <= 0:
            return set(futures) - pending, TimeoutError(f"not finished within {timeout:.0f}s")
        try:
            with next(iter(pending)).client.as_current():  # the futures' client, default or not (wait looks one up)
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


def results_of(futures, timeout: float, alive=None) -> tuple[list | None, BaseException | None]:
    """:func:`wait_first_error`, then the futures' results: (results, None) or (None, error). A result
    lost with its worker after its task finished (the next step, submitted ahead, was running on that
    worker when it left) is never recomputed (the task is pinned there): that reads as the worker
    leaving, as in :func:`wait_first_error`."""
    deadline = time.time() + timeout
    while True:
        _, error = wait_first_error(futures, max(0.0, deadline - time.time()), alive)
        if error is not None:
            return None, error
        try:
            return [f.result(timeout=1.0) for f in futures], None
        except TimeoutError:
            if alive is not None and not alive():
                return None, RuntimeError("a trainer worker of the gang left the cluster with a step's result")


def present(client: Client, workers: list[str]) -> bool:
    """Whether every one of ``workers`` is still in the cluster (as a trainer): a task pinned to one
    that left (``allow_other_workers=False``) would wait for it forever."""
    return set(workers) <= set(workers_with(client, TRAINER))


def run_bounded(client: Client, fn, workers: list[str], timeout: float) -> dict:
    """``client.run(fn)`` on each of ``workers``, bounded: the workers that have not answered in
    ``timeout`` seconds (e.g. stuck destroying a process group under a collective) are restarted by
    their nannies (``Client.restart_workers``) and reported as failed; the others keep their process
    (and the trainer state it holds)."""
    import concurrent.futures

    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(workers)))
    futs = {w: pool.submit(client.run, fn, workers=[w], on_error="return") for w in workers}
    try:
        concurrent.futures.wait(futs.values(), timeout=timeout)
        out, stuck = {}, []
        for w, fut in futs.items():
            if not fut.done():
                stuck.append(w)
                out[w] = TimeoutError(f"{name} timed out")
            elif fut.exception() is not None:
                out[w] = fut.exception()
            else:
                out.update(fut.result())
        if stuck:
            log.warning("%s did not return within %.0fs on %s; restarting those workers", name, timeout, stuck)
            client.restart_workers(stuck, timeout=max(60.0, timeout), raise_for_error=False)
        return out
    finally:
        pool.shutdown(wait=False)


def task_states(client: Client, futures) -> list[str]:
    """The scheduler's state of each future's task (``"waiting"``, ``"processing"``: sent to a worker,
    ``"memory"``: done, ...; ``"released"`` if it has forgotten it)."""
    keys = [f.key for f in futures]
    return client.run_on_scheduler(
        lambda dask_scheduler: [getattr(dask_scheduler.tasks.get(k), "state", "released") for k in keys])


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
    :func:`grpo_kit.remote.reward_task`), and ``picks`` names the samples in training order."""

    scored: list
    """Futures of the scored chunks (``{"rollouts": [Rollout.to_dict() + reward fields], ...}``)."""
    picks: list[tuple[int, int]] | None
    """``(chunk index, rollout index)`` of each sample, whole groups of ``group_size`` in a row. None:
    every completion of every chunk, in group order (:func:`all_picks`: a batch trained as generated,
    submitted before the driver has read its summaries)."""
    group_size: int

    def __len__(self) -> int:
        return len(self.picks)


def batch_of(groups: list[Group], group_size: int) -> RolloutBatch:
    """The training batch of ``groups`` by reference: the scored chunks they live in and where."""
    futures, index, picks = [], {}, []
    for g in groups:
        for _, fut, i in g.payload:
            if fut.key not in index:
                index[fut.key] = len(futures)
                futures.append(fut)
            picks.append((index[fut.key], i))
    return RolloutBatch(futures, picks, group_size)


def all_picks(chunks: list[dict]) -> list[tuple[int, int]]:
    """Every completion of ``chunks`` (scored chunks or their summaries: ``{"rollouts": [...]}`` with
    ``group_id`` and ``sample_idx``) as ``(chunk index, rollout index)``, in group then sample order:
    what :func:`batch_of` gives for all the groups of a batch.

    >>> all_picks([{"rollouts": [{"group_id": 1, "sample_idx": 0}, {"group_id": 0, "sample_idx": 1}]},
    ...            {"rollouts": [{"group_id": 0, "sample_idx": 0}]}])
    [(1, 0), (0, 1), (0, 0)]
    """
    keyed = [((r["group_id"], r["sample_idx"]), (c, i)) for c, ch in enumerate(chunks) for i, r in enumerate(ch["rollouts"])]
    return [p for _, p in sorted(keyed)]


def batch_samples(scored: list[dict], picks: list[tuple[int, int]], group_size: int, adv_scale: str,
                  advantage: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> list[tuple]:
    """The trainer's samples ``(prompt_ids, completion_ids, logprobs, adv)`` for ``picks``, with the
    rollout's ``mask`` appended where it has one (a multi-turn episode's: 0 on environment ids). The
    advantages come from the rewards in ``scored``, as the driver computes them for its records:
    tokens and rewards always come from the same computation, even if Dask had to recompute a chunk
    whose worker died after the driver read its summary. ``advantage(rewards, group_size)`` replaces
    the group advantages of ``adv_scale`` (an estimator of :mod:`grpo_kit.algorithms`).

    >>> chunk = {"rollouts": [{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-0.5], "reward": r} for r in (1.0, 0.0)]}
    >>> batch_samples([chunk], [(0, 1), (0, 0)], 2, "none")
    [([1], [2], [-0.5], -0.5), ([1], [2], [-0.5], 0.5)]
    >>> chunk["rollouts"][0]["mask"] = [1]
    >>> batch_samples([chunk], [(0, 0), (0, 1)], 2, "none")
    [([1], [2], [-0.5], 0.5, [1]), ([1], [2], [-0.5], -0.5)]
    >>> unscorable = {"rollouts": [{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-0.5], "reward": r} for r in (1.0, None, 0.0)]}
    >>> [s[3] for s in batch_samples([unscorable], [(0, 0), (0, 1), (0, 2)], 3, "none")]
    [0.5, 0.0, -0.5]
    """
    rows = [scored[c]["rollouts"][i] for c, i in picks]
    rewards = torch.tensor([math.nan if r["reward"] is None else r["reward"] for r in rows], dtype=torch.float64)
    if not rows:
        adv = []
    elif advantage is None:
        adv = group_advantages(rewards, group_size, scale=adv_scale).tolist()
    else:
        adv = advantage(rewards, group_size).tolist()
    return [(r["prompt_ids"], r["completion_ids"], r["logprobs"], a) + ((r["mask"],) if r.get("mask") is not None else ())
            for r, a in zip(rows, adv, strict=True)]


def train_rank_on(spec: RankSpec, scored: list[dict], picks: list[tuple[int, int]] | None, group_size: int,
                  version: int, iteration: int, after: dict | None = None) -> dict:
    """One rank's part of a training step on a :class:`RolloutBatch` (a Dask task: ``scored`` arrives
    from the workers that hold it, never through the driver). ``after``: this rank's result of the
    step before (a Dask dependency that orders the two on the worker; not read)."""
    picks = all_picks(scored) if picks is None else picks
    estimator = spec.advantage_function()
    samples = batch_samples(scored, picks, group_size, spec.loss.adv_scale,
                            advantage=lambda r, g: algorithms.compute_advantages(estimator, r, g, spec.loss))
    return train_rank(spec, samples, version, iteration)


@dataclass
class StepHandle:
    """A training step submitted to the gang (:meth:`TrainerGang.submit`)."""

    batch: RolloutBatch
    """What it trains on."""
    version: int
    """The adapter version it trains from (it publishes ``version + 1``)."""
    iteration: int
    """The driver's iteration."""
    gang_id: int
    """The gang it went to: a gang re-formed since then submits it again (:meth:`TrainerGang.finish`)."""
    futures: list
    """The rank tasks' futures, rank order."""


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

    def specs(self) -> list[RankSpec]:
        local = local_ranks(self.workers)
        return [replace(self.base_spec, rank=r, gang_id=self.gang_id, init_method=self.init_method, local_rank=local[r])
                for r in range(self.base_spec.world_size)]

    def _alive(self) -> bool:
        return present(self.client, self.workers)

    def submit(self, batch: RolloutBatch, version: int, iteration: int, after: StepHandle | None = None) -> StepHandle:
        """Submit the rank tasks of a step on ``batch`` from ``version``. ``after``: a step submitted to
        this gang before, not yet finished, that publishes ``version``; each rank task waits for the
        same rank's task of it (on the same worker), so this one can be queued before that one ends."""
        prev = after.futures if after is not None and after.gang_id == self.gang_id else [None] * len(self.workers)
        futures = [
            self.client.submit(train_rank_on, spec, batch.scored, batch.picks, batch.group_size, version, iteration, p,
                               workers=[w], allow_other_workers=False,
                               key=f"{self.base_spec.run_id}-train-{iteration}-g{self.gang_id}-r{spec.rank}")
            for spec, w, p in zip(self.specs(), self.workers, prev, strict=True)
        ]
        return StepHandle(batch, version, iteration, self.gang_id, futures)

    def finish(self, handle: StepHandle, store: AdapterStore, retries=None) -> dict:
        """Wait for a submitted step; returns rank 0's stats (identical on all ranks).
        Every rank task fetches the batch's scored chunks from the workers that hold them. A chunk
        lost with its workers while they fetch it (Dask recomputes it; ``KilledWorker`` when its
        workers keep dying) is resubmitted by ``retries`` (:class:`grpo_kit.remote.TaskRetries`) and
        the step runs again on a re-formed gang, not counted as a restart: no rank failed. A step
        submitted to a gang that was re-formed since (after a failure of the step before) is
        submitted again, ``handle`` updated in place (so a stopping driver takes back that one)."""
        batch, version, iteration = handle.batch, handle.version, handle.iteration
        while True:
            if handle.gang_id != self.gang_id:  # queued behind a step that failed: that gang is gone
                self.client.cancel(handle.futures)
                again = self.submit(batch, version, iteration)  # in place: the driver's handle follows it
                handle.futures, handle.gang_id = again.futures, again.gang_id
            futures = handle.futures
            results, error = results_of(futures, self.step_timeout_s, alive=self._alive)
            if error is None:
                sums = [r["param_checksum"] for r in results]
                finite = [math.isfinite(s) for s in sums]
                if (any(finite) and not all(finite)) or (all(finite) and max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0]))):
                    raise RuntimeError(f"trainer ranks diverged at iteration {iteration}: parameter sums {sums}")
                return {**results[0], "ranks": results}
            self.client.cancel(futures)
            if retries is not None and isinstance(error, KilledWorker) and retries.retry_lost(batch.scored):
                log.warning("a scored chunk of iteration %d was lost with its workers; resubmitted, re-forming", iteration)
                self.reset()
                continue
            if store.exists(version + 1) and store.descends(version + 1):
                # Rank 0 published before the failure surfaced (or the step's result was lost with a
                # worker after it): the step is done, the gang is not; re-formed within max_restarts.
                # (A version trained from another attempt of `version` is an orphan the retry replaces.)
                self.recover(error, f"iteration {iteration}, after publishing v{version + 1}")
                meta = store.manifest(version + 1).get("meta", {})
                return {**meta.get("stats", {}), "recovered": True}
            self.recover(error, f"iteration {iteration}")

    def withdraw(self, handles: list[StepHandle], store: AdapterStore, committed: int, delete: bool = True,
                 timeout: float | None = None) -> list[int]:
        """Take back what the driver will not commit (it stops) so that the store ends at version
        ``committed`` (the run state's) and a resumed run trains those iterations again with full
        records. ``handles``: the steps submitted and not waited for. The scheduler is asked once where
        each stands: every step after the last one a worker has started (or finished) is cancelled
        first, so none starts behind it; then the started ones are waited for (a running task cannot
        be stopped); then every version above ``committed`` is deleted, newest first, adapter and
        optimizer state (:func:`grpo_kit.retention.delete_version`), which includes a version whose
        step the driver waited for but did not commit. Left in place, for a resumed run to adopt as
        after a driver that died between a publish and the run state
        (:func:`grpo_kit.checkpoint.reconcile`): everything, when ``committed``'s own optimizer state is
        gone (the resumed run could not load it). A cancelled step a worker began in the milliseconds
        between the scheduler's answer and the cancel still runs to its end (as does a started one
        the wait gave up on): before deleting, the store is fenced against this gang's steps and every
        trainer is waited for until none is in a publish of them (:meth:`fence_out`), so such a step
        publishes nothing, or publishes before the deletion; only one still publishing when that wait
        times out leaves its version for a resumed run to adopt.
        ``delete=False``: only cancel the steps not started, wait for nothing, delete nothing.
        Returns the versions deleted."""
        handles = sorted(handles, key=lambda h: h.iteration)
        ours = [h for h in handles if h.gang_id == self.gang_id]  # the others were never going to run
        states = task_states(self.client, [f for h in ours for f in h.futures])
        started = [h for k, h in enumerate(ours)
                   if any(st in ("processing", "memory") for st in states[k * len(h.futures):(k + 1) * len(h.futures)])]
        last = max((h.iteration for h in started), default=None)
        for h in handles:
            if last is None or h.iteration > last or h.gang_id != self.gang_id:
                self.client.cancel(h.futures)
        if not delete:
            return []
        for h in started:
            log.warning("the driver stopped while the step of iteration %d runs: waiting for it to take back "
                        "v%d", h.iteration, h.version + 1)
            results_of(h.futures, self.step_timeout_s if timeout is None else timeout, alive=self._alive)
        if ours:  # a cancelled one a worker began since the scheduler answered, or one the wait gave up on
            self.fence_out(store, self.step_timeout_s if timeout is None else timeout)
        above = [v for v in store.versions() if v > committed]
        if not above:
            return []
        if committed > 0 and not store.state_exists(store.manifest(committed).get("meta", {}).get(OPTIMIZER_STATE_KEY)
                                                    or optimizer_state_name(committed)):
            log.warning("v%d's optimizer state is gone: v%s left for a resumed run to adopt", committed,
                        ", v".join(map(str, above)))
            return []
        return [v for v in sorted(above, reverse=True) if delete_version(store, v)]

    def fence_out(self, store: AdapterStore, timeout: float) -> None:
        """Make sure no step of this gang publishes from now on: record the gang in the store's fence
        (:func:`grpo_kit.publish.fence`; rank 0 reads it before it publishes), then wait until no
        trainer of the gang still here is in a publish of it (:func:`grpo_kit.trainer.publishes_running`;
        rank 0 counts from just before its fence read to the end of its publish), ``timeout`` at most.
        A step that read the fence before it was written therefore publishes before this returns, and
        one that reads it after publishes nothing."""
        fence(store, self.gang_id)
        deadline = time.time() + timeout
        while True:
            here = set(workers_with(self.client, TRAINER))  # a departed worker would cost a connect timeout
            workers = [w for w in self.workers if w in here]
            counts = self.client.run(publishes_running, self.gang_id, workers=workers, on_error="ignore") if workers else {}
            if not any(counts.values()):
                return
            if time.time() > deadline:
                log.warning("a cancelled step of gang %d still runs after %.0f s: a version it publishes is left "
                            "for a resumed run to adopt", self.gang_id, timeout)
                return
            time.sleep(0.05)

    def recover(self, error: BaseException, where: str) -> None:
        """After a failure of the gang's rank tasks (a training step, or the pre-flight sweep:
        :func:`grpo_kit.preflight.sweep_gang`): count it as a restart, fail with :class:`GangFailed`
        past ``max_restarts``, else re-form the gang (:meth:`reset`) for the caller to try again."""
        self.restarts += 1
        log.warning("trainer gang failed at %s (%s); restart %d of %d", where, error, self.restarts, self.max_restarts)
        if self.restarts > self.max_restarts:
            raise GangFailed(
                f"trainer gang failed {self.restarts} times (max_restarts={self.max_restarts}); last error at "
                f"{where}: {error!r}"
            ) from error
        self.reset()

    def reset(self, timeout: float = 120) -> None:
        """Tear the process group down on every live trainer and form a new gang.

        Waits until ``world_size`` trainer workers answer (a killed one is restarted by its
        nanny under a new address; the scheduler may list the dead one for a moment).
        """
        deadline = None  # from the end of the first pass: a stuck teardown alone takes timeout_s, and the
        while True:      # workers it restarted answer on a later pass
            live = workers_with(self.client, TRAINER)
            answers = run_bounded(self.client, teardown, live, self.base_spec.timeout_s) if live else {}
            ok = sorted(w for w, a in answers.items() if a is True)
            if len(ok) >= self.base_spec.world_size:
                break
            deadline = time.time() + timeout if deadline is None else deadline
            if time.time() > deadline:
                raise GangFailed(f"only {len(ok)} of {self.base_spec.world_size} trainer workers came back within {timeout:.0f}s")
            time.sleep(0.5)
        self._form(ok)

    def close(self) -> None:
        live = workers_with(self.client, TRAINER)
        if live:
            run_bounded(self.client, teardown, live, self.base_spec.timeout_s)
