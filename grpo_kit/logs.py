"""Where worker output goes: a log file per Dask worker in the run directory, errors still in the notebook.

A LocalCluster's workers are child processes of the notebook kernel and inherit its stdout and
stderr, which ipykernel captures at the file-descriptor level and shows under the running cell.
A quickstart run printed about 40 vLLM start-up lines, FutureWarnings, Triton notices, progress
bars of model loads and two vLLM warnings per training step there. :class:`WorkerLogs`, a worker
plugin (:func:`route_worker_logs`), points each worker's file descriptors 1 and 2 at
``<directory>/<worker name>.log``, so everything a worker prints, from Python or from C++, lands
in that file; log records at ERROR and above, from any logger, are also written to the stream the
worker inherited, so they still show in the cell. Exceptions of tasks reach the notebook through
Dask as before. A worker that its nanny restarts gets the plugin again and appends to its file.
``loop.run`` does this for every run, into :func:`run_log_dir` (``worker_logs=False`` opts out); a
later run on the same client moves the workers' output to its own directory.

:func:`reload_misses` filters the two warnings that vLLM's weight reload (the vLLM engine's merged
LoRA mode, once per training step) logs for layers that hold no checkpoint weights by design, and
collects any other layer that got none, for the engine to raise on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from distributed import Client, WorkerPlugin

PLUGIN = "grpo-kit-logs"
"""The prefix of the worker plugin's name; the name ends with the directory it routes to."""
ECHO_FORMAT = "%(levelname)s %(name)s: %(message)s"
RUN_LOGS = "logs"
"""The folder of a run directory that ``loop.run`` sends the workers' output to."""


def run_log_dir(run_dir: str | os.PathLike) -> Path:
    """Where ``loop.run`` sends the workers' output for a run in ``run_dir``: ``<run_dir>/logs``.

    >>> run_log_dir("runs/tiny").as_posix()
    'runs/tiny/logs'
    """
    return Path(run_dir) / RUN_LOGS


def route_worker_logs(client: Client, directory: str | os.PathLike, *, quiet: bool = False) -> Path:
    """Send the output of every worker of ``client`` (now and later ones) to ``<directory>/<worker>.log``.

    Returns the directory (absolute); unless ``quiet``, prints one line that says where the logs go.
    Routing again to the same directory changes nothing (a notebook routes from its cluster cell, so
    the workers' start-up output lands there too, and ``loop.run`` routes again); another directory
    replaces the last one. :func:`unroute_worker_logs` gives the workers their own streams back.
    The directory must be writable by the workers (a local cluster's workers share this machine's
    file system); a worker that cannot open its file keeps printing where it did.
    """
    directory = Path(directory).resolve()
    name = f"{PLUGIN}:{directory}"
    routed = routed_plugins(client)
    if routed != [name]:  # already routed there: a second registration would tear the redirection down and redo it
        for other in routed:  # another directory (an earlier run on this client): its files stop growing
            client.unregister_worker_plugin(other)
        client.register_plugin(WorkerLogs(str(directory)), name=name)
    if not quiet:
        print(f"worker logs (vLLM, transformers, warnings): {directory}/<worker>.log; errors also show here")
    return directory


def routed_plugins(client: Client) -> list[str]:
    """The names of the log plugins registered on ``client``'s scheduler (one per routed directory)."""
    return client.run_on_scheduler(
        lambda dask_scheduler, prefix=PLUGIN: [n for n in dask_scheduler.worker_plugins if n.startswith(prefix)]
    )


def unroute_worker_logs(client: Client) -> None:
    """Undo :func:`route_worker_logs`: the workers print to the streams they inherited again."""
    for name in routed_plugins(client):
        client.unregister_worker_plugin(name)


def _file_name(name: object) -> str:
    """A worker name as a file name.

    >>> _file_name("rollout-0"), _file_name("tcp://127.0.0.1:4000")
    ('rollout-0', 'tcp___127.0.0.1_4000')
    """
    return re.sub(r"[^\w.-]", "_", str(name)) or "worker"


class WorkerLogs(WorkerPlugin):
    """Redirects a worker process's stdout and stderr (file descriptors 1 and 2) to a log file."""

    def __init__(self, directory: str):
        self.directory = directory
        self._saved: tuple[int, int] | None = None
        self._echo: ErrorEcho | None = None
        self._buffering = False

    def setup(self, worker) -> None:
        path = Path(self.directory) / f"{_file_name(worker.name)}.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:  # e.g. a remote worker without this path: keep its output where it was
            logging.getLogger(__name__).error("worker %s cannot write its log to %s: %s", worker.name, path, e)
            return
        os.environ.setdefault("VLLM_LOGGING_COLOR", "0")  # a file, not a terminal: no colour codes
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # a worker's stdout is a pipe, block-buffered: a worker killed outright (memory limit, OOM, a
        # segfault) lost its last prints, the lines before the crash (a review); line by line now
        if callable(getattr(sys.stdout, "reconfigure", None)):  # (a replaced stdout may have none)
            self._buffering = sys.stdout.line_buffering
            sys.stdout.reconfigure(line_buffering=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"==== {stamp} worker {worker.name} (pid {os.getpid()}, {worker.address})", flush=True)
        # errors go on to the kernel's stream (the notebook cell), as they did before the redirect
        self._echo = ErrorEcho(os.fdopen(os.dup(self._saved[1]), "w", buffering=1), prefix=f"[worker {worker.name}] ")
        self._echo.install()

    def teardown(self, worker) -> None:
        if self._echo is not None:
            self._echo.uninstall()
            self._echo = None
        if self._saved is not None:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            if callable(getattr(sys.stdout, "reconfigure", None)):
                sys.stdout.reconfigure(line_buffering=self._buffering)
            os.dup2(self._saved[0], 1)
            os.dup2(self._saved[1], 2)
            for fd in self._saved:
                os.close(fd)
            self._saved = None


class ErrorEcho:
    """A log-record factory that also writes every record at ERROR or above to ``stream``.

    A factory sees the records of every logger, whatever its handlers and ``propagate``: vLLM and
    transformers give their loggers their own handlers (on stdout, here the log file) and do not
    propagate to the root logger. vLLM installs its own factory on top of the current one, which
    keeps calling this one.
    """

    def __init__(self, stream, prefix: str = ""):
        self.stream, self.prefix = stream, prefix
        self.formatter = logging.Formatter(ECHO_FORMAT)
        self.active = False
        self._inner = None

    def install(self) -> None:
        self._inner = logging.getLogRecordFactory()
        logging.setLogRecordFactory(self)
        self.active = True

    def uninstall(self) -> None:
        self.active = False  # a factory installed over this one (vLLM's) still calls it: it passes through
        if logging.getLogRecordFactory() is self:
            logging.setLogRecordFactory(self._inner)

    def __call__(self, *args, **kwargs) -> logging.LogRecord:
        record = self._inner(*args, **kwargs)
        if self.active and record.levelno >= logging.ERROR:
            try:
                self.stream.write(self.prefix + self.formatter.format(record) + "\n")
                self.stream.flush()
            except Exception:  # noqa: BLE001 - logging must never fail the caller
                pass
        return record


# ----------------------------------------------------------------------------- vLLM weight reloads

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's layerwise weight reload (``reload_weights``)."""
RELOAD_MISS = "%s: Failed to load weights"
"""Its warning, per layer, when a reload put no tensor into a layer that has weights."""
NO_CHECKPOINT_WEIGHTS = re.compile(r"\w*RotaryEmbedding|ParallelLMHead")
"""Layers that get no tensor from a checkpoint by design: rotary embeddings (their cos/sin cache is
computed) and a language-model head tied to the input embeddings (the tiny model's, Qwen3-0.6B's:
it shares the embedding's weight). vLLM puts their previous tensors back, which is right: the kit's
adapters never change them."""


class ReloadMisses(logging.Filter):
    """Drops vLLM's reload warning for :data:`NO_CHECKPOINT_WEIGHTS` layers; lists every other layer
    it names in ``unexpected`` (and lets that warning through)."""

    def __init__(self):
        super().__init__()
        self.expected: list[str] = []
        self.unexpected: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_MISS or not record.args:
            return True
        layer = str(record.args[0] if isinstance(record.args, tuple) else record.args)
        if NO_CHECKPOINT_WEIGHTS.fullmatch(layer):
            self.expected.append(layer)
            return False
        self.unexpected.append(layer)
        return True


@contextlib.contextmanager
def reload_misses(logger: str = RELOAD_LOGGER) -> Iterator[ReloadMisses]:
    """Filter vLLM's per-layer reload warnings for the block (:class:`ReloadMisses`)::

    with reload_misses() as misses:
        llm.collective_rpc("reload_weights", ...)
    if misses.unexpected:
        raise RuntimeError(...)
    """
    misses = ReloadMisses()
    target = logging.getLogger(logger)
    level = target.level
    # the warnings must be created to be seen, whatever vLLM's level is: VLLM_LOGGING_LEVEL=ERROR (which
    # ``import trl`` sets in the environment) would otherwise drop them before the filter
    target.setLevel(logging.WARNING)
    target.addFilter(misses)
    try:
        yield misses
    finally:
        target.removeFilter(misses)
        target.setLevel(level)
