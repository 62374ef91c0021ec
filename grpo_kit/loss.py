"""The GRPO objective: group advantages, the clipped importance-ratio surrogate, k3 KL, aggregation.

Pure tensor math: tensors in, ``(loss, stats)`` out; no model calls, process groups or logging.

Per completion token (``B`` sequences, ``T`` positions, ``mask`` marks the completion tokens)::

    ratio    = exp(logp - old_logp)
    surr     = min(ratio * adv, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * adv)
    k3       = exp(ref_logp - logp) - (ref_logp - logp) - 1        # >= 0, unbiased KL estimate
    loss_tok = -surr + kl_beta * k3

Engine/trainer mismatch (TRL's ``vllm_importance_sampling_*`` semantics): when the old log-probs are
the trainer's own (``old_logp`` computed by the trainer, not the engine's sampling log-probs) and
``sampling_logp`` is given, the policy-gradient term of each token is multiplied by a detached
importance weight from the sampling policy to the trainer's::

    w = exp(old_logp - sampling_logp)               # per token (token_*), or
    w = exp(sum over the sequence of the same)      # per sequence (sequence_*)
    token_truncate / sequence_truncate:  w = min(w, cap)
    token_mask / sequence_mask:          w = 0 where w > cap
    loss_tok = -w * surr + kl_beta * k3

Aggregation uses TRL's ``loss_type`` names:

- ``grpo``: mean over sequences of each sequence's token mean,
- ``dapo``: sum over all tokens / token count,
- ``dr_grpo``: sum over all tokens / (sequences * max_len), max_len a constant (the completion budget).

A :class:`Normalizer` replaces the local counts by global ones; the loss is then the local sum divided
by the global normalizer, so losses of disjoint parts of a batch add up to the loss of the whole batch
(which is what a sharded, micro-batched step needs). :class:`LossStats` carries raw sums, so stats of
parts combine exactly too (``+`` locally, all-reduce of :meth:`LossStats.pack` across ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_kit.config import ADV_SCALES, IS_MODES, LOSS_TYPES


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Advantages ``(r - group mean) / (std + eps)`` for consecutive groups of ``group_size`` rewards.

    ``scale`` picks the std: the group's (``"group"``), the whole batch's (``"batch"``), or none
    (``"none"``, no division). Stds are unbiased (``correction=1``), as in TRL. A group whose rewards
    are all equal gets advantage exactly 0 everywhere, whatever the scale: its float mean need not
    equal its rewards (the mean of six 0.1s is not 0.1), and a residue of 1e-13 would count as an
    advantage where the trainer skips rows with none.

    A NaN reward is an unscorable completion (no reward function applied; TRL's all-NaN row): it is
    left out of its group's mean and std and of the batch's std, and its advantage is 0, as TRL's
    ``nanmean``/``nanstd`` and ``nan_to_num`` do. A group with fewer than two rewards has no spread.

    >>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, scale="none")
    tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    >>> group_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), 4, scale="none")
    tensor([ 0.6667,  0.0000, -0.3333, -0.3333])
    """
    if scale not in ADV_SCALES:
        raise ValueError(f"scale must be one of {ADV_SCALES}, got {scale!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}; "
            "rewards must hold whole consecutive groups"
        )
    if scale == "group" and group_size < 2:
        raise ValueError("scale='group' needs group_size >= 2 (the std of one reward is undefined)")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # (N,)
    if bool(torch.isnan(r).any()):
        return _group_advantages_unscorable(r, group_size, scale, eps)
    groups = r.view(-1, group_size)  # (G, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)  # (G, group_size)
    if scale == "group":
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        std = r.std() if r.numel() > 1 else r.new_zeros(())
        centered = centered / (std + eps)
    flat = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)  # (G, 1) no reward spread
    return torch.where(flat, 0.0, centered).reshape(-1)  # (N,)


class ScoredGroups(NamedTuple):
    """Per-group views of rewards (N,) with NaN for unscorable completions (:func:`scored_groups`)."""

    values: Tensor
    """(G, group_size) the rewards, NaN put to 0."""
    scored: Tensor
    """(G, group_size) bool: the completion has a reward."""
    count: Tensor
    """(G, 1) scored completions per group."""
    mean: Tensor
    """(G, 1) the mean of the scored rewards (0 where none is scored)."""
    flat: Tensor
    """(G, 1) bool: fewer than two scored, or all scored equal (no reward spread)."""


def scored_groups(rewards: Tensor, group_size: int) -> ScoredGroups:
    """:class:`ScoredGroups` of rewards (N,) in consecutive groups of ``group_size``."""
    groups = rewards.view(-1, group_size)  # (G, group_size)
    scored = ~torch.isnan(groups)
    count = scored.sum(dim=1, keepdim=True)  # (G, 1)
    hi = torch.where(scored, groups, -torch.inf).amax(dim=1, keepdim=True)
    lo = torch.where(scored, groups, torch.inf).amin(dim=1, keepdim=True)
    values = torch.where(scored, groups, 0.0)
    return ScoredGroups(values, scored, count, values.sum(dim=1, keepdim=True) / count.clamp(min=1),
                        (count < 2) | (hi == lo))


def _group_advantages_unscorable(r: Tensor, group_size: int, scale: str, eps: float) -> Tensor:
    g = scored_groups(r, group_size)
    centered = torch.where(g.scored, g.values - g.mean, 0.0)  # (G, group_size)
    if scale == "group":  # unbiased, as TRL's nanstd
        centered = centered / ((centered.square().sum(dim=1, keepdim=True) / (g.count - 1).clamp(min=1)).sqrt() + eps)
    elif scale == "batch":
        kept = r[~torch.isnan(r)]
        std = kept.std() if kept.numel() > 1 else r.new_zeros(())
        centered = centered / (std + eps)
    return torch.where(g.flat | ~g.scored, 0.0, centered).reshape(-1)  # (N,)


@dataclass(frozen=True)
class Normalizer:
    """Global counts that replace a batch's own in :func:`grpo_loss` (all-reduced by a sharded step)."""

    num_seqs: int
    """Sequences in the whole batch (grpo, dr_grpo)."""
    num_tokens: int
    """Completion tokens in the whole batch (dapo)."""
    max_len: int
    """dr_grpo's constant length (the completion budget, e.g. max_new_tokens)."""


@dataclass(frozen=True)
class LossStats:
    """Detached raw sums over masked tokens; combine with ``+`` (or all-reduce :meth:`pack`),
    then read means with :meth:`summary`."""

    tokens: Tensor
    """() completion tokens."""
    ratio_sum: Tensor
    """() sum of ratios."""
    ratio_sqsum: Tensor
    """() sum of squared ratios."""
    clip_low_count: Tensor
    """() tokens where the lower clip is active (ratio < 1 - clip_eps and adv < 0)."""
    clip_high_count: Tensor
    """() tokens where the upper clip is active (ratio > 1 + clip_eps_high and adv > 0)."""
    kl_sum: Tensor
    """() sum of k3; NaN when no reference log-probs were given."""
    ratio_min: Tensor
    """() smallest ratio; +inf when there are no tokens."""
    ratio_max: Tensor
    """() largest ratio; -inf when there are no tokens."""
    is_sum: Tensor
    """() sum over tokens of the engine-mismatch weight before truncation; NaN when not applied."""
    is_capped_count: Tensor
    """() tokens whose weight was truncated or masked (it exceeded the cap)."""
    is_min: Tensor
    """() smallest weight before truncation; +inf when there are no tokens."""
    is_max: Tensor
    """() largest weight before truncation; -inf when there are no tokens."""

    SUMS = ("tokens", "ratio_sum", "ratio_sqsum", "clip_low_count", "clip_high_count", "kl_sum", "is_sum",
            "is_capped_count")
    MAXES = ("ratio_min", "ratio_max", "is_min", "is_max")  # the *_min ones travel negated
    SUMMARY_KEYS = ("ratio_mean", "ratio_std", "ratio_min", "ratio_max", "clip_low", "clip_high", "clip_frac", "kl",
                    "is_mean", "is_min", "is_max", "is_capped_frac", "tokens")
    """The keys of :meth:`summary`."""

    @classmethod
    def empty(cls, device: torch.device | str | None = None, kl: bool = True, is_weight: bool = False) -> LossStats:
        """Stats of zero tokens (the identity of ``+``); ``kl=False`` marks KL as not computed and
        ``is_weight=False`` the engine-mismatch weight."""
        z = torch.zeros((), dtype=torch.float64, device=device)
        inf = torch.full((), float("inf"), dtype=torch.float64, device=device)
        nan = z + float("nan")
        return cls(z, z, z, z, z, z if kl else nan, inf, -inf, z if is_weight else nan, z, inf, -inf)

    def __add__(self, other: LossStats) -> LossStats:
        sums = {k: getattr(self, k) + getattr(other, k) for k in self.SUMS}
        return LossStats(
            **sums,
            ratio_min=torch.minimum(self.ratio_min, other.ratio_min),
            ratio_max=torch.maximum(self.ratio_max, other.ratio_max),
            is_min=torch.minimum(self.is_min, other.is_min),
            is_max=torch.maximum(self.is_max, other.is_max),
        )

    def pack(self) -> tuple[Tensor, Tensor]:
        """``(sums (8,), maxes (4,))``: all-reduce the first with SUM and the second with MAX
        (it holds ``-ratio_min``, ``ratio_max``, ``-is_min``, ``is_max``), then :meth:`unpack`."""
        sums = torch.stack([getattr(self, k) for k in self.SUMS])  # (8,)
        maxes = torch.stack([-self.ratio_min, self.ratio_max, -self.is_min, self.is_max])  # (4,)
        return sums, maxes

    @classmethod
    def unpack(cls, sums: Tensor, maxes: Tensor) -> LossStats:
        return cls(**dict(zip(cls.SUMS, sums.unbind(), strict=True)), ratio_min=-maxes[0], ratio_max=maxes[1],
                   is_min=-maxes[2], is_max=maxes[3])

    def summary(self) -> dict[str, float | None]:
        """Means over tokens: ratio mean/std/min/max, clip fractions (low/high/total), KL mean, the
        engine-mismatch weight's mean/min/max and capped share, token count. None where there are no
        tokens (a step that trained nothing measured nothing, and None stays valid JSON where NaN does
        not); ``kl`` is NaN when tokens were trained without a reference; the ``is_*`` values are None
        when no weight was applied."""
        names = [f.name for f in fields(self)]
        v = dict(zip(names, torch.stack([getattr(self, k) for k in names]).tolist(), strict=True))  # one sync
        n = v["tokens"]
        if n <= 0:
            return {k: None for k in self.SUMMARY_KEYS} | {"tokens": n}
        mean = v["ratio_sum"] / n
        return {
            "ratio_mean": mean,
            "ratio_std": max(v["ratio_sqsum"] / n - mean * mean, 0.0) ** 0.5,
            "ratio_min": v["ratio_min"],
            "ratio_max": v["ratio_max"],
            "clip_low": v["clip_low_count"] / n,
            "clip_high": v["clip_high_count"] / n,
            "clip_frac": (v["clip_low_count"] + v["clip_high_count"]) / n,
            "kl": v["kl_sum"] / n,
            **(
                {"is_mean": None, "is_min": None, "is_max": None, "is_capped_frac": None}
                if math.isnan(v["is_sum"])  # no engine-mismatch weight in this loss
                else {
                    "is_mean": v["is_sum"] / n,
                    "is_min": v["is_min"],
                    "is_max": v["is_max"],
                    "is_capped_frac": v["is_capped_count"] / n,
                }
            ),
            "tokens": n,
        }


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.0,
    loss_type: str = "grpo",
    norm: Normalizer | None = None,
    sampling_logp: Tensor | None = None,
    is_mode: str = "sequence_mask",
    is_cap: float = 3.0,
) -> tuple[Tensor, LossStats]:
    """The clipped GRPO loss of a batch and its :class:`LossStats`.

    ``logp``, ``old_logp``, ``ref_logp`` and ``mask`` are ``(B, T)``, ``adv`` is ``(B,)``. Only
    positions where ``mask`` is set are read: anything elsewhere (padding, prompt, NaN) changes
    neither the loss nor the gradient. ``ref_logp`` may be None when ``kl_beta == 0``. Without
    ``norm`` the counts are this batch's (dr_grpo's ``max_len`` is then ``T``, the batch's width,
    prompt included: pass ``norm`` with the completion budget for the paper's constant); with it, the loss is the
    local sum over the global normalizer. Sequences without tokens contribute 0 (no NaN).
    ``sampling_logp`` (B, T), when given, applies the engine-mismatch weight of ``is_mode`` capped at
    ``is_cap`` (module docstring); ``old_logp`` is then the trainer's.
    """
    check_inputs(logp, old_logp, ref_logp, adv, mask, kl_beta, loss_type)
    if sampling_logp is not None:
        check_mismatch(logp, sampling_logp, is_mode, is_cap)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    m = mask.bool()  # (B, T)
    # torch.where, not a multiply: garbage (inf/NaN) off the mask must not reach values or gradients
    logp = torch.where(m, logp, 0.0)  # (B, T)
    old_logp = torch.where(m, old_logp.to(logp.dtype), 0.0)  # (B, T)
    a = adv.to(logp.dtype)[:, None]  # (B, 1)

    ratio = torch.exp(logp - old_logp)  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)  # (B, T)
    surr = torch.minimum(ratio * a, clipped * a)  # (B, T)
    w_raw = None
    if sampling_logp is not None:
        w_raw, w = mismatch_weight(old_logp, sampling_logp, m, is_mode, is_cap)
        surr = surr * w
    per_tok, k3 = add_kl(-surr, logp, ref_logp, m, kl_beta)  # (B, T)
    loss = aggregate(per_tok, m, loss_type, norm)
    with torch.no_grad():
        # exactly where the min picks the clipped branch (whose slope in logp is 0)
        stats = token_stats(ratio, m, (ratio < 1.0 - clip_eps) & (a < 0), (ratio > 1.0 + eps_high) & (a > 0), k3,
                            w_raw, is_cap)
    return loss, stats


def check_inputs(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor, kl_beta: float,
                 loss_type: str) -> None:
    """The shape and argument checks every policy loss makes (:func:`grpo_loss`'s)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if kl_beta > 0 and ref_logp is None:
        raise ValueError("kl_beta > 0 needs ref_logp")
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape or adv.shape != logp.shape[:1]:
        raise ValueError(
            f"expected logp/old_logp/mask (B, T) and adv (B,); got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}, {tuple(adv.shape)}"
        )


def check_mismatch(logp: Tensor, sampling_logp: Tensor, is_mode: str, is_cap: float) -> None:
    """The checks of the engine-mismatch weight's arguments."""
    if is_mode not in IS_MODES:
        raise ValueError(f"is_mode must be one of {IS_MODES}, got {is_mode!r}")
    if not is_cap > 0:
        raise ValueError(f"is_cap must be > 0, got {is_cap}")
    if sampling_logp.shape != logp.shape:
        raise ValueError(f"sampling_logp must be (B, T) like logp, got {tuple(sampling_logp.shape)}")


def mismatch_weight(old_logp: Tensor, sampling_logp: Tensor, m: Tensor, is_mode: str,
                    is_cap: float) -> tuple[Tensor, Tensor]:
    """``(w_raw, w)`` (B, T), detached: the engine-mismatch weight before and after its cap (module
    docstring); ``old_logp`` is the trainer's, already 0 off the boolean mask ``m``."""
    with torch.no_grad():  # in float64: a sequence's summed log-weight passes float32's exp range (88.7)
        d = torch.where(m, old_logp.detach().double() - sampling_logp.double(), 0.0)  # (B, T)
        if is_mode.startswith("sequence"):
            d = d.sum(dim=1, keepdim=True).expand_as(d)  # (B, T): the sequence's log-weight on each token
        w_raw = torch.exp(d.clamp(max=LOG_WEIGHT_MAX)).to(old_logp.dtype)  # (B, T)
        w = w_raw.clamp(max=is_cap) if is_mode.endswith("truncate") else torch.where(w_raw > is_cap, 0.0, w_raw)
    return w_raw, w


def add_kl(per_tok: Tensor, logp: Tensor, ref_logp: Tensor | None, m: Tensor,
           kl_beta: float) -> tuple[Tensor, Tensor | None]:
    """``(per_tok + kl_beta * k3, k3)`` with ``k3`` (B, T) the KL estimate to ``ref_logp`` (None
    without one), then 0 off the boolean mask ``m``. ``logp`` must already be 0 off the mask."""
    k3 = None
    if ref_logp is not None:
        d = torch.where(m, ref_logp.to(logp.dtype), 0.0) - logp  # (B, T)
        k3 = torch.exp(d) - d - 1.0  # (B, T)
        if kl_beta > 0:
            per_tok = per_tok + kl_beta * k3
    return torch.where(m, per_tok, 0.0), k3  # (B, T)


def aggregate(per_tok: Tensor, m: Tensor, loss_type: str, norm: Normalizer | None) -> Tensor:
    """The loss ``per_tok`` (B, T, 0 off the boolean mask ``m``) aggregated by ``loss_type``: the
    local sum over ``norm``'s global counts (None: this batch's own, dr_grpo's ``max_len`` is ``T``,
    the width with the prompt: a fallback, not the completion budget)."""
    B, T = per_tok.shape
    tok_per_seq = m.sum(dim=1)  # (B,)
    if norm is None:  # this batch's own counts; the token count stays a tensor (no host sync)
        num_seqs, num_tokens, max_len = B, tok_per_seq.sum(), T
    else:
        num_seqs, num_tokens, max_len = norm.num_seqs, norm.num_tokens, norm.max_len
    if loss_type == "grpo":
        seq_mean = per_tok.sum(dim=1) / tok_per_seq.clamp(min=1)  # (B,)
        return seq_mean.sum() / _at_least_one(num_seqs)
    if loss_type == "dapo":
        return per_tok.sum() / _at_least_one(num_tokens)
    return per_tok.sum() / _at_least_one(num_seqs * max_len)  # dr_grpo


def token_stats(ratio: Tensor, m: Tensor, clip_low: Tensor, clip_high: Tensor, k3: Tensor | None,
                w_raw: Tensor | None = None, is_cap: float = float("inf")) -> LossStats:
    """:class:`LossStats` of the tokens of the boolean mask ``m``: ``ratio`` (B, T) each token's
    importance ratio, ``clip_low``/``clip_high`` (B, T) bool where a clip is active, ``k3`` (B, T) or
    None, ``w_raw`` the engine-mismatch weight before its cap ``is_cap``, or None."""
    with torch.no_grad():
        f64, dev = torch.float64, ratio.device
        r = ratio.to(f64)  # (B, T)
        mf = m.to(f64)  # (B, T)
        return LossStats(
            tokens=mf.sum(),
            ratio_sum=(r * mf).sum(),
            ratio_sqsum=(r * r * mf).sum(),
            clip_low_count=(clip_low & m).sum().to(f64),
            clip_high_count=(clip_high & m).sum().to(f64),
            kl_sum=(k3.to(f64) * mf).sum() if k3 is not None else torch.full((), float("nan"), dtype=f64, device=dev),
            ratio_min=_masked_extreme(r, m, largest=False),
            ratio_max=_masked_extreme(r, m, largest=True),
            **_weight_stats(w_raw, is_cap, m, mf),
        )


LOG_WEIGHT_MAX = 60.0
"""The engine-mismatch log-weight is clamped here before ``exp`` (``w_raw`` <= e^60, about 1e26): far
past any cap, so the capped weight is unchanged, and its statistics stay finite (a long sequence's
summed log-difference overflowed float32 to inf, which is not valid JSON in the records)."""
MISMATCH_FAR = math.log(2.0)
"""A token is far from the engine when its trainer log-prob differs by more than this (a 2x probability)."""


def mismatch_sums(logp: Tensor, engine_logp: Tensor, mask: Tensor, far: float = MISMATCH_FAR) -> Tensor:
    """``(3,)`` float64 detached sums over the masked tokens: the k3 KL from the engine's sampling
    distribution to the trainer's, the tokens whose log-probs differ by more than ``far``, and the
    trainer's ``-logp`` (a one-sample estimate of the sampled tokens' entropy). The tokens were
    sampled by the engine, so with ``d = logp - engine_logp`` the k3 term ``exp(d) - d - 1`` is an
    unbiased, non-negative estimate of KL(engine || trainer). Off-mask values are never read.

    >>> mismatch_sums(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, float("nan")]]), torch.tensor([[1, 0]]))
    tensor([0., 0., 1.], dtype=torch.float64)
    """
    with torch.no_grad():
        m = mask.bool()
        t = torch.where(m, logp.detach().to(torch.float64), 0.0)  # (B, T)
        d = torch.where(m, t - engine_logp.to(torch.float64), 0.0)  # (B, T)
        k3 = torch.exp(d) - d - 1.0  # (B, T) 0 off the mask
        return torch.stack([k3.sum(), (d.abs() > far).sum().to(torch.float64), -t.sum()])  # (3,)


def _weight_stats(w_raw: Tensor | None, cap: float, m: Tensor, mf: Tensor) -> dict[str, Tensor]:
    f64 = torch.float64
    if w_raw is None:
        nan = torch.full((), float("nan"), dtype=f64, device=m.device)
        inf = torch.full((), float("inf"), dtype=f64, device=m.device)
        return {"is_sum": nan, "is_capped_count": torch.zeros((), dtype=f64, device=m.device), "is_min": inf,
                "is_max": -inf}
    w = w_raw.to(f64)
    return {
        "is_sum": (w * mf).sum(),
        "is_capped_count": ((w_raw > cap) & m).sum().to(f64),
        "is_min": _masked_extreme(w, m, largest=False),
        "is_max": _masked_extreme(w, m, largest=True),
    }


def _at_least_one(n: int | Tensor) -> int | Tensor:
    # an empty batch (or shard) has a zero normalizer; its sum is 0 as well, so 0 / 1 = 0, never NaN
    return n.clamp(min=1) if isinstance(n, Tensor) else max(n, 1)


def _masked_extreme(x: Tensor, m: Tensor, largest: bool) -> Tensor:
    fill = float("-inf") if largest else float("inf")
    # a trailing fill column keeps the reduction defined on empty tensors
    flat = torch.cat([torch.where(m, x, fill).flatten(), x.new_full((1,), fill)])
    return flat.amax() if largest else flat.amin()
