import pytest

from tailorfx import Budget
from tailorfx.budget import PRESETS, format_bytes
from tailorfx.attention import Exact


@pytest.mark.parametrize("text,nbytes", [
    ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("123456B", 123456), ("1.5GiB", 3 * 2**29),
    ("2 gb", 2 * 10**9), (4096, 4096),
])
def test_parse(text, nbytes):
    assert Budget.parse(text).bytes == nbytes


def test_presets_are_below_marketed_size():
    b = Budget.parse("A100-80GB")
    assert b.bytes == PRESETS["A100-80GB"] and 75 * 2**30 < b.bytes < 80 * 2**30
    assert Budget.parse("h100-80gb").bytes == PRESETS["H100-80GB"]


@pytest.mark.parametrize("bad", ["24 parsecs", "GB", "-5GB", 0, "lots"])
def test_bad_budget_names_the_fix(bad):
    with pytest.raises(ValueError, match="budget"):
        Budget.parse(bad)


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(512) == "512 B"


def test_cuda_workspace_formulas_follow_torchs_defaults():
    """cuBLAS: CUBLAS_WORKSPACE_CONFIG's default, ':4096:8' KiB on sm90 and ':4096:2:16:8' before,
    per handle (forward thread and autograd's); FlashAttention-2's backward: the fp32 dq
    accumulator and softmax_d at the rounded length and head dim, plus dk/dv expanded to every
    head under grouped KV heads."""
    from tailorfx.budget import cublas_workspace_bytes, flash_backward_scratch_bytes
    assert cublas_workspace_bytes("sm90") == 2 * 4096 * 8 * 1024
    assert cublas_workspace_bytes("sm80") == 2 * (2 * 4096 + 8 * 16) * 1024
    # batch 2, 8 heads, length 1000 -> 1024 rows, head dim 80 -> 96; no GQA
    assert flash_backward_scratch_bytes(2, 8, 8, 1000, 80, 2) == 4 * 2 * 1024 * 8 * 96 + 4 * 2 * 8 * 1024
    # 2 KV heads for 8: dk and dv of every head in bf16 (2 bytes) as well
    assert (flash_backward_scratch_bytes(2, 8, 2, 1000, 80, 2) - flash_backward_scratch_bytes(2, 8, 8, 1000, 80, 2)
            == 2 * 2 * 1000 * 8 * 80 * 2)


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_a_device_preset_plans_with_cuda_costs_and_a_byte_budget_does_not():
    """A budget named for a CUDA device predicts with its workspaces (the peak grows by exactly
    CudaCosts.bytes at the length) and keeps the allocator's headroom; the same bytes as a number
    are not modelled for a device."""
    from tailorfx import sizing
    from tailorfx.budget import CudaCosts
    from models import hf_family
    model = hf_family("llama", vocab_size=512)
    # one attention for both (a byte budget plans for the CPU, whose GQA backward may repeat k, v)
    kw = dict(setup="fp32", attention=Exact())
    preset = sizing.plan_for_budget(model, "A100-40GB", 256, **kw)
    plain = sizing.plan_for_budget(model, PRESETS["A100-40GB"], 256, **kw)
    costs = preset.setup.device
    assert plain.setup.device is None and isinstance(costs, CudaCosts) and costs.arch == "sm80"
    cfg = model.config
    assert costs.attention == (1, cfg.num_attention_heads, cfg.num_key_value_heads,
                               cfg.hidden_size // cfg.num_attention_heads, 4)
    assert preset.setup.headroom == costs.allocator_headroom > 0 and plain.setup.headroom == 0
    for n in (256, 1000):
        with_costs, without = preset.predict_memory(n), plain.predict_memory(n)
        assert with_costs.device_bytes == costs.bytes(n) > 0 and without.device_bytes == 0
        assert with_costs.peak_bytes - without.peak_bytes == costs.bytes(n)
        assert with_costs.breakdown()["CUDA workspaces"] == costs.bytes(n)
    assert "modelled for CUDA (sm80)" in preset.setup.describe()


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_optimize_under_a_device_preset_counts_the_example_batch():
    """optimize(budget="A100-80GB") plans with the CUDA costs at its example inputs' batch (the
    flash scratch grows with it); a byte budget plans with none."""
    import torch
    import tailorfx
    from models import hf_family
    ids = torch.randint(0, 512, (3, 32))
    example = {"input_ids": ids, "labels": ids}
    opt = tailorfx.optimize(hf_family("llama", vocab_size=512), budget="A100-80GB", example_inputs=example)
    costs = opt.setup.device
    assert costs.arch == "sm80" and costs.attention[0] == 3
    assert opt.predict_memory(32).device_bytes == costs.bytes(32) > costs.terms(32)["cublas_workspace"]
    plain = tailorfx.optimize(hf_family("llama", vocab_size=512), budget="1GB", example_inputs=example)
    assert plain.setup.device is None and plain.predict_memory(32).device_bytes == 0


@pytest.mark.slow
def test_a_device_preset_counts_flash_attentions_backward_scratch_once():
    """On CPU fake tensors a GPU budget's attention backward is the CPU flash kernel's node: its
    fp32 dq accumulator is CUDA's flash_backward_scratch (the device term), so the node itself adds
    nothing; a byte budget counts the CPU kernel's accumulator at the node."""
    from tailorfx import sizing
    from models import hf_family
    model = hf_family("llama", vocab_size=512)
    # one attention for both (a byte budget plans for the CPU, whose GQA backward may repeat k, v)
    kw = dict(setup="fp32", attention=Exact())
    preset = sizing.plan_for_budget(model, "A100-40GB", 256, **kw)
    plain = sizing.plan_for_budget(model, PRESETS["A100-40GB"], 256, **kw)
    name = "_scaled_dot_product_flash_attention_for_cpu_backward"

    def at_backward(opt):
        pts = opt.predict_memory(1024).timeline.points
        i = next(i for i, (phase, node, _) in enumerate(pts) if node.startswith(name))
        return pts[i][2] - pts[i - 1][2]   # what the node added: its outputs and transient
    cfg = model.config
    q_fp32 = 1024 * cfg.hidden_size * 4
    assert at_backward(plain) - at_backward(preset) >= q_fp32
