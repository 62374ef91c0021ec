"""The quickstart as a person sees it: JupyterLab in a headless Chromium, Run All, watched while it runs.

JupyterLab (from this environment) serves a copy of ``notebooks/01_quickstart.ipynb`` with small
parameters from a temporary directory; Playwright drives Debian's ``/usr/bin/chromium`` (no browser
is downloaded). The test watches the run about once a second and checks what issue 16 fixed:

- the figure widgets render and update while the run goes on (two different states are drawn while the
  training cell runs, recorded in the page every 200 ms);
- JupyterLab's status bar and the server's ``execution_state`` say busy for the whole training cell
  and idle at the end;
- the training cell shows no engine output (no ``WARNING`` line, nothing on stderr), only the
  progress bar; the workers' output is in ``<run_dir>/logs``;
- no figure's title, subplot titles, axis titles and legend overlap (their boxes in the page);
- no JavaScript error in the console; the notebook is not marked modified on opening.

A second, tiny notebook shows the upstream behaviour the kit works around (see
:func:`grpo_kit.widgets.await_comm_subshell`). Screenshots go to ``runs/browser/``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "runs" / "browser"
PARAMS = {"iterations": 12, "eval_size": 32}  # long enough (~0.7 s an iteration) for several mid-run samples
TRAINING_CELL = "loop.run(cfg, client"
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
NOTEBOOK_FIGURES = f"{PANEL} .jp-OutputArea .js-plotly-plot"
RUN_TIMEOUT_S = 420
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = pytest.mark.timeout(900)

BOXES_JS = """
(selector) => [...document.querySelectorAll(selector)].map(gd => {
  const box = el => { const r = el.getBoundingClientRect(); return {x0: r.left, y0: r.top, x1: r.right, y1: r.bottom}; };
  const items = [];
  const add = (kind, el) => items.push({kind, text: el.textContent, ...box(el)});
  gd.querySelectorAll('.gtitle').forEach(e => add('title', e));
  gd.querySelectorAll('.annotation').forEach(e => add('subplot title', e));
  gd.querySelectorAll('[class*="title"] > text[class$="title"]').forEach(e => {
    if (!e.classList.contains('gtitle')) add('axis title', e);
  });
  gd.querySelectorAll('.legend .bg').forEach(e => add('legend', e));
  gd.querySelectorAll('.nsewdrag').forEach(e => add('plot area', e));
  return {title: gd.layout && gd.layout.title ? (gd.layout.title.text || '') : '',
          points: Object.fromEntries((gd.data || []).map(t => [t.name, (t.x || []).length])), items};
})
"""
WATCH_JS = """
([panel, train]) => {
  // Records in the page, every 200 ms, each new state of the reward figure (points per trace) with
  // whether the training cell is running: what was on screen, however rarely Playwright's polls get
  // through while the browser's main thread is busy redrawing seven figures an iteration.
  window.grpoStates = [];
  setInterval(() => {
    const cell = document.querySelectorAll(`${panel} .jp-CodeCell`)[train];
    const prompt = cell ? ((cell.querySelector('.jp-InputPrompt') || {}).textContent || '').trim() : '';
    for (const gd of document.querySelectorAll(`${panel} .jp-OutputArea .js-plotly-plot`)) {
      if (!(gd.layout && gd.layout.title && gd.layout.title.text === 'Reward and accuracy')) continue;
      const points = Object.fromEntries((gd.data || []).map(t => [t.name, (t.x || []).length]));
      const last = window.grpoStates[window.grpoStates.length - 1];
      const key = JSON.stringify(points) + prompt;
      if (!last || last.key !== key) window.grpoStates.push({key, points, running: prompt === '[*]:', t: performance.now()});
    }
  }, 200);
}
"""
CELLS_JS = """
() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')].map(c => ({
  code: c.classList.contains('jp-CodeCell'),
  prompt: (c.querySelector('.jp-InputPrompt') || {}).textContent || '',
  source: (c.querySelector('.jp-InputArea-editor') || {}).textContent || '',
  output: (c.querySelector('.jp-OutputArea') || {}).textContent || '',
  stderr: c.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').length,
}))
"""


def overlaps(figure: dict) -> list[str]:
    """Pairs of a figure's title, subplot titles, axis titles and legend whose boxes overlap (> 1 px
    each way), and a legend over a plot area."""
    items = [i for i in figure["items"] if i["x1"] - i["x0"] > 0 and i["y1"] - i["y0"] > 0]
    bad = []
    for a, p in enumerate(items):
        for q in items[a + 1 :]:
            kinds = {p["kind"], q["kind"]}
            if "plot area" in kinds and kinds != {"plot area", "legend"}:
                continue  # subplot and axis titles sit on a plot area's edge by design
            dx = min(p["x1"], q["x1"]) - max(p["x0"], q["x0"])
            dy = min(p["y1"], q["y1"]) - max(p["y0"], q["y0"])
            if dx > 1 and dy > 1:
                bad.append(f"{figure['title']!r}: {p['kind']} {p['text'][:30]!r} / {q['kind']} {q['text'][:30]!r}")
    return bad


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless, driven by Playwright."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI: apt-get install -y chromium")
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright", reason="pip install playwright (the dev extra)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with a token, serving a temporary directory; yields
    ``(base_url, token, root)``. User settings and workspaces are the directory's own (JupyterLab's
    defaults, news and update checks off)."""
    pytest.importorskip("jupyterlab")
    root = tmp_path_factory.mktemp("lab")
    settings = root / ".settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    port, token = _free_port(), secrets.token_hex(16)
    args = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={root / '.settings'}",
        f"--LabApp.workspaces_dir={root / '.workspaces'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(root / ".runtime")}
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen(args, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{(root / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, root
    finally:
        try:  # kernels first, by request: a kernel's exit closes the LocalCluster it started
            for kernel in json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=5)):
                req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req, timeout=60)
        except OSError:
            pass
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def kernel_states(base: str, token: str) -> list[str]:
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=5) as r:
        return [k["execution_state"] for k in json.load(r)]


def status_bar(page) -> str:
    item = page.locator(".jp-StatusBar-TextItem", has_text="ipykernel").first
    return item.text_content(timeout=5000) or ""


def settled_status(page, base: str, token: str, timeout_s: float = 30.0) -> dict:
    """The status bar's text and the server's kernel states once both read idle twice in a row, 0.5 s
    apart (else the last reading, at ``timeout_s``). After the last cell the kernel is still briefly
    busy now and then: each widget comm message the page sends (the FigureWidgets' views report their
    layout as they render) is kernel work, so a single reading can fall inside one."""
    deadline, calm = time.time() + timeout_s, 0
    while True:
        final = {"bar": status_bar(page), "server": kernel_states(base, token)}
        calm = calm + 1 if final["bar"].endswith("| Idle") and final["server"] == ["idle"] else 0
        if calm >= 2 or time.time() > deadline:
            return final
        time.sleep(0.5)


def open_notebook(browser, base: str, token: str, name: str, sent: list | None = None):
    """A page with the notebook open and its kernel idle; console errors collect in ``page.errors``, and
    the websocket frames the page sends in ``sent`` if given."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.errors = []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    if sent is not None:
        page.on(
            "websocket",
            lambda ws: ws.on(
                "framesent", lambda f: sent.append(f if isinstance(f, str) else f.decode(errors="replace"))
            ),
        )
    page.goto(f"{base}/lab/tree/{name}?reset&token={token}")  # reset: a fresh workspace, only this notebook
    page.wait_for_selector(f"{PANEL} .jp-Cell", timeout=120_000)
    page.locator(".jp-StatusBar-TextItem", has_text="| Idle").first.wait_for(timeout=120_000)
    return page


def run_all(page) -> None:
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()


def copy_quickstart(root: Path, name: str = "quickstart", params: dict | None = None) -> dict:
    """The quickstart with ``params`` (default :data:`PARAMS`) and its run directory ``root/<name>-run``
    (``root/run`` for the default name), as ``root/<name>.ipynb``; returns the notebook JSON."""
    nb = json.loads((ROOT / "notebooks" / "01_quickstart.ipynb").read_text())
    [cell] = [c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", [])]
    src = "".join(cell["source"])
    run_dir = root / ("run" if name == "quickstart" else f"{name}-run")
    for name_, value in {**(params or PARAMS), "run_dir": str(run_dir)}.items():
        src, n = re.subn(
            rf"^{name_}: (\w+) = [^#\n]*",
            lambda m, v=value, name=name_: f"{name}: {m.group(1)} = {v!r} ",
            src,
            flags=re.M,
        )
        assert n == 1, name_
    cell["source"] = src
    (root / f"{name}.ipynb").write_text(json.dumps(nb, indent=1))
    return nb


@pytest.fixture(scope="module")
def quickstart_run(lab, browser):
    """Run All on the quickstart copy, watched about once a second until every cell has run."""
    from grpo_kit import tiny

    tiny.ensure_tiny_model()  # a first use would pretrain it in the model cell: minutes, not what is tested here
    base, token, root = lab
    nb = copy_quickstart(root)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    train = next(i for i, c in enumerate(code) if TRAINING_CELL in "".join(c["source"]))
    live = next(i for i, c in enumerate(code) if "widgets.LivePlots()" in "".join(c["source"]))
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = open_notebook(browser, base, token, "quickstart.ipynb")
    time.sleep(2)  # let the kernel's language_info arrive (it used to mark the notebook modified)
    dirty_on_open = page.locator(".lm-TabBar-tab.jp-mod-dirty").count() > 0
    page.evaluate(WATCH_JS, [PANEL, train])
    run_all(page)
    t0, samples, polled_states, midrun, shot = time.time(), [], [], None, None
    while True:
        cells = [c for c in page.evaluate(CELLS_JS) if c["code"]]
        prompts = [c["prompt"].strip() for c in cells]
        current = next((i for i, p in enumerate(prompts) if p == "[*]:"), None)  # queued cells show [*] too
        figs = page.evaluate(BOXES_JS, NOTEBOOK_FIGURES)
        sample = {"t": time.time() - t0, "cell": current, "bar": status_bar(page), "server": kernel_states(base, token)}
        samples.append(sample)
        if current == train:
            reward = next((f for f in figs if f["title"] == "Reward and accuracy"), None)
            if reward and reward["points"].get("reward mean"):
                polled_states.append(tuple(reward["points"].values()))
                if shot is None:  # the mid-run state measured: the screenshot's, else the last one seen
                    midrun = figs
                if shot is None and reward["points"]["reward mean"] >= 4:  # a fast run may finish before
                    page.mouse.move(10, 10)  # no hover labels or mode bars in the pictures
                    shot = SHOTS / "quickstart-midrun.png"  # docs/quickstart-jupyterlab.png is one of these
                    for cell, path in ((live, shot), (train, SHOTS / "quickstart-midrun-training-cell.png")):
                        page.locator(f"{PANEL} .jp-CodeCell").nth(cell).evaluate("e => e.scrollIntoView()")
                        time.sleep(0.5)  # cells that were off screen are painted on the next frames
                        page.screenshot(path=str(path))
        if current is None and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            break
        assert time.time() - t0 < RUN_TIMEOUT_S, f"the notebook did not finish in {RUN_TIMEOUT_S} s: {prompts}"
        time.sleep(1.0)
    page.locator(".jp-StatusBar-TextItem", has_text="| Idle").first.wait_for(timeout=60_000)
    # the last cells' widget updates (live.show with the final evaluation) may still be on their way
    final_eval = "(gd.data || []).some(t => t.name === 'held-out accuracy' && (t.x || []).length >= 2)"
    try:
        page.wait_for_function(
            f"() => [...document.querySelectorAll('{NOTEBOOK_FIGURES}')].some(gd => {final_eval})", timeout=15_000
        )
    except Exception:  # noqa: BLE001 - a timeout is reported by test_figures_render_and_update_mid_run
        pass
    watched = page.evaluate("() => window.grpoStates")
    # the reward figure's states drawn while the training cell ran, once it has points
    figure_states = [tuple(w["points"].values()) for w in watched if w["running"] and w["points"].get("reward mean")]
    final = settled_status(page, base, token)
    page.locator(f"{PANEL} .jp-CodeCell").nth(train).scroll_into_view_if_needed()
    time.sleep(0.5)
    page.screenshot(path=str(SHOTS / "quickstart-end.png"))
    # fresh-3 of session 12 read the timeline's div with no layout title ('') right after the scroll and
    # screenshot above, under load: a view caught mid-redraw (why it redrew is not established;
    # JupyterLab 4.6's default windowing, contentVisibility, detaches no cells); read the figures once
    # every one has its title again
    drawn = "gd => gd.layout && gd.layout.title && gd.layout.title.text"
    try:
        page.wait_for_function(f"() => [...document.querySelectorAll('{NOTEBOOK_FIGURES}')].every({drawn})", timeout=30_000)
    except Exception:  # noqa: BLE001 - a figure that never gets its title is reported by test_figures_render_and_update_mid_run
        pass
    result = {
        "train": train,
        "cells": [c for c in page.evaluate(CELLS_JS) if c["code"]],
        "samples": samples,
        "figure_states": figure_states,
        "polled_states": polled_states,
        "midrun": midrun,
        "end_figures": page.evaluate(BOXES_JS, NOTEBOOK_FIGURES),
        "final": final,
        "dirty_on_open": dirty_on_open,
        "errors": list(page.errors),
        "run_dir": root / "run",
        "notebook": nb,
    }
    page.close()
    return result


def test_figures_render_and_update_mid_run(quickstart_run):
    states = quickstart_run["figure_states"]  # recorded in the page (WATCH_JS), not by the polls
    assert len(set(states)) >= 2, (f"the reward figure did not change while training ran: {states} "
                                   f"(polls saw {quickstart_run['polled_states']})")
    titles = [f["title"] for f in quickstart_run["end_figures"]]
    assert titles == ["Reward and accuracy", "Off-policy drift", "Staleness", "Reward components", "Pipeline timeline",
                      "Time per iteration", "Usable samples and their cost"]
    assert all(max(f["points"].values()) > 0 for f in quickstart_run["end_figures"]), "a figure has no data"
    reward = quickstart_run["end_figures"][0]["points"]
    assert reward["reward mean"] == PARAMS["iterations"] and reward["held-out accuracy"] >= 2, reward  # + final eval


def test_no_title_or_legend_overlaps(quickstart_run):
    for figures in (quickstart_run["midrun"], quickstart_run["end_figures"]):
        assert figures, "no figures measured"
        bad = [b for f in figures for b in overlaps(f)]
        assert not bad, bad


def test_kernel_status_is_busy_for_the_whole_training_cell(quickstart_run):
    training = [s for s in quickstart_run["samples"] if s["cell"] == quickstart_run["train"]]
    assert len(training) >= 5, quickstart_run["samples"]
    settled = [s for s in training if s["t"] - training[0]["t"] >= 1.0]  # a sample may straddle the cell start
    idle = [s for s in settled if not s["bar"].endswith("| Busy") or s["server"] != ["busy"]]
    assert not idle, f"status not busy while the training cell ran: {idle[:5]}"
    assert quickstart_run["final"]["bar"].endswith("| Idle") and quickstart_run["final"]["server"] == ["idle"]


def test_training_cell_shows_progress_not_engine_logs(quickstart_run):
    cells = quickstart_run["cells"]
    train = cells[quickstart_run["train"]]
    assert "GRPO" in train["output"] and f"{PARAMS['iterations']}/{PARAMS['iterations']}" in train["output"]
    assert not re.search(r"\bWARNING\b|Failed to load weights|Dask Worker process", train["output"]), train["output"]
    for i, cell in enumerate(cells):
        assert cell["stderr"] == 0, f"code cell {i} has stderr output: {cell['output'][:2000]}"
    assert "worker logs" in "".join(c["output"] for c in cells)
    logs = quickstart_run["run_dir"] / "logs"
    rollout = (logs / "rollout-0.log").read_text()
    # vLLM's start-up went to the file (the whole file on failure: CI's short repr cut its middle once)
    assert "Initializing a V1 LLM engine" in rollout, f"rollout-0.log:\n{rollout[:6000]}"
    assert rollout.count("==== ") == 1, "the cluster cell and loop.run each set the routing up"
    assert "Failed to load weights" not in rollout  # the merged reloads no longer warn
    assert (logs / "trainer-0.log").exists()


def test_summary_and_absolute_paths(quickstart_run):
    out = "".join(c["output"] for c in quickstart_run["cells"])
    assert re.search(rf"held-out accuracy [\d.]+ -> [\d.]+ after {PARAMS['iterations']} iterations", out), out[-3000:]
    run_dir = str(quickstart_run["run_dir"])
    assert re.search(rf"adapters\s+{re.escape(run_dir)}/store", out)
    assert ".." not in "".join(ln for ln in out.splitlines() if run_dir in ln)


def test_no_console_errors_and_not_modified_on_open(quickstart_run):
    assert quickstart_run["errors"] == []
    info = quickstart_run["notebook"]["metadata"]["language_info"]
    if info.get("version") != platform.python_version():
        pytest.skip(
            f"the notebook stores Python {info.get('version')}'s language_info; this kernel is {platform.python_version()}"
        )
    assert not quickstart_run["dirty_on_open"], "JupyterLab marked the notebook modified on opening"


def test_upstream_first_widget_shows_the_kernel_idle_mid_cell(lab, browser):
    """What :func:`grpo_kit.widgets.await_comm_subshell` works around, pinned: in JupyterLab >= 4.4 the
    first widget of a kernel makes the frontend send ``create_subshell_request`` (control channel), and
    ipykernel 7's busy/idle status for it turns the status bar to Idle while the cell still runs
    (jupyter/jupyter_client#838). When this test fails, upstream has fixed it."""
    base, token, root = lab
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "id": "probe",
                "metadata": {},
                "execution_count": None,
                "outputs": [],
                "source": "import time, ipywidgets\ndisplay(ipywidgets.IntSlider())\ntime.sleep(6)",
            }
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (root / "probe.ipynb").write_text(json.dumps(nb))
    sent: list[str] = []
    page = open_notebook(browser, base, token, "probe.ipynb", sent)
    run_all(page)
    seen = []
    t0 = time.time()
    while time.time() - t0 < 12:
        prompt = page.locator(f"{PANEL} .jp-InputPrompt").first.text_content() or ""
        seen.append((round(time.time() - t0, 1), prompt.strip(), status_bar(page)))
        if re.fullmatch(r"\[\d+\]:", prompt.strip()):
            break
        time.sleep(0.5)
    page.close()
    running = [s for s in seen if s[1] == "[*]:"]
    assert any("create_subshell_request" in f for f in sent), "the frontend sent no create_subshell_request"
    assert any(s[2].endswith("| Idle") for s in running), f"status stayed busy: upstream fixed? {seen}"


@pytest.mark.parametrize("width", [820, 1400])
def test_report_figures_do_not_overlap(browser, tmp_path, width):
    from synthetic_run import make_run  # pytest puts tests/ on sys.path

    from grpo_kit import figures as kit_figures
    from grpo_kit import report as html_report

    make_run(tmp_path / "run", 40)
    report = html_report.write_report(tmp_path / "run")
    page = browser.new_page(viewport={"width": width, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(report.as_uri())
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 5", timeout=60_000)
    figures = page.evaluate(BOXES_JS, ".plot .js-plotly-plot")
    page.close()
    assert len(figures) == len(kit_figures.FIGURES) and not errors
    bad = [b for f in figures for b in overlaps(f)]
    assert not bad, bad


def _metrics_iterations(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.strip()]


def _wait_all_ran(page, timeout_s: float) -> list[dict]:
    t0 = time.time()
    while True:
        cells = [c for c in page.evaluate(CELLS_JS) if c["code"]]
        prompts = [c["prompt"].strip() for c in cells]
        if all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return cells
        assert time.time() - t0 < timeout_s, f"cells did not finish in {timeout_s} s: {prompts}"
        time.sleep(1.0)


def test_interrupting_the_kernel_then_resume_true_continues_the_run(lab, browser):
    """What a person does when a run must stop: Kernel > Interrupt mid-run, set ``resume = True``, run
    the training cell and those below it again. The run continues where it stopped: every iteration
    is recorded exactly once and the summary counts them all."""
    from grpo_kit import tiny

    tiny.ensure_tiny_model()
    base, token, root = lab
    iterations = 24
    nb = copy_quickstart(root, "resume", {"iterations": iterations, "eval_size": 16, "eval_every": 8})
    run_dir = root / "resume-run"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    train = next(i for i, c in enumerate(code) if TRAINING_CELL in "".join(c["source"]))
    page = open_notebook(browser, base, token, "resume.ipynb")
    run_all(page)
    t0 = time.time()
    while len(_metrics_iterations(run_dir)) < 3:
        assert time.time() - t0 < RUN_TIMEOUT_S, "the run did not reach iteration 3"
        time.sleep(0.5)
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Kernel$")).click()
    page.locator('.lm-Menu-item[data-command="kernelmenu:interrupt"]').click()
    page.locator(".jp-StatusBar-TextItem", has_text="| Idle").first.wait_for(timeout=120_000)
    cells = [c for c in page.evaluate(CELLS_JS) if c["code"]]
    assert "KeyboardInterrupt" in cells[train]["output"], cells[train]["output"][-2000:]
    done = _metrics_iterations(run_dir)
    assert 3 <= len(done) < iterations and done == list(range(len(done))), done

    # resume = True at the end of the parameters cell, run it, then the training cell and all below
    params = page.locator(f"{PANEL} .jp-CodeCell").first
    params.locator(".cm-content").click()
    page.keyboard.press("Control+End")
    page.keyboard.type("\nresume = True")
    page.keyboard.press("Shift+Enter")
    page.locator(f"{PANEL} .jp-CodeCell").nth(train).locator(".jp-InputPrompt").click()
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator('.lm-Menu-item[data-command="notebook:run-all-below"]').click()
    time.sleep(2)
    cells = _wait_all_ran(page, RUN_TIMEOUT_S)
    page.locator(".jp-StatusBar-TextItem", has_text="| Idle").first.wait_for(timeout=60_000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "quickstart-resumed.png"))
    errors = list(page.errors)
    page.close()
    assert "KeyboardInterrupt" not in cells[train]["output"] and "Error" not in cells[train]["output"], cells[train]["output"][-2000:]
    assert _metrics_iterations(run_dir) == list(range(iterations))  # each iteration once, none repeated
    # an iteration trained but not yet recorded when the interrupt came is rebuilt from its adapter's manifest
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == iterations and summary["final_version"] == iterations
    assert errors == []
