"""The batch record and one GRPO optimizer step (single process or one DDP rank).

A :class:`TrainBatch` is right-padded; every per-token tensor is ``(B, T)`` and aligned with
``input_ids`` (:mod:`grpo_kit.logprobs` says how, and what the scored and real tokens are). The step's
forwards are :func:`grpo_kit.logprobs.token_logprobs`, with ``OptimConfig.share_prompt``
:func:`grpo_kit.logprobs.shared_prompt_logprobs` (each group's prompt once), and with
``OptimConfig.packing`` :func:`grpo_kit.packing.packed_logprobs` (one padding-free row per
micro-batch, micro-batches cut by tokens and ranks balanced by tokens, :mod:`grpo_kit.packing`).

The step issues the same collectives, in the same order, on every rank whatever its shard holds
(empty, uneven, all advantages zero), so it cannot deadlock:

1. all-reduce the normalizers (sequences, completion tokens, longest completion) of the whole batch;
2. forward and backward each micro-batch of the rank's shard inside ``model.no_sync()``: local only
   (with ``kl_beta == 0`` only the rows with a nonzero advantage: the others have no loss term, see
   below, and a shard may become empty here);
3. one 1-token forward through the DDP wrapper and a 0-scaled backward outside ``no_sync()``: this
   backward is the rank's single gradient all-reduce (the gradients accumulated in step 2 ride on it).
   Its loss also adds the 0-scaled sum of every trainable parameter: a 1-token forward does not reach
   a MoE expert its router skips (or any conditionally run module), whose bucket would then never be
   reduced (the next step fails with "Expected to have finished reduction");
4. clip, optimizer step; all-reduce the stats.

DDP's own one-off collective (the bucket rebuild, a broadcast at the first DDP forward after the first
synchronized backward) lines up too: every rank makes at least one DDP forward per step, step 3's.

The DDP wrapper must have ``broadcast_buffers=False`` (``forward_sync_buffers=False`` in newer torch;
:func:`wrap_ddp` picks the right one): otherwise DDP broadcasts module buffers (rotary tables) as part
of forwards, whose number depends on the rank's shard, and uneven shards deadlock.
Because losses are normalized by global counts and DDP averages gradients over ranks, each rank
backpropagates ``world_size * (local sum / global normalizer)``; the update then equals the
single-process update on the whole batch for every ``loss_type``.

Rows with advantage 0 (every row of a group without reward spread): their surrogate ``min(ratio * 0,
clip(ratio) * 0)`` is 0 in value and gradient, so with ``kl_beta == 0`` they are skipped after the
normalizers are counted (for any policy loss that declares the same, ``zero_adv_is_zero`` in
:mod:`grpo_kit.algorithms`: every built-in does) (which keep them: the update is the one of the whole batch, exactly). The
ratio, clip and weight stats then cover the trained tokens only (``tokens_trained``; ``tokens`` stays
the batch's). With ``kl_beta > 0`` such a row still has the KL term's gradient, so every row is
trained: skipping it would change the update (``SamplingConfig.dynamic_sampling`` drops those groups
on purpose, and ``grpo_kit.sampling`` says what that changes).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from grpo_kit import algorithms
from grpo_kit.config import LossConfig, OptimConfig
from grpo_kit.logprobs import attention_window, shared_prompt_logprobs, shares_within, token_logprobs
from grpo_kit.loss import LossStats, Normalizer, mismatch_sums
from grpo_kit.packing import balanced_shard_sizes, check_packing, micro_batch_bounds, packed_costs, packed_logprobs

log = logging.getLogger(__name__)


class Sample(NamedTuple):
    """One completion as the trainer needs it (a plain 4- or 5-tuple works as well)."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    completion_logprobs: Sequence[float]
    """Sampling log-prob of each completion token (same length as ``completion_ids``)."""
    adv: float
    mask: Sequence[int] | None = None
    """Per completion token: 1 sampled by the policy (scored), 0 environment/template (read by the
    model, not scored); None: all 1 (a single-turn completion)."""


@dataclass(frozen=True)
class TrainBatch:
    """A right-padded batch; every ``(B, T)`` tensor is aligned with ``input_ids`` (module docstring)."""

    input_ids: Tensor
    """(B, T) int64 prompt + completion token ids, right-padded."""
    attention_mask: Tensor
    """(B, T) 1 on prompt and completion tokens."""
    completion_mask: Tensor
    """(B, T) 1 on the completion tokens the policy sampled: the loss mask (0 on the prompt, on
    environment tokens inside a completion, and on padding)."""
    old_logp: Tensor
    """(B, T) sampling log-probs where ``completion_mask`` is 1, 0 elsewhere."""
    adv: Tensor
    """(B,) advantages."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, rows: slice | Tensor) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def trim(self) -> TrainBatch:
        """Drop the trailing columns that are padding in every row (cheaper forwards, same values)."""
        width = int(self.attention_mask.sum(dim=1).max()) if len(self) else 0
        cols = {f.name: getattr(self, f.name)[:, :width] for f in fields(self) if f.name != "adv"}
        return TrainBatch(**cols, adv=self.adv)


def collate(samples: Sequence[Sample | tuple], pad_id: int, dtype: torch.dtype = torch.float32) -> TrainBatch:
    """Build a right-padded :class:`TrainBatch` from ``(prompt_ids, completion_ids,
    completion_logprobs, adv[, mask])`` samples, keeping the token ids exactly as sampled. A
    sample's ``mask`` (None: all 1) becomes its row of ``completion_mask``; its log-probs are kept
    where the mask is 1 only."""
    samples = [Sample(*s) for s in samples]
    width = max((len(s.prompt_ids) + len(s.completion_ids) for s in samples), default=0)
    B = len(samples)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    completion_mask = torch.zeros((B, width), dtype=torch.long)
    old_logp = torch.zeros((B, width), dtype=dtype)
    for i, s in enumerate(samples):
        if len(s.prompt_ids) == 0:
            raise ValueError(f"sample {i}: empty prompt (the first token has no log-prob)")
        if len(s.completion_logprobs) != len(s.completion_ids):
            raise ValueError(
                f"sample {i}: {len(s.completion_ids)} completion ids but {len(s.completion_logprobs)} log-probs"
            )
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.completion_ids)
        scored = torch.ones(n - p, dtype=torch.long) if s.mask is None else torch.tensor(list(s.mask), dtype=torch.long)
        if scored.shape != (n - p,) or not bool(((scored == 0) | (scored == 1)).all()):
            raise ValueError(f"sample {i}: the mask must be 0/1, one per completion id ({n - p}); got {list(s.mask)}")
        input_ids[i, :n] = torch.tensor([*s.prompt_ids, *s.completion_ids], dtype=torch.long)
        attention_mask[i, :n] = 1
        completion_mask[i, p:n] = scored
        old_logp[i, p:n] = torch.tensor(list(s.completion_logprobs), dtype=dtype).where(scored.bool(), 0.0)  # 0 off the mask
    adv = torch.tensor([float(s.adv) for s in samples], dtype=dtype)
    return TrainBatch(input_ids, attention_mask, completion_mask, old_logp, adv)


def wrap_ddp(model: nn.Module, **kw) -> DDP:
    """Wrap a (PEFT) model for :func:`grpo_step`: DDP without forward-time buffer syncs (required).

    Newer torch spells ``broadcast_buffers=False`` as ``forward_sync_buffers=False`` (buffers are
    still synced once at construction, which is harmless: every rank builds the same model).
    """
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return DDP(model, forward_sync_buffers=False, **kw)
    return DDP(model, broadcast_buffers=False, **kw)


def _syncs_buffers_in_forward(ddp: DDP) -> bool:
    return bool(getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)))


def make_optimizer(model: nn.Module, optim_cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable (LoRA) parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay)


def shard_bounds(n: int, rank: int, world_size: int, shard_sizes: Sequence[int] | None = None) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous shard of ``n`` samples: ``shard_sizes`` if given,
    else ``numpy.array_split`` sizes (the first ``n % world_size`` ranks take one more)."""
    if shard_sizes is None:
        shard_sizes = [n // world_size + (r < n % world_size) for r in range(world_size)]
    if len(shard_sizes) != world_size or sum(shard_sizes) != n or min(shard_sizes) < 0:
        raise ValueError(f"shard_sizes {list(shard_sizes)} must be {world_size} sizes >= 0 summing to {n}")
    start = sum(shard_sizes[:rank])
    return start, start + shard_sizes[rank]


def grpo_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    loss_cfg: LossConfig,
    optim_cfg: OptimConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    shard_sizes: Sequence[int] | None = None,
    max_len: int | None = None,
    temperature: float = 1.0,
    policy_loss: algorithms.PolicyLoss | None = None,
) -> dict[str, float]:
    """One optimizer step on the FULL ``batch``, of which this rank processes its shard.

    ``model`` is a PEFT model (``world_size == 1``: no DDP, no ``torch.distributed`` call) or
    :func:`wrap_ddp` around one. ``max_len`` is dr_grpo's constant (pass the completion budget,
    ``max_new_tokens``, or ``max_episode_tokens`` in a multi-turn run); None takes the batch's longest
    count of scored tokens, which changes from step to step and leaves environment ids out: a
    fallback for direct calls, not the paper's constant (the trainer always passes it). ``temperature`` is the
    sampling temperature: the policy and the KL reference are scored tempered
    (:func:`token_logprobs`), as the engines' sampling log-probs are. Completion tokens are the
    scored ones (``completion_mask``; an episode's environment ids are not): the normalizers, the
    ratio, clip, KL and weight, and the stats cover them only. Returns stats that are
    all-reduced and identical on every rank: ``loss``, ``ratio_mean/std/min/max``,
    ``clip_low/high/frac``, ``kl`` (NaN when ``kl_beta == 0``), ``is_mean/min/max/capped_frac`` (the
    engine-mismatch weight with ``old_logp_source="trainer"``; None otherwise), ``grad_norm`` (before clipping),
    ``mismatch_kl`` (k3 KL(engine || trainer) over the trained tokens, from the engine's sampling
    log-probs and this step's forward: staleness included when the batch is off-policy),
    ``mismatch_far_frac`` (the share of those tokens whose two log-probs differ by more than
    :data:`~grpo_kit.loss.MISMATCH_FAR`), ``sampled_nll`` (their mean ``-logp`` under the trainer: an
    estimate of the per-token entropy; all three None when no token was trained), ``base_mismatch_kl``
    (k3 KL(engine || base model) over the same tokens, from the reference forward: None when
    ``kl_beta == 0``, which runs none),
    ``tokens`` (the batch's scored completion tokens), ``tokens_trained`` (those of the rows trained: fewer
    when ``kl_beta == 0`` skips rows with advantage 0), ``samples``, ``samples_nonzero_adv``.
    ``policy_loss``: the loss function (the contract in :mod:`grpo_kit.algorithms`); None takes the
    one ``loss_cfg.policy_loss`` names. Rows with advantage 0 are skipped only for a loss that
    declares them lossless (``zero_adv_is_zero``). ``shard_sizes``: this step's rows per rank; None
    splits by rows (``numpy.array_split``), or with ``optim_cfg.packing`` by the tokens each rank runs.
    """
    distributed = isinstance(model, DDP)
    module = model.module if distributed else model
    if distributed:
        pg = model.process_group
        if _syncs_buffers_in_forward(model):
            raise ValueError(
                "DDP must be built with broadcast_buffers=False (forward_sync_buffers=False): use wrap_ddp"
            )
        if (rank, world_size) != (torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg)):
            raise ValueError(f"rank/world_size {rank}/{world_size} do not match the DDP process group")
    elif world_size != 1:
        raise ValueError(f"world_size={world_size} needs a DDP-wrapped model (wrap_ddp)")
    if loss_cfg.kl_beta > 0 and not hasattr(module, "disable_adapter"):
        raise ValueError("kl_beta > 0 takes the reference from the base model: model must be a PEFT model")

    device = next(module.parameters()).device
    loss_fn = algorithms.policy_loss(loss_cfg.policy_loss) if policy_loss is None else policy_loss
    skip = loss_cfg.kl_beta == 0 and algorithms.skips_zero_adv(loss_fn)
    if optim_cfg.packing and shard_sizes is None and world_size > 1:
        # balance the ranks by the tokens they will run (skipped rows run none), not by rows
        full, _ = packed_costs(batch, optim_cfg.share_prompt)
        costs = [c if not skip or a != 0 else 0 for c, a in zip(full, batch.adv.tolist(), strict=True)]
        shard_sizes = balanced_shard_sizes(costs, world_size)
    start, stop = shard_bounds(len(batch), rank, world_size, shard_sizes)
    shard = batch[start:stop].to(device)
    f64 = torch.float64
    optimizer.zero_grad(set_to_none=True)

    # (1) global normalizers, before any backward
    counts = torch.stack(
        [
            torch.tensor(float(len(shard)), dtype=f64, device=device),
            shard.completion_mask.sum().to(f64),
            (shard.adv != 0).sum().to(f64),
        ]
    )  # (3,) samples, tokens, samples with nonzero adv
    longest = shard.completion_mask.sum(dim=1).max().to(f64) if len(shard) else torch.zeros((), dtype=f64)
    longest = longest.to(device).reshape(1)  # (1,)
    if distributed:
        torch.distributed.all_reduce(counts, group=pg)
        torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX, group=pg)
    n_samples, n_tokens, n_nonzero = (int(c) for c in counts.tolist())
    norm = Normalizer(num_seqs=n_samples, num_tokens=n_tokens, max_len=int(longest) if max_len is None else max_len)
    if skip and not bool((shard.adv != 0).all()):
        shard = shard[(shard.adv != 0).nonzero().squeeze(1)]  # no loss term without an advantage (module docstring)

    # (2) local micro-batches; gradients accumulate without communication. Shared prompts only
    # where no sequence outruns a sliding attention window (logprobs.attention_window)
    window = attention_window(module)
    share = optim_cfg.share_prompt and shares_within(window, batch.input_ids, batch.attention_mask, batch.completion_mask)
    if optim_cfg.share_prompt and not share:
        # one text per model: Python's default filter shows it once per process, not every step
        warnings.warn(f"share_prompt is off for batches whose longest prompt and longest completion together pass "
                      f"the model's sliding attention window ({window} tokens): a shared prompt's cache positions "
                      "would misplace the window (set share_prompt=False to silence this)", RuntimeWarning, stacklevel=2)
    if optim_cfg.packing:
        if not share:
            check_packing(module)  # once per model class: its attention must see the packed boundaries
        logprobs_fn = functools.partial(packed_logprobs, share_prompt=share)
    else:
        logprobs_fn = shared_prompt_logprobs if share else token_logprobs
    loss_sum = torch.zeros((), dtype=f64, device=device)
    trainer_old = loss_cfg.old_logp_source == "trainer"
    correct = trainer_old and loss_cfg.importance_sampling_correction
    stats = LossStats.empty(device, kl=loss_cfg.kl_beta > 0, is_weight=correct)
    diag = torch.zeros(4, dtype=f64, device=device)  # engine/trainer k3, far tokens, -logp (loss.mismatch_sums); engine/base k3
    with model.no_sync() if distributed else contextlib.nullcontext():
        for lo, hi in micro_batch_bounds(shard, optim_cfg):
            mb = shard[lo:hi].trim()
            ref_logp = None
            if loss_cfg.kl_beta > 0:
                # the unwrapped module: a reference forward must not touch the DDP reducer
                with torch.no_grad(), module.disable_adapter():
                    ref_logp = logprobs_fn(module, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                           temperature=temperature)
            logp = logprobs_fn(model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                               temperature=temperature)  # (b, t)
            # old_logp_source="trainer": the trainer's own log-probs before this (single) update are
            # this forward's, detached; the engine's then only feed the mismatch weight
            loss, st = loss_fn(
                logp,
                logp.detach() if trainer_old else mb.old_logp,
                ref_logp,
                mb.adv,
                mb.completion_mask,
                cfg=loss_cfg,
                norm=norm,
                sampling_logp=mb.old_logp if correct else None,
            )
            # DDP averages gradients over ranks; the global loss is the SUM of the local ones
            (loss * world_size).backward()
            loss_sum += loss.detach().to(f64)
            stats = stats + st
            diag[:3] += mismatch_sums(logp, mb.old_logp, mb.completion_mask)  # old_logp: the engine's, always
            if ref_logp is not None:  # how close the engine's samples are to the base model's (loop: wrong policy)
                diag[3] += mismatch_sums(ref_logp, mb.old_logp, mb.completion_mask)[0]

    # (3) the one synchronizing backward, identical on every rank. The 1-token forward need not
    # reach every trainable parameter (an expert its router skips, any conditionally run module):
    # the 0-weighted sum of all of them puts each one in the graph, so every DDP bucket is reduced.
    # Its gradient is exactly 0 (0 * 1 per element), so the accumulated gradients are unchanged.
    params = [p for p in module.parameters() if p.requires_grad]
    if distributed:
        out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
        (sum((p.sum() for p in params), out.logits.sum()) * 0.0).backward()

    # (4) clip, step, stats. A parameter no backward reached (a batch whose rows all lack an
    # advantage, skipped) gets a zero gradient, as the whole-batch update and DDP's reduced buckets
    # give it: the optimizer still steps (AdamW's decay and moments, its step count)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    max_norm = optim_cfg.max_grad_norm if optim_cfg.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    else:  # clipping an inf gradient makes it NaN, and the step would write NaN into the adapter: skipped
        # (every rank sees the same reduced gradients, so all skip); the record's grad_norm says so
        log.warning("non-finite gradient norm (%s): the optimizer step is skipped", grad_norm)
    optimizer.zero_grad(set_to_none=True)

    sums, maxes = stats.pack()
    sums = torch.cat([sums, diag, loss_sum.reshape(1)])  # (13,): the same all-reduce carries the diagnostics
    if distributed:
        torch.distributed.all_reduce(sums, group=pg)
        torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=pg)
    summary = LossStats.unpack(sums[:-5], maxes).summary()
    k3_sum, far_count, nll_sum, base_k3_sum = sums[-5:-1].tolist()
    trained = summary["tokens"]
    return {
        "loss": float(sums[-1]),
        **summary,
        "mismatch_kl": k3_sum / trained if trained else None,
        "mismatch_far_frac": far_count / trained if trained else None,
        "sampled_nll": nll_sum / trained if trained else None,
        "base_mismatch_kl": base_k3_sum / trained if trained and loss_cfg.kl_beta > 0 else None,
        "tokens": float(n_tokens),
        "tokens_trained": summary["tokens"],
        "grad_norm": grad_norm,
        "samples": float(n_samples),
        "samples_nonzero_adv": float(n_nonzero),
    }
