import json
import os
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: Inductor compiles in the worker itself, not in a subprocess pool of
    # its own per worker (on 2 cores it makes one), whose compile sidecar, if it dies, leaves the
    # worker waiting on its futures forever (seen once in a run of tests/test_kernels_pass.py:
    # every process of the run idle on a lock). Set before torch reads it, at its import.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
import suite_time  # noqa: E402

# CI has no GPU: every Triton kernel in the suite runs through Triton's CPU interpreter (set
# before anything imports triton; the kernels' ahead-of-time compile for sm80/sm90 still runs)
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one intra-op thread each, else OpenMP threads
    # spin-wait against the other worker's
    torch.set_num_threads(1)
if os.environ.get("TAILORFX_TEST_THREADS"):
    # the intra-op thread count asked for (the exact comparisons' determinism across counts)
    torch.set_num_threads(int(os.environ["TAILORFX_TEST_THREADS"]))
# how this session computes, for the ratio log (pytest_sessionfinish)
RUN_CONFIG = {"threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
              "reverse": os.environ.get("TAILORFX_REVERSE_ORDER") == "1"}


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


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """The tests of suite_time.MOVED are marked slow (`make test-slow`); the slow ones
    suite_time.is_long names, long (`make test-long`)."""
    for item in items:
        if item.nodeid in suite_time.MOVED:
            item.add_marker(pytest.mark.slow)
        slow = any(item.get_closest_marker(m) for m in ("slow", "multiprocess"))
        if slow and suite_time.is_long(item.nodeid):   # a case `make test` runs stays there
            item.add_marker(pytest.mark.long)


class _Order:
    @pytest.hookimpl(trylast=True)   # on the tests -m selected
    def pytest_collection_modifyitems(self, config, items):
        """The longest tests first, spread over the workers (suite_time.front_load).
        TAILORFX_REVERSE_ORDER=1 runs the selected tests last to first instead: a test that passes
        only after (or before) another shows."""
        if os.environ.get("TAILORFX_REVERSE_ORDER") == "1":
            items.reverse()
        else:
            items[:] = suite_time.front_load(items, suite_time.workers(config))


def pytest_configure(config):
    config.pluginmanager.register(_Order(), "tailorfx_order")


def pytest_sessionfinish(session, exitstatus):
    """TAILORFX_RATIO_LOG=path: every exact comparison's worst error / tolerance (harness.RATIO_LOG)
    as JSON at `path`, or `path.<worker>` from each xdist worker (tests/ratio_table.py merges them)."""
    path = os.environ.get("TAILORFX_RATIO_LOG")
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        path = f"{path}.{worker}"
    elif session.config.pluginmanager.has_plugin("dsession"):
        return   # the xdist controller: its workers wrote theirs
    with open(path, "w") as f:
        json.dump({"config": RUN_CONFIG, "comparisons": harness.RATIO_LOG}, f, indent=1)
