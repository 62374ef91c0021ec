"""The pipelined GRPO driver: generate, score, filter by staleness, train, publish, evaluate.

With ``pipelined=True`` generation of batch N+1 is submitted (with the newest published adapter)
*before* the driver waits for training on batch N, so the two overlap on disjoint workers; up to
``RunConfig.depth`` batches are in flight. With ``staleness_policy="pace"`` (default) the depth is
at most ``max_staleness``, so no batch is ever too stale; with ``"discard"`` generation may run
further ahead, and a batch more than ``max_staleness`` versions behind when its turn comes is
dropped, counted in ``rejected_groups`` and generated again from the current adapter.
``pipelined=False`` runs the same work in order.

Every iteration appends a record to ``<run_dir>/metrics.jsonl`` and checkpoints: the trainer's
rank 0 publishes adapter ``v+1`` and its optimizer state to the store, then the driver writes the
run state (``state/run.json``). ``run(..., resume=True)`` continues at the next unfinished
iteration; an iteration whose adapter was published but whose run state was not (the driver died
in between) is recognised from the adapter's manifest and not repeated.

Seeds derive from (run seed, iteration, group), so a retried rollout task reproduces its batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cluster as cl
from .adapters import AdapterStore
from .config import Config
from .data import load_problems
from .loss import group_advantages
from .models import resolve_model
from .retention import Pruner
from .rollout import Rollout
from .trainer import RankSpec

RUN_STATE = "run"


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("-".join(map(str, parts)).encode()).digest()[:4], "little")


@dataclass
class _Pending:
    version: int
    futures: list


@dataclass
class RunResult:
    run_dir: Path
    records: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def _append_jsonl(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a half-written last line from a crash
    return out


def trim_jsonl(path: Path, keep: Callable[[dict], bool]) -> int:
    """Rewrite a JSONL file with the lines for which ``keep(record)`` holds, streaming (a long run's
    ``rollouts.jsonl`` holds hundreds of MB; nothing is read whole). Stops at a half-written last
    line (a crash mid-write). Returns the number of lines kept."""
    if not path.exists():
        return 0
    tmp = path.with_name(path.name + ".trim")
    kept = 0
    with open(path) as src, open(tmp, "w") as dst:
        for line in src:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            if keep(rec):
                dst.write(line if line.endswith("\n") else line + "\n")
                kept += 1
    os.replace(tmp, path)
    return kept


def run(
    cfg: Config,
    client=None,
    store: AdapterStore | None = None,
    callbacks: Iterable[Callable[[dict], None]] = (),
    *,
    resume: bool = False,
    storage_options: dict | None = None,
    progress: bool = True,
) -> RunResult:
    """Run ``cfg.run.iterations`` GRPO iterations on a Dask cluster; returns records and summary.

    ``client``: an existing ``distributed.Client`` (None connects to ``cfg.cluster.scheduler_address``
    or starts a LocalCluster sized by ``cfg.cluster``, and closes it at the end). ``store``: the
    adapter store (default ``AdapterStore(cfg.run.store_root, storage_options)``); trainers and
    engines open the same root with the same options. ``callbacks`` are called with every record.
    One run at a time per cluster: a run registers its engines on every rollout worker.
    """
    from tqdm.auto import tqdm

    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = store or AdapterStore(cfg.run.store_root, storage_options)
    storage_options = store.storage_options
    model_path = resolve_model(cfg.model.model, progress=progress)  # before any cluster: a bad name fails at once
    own_client = client is None
    if own_client:
        client = cl.connect(
            cfg.cluster.scheduler_address,
            n_rollout_workers=cfg.cluster.n_rollout_workers,
            n_trainer_workers=cfg.cluster.world_size,
            threads_per_worker=cfg.cluster.threads_per_worker,
            quiet=not progress,
        )
    metrics_path = run_dir / "metrics.jsonl"
    samples_path = run_dir / "samples.jsonl"
    run_id = _run_id(cfg, store.root)
    gang = None

    try:
        state = _load_state(store, run_id) if resume else None
        if state is None and resume and store.latest() is not None:
            state = _fresh_state(run_id)  # died in iteration 0, after the first publish
        if state is None:
            if store.latest() is not None:
                raise FileExistsError(
                    f"the adapter store {store.root} already holds versions {store.versions()[:5]}...; "
                    "pass resume=True to continue that run, or use a fresh run_dir / store_url"
                )
            for p in (metrics_path, samples_path, run_dir / "rollouts.jsonl"):
                p.unlink(missing_ok=True)
            state = _fresh_state(run_id)
        state = _reconcile(state, store)
        store.write_json(RUN_STATE, state)
        records = [r for r in _read_records(metrics_path) if r["iteration"] < state["next_iteration"]]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
        for p in (samples_path, run_dir / "rollouts.jsonl"):  # drop lines of unfinished iterations
            trim_jsonl(p, lambda r: r["iteration"] < state["next_iteration"])
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))

        cl.register_engines(client, cfg, model_path, store.root, storage_options)
        cl.wait_for_role(client, cl.ROLLOUT, 1)
        spec = RankSpec(
            run_id=run_id, model_path=model_path, store_root=store.root, storage_options=storage_options,
            model=cfg.model, lora=cfg.lora, loss=cfg.loss, optim=cfg.optim, seed=cfg.run.seed, rank=0,
            world_size=cfg.cluster.world_size, gang_id=0, init_method=None,
            timeout_s=cfg.cluster.collective_timeout_s, max_len=cfg.sampling.max_new_tokens,
        )
        gang = cl.TrainerGang(client, spec, max_restarts=cfg.cluster.max_restarts)

        d = cfg.data
        train_pool = load_problems(d.dataset, "train", d.train_size, seed=cfg.run.seed, n_digits=d.n_digits, n_terms=d.n_terms)
        heldout = load_problems(d.dataset, "heldout", d.eval_size, seed=0, n_digits=d.n_digits, n_terms=d.n_terms)
        heldout_d = [cl.problem_dict(p) for p in heldout]
        driver = _Driver(cfg, client, store, gang, train_pool, heldout_d, state, metrics_path, samples_path,
                         list(callbacks), records)
        driver.pruner = Pruner(store, cfg.run.keep_versions, cfg.run.keep_every)
        if resume:  # versions a crash (or a run with another policy) left behind
            driver.pruner.sweep(state["version"])
        # engines and policies are built before the first iteration's clock starts
        t_warm = time.time()
        if progress:
            print("warming up: building rollout engines and trainer policies ...", flush=True)
        driver.warm_up_s = cl.warm_up(client, gang, state["version"], driver.key)
        driver.startup_s = time.time() - t_warm
        driver.loop(tqdm(total=cfg.run.iterations, initial=state["next_iteration"], desc="GRPO", disable=not progress))
        summary = driver.finish()
        return RunResult(run_dir, driver.records, summary)
    finally:
        if gang is not None:
            gang.close()
        if own_client:
            cluster = client.cluster
            client.close()
            if cluster is not None:
                cluster.close()


def _run_id(cfg: Config, store_root: str) -> str:
    """Identifies what a resumed run must share: everything but the length, paths and eval cadence."""
    d = cfg.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("iterations", "run_dir", "store_url", "eval_every",
                                                                "keep_versions", "keep_every", "rollouts_every")}
    d.pop("cluster")
    blob = json.dumps(d, sort_keys=True) + store_root
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _fresh_state(run_id: str) -> dict:
    return {"run_id": run_id, "next_iteration": 0, "version": 0, "base_acc": None, "grpo_wall_s": 0.0, "evals": []}


def _load_state(store: AdapterStore, run_id: str) -> dict | None:
    try:
        state = store.read_json(RUN_STATE)
    except FileNotFoundError:
        return None
    if state.get("run_id") != run_id:
        raise ValueError(
            f"resume=True but the store's run state belongs to another configuration (run_id {state.get('run_id')} "
            f"!= {run_id}); resume with the same config or start a fresh run_dir"
        )
    return state


def _reconcile(state: dict, store: AdapterStore) -> dict:
    """Fold in a step that published its adapter but died before the run state was written."""
    latest = store.latest() or 0
    while latest > state["version"]:
        v = state["version"] + 1
        meta = store.manifest(v).get("meta", {})
        state = {**state, "version": v, "next_iteration": max(state["next_iteration"], meta.get("iteration", -1) + 1)}
    return state


class _Driver:
    def __init__(self, cfg, client, store, gang, train_pool, heldout, state, metrics_path, samples_path, callbacks, records):
        self.cfg, self.client, self.store, self.gang = cfg, client, store, gang
        self.train_pool, self.heldout = train_pool, heldout
        self.state, self.metrics_path, self.samples_path = state, metrics_path, samples_path
        self.callbacks, self.records = callbacks, records
        self.pending: dict[int, _Pending] = {}
        self.evals: list = []  # (iteration, future)
        self.startup_s: float | None = None  # engines and policies built before the first iteration
        self.warm_up_s: dict = {}  # seconds per engine / rank (cluster.warm_up)
        # task keys are unique per run() call: two drivers on one scheduler never share a task
        self.key = f"{state['run_id']}-{os.urandom(3).hex()}"
        s = cfg.sampling
        self.depth = cfg.run.depth
        self.chunks = max(1, min(cfg.cluster.n_rollout_workers, s.prompts_per_step))
        self.reward_kw = cl.reward_kwargs(cfg)

    # ------------------------------------------------------------------ submission
    def problems_for(self, iteration: int):
        rng = random.Random(_seed(self.cfg.run.seed, "prompts", iteration))
        return rng.sample(self.train_pool, self.cfg.sampling.prompts_per_step)

    def rollout_version(self, iteration: int) -> int:
        """The adapter version that generates ``iteration``'s batch. Pacing: the trainer's version
        ``depth`` iterations earlier, when generation is submitted in an uninterrupted run (a resumed
        run so samples its pending batches from the versions the uninterrupted run would have used).
        Discarding: the newest version."""
        if self.cfg.run.staleness_policy == "discard":
            return self.state["version"]
        return min(self.state["version"], max(0, iteration - self.depth))

    def submit_generation(self, iteration: int, version: int | None = None) -> None:
        if iteration in self.pending or iteration >= self.cfg.run.iterations:
            return
        s = self.cfg.sampling
        version = self.rollout_version(iteration) if version is None else version
        probs = self.problems_for(iteration)
        per = math.ceil(len(probs) / self.chunks)
        futures = []
        for c in range(0, len(probs), per):
            chunk = [cl.problem_dict(p) for p in probs[c : c + per]]
            key = f"{self.key}-rollout-{iteration}-{c}-v{version}"
            gen = self.client.submit(
                cl.rollout_task, chunk, s.group_size, version, s.max_new_tokens, s.temperature,
                _seed(self.cfg.run.seed, iteration), c, iteration,
                key=key, resources={cl.ROLLOUT: 1}, retries=2,
            )
            futures.append(self.client.submit(cl.reward_task, gen, self.reward_kw, key=f"{self.key}-reward-{iteration}-{c}",
                                              retries=2))
        self.pending[iteration] = _Pending(version, futures)

    def submit_eval(self, iteration: int, version: int) -> None:
        fut = self.client.submit(cl.eval_task, self.heldout, version, self.cfg.sampling.max_new_tokens,
                                 key=f"{self.key}-eval-{iteration}-v{version}", resources={cl.ROLLOUT: 1}, retries=2,
                                 priority=-10)  # generation goes first when both wait for an engine
        self.evals.append((iteration, fut))

    def collect_evals(self, block: bool = False) -> list[dict]:
        done = []
        for it, fut in list(self.evals):
            if block or fut.done():
                res = fut.result()
                res["iteration"] = it
                done.append(res)
                self.evals.remove((it, fut))
        for res in done:
            self.state["evals"].append(res)
            if res["version"] == 0 and self.state["base_acc"] is None:
                self.state["base_acc"] = res["acc"]
                self.state["base_lenient_acc"] = res.get("lenient_acc")
        return done

    # ------------------------------------------------------------------ the loop
    def loop(self, bar) -> None:
        cfg = self.cfg
        start = self.state["next_iteration"]
        self.session_start, self.wall_base = time.time(), self.state["grpo_wall_s"]
        self.submit_generation(start)
        if start == 0 and self.state["base_acc"] is None and cfg.run.eval_every > 0:
            self.submit_eval(-1, 0)
        for it in range(start, cfg.run.iterations):
            t_iter = time.time()
            pend = self.pending.pop(it)
            results = self.client.gather(pend.futures)
            rejected = 0
            if self.state["version"] - pend.version > cfg.run.max_staleness:
                # too stale (staleness_policy="discard"): drop it, generate it again from the current adapter
                rejected = cfg.sampling.prompts_per_step
                self.submit_generation(it, version=self.state["version"])
                pend = self.pending.pop(it)
                results = self.client.gather(pend.futures)
            t_gen_done = time.time()
            for j in range(it + 1, it + 1 + self.depth):  # pipelining: next batch before we train
                self.submit_generation(j)
            rec = self.train_on(it, pend, results, t_iter, t_gen_done, rejected)
            if self.depth == 0:
                self.submit_generation(it + 1)
            self.finish_iteration(rec, bar)

    def train_on(self, it, pend, results, t_iter, t_gen_done, rejected: int = 0) -> dict:
        cfg, s = self.cfg, self.cfg.sampling
        rollouts = [Rollout.from_dict(r) for res in results for r in res["rollouts"]]
        rollouts.sort(key=lambda r: (r.group_id, r.sample_idx))
        want = [(g, i) for g in range(s.prompts_per_step) for i in range(s.group_size)]
        if [(r.group_id, r.sample_idx) for r in rollouts] != want:
            raise RuntimeError(f"iteration {it}: rollouts do not form {s.prompts_per_step} complete groups of {s.group_size}")
        version = self.state["version"]
        lag = version - pend.version
        if lag > cfg.run.max_staleness:  # the loop regenerates too-stale batches before they get here
            raise RuntimeError(f"iteration {it}: a batch {lag} versions behind reached the trainer (max_staleness "
                               f"{cfg.run.max_staleness})")
        kept = rollouts
        n_groups = len(rollouts) // s.group_size
        rewards = torch.tensor([r.reward for r in kept], dtype=torch.float64)
        adv = group_advantages(rewards, s.group_size, scale=cfg.loss.adv_scale) if len(kept) else rewards
        samples = [(r.prompt_ids, r.completion_ids, r.logprobs, float(a)) for r, a in zip(kept, adv.tolist(), strict=True)]
        spread = [max(g) > min(g) for g in (rewards[i : i + s.group_size].tolist() for i in range(0, len(kept), s.group_size))]

        t_train = time.time()
        stats = self.gang.step(samples, version, it, self.store) if samples else {}
        t_train_end = time.time()
        self.state["version"] = version + 1 if samples else version
        if samples and cfg.run.eval_every and ((it + 1) % cfg.run.eval_every == 0):
            self.submit_eval(it, self.state["version"])

        gen_spans = [{"name": "generate", "iteration": it, "start": r["start"], "end": r["end"]} for r in results]
        spans = list(gen_spans)
        ranks = stats.get("ranks", [])
        if ranks:
            r0 = ranks[0]
            spans.append({"name": "train", "iteration": it, "start": r0["start"], "end": r0["start"] + r0["prepare_s"] + r0["compute_s"]})
            spans.append({"name": "publish", "iteration": it, "start": r0["end"] - r0["publish_s"] - r0["checkpoint_s"],
                          "end": r0["end"]})
        n_rollouts = len(rollouts)
        usable = sum(1 for a in adv.tolist() if a != 0)
        iter_end = time.time()
        gen_s = max(r["end"] for r in results) - min(r["start"] for r in results)
        rec = {
            "iteration": it,
            "version": self.state["version"],
            "rollout_version": pend.version,
            "reward_mean": float(torch.tensor([r.reward for r in rollouts]).mean()) if rollouts else None,
            "reward_std": float(torch.tensor([r.reward for r in rollouts]).std()) if n_rollouts > 1 else None,
            "train_acc": sum(bool(r.correct) for r in rollouts) / max(1, n_rollouts),
            "train_lenient_acc": sum(bool(r.lenient_correct) for r in rollouts) / max(1, n_rollouts),
            "eval_acc": None,
            "eval_lenient_acc": None,
            "base_acc": self.state["base_acc"],
            "loss": stats.get("loss"),
            "ratio_mean": stats.get("ratio_mean"),
            "ratio_std": stats.get("ratio_std"),
            "ratio_min": stats.get("ratio_min"),
            "ratio_max": stats.get("ratio_max"),
            "clip_frac_low": stats.get("clip_low"),
            "clip_frac_high": stats.get("clip_high"),
            "clip_frac": stats.get("clip_frac"),
            "kl_mean": _finite(stats.get("kl")),
            "is_mean": stats.get("is_mean"),
            "is_min": stats.get("is_min"),
            "is_max": stats.get("is_max"),
            "is_capped_frac": stats.get("is_capped_frac"),
            "grad_norm": stats.get("grad_norm"),
            "tokens": stats.get("tokens"),
            "samples_nonzero_adv": stats.get("samples_nonzero_adv"),
            "staleness_max": lag,
            "staleness_mean": float(lag),
            "rejected_groups": rejected,
            "kept_groups": n_groups,
            "zero_spread_groups": sum(not x for x in spread),
            "all_zero_spread": bool(spread) and not any(spread),
            "usable_samples": usable,
            "usable_per_s": usable / max(1e-9, iter_end - t_iter),
            "truncated": sum(r.truncated for r in rollouts),
            "completion_tokens": sum(len(r.completion_ids) for r in rollouts),
            "gen_s": gen_s,
            "gen_wait_s": t_gen_done - t_iter,
            "train_s": t_train_end - t_train,
            "train_compute_s": ranks[0]["compute_s"] if ranks else None,
            "publish_s": ranks[0]["publish_s"] if ranks else None,
            "checkpoint_s": ranks[0]["checkpoint_s"] if ranks else None,
            "prepare_s": ranks[0]["prepare_s"] if ranks else None,
            "gang_restarts": self.gang.restarts,
            "t_iter_start": t_iter,
            "t_iter_end": iter_end,
            "iter_s": iter_end - t_iter,
            "spans": spans,
        }
        self._write_samples(it, rollouts)
        return rec

    def finish_iteration(self, rec: dict, bar) -> None:
        for res in self.collect_evals():
            self._attach_eval(rec, res)
        rec["base_acc"] = self.state["base_acc"]
        # wall time of the loop itself, summed over resumed sessions: everything on the critical
        # path (dispatch, I/O, callbacks), unlike iter_s which ends when the record is complete
        self.state["grpo_wall_s"] = self.wall_base + (time.time() - self.session_start)
        rec["grpo_wall_s"] = self.state["grpo_wall_s"]
        self.records.append(rec)
        _append_jsonl(self.metrics_path, rec)
        self.state["next_iteration"] = rec["iteration"] + 1
        self.store.write_json(RUN_STATE, self.state)
        self.prune()
        for cb in self.callbacks:
            cb(rec)
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward_mean']:.2f}", acc=_fmt(self.last_eval()), v=rec["version"])

    @staticmethod
    def _attach_eval(rec: dict, res: dict) -> None:
        """An evaluation that finished during this iteration: the base model's (version 0) is the
        baseline, any other is the held-out accuracy of the version it names."""
        rec.setdefault("evals", []).append(res)
        rec["spans"].append({"name": "eval", "iteration": res["iteration"], "start": res["start"], "end": res["end"]})
        if res["version"] > 0:
            rec["eval_acc"], rec["eval_version"] = res["acc"], res["version"]
            rec["eval_lenient_acc"] = res.get("lenient_acc")

    def last_eval(self):
        evs = [e for e in self.state["evals"] if e["version"] > 0]
        return evs[-1]["acc"] if evs else None

    def prune(self) -> None:
        """Retention (:mod:`grpo_kit.retention`) after a committed iteration; batches in flight and
        pending evaluations keep the versions they were submitted with."""
        pruner = getattr(self, "pruner", None)
        if pruner is not None:
            busy = {p.version for p in self.pending.values()} | {_eval_version(f) for _, f in self.evals}
            pruner.after_commit(self.state["version"], busy)

    def _write_samples(self, it: int, rollouts: list[Rollout]) -> None:
        every = self.cfg.run.rollouts_every
        if every and it % every == 0:
            with open(self.samples_path.with_name("rollouts.jsonl"), "a") as f:
                for r in rollouts:
                    f.write(json.dumps(r.to_dict()) + "\n")
        with open(self.samples_path, "a") as f:
            for r in rollouts[:: max(1, len(rollouts) // 3)][:3]:
                f.write(json.dumps({"iteration": it, "prompt": r.prompt_id, "completion": r.text, "reward": r.reward,
                                    "gold": r.gold, "version": r.version}) + "\n")

    def finish(self) -> dict:
        """Final evaluation (blocking), summary.json."""
        cfg = self.cfg
        for p in self.pending.values():
            self.client.cancel(p.futures)
        self.pending.clear()
        final_version = self.state["version"]
        if cfg.run.eval_every and not any(e["version"] == final_version for e in self.state["evals"]):
            if not any(it == cfg.run.iterations - 1 for it, _ in self.evals):
                self.submit_eval(cfg.run.iterations - 1, final_version)
        final = self.collect_evals(block=True)
        if final and self.records:
            last = self.records[-1]
            for res in final:
                self._attach_eval(last, res)
            last["base_acc"] = self.state["base_acc"]
            self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.store.write_json(RUN_STATE, self.state)
        recs = [r for r in self.records if r.get("ratio_mean") is not None]
        evs = [e for e in self.state["evals"] if e["version"] == final_version]
        summary = {
            "acc_before": self.state["base_acc"],
            "acc_after": evs[-1]["acc"] if evs else None,
            "lenient_acc_before": self.state.get("base_lenient_acc"),
            "lenient_acc_after": evs[-1].get("lenient_acc") if evs else None,
            "grpo_wall_s": self.state["grpo_wall_s"],
            "iterations": self.state["next_iteration"],
            "final_version": final_version,
            "ratio_mean": sum(r["ratio_mean"] for r in recs) / len(recs) if recs else None,
            "clip_fraction": sum(r["clip_frac"] for r in recs) / len(recs) if recs else None,
            "kl_final": recs[-1]["kl_mean"] if recs else None,
            "rejected_groups": sum(r["rejected_groups"] for r in self.records),
            "truncated": sum(r["truncated"] for r in self.records),
            "gang_restarts": self.gang.restarts,
            "startup_s": self.startup_s,
            "warm_up_s": self.warm_up_s,
        }
        (Path(self.cfg.run.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def _eval_version(fut) -> int:
    """The adapter version of an evaluation future (its key ends in ``-v<version>``, submit_eval)."""
    return int(str(fut.key).rsplit("-v", 1)[1])


def _finite(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"
