"""``python -m grpo_kit.demo`` (``make demo``): the quickstart notebook, executed headless with papermill.

The executed notebook goes to ``<run_dir>/01_quickstart.ipynb`` beside the run's files
(``metrics.jsonl``, ``summary.json``, ``report.html``); ``run_dir`` defaults to ``runs/quickstart``
in the repository. ``-p NAME VALUE`` sets a notebook parameter as papermill's ``-p`` does (the
value is read as bool, None, int or float where it parses as one, else kept a string). The kernel
runs in ``notebooks/``, as in JupyterLab: relative paths in parameters other than ``run_dir`` are
relative to it::

    python -m grpo_kit.demo -p iterations 20 -p engine hf
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from .records import run_files

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
DEFAULT_RUN_DIR = ROOT / "runs" / "quickstart"
SUMMARY_KEYS = ("acc_before", "acc_after", "grpo_wall_s", "iterations", "ratio_mean", "clip_fraction", "kl_final")


def parse_value(text: str) -> Any:
    """A ``-p`` value, typed the way papermill types its own ``-p`` values.

    >>> [parse_value(v) for v in ("True", "None", "20", "1e-3", "hf")]
    [True, None, 20, 0.001, 'hf']
    """
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_kit.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "-p",
        "--parameters",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a notebook parameter, e.g. -p iterations 20 (repeatable)",
    )
    ap.add_argument("--kernel", default="python3", help="Jupyter kernel to execute with (default: python3)")
    ap.add_argument("--log-output", action="store_true", help="also stream the notebook's outputs to the terminal")
    args = ap.parse_args(argv)

    import papermill as pm

    if args.log_output:  # papermill logs cell outputs at INFO level
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = {name: parse_value(value) for name, value in args.parameters}
    run_dir = Path(params.get("run_dir", DEFAULT_RUN_DIR)).resolve()
    params["run_dir"] = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    executed = run_dir / NOTEBOOK.name
    print(f"executing {NOTEBOOK} -> {executed}", flush=True)
    try:
        pm.execute_notebook(
            NOTEBOOK,
            executed,
            parameters=params,
            kernel_name=args.kernel,
            cwd=NOTEBOOK.parent,  # relative paths mean what they mean in JupyterLab
            progress_bar=True,
            log_output=args.log_output,
        )
    except pm.PapermillExecutionError as e:
        print(f"\nthe notebook failed in cell {e.exec_count}: {e.ename}: {e.evalue}\nsee {executed}", file=sys.stderr)
        return 1

    files = run_files(run_dir)
    summary = json.loads(files.summary.read_text())
    print(f"\nexecuted notebook  {executed}")
    print(f"run directory      {run_dir}")
    print(f"report             {files.report}")
    print(f"metrics            {files.metrics}")
    print("summary:")
    for key in SUMMARY_KEYS:
        value = summary.get(key)
        print(f"  {key:14} {value:.4g}" if isinstance(value, float) else f"  {key:14} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
