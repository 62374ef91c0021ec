"""The HTML report of a run: one self-contained file that opens offline (plotly.js inlined once).

It holds every figure of :data:`grpo_kit.figures.FIGURES` (and, for a multi-turn run, of
:data:`~grpo_kit.figures.EPISODE_FIGURES`), the run's headline numbers (:func:`final_numbers`, and
``summary.json``), a few sampled completions (a multi-turn one as its conversation, the environment's
turns set apart from the model's; each with what the reward functions logged for it, ``log_extra``),
the reward functions' ``log_metric`` values (:func:`reward_metrics`) and ``config.json``. Everything a policy or an environment wrote is
escaped: a completion is hostile text.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .figures import all_figures, figure_builders
from .records import load_run, run_files
from .series import EVAL_FIELDS, Record, all_spans, eval_series, last_number, number, series, thin_records

REPORT_MAX_POINTS = 3000
"""Points per series the HTML report draws at most: every iteration of a 3,000-iteration run."""
REPORT_KEEP_LAST = 500
"""The most recent records the report always draws in full."""


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
    evals = eval_series(records, "eval_acc")[1]  # in version order: the last is the newest version's
    spans = all_spans(records)
    iter_s = series(records, "iter_s")[1]

    def total(key: str) -> float | None:
        ys = series(records, key)[1]
        return sum(ys) if ys else None

    def peak(key: str) -> float | None:
        ys = series(records, key)[1]
        return max(ys) if ys else None

    def newest(key: str) -> float | None:  # the newest version's held-out value
        ys = eval_series(records, key)[1] if key in EVAL_FIELDS else series(records, key)[1]
        return ys[-1] if ys else None

    def lenient(name: str, key: str) -> dict[str, Any]:  # runs from before lenient grading have no such key
        return {name: newest(key)} if any(key in r for r in records) else {}

    def sampled() -> dict[str, Any]:  # a run with eval_samples = k (grpo_kit.passk); a greedy-only run has none
        if not any("eval_pass_at_k" in r for r in records):
            return {}
        return {"final eval pass@k": newest("eval_pass_at_k"), "final eval maj@k": newest("eval_maj_acc")}

    def episodes() -> dict[str, Any]:  # a multi-turn run's rows; a single-turn run has none
        if not any("turns_mean" in r for r in records):
            return {}
        ends = {f"episodes ended: {k.removeprefix('end_')}": total(k)
                for k in ("end_answered", "end_max_turns", "end_budget", "end_error")}
        return {
            "final turns per episode": last_number(records, "turns_mean"),
            "final tool calls per episode": last_number(records, "tool_calls_mean"),
            "final tool rate": last_number(records, "tool_rate"),
            "tool errors per episode (run)": _per_episode(records, "tool_errors_mean"),
            "environment tokens": total("env_tokens"),
            **{k: None if v is None else int(v) for k, v in ends.items()},
        }

    return {
        "iterations": len(records),
        "adapter version": last_number(records, "version"),
        "base accuracy": last_number(records, "base_acc"),
        "final eval accuracy": evals[-1] if evals else None,
        **lenient("final eval accuracy (lenient)", "eval_lenient_acc"),
        **sampled(),
        "best eval accuracy": max(evals) if evals else None,
        "final train accuracy": last_number(records, "train_acc"),
        **lenient("final train accuracy (lenient)", "train_lenient_acc"),
        "final reward mean": last_number(records, "reward_mean"),
        "final ratio mean": last_number(records, "ratio_mean"),
        "final clip fraction": last_number(records, "clip_frac"),
        "final KL": last_number(records, "kl_mean"),
        "max staleness": peak("staleness_max"),
        "rejected groups": total("rejected_groups"),
        "tokens": total("tokens"),
        "mean iteration (s)": sum(iter_s) / len(iter_s) if iter_s else None,
        # the loop's own clock, summed over resumed sessions (first span to last would count the time between them)
        "wall time (s)": last_number(records, "grpo_wall_s") if last_number(records, "grpo_wall_s") is not None
        else (max(s[3] for s in spans) - min(s[2] for s in spans) if spans else None),
        **episodes(),
    }


def _per_episode(records: Sequence[Record], key: str) -> float | None:
    """A per-episode mean over the whole run: each record's mean weighted by its episodes."""
    pairs = [(number(r.get(key)), number(r.get("episodes"))) for r in records]
    pairs = [(m, n) for m, n in pairs if m is not None and n]
    n = sum(p[1] for p in pairs)
    return sum(m * k for m, k in pairs) / n if n else None


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


EPISODE_MAX_MESSAGES = 40
"""Messages of a sampled episode the report shows at most (the first ones; the rest are counted)."""


def _episode_html(ep: Mapping[str, Any]) -> str:
    """A sampled episode as its conversation after the prompt: the model's turns and, set apart, the
    environment's answers (``role`` ``"tool"``), each escaped; its counts above them."""
    msgs = [m for m in ep.get("messages") or () if isinstance(m, Mapping)]
    facts = ", ".join(f"{k.replace('_', ' ')} {format_number(ep.get(k))}"
                      for k in ("turns", "tool_calls", "end_reason", "model_tokens", "env_tokens", "env_reward")
                      if ep.get(k) is not None)
    errors = ep.get("tool_errors")
    if isinstance(errors, Mapping) and errors:
        facts += ", tool errors " + ", ".join(f"{k} {format_number(v)}" for k, v in errors.items())
    turns = []
    for m in msgs[:EPISODE_MAX_MESSAGES]:
        env = m.get("role") == "tool"
        who = f"environment · {_clip(m.get('name'), 80)}" if env and m.get("name") else "environment" if env else (
            "model" if m.get("role") == "assistant" else _clip(m.get("role"), 40))
        turns.append(f'<div class="turn {"turn-env" if env else "turn-model"}"><div class="who">{html.escape(who)}</div>'
                     f"<pre>{html.escape(_clip(m.get('content')))}</pre></div>")
    if len(msgs) > EPISODE_MAX_MESSAGES:
        turns.append(f'<p class="none">{len(msgs) - EPISODE_MAX_MESSAGES} more messages</p>')
    error = f'<p class="ep-error">{html.escape(_clip(ep.get("error"), 500))}</p>' if ep.get("error") else ""
    return f'<div class="episode"><p class="meta">{html.escape(facts)}</p>{error}{"".join(turns)}</div>'


def _completion_html(s: Record) -> str:
    ep = s.get("episode")
    body = _episode_html(ep) if isinstance(ep, Mapping) else f"<pre>{html.escape(_clip(s.get('completion')))}</pre>"
    extra = s.get("extra")
    if isinstance(extra, Mapping) and extra:  # what the reward functions logged for it (log_extra)
        body += f'<div class="logged">{_table({k: _clip(v, 500) if isinstance(v, str) else v for k, v in extra.items()}, "extra")}</div>'
    return body


def reward_metrics(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """What the reward functions logged with ``log_metric``: per name, its final value, its mean
    over the iterations that logged it, and how many did."""
    out: dict[str, list[float]] = {}
    for r in records:
        for name, v in (r.get("reward_metrics") or {}).items():
            if number(v) is not None:
                out.setdefault(str(name), []).append(number(v))
    return {name: {"final": vs[-1], "mean": sum(vs) / len(vs), "iterations": len(vs)} for name, vs in out.items()}


def _metrics_html(records: Sequence[Record]) -> str:
    rows = reward_metrics(records)
    if not rows:
        return '<p class="none">none logged</p>'
    body = "".join(f'<tr data-key="{html.escape(k)}"><th>{html.escape(k)}</th>'
                   + "".join(f'<td class="num">{html.escape(format_number(v[c]))}</td>' for c in ("final", "mean", "iterations"))
                   + "</tr>" for k, v in rows.items())
    return ('<table class="reward-metrics"><thead><tr><th>name</th><th>final</th><th>mean</th><th>iterations</th>'
            f"</tr></thead><tbody>{body}</tbody></table>")


def _samples_html(samples: Sequence[Record], n: int) -> str:
    picked = _pick_samples(samples, n)
    if not picked:
        return '<p class="none">no samples recorded</p>'
    rows = "".join(
        f"<tr><td>{html.escape(format_number(s.get('iteration')))}</td>"
        f'<td class="num">{html.escape(format_number(s.get("reward")))}</td>'
        f"<td><pre>{html.escape(_clip(s.get('prompt')))}</pre></td>"
        f"<td>{_completion_html(s)}</td>"
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
.episode .meta { margin: 0 0 6px; font-size: 12px; }
.turn { margin: 4px 0; padding: 4px 8px; border-left: 3px solid; border-radius: 3px; }
.turn-model { border-color: #636efa; background: #f5f6ff; }
.turn-env { border-color: #b8860b; background: #fbf6e9; margin-left: 28px; }
.turn .who { font-size: 11px; color: #666; text-transform: uppercase; letter-spacing: 0.04em; }
.ep-error { color: #b00020; font-size: 12px; margin: 0 0 6px; }
.logged { margin-top: 6px; font-size: 12px; } .logged th { color: #666; font-weight: normal; }
"""


def write_report(run_dir: str | os.PathLike, path: str | os.PathLike | None = None, *, n_samples: int = 6) -> Path:
    """Write one self-contained HTML report of a run (default ``<run_dir>/report.html``) and return its path.

    It holds every figure of :func:`~grpo_kit.figures.figure_builders` (div ids ``fig-<name>``, plotly.js
    inlined once), the final numbers (from the metrics and ``summary.json``), a few sampled completions
    (episodes as conversations) and ``config.json``.
    """
    run = load_run(run_dir)
    out = Path(path) if path is not None else run_files(run_dir).report
    records = run["records"]
    sections = []
    view = thin_records(records, REPORT_MAX_POINTS, REPORT_KEEP_LAST)
    builders = figure_builders(view)
    for i, (name, fig) in enumerate(all_figures(view).items()):
        div = fig.to_html(
            full_html=False,
            include_plotlyjs=(i == 0),
            div_id=f"fig-{name}",
            default_width="100%",
            default_height=f"{fig.layout.height or 450}px",
            config={"displaylogo": False, "responsive": True},
        )
        doc = html.escape((builders[name].__doc__ or "").strip().split("\n")[0])
        sections.append(f'<section class="plot" id="section-{name}">{div}<p class="meta">{doc}</p></section>')
    title = html.escape(Path(run_dir).resolve().name)
    written = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>GRPO run {title}</title><style>{_CSS}</style></head>
<body><main>
<h1>GRPO run {title}</h1>
<p class="meta">{html.escape(str(run_dir))} · {len(records)} iterations · written {written}</p>
<section id="numbers"><h2>Final numbers</h2><div class="columns">
<div><h3>from the metrics</h3>{_table(final_numbers(records), "numbers")}</div>
<div><h3>summary.json</h3>{_table(run["summary"], "numbers summary")}</div></div></section>
{"".join(sections)}
<section id="reward-metrics"><h2>Reward functions' metrics (log_metric)</h2>{_metrics_html(records)}</section>
<section id="samples"><h2>Sampled completions</h2>{_samples_html(run["samples"], n_samples)}</section>
<section id="config"><h2>Configuration</h2><pre>{html.escape(json.dumps(run["config"], indent=2, sort_keys=True))}</pre></section>
</main></body></html>
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8", errors="backslashreplace")  # a lone surrogate a policy wrote (\ud800)
    os.replace(tmp, out)  # a notebook reloading the report never sees half a file
    return out
