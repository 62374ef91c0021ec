"""Plotly figures from a run's metric records; live updates in a notebook; a self-contained HTML report.

Every figure is a pure function of the metric records (the dicts the loop appends to ``metrics.jsonl``,
one per iteration). Any key may be missing or ``None`` in an early or partial run: a series is drawn
from the records that have it, and a figure always carries the same traces, empty where there is no
data, so that :class:`LivePlots` can update a figure in place by copying the arrays of a freshly built
one into it. Trace names are part of the contract (the tests look them up).

``LivePlots`` shows ``FigureWidget`` s that follow a run in JupyterLab; under papermill, in a console
or in plain python it only collects records, and :meth:`LivePlots.show` displays static figures at
the end. ``write_report`` writes one HTML file that opens offline: plotly.js is inlined once.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

Record = Mapping[str, Any]

SPAN_KINDS = ("generate", "train", "publish", "eval")
"""Span names the loop records, top to bottom in the timeline."""

_C = qualitative.Plotly
COLORS = {
    "reward": _C[0],
    "train_acc": _C[2],
    "eval_acc": _C[1],
    "base": "#7f7f7f",
    "ratio": _C[0],
    "clip_low": _C[4],
    "clip_high": _C[1],
    "clip": "#444444",
    "kl": _C[3],
    "is_weight": _C[5],
    "staleness_max": _C[1],
    "staleness_mean": _C[0],
    "rejected": "#b0b0b0",
    "generate": _C[0],
    "train": _C[1],
    "publish": _C[2],
    "eval": _C[3],
    "iteration": "#444444",
    "usable": _C[2],
    "cost": _C[4],
    "workers": _C[6],
}
# The title sits at the top edge of the figure and the legend at its bottom edge, under the x axis
# title: a legend that wraps onto more rows at a narrow width (JupyterLab's output area, the report
# in a small window) grows away from the title and pushes the plot area up, never over a title.
_LAYOUT = dict(
    template="plotly_white",
    margin=dict(l=60, r=30, t=50, b=50),
    hovermode="x unified",
    title=dict(x=0, xref="paper", xanchor="left", y=1, yref="container", yanchor="top", pad=dict(t=14)),
    legend=dict(orientation="h", x=0, xanchor="left", y=0, yref="container", yanchor="bottom"),
)


def _style(fig: go.Figure, title: str, height: int, **layout: Any) -> None:
    """The common layout (:data:`_LAYOUT`, overridden by ``layout``), a title and a height."""
    fig.update_layout(**{**_LAYOUT, **layout}, height=height)
    fig.update_layout(title_text=title)


# ---------------------------------------------------------------- reading a run


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file. The last line may be half written (a run in progress): it is dropped;
    an unreadable line elsewhere is skipped with a warning."""
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                warnings.warn(f"{path}: skipping unreadable line {i + 1}", stacklevel=3)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object, or ``{}`` when the file is missing or not (yet) complete."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"records", "config", "summary", "samples"}`` of a run directory; missing files read as empty."""
    d = Path(run_dir)
    return {
        "records": _read_jsonl(d / "metrics.jsonl"),
        "config": _read_json(d / "config.json"),
        "summary": _read_json(d / "summary.json"),
        "samples": _read_jsonl(d / "samples.jsonl"),
    }


# ---------------------------------------------------------------- series helpers


def _num(v: Any) -> float | None:
    """A finite real number as float, else None (bools, strings, NaN and null are not data)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _x(rec: Record, i: int) -> int:
    it = rec.get("iteration")
    return it if isinstance(it, int) and not isinstance(it, bool) else i


def _series(records: Sequence[Record], key: str | Callable[[Record], Any]) -> tuple[list[int], list[float]]:
    """(iterations, values) over the records where ``key`` (a field or a function of the record) is a number."""
    get = key if callable(key) else (lambda r: r.get(key))
    xs, ys = [], []
    for i, rec in enumerate(records):
        y = _num(get(rec))
        if y is not None:
            xs.append(_x(rec, i))
            ys.append(y)
    return xs, ys


def _sum(rec: Record, a: str, b: str) -> float | None:
    va, vb = _num(rec.get(a)), _num(rec.get(b))
    return None if va is None or vb is None else va + vb


def _last(records: Sequence[Record], key: str) -> Any:
    return next((r[key] for r in reversed(records) if _num(r.get(key)) is not None), None)


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


Arrays = dict[str, list]
"""The data arrays of one trace (``x``, ``y`` and for bars ``base``, ``text``, ``customdata``)."""


def _xy(series: tuple[list, list]) -> Arrays:
    return {"x": series[0], "y": series[1]}


def _line(arr: Arrays, name, color, dash=None, mode="lines+markers", **kw) -> go.Scatter:
    return go.Scatter(**arr, name=name, mode=mode, line=dict(color=color, dash=dash), marker=dict(size=5), **kw)


def _lenient(arr: Arrays, name: str, color: str) -> go.Scatter:
    """A lenient-accuracy series: the strict series' colour, lighter and dotted."""
    return go.Scatter(
        **arr,
        name=name,
        mode="lines+markers",
        opacity=0.55,
        line=dict(color=color, dash="dot", width=1.5),
        marker=dict(size=3),
    )


def _eval_series(records: Sequence[Record], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of a held-out measure, each at the step that produced the version it evaluated.

    An evaluation finishes later than that step (version v comes out of iteration v - 1): plotted
    at the iteration during which it finished, it would lag. Records without ``eval_version`` keep
    their own iteration.
    """
    pts = []
    for i, rec in enumerate(records):
        y = _num(rec.get(key))
        v = rec.get("eval_version")
        if y is not None:
            pts.append((v - 1 if isinstance(v, int) and not isinstance(v, bool) else _x(rec, i), y))
    pts.sort()
    return [p[0] for p in pts], [p[1] for p in pts]


def _band_data(records, lo: Callable[[Record], Any], hi: Callable[[Record], Any]) -> Arrays:
    """A filled band's outline: along the upper edge and back along the lower one."""
    pts = [(_x(r, i), _num(lo(r)), _num(hi(r))) for i, r in enumerate(records)]
    pts = [(x, a, b) for x, a, b in pts if a is not None and b is not None]
    xs = [p[0] for p in pts]
    return {"x": xs + xs[::-1], "y": [p[2] for p in pts] + [p[1] for p in pts][::-1]}


def _band(arr: Arrays, name: str, color: str) -> go.Scatter:
    """A filled band as one closed polygon (one trace, so a live update is one restyle)."""
    return go.Scatter(
        **arr,
        name=name,
        fill="toself",
        fillcolor=_rgba(color, 0.18),
        line=dict(width=0),
        mode="lines",
        hoverinfo="skip",
    )


# ---------------------------------------------------------------- figures
#
# Each figure is two functions: ``<name>_data(records)`` computes the data arrays of its traces, in
# trace order (cheap: what a live update recomputes), and ``<name>_figure(records)`` builds the
# figure around them (styles, axes, subplots: what a live update keeps).


def _std_edge(sign: int) -> Callable[[Record], Any]:
    def edge(r: Record) -> float | None:
        m, s = _num(r.get("reward_mean")), _num(r.get("reward_std"))
        return None if m is None or s is None else m + sign * s

    return edge


def reward_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`reward_figure`."""
    # The base model's accuracy is one number: a dashed line across the iterations run so far.
    base = _num(_last(records, "base_acc"))
    xs = [_x(r, i) for i, r in enumerate(records)] if base is not None else []
    bx = [min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1] if xs else []
    return [
        _band_data(records, _std_edge(-1), _std_edge(+1)),
        _xy(_series(records, "reward_mean")),
        _xy(_series(records, "train_acc")),
        _xy(_series(records, "train_lenient_acc")),
        _xy(_eval_series(records, "eval_acc")),
        _xy(_eval_series(records, "eval_lenient_acc")),
        {"x": bx, "y": [base] * len(bx)},
    ]


def reward_figure(records: Sequence[Record]) -> go.Figure:
    """Reward mean with a ±std band (left axis); train, held-out and base-model accuracy (right axis).

    Accuracy is strict (the ``#### <n>`` form and the right value), with lenient accuracy (the right
    value by any rule) beside it, lighter and dotted, where the records have it.
    """
    band, mean, train, train_len, ev, ev_len, base = reward_data(records)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(_band(band, "reward ± std", COLORS["reward"]), secondary_y=False)
    fig.add_trace(_line(mean, "reward mean", COLORS["reward"]), secondary_y=False)
    # runs from before lenient grading have no lenient keys: those traces stay empty, out of the legend
    fig.add_trace(_line(train, "train accuracy", COLORS["train_acc"]), secondary_y=True)
    fig.add_trace(_lenient(train_len, "train (lenient)", COLORS["train_acc"]), secondary_y=True)
    fig.add_trace(_line(ev, "held-out accuracy", COLORS["eval_acc"]), secondary_y=True)
    fig.add_trace(_lenient(ev_len, "held-out (lenient)", COLORS["eval_acc"]), secondary_y=True)
    fig.add_trace(
        go.Scatter(**base, name="base model", mode="lines", line=dict(color=COLORS["base"], dash="dash")),
        secondary_y=True,
    )
    _style(fig, "Reward and accuracy", 420)
    fig.update_xaxes(title_text="iteration")
    fig.update_yaxes(title_text="reward", secondary_y=False)
    # explicit ticks: plotly.js would otherwise sync them to the reward axis' grid (0.122, 0.302, ...)
    fig.update_yaxes(
        title_text="accuracy",
        range=[-0.02, 1.02],
        tickmode="linear",
        tick0=0,
        dtick=0.2,
        tickformat=".0%",
        secondary_y=True,
        showgrid=False,
    )
    return fig


def drift_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`drift_figure`."""
    return [
        _band_data(records, lambda r: r.get("ratio_min"), lambda r: r.get("ratio_max")),
        *(_xy(_series(records, k)) for k in ("ratio_mean", "clip_frac_low", "clip_frac_high", "clip_frac",
                                              "is_capped_frac", "kl_mean")),
        _band_data(records, lambda r: r.get("is_min"), lambda r: r.get("is_max")),
        _xy(_series(records, "is_mean")),
    ]


def drift_figure(records: Sequence[Record]) -> go.Figure:
    """Off-policy drift: the policy's importance ratio (mean, min/max band), clip fractions, KL to the
    base model and, with ``old_logp_source="trainer"``, the engine-mismatch weight π_old/π_engine
    (mean, min/max band before the cap) and the share of tokens whose weight was capped."""
    ratio_band, ratio, clip_low, clip_high, clip, capped, kl, is_band, is_mean = drift_data(records)
    fig = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=("importance ratio π/π_old", "clip fraction, weight capped", "KL to base",
                        "engine mismatch weight π_old/π_engine"),
    )
    fig.add_trace(_band(ratio_band, "ratio min/max", COLORS["ratio"]), row=1, col=1)
    fig.add_trace(_line(ratio, "ratio mean", COLORS["ratio"]), row=1, col=1)
    fig.add_trace(_line(clip_low, "clip low", COLORS["clip_low"], dash="dot"), row=2, col=1)
    fig.add_trace(_line(clip_high, "clip high", COLORS["clip_high"], dash="dot"), row=2, col=1)
    fig.add_trace(_line(clip, "clip total", COLORS["clip"]), row=2, col=1)
    fig.add_trace(_line(capped, "weight capped", COLORS["is_weight"], dash="dash"), row=2, col=1)
    fig.add_trace(_line(kl, "KL", COLORS["kl"]), row=3, col=1)
    fig.add_trace(_band(is_band, "weight min/max", COLORS["is_weight"]), row=4, col=1)
    fig.add_trace(_line(is_mean, "weight mean", COLORS["is_weight"]), row=4, col=1)
    _style(fig, "Off-policy drift", 860)
    fig.update_xaxes(title_text="iteration", row=4, col=1)
    return fig


def staleness_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`staleness_figure`."""
    return [_xy(_series(records, k)) for k in ("rejected_groups", "staleness_max", "staleness_mean")]


def staleness_figure(records: Sequence[Record]) -> go.Figure:
    """Version lag of each batch (trainer version minus generating adapter version) and rejected groups."""
    rejected, lag_max, lag_mean = staleness_data(records)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Bar(**rejected, name="rejected groups", marker_color=COLORS["rejected"], opacity=0.6), secondary_y=True
    )
    fig.add_trace(_line(lag_max, "staleness max", COLORS["staleness_max"]), secondary_y=False)
    fig.add_trace(_line(lag_mean, "staleness mean", COLORS["staleness_mean"], dash="dot"), secondary_y=False)
    _style(fig, "Staleness", 380)
    fig.update_xaxes(title_text="iteration")
    fig.update_yaxes(title_text="version lag", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(
        title_text="rejected groups", rangemode="tozero", tickmode="auto", secondary_y=True, showgrid=False
    )
    return fig


def _component_names(records: Sequence[Record]) -> list[str]:
    names: list[str] = []
    for r in records:
        for name in r.get("reward_components") or {}:
            if name not in names:
                names.append(name)
    return names


def components_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`components_figure`."""
    comps = [_xy(_series(records, lambda r, n=name: (r.get("reward_components") or {}).get(n)))
             for name in _component_names(records)]
    return [_xy(_series(records, "reward_errors")), _xy(_series(records, "reward_mean")), *comps]


def components_figure(records: Sequence[Record]) -> go.Figure:
    """Each reward component's batch mean (the task's reward functions, unweighted) beside the
    weighted total, and the completions a reward function failed on (raised, timed out, or returned
    something that is not a score) as bars on the right axis."""
    errors, total, *comps = components_data(records)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(**errors, name="reward errors", marker_color=COLORS["rejected"], opacity=0.6), secondary_y=True)
    fig.add_trace(_line(total, "total (weighted)", COLORS["reward"]), secondary_y=False)
    for k, (name, arr) in enumerate(zip(_component_names(records), comps, strict=True)):
        fig.add_trace(_line(arr, name, _C[(k + 2) % len(_C)], dash="dot"), secondary_y=False)
    _style(fig, "Reward components", 380)
    fig.update_xaxes(title_text="iteration")
    fig.update_yaxes(title_text="batch mean", secondary_y=False)
    fig.update_yaxes(title_text="completions with a failed reward", rangemode="tozero", secondary_y=True, showgrid=False)
    return fig


def _spans(records: Sequence[Record]) -> list[tuple[str, Any, float, float]]:
    """Well-formed spans ``(name, iteration, start, end)`` of all records, duplicates dropped."""
    seen, out = set(), []
    for rec in records:
        spans = rec.get("spans")
        for s in spans if isinstance(spans, list) else ():
            if not isinstance(s, Mapping):
                continue
            start, end = _num(s.get("start")), _num(s.get("end"))
            if start is None or end is None or end < start:
                continue
            key = (str(s.get("name")), s.get("iteration"), start, end)
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


TIMELINE_ITERATIONS = 100
"""The timeline shows the spans of the last this many records: over a long run thousands of bars
would be unreadable (and weigh megabytes in the report)."""


def _timeline_kinds(spans) -> list[str]:
    return list(SPAN_KINDS) + sorted({s[0] for s in spans} - set(SPAN_KINDS))


def timeline_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`timeline_figure`: one bar trace per span kind."""
    spans = _spans(records[-TIMELINE_ITERATIONS:])
    t0 = min((s[2] for s in spans), default=0.0)
    out = []
    for kind in _timeline_kinds(spans):
        mine = [s for s in spans if s[0] == kind]
        out.append({
            "y": [kind] * len(mine),
            "base": [s[2] - t0 for s in mine],
            "x": [s[3] - s[2] for s in mine],
            "text": [str(s[1]) for s in mine],
            "customdata": [[str(s[1]), s[2] - t0, s[3] - t0, s[3] - s[2]] for s in mine],
        })
    return out


def timeline_figure(records: Sequence[Record]) -> go.Figure:
    """Gantt chart of generate / train / publish / eval spans, seconds since the first span.

    One row per kind, one bar per span labelled by its iteration: with a pipelined loop the generate
    bar of iteration i+1 runs beside the train bar of iteration i. Spans of the last
    :data:`TIMELINE_ITERATIONS` records only.
    """
    kinds = _timeline_kinds(_spans(records[-TIMELINE_ITERATIONS:]))
    fig = go.Figure()
    for i, (kind, arr) in enumerate(zip(kinds, timeline_data(records), strict=True)):
        fig.add_trace(
            go.Bar(
                **arr,
                orientation="h",
                name=kind,
                textposition="inside",
                insidetextanchor="middle",
                hovertemplate="iteration %{customdata[0]}: %{customdata[1]:.2f}–%{customdata[2]:.2f} s"
                " (%{customdata[3]:.2f} s)<extra>%{fullData.name}</extra>",
                marker=dict(color=COLORS.get(kind, _C[(i + 4) % len(_C)]), line=dict(color="white", width=1)),
            )
        )
    _style(
        fig,
        "Pipeline timeline",
        340,
        hovermode="closest",
        barmode="overlay",
        bargap=0.25,
        uniformtext=dict(minsize=8, mode="hide"),
    )
    fig.update_xaxes(title_text="seconds since the first span", rangemode="tozero")
    fig.update_yaxes(categoryorder="array", categoryarray=kinds[::-1])
    return fig


def timing_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`timing_figure`."""
    return [
        *(_xy(_series(records, k)) for k in ("iter_s", "gen_s", "train_s")),
        _xy(_series(records, lambda r: _sum(r, "gen_s", "train_s"))),
    ]


def timing_figure(records: Sequence[Record]) -> go.Figure:
    """Wall time per iteration against its generation and training time; below the serial sum means overlap."""
    it, gen, train, serial = timing_data(records)
    fig = go.Figure()
    fig.add_trace(_line(it, "iteration", COLORS["iteration"]))
    fig.add_trace(_line(gen, "generate", COLORS["generate"]))
    fig.add_trace(_line(train, "train", COLORS["train"]))
    fig.add_trace(_line(serial, "generate + train", COLORS["base"], dash="dash", mode="lines"))
    _style(fig, "Time per iteration", 380)
    fig.update_xaxes(title_text="iteration")
    fig.update_yaxes(title_text="seconds", rangemode="tozero")
    return fig


def usable_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`usable_figure`."""
    keys = ("dropped_groups", "usable_share", "usable_cost_s", "rollout_workers", "usable_cost")
    return [_xy(_series(records, k)) for k in keys]


def usable_figure(records: Sequence[Record]) -> go.Figure:
    """Usable samples (completions in groups with reward spread): their share of what was generated
    and the zero-spread groups dropped (dynamic sampling); the device-seconds (and money, given a
    price) per usable sample beside the rollout workers that served the iteration."""
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        specs=[[{"secondary_y": True}], [{"secondary_y": True}], [{}]],
                        subplot_titles=("usable share of generated completions", "cost per usable sample",
                                        "money per usable sample"))
    dropped, share, cost_s, workers, cost = usable_data(records)
    fig.add_trace(go.Bar(**dropped, name="dropped groups", marker_color=COLORS["rejected"], opacity=0.6),
                  row=1, col=1, secondary_y=True)
    fig.add_trace(_line(share, "usable share", COLORS["usable"]), row=1, col=1, secondary_y=False)
    fig.add_trace(_line(cost_s, "device-s per usable sample", COLORS["cost"]), row=2, col=1, secondary_y=False)
    fig.add_trace(_line(workers, "rollout workers", COLORS["workers"], dash="dot", line_shape="hv"), row=2, col=1,
                  secondary_y=True)
    fig.add_trace(_line(cost, "money per usable sample", COLORS["cost"], dash="dash"), row=3, col=1)
    _style(fig, "Usable samples and their cost", 760)
    fig.update_xaxes(title_text="iteration", row=3, col=1)
    fig.update_yaxes(title_text="share", range=[0, 1.05], row=1, col=1, secondary_y=False)
    fig.update_yaxes(title_text="groups", rangemode="tozero", showgrid=False, row=1, col=1, secondary_y=True)
    fig.update_yaxes(title_text="device-s", rangemode="tozero", row=2, col=1, secondary_y=False)
    fig.update_yaxes(title_text="workers", rangemode="tozero", dtick=1, showgrid=False, row=2, col=1, secondary_y=True)
    fig.update_yaxes(title_text="price_per_hour units", rangemode="tozero", row=3, col=1)
    return fig


FIGURES: dict[str, Callable[[Sequence[Record]], go.Figure]] = {
    "reward": reward_figure,
    "drift": drift_figure,
    "staleness": staleness_figure,
    "rewards": components_figure,
    "timeline": timeline_figure,
    "timing": timing_figure,
    "usable": usable_figure,
}
"""Figure builders by stable name; the report's div ids are ``fig-<name>``."""

FIGURE_DATA: dict[str, Callable[[Sequence[Record]], list[Arrays]]] = {
    "reward": reward_data,
    "drift": drift_data,
    "staleness": staleness_data,
    "rewards": components_data,
    "timeline": timeline_data,
    "timing": timing_data,
    "usable": usable_data,
}
"""The trace arrays of each figure of :data:`FIGURES`, in trace order (what a live update copies)."""


def all_figures(records: Sequence[Record]) -> dict[str, go.Figure]:
    """Every figure of :data:`FIGURES`, built from the same records."""
    return {name: build(records) for name, build in FIGURES.items()}


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
    return rec.get("eval_acc") is not None or rec.get("eval_lenient_acc") is not None


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


# ---------------------------------------------------------------- live plots


def notebook_frontend() -> bool:
    """True in an IPython kernel driven by a notebook UI that can show widgets.

    JupyterLab, Notebook 7 and VS Code send the cell id in each execute request's metadata;
    papermill / nbclient and the consoles send none, and plain python has no kernel at all.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or not hasattr(kernel, "get_parent"):
        return False
    parent = kernel.get_parent("shell") or {}
    return bool(parent.get("metadata"))


SUBSHELL_WAIT_S = 5.0
"""How long :class:`LivePlots` waits for the frontend to set up the widgets' comm subshell."""
_subshell_wait_failed = False


def await_comm_subshell(timeout: float = SUBSHELL_WAIT_S, settle: float = 0.3) -> bool | None:
    """Wait until the notebook frontend has set up its subshell for widget comms; True once it has.

    Why: JupyterLab 4.4 and later send widget comms over kernel subshells (``commsOverSubshells``
    setting, default one subshell per comm target). The first widget comm of a kernel makes it send
    a ``create_subshell_request`` on the control channel, and ipykernel 7 answers every control
    request with a busy/idle pair of status messages on IOPub. JupyterLab's status bar and
    jupyter_server's ``execution_state`` take any status message as the kernel's, so from that
    ``idle`` on they say "Idle" until the running cell ends (jupyter/jupyter_client#838: control
    requests should not publish execution state). Called in the short cell that first shows
    widgets, this lets the pair go out before the next, long cell starts.

    It reads ipykernel 7's subshell manager (``kernel.shell_channel_thread.manager.list_subshell()``,
    what the ``%subshell`` magic lists). Returns None where the kernel has no subshells (ipykernel < 7,
    or not in a kernel), True when a subshell exists (at once if one already did: an earlier widget),
    False after ``timeout`` seconds without one (a frontend that does not use subshells for comms);
    it waits that long once per kernel.
    """
    global _subshell_wait_failed
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    kernel = getattr(get_ipython(), "kernel", None)
    manager = getattr(getattr(kernel, "shell_channel_thread", None), "manager", None)
    if manager is None or not hasattr(manager, "list_subshell"):
        return None
    if manager.list_subshell():
        return True
    if _subshell_wait_failed:
        return False
    deadline = time.monotonic() + timeout
    while not manager.list_subshell():
        if time.monotonic() > deadline:
            _subshell_wait_failed = True
            return False
        time.sleep(0.05)
    time.sleep(settle)  # the control thread publishes its idle status just after creating the subshell
    return True


def _figure_widget(fig: go.Figure) -> go.Figure | None:
    """``go.FigureWidget(fig)``, or None where it cannot be made (plotly >= 6 needs anywidget)."""
    try:
        return go.FigureWidget(fig)
    except Exception:  # ImportError without anywidget; whatever an odd widget stack raises outside a kernel
        return None


_TRACE_ARRAYS = ("x", "y", "base", "text", "customdata")


def update_in_place(fig: go.Figure, fresh: go.Figure | list[Arrays], build: Callable[[], go.Figure] | None = None) -> None:
    """Copy the data arrays of ``fresh`` (a figure, or its trace arrays from :data:`FIGURE_DATA`) into
    ``fig`` (a ``FigureWidget`` sends one batched message). When the traces differ in number (a new
    span kind appeared) ``fig``'s traces and layout are replaced wholesale from ``fresh`` or, given
    arrays, from ``build()``."""
    arrays = [{k: t[k] for k in _TRACE_ARRAYS if k in t} for t in fresh.data] if isinstance(fresh, go.Figure) else fresh
    same = len(fig.data) == len(arrays) and (
        not isinstance(fresh, go.Figure)
        or all(a.type == b.type and a.name == b.name for a, b in zip(fig.data, fresh.data, strict=True))
    )
    if not same:
        full = fresh if isinstance(fresh, go.Figure) else build()
        fig.data = ()
        fig.add_traces(list(full.data))
        fig.layout = full.layout
        return
    with fig.batch_update():
        for old, new in zip(fig.data, arrays, strict=True):
            for key, val in new.items():
                if old[key] is None and not len(val):
                    continue
                if old[key] is None or len(old[key]) != len(val) or tuple(old[key]) != tuple(val):
                    old[key] = val


LIVE_MAX_POINTS = 800
"""Points per series a live figure draws at most (:func:`thin_records`)."""
LIVE_KEEP_LAST = 200
"""The most recent records a live figure always draws in full."""
REPORT_MAX_POINTS = 3000
"""Points per series the HTML report draws at most: every iteration of a 3,000-iteration run."""
REPORT_KEEP_LAST = 500
"""The most recent records the report always draws in full."""


class LivePlots:
    """A metrics callback that plots a run as it goes.

    Create it in a notebook cell of its own, before the cell that runs the loop, and hand it to the
    loop as its per-iteration metrics callback::

        live = LivePlots()         # the figures appear under this cell
        ...                        # the run calls live(record) after every iteration
        live.show(result.records)  # adds the final evaluation; static figures where none were live

    In JupyterLab it displays ``FigureWidget`` s at construction and updates them in place on each
    record. The first widgets of a kernel make JupyterLab set up a kernel subshell, whose status
    messages would show the kernel as idle for the rest of the cell (:func:`await_comm_subshell`):
    the constructor waits for that, so a cell of its own ends before the long one starts and the
    status bar says Busy for the whole run. Elsewhere (papermill, a console, plain python, or
    without anywidget) it only collects records, and :meth:`show` displays static figures.
    ``live=True`` forces in-place updates of the held figures (``FigureWidget`` where possible, else
    ``go.Figure``) and ``live=False`` turns them off.

    Long runs: the figures draw at most ``max_points`` records, the last ``keep_last`` in full and
    older ones thinned (:func:`thin_records`), and an update recomputes only the trace arrays
    (:data:`FIGURE_DATA`), so its cost stays flat as the history grows (``bench/soak.py`` measures it).
    """

    def __init__(self, records: Iterable[Record] = (), *, live: bool | None = None, names: Sequence[str] | None = None,
                 max_points: int = LIVE_MAX_POINTS, keep_last: int = LIVE_KEEP_LAST):
        thin_indices(0, max_points, keep_last)  # validates the pair
        self.max_points, self.keep_last = max_points, keep_last
        self.records: list[dict[str, Any]] = [dict(r) for r in records]
        self.names = tuple(names or FIGURES)
        unknown = set(self.names) - set(FIGURES)
        if unknown:
            raise ValueError(f"unknown figure names {sorted(unknown)}; choose from {list(FIGURES)}")
        frontend = notebook_frontend()
        self._figs: dict[str, go.Figure] | None = None
        self.widgets = False
        """Whether the held figures are ``FigureWidget`` s shown in a notebook frontend."""
        if not (frontend if live is None else live):
            return
        static = self._build()
        widgets = {name: _figure_widget(fig) for name, fig in static.items()}
        if all(w is not None for w in widgets.values()):
            self._figs = widgets
            if frontend:
                from IPython.display import display

                for w in widgets.values():
                    display(w)
                self.widgets = True
                await_comm_subshell()
            return
        if frontend:
            warnings.warn(
                "live plots need plotly's FigureWidget (install anywidget); showing static figures at the end instead",
                stacklevel=2,
            )
        if live:
            self._figs = static

    @property
    def live(self) -> bool:
        """Whether each record updates the held figures in place."""
        return self._figs is not None

    def _view(self) -> list[Record]:
        return thin_records(self.records, self.max_points, self.keep_last)

    def _build(self) -> dict[str, go.Figure]:
        view = self._view()
        return {name: FIGURES[name](view) for name in self.names}

    @property
    def figures(self) -> dict[str, go.Figure]:
        """The live figures when live; otherwise static figures built from the records so far."""
        return self._figs if self._figs is not None else self._build()

    def __call__(self, record: Record) -> None:
        """Append one metrics record and, when live, refresh every figure in place."""
        self.records.append(dict(record))
        self._refresh()

    def _refresh(self) -> None:
        if self._figs is not None:
            view = self._view()
            for name in self.names:
                update_in_place(self._figs[name], FIGURE_DATA[name](view), lambda name=name: FIGURES[name](view))

    def show(self, records: Iterable[Record] | None = None) -> dict[str, go.Figure]:
        """Display static figures of the whole run, unless live widgets already show it; returns them.

        ``records`` (a run's ``result.records``) first replace the records collected so far, and live
        figures are redrawn with them: the loop attaches its final evaluation to the last record after
        the last callback.
        """
        if records is not None:
            self.records = [dict(r) for r in records]
            self._refresh()
        figs = self.figures
        if not self.widgets:
            try:
                from IPython import get_ipython
            except ImportError:
                return figs
            if get_ipython() is not None:
                from IPython.display import display

                for fig in figs.values():
                    display(go.Figure(fig))
        return figs


# ---------------------------------------------------------------- report


def format_number(v: Any) -> str:
    """How the report writes a value.

    >>> [format_number(v) for v in (0.6875, 2 / 3, 48066.0, 12, 3.2e-5, None)]
    ['0.6875', '0.6667', '48,066', '12', '3.20e-05', 'n/a']
    """
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.2e}" if abs(v) < 1e-3 else f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def final_numbers(records: Sequence[Record]) -> dict[str, Any]:
    """Headline numbers of a run from its metric records (``None`` where the run has no such data).

    Accuracy is strict (the ``#### <n>`` form and the right value); the lenient rows (the right value
    by any rule) appear only for runs whose records carry lenient accuracy.
    """
    evals = _series(records, "eval_acc")[1]
    spans = _spans(records)
    iter_s = _series(records, "iter_s")[1]

    def total(key: str) -> float | None:
        ys = _series(records, key)[1]
        return sum(ys) if ys else None

    def peak(key: str) -> float | None:
        ys = _series(records, key)[1]
        return max(ys) if ys else None

    def lenient(name: str, key: str) -> dict[str, Any]:  # runs from before lenient grading have no such key
        return {name: _last(records, key)} if any(key in r for r in records) else {}

    return {
        "iterations": len(records),
        "adapter version": _last(records, "version"),
        "base accuracy": _last(records, "base_acc"),
        "final eval accuracy": evals[-1] if evals else None,
        **lenient("final eval accuracy (lenient)", "eval_lenient_acc"),
        "best eval accuracy": max(evals) if evals else None,
        "final train accuracy": _last(records, "train_acc"),
        **lenient("final train accuracy (lenient)", "train_lenient_acc"),
        "final reward mean": _last(records, "reward_mean"),
        "final ratio mean": _last(records, "ratio_mean"),
        "final clip fraction": _last(records, "clip_frac"),
        "final KL": _last(records, "kl_mean"),
        "max staleness": peak("staleness_max"),
        "rejected groups": total("rejected_groups"),
        "tokens": total("tokens"),
        "mean iteration (s)": sum(iter_s) / len(iter_s) if iter_s else None,
        "wall time (s)": max(s[3] for s in spans) - min(s[2] for s in spans) if spans else None,
    }


def _table(rows: Mapping[str, Any], cls: str) -> str:
    body = "".join(
        f'<tr data-key="{html.escape(str(k))}"><th>{html.escape(str(k))}</th>'
        f"<td>{html.escape(format_number(v))}</td></tr>"
        for k, v in rows.items()
    )
    return f'<table class="{cls}">{body}</table>' if body else '<p class="none">none recorded</p>'


def _pick_samples(samples: Sequence[Record], n: int) -> list[Record]:
    """Up to ``n`` samples: half from the earliest iteration, half from the latest (before against after)."""
    its = sorted({s.get("iteration") for s in samples if isinstance(s.get("iteration"), int)})
    if len(its) < 2 or n < 2:
        return list(samples[: max(n, 0)])
    first = [s for s in samples if s.get("iteration") == its[0]][: n // 2]
    last = [s for s in samples if s.get("iteration") == its[-1]][-(n - len(first)) :]
    return first + last


def _clip(text: Any, limit: int = 2000) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= limit else s[:limit] + " …"


def _samples_html(samples: Sequence[Record], n: int) -> str:
    picked = _pick_samples(samples, n)
    if not picked:
        return '<p class="none">no samples recorded</p>'
    rows = "".join(
        f"<tr><td>{html.escape(format_number(s.get('iteration')))}</td>"
        f'<td class="num">{html.escape(format_number(s.get("reward")))}</td>'
        f"<td><pre>{html.escape(_clip(s.get('prompt')))}</pre></td>"
        f"<td><pre>{html.escape(_clip(s.get('completion')))}</pre></td>"
        f"<td><pre>{html.escape(_clip(s.get('gold')))}</pre></td></tr>"
        for s in picked
    )
    return (
        '<table class="samples"><thead><tr><th>iteration</th><th>reward</th><th>prompt</th>'
        f"<th>completion</th><th>gold</th></tr></thead><tbody>{rows}</tbody></table>"
    )


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #222; background: #fafafa; }
main { max-width: 1300px; margin: 0 auto; padding: 24px; }
h1 { margin-bottom: 4px; } .meta { color: #666; margin-top: 0; }
section { background: white; border: 1px solid #e4e4e4; border-radius: 6px; padding: 12px 18px; margin: 18px 0; }
table { border-collapse: collapse; font-size: 14px; }
th, td { text-align: left; padding: 4px 12px; border-bottom: 1px solid #eee; vertical-align: top; }
.numbers td, td.num { font-variant-numeric: tabular-nums; }
.columns { display: flex; gap: 48px; flex-wrap: wrap; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; font-size: 13px; }
.samples td:nth-child(4) { min-width: 420px; }
.none { color: #888; }
"""


def write_report(run_dir: str | os.PathLike, path: str | os.PathLike | None = None, *, n_samples: int = 6) -> Path:
    """Write one self-contained HTML report of a run (default ``<run_dir>/report.html``) and return its path.

    It holds every figure of :data:`FIGURES` (div ids ``fig-<name>``, plotly.js inlined once), the final
    numbers (from the metrics and ``summary.json``), a few sampled completions and ``config.json``.
    """
    run = load_run(run_dir)
    out = Path(path) if path is not None else Path(run_dir) / "report.html"
    records = run["records"]
    plots = []
    for i, (name, fig) in enumerate(all_figures(thin_records(records, REPORT_MAX_POINTS, REPORT_KEEP_LAST)).items()):
        div = fig.to_html(
            full_html=False,
            include_plotlyjs=(i == 0),
            div_id=f"fig-{name}",
            default_width="100%",
            default_height=f"{fig.layout.height or 450}px",
            config={"displaylogo": False, "responsive": True},
        )
        doc = html.escape((FIGURES[name].__doc__ or "").strip().split("\n")[0])
        plots.append(f'<section class="plot" id="section-{name}">{div}<p class="meta">{doc}</p></section>')
    title = html.escape(Path(run_dir).resolve().name)
    written = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>GRPO run {title}</title><style>{_CSS}</style></head>
<body><main>
<h1>GRPO run {title}</h1>
<p class="meta">{html.escape(str(run_dir))} · {len(records)} iterations · written {written}</p>
<section id="numbers"><h2>Final numbers</h2><div class="columns">
<div><h3>from the metrics</h3>{_table(final_numbers(records), "numbers")}</div>
<div><h3>summary.json</h3>{_table(run["summary"], "numbers summary")}</div></div></section>
{"".join(plots)}
<section id="samples"><h2>Sampled completions</h2>{_samples_html(run["samples"], n_samples)}</section>
<section id="config"><h2>Configuration</h2><pre>{html.escape(json.dumps(run["config"], indent=2, sort_keys=True))}</pre></section>
</main></body></html>
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a notebook reloading the report never sees half a file
    return out
