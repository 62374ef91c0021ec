"""The live widgets of grpo_kit.widgets: in plain python, in a real kernel, under papermill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import pytest
from synthetic_run import names, synthetic_episode_records, synthetic_records, trace

from grpo_kit import figures, widgets

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- live plots


def test_live_plots_only_collect_in_plain_python(capsys):
    live = widgets.LivePlots()
    assert not live.live and not live.widgets
    for r in synthetic_records(3):
        live(r)
    assert len(live.records) == 3
    figs = live.show()
    assert list(figs) == list(figures.FIGURES) and len(trace(figs["reward"], "reward mean").x) == 3
    assert capsys.readouterr().out == ""  # nothing printed, no browser opened


def test_live_plots_update_figures_in_place():
    records = synthetic_records(6)
    live = widgets.LivePlots(records[:2], live=True)
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


def test_a_run_started_again_replaces_the_held_records_from_its_first_iteration():
    """Review finding (2026-12-03): the run cell run again fed a fresh run into the same LivePlots,
    and the live figures drew both runs as one (x 0..4 then back to 0)."""
    live = widgets.LivePlots(live=True)
    for i in range(5):
        live({"iteration": i, "reward_mean": 0.1 * i})
    for i in range(3):
        live({"iteration": i, "reward_mean": 0.9})
    assert [r["iteration"] for r in live.records] == [0, 1, 2]
    assert trace(live.figures["reward"], "reward mean").y == (0.9, 0.9, 0.9)
    live({"iteration": 2, "reward_mean": 0.5})  # a resumed run repeating its last iteration
    live({"iteration": 3, "reward_mean": 0.6})
    assert [(r["iteration"], r["reward_mean"]) for r in live.records] == [(0, 0.9), (1, 0.9), (2, 0.5), (3, 0.6)]


def test_show_takes_the_final_records():
    # the loop attaches the final evaluation to the last record after the last callback
    records = synthetic_records(5)
    live = widgets.LivePlots(records[:-1], live=True)
    fig = live.figures["reward"]
    final = [dict(r) for r in records]
    final[-1].update(eval_acc=0.875, eval_version=5)
    assert live.show(final)["reward"] is fig  # redrawn in place
    assert trace(fig, "held-out accuracy").x == (3, 4) and trace(fig, "held-out accuracy").y[-1] == 0.875
    assert widgets.LivePlots().show(final)["reward"].data  # not live: static figures of those records


def test_episode_figures_follow_a_multi_turn_run():
    records = synthetic_episode_records(6)
    live = widgets.LivePlots(records[:2], live=True, episodes=True)
    figs = dict(live.figures)
    assert set(figs) == set(figures.FIGURES) | set(figures.EPISODE_FIGURES)
    panel = figs["episodes"]
    before = [len(t.x or ()) for t in panel.data]
    for r in records[2:]:
        live(r)
    assert live.figures["episodes"] is panel  # updated in place
    assert [len(t.x or ()) for t in panel.data] != before
    # static figures (papermill, or a LivePlots made without episodes=True) add them when records hold episodes
    assert set(widgets.LivePlots().show(records)) == set(figs)
    assert set(widgets.LivePlots().show(synthetic_records(3))) == set(figures.FIGURES)
    assert set(widgets.LivePlots(live=True).figures) == set(figures.FIGURES)  # live: only what was asked for


def test_update_in_place_takes_a_plain_figure():
    """Review finding: a plain Scatter's unset text/customdata came through as None and len(None) raised."""
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4], name="a"))
    widgets.update_in_place(fig, go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 4, 5], name="a")))
    assert list(fig.data[0].x) == [1, 2, 3] and list(fig.data[0].y) == [3, 4, 5] and fig.data[0].text is None


def test_live_plots_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown figure"):
        widgets.LivePlots(names=["reward", "nope"])


def test_figure_widget_construction_never_raises_in_plain_python():
    code = (
        "from grpo_kit.widgets import LivePlots\n"
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
        code = "from grpo_kit.widgets import notebook_frontend; print(notebook_frontend())"
        assert _execute(kc, code, {}).strip() == "False"  # what nbclient / papermill send
        assert _execute(kc, code, {"cellId": "abc", "recordTiming": False}).strip() == "True"  # JupyterLab
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_await_comm_subshell_in_a_real_kernel():
    """The wait reads ipykernel's subshells: none without a kernel, a bounded wait (once) while no
    frontend creates one, at once when one exists (JupyterLab creates it for the first widget)."""
    from jupyter_client.manager import start_new_kernel

    assert widgets.await_comm_subshell() is None  # plain python: no kernel
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), startup_timeout=120)
    try:
        code = (
            "import time\nfrom grpo_kit.widgets import await_comm_subshell as wait\n"
            "t = time.monotonic(); a = wait(timeout=0.5); b = wait(timeout=5); print(a, b, time.monotonic() - t)"
        )
        a, b, elapsed = _execute(kc, code, {}).split()
        assert (a, b) == ("False", "False") and 0.45 <= float(elapsed) < 4.5  # waited once, for 0.5 s, not 5.5 s
        if "kernel subshells" not in kc.kernel_info(reply=True)["content"].get("supported_features", []):
            pytest.skip("this ipykernel has no subshells")
        request = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(request)  # what JupyterLab sends when a kernel's first widget comm opens
        assert kc.control_channel.get_msg(timeout=30)["content"]["subshell_id"]
        code = "from grpo_kit.widgets import await_comm_subshell as wait\nprint(wait(timeout=0.0))"
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
        nbformat.v4.new_code_cell("import json\nfrom grpo_kit.widgets import LivePlots\nlive = LivePlots()"),
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
    assert len(shown) == len(figures.FIGURES)
    assert not any("widget-view" in json.dumps(c.outputs) for c in cells)


def test_live_plots_thin_a_long_history():
    records = synthetic_records(3_000)
    live = widgets.LivePlots(records[:-1], live=True, max_points=300, keep_last=100)
    live(records[-1])
    reward_x = trace(live.figures["reward"], "reward mean").x
    assert len(reward_x) <= 300 and reward_x[-1] == 2_999 and reward_x[0] == 0
    assert len(trace(live.figures["timeline"], "generate").x) == figures.TIMELINE_ITERATIONS


def test_a_max_points_too_small_for_evaluations_is_refused_at_once():
    """Review finding: max_points=2 passed the constructor and raised inside the run's callback at the
    first thinning with an evaluation (which killed the run)."""
    with pytest.raises(ValueError, match="max_points must be >= 3"):
        widgets.LivePlots(live=True, max_points=2, keep_last=1)
    live = widgets.LivePlots(live=True, max_points=3, keep_last=1)
    for i in range(8):
        live({"iteration": i, "reward_mean": 0.1 * i, "eval_acc": 0.5 if i % 3 == 0 else None, "spans": []})


def test_a_live_update_rebuilds_when_thinning_reorders_the_error_kinds():
    """The kinds are listed first seen first in the thinned view: once thinning drops the record
    where "timeout" first appeared, "parse" comes first. Copying the arrays by position would put
    parse's counts under the "error: timeout" trace; the names differ, so the figure is rebuilt."""
    def rec(i, kinds):
        return {"iteration": i, "episodes": 8, "turns_mean": 2.0, "tool_errors_by_kind": kinds}

    recs = [rec(0, {}), rec(1, {"timeout": 1}), rec(2, {"parse": 5})] + [
        rec(i, {"timeout": 1, "parse": 5}) for i in range(3, 10)]
    live = widgets.LivePlots(recs, live=True, names=["episodes"], max_points=10, keep_last=2)
    assert [t.name for t in live.figures["episodes"].data if t.name.startswith("error")] == ["error: timeout", "error: parse"]
    live(rec(10, {"timeout": 1, "parse": 5}))  # 11 records: thinning drops record 1
    fig = live.figures["episodes"]
    assert {t.name: set(t.y) for t in fig.data if t.name.startswith("error")} == {"error: parse": {5.0}, "error: timeout": {1.0}}


def test_a_resumed_multi_turn_run_refreshes_its_episode_figures():
    def rec(i):
        return {"iteration": i, "episodes": 8, "turns_mean": 1.0 + i, "reward_mean": 0.1 * i}

    live = widgets.LivePlots([rec(0), rec(1)], live=True)  # the records so far passed in
    assert {"episodes", "episode_ends"} <= set(live.figures)
    for i in range(2, 5):
        live(rec(i))
    assert list(trace(live.figures["episodes"], "turns mean").x) == [0, 1, 2, 3, 4]
