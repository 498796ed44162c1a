"""The scratch oneDNN allocates through torch's CPU allocator inside 16-bit matmuls
(runtime/cpu_scratch.py), which the memory model adds at each one: measured on a probe of the
same op, shapes and layouts, or above 4096 rows on probes of 2048 and 4096 rows extended in the
rows. On a CPU whose oneDNN allocates none through torch (AVX2) both sides are 0."""
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import tailorfx
from tailorfx.runtime import cpu_scratch

aten = torch.ops.aten


def _measured(func, args) -> int:
    out = func(*args)
    new = 0 if out is args[0] else out.numel() * out.element_size()
    return tailorfx.measure_peak(lambda: func(*args)) - new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, k, n", [(5000, 512, 512), (4600, 1024, 256), (6000, 64, 172)])
def test_a_matmul_of_many_rows_holds_the_scratch_its_shorter_probes_extend_to(rows, k, n, dtype):
    """mm and addmm, each operand as stored or transposed: within 3% of the allocator's peak less
    the output (the memory model's claim), rows above the 4096 a probe runs."""
    assert rows > cpu_scratch.EXACT_ROWS
    for a in (torch.zeros(rows, k, dtype=dtype), torch.zeros(k, rows, dtype=dtype).t()):
        for b in (torch.zeros(k, n, dtype=dtype), torch.zeros(n, k, dtype=dtype).t()):
            for func, args in ((aten.mm.default, (a, b)), (aten.addmm.default, (torch.zeros(n, dtype=dtype), a, b))):
                got, predicted = _measured(func, args), cpu_scratch.matmul_scratch_bytes(func, args)
                assert -0.03 * got <= predicted - got <= 0.10 * got, (func, a.stride(), b.stride(), got, predicted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_in_place_weight_gradient_sum_holds_its_scratch_beside_no_new_output(dtype):
    """add_weight_grad's acc.addmm_(g^T, x) in the weight's dtype: the sum is written into acc."""
    args = (torch.zeros(176, 64, dtype=dtype), torch.ones(512, 176, dtype=dtype).t(), torch.ones(512, 64, dtype=dtype))
    got = _measured(aten.addmm_.default, args)
    assert cpu_scratch.matmul_scratch_bytes(aten.addmm_.default, args) == got


def test_fp32_and_fake_matmuls_run_no_probe():
    a = torch.zeros(64, 64)
    assert cpu_scratch.matmul_scratch_bytes(aten.mm.default, (a, a)) == 0
    assert cpu_scratch.matmul_scratch_bytes(aten.add.Tensor, (a, a)) == 0


def test_a_prediction_inside_a_users_profiler_leaves_the_profile_running():
    """Measuring a probe would stop the user's torch.profiler session: the scratch is left out
    (0) with a warning that says so, and the user's profile goes on recording."""
    a, b = torch.zeros(37, 29, dtype=torch.bfloat16), torch.zeros(29, 31, dtype=torch.bfloat16)   # probed nowhere else
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cpu_scratch.matmul_scratch_bytes(aten.mm.default, (a, b)) == 0
        torch.mm(a, b)
    assert any("torch.profiler runs" in str(w.message) for w in caught)
    assert any(e.name == "aten::mm" for e in prof.events())


def test_live_bytes_adds_a_cpu_matmuls_scratch_beside_its_output_unless_told_not_to():
    """memory.LiveBytes on fake tensors: the output of a bf16 mm, plus its scratch where the chunk
    runs on the CPU; a chunk's costs leave the scratch out for a model on another device or one
    planned for a GPU budget (passes/minisequence/cost.py::runs_on_cpu)."""
    from dataclasses import replace

    from tailorfx.passes.minisequence.cost import runs_on_cpu
    from tailorfx.rewrite.memory import LiveBytes
    from tailorfx.rewrite.passes import PassContext
    from tailorfx.setup import PRESETS
    real = torch.zeros(300, 64, dtype=torch.bfloat16), torch.zeros(64, 176, dtype=torch.bfloat16)
    scratch = _measured(aten.mm.default, real)
    peaks = {}
    with tailorfx.compat.FakeTensorMode():
        fake = [torch.empty(t.shape, dtype=t.dtype) for t in real]
        for on_cpu in (True, False):
            with LiveBytes(cpu_scratch=on_cpu) as live:
                torch.mm(*fake)
            peaks[on_cpu] = live.peak
    assert peaks == {True: 300 * 176 * 2 + scratch, False: 300 * 176 * 2}
    ctx = PassContext(regions=None, seq=None)
    assert runs_on_cpu(ctx, real) and not runs_on_cpu(ctx, [torch.empty(1, device="meta")])
    gpu = replace(PRESETS["pure-bf16"], device=object())
    assert not runs_on_cpu(replace(ctx, options={"setup": gpu}), real)
