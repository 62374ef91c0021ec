"""Batch execution: one papermill run of a notebook per grid point, the runs in parallel as Dask tasks.

:func:`sweep` expands a grid (``{"lr": [1e-3, 4e-3], "kl_beta": [0.0, 0.04]}``) into its points,
executes the notebook once per point with ``{**base_params, **point, "run_dir": <out_dir>/<name>}``
injected as papermill parameters, and collects every run's ``summary.json``: the notebook takes a
``run_dir`` parameter and leaves ``summary.json`` there, as the quickstart and the GSM8K notebook do.
The executed notebook goes to ``<out_dir>/<name>.ipynb``, beside its run directory ``<out_dir>/<name>/``;
the kernel runs in the notebook's directory, as in JupyterLab, so relative paths mean the same.

Each execution is a Dask task: on the given client, or on a ``LocalCluster`` of ``max_parallel``
worker processes started for the sweep. Those are non-daemonic, as in :func:`grpo_kit.cluster.connect`:
the kernel papermill starts is an ordinary subprocess (it starts the run's own LocalCluster), but a
task is then also free to use multiprocessing itself. A tiny run keeps about two cores busy (its
rollout worker and its trainer worker), hence the default of one run per two cores.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dask
import plotly.graph_objects as go
from distributed import Client, LocalCluster, as_completed
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from .records import run_files

METRICS = ("acc_after", "kl_final", "clip_fraction", "grpo_wall_s")
"""summary.json keys :func:`sweep_figure` compares by default."""


class SweepError(RuntimeError):
    """Some grid points failed; ``results`` holds every point's result, the failed ones with ``error`` set."""

    def __init__(self, message: str, results: list[dict]):
        super().__init__(message)
        self.results = results


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the last axis varying fastest.

    >>> grid_points({"lr": [1e-3, 4e-3], "kl_beta": [0.0]})
    [{'lr': 0.001, 'kl_beta': 0.0}, {'lr': 0.004, 'kl_beta': 0.0}]
    """
    for key, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"grid[{key!r}] must be a non-empty list of values, got {values!r}")
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))]


def point_name(point: Mapping[str, Any]) -> str:
    """A file-name-safe name for a grid point.

    >>> point_name({"lr": 0.001, "kl_beta": 0.0, "loss_type": "dr_grpo"})
    'lr=0.001_kl_beta=0.0_loss_type=dr_grpo'
    """
    name = "_".join(f"{k}={v}" for k, v in point.items()) or "default"
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "-", name)


def run_point(notebook: str, output: str, params: dict[str, Any], cwd: str, kernel_name: str) -> dict[str, Any]:
    """Execute one notebook with papermill (the Dask task); returns the run's summary and timings.

    A cell that raises is reported in ``error`` (the executed notebook shows where); anything
    else (a kernel that dies, a missing notebook) fails the task.
    """
    import papermill as pm

    start = time.time()
    error = None
    try:
        pm.execute_notebook(notebook, output, parameters=params, kernel_name=kernel_name, cwd=cwd, progress_bar=False)
    except pm.PapermillExecutionError as e:
        error = f"{e.ename}: {e.evalue}"
    summary_path = run_files(params["run_dir"]).summary
    if error is None and not summary_path.is_file():
        error = f"the notebook finished but wrote no {summary_path}"
    summary = json.loads(summary_path.read_text()) if error is None else {}
    end = time.time()
    return {"summary": summary, "error": error, "start": start, "end": end, "wall_s": end - start}


def default_parallelism() -> int:
    """One run per two CPU cores (a run's rollout and trainer workers each keep a core busy)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // 2)


def sweep(
    notebook: str | os.PathLike,
    grid: Mapping[str, Sequence[Any]],
    base_params: Mapping[str, Any] | None = None,
    out_dir: str | os.PathLike = "runs/sweep",
    *,
    client=None,
    max_parallel: int | None = None,
    kernel_name: str = "python3",
    raise_errors: bool = True,
) -> list[dict[str, Any]]:
    """Execute ``notebook`` once per grid point, at most ``max_parallel`` at a time, as Dask tasks.

    Returns one dict per point, in grid order: ``name``, ``point``, ``params`` (all injected
    parameters), ``notebook`` (the executed copy), ``run_dir``, ``summary`` (its summary.json),
    ``error`` (None, or the failing cell's exception), ``start``/``end``/``wall_s``. With
    ``raise_errors`` a failed point raises :class:`SweepError` once every point has finished.
    """
    notebook = Path(notebook).resolve()
    if not notebook.is_file():
        raise FileNotFoundError(f"no notebook {notebook}")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    points = grid_points(grid)
    names = [point_name(p) for p in points]
    if len(set(names)) < len(names):
        raise ValueError(f"grid points share a name: {names}")
    max_parallel = default_parallelism() if max_parallel is None else max_parallel
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
    jobs = [
        {
            "name": name,
            "point": point,
            "params": {**(base_params or {}), **point, "run_dir": str(out / name)},
            "notebook": str(out / f"{name}.ipynb"),
            "run_dir": str(out / name),
        }
        for name, point in zip(names, points, strict=True)
    ]

    with dask.config.set({"distributed.worker.daemon": False}):
        own = client is None
        if own:
            cluster = LocalCluster(
                n_workers=min(max_parallel, len(jobs)),
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address="127.0.0.1:0",
                memory_limit=0,
            )
            client = Client(cluster)
        try:
            results = _execute(client, jobs, notebook, kernel_name, max_parallel)
        finally:
            if own:
                client.close()
                cluster.close()

    failed = [r for r in results if r["error"]]
    if failed and raise_errors:
        lines = "\n".join(f"  {r['name']}: {r['error']} (see {r['notebook']})" for r in failed)
        raise SweepError(f"{len(failed)} of {len(results)} grid points failed:\n{lines}", results)
    return results


def _execute(client: Client, jobs: list[dict], notebook: Path, kernel_name: str, max_parallel: int) -> list[dict]:
    """Submit the jobs, keeping at most ``max_parallel`` in flight; results in job order."""
    waiting = list(enumerate(jobs))[::-1]
    running = as_completed()
    job_of = {}

    def launch() -> None:
        i, job = waiting.pop()
        fut = client.submit(
            run_point,
            str(notebook),
            job["notebook"],
            job["params"],
            str(notebook.parent),
            kernel_name,
            key=f"sweep-{job['name']}-{uuid.uuid4().hex[:8]}",
            pure=False,
        )
        job_of[fut.key] = i
        running.add(fut)

    for _ in range(min(max_parallel, len(jobs))):
        launch()
    results: list[dict] = [{}] * len(jobs)
    for fut in running:
        i = job_of[fut.key]
        if fut.status == "error":
            exc = fut.exception()
            res = {"summary": {}, "error": f"{type(exc).__name__}: {exc}", "start": None, "end": None, "wall_s": None}
        else:
            res = fut.result()
        results[i] = {**jobs[i], **res}
        if waiting:
            launch()
    return results


def table(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per grid point (its values, its summary, its error), for a DataFrame."""
    return [{"name": r["name"], **r["point"], **r["summary"], "error": r["error"]} for r in results]


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _axis_value(v: Any) -> Any:
    return v if _is_num(v) else str(v)


def sweep_figure(
    results: Sequence[Mapping[str, Any]],
    x: str,
    color: str | None = None,
    metrics: Sequence[str] = METRICS,
) -> go.Figure:
    """One panel per summary metric against grid axis ``x``, one line per value of axis ``color``.

    Failed points and missing values are left out. A positive numeric ``x`` spanning a factor of
    ten or more gets a log axis.
    """
    ok = [r for r in results if not r.get("error")]
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for r in ok:
        groups.setdefault(r["point"].get(color) if color else None, []).append(r)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=list(metrics), horizontal_spacing=0.07)
    palette = qualitative.Plotly
    for g, (value, rows) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        rows = sorted(rows, key=lambda r: (str(type(r["point"].get(x))), r["point"].get(x)))
        name = f"{color}={value}" if color else "runs"
        for m, metric in enumerate(metrics):
            pts = [(r["point"].get(x), r["summary"].get(metric), r["name"]) for r in rows]
            pts = [p for p in pts if _is_num(p[1]) and math.isfinite(p[1])]
            fig.add_trace(
                go.Scatter(
                    x=[_axis_value(p[0]) for p in pts],
                    y=[p[1] for p in pts],
                    text=[p[2] for p in pts],
                    mode="lines+markers",
                    name=name,
                    legendgroup=name,
                    showlegend=m == 0,
                    marker=dict(color=palette[g % len(palette)], size=9),
                    line=dict(color=palette[g % len(palette)]),
                    hovertemplate=f"%{{text}}<br>{metric}: %{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=m + 1,
            )
    xs = [r["point"].get(x) for r in ok]
    numeric = bool(xs) and all(_is_num(v) for v in xs)
    log = numeric and min(xs) > 0 and max(xs) / min(xs) >= 10
    fig.update_xaxes(title_text=x, type="log" if log else None)
    fig.update_layout(
        title=f"Sweep: {len(ok)} of {len(results)} runs" + (f", by {color}" if color else ""),
        template="plotly_white",
        height=380,
        width=max(600, 330 * len(metrics)),
        legend=dict(orientation="h", yanchor="bottom", y=1.1, xanchor="right", x=1),
        margin=dict(l=50, r=30, t=90, b=50),
    )
    return fig
