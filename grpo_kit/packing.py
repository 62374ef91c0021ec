"""Padding-free packed micro-batches: one row per micro-batch, and micro-batches and shards by tokens.

With ``OptimConfig.packing`` each micro-batch runs as ONE padding-free row (:func:`packed_logprobs`):
every sequence's real tokens back to back, positions restarting at 0 for each, a block-diagonal
causal mask (transformers builds it from the position resets since 4.53.1, the project's floor:
before that one causal mask spanned the row and each sequence attended to the ones packed before it,
0.07 nats off in a review's check; or flash attention's variable-length path reads them), and with ``share_prompt`` each group's prompt once under an explicit 4-D mask
(:func:`pack_attention_mask`). The log-probs come back in :mod:`grpo_kit.logprobs`'s ``(B, T)``
layout, so the loss is the same function of the same tensors. Micro-batches are cut by tokens
(``micro_batch_tokens``, :func:`micro_batch_bounds`), and without explicit ``shard_sizes`` the ranks'
contiguous shards are balanced by the tokens they run (:func:`balanced_shard_sizes`; the update does
not depend on the split).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from grpo_kit.config import OptimConfig
from grpo_kit.logprobs import check_masks, check_right_padded, prompt_runs, rows_logprobs, token_logprobs

if TYPE_CHECKING:
    from grpo_kit.train_step import TrainBatch


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


def pack_layout(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, *,
                share_prompt: bool = False) -> PackLayout:
    """The packed row of a right-padded micro-batch (:func:`grpo_kit.train_step.collate`): every row with a scored token,
    its real tokens only, one after the other; rows with nothing scored are left out (their
    log-probs are 0). With ``share_prompt`` each run of consecutive rows that share a prompt
    (:func:`prompt_runs`) holds that prompt once, then each row's completion side, whose positions
    continue the prompt's."""
    check_masks(attention_mask, completion_mask)
    check_right_padded(attention_mask, "packing")
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
    vals = rows_logprobs(rows, input_ids[:, 1:][m], chunk, temperature)  # (S,)
    logp = vals.new_zeros((B, T - 1)).masked_scatter(m, vals)  # (B, T-1)
    return F.pad(logp, (1, 0))  # (B, T)


_LEAK: dict[type, float] = {}
"""Model class -> how far the probe's second packed sequence moved with the first (:func:`check_packing`)."""
PACKING_TOLERANCE = 1e-4


def check_packing(model: nn.Module) -> None:
    """Refuse plain packing on a model whose forward does not find packed sequences from their
    position resets (Falcon's attention reaches across them): once per model class, a sequence
    packed after two different first sequences must score the same (a difference of
    :data:`PACKING_TOLERANCE` or more is a leak; a padding-versus-packing rounding difference, which
    bfloat16 makes large, does not enter this comparison)."""
    base = _base_module(model)
    # the architecture under a PEFT wrapper (its class is PeftModelForCausalLM for every model: keyed
    # on it, the first model checked answered for every later one in the process)
    cls = type(base.get_base_model() if hasattr(base, "get_base_model") else base)
    if cls not in _LEAK:
        vocab = int(getattr(getattr(base, "config", None), "vocab_size", 0) or 0)
        gen = torch.Generator().manual_seed(0)
        device = next(base.parameters()).device
        ids = torch.randint(3, max(4, min(vocab, 1000)), (3, 8), generator=gen).to(device)  # (3, 8)
        mask = torch.ones_like(ids[:2])
        scored = torch.zeros_like(ids[:2])
        scored[:, 2:] = 1
        was_training = base.training
        base.eval()  # in train mode LoRA dropout would draw two masks, read as a leak
        try:
            with torch.no_grad():
                a = packed_logprobs(base, ids[[0, 2]], mask, scored)[1]  # the third sequence after the first
                b = packed_logprobs(base, ids[[1, 2]], mask, scored)[1]  # ... and after the second
        finally:
            base.train(was_training)
        _LEAK[cls] = float((a - b).abs().max())
    if _LEAK[cls] >= PACKING_TOLERANCE:
        raise ValueError(f"packing=True is not exact for {cls.__name__}: a packed sequence's log-probs moved by "
                         f"{_LEAK[cls]:.2g} with the sequence before it (its attention does not see packed "
                         "sequences' boundaries); set packing=False")


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
