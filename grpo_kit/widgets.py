"""Live figures in JupyterLab: ``FigureWidget`` s that follow a run, updated in place per record.

``LivePlots`` shows ``FigureWidget`` s that follow a run in JupyterLab; under papermill, in a console
or in plain python it only collects records, and :meth:`LivePlots.show` displays static figures at
the end. An update recomputes only each figure's trace arrays (:data:`grpo_kit.figures.FIGURE_DATA`)
from a thinned view of the history (:func:`grpo_kit.series.thin_records`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from .figures import EPISODE_FIGURE_DATA, EPISODE_FIGURES, FIGURE_DATA, FIGURES, Arrays, has_episodes
from .series import Record, thin_indices, thin_records

ALL_FIGURES = {**FIGURES, **EPISODE_FIGURES}
"""Every figure :class:`LivePlots` can draw, by name: the run's and a multi-turn run's episode figures."""
ALL_FIGURE_DATA = {**FIGURE_DATA, **EPISODE_FIGURE_DATA}


def notebook_frontend() -> bool:
    """True in an IPython kernel driven by a notebook UI that can show widgets.

    JupyterLab, Notebook 7 and VS Code send the cell id in each execute request's metadata;
    papermill / nbclient and the consoles send none, and plain python has no kernel at all.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or not hasattr(kernel, "get_parent"):
        return False
    parent = kernel.get_parent("shell") or {}
    return bool(parent.get("metadata"))


SUBSHELL_WAIT_S = 5.0
"""How long :class:`LivePlots` waits for the frontend to set up the widgets' comm subshell."""
_subshell_wait_failed = False


def await_comm_subshell(timeout: float = SUBSHELL_WAIT_S, settle: float = 0.3) -> bool | None:
    """Wait until the notebook frontend has set up its subshell for widget comms; True once it has.

    Why: JupyterLab 4.4 and later send widget comms over kernel subshells (``commsOverSubshells``
    setting, default one subshell per comm target). The first widget comm of a kernel makes it send
    a ``create_subshell_request`` on the control channel, and ipykernel 7 answers every control
    request with a busy/idle pair of status messages on IOPub. JupyterLab's status bar and
    jupyter_server's ``execution_state`` take any status message as the kernel's, so from that
    ``idle`` on they say "Idle" until the running cell ends (jupyter/jupyter_client#838: control
    requests should not publish execution state). Called in the short cell that first shows
    widgets, this lets the pair go out before the next, long cell starts.

    It reads ipykernel 7's subshell manager (``kernel.shell_channel_thread.manager.list_subshell()``,
    what the ``%subshell`` magic lists). Returns None where the kernel has no subshells (ipykernel < 7,
    or not in a kernel), True when a subshell exists (at once if one already did: an earlier widget),
    False after ``timeout`` seconds without one (a frontend that does not use subshells for comms);
    it waits that long once per kernel.
    """
    global _subshell_wait_failed
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    kernel = getattr(get_ipython(), "kernel", None)
    manager = getattr(getattr(kernel, "shell_channel_thread", None), "manager", None)
    if manager is None or not hasattr(manager, "list_subshell"):
        return None
    if manager.list_subshell():
        return True
    if _subshell_wait_failed:
        return False
    deadline = time.monotonic() + timeout
    while not manager.list_subshell():
        if time.monotonic() > deadline:
            _subshell_wait_failed = True
            return False
        time.sleep(0.05)
    time.sleep(settle)  # the control thread publishes its idle status just after creating the subshell
    return True


def _figure_widget(fig: go.Figure) -> go.Figure | None:
    """``go.FigureWidget(fig)``, or None where it cannot be made (plotly >= 6 needs anywidget)."""
    try:
        return go.FigureWidget(fig)
    except Exception:  # ImportError without anywidget; whatever an odd widget stack raises outside a kernel
        return None


_TRACE_ARRAYS = ("x", "y", "base", "text", "customdata")


def update_in_place(fig: go.Figure, fresh: go.Figure | list[Arrays], build: Callable[[], go.Figure] | None = None) -> None:
    """Copy the data arrays of ``fresh`` (a figure, or its trace arrays from :data:`FIGURE_DATA`) into
    ``fig`` (a ``FigureWidget`` sends one batched message). When the traces differ in number or name (a
    new span kind appeared; thinning dropped the record where an error kind was first seen, so the
    kinds come in another order) ``fig``'s traces and layout are replaced wholesale from ``fresh`` or,
    given arrays, from ``build()``."""
    if isinstance(fresh, go.Figure):
        arrays = [{k: t[k] for k in _TRACE_ARRAYS if k in t} for t in fresh.data]
        same = len(fig.data) == len(arrays) and all(
            a.type == b.type and a.name == b.name for a, b in zip(fig.data, fresh.data, strict=True))
    else:
        arrays = [{k: v for k, v in t.items() if k in _TRACE_ARRAYS} for t in fresh]
        same = len(fig.data) == len(arrays) and all(
            t.get("name", old.name) == old.name for old, t in zip(fig.data, fresh, strict=True))
    if not same:
        full = fresh if isinstance(fresh, go.Figure) else build()
        fig.data = ()
        fig.add_traces(list(full.data))
        fig.layout = full.layout
        return
    with fig.batch_update():
        for old, new in zip(fig.data, arrays, strict=True):
            for key, val in new.items():
                if val is None:  # a plain figure's unset text or customdata
                    continue
                if old[key] is None and not len(val):
                    continue
                if old[key] is None or len(old[key]) != len(val) or tuple(old[key]) != tuple(val):
                    old[key] = val


LIVE_MAX_POINTS = 800
"""Points per series a live figure draws at most (:func:`thin_records`)."""
LIVE_KEEP_LAST = 200
"""The most recent records a live figure always draws in full."""


class LivePlots:
    """A metrics callback that plots a run as it goes.

    Create it in a notebook cell of its own, before the cell that runs the loop, and hand it to the
    loop as its per-iteration metrics callback::

        live = LivePlots()         # the figures appear under this cell
        ...                        # the run calls live(record) after every iteration
        live.show(result.records)  # adds the final evaluation; static figures where none were live

    In JupyterLab it displays ``FigureWidget`` s at construction and updates them in place on each
    record. The first widgets of a kernel make JupyterLab set up a kernel subshell, whose status
    messages would show the kernel as idle for the rest of the cell (:func:`await_comm_subshell`):
    the constructor waits for that, so a cell of its own ends before the long one starts and the
    status bar says Busy for the whole run. Elsewhere (papermill, a console, plain python, or
    without anywidget) it only collects records, and :meth:`show` displays static figures.
    ``live=True`` forces in-place updates of the held figures (``FigureWidget`` where possible, else
    ``go.Figure``) and ``live=False`` turns them off.

    Multi-turn runs (a task with tools or an environment): ``episodes=True`` adds the episode figures
    (:data:`grpo_kit.figures.EPISODE_FIGURES`: turns, tool calls and errors, tool rate, environment
    and model tokens, end reasons) to the live ones; static figures add them whenever the records
    hold episodes.

    Long runs: the figures draw at most ``max_points`` records, the last ``keep_last`` in full and
    older ones thinned (:func:`thin_records`), and an update recomputes only the trace arrays
    (:data:`FIGURE_DATA`), so its cost stays flat as the history grows (``bench/soak.py`` measures it).
    """

    def __init__(self, records: Iterable[Record] = (), *, live: bool | None = None, names: Sequence[str] | None = None,
                 max_points: int = LIVE_MAX_POINTS, keep_last: int = LIVE_KEEP_LAST, episodes: bool = False):
        thin_indices(0, max_points, keep_last)  # validates the pair
        if max_points < 3:  # thin_records gives evaluations max(2, max_points // 4) and needs one more
            raise ValueError(f"max_points must be >= 3 (evaluations keep two points of their own), got {max_points}")
        self.max_points, self.keep_last = max_points, keep_last
        self.records: list[dict[str, Any]] = [dict(r) for r in records]
        self.explicit = names is not None
        self.names = tuple(names or [*FIGURES, *(EPISODE_FIGURES if episodes else ())])
        unknown = set(self.names) - set(ALL_FIGURES)
        if unknown:
            raise ValueError(f"unknown figure names {sorted(unknown)}; choose from {list(ALL_FIGURES)}")
        frontend = notebook_frontend()
        self._figs: dict[str, go.Figure] | None = None
        self.widgets = False
        """Whether the held figures are ``FigureWidget`` s shown in a notebook frontend."""
        if not (frontend if live is None else live):
            return
        static = self._build()
        self.names = tuple(static)  # a resumed multi-turn run's episode figures too: each is refreshed
        widgets = {name: _figure_widget(fig) for name, fig in static.items()}
        if all(w is not None for w in widgets.values()):
            self._figs = widgets
            if frontend:
                from IPython.display import display

                for w in widgets.values():
                    display(w)
                self.widgets = True
                await_comm_subshell()
            return
        if frontend:
            warnings.warn(
                "live plots need plotly's FigureWidget (install anywidget); showing static figures at the end instead",
                stacklevel=2,
            )
        if live:
            self._figs = static

    @property
    def live(self) -> bool:
        """Whether each record updates the held figures in place."""
        return self._figs is not None

    def _view(self) -> list[Record]:
        return thin_records(self.records, self.max_points, self.keep_last)

    def _build(self) -> dict[str, go.Figure]:
        view = self._view()
        names = self.names
        if not self.explicit and self._figs is None and has_episodes(view):  # static: a multi-turn run's too
            names = tuple(dict.fromkeys([*names, *EPISODE_FIGURES]))
        return {name: ALL_FIGURES[name](view) for name in names}

    @property
    def figures(self) -> dict[str, go.Figure]:
        """The live figures when live; otherwise static figures built from the records so far."""
        return self._figs if self._figs is not None else self._build()

    def __call__(self, record: Record) -> None:
        """Append one metrics record and, when live, refresh every figure in place. A record whose
        iteration is not past the last one held starts a new run (the run cell run again, from
        scratch or resumed): the held records from that iteration on are dropped first (a review found
        the two runs drawn as one, x going 0..4 then back to 0)."""
        it = record.get("iteration")
        if isinstance(it, int) and self.records and isinstance(self.records[-1].get("iteration"), int) \
                and it <= self.records[-1]["iteration"]:
            self.records = [r for r in self.records if not (isinstance(r.get("iteration"), int) and r["iteration"] >= it)]
        self.records.append(dict(record))
        self._refresh()

    def _refresh(self) -> None:
        if self._figs is not None:
            view = self._view()
            for name in self.names:
                update_in_place(self._figs[name], ALL_FIGURE_DATA[name](view), lambda name=name: ALL_FIGURES[name](view))

    def show(self, records: Iterable[Record] | None = None) -> dict[str, go.Figure]:
        """Display static figures of the whole run, unless live widgets already show it; returns them.

        ``records`` (a run's ``result.records``) first replace the records collected so far, and live
        figures are redrawn with them: the loop attaches its final evaluation to the last record after
        the last callback.
        """
        if records is not None:
            self.records = [dict(r) for r in records]
            self._refresh()
        figs = self.figures
        if not self.widgets:
            try:
                from IPython import get_ipython
            except ImportError:
                return figs
            if get_ipython() is not None:
                from IPython.display import display

                for fig in figs.values():
                    display(go.Figure(fig))
        return figs
