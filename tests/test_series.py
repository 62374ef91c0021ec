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
