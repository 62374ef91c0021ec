"""Plotly figures from a run's metric records.

Every figure is a pure function of the metric records (the dicts the loop appends to ``metrics.jsonl``,
one per iteration; :mod:`grpo_kit.records`). Any key may be missing or ``None`` in an early or partial
run: a series is drawn from the records that have it, and a figure always carries the same traces,
empty where there is no data, so that a live widget (:mod:`grpo_kit.widgets`) can update a figure in
place by copying the arrays of a freshly built one into it (:data:`FIGURE_DATA`). Trace names are part
of the contract (the tests look them up).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from .series import Record, all_spans, eval_series, iteration_of, last_number, made_at, number, series

SPAN_KINDS = ("generate", "train", "publish", "eval")
"""Span names the loop records, top to bottom in the timeline."""

_C = qualitative.Plotly
COLORS = {
    "reward": _C[0],
    "train_acc": _C[2],
    "eval_acc": _C[1],
    "eval_pass_at_k": _C[7],
    "eval_maj_acc": _C[8],
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
    "turns": _C[0],
    "tool_calls": _C[2],
    "tool_errors": _C[1],
    "tool_rate": _C[5],
    "eval_tool_rate": _C[3],
    "model_tokens": _C[0],
    "env_tokens": _C[9],
    "answered": _C[2],
    "max_turns": _C[4],
    "budget": _C[1],
    "error": "#444444",
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


def _sum(rec: Record, a: str, b: str) -> float | None:
    va, vb = number(rec.get(a)), number(rec.get(b))
    return None if va is None or vb is None else va + vb


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


Arrays = dict[str, list]
"""The data arrays of one trace (``x``, ``y`` and for bars ``base``, ``text``, ``customdata``); a trace
whose presence depends on the records (a reward component, an eval set, a tool-error kind) also
carries its ``name``, so that a live update can tell a renamed trace from an updated one."""


def _xy(xy: tuple[list, list]) -> Arrays:
    return {"x": xy[0], "y": xy[1]}


def _named(arr: Arrays, name: str) -> Arrays:
    return {**arr, "name": name}


def _line(arr: Arrays, name, color, dash=None, mode="lines+markers", **kw) -> go.Scatter:
    return go.Scatter(**{**arr, "name": name}, mode=mode, line=dict(color=color, dash=dash), marker=dict(size=5), **kw)


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


def _band_data(records, lo: Callable[[Record], Any], hi: Callable[[Record], Any]) -> Arrays:
    """A filled band's outline: along the upper edge and back along the lower one."""
    pts = [(iteration_of(r, i), number(lo(r)), number(hi(r))) for i, r in enumerate(records)]
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
        m, s = number(r.get("reward_mean")), number(r.get("reward_std"))
        return None if m is None or s is None else m + sign * s

    return edge


def reward_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`reward_figure`."""
    # The base model's accuracy is one number: a dashed line across the iterations run so far.
    base = number(last_number(records, "base_acc"))
    xs = [iteration_of(r, i) for i, r in enumerate(records)] if base is not None else []
    bx = [min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1] if xs else []
    return [
        _band_data(records, _std_edge(-1), _std_edge(+1)),
        _xy(series(records, "reward_mean")),
        _xy(series(records, "train_acc")),
        _xy(series(records, "train_lenient_acc")),
        _xy(eval_series(records, "eval_acc")),
        _xy(eval_series(records, "eval_lenient_acc")),
        {"x": bx, "y": [base] * len(bx)},
        _xy(eval_series(records, "eval_pass_at_k")),
        _xy(eval_series(records, "eval_maj_acc")),
        *(_named(_eval_points(records, "acc", name), f"held-out: {name}") for name in eval_set_names(records)),
    ]


def reward_figure(records: Sequence[Record]) -> go.Figure:
    """Reward mean with a ±std band (left axis); train, held-out and base-model accuracy (right axis).

    Accuracy is strict (the ``#### <n>`` form and the right value), with lenient accuracy (the right
    value by any rule) beside it, lighter and dotted, where the records have it. A run with
    ``eval_samples`` = k adds held-out pass@k (at that k) and maj@k (:mod:`grpo_kit.passk`), and each
    of ``DataConfig.eval_sets`` its greedy accuracy (``held-out: <name>``).
    """
    band, mean, train, train_len, ev, ev_len, base, pass_k, maj, *sets = reward_data(records)
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
    # runs without a sampled evaluation leave these two empty, out of the legend
    fig.add_trace(_line(pass_k, "held-out pass@k", COLORS["eval_pass_at_k"], dash="dash"), secondary_y=True)
    fig.add_trace(_line(maj, "held-out maj@k", COLORS["eval_maj_acc"], dash="dashdot"), secondary_y=True)
    for k, arr in enumerate(sets):
        fig.add_trace(_line(arr, arr["name"], _C[(5 + k) % len(_C)], dash="dot"), secondary_y=True)
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
        *(_xy(series(records, k)) for k in ("ratio_mean", "clip_frac_low", "clip_frac_high", "clip_frac",
                                              "is_capped_frac", "kl_mean")),
        _band_data(records, lambda r: r.get("is_min"), lambda r: r.get("is_max")),
        _xy(series(records, "is_mean")),
        *(_xy(series(records, k)) for k in ("mismatch_kl", "mismatch_far_frac", "base_mismatch_kl")),
    ]


def drift_figure(records: Sequence[Record]) -> go.Figure:
    """Off-policy drift: the policy's importance ratio (mean, min/max band), clip fractions, KL to the
    base model and, with ``old_logp_source="trainer"``, the engine-mismatch weight π_old/π_engine
    (mean, min/max band before the cap) and the share of tokens whose weight was capped; the
    engine/trainer mismatch KL(engine || trainer) beside the KL, and the share of tokens whose engine
    and trainer log-probs are more than log 2 apart beside the clip fractions; the engine/base KL
    (``kl_beta > 0``) beside the mismatch KL: a wrong-policy batch has it far below the mismatch KL."""
    ratio_band, ratio, clip_low, clip_high, clip, capped, kl, is_band, is_mean, mkl, far, bkl = drift_data(records)
    fig = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=("importance ratio π/π_old", "clip fraction, weight capped, far tokens",
                        "KL to base, engine/trainer mismatch KL, engine/base KL",
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
    fig.add_trace(_line(mkl, "mismatch KL", COLORS["is_weight"], dash="dot"), row=3, col=1)
    fig.add_trace(_line(far, "mismatch far", COLORS["is_weight"], dash="dot"), row=2, col=1)
    fig.add_trace(_line(bkl, "engine/base KL", COLORS["kl"], dash="dot"), row=3, col=1)
    _style(fig, "Off-policy drift", 860)
    fig.update_xaxes(title_text="iteration", row=4, col=1)
    return fig


def staleness_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`staleness_figure`."""
    return [_xy(series(records, k)) for k in ("rejected_groups", "staleness_max", "staleness_mean")]


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
    comps = [_named(_xy(series(records, lambda r, n=name: (r.get("reward_components") or {}).get(n))), name)
             for name in _component_names(records)]
    return [_xy(series(records, "reward_errors")), _xy(series(records, "reward_mean")), *comps]


def components_figure(records: Sequence[Record]) -> go.Figure:
    """Each reward component's batch mean (the task's reward functions, unweighted) beside the
    weighted total, and the completions a reward function failed on (raised, timed out, or returned
    something that is not a score) as bars on the right axis."""
    errors, total, *comps = components_data(records)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(**errors, name="reward errors", marker_color=COLORS["rejected"], opacity=0.6), secondary_y=True)
    fig.add_trace(_line(total, "total (weighted)", COLORS["reward"]), secondary_y=False)
    for k, arr in enumerate(comps):
        fig.add_trace(_line(arr, arr["name"], _C[(k + 2) % len(_C)], dash="dot"), secondary_y=False)
    _style(fig, "Reward components", 380)
    fig.update_xaxes(title_text="iteration")
    fig.update_yaxes(title_text="batch mean", secondary_y=False)
    fig.update_yaxes(title_text="reward-function failures", rangemode="tozero", secondary_y=True, showgrid=False)
    return fig


TIMELINE_ITERATIONS = 100
"""The timeline shows the spans of the last this many records: over a long run thousands of bars
would be unreadable (and weigh megabytes in the report)."""


def _timeline_kinds(spans) -> list[str]:
    return list(SPAN_KINDS) + sorted({s[0] for s in spans} - set(SPAN_KINDS))


def timeline_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`timeline_figure`: one bar trace per span kind."""
    spans = all_spans(records[-TIMELINE_ITERATIONS:])
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
    kinds = _timeline_kinds(all_spans(records[-TIMELINE_ITERATIONS:]))
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
        *(_xy(series(records, k)) for k in ("iter_s", "gen_s", "train_s")),
        _xy(series(records, lambda r: _sum(r, "gen_s", "train_s"))),
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
    return [_xy(series(records, k)) for k in keys]


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


# ---------------------------------------------------------------- multi-turn episodes

END_REASON_KEYS = ("end_answered", "end_max_turns", "end_budget", "end_error")
"""The records' end-reason counts, bottom to top in the stacked bars."""


def has_episodes(records: Sequence[Record]) -> bool:
    """Whether the records are a multi-turn run's: some batch held episodes (:data:`EPISODE_FIGURES`)."""
    return any((number(r.get("episodes")) or 0) > 0 for r in records)


def _errors_by_kind(r: Record) -> Mapping[str, Any]:
    by_kind = r.get("tool_errors_by_kind")
    return by_kind if isinstance(by_kind, Mapping) else {}


def _error_kinds(records: Sequence[Record]) -> list[str]:
    kinds: list[str] = []
    for r in records:
        for kind in _errors_by_kind(r):
            if kind not in kinds:
                kinds.append(kind)
    return kinds


def _evals_of(records: Sequence[Record]) -> list[Mapping[str, Any]]:
    """Every evaluation result the records carry (``MetricsRecord.evals``), duplicates dropped."""
    out: list[Mapping[str, Any]] = []
    for r in records:
        evs = r.get("evals")
        for ev in evs if isinstance(evs, list) else ():
            if isinstance(ev, Mapping) and ev not in out:
                out.append(ev)
    return out


def _eval_points(records: Sequence[Record], key: str, eval_set: str | None = None) -> Arrays:
    """A held-out measure of each adapter version, at the step that made it (as :func:`eval_series`),
    on the task's own held-out set or on the ``eval_set`` of that name."""
    pts = sorted({(made_at(ev), ev["version"], y) for ev in _evals_of(records)
                  if isinstance(ev.get("version"), int) and ev["version"] > 0 and ev.get("set") == eval_set
                  and (y := number(ev.get(key))) is not None})
    return {"x": [p[0] for p in pts], "y": [p[2] for p in pts]}


def eval_set_names(records: Sequence[Record]) -> list[str]:
    """Names of the other held-out sets (``DataConfig.eval_sets``) the records' evaluations measured, first seen first."""
    return list(dict.fromkeys(ev["set"] for ev in _evals_of(records) if isinstance(ev.get("set"), str)))


def _base_line(records: Sequence[Record], key: str) -> Arrays:
    """The base model's held-out ``key`` (its evaluation, version 0) as a line across the iterations."""
    base = next((y for ev in _evals_of(records) if ev.get("version") == 0 and ev.get("set") is None
                 and (y := number(ev.get(key))) is not None),
                None)
    xs = [iteration_of(r, i) for i, r in enumerate(records)] if base is not None else []
    bx = [min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1] if xs else []
    return {"x": bx, "y": [base] * len(bx)}


def episodes_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`episodes_figure`."""
    kinds = [_named(_xy(series(records, lambda r, k=kind: _errors_by_kind(r).get(k))), f"error: {kind}")
             for kind in _error_kinds(records)]
    return [
        *(_xy(series(records, k)) for k in ("turns_mean", "turns_max", "tool_calls_mean", "tool_errors_mean")),
        _xy(series(records, "tool_rate")),
        _eval_points(records, "tool_rate"),
        _base_line(records, "tool_rate"),
        *kinds,
    ]


def episodes_figure(records: Sequence[Record]) -> go.Figure:
    """Multi-turn episodes: model turns, tool calls and failed calls per episode; who called a tool; failures by kind.

    Turns per episode as mean and max; the share of episodes that called a tool in the batch, in the
    held-out greedy episodes of each version (at the step that made it) and the base model's; failed
    calls by kind (:data:`grpo_kit.tools.ERROR_KINDS`), stacked."""
    turns, turns_max, calls, errors, rate, ev_rate, base_rate, *kinds = episodes_data(records)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=("per episode", "episodes that called a tool", "failed tool calls by kind"))
    fig.add_trace(_line(turns, "turns mean", COLORS["turns"]), row=1, col=1)
    fig.add_trace(_line(turns_max, "turns max", COLORS["turns"], dash="dot"), row=1, col=1)
    fig.add_trace(_line(calls, "tool calls", COLORS["tool_calls"]), row=1, col=1)
    fig.add_trace(_line(errors, "tool errors", COLORS["tool_errors"]), row=1, col=1)
    fig.add_trace(_line(rate, "tool rate", COLORS["tool_rate"]), row=2, col=1)
    fig.add_trace(_line(ev_rate, "held-out tool rate", COLORS["eval_tool_rate"]), row=2, col=1)
    fig.add_trace(go.Scatter(**base_rate, name="base tool rate", mode="lines",
                             line=dict(color=COLORS["base"], dash="dash")), row=2, col=1)
    for k, arr in enumerate(kinds):
        fig.add_trace(go.Bar(**arr, marker_color=_C[(k + 6) % len(_C)]), row=3, col=1)
    _style(fig, "Episodes: turns and tool calls", 760, barmode="stack")
    fig.update_xaxes(title_text="iteration", row=3, col=1)
    fig.update_yaxes(title_text="count", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="share", range=[-0.02, 1.02], tickformat=".0%", row=2, col=1)
    fig.update_yaxes(title_text="failed calls", rangemode="tozero", row=3, col=1)
    return fig


def episode_ends_data(records: Sequence[Record]) -> list[Arrays]:
    """Trace arrays of :func:`episode_ends_figure`."""
    keys = ("model_tokens_mean", "env_tokens_mean", "end_answered", "end_max_turns", "end_budget", "end_error")
    return [_xy(series(records, k)) for k in keys]


def episode_ends_figure(records: Sequence[Record]) -> go.Figure:
    """Multi-turn episodes: tokens the policy sampled against the environment's, and how the episodes ended.

    Tokens per episode: the model's (trained on) and the environment's and chat template's between
    the turns (not trained on); endings: answered, out of turns, out of tokens, or an environment error."""
    model, env, *ends = episode_ends_data(records)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=("tokens per episode", "how the episodes ended"))
    fig.add_trace(_line(model, "model tokens", COLORS["model_tokens"]), row=1, col=1)
    fig.add_trace(_line(env, "environment tokens", COLORS["env_tokens"]), row=1, col=1)
    for key, arr in zip(END_REASON_KEYS, ends, strict=True):
        reason = key.removeprefix("end_")
        fig.add_trace(go.Bar(**arr, name=reason.replace("_", " "), marker_color=COLORS[reason]), row=2, col=1)
    _style(fig, "Episodes: tokens and endings", 560, barmode="stack")
    fig.update_xaxes(title_text="iteration", row=2, col=1)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="episodes", rangemode="tozero", row=2, col=1)
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

EPISODE_FIGURES: dict[str, Callable[[Sequence[Record]], go.Figure]] = {
    "episodes": episodes_figure,
    "episode_ends": episode_ends_figure,
}
"""The figures of a multi-turn run (:func:`has_episodes`), drawn after :data:`FIGURES`."""

EPISODE_FIGURE_DATA: dict[str, Callable[[Sequence[Record]], list[Arrays]]] = {
    "episodes": episodes_data,
    "episode_ends": episode_ends_data,
}
"""The trace arrays of each figure of :data:`EPISODE_FIGURES`."""


def figure_builders(records: Sequence[Record]) -> dict[str, Callable[[Sequence[Record]], go.Figure]]:
    """The figures these records get: :data:`FIGURES`, and :data:`EPISODE_FIGURES` for a multi-turn run."""
    return {**FIGURES, **(EPISODE_FIGURES if has_episodes(records) else {})}


def all_figures(records: Sequence[Record]) -> dict[str, go.Figure]:
    """Every figure of :func:`figure_builders`, built from the same records."""
    return {name: build(records) for name, build in figure_builders(records).items()}
