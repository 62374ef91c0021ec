"""grpo_kit.sweep: grid expansion, the figure, and papermill runs as parallel Dask tasks.

The scheduling tests run a stub notebook (sleeps, writes a summary, or raises) on a shared
two-worker cluster; one test runs the real quickstart at two grid points on a cluster of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import dask
import nbformat
import pytest
from distributed import Client, LocalCluster
from nbformat.v4 import new_code_cell, new_notebook

from grpo_kit import sweep

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(600)


# ----------------------------------------------------------------------------- grid and names


def test_grid_points_are_every_combination_last_axis_fastest():
    pts = sweep.grid_points({"lr": [1e-3, 4e-3], "kl_beta": [0.0, 0.04]})
    assert pts == [
        {"lr": 1e-3, "kl_beta": 0.0},
        {"lr": 1e-3, "kl_beta": 0.04},
        {"lr": 4e-3, "kl_beta": 0.0},
        {"lr": 4e-3, "kl_beta": 0.04},
    ]
    assert sweep.grid_points({}) == [{}]  # no axes: one run with the base parameters


@pytest.mark.parametrize(
    "grid",
    [
        {"lr": []},  # an axis without values would silently drop every run
        {"lr": 1e-3},  # a scalar, not a list
        {"loss_type": "grpo"},  # a string is a sequence of characters, not of values
    ],
)
def test_grid_points_reject_malformed_axes(grid):
    with pytest.raises(ValueError, match="non-empty list"):
        sweep.grid_points(grid)


def test_point_names_are_file_safe():
    assert sweep.point_name({"lr": 0.001, "kl_beta": 0}) == "lr=0.001_kl_beta=0"
    assert sweep.point_name({"dataset": "../data/x y"}) == "dataset=..-data-x-y"
    assert sweep.point_name({}) == "default"


# ----------------------------------------------------------------------------- the figure


def _result(lr, kl_beta, acc, error=None):
    point = {"lr": lr, "kl_beta": kl_beta}
    summary = {} if error else {"acc_after": acc, "kl_final": 0.01, "clip_fraction": 0.0, "grpo_wall_s": 10.0}
    return {"name": sweep.point_name(point), "point": point, "summary": summary, "error": error}


def test_sweep_figure_draws_one_line_per_color_value_and_skips_failures():
    results = [
        _result(4e-3, 0.0, 0.5),
        _result(1e-4, 0.0, 0.3),
        _result(1e-4, 0.04, 0.2),
        _result(4e-3, 0.04, None, error="ValueError: boom"),
    ]
    fig = sweep.sweep_figure(results, "lr", "kl_beta", metrics=("acc_after", "kl_final"))
    assert len(fig.data) == 2 * 2  # two kl_beta values x two panels
    acc = {t.name: (list(t.x), list(t.y)) for t in fig.data if t.xaxis == "x"}
    assert acc == {"kl_beta=0.0": ([1e-4, 4e-3], [0.3, 0.5]), "kl_beta=0.04": ([1e-4], [0.2])}
    assert fig.layout.xaxis.type == "log"  # lr spans 40x
    assert [t.showlegend for t in fig.data] == [True, False, True, False]
    assert "3 of 4 runs" in fig.layout.title.text


def test_an_axis_of_ints_and_floats_is_drawn_in_order():
    """Review finding: the sort key put every float before every int (0.04, 0.1, then 0)."""
    results = [_result(1e-4, 0.1, 0.7), _result(1e-4, 0, 0.5), _result(1e-4, 0.04, 0.6)]
    fig = sweep.sweep_figure(results, "kl_beta", metrics=("acc_after",))
    assert list(fig.data[0].x) == [0, 0.04, 0.1] and list(fig.data[0].y) == [0.5, 0.6, 0.7]


def test_color_groups_are_in_value_order_and_may_be_lists():
    """Review findings (2026-12-03): the legend read kl_beta=16, 2, 8 (sorted as text), and a list-valued
    colour axis (``stop``, which 05_sweep may pick) raised TypeError after every run had finished."""
    results = [_result(1e-4, kl, 0.5) for kl in (16, 2, 8, 1e-5)]
    fig = sweep.sweep_figure(results, "lr", "kl_beta", metrics=("acc_after",))
    assert [t.name for t in fig.data] == ["kl_beta=1e-05", "kl_beta=2", "kl_beta=8", "kl_beta=16"]
    results = [{**_result(lr, 0.0, acc), "point": {"lr": lr, "stop": stop}}
               for lr, stop, acc in ((1e-4, ["\n\n"], 0.3), (1e-3, ["\n\n"], 0.4), (1e-4, ["####"], 0.6))]
    fig = sweep.sweep_figure(results, "lr", "stop", metrics=("acc_after",))
    assert {t.name: list(t.y) for t in fig.data} == {"stop=['\\n\\n']": [0.3, 0.4], "stop=['####']": [0.6]}


def test_table_flattens_point_summary_and_error():
    rows = sweep.table([_result(1e-3, 0.0, 0.5), _result(1e-3, 0.04, None, error="boom")])
    assert rows[0] == {
        "name": "lr=0.001_kl_beta=0.0",
        "lr": 1e-3,
        "kl_beta": 0.0,
        "acc_after": 0.5,
        "kl_final": 0.01,
        "clip_fraction": 0.0,
        "grpo_wall_s": 10.0,
        "error": None,
    }
    assert rows[1]["error"] == "boom" and "acc_after" not in rows[1]


# ----------------------------------------------------------------------------- scheduling (stub notebook)


STUB = """
import json, os, time
from pathlib import Path

time.sleep(sleep_s)
if fail:
    raise ValueError(f"point {tag} failed on purpose")
Path(run_dir).mkdir(parents=True, exist_ok=True)
summary = {"tag": tag, "cwd": os.getcwd(), "iterations": 1}
(Path(run_dir) / "summary.json").write_text(json.dumps(summary))
"""


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    nb = new_notebook()
    params = new_code_cell(
        'tag: str = "a"  # which point\nsleep_s: float = 0.0  # work\nfail: bool = False  # raise\n'
        'run_dir: str = "run"  # where the summary goes'
    )
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, new_code_cell(STUB)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path_factory.mktemp("stub") / "stub.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def client():
    with dask.config.set({"distributed.worker.daemon": False}):
        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0"
        )
        c = Client(cluster)
        yield c
        c.close()
        cluster.close()


def _overlap(a, b) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_points_run_in_parallel_with_their_parameters(stub, client, tmp_path):
    results = sweep.sweep(stub, {"tag": ["a", "b"]}, {"sleep_s": 3.0}, tmp_path, client=client, max_parallel=2)
    assert [r["name"] for r in results] == ["tag=a", "tag=b"]
    for r, tag in zip(results, "ab", strict=True):
        assert r["error"] is None
        assert r["summary"]["tag"] == tag
        assert r["summary"]["cwd"] == str(
            stub.resolve().parent
        )  # the kernel runs beside the notebook, as in JupyterLab
        assert r["params"] == {"sleep_s": 3.0, "tag": tag, "run_dir": str(tmp_path.resolve() / f"tag={tag}")}
        assert Path(r["notebook"]) == tmp_path.resolve() / f"tag={tag}.ipynb" and Path(r["notebook"]).is_file()
    assert _overlap(*results)


def test_a_point_that_writes_no_summary_is_not_given_the_previous_sweeps(stub, tmp_path):
    """Review finding: a re-run into the same out_dir returned the old summary.json as this run's."""
    run_dir = tmp_path / "p"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"acc_after": 0.9, "from": "the previous sweep"}))
    quiet = new_notebook(cells=[new_code_cell('run_dir: str = "run"')])
    quiet.cells[0].metadata["tags"] = ["parameters"]
    quiet.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(quiet, tmp_path / "quiet.ipynb")
    out = sweep.run_point(str(tmp_path / "quiet.ipynb"), str(tmp_path / "out.ipynb"), {"run_dir": str(run_dir)},
                          str(tmp_path), "python3")
    assert out["summary"] == {} and "wrote no" in out["error"]


def test_max_parallel_bounds_the_runs_in_flight(stub, client, tmp_path):
    results = sweep.sweep(stub, {"tag": ["a", "b", "c"]}, {"sleep_s": 1.0}, tmp_path, client=client, max_parallel=1)
    assert [r["summary"]["tag"] for r in results] == ["a", "b", "c"]
    assert not any(_overlap(a, b) for i, a in enumerate(results) for b in results[i + 1 :])


def test_a_failed_point_is_reported_after_the_others_finish(stub, client, tmp_path):
    with pytest.raises(sweep.SweepError, match=r"1 of 2 grid points failed") as info:
        sweep.sweep(stub, {"fail": [False, True]}, {}, tmp_path, client=client, max_parallel=2)
    ok, bad = info.value.results
    assert ok["error"] is None and ok["summary"]["iterations"] == 1
    assert bad["error"] == "ValueError: point a failed on purpose" and bad["summary"] == {}
    assert Path(bad["notebook"]).is_file()  # the executed copy shows the traceback
    kept = sweep.sweep(stub, {"fail": [True]}, {}, tmp_path / "again", client=client, raise_errors=False)
    assert kept[0]["error"].startswith("ValueError")


def test_a_missing_notebook_fails_before_any_task(tmp_path):
    with pytest.raises(FileNotFoundError):
        sweep.sweep(tmp_path / "nope.ipynb", {"lr": [1e-3]}, {}, tmp_path)


# ----------------------------------------------------------------------------- the real thing


@pytest.mark.slow
def test_quickstart_sweep_runs_two_points_in_parallel(tmp_path):
    base = {"engine": "hf", "iterations": 1, "eval_size": 8, "prompts_per_step": 4, "group_size": 4}
    results = sweep.sweep(
        ROOT / "notebooks" / "01_quickstart.ipynb", {"lr": [1e-3, 3e-3]}, base, tmp_path, max_parallel=2
    )
    assert [r["error"] for r in results] == [None, None]
    for r, lr in zip(results, (1e-3, 3e-3), strict=True):
        assert r["summary"]["iterations"] == 1 and r["summary"]["acc_after"] is not None
        run_cfg = json.loads((Path(r["run_dir"]) / "config.json").read_text())
        assert run_cfg["optim"]["lr"] == lr and run_cfg["sampling"]["engine"] == "hf"
        assert Path(r["run_dir"]).parent == tmp_path.resolve() and (Path(r["run_dir"]) / "report.html").is_file()
    assert _overlap(*results)
    fig = sweep.sweep_figure(results, "lr")
    assert [len(t.x) for t in fig.data] == [2] * len(sweep.METRICS)


# ----------------------------------------------------------------------------- runs of configs


def test_sweep_runs_validates_every_point_before_any_runs(tmp_path):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        sweep.sweep_runs({"ok": {}, "bad": {"group_size": 1}}, "tiny", {}, tmp_path, client=object())
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        sweep.sweep_runs({"typo": {"policy_loss": "gpso"}}, "tiny", {}, tmp_path, client=object())
    with pytest.raises(ValueError, match="not file-name safe"):
        sweep.sweep_runs({"a/b": {}}, "tiny", {}, tmp_path, client=object())
    for name in ("..", ".", "..."):  # review: ".." wrote into out_dir's parent and deleted its store/
        with pytest.raises(ValueError, match="not file-name safe.*only dots"):
            sweep.sweep_runs({name: {}}, "tiny", {}, tmp_path, client=object())
    # review findings: runs sharing one store would publish into each other's; a shared cluster
    # sized by the first run would not give another run its shape
    with pytest.raises(ValueError, match="store_url '/tmp/one-store' is shared by several runs"):
        sweep.sweep_runs({"a": {}, "b": {}}, "tiny", {"store_url": "/tmp/one-store"}, tmp_path, client=object())
    with pytest.raises(ValueError, match=r"shared_cluster: the runs differ in \['n_rollout_workers'\]"):
        sweep.sweep_runs({"a": {}, "b": {"n_rollout_workers": 2}}, "tiny", {}, tmp_path, client=object(), shared_cluster=True)
    assert not list(tmp_path.iterdir())  # nothing ran (the client is never used)


def test_a_notebook_sweep_refuses_trl_names_the_notebook_would_not_read(tmp_path):
    """Review finding: learning_rate= passed profile()'s check but the run notebook reads only the kit's
    names (config.overrides_in), so every point ran with the profile's lr."""
    nb = tmp_path / "nb.ipynb"
    nb.write_text("{}")
    with pytest.raises(ValueError, match=r"\['learning_rate'\] are TRL's names.*learning_rate -> lr"):
        sweep.sweep(nb, {"learning_rate": [1e-3, 2e-3]}, {}, tmp_path / "out", client=object())
    with pytest.raises(ValueError, match=r"\['beta'\] are TRL's names"):
        sweep.sweep(nb, {"lr": [1e-3]}, {"beta": 0.04}, tmp_path / "out", client=object())
    # review finding (2026-12-03): one store for every point failed the second point after the first's run
    with pytest.raises(ValueError, match="store_url 's3://b/sweep' is shared by several grid points"):
        sweep.sweep(nb, {"lr": [1e-3, 2e-3]}, {"store_url": "s3://b/sweep"}, tmp_path / "out", client=object())


def _run(name, curve, acc_before=0.25):
    recs = [{"iteration": i, "grpo_wall_s": t, "eval_acc": a, "ratio_std": 0.01 * i, "clip_frac": None,
             "mismatch_kl": 1e-3} for i, (t, a) in enumerate(curve)]
    return {"name": name, "point": {}, "summary": {"acc_before": acc_before}, "records": recs, "error": None}


def test_accuracy_curve_and_time_to_target():
    run = _run("a", [(1.0, None), (2.5, 0.5), (4.0, 0.95), (6.0, 0.9)])
    assert sweep.accuracy_curve(run["records"], 0.25) == [(0.0, 0.25), (2.5, 0.5), (4.0, 0.95), (6.0, 0.9)]
    assert sweep.time_to(run["records"], 0.9) == 4.0  # the first evaluation at or past the target
    assert sweep.time_to(run["records"], 0.99) is None
    nan = _run("b", [(1.0, float("nan")), (2.0, 0.5)])  # review finding: NaN points were kept
    assert sweep.accuracy_curve(nan["records"], float("nan")) == [(2.0, 0.5)]


def test_accuracy_curve_keeps_both_evaluations_that_finished_in_one_iteration():
    # review finding (2026-12-03): the run's end attaches a lagging evaluation and the final one to the
    # last record; its eval_acc holds only the last, and time_to missed version 8's 0.92
    recs = [{"iteration": 0, "grpo_wall_s": 50.0, "eval_acc": 0.5},
            {"iteration": 11, "grpo_wall_s": 120.0, "eval_acc": 0.88, "eval_version": 12,
             "evals": [{"version": 12, "acc": 0.88, "iteration": 11}, {"version": 8, "acc": 0.92, "iteration": 7},
                       {"version": 12, "acc": 0.1, "set": "other", "iteration": 11}]}]
    assert sweep.accuracy_curve(recs, 0.25) == [(0.0, 0.25), (50.0, 0.5), (120.0, 0.92), (120.0, 0.88)]
    assert sweep.time_to(recs, 0.9) == 120.0


def test_compare_figure_draws_each_run_in_every_panel_and_skips_failures():
    results = [_run("grpo", [(1.0, 0.5), (2.0, 0.9)]), _run("gspo", [(1.5, 0.6)]),
               {**_run("cispo", []), "error": "boom"}]
    fig = sweep.compare_figure(results)
    assert len(fig.data) == 2 * (1 + len(sweep.COMPARE_SERIES))
    acc = {t.name: (list(t.x), list(t.y)) for t in fig.data if t.xaxis == "x"}
    assert acc == {"grpo": ([0.0, 1.0, 2.0], [0.25, 0.5, 0.9]), "gspo": ([0.0, 1.5], [0.25, 0.6])}
    clip = [t for t in fig.data if t.xaxis == "x3"]
    assert [list(t.y) for t in clip] == [[], []]  # no iteration measured a clip fraction
    assert "2 of 3 runs" in fig.layout.title.text


def test_a_run_that_fails_before_it_starts_returns_no_earlier_sweeps_records(tmp_path):
    """Review finding (2026-12-03): a child that failed before its run cleared the run files (a bad
    dataset path) returned the previous sweep's metrics.jsonl of that point as its records."""
    import cloudpickle

    run_dir = tmp_path / "a"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "eval_acc": 0.9}) + "\n" for i in range(3)))
    (run_dir / "summary.json").write_text("{}")
    spec = cloudpickle.dumps({"profile": "tiny", "params": {"run_dir": str(run_dir), "dataset": str(tmp_path / "none.jsonl")},
                              "policy_loss": None, "advantage": None})
    res = sweep.run_config(spec, str(run_dir))
    assert "none.jsonl" in res["error"] and res["records"] == [] and res["summary"] == {}
    assert not (run_dir / "summary.json").exists()


def test_a_plug_in_registered_in_the_notebook_reaches_the_runs_child(tmp_path):
    """Review finding (2026-12-03): a loss registered by name in a cell passed the check in the notebook
    and failed in every run's child ("policy_loss must be one of"), which never ran the cell. Here the
    child gets past the config to the (missing) dataset: the name was registered there."""
    from grpo_kit import algorithms

    @algorithms.register_policy_loss("cell_loss_for_sweep_test", zero_adv_is_zero=True)
    def cell_loss(*args, **kw):
        return algorithms.grpo_policy_loss(*args, **kw)

    try:
        named, spec = sweep.point_spec("tiny", {"policy_loss": "cell_loss_for_sweep_test", "run_dir": str(tmp_path / "a"),
                                                "dataset": str(tmp_path / "none.jsonl")})
        assert named["policy_loss"] == "cell_loss_for_sweep_test"
        res = sweep.run_config(spec, str(tmp_path / "a"))
        assert "none.jsonl" in res["error"] and "must be one of" not in res["error"], res["error"]
    finally:
        algorithms.POLICY_LOSSES.pop("cell_loss_for_sweep_test", None)
