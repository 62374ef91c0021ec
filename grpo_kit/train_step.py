"""Token log-probs, the batch record, and one GRPO optimizer step (single process or one DDP rank).

Alignment: every per-token tensor is ``(B, T)`` and aligned with ``input_ids``: column ``t`` holds
the value for token ``input_ids[:, t]``, predicted from positions ``< t``. Column 0 has no prediction
and is 0; prompts are non-empty, so it is never a completion token. ``completion_mask`` is therefore
the loss mask as it is, and an engine's sampling log-probs go at the completion tokens' own columns.

Scored and real tokens: ``attention_mask`` marks the real tokens (prompt and the whole completion
side), ``completion_mask`` the scored ones, the tokens the policy sampled. For a single-turn
completion they coincide after the prompt; a multi-turn episode (:mod:`grpo_kit.episode`) has holes
in its completion: environment and template ids, real (attention 1) but not scored (mask 0). The
stream is scored in one forward, and the loss, its normalizers and every statistic cover the scored
tokens only (:func:`grpo_kit.loss.grpo_loss` reads nothing off its mask).

Shared prompts: with ``OptimConfig.share_prompt`` the step's forwards use
:func:`shared_prompt_logprobs`, which runs each group's prompt once and its completions on the
prompt's key/value cache; values and gradients equal :func:`token_logprobs`'s up to float rounding.

Packed micro-batches: with ``OptimConfig.packing`` each micro-batch runs as ONE padding-free row
(:func:`packed_logprobs`): every sequence's real tokens back to back, positions restarting at 0 for
each, a block-diagonal causal mask (transformers builds it from the position resets, or flash
attention's variable-length path reads them), and with ``share_prompt`` each group's prompt once
under an explicit 4-D mask. The log-probs come back in the ``(B, T)`` layout above, so the loss is
the same function of the same tensors. Micro-batches are cut by tokens (``micro_batch_tokens``,
:func:`micro_batch_bounds`), and without explicit ``shard_sizes`` the ranks' contiguous shards are
balanced by the tokens they run (:func:`balanced_shard_sizes`; the update does not depend on the split).

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
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from grpo_kit import algorithms
from grpo_kit.config import LossConfig, OptimConfig
from grpo_kit.loss import LossStats, Normalizer, mismatch_sums


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


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
) -> Tensor:
    """``(B, T)`` log-probs of the completion tokens of ``input_ids`` under ``model``; 0 elsewhere.

    Aligned with ``input_ids`` (module docstring). Only the logits rows that predict completion
    tokens are kept, and they are upcast (to float32, or kept in float64) ``chunk`` rows at a time,
    so the float32 copy of the vocab-wide logits exists once, for completion rows only.
    ``temperature`` scores the tempered distribution ``softmax(logits / temperature)``, the one the
    engines sample from and record log-probs of (TRL divides its logits the same way).
    ``completion_mask`` may have holes (real tokens not scored: an episode's environment ids); it
    must not be set on padding (``attention_mask`` 0).
    """
    check_masks(attention_mask, completion_mask)
    B, T = input_ids.shape
    m = completion_mask[:, 1:].bool()  # (B, T-1) completion tokens at columns 1..T-1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    rows = logits[:, :-1][m]  # (N, V) in the model dtype: the rows that predict completion tokens
    del logits  # autograd keeps only indices for the selection: the full (B, T, V) tensor is freed here
    vals = _rows_logprobs(rows, input_ids[:, 1:][m], chunk, temperature)  # (N,)
    logp = vals.new_zeros((B, T - 1)).masked_scatter(m, vals)  # (B, T-1)
    return F.pad(logp, (1, 0))  # (B, T)


def check_masks(attention_mask: Tensor, completion_mask: Tensor) -> None:
    """Reject a ``completion_mask`` set at column 0 (no prediction) or on padding (``attention_mask`` 0)."""
    if completion_mask[:, :1].any():
        raise ValueError("completion_mask is set at column 0, which has no prediction; prompts must be non-empty")
    if (completion_mask.bool() & ~attention_mask.bool()).any():
        raise ValueError("completion_mask is set on padding (attention_mask 0): rows must be right-padded prompt + "
                         "completion (train_step.collate)")


def _rows_logprobs(rows: Tensor, targets: Tensor, chunk: int, temperature: float = 1.0) -> Tensor:
    """``log_softmax(rows / temperature)[targets]`` for ``(N, V)`` logits rows, upcast ``chunk`` rows at a time."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    dtype = torch.promote_types(rows.dtype, torch.float32)
    parts = []
    for x, y in zip(rows.split(chunk), targets.split(chunk), strict=True):
        x = x.to(dtype)  # (n, V)
        if temperature != 1.0:
            x = x / temperature  # after the upcast, as the engines temper their float32 logits
        parts.append(x.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(x, dim=-1))  # (n,)
    return torch.cat(parts) if parts else rows.new_zeros((0,), dtype=dtype)  # (N,)


def shared_prompt_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
) -> Tensor:
    """:func:`token_logprobs` (same layout, same values up to float rounding), with each run of
    consecutive rows that share a prompt running that prompt once.

    A GRPO group's completions share their prompt, so a batch of ``P`` groups of ``G`` holds each
    prompt ``G`` times. Here the ``P`` distinct prompts go through the model once (right-padded,
    ``use_cache=True``); their key/value cache is indexed out to the ``B`` rows
    (``Cache.batch_select_indices``, differentiable), and the completions run on top of it with
    explicit positions. Gradients flow through the cache into the prompt forward, so the LoRA
    gradient is that of the full forward. Rows must be right-padded (``attention_mask`` a run of 1s
    from column 0, :func:`collate`); a row's shared prefix is everything before its first scored
    token (its prompt: a completion begins with a sampled token), and everything after it, scored
    or not (an episode's environment ids), runs on the cache. Rows whose prefixes differ simply
    form runs of one.
    """
    check_masks(attention_mask, completion_mask)
    B, T = input_ids.shape
    device = input_ids.device
    scored = completion_mask.bool()  # (B, T)
    seq_len = attention_mask.sum(dim=1)  # (B,) real tokens
    if B == 0 or not bool(scored.any()):  # nothing to share; the plain forward keeps the graph (and DDP) as is
        return token_logprobs(model, input_ids, attention_mask, completion_mask, chunk=chunk, temperature=temperature)
    cols = torch.arange(T, device=device)
    if not torch.equal((cols[None] < seq_len[:, None]).to(attention_mask.dtype), attention_mask):
        raise ValueError("shared_prompt_logprobs needs right-padded rows of prompt then completion (train_step.collate)")
    has = scored.any(dim=1)  # (B,)
    prompt_len = torch.where(has, scored.long().argmax(dim=1), seq_len)  # (B,) first scored column, or all
    comp_len = seq_len - prompt_len  # (B,) real tokens from the first scored one on
    if (prompt_len < 1).any():
        raise ValueError("shared_prompt_logprobs needs right-padded rows of prompt then completion (train_step.collate)")

    # runs of consecutive rows with the same prompt
    in_prompt = cols[None] < prompt_len[:, None]  # (B, T)
    same = (prompt_len[1:] == prompt_len[:-1]) & ((input_ids[1:] == input_ids[:-1]) | ~in_prompt[1:]).all(dim=1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=device), ~same])  # (B,)
    run = starts.long().cumsum(0) - 1  # (B,) run index of each row
    heads = starts.nonzero().squeeze(1)  # (P,) first row of each run
    Lp = int(prompt_len.max())
    p_ids = input_ids[heads, :Lp]  # (P, Lp) prompt, then whatever follows it (masked out)
    p_mask = in_prompt[heads, :Lp].to(attention_mask.dtype)  # (P, Lp)
    p_pos = cols[:Lp].expand(len(heads), Lp)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True)
    cache = out.past_key_values
    if cache is None or not hasattr(cache, "batch_select_indices"):
        raise TypeError(f"{type(model).__name__} returned no indexable cache; use share_prompt=False")
    p_plen = prompt_len[heads]  # (P,)
    last = out.logits[torch.arange(len(heads), device=device), p_plen - 1]  # (P, V): predicts completion token 0
    del out
    cache.batch_select_indices(run)  # (B, ...) per layer

    Lc = int(comp_len.max())
    c_cols = prompt_len[:, None] + torch.arange(Lc, device=device)[None]  # (B, Lc) columns in input_ids
    c_real = torch.arange(Lc, device=device)[None] < comp_len[:, None]  # (B, Lc) real tokens (attended)
    c_ids = input_ids.gather(1, c_cols.clamp(max=T - 1)) * c_real  # (B, Lc), 0 at padding
    c_scored = scored.gather(1, c_cols.clamp(max=T - 1)) & c_real  # (B, Lc) scored tokens; column 0 where has
    mask = torch.cat([p_mask[run], c_real.to(attention_mask.dtype)], dim=1)  # (B, Lp + Lc)
    logits = model(input_ids=c_ids, attention_mask=mask, position_ids=c_cols, past_key_values=cache,
                   use_cache=False).logits  # (B, Lc, V)
    first = _rows_logprobs(last[run[has]], c_ids[has, 0], chunk, temperature)  # (B0,) the first scored token
    m = c_scored[:, 1:]  # (B, Lc-1) scored tokens after it, predicted by completion positions 0..
    rest = _rows_logprobs(logits[:, :-1][m], c_ids[:, 1:][m], chunk, temperature)  # (N - B0,)
    del logits
    r0 = has.nonzero().squeeze(1)
    ri, rj = m.nonzero(as_tuple=True)
    rows_i = torch.cat([r0, ri])
    cols_t = torch.cat([prompt_len[r0], prompt_len[ri] + rj + 1])
    vals = torch.cat([first, rest])
    return vals.new_zeros((B, T)).index_put((rows_i, cols_t), vals)  # (B, T)


class PackLayout(NamedTuple):
    """Where each real token of a right-padded ``(B, T)`` micro-batch sits in its packed row of ``N`` tokens."""

    src: Tensor
    """(N,) flat index into ``input_ids.reshape(-1)`` of each packed token."""
    position_ids: Tensor
    """(N,) each token's position in its own sequence (0 at every sequence's first token)."""
    unit: Tensor
    """(N,) the unit each token belongs to: a row, or with ``share_prompt`` a run of rows sharing a prompt."""
    segment: Tensor
    """(N,) -1 on a unit's shared prompt, else the index of the row (within the unit) the token belongs to."""
    index: Tensor
    """(B, T) the packed index of each real token of each row (its shared prompt's for prompt tokens), -1 elsewhere."""


def prompt_runs(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(prompt_len, starts)``: each row's shared prefix (everything before its first scored token;
    all of it when none is scored) and whether the row starts a run of consecutive rows sharing that
    prefix (the runs :func:`shared_prompt_logprobs` and :func:`packed_logprobs` run once). Both ``(B,)``."""
    B, T = input_ids.shape
    device = input_ids.device
    scored = completion_mask.bool()
    seq_len = attention_mask.sum(dim=1)
    prompt_len = torch.where(scored.any(dim=1), scored.long().argmax(dim=1), seq_len)  # (B,)
    in_prompt = torch.arange(T, device=device)[None] < prompt_len[:, None]  # (B, T)
    same = (prompt_len[1:] == prompt_len[:-1]) & ((input_ids[1:] == input_ids[:-1]) | ~in_prompt[1:]).all(dim=1)
    starts = torch.cat([torch.ones(min(B, 1), dtype=torch.bool, device=device), ~same])  # (B,)
    return prompt_len, starts


def _check_right_padded(attention_mask: Tensor, who: str) -> None:
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    seq_len = attention_mask.sum(dim=1)
    if not torch.equal((cols[None] < seq_len[:, None]).to(attention_mask.dtype), attention_mask):
        raise ValueError(f"{who} needs right-padded rows of prompt then completion (train_step.collate)")


def pack_layout(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, *,
                share_prompt: bool = False) -> PackLayout:
    """The packed row of a right-padded micro-batch (:func:`collate`): every row with a scored token,
    its real tokens only, one after the other; rows with nothing scored are left out (their
    log-probs are 0). With ``share_prompt`` each run of consecutive rows that share a prompt
    (:func:`prompt_runs`) holds that prompt once, then each row's completion side, whose positions
    continue the prompt's."""
    check_masks(attention_mask, completion_mask)
    _check_right_padded(attention_mask, "packing")
    B, T = input_ids.shape
    cpu = lambda x: x.detach().cpu()  # noqa: E731 (the layout is a few small integer vectors)
    seq_len = cpu(attention_mask.sum(dim=1)).tolist()
    has = cpu(completion_mask.bool().any(dim=1)).tolist()
    if share_prompt:
        prompt_len, starts = prompt_runs(input_ids, attention_mask, completion_mask)
        prompt_len, run = cpu(prompt_len).tolist(), cpu(starts.long().cumsum(0)).tolist()
    else:
        prompt_len, run = [0] * B, list(range(B))
    src, pos, unit, segment = [], [], [], []
    index = torch.full((B, T), -1, dtype=torch.long)
    n, u, j, cur, prompt_at = 0, -1, 0, None, None  # tokens so far; unit, row in it, its run, its prompt's indices
    for r in range(B):
        if not has[r]:
            continue
        p, L = prompt_len[r], seq_len[r]
        if run[r] != cur:  # a new unit: its prompt once (with share_prompt)
            u, j, cur = u + 1, 0, run[r]
            src.append(torch.arange(p) + r * T)
            pos.append(torch.arange(p))
            unit.append(torch.full((p,), u))
            segment.append(torch.full((p,), -1))
            prompt_at = torch.arange(n, n + p)
            n += p
        index[r, :p] = prompt_at
        src.append(torch.arange(p, L) + r * T)
        pos.append(torch.arange(p, L))
        unit.append(torch.full((L - p,), u))
        segment.append(torch.full((L - p,), j))
        index[r, p:L] = torch.arange(n, n + L - p)
        n, j = n + L - p, j + 1
    device = input_ids.device
    cat = (lambda xs: torch.cat(xs).to(device)) if src else (lambda xs: torch.zeros(0, dtype=torch.long, device=device))
    return PackLayout(cat(src), cat(pos), cat(unit), cat(segment), index.to(device))


def pack_attention_mask(layout: PackLayout, attn_implementation: str, dtype: torch.dtype) -> Tensor:
    """(1, 1, N, N) mask of a packed row with shared prompts: a token sees the earlier tokens of its
    own segment and its unit's shared prompt, nothing else (causal, block-diagonal per unit). Boolean
    for sdpa, additive for eager (transformers adds an eager mask to the scores)."""
    n = layout.src.shape[0]
    causal = torch.ones((n, n), dtype=torch.bool, device=layout.src.device).tril()
    same_unit = layout.unit[:, None] == layout.unit[None, :]
    visible = (layout.segment[:, None] == layout.segment[None, :]) | (layout.segment[None, :] == -1)
    allowed = (causal & same_unit & visible)[None, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"packing with share_prompt builds a 4-D mask, which attn_implementation={attn_implementation!r} "
                     "does not take; use sdpa or eager attention, or share_prompt=False (packing by position ids, "
                     "which flash attention's variable-length path reads)")


def _base_module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def packed_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    share_prompt: bool = False,
    chunk: int = 1024,
    temperature: float = 1.0,
) -> Tensor:
    """:func:`token_logprobs` (same ``(B, T)`` layout, same values up to float rounding) from ONE
    forward of the micro-batch packed into a single row, padding-free (:func:`pack_layout`).

    Without ``share_prompt`` the row carries per-sequence ``position_ids`` (0 at each sequence's
    start) and no attention mask: transformers then finds the sequences from the position resets
    (``masking_utils.find_packed_sequence_indices``) and builds the block-diagonal causal mask (sdpa,
    eager, flex) or runs flash attention's variable-length kernel. An ``attention_mask`` of ones
    would switch that detection off and let sequences attend to their neighbours (huggingface/trl#7087
    is that class of bug), so none is passed. With ``share_prompt`` each run of rows sharing a prompt
    holds it once, and an explicit 4-D mask (:func:`pack_attention_mask`, sdpa or eager) lets each
    completion see its prompt and itself. Only the positions that predict scored tokens reach the LM
    head (``logits_to_keep`` as an index tensor, where the model takes it).
    """
    B, T = input_ids.shape
    if B == 0 or not bool(completion_mask.any()):  # nothing scored: the plain forward keeps the graph (and DDP)
        return token_logprobs(model, input_ids, attention_mask, completion_mask, chunk=chunk, temperature=temperature)
    lay = pack_layout(input_ids, attention_mask, completion_mask, share_prompt=share_prompt)
    m = completion_mask[:, 1:].bool()  # (B, T-1) scored tokens at columns 1..T-1
    pred = lay.index[:, :-1][m]  # (S,) packed positions that predict them
    kw = {}
    base = _base_module(model)
    if share_prompt:
        cfg = base.config
        dtype = base.get_input_embeddings().weight.dtype
        kw["attention_mask"] = pack_attention_mask(lay, getattr(cfg, "_attn_implementation", None), dtype)
    if "logits_to_keep" in inspect.signature(base.get_base_model().forward if hasattr(base, "get_base_model")
                                             else base.forward).parameters:
        kw["logits_to_keep"] = pred
    ids = input_ids.reshape(-1)[lay.src][None]  # (1, N)
    logits = model(input_ids=ids, position_ids=lay.position_ids[None], use_cache=False, **kw).logits[0]
    # (S, V) if the model kept those rows; (N, V) if it ignores logits_to_keep (N > S: a row's last token predicts nothing)
    rows = logits if logits.shape[0] == pred.shape[0] else logits[pred]
    del logits
    vals = _rows_logprobs(rows, input_ids[:, 1:][m], chunk, temperature)  # (S,)
    logp = vals.new_zeros((B, T - 1)).masked_scatter(m, vals)  # (B, T-1)
    return F.pad(logp, (1, 0))  # (B, T)


def micro_batch_bounds(batch: TrainBatch, optim_cfg: OptimConfig) -> list[tuple[int, int]]:
    """``[start, stop)`` of each micro-batch of ``batch``: ``micro_batch`` rows at a time, or with
    ``packing`` consecutive rows while their packed tokens (:func:`packed_costs`; a shared prompt
    counted once per micro-batch) fit ``micro_batch_tokens`` (a row longer than it goes alone)."""
    n = len(batch)
    if not optim_cfg.packing:
        return [(i, min(i + optim_cfg.micro_batch, n)) for i in range(0, n, optim_cfg.micro_batch)]
    full, cont = packed_costs(batch, optim_cfg.share_prompt)
    bounds, lo, used = [], 0, 0
    for i in range(n):
        c = cont[i] if i > lo else full[i]  # a micro-batch's first row brings its prompt
        if i > lo and c and used + c > optim_cfg.micro_batch_tokens:
            bounds.append((lo, i))
            lo, c = i, full[i]
            used = 0
        used += c
    if n:
        bounds.append((lo, n))
    return bounds


def packed_costs(batch: TrainBatch, share_prompt: bool) -> tuple[list[int], list[int]]:
    """Per row, the packed tokens it adds: alone (``full``: its real tokens; 0 when nothing is
    scored, :func:`pack_layout` leaves it out) and after the previous row (``cont``: without its
    prompt when it continues a run of a shared prompt)."""
    seq_len = batch.attention_mask.sum(dim=1)
    has = batch.completion_mask.bool().any(dim=1)
    full = torch.where(has, seq_len, 0)
    if not share_prompt or not len(batch):
        return full.tolist(), full.tolist()
    prompt_len, starts = prompt_runs(batch.input_ids, batch.attention_mask, batch.completion_mask)
    prev_has = torch.cat([torch.zeros(1, dtype=torch.bool, device=has.device), has[:-1]])  # a run continues through a scored row
    cont = torch.where(~starts & prev_has & has, seq_len - prompt_len, full)
    return full.tolist(), cont.tolist()


def balanced_shard_sizes(costs: Sequence[float], world_size: int) -> list[int]:
    """Contiguous shard sizes whose summed ``costs`` (a row's tokens) are near-even across ranks: rank
    ``r`` ends at the (first) row boundary nearest ``(r + 1) / world_size`` of the total.
    Deterministic, so every rank computes the same split of the same batch."""
    cum = [0.0]
    for c in costs:
        cum.append(cum[-1] + float(c))
    total, cuts = cum[-1], [0]
    for r in range(1, world_size):
        target = total * r / world_size
        cuts.append(min(range(cuts[-1], len(cum)), key=lambda i: abs(cum[i] - target)))  # the first nearest
    cuts.append(len(costs))
    return [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


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
    ``max_new_tokens``); None takes the longest completion in the batch. ``temperature`` is the
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

    # (2) local micro-batches; gradients accumulate without communication
    if optim_cfg.packing:
        logprobs_fn = functools.partial(packed_logprobs, share_prompt=optim_cfg.share_prompt)
    else:
        logprobs_fn = shared_prompt_logprobs if optim_cfg.share_prompt else token_logprobs
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

    # (4) clip, step, stats
    max_norm = optim_cfg.max_grad_norm if optim_cfg.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    optimizer.step()
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
