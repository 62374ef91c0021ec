"""The HTML report of grpo_kit.report, on a synthetic run directory.

The report is also opened in a real headless Chromium (Debian's ``chromium``): plotly must draw every
figure without a JavaScript error, and a screenshot goes to ``runs/report.png`` for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html import escape as html_escape
from pathlib import Path

import pytest
from synthetic_run import NASTY, episode_account, make_run

from grpo_kit import figures, report

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# ---------------------------------------------------------------- report


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    records = make_run(run_dir)
    path = report.write_report(run_dir)
    return records, path, path.read_text(encoding="utf-8")


def test_report_is_one_self_contained_file(written):
    _, path, text = written
    assert path.name == "report.html" and not path.with_name("report.html.tmp").exists()
    for name in figures.FIGURES:
        assert f'id="fig-{name}"' in text
    assert text.count("* plotly.js v") == 1  # inlined once
    assert not re.search(r"<script[^>]*\bsrc=", text, re.I)  # nothing fetched from anywhere


def test_report_holds_the_numbers_samples_and_config(written):
    records, _, text = written
    final_eval = [r["eval_acc"] for r in records if r["eval_acc"] is not None][-1]
    assert report.format_number(final_eval) == "0.9375"
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
    out = report.write_report(tmp_path / "empty-run", tmp_path / "out" / "r.html")
    text = out.read_text()
    assert out == tmp_path / "out" / "r.html"
    assert all(f'id="fig-{name}"' in text for name in figures.FIGURES)
    assert "no samples recorded" in text


def test_a_single_turn_report_has_no_episodes(written):
    _, _, text = written
    assert 'id="fig-episodes"' not in text and 'class="turn ' not in text
    assert "tool rate" not in text and "per episode" not in text


def test_a_multi_turn_report_shows_its_episodes_as_conversations(tmp_path):
    records = make_run(tmp_path, episodes=True)
    text = report.write_report(tmp_path).read_text(encoding="utf-8")
    for name in [*figures.FIGURES, *figures.EPISODE_FIGURES]:
        assert f'id="fig-{name}"' in text, name
    assert re.search(r'data-key="final turns per episode"><th>[^<]*</th><td>2\.6</td>', text)
    assert re.search(r'data-key="final tool rate"><th>[^<]*</th><td>0\.95</td>', text)
    ends = sum(r["end_error"] for r in records)
    assert f'data-key="episodes ended: error"><th>episodes ended: error</th><td>{ends}</td>' in text
    assert f'<td>{sum(r["end_max_turns"] for r in records):,}</td>' in text.split('data-key="episodes ended: max_turns"')[1]
    samples = text[text.index('<section id="samples">'):]
    # each sampled episode: model turns, the environment's answer set apart, and its counts
    assert samples.count('<div class="turn turn-model">') == 2 * 6 and samples.count('<div class="turn turn-env">') == 6
    env = re.findall(r'<div class="turn turn-env"><div class="who">environment · note</div><pre>([^<]*)</pre>', samples)
    assert env[0] == "noted 4"
    assert "turns 2, tool calls 1, end reason answered" in samples and "tool errors timeout 1" in samples
    # a policy's and an environment's text are hostile: escaped in the model's turn and in the tool's answer
    assert "<script>alert" not in text and "<script>steal" not in text
    assert env[-1] == "&lt;script&gt;steal(&#x27;x&#x27;)&lt;/script&gt; &amp; 2 &lt; 3"
    model = re.findall(r'<div class="turn turn-model"><div class="who">model</div><pre>([^<]*)</pre>', samples)
    assert html_escape(NASTY) in model


def test_an_episode_s_hostile_tool_name_error_and_long_conversation_are_escaped_and_cut(tmp_path):
    name = '<img src=x onerror="alert(1)">'
    messages = [{"role": "assistant", "content": "call"}, {"role": "tool", "name": name, "content": "?"}] * 30
    ep = episode_account(messages=messages, error="get_reward raised <b>boom</b>", end_reason="max_turns")
    make_run(tmp_path, 2, episodes=True)
    (tmp_path / "samples.jsonl").write_text(json.dumps({"iteration": 0, "prompt": "p", "completion": "c",
                                                        "reward": 0.0, "gold": "1", "episode": ep}) + "\n")
    samples = report.write_report(tmp_path).read_text(encoding="utf-8").split('<section id="samples">')[1]
    assert "<img" not in samples and "<b>" not in samples
    assert f"environment · {html_escape(name)}" in samples and "get_reward raised &lt;b&gt;boom&lt;/b&gt;" in samples
    assert samples.count('class="turn ') == report.EPISODE_MAX_MESSAGES and "20 more messages" in samples


def test_a_lone_surrogate_a_policy_wrote_does_not_stop_the_report(tmp_path):
    """Review finding: a completion holding the JSON escape \\ud800 (a reward that parsed it logged the
    field) reached samples.jsonl as a lone surrogate, and writing the report raised UnicodeEncodeError."""
    make_run(tmp_path, 2)
    (tmp_path / "samples.jsonl").write_text(json.dumps({"iteration": 0, "prompt": "p", "completion": "a\ud800b",
                                                        "reward": 0.0, "gold": "1"}) + "\n")
    page = report.write_report(tmp_path).read_text(encoding="utf-8")
    assert "a\\ud800b" in page


def test_what_reward_functions_logged_is_in_the_report(tmp_path, written):
    """``log_metric`` values: a table of each name's final and mean value; ``log_extra`` columns:
    under each sampled completion, escaped (a reward may log the policy's text)."""
    assert '<section id="reward-metrics">' in written[2] and "none logged" in written[2]  # a run without any
    make_run(tmp_path, 4, partial_last_line=False)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for i, r in enumerate(recs):
        r["reward_metrics"] = {"progress": i / 4, **({"judge_s": 2.0} if i == 3 else {})}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    samples = [{"iteration": 3, "prompt": "p", "completion": "c", "reward": 1.0, "gold": "1",
                "extra": {"marked": True, "quote": NASTY}}]
    (tmp_path / "samples.jsonl").write_text(json.dumps(samples[0]) + "\n")
    text = report.write_report(tmp_path).read_text(encoding="utf-8")
    assert report.reward_metrics(recs) == {"progress": {"final": 0.75, "mean": 0.375, "iterations": 4},
                                           "judge_s": {"final": 2.0, "mean": 2.0, "iterations": 1}}
    table = text.split('<section id="reward-metrics">')[1].split("</section>")[0]
    assert re.search(r'data-key="progress"><th>progress</th><td class="num">0\.75</td><td class="num">0\.375</td>'
                     r'<td class="num">4</td>', table)
    logged = text.split('<section id="samples">')[1]
    assert re.search(r'data-key="marked"><th>marked</th><td>true</td>', logged)
    assert html_escape(NASTY) in logged and "<script>alert" not in text


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
    assert report.format_number(value) == text


def test_report_renders_in_headless_chromium(written, tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI: apt-get install -y chromium")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    _, path, _ = written
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
    assert drawn == set(figures.FIGURES), drawn
    shot = ROOT / "runs" / "report.png"
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    snap = subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1400,4000", url], capture_output=True, text=True, timeout=180
    )
    assert snap.returncode == 0 and shot.stat().st_size > 50_000, snap.stderr[-3000:]


def test_wall_time_is_the_loops_clock_not_the_gap_between_sessions():
    """Review finding: two 10 s iterations two days apart (a resumed run) reported 172,810 s."""
    day = 86400.0
    recs = [{"iteration": 0, "grpo_wall_s": 10.0, "spans": [{"name": "generate", "start": 0.0, "end": 10.0}]},
            {"iteration": 1, "grpo_wall_s": 20.0, "spans": [{"name": "generate", "start": 2 * day, "end": 2 * day + 10}]}]
    assert report.final_numbers(recs)["wall time (s)"] == 20.0
    old = [{k: v for k, v in r.items() if k != "grpo_wall_s"} for r in recs]  # records without the loop's clock
    assert report.final_numbers(old)["wall time (s)"] == 2 * day + 10


def test_final_and_best_eval_accuracy_count_every_evaluation_of_a_record():
    """Versions 2 and 4 evaluated during one iteration: the record's fields keep only the last to
    finish; the headline numbers read both, the newest version's as final."""
    from grpo_kit import evals

    recs = [{"iteration": i, "version": i + 1, "spans": [], "eval_acc": None} for i in range(6)]
    for v, acc in ((4, 0.55), (2, 0.70)):  # version 2's finished last
        evals.attach(recs[5], {"version": v, "acc": acc, "lenient_acc": acc, "iteration": 5, "start": 0.0, "end": 1.0})
    nums = report.final_numbers(recs)
    assert nums["best eval accuracy"] == 0.70 and nums["final eval accuracy"] == 0.55
    assert nums["final eval accuracy (lenient)"] == 0.55
