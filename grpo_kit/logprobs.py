"""Token log-probs of a right-padded batch under a model: the plain forward, and shared prompts.

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

Shared prompts: :func:`shared_prompt_logprobs` runs each group's prompt once and its completions on
the prompt's key/value cache; values and gradients equal :func:`token_logprobs`'s up to float
rounding. Padding-free packed forwards are :mod:`grpo_kit.packing`'s; the batch and the optimizer
step, :mod:`grpo_kit.train_step`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def attention_window(model: nn.Module) -> int | None:
    """The sliding attention window of a model's layers (Gemma-2/3, Mistral-v0.1, Qwen with
    ``use_sliding_window``, GPT-Neo's ``local`` layers), or None where every layer attends to the
    whole sequence. The shared-prompt forwards (:func:`shared_prompt_logprobs`, packed
    ``share_prompt``) place completions at cache indices past the micro-batch's longest prompt, which
    a window counts in: they are exact only where the longest prompt and the longest completion
    side together fit in the window (:func:`shares_within`)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    if "local" in (getattr(cfg, "attention_layers", None) or ()) and getattr(cfg, "window_size", None):
        return int(cfg.window_size)  # GPT-Neo: its local layers' window
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def shares_within(window: int | None, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> bool:
    """Whether shared-prompt forwards of any micro-batch of these rows stay exact under a sliding
    attention ``window`` (None: no window): the longest prompt plus the longest completion side (the
    cache indices a completion token reaches) fit in it. The batch's width alone did not: a row with
    a long prompt and another with a long completion fit it, while a completion token's cache index
    is the longest prompt plus its own place."""
    if window is None or input_ids.shape[0] == 0:
        return True
    prompt_len, _ = prompt_runs(input_ids, attention_mask, completion_mask)
    side = attention_mask.sum(dim=1) - prompt_len
    return int(prompt_len.max()) + int(side.max()) <= window


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
    vals = rows_logprobs(rows, input_ids[:, 1:][m], chunk, temperature)  # (N,)
    logp = vals.new_zeros((B, T - 1)).masked_scatter(m, vals)  # (B, T-1)
    return F.pad(logp, (1, 0))  # (B, T)


def check_masks(attention_mask: Tensor, completion_mask: Tensor) -> None:
    """Reject a ``completion_mask`` set at column 0 (no prediction) or on padding (``attention_mask`` 0)."""
    if completion_mask[:, :1].any():
        raise ValueError("completion_mask is set at column 0, which has no prediction; prompts must be non-empty")
    if (completion_mask.bool() & ~attention_mask.bool()).any():
        raise ValueError("completion_mask is set on padding (attention_mask 0): rows must be right-padded prompt + "
                         "completion (train_step.collate)")


def rows_logprobs(rows: Tensor, targets: Tensor, chunk: int, temperature: float = 1.0) -> Tensor:
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
    from column 0, :func:`grpo_kit.train_step.collate`); a row's shared prefix is everything before its first scored
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
    check_right_padded(attention_mask, "shared_prompt_logprobs")
    cols = torch.arange(T, device=device)
    has = scored.any(dim=1)  # (B,)
    # each row's prompt (first scored column, or all of it) and the runs of consecutive rows sharing it
    prompt_len, starts = prompt_runs(input_ids, attention_mask, completion_mask)  # (B,), (B,)
    comp_len = seq_len - prompt_len  # (B,) real tokens from the first scored one on
    if (prompt_len < 1).any():
        raise ValueError("shared_prompt_logprobs needs right-padded rows of prompt then completion (train_step.collate)")
    in_prompt = cols[None] < prompt_len[:, None]  # (B, T)
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
    first = rows_logprobs(last[run[has]], c_ids[has, 0], chunk, temperature)  # (B0,) the first scored token
    m = c_scored[:, 1:]  # (B, Lc-1) scored tokens after it, predicted by completion positions 0..
    rest = rows_logprobs(logits[:, :-1][m], c_ids[:, 1:][m], chunk, temperature)  # (N - B0,)
    del logits
    r0 = has.nonzero().squeeze(1)
    ri, rj = m.nonzero(as_tuple=True)
    rows_i = torch.cat([r0, ri])
    cols_t = torch.cat([prompt_len[r0], prompt_len[ri] + rj + 1])
    vals = torch.cat([first, rest])
    return vals.new_zeros((B, T)).index_put((rows_i, cols_t), vals)  # (B, T)


def prompt_runs(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(prompt_len, starts)``: each row's shared prefix (everything before its first scored token;
    all of it when none is scored) and whether the row starts a run of consecutive rows sharing that
    prefix (the runs :func:`shared_prompt_logprobs` and :func:`grpo_kit.packing.packed_logprobs` run once). Both ``(B,)``."""
    B, T = input_ids.shape
    device = input_ids.device
    scored = completion_mask.bool()
    seq_len = attention_mask.sum(dim=1)
    prompt_len = torch.where(scored.any(dim=1), scored.long().argmax(dim=1), seq_len)  # (B,)
    in_prompt = torch.arange(T, device=device)[None] < prompt_len[:, None]  # (B, T)
    same = (prompt_len[1:] == prompt_len[:-1]) & ((input_ids[1:] == input_ids[:-1]) | ~in_prompt[1:]).all(dim=1)
    starts = torch.cat([torch.ones(min(B, 1), dtype=torch.bool, device=device), ~same])  # (B,)
    return prompt_len, starts


def check_right_padded(attention_mask: Tensor, who: str) -> None:
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    seq_len = attention_mask.sum(dim=1)
    if not torch.equal((cols[None] < seq_len[:, None]).to(attention_mask.dtype), attention_mask):
        raise ValueError(f"{who} needs right-padded rows of prompt then completion (train_step.collate)")
