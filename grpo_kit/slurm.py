"""Rollout and trainer workers as two kinds of Slurm job on one Dask scheduler (dask-jobqueue).

A ``SLURMCluster`` submits identical jobs; the kit needs two kinds (workers advertising
``rollout=1`` and workers advertising ``trainer=1``, see :mod:`grpo_kit.cluster`), and a second
``SLURMCluster`` would start a second scheduler. dask-jobqueue has no documented call for mixed
jobs (dask/dask-jobqueue#378, #381); its clusters are ``SpecCluster`` s, so :func:`slurm_cluster`
puts one ``SLURMJob`` spec per job into ``worker_spec``, each with its role's ``--resources``.

A job that ends (``scancel``, walltime, a node failure) is closed by ``SpecCluster`` once its
worker has been gone for ``distributed.deploy.lost-worker-timeout``; the spec stays, and
:class:`RoleSLURMCluster` re-applies the spec every few seconds, which submits a replacement job
of the same role. The kit's own recovery then takes over: Dask re-runs lost rollout tasks, and the
trainer gang re-forms from the store's last version once a trainer worker is back.
"""

from __future__ import annotations

import logging
import time

from dask_jobqueue import SLURMCluster
from distributed import Client
from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from .cluster import ROLLOUT, THREADS_PLUGIN, TRAINER, ThreadsPlugin, wait_for_role

log = logging.getLogger(__name__)

REPLACE_INTERVAL_MS = 2000
"""How often the cluster re-applies its job specs (submitting a replacement for an ended job)."""

WORKER_ENV = {
    "DASK_DISTRIBUTED__WORKER__DAEMON": "False",  # engines and process groups start child processes
    "TOKENIZERS_PARALLELISM": "false",
}


class RoleSLURMCluster(SLURMCluster):
    """A ``SLURMCluster`` whose ``worker_spec`` holds jobs of several kinds, each kept running:
    a job that ended is replaced by a new job with the same spec."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.periodic_callbacks["grpo-kit-replace-jobs"] = PeriodicCallback(self._keep_jobs, REPLACE_INTERVAL_MS)
        if not self.asynchronous:
            self.loop.add_callback(self.periodic_callbacks["grpo-kit-replace-jobs"].start)

    def _keep_jobs(self) -> None:
        missing = set(self.worker_spec) - set(self.workers)
        if missing and self.status == Status.running:
            log.warning("Slurm jobs %s ended; submitting replacements", sorted(missing))
            self.scale(jobs=len(self.worker_spec))  # same size: re-applies worker_spec (starts what is missing)

    def add_jobs(self, role: str, n: int, **job_kwargs) -> list[str]:
        """Add ``n`` jobs whose workers advertise ``role=1``; ``job_kwargs`` override this cluster's
        job options for them (e.g. ``job_extra_directives=["--gres=gpu:1"]``; :func:`role_options`).
        Returns their names."""
        opts = role_options(self.new_spec["options"], role, job_kwargs)
        names = []
        first = sum(k.startswith(role + "-") for k in self.worker_spec)
        for i in range(first, first + n):
            name = f"{role}-{i}"
            self.worker_spec[name] = {"cls": self.job_cls, "options": {**opts, "job_name": f"grpo-{name}"}}
            names.append(name)
        self.scale(jobs=len(self.worker_spec))
        return names


def thread_exports(threads: int) -> list[str]:
    """The job script's ``export`` lines: non-daemonic workers, and ``threads`` for torch and BLAS."""
    env = {**WORKER_ENV, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "GRPO_KIT_THREADS": threads}
    return [f"export {k}={v}" for k, v in env.items()]


def role_options(cluster_options: dict, role: str, job_kwargs: dict) -> dict:
    """A role's job options: ``job_kwargs`` over the cluster's, where the kit's own settings survive
    a role's lists instead of being replaced by them: ``worker_extra_args`` are the cluster's, the
    role's, then ``--memory-limit 0`` and ``--resources role=1``; ``job_directives_skip`` keeps
    ``--mem``; ``job_script_prologue`` is the cluster's, the exports again with the role's ``cores``
    when it sets them (a later ``export`` wins), then the role's lines.

    >>> o = role_options({"cores": 1, "worker_extra_args": ["--memory-limit", "0"], "job_directives_skip": ["--mem"],
    ...                   "job_script_prologue": ["export A=1"]}, "trainer",
    ...                  {"cores": 4, "worker_extra_args": ["--lifetime", "10h"], "job_directives_skip": ["--exclusive"]})
    >>> o["worker_extra_args"], o["job_directives_skip"], o["job_script_prologue"][-1]
    (['--memory-limit', '0', '--lifetime', '10h', '--memory-limit', '0', '--resources', 'trainer=1'], ['--mem', '--exclusive'], 'export GRPO_KIT_THREADS=4')
    """
    base = dict(cluster_options)
    opts = {**base, **job_kwargs}
    opts["worker_extra_args"] = [*(base.get("worker_extra_args") or []), *(job_kwargs.get("worker_extra_args") or []),
                                 "--memory-limit", "0", "--resources", f"{role}=1"]
    opts["job_directives_skip"] = list(dict.fromkeys(["--mem", *(base.get("job_directives_skip") or []),
                                                      *(job_kwargs.get("job_directives_skip") or [])]))
    opts["job_script_prologue"] = [*(base.get("job_script_prologue") or []),
                                   *(thread_exports(int(job_kwargs["cores"])) if "cores" in job_kwargs else []),
                                   *(job_kwargs.get("job_script_prologue") or [])]
    return opts


def cluster_options(threads_per_worker: int = 1, **jobqueue_kwargs) -> dict:
    """``SLURMCluster``'s options: the user's, with the kit's defaults (one process per job, no
    ``--mem`` request, no worker memory limit, the exports of :func:`thread_exports` for the job's
    ``cores``) kept whatever lists the user passes."""
    kw = {
        "cores": threads_per_worker,
        "processes": 1,
        "memory": "1GB",  # dask-jobqueue requires it; not requested from Slurm, no worker limit (below)
        "scheduler_options": {"dashboard_address": ":0"},
        **jobqueue_kwargs,
    }
    kw["job_directives_skip"] = list(dict.fromkeys(["--mem", *(kw.get("job_directives_skip") or [])]))
    kw["job_script_prologue"] = thread_exports(int(kw["cores"])) + list(kw.get("job_script_prologue") or [])
    kw["worker_extra_args"] = [*(kw.get("worker_extra_args") or []), "--memory-limit", "0"]
    return kw


def slurm_cluster(
    rollout_jobs: int = 1,
    trainer_jobs: int = 1,
    *,
    threads_per_worker: int = 1,
    rollout_job_kwargs: dict | None = None,
    trainer_job_kwargs: dict | None = None,
    timeout: float = 300,
    **jobqueue_kwargs,
) -> Client:
    """A Dask client on one scheduler with ``rollout_jobs`` rollout jobs and ``trainer_jobs``
    trainer jobs on Slurm (one worker per job, ``threads_per_worker`` cores); waits until all
    workers joined. Pass it to :func:`grpo_kit.loop.run` (``client=...``); ``client.cluster`` is the
    :class:`RoleSLURMCluster` (close both when done).

    ``jobqueue_kwargs`` go to ``SLURMCluster`` (``queue``, ``account``, ``walltime``, ``interface``,
    ``job_script_prologue``, ``log_directory``, ...); ``rollout_job_kwargs`` / ``trainer_job_kwargs``
    override them per role (a GPU partition for trainers, say). Defaults: one process per job, no
    ``--mem`` request and no worker memory limit (engines size their own memory), non-daemonic
    workers (``DASK_DISTRIBUTED__WORKER__DAEMON=False`` in the job script).
    """
    cluster = RoleSLURMCluster(n_workers=0, **cluster_options(threads_per_worker, **jobqueue_kwargs))
    client = None
    try:
        cluster.add_jobs(ROLLOUT, rollout_jobs, **(rollout_job_kwargs or {}))
        cluster.add_jobs(TRAINER, trainer_jobs, **(trainer_job_kwargs or {}))
        client = Client(cluster)
        t0 = time.time()
        wait_for_role(client, ROLLOUT, rollout_jobs, timeout=timeout)
        wait_for_role(client, TRAINER, trainer_jobs, timeout=max(1.0, timeout - (time.time() - t0)))
        client.register_plugin(ThreadsPlugin(), name=THREADS_PLUGIN)
    except BaseException:
        if client is not None:  # else it stays the default client, pointing at a closed scheduler
            client.close()
        cluster.close()
        raise
    return client
