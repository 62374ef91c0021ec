"""The synthetic task: seeded column addition (see :mod:`grpo_kit.data`), scored by the ``####`` reward."""

from __future__ import annotations

import functools

from .. import data
from .base import Task
from .gsm8k import hash_reward


def task(n_digits: int = 3, n_terms: int = 2, format_bonus: float = 0.0, lenient_credit: float = 0.0) -> Task:
    """Addition of ``n_terms`` numbers of ``n_digits`` digits; no held-out question is a training one (a
    hash of the operands splits them), though its operands' other order may be, and its sum usually is."""

    def problems(split: str, n: int, seed: int) -> list[data.Problem]:
        return data.synthetic_problems(n, split=split, seed=seed, n_digits=n_digits, n_terms=n_terms)

    reward = functools.partial(hash_reward, format_bonus=format_bonus, lenient_credit=lenient_credit)
    return Task("synthetic", problems, [reward], names=["answer"], instruction=data.DEFAULT_INSTRUCTION)
