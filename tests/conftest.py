import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# CI has no GPU: every Triton kernel in the suite runs through Triton's CPU interpreter (set
# before anything imports triton; the kernels' ahead-of-time compile for sm80/sm90 still runs)
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one intra-op thread each, else OpenMP threads
    # spin-wait against the other worker's
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (as under `make test`'s workers): their ops
    are thousands of small barriers, and two OpenMP threads on a shared 2-core machine spin-wait
    against other processes, 10-100x slower. Restored after the module. Use it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seeded():
    """The same random weights and inputs whatever ran before. Dynamo is NOT reset between tests:
    each test runs in the state of a user's process that has compiled other models before (a
    test that needs a clean cache resets it itself and says why)."""
    torch.manual_seed(0)
    yield
