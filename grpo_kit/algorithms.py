"""Policy losses and advantage estimators as plug-ins: two small registries and the built-ins.

The config names one of each (``LossConfig.policy_loss``, ``LossConfig.advantage``); a notebook cell
can register its own with :func:`register_policy_loss` / :func:`register_advantage`, or hand a plain
function to ``loop.run(..., policy_loss=fn, advantage=fn)``. Either way the driver resolves the name
to a function and the trainer ranks receive that function by cloudpickle (so a function defined in a
notebook cell reaches them by value); ``config.json`` records a function given directly as
``module:qualname``. Names of that form are resolved by import, so an importable function needs no
registration. A function pickled by value carries the globals it references (keep a cell's loss
free of references to big objects: it travels with every step's rank spec).

Advantage contract::

    adv = fn(rewards, group_size, cfg)     # rewards (N,) float64, cfg a LossConfig -> adv (N,)

- ``rewards`` holds the WHOLE step's batch, as consecutive groups of ``group_size`` completions of one
  prompt; every rank computes the advantages of the whole batch before sharding it, so batch-level
  statistics (REINFORCE++'s) are exact under DDP. The function must be deterministic (each rank
  calls it) and return finite values, one per completion (one advantage per sequence: per-token
  advantages are not a plug-in point yet).
- A group whose rewards are all equal must get advantage exactly 0 (``0.0``, not a 1e-17 residue):
  the trainer skips rows without advantage, dynamic sampling drops such groups, and the records count
  them; :func:`zero_flat_groups` does it. The one exception is a baseline from outside the group
  (``reinforce_pp_global``): there a flat group carries signal, which dynamic sampling (it drops
  groups without reward spread) and the records' usable-sample counts (groups with spread) do not see.
- Unscorable completions (no reward function applied to them: reward None, TRL's all-NaN row) get
  advantage 0 and must not move their group's baseline. An estimator that declares
  ``takes_unscorable`` (``register_advantage(name, takes_unscorable=True)`` or
  ``fn.takes_unscorable = True``; all the built-ins do) receives them as NaN and leaves them out, as
  TRL's ``nanmean``/``nanstd`` do. Any other receives each as its group's mean of the scored rewards
  (0 where none is scored): exact for a group-mean baseline, while a std or leave-one-out mean then
  counts the filled values too. Either way :func:`compute_advantages` puts their advantages to 0.

Policy-loss contract::

    loss, stats = fn(logp, old_logp, ref_logp, adv, mask, *, cfg, norm, sampling_logp)

- ``logp`` (B, T) the trainer's log-probs (with gradient), ``old_logp`` (B, T) the ratio's old
  log-probs (the engine's, or the trainer's own detached ones with ``old_logp_source="trainer"``),
  ``ref_logp`` (B, T) the base model's or None (``kl_beta == 0``), ``adv`` (B,), ``mask`` (B, T) 1 on
  the tokens the policy sampled, ``cfg`` the :class:`~grpo_kit.config.LossConfig`, ``norm`` a
  :class:`~grpo_kit.loss.Normalizer` of global counts (None: this batch's own), ``sampling_logp``
  (B, T) the engine's sampling log-probs when the engine-mismatch weight is to be applied (else None).
- Masked tokens: only positions where ``mask`` is 1 may be read. Mask 0 covers padding, the prompt
  and, in multi-turn episodes, the environment's and the template's ids; their log-probs can be
  anything (0, NaN, inf). Use ``torch.where(mask, x, 0.0)`` before any arithmetic, never ``x * mask``
  (``nan * 0`` is NaN, and a NaN gradient leaks through a multiply).
- Exactness: the loss must be a SUM over the batch's tokens (or sequences) divided by the normalizer
  of ``cfg.loss_type`` computed from ``norm`` (:func:`grpo_kit.loss.aggregate` does it), never a mean
  over the tensors given: the trainer calls the function once per micro-batch on each rank's shard,
  and only a local sum over a global count adds up to the full-batch loss, so that DDP and
  micro-batched updates equal the single full-batch update exactly. Anything that couples sequences
  (a batch mean inside the loss) breaks this; put it in the advantage estimator, which sees the
  whole batch.
- Zero-advantage skip: with ``kl_beta == 0`` the trainer drops rows whose advantage is 0 before the
  forward, which is exact only if such a row contributes 0 in value and gradient. Declare it with
  ``register_policy_loss(name, zero_adv_is_zero=True)`` (or ``fn.zero_adv_is_zero = True``); an
  undeclared function trains every row (the same update, more work).
- Statistics: return a :class:`~grpo_kit.loss.LossStats` of raw sums over the masked tokens
  (:func:`grpo_kit.loss.token_stats` builds one); the figures read its ratio mean/std/min/max, clip
  fractions, KL mean and mismatch weight. Stats of micro-batches and ranks are added and
  all-reduced, so they must be sums, not means.

Built-ins (``POLICY_LOSSES``: ``grpo``, ``gspo``, ``cispo``; ``ADVANTAGES``: ``grpo``, ``dr_grpo``,
``rloo``, ``reinforce_pp``, ``reinforce_pp_global``) keep the KL term and the engine-mismatch weight of :func:`grpo_loss`, so
``kl_beta``, ``loss_type`` and ``importance_sampling_*`` mean the same for each.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from grpo_kit.loss import (
    LossStats,
    Normalizer,
    add_kl,
    aggregate,
    check_inputs,
    check_mismatch,
    group_advantages,
    grpo_loss,
    mismatch_weight,
    scored_groups,
    token_stats,
)

if TYPE_CHECKING:
    from grpo_kit.config import LossConfig

PolicyLoss = Callable[..., tuple[Tensor, LossStats]]
Advantage = Callable[[Tensor, int, "LossConfig"], Tensor]

POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Registered policy losses by name."""
ADVANTAGES: dict[str, Advantage] = {}
"""Registered advantage estimators by name."""


REGISTRIES: dict[str, dict] = {"policy_loss": POLICY_LOSSES, "advantage": ADVANTAGES}
"""Each plug-in config field (``LossConfig.policy_loss``, ``LossConfig.advantage``) -> its registry."""


def register_policy_loss(name: str, *, zero_adv_is_zero: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss under ``name`` (module docstring: the contract).
    ``zero_adv_is_zero``: a row with advantage 0 contributes nothing without the KL term, so the
    trainer may skip it. Registering a taken name replaces the entry (a re-run notebook cell)."""
    _check_name(name)

    def deco(fn: PolicyLoss) -> PolicyLoss:
        if zero_adv_is_zero:
            fn.zero_adv_is_zero = True
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def register_advantage(name: str, *, takes_unscorable: bool = False) -> Callable[[Advantage], Advantage]:
    """Decorator: register an advantage estimator under ``name`` (module docstring: the contract).
    ``takes_unscorable``: it receives unscorable completions' rewards as NaN and leaves them out
    (else they arrive filled with their group's mean)."""
    _check_name(name)

    def deco(fn: Advantage) -> Advantage:
        if takes_unscorable:
            fn.takes_unscorable = True
        ADVANTAGES[name] = fn
        return fn

    return deco


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a plug-in name is a non-empty string without ':' (kept for module:qualname), got {name!r}")


def policy_loss(name: str) -> PolicyLoss:
    """The policy loss ``name`` names: a registered one, or ``module:qualname`` (imported)."""
    return _lookup(name, POLICY_LOSSES, "policy loss")


def advantage(name: str) -> Advantage:
    """The advantage estimator ``name`` names: a registered one, or ``module:qualname`` (imported)."""
    return _lookup(name, ADVANTAGES, "advantage estimator")


def _lookup(name: str, registry: dict, what: str):
    if name in registry:
        return registry[name]
    if isinstance(name, str) and ":" in name:
        return resolve(name)
    raise ValueError(f"unknown {what} {name!r}; registered: {sorted(registry)} (or give 'module:qualname')")


def check_name(name: str, kind: str) -> None:
    """Raise ValueError unless ``name`` is a registered ``kind`` (``"policy_loss"`` or ``"advantage"``)
    or of the form ``module:qualname`` (resolved when the run starts, not here)."""
    registry = REGISTRIES[kind]
    if not (isinstance(name, str) and (name in registry or ":" in name)):
        raise ValueError(f"{kind} must be one of {sorted(registry)} or 'module:qualname', got {name!r}")


def reference(fn: Callable) -> str:
    """``module:qualname`` of ``fn`` (what ``config.json`` records for a function given directly).

    >>> reference(grpo_loss)
    'grpo_kit.loss:grpo_loss'

    Only a plain function (``def``) has one: a ``functools.partial`` or a callable object would be
    recorded as a name that a resumed run or an export cannot rebuild with its arguments.
    """
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str) or not isinstance(getattr(fn, "__module__", None), str):
        raise ValueError(f"a plug-in must be a plain function (def), not {type(fn).__name__} {fn!r:.60}: wrap "
                         "it, e.g. def my_loss(*args, **kw): return dual_clip(*args, c=3.0, **kw)")
    return f"{fn.__module__}:{qualname}"


def resolve(ref: str) -> Callable:
    """The function ``module:qualname`` names, imported (a function local to another one cannot be)."""
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        raise ValueError(f"{ref!r}: no {qualname!r} in module {module!r}") from e
    return obj


def pack(fn: Callable) -> bytes:
    """``fn`` by cloudpickle: by reference when importable, by value when defined in ``__main__``
    (a notebook cell), so it runs on trainer ranks that never saw the cell."""
    import cloudpickle

    return cloudpickle.dumps(fn)


def unpack(blob: bytes) -> Callable:
    import cloudpickle

    return cloudpickle.loads(blob)


def skips_zero_adv(fn: PolicyLoss) -> bool:
    """Whether the trainer may skip the rows with advantage 0 of ``fn`` (without a KL term)."""
    return bool(getattr(fn, "zero_adv_is_zero", False))


def zero_flat_groups(adv: Tensor, rewards: Tensor, group_size: int) -> Tensor:
    """``adv`` (N,) with exactly 0 in every group whose scored rewards are all equal (or fewer than
    two), and on every unscorable completion (NaN reward)."""
    g = scored_groups(rewards, group_size)
    return torch.where(g.flat | ~g.scored, 0.0, adv.view(-1, group_size)).reshape(-1)  # (N,)


def _check_groups(rewards: Tensor, group_size: int, need: int = 1) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < need or rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} entries: not whole groups of group_size={group_size} "
                         f"(>= {need})")


# ---------------------------------------------------------------- advantage estimators


@register_advantage("grpo", takes_unscorable=True)
def grpo_advantage(rewards: Tensor, group_size: int, cfg: LossConfig) -> Tensor:
    """GRPO's ``(r - group mean) / (std + 1e-4)``, the std per ``cfg.adv_scale`` (today's default).
    TRL: ``advantages = rewards - mean_grouped_rewards`` then ``/ (std_rewards + 1e-4)``
    (``trl/trainer/grpo_trainer.py``, ``_generate_and_score_completions``)."""
    return group_advantages(rewards, group_size, scale=cfg.adv_scale)


@register_advantage("dr_grpo", takes_unscorable=True)
def dr_grpo_advantage(rewards: Tensor, group_size: int, cfg: LossConfig) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training", eq. 3): ``r - group mean``,
    no std (TRL's ``scale_rewards="none"``); the same as ``adv_scale="none"``, as a name."""
    return group_advantages(rewards, group_size, scale="none")


@register_advantage("rloo", takes_unscorable=True)
def rloo_advantage(rewards: Tensor, group_size: int, cfg: LossConfig) -> Tensor:
    """RLOO's leave-one-out baseline (Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i} r_j``, which
    is ``G / (G - 1) * (r_i - group mean)``; verl's ``compute_rloo_outcome_advantage``
    (``verl/trainer/ppo/core_algos.py``: ``scores[i] * response_num / (response_num - 1) -
    id2mean[index[i]] * response_num / (response_num - 1)``). Unscaled; needs ``group_size >= 2``.
    With unscorable completions "the others" are the group's other scored completions."""
    _check_groups(rewards, group_size, need=2)
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # (N,)
    g = scored_groups(r, group_size)
    loo = (g.values.sum(dim=1, keepdim=True) - g.values) / (g.count - 1).clamp(min=1)  # (G, group_size) the others' mean
    return zero_flat_groups((g.values - loo).reshape(-1), r, group_size)


@register_advantage("reinforce_pp", takes_unscorable=True)
def reinforce_pp_advantage(rewards: Tensor, group_size: int, cfg: LossConfig) -> Tensor:
    """REINFORCE++ with its group baseline (Hu et al. 2025, "REINFORCE++-baseline"): subtract the
    group mean, then whiten over the whole batch, ``(x - batch mean) / (batch std + 1e-8)``; verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (``scores - id2mean``, then
    ``verl_F.masked_whiten``). verl whitens over tokens (each sequence weighted by its length); an
    estimator here sees one reward per sequence, so the whitening is over sequences. Groups without
    reward spread stay exactly 0 (the kit's contract). The global-baseline variant is
    :func:`reinforce_pp_global_advantage`. Left open: the KL-in-reward term (it needs the rollouts'
    per-token reference log-probs, which an estimator does not receive)."""
    _check_groups(rewards, group_size)
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # (N,)
    g = scored_groups(r, group_size)
    x = (g.values - g.mean).reshape(-1)  # (N,)
    kept = x[g.scored.reshape(-1)]  # whitened over the scored completions
    std = kept.std() if kept.numel() > 1 else x.new_zeros(())
    return zero_flat_groups((x - (kept.mean() if kept.numel() else 0.0)) / (std + 1e-8), r, group_size)


@register_advantage("reinforce_pp_global", takes_unscorable=True)
def reinforce_pp_global_advantage(rewards: Tensor, group_size: int, cfg: LossConfig) -> Tensor:
    """REINFORCE++ with its global baseline (Hu et al. 2025, "REINFORCE++", global advantage
    normalization): no group mean, the rewards whitened over the whole batch,
    ``(r - batch mean) / (batch std + 1e-8)``; verl's ``compute_reinforce_plus_plus_outcome_advantage``
    (the outcome reward's return, ``gamma = 1``, then ``verl_F.masked_whiten`` over the batch), per
    sequence where verl whitens per token. A group without reward spread gets the signal of its reward
    against the batch's (all right: pushed up; all wrong: pushed down): the contract's one exception
    (module docstring). A batch without any spread gets exactly 0."""
    _check_groups(rewards, group_size)
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # (N,)
    scored = ~torch.isnan(r)
    kept = r[scored]
    if kept.numel() < 2 or kept.amax() == kept.amin():
        return torch.zeros_like(r)
    return torch.where(scored, (r - kept.mean()) / (kept.std() + 1e-8), 0.0)  # (N,)


PRESETS: dict[str, dict[str, str]] = {
    "grpo": {"policy_loss": "grpo", "advantage": "grpo"},
    "gspo": {"policy_loss": "gspo", "advantage": "grpo"},
    "cispo": {"policy_loss": "cispo", "advantage": "grpo"},
    "rloo": {"policy_loss": "grpo", "advantage": "rloo"},
    "reinforce_pp": {"policy_loss": "grpo", "advantage": "reinforce_pp"},
    "dr_grpo": {"policy_loss": "grpo", "advantage": "dr_grpo", "loss_type": "dr_grpo"},
}
"""The built-ins as the study compares them (``bench/algorithms.py``, ``08_algorithms.ipynb``): an
algorithm's config overrides. A loss changes with the rest the kit's default; ``dr_grpo`` is Dr. GRPO
whole, unscaled advantages with its constant normalizer (TRL's ``loss_type="dr_grpo"``)."""


def compute_advantages(fn: Advantage, rewards: Tensor, group_size: int, cfg: LossConfig) -> Tensor:
    """``fn``'s advantages for ``rewards`` (N,), checked against the contract (shape, finite), with
    0 on the unscorable completions (NaN rewards; module docstring: how ``fn`` receives them)."""
    if rewards.numel() == 0:
        return rewards.new_zeros((0,))
    unscorable = torch.isnan(rewards)
    given = rewards
    if bool(unscorable.any()) and not getattr(fn, "takes_unscorable", False):
        _check_groups(rewards, group_size)
        g = scored_groups(rewards, group_size)
        given = torch.where(g.scored, g.values, g.mean).reshape(-1)  # the group's scored mean (0 where none)
    adv = fn(given, group_size, cfg)
    if not isinstance(adv, Tensor) or adv.shape != rewards.shape:
        raise ValueError(f"advantage estimator {reference(fn)} returned {getattr(adv, 'shape', type(adv))}, "
                         f"not one advantage per reward {tuple(rewards.shape)}")
    if not bool(torch.isfinite(adv[~unscorable]).all()):
        raise ValueError(f"advantage estimator {reference(fn)} returned non-finite advantages")
    return torch.where(unscorable, 0.0, adv) if bool(unscorable.any()) else adv


# ---------------------------------------------------------------- policy losses


@register_policy_loss("grpo", zero_adv_is_zero=True)
def grpo_policy_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor, *,
                     cfg: LossConfig, norm: Normalizer | None = None,
                     sampling_logp: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """Today's clipped token-ratio loss, :func:`grpo_kit.loss.grpo_loss` with the config's settings
    (TRL's ``per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)``)."""
    return grpo_loss(
        logp, old_logp, ref_logp, adv, mask,
        clip_eps=cfg.clip_eps,
        clip_eps_high=cfg.clip_eps_high,
        kl_beta=cfg.kl_beta,
        loss_type=cfg.loss_type,
        norm=norm,
        sampling_logp=sampling_logp,
        is_mode=cfg.importance_sampling_mode,
        is_cap=cfg.importance_sampling_cap,
    )


GSPO_CLIP = (3e-4, 4e-4)
"""GSPO's recommended clip range (Zheng et al. 2025, "Group Sequence Policy Optimization", §5.1:
left 3e-4, right 4e-4; verl's GSPO recipe sets ``clip_ratio_low=0.0003, clip_ratio_high=0.0004``)."""


def gspo_clip_range(cfg: LossConfig) -> tuple[float, float]:
    """``(low, high)`` of GSPO's sequence-ratio clip: :data:`GSPO_CLIP` when the config's range is the
    kit's default token range (``clip_eps == 0.2`` and ``clip_eps_high is None``: three orders of
    magnitude too wide for a length-normalized ratio), else the config's. A sequence clip of exactly
    0.2 is ``clip_eps=0.2, clip_eps_high=0.2``."""
    from grpo_kit.config import LossConfig

    default = LossConfig.__dataclass_fields__["clip_eps"].default
    if cfg.clip_eps == default and cfg.clip_eps_high is None:
        return GSPO_CLIP
    return cfg.clip_eps, cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high


def stale_clip_warning(cfg: LossConfig, depth: int) -> str | None:
    """Why a run's GSPO setting will clip most sequences, or None. GSPO's recommended sequence clip
    (:data:`GSPO_CLIP`) is made for a ratio that starts at 1; against pipelined batches (``depth`` > 0,
    sampled a version or more behind) with ``old_logp_source="engine"`` the sequence ratio already
    carries a whole update when the step starts, so the clip drops most sequences' gradients.
    Measured with ``bench/algorithms.py`` (16 iterations, pipelined K = 1): 42% of tokens clipped and
    55.5% held-out accuracy on tiny (the other objectives 100%), 50% clipped and 17.2% on SmolLM2 (the
    others 62.5-69.5%); on tiny with ``pipelined=False``, or pipelined with ``old_logp_source="trainer"``,
    GSPO reached 100% at version 12 as GRPO did, none clipped."""
    try:  # the function, not the name: "grpo_kit.algorithms:gspo_policy_loss" is GSPO too (a review)
        gspo = policy_loss(cfg.policy_loss) is gspo_policy_loss
    except (ValueError, ImportError):
        gspo = False
    if not gspo or depth == 0 or cfg.old_logp_source != "engine" or gspo_clip_range(cfg) != GSPO_CLIP:
        return None
    return (f"policy_loss='gspo' with its recommended sequence clip {GSPO_CLIP} against pipelined batches "
            f"(pipeline depth {depth}, old_logp_source='engine'): each batch is sampled a version behind, so the "
            "sequence ratio carries a whole update and the clip drops most sequences (measured: 42-50% of tokens "
            "clipped, and GSPO did not learn where the other objectives did). Use old_logp_source='trainer' (TRL's "
            "ratio, staleness corrected by the importance weight) or pipelined=False, or a wider clip_eps/clip_eps_high")


def _policy_inputs(logp, old_logp, ref_logp, adv, mask, cfg, sampling_logp):
    check_inputs(logp, old_logp, ref_logp, adv, mask, cfg.kl_beta, cfg.loss_type)
    if sampling_logp is not None:
        check_mismatch(logp, sampling_logp, cfg.importance_sampling_mode, cfg.importance_sampling_cap)
    m = mask.bool()  # (B, T)
    # torch.where, not a multiply: garbage (inf/NaN) off the mask must not reach values or gradients
    logp = torch.where(m, logp, 0.0)  # (B, T)
    old_logp = torch.where(m, old_logp.to(logp.dtype), 0.0)  # (B, T)
    return m, logp, old_logp, adv.to(logp.dtype)[:, None]  # a: (B, 1)


def _weighted(x: Tensor, old_logp: Tensor, sampling_logp: Tensor | None, m: Tensor,
              cfg: LossConfig) -> tuple[Tensor, Tensor | None]:
    """``x`` (B, T) times the engine-mismatch weight of :func:`grpo_kit.loss.mismatch_weight` and the
    weight before its cap (for the stats); ``(x, None)`` without sampling log-probs."""
    if sampling_logp is None:
        return x, None
    w_raw, w = mismatch_weight(old_logp, sampling_logp, m, cfg.importance_sampling_mode, cfg.importance_sampling_cap)
    return x * w, w_raw


@register_policy_loss("gspo", zero_adv_is_zero=True)
def gspo_policy_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor, *,
                     cfg: LossConfig, norm: Normalizer | None = None,
                     sampling_logp: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios, clipped per
    sequence (range: :func:`gspo_clip_range`)::

        s_i      = exp(mean over the sequence's masked tokens of (logp - old_logp))
        loss_tok = -min(s_i * A_i, clip(s_i, 1 - low, 1 + high) * A_i)  on each of its tokens

    TRL ``importance_sampling_level="sequence"`` (``trl/trainer/grpo_trainer.py``, ``_compute_loss``:
    ``log_importance_weights = (log_ratio * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)``,
    then ``coef_1 = torch.exp(log_importance_weights)``). With a per-sequence advantage and a
    sequence-level engine-mismatch weight (the default ``sequence_*`` modes) this has the gradient of
    verl's ``compute_policy_loss_gspo`` (GSPO-token, ``log_prob - log_prob.detach() +
    negative_approx_kl_seq.detach()``): ``s_i * A_i * grad logp`` per token, summed the same way; with
    a per-token weight (``token_truncate``, ``token_mask``) each token's gradient carries the
    sequence's mean weight, TRL's formula (``per_token_loss * importance_sampling_ratio``), where
    verl weights each token's own term.
    The paper's objective is ``loss_type="grpo"`` (a mean over sequences of constant token values);
    the KL term and the engine-mismatch weight are per token, as in :func:`grpo_loss`. The stats give
    each token its sequence's ratio; a clip counts on every token of a clipped sequence."""
    m, logp, old_logp, a = _policy_inputs(logp, old_logp, ref_logp, adv, mask, cfg, sampling_logp)
    low, high = gspo_clip_range(cfg)
    n = m.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    s = torch.exp((logp - old_logp).sum(dim=1, keepdim=True) / n)  # (B, 1) 0 off the mask already
    clipped = torch.clamp(s, 1.0 - low, 1.0 + high)  # (B, 1)
    surr, w_raw = _weighted(torch.minimum(s * a, clipped * a).expand_as(logp), old_logp, sampling_logp, m, cfg)
    per_tok, k3 = add_kl(-surr, logp, ref_logp, m, cfg.kl_beta)  # (B, T)
    loss = aggregate(per_tok, m, cfg.loss_type, norm)
    ratio = s.detach().expand_as(logp)  # (B, T)
    stats = token_stats(ratio, m, ((s < 1.0 - low) & (a < 0)).expand_as(m), ((s > 1.0 + high) & (a > 0)).expand_as(m),
                        k3, w_raw, cfg.importance_sampling_cap)
    return loss, stats


@register_policy_loss("cispo", zero_adv_is_zero=True)
def cispo_policy_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor, *,
                      cfg: LossConfig, norm: Normalizer | None = None,
                      sampling_logp: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): a clipped, stop-gradient importance weight on
    every token, so the clip scales a token's gradient but never drops it::

        loss_tok = -sg(min(ratio, 1 + eps_high)) * A * logp        eps_high = clip_eps_high or clip_eps

    verl's ``compute_policy_loss_cispo`` (``verl/trainer/ppo/core_algos.py``: ``pg_losses =
    -clipped_ratio_sg * advantages * log_prob``). No lower bound: the paper "did not impose a lower
    bound on the IS weight ... only tuned eps_high". Its value is not a surrogate's (it is
    ``-w A logp``); its gradient ``-w A grad logp`` is what matters. The paper normalizes by the
    token count (``loss_type="dapo"``); every ``loss_type`` works. ``clip_high`` counts the tokens
    whose weight was truncated (whatever the advantage's sign), ``clip_low`` is 0."""
    m, logp, old_logp, a = _policy_inputs(logp, old_logp, ref_logp, adv, mask, cfg, sampling_logp)
    eps_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    ratio = torch.exp(logp - old_logp).detach()  # (B, T)
    weight = ratio.clamp(max=1.0 + eps_high)  # (B, T) sg(clip(ratio, max=1 + eps_high))
    pg, w_raw = _weighted(weight * a * logp, old_logp, sampling_logp, m, cfg)  # (B, T)
    per_tok, k3 = add_kl(-pg, logp, ref_logp, m, cfg.kl_beta)  # (B, T)
    loss = aggregate(per_tok, m, cfg.loss_type, norm)
    stats = token_stats(ratio, m, torch.zeros_like(m), ratio > 1.0 + eps_high, k3, w_raw, cfg.importance_sampling_cap)
    return loss, stats
