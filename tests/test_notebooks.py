"""Every notebook executed top to bottom with papermill on tiny parameters.

The quickstart runs through ``python -m grpo_kit.demo`` with the default vLLM engine, so the vLLM
path runs end to end inside Dask workers; the other notebooks use the HF engine, which starts
faster. Each run starts its own LocalCluster: the file takes a few minutes on two cores.
"""

from __future__ import annotations

import ast
import json
import statistics
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill as pm
import pytest
from click.testing import CliRunner
from conftest import GSM8K_DIR
from papermill.cli import papermill as papermill_cli

from grpo_kit import config, figures

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TINY = {"iterations": 2, "eval_size": 16, "prompts_per_step": 4, "group_size": 4}
HF = {**TINY, "engine": "hf"}
SUMMARY_KEYS = ("acc_before", "acc_after", "grpo_wall_s", "iterations", "ratio_mean", "clip_fraction", "kl_final")
NOTEBOOK_ONLY = {"profile", "resume", "n_samples", "notebook", "grid", "max_parallel", "out_dir", "x", "color", "pin_cpus",
                 "staleness_ks", "corrections", "n_rows", "brevity_weight", "sample_version", "presets", "target",
                 "shared_cluster"}
"""Parameters that are not config fields; every other parameter name must be one."""

pytestmark = pytest.mark.timeout(900)


def execute(name: str, dest: Path, /, **params) -> nbformat.NotebookNode:
    """Run a notebook as JupyterLab would (kernel in notebooks/) and return the executed copy."""
    out = dest / name
    pm.execute_notebook(
        NOTEBOOKS / name, out, parameters=params, kernel_name="python3", cwd=NOTEBOOKS, progress_bar=False
    )
    return nbformat.read(out, as_version=4)


def error_outputs(nb: nbformat.NotebookNode) -> list[str]:
    return [
        f"{o.get('ename')}: {o.get('evalue')}"
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]


def outputs(nb: nbformat.NotebookNode, mime: str) -> list:
    return [
        o["data"][mime]
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.get("output_type") in ("display_data", "execute_result") and mime in o.get("data", {})
    ]


def stdout(nb: nbformat.NotebookNode) -> str:
    return "".join(
        o["text"]
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream" and o["name"] == "stdout"
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- 01 through the demo


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """``python -m grpo_kit.demo`` on tiny parameters, the default (vLLM) engine."""
    run_dir = tmp_path_factory.mktemp("quickstart")
    args = [sys.executable, "-m", "grpo_kit.demo", "-p", "run_dir", str(run_dir)]
    for name, value in TINY.items():
        args += ["-p", name, str(value)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return run_dir, proc.stdout


@pytest.mark.slow
def test_quickstart_runs_through_the_demo_with_vllm(quickstart):
    run_dir, out = quickstart
    executed = run_dir / "01_quickstart.ipynb"
    nb = nbformat.read(executed, as_version=4)
    assert not error_outputs(nb)
    assert json.loads((run_dir / "config.json").read_text())["sampling"]["engine"] == "vllm"
    assert len(outputs(nb, "application/vnd.plotly.v1+json")) == len(figures.FIGURES)  # live.show() under papermill
    for path in (executed, run_dir / "report.html", run_dir / "metrics.jsonl"):
        assert str(path) in out, f"the demo does not say where {path.name} is"
    assert "acc_after" in out


@pytest.mark.slow
def test_quickstart_report_holds_every_figure(quickstart):
    run_dir, _ = quickstart
    page = (run_dir / "report.html").read_text()
    for name in ("reward", "drift", "staleness", "timeline", "timing"):
        assert f'id="fig-{name}"' in page


@pytest.mark.slow
def test_quickstart_summary_matches_the_metrics(quickstart):
    run_dir, _ = quickstart
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["iterations"] == len(records) == TINY["iterations"]
    assert summary["ratio_mean"] == pytest.approx(statistics.mean(r["ratio_mean"] for r in records))
    assert summary["clip_fraction"] == pytest.approx(statistics.mean(r["clip_frac"] for r in records))
    assert summary["kl_final"] == pytest.approx(records[-1]["kl_mean"])
    # the loop's wall time: at least the iterations' own time, and what the last record says
    assert summary["grpo_wall_s"] == pytest.approx(records[-1]["grpo_wall_s"])
    assert summary["grpo_wall_s"] >= sum(r["iter_s"] for r in records) - 1e-6
    assert summary["acc_before"] == records[-1]["base_acc"]
    assert summary["acc_after"] == records[-1]["eval_acc"]  # the final evaluation lands on the last record
    assert 0 <= summary["acc_before"] <= 1 and 0 <= summary["acc_after"] <= 1


def test_quickstart_defaults_are_the_tiny_profile():
    """The quickstart spells out the tiny profile's values; they must not drift from config.py."""
    tiny = config.profile("tiny").flat()
    params = pm.inspect_notebook(NOTEBOOKS / "01_quickstart.ipynb")
    spelled = {n: ast.literal_eval(p["default"]) for n, p in params.items() if n in tiny and n != "run_dir"}
    assert {"iterations", "lr", "eval_samples", "report_to"} <= set(spelled)  # the parse misses none of them
    applied = config.from_params("tiny", spelled).flat()  # as the derived-values cell reads them ("none" is ())
    for name in spelled:
        assert applied[name] == tiny[name], f"01_quickstart: {name} = {spelled[name]!r} differs from the tiny profile"


# ----------------------------------------------------------------------------- 02 to 05


@pytest.mark.slow
def test_inspect_run_redraws_a_finished_run(quickstart, tmp_path):
    run_dir, _ = quickstart
    nb = execute("04_inspect_run.ipynb", tmp_path, run_dir=str(run_dir), n_samples=4)
    assert not error_outputs(nb)
    assert len(outputs(nb, "application/vnd.plotly.v1+json")) == len(figures.FIGURES)
    assert f"{TINY['iterations']} of {TINY['iterations']} iterations, finished" in stdout(nb)
    assert any("completion" in html for html in outputs(nb, "text/html")), "no samples table"
    assert f"version {TINY['iterations']} of [" in stdout(nb)  # sampled from the latest version


@pytest.mark.slow
@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_notebook_runs_the_smol_profile_on_a_cpu(tmp_path):
    """The real chat model (SmolLM2-135M-Instruct) on GSM8K through the notebook, default vLLM engine
    (merged LoRA on a CPU). This is also the loop test of merged vLLM on this model (see
    tests/test_real_model.py's LOOP_ENGINES): the first step on-policy, the stop string, every row.
    It is also the notebook's run on local GSM8K files (a separate smoke-profile run of the same
    notebook on the tiny model was cut: 43 s for nothing this one does not check; the tiny model on
    GSM8K through the Dask loop is tests/test_tasks.py's gsm8k-tiny case)."""
    run_dir = tmp_path / "run"
    nb = execute(
        "02_gsm8k.ipynb", tmp_path, profile="smol", dataset=str(GSM8K_DIR), iterations=2, prompts_per_step=2,
        group_size=4, eval_size=4, eval_every=1, max_new_tokens=16, micro_batch=4, max_model_len=512,
        train_size=64, run_dir=str(run_dir),
        kl_beta=1e-3,  # every row trains (kl_beta 0 skips rows with no advantage), so the ratio is measured
    )
    assert not error_outputs(nb)
    out = stdout(nb)
    assert "<|im_start|>system" in out and "<|im_start|>assistant" in out  # the prompt as the chat model sees it
    assert "strict ('#### <n>' and the right value)" in out and "lenient" in out
    cfg = json.loads((run_dir / "config.json").read_text())
    assert (cfg["profile"], cfg["model"]["model"], cfg["data"]["dataset"]) == ("smol", "smollm2-135m", str(GSM8K_DIR))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["lenient_acc_after"] is not None
    assert (run_dir / "report.html").is_file()
    assert cfg["sampling"]["engine"] == "vllm" and cfg["sampling"]["lora_mode"] == "auto"
    first = read_jsonl(run_dir / "metrics.jsonl")[0]  # sampled and trained at version 0: on-policy
    assert first["rollout_version"] == 0 and abs(first["ratio_mean"] - 1) < 1e-3
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rows) == 2 * 2 * 4 and all(r["prompt_id"].startswith("gsm8k-train-") for r in rows)
    assert all(r["stop"] in (None, "\n\n") for r in rows)


@pytest.mark.slow
def test_pipelining_study_runs_both_modes(tmp_path):
    nb = execute("03_pipelining_study.ipynb", tmp_path, **HF, run_dir=str(tmp_path / "study"), staleness_ks=[2],
                 corrections=["trainer"])
    assert not error_outputs(nb)
    deep = read_jsonl(tmp_path / "study" / "k2-trainer" / "metrics.jsonl")
    assert [r["staleness_max"] for r in deep] == [0, 1]  # two iterations: the second batch is one behind
    assert all(r["ratio_mean"] == 1.0 and r["is_mean"] is not None for r in deep)  # TRL's semantics
    for mode in ("pipelined", "sequential"):
        cfg = json.loads((tmp_path / "study" / mode / "config.json").read_text())
        assert cfg["run"]["pipelined"] is (mode == "pipelined")
        assert len(read_jsonl(tmp_path / "study" / mode / "metrics.jsonl")) == TINY["iterations"]
    assert "pipelining speedup: measured" in stdout(nb)
    assert len(outputs(nb, "application/vnd.plotly.v1+json")) == 4  # speedup bars, reward curves, two timelines


@pytest.mark.slow
def test_sweep_notebook_runs_its_grid(tmp_path):
    """One grid point keeps this cheap; tests/test_sweep.py runs two quickstarts in parallel."""
    out_dir = tmp_path / "sweep"
    nb = execute(
        "05_sweep.ipynb", tmp_path, grid={"lr": [1e-3]}, iterations=1, eval_size=8, max_parallel=1, out_dir=str(out_dir)
    )
    assert not error_outputs(nb)
    assert not error_outputs(nbformat.read(out_dir / "lr=0.001.ipynb", as_version=4))
    assert json.loads((out_dir / "lr=0.001" / "summary.json").read_text())["iterations"] == 1
    assert json.loads((out_dir / "lr=0.001" / "config.json").read_text())["sampling"]["engine"] == "hf"
    assert len(outputs(nb, "application/vnd.plotly.v1+json")) == 1


@pytest.mark.slow
def test_custom_task_notebook_trains_on_a_dataset_and_rewards_defined_in_cells(tmp_path):
    run_dir = tmp_path / "run"
    nb = execute("06_custom_task.ipynb", tmp_path, **HF, n_rows=300, eval_every=2, brevity_weight=0.25,
                 run_dir=str(run_dir))
    assert not error_outputs(nb)
    task = json.loads((run_dir / "config.json").read_text())["task"]
    # the functions were defined in the notebook's kernel and reached the workers by cloudpickle
    assert task["rewards"] == ["__main__:exact_answer", "__main__:brevity"] and task["weights"] == [1.0, 0.25]
    recs = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in recs] == list(range(TINY["iterations"]))
    for r in recs:
        comps = r["reward_components"]
        assert set(comps) == {"exact_answer", "brevity"} and r["reward_errors"] == 0
        assert r["reward_mean"] == pytest.approx(comps["exact_answer"] + 0.25 * comps["brevity"])
    assert len(outputs(nb, "application/vnd.plotly.v1+json")) == len(figures.FIGURES)
    assert all(r["prompt_id"].startswith("sums-train-") for r in read_jsonl(run_dir / "rollouts.jsonl"))


def test_tools_notebook_trains_episodes_with_a_tool_defined_in_a_cell(tmp_path):
    run_dir = tmp_path / "run"
    nb = execute("07_tools.ipynb", tmp_path, **HF, eval_every=2, run_dir=str(run_dir))
    assert not error_outputs(nb)
    task = json.loads((run_dir / "config.json").read_text())["task"]
    # the tool was defined in the notebook's kernel and reached the rollout workers by cloudpickle
    assert task["name"] == "calculator" and task["tools"] == ["__main__:multiply"]
    recs = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in recs] == list(range(TINY["iterations"]))
    assert all(r["episodes"] == TINY["prompts_per_step"] * TINY["group_size"] for r in recs)
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    calls = [m for r in rows for m in r["episode"]["messages"] if m["role"] == "tool"]
    assert calls and all(m["name"] == "multiply" for m in calls)  # the base model calls the tool some of the time
    a, b = (int(x) for x in rows[0]["prompt_id"].split("-")[1:])  # mul-<a>-<b>
    assert rows[0]["gold"] == str(a * b)
    # the episode figures are among the plots, and the report shows episodes as conversations
    assert len(outputs(nb, "application/vnd.plotly.v1+json")) == len(figures.FIGURES) + len(figures.EPISODE_FIGURES)
    assert "held-out tool rate" in stdout(nb) and "[assistant] " in stdout(nb)
    assert "episodes ended: answered" in (run_dir / "report.html").read_text()
    assert '<div class="episode">' in (run_dir / "report.html").read_text()
    # review finding: 04 sampled the built-in synthetic task's problems for a run of a Task object
    inspect = execute("04_inspect_run.ipynb", tmp_path, run_dir=str(run_dir), n_samples=2)
    assert not error_outputs(inspect)
    assert "not sampled: the run trained on task 'calculator' (multi-turn episodes)" in stdout(inspect)


def test_algorithms_notebook_runs_a_loss_defined_in_a_cell(tmp_path):
    """One run through sweep.sweep_runs, one iteration: the cell's dual-clip loss, which reached the
    trainer ranks by cloudpickle from the kernel. A built-in by name is the same path with a string
    (tests/test_algorithms.py runs each built-in in the step and in DDP; tests/test_sweep.py checks the
    names); a second run here cost the suite about another minute."""
    out_dir = tmp_path / "algos"
    nb = execute("08_algorithms.ipynb", tmp_path, **{**HF, "iterations": 1, "eval_size": 8}, presets=[],
                 eval_every=1, max_parallel=1, out_dir=str(out_dir))
    assert not error_outputs(nb)
    for name, loss in (("dual_clip", "__main__:dual_clip"),):
        cfg = json.loads((out_dir / name / "config.json").read_text())
        assert cfg["loss"]["policy_loss"] == loss and cfg["sampling"]["engine"] == "hf"
        rec = read_jsonl(out_dir / name / "metrics.jsonl")[0]
        assert rec["ratio_std"] is not None and rec["mismatch_kl"] is not None  # the step ran the loss
    assert json.loads((out_dir / "dual_clip" / "summary.json").read_text())["iterations"] == 1
    table = outputs(nb, "text/html")
    assert any("dual_clip" in html and "mismatch_kl" in html for html in table)
    fig = outputs(nb, "application/vnd.plotly.v1+json")
    assert len(fig) == 1 and {t["name"] for t in fig[0]["data"]} == {"dual_clip"}


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("name", "params", "ename", "message"),
    [
        ("01_quickstart.ipynb", {"group_size": 1}, "ValueError", "group_size must be >= 2"),
        ("02_gsm8k.ipynb", {"profile": "huge"}, "ValueError", "unknown profile 'huge'"),
        ("03_pipelining_study.ipynb", {"max_staleness": -1}, "ValueError", "max_staleness must be >= 0"),
        ("04_inspect_run.ipynb", {"run_dir": "/nonexistent/run"}, "FileNotFoundError", "holds no run"),
        ("05_sweep.ipynb", {"grid": {"group_size": [4, 1]}}, "ValueError", "group_size must be >= 2"),
        ("06_custom_task.ipynb", {"lr": -1.0}, "ValueError", "lr must be > 0"),
        ("07_tools.ipynb", {"max_turns": 0}, "ValueError", "max_turns must be >= 1"),
        ("08_algorithms.ipynb", {"presets": ["grpo", "ppo"]}, "ValueError", "unknown algorithm(s) ['ppo']"),
    ],
)
def test_a_bad_parameter_stops_in_the_derived_values_cell(name, params, ename, message, tmp_path):
    with pytest.raises(pm.PapermillExecutionError) as info:
        execute(name, tmp_path, **params)
    err = info.value
    assert err.ename == ename and message in err.evalue
    code = [c for c in nbformat.read(tmp_path / name, as_version=4).cells if c.cell_type == "code"]
    failed = next(i for i, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.outputs))
    assert "injected-parameters" in code[failed - 1].metadata.get("tags", []), "failed later than the derived cell"


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_help_notebook_lists_every_parameter(name):
    # papermill's own command line, run in this process (a subprocess spends seconds importing)
    result = CliRunner().invoke(papermill_cli, ["--help-notebook", str(NOTEBOOKS / name)])
    assert result.exit_code == 0, result.output
    params = pm.inspect_notebook(NOTEBOOKS / name)
    assert params, f"{name}: no parameters found"
    # papermill skips a line it cannot parse (a second "=" in its comment, say) with a log warning only
    cell = next(c for c in nbformat.read(NOTEBOOKS / name, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    assigned = [n.target.id for n in ast.parse(cell.source).body if isinstance(n, ast.AnnAssign)]
    assert list(params) == assigned, f"{name}: papermill does not list {sorted(set(assigned) - set(params))}"
    fields = set(config.flat_field_names())
    for p in params.values():
        assert f"  {p['name']}: {p['inferred_type_name']} (default" in result.output
        assert p["inferred_type_name"] != "None", f"{name}: {p['name']} has no type annotation"
        assert p["help"], f"{name}: {p['name']} has no comment"
        assert p["name"] in fields | NOTEBOOK_ONLY, f"{name}: {p['name']} is neither a config field nor a known extra"
