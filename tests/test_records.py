"""Reading a run directory (grpo_kit.records), on a synthetic run caught mid-write."""

from __future__ import annotations

import pytest
from synthetic_run import make_run

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
