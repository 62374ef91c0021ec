"""Fixtures and constants shared by the test modules.

``client``: a real Dask ``LocalCluster`` (worker processes, :func:`grpo_kit.cluster.connect`) shared
by the tests of one module. Its shape is ``connect``'s keyword arguments in the module's
``CLUSTER_SHAPE`` (default :data:`CLUSTER_SHAPE`: one rollout worker and two trainer workers, a DDP
gang of two). ``GSM8K_DIR``: the GSM8K train/test JSONL the tests that need real data read
(``../shared/data/gsm8k`` beside the repository; those tests skip without it).

The process environment is put back after collection and after every test (:func:`restore_environment`):
an import or a test that sets a variable must not change what later tests, and the processes they
start (Dask workers, JupyterLab and its kernels), see. ``import trl`` sets ``VLLM_LOGGING_LEVEL=ERROR``
(``trl/_compat.py``), and ``tests/test_trl_config.py`` imports it at collection: every vLLM engine the
suite started after it, the browser test's JupyterLab kernels' included, logged errors only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""

GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"
"""GSM8K's ``train.jsonl`` and ``test.jsonl`` (``from conftest import GSM8K_DIR``)."""

ENV_AT_START = dict(os.environ)
"""The environment pytest started with (this module is imported before the test modules)."""

CLUSTER_SHAPE = {"n_rollout_workers": 1, "n_trainer_workers": 2}
"""The ``client`` fixture's cluster unless a test module sets its own ``CLUSTER_SHAPE``."""


@pytest.fixture(scope="module")
def client(request):
    """A LocalCluster of real worker processes for one test module, closed after its last test."""
    from grpo_kit import cluster as cl

    c = cl.connect(**getattr(request.module, "CLUSTER_SHAPE", CLUSTER_SHAPE), quiet=True)
    yield c
    cl.shutdown(c)


def restore_environment(saved: dict[str, str]) -> None:
    """Make ``os.environ`` exactly ``saved`` (``os.environ`` also sets the C-level environment)."""
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def pytest_collection_finish(session):
    restore_environment(ENV_AT_START)  # what the test modules' imports set (trl's VLLM_LOGGING_LEVEL)


@pytest.fixture(autouse=True)
def _no_environment_leaks():
    """A test's changes to the environment end with it (fixtures of a wider scope keep theirs: they
    are set up before this one)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        restore_environment(before)
