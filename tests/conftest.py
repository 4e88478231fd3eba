"""Shared test settings."""

import os

import pytest
import torch
from hypothesis import settings

from tests.distributed.two_ranks import spawn_two_ranks

# Accountant evaluations cost up to ~0.5 s: keep property tests small and
# deterministic so the suite's run time is predictable.
settings.register_profile("dptrain", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("dptrain")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` runs two pytest-xdist workers, one per core of the CI machine: a
        # second torch thread in each worker (and in the processes it starts) would only
        # contend for the cores (the suite took 9:39 so, against 14:02 in one process).
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: several threads only contend (seconds instead of milliseconds a run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """The shared 2-process run: its folder and every rank's results (see two_ranks.py)."""
    out = tmp_path_factory.mktemp("two_ranks")
    return out, spawn_two_ranks(out)
