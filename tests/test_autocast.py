"""Under torch.autocast, what Trainer(bf16=True) and accelerate's mixed_precision="bf16" put around
the forward of a model with fp32 weights: the rewrites compute in autocast's dtype, as the ops they
replace did, and the memory model predicts what runs. The compiled graph runs with autocast off
(AOTAutograd put its casts in the graph), so a chunked region enters it itself and the fused head
and attention kernels, custom ops autocast does not reach, get their inputs cast."""
import copy

import pytest
import torch

import tailorfx
from tailorfx.rewrite.capture import node_value
from harness import peak_of_step, round_bf16_to_nearest_even
from models import batch, hf_family, hf_llama

AMP = torch.bfloat16


class Autocast(torch.nn.Module):
    """The module's forward under CPU autocast, as accelerate wraps a prepared model's."""

    def __init__(self, inner, dtype=AMP):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, **kw):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.inner(**kw)


def step(module, model, inputs):
    """(loss, logits, every parameter's gradient) of one forward (under autocast if `module` wraps
    it) and backward."""
    model.zero_grad(set_to_none=True)
    out = module(**inputs)
    out.loss.backward()
    return out.loss.detach(), out.logits, {n: p.grad for n, p in model.named_parameters()}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# fp16: Trainer's fp16=True (its loss scaling outside the step)
@pytest.mark.parametrize("amp", [AMP, pytest.param(torch.float16, marks=pytest.mark.slow)], ids=["bf16", "fp16"])
def test_under_autocast_the_rewrites_compute_in_its_dtype_and_are_predicted(amp):
    model, inputs = hf_llama(2), batch(2, 256)
    amp_loss, amp_logits, amp_grads = step(Autocast(m := copy.deepcopy(model), amp), m, inputs)
    fp32_loss, fp32_logits, fp32_grads = step(m := copy.deepcopy(model), m, inputs)

    # the head left unfused: the forward through rewritten attention and chunked MLPs is autocast's
    # (the MLPs ran in fp32 when the regions did not enter autocast: their logits 0.3x of bf16's
    # own distance from fp32 away from autocast's, where these are autocast's to the bit here)
    kept = copy.deepcopy(model)
    opt = tailorfx.optimize(kept, passes=["attention", "minisequence"], keep_logits=True)   # captured under autocast
    _, logits, _ = step(Autocast(opt, amp), kept, inputs)
    rec = opt.session.graphs[-1]
    assert {r.name: r.changed for r in rec.records} == {"attention": True, "minisequence": True}, rec.warnings
    assert logits.dtype == amp
    assert rel(logits, amp_logits) <= 0.05 * rel(amp_logits, fp32_logits)

    # the head fused: q, k, v and the head's input and weight cast as autocast cast them; the loss
    # in fp32 as eager's; every gradient within the distance autocast itself puts between eager and
    # fp32 (x1.5: the chunks sum bf16 products in another order); the peak predicted within 1% (the
    # fused head's per-row temporaries on 16-bit inputs on the CPU go uncounted: 0.26% here)
    fused = copy.deepcopy(model)
    opt = tailorfx.optimize(fused, passes=["attention", "minisequence"])
    loss, logits, grads = step(Autocast(opt, amp), fused, inputs)
    graph = opt.session.graphs[-1].rewritten.graph
    head = next(n for n in graph.nodes if getattr(n.target, "__name__", "") == "chunked_linear_cross_entropy")
    attention = [n for n in graph.nodes if getattr(n.target, "__name__", "") == "attention_call"]
    assert [node_value(a).dtype for a in head.args[:2]] == [amp, amp] and len(attention) == 2
    assert all(node_value(a).dtype == amp for n in attention for a in n.args[:3])
    assert logits is None and loss.dtype == torch.float32
    assert abs(loss - amp_loss).item() <= 2 ** -8 * amp_loss.item()
    for name, g in grads.items():
        assert g.dtype == torch.float32 and rel(g, amp_grads[name]) <= 1.5 * rel(amp_grads[name], fp32_grads[name]), name
    measured = peak_of_step(Autocast(opt, amp), fused, inputs)
    assert abs(opt.predict_memory().dynamic_peak_bytes / measured - 1) <= 0.01


class Fp32Mix(torch.nn.Module):
    """A matmul with autocast turned off inside the model, as transformers 5.17's rotary embedding
    turns it off: fp32 whatever the autocast around."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("w", torch.randn(width, width, generator=torch.Generator().manual_seed(3)) / width ** 0.5)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return (x.float() @ self.w).to(x.dtype)


def test_an_autocast_block_inside_the_model_is_rewritten_around_and_kept():
    """Dynamo captures the block's entry and exit as calls whose value is the autocast context, not
    a tensor: the passes' check refused them ("has no fake value"), and the graph ran as captured,
    nothing rewritten. Each MLP's activation here has such a block: the attention is rewritten, and
    each MLP is left as captured, with the reason in the report (chunked apart it ran its block under
    the autocast around it: its logits 0.85x of fp32's distance from autocast eager's away); the
    logits are autocast eager's."""
    model, inputs = hf_llama(2), batch(2, 128)
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.Sequential(layer.mlp.act_fn, Fp32Mix(model.config.intermediate_size))
    amp_loss, amp_logits, _ = step(Autocast(m := copy.deepcopy(model)), m, inputs)
    _, fp32_logits, _ = step(m := copy.deepcopy(model), m, inputs)
    kept = copy.deepcopy(model)
    opt = tailorfx.optimize(kept, passes=["attention", "minisequence"], keep_logits=True)
    loss, logits, _ = step(Autocast(opt), kept, inputs)
    rec = opt.session.graphs[-1]
    assert {r.name: r.changed for r in rec.records} == {"attention": True, "minisequence": False}, rec.warnings
    left = [w for w in rec.warnings if "left as captured: part of it runs inside an autocast block" in w]
    assert [w.split()[3] for w in left] == ["model.layers.0.mlp", "model.layers.1.mlp"], rec.warnings
    assert rel(logits, amp_logits) <= 0.05 * rel(amp_logits, fp32_logits)
    assert abs(loss - amp_loss).item() <= 2 ** -8 * amp_loss.item()


def test_a_bf16_models_fused_loss_is_eagers_fp32_loss():
    """A model in bf16 (no autocast): HF's loss upcasts the logits (`logits.float()`), so eager's
    loss is fp32; the fused head's is too, not rounded to bf16 (up to 2^-9 off: 6.25 for 6.2398)."""
    model, inputs = hf_llama(2).to(torch.bfloat16), batch(2, 64)
    want = copy.deepcopy(model)(**inputs).loss
    opt = tailorfx.optimize(copy.deepcopy(model), passes=["minisequence"], example_inputs=inputs)
    got = opt(**inputs).loss
    assert any(t.startswith("lm_head") for t in opt.session.graphs[0].records[0].touched)   # the head fused
    assert got.dtype == want.dtype == torch.float32
    assert abs(got - want).item() <= 1e-4 * want.item()


@pytest.mark.slow
def test_under_autocast_the_triton_kernels_take_autocasts_dtypes():
    """`kernels="triton"` under autocast (a GPU's Trainer(bf16=True); here Triton's interpreter): the
    norms run on the fp32 residual stream as eager's do, attention, RoPE and the head on bf16 inputs;
    the loss is eager autocast's within 2^-8, every gradient no farther from fp32 than 1.5x eager
    autocast's. HF rotates bf16 q and k by fp32 cos and sin into fp32 (type promotion), as the
    kernel does; where the attention's cast to bf16 is the rotation's one use (no KV cache, as
    trainers that checkpoint set it) the kernel writes bf16 itself (the same rounding of the same
    fp32 values on a GPU: tests/test_triton_kernels.py; the interpreter truncates)."""
    model, inputs = hf_llama(2), batch(2, 128)
    amp_loss, _, amp_grads = step(Autocast(m := copy.deepcopy(model)), m, inputs)
    _, _, fp32_grads = step(m := copy.deepcopy(model), m, inputs)
    for use_cache in (True, False):
        kept = copy.deepcopy(model)
        kept.config.use_cache = use_cache
        opt = tailorfx.optimize(kept, kernels="triton")
        loss, _, grads = step(Autocast(opt), kept, inputs)
        graph = opt.session.graphs[-1].rewritten.graph
        calls = {}
        for n in graph.nodes:
            if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("triton_"):
                calls.setdefault(n.target.__name__, set()).update(node_value(a).dtype for a in n.args[:2])
        assert calls == {"triton_norm": {torch.float32}, "triton_attention": {AMP}, "triton_rope_qk": {AMP},
                         "triton_linear_cross_entropy": {AMP}}, calls
        rope = [n for n in graph.nodes if getattr(n.target, "__name__", "") == "triton_rope_qk"]
        written = {node_value(u).dtype for n in rope for u in n.users}
        assert len(rope) == 2 and written == ({torch.float32} if use_cache else {AMP}), (use_cache, written)
        # each pass's graph predicted when the report reads it, after the step, autocast off
        assert all(r.peak_before is not None and r.peak_after is not None for r in opt.session.graphs[-1].records)
        assert loss.dtype == torch.float32 and abs(loss - amp_loss).item() <= 2 ** -8 * amp_loss.item()
        # the flash kernel's tiles round otherwise than eager's attention: each gradient is as far
        # from fp32 as eager autocast's (at most 1.38x here), 1.61x autocast's distance from eager
        # autocast's own (two bf16 computations' independent errors), so the bound is on the former
        for name, g in grads.items():
            assert g.dtype == torch.float32 and rel(g, fp32_grads[name]) <= 1.5 * rel(amp_grads[name], fp32_grads[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_with_a_gpus_rounding_the_kernels_are_as_near_fp32_as_eager_autocast(family, monkeypatch):
    """The Triton kernels under autocast with fp32 rounded to bf16 to nearest even, as a GPU does
    (Triton's interpreter truncates: a bias toward zero that a bias's gradient, a sum over tokens,
    accumulates; Qwen's q_proj.bias then lands 1.54x autocast's distance from fp32): every
    gradient within 1.15x eager autocast's distance from fp32 (1.09x at most measured), the loss
    within 2^-8 of autocast's. Qwen2 (q, k, v biases) and Qwen3 (norms of q and k), no KV cache."""
    round_bf16_to_nearest_even(monkeypatch)
    model, inputs = hf_family(family, 2), batch(2, 128)
    model.config.use_cache = False
    amp_loss, _, amp_grads = step(Autocast(m := copy.deepcopy(model)), m, inputs)
    _, _, fp32_grads = step(m := copy.deepcopy(model), m, inputs)
    opt = tailorfx.optimize(kept := copy.deepcopy(model), kernels="triton")
    loss, _, grads = step(Autocast(opt), kept, inputs)
    ops = {getattr(n.target, "__name__", "") for n in opt.session.graphs[-1].rewritten.graph.nodes}
    assert {"triton_norm", "triton_attention", "triton_rope_qk", "triton_linear_cross_entropy"} <= ops, ops
    assert abs(loss - amp_loss).item() <= 2 ** -8 * amp_loss.item()
    for name, g in grads.items():
        assert rel(g, fp32_grads[name]) <= 1.15 * rel(amp_grads[name], fp32_grads[name]), name
