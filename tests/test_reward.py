"""Tests for grpo_kit.reward: every GSM8K gold solution against itself, tables of tricky completions, and
garbage / empty / enormous inputs that must score 0 with a reason, quickly, without raising."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import GSM8K_DIR

from grpo_kit.reward import MAX_CHARS, RewardResult, extract_answer, gsm8k_reward, reward_batch

GSM8K_ROWS = 8792  # 7,473 train + 1,319 test


def _gold_rows() -> list[tuple[str, str]]:
    """(answer text, gold as written on its ``#### `` line) for every row of train and test."""
    rows = []
    for name in ("train.jsonl", "test.jsonl"):
        path = GSM8K_DIR / name
        # No skip: a missing file must fail loudly, or the test that guards the marker convention vanishes.
        assert path.is_file(), f"GSM8K data missing: {path}"
        with path.open(encoding="utf-8") as f:
            for line in f:
                answer = json.loads(line)["answer"]
                last = answer.rstrip().splitlines()[-1]
                assert last.startswith("#### "), f"{name}: last line is not '#### <n>': {last!r}"
                rows.append((answer, last.removeprefix("#### ").strip()))
    return rows


def test_every_gsm8k_gold_solution_scores_correct():
    rows = _gold_rows()
    assert len(rows) == GSM8K_ROWS
    failures = []
    for answer, gold_text in rows:
        gold = int(gold_text.replace(",", ""))  # parsed independently of the code under test
        for g in (gold, gold_text):  # the gold as a number and as the string from the data ("1,000")
            r = gsm8k_reward(answer, g, format_bonus=0.5)
            if (r.score, r.parsed, r.reason) != (1.5, gold, "correct"):
                failures.append((gold_text, g, r))
    assert not failures, f"{len(failures)} gold solutions not scored correct, e.g. {failures[:3]}"


# (completion, lenient, expected number or None). Each row says why it is there.
EXTRACT_CASES = [
    ("#### 72", False, 72),  # the GSM8K form itself
    ("#### 5\nwait, no.\n#### 7", False, 5),  # several markers: the first one wins (lm-eval's strict match)
    ("#### 18\n\nQuestion: What is 2 + 2?\n#### 4", False, 18),  # a chat model that keeps writing: its answer counts
    ("#### **18**", False, 18),  # markdown bold around the answer, as chat models write it
    ("#### *18*.", False, 18),  # ... italics, then a full stop
    ("#### `18`", False, 18),  # ... a code mark
    ("#### **$18.00**", False, 18),  # ... bold around a currency amount
    ("\\boxed{18}", True, 18),  # lenient: a boxed answer with no marker
    ("\\boxed{\\$1,000}", True, 1000),  # lenient: LaTeX-escaped dollar inside the box
    ("\\boxed{18} but the last number is 3", True, 18),  # lenient: the box wins over the last number
    ("\\boxed{\\frac{3}{4}}", True, None),  # lenient: a LaTeX fraction is not read as a number here
    ("\\boxed{18}", False, None),  # strict: a box is not the marker
    ("#### 7\n... on reflection 5 is right", False, 7),  # numbers after the answer line do not override it
    ("#### 1,000", False, 1000),  # thousands separator
    ("#### $1,000.00", False, 1000),  # dollar, separator and cents all at once
    ("#### 109,200,000", False, 109_200_000),  # several separators (a real GSM8K gold)
    ("#### 12,345,678", False, 12_345_678),  # thousands separators only ...
    ("#### -1,234.5", False, -1234.5),  # ... with a sign and decimals
    ("#### $-12,345.50", False, -12345.5),  # ... and a dollar
    ("#### 1,000, then 5", False, 1000),  # a comma after the number is punctuation
    ("#### 1,2,3", False, None),  # commas that separate no thousands: never read as 123 ...
    ("#### 1,2", False, None),  # ... nor as 12 (or 1)
    ("#### 12,34", False, None),  # ... a group of two
    ("#### 1,2345", False, None),  # ... a group of four, never read as 1,234 or 12,345
    ("#### 1,234,5", False, None),  # ... a short last group
    ("#### 1234,567", False, None),  # ... a first group of four
    ("#### 1,23,456", False, None),  # ... Indian grouping is not read as thousands here
    ("#### 0,5", False, None),  # ... a decimal comma is not read as 5 or 0
    ("#### 012,345", False, None),  # ... a first group with a leading zero
    ("the digits are 1,2,3", True, None),  # lenient: the last number too
    ("\\boxed{1,2,3}", True, None),  # lenient: a box too
    ("#### -47", False, -47),  # negatives exist in GSM8K golds
    ("#### \u22125", False, -5),  # the Unicode minus sign, as some tokenizers/models write it
    ("#### -$5", False, -5),  # sign before the dollar
    ("#### $-5", False, -5),  # sign after the dollar
    ("#### $ 5", False, 5),  # a space after the dollar
    ("#### +7", False, 7),  # an explicit plus sign
    ("#### 18.00", False, 18),  # trailing zeros in the decimal part
    ("#### 0.5", False, 0.5),  # a genuine decimal
    ("#### .5", False, 0.5),  # a decimal with no leading zero
    ("#### 5.", False, 5),  # a full stop after the number is punctuation, not a decimal point
    ("####    42   ", False, 42),  # spaces around the number
    ("####\n42", False, 42),  # the number on the line after the marker
    ("####42", False, 42),  # no space after the marker
    ("#### 42 apples in total.", False, 42),  # text after the number
    ("#### 12 km", False, 12),  # a unit after the number
    ("#### 5, 6", False, 5),  # a list after the marker: the first number is the answer
    ("The answer is #### 42", False, 42),  # the marker mid-line
    ("#### ", False, None),  # marker with no number
    ("#### the answer is 42", False, None),  # marker followed by words: the number must come first
    ("#### \n#### 42", False, None),  # the first marker has no number, even though a later one does
    ("#### $", False, None),  # a dollar sign alone
    ("#### 1e3", False, None),  # scientific notation is rejected, never read as 1
    ("#### 3/4", False, None),  # a fraction is rejected, never read as 3
    ("#### 3 / 4", False, None),  # ... spaces around the bar too
    # review: each of these read as 18 (rewards.math read the first as 18.5)
    ("#### 18 \\frac{1}{2}", False, None),
    ("#### 18**2", False, None),
    ("#### 18\u200b5", False, None),  # a zero-width space inside 185
    ("#### 18\u202f000", False, None),  # a thin-space thousands separator
    ("#### 18 000", False, None),
    ("#### 18'000", False, None),
    ("#### 18k", False, None),
    ("#### 18M", False, None),
    ("#### 18 thousand", False, None),
    ("#### 18 apples, 12 pears", False, 18),  # a digit group needs three digits after the space
    ("#### 18 kg", False, 18),  # a unit after a space, as before
    ("#### 18\n100 people came", False, 18),  # a number on the next line is not a digit group
    ("#### 2^10", False, None),  # a power is rejected, never read as 2
    ("#### 1.2.3", False, None),  # a version-like string is rejected, never read as 1.2
    ("#### 0x1F", False, None),  # hex is rejected, never read as 0
    ("#### \u0664\u0662", False, None),  # non-ASCII digits are not numbers here (documented limit)
    ("#### 18 1/2", False, None),  # a mixed number is rejected, never read as its whole part
    ("#### 18\u00bd", False, None),  # ... a vulgar fraction glued to it too (18½)
    ("#### 18 \u00bd", False, None),  # ... or after a space (18 ½: review, read as 18)
    ("#### 18\u00a0\u2153", False, None),  # ... or after a no-break space (18 ⅓)
    ("#### 18\u00b2", False, None),  # a superscript power is rejected, never read as 18 (18²)
    ("#### 18\u066b5", False, None),  # another script's decimal mark (18٫5) ...
    ("#### 18.\u0665", False, None),  # ... or its digits after the point (18.٥)
    ("#### 18\uff0e5", False, None),  # a fullwidth full stop as the point
    ("so 18\u00bd", True, None),  # lenient: the same rule for the last number
    ("#### inf", False, None),  # float() would accept these words; the parser must not
    ("#### nan", False, None),  # ... nor this one
    ("The answer is 42.", False, None),  # no marker, strict mode: no answer
    ("The answer is 42.", True, 42),  # lenient fallback: the last number in the text
    ("3 + 4 = 7, so she has 7 apples", True, 7),  # lenient: the last of several numbers
    ("She paid $1,234.50 in total.", True, 1234.5),  # lenient: dollar, separator and decimal
    ("The change is -12 dollars", True, -12),  # lenient: a negative
    ("It is 10 - 5", True, 5),  # lenient: a binary minus is not a sign
    ("#### 9\nbut really 5", True, 9),  # lenient never overrides a marker
    ("####\nno idea", True, None),  # lenient falls back only when there is no marker at all
    ("no numbers at all", True, None),  # lenient with nothing to find
    ("x = 1e3", True, None),  # lenient: a malformed last number is rejected, not read as 1 or 3
    ("abc123", True, None),  # lenient: digits inside a word are not a number
    ("ratio 3/4", True, None),  # lenient: a trailing fraction is rejected, not read as 4
]


@pytest.mark.parametrize(("text", "lenient", "expected"), EXTRACT_CASES)
def test_extract_answer(text, lenient, expected):
    got = extract_answer(text, lenient=lenient)
    assert got == expected
    assert got is None or isinstance(got, float)


def test_extract_answer_custom_marker():
    # Another task's marker; "####" is then ordinary text.
    assert extract_answer("#### 1\nAnswer: 2", marker="Answer:") == 2
    assert extract_answer("#### 1", marker="Answer:") is None


# (completion, gold, kwargs, expected RewardResult). Each row says why it is there.
M, L = "marker", "last"
OK, WRONG = (True, True), (False, False)  # (strictly correct, leniently correct)
REWARD_CASES = [
    ("#### 72", 72, {}, RewardResult(1.0, 72.0, "correct", M, *OK)),  # the plain case
    ("#### 18.00", 18, {}, RewardResult(1.0, 18.0, "correct", M, *OK)),  # numeric, not string, equality
    ("#### 18", "18.00", {}, RewardResult(1.0, 18.0, "correct", M, *OK)),  # ... whichever side has the zeros
    ("#### $1,000.00", "1,000", {}, RewardResult(1.0, 1000.0, "correct", M, *OK)),  # a string gold with a separator
    ("#### 1000", 1000.0, {}, RewardResult(1.0, 1000.0, "correct", M, *OK)),  # a float gold
    ("#### 0.75", Fraction(3, 4), {}, RewardResult(1.0, 0.75, "correct", M, *OK)),  # any real number type as gold
    ("#### 0.5", Decimal("0.50"), {}, RewardResult(1.0, 0.5, "correct", M, *OK)),  # ... Decimal too
    ("#### -3", -3, {}, RewardResult(1.0, -3.0, "correct", M, *OK)),  # negative gold
    ("#### -0", 0, {}, RewardResult(1.0, -0.0, "correct", M, *OK)),  # minus zero is zero
    ("#### **18**", 18, {}, RewardResult(1.0, 18.0, "correct", M, *OK)),  # markdown around the answer is still strict
    ("#### 12", 13, {}, RewardResult(0.0, 12.0, "wrong answer 12 != 13", M, *WRONG)),  # wrong: the reason shows both
    ("#### 12.5", 13, {}, RewardResult(0.0, 12.5, "wrong answer 12.5 != 13", M, *WRONG)),  # wrong, non-integer
    # exact: near-misses that equal the gold as floats are wrong
    ("#### 17.99999999999999999", 18, {}, RewardResult(0.0, 18.0, "wrong answer 17.99999999999999999 != 18", M, *WRONG)),
    ("#### 9007199254740993", 9007199254740992, {},
     RewardResult(0.0, 9007199254740992.0, "wrong answer 9007199254740993 != 9007199254740992", M, *WRONG)),
    ("#### 18.1", 18.1, {}, RewardResult(1.0, 18.1, "correct", M, *OK)),  # a float gold is its shortest repr, not the double
    ("#### 13\n#### 12", 13, {}, RewardResult(1.0, 13.0, "correct", M, *OK)),  # the first marker wins
    # a marked wrong answer is wrong even when the right number appears later: lenient never overrides a marker
    ("#### 12, no: 13", 13, {"lenient": True}, RewardResult(0.0, 12.0, "wrong answer 12 != 13", M, *WRONG)),
    # format bonus: added to a correct answer in '#### <n>' form ...
    ("#### 72", 72, {"format_bonus": 0.1}, RewardResult(1.1, 72.0, "correct", M, *OK)),
    # ... and, by design, to a well-formed wrong one (a format signal before correctness is learned)
    ("#### 71", 72, {"format_bonus": 0.1}, RewardResult(0.1, 71.0, "wrong answer 71 != 72", M, *WRONG)),
    # ... but never to commas that separate no thousands, right digits or not (a policy's cheap variant)
    ("#### 1,2,3", 123, {"format_bonus": 0.1},
     RewardResult(0.0, None, "malformed number after '####': '1,2,3'", None, False, False)),
    ("#### 1,2", 12, {"format_bonus": 0.1, "lenient": True},
     RewardResult(0.0, None, "malformed number after '####': '1,2'", None, *WRONG)),
    ("#### 12,345,678", "12345678", {}, RewardResult(1.0, 12345678.0, "correct", M, *OK)),  # real separators
    # ... but never to an answer found by the lenient fallback
    ("so 72", 72, {"format_bonus": 0.1, "lenient": True},
     RewardResult(1.0, 72.0, "correct (no '####', last number)", L, False, True)),
    ("so 71", 72, {"format_bonus": 0.1, "lenient": True}, RewardResult(0.0, 71.0, "wrong answer 71 != 72", L, *WRONG)),
    # lenient_credit: a right value without the marker scores less than the strict form
    ("so 72", 72, {"lenient": True, "lenient_credit": 0.5},
     RewardResult(0.5, 72.0, "correct (no '####', last number)", L, False, True)),
    ("\\boxed{72}", 72, {"lenient": True, "lenient_credit": 0.5},
     RewardResult(0.5, 72.0, "correct (no '####', \\boxed{})", "boxed", False, True)),
    # ... nor to a marker with no number
    ("#### ", 72, {"format_bonus": 0.1}, RewardResult(0.0, None, "no number after '####': ''", None, *WRONG)),
    # strict: no marker, no score; the lenient verdict is still recorded (for the lenient accuracy)
    ("The answer is 72.", 72, {}, RewardResult(0.0, None, "no '####' answer", None, False, True)),
    ("The answer is 71.", 72, {}, RewardResult(0.0, None, "no '####' answer", None, *WRONG)),
    ("no idea", 72, {"lenient": True}, RewardResult(0.0, None, "no '####' answer and no number")),  # lenient, empty
    ("", 72, {}, RewardResult(0.0, None, "empty completion")),  # empty
    (" \n\t ", 72, {}, RewardResult(0.0, None, "empty completion")),  # whitespace only is empty too
]


@pytest.mark.parametrize(("completion", "gold", "kw", "expected"), REWARD_CASES)
def test_gsm8k_reward(completion, gold, kw, expected):
    assert gsm8k_reward(completion, gold, **kw) == expected


GARBAGE = [
    "",  # empty
    "\x00\x01\x02\ufffd",  # control characters and a replacement character
    "🙂" * 1000,  # non-ASCII, no numbers
    "####" * 1000,  # only markers
    "#### #### ####",  # markers with nothing after any of them
    "$$$---+++,,,...",  # only the characters a number may contain, in no valid order
    "#### " + "-$" * 10_000,  # signs and dollars, never a digit
    "#### 1e" + "9" * 1000,  # an exponent with a long tail
    "\u2212" * 5000,  # Unicode minus signs only
]


@pytest.mark.parametrize("lenient", [False, True])
@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_scores_zero_with_reason(text, lenient):
    r = gsm8k_reward(text, 24, format_bonus=0.1, lenient=lenient)
    assert r.score == 0.0 and r.parsed is None and r.reason


# Inputs built to make a backtracking parser go quadratic or worse, each just under the length cap.
_N = MAX_CHARS // 2 - 10
PATHOLOGICAL = [
    "9" * (2 * _N) + "e5",  # one long digit run that ends malformed
    "1," * _N,  # separators forever
    "1." * _N + "x",  # decimal points forever
    "1/" * _N,  # fractions forever
    "-$" * _N,  # sign/dollar prefixes forever, never a digit
    "#### " + " " * (2 * _N) + "x",  # whitespace after the marker, then no number
    "a1" * _N,  # digits glued to words
    "####" * (_N // 2),  # markers forever
]


@pytest.mark.parametrize("lenient", [False, True])
@pytest.mark.parametrize("text", PATHOLOGICAL, ids=lambda t: repr(t[:6]))
def test_pathological_input_is_fast(text, lenient):
    assert len(text) <= MAX_CHARS
    t0 = time.perf_counter()
    r = gsm8k_reward(text, 5, lenient=lenient)
    # Linear parsing takes milliseconds here; a backtracking one takes minutes. The bound leaves room for a
    # loaded machine (a garbage collection with torch loaded takes ~0.3 s).
    assert time.perf_counter() - t0 < 5.0
    assert r.score == 0.0 and r.reason


@pytest.mark.parametrize("lenient", [False, True])
def test_enormous_input_is_rejected_fast(lenient):
    text = "#### 5 " + "9" * 10_000_000  # 10 MB, with a correct-looking answer at the front
    t0 = time.perf_counter()
    r = gsm8k_reward(text, 5, format_bonus=0.1, lenient=lenient)
    assert time.perf_counter() - t0 < 0.5
    assert r == RewardResult(0.0, None, f"input too long ({len(text)} chars > {MAX_CHARS})")
    assert extract_answer(text, lenient=lenient) is None


def test_max_chars_is_a_knob():
    assert gsm8k_reward("#### 5", 5, max_chars=5).reason.startswith("input too long")
    assert gsm8k_reward("#### 5", 5, max_chars=6).reason == "correct"
    assert extract_answer("#### 5", max_chars=5) is None


def test_huge_number_is_a_wrong_answer_not_an_exception():
    # float() turns a 50,000-digit number into inf; it must compare unequal, not raise, and the reason stays short.
    r = gsm8k_reward("#### " + "9" * 50_000, 5)
    assert r.score == 0.0 and r.parsed == float("inf") and r.reason == "wrong answer 99999999999999999999... (50000 characters) != 5"
    assert gsm8k_reward("#### -" + "9" * 40 + "8", "-" + "9" * 41).score == 0.0  # exact past Decimal's 28 digits


@pytest.mark.parametrize(
    ("completion", "gold", "error"),
    [
        (None, 5, TypeError),  # a non-string completion is a caller bug, not model output: it raises
        (b"#### 5", 5, TypeError),  # bytes are not decoded silently
        ("#### 5", "five", ValueError),  # an unparseable gold is a data bug
        ("#### 5", "", ValueError),  # ... an empty one too
        ("#### 5", True, TypeError),  # a bool is an int, but never a gold answer
        ("#### 5", None, TypeError),  # a missing gold
        ("#### 5", float("nan"), ValueError),  # nan would make every answer wrong, silently
        ("#### 5", float("inf"), ValueError),  # inf would match an overflowing answer
    ],
)
def test_caller_bugs_raise(completion, gold, error):
    with pytest.raises(error):
        gsm8k_reward(completion, gold)


@pytest.mark.parametrize("bonus", [-0.1, float("nan"), float("inf")])
def test_bad_format_bonus_raises(bonus):
    with pytest.raises(ValueError, match="format_bonus"):
        gsm8k_reward("#### 5", 5, format_bonus=bonus)


def test_empty_marker_raises():
    with pytest.raises(ValueError, match="marker"):
        extract_answer("#### 5", marker="")


def test_result_is_frozen():
    r = gsm8k_reward("#### 5", 5)
    with pytest.raises(AttributeError):
        r.score = 2.0


def test_reward_batch():
    completions, golds = ["#### 1", "#### 2", "so 3", ""], [1, "1", 3, 4]
    rs = reward_batch(completions, golds, lenient=True, format_bonus=0.5)
    assert [r.score for r in rs] == [1.5, 0.5, 1.0, 0.0]
    assert rs == [gsm8k_reward(c, g, lenient=True, format_bonus=0.5) for c, g in zip(completions, golds, strict=True)]
    assert reward_batch([], []) == []
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        reward_batch(["#### 1", "#### 2"], [1])


def test_real_smollm2_completions():
    """Completions SmolLM2-135M-Instruct wrote under the smol profile's chat prompt (sampled in a
    two-iteration run, and greedy), with the scores the smol reward settings give (format bonus
    0.1, lenient credit 0.5); each row's ``why`` says what it checks."""
    import json

    rows = [json.loads(line) for line in (Path(__file__).parent / "data" / "smollm2_completions.jsonl").open()]
    assert len(rows) >= 10 and {r["expected"]["rule"] for r in rows} == {None, "last", "marker"}
    for row in rows:
        got = gsm8k_reward(row["text"], row["gold"], format_bonus=0.1, lenient=True, lenient_credit=0.5)
        want = row["expected"]
        assert (got.score, got.parsed, got.rule, got.correct, got.lenient_correct) == (
            pytest.approx(want["score"]), want["parsed"], want["rule"], want["correct"], want["lenient_correct"]
        ), row["why"]
