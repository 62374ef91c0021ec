"""What runs on the rollout and reward workers: the worker-resident engine and the task bodies.

- Rollout, reward and eval are ordinary Dask tasks: rollout and eval need ``rollout=1`` (reward
  tasks need ``reward=1`` where workers advertise it, else none), so Dask places them on engine
  workers and re-runs them elsewhere if a worker dies (Dask's own recomputation of lost tasks, plus
  ``retries`` for raised errors). The engine is worker-resident (:class:`EnginePlugin`): built on
  first use, then reused; only adapters are fetched per version.
- A task Dask gives up on because its workers kept dying (``KilledWorker``: more than the scheduler's
  ``distributed.scheduler.allowed-failures``, default 3, lost it) is resubmitted by the driver
  (:class:`TaskRetries`, ``Client.retry``: same key, same seed, so it reproduces its result), up to
  ``RunConfig.max_task_failures`` times per task: a preempted rollout worker costs a batch, not the run.
- The driver stays out of the data path: it gathers :func:`summary_task`'s view of each scored
  chunk (rewards, counts, texts; no token ids or log-probs) and hands the trainer gang
  (:mod:`grpo_kit.gang`) the scored chunks' futures; each rank task fetches them from the rollout
  workers itself.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from distributed import Client, Future, WorkerPlugin, get_worker, wait
from distributed.scheduler import KilledWorker

from .adapters import AdapterStore
from .cluster import (
    ENGINE_PLUGIN,
    EVAL,
    ROLLOUT,
    THREADS_PLUGIN,
    TRAINER,
    ThreadsPlugin,
    warm_workers,
    worker_resources,
    workers_with,
)
from .config import Config
from .data import DEFAULT_INSTRUCTION, Problem
from .episode import EpisodePlan, to_rollout
from .passk import sampled_metrics
from .renderers import for_engine
from .rollout import RolloutSummary, build_engine, engine_options
from .tasks import RewardLog, Scorer, TrainingProgress
from .trainer import warm

if TYPE_CHECKING:
    from .gang import TrainerGang

log = logging.getLogger(__name__)


class EnginePlugin(WorkerPlugin):
    """A warm rollout engine in each rollout worker, reused across tasks.

    Registered with ``client.register_plugin``, so the scheduler also installs it on every worker that
    joins later. On a rollout worker, :meth:`setup` starts building the engine (and sampling once) in
    a background thread; a task that arrives meanwhile waits until that is done (a second thread in
    the engine, or in transformers' first imports, breaks it), and :func:`grpo_kit.cluster.engine_ready`
    says when it is done. The worker's ``rollout`` resource is never changed: Dask does not revisit a
    task it could not place when a worker's resources come back (``Scheduler.add_resources``), nor a
    task a worker holds as ``constrained`` when ``Worker.set_resources`` raises them, so holding the
    resource at 0 during the build hung runs whose only rollout worker was being replaced.
    """

    def __init__(self, kind: str, model_path: str, store_root: str, storage_options: dict | None, engine_kwargs: dict):
        self.kind, self.model_path = kind, model_path
        self.store_root, self.storage_options = store_root, storage_options
        self.engine_kwargs = engine_kwargs
        self._engine = None

    def setup(self, worker):
        self._engine, self._closed = None, False
        self._lock = threading.Lock()
        self.warm = threading.Event()  # set once the worker's engine is built and has sampled
        self.warm_s = 0.0  # seconds that took (build included)
        if worker.state.total_resources.get(ROLLOUT, 0) or worker.state.total_resources.get(EVAL, 0):
            worker.loop.add_callback(self._warm, worker)
        else:
            self.warm.set()

    async def _warm(self, worker) -> None:
        import asyncio

        def build_and_sample() -> float:
            with WARM_LOCK:  # after a replaced plugin's warm-up, never beside it
                return warm_engine(engine=self.engine)

        try:
            self.warm_s = await asyncio.to_thread(build_and_sample)
        except Exception:  # the first task raises the same error where a driver sees it
            if not self._closed:
                log.exception("building the rollout engine failed on %s", worker.address)
        finally:
            self.warm.set()

    def engine(self):
        with self._lock:  # a task that arrives during the warm-up waits for it, never builds twice
            if self._closed:
                raise RuntimeError("this worker's engine plugin was replaced or removed")
            if self._engine is None:
                store = AdapterStore(self.store_root, self.storage_options)
                with WARM_LOCK:
                    engine = build_engine(self.kind, self.model_path, store, **self.engine_kwargs)
                if self._closed:  # torn down while it was being built
                    engine.close()
                    raise RuntimeError("this worker's engine plugin was replaced or removed")
                self._engine = engine
            return self._engine

    def teardown(self, worker):
        self._closed = True
        if self._lock.acquire(blocking=False):  # else a build is under way: engine() closes what it builds
            try:
                if self._engine is not None:
                    self._engine.close()
                    self._engine = None
            finally:
                self._lock.release()


WARM_LOCK = threading.RLock()
"""One engine build or warm-up at a time in a worker process: a plugin registered by a new run
replaces the last one while the last one may still be building (transformers' lazy imports and model
loading break when two threads run them at once)."""


def register_engines(client: Client, cfg: Config, model_path: str, store_root: str | None = None,
                     storage_options: dict | None = None, instruction: str = DEFAULT_INSTRUCTION) -> None:
    """Register the run's engine on every rollout worker (built there on first use). ``instruction``
    is the task's answer-format instruction (``cfg.prompt.instruction`` overrides it)."""
    kw = engine_options(cfg, instruction)
    plugin = EnginePlugin(cfg.sampling.engine, model_path, store_root or cfg.run.store_root, storage_options, kw)
    client.register_plugin(ThreadsPlugin(), name=THREADS_PLUGIN)  # also on clusters connect() did not start
    client.register_plugin(plugin, name=ENGINE_PLUGIN)


def _engine():
    plugin = get_worker().plugins.get(ENGINE_PLUGIN)
    if plugin is None:
        raise RuntimeError("no engine registered on this worker (call remote.register_engines first)")
    plugin.warm.wait()  # never beside the plugin's own first sampling: engines are not thread-safe
    return plugin.engine()


def rollout_task(problems: list[dict], n: int, version: int, max_new_tokens: int, temperature: float, seed: int,
                 group_offset: int, iteration: int, newest: bool = False, episodes: EpisodePlan | None = None,
                 scorer: Scorer | None = None) -> dict:
    """Generate ``n`` completions for each problem with the worker's warm engine, from adapter
    ``version``, or with ``newest`` from the newest version in the store when the task starts (never
    an older one than ``version``; the rollouts record which).

    With ``episodes`` (a multi-turn task) each completion is an episode played with the task's tools
    and environment (:mod:`grpo_kit.episode`; one adapter version for the whole episode), scored here
    by ``scorer`` while the environments are alive (:func:`score_episodes`). A single-turn chunk is
    scored here too when ``scorer`` is given (:func:`score_chunk`: a run without reward workers, which
    saves a task and its scheduler round trip between generation and the driver); either way
    :func:`reward_task` passes such a chunk through."""
    t0 = time.time()
    probs = [Problem(**p) for p in problems]
    engine = _engine()
    store = getattr(engine, "store", None)
    if newest and store is not None:
        version = max(version, store.latest() or 0)
    if episodes is not None:
        lives = episodes.runner(engine, for_engine(engine), temperature).play(
            probs, n, version, seed=seed, iteration=iteration, group_offset=group_offset)
        t1 = time.time()
        rows = [to_rollout(lv.ep).to_dict() for lv in lives]
        log = RewardLog(len(rows))
        if scorer is not None:
            score_episodes(scorer, [probs[lv.ep.group_id - group_offset] for lv in lives], lives, rows,
                           state=scorer.progress(iteration, version), log=log)
        return {"rollouts": rows, "start": t0, "end": t1, "worker": get_worker().address, "scored": scorer is not None,
                "reward_start": t1, "reward_end": time.time(), "reward_worker": get_worker().address,
                "reward_metrics": log.metrics}
    outs = engine.generate(probs, n, version, max_new_tokens=max_new_tokens, temperature=temperature,
                           seed=seed, group_offset=group_offset)
    for r in outs:
        r.iteration = iteration
    result = {"rollouts": [r.to_dict() for r in outs], "start": t0, "end": time.time(), "worker": get_worker().address}
    return score_chunk(result, probs, group_offset, scorer) if scorer is not None else result


def score_episodes(scorer: Scorer, problems: list[Problem], lives: list, rows: list[dict], *,
                   state: TrainingProgress | None = None, log: RewardLog | None = None) -> list:
    """Score finished episodes with the task's reward functions: ``completions`` are the final
    answers (for conversational prompts, as TRL gives tool episodes, the messages after the prompt),
    ``completion_ids`` each episode's tokens after its first prompt (tool results included; its
    ``mask`` marks the sampled ones), and the columns ``environments`` (the live instances),
    ``env_reward`` and ``episodes`` come beside the problems' (:mod:`grpo_kit.tasks.base`).
    Stamps ``rows`` like :func:`reward_task`."""
    extra = {"environments": [lv.env for lv in lives], "env_reward": [lv.ep.env_reward for lv in lives],
             "episodes": [r["episode"] for r in rows]}
    conversational = bool(problems) and problems[0].conversational
    completions = [(r["episode"].get("messages") or r["text"]) if conversational else r["text"] for r in rows]
    log = log if log is not None else RewardLog(len(rows))
    scores = scorer.score_problems(problems, completions, extra, completion_ids=[r["completion_ids"] for r in rows],
                                   state=state, log=log)
    # an episode whose environment failed before the policy acted (environment_factory or reset raised or
    # timed out) is unscorable, advantage 0: its 0 moved the group's mean and gave the others advantages
    # no action of theirs earned (a review); an error after the policy sampled keeps its penalty
    scores = [dataclasses.replace(sc, reward=None, reason=f"not scored: {lv.ep.error} (before the policy acted)")
              if lv.ep.end_reason == "error" and lv.ep.sampled_tokens == 0 else sc
              for sc, lv in zip(scores, lives, strict=True)]
    stamp(rows, scores, log)
    return scores


def stamp(rows: list[dict], scores: list, log: RewardLog | None = None) -> None:
    """Write each :class:`~grpo_kit.tasks.Score` into its rollout row, and what the reward functions
    logged for it with ``log_extra`` (``reward_extra``)."""
    for i, (r, sc) in enumerate(zip(rows, scores, strict=True)):
        r["reward"], r["reward_reason"] = sc.reward, sc.reason
        r["correct"], r["lenient_correct"] = sc.correct, sc.lenient_correct
        r["reward_components"], r["reward_errors"] = sc.components, sc.errors
        if log is not None and log.extra:
            r["reward_extra"] = log.row(i)


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


def warm_up(client: Client, gang: TrainerGang, version: int, key: str, poll_s: float = 1.0) -> dict:
    """Build every rollout worker's engine and every gang rank's policy (at ``version``), concurrently,
    before the first iteration. Returns the seconds each part took on its worker; a part whose worker
    left the cluster meanwhile is left out (nothing waits on a dead worker: a rollout worker that
    replaces it warms itself through the engine plugin, a trainer's loss re-forms the gang at the first
    step). A failed build raises here, before any batch.

    Each task is pinned to its worker *strictly*. Dask's softer form, ``workers=[w],
    allow_other_workers=True`` with a ``resources=`` restriction, sends the task to *any* worker once
    ``w`` is gone or not running (``distributed.scheduler.decide_worker`` drops the resource
    restriction with the worker one): a trainer worker handed an engine task fails with
    ``KeyError: 'rollout'`` in the scheduler's and the worker's state machines, which lost a trainer
    worker mid-test (tests/test_remote.py)."""
    rollout = wait_until_warm(client)
    parts = {
        f"engine {w}": (w, client.submit(warm_engine, workers=[w], allow_other_workers=False, resources={ROLLOUT: 1},
                                         key=f"{key}-warm-engine-{i}", pure=False))
        for i, w in enumerate(rollout)
    }
    for spec, w in zip(gang.specs(), gang.workers, strict=True):
        parts[f"trainer rank {spec.rank}"] = (w, client.submit(
            warm, spec, version, workers=[w], allow_other_workers=False, resources={TRAINER: 1},
            key=f"{key}-warm-trainer-{spec.rank}", pure=False,
        ))
    return gather_pinned(client, parts, poll_s)


def gather_pinned(client: Client, parts: dict[str, tuple[str, Future]], poll_s: float = 1.0) -> dict:
    """The results of futures each pinned to one worker (``name: (address, future)``), in order,
    without the ones whose worker left the cluster before they finished (cancelled: Dask would keep
    them waiting for that worker forever). The first task that failed raises its error."""
    out, pending = {}, dict(parts)
    while pending:
        try:
            with client.as_current():  # wait looks a client up: this one, default or not
                wait([f for _, f in pending.values()], timeout=poll_s, return_when="FIRST_COMPLETED")
        except TimeoutError:
            pass
        present = set(worker_resources(client)) if pending else set()  # the scheduler's, not the client's cached view
        for name, (w, f) in list(pending.items()):
            if f.done():
                out[name] = f.result()
                del pending[name]
            elif w not in present:
                log.warning("%s: its worker %s left the cluster; not waiting for it", name, w)
                f.cancel()
                del pending[name]
    return {name: out[name] for name in parts if name in out}


def wait_until_warm(client: Client, timeout: float = 900) -> list[str]:
    """Wait until every rollout worker has built its engine and sampled once (:func:`grpo_kit.cluster.engine_ready`),
    at most ``timeout`` seconds; returns the rollout workers that are warm."""
    deadline = time.time() + timeout
    while True:
        workers = workers_with(client, ROLLOUT)
        warm = warm_workers(client, workers)
        if warm == workers or time.time() > deadline:
            return warm
        time.sleep(0.1)


def reward_task(result: dict, problems: list[dict], group_offset: int, scorer: Scorer) -> dict:
    """Score rollouts as soon as they complete, with the task's reward functions (``scorer``; they
    get each rollout's sampled ``completion_ids`` as TRL passes them), on a reward worker. A reward
    function that fails scores 0 with its reason (``reward_errors`` counts it)."""
    if result.get("scored"):  # scored where it was generated (rollout_task)
        return result
    return score_chunk(result, [Problem(**p) for p in problems], group_offset, scorer)


def score_chunk(result: dict, problems: list[Problem], group_offset: int, scorer: Scorer) -> dict:
    """Stamp a generated chunk's rollouts with ``scorer``'s scores (the problem of each is
    ``problems[group_id - group_offset]``), what the rewards logged, and the scoring's timings."""
    t0 = time.time()
    rows = result["rollouts"]
    log = RewardLog(len(rows))
    state = scorer.progress(rows[0].get("iteration") or 0, rows[0].get("version")) if rows else None
    stamp(rows, scorer.score_problems([problems[r["group_id"] - group_offset] for r in rows], [r["text"] for r in rows],
                                      completion_ids=[r["completion_ids"] for r in rows], state=state, log=log), log)
    result["reward_metrics"] = log.metrics
    result["reward_start"], result["reward_end"] = t0, time.time()
    result["reward_worker"] = get_worker().address
    result["scored"] = True
    return result


def summary_task(scored: dict) -> dict:
    """What the driver gathers of a scored chunk (:func:`reward_task`'s result): each rollout's
    :meth:`~grpo_kit.rollout.RolloutSummary.of` and the chunk's timings. The token ids and log-probs
    stay in the scored chunk, on its worker, until the trainer ranks fetch it (:func:`grpo_kit.gang.train_rank_on`)."""
    return {**{k: v for k, v in scored.items() if k != "rollouts"},
            "rollouts": [RolloutSummary.of(r) for r in scored["rollouts"]]}


def eval_task(problems: list[dict], version: int, max_new_tokens: int, scorer: Scorer,
              episodes: EpisodePlan | None = None, samples: int = 0, temperature: float = 1.0, seed: int = 0) -> dict:
    """Greedy held-out accuracy of adapter ``version`` (0 = the base model) by the task's rule:
    strict (``acc``; for the arithmetic tasks the ``####`` form and the right value) and lenient
    (``lenient_acc``; there, the right value by any rule), both over every problem: an unscorable
    completion counts as not correct, and ``unscored`` says how many there were. With ``episodes``: one greedy episode per
    problem, and the episodes' counts besides (``tool_rate``: share of episodes that called a tool;
    ``turns_mean``; ``tool_errors``). With ``samples`` = k >= 1: also k completions (episodes) per
    problem sampled at ``temperature`` from ``seed``, and their pass@1..k, avg@k and maj@k
    (:func:`sampled_eval`)."""
    t0 = time.time()
    probs = [Problem(**p) for p in problems]
    extra: dict = {}
    log = RewardLog(len(probs))  # what the rewards log for the greedy completions (log_metric: kept)
    if episodes is not None:
        engine = _engine()
        lives = episodes.runner(engine, for_engine(engine), 0.0).play(probs, 1, version)
        outs = [to_rollout(lv.ep) for lv in lives]
        rows = [r.to_dict() for r in outs]
        results = score_episodes(scorer, probs, lives, rows, state=scorer.progress(version, version, "eval"), log=log)
        eps = [lv.ep for lv in lives]
        extra = {"tool_rate": sum(e.tool_calls > 0 for e in eps) / max(1, len(eps)),
                 "turns_mean": sum(e.turns for e in eps) / max(1, len(eps)),
                 "tool_errors": sum(sum(e.tool_errors.values()) for e in eps)}
    else:
        outs = _engine().greedy(probs, version, max_new_tokens=max_new_tokens)
        results = scorer.score_problems(probs, [r.text for r in outs], completion_ids=[r.completion_ids for r in outs],
                                        state=scorer.progress(version, version, "eval"), log=log)
    if samples:
        extra.update(sampled_eval(_engine(), probs, version, max_new_tokens, scorer, episodes, samples, temperature, seed))
    correct = [res.correct for res in results]
    return {**extra,
        "version": version,
        "acc": sum(correct) / max(1, len(correct)),
        "lenient_acc": sum(res.lenient_correct for res in results) / max(1, len(results)),
        "n": len(correct),
        "truncated": sum(r.truncated for r in outs),
        "reward_errors": sum(res.errors for res in results),
        "unscored": sum(res.reward is None for res in results),
        "start": t0,
        "end": time.time(),
        "worker": str(get_worker().name),
        "reward_metrics": {name: sum(vs) / len(vs) for name, vs in log.metrics.items() if vs},
    }


def sampled_eval(engine, probs: list[Problem], version: int, max_new_tokens: int, scorer: Scorer,
                 episodes: EpisodePlan | None, samples: int, temperature: float, seed: int) -> dict:
    """``samples`` completions per problem (episodes, for a multi-turn task) from ``engine``, sampled at
    ``temperature``, scored by the task's rewards: pass@k, avg@k and maj@k of them
    (:func:`grpo_kit.passk.sampled_metrics`; maj@k votes on each score's extracted ``answer``), plus
    ``temperature``, ``sample_truncated`` and ``sample_reward_errors``."""
    if episodes is not None:
        lives = episodes.runner(engine, for_engine(engine), temperature).play(probs, samples, version, seed=seed)
        outs = [to_rollout(lv.ep) for lv in lives]
        scores = score_episodes(scorer, [probs[r.group_id] for r in outs], lives, [r.to_dict() for r in outs],
                                state=scorer.progress(version, version, "eval"))
    else:
        outs = engine.generate(probs, samples, version, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        scores = scorer.score_problems([probs[r.group_id] for r in outs], [r.text for r in outs],
                                       completion_ids=[r.completion_ids for r in outs],
                                       state=scorer.progress(version, version, "eval"))
    where = [(r.group_id, r.sample_idx) for r in outs]
    if sorted(where) != [(g, j) for g in range(len(probs)) for j in range(samples)]:
        raise RuntimeError(f"sampled evaluation: expected {samples} samples of each of {len(probs)} problems")
    correct = [[False] * samples for _ in probs]
    answers: list[list] = [[None] * samples for _ in probs]
    for (g, j), sc in zip(where, scores, strict=True):
        correct[g][j], answers[g][j] = sc.correct, sc.answer
    return {**sampled_metrics(correct, answers), "temperature": temperature,
            "sample_truncated": sum(r.truncated for r in outs),
            "sample_reward_errors": sum(sc.errors for sc in scores)}


class TasksLost(RuntimeError):
    """A task's workers died more often than ``RunConfig.max_task_failures`` resubmissions allow."""


class TaskRetries:
    """The driver's collection of rollout, reward, summary and eval results: futures that ended in
    ``KilledWorker`` (the scheduler gave up after ``allowed-failures`` workers died running the task)
    are resubmitted with ``Client.retry`` (the task and its erred dependencies, under the same keys,
    so futures held elsewhere, e.g. a batch's scored chunks, stay valid), at most ``max_failures``
    times per task, then :class:`TasksLost`. These tasks are seeded and idempotent, so a retry
    reproduces the result. Dask does not reset a task's count of lost workers on a retry: after its
    first ``KilledWorker``, each further worker lost while running it is one resubmission.

    ``Client.retry`` needs the client to hold a future of every task it retries, the erred
    dependencies included: :meth:`hold` keeps those (a chunk's rollout task, under its scored chunk
    and summary) for as long as the chunk may be trained on (:meth:`release_before`)."""

    def __init__(self, client: Client, max_failures: int):
        self.client, self.max_failures = client, max_failures
        self.failures: dict[str, int] = {}  # resubmissions per task key
        self.resubmitted = 0  # in all
        self._taken = 0
        self._held: dict[int, list] = {}  # iteration -> futures of upstream tasks its chunks depend on

    def hold(self, iteration: int, upstream: list) -> None:
        """Keep ``upstream`` (futures the driver does not otherwise hold, which its chunks of
        ``iteration`` depend on) until :meth:`release_before` passes ``iteration``."""
        self._held.setdefault(iteration, []).extend(upstream)

    def release_before(self, iteration: int) -> None:
        """Drop the futures held for iterations before ``iteration`` (their chunks are trained or dropped)."""
        for it in [i for i in self._held if i < iteration]:
            del self._held[it]

    def retry_lost(self, futures: list) -> int:
        """Resubmit those of ``futures`` that ended in ``KilledWorker``; returns how many."""
        lost = [f for f in futures if f.status == "error" and isinstance(f.exception(), KilledWorker)]
        for f in lost:
            n = self.failures[f.key] = self.failures.get(f.key, 0) + 1
            if n > self.max_failures:
                raise TasksLost(f"task {f.key} lost its workers after {n - 1} resubmissions "
                                f"(max_task_failures={self.max_failures}): {f.exception()!r}") from f.exception()
        if lost:
            log.warning("resubmitting %d task(s) whose workers died (KilledWorker): %s", len(lost),
                        [f.key for f in lost])
            self.client.retry(lost)
            self.resubmitted += len(lost)
        return len(lost)

    def gather(self, futures: list) -> list:
        """``client.gather(futures)``, resubmitting what ends in ``KilledWorker`` (:meth:`retry_lost`)."""
        while True:
            try:
                return self.client.gather(futures)
            except KilledWorker:
                if not self.retry_lost(futures):
                    raise

    def take(self) -> int:
        """Resubmissions since the last call (a metrics record's ``task_resubmits``)."""
        n, self._taken = self.resubmitted - self._taken, self.resubmitted
        return n


def problem_dict(p: Problem) -> dict:
    return {"id": p.id, "question": p.question, "gold": p.gold, "solution": None, "columns": dict(p.columns),
            "messages": p.messages}
