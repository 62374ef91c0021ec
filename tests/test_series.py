"""Series and thinning of grpo_kit.series."""

from __future__ import annotations

import pytest
from synthetic_run import synthetic_records

from grpo_kit import series

# ---------------------------------------------------------------- long runs


@pytest.mark.parametrize("n", [0, 1, 799, 800, 801, 1_000, 10_000, 123_457])
def test_thin_indices_bounds_the_points_and_keeps_the_recent_ones(n):
    idx = series.thin_indices(n, 800, 200)
    assert len(idx) <= 800 and idx == sorted(set(idx))
    assert idx[-200:] == list(range(max(0, n - 200), n))  # the last 200 all there, in full
    if n <= 800:
        assert idx == list(range(n))  # a short history is drawn whole
    else:
        assert idx[0] == 0 and len(idx) > 400  # the start stays, and the budget is used, not wasted
        # older points are evenly spaced
        old = idx[: len(idx) - 200]
        assert len({b - a for a, b in zip(old, old[1:], strict=False)}) == 1


def test_thin_indices_keeps_a_drawn_point_until_the_stride_doubles():
    before, after = series.thin_indices(4_000, 800, 200), series.thin_indices(4_001, 800, 200)
    old_before = set(before[:-200])
    assert old_before <= set(after)  # no flicker: the old points stay as one point arrives
    with pytest.raises(ValueError):
        series.thin_indices(10, 100, 100)


def test_thin_records_keeps_sparse_evaluations():
    recs = synthetic_records(5_000, eval_every=7)  # evaluations fall between the strides
    view = series.thin_records(recs, 800, 200)
    ev_all = [r["iteration"] for r in recs if r["eval_acc"] is not None]
    ev_view = [r["iteration"] for r in view if r["eval_acc"] is not None]
    assert len(view) <= 800 and len(ev_view) >= 100  # within the budget, evaluations kept
    assert ev_view[-1] == ev_all[-1] and view[-1] is recs[-1]
    assert series.thin_records(recs[:50], 800, 200) == recs[:50]


def test_thin_records_keeps_a_record_holding_only_the_base_or_another_sets_evaluation():
    recs = [{"iteration": i, "version": i + 1, "tool_rate": 0.5, "eval_acc": None} for i in range(801)]
    recs[1]["evals"] = [{"version": 0, "acc": 0.2, "tool_rate": 0.1}]  # the base model's evaluation
    recs[11]["evals"] = [{"version": 10, "set": "math500", "acc": 0.3}]
    view = series.thin_records(recs, 800, 200)
    assert recs[1] in view and recs[11] in view


def test_an_evaluation_sits_at_the_iteration_that_published_its_version():
    """An iteration without a usable group publishes nothing: v2 then comes from iteration 2, and
    its evaluation belongs there (its result's ``iteration``), not at ``version - 1``."""
    from grpo_kit import evals

    recs = [{"iteration": i, "version": v, "spans": []} for i, v in enumerate((0, 1, 2, 2))]
    evals.attach(recs[3], {"version": 2, "acc": 0.5, "iteration": 2, "start": 0.0, "end": 1.0})
    evals.attach(recs[3], {"version": 1, "acc": 0.25, "iteration": 1, "start": 0.0, "end": 1.0})
    assert series.eval_series(recs, "eval_acc") == ([1, 2], [0.25, 0.5])
    assert series.made_at({"version": 3}) == 2  # a result from before ``iteration`` was kept


def test_eval_series_reads_every_evaluation_of_a_record():
    """Two evaluations finishing during one iteration: the record's fields hold the last, its
    ``evals`` both; an older record without ``evals`` is read from its fields."""
    from grpo_kit import evals

    recs = [{"iteration": i, "version": i + 1, "spans": [], "eval_acc": None} for i in range(6)]
    recs[1].update(eval_acc=0.1, eval_version=1)  # a record from before ``evals``
    for v, acc, pass_k in ((2, 0.40, 0.6), (4, 0.55, 0.7)):
        evals.attach(recs[5], {"version": v, "acc": acc, "lenient_acc": acc + 0.1, "iteration": v - 1, "start": 0.0,
                               "end": 1.0, "samples": 4, "pass_at": {"1": acc, "4": pass_k}, "maj_acc": acc})
    evals.attach(recs[5], {"version": 0, "acc": 0.05, "iteration": 5, "start": 0.0, "end": 1.0})  # the base model's
    evals.attach(recs[5], {"version": 4, "set": "other", "acc": 0.9, "iteration": 5, "start": 0.0, "end": 1.0})
    assert series.eval_series(recs, "eval_acc") == ([0, 1, 3], [0.1, 0.40, 0.55])
    assert series.eval_series(recs, "eval_lenient_acc") == ([1, 3], [0.5, 0.65])
    assert series.eval_series(recs, "eval_pass_at_k") == ([1, 3], [0.6, 0.7])
