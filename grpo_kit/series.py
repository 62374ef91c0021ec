"""Numbers read out of a run's metric records: finite values, per-iteration series, spans, thinning.

What the figures (:mod:`grpo_kit.figures`), the live widgets and the report share. Any key may be
missing or ``None`` in an early or partial run: a series holds the records that have a number there.
Long runs are drawn from a thinned view (:func:`thin_records`) so that a figure's cost stays flat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Record = Mapping[str, Any]
"""One per-iteration metrics record as read back (:class:`grpo_kit.records.MetricsRecord`'s keys)."""


def number(v: Any) -> float | None:
    """A finite real number as float, else None (bools, strings, NaN and null are not data)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def iteration_of(rec: Record, i: int) -> int:
    it = rec.get("iteration")
    return it if isinstance(it, int) and not isinstance(it, bool) else i


def series(records: Sequence[Record], key: str | Callable[[Record], Any]) -> tuple[list[int], list[float]]:
    """(iterations, values) over the records where ``key`` (a field or a function of the record) is a number."""
    get = key if callable(key) else (lambda r: r.get(key))
    xs, ys = [], []
    for i, rec in enumerate(records):
        y = number(get(rec))
        if y is not None:
            xs.append(iteration_of(rec, i))
            ys.append(y)
    return xs, ys


def last_number(records: Sequence[Record], key: str) -> Any:
    return next((r[key] for r in reversed(records) if number(r.get(key)) is not None), None)


EVAL_FIELDS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "eval_acc": lambda ev: ev.get("acc"),
    "eval_lenient_acc": lambda ev: ev.get("lenient_acc"),
    "eval_pass_at_k": lambda ev: (ev.get("pass_at") or {}).get(str(ev.get("samples"))) if isinstance(ev.get("pass_at"), Mapping) else None,
    "eval_maj_acc": lambda ev: ev.get("maj_acc"),
}
"""A record's held-out field -> its value in one evaluation result of the record's ``evals`` (what
:func:`grpo_kit.evals.attach` copies into the record's fields from the latest result)."""


def own_evals(rec: Record) -> list[Mapping[str, Any]]:
    """The record's evaluation results of a trained version on the task's own held-out set."""
    evs = rec.get("evals")
    return [ev for ev in evs if isinstance(ev, Mapping) and ev.get("set") is None
            and isinstance(ev.get("version"), int) and not isinstance(ev.get("version"), bool) and ev["version"] > 0] \
        if isinstance(evs, list) else []


def made_at(ev: Mapping[str, Any]) -> int:
    """The iteration whose step published the version an evaluation result measured: its
    ``iteration`` (-1 for the base model), else ``version - 1`` (results written before it was kept;
    true only of runs where every iteration trained: an iteration without a usable group publishes
    nothing, and the versions after it come from later iterations)."""
    it = ev.get("iteration")
    return it if isinstance(it, int) and not isinstance(it, bool) else ev["version"] - 1


def eval_series(records: Sequence[Record], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of a held-out measure, each at the step that produced the version it evaluated
    (:func:`made_at`), in version order.

    An evaluation finishes later than that step (version v comes out of iteration v - 1 where every iteration trained): plotted
    at the iteration during which it finished, it would lag. Two evaluations can finish during one
    iteration: the record's ``evals`` holds both (its ``eval_*`` fields only the last), so a record with
    ``evals`` is read from them (for the keys of :data:`EVAL_FIELDS`). Records without ``eval_version``
    keep their own iteration.
    """
    pts = set()
    for i, rec in enumerate(records):
        evs = own_evals(rec) if key in EVAL_FIELDS else []
        if evs:  # (iteration, version, value): in version order where iterations tie
            pts.update((made_at(ev), ev["version"], y) for ev in evs if (y := number(EVAL_FIELDS[key](ev))) is not None)
            continue
        y = number(rec.get(key))
        v = rec.get("eval_version")
        if y is not None:
            versioned = isinstance(v, int) and not isinstance(v, bool)
            x = v - 1 if versioned else iteration_of(rec, i)
            pts.add((x, v if versioned else x + 1, y))
    pts = sorted(pts)
    return [p[0] for p in pts], [p[2] for p in pts]


def all_spans(records: Sequence[Record]) -> list[tuple[str, Any, float, float]]:
    """Well-formed spans ``(name, iteration, start, end)`` of all records, duplicates dropped."""
    seen, out = set(), []
    for rec in records:
        spans = rec.get("spans")
        for s in spans if isinstance(spans, list) else ():
            if not isinstance(s, Mapping):
                continue
            start, end = number(s.get("start")), number(s.get("end"))
            if start is None or end is None or end < start:
                continue
            key = (str(s.get("name")), s.get("iteration"), start, end)
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


# ---------------------------------------------------------------- long runs


def thin_indices(n: int, max_points: int, keep_last: int) -> list[int]:
    """Which of ``n`` points to draw so that at most ``max_points`` remain: the last ``keep_last``
    all, the older ones every ``stride``-th from the first, ``stride`` the smallest power of two
    that fits them into the rest. A point once drawn stays drawn until the stride doubles, so a
    live plot does not flicker as points arrive.

    >>> thin_indices(5, 10, 2)
    [0, 1, 2, 3, 4]
    >>> thin_indices(12, 6, 2)
    [0, 4, 8, 10, 11]
    """
    if max_points <= keep_last or keep_last < 0:
        raise ValueError(f"need 0 <= keep_last < max_points, got keep_last={keep_last}, max_points={max_points}")
    if n <= max_points:
        return list(range(n))
    old, room = n - keep_last, max_points - keep_last
    stride = 1
    while -(-old // stride) > room:
        stride *= 2
    return [*range(0, old, stride), *range(old, n)]


def _has_eval(rec: Record) -> bool:
    """Whether the record carries an evaluation result: a trained version's held-out accuracy, or only
    the base model's or another eval set's (in ``evals``)."""
    return rec.get("eval_acc") is not None or rec.get("eval_lenient_acc") is not None or bool(rec.get("evals"))


def thin_records(records: Sequence[Record], max_points: int, keep_last: int) -> list[Record]:
    """At most ``max_points`` of ``records`` to draw a long run from (:func:`thin_indices`). Records
    that carry an evaluation are a sparse series of their own: they get a quarter of the budget and
    are thinned apart, so that held-out accuracy never vanishes between strides. Shorter runs come
    back whole."""
    if len(records) <= max_points:
        return list(records)
    evals = [i for i, r in enumerate(records) if _has_eval(r)]
    if not evals:
        return [records[i] for i in thin_indices(len(records), max_points, keep_last)]
    ev_budget = max(2, max_points // 4)
    dense = max_points - ev_budget
    keep = {*thin_indices(len(records), dense, min(keep_last, dense - 1))}
    keep.update(evals[i] for i in thin_indices(len(evals), ev_budget, min(keep_last, ev_budget // 2)))
    return [records[i] for i in sorted(keep)]
