"""Every script in examples/ runs, at tiny size, in a process of its own (as a user runs it).
Marked slow (each is a fresh process that compiles: 40-100 s on 2 cores); CI runs them."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
ONE_PROCESS = ["plain_loop.py", "hf_trainer.py", "trl_sft.py", "size_8b.py", "inspect_graph.py"]


def run(cmd: list, timeout: int = 600) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-4000:]}"
    return p.stdout


def test_every_example_is_tested():
    assert sorted(ONE_PROCESS + ["torchrun_parallel.py"]) == sorted(
        f for f in os.listdir(EXAMPLES) if f.endswith(".py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", ONE_PROCESS)
def test_example_runs(script):
    out = run([sys.executable, os.path.join(EXAMPLES, script), "--tiny"])
    if script != "size_8b.py":
        assert "tailorfx:" in out and "graph(s) captured" in out, out[-2000:]   # the report printed
    if script == "trl_sft.py":
        assert "TRL's fused LM head" in out and "without tailorfx's graph" not in out
    if script == "size_8b.py":
        assert out.count("longest sequence on one H100-80GB") == 2, out


@pytest.mark.multiprocess
def test_torchrun_example_runs():
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               os.path.join(EXAMPLES, "torchrun_parallel.py"), "--tiny"], timeout=900)
    assert "step 1: loss" in out, out[-2000:]
