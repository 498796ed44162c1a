"""`make test` keeps at least one test of every pass and of every HF family it covers; the
tests moved to `make test-slow` (CI runs both) to keep it under 10 minutes may not take the last."""
import os
import subprocess
import sys

import pytest

from tailorfx import passes

TESTS = os.path.dirname(os.path.abspath(__file__))
MAKE_TEST = "not slow and not multiprocess and not cuda_build"     # the Makefile's selection
# each pass's own tests
PASS_TESTS = {"attention": "test_attention_pass.py", "kernels": "test_kernels_pass.py",
              "minisequence": "test_minisequence.py", "precision": "test_precision.py",
              "recompute": "test_recompute.py"}
# the families `make test` names in its tests' parameters (tests/models.py builds them; the
# property test adds random ones)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "starcoder2", "gpt_neox", "falcon", "gemma2",
            "gemma3_text", "cohere", "mixtral", "qwen2_moe", "olmoe", "gpt2"]


def make_test_selection(request) -> list[str]:
    """The node ids `make test` runs: this session's when it is that run, else collected anew."""
    config = request.config
    if config.option.markexpr == MAKE_TEST and [os.path.abspath(a) for a in config.args] == [TESTS]:
        return [item.nodeid for item in request.session.items]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", MAKE_TEST, TESTS], capture_output=True, text=True, cwd=os.path.dirname(TESTS))
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def test_make_test_keeps_a_test_of_every_pass_and_family(request):
    ids = make_test_selection(request)
    assert sorted(PASS_TESTS) == passes.available(), "a pass without its tests listed here"
    missing = [p for p, f in PASS_TESTS.items() if not any(i.startswith(f"tests/{f}::") for i in ids)]
    assert not missing, f"make test runs no test of the passes {missing}"
    params = [i.split("[", 1)[1] for i in ids if "[" in i]
    missing = [f for f in FAMILIES if not any(f in p.replace("]", "-").split("-") for p in params)]
    assert not missing, f"make test runs no test of the families {missing}"


def test_every_test_moved_to_make_test_slow_exists():
    """suite_time.MOVED, LONG and LONGEST name tests by node id: one renamed away would silently
    run in neither target's selection as intended."""
    import re
    import suite_time
    stale = []
    covering = {c.split(" - ", 1)[0] for c in suite_time.LONG.values()}
    for node in suite_time.MOVED | set(suite_time.LONGEST) | set(suite_time.LONG) | covering:
        path, name = node.split("::", 1)
        func = name.split("[", 1)[0]
        full = os.path.join(os.path.dirname(TESTS), path)
        if not os.path.exists(full) or not re.search(rf"^def {re.escape(func)}\(", open(full).read(), re.M):
            stale.append(node)
    assert not stale, f"tests/suite_time.py names tests that do not exist: {stale}"
    # a long test's claim is checked in CI by the test named beside it, which is not long itself,
    # and no long test is ordered as one of the slow suite's
    assert not any(map(suite_time.is_long, covering)) and not any(map(suite_time.is_long, suite_time.LONGEST))


def test_the_longest_tests_start_first_on_each_worker():
    """front_load deals LONGEST's tests, longest first, to the head of each slice worksteal sends
    its workers (the first gets floor(n / 2) of n), and keeps every other test, in its order."""
    import suite_time

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid
    longest = sorted(suite_time.LONGEST, key=lambda n: (-suite_time.LONGEST[n], n))
    items = [Item(f"other{i}") for i in range(11)] + [Item(n) for n in reversed(longest)]
    out = [i.nodeid for i in suite_time.front_load(items, 2)]
    first = len(items) // 2
    assert sorted(out) == sorted(i.nodeid for i in items)
    assert out[:first].index("other0") == len(longest[0::2]) and out[:first][:len(longest[0::2])] == longest[0::2]
    assert out[first:][:len(longest[1::2])] == longest[1::2]
    assert [n for n in out if n.startswith("other")] == [f"other{i}" for i in range(11)]


def test_each_worker_orders_for_the_number_of_workers():
    """xdist's workers order their collections themselves, and -n is not among a worker's options:
    the count is read from what the controller sent (until 2026-12-02 every worker read 1, and the
    first worker's half held every long test, one after another)."""
    import types

    import suite_time
    worker = types.SimpleNamespace(workerinput={"workerid": "gw1", "workercount": 2},
                                   option=types.SimpleNamespace(numprocesses=None))
    assert suite_time.workers(worker) == 2
    assert suite_time.workers(types.SimpleNamespace(option=types.SimpleNamespace(numprocesses=None))) == 1


@pytest.mark.slow   # a collection of 17 test modules (20 s): it checks make test-slow's selection, and runs there
def test_each_long_case_leaves_a_case_of_its_test_in_ci():
    """suite_time.LONG_CASES keeps, of each test it names, cases that exist and run in CI's
    `make test-slow`; the others are marked long (`make test-long`)."""
    import suite_time
    files = sorted({f.split("::")[0] for f in suite_time.LONG_CASES})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "slow and not long", *files], capture_output=True, text=True,
                         cwd=os.path.dirname(TESTS))
    ids = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    kept = {f"{func}[{case}]" for func, cases in suite_time.LONG_CASES.items() for case in cases}
    assert not kept - ids, f"cases LONG_CASES keeps that make test-slow does not run: {sorted(kept - ids)}"
    assert not any(suite_time.is_long(i) for i in ids)
