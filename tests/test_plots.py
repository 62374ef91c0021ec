"""Figures, live updates and the HTML report of grpo_kit.plots, on a synthetic run directory.

The report is also opened in a real headless Chromium (Debian's ``chromium``): plotly must draw every
figure without a JavaScript error, and a screenshot goes to ``runs/report.png`` for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import pytest

from grpo_kit import plots

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NASTY = "<script>alert('x')</script> & 2 < 3"


def synthetic_records(n: int = 12, *, eval_every: int = 4, t0: float = 1_700_000_000.0) -> list[dict]:
    """Metric records of a pipelined run: generate(i + 1) overlaps train(i), eval every few iterations."""
    records = []
    for i in range(n):
        g0 = t0 + 10.0 * i
        spans = [
            {"name": "generate", "iteration": i, "start": g0, "end": g0 + 9.0},
            {"name": "train", "iteration": i, "start": g0 + 9.0, "end": g0 + 16.0},
            {"name": "publish", "iteration": i, "start": g0 + 16.0, "end": g0 + 16.5},
        ]
        evaluated = (i + 1) % eval_every == 0
        if evaluated:
            spans.append({"name": "eval", "iteration": i, "start": g0 + 16.5, "end": g0 + 19.0})
        records.append(
            {
                "iteration": i,
                "version": i + 1,
                "reward_mean": 0.2 + 0.05 * i,
                "reward_std": 0.3 - 0.01 * i,
                "reward_components": {"answer": 0.2 + 0.05 * i, "short": 1.0 if i % 2 else None},
                "reward_errors": i % 3,
                "train_acc": 0.15 + 0.05 * i,
                "train_lenient_acc": 0.2 + 0.05 * i,
                "eval_acc": 0.25 + 0.0625 * i if evaluated else None,
                "eval_lenient_acc": 0.3 + 0.0625 * i if evaluated else None,
                "base_acc": 0.25,
                "loss": -0.01 * i,
                "ratio_mean": 1.0 + 0.001 * i,
                "ratio_std": 0.02,
                "ratio_min": 0.8 - 0.01 * i,
                "ratio_max": 1.2 + 0.01 * i,
                "is_mean": 1.0 - 0.001 * i,  # old_logp_source="trainer": the engine-mismatch weight
                "is_min": 0.5,
                "is_max": 3.5 + 0.1 * i,
                "is_capped_frac": 0.001 * i,
                "clip_frac_low": 0.01,
                "clip_frac_high": 0.02 + 0.001 * i,
                "clip_frac": 0.03 + 0.001 * i,
                "kl_mean": 1e-4 * i,
                "grad_norm": 0.5,
                "tokens": 4000 + i,
                "samples_nonzero_adv": 60,
                "staleness_max": min(i, 1),
                "staleness_mean": 0.5 if i else 0.0,
                "rejected_groups": i % 3,
                "kept_groups": 16 - i % 3,
                "usable_samples": 90,
                "usable_per_s": 9.5,
                "usable_share": 0.9 - 0.05 * i,
                "usable_cost_s": 0.2 + 0.01 * i,
                "usable_cost": (0.2 + 0.01 * i) * 2.0 / 3600,
                "dropped_groups": i % 4,
                "rollout_workers": 1 + (3 <= i < 7),
                "truncated": 2,
                "iter_s": 10.0,
                "gen_s": 9.0,
                "train_s": 7.0,
                "spans": spans,
            }
        )
    return records


def make_run(run_dir: Path, n: int = 12, *, partial_last_line: bool = True) -> list[dict]:
    """A run directory as the loop writes it, caught mid-write: the last metrics line is half there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = synthetic_records(n)
    lines = [json.dumps(r) for r in records]
    if partial_last_line:
        lines.append(json.dumps(synthetic_records(n + 1)[-1])[:57])
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))
    (run_dir / "config.json").write_text(
        json.dumps(
            {
                "model": {"model": "tiny", "dtype": "float32"},
                "sampling": {"group_size": 6, "prompts_per_step": 16},
                "loss": {"loss_type": "dapo", "clip_eps_high": 0.28},
            }
        )
    )
    (run_dir / "summary.json").write_text(
        json.dumps(
            {"acc_before": 0.25, "acc_after": 0.9375, "grpo_wall_s": 1234.5, "iterations": n, "kl_final": 0.0011}
        )
    )
    samples = [
        {
            "iteration": it,
            "prompt": f"What is {k} + {it}?",
            "completion": f"The answer is {k + it}",
            "reward": 1.0 if k % 2 else 0.0,
            "gold": str(k + it),
        }
        for it in (0, n - 1)
        for k in range(4)
    ]
    samples[-1]["completion"] = NASTY
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return records


def names(fig: go.Figure) -> set[str]:
    return {t.name for t in fig.data}


def trace(fig: go.Figure, name: str):
    return next(t for t in fig.data if t.name == name)


# ---------------------------------------------------------------- loading


def test_load_run_drops_a_half_written_last_line(tmp_path):
    records = make_run(tmp_path)
    run = plots.load_run(tmp_path)
    assert run["records"] == records
    assert run["config"]["loss"]["loss_type"] == "dapo"
    assert run["summary"]["acc_after"] == 0.9375
    assert len(run["samples"]) == 8


def test_load_run_missing_files_and_a_bad_middle_line(tmp_path):
    assert plots.load_run(tmp_path / "nothing-yet") == {"records": [], "config": {}, "summary": {}, "samples": []}
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1, "rew\n{"iteration": 2}\n')
    (tmp_path / "summary.json").write_text('{"acc_aft')  # written while we read it
    with pytest.warns(UserWarning, match="line 2"):
        run = plots.load_run(tmp_path)
    assert [r["iteration"] for r in run["records"]] == [0, 2]
    assert run["summary"] == {}


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
    },
    "drift": {"ratio min/max", "ratio mean", "clip low", "clip high", "clip total", "KL", "weight capped",
              "weight min/max", "weight mean"},
    "staleness": {"staleness max", "staleness mean", "rejected groups"},
    "rewards": {"total (weighted)", "reward errors"},  # plus one trace per component the records name
    "timeline": {"generate", "train", "publish", "eval"},
    "timing": {"iteration", "generate", "train", "generate + train"},
    "usable": {"usable share", "dropped groups", "device-s per usable sample", "rollout workers",
               "money per usable sample"},
}


def test_all_figures_have_stable_keys_and_expected_traces():
    figs = plots.all_figures(synthetic_records())
    assert list(figs) == ["reward", "drift", "staleness", "rewards", "timeline", "timing", "usable"]
    for key, fig in figs.items():
        assert isinstance(fig, go.Figure)
        assert names(fig) == EXPECTED[key] | ({"answer", "short"} if key == "rewards" else set()), key
        assert all(len(t.x) > 0 for t in fig.data), key  # every series has data in a complete run


def test_usable_figure_values():
    recs = plots.usable_figure(synthetic_records(10))
    assert trace(recs, "rollout workers").y == (1, 1, 1, 2, 2, 2, 2, 1, 1, 1)
    assert trace(recs, "rollout workers").line.shape == "hv"
    assert trace(recs, "usable share").y[2] == pytest.approx(0.8)
    assert trace(recs, "money per usable sample").y[0] == pytest.approx(0.2 * 2 / 3600)
    # a run without a price or dynamic sampling: the traces are there, empty where there is no data
    bare = plots.usable_figure([{"iteration": 0, "usable_share": 0.5, "usable_cost": None}])
    assert names(bare) == EXPECTED["usable"] and trace(bare, "money per usable sample").x == ()


def test_reward_figure_values():
    fig = plots.reward_figure(synthetic_records(12))
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


def test_components_figure_plots_each_reward_where_it_applied():
    fig = plots.components_figure(synthetic_records(6))
    assert trace(fig, "answer").y == pytest.approx([0.2 + 0.05 * i for i in range(6)])
    assert trace(fig, "short").x == (1, 3, 5)  # None (did not apply) leaves a gap, not a zero
    assert trace(fig, "reward errors").y == (0, 1, 2, 0, 1, 2) and trace(fig, "reward errors").yaxis == "y2"


def test_evaluations_sit_at_the_step_that_made_their_version():
    # the evaluation of v4 (made by iteration 3) finished during iteration 5; one record has no version
    recs = [{"iteration": i} for i in range(7)]
    recs[5].update(eval_acc=0.5, eval_lenient_acc=0.625, eval_version=4)
    recs[6].update(eval_acc=0.75)
    fig = plots.reward_figure(recs)
    assert trace(fig, "held-out accuracy").x == (3, 6) and trace(fig, "held-out (lenient)").x == (3,)


def test_runs_without_lenient_accuracy_draw_and_report_as_before(tmp_path):
    old = [{k: v for k, v in r.items() if "lenient" not in k} for r in synthetic_records(8)]
    fig = plots.reward_figure(old)
    for name in ("train (lenient)", "held-out (lenient)"):  # still there, empty: plotly leaves them out of the legend
        assert trace(fig, name).x == () and trace(fig, name).y == ()
    assert len(trace(fig, "held-out accuracy").x) == 2
    numbers = plots.final_numbers(old)
    assert not [k for k in numbers if "lenient" in k]
    assert numbers["final eval accuracy"] == pytest.approx(0.25 + 0.0625 * 7)
    new = plots.final_numbers(synthetic_records(8))
    assert new["final eval accuracy (lenient)"] == pytest.approx(0.3 + 0.0625 * 7)
    assert new["final train accuracy (lenient)"] == pytest.approx(0.2 + 0.05 * 7)
    keys = list(new)  # each lenient row right after its strict one
    assert keys.index("final eval accuracy (lenient)") == keys.index("final eval accuracy") + 1
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert "accuracy (lenient)</th>" not in plots.write_report(tmp_path).read_text()


def test_titles_on_top_legends_at_the_bottom():
    """Titles at the top of the figure, legends at the bottom below the x axis: a legend that wraps
    at a narrow width grows away from the title (``test_browser`` measures the drawn boxes)."""
    for name, fig in plots.all_figures(synthetic_records()).items():
        title, legend = fig.layout.title, fig.layout.legend
        assert (title.yref, title.yanchor, title.x, title.xanchor) == ("container", "top", 0, "left"), name
        assert (legend.yref, legend.y, legend.yanchor, legend.orientation) == ("container", 0, "bottom", "h"), name


def test_drift_panels_share_x():
    fig = plots.drift_figure(synthetic_records())
    assert trace(fig, "KL").yaxis == "y3" and trace(fig, "ratio mean").yaxis == "y"
    assert trace(fig, "weight mean").yaxis == "y4" and trace(fig, "weight capped").yaxis == "y2"
    assert fig.layout.xaxis.matches == "x4" or fig.layout.xaxis2.matches == "x4"


def test_drift_shows_the_engine_mismatch_weight_apart_from_the_ratio():
    recs = synthetic_records()
    fig = plots.drift_figure(recs)
    assert list(trace(fig, "weight mean").y) == [r["is_mean"] for r in recs]
    band = trace(fig, "weight min/max")
    assert max(band.y) == recs[-1]["is_max"] and min(band.y) == 0.5
    assert list(trace(fig, "ratio mean").y) == [r["ratio_mean"] for r in recs]  # the policy ratio, unchanged
    # the default mode (ratio against the engine's log-probs) records no weight: those traces stay empty
    engine_mode = [{**r, "is_mean": None, "is_min": None, "is_max": None, "is_capped_frac": None} for r in recs]
    fig = plots.drift_figure(engine_mode)
    assert all(len(trace(fig, n).x) == 0 for n in ("weight mean", "weight min/max", "weight capped"))
    assert len(trace(fig, "ratio mean").x) == len(recs)


def test_timeline_is_relative_and_shows_the_overlap():
    fig = plots.timeline_figure(synthetic_records(12))
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
    for key, fig in plots.all_figures(records).items():
        assert EXPECTED[key] <= names(fig), key
        fig.to_json()  # serializable, so it renders
    plots.final_numbers(records)


def test_sparse_records_keep_what_is_there():
    recs = [
        {"iteration": 0, "spans": [{"name": "odd", "iteration": 0, "start": 1.0, "end": 2.0}]},
        {"reward_mean": 0.5, "reward_std": None, "base_acc": 0.1},
    ]
    reward = plots.reward_figure(recs)
    assert trace(reward, "reward mean").x == (1,)  # a record without "iteration" sits at its index
    assert trace(reward, "reward ± std").x == ()
    assert trace(reward, "base model").y == (0.1, 0.1)
    assert "odd" in names(plots.timeline_figure(recs))  # an unknown span kind gets its own row


# ---------------------------------------------------------------- live plots


def test_live_plots_only_collect_in_plain_python(capsys):
    live = plots.LivePlots()
    assert not live.live and not live.widgets
    for r in synthetic_records(3):
        live(r)
    assert len(live.records) == 3
    figs = live.show()
    assert list(figs) == list(plots.FIGURES) and len(trace(figs["reward"], "reward mean").x) == 3
    assert capsys.readouterr().out == ""  # nothing printed, no browser opened


def test_live_plots_update_figures_in_place():
    records = synthetic_records(6)
    live = plots.LivePlots(records[:2], live=True)
    assert live.live and not live.widgets  # no frontend in plain python: nothing displayed
    figs = dict(live.figures)
    try:
        import anywidget  # noqa: F401
    except ImportError:
        pass
    else:
        assert all(isinstance(f, go.FigureWidget) for f in figs.values())
    reward_y = trace(figs["reward"], "reward mean").y
    gen_x = trace(figs["timeline"], "generate").x
    for r in records[2:]:
        live(r)
    assert all(live.figures[k] is figs[k] for k in figs)  # the same objects, updated
    assert len(reward_y) == 2 and trace(figs["reward"], "reward mean").y[-1] == pytest.approx(0.2 + 0.05 * 5)
    assert len(gen_x) == 2 and len(trace(figs["timeline"], "generate").x) == 6
    assert trace(figs["reward"], "held-out accuracy").x == (3,)
    # a new span kind changes the trace list: replaced wholesale, still the same figure object
    live({"iteration": 6, "spans": [{"name": "odd", "iteration": 6, "start": 1_700_000_100.0, "end": 1_700_000_101.0}]})
    assert "odd" in names(live.figures["timeline"]) and live.figures["timeline"] is figs["timeline"]


def test_show_takes_the_final_records():
    # the loop attaches the final evaluation to the last record after the last callback
    records = synthetic_records(5)
    live = plots.LivePlots(records[:-1], live=True)
    fig = live.figures["reward"]
    final = [dict(r) for r in records]
    final[-1].update(eval_acc=0.875, eval_version=5)
    assert live.show(final)["reward"] is fig  # redrawn in place
    assert trace(fig, "held-out accuracy").x == (3, 4) and trace(fig, "held-out accuracy").y[-1] == 0.875
    assert plots.LivePlots().show(final)["reward"].data  # not live: static figures of those records


def test_live_plots_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown figure"):
        plots.LivePlots(names=["reward", "nope"])


def test_figure_widget_construction_never_raises_in_plain_python():
    code = (
        "from grpo_kit.plots import LivePlots\n"
        "live = LivePlots(live=True)\nlive({'iteration': 0, 'reward_mean': 1.0})\n"
        "print(type(live.figures['reward']).__name__, live.live)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() in (["FigureWidget", "True"], ["Figure", "True"])


def _execute(kc, code: str, metadata: dict) -> str:
    """Run code in a kernel with the given execute-request metadata; return its stdout."""
    msg = kc.session.msg(
        "execute_request",
        {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        metadata=metadata,
    )
    kc.shell_channel.send(msg)
    out = []
    while True:
        reply = kc.get_iopub_msg(timeout=60)
        if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        if reply["msg_type"] == "stream":
            out.append(reply["content"]["text"])
        elif reply["msg_type"] == "error":
            raise AssertionError("\n".join(reply["content"]["traceback"]))
        elif reply["msg_type"] == "status" and reply["content"]["execution_state"] == "idle":
            return "".join(out)


def test_notebook_frontend_is_told_from_papermill_in_a_real_kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), startup_timeout=120)
    try:
        code = "from grpo_kit.plots import notebook_frontend; print(notebook_frontend())"
        assert _execute(kc, code, {}).strip() == "False"  # what nbclient / papermill send
        assert _execute(kc, code, {"cellId": "abc", "recordTiming": False}).strip() == "True"  # JupyterLab
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_await_comm_subshell_in_a_real_kernel():
    """The wait reads ipykernel's subshells: none without a kernel, a bounded wait (once) while no
    frontend creates one, at once when one exists (JupyterLab creates it for the first widget)."""
    from jupyter_client.manager import start_new_kernel

    assert plots.await_comm_subshell() is None  # plain python: no kernel
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), startup_timeout=120)
    try:
        code = (
            "import time\nfrom grpo_kit.plots import await_comm_subshell as wait\n"
            "t = time.monotonic(); a = wait(timeout=0.5); b = wait(timeout=5); print(a, b, round(time.monotonic() - t))"
        )
        assert _execute(kc, code, {}).split() == ["False", "False", "1"]  # waited once, for 0.5 s
        if "kernel subshells" not in kc.kernel_info(reply=True)["content"].get("supported_features", []):
            pytest.skip("this ipykernel has no subshells")
        request = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(request)  # what JupyterLab sends when a kernel's first widget comm opens
        assert kc.control_channel.get_msg(timeout=30)["content"]["subshell_id"]
        code = "from grpo_kit.plots import await_comm_subshell as wait\nprint(wait(timeout=0.0))"
        assert _execute(kc, code, {}).strip() == "True"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_live_plots_under_papermill_show_static_figures(tmp_path):
    import nbformat
    import papermill

    (tmp_path / "records.json").write_text(json.dumps(synthetic_records(5)))
    nb = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"}}
    )
    nb.cells = [
        nbformat.v4.new_code_cell(
            "records_path: str = ''  # metric records to replay", metadata={"tags": ["parameters"]}
        ),
        nbformat.v4.new_code_cell("import json\nfrom grpo_kit.plots import LivePlots\nlive = LivePlots()"),
        nbformat.v4.new_code_cell("for r in json.load(open(records_path)):\n    live(r)\nassert not live.live"),
        nbformat.v4.new_code_cell("figs = live.show()"),
    ]
    src, dst = tmp_path / "live.ipynb", tmp_path / "live.out.ipynb"
    nbformat.write(nb, src)
    papermill.execute_notebook(
        str(src),
        str(dst),
        parameters={"records_path": str(tmp_path / "records.json")},
        kernel_name="python3",
        cwd=str(ROOT),
        progress_bar=False,
        execution_timeout=120,
    )
    cells = nbformat.read(dst, as_version=4).cells
    assert cells[2].outputs == []  # collecting only: no widget views that papermill could not render
    shown = [o for o in cells[-1].outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(shown) == len(plots.FIGURES)
    assert not any("widget-view" in json.dumps(c.outputs) for c in cells)


# ---------------------------------------------------------------- report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    records = make_run(run_dir)
    path = plots.write_report(run_dir)
    return records, path, path.read_text(encoding="utf-8")


def test_report_is_one_self_contained_file(report):
    _, path, text = report
    assert path.name == "report.html" and not path.with_name("report.html.tmp").exists()
    for name in plots.FIGURES:
        assert f'id="fig-{name}"' in text
    assert text.count("* plotly.js v") == 1  # inlined once
    assert not re.search(r"<script[^>]*\bsrc=", text, re.I)  # nothing fetched from anywhere


def test_report_holds_the_numbers_samples_and_config(report):
    records, _, text = report
    final_eval = [r["eval_acc"] for r in records if r["eval_acc"] is not None][-1]
    assert plots.format_number(final_eval) == "0.9375"
    assert re.search(r'data-key="final eval accuracy"><th>[^<]*</th><td>0\.9375</td>', text)
    assert re.search(r'data-key="final eval accuracy \(lenient\)"><th>[^<]*</th><td>0\.9875</td>', text)
    assert "<td>0.25</td>" in text  # base accuracy
    assert re.search(r'data-key="grpo_wall_s"><th>grpo_wall_s</th><td>1,234</td>', text)  # summary.json
    assert re.search(r'data-key="tokens"><th>tokens</th><td>48,066</td>', text)
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; 2 &lt; 3" in text
    assert "<script>alert" not in text
    assert "What is 0 + 0?" in text and "What is 3 + 11?" in text  # first and last iteration
    assert "&quot;loss_type&quot;: &quot;dapo&quot;" in text


def test_report_custom_path_and_empty_run(tmp_path):
    out = plots.write_report(tmp_path / "empty-run", tmp_path / "out" / "r.html")
    text = out.read_text()
    assert out == tmp_path / "out" / "r.html"
    assert all(f'id="fig-{name}"' in text for name in plots.FIGURES)
    assert "no samples recorded" in text


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "n/a"),
        (12, "12"),
        (48066, "48,066"),
        (0.9375, "0.9375"),
        (2 / 3, "0.6667"),
        (1234.5, "1,234"),
        (3.2e-5, "3.20e-05"),
        (0.0, "0"),
        (True, "true"),
    ],
)
def test_format_number(value, text):
    assert plots.format_number(value) == text


def test_report_renders_in_headless_chromium(report, tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI: apt-get install -y chromium")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    _, path, _ = report
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
    ]
    url = path.resolve().as_uri()
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-3000:]
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not [ln for ln in console if re.search(r"uncaught|error", ln, re.I)], console
    # plotly drew every figure: each figure div holds its own <svg class="main-svg">
    chunks = re.split(r'(?=<div id="fig-)', dom.stdout)
    drawn = {m.group(1) for c in chunks if (m := re.match(r'<div id="fig-(\w+)"', c)) and 'class="main-svg"' in c}
    assert drawn == set(plots.FIGURES), drawn
    shot = ROOT / "runs" / "report.png"
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    snap = subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1400,4000", url], capture_output=True, text=True, timeout=180
    )
    assert snap.returncode == 0 and shot.stat().st_size > 50_000, snap.stderr[-3000:]


# ---------------------------------------------------------------- long runs


@pytest.mark.parametrize("n", [0, 1, 799, 800, 801, 1_000, 10_000, 123_457])
def test_thin_indices_bounds_the_points_and_keeps_the_recent_ones(n):
    idx = plots.thin_indices(n, 800, 200)
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
    before, after = plots.thin_indices(4_000, 800, 200), plots.thin_indices(4_001, 800, 200)
    old_before = set(before[:-200])
    assert old_before <= set(after)  # no flicker: the old points stay as one point arrives
    with pytest.raises(ValueError):
        plots.thin_indices(10, 100, 100)


def test_thin_records_keeps_sparse_evaluations():
    recs = synthetic_records(5_000, eval_every=7)  # evaluations fall between the strides
    view = plots.thin_records(recs, 800, 200)
    ev_all = [r["iteration"] for r in recs if r["eval_acc"] is not None]
    ev_view = [r["iteration"] for r in view if r["eval_acc"] is not None]
    assert len(view) <= 800 and len(ev_view) >= 100  # within the budget, evaluations kept
    assert ev_view[-1] == ev_all[-1] and view[-1] is recs[-1]
    assert plots.thin_records(recs[:50], 800, 200) == recs[:50]


def _plain(v):
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def test_figure_data_matches_the_figures():
    """FIGURE_DATA (what a live update copies) is what the figure builders draw, trace by trace."""
    records = synthetic_records(12)
    for name, build in plots.FIGURES.items():
        fig, arrays = build(records), plots.FIGURE_DATA[name](records)
        assert len(fig.data) == len(arrays), name
        for tr, arr in zip(fig.data, arrays, strict=True):
            for key, val in arr.items():
                assert _plain(tr[key] if tr[key] is not None else []) == _plain(val), (name, tr.name, key)


def test_live_plots_thin_a_long_history():
    records = synthetic_records(3_000)
    live = plots.LivePlots(records[:-1], live=True, max_points=300, keep_last=100)
    live(records[-1])
    reward_x = trace(live.figures["reward"], "reward mean").x
    assert len(reward_x) <= 300 and reward_x[-1] == 2_999 and reward_x[0] == 0
    assert len(trace(live.figures["timeline"], "generate").x) == plots.TIMELINE_ITERATIONS
