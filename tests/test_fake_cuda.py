"""Ready for the GPU without one: HF Llama, Qwen3 and Gemma-2 captured and rewritten on fake CUDA
tensors (forward only, in a subprocess: fake_cuda_decisions.py), against the same on fake CPU
tensors. The passes decide alike on both devices (regions, chunking, attention specs, dtypes);
what differs is what CUDA runs: exact attention as one SDPA call flash can take (no mask, causal,
bf16), windows, packed masks and soft-caps on the Triton flash kernel where the CPU runs the tile
engine, and the fused head's GEMMs in bf16.

Needs a torch linked with CUDA (no GPU): the CPU wheel cannot index a fake CUDA tensor ("PyTorch is
not linked with support for cuda devices"). Marked cuda_build: `make test-torch211` runs it on
`.venv-torch211` (torch 2.11's CUDA build); under a CPU wheel the script runs on
$TAILORFX_CUDA_PYTHON's Python, and without one the tests fail (they never skip).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda_build
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fake_cuda_decisions.py")
CASES = [f"{f}/{v}" for f in ("llama", "qwen3", "gemma2") for v in ("default", "triton", "window")]


def _cuda_python() -> str:
    """A Python whose torch is linked with CUDA: this one's, else $TAILORFX_CUDA_PYTHON, else
    `make test-torch211`'s .venv-torch211."""
    if torch.backends.cuda.is_built():
        return sys.executable
    exe = os.environ.get("TAILORFX_CUDA_PYTHON") or os.path.join(os.path.dirname(HERE), ".venv-torch211", "bin", "python")
    assert os.path.exists(exe), (f"the fake-CUDA capture needs a torch linked with CUDA and this one is a CPU build: "
                                 f"no {exe}; run `make test-torch211` (it sets up .venv-torch211) or set TAILORFX_CUDA_PYTHON")
    return exe


def _run_both(exe: str, folder) -> dict:
    """Both devices' decisions, the two scripts side by side on the same torch."""
    env, procs = {**os.environ, "TRITON_INTERPRET": "1"}, {}
    for d in ("cpu", "cuda"):
        with open(folder / f"{d}.out", "w") as out, open(folder / f"{d}.err", "w") as err:
            procs[d] = subprocess.Popen([exe, SCRIPT, d], stdout=out, stderr=err, text=True, env=env)
    got = {}
    for d, p in procs.items():
        rc = p.wait(timeout=900)
        assert rc == 0, f"{d} ({exe}): exit {rc}\n{(folder / f'{d}.err').read_text()[-3000:]}"
        got[d] = json.loads((folder / f"{d}.out").read_text().strip().splitlines()[-1])
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run once per session, whichever xdist worker comes first (the others read its JSON)."""
    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()   # under xdist each worker's: their parent is this run's
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fake_cuda"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / "lock")):
        done = shared / "decisions.json"
        if not done.exists():
            done.write_text(json.dumps(_run_both(_cuda_python(), shared)))
        return json.loads(done.read_text())


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
    # k, v grouped (2 heads for 4): flash takes them so
    assert cuda["sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.bfloat16", "heads": [4, 2]}] * 2
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
    want = {"tailorfx.triton_norm", "tailorfx.triton_rope_qk", "tailorfx.triton_attention",
            "tailorfx.triton_linear_cross_entropy"}
    assert want <= set(cuda["ops"])
    assert ["kernels", True] in cuda["passes"]


def test_under_autocast_the_triton_ops_run_on_cuda_and_rope_writes_bf16(runs):
    """fp32 weights, the forward under autocast to bf16 (Trainer's bf16=True), no KV cache: every
    Triton op runs on CUDA (the rotation's `out_dtype` taken by the triton_op), attention on bf16,
    and each rotation, fp32 as torch promotes bf16 q by fp32 cos, writes bf16 where the
    attention's cast to it was its one use (the cast fused), on both devices."""
    for device in ("cpu", "cuda"):
        g = _graph(runs, device, "llama/amp-triton")
        assert {"tailorfx.triton_norm", "tailorfx.triton_rope_qk", "tailorfx.triton_attention",
                "tailorfx.triton_linear_cross_entropy"} <= set(g["ops"]), device
        assert [c[2] for c in g["calls"] if c[:2] == ["kernel", "triton_rope_qk"]] == ["torch.bfloat16"] * 2, device
        assert [c[6] for c in g["calls"] if c[0] == "attention"] == ["torch.bfloat16"] * 2, device


def test_fp32_exact_attention_repeats_grouped_kv_on_cuda_only(runs):
    """On CUDA neither flash (fp16/bf16 only) nor the memory-efficient kernel (no grouped heads)
    takes grouped k, v in fp32: SDPA's math kernel would hold (B, H, S, S) scores (8.4 GiB at 16K
    tokens on an H200). Exact attention repeats them there, and so does the parallel layouts' graph
    whose causal masks are dropped; the CPU's flash takes them grouped."""
    cpu, cuda = _graph(runs, "cpu", "llama/fp32"), _graph(runs, "cuda", "llama/fp32")
    assert [c[1:4] for c in cuda["calls"] if c[0] == "attention"] == [["attention_call", "Exact", []]] * 2
    assert cuda["sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.float32", "heads": [4, 4]}] * 2
    assert cpu["sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.float32", "heads": [4, 2]}] * 2
    assert "aten.repeat_interleave" in cuda["ops"] or "aten.index_select" in cuda["ops"] or "aten.expand" in cuda["ops"]
    # the parallel layouts' graph (the captured one, its causal masks dropped): k, v stay repeated on CUDA
    assert cuda["masks_dropped_sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.float32", "heads": [4, 4]}] * 2
    assert cpu["masks_dropped_sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.float32", "heads": [4, 2]}] * 2


def test_a_maskless_grouped_sdpa_call_is_swapped_where_cuda_would_run_it_on_the_math_kernel(runs):
    """A model's own SDPA call on grouped k, v without a mask (is_causal, enable_gqa) makes no S x S
    tensor on the CPU (its flash takes grouped heads), so the default plan leaves it; on CUDA in
    fp32 it would run the math kernel's (B, H, S, S) scores, so the exact swap runs there, on
    repeated k, v."""
    cpu, cuda = _graph(runs, "cpu", "grouped_sdpa/fp32"), _graph(runs, "cuda", "grouped_sdpa/fp32")
    assert [c[1:4] for c in cuda["calls"] if c[0] == "attention"] == [["attention_call", "Exact", []]] * 2
    assert cuda["sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.float32", "heads": [4, 4]}] * 2
    assert not [c for c in cpu["calls"] if c[0] == "attention"], cpu["calls"]
    assert cpu["sdpa"] == [{"mask": False, "causal": True, "dtype": "torch.float32", "heads": [4, 1]}] * 2


def test_flex_attention_asked_for_runs_flexattention_on_cuda(runs):
    """attention_kernel="flex": Gemma-2's soft-capped window and global layers become FlexAttention
    calls on CUDA as on the CPU, and the graph runs on fake CUDA tensors (FlexAttention's operator,
    called as tailorfx.compat calls it, on this torch)."""
    cpu, cuda = _graph(runs, "cpu", "gemma2/flex"), _graph(runs, "cuda", "gemma2/flex")
    attn = [c for c in cuda["calls"] if c[0] == "attention"]
    assert [(c[1], c[2]) for c in attn] == [("flex_attention", "SlidingWindow"), ("flex_attention", "Exact")]
    assert all(["softcap", 50.0] in c[3] for c in attn), attn
    assert cuda["calls"] == cpu["calls"]
    assert "higher_order.flex_attention" in cuda["ops"]
    assert "tailorfx.triton_attention" not in cuda["ops"] and "tailorfx.sparse_attention" not in cuda["ops"]


def test_a_chunked_16bit_weight_gradient_is_summed_by_a_tensor_core_gemm_on_cuda():
    """The mini-sequence MLP and the fused head sum a bf16 weight's gradient over chunks in fp32
    (kernels/weight_grad.py::add_weight_grad). On the 2026-12-04 H200 run the MLP's sum ran as an
    fp32 GEMM on upcast copies (`cutlass_80_simt_sgemm`, no tensor cores): 2.5 s of Llama-3-8B's
    7.9 s step at 32K tokens, and each chunk's gate and up gradients were added into the sum by a
    kernel of their own (`CUDAFunctor_add<float>`, 896 calls). On CUDA it is one bf16 GEMM that
    accumulates into the fp32 sum (`addmm.dtype_out`, out= the sum): no upcast, no temporary, no add;
    the CPU keeps its upcast."""
    script = os.path.join(HERE, "fake_cuda_weight_grad.py")
    r = subprocess.run([_cuda_python(), script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    cuda, cpu = ({op: (dtypes, into) for op, dtypes, into in got[d] if not op.startswith("prim.")}
                 for d in ("cuda", "cpu"))
    assert cuda["aten.addmm.dtype_out"] == (["torch.float32", "torch.bfloat16", "torch.bfloat16"], True), got["cuda"]
    assert set(cuda) == {"aten.t.default", "aten.addmm.dtype_out"}, got["cuda"]   # no copy, no mm, no add
    assert cpu["aten.addmm_.default"] == (["torch.float32"] * 3, False) and "aten.addmm.dtype_out" not in cpu, got["cpu"]
