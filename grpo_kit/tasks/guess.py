"""Guess the number: a stateful environment whose answers depend on the episode's earlier actions.

Each problem hides a number in ``1..high``; the model calls the environment's ``guess`` tool and
hears ``"higher"``, ``"lower"`` or ``"correct"``, so every observation depends on the guesses before
it, and a policy that halves the interval finds any number within ``ceil(log2(high + 1))`` guesses.
The environment has TRL's ``environment_factory`` shape (``reset(**row)``, a public tool method,
``get_reward()``), one instance per episode. The reward is the environment's: 1.0 when the number
was found within ``max_guesses`` guesses, else 0.0 (:func:`~grpo_kit.tasks.base.env_reward`).

What the policy may try, and what it gets (the adversarial table in ``tests/test_guess_task.py``):
guesses past the budget are answered ``"no guesses left"`` and never count, so brute force over
many turns or many calls per turn does not pay; a number outside the range, a non-integer, a bool or
a string is answered with an error message and uses a guess; the answer text is not read at all, so
writing the secret (or "correct") without guessing it scores 0; and guessing after the number was
found changes nothing.
"""

from __future__ import annotations

import math
import random

from .. import data
from .base import Task

QUESTION = ("I am thinking of a whole number from 1 to {high}. Find it with the guess tool, which answers "
            "higher, lower or correct. You have {max_guesses} guesses.")


class GuessNumber:
    """The environment of one episode (module docstring). ``high``: the range's top; ``max_guesses``:
    the budget (None: enough for a binary search, ``ceil(log2(high + 1))``)."""

    def __init__(self, high: int = 100, max_guesses: int | None = None) -> None:
        self.high = high
        self.max_guesses = max_guesses or math.ceil(math.log2(high + 1))
        self.secret: int | None = None
        self.guesses: list[int] = []
        self.found = False

    def reset(self, gold: str | None = None, **row) -> str | None:
        """Start an episode on the problem's number (its ``gold``)."""
        secret = int(gold) if gold is not None else None
        if secret is None or not 1 <= secret <= self.high:
            raise ValueError(f"the secret must be a whole number from 1 to {self.high}, got {gold!r}")
        self.secret, self.guesses, self.found = secret, [], False
        return None

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: A whole number in the range.
        """
        if self.found:
            return "correct (already found)"
        if len(self.guesses) >= self.max_guesses:
            return "no guesses left"
        if isinstance(number, bool) or not isinstance(number, int):
            self.guesses.append(-1)
            return f"error: guess a whole number from 1 to {self.high}, not {str(number)[:20]!r}"
        self.guesses.append(number)
        if not 1 <= number <= self.high:
            return f"error: {number} is outside 1..{self.high}"
        if number == self.secret:
            self.found = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        return 1.0 if self.found else 0.0


def problems(split: str, n: int, seed: int, high: int = 100, max_guesses: int | None = None) -> list[data.Problem]:
    """``n`` hidden numbers; the held-out split's are drawn from another stream than training's."""
    rng = random.Random(f"guess-{split}-{seed}")
    budget = max_guesses or math.ceil(math.log2(high + 1))
    out = []
    for i in range(n):
        secret = rng.randint(1, high)
        out.append(data.Problem(id=f"guess-{split}-{seed}-{i}", question=QUESTION.format(high=high, max_guesses=budget),
                                gold=str(secret)))
    return out


def task(high: int = 100, max_guesses: int | None = None) -> Task:
    """Guess the number in ``1..high`` within ``max_guesses`` (None: a binary search's ``ceil(log2(high + 1))``)."""

    def make() -> GuessNumber:
        return GuessNumber(high, max_guesses)

    def draw(split: str, n: int, seed: int) -> list[data.Problem]:
        return problems(split, n, seed, high, max_guesses)

    return Task("guess_number", draw, environment_factory=make, names=["found"], instruction="")
