"""A benchmarks/ script loaded as a module for a test, without leaving its folder on sys.path (a
user's process does not have it; the script puts it there to import its siblings)."""
import importlib.util
import os
import sys
import types

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load(name: str) -> types.ModuleType:
    """benchmarks/<name>.py as the module `<name>_under_test`."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", os.path.join(BENCH_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
