"""GSM8K (hub id, or local JSONL/parquet as at ``../shared/data/gsm8k``), scored by the ``####`` reward."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .. import data
from ..reward import RewardResult, gsm8k_reward
from .base import Task, text_of


def hash_reward(prompts: Sequence[str], completions: Sequence[str], gold: Sequence[str],
                format_bonus: float = 0.0, lenient_credit: float = 0.0, **_) -> list[RewardResult]:
    """:func:`~grpo_kit.reward.gsm8k_reward` in TRL's signature (completions as text or TRL's
    conversational messages): 1 for ``#### <gold>``, plus
    ``format_bonus`` for the form, ``lenient_credit`` for the right number read without the marker.

    >>> [r.score for r in hash_reward(["1+1?", "1+1?"], ["#### 2", "it is 2"], ["2", "2"], lenient_credit=0.5)]
    [1.0, 0.5]
    """
    return [gsm8k_reward(text_of(c), g, format_bonus=format_bonus, lenient=lenient_credit > 0, lenient_credit=lenient_credit)
            for c, g in zip(completions, gold, strict=True)]


def task(source: str = data.GSM8K_HUB_ID, format_bonus: float = 0.0, lenient_credit: float = 0.0) -> Task:
    """GSM8K's train split for training, its test split held out."""

    def problems(split: str, n: int, seed: int) -> list[data.Problem]:
        return list(data.load_gsm8k(source, "test" if split == "heldout" else "train", limit=n))

    reward = functools.partial(hash_reward, format_bonus=format_bonus, lenient_credit=lenient_credit)
    return Task("gsm8k", problems, [reward], names=["answer"], instruction=data.DEFAULT_INSTRUCTION)
