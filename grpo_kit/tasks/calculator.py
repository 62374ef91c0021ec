"""The built-in tool task: seeded multi-digit multiplication with a ``multiply`` tool.

Questions are ``"What is 347 * 28?"`` (an ``n_digits``-digit factor times a ``factor_digits``-digit
one), beyond what the tiny model computes in its head, and the task gives the model one tool,
:func:`multiply`, so a multi-turn episode can call it (``<call>multiply(347, 28)</call>`` in the tiny
model's plain format, a Hermes ``<tool_call>`` block for chat models) and copy its result into the
final answer. Only the final answer is rewarded: the last assistant message's ``#### <integer>``,
strictly right (the arithmetic ``####`` reward, :func:`grpo_kit.tasks.gsm8k.hash_reward`; accuracy is
strict correctness). Calling the tool earns nothing by itself, and a result the model writes
without calling the tool counts only if its number is right.

The held-out split shares no question with the training one (a hash of the factors, in order,
decides); with factors of one width, a held-out question's factors in the other order may be a
training question.

``demos`` (for chat models) puts worked examples before each question, as earlier turns of its
conversation (:func:`demo_messages`): a question answered through a ``multiply`` call in the Hermes
format, or one answered at once. A small chat model that never calls a tool on its own (SmolLM2-135M)
follows them: which kinds, and in what order, sets how often the base model calls the tool, the
calibration that gives GRPO a signal (``bench/multiturn.py``'s smol part).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Sequence

from .. import data
from .base import Task
from .gsm8k import hash_reward

MAX_OPERAND_DIGITS = 18
"""Largest factor :func:`multiply` takes, in digits: a bigger one is an error answer, not a slow product."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    for name, v in (("a", a), ("b", b)):
        if type(v) is not int:  # bools, floats, strings, int subclasses: not an integer argument
            raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
        if v.bit_length() > MAX_OPERAND_DIGITS * 4 or abs(v) >= 10**MAX_OPERAND_DIGITS:
            raise ValueError(f"{name} has more than {MAX_OPERAND_DIGITS} digits")
    return a * b


def is_heldout(a: int, b: int, heldout_mod: int = 10) -> bool:
    """Whether the question ``a * b`` belongs to the held-out split (a hash of the factors)."""
    return hashlib.sha256(f"{a}*{b}".encode()).digest()[0] % heldout_mod == 0


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def available(split: str, n_digits: int = 3, factor_digits: int = 2) -> int:
    """The most distinct questions :func:`problems` draws for one split and shape (half of the split's
    share of the ``n_digits`` x ``factor_digits`` factor pairs, so the seeded draw stays quick).

    >>> available("train"), available("heldout"), available("train", 2, 1)
    (36450, 4050, 364)
    """
    space = 9 * 10 ** (n_digits - 1) * 9 * 10 ** (factor_digits - 1)
    return int(0.5 * (space // 10 if split == "heldout" else space - space // 10))


DEMOS = {"tool": (23, 41), "direct": (7, 8)}
"""The worked examples :func:`demo_messages` knows: ``"tool"`` answers 23 * 41 through a
``multiply`` call, ``"direct"`` answers 7 * 8 at once."""


def demo_messages(demos: Sequence[str]) -> list[dict]:
    """The conversation turns of worked examples (:data:`DEMOS`), in order: each a user question (with
    the task's answer instruction, as the question will have it), then for ``"tool"`` the assistant's
    Hermes call and the tool's answer, then the final ``#### <product>``.

    >>> [m["role"] for m in demo_messages(["direct", "tool"])]
    ['user', 'assistant', 'user', 'assistant', 'tool', 'assistant']
    >>> demo_messages(["tool"])[1]["content"]
    '<tool_call>{"name": "multiply", "arguments": {"a": 23, "b": 41}}</tool_call>'
    """
    out: list[dict] = []
    for kind in demos:
        if kind not in DEMOS:
            raise ValueError(f"unknown demo {kind!r}: expected any of {sorted(DEMOS)}")
        a, b = DEMOS[kind]
        # as the question itself will read: the run appends the task's instruction to the last user message
        out.append({"role": "user", "content": f"{question(a, b)}\n{data.DEFAULT_INSTRUCTION}"})
        if kind == "tool":
            call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
            out += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                    {"role": "tool", "name": "multiply", "content": str(a * b)}]
        out.append({"role": "assistant", "content": f"#### {a * b}"})
    return out


def demo_kinds(demos: str | Sequence[str]) -> tuple[str, ...]:
    """``demos`` as a tuple of kinds: a sequence, or a comma-separated string (``"direct,tool"``)."""
    kinds = tuple(k.strip() for k in demos.split(",") if k.strip()) if isinstance(demos, str) else tuple(demos)
    demo_messages(kinds)  # unknown kinds raise here, when the task is made
    return kinds


def problems(split: str, n: int, seed: int = 0, *, n_digits: int = 3, factor_digits: int = 2,
             demos: Sequence[str] = ()) -> list[data.Problem]:
    """``n`` distinct seeded multiplication questions of one split; with ``demos``, each a
    conversation whose worked examples (:func:`demo_messages`) come before the question.

    >>> [p.question for p in problems("train", 2, seed=1)]
    ['What is 455 * 15?', 'What is 526 * 27?']
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not (1 <= n_digits <= 9 and 1 <= factor_digits <= 9):
        raise ValueError(f"n_digits and factor_digits must be in 1..9, got {n_digits} and {factor_digits}")
    ranges = [(10 ** (d - 1), 10**d - 1) for d in (n_digits, factor_digits)]
    if n > available(split, n_digits, factor_digits):
        raise ValueError(f"asked for {n} distinct {split} questions of {n_digits} x {factor_digits} digits; "
                         f"at most {available(split, n_digits, factor_digits)} are drawn (calculator.available)")
    rng = random.Random(f"mul-{seed}-{split}-{n_digits}-{factor_digits}")
    before = demo_messages(demos)
    # a worked example's own question (either order) is not drawn: its answer is in the prompt (a review
    # found mul-23-41 held out under the "tool" demo of 23 * 41)
    shown = {pair for kind in (demos or ()) for pair in (DEMOS[kind], DEMOS[kind][::-1])}
    seen, out = set(), []
    while len(out) < n:
        a, b = (rng.randint(lo, hi) for lo, hi in ranges)
        if (a, b) in seen or (a, b) in shown or is_heldout(a, b) != (split == "heldout"):
            continue
        seen.add((a, b))
        messages = before + [{"role": "user", "content": question(a, b)}] if demos else None
        out.append(data.Problem(id=f"mul-{a}-{b}", question=question(a, b), gold=str(a * b),
                                columns={"a": a, "b": b}, messages=messages))
    return out


def task(n_digits: int = 3, factor_digits: int = 2, format_bonus: float = 0.0, lenient_credit: float = 0.0,
         demos: str | Sequence[str] = ()) -> Task:
    """Multiplication questions with the :func:`multiply` tool, rewarded on the final answer only;
    ``demos``: worked examples before each question (module docstring; ``"direct,tool"`` or a list)."""
    reward = functools.partial(hash_reward, format_bonus=format_bonus, lenient_credit=lenient_credit)
    return Task("calculator", functools.partial(problems, n_digits=n_digits, factor_digits=factor_digits,
                                                demos=demo_kinds(demos)),
                [reward], names=["answer"], instruction=data.DEFAULT_INSTRUCTION, tools=[multiply])
