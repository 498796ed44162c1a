"""benchmarks/gpu_check.py --dry-run: every section's set-up and a tiny version of its work on CPU,
so the script a lent GPU runs for a few minutes does not rot between loans (~30 s, one thread)."""
import json
import os
import subprocess
import sys

import pytest

import tailorfx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = {f"{k}/{dt}" for k in ("rms_norm", "layer_norm", "swiglu", "geglu", "rope", "attention_causal",
                                  "linear_cross_entropy") for dt in ("float32", "bfloat16")} | {
    "attention_sliding_window/bfloat16", "attention_documents/bfloat16", "attention_alibi_tiles/float32",
    "attention_alibi_tiles/bfloat16"} | {   # benchmarks/kernel_speed.py's norm cases, at the dry run's shapes
    "benchmark rms_norm 64x64", "benchmark rms_norm 128x64", "benchmark layer_norm 64x64"}


@pytest.mark.slow
def test_dry_run_passes_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    # one OpenMP thread: under `make test` another worker shares the two cores
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["meta"]["dry_run"] and data["meta"]["device"] == "cpu"
    assert data["meta"]["tailorfx"] == os.path.dirname(tailorfx.__file__)   # this checkout, not an installed one
    assert list(data["sections"]) == ["kernels", "memory", "nccl", "hf"]
    for name, sec in data["sections"].items():
        bad = [(c["name"], c.get("error", c)) for c in sec["checks"] if c["status"] not in ("pass", "skipped")]
        assert sec["status"] == "ok" and not bad, (name, bad)
        assert all(c.get("reason") for c in sec["checks"] if c["status"] == "skipped"), name
    assert {c["name"] for c in data["sections"]["kernels"]["checks"]} == KERNELS
    bench = [c for c in data["sections"]["kernels"]["checks"] if c["name"].startswith("benchmark")]
    for c in bench:   # the kernel benchmark's rows: ours ran and agreed; the CUDA-only peers say why not
        ours = [r for r in c["rows"] if r["provider"] == "tailorfx"]
        assert len(ours) == 1 and ours[0]["agrees"], c
        assert all(r.get("skipped") for r in c["rows"] if r["provider"] in ("liger", "inductor")), c
    hf = {c["name"]: c for c in data["sections"]["hf"]["checks"]}
    assert hf["bf16/default"]["status"] == "pass" and hf["fp32/default"]["grad_rel"] < 1e-5
    assert hf["bf16/setup=pure-bf16-fused-optimizer"]["predicted"]["grads"] == 0   # consumed in backward
    for lowering in ("eager", "inductor"):
        offload = hf[f"fp32/lowering={lowering}/offload=checkpoints"]
        assert offload["status"] == "pass" and offload["grad_rel"] < 1e-5 and offload["predicted"]["host_offloaded"] > 0
    window = {k: hf[f"bf16/mistral-window/{k}"] for k in ("default", "attention_kernel=flex", "attention_kernel=triton")}
    assert all(c["status"] == "pass" for c in window.values()), window
    assert window["default"]["attention_kernels"] == ["tiles"]   # the CPU's: no timing off a GPU
    assert [k[:21] for k in window["attention_kernel=flex"]["attention_kernels"]] == ["FlexAttention (asked)"]
    assert "[hf] ok" in r.stdout   # the closing table
