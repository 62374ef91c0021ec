"""Fixtures and constants shared by the test modules.

``client``: a real Dask ``LocalCluster`` (worker processes, :func:`grpo_kit.cluster.connect`) shared
by the tests of one module. Its shape is ``connect``'s keyword arguments in the module's
``CLUSTER_SHAPE`` (default :data:`CLUSTER_SHAPE`: one rollout worker and two trainer workers, a DDP
gang of two). ``GSM8K_DIR``: the GSM8K train/test JSONL the tests that need real data read
(``../shared/data/gsm8k`` beside the repository; those tests skip without it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""

GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"
"""GSM8K's ``train.jsonl`` and ``test.jsonl`` (``from conftest import GSM8K_DIR``)."""

CLUSTER_SHAPE = {"n_rollout_workers": 1, "n_trainer_workers": 2}
"""The ``client`` fixture's cluster unless a test module sets its own ``CLUSTER_SHAPE``."""


@pytest.fixture(scope="module")
def client(request):
    """A LocalCluster of real worker processes for one test module, closed after its last test."""
    from grpo_kit import cluster as cl

    c = cl.connect(**getattr(request.module, "CLUSTER_SHAPE", CLUSTER_SHAPE), quiet=True)
    yield c
    cl.shutdown(c)
