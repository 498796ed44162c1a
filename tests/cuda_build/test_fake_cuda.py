"""Ready for the GPU without one: HF Llama, Qwen3 and Gemma-2 captured and rewritten on fake CUDA
tensors (forward only, in a subprocess: fake_cuda_decisions.py), against the same on fake CPU
tensors. The passes decide alike on both devices (regions, chunking, attention specs, dtypes);
what differs is what CUDA runs: exact attention as one SDPA call flash can take (no mask, causal,
bf16), windows, packed masks and soft-caps on the Triton flash kernel where the CPU runs the tile
engine, and the fused head's GEMMs in bf16.

Needs a torch linked with CUDA (no GPU): the CPU wheel cannot index a fake CUDA tensor ("PyTorch is
not linked with support for cuda devices"), so `make test-torch211` runs this directory in a
second virtualenv with torch 2.11's CUDA build; `make test`'s CPU wheel does not collect it.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "fake_cuda_decisions.py")
CASES = [f"{f}/{v}" for f in ("llama", "qwen3", "gemma2") for v in ("default", "triton", "window")]


def _decisions(device: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, SCRIPT, device], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, f"{device}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    assert torch.backends.cuda.is_built(), "needs a torch built with CUDA (make test-torch211)"
    return {"cpu": _decisions("cpu"), "cuda": _decisions("cuda")}


def _graph(runs, device, case):
    got = runs[device][case]
    assert "error" not in got, f"{case} on {device}: {got.get('error')}"
    assert len(got["graphs"]) == 1 and not got["graphs"][0]["failed"], got["graphs"]
    return got["graphs"][0]


def _spec_only(calls):
    """The decisions with the attention's kernel left out (the one thing meant to differ; the
    Triton kernel takes a soft-cap as its own argument, the spec as a field)."""
    out = []
    for c in calls:
        if c[0] == "attention":
            _, _, kind, params, softcap, causal, dtype = c
            spec = dict(params, **({"softcap": softcap} if softcap is not None else {}))
            c = ["attention", kind, sorted(spec.items()), causal, dtype]
        out.append(c)
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_passes_decide_on_cuda_as_on_cpu(runs, case):
    cpu, cuda = _graph(runs, "cpu", case), _graph(runs, "cuda", case)
    assert cuda["passes"] == cpu["passes"] and cuda["warnings"] == cpu["warnings"]
    assert _spec_only(cuda["calls"]) == _spec_only(cpu["calls"])
    assert any(c[0] == "chunked" for c in cuda["calls"])   # mini-sequence chunked the MLPs on both
    assert all(c[-1] == "torch.bfloat16" for c in cuda["calls"] if c[0] == "attention")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exact_attention_is_one_flash_eligible_sdpa_call_and_the_head_runs_bf16_gemms(runs, family):
    cpu, cuda = _graph(runs, "cpu", f"{family}/default"), _graph(runs, "cuda", f"{family}/default")
    attn = [c for c in cuda["calls"] if c[0] == "attention"]
    assert [c[1:4] for c in attn] == [["attention_call", "Exact", []]] * 2
    assert cuda["sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.bfloat16"}] * 2
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in cpu["ops"]
    assert cuda["head_inputs"] == [["torch.bfloat16", "torch.bfloat16", "cuda", True]]
    assert cpu["head_inputs"] == [["torch.bfloat16", "torch.bfloat16", "cpu", False]]


@pytest.mark.parametrize("case", ["llama/window", "qwen3/window", "gemma2/default"])
def test_windows_and_soft_caps_take_the_triton_kernel_on_cuda_the_tiles_on_cpu(runs, case):
    cpu, cuda = _graph(runs, "cpu", case), _graph(runs, "cuda", case)
    assert {c[1] for c in cuda["calls"] if c[0] == "attention"} == {"triton_attention"}
    assert {c[1] for c in cpu["calls"] if c[0] == "attention"} == {"attention_call"}
    assert "tailorfx.triton_attention" in cuda["ops"] and "tailorfx.sparse_attention" not in cuda["ops"]
    assert "tailorfx.sparse_attention" in cpu["ops"] and "tailorfx.triton_attention" not in cpu["ops"]
    if case.startswith("gemma2"):   # a window layer and a global one, both soft-capped at 50
        assert [(c[2], c[4]) for c in cuda["calls"] if c[0] == "attention"] == [("SlidingWindow", 50.0),
                                                                                  ("Exact", 50.0)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_kernels_triton_runs_every_triton_op_on_cuda(runs, family):
    cuda = _graph(runs, "cuda", f"{family}/triton")
    want = {"tailorfx.triton_norm", "tailorfx.triton_rope", "tailorfx.triton_attention",
            "tailorfx.triton_linear_cross_entropy"}
    assert want <= set(cuda["ops"])
    assert ["kernels", True] in cuda["passes"]
