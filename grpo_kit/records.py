"""The run record: reading a run directory's files (metrics, config, summary, samples).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file. The last line may be half written (a run in progress): it is dropped;
    an unreadable line elsewhere is skipped with a warning."""
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                warnings.warn(f"{path}: skipping unreadable line {i + 1}", stacklevel=3)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object, or ``{}`` when the file is missing or not (yet) complete."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"records", "config", "summary", "samples"}`` of a run directory; missing files read as empty."""
    d = Path(run_dir)
    return {
        "records": read_jsonl(d / "metrics.jsonl"),
        "config": read_json(d / "config.json"),
        "summary": read_json(d / "summary.json"),
        "samples": read_jsonl(d / "samples.jsonl"),
    }
