"""Tests for grpo_kit.tasks.math: math-verify agrees with the ``####`` reward on GSM8K gold solutions
(a sample here; all 8,792 in bench/rewards.py), accepts ``\\boxed{}``, fractions and LaTeX the regex
cannot, runs off the main thread (a Dask worker's) with a hang bounded at process level, and the task
loads GSM8K or a file of ``\\boxed{}`` answers."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from conftest import GSM8K_DIR

from grpo_kit.reward import gsm8k_reward
from grpo_kit.tasks import resolve
from grpo_kit.tasks.math import Verifier, final_answer, math_reward

SAMPLE = 300
PATIENT_S = 60.0
"""Per-check bound where a test is about the answer, not the bound: the machine may be heavily loaded."""


def gsm8k_gold_rows() -> list[tuple[str, str]]:
    """(answer text, gold number) for every train and test row."""
    rows = []
    for name in ("train.jsonl", "test.jsonl"):
        path = GSM8K_DIR / name
        assert path.is_file(), f"GSM8K data missing: {path}"
        for line in path.open(encoding="utf-8"):
            answer = json.loads(line)["answer"]
            rows.append((answer, answer.rsplit("####", 1)[1].strip().replace(",", "")))
    return rows


def perturbed(answer: str, gold: str) -> tuple[str, str]:
    """The same solution with its final answer off by one: both rewards must call it wrong."""
    wrong = str(float(gold) + 1).removesuffix(".0")
    return answer.rsplit("####", 1)[0] + f"#### {wrong}", gold


def test_math_verify_agrees_with_the_marker_reward_on_gsm8k_gold_solutions():
    rows = random.Random(0).sample(gsm8k_gold_rows(), SAMPLE)
    cases = rows + [perturbed(a, g) for a, g in rows]
    mv = math_reward(["q"] * len(cases), [a for a, _ in cases], [g for _, g in cases], timeout_s=PATIENT_S)
    hashes = [gsm8k_reward(a, g) for a, g in cases]
    disagree = [(a[-60:], g, m.reason, h.reason) for (a, g), m, h in zip(cases, mv, hashes, strict=True)
                if m.correct != h.correct]
    assert not disagree, disagree[:5]
    assert sum(m.correct for m in mv) == SAMPLE  # the gold solutions right, the perturbed ones wrong


ACCEPTED = [
    # (completion, gold, why the `####` regex cannot read it and math-verify can)
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", "a LaTeX fraction in \\boxed{}: the regex wants a plain number there"),
    ("so the answer is \\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", "\\dfrac vs \\frac, and a LaTeX gold"),
    ("The answer is $\\frac{6}{8}$.", "3/4", "an unreduced fraction between $...$, gold as a slash fraction"),
    ("#### 3/4", "0.75", "the regex rejects a fraction after the marker, by design"),
    ("\\boxed{2^{10}}", "1024", "a power"),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}", "equal surds"),
    ("\\boxed{x+1}", "1+x", "an expression, terms in another order"),
    ("\\boxed{(1, 2)}", "(1,2)", "a tuple"),
    ("\\boxed{\\$1{,}000}", "1000", "a dollar sign and a LaTeX thousands separator"),
]
# review: a number character anywhere in the reasoning voided a right answer
NUMBER_CHARACTERS_IN_THE_REASONING = [
    ("The room is 9 m\u00b2, so the answer is \\boxed{9}.", "9"),
    ("Half (\u00bd) of 36 is 18. So $\\boxed{18}$.", "18"),
    ("x\u00b2 = 81 so x = 9", "9"),
]
REJECTED = [
    # (completion, gold, why math-verify must say wrong)
    ("\\boxed{\\frac{1}{3}}", "0.33", "a rounded value is not equal"),
    ("\\boxed{x-1}", "1-x", "a sign flipped"),
    ("so 5 apples", "6", "a plain wrong number"),
    ("I do not know.", "6", "no answer at all"),
    ("", "6", "empty"),
    ("#### 18\u00bd", "18", "a vulgar fraction math-verify drops (18½ read as 18)"),
    ("\\boxed{18\u00b2}", "18", "a superscript power math-verify drops"),
    ("#### 18\u066b5", "18", "another script's decimal mark"),
    ("\\boxed{\uff11\uff18}", "18", "fullwidth digits: math-verify reads no number"),
    ("so she has 18\u00bd cups", "18", "a vulgar fraction on the last number, no marker"),
    ("so she has 18 \u00bd cups", "18", "... after a space"),
    # review: dollar amounts made the last $...$ a span between them, and the check read only that span
    ("She pays $2 and $3, so the final answer is 18\u00bd.", "18", "a vulgar fraction beside dollar amounts"),
    ("The answer is 18\u00bd cups, after adding $2 and $3 worth.", "18", "... before them"),
]


# (completion, gold, whether right): commas on the marker line count only as thousands separators, as in
# grpo_kit.reward; math-verify alone read "1,2345" as 1234, "1,2,3" as 1.2, "5,000,00" as 5000, "0,5" as 0.5
COMMAS = [
    ("#### 1,2345", "1234", False),
    ("#### 1,2,3", "1.2", False),
    ("#### 1,2,3", "123", False),
    ("#### 5,000,00", "5000", False),
    ("#### 1,234,5", "1234", False),
    ("#### 1,2", "1.2", False),
    ("#### 12,34", "12.34", False),
    ("#### 0,5", "0.5", False),
    ("#### **1,2345**", "1234", False),
    ("#### 12,345,678", "12345678", True),
    ("#### -1,234.5", "-1234.5", True),
    ("#### $1,000", "1000", True),
    ("#### **1,234**", "1234", True),
]


# (completion, gold, whether right): the marker line is read whole between $...$ as the gold is, unless it
# holds words; a review found "#### 2^{5}" read as 2 (right for gold 2, wrong for 32) and a hedge passing
MARKER_LINES = [
    ("#### 2^{5}", "32", True),  # a power, read whole
    ("#### 2^{5}", "2", False),  # ... not as its base
    ("#### 10^{3}", "1000", True),
    ("#### (1, 2)", "(1,2)", True),  # a tuple, not its last number
    ("#### 3^{2} = 9", "9", True),  # an equation's value
    ("#### x = 5", "5", True),
    ("#### 72 dollars", "72", True),  # a number with a unit word: as before
    ("#### 5 apples", "6", False),
    ("#### 12 or 13", "13", False),  # a hedge: two numbers among words
    ("#### 12 and 13", "12", False),
    ("#### 1, 2 or 3", "3", False),
    ("#### 12 or 13$", "13", False),  # review: a $ or \\boxed on the line switched the hedge rule off
    ("#### 12 or \\boxed{13}", "13", False),
    ("#### \\boxed{} 12 or 13", "13", False),
    ("#### $\\frac{1}{2}$", "0.5", True),  # delimiters without words are still read whole
    ("#### 72", "72", True),
    ("#### 0.5", "1/2", True),
    # review: a Markdown heading is not the marker; it replaced the \\boxed answer the instruction asks for
    ("#### Step 1: Add the apples\n5 + 13 = 18\n#### Step 2: Answer\nSo the answer is \\boxed{18}.", "18", True),
    ("#### Solution\nShe has 5 + 13 = 18 apples.\n\n\\boxed{18}", "18", True),
    ("#### Step 18\nShe has 5 + 7 = 12 apples, \\boxed{12}", "18", False),  # the heading's number earns nothing
    ("#### **Solution**\n#### 18", "18", True),  # the first marker with an answer after it
    ("#### Step 1\n#### 17", "18", False),
]


def test_a_number_character_in_the_reasoning_does_not_void_a_right_answer():
    rows = NUMBER_CHARACTERS_IN_THE_REASONING
    rs = math_reward(["q"] * len(rows), [c for c, _ in rows], [g for _, g in rows], timeout_s=PATIENT_S)
    assert [r.score for r in rs] == [1.0] * len(rows), [r.reason for r in rs]


@pytest.mark.parametrize("completion,gold,ok", MARKER_LINES, ids=[f"{c} vs {g}" for c, g, _ in MARKER_LINES])
def test_the_marker_line_is_read_whole_and_hedges_score_zero(completion, gold, ok):
    (r,) = math_reward(["q"], [completion], [gold], timeout_s=PATIENT_S)
    assert (r.correct, r.score) == (ok, float(ok)), r.reason


def test_marker_commas_are_thousands_separators_only():
    rs = math_reward(["q"] * len(COMMAS), [c for c, _, _ in COMMAS], [g for _, g, _ in COMMAS], timeout_s=PATIENT_S)
    got = [(c, g, r.correct, r.score) for (c, g, _), r in zip(COMMAS, rs, strict=True)]
    assert got == [(c, g, ok, float(ok)) for c, g, ok in COMMAS]
    assert all(r.reason.startswith("malformed number after '####'") for r, (_, _, ok) in zip(rs, COMMAS, strict=True)
               if not ok)
    assert [gsm8k_reward(c, g).correct for c, g, _ in COMMAS] == [ok for _, _, ok in COMMAS]  # the same rule


@pytest.mark.parametrize("completion,gold,why", ACCEPTED, ids=[c[2] for c in ACCEPTED])
def test_accepts_what_the_regex_cannot(completion, gold, why):
    (r,) = math_reward(["q"], [completion], [gold], timeout_s=PATIENT_S)
    assert r.score == 1.0 and r.correct, r.reason
    try:
        assert not gsm8k_reward(completion, gold, lenient=True).lenient_correct
    except ValueError:  # the gold itself is not a number the regex reads
        pass


@pytest.mark.parametrize("completion,gold,why", REJECTED, ids=[c[2] for c in REJECTED])
def test_rejects_wrong_answers_with_a_reason(completion, gold, why):
    (r,) = math_reward(["q"], [completion], [gold], timeout_s=PATIENT_S)
    assert r.score == 0.0 and not r.correct and r.reason


def test_final_answer_reads_the_first_marker_line():
    assert final_answer("x = 2\n#### **18**\n\nQuestion: ...\n#### 4") == "18"


HANG = "\\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate the power tower: runs for hours


def test_a_hang_is_bounded_and_the_next_check_works_off_the_main_thread():
    v = Verifier()
    out = {}

    def work():
        out["warm"] = v.check("1", "1", timeout_s=120.0)  # the child's first start imports sympy
        t0 = time.monotonic()
        out["hang"] = v.check(HANG, "5", timeout_s=1.0)
        out["hang_s"] = time.monotonic() - t0
        out["next"] = v.check("\\boxed{\\frac{10}{2}}", "5", timeout_s=30.0)

    th = threading.Thread(target=work)
    th.start()
    th.join(120)
    v.close()
    assert out["hang"] == {"ok": False, "error": "timed out after 1 s"}
    assert out["warm"]["ok"] and out["hang_s"] < 1.0 + 10.0  # the bound, plus slack for a loaded machine
    assert out["next"]["ok"] and v.starts == 2


def test_threads_share_one_child_safely():
    """Scorer and Dask threads call the reward at once: answers must not cross between them."""
    import concurrent.futures

    def batch(k):
        golds = [str(k * 100 + i) for i in range(15)]
        return [r.correct for r in math_reward(["q"] * 15, [f"\\boxed{{{g}}}" for g in golds], golds, timeout_s=PATIENT_S)]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(batch, range(8)))
    assert all(all(r) for r in results)


def _reward_in_worker(completions, golds, timeout_s):
    scores = math_reward(["q"] * len(completions), completions, golds, timeout_s=timeout_s)
    return threading.current_thread().name, [(r.score, r.reason) for r in scores]


def test_math_reward_in_a_dask_worker_thread():
    distributed = pytest.importorskip("distributed")
    import dask

    with dask.config.set({"distributed.comm.timeouts.connect": "120s"}), \
            distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                                     dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        good = client.submit(_reward_in_worker, ["\\boxed{\\frac{1}{2}}", "#### 7"], ["0.5", "7"], PATIENT_S).result()
        hang = client.submit(_reward_in_worker, [HANG], ["5"], 2.0).result()
        after = client.submit(_reward_in_worker, ["#### 7"], ["7"], PATIENT_S, pure=False).result()
    assert good[0] != "MainThread" and hang[0] != "MainThread"
    assert [s for s, _ in good[1]] == [1.0, 1.0], good
    assert hang[1][0][0] == 0.0 and "timed out after 2 s" in hang[1][0][1], hang
    assert after[1][0][0] == 1.0, after  # the worker goes on scoring, with a new child


def test_task_reads_gsm8k_by_default_and_any_file_with_an_answer_column(tmp_path):
    task = resolve("math")
    train, held = task.load("train", 3), task.load("heldout", 3)
    assert train[0].id.startswith("gsm8k-train") and held[0].id.startswith("gsm8k-test")
    assert "\\boxed" in task.instruction
    rows = [{"problem": f"What is {k}/{k + 1} + 0?", "solution": f"It is \\boxed{{\\frac{{{k}}}{{{k + 1}}}}}"} for k in range(1, 41)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    t = resolve("math", source=str(path), question="problem", answer="solution", heldout_fraction=0.25, timeout_s=PATIENT_S)
    tr, he = t.load("train", 100), t.load("heldout", 100)
    assert len(tr) + len(he) == 40 and 0 < len(he) < 20
    p = he[0]
    k = int(p.question.split()[2].split("/")[0])
    scores = t.scorer().score_problems([p, p], [f"so \\boxed{{\\frac{{{2 * k}}}{{{2 * k + 2}}}}}", "\\boxed{0}"])
    assert [s.reward for s in scores] == [1.0, 0.0], [s.reason for s in scores]
    with pytest.raises(KeyError, match="no column 'answer'"):
        resolve("math", source=str(path), question="problem").load("train", 5)


def test_symbolic_answers_vote_in_maj_at_k():
    """Review finding: an answer with no float value (x + 1, an interval) was parsed as None, so maj@k
    counted the problem wrong (abstentions) where pass@k counted it right."""
    from grpo_kit import passk

    out = math_reward(["q"] * 4, ["#### x+1", "so \\boxed{x+1}", "#### x+1", "#### x+2"], ["x+1"] * 4)
    assert [r.score for r in out] == [1.0, 1.0, 1.0, 0.0]
    assert all(isinstance(r.parsed, str) for r in out) and out[0].parsed == out[1].parsed
    metrics = passk.sampled_metrics([[r.correct for r in out]], [[r.parsed for r in out]])
    assert metrics["maj_acc"] == 1.0 and metrics["avg_acc"] == 0.75
    assert math_reward(["q"], ["#### 0.5"], ["1/2"])[0].parsed == 0.5  # a number stays a float


def test_an_unread_answer_votes_as_its_text_not_as_a_number():
    """math-verify reads no number from fullwidth digits (its text fallback); ``float()`` would, and
    the wrong answer would vote for the gold in maj@k."""
    (r,) = math_reward(["q"], ["\\boxed{\uff11\uff18}"], ["18"], timeout_s=PATIENT_S)
    assert r.score == 0.0 and r.parsed != 18.0


def test_a_batch_of_slow_answers_stops_at_batch_timeout_s():
    """Checks run one after another: past ``batch_timeout_s`` the rest are not run (None, unscorable)
    rather than the whole batch passing the scorer's bound and scoring 0, right answers included."""
    math_reward(["q"], ["\\boxed{1}"], ["1"], timeout_s=120.0)  # the child's first start imports sympy
    t0 = time.monotonic()
    rs = math_reward(["q"] * 4, [HANG] * 3 + ["#### 18"], ["18"] * 4, timeout_s=1.0, batch_timeout_s=1.5)
    assert [r.score for r in rs[:2]] == [0.0, 0.0] and "timed out" in rs[0].reason
    assert [r.score for r in rs[2:]] == [None, None] and all("batch_timeout_s" in r.reason for r in rs[2:])
    assert time.monotonic() - t0 < 30  # two bounded checks and their restarts, not four
    (r,) = math_reward(["q"], ["#### 18"], ["18"], timeout_s=PATIENT_S)  # the verifier still works
    assert r.score == 1.0
