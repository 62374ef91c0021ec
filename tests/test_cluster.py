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
