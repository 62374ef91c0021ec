"""grpo_kit.cluster on a real LocalCluster (worker processes)."""

from __future__ import annotations

import dask
import pytest
from distributed import Client

from grpo_kit import cluster as cl

pytestmark = pytest.mark.timeout(300)


def test_workers_with_never_reads_an_empty_cluster(client):
    """The client's periodic identity refresh (here every 2 ms) lists no workers; a role look-up that
    read the client's cached identity saw none now and then (warm_up then built no engine at all)."""
    want = cl.workers_with(client, cl.ROLLOUT)
    assert len(want) == 1 and len(cl.workers_with(client, cl.TRAINER)) == 2
    with dask.config.set({"distributed.client.scheduler-info-interval": "2ms"}):
        fast = Client(client.scheduler.address, set_as_default=False)
    try:
        seen = [cl.workers_with(fast, cl.ROLLOUT) for _ in range(300)]
    finally:
        fast.close()
    assert all(s == want for s in seen), f"{sum(s != want for s in seen)} of 300 look-ups saw {set(map(tuple, seen))}"
    assert set(cl.worker_resources(client)) == set(want) | set(cl.workers_with(client, cl.TRAINER))


def test_a_cluster_that_does_not_come_up_is_closed(monkeypatch):
    """Review finding: a connect that failed after the LocalCluster started (workers slower than the
    wait, a plugin that failed) left the cluster and its worker processes running."""
    import multiprocessing
    import time

    from distributed.deploy.spec import SpecCluster

    def too_slow(self, n_workers, timeout=None):
        raise TimeoutError(f"only 0 of {n_workers} workers came up")

    monkeypatch.setattr(Client, "wait_for_workers", too_slow)
    before = {id(c) for c in SpecCluster._instances}
    others = {p.pid for p in multiprocessing.active_children()}  # another test's cluster, if any
    with pytest.raises(TimeoutError, match="workers came up"):
        cl.connect(n_rollout_workers=1, n_trainer_workers=1, quiet=True)
    mine = [c for c in SpecCluster._instances if id(c) not in before]
    assert mine and all(c.status.name == "closed" for c in mine), [c.status for c in mine]
    deadline = time.time() + 30

    def left():
        return [p for p in multiprocessing.active_children() if "Dask" in p.name and p.pid not in others]

    while left() and time.time() < deadline:
        time.sleep(0.2)
    assert not left()


def test_a_worker_slower_to_come_back_than_the_lost_worker_timeout_keeps_its_nanny():
    """Killed, a worker's nanny restarts it; here it takes longer than the lost-worker-timeout (set
    to 0.3 s; Dask's default is 15 s, which a loaded machine's restart exceeded on a fresh clone).
    Dask's SpecCluster then closed the nanny (the cluster lost track of it, and on the fresh clone
    the worker never came back); the kit's local cluster keeps it, and the worker returns."""
    import os
    import signal
    import time

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "0.3s"}):
        client = cl.connect(n_rollout_workers=1, n_trainer_workers=1, quiet=True)
        try:
            cluster = client.cluster
            (addr,) = cl.workers_with(client, cl.ROLLOUT)
            nanny = cluster.workers["rollout-0"]
            os.kill(client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
            deadline = time.time() + 120
            while addr in cl.worker_resources(client) and time.time() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # past the timeout, while the worker is still away
            assert cluster.workers.get("rollout-0") is nanny, "the cluster closed the nanny of a worker on its way back"
            cl.wait_for_role(client, cl.ROLLOUT, 1, timeout=120)
            assert cluster.workers.get("rollout-0") is nanny and len(cl.workers_with(client, cl.ROLLOUT)) == 1
        finally:
            cl.shutdown(client)


def _start_of_this_worker() -> dict:
    import os
    import sys

    return {"ppid": os.getppid(), "preloaded": [m in sys.modules for m in ("torch", "transformers", "vllm")],
            "mark": os.environ.get("GRPO_KIT_TEST_MARK"), "omp": os.environ.get("OMP_NUM_THREADS")}


def test_workers_are_forked_with_the_heavy_imports_done_and_the_current_environment(client, monkeypatch):
    """connect's default worker_start: every worker is forked from one server that imported torch,
    transformers and vLLM once (a spawned worker imports them when a task needs them: 44 s
    for a cluster of three, imports included, against 0.8 s forked), and sees the environment as it is
    when its cluster is started, not as it was when the server started; ``spawn`` still spawns."""
    import os

    forked = client.run(_start_of_this_worker)
    assert all(w["preloaded"] == [True] * 3 and w["ppid"] != os.getpid() for w in forked.values()), forked
    monkeypatch.setenv("GRPO_KIT_TEST_MARK", "set after the server started")
    later = cl.connect(n_rollout_workers=1, n_trainer_workers=0, quiet=True)
    try:
        (w,) = later.run(_start_of_this_worker).values()
        assert w["mark"] == "set after the server started" and w["omp"] == "1" and w["preloaded"] == [True] * 3
    finally:
        cl.shutdown(later)
    spawned = cl.connect(n_rollout_workers=1, n_trainer_workers=0, worker_start="spawn", quiet=True)
    try:
        (w,) = spawned.run(_start_of_this_worker).values()
        assert w["ppid"] == os.getpid() and w["preloaded"][1:] == [False] * 2 and w["mark"] is not None  # torch: ThreadsPlugin
    finally:
        cl.shutdown(spawned)
        cl.use_worker_start("forkserver")  # the rest of the suite's clusters, as connect's default
    with pytest.raises(ValueError, match="worker_start"):
        cl.connect(worker_start="fork", quiet=True)


def test_scale_rollout_places_new_workers_round_robin_like_connect(monkeypatch):
    """Review finding: a rollout worker added by scale_rollout copied rollout-0's environment, its
    device and cores included: with four GPUs, rollout-1 and rollout-2 both went on device 0 (a
    second engine there runs out of memory) while devices 2 and 3 sat idle."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # this CPU machine's torch sees no device either way

    def placement(dask_worker):
        import os

        return dask_worker.name, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("GRPO_KIT_CPUS")

    client = cl.connect(n_rollout_workers=2, n_trainer_workers=1, pin_cpus=True, quiet=True)
    try:
        cl.scale_rollout(client, 3, timeout=120)
        spec = client.cluster.worker_spec
        devices = {name: spec[name]["options"]["env"]["CUDA_VISIBLE_DEVICES"] for name in spec}
        assert devices == {"rollout-0": "0", "rollout-1": "1", "trainer-0": "2", "rollout-2": "3"}
        seen = {name: (dev, cpus) for name, dev, cpus in client.run(placement).values()}
        assert {name: dev for name, (dev, _) in seen.items()} == devices
        assert all(cpus for _, cpus in seen.values())  # pinned, as connect pinned the first two
        # review finding: shrunk, then grown again, the new worker went on slot len(spec): the trainer's device
        cl.scale_rollout(client, 1, timeout=120)
        cl.scale_rollout(client, 2, timeout=120)
        spec = client.cluster.worker_spec
        assert {name: spec[name]["options"]["env"]["CUDA_VISIBLE_DEVICES"] for name in spec} == {
            "rollout-0": "0", "trainer-0": "2", "rollout-1": "1"}
    finally:
        cl.shutdown(client)
