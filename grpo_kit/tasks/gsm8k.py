"""GSM8K (hub id, or local JSONL/parquet as at ``../shared/data/gsm8k``), scored by the ``####`` reward."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from .. import data
from ..reward import RewardResult, gold_value, gsm8k_reward
from .base import Task, text_of
from .rows import in_heldout


def hash_reward(prompts: Sequence[str], completions: Sequence[str], gold: Sequence[str],
                format_bonus: float = 0.0, lenient_credit: float = 0.0, **_) -> list[RewardResult]:
    """:func:`~grpo_kit.reward.gsm8k_reward` in TRL's signature (completions as text or TRL's
    conversational messages): 1 for ``#### <gold>``, plus
    ``format_bonus`` for the form, ``lenient_credit`` for the right number read without the marker.

    >>> [r.score for r in hash_reward(["1+1?", "1+1?"], ["#### 2", "it is 2"], ["2", "2"], lenient_credit=0.5)]
    [1.0, 0.5]

    A gold it cannot read leaves that completion unscored (None, with why), not the call: one bad
    row of a user's data must not zero the other problems of its chunk.
    """
    out = []
    for c, g in zip(completions, gold, strict=True):
        try:
            gold_value(g)
        except (ValueError, TypeError) as e:
            out.append(RewardResult(None, None, f"unreadable gold: {e}"))
            continue
        out.append(gsm8k_reward(text_of(c), g, format_bonus=format_bonus, lenient=lenient_credit > 0,
                                lenient_credit=lenient_credit))
    return out


HELDOUT_FRACTION = 0.1
"""The share of a single-file source held out (by a hash of the question, :func:`~grpo_kit.tasks.rows.in_heldout`)."""


def task(source: str = data.GSM8K_HUB_ID, format_bonus: float = 0.0, lenient_credit: float = 0.0) -> Task:
    """GSM8K's train split for training, its test split held out; from one file (``dataset=".../train.jsonl"``),
    its rows split by a hash of the question, :data:`HELDOUT_FRACTION` held out (until 2026-12-03 both
    splits read the whole file: held-out accuracy measured the training rows)."""
    def problems(split: str, n: int, seed: int) -> list[data.Problem]:
        if source != data.GSM8K_HUB_ID and Path(source).expanduser().is_file():
            rows = data.load_gsm8k(source, "train")
            return [p for p in rows if in_heldout(p.question.strip(), HELDOUT_FRACTION) == (split == "heldout")][:n]
        return list(data.load_gsm8k(source, "test" if split == "heldout" else "train", limit=n))

    reward = functools.partial(hash_reward, format_bonus=format_bonus, lenient_credit=lenient_credit)
    return Task("gsm8k", problems, [reward], names=["answer"], instruction=data.DEFAULT_INSTRUCTION)
