"""The figures of grpo_kit.figures, built from synthetic metric records."""

from __future__ import annotations

import json

import plotly.graph_objects as go
import pytest
from synthetic_run import names, synthetic_episode_records, synthetic_records, trace

from grpo_kit import figures, report

# ---------------------------------------------------------------- figures

EXPECTED = {
    "reward": {
        "reward ± std",
        "reward mean",
        "train accuracy",
        "train (lenient)",
        "held-out accuracy",
        "held-out (lenient)",
        "base model",
        "held-out pass@k",
        "held-out maj@k",
    },
    "drift": {"ratio min/max", "ratio mean", "clip low", "clip high", "clip total", "KL", "weight capped",
              "weight min/max", "weight mean", "mismatch KL", "mismatch far",
              "engine/base KL"},
    "staleness": {"staleness max", "staleness mean", "rejected groups"},
    "rewards": {"total (weighted)", "reward errors"},  # plus one trace per component the records name
    "timeline": {"generate", "train", "publish", "eval"},
    "timing": {"iteration", "generate", "train", "generate + train"},
    "usable": {"usable share", "dropped groups", "device-s per usable sample", "rollout workers",
               "money per usable sample"},
}


def test_all_figures_have_stable_keys_and_expected_traces():
    figs = figures.all_figures(synthetic_records())
    assert list(figs) == ["reward", "drift", "staleness", "rewards", "timeline", "timing", "usable"]
    for key, fig in figs.items():
        assert isinstance(fig, go.Figure)
        assert names(fig) == EXPECTED[key] | ({"answer", "short"} if key == "rewards" else set()), key
        assert all(len(t.x) > 0 for t in fig.data), key  # every series has data in a complete run


def test_usable_figure_values():
    recs = figures.usable_figure(synthetic_records(10))
    assert trace(recs, "rollout workers").y == (1, 1, 1, 2, 2, 2, 2, 1, 1, 1)
    assert trace(recs, "rollout workers").line.shape == "hv"
    assert trace(recs, "usable share").y[2] == pytest.approx(0.8)
    assert trace(recs, "money per usable sample").y[0] == pytest.approx(0.2 * 2 / 3600)
    # a run without a price or dynamic sampling: the traces are there, empty where there is no data
    bare = figures.usable_figure([{"iteration": 0, "usable_share": 0.5, "usable_cost": None}])
    assert names(bare) == EXPECTED["usable"] and trace(bare, "money per usable sample").x == ()


def test_reward_figure_values():
    fig = figures.reward_figure(synthetic_records(12))
    ev = trace(fig, "held-out accuracy")
    assert ev.x == (3, 7, 11)  # only the iterations where eval ran
    assert ev.y[-1] == pytest.approx(0.25 + 0.0625 * 11)
    lenient = trace(fig, "held-out (lenient)")
    assert lenient.x == ev.x and lenient.y[-1] == pytest.approx(0.3 + 0.0625 * 11)
    assert lenient.line.color == ev.line.color and lenient.line.dash == "dot" and lenient.opacity < 1
    assert trace(fig, "train (lenient)").y[:2] == (0.2, 0.25) and trace(fig, "train (lenient)").yaxis == "y2"
    base = trace(fig, "base model")
    assert base.x == (0, 11) and base.y == (0.25, 0.25) and base.line.dash == "dash"
    band = trace(fig, "reward ± std")
    assert len(band.x) == 24 and band.fill == "toself"
    # a sampled evaluation's pass@k and maj@k sit with the greedy accuracy, on the accuracy axis
    for name, y0 in (("held-out pass@k", 0.4), ("held-out maj@k", 0.3)):
        t = trace(fig, name)
        assert t.x == ev.x and t.y[-1] == pytest.approx(y0 + 0.05 * 11) and t.yaxis == "y2", name
    greedy_only = [{k: v for k, v in r.items() if k not in ("eval_pass_at_k", "eval_maj_acc")} for r in synthetic_records(8)]
    assert trace(figures.reward_figure(greedy_only), "held-out pass@k").x == ()  # there, empty: out of the legend


def test_components_figure_plots_each_reward_where_it_applied():
    fig = figures.components_figure(synthetic_records(6))
    assert trace(fig, "answer").y == pytest.approx([0.2 + 0.05 * i for i in range(6)])
    assert trace(fig, "short").x == (1, 3, 5)  # None (did not apply) leaves a gap, not a zero
    assert trace(fig, "reward errors").y == (0, 1, 2, 0, 1, 2) and trace(fig, "reward errors").yaxis == "y2"


def test_evaluations_sit_at_the_step_that_made_their_version():
    # the evaluation of v4 (made by iteration 3) finished during iteration 5; one record has no version
    recs = [{"iteration": i} for i in range(7)]
    recs[5].update(eval_acc=0.5, eval_lenient_acc=0.625, eval_version=4)
    recs[6].update(eval_acc=0.75)
    fig = figures.reward_figure(recs)
    assert trace(fig, "held-out accuracy").x == (3, 6) and trace(fig, "held-out (lenient)").x == (3,)


def test_runs_without_lenient_accuracy_draw_and_report_as_before(tmp_path):
    old = [{k: v for k, v in r.items() if "lenient" not in k} for r in synthetic_records(8)]
    fig = figures.reward_figure(old)
    for name in ("train (lenient)", "held-out (lenient)"):  # still there, empty: plotly leaves them out of the legend
        assert trace(fig, name).x == () and trace(fig, name).y == ()
    assert len(trace(fig, "held-out accuracy").x) == 2
    numbers = report.final_numbers(old)
    assert not [k for k in numbers if "lenient" in k]
    assert numbers["final eval accuracy"] == pytest.approx(0.25 + 0.0625 * 7)
    new = report.final_numbers(synthetic_records(8))
    assert new["final eval accuracy (lenient)"] == pytest.approx(0.3 + 0.0625 * 7)
    assert new["final train accuracy (lenient)"] == pytest.approx(0.2 + 0.05 * 7)
    keys = list(new)  # each lenient row right after its strict one
    assert keys.index("final eval accuracy (lenient)") == keys.index("final eval accuracy") + 1
    # a sampled evaluation's pass@k and maj@k (eval_samples = k) come after the greedy rows; none without one
    assert (new["final eval pass@k"], new["final eval maj@k"]) == pytest.approx((0.4 + 0.05 * 7, 0.3 + 0.05 * 7))
    greedy = [{k: v for k, v in r.items() if k not in ("eval_pass_at_k", "eval_maj_acc")} for r in synthetic_records(8)]
    assert not [k for k in report.final_numbers(greedy) if "@k" in k]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert "accuracy (lenient)</th>" not in report.write_report(tmp_path).read_text()


def test_titles_on_top_legends_at_the_bottom():
    """Titles at the top of the figure, legends at the bottom below the x axis: a legend that wraps
    at a narrow width grows away from the title (``test_browser`` measures the drawn boxes)."""
    for name, fig in figures.all_figures(synthetic_records()).items():
        title, legend = fig.layout.title, fig.layout.legend
        assert (title.yref, title.yanchor, title.x, title.xanchor) == ("container", "top", 0, "left"), name
        assert (legend.yref, legend.y, legend.yanchor, legend.orientation) == ("container", 0, "bottom", "h"), name


def test_drift_panels_share_x():
    fig = figures.drift_figure(synthetic_records())
    assert trace(fig, "KL").yaxis == "y3" and trace(fig, "ratio mean").yaxis == "y"
    assert trace(fig, "weight mean").yaxis == "y4" and trace(fig, "weight capped").yaxis == "y2"
    assert fig.layout.xaxis.matches == "x4" or fig.layout.xaxis2.matches == "x4"


def test_drift_shows_the_engine_mismatch_weight_apart_from_the_ratio():
    recs = synthetic_records()
    fig = figures.drift_figure(recs)
    assert list(trace(fig, "weight mean").y) == [r["is_mean"] for r in recs]
    band = trace(fig, "weight min/max")
    assert max(band.y) == recs[-1]["is_max"] and min(band.y) == 0.5
    assert list(trace(fig, "ratio mean").y) == [r["ratio_mean"] for r in recs]  # the policy ratio, unchanged
    # the engine/trainer mismatch beside the KL and the clip fractions
    assert list(trace(fig, "mismatch KL").y) == [r["mismatch_kl"] for r in recs]
    assert list(trace(fig, "mismatch far").y) == [r["mismatch_far_frac"] for r in recs]
    assert trace(fig, "mismatch KL").yaxis == "y3" and trace(fig, "mismatch far").yaxis == "y2"
    # the engine/base KL (the wrong-policy check's) in the KL panel; None (kl_beta == 0) draws nothing
    assert list(trace(fig, "engine/base KL").y) == [r["base_mismatch_kl"] for r in recs]
    assert trace(fig, "engine/base KL").yaxis == "y3"
    no_base = figures.drift_figure([{**r, "base_mismatch_kl": None} for r in recs])
    assert len(trace(no_base, "engine/base KL").x) == 0
    # the default mode (ratio against the engine's log-probs) records no weight: those traces stay empty
    engine_mode = [{**r, "is_mean": None, "is_min": None, "is_max": None, "is_capped_frac": None} for r in recs]
    fig = figures.drift_figure(engine_mode)
    assert all(len(trace(fig, n).x) == 0 for n in ("weight mean", "weight min/max", "weight capped"))
    assert len(trace(fig, "ratio mean").x) == len(recs)


def test_timeline_is_relative_and_shows_the_overlap():
    fig = figures.timeline_figure(synthetic_records(12))
    gen, train = trace(fig, "generate"), trace(fig, "train")
    assert min(gen.base) == 0.0 and gen.orientation == "h" and set(gen.y) == {"generate"}
    assert len(gen.x) == 12 and len(trace(fig, "eval").x) == 3
    assert gen.text[1] == "1"  # each bar labelled by its iteration
    # pipelining: generation of iteration 1 starts before training of iteration 0 ends
    assert gen.base[1] < train.base[0] + train.x[0]
    assert list(fig.layout.yaxis.categoryarray) == ["eval", "publish", "train", "generate"]


@pytest.mark.parametrize(
    "records",
    [
        [],
        [{}],
        [{"iteration": 0, "reward_mean": None, "eval_acc": float("nan"), "spans": "garbage"}],
        [
            {
                "iteration": 0,
                "spans": [
                    {"name": "generate", "start": 5.0},
                    None,
                    {"name": "odd", "iteration": 0, "start": 1.0, "end": 2.0},
                ],
            },
            {"reward_mean": 0.5, "reward_std": None, "base_acc": 0.1, "staleness_max": True},
        ],
    ],
    ids=["empty", "blank", "nulls", "sparse"],
)
def test_figures_survive_missing_and_odd_data(records):
    for key, fig in figures.all_figures(records).items():
        assert EXPECTED[key] <= names(fig), key
        fig.to_json()  # serializable, so it renders
    report.final_numbers(records)


def test_sparse_records_keep_what_is_there():
    recs = [
        {"iteration": 0, "spans": [{"name": "odd", "iteration": 0, "start": 1.0, "end": 2.0}]},
        {"reward_mean": 0.5, "reward_std": None, "base_acc": 0.1},
    ]
    reward = figures.reward_figure(recs)
    assert trace(reward, "reward mean").x == (1,)  # a record without "iteration" sits at its index
    assert trace(reward, "reward ± std").x == ()
    assert trace(reward, "base model").y == (0.1, 0.1)
    assert "odd" in names(figures.timeline_figure(recs))  # an unknown span kind gets its own row


def _plain(v):
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


@pytest.mark.parametrize("episodes", [False, True], ids=["run", "episodes"])
def test_figure_data_matches_the_figures(episodes):
    """FIGURE_DATA (what a live update copies) is what the figure builders draw, trace by trace; the
    same for a multi-turn run's EPISODE_FIGURE_DATA."""
    records = synthetic_episode_records(12) if episodes else synthetic_records(12)
    builders, data = ((figures.EPISODE_FIGURES, figures.EPISODE_FIGURE_DATA) if episodes
                      else (figures.FIGURES, figures.FIGURE_DATA))
    for name, build in builders.items():
        fig, arrays = build(records), data[name](records)
        assert len(fig.data) == len(arrays), name
        for tr, arr in zip(fig.data, arrays, strict=True):
            for key, val in arr.items():
                assert _plain(tr[key] if tr[key] is not None else []) == _plain(val), (name, tr.name, key)


# ---------------------------------------------------------------- multi-turn episodes

EPISODE_EXPECTED = {
    "episodes": {"turns mean", "turns max", "tool calls", "tool errors", "tool rate", "held-out tool rate",
                 "base tool rate"},  # plus one bar trace per tool error kind the records name
    "episode_ends": {"model tokens", "environment tokens", "answered", "max turns", "budget", "error"},
}


def test_episode_figures_only_for_a_multi_turn_run():
    single = figures.all_figures(synthetic_records())
    assert not set(figures.EPISODE_FIGURES) & set(single)
    assert not figures.has_episodes(synthetic_records())
    recs = synthetic_episode_records()
    figs = figures.all_figures(recs)
    assert list(figs) == [*figures.FIGURES, "episodes", "episode_ends"]
    for key in figures.EPISODE_FIGURES:
        extra = {"error: malformed", "error: timeout"} if key == "episodes" else set()
        assert names(figs[key]) == EPISODE_EXPECTED[key] | extra, key
        assert all(len(t.x) > 0 for t in figs[key].data), key
        title, legend = figs[key].layout.title, figs[key].layout.legend
        assert (title.yref, title.yanchor, legend.yref, legend.yanchor) == ("container", "top", "container", "bottom")


def test_episodes_figure_values():
    recs = synthetic_episode_records(12)
    fig = figures.episodes_figure(recs)
    assert list(trace(fig, "turns mean").y) == pytest.approx([1.5 + 0.1 * i for i in range(12)])
    assert list(trace(fig, "turns max").y) == [3 + i % 2 for i in range(12)]
    assert list(trace(fig, "tool calls").y) == pytest.approx([0.6 + 0.1 * i for i in range(12)])
    assert list(trace(fig, "tool errors").y) == pytest.approx([0.25 - 0.01 * i for i in range(12)])
    assert trace(fig, "tool rate").yaxis == "y2" and trace(fig, "tool rate").y[0] == pytest.approx(0.4)
    # held-out tool rate of v4, v8, v12 at the steps that made them; the base model's as a line
    held = trace(fig, "held-out tool rate")
    assert held.x == (3, 7, 11) and held.y == pytest.approx((0.5 + 0.04 * 3, 0.5 + 0.04 * 7, 0.5 + 0.04 * 11))
    base = trace(fig, "base tool rate")
    assert base.x == (0, 11) and base.y == (0.125, 0.125) and base.line.dash == "dash"
    malformed, timeout = trace(fig, "error: malformed"), trace(fig, "error: timeout")
    assert malformed.type == "bar" and malformed.yaxis == "y3" and malformed.y[5] == 15
    assert 5 not in timeout.x and len(timeout.x) == 11  # no timeout that iteration: a gap, not a zero
    assert fig.layout.barmode == "stack"


def test_episode_ends_figure_values():
    recs = synthetic_episode_records(12)
    fig = figures.episode_ends_figure(recs)
    assert list(trace(fig, "environment tokens").y) == [12.0 + 2 * i for i in range(12)]
    assert list(trace(fig, "model tokens").y) == [40.0 + i for i in range(12)]
    ends = [trace(fig, n) for n in ("answered", "max turns", "budget", "error")]
    assert all(t.type == "bar" and t.yaxis == "y2" for t in ends)
    assert [sum(t.y[i] for t in ends) for i in range(12)] == [96] * 12  # every episode ended one way
    assert list(trace(fig, "budget").y) == [r["end_budget"] for r in recs]


@pytest.mark.parametrize(
    "records",
    [
        [],
        [{"episodes": 4}],
        [{"iteration": 0, "episodes": 2, "turns_mean": None, "tool_errors_by_kind": "garbage", "evals": "garbage"}],
        [{"iteration": 0, "episodes": 2, "tool_errors_by_kind": {"raised": None}, "evals": [None, {"version": 0}]},
         {"episodes": 3, "end_error": float("nan"), "evals": [{"version": 2, "tool_rate": 0.5}]}],
    ],
    ids=["empty", "bare", "nulls", "sparse"],
)
def test_episode_figures_survive_missing_and_odd_data(records):
    for key, build in figures.EPISODE_FIGURES.items():
        fig = build(records)
        assert EPISODE_EXPECTED[key] <= names(fig), key
        fig.to_json()
    report.final_numbers(records)


def test_other_eval_sets_get_a_line_each_from_their_results():
    recs = [{"iteration": i} for i in range(5)]
    recs[1]["evals"] = [{"version": 0, "acc": 0.1}, {"version": 0, "acc": 0.9, "set": "gsm8k"},
                        {"version": 2, "acc": 0.5}, {"version": 2, "acc": 0.25, "set": "gsm8k"}]
    recs[1].update(eval_acc=0.5, eval_version=2)
    recs[4]["evals"] = [{"version": 4, "acc": 0.75, "set": "gsm8k"}, {"version": 4, "acc": 0.5, "set": "sums"}]
    fig = figures.reward_figure(recs)
    assert figures.eval_set_names(recs) == ["gsm8k", "sums"]
    gsm = trace(fig, "held-out: gsm8k")
    assert (gsm.x, gsm.y, gsm.yaxis) == ((1, 3), (0.25, 0.75), "y2")  # at the steps that made v2, v4; no base point
    assert trace(fig, "held-out: sums").x == (3,)
    assert trace(fig, "held-out accuracy").y == (0.5,)  # the task's own set only
    assert not [n for n in names(figures.reward_figure(recs[:1])) if n.startswith("held-out: ")]
    recs[4]["evals"][0]["iteration"] = 4  # v4 made by iteration 4 (an earlier one trained nothing)
    assert trace(figures.reward_figure(recs), "held-out: gsm8k").x == (1, 4)
