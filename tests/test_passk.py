"""grpo_kit.passk: the pass@k estimator against brute force, its edge cases, and the majority vote."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from grpo_kit import passk


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_equals_brute_force_enumeration_of_k_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert passk.pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    # C(1000, 100) has 140 digits: the product form never builds it; the exact ratio agrees
    for n, c, k in [(1000, 3, 100), (1000, 1, 1), (512, 500, 256), (200, 7, 199)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert passk.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert passk.pass_at_k(6, 0, 1) == passk.pass_at_k(6, 0, 6) == 0.0  # nothing correct: no k-subset passes
    assert passk.pass_at_k(6, 6, 1) == passk.pass_at_k(6, 6, 3) == 1.0  # everything correct
    assert passk.pass_at_k(6, 1, 6) == 1.0 and passk.pass_at_k(6, 0, 6) == 0.0  # k = n: any correct sample
    assert passk.pass_at_k(6, 5, 2) == 1.0  # n - c < k: every pair holds a correct one
    assert passk.pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # pass@1 is c / n
    with pytest.raises(ValueError, match="at least 5 samples"):
        passk.pass_at_k(4, 1, 5)  # k > n cannot be estimated
    for bad in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (0, 0, 1)]:
        with pytest.raises(ValueError):
            passk.pass_at_k(*bad)
    with pytest.raises(TypeError):
        passk.pass_at_k(4, 1.0, 1)


def test_ks_are_powers_of_two_and_n():
    assert passk.ks_for(1) == [1] and passk.ks_for(2) == [1, 2] and passk.ks_for(8) == [1, 2, 4, 8]
    assert passk.ks_for(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        passk.ks_for(0)


def test_majority_vote_ties_and_abstentions():
    # the most votes win; None abstains
    assert passk.majority([None, 7, 3, 7]) == 7
    # a tie goes to the tied answer voted first: 5 (first at index 1) before 3 (index 2), both 2 votes
    assert passk.majority([None, 5, 3, 3, 5]) == 5
    assert passk.majority([3, 5, 5, 3]) == 3
    # a one-vote-each tie: the first sample's answer
    assert passk.majority(["x", "y", "z"]) == "x"
    assert passk.majority([None, None]) is None and passk.majority([]) is None
    assert passk.majority([12, 12.0, 13]) == 12  # 12 and 12.0 are one answer
    assert passk.majority([[1, 2], [1, 2], [3]]) == [1, 2]  # unhashable answers vote by their repr


def test_majority_correct_reads_the_winners_samples():
    # the winner 3 was written once strictly right (True) and once not: the answer counts correct
    assert passk.majority_correct([3, 3, 4], [True, False, False])
    # a right minority answer does not make the majority right
    assert not passk.majority_correct([4, 4, 3], [False, False, True])
    # no sample gave an answer: wrong, whatever the correctness flags say
    assert not passk.majority_correct([None, None], [False, False])
    with pytest.raises(ValueError):
        passk.majority_correct([1], [True, False])


def test_sampled_metrics_are_consistent():
    correct = [[True, False, True, False], [False] * 4, [True] * 4]
    answers = [[1, 2, 1, None], [None, 9, 8, 9], [5, 5, 5, 5]]
    m = passk.sampled_metrics(correct, answers)
    assert m["samples"] == 4 and list(m["pass_at"]) == ["1", "2", "4"]
    assert m["pass_at"]["1"] == pytest.approx(m["avg_acc"]) == pytest.approx((2 + 0 + 4) / 12)
    assert m["pass_at"]["4"] == pytest.approx(2 / 3)  # two problems with a correct sample
    assert m["pass_at"]["2"] == pytest.approx((passk.pass_at_k(4, 2, 2) + 0 + 1) / 3)
    assert m["maj_acc"] == pytest.approx(2 / 3)  # 1 (right), 9 (wrong), 5 (right)
    # rewards that extract nothing leave maj@k out (None), not 0
    assert passk.sampled_metrics(correct, [[None] * 4] * 3)["maj_acc"] is None
    assert passk.sampled_metrics(correct)["maj_acc"] is None
    with pytest.raises(ValueError, match="same number"):
        passk.sampled_metrics([[True], [True, False]])
    with pytest.raises(ValueError):
        passk.sampled_metrics([])


def test_lenient_answers_cast_no_vote_so_maj_at_k_ignores_lenient_credit():
    """Review finding (2026-12-03): with lenient_credit > 0 a completion without '####' voted with its
    last number, so the same completions gave maj@k 1.0 or 0.0 by a reward-shaping knob."""
    from grpo_kit import tasks
    from grpo_kit.data import Problem

    p = Problem("add-764-993", "What is 764 + 993?", "1757")
    texts = ["#### 1757", "#### 1757", "carry the 1 ... 7", "carry the 1 ... 7", "carry the 1 ... 7"]
    maj = {}
    for lc in (0.0, 0.5):
        scores = tasks.resolve("synthetic", lenient_credit=lc).scorer().score_problems([p] * 5, texts)
        answers = [s.answer for s in scores]
        assert answers == [1757.0, 1757.0, None, None, None], (lc, answers)
        maj[lc] = passk.sampled_metrics([[s.correct for s in scores]], [answers])["maj_acc"]
    assert maj == {0.0: 1.0, 0.5: 1.0}
