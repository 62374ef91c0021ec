"""Worker-resident trainer state: the policy (base model + LoRA), its optimizer and the process group.

One :class:`TrainerState` lives in each trainer process (a Dask worker) between steps, so a step
costs a forward/backward, not a model load. :func:`train_rank` is the body of one rank's task:

- the process group is formed once per gang (``gang_id``) and kept across steps; it is re-formed
  only when the driver starts a new gang after a failure. The DDP wrapper is deleted before
  ``destroy_process_group()`` (destroying the group under a live wrapper deadlocked workers);
- the state follows the adapter store: if the requested version is not the one in memory (a fresh
  or restarted worker, a retried step, or the same number published anew after a take-back: each
  step compares the store's attempt with the one in memory), the adapter and optimizer state are
  loaded from the store;
- rank 0 publishes version ``v + 1`` after the step (:mod:`grpo_kit.publish`: the optimizer state,
  then the adapter, whose manifest records the attempt of the ``v`` it was trained from) and
  broadcasts the outcome and the attempt it published (:func:`agree_on_outcome`): when an earlier
  attempt of the step had committed ``v + 1`` first, every rank adopts that version (adapter and
  optimizer state), and when the publish raised, every rank fails the step. The other ranks
  therefore wait for rank 0's publish (bounded by the collective timeout). The driver gets the
  all-reduced stats back, never tensors.
"""

from __future__ import annotations

import datetime
import gc
import os
import threading
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import algorithms
from .adapters import AdapterStore
from .config import Config, LoRAConfig, LossConfig, ModelConfig, OptimConfig
from .publish import ADOPTED, FAILED, PUBLISHED, optimizer_state_name, publish_step, state_version
from .train_step import collate, grpo_step, make_optimizer, wrap_ddp


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank task needs to find or build its state (small, pickled per step)."""

    run_id: str
    """Identifies the run; a state built for another run is discarded."""
    model_path: str
    """Base model directory or hub id."""
    store_root: str
    """Adapter store root."""
    storage_options: dict | None
    """fsspec options for the store."""
    model: ModelConfig
    lora: LoRAConfig
    loss: LossConfig
    optim: OptimConfig
    seed: int
    """Seeds the LoRA initialisation (identical on every rank)."""
    rank: int
    world_size: int
    gang_id: int
    """Bumped by the driver whenever the gang is re-formed."""
    init_method: str | None
    """``tcp://host:port`` of rank 0's rendezvous (None for world_size 1)."""
    timeout_s: float
    """Bound on rendezvous and on every collective."""
    max_len: int | None
    """dr_grpo's constant (the completion budget)."""
    local_rank: int = 0
    """This rank's index among the gang's ranks on the same host: its GPU where a worker sees several."""
    temperature: float = 1.0
    """The sampling temperature: the step scores the tempered policy (and reference), whose
    log-probs the engines record."""
    policy_loss_fn: bytes | None = None
    """The policy loss, cloudpickled (:func:`grpo_kit.algorithms.pack`): the driver's resolution of
    ``loss.policy_loss`` or the function given to ``loop.run``; None looks the name up on the rank."""
    advantage_fn: bytes | None = None
    """The advantage estimator, cloudpickled likewise; None looks ``loss.advantage`` up on the rank."""

    def policy_loss_function(self) -> algorithms.PolicyLoss:
        """The policy loss the ranks train with."""
        if self.policy_loss_fn is not None:
            return algorithms.unpack(self.policy_loss_fn)
        return algorithms.policy_loss(self.loss.policy_loss)

    def advantage_function(self) -> algorithms.Advantage:
        """The advantage estimator the ranks take the advantages with."""
        if self.advantage_fn is not None:
            return algorithms.unpack(self.advantage_fn)
        return algorithms.advantage(self.loss.advantage)

    @classmethod
    def for_run(cls, cfg: Config, run_id: str, model_path: str, store_root: str,
                storage_options: dict | None, multi_turn: bool = False, policy_loss=None,
                advantage=None) -> RankSpec:
        """Rank 0's spec for a run of ``cfg`` (the gang fills in rank, gang id and rendezvous).
        ``multi_turn``: the task plays episodes, whose budget is ``cfg.episode.max_episode_tokens``.
        ``policy_loss``/``advantage``: functions that replace the ones ``cfg.loss`` names. Either
        way the functions are resolved here, on the driver, and travel cloudpickled: a name
        registered in a notebook cell, or a function defined there, reaches ranks that never ran it."""
        return cls(
            policy_loss_fn=algorithms.pack(policy_loss or algorithms.policy_loss(cfg.loss.policy_loss)),
            advantage_fn=algorithms.pack(advantage or algorithms.advantage(cfg.loss.advantage)),
            run_id=run_id, model_path=model_path, store_root=store_root, storage_options=storage_options,
            model=cfg.model, lora=cfg.lora, loss=cfg.loss, optim=cfg.optim, seed=cfg.run.seed, rank=0,
            world_size=cfg.cluster.world_size, gang_id=0, init_method=None,
            timeout_s=cfg.cluster.collective_timeout_s,
            max_len=cfg.episode.max_episode_tokens if multi_turn else cfg.sampling.max_new_tokens,
            temperature=cfg.sampling.temperature,
        )


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}[name]


def peft_lora_config(lora_cfg: LoRAConfig):
    """PEFT's ``LoraConfig`` for the kit's LoRA settings (the trainer's, and what benchmarks give peers)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora_cfg.lora_r,
        lora_alpha=lora_cfg.lora_alpha,
        lora_dropout=lora_cfg.lora_dropout,
        target_modules=list(lora_cfg.lora_targets),
        task_type="CAUSAL_LM",
    )


def build_policy(model_path: str, model_cfg: ModelConfig, lora_cfg: LoRAConfig, seed: int, device: str | None = None):
    """The base model with a freshly initialised LoRA adapter (B = 0: the policy starts as the base)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=_dtype(model_cfg.dtype))
    if device:
        base = base.to(device)
    torch.manual_seed(seed)
    model = get_peft_model(base, peft_lora_config(lora_cfg))
    # eval mode: no dropout anywhere, so the trainer scores exactly the policy the engines sample
    # from (gradients flow all the same); train mode only when LoRA dropout was explicitly allowed
    model.train(lora_cfg.lora_dropout > 0)
    return model


def load_adapter_weights(model, path: str) -> None:
    """Load a published adapter directory's weights into a PEFT model in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    sd = load_file(os.path.join(path, "adapter_model.safetensors"))
    res = set_peft_model_state_dict(model, sd)
    unexpected = getattr(res, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"adapter at {path} has keys the policy does not: {unexpected[:3]}")


class TrainerState:
    """The policy, optimizer, DDP wrapper and process group of one trainer process."""

    def __init__(self, spec: RankSpec):
        self.run_id = spec.run_id
        self.device = rank_device(spec.local_rank)
        if self.device.startswith("cuda"):
            torch.cuda.set_device(self.device)  # NCCL and the default CUDA stream follow this device
        self.store = AdapterStore(spec.store_root, spec.storage_options)
        self.model = build_policy(spec.model_path, spec.model, spec.lora, spec.seed, self.device)
        self.init_lora = {k: v.detach().clone() for k, v in self.model.named_parameters() if v.requires_grad}
        self.optimizer = make_optimizer(self.model, spec.optim)
        self.version: int | None = 0
        # (version, the store's publish attempt of it) where this process knows it: it loaded or published that version
        self.attempt: tuple[int, str | None] | None = (0, None)
        self.saved_states: list[str] = []  # optimizer states this process published, oldest first
        self.gang_id: int | None = None
        self.ddp = None
        tok_path = spec.model_path
        from transformers import AutoTokenizer

        self.pad_id = AutoTokenizer.from_pretrained(tok_path).pad_token_id or 0

    # ------------------------------------------------------------------ process group
    def ensure_group(self, spec: RankSpec) -> None:
        if spec.world_size == 1:
            if self.ddp is not None or self.gang_id != spec.gang_id:
                self.teardown_group()
            self.gang_id = spec.gang_id
            return
        if self.gang_id == spec.gang_id and self.ddp is not None:
            return
        self.teardown_group()
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(
            backend,
            init_method=spec.init_method,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        self.ddp = wrap_ddp(self.model)
        self.gang_id = spec.gang_id

    def teardown_group(self) -> None:
        # The wrapper goes first: destroying the group under a live DDP wrapper can deadlock.
        had_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.ddp is not None:
            self.ddp = None
            gc.collect()
        if had_group:
            torch.distributed.destroy_process_group()
        self.gang_id = None

    # ------------------------------------------------------------------ versions
    def sync_to(self, version: int) -> None:
        """Make the in-memory policy and optimizer equal the store's ``version``.

        ``self.version`` is None after a failed step (the weights may hold a half-applied update):
        then the state is always reloaded."""
        if version == self.version and (version == 0 or self.attempt == (version, self.store.attempt(version))):
            return  # the weights in memory are the store's (a version taken back and trained anew has another attempt)
        man: dict = {}
        self.version = self.attempt = None  # until loaded: a failure below leaves the weights unknown
        if version == 0:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name in self.init_lora:
                        p.copy_(self.init_lora[name])
            self.optimizer.state.clear()
        else:
            # saved before the adapter's manifest (train_rank), which names it: the pair commits together;
            # read fresh: the version may have been taken back and trained anew since this process
            # cached it (the fetched copy is then checked against the new manifest)
            man = self.store.manifest(version, fresh=True)
            load_adapter_weights(self.model, self.store.fetch(version))
            name = man.get("meta", {}).get("optimizer_state") or optimizer_state_name(version)
            self.optimizer.load_state_dict(self.store.load_state(name))
        self.attempt = (version, man.get("attempt"))
        # states this process wrote for versions a stopping driver took back (deleted from the store)
        # leave the ring of kept states, which must make room for this version's successors first
        self.saved_states = [n for n in self.saved_states if state_version(n) <= version or self.store.state_exists(n)]
        self.version = version


def rank_device(local_rank: int) -> str:
    """The device of the rank with this host-local index: ``cuda:<local_rank mod GPUs visible>``
    (a worker that sees one GPU, as LocalCluster workers do, always gets ``cuda:0``), or ``cpu``."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{local_rank % torch.cuda.device_count()}"


_STATE: TrainerState | None = None
_LOCK = threading.Lock()


def get_state(spec: RankSpec) -> TrainerState:
    global _STATE
    with _LOCK:
        # another run, or this run's rank on another device (a re-formed gang's local ranks follow the
        # workers' addresses: a worker that kept its state could otherwise share a GPU with a new one)
        if _STATE is None or _STATE.run_id != spec.run_id or _STATE.device != rank_device(spec.local_rank):
            if _STATE is not None:
                _STATE.teardown_group()
                _STATE = None  # free the old policy before building the new one
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            _STATE = TrainerState(spec)
        return _STATE


def drop_state() -> bool:
    """Drop this process's trainer state (policy, optimizer, process group), as a restarted worker
    has none: the next step rebuilds the policy and loads its version's adapter and optimizer state
    from the store."""
    global _STATE
    with _LOCK:
        if _STATE is not None:
            _STATE.teardown_group()
            _STATE = None
    gc.collect()
    return True


def teardown() -> bool:
    """Drop this process's process group (and DDP wrapper); keeps the policy warm."""
    with _LOCK:
        if _STATE is not None:
            _STATE.teardown_group()
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return True


def warm(spec: RankSpec, version: int) -> float:
    """Build this process's policy and optimizer for ``spec`` and load ``version`` (a task run before
    the first step, so that the first step costs a step). Returns the seconds it took."""
    t0 = time.time()
    get_state(spec).sync_to(version)
    return time.time() - t0


def agree_on_outcome(outcome: int, attempt: str | None, group, device: str) -> tuple[int, str | None]:
    """Rank 0's publish outcome and the attempt it published (16 hex digits, or None), on every rank
    of ``group`` (one broadcast from rank 0; every rank calls it once per step, whatever its own
    outcome, so the collectives line up): every rank then knows the attempt of the weights it holds."""
    halves = [int(attempt[:8], 16), int(attempt[8:], 16)] if attempt else [-1, -1]
    flag = torch.tensor([outcome, *halves], dtype=torch.int64, device=device)  # on the GPU for NCCL
    torch.distributed.broadcast(flag, src=torch.distributed.get_global_rank(group, 0), group=group)
    out, hi, lo = (int(x) for x in flag.tolist())
    return out, (None if hi < 0 else f"{hi:08x}{lo:08x}")


_RUNNING: Counter[int] = Counter()  # gang id -> rank-0 publishes of that gang running in this process
_RUNNING_LOCK = threading.Lock()


def publishes_running(gang_id: int) -> int:
    """How many steps of gang ``gang_id`` are in their publish in this process now (rank 0, from
    just before it reads the fence, :func:`grpo_kit.publish.fenced`, to the end of its publish): a
    stopping driver that fenced the gang waits for 0 on every trainer (:meth:`TrainerGang.fence_out`),
    since a cancelled task a worker had begun still runs to its end. Only that span counts: a step
    before it will read the fence, and the other ranks publish nothing."""
    with _RUNNING_LOCK:
        return _RUNNING[gang_id]


@contextmanager
def _running(gang_id: int):
    with _RUNNING_LOCK:
        _RUNNING[gang_id] += 1
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING[gang_id] -= 1
            if not _RUNNING[gang_id]:
                del _RUNNING[gang_id]


def train_rank(spec: RankSpec, samples: list, version: int, iteration: int) -> dict:
    """One rank's part of one training step (a Dask task). Returns stats and timings."""
    t0 = time.time()
    state = get_state(spec)
    # Sync before forming the group: building the DDP wrapper copies rank 0's weights to every
    # rank, so each rank must already hold `version` (a restarted worker may become rank 0).
    state.sync_to(version)
    parent = state.attempt[1]  # the attempt of `version` this rank trains from (sync_to checked it is the store's)
    state.ensure_group(spec)
    t_ready = time.time()
    batch = collate(samples, state.pad_id)
    model = state.ddp if spec.world_size > 1 else state.model
    try:
        stats = grpo_step(
            model,
            state.optimizer,
            batch,
            spec.loss,
            spec.optim,
            rank=spec.rank,
            world_size=spec.world_size,
            max_len=spec.max_len,
            temperature=spec.temperature,
            policy_loss=spec.policy_loss_function(),
        )
    finally:
        state.version = state.attempt = None  # the update is applied; which version that is, the outcome says
    t_step = time.time()
    t_opt = t_step
    outcome, error, attempt = PUBLISHED, None, None
    if spec.rank == 0:
        try:
            with _running(spec.gang_id):
                outcome, attempt, t_opt = publish_step(state, version, iteration, stats, parent, spec.gang_id)
        except Exception as e:  # told to the other ranks first, so that none waits on rank 0
            outcome, error = FAILED, e
    if spec.world_size > 1:
        outcome, attempt = agree_on_outcome(outcome, attempt, state.ddp.process_group, state.device)
    if outcome == FAILED:
        state.version = None  # v+1 may or may not be in the store: reload on retry
        if error is not None:
            raise error
        raise RuntimeError(f"rank 0 failed to publish version {version + 1}; this rank's update is dropped")
    if outcome == ADOPTED:
        # adapter and optimizer state together, on every rank (the ranks must hold the same weights)
        state.version = None
        state.sync_to(version + 1)
        stats = state.store.manifest(version + 1).get("meta", {}).get("stats", stats)
    else:
        state.version, state.attempt = version + 1, (version + 1, attempt)
    if outcome == PUBLISHED and spec.rank == 0:
        state.saved_states.append(optimizer_state_name(version + 1, attempt))
        # keep the last three this process wrote: a driver that stops takes back up to two versions
        # published past the one it committed (gang.TrainerGang.withdraw), whose state must stay
        while len(state.saved_states) > 3:  # clean-up after the commit: a failure here must not fail the step
            try:
                state.store.delete_state(state.saved_states[0])
            except Exception as e:  # noqa: BLE001 - a transient store error; the next step tries again
                warnings.warn(f"could not delete the old optimizer state {state.saved_states[0]!r} ({type(e).__name__}: "
                              f"{e}); v{version + 1} is published, a later step retries", RuntimeWarning, stacklevel=2)
                break
            state.saved_states.pop(0)
    adopted = outcome == ADOPTED
    t_end = time.time()
    with torch.no_grad():  # cheap fingerprint: the driver checks that ranks hold the same weights
        checksum = float(sum(p.double().sum() for p in state.model.parameters() if p.requires_grad))
    return {
        **stats,
        "rank": spec.rank,
        "param_checksum": checksum,
        "prepare_s": t_ready - t0,
        "compute_s": t_step - t_ready,
        "checkpoint_s": t_opt - t_step,
        "publish_s": t_end - t_opt,
        "start": t0,
        "end": t_end,
        "pid": os.getpid(),
        "adopted": adopted,
    }
