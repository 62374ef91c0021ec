"""Sampled evaluation: pass@k, avg@k and maj@k from ``n`` sampled completions per problem.

- **pass@k** is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1): with ``c`` of ``n >= k`` samples correct, the chance that at least one
  of ``k`` samples drawn without replacement is correct is ``1 - C(n-c, k) / C(n, k)``, computed as
  the product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no large binomials), averaged over problems.
  It is reported at ``k = 1, 2, 4, ...`` up to ``n`` and at ``n`` itself (:func:`ks_for`), as verl
  and others do. pass@1 is ``c / n``.
- **avg@k** (here ``k = n``) is the mean correctness of the samples, averaged over problems: the
  same number as pass@1's estimate, reported under its own name because papers use both.
- **maj@k** (self-consistency, Wang et al. 2022) is the share of problems whose *majority answer*
  is correct. What is voted on is each sample's extracted answer (for the kit's tasks, the first
  reward's ``RewardResult.parsed``: the number read after ``####``, math-verify's value); a sample
  without one abstains, as does one whose number was read only leniently (``\\boxed{}`` or the last
  number, under ``lenient_credit``: the same samples vote alike whatever the reward's shaping). The answer with the most votes wins; a tie goes to the tied answer whose
  first vote came earliest in sample order (a fixed rule, as verl's first-seen order). The winner
  counts correct when any sample that voted for it is correct (for a task whose correctness depends
  on the answer alone, all of them are). A problem where no sample gave an answer counts wrong; an
  evaluation where no sample of any problem gave one has no maj@k (None: the task's rewards extract
  nothing to vote on, e.g. plain-float rewards or code execution).

Pure functions of booleans and answers: :func:`grpo_kit.remote.eval_task` feeds them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one problem with ``c`` of ``n`` samples correct.

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 4), pass_at_k(4, 0, 2), round(pass_at_k(4, 1, 2), 4)
    (0.25, 1.0, 0.0, 0.5)
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"n, c and k must be ints, got {n!r}, {c!r}, {k!r}")
    if k < 1 or n < 1:
        raise ValueError(f"need n >= 1 and k >= 1, got n={n}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in 0..n={n}, got {c}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def ks_for(n: int) -> list[int]:
    """The ``k`` pass@k is reported at for ``n`` samples: the powers of two below ``n``, and ``n``.

    >>> ks_for(1), ks_for(4), ks_for(6)
    ([1], [1, 2, 4], [1, 2, 4, 6])
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def _key(answer: Any) -> Hashable:
    """A vote's key: the answer itself when hashable (``12`` and ``12.0`` are one vote), else its repr."""
    try:
        hash(answer)
    except TypeError:
        return repr(answer)
    return answer


def majority(answers: Sequence[Any]) -> Any:
    """The majority answer among ``answers`` (None entries abstain), None when none voted. A tie goes
    to the tied answer whose first vote came first.

    >>> majority([None, 3.0, 5.0, 5.0, 3.0]), majority([None, None]), majority(["b", "a"])
    (3.0, None, 'b')
    """
    votes: dict[Hashable, int] = {}
    first: dict[Hashable, Any] = {}
    for a in answers:
        if a is None:
            continue
        k = _key(a)
        votes[k] = votes.get(k, 0) + 1
        first.setdefault(k, a)
    if not votes:
        return None
    best = max(votes.values())
    return first[next(k for k, v in votes.items() if v == best)]  # dicts keep first-vote order


def majority_correct(answers: Sequence[Any], correct: Sequence[bool]) -> bool:
    """Whether the majority answer (:func:`majority`) is correct: any sample that voted for it is.
    False when no sample gave an answer."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers for {len(correct)} samples")
    win = majority(answers)
    if win is None:
        return False
    k = _key(win)
    return any(ok for a, ok in zip(answers, correct, strict=True) if a is not None and _key(a) == k)


def sampled_metrics(correct: Sequence[Sequence[bool]], answers: Sequence[Sequence[Any]] | None = None) -> dict:
    """pass@k, avg@k and maj@k over problems, from each problem's samples' correctness (and their
    extracted answers, None where a sample has none): ``{"samples": n, "pass_at": {"1": .., "2": ..,
    ..., str(n): ..}, "avg_acc": .., "maj_acc": .. or None}``. Every problem needs the same ``n``.

    >>> m = sampled_metrics([[True, False, False, False], [False] * 4], [[2, 3, 3, None], [None] * 4])
    >>> m["pass_at"], m["avg_acc"], m["maj_acc"]
    ({'1': 0.125, '2': 0.25, '4': 0.5}, 0.125, 0.0)
    """
    if not correct:
        raise ValueError("no problems to evaluate")
    ns = {len(c) for c in correct}
    if len(ns) != 1:
        raise ValueError(f"every problem needs the same number of samples, got {sorted(ns)}")
    (n,) = ns
    if answers is not None and (len(answers) != len(correct) or any(len(a) != n for a in answers)):
        raise ValueError("answers must hold one entry per sample of each problem")
    cs = [sum(bool(x) for x in c) for c in correct]
    m = len(correct)
    out: dict = {"samples": n,
                 "pass_at": {str(k): sum(pass_at_k(n, c, k) for c in cs) / m for k in ks_for(n)},
                 "avg_acc": sum(cs) / (m * n), "maj_acc": None}
    if answers is not None and any(a is not None for row in answers for a in row):
        out["maj_acc"] = sum(majority_correct(a, c) for a, c in zip(answers, correct, strict=True)) / m
    return out
