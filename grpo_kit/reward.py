"""Verifiable GSM8K rewards: completion text in, number and score out; pure, no model.

Rules, in order, and the one used is recorded in :attr:`RewardResult.rule`:

- ``"marker"``: the number after the *first* ``####`` marker, as lm-evaluation-harness's GSM8K
  strict match reads it, with one difference: lm-eval skips a marker with no number after it
  (``#### Step 1``, a Markdown heading) and reads the next; here the first marker decides, and a
  heading before the answer voids it (the kit's GSM8K prompts ask for one marker, at the end;
  :mod:`grpo_kit.tasks.math` reads headings as headings). The first, not the last: a chat model that answers and then keeps
  writing (``#### 18\\n\\nQuestion: ... #### 4``) is graded on its answer, not on what it invented
  after it. (A model that corrects itself with a second marker is graded on the first; the kit's
  stop rules end most completions at the answer anyway.) Markdown emphasis and code marks around
  the number (``#### **18**``, ``#### `18` ``), a ``$`` and surrounding whitespace are ignored.
- ``"boxed"``: with no marker, the number inside the first ``\\boxed{...}``.
- ``"last"``: with neither, the last number in the text.

*Strict* correctness (:attr:`RewardResult.correct`) needs the marker and the right value: format
and value. *Lenient* correctness (:attr:`RewardResult.lenient_correct`) accepts any rule. Both are
always computed; the score uses the lenient rules only with ``lenient=True``. A marker followed by
no number is a failed answer either way (lenient never overrides a marker).

Signs (``-``, ``+``, the Unicode minus) and decimals are kept; commas are read only as thousands
separators (``1,234``, ``12,345,678``); answers compare as numbers, so ``18.00`` equals ``18`` and
``1,000`` equals ``1000``. Numbers glued to an exponent, a fraction bar, a power, a second decimal
point or a comma that separates no thousands (``1e3``, ``3/4``, ``2^10``, ``1.2.3``, ``1,2,3``,
``12,34``, ``0,5``), to a mixed number's fraction (``18 1/2``, ``18 \\frac{1}{2}``), to a ``**``
power, a zero-width character, a digit group after a space or an apostrophe (``18 000``), a
magnitude (``18k``, ``18 thousand``), to a character that is itself a
number (``18½``, ``18²``) or to another script's decimal mark (``18٫5``, ``18.٥``) are rejected
rather than read as their first digits or their digits run together, so they cannot score by
accident. Answers compare exactly, as decimals (``17.99999999999999999`` is not 18).
Any string, however malformed or long, gives a :class:`RewardResult` with a reason, never an
exception: texts over ``max_chars`` are rejected before any scan, and every pattern here is linear
in the text length. Caller bugs (a non-string completion, an unparseable gold) still raise.

>>> gsm8k_reward("48 / 2 = 24, so 48 + 24 = 72.\\n#### 72", 72)
RewardResult(score=1.0, parsed=72.0, reason='correct', rule='marker', correct=True, lenient_correct=True)
>>> gsm8k_reward("The answer is 72.", "72").reason
"no '####' answer"
>>> gsm8k_reward("The answer is 72.", "72").lenient_correct
True
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from numbers import Real

MARKER = "####"
MAX_CHARS = 100_000
"""Longest completion parsed (~25k tokens). Longer ones are rejected unread: a 10 MB degenerate
rollout costs one ``len()``, not a scan."""

# One number: an optional sign and/or dollar in either order, digits (grouped in thousands by commas,
# or not at all), an optional decimal part. No nested or adjacent unbounded quantifiers, so a failed
# match cannot backtrack (the grouped form gives up after at most 3 digits).
_SIGN = r"(?:(?P<sign>[-+\u2212])(?:\$ ?)?|\$ ?(?P<sign2>[-+\u2212])?)?"  # -, -$, $, $- or nothing; "$ 5" too
_NUMBER = _SIGN + r"(?P<digits>(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)"
_NUMBER_RE = re.compile(_NUMBER)
# The lenient fallback scans for whole numbers only: never start inside a word, a number or a fraction.
_FREE_NUMBER_RE = re.compile(r"(?<![\w.,/^])" + _NUMBER)
# What may not follow a number: an exponent, digits glued to letters (0x1F, 12km2) or non-ASCII digits,
# a fraction bar, a power, a second decimal point, a comma glued to a digit (1,2,3, 0,5, 1,234,5: not
# thousands). Matched on a short window, so it is O(1) per number.
ARABIC_MARKS = "\u066b\u066c"
"""Arabic decimal and thousands separators (``18٫5``): another script's number punctuation."""
_BAD_TAIL_RE = re.compile(r"[eE][-+]?[0-9]|[^\W\d]*\d|\s*[/^\u2044\u2215]\s*\d|\^|[.,\u00b7\uff0e\uff0c" + ARABIC_MARKS
                          + r"]\d|\s+\d+\s*[/\u2044\u2215]\s*\d"
                          # a LaTeX fraction, a ** power, a zero-width character or a digit group after a space
                          # or an apostrophe (18 \frac{1}{2}, 18**2, 18<ZWSP>5, 18<thin space>000, 18'000), a
                          # magnitude (18k, 18M, 18 thousand): not 18
                          r"|\s*\\[dt]?frac|\s*\*\*\s*\d|[\u200b-\u200d\u2060\ufeff]+\d|[ \t\u00a0\u2009\u202f'\u2019]\d{3}(?!\d)"
                          r"|(?:k|K|M|B|bn)\b|\s*(?:hundred|thousand|million|billion|trillion)\b")
# ...nor a character that is itself a number (a vulgar fraction, a superscript power: 18½, 18²)
NUMBER_CHARACTERS = ("Nl", "No")
"""Unicode categories of characters that are numbers but not decimal digits (``½``, ``²``, ``Ⅻ``)."""
_NUMERIC_CATEGORIES = ("Nd", *NUMBER_CHARACTERS)
_TAIL_WINDOW = 32
# A number's digit run with commas in it, and the same run when its commas separate thousands.
_COMMA_RUN_RE = re.compile(_SIGN + r"(?P<run>[0-9]+(?:,[0-9]+)+)")
_THOUSANDS_RE = re.compile(r"[1-9][0-9]{0,2}(?:,[0-9]{3})+")
# Markdown emphasis / code marks a chat model puts around its answer: "#### **18**", "#### `18`".
_MARKUP_RE = re.compile(r"[*_`]{1,3}\s*")
_BOXED = "\\boxed{"
_BOXED_MAX = 64  # a boxed answer longer than this is not a number


LENIENT_RULES = ("boxed", "last")
"""The rules by which the ``####`` reward reads an answer only with ``lenient``: such an answer earns
``lenient_credit`` but casts no maj@k vote (:class:`grpo_kit.tasks.base.Score`), so maj@k does not
move with a reward-shaping knob."""


@dataclass(frozen=True, slots=True)
class RewardResult:
    score: float | None
    """Reward: 1.0 if correct, else 0.0, plus ``format_bonus`` when the answer is in ``#### <n>`` form;
    None where the reward did not score the completion (it does not apply, or was not run), with why
    in ``reason``."""
    parsed: float | str | None
    """The number read from the completion, or None when none could be read (the math task gives a
    symbolic answer as math-verify's text): what maj@k votes on."""
    reason: str
    """Why this score, in a few words ("correct", "wrong answer 12 != 13", ...); never empty."""
    rule: str | None = None
    """How the number was read: ``"marker"``, ``"boxed"``, ``"last"``, or None when none was."""
    correct: bool = False
    """Strictly correct: read after the marker and equal to the gold (format and value)."""
    lenient_correct: bool = False
    """Correct by any rule (marker, ``\\boxed{}`` or the last number)."""


def _to_decimal(m: re.Match[str]) -> Decimal:
    value = Decimal(m["digits"].replace(",", ""))
    sign = m["sign"] or m["sign2"]
    return value.copy_negate() if sign in ("-", "\u2212") else value  # exact (unary minus rounds to 28 digits)


def _well_ended(text: str, end: int) -> bool:
    tail = text[end : end + _TAIL_WINDOW]
    if _BAD_TAIL_RE.match(tail) is not None or (tail and unicodedata.category(tail[0]) in _NUMERIC_CATEGORIES):
        return False
    spaced = tail.lstrip()  # "18 ½", "18\xa0⅓": a mixed number written with a vulgar fraction
    return not (spaced and unicodedata.category(spaced[0]) in NUMBER_CHARACTERS)


def _parse(text: str, marker: str, lenient: bool) -> tuple[Decimal | None, str]:
    """``(value, rule)``; ``rule`` is "marker", "boxed" or "last" on success, else a short reason."""
    at = text.find(marker)
    if at >= 0:
        tail = text[at + len(marker) :].lstrip()
        m = _MARKUP_RE.match(tail)
        if m is not None:
            tail = tail[m.end() :]
        m = _NUMBER_RE.match(tail)
        if m is None:
            return None, f"no number after {marker!r}: {tail[:20]!r}"
        if not _well_ended(tail, m.end()):
            return None, f"malformed number after {marker!r}: {tail[: m.end() + 8]!r}"
        return _to_decimal(m), "marker"
    if not lenient:
        return None, f"no {marker!r} answer"
    at = text.find(_BOXED)
    if at >= 0:
        end = text.find("}", at, at + len(_BOXED) + _BOXED_MAX)
        inner = text[at + len(_BOXED) : end].replace("\\$", "$").replace("\\,", "").strip() if end >= 0 else ""
        m = _NUMBER_RE.fullmatch(inner)
        if m is None:
            return None, f"no {marker!r} answer; \\boxed{{}} holds no number: {text[at : at + 24]!r}"
        return _to_decimal(m), "boxed"
    last = deque(_FREE_NUMBER_RE.finditer(text), maxlen=1)  # only the last match is kept
    if not last:
        return None, f"no {marker!r} answer and no number"
    m = last[0]
    if not _well_ended(text, m.end()):
        return None, f"no {marker!r} answer; malformed last number {text[m.start() : m.end() + 8]!r}"
    return _to_decimal(m), "last"


def unreadable_number(answer: str) -> bool:
    """Whether ``answer`` holds a character that is itself a number (``½``, ``²``) or another script's
    number punctuation (``18٫5``), which the ``####`` reader rejects after a number: for other
    readers of the answer (math-verify drops them and would read ``18½`` as 18).

    >>> [unreadable_number(s) for s in ("18½", "18²", "18٫5", "\\frac{37}{2}", "18")]
    [True, True, True, False, False]
    """
    return any(ch in ARABIC_MARKS or unicodedata.category(ch) in NUMBER_CHARACTERS for ch in answer)


def stray_commas(answer: str) -> bool:
    """Whether ``answer`` starts with a number whose commas are not thousands separators, which the
    marker rule rejects: for other readers of the ``####`` line (math-verify reads ``1,2345`` as
    1234 and ``1,2,3`` as 1.2).

    >>> [stray_commas(s) for s in ("1,2,3", "12,34", "0,5", "1,2345", "1,234", "-$12,345.5", "(1,2)", "1, 2")]
    [True, True, True, True, False, False, False, False]
    """
    m = _COMMA_RUN_RE.match(answer.strip())
    return m is not None and _THOUSANDS_RE.fullmatch(m["run"]) is None


def _check_text(text: object, marker: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"completion must be a str, got {type(text).__name__}")
    if not marker:
        raise ValueError("marker must be a non-empty string")


def extract_answer(
    text: str, marker: str = MARKER, lenient: bool = False, *, max_chars: int = MAX_CHARS
) -> float | None:
    """The number after the first ``marker`` in ``text`` (or, if ``lenient`` and there is no marker,
    the one in ``\\boxed{}`` or else the last number in the text); None when there is none or
    ``text`` is longer than ``max_chars``.

    >>> extract_answer("#### $1,000.00\\n\\nQuestion: what is 2 + 2?\\n#### 4")
    1000.0
    >>> extract_answer("#### **18**")
    18.0
    >>> extract_answer("so \\\\boxed{18}", lenient=True)
    18.0
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
    value = _parse(text, marker, lenient)[0]
    return None if value is None else float(value)


def gold_value(gold: float | Decimal | str) -> Decimal:
    """The gold answer as an exact decimal: a float as its shortest repr (``18.1`` is 18.1, not the
    binary double nearest it), so answers compare digit for digit. Raises ValueError or TypeError for
    a gold the ``####`` reward cannot read (``"5."``, ``"1e3"``, ``"nan"``, ``""``)."""
    if isinstance(gold, bool):  # a bool is an int; as a gold answer it is always a bug
        raise TypeError("gold must be a number or a numeric string, got bool")
    if isinstance(gold, int):
        return Decimal(gold)
    if isinstance(gold, (Real, Decimal)):
        if not math.isfinite(gold):
            raise ValueError(f"gold must be finite, got {gold!r}")
        return gold if isinstance(gold, Decimal) else Decimal(repr(float(gold)))
    if isinstance(gold, str):
        m = _NUMBER_RE.fullmatch(gold.strip())
        if m is None:
            raise ValueError(f"gold is not a number: {gold!r}")
        return _to_decimal(m)
    raise TypeError(f"gold must be a number or a numeric string, got {type(gold).__name__}")


def _fmt(x: Decimal) -> str:
    """``18`` for 18.00, ``-3.5`` for -3.50: the value without its trailing zeros, cut short when long."""
    text = format(x, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    text = "0" if text in ("-0", "") else text
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"


def gsm8k_reward(
    completion: str,
    gold: float | str,
    *,
    format_bonus: float = 0.0,
    lenient: bool = False,
    lenient_credit: float = 1.0,
    max_chars: int = MAX_CHARS,
) -> RewardResult:
    """Score ``completion`` against the ``gold`` number (a number, or a string such as ``"1,000"``).

    ``score`` is 1.0 for a strictly correct answer (after the marker) and 0.0 otherwise, plus
    ``format_bonus`` whenever the answer was read from the ``#### <n>`` form, *correct or not*. With
    ``lenient``, an answer read without the marker (``\\boxed{}``, or the last number) scores
    ``lenient_credit`` when right and never gets the bonus. Keep ``format_bonus`` small or zero: on a
    model that rarely gets the value right, a bonus for the form alone is the easiest reward to
    collect, and a policy can settle on ``#### <any number>``. A ``lenient_credit`` below 1 instead
    rewards right values in any form and the marker form most.

    Empty, garbage or over-long completions score 0.0 with a reason; a non-string completion or an
    unparseable gold raise, since they are caller bugs, not model output.

    >>> gsm8k_reward("#### 18.00", 18, format_bonus=0.1).score
    1.1
    >>> gsm8k_reward("#### 12", "13", format_bonus=0.1).reason
    'wrong answer 12 != 13'
    >>> r = gsm8k_reward("...so 1,000 in total", "1,000", lenient=True, lenient_credit=0.5)
    >>> r.score, r.reason, r.rule, r.correct, r.lenient_correct
    (0.5, "correct (no '####', last number)", 'last', False, True)
    >>> gsm8k_reward("x" * 10_000_000, 5).reason
    'input too long (10000000 chars > 100000)'
    """
    _check_text(completion, MARKER)
    for name, v in (("format_bonus", format_bonus), ("lenient_credit", lenient_credit)):
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    target = gold_value(gold)
    if len(completion) > max_chars:
        return RewardResult(0.0, None, f"input too long ({len(completion)} chars > {max_chars})")
    if not completion.strip():
        return RewardResult(0.0, None, "empty completion")
    exact, how = _parse(completion, MARKER, lenient=True)
    parsed = None if exact is None else float(exact)
    if how == "marker":
        ok = exact == target  # exact: 17.99999999999999999 is not 18, though the two floats are equal
        reason = "correct" if ok else f"wrong answer {_fmt(exact)} != {_fmt(target)}"
        return RewardResult(float(ok) + format_bonus, parsed, reason, "marker", ok, ok)
    loose_ok = exact is not None and exact == target
    rule = how if parsed is not None else None
    if not lenient:
        strict_reason = _parse(completion, MARKER, lenient=False)[1]
        return RewardResult(0.0, None, strict_reason, None, False, loose_ok)
    if parsed is None:
        return RewardResult(0.0, None, how, None, False, False)
    if loose_ok:
        what = "last number" if rule == "last" else "\\boxed{}"
        return RewardResult(lenient_credit, parsed, f"correct (no {MARKER!r}, {what})", rule, False, True)
    return RewardResult(0.0, parsed, f"wrong answer {_fmt(exact)} != {_fmt(target)}", rule, False, False)


def reward_batch(completions: Sequence[str], golds: Sequence[float | str], **kw) -> list[RewardResult]:
    """:func:`gsm8k_reward` over pairs; ``kw`` is passed through. The two sequences must have equal length.

    >>> [r.score for r in reward_batch(["#### 1", "#### 2", ""], [1, 1, 1])]
    [1.0, 0.0, 0.0]
    """
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
    return [gsm8k_reward(c, g, **kw) for c, g in zip(completions, golds, strict=True)]
