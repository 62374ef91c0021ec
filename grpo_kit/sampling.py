"""Usable groups: which groups carry a policy gradient, dynamic sampling's selection, and what a usable sample costs.

A group whose completions all got the same reward has advantage 0 on every completion
(:func:`~grpo_kit.loss.group_advantages`), so its policy-gradient term is 0 in value and gradient.
Its *usable* samples are none; a group with reward spread contributes all of its completions that
have a reward. An unscorable completion (reward None: no reward function applied; TRL's all-NaN
row, :mod:`grpo_kit.tasks.base`) is left out of its group's spread and gets advantage 0.

Dynamic sampling (DAPO, verl's ``filter_groups``; ``SamplingConfig.dynamic_sampling``) drops the
zero-spread groups before training and fills the batch with usable groups from more generation
(:func:`extra_prompts` sizes each extra round) and from a carry-over of surplus usable groups
(:func:`select_groups`), within ``max_gen_batches * prompts_per_step`` prompts per iteration and
``max_staleness``. The pipelined batch itself is over-sampled by the usable share seen so far
(:func:`extra_prompts` again) for the usable groups it needs beyond those carried into it, so that
its generation, which overlaps the previous step's training, does most of the work and the extra
rounds, which do not, are rare. A surplus group is carried only if it will still be within
``max_staleness`` at the next step, one version later, where the oldest groups train first
(:func:`select_groups`: a carried group can be newer than the pipelined batch's, sampled ``depth``
versions back); one that finds no room there is carried again while it stays within bounds, else
counted as expired. A pipelined batch that arrives ``max_staleness`` behind (pacing's full depth)
therefore cannot pass its surplus on.

What dropping changes in the objective. Per batch of ``N`` sequences with normalizer ``Z``
(``loss_type`` grpo: ``N``; dr_grpo: ``N * max_len``; dapo: the batch's completion tokens), the loss
is ``L = (1/Z) sum_i [PG_i + kl_beta * KL_i]``, ``i`` over all sequences. A zero-spread sequence has
``PG_i = 0`` but not ``KL_i = 0``. Training on the usable set ``U`` alone (normalizer ``Z_U``) gives
``grad L_U = (Z / Z_U) * (grad L - (kl_beta / Z) * sum_{i not in U} grad KL_i)``: with
``kl_beta = 0`` the same direction, rescaled by ``Z / Z_U`` (Adam's update is nearly scale-free; the
gradient-norm clip sees the larger norm). With ``kl_beta > 0`` the KL gradient of the dropped
sequences is lost: the policy is no longer held to the reference on the prompts it always solves
(or always fails) in that batch, the KL penalty becomes an estimate over prompts that have reward
spread only, and the recorded ``kl_mean`` is measured on those prompts only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .rollout import RolloutSummary


@dataclass(frozen=True)
class Group:
    """One prompt's completions as dynamic sampling sees them (the completions themselves ride in ``payload``)."""

    rewards: tuple[float | None, ...]
    """Reward of each completion (None: unscorable)."""
    version: int
    """Adapter version that sampled the group."""
    tokens: int = 0
    """Completion tokens of the group."""
    payload: Any = None
    """The completions (or a handle to them); never read here."""

    @property
    def has_spread(self) -> bool:
        """Some completion scored differently from another: the group has a policy gradient."""
        scored = self.scored
        return len(scored) > 1 and max(scored) > min(scored)

    @property
    def scored(self) -> tuple[float, ...]:
        """The rewards of the completions that have one."""
        return tuple(r for r in self.rewards if r is not None)

    def __len__(self) -> int:
        return len(self.rewards)


def usable_samples(groups: Sequence[Group]) -> int:
    """Completions with a reward in groups with reward spread.

    >>> usable_samples([Group((1.0, 0.0), 0), Group((1.0, 1.0), 0), Group((0.5, 0.0, 0.5), 0), Group((1.0, None, 0.0), 0)])
    7
    """
    return sum(len(g.scored) for g in groups if g.has_spread)


@dataclass(frozen=True)
class Selection:
    """What :func:`select_groups` decided for one batch."""

    train: list[Group]
    """Usable groups to train on now, at most ``want``, carried-over ones first."""
    carry: list[Group]
    """Surplus usable groups kept for the next batch (still within ``max_staleness`` then)."""
    dropped: int
    """Zero-spread groups dropped."""
    expired: int
    """Usable groups dropped because they would be more than ``max_staleness`` behind when trained."""


def select_groups(carried: Sequence[Group], fresh: Sequence[Group], want: int, version: int,
                  max_staleness: int) -> Selection:
    """Choose ``want`` usable groups for a step at trainer ``version``: the oldest first (they expire
    first; a carried group can be newer than a fresh one of a pipelined batch, sampled ``depth``
    versions back), carried before fresh among equals, each in its order. Zero-spread groups are dropped; a surplus
    usable group is carried to the next step (trained at ``version + 1``) if it will still be within
    ``max_staleness`` there, else counted as expired.

    >>> g = lambda spread, v: Group((1.0, 0.0) if spread else (0.0, 0.0), v)
    >>> s = select_groups([g(True, 0)], [g(False, 1), g(True, 1), g(True, 1)], want=2, version=1, max_staleness=1)
    >>> [x.version for x in s.train], [x.version for x in s.carry], s.dropped, s.expired
    ([0, 1], [1], 1, 0)
    >>> s = select_groups([], [g(True, 0), g(True, 0)], want=1, version=1, max_staleness=1)
    >>> len(s.train), len(s.carry), s.expired
    (1, 0, 1)
    >>> s = select_groups([g(True, 3), g(True, 3)], [g(True, 2), g(True, 2)], want=2, version=3, max_staleness=1)
    >>> [x.version for x in s.train], [x.version for x in s.carry], s.expired  # the older fresh ones train
    ([2, 2], [3, 3], 0)
    """
    pool = sorted([*carried, *fresh], key=lambda g: g.version)  # stable: carried first among equals
    dropped = sum(not g.has_spread for g in pool)
    usable = [g for g in pool if g.has_spread]
    too_old = [g for g in usable if version - g.version > max_staleness]
    usable = [g for g in usable if version - g.version <= max_staleness]
    train, rest = usable[:want], usable[want:]
    carry = [g for g in rest if version + 1 - g.version <= max_staleness]
    return Selection(train, carry, dropped, len(too_old) + len(rest) - len(carry))


def extra_prompts(need: int, usable_share: float | None, cap: int) -> int:
    """Prompts to sample in an extra round for ``need`` more usable groups, given the share of usable
    groups seen so far (None: no estimate yet); at least ``need``, at most ``cap``.

    >>> extra_prompts(4, 0.5, 16), extra_prompts(4, 0.0, 16), extra_prompts(4, None, 16), extra_prompts(0, 0.5, 16)
    (8, 16, 4, 0)
    >>> extra_prompts(21, 7 / 10, 64)  # not 31: 21 / 0.7 is 30.000000000000004 in floats
    30
    """
    if need <= 0:
        return 0
    if usable_share is None:
        return min(cap, need)
    exact = need / max(usable_share, 1e-9)
    return max(min(need, cap), min(cap, math.ceil(exact - 1e-9 * exact)))  # a float residue is not a prompt


def usable_cost(device_s: float, usable: int, price_per_hour: float = 0.0) -> tuple[float | None, float | None]:
    """Device-seconds and money per usable sample: ``(device_s / usable, that * price_per_hour / 3600)``;
    None where there is no usable sample or no price.

    >>> usable_cost(36.0, 12, price_per_hour=2.0)
    (3.0, 0.0016666666666666668)
    >>> usable_cost(36.0, 0)
    (None, None)
    """
    if usable <= 0:
        return None, None
    per = device_s / usable
    return per, (per * price_per_hour / 3600.0 if price_per_hour > 0 else None)


# ---------------------------------------------------------------- groups of the rollout chunks


def summaries_of(results: list[dict]) -> list[RolloutSummary]:
    """The chunks' rollout summaries in training order (group, then sample)."""
    rows = [RolloutSummary.from_dict(r) for res in results for r in res["rollouts"]]
    return sorted(rows, key=lambda r: (r.group_id, r.sample_idx))


def groups_of(results: list[dict], scored: list | None, group_size: int) -> list[Group]:
    """The groups of some chunks' summaries (each chunk holds whole groups), in group order. Each
    group's payload is its completions as ``(summary, scored chunk future, index in that chunk)``:
    where the trainer ranks will fetch the tokens from (``scored`` None: no futures, records only)."""
    by: dict[int, list] = {}
    for c, res in enumerate(results):
        for i, d in enumerate(res["rollouts"]):
            r = RolloutSummary.from_dict(d)
            by.setdefault(r.group_id, []).append((r, None if scored is None else scored[c], i))
    out = []
    for gid in sorted(by):
        rs = sorted(by[gid], key=lambda x: x[0].sample_idx)
        if len(rs) != group_size:
            raise RuntimeError(f"group {gid} has {len(rs)} completions, not group_size={group_size}")
        out.append(Group(tuple(None if r.reward is None else float(r.reward) for r, _, _ in rs), rs[0][0].version,
                         sum(r.completion_tokens for r, _, _ in rs), rs))
    return out
