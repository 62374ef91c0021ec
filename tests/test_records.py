"""The run record (grpo_kit.records): the schema the figures and the report read, the JSONL helpers,
and reading a run directory caught mid-write."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from synthetic_run import episode_account, make_run, synthetic_episode_records, synthetic_records

from grpo_kit import records

# ---------------------------------------------------------------- loading


def test_load_run_drops_a_half_written_last_line(tmp_path):
    written = make_run(tmp_path)
    run = records.load_run(tmp_path)
    assert run["records"] == written
    assert run["config"]["loss"]["loss_type"] == "dapo"
    assert run["summary"]["acc_after"] == 0.9375
    assert len(run["samples"]) == 8


def test_load_run_missing_files_and_a_bad_middle_line(tmp_path):
    assert records.load_run(tmp_path / "nothing-yet") == {"records": [], "config": {}, "summary": {}, "samples": []}
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1, "rew\n{"iteration": 2}\n')
    (tmp_path / "summary.json").write_text('{"acc_aft')  # written while we read it
    with pytest.warns(UserWarning, match="line 2"):
        run = records.load_run(tmp_path)
    assert [r["iteration"] for r in run["records"]] == [0, 2]
    assert run["summary"] == {}


def test_read_jsonl_can_stop_at_the_first_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    records.append_jsonl(path, [{"iteration": 0}, {"iteration": 1}])
    with open(path, "a") as f:
        f.write('{"iteration": 2, "rew\n{"iteration": 3}\n')
    assert [r["iteration"] for r in records.read_jsonl(path, stop_at_bad_line=True)] == [0, 1]
    with pytest.warns(UserWarning, match="line 3"):
        assert [r["iteration"] for r in records.read_jsonl(path)] == [0, 1, 3]
    records.write_jsonl(path, [{"iteration": 7}])
    assert records.read_jsonl(path) == [{"iteration": 7}]


def test_a_failed_write_jsonl_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """Review finding: write_jsonl truncated in place, so a full disk on resume kept only part of
    metrics.jsonl (here a write that stops half way with ENOSPC)."""
    import errno
    from pathlib import Path

    path = tmp_path / "metrics.jsonl"
    records.write_jsonl(path, [{"iteration": i} for i in range(3)])

    def disk_full(self, text, *a, **k):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space"):
        records.write_jsonl(path, [{"iteration": i} for i in range(5)])
    monkeypatch.undo()
    assert records.read_jsonl(path) == [{"iteration": i} for i in range(3)] and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_trim_jsonl_streams(tmp_path):
    """Resume trims rollouts.jsonl line by line: a long run's file is never read whole."""
    import tracemalloc

    path = tmp_path / "rollouts.jsonl"
    line = json.dumps({"iteration": 0, "completion_ids": list(range(2000))})
    with open(path, "w") as f:
        for it in range(400):  # ~4 MB
            f.write(line.replace('"iteration": 0', f'"iteration": {it}') + "\n")
        f.write('{"iteration": 400, "completion_ids": [1, 2')  # a half-written last line
    tracemalloc.start()
    kept = records.trim_jsonl(path, lambda r: r["iteration"] < 300)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert kept == 300 and peak < 1_000_000, peak
    lines = path.read_text().splitlines()
    assert len(lines) == 300 and json.loads(lines[-1])["iteration"] == 299


# ---------------------------------------------------------------- the schema

READERS = ("figures.py", "series.py", "report.py")
"""The modules that read records; every key they look up must be declared in records.py."""


RECORD_NAMES = {"r", "rec", "s", "ev", "ep"}
"""What the readers call a record, a span, a sample, an evaluation or an episode account."""
SERIES_HELPERS = {"series", "eval_series", "last_number", "lenient", "total", "peak", "_sum"}
"""Functions the readers hand a record key to."""


def keys_read(path: Path) -> set[str]:
    """String keys ``path`` looks up in a record: ``r.get("k")``, ``r["k"]``, ``series(records, "k")``,
    ``for k in ("k1", "k2")`` and ``keys = ("k1", "k2")``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        args = []
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and getattr(f.value, "id", None) in RECORD_NAMES:
                args = node.args[:1]
            elif getattr(f, "id", None) in SERIES_HELPERS:
                args = node.args
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) in RECORD_NAMES:
            args = [node.slice]
        elif isinstance(node, ast.comprehension) and getattr(node.target, "id", None) == "k":  # for k in ("a", "b")
            args = getattr(node.iter, "elts", [])
        elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["keys"]:
            args = getattr(node.value, "elts", [])
        out |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_every_key_the_readers_look_up_is_declared():
    root = Path(records.__file__).parent
    declared = records.schema_keys()
    not_records = {"final eval accuracy (lenient)", "final train accuracy (lenient)"}  # the report's row names
    for name in READERS:
        read = keys_read(root / name) - not_records
        assert len(read) >= 5, (name, read)
        assert not read - declared, (name, sorted(read - declared))


def test_the_synthetic_run_uses_declared_keys():
    declared = records.schema_keys()
    for recs in (synthetic_records(8), synthetic_episode_records(8)):
        assert not {k for r in recs for k in r} - declared
        assert not {k for r in recs for s in r["spans"] + r.get("evals", []) for k in s} - declared
    assert set(episode_account()) == set(records.EpisodeAccount.__annotations__)


def test_the_episode_account_is_what_the_episode_module_writes():
    """The schema's :class:`EpisodeAccount` and :func:`grpo_kit.episode.summary` name the same keys."""
    from grpo_kit.episode import Episode, summary

    ep = Episode("p0", 0, 0, 0, 1, 0, "4", end_reason="answered",
                 messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### 4"}], prompt_messages=1)
    account = summary(ep)
    assert set(account) == set(records.EpisodeAccount.__annotations__)
    assert account["messages"] == [{"role": "assistant", "content": "#### 4"}]  # after the prompt


def _summary(i: int, episode: dict | None = None):
    from grpo_kit.rollout import RolloutSummary

    return RolloutSummary(prompt_id=f"p{i}", group_id=i // 4, sample_idx=i % 4, version=2, finish_reason="stop",
                          text=f"#### {i}", gold=str(i), prompt_tokens=5, completion_tokens=7, reward=i / 10,
                          episode=episode)


def test_samples_of_keeps_three_spread_over_the_batch():
    rollouts = [_summary(i) for i in range(12)]
    picked = records.samples_of(3, rollouts)
    assert [s["prompt"] for s in picked] == ["p0", "p4", "p8"]
    assert picked[1] == {"iteration": 3, "prompt": "p4", "completion": "#### 4", "reward": 0.4, "gold": "4",
                         "version": 2}  # a single-turn sample: no episode key
    assert [s["prompt"] for s in records.samples_of(0, rollouts[:2])] == ["p0", "p1"]
    assert records.samples_of(0, []) == []
    eps = [_summary(i, episode_account(answer=f"noted {i}")) for i in range(6)]
    picked = records.samples_of(1, eps)
    assert [s["episode"]["messages"][1]["content"] for s in picked] == ["noted 0", "noted 2", "noted 4"]
    assert not {k for s in picked for k in s} - records.schema_keys()
    json.dumps(picked)
    logged = [dataclasses.replace(_summary(i), reward_extra={"marked": i % 2 == 0}) for i in range(3)]
    assert [s["extra"] for s in records.samples_of(2, logged)] == [{"marked": True}, {"marked": False}, {"marked": True}]


def test_run_files():
    files = records.run_files("runs/x")
    assert files.metrics == Path("runs/x/metrics.jsonl") and files.report.name == "report.html"
    assert {files.samples.name, files.rollouts.name, files.config.name, files.summary.name} == {
        "samples.jsonl", "rollouts.jsonl", "config.json", "summary.json"}
    assert json.dumps(records.load_run(files.root)) == json.dumps(
        {"records": [], "config": {}, "summary": {}, "samples": []})
