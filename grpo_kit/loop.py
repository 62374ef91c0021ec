"""The pipelined GRPO driver: generate, score, filter by staleness, train, publish, evaluate.

With ``pipelined=True`` generation of batch N+1 is submitted (with the newest published adapter)
*before* the driver waits for training on batch N, so the two overlap on disjoint workers; up to
``RunConfig.depth`` batches are in flight. With ``staleness_policy="pace"`` (default) the depth is
at most ``max_staleness``, so no batch is ever too stale; with ``"discard"`` generation may run
further ahead, each chunk sampling from the newest adapter published when it starts on a worker,
and a batch more than ``max_staleness`` versions behind when its turn comes is dropped, counted in
``rejected_groups`` and generated again from the current adapter.
``pipelined=False`` runs the same work in order.

Each iteration is four steps (``_Driver.loop``): *assemble* the batch (regenerating a too-stale one,
submitting the next ones, dynamic sampling's top-up), *train* (one trainer-gang step: rank 0
publishes adapter ``v+1`` and its optimizer state to the store; with ``RunConfig.train_ahead`` the
step was submitted with its batch's generation, chained after the step before, and the driver
waits for it here), *record* (the metrics record,
:mod:`grpo_kit.metrics`) and *publish* (the record appended to ``<run_dir>/metrics.jsonl``, the run
state written: :mod:`grpo_kit.checkpoint`, which also holds ``run(..., resume=True)``).

Seeds derive from (run seed, iteration, group), so a retried rollout task reproduces its batch.

Token ids and log-probs never pass through the driver: it gathers each scored chunk's summary
(:class:`~grpo_kit.rollout.RolloutSummary`: rewards, counts, finish reasons, texts), records it
(``rollouts.jsonl`` holds the summaries), and hands the trainer gang the scored chunks' futures,
which every rank fetches from the rollout workers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import algorithms, checkpoint, evals, logs, preflight, remote, tasks
from . import cluster as cl
from .adapters import AdapterStore
from .config import Config
from .episode import EpisodePlan
from .gang import RolloutBatch, StepHandle, TrainerGang, all_picks, batch_of
from .metrics import Batch, Step, WrongPolicyWarning, iteration_record, run_summary, wrong_policy_warning
from .models import resolve_model
from .records import MetricsRecord, append_jsonl, run_files, samples_of, write_jsonl
from .retention import Pruner
from .rollout import RolloutSummary
from .sampling import Group, extra_prompts, groups_of, select_groups, summaries_of
from .tasks import Task
from .trackers import TrackerSet
from .trainer import RankSpec


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("-".join(map(str, parts)).encode()).digest()[:4], "little")


def iteration_problems(cfg: Config, pool: list, iteration: int, round_: int = 0, n: int | None = None) -> list:
    """The prompts of ``iteration``'s batch, drawn from the training ``pool`` with a seed of (run seed,
    iteration): a resumed run and a benchmark comparing against another trainer see the same ones.
    Dynamic sampling's extra rounds (``round_`` >= 1) draw ``n`` from their own seed (they may repeat
    an earlier round's prompt). An over-sampled ``n`` larger than the pool takes the whole pool."""
    parts = (cfg.run.seed, "prompts", iteration) + ((round_,) if round_ else ())
    return random.Random(_seed(*parts)).sample(pool, min(len(pool), n or cfg.sampling.prompts_per_step))


@dataclass
class _Pending:
    version: int
    """The version the batch was submitted with (``staleness_policy="discard"``: the oldest its
    chunks may sample from; each takes the newest published when it starts)."""
    futures: list
    """Futures of the chunks' summaries (:func:`remote.summary_task`): what the driver gathers."""
    scored: list = field(default_factory=list)
    """Futures of the scored chunks (token ids and log-probs): they stay on the workers."""
    n: int | None = None
    """Prompts drawn (None: ``prompts_per_step``); dynamic sampling over-samples."""


@dataclass
class RunResult:
    run_dir: Path
    records: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def run(
    cfg: Config,
    client=None,
    store: AdapterStore | None = None,
    callbacks: Iterable[Callable[[dict], None]] = (),
    *,
    resume: bool = False,
    storage_options: dict | None = None,
    progress: bool = True,
    task: Task | None = None,
    policy_loss: Callable | None = None,
    advantage: Callable | None = None,
    worker_logs: bool = True,
    eval_sets: Mapping[str, Task | str | dict] | None = None,
) -> RunResult:
    """Run ``cfg.run.iterations`` GRPO iterations on a Dask cluster; returns records and summary.

    ``client``: an existing ``distributed.Client`` (None connects to ``cfg.cluster.scheduler_address``
    or starts a LocalCluster sized by ``cfg.cluster``, and closes it at the end). ``store``: the
    adapter store (default ``AdapterStore(cfg.run.store_root, storage_options)``); trainers and
    engines open the same root with the same options. ``callbacks`` are called with every record;
    ``cfg.run.report_to`` names the experiment trackers (:mod:`grpo_kit.trackers`) it also goes to.
    ``task``: a :class:`~grpo_kit.tasks.Task` (e.g. rows and reward functions from a notebook cell);
    None uses the one ``cfg.data.task`` names.
    ``policy_loss``/``advantage``: a function (e.g. from a notebook cell) that replaces the policy loss
    or advantage estimator ``cfg`` names, with the contract of :mod:`grpo_kit.algorithms`; it travels
    to the trainer ranks by cloudpickle and ``config.json`` records it as ``module:qualname``.
    ``worker_logs``: send the output of every worker of a cluster this process started (a LocalCluster,
    the run's own or the client's; a Slurm cluster object), now and later ones, to
    ``<run_dir>/logs/<worker>.log`` (:func:`grpo_kit.logs.route_worker_logs`; errors still show here).
    False leaves it where it goes (a LocalCluster's workers print under the running cell). Workers of
    a scheduler the client joined by address keep their output where they were started (call
    ``route_worker_logs`` for them on a shared file system).
    ``eval_sets``: more held-out sets by name, as ``DataConfig.eval_sets`` takes them or as Task
    objects (added to those the config names; see :func:`grpo_kit.evals.eval_set_tasks`).
    One run at a time per cluster: a run registers its engines on every rollout worker.
    """
    from tqdm.auto import tqdm

    cfg = cfg.override(**{k: algorithms.reference(fn) for k, fn in (("policy_loss", policy_loss),
                                                                    ("advantage", advantage)) if fn is not None})
    message = algorithms.stale_clip_warning(cfg.loss, cfg.run.depth)
    if message:
        warnings.warn(message, UserWarning, stacklevel=2)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = store or AdapterStore(cfg.run.store_root, storage_options)
    storage_options = store.storage_options
    model_path = resolve_model(cfg.model.model, progress=progress)  # before any cluster: a bad name fails at once
    task = tasks.for_config(cfg, task)  # so do a bad task, dataset or column
    tracking = TrackerSet.for_names(cfg.run.report_to)  # and an unknown tracker name
    train_pool = task.load("train", cfg.data.train_size, cfg.run.seed)
    if len(train_pool) < cfg.sampling.prompts_per_step:  # before any cluster: else the first batch fails, minutes in
        raise ValueError(f"task {task.name!r} has {len(train_pool)} training problems (train_size="
                         f"{cfg.data.train_size}), fewer than prompts_per_step={cfg.sampling.prompts_per_step}: "
                         "lower prompts_per_step or give the task more rows")
    heldout = task.load("heldout", cfg.data.eval_size, 0)
    more_sets = evals.eval_set_tasks(cfg, task, eval_sets)
    more_heldout = {n: [remote.problem_dict(p) for p in t.load("heldout", cfg.data.eval_size, 0)] for n, t in more_sets.items()}
    files = run_files(run_dir)
    metrics_path, samples_path = files.metrics, files.samples
    run_id = checkpoint.run_id_for(cfg, store.root, task)  # before any cluster: a config JSON refuses fails here
    own_client = client is None
    if own_client:
        client = cl.connect(
            cfg.cluster.scheduler_address,
            n_rollout_workers=cfg.cluster.n_rollout_workers,
            n_trainer_workers=cfg.cluster.world_size,
            n_reward_workers=cfg.cluster.n_reward_workers,
            n_eval_workers=cfg.cluster.n_eval_workers,
            threads_per_worker=cfg.cluster.threads_per_worker,
            quiet=not progress,
        )
    gang = driver = None

    try:
        if worker_logs and client.cluster is not None:  # before the engines: their start-up output goes there too
            logs.route_worker_logs(client, logs.run_log_dir(run_dir), quiet=not progress)
        state, records = checkpoint.restore(store, run_id, files, resume, checkpoint.rows_digest(train_pool))
        files.config.write_text(json.dumps({**cfg.to_dict(), "task": task.describe(),
                                            **({"eval_sets": {n: t.describe() for n, t in more_sets.items()}}
                                               if more_sets else {})}, indent=1))

        t_warm = time.time()  # rollout workers start building their engines when the plugin arrives
        if progress:
            print("warming up: building rollout engines and trainer policies ...", flush=True)
        remote.register_engines(client, cfg, model_path, store.root, storage_options, instruction=task.instruction)
        tracking.start_run(run_dir, cfg.flat(), resumed=resume)  # its imports overlap the engines' build
        for rec in checkpoint.rebuilt_tail(records):  # published, but never recorded nor logged
            tracking.on_record(rec)
        cl.wait_for_role(client, cl.ROLLOUT, 1)
        spec = RankSpec.for_run(cfg, run_id, model_path, store.root, storage_options, multi_turn=task.multi_turn,
                                policy_loss=policy_loss, advantage=advantage)
        gang = TrainerGang(client, spec, max_restarts=cfg.cluster.max_restarts)
        fabric = None
        if cfg.cluster.world_size > 1 and cfg.cluster.preflight_sizes:  # before hours are spent on a slow fabric
            c = cfg.cluster  # a rank lost during the sweep re-forms the gang, as after a failed step
            fabric = preflight.sweep_gang(gang, preflight.parse_sizes(c.preflight_sizes),
                                          min_busbw_gbps=c.preflight_min_busbw_gbps, on_slow=c.preflight_on_slow)
            if progress:
                print(f"preflight: all-reduce busbw peak {fabric.busbw_peak_gbps:.2f} GB/s ({fabric.backend}, "
                      f"{fabric.world_size} ranks)", flush=True)

        heldout_d = [remote.problem_dict(p) for p in heldout]
        driver = _Driver(cfg, client, store, gang, train_pool, heldout_d, state, metrics_path, samples_path,
                         list(callbacks), records, task.scorer(cfg.reward.reward_timeout_s, max_steps=cfg.run.iterations), EpisodePlan.of(task, cfg))
        driver.pruner = Pruner(store, cfg.run.keep_versions, cfg.run.keep_every)
        driver.trackers = tracking
        driver.evals.sets += [(n, more_heldout[n], t.scorer(cfg.reward.reward_timeout_s), None) for n, t in more_sets.items()]
        if resume:  # versions a crash (or a run with another policy) left behind
            driver.pruner.sweep(state["version"], driver.busy_versions())
        # engines and policies are built before the first iteration's clock starts
        driver.warm_up_s = remote.warm_up(client, gang, state["version"], driver.key)
        driver.startup_s = time.time() - t_warm
        driver.loop(tqdm(total=cfg.run.iterations, initial=state["next_iteration"], desc="GRPO", disable=not progress))
        summary = driver.finish(preflight=fabric.summary() if fabric else None)
        tracking.finish_run(run_dir)  # the HTML report, as the trackers' artifact
        return RunResult(run_dir, driver.records, summary)
    except BaseException as e:
        tracking.end(error=e)  # a failed or interrupted run's trackers are closed too (no report), marked failed
        raise
    finally:
        tracking.end()  # (done already when it failed)
        try:
            try:
                if driver is not None and driver.uncommitted():  # the run failed or was interrupted
                    _take_back(driver, progress)
            finally:  # (a second interrupt while a step is taken back too: a review)
                if driver is not None:  # its generations ahead would hold the workers a resumed run needs
                    try:
                        driver.abandon()
                    except Exception as e:  # never masking the run's own error
                        warnings.warn(f"could not cancel the generations and evaluations in flight: {e!r}", stacklevel=2)
        finally:  # a second interrupt while a step is waited for still closes the gang and the cluster
            try:
                if gang is not None:
                    gang.close()
            finally:
                if own_client:
                    cl.shutdown(client)


def _take_back(driver: _Driver, progress: bool) -> None:
    """The store must end at the committed version: take back the steps submitted ahead
    (:meth:`_Driver.withdraw_steps`); a failure to is a warning, never masking the run's own error."""
    try:
        taken = driver.withdraw_steps()
    except Exception as e:
        warnings.warn(f"could not take back the training steps submitted ahead: {e!r}; a resumed run adopts any "
                      "version they published (a record rebuilt from the trainer's statistics)", stacklevel=3)
        return
    if taken and progress:
        print(f"took back v{', v'.join(map(str, taken))}: published by training steps the run never committed "
              "(a resumed run trains them again)", flush=True)


class _Driver:
    trackers = TrackerSet()  # the run's experiment trackers (``run`` sets them; none here)

    def __init__(self, cfg, client, store, gang, train_pool, heldout, state, metrics_path, samples_path, callbacks, records,
                 scorer, episodes=None):
        self.cfg, self.client, self.store, self.gang = cfg, client, store, gang
        self.train_pool = train_pool
        self.state, self.metrics_path, self.samples_path = state, metrics_path, samples_path
        self.callbacks, self.records = callbacks, records
        self.pending: dict[int, _Pending] = {}
        self.startup_s: float | None = None  # engines and policies built before the first iteration
        self.warm_up_s: dict = {}  # seconds per engine / rank (remote.warm_up)
        # task keys are unique per run() call: two drivers on one scheduler never share a task
        self.key = f"{state['run_id']}-{os.urandom(3).hex()}"
        s = cfg.sampling
        self.depth = cfg.run.depth
        # training steps submitted with their batch's generation (RunConfig.train_ahead), by iteration
        self.train_ahead = (cfg.run.train_ahead and self.depth > 0 and not s.dynamic_sampling
                            and cfg.run.staleness_policy == "pace")
        self.steps: dict[int, StepHandle] = {}
        self.eval_due: tuple[int, int] | None = None  # (iteration, version) to evaluate once committed
        self.samples: list = []  # the recorded iteration's samples.jsonl entries, for the trackers once committed
        self.chunks = max(1, min(cfg.cluster.n_rollout_workers, s.prompts_per_step))
        self.scorer = scorer
        self.episodes = episodes  # a multi-turn task's EpisodePlan (its chunks are scored on the rollout worker)
        self.episode_kw = {"episodes": episodes, "scorer": scorer} if episodes is not None else {}
        # scoring runs on workers with the reward resource where there are any, else in the rollout task
        self.reward_resources = {cl.REWARD: 1} if cl.workers_with(client, cl.REWARD) else None
        self.retries = remote.TaskRetries(client, cfg.run.max_task_failures)  # resubmits what KilledWorker ends
        self.waited: list = []  # the futures being waited for (out of self.pending): cancel_pending's too
        # held-out evaluations: the task's own set here, the run's other sets added by run()
        self.evals = evals.Evaluations(client, cfg, self.key, [(None, heldout, scorer, episodes)], self.retries,
                                       seed=_seed(cfg.run.seed, "eval"))
        self.carry: list[Group] = []  # dynamic sampling: usable groups for the next batch
        self.carry_for = state["next_iteration"]  # the iteration the carry goes into
        self.carry_specs: list[dict] = []  # where each carried group's chunk came from (the run state keeps them)
        # dynamic sampling: usable and all groups generated so far (checkpointed: the over-sampling reads it)
        self.groups_seen = list(state.get("groups_seen") or [0, 0])
        # batches in flight when the run state was written: a resumed run submits them as they were
        self.resumed_pending: dict = dict(state.get("pending") or {})

    # ------------------------------------------------------------------ submission
    def problems_for(self, iteration: int, round_: int = 0, n: int | None = None):
        return iteration_problems(self.cfg, self.train_pool, iteration, round_, n)

    def rollout_version(self, iteration: int) -> int:
        """The adapter version that generates ``iteration``'s batch. Pacing: the trainer's version
        ``depth`` iterations earlier, when generation is submitted in an uninterrupted run (a resumed
        run submits its pending batches with the versions the run state saved for them, this as a
        fallback). Discarding: the newest version now, the oldest the batch may use: each chunk
        samples from the newest version published when it starts on a rollout worker (``newest``)."""
        if self.cfg.run.staleness_policy == "discard":
            return self.state["version"]
        return min(self.state["version"], max(0, iteration - self.depth))

    @property
    def newest(self) -> bool:
        """Whether rollout chunks take the newest published version when they start (discarding)."""
        return self.cfg.run.staleness_policy == "discard"

    def submit_generation(self, iteration: int, version: int | None = None, priority: int = 0) -> None:
        if iteration in self.pending or iteration >= self.cfg.run.iterations:
            return
        saved = self.resumed_pending.pop(str(iteration), None) if version is None else None
        version = saved["version"] if saved else self.rollout_version(iteration) if version is None else version
        s, n = self.cfg.sampling, None
        if saved:
            n = saved["n"]
        elif s.dynamic_sampling:  # over-sample by the usable share so far: this generation overlaps training
            # the usable groups still needed beyond those carried into this batch (at least one prompt)
            need = max(1, s.prompts_per_step - (len(self.carry) if iteration == self.carry_for else 0))
            n = extra_prompts(need, self.usable_share_seen(), s.prompts_per_step * s.max_gen_batches)
        self.pending[iteration] = _Pending(version, *self.submit_round(iteration, 0, version, n, priority), n=n)

    def usable_share_seen(self, fresh: list[Group] = ()) -> float | None:
        """Share of the groups generated so far (and ``fresh``) that had reward spread; None before any."""
        usable, seen = self.groups_seen[0] + sum(g.has_spread for g in fresh), self.groups_seen[1] + len(fresh)
        return usable / seen if seen else None

    def submit_round(self, iteration: int, round_: int, version: int, n: int | None = None,
                     priority: int = 0) -> tuple[list, list]:
        """One generation round, split over the rollout workers present now (at least
        ``n_rollout_workers`` chunks: workers that joined mid-run get a share from here on). Returns the
        futures of the chunks' summaries (what the driver gathers) and of the scored chunks (which stay
        on the workers until the trainer ranks fetch them)."""
        s = self.cfg.sampling
        probs = self.problems_for(iteration, round_, n)
        live = len(cl.workers_with(self.client, cl.ROLLOUT))
        per = math.ceil(len(probs) / max(1, min(len(probs), max(self.chunks, live))))
        offset = round_ * s.prompts_per_step * s.max_gen_batches  # distinct group ids (and seeds) per round
        futures, scored = [], []
        for c in range(0, len(probs), per):
            tag = f"{iteration}-{c}" + (f"-r{round_}" if round_ else "") + f"-v{version}"
            summary, sc = self.submit_chunk(probs[c : c + per], iteration, version, offset + c, tag, priority)
            futures.append(summary)
            scored.append(sc)
        return futures, scored

    def submit_chunk(self, probs, iteration: int, version: int, group_offset: int, tag: str,
                     priority: int = 0, newest: bool | None = None) -> tuple:
        """One chunk's tasks: its generation on a rollout worker, its scoring (on a reward worker where
        there are any; else in the generation task itself, one scheduler round trip fewer) and its
        summary. ``newest``: sample the newest version when it starts (default: :attr:`newest`).
        Returns the futures of the summary and of the scored chunk."""
        s = self.cfg.sampling
        chunk = [remote.problem_dict(p) for p in probs]
        gen = self.client.submit(
            remote.rollout_task, chunk, s.group_size, version, s.max_new_tokens, s.temperature,
            _seed(self.cfg.run.seed, iteration), group_offset, iteration,
            newest=self.newest if newest is None else newest,
            **(self.episode_kw or ({"scorer": self.scorer} if self.reward_resources is None else {})),
            key=f"{self.key}-rollout-{tag}", resources={cl.ROLLOUT: 1}, retries=2, priority=priority,
        )
        scored = gen
        if self.reward_resources is not None and self.episodes is None:  # episodes are scored where they live
            scored = self.client.submit(remote.reward_task, gen, chunk, group_offset, self.scorer,
                                        key=f"{self.key}-reward-{tag}", resources=self.reward_resources,
                                        retries=2, priority=priority)
        summary = self.client.submit(remote.summary_task, scored, key=f"{self.key}-summary-{tag}", retries=2,
                                     priority=priority)
        self.retries.hold(iteration, [gen])  # so that a KilledWorker in the chain can be resubmitted
        return summary, scored

    def fill_usable(self, it: int, results: list[dict], scored: list, n0: int | None = None
                    ) -> tuple[list[dict], list[Group], dict]:
        """Dynamic sampling: this batch's usable groups plus the carried ones, topped up by extra
        generation rounds (at the current version, ahead of queued work), up to ``max_gen_batches *
        prompts_per_step`` prompts in all.
        Returns every round's summaries, the groups to train on, and the counts for the record."""
        s, version = self.cfg.sampling, self.state["version"]
        fresh = groups_of(results, scored, s.group_size)
        carried = len(self.carry)
        # where each group's chunk came from: a resumed run regenerates the carried ones from it
        specs = {g.payload[0][1].key: spec for g, spec in zip(self.carry, self.carry_specs, strict=True)}
        specs.update(self.chunk_specs(it, 0, n0, results, scored))
        sel = select_groups(self.carry, fresh, s.prompts_per_step, version, self.cfg.run.max_staleness)
        rounds, bound = 1, s.prompts_per_step * s.max_gen_batches
        while len(sel.train) < s.prompts_per_step and len(fresh) < bound:
            n = extra_prompts(s.prompts_per_step - len(sel.train), self.usable_share_seen(fresh), bound - len(fresh))
            more_f, more_scored = self.submit_round(it, rounds, version, n, priority=10)
            more = self.gather(more_f, more_scored)
            results = results + more
            fresh += groups_of(more, more_scored, s.group_size)
            specs.update(self.chunk_specs(it, rounds, n, more, more_scored))
            rounds += 1
            sel = select_groups(self.carry, fresh, s.prompts_per_step, version, self.cfg.run.max_staleness)
        self.groups_seen[0] += sum(g.has_spread for g in fresh)
        self.groups_seen[1] += len(fresh)
        self.carry, self.carry_for = sel.carry, it + 1
        self.carry_specs = [{**specs[g.payload[0][1].key], "group_id": g.payload[0][0].group_id, "version": g.version}
                            for g in sel.carry]
        counts = {"gen_batches": rounds, "dropped_groups": sel.dropped, "carried_in_groups": carried,
                  "carried_out_groups": len(sel.carry), "expired_groups": sel.expired}
        return results, sel.train, counts

    def chunk_specs(self, iteration: int, round_: int, n: int | None, results: list[dict], scored: list) -> dict:
        """What regenerates each of a round's scored chunks (keyed by its future's key): the round's
        prompt draw (iteration, round, count) and the chunk's slice of it. Each chunk holds the
        consecutive groups ``offset + start .. offset + stop - 1`` (:meth:`submit_round`)."""
        s = self.cfg.sampling
        offset = round_ * s.prompts_per_step * s.max_gen_batches
        out = {}
        for res, fut in zip(results, scored, strict=True):
            ids = [r["group_id"] for r in res["rollouts"]]
            out[fut.key] = {"iteration": iteration, "round": round_, "n": n or s.prompts_per_step,
                            "start": min(ids) - offset, "stop": max(ids) + 1 - offset}
        return out

    def gather(self, futures: list, scored: list) -> list:
        """The summaries of ``futures`` (:class:`~grpo_kit.remote.TaskRetries`), with them and their
        scored chunks where :meth:`cancel_pending` finds them while they are waited for (a review:
        the batch being waited for, out of ``pending``, ran on after an interrupt)."""
        self.waited = [*futures, *scored]  # (kept when the wait raises: cancel_pending's then)
        out = self.retries.gather(futures)
        self.waited = []
        return out

    def restore_carry(self) -> None:
        """Resume: the carried groups of the run state, regenerated chunk by chunk as they were first
        generated (same prompts, seed, group ids and adapter version, so the same completions and
        rewards) on the rollout workers, where the trainer ranks fetch them from."""
        entries, s = list(self.state.get("carry") or []), self.cfg.sampling
        chunks: dict[tuple, tuple] = {}
        for e in entries:
            k = (e["iteration"], e["round"], e["start"], e["version"])
            if k in chunks:
                continue
            offset = e["round"] * s.prompts_per_step * s.max_gen_batches
            probs = self.problems_for(e["iteration"], e["round"], e["n"])[e["start"] : e["stop"]]
            tag = f"carry-{e['iteration']}-r{e['round']}-{e['start']}-v{e['version']}"
            # the version it was first sampled from, never a newer one
            chunks[k] = self.submit_chunk(probs, e["iteration"], e["version"], offset + e["start"], tag, newest=False)
        summaries = dict(zip(chunks, self.gather([f for f, _ in chunks.values()], [s for _, s in chunks.values()]),
                             strict=True))
        by = {(k, g.payload[0][0].group_id): g for k, (_, scored) in chunks.items()
              for g in groups_of([summaries[k]], [scored], s.group_size)}
        self.carry = [by[((e["iteration"], e["round"], e["start"], e["version"]), e["group_id"])] for e in entries]
        self.carry_specs = entries

    def busy_versions(self) -> set[int]:
        """Adapter versions the run still needs besides the policy's: those of batches in flight,
        pending evaluations and carried groups (a lost chunk is recomputed from its version), and
        those the run state names for a resumed run (its pending batches, evaluations and carried
        groups)."""
        busy = {p.version for p in self.pending.values()} | self.evals.versions()
        busy |= {g.version for g in self.carry}
        busy |= {p["version"] for p in (self.state.get("pending") or {}).values()}
        busy |= {v for _, v in self.state.get("evals_pending") or []}  # a resumed run evaluates them
        return busy | {e["version"] for e in self.state.get("carry") or []}

    def collect_evals(self, block: bool = False) -> list[dict]:
        """The evaluations finished now (``block``: all), into the run state (the first of version 0
        is the base accuracy)."""
        done = self.evals.collect(block)
        for res in done:
            self.state["evals"].append(res)
            if res["version"] == 0 and self.state["base_acc"] is None and "set" not in res:
                self.state["base_acc"] = res["acc"]
                self.state["base_lenient_acc"] = res.get("lenient_acc")
        return done

    # ------------------------------------------------------------------ the loop
    def loop(self, bar) -> None:
        cfg = self.cfg
        start = self.state["next_iteration"]
        self.session_start, self.wall_base = time.time(), self.state["grpo_wall_s"]
        if self.state.get("carry"):  # resumed with dynamic sampling's carry-over
            self.restore_carry()
        self.submit_generation(start)
        if cfg.run.eval_every > 0:  # those a stopped run left pending (saved with its commits), and the base's
            for it, version in self.state.get("evals_pending") or []:  # on the sets without a result for it
                missing = self.evals.missing(version, self.state["evals"])
                if missing and version not in self.evals.versions():
                    self.evals.submit(it, version, only=missing)
            if self.state["base_acc"] is None and 0 not in self.evals.versions():
                self.evals.submit(-1, 0)
        for it in range(start, cfg.run.iterations):
            batch = self.assemble(it)
            step = self.train(batch)
            rec = self.record(batch, step)
            self.publish(rec, bar)
            if self.depth == 0:  # in order: the next batch is generated by the adapter this step published,
                self.submit_generation(it + 1)  # once committed: an interrupt before then takes it back

    def assemble(self, it: int) -> Batch:
        """Wait for ``it``'s batch (generating it again if it is too stale), submit the next batches
        (pipelining: before this one trains) and, with dynamic sampling, top it up to usable groups."""
        cfg, s = self.cfg, self.cfg.sampling
        t_iter = time.time()
        pend = self.pending.pop(it)
        results = self.gather(pend.futures, pend.scored)
        pend.version = sampled_version(results, pend.version)
        rejected, discarded = 0, []
        if self.state["version"] - pend.version > cfg.run.max_staleness:
            # too stale (staleness_policy="discard"): drop it, generate it again from the current adapter,
            # ahead of the batches generated ahead (which queued first: they would delay it, and go stale)
            discarded = results
            rejected = len(summaries_of(results)) // s.group_size  # dynamic sampling may have over-sampled
            self.submit_generation(it, version=self.state["version"], priority=10)
            pend = self.pending.pop(it)
            results = self.gather(pend.futures, pend.scored)
            pend.version = sampled_version(results, pend.version)
        t_gen_done = time.time()
        ahead = range(it + 1, it + 1 + self.depth)  # pipelining: the next batches, submitted before we train
        if not cfg.sampling.dynamic_sampling:
            self.submit_step(it, pend)
            for j in ahead:
                self.submit_generation(j)
                self.submit_step(j, self.pending.get(j))
        picked = dyn = None
        if cfg.sampling.dynamic_sampling:
            results, picked, dyn = self.fill_usable(it, results, pend.scored, pend.n)
            t_gen_done = time.time()
            for j in ahead:  # after the selection: the next batch's over-sampling counts the groups carried
                # into it (the batch right after this one; deeper ones were submitted before their carry was known)
                self.submit_generation(j)
        # the batch to train on (``picked``: dynamic sampling's usable groups; None: all of ``results``)
        rollouts = summaries_of(results)
        if picked is None:
            generated = groups_of(results, pend.scored, s.group_size)
            want = [(g, i) for g in range(s.prompts_per_step) for i in range(s.group_size)]
            if [(r.group_id, r.sample_idx) for r in rollouts] != want:
                raise RuntimeError(f"iteration {it}: rollouts do not form {s.prompts_per_step} complete groups of {s.group_size}")
            picked = generated
        else:
            generated = groups_of(results, None, s.group_size)
        version = self.state["version"]
        lags = [version - g.version for g in picked] or [version - pend.version]
        lag = max(lags)
        if lag > cfg.run.max_staleness:  # the loop regenerates too-stale batches before they get here
            raise RuntimeError(f"iteration {it}: a batch {lag} versions behind reached the trainer (max_staleness "
                               f"{cfg.run.max_staleness})")
        return Batch(it, pend.version, results, rollouts, generated, picked, lags, rejected, dyn, t_iter, t_gen_done,
                     self.retries.take(), discarded)

    def submit_step(self, iteration: int, pend: _Pending | None) -> None:
        """Train ahead (``RunConfig.train_ahead``): submit ``iteration``'s step on all of its batch, after
        the step before it (queued or running) or, for the current iteration, now. Its version is the
        one the step before publishes: every step of such a run trains (no dynamic sampling)."""
        if not self.train_ahead or pend is None or iteration in self.steps:
            return
        after = self.steps.get(iteration - 1)
        if after is None and iteration != self.state["next_iteration"]:
            return  # the step before it has not been submitted: no place in the chain yet
        if after is not None and after.gang_id != self.gang.gang_id:
            return  # queued on a gang re-formed since: it goes again in its turn, and this one after it
        version = after.version + 1 if after is not None else self.state["version"]
        batch = RolloutBatch(pend.scored, None, self.cfg.sampling.group_size)
        self.steps[iteration] = self.gang.submit(batch, version, iteration, after=after)

    def committed(self) -> int:
        """The version the run state in the store names (read there: an interrupt may land after it is
        written, before the driver goes on); if it cannot be read, the newest in the store (nothing
        is taken back)."""
        try:
            return self.store.read_json(checkpoint.RUN_STATE)["version"]
        except (OSError, ValueError, KeyError):
            return max(self.store.versions(), default=0)

    def uncommitted(self) -> bool:
        """Whether steps were submitted and not waited for, or a version published and not committed."""
        return bool(self.steps) or self.state["version"] > self.committed()

    def withdraw_steps(self) -> list[int]:
        """Take back what the run did not commit (the driver stops): the training steps submitted and
        not waited for, and the versions published past the run state's (:meth:`TrainerGang.withdraw`),
        so that a resumed run trains those iterations again from the same seeds with full records.
        Kept: a version a generation in flight was submitted with (sequential runs submit the next
        batch before the commit), and, when chunks sample the newest version (``discard``), every
        one: an engine may hold it, and a re-trained version of the same number must not meet a
        stale copy. A resumed run adopts those. Returns the versions deleted."""
        if not self.uncommitted():
            return []
        handles = list(self.steps.values())
        self.steps.clear()
        committed = self.committed()
        read = [v for v in self.busy_versions() if v > committed]
        return self.gang.withdraw(handles, self.store, max([committed, *read]), delete=not self.newest)

    def train(self, batch: Batch) -> Step:
        """One step of the trainer gang on ``batch`` (rank 0 publishes the next adapter version); then
        the evaluation of that version is submitted when one is due."""
        cfg, it = self.cfg, batch.iteration
        version = self.state["version"]
        # by reference: the ranks fetch the tokens and take the advantages from the same rewards
        rollout_batch = batch_of(batch.picked, cfg.sampling.group_size)
        t_train = time.time()
        handle = self.steps.get(it)
        if handle is not None:  # submitted ahead, on every completion of the batch: check that is the one picked
            if (handle.version != version or [f.key for f in handle.batch.scored] != [f.key for f in rollout_batch.scored]
                    or all_picks(batch.results) != rollout_batch.picks):
                raise RuntimeError(f"iteration {it}: the step submitted ahead (from v{handle.version}) is not the "
                                   f"batch the driver picked (from v{version})")
            ahead = True
        elif rollout_batch:
            handle = self.steps[it] = self.gang.submit(rollout_batch, version, it)
            ahead = False
        stats = {}
        if handle is not None:  # popped once waited for: a driver stopping while it waits takes it back
            stats = self.gang.finish(handle, self.store, retries=self.retries)
            self.steps.pop(it)
        t_train_end = time.time()
        if handle is not None and ahead and stats.get("ranks"):  # it ran on its own clock, not the driver's:
            t_train = min([t_train] + [r["start"] for r in stats["ranks"]])  # it may have started before the wait,
            t_train_end = min(t_train_end, max(r["end"] for r in stats["ranks"]))  # and ended before the driver looked
        self.retries.release_before(it - self.depth - cfg.run.max_staleness)  # carried groups may still train
        self.state["version"] = version + 1 if rollout_batch else version
        if rollout_batch and cfg.run.eval_every and ((it + 1) % cfg.run.eval_every == 0):
            self.eval_due = (it, self.state["version"])  # submitted once committed: no engine reads it before
        return Step(stats, bool(rollout_batch), t_train, t_train_end)

    def record(self, batch: Batch, step: Step) -> MetricsRecord:
        """The iteration's metrics record; a few of its completions go to ``samples.jsonl`` (and all to
        ``rollouts.jsonl`` every ``rollouts_every`` iterations)."""
        rec = iteration_record(self.cfg, batch, step, self.state["version"], self.state["base_acc"],
                               self.gang.restarts)
        self.samples = self._write_samples(batch.iteration, batch.rollouts)  # to the trackers once committed
        return rec

    def publish(self, rec: MetricsRecord, bar) -> None:
        """Commit the iteration: attach finished evaluations, append the record, write the run state,
        hand the record and its samples to the trackers (only now: a resumed run trains an uncommitted
        iteration again, and its rows must not reach a tracker twice), apply retention, call the callbacks."""
        for res in self.collect_evals():
            evals.attach(rec, res)
        if errors := self.evals.take_errors():
            rec["eval_errors"] = errors
        rec["base_acc"] = self.state["base_acc"]
        # wall time of the loop itself, summed over resumed sessions: everything on the critical
        # path (dispatch, I/O, callbacks), unlike iter_s which ends when the record is complete
        self.state["grpo_wall_s"] = self.wall_base + (time.time() - self.session_start)
        rec["grpo_wall_s"] = self.state["grpo_wall_s"]
        message = wrong_policy_warning(rec, self.records[-1] if self.records else None)
        if message:
            warnings.warn(message, WrongPolicyWarning, stacklevel=2)
        self.records.append(rec)
        append_jsonl(self.metrics_path, [rec])
        self.state["next_iteration"] = rec["iteration"] + 1
        self.state.update(checkpoint.resume_fields(self.groups_seen, self.carry_specs,
                                                   {j: (p.version, p.n) for j, p in self.pending.items()}))
        # evaluations still to come (the due one included): a resumed run submits them again
        self.state["evals_pending"] = sorted({*self.evals.due(), *([self.eval_due] if self.eval_due else [])})
        checkpoint.save_state(self.store, self.state)
        self.trackers.add_samples(self.samples)
        self.samples = []
        self.trackers.on_record(rec)  # before the callbacks: one that stops the run leaves nothing unlogged
        if self.eval_due is not None:
            self.evals.submit(*self.eval_due)
            self.eval_due = None
        self.prune()
        for cb in self.callbacks:
            cb(rec)
        bar.update(1)
        bar.set_postfix(reward=_fmt(rec['reward_mean']), acc=_fmt(self.last_eval()), v=rec["version"])

    def last_eval(self):
        evs = [e for e in self.state["evals"] if e["version"] > 0 and "set" not in e]
        return evs[-1]["acc"] if evs else None

    def prune(self) -> None:
        """Retention (:mod:`grpo_kit.retention`) after a committed iteration; batches in flight,
        pending evaluations and carried groups keep their versions (:meth:`busy_versions`)."""
        pruner = getattr(self, "pruner", None)
        if pruner is not None:
            pruner.after_commit(self.state["version"], self.busy_versions())

    def _write_samples(self, it: int, rollouts: list[RolloutSummary]) -> list:
        every = self.cfg.run.rollouts_every
        if every and it % every == 0:
            append_jsonl(self.samples_path.with_name("rollouts.jsonl"), (r.to_dict() for r in rollouts))
        samples = samples_of(it, rollouts)
        append_jsonl(self.samples_path, samples)
        return samples

    def cancel_pending(self) -> None:
        """Cancel the generations in flight (batches submitted ahead) and let go of the futures held for
        their retries; what they would have produced is regenerated by a resumed run."""
        futures = [f for p in self.pending.values() for f in p.futures + p.scored] + self.waited
        self.pending.clear()
        self.waited = []
        if futures:
            self.client.cancel(futures)
        self.retries.release_before(1 << 62)

    def abandon(self) -> None:
        """A failed or interrupted run: :meth:`cancel_pending`, and cancel the evaluations still running
        and let go of the carried groups' chunks (the run state names both: a resumed run submits the
        evaluations again and regenerates the chunks), which would otherwise hold engine slots and
        worker memory for as long as the driver is referenced (a notebook's traceback)."""
        self.cancel_pending()
        self.evals.cancel()
        self.carry, self.carry_specs = [], []

    def finish(self, preflight: dict | None = None) -> dict:
        """Final evaluation (blocking), summary.json (with the pre-flight sweep's figures, if one ran)."""
        cfg = self.cfg
        self.cancel_pending()
        self.withdraw_steps()  # none in a run that trained every iteration
        final_version = self.state["version"]
        if cfg.run.eval_every and not any(e["version"] == final_version for e in self.state["evals"]):
            if final_version not in self.evals.versions():  # (pending since the iteration that published it)
                # at the iteration that published it (a review: an iteration that trained nothing last, as
                # dynamic sampling's can, put it one or more iterations late in every figure)
                try:
                    made = self.store.manifest(final_version).get("meta", {}).get("iteration") if final_version else -1
                except KeyError:  # (VersionNotFoundError: pruned by hand meanwhile; the run's last iteration then)
                    made = None
                self.evals.submit(made if isinstance(made, int) else cfg.run.iterations - 1, final_version)
        final = self.collect_evals(block=True)
        errors = self.evals.take_errors()
        if (final or errors) and self.records:
            last = self.records[-1]
            for res in final:
                evals.attach(last, res)
            if errors:
                last.setdefault("eval_errors", []).extend(errors)
            last["base_acc"] = self.state["base_acc"]
            write_jsonl(self.metrics_path, self.records)
            self.trackers.on_eval(final, last["iteration"])
        checkpoint.save_state(self.store, self.state)
        summary = run_summary(self.state, self.records, self.gang.restarts, self.startup_s, self.warm_up_s, preflight)
        run_files(self.cfg.run.run_dir).summary.write_text(json.dumps(summary, indent=1))
        return summary


def sampled_version(results: list[dict], default: int) -> int:
    """The oldest adapter version the chunks' rollouts were sampled from (``default`` if none)."""
    return min((r["version"] for res in results for r in res["rollouts"]), default=default)


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"
