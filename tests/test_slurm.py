"""The kit on a real single-node Slurm (scripts/slurm.sh) through dask-jobqueue: rollout and trainer
workers are two kinds of Slurm job on one Dask scheduler (grpo_kit.slurm.slurm_cluster), all on
127.0.0.1. Faults are real ``scancel`` s of a rollout job and of a trainer job mid-run."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from grpo_kit import cluster as cl
from grpo_kit import config, loop
from grpo_kit.adapters import AdapterStore
from grpo_kit.testing import assert_run_exact

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]


def _slurm_up() -> str | None:
    """Brings Slurm up (idempotent); returns why it cannot run here, or None."""
    running = shutil.which("srun") and subprocess.run(["srun", "--immediate=10", "hostname"], capture_output=True,
                                                        timeout=30).returncode == 0
    if running:
        return None
    if os.geteuid() != 0:
        return "Slurm is not running and scripts/slurm.sh needs root to install and start it"
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "no apt-get to install Debian's slurm-wlm and munge"
    out = subprocess.run(["bash", str(ROOT / "scripts/slurm.sh"), "up"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"scripts/slurm.sh up failed:\n{out.stdout}\n{out.stderr}"
    return None


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    why = _slurm_up()
    if why:
        pytest.skip(why)
    from grpo_kit.slurm import slurm_cluster

    logs = tmp_path_factory.mktemp("slurm-logs")
    c = slurm_cluster(
        rollout_jobs=1, trainer_jobs=1, interface="lo", walltime="00:30:00", log_directory=str(logs),
        scheduler_options={"dashboard_address": "127.0.0.1:0"},
        job_script_prologue=[f"export PYTHONPATH={ROOT}"],  # the checkout under test, not an installed kit
    )
    yield c
    cl.shutdown(c)


def _cfg(tmp_path, **kw):
    base = dict(engine="hf", iterations=3, eval_every=0, eval_size=8, prompts_per_step=4, group_size=4,
                max_new_tokens=32, run_dir=str(tmp_path / "run"), collective_timeout_s=30, lr=1e-3, world_size=1)
    base.update(kw)
    return config.profile("tiny", **base)


def _jobs(client) -> dict[str, str]:
    """Role -> Slurm job id of each live worker (read inside the worker)."""
    info = client.run(lambda dask_worker: (dask_worker.name, os.environ.get("SLURM_JOB_ID")))
    return dict(info.values())


def _scancel_when(client, part: str, done: list, timeout: float = 240):
    """scancel the Slurm job of the worker running a task whose key contains ``part``."""

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline:
            for worker, keys in client.processing().items():
                if any(part in str(k) for k in keys):
                    name, job = client.run(lambda dask_worker: (dask_worker.name, os.environ["SLURM_JOB_ID"]),
                                           workers=[worker])[worker]
                    subprocess.run(["scancel", job], check=True)
                    done.append((name, job))
                    return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_cluster_that_does_not_start_leaves_no_client_behind(monkeypatch):
    """Review finding: a start that timed out closed the cluster but left its Client open, the
    session's default client pointing at a closed scheduler. No job is submitted (0 of each)."""
    from grpo_kit import slurm

    made = []

    def never(client, role, n, timeout=None):
        made.append(client)
        raise TimeoutError(f"no {role} worker came")

    monkeypatch.setattr(slurm, "wait_for_role", never)
    with pytest.raises(TimeoutError, match="no rollout worker came"):
        slurm.slurm_cluster(rollout_jobs=0, trainer_jobs=0, interface="lo", timeout=1,
                            scheduler_options={"dashboard_address": "127.0.0.1:0"})
    assert len(made) == 1 and made[0].status == "closed"


def test_a_roles_own_job_options_keep_the_kits_settings():
    """Review finding: a role's worker_extra_args, job_directives_skip, job_script_prologue or cores
    replaced the kit's (the worker got dask-jobqueue's 0.93 GiB memory limit and Slurm --mem=954M,
    daemonic workers, one torch thread on a 16-core job). The job scripts as dask-jobqueue writes
    them; nothing is submitted."""
    from dask_jobqueue.slurm import SLURMJob

    from grpo_kit.slurm import cluster_options, role_options

    base = {k: v for k, v in cluster_options(1, walltime="00:10:00", job_directives_skip=["--exclusive"]).items()
            if k != "scheduler_options"}  # the cluster's, not a job's
    roles = {"rollout": {"job_script_prologue": ["module load cuda"], "job_extra_directives": ["--gres=gpu:1"]},
             "trainer": {"cores": 16, "worker_extra_args": ["--lifetime", "10h"], "job_directives_skip": ["-o"]}}
    scripts = {role: SLURMJob(scheduler="tcp://127.0.0.1:8786", name=role, **role_options(base, role, kw)).job_script()
               for role, kw in roles.items()}
    for role, script in scripts.items():
        assert "--mem" not in script.replace("--memory-limit", "") and "--memory-limit 0 --resources" in script
        assert f"--resources {role}=1" in script and "export DASK_DISTRIBUTED__WORKER__DAEMON=False" in script
    assert "module load cuda" in scripts["rollout"] and "--gres=gpu:1" in scripts["rollout"]
    trainer = scripts["trainer"]
    assert "--cpus-per-task=16" in trainer and "--nthreads 16" in trainer and "--lifetime 10h" in trainer
    assert trainer.rindex("export GRPO_KIT_THREADS=16") > trainer.rindex("export GRPO_KIT_THREADS=1\n")  # the later wins


def test_workers_are_slurm_jobs_of_two_kinds(client):
    jobs = _jobs(client)
    assert sorted(jobs) == ["rollout-0", "trainer-0"] and all(jobs.values())
    assert len(set(jobs.values())) == 2  # two jobs, one scheduler
    # asked by job id: a killed earlier run's jobs of the same names may still be in the queue
    queue = subprocess.run(["squeue", "-h", "-j", ",".join(jobs.values()), "-o", "%i %j %T"], capture_output=True,
                           text=True, check=True).stdout
    running = {line.split()[0]: line.split()[1] for line in queue.splitlines() if line.endswith("RUNNING")}
    assert running == {jobs["rollout-0"]: "grpo-rollout-0", jobs["trainer-0"]: "grpo-trainer-0"}
    assert cl.workers_with(client, cl.ROLLOUT) and cl.workers_with(client, cl.TRAINER)
    addrs = cl.worker_resources(client)
    assert addrs and all(a.startswith("tcp://127.0.0.1:") for a in addrs) and client.scheduler.address.startswith("tcp://127.0.0.1:")
    daemon = client.run(lambda: __import__("multiprocessing").current_process().daemon)
    assert not any(daemon.values())  # engines and process groups may start child processes


def test_loop_runs_on_slurm(tmp_path, client):
    cfg = _cfg(tmp_path)
    res = loop.run(cfg, client=client, progress=False)
    assert [r["iteration"] for r in res.records] == [0, 1, 2]
    assert_run_exact(tmp_path / "run", cfg, AdapterStore(cfg.run.store_root))


def test_scancel_rollout_job_mid_run(tmp_path, client):
    before = _jobs(client)
    cfg = _cfg(tmp_path, iterations=4)
    cancelled = []
    _scancel_when(client, "-rollout-2-", cancelled)
    res = loop.run(cfg, client=client, progress=False)
    assert cancelled and cancelled[0] == ("rollout-0", before["rollout-0"]), "the fault was not injected"
    assert len(res.records) == 4
    print(f"rollout job {before['rollout-0']} cancelled; iteration seconds {[round(r['iter_s'], 1) for r in res.records]}")
    assert_run_exact(tmp_path / "run", cfg, AdapterStore(cfg.run.store_root))
    cl.wait_for_role(client, cl.ROLLOUT, 1)
    assert _jobs(client)["rollout-0"] != before["rollout-0"]  # a replacement job took over


def test_scancel_trainer_job_mid_run(tmp_path, client):
    before = _jobs(client)
    cfg = _cfg(tmp_path, iterations=4, max_restarts=2)
    cancelled = []
    _scancel_when(client, "-train-1-", cancelled)
    res = loop.run(cfg, client=client, progress=False)
    assert cancelled and cancelled[0] == ("trainer-0", before["trainer-0"]), "the fault was not injected"
    assert len(res.records) == 4 and res.summary["gang_restarts"] >= 1
    print(f"trainer job {before['trainer-0']} cancelled; gang restarts {res.summary['gang_restarts']}; "
          f"iteration seconds {[round(r['iter_s'], 1) for r in res.records]}")
    assert_run_exact(tmp_path / "run", cfg, AdapterStore(cfg.run.store_root))
    assert _jobs(client)["trainer-0"] != before["trainer-0"]
