"""benchmarks/kernel_speed.py --dry-run: every case of the kernel benchmark at tiny shapes on CPU (Triton's
interpreter), so the benchmark a lent GPU runs does not rot between loans; eager and tailorfx's
kernels must agree in every case (bf16: 2e-2 relative on the output and every gradient)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = {"rms_norm", "layer_norm", "swiglu", "rope", "attention causal", "attention window 16",
           "attention documents", "attention alibi", "linear_cross_entropy"}


@pytest.mark.slow
def test_dry_run_covers_every_case_and_agrees(tmp_path):
    out = tmp_path / "kernels.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_speed.py"), "--dry-run", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == KERNELS
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    ran = [r for r in rows if "skipped" not in r]
    assert {(r["kernel"], r["provider"]) for r in ran} >= {(k, p) for k in KERNELS for p in ("torch eager", "tailorfx")}
    assert all(r["agrees"] for r in ran), [r for r in ran if not r["agrees"]]
    # only what needs CUDA or an uninstalled peer is skipped, and it says so
    assert all("CUDA" in r["skipped"] or "not installed" in r["skipped"] for r in rows if "skipped" in r)
    assert {r["provider"] for r in rows} == {"torch eager", "inductor", "liger", "tailorfx", "sdpa flash", "sdpa cudnn",
                                           "flex", "tailorfx flex", "tailorfx inductor", "liger fp32 sum",
                                           "tailorfx fp32 sum"}


def test_a_case_starts_only_while_the_time_left_fits_and_each_is_saved(monkeypatch):
    """A GPU call has a hard wall: the benchmark starts a case only while the time left fits the
    longest case so far, records the rest as skipped with both figures, and saves after each case."""
    import time
    import bench_script
    ks = bench_script.load("kernel_speed")
    two = [ks.Case(k, "tiny", None, None, (), {"torch eager": None, "tailorfx": None}) for k in ("rms_norm", "swiglu")]
    monkeypatch.setattr(ks, "cases", lambda dev, dry: two)

    def run_case(case, dev, reps):
        time.sleep(0.3)
        return [{"kernel": case.kernel, "provider": p} for p in case.providers]
    monkeypatch.setattr(ks, "run_case", run_case)
    saves = []
    rows = ks.run_all("cpu", True, None, 1, budget_s=0.45, saved=lambda rows: saves.append(len(rows)))
    assert [r["kernel"] for r in rows] == ["rms_norm", "rms_norm", "swiglu", "swiglu"]
    assert "skipped" not in rows[0] and all("time budget" in r["skipped"] and "took 0.3 s" in r["skipped"]
                                            for r in rows[2:])
    assert saves == [2, 4]
    assert [r.get("skipped") for r in ks.run_all("cpu", True, None, 1)] == [None] * 4   # no budget: every case
