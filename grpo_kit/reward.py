"""Verifiable GSM8K rewards: completion text in, number and score out; pure, no model.

The answer is the number after the *last* ``####`` marker (GSM8K's own convention, so every gold
solution scores 1.0 against itself). Commas, a ``$`` and surrounding whitespace are ignored; signs
(``-``, ``+``, the Unicode minus) and decimals are kept. Answers compare as numbers, so ``18.00``
equals ``18`` and ``1,000`` equals ``1000``. A lenient mode falls back to the last number in the
text when no marker is present at all; a marker followed by no number is a failed answer either way.

Numbers glued to an exponent, a fraction bar, a power or a second decimal point (``1e3``, ``3/4``,
``2^10``, ``1.2.3``) are rejected rather than read as their first digits, so they cannot score by
accident. Any string, however malformed or long, gives a :class:`RewardResult` with a reason, never
an exception: texts over ``max_chars`` are rejected before any scan, and every pattern here is
linear in the text length. Caller bugs (a non-string completion, an unparseable gold) still raise.

>>> gsm8k_reward("48 / 2 = 24, so 48 + 24 = 72.\\n#### 72", 72)
RewardResult(score=1.0, parsed=72.0, reason='correct')
>>> gsm8k_reward("The answer is 72.", "72").reason
"no '####' answer"
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from numbers import Real

MARKER = "####"
MAX_CHARS = 100_000
"""Longest completion parsed (~25k tokens). Longer ones are rejected unread: a 10 MB degenerate
rollout costs one ``len()``, not a scan."""

# One number: an optional sign and/or dollar in either order, digits with commas anywhere, an optional
# decimal part. No nested or adjacent unbounded quantifiers, so a failed match cannot backtrack.
_NUMBER = (
    r"(?:(?P<sign>[-+\u2212])(?:\$ ?)?|\$ ?(?P<sign2>[-+\u2212])?)?"  # -, -$, $, $- or nothing; "$ 5" too
    r"(?P<digits>[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)"
)
_NUMBER_RE = re.compile(_NUMBER)
# The lenient fallback scans for whole numbers only: never start inside a word, a number or a fraction.
_FREE_NUMBER_RE = re.compile(r"(?<![\w.,/^])" + _NUMBER)
# What may not follow a number: an exponent, digits glued to letters (0x1F, 12km2) or non-ASCII digits,
# a fraction bar, a power, a second decimal point. Matched on a short window, so it is O(1) per number.
_BAD_TAIL_RE = re.compile(r"[eE][-+]?[0-9]|[^\W\d]*\d|\s*[/^]\s*[0-9]|\^|\.[0-9]")
_TAIL_WINDOW = 32


@dataclass(frozen=True, slots=True)
class RewardResult:
    score: float
    """Reward: 1.0 if correct, else 0.0, plus ``format_bonus`` when the answer is in ``#### <n>`` form."""
    parsed: float | None
    """The number read from the completion, or None when none could be read."""
    reason: str
    """Why this score, in a few words ("correct", "wrong answer 12 != 13", ...); never empty."""


def _to_float(m: re.Match[str]) -> float:
    value = float(m["digits"].replace(",", ""))
    sign = m["sign"] or m["sign2"]
    return -value if sign in ("-", "\u2212") else value


def _well_ended(text: str, end: int) -> bool:
    return _BAD_TAIL_RE.match(text[end : end + _TAIL_WINDOW]) is None


def _parse(text: str, marker: str, lenient: bool) -> tuple[float | None, str]:
    """``(value, how)``; ``how`` is "marker" or "last" on success, else a short reason for failure."""
    at = text.rfind(marker)
    if at >= 0:
        tail = text[at + len(marker) :].lstrip()
        m = _NUMBER_RE.match(tail)
        if m is None:
            return None, f"no number after {marker!r}: {tail[:20]!r}"
        if not _well_ended(tail, m.end()):
            return None, f"malformed number after {marker!r}: {tail[: m.end() + 8]!r}"
        return _to_float(m), "marker"
    if not lenient:
        return None, f"no {marker!r} answer"
    last = deque(_FREE_NUMBER_RE.finditer(text), maxlen=1)  # only the last match is kept
    if not last:
        return None, f"no {marker!r} answer and no number"
    m = last[0]
    if not _well_ended(text, m.end()):
        return None, f"no {marker!r} answer; malformed last number {text[m.start() : m.end() + 8]!r}"
    return _to_float(m), "last"


def _check_text(text: object, marker: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"completion must be a str, got {type(text).__name__}")
    if not marker:
        raise ValueError("marker must be a non-empty string")


def extract_answer(
    text: str, marker: str = MARKER, lenient: bool = False, *, max_chars: int = MAX_CHARS
) -> float | None:
    """The number after the last ``marker`` in ``text`` (or, if ``lenient`` and there is no marker, the
    last number in the text); None when there is none or ``text`` is longer than ``max_chars``.

    >>> extract_answer("#### 5 ... no wait\\n#### $1,000.00")
    1000.0
    >>> extract_answer("It costs -$3.50.\\n####   -3.5")
    -3.5
    >>> extract_answer("so she has 18 apples") is None
    True
    >>> extract_answer("so she has 18 apples", lenient=True)
    18.0
    >>> extract_answer("#### 1e3") is None  # never read as 1
    True
    """
    _check_text(text, marker)
    if len(text) > max_chars:
        return None
    return _parse(text, marker, lenient)[0]


def _gold_value(gold: float | Decimal | str) -> float:
    if isinstance(gold, bool):  # a bool is an int; as a gold answer it is always a bug
        raise TypeError("gold must be a number or a numeric string, got bool")
    if isinstance(gold, (Real, Decimal)):
        value = float(gold)
    elif isinstance(gold, str):
        s = gold.strip()
        m = _NUMBER_RE.fullmatch(s)
        if m is None:
            raise ValueError(f"gold is not a number: {gold!r}")
        value = _to_float(m)
    else:
        raise TypeError(f"gold must be a number or a numeric string, got {type(gold).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"gold must be finite, got {gold!r}")
    return value


def _fmt(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 1e16 else repr(x)


def gsm8k_reward(
    completion: str,
    gold: float | str,
    *,
    format_bonus: float = 0.0,
    lenient: bool = False,
    max_chars: int = MAX_CHARS,
) -> RewardResult:
    """Score ``completion`` against the ``gold`` number (a number, or a string such as ``"1,000"``).

    ``score`` is 1.0 for a correct answer and 0.0 otherwise, plus ``format_bonus`` whenever the answer
    was read from the ``#### <n>`` form, *correct or not*: format is what the grader needs, and a small
    bonus on well-formed wrong answers gives a model that has not yet learned the marker a signal to
    learn it from (as separate format rewards do in R1-style recipes). Answers found by the lenient
    last-number fallback get no bonus. Numbers compare exactly (both sides are parsed the same way).

    Empty, garbage or over-long completions score 0.0 with a reason; a non-string completion or an
    unparseable gold raise, since they are caller bugs, not model output.

    >>> gsm8k_reward("#### 18.00", 18, format_bonus=0.1)
    RewardResult(score=1.1, parsed=18.0, reason='correct')
    >>> gsm8k_reward("#### 12", "13", format_bonus=0.1)
    RewardResult(score=0.1, parsed=12.0, reason='wrong answer 12 != 13')
    >>> gsm8k_reward("...so 1,000 in total", "1,000", lenient=True)
    RewardResult(score=1.0, parsed=1000.0, reason="correct (no '####', last number)")
    >>> gsm8k_reward("x" * 10_000_000, 5).reason
    'input too long (10000000 chars > 100000)'
    """
    _check_text(completion, MARKER)
    if not (math.isfinite(format_bonus) and format_bonus >= 0.0):
        raise ValueError(f"format_bonus must be finite and >= 0, got {format_bonus!r}")
    target = _gold_value(gold)
    if len(completion) > max_chars:
        return RewardResult(0.0, None, f"input too long ({len(completion)} chars > {max_chars})")
    if not completion.strip():
        return RewardResult(0.0, None, "empty completion")
    parsed, how = _parse(completion, MARKER, lenient)
    if parsed is None:
        return RewardResult(0.0, None, how)
    bonus = format_bonus if how == "marker" else 0.0
    if parsed == target:
        reason = "correct" if how == "marker" else f"correct (no {MARKER!r}, last number)"
        return RewardResult(1.0 + bonus, parsed, reason)
    return RewardResult(bonus, parsed, f"wrong answer {_fmt(parsed)} != {_fmt(target)}")


def reward_batch(completions: Sequence[str], golds: Sequence[float | str], **kw) -> list[RewardResult]:
    """:func:`gsm8k_reward` over pairs; ``kw`` is passed through. The two sequences must have equal length.

    >>> [r.score for r in reward_batch(["#### 1", "#### 2", ""], [1, 1, 1])]
    [1.0, 0.0, 0.0]
    """
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
    return [gsm8k_reward(c, g, **kw) for c, g in zip(completions, golds, strict=True)]
