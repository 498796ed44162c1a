"""Numerics, graph shape and memory of the chunked runtime ops against eager PyTorch."""

import functools
import gc
import operator

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from tailorfx.runtime import ops

B, S, H, I = 2, 37, 32, 88
CHUNKS = [1, 2, 3, 8, 64]  # 64 > S: clamped to S chunks of one token


def swiglu(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def gpt2_mlp(x, w_fc, b_fc, w_proj, b_proj):
    return F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)


def _params(fn, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {swiglu: [(I, H), (I, H), (H, I)], gpt2_mlp: [(I, H), (I,), (H, I), (H,)]}[fn]
    return [(torch.randn(s, generator=g, dtype=dtype) / s[-1] ** 0.5).requires_grad_()
            for s in shapes]


def _x(dtype, s=S, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, s, H, generator=g, dtype=dtype).requires_grad_()


class GraphRecorder:
    """A backend that keeps AOTAutograd's forward and backward graphs and runs them eagerly."""

    def __init__(self):
        self.fw, self.bw = [], []
        self.backend = aot_autograd(fw_compiler=functools.partial(self._keep, self.fw),
                                    bw_compiler=functools.partial(self._keep, self.bw))

    @staticmethod
    def _keep(store, gm, example_inputs):
        store.append(gm)
        return make_boxed_func(gm.forward)


def _saved_tensors(fw_gm, num_user_outputs=1):
    """Nodes the forward graph hands to the backward (outputs after the user outputs)."""
    out = next(n for n in fw_gm.graph.nodes if n.op == "output").args[0]
    return [n for n in out[num_user_outputs:] if n is not None and "val" in n.meta
            and isinstance(n.meta["val"], torch.Tensor)]


def _targets(gm):
    return [n.target for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem]


def _peak_bytes(fn):
    """Peak of the allocator's running total while fn runs (profiler's raw [memory] events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    peak = total = 0
    for e in events:
        total += e.nbytes()
        peak = max(peak, total)
    return peak


# --- region registry ---------------------------------------------------------------------------


def test_register_region_key_is_a_content_hash():
    region = ops.register_region(torch.fx.symbolic_trace(swiglu))
    # same code, same key, and the live region of that key is returned, not a second one
    assert ops.register_region(torch.fx.symbolic_trace(swiglu)) is region
    assert ops.register_region(torch.fx.symbolic_trace(gpt2_mlp)).key != region.key
    with pytest.raises(TypeError):  # a plain callable has no stable content to hash
        ops.register_region(swiglu)
    plain = ops.register_region(swiglu, key="test_swiglu_plain")
    assert plain.key == "test_swiglu_plain" and ops.get_region("test_swiglu_plain") is swiglu
    with pytest.raises(ValueError):  # one key, two functions
        ops.register_region(gpt2_mlp, key="test_swiglu_plain")
    with pytest.raises(KeyError, match="not_registered"):
        ops.get_region("not_registered")


def _lone_swiglu(x, w_gate, w_up, w_down):
    """swiglu in code no other test registers, so no other test's graph or cache holds its region."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down) * 1.0


def test_region_lives_as_long_as_its_holders():
    """The index is weak: a region is registered while something (a graph, a pending backward)
    holds it."""
    region = ops.register_region(torch.fx.symbolic_trace(_lone_swiglu))
    key = region.key
    again = ops.register_region(torch.fx.symbolic_trace(_lone_swiglu))   # a second graph's reference
    del region
    gc.collect()
    assert ops.chunked_region(key) is again
    x, params = _x(torch.float64), _params(swiglu, torch.float64)
    out = ops.token_chunked(key, [x], params, 1, 3)
    del again
    gc.collect()
    out.sum().backward()   # the autograd node holds the region until its backward ran
    torch.testing.assert_close(x.grad, torch.autograd.grad(swiglu(x, *params).sum(), x)[0])
    del out
    gc.collect()
    with pytest.raises(KeyError, match=key):
        ops.chunked_region(key)


def test_region_key_includes_recorded_shapes():
    """Costs and FLOPs are read from a region's metadata, so the same code recorded at other sizes
    (another model) must not share a key: it once made a later model's planner read a stale
    symbolic size and fail."""
    def traced(width):
        gm = torch.fx.symbolic_trace(swiglu)
        for n in gm.graph.nodes:
            n.meta["val"] = torch.empty(3, width)
        return gm
    assert ops.register_region(traced(8)) is ops.register_region(traced(8))
    assert ops.register_region(traced(8)).key != ops.register_region(traced(16)).key


# --- token_chunked numerics --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("region", [swiglu, gpt2_mlp])
def test_token_chunked_matches_eager(region, dtype):
    chunked = ops.register_region(torch.fx.symbolic_trace(region))
    key = chunked.key
    x, params = _x(dtype), _params(region, dtype)
    ref = region(x, *params)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, *params], grad_out)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    # Weight grads sum B*S rows in a different order (per chunk, then across chunks), so fp32
    # allows a reassociation error of a few ulps of their O(1) entries.
    param_tol = dict(tol, atol=1e-5) if dtype == torch.float32 else tol
    for num_chunks in CHUNKS:
        out = ops.token_chunked(key, [x], params, 1, num_chunks)
        torch.testing.assert_close(out, ref, **tol)
        grads = torch.autograd.grad(out, [x, *params], grad_out)
        torch.testing.assert_close(grads[0], ref_grads[0], **tol)
        for got, want in zip(grads[1:], ref_grads[1:]):
            torch.testing.assert_close(got, want, **param_tol)


def test_token_chunked_partial_requires_grad_and_negative_seq_dim():
    # Frozen weights get no grad (the op must not return one); seq dim given as -2.
    region = ops.register_region(torch.fx.symbolic_trace(swiglu))
    key = region.key
    x = _x(torch.float64)
    params = [p.detach() for p in _params(swiglu, torch.float64)]
    params[2].requires_grad_()
    out = ops.token_chunked(key, [x], params, -2, 5)
    torch.testing.assert_close(out, swiglu(x, *params))
    out.sum().backward()
    ref_x, ref_w = torch.autograd.grad(swiglu(x, *params).sum(), [x, params[2]])
    torch.testing.assert_close(x.grad, ref_x)
    torch.testing.assert_close(params[2].grad, ref_w)
    assert params[0].grad is None and params[1].grad is None


def test_token_chunked_peak_memory_far_below_dense():
    # Profiler allocator events over forward + backward; the dense MLP keeps (S, I) activations.
    s, i = 4096, 512
    region = ops.register_region(torch.fx.symbolic_trace(swiglu))
    key = region.key
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, s, H, generator=g).requires_grad_()
    params = [(torch.randn(shape, generator=g) / 16).requires_grad_()
              for shape in [(i, H), (i, H), (H, i)]]
    dense_peak = _peak_bytes(lambda: torch.autograd.grad(swiglu(x, *params).sum(), [x, *params]))
    chunked_peak = _peak_bytes(lambda: torch.autograd.grad(
        ops.token_chunked(key, [x], params, 1, 8).sum(), [x, *params]))
    assert dense_peak >= 2 * s * i * 4  # at least two (S, I) fp32 activations live at once
    assert chunked_peak < 0.3 * dense_peak, (chunked_peak, dense_peak)


# --- token_chunked under AOTAutograd / Inductor ------------------------------------------------


def test_token_chunked_aot_saves_only_inputs():
    region = ops.register_region(torch.fx.symbolic_trace(swiglu))
    key = region.key
    x, params = _x(torch.float32), _params(swiglu, torch.float32)

    chunked, dense = GraphRecorder(), GraphRecorder()
    out = torch.compile(lambda x, *p: ops.token_chunked(key, [x], p, 1, 4),
                        backend=chunked.backend, fullgraph=True)(x, *params)
    grad_x = torch.autograd.grad(out.sum(), x)[0]
    torch.compile(swiglu, backend=dense.backend, fullgraph=True)(x, *params).sum().backward()

    placeholders = {n for n in chunked.fw[0].graph.nodes if n.op == "placeholder"}
    saved = _saved_tensors(chunked.fw[0])
    assert saved and all(n in placeholders for n in saved)
    # Control: the unchunked MLP saves (B, S, I) activations, so the check above can fail.
    assert any(n.meta["val"].numel() >= B * S * I for n in _saved_tensors(dense.fw[0]))
    assert all(n.meta["val"].numel() < B * S * I for n in saved)
    # One opaque node each way; the recompute was not decomposed into the backward graph.
    assert _targets(chunked.fw[0]) == [torch.ops.tailorfx.token_chunked.default]
    bw_ops = _targets(chunked.bw[0])
    assert bw_ops.count(torch.ops.tailorfx.token_chunked_backward.default) == 1
    assert not any("mm" in str(t) for t in bw_ops)
    torch.testing.assert_close(grad_x, torch.autograd.grad(swiglu(x, *params).sum(), x)[0],
                               rtol=1e-5, atol=1e-6)


def test_token_chunked_symbolic_seq_len_compiles_once():
    region = ops.register_region(torch.fx.symbolic_trace(gpt2_mlp))
    key = region.key
    params = _params(gpt2_mlp, torch.float32)
    rec = GraphRecorder()
    f = torch.compile(lambda x, *p: ops.token_chunked(key, [x], p, 1, 3),
                      backend=rec.backend, dynamic=True, fullgraph=True)
    for s in (37, 50):
        x = _x(torch.float32, s=s)
        out = f(x, *params)
        torch.testing.assert_close(out, gpt2_mlp(x, *params), rtol=1e-5, atol=1e-6)
        out.sum().backward()
    assert len(rec.fw) == 1, "fake impl should handle a SymInt sequence length without recompiling"
    x_vals = [n.meta["val"] for n in rec.fw[0].graph.find_nodes(op="placeholder")
              if isinstance(n.meta["val"], torch.Tensor) and n.meta["val"].dim() == 3]
    assert len(x_vals) == 1 and isinstance(x_vals[0].shape[1], torch.SymInt)


def test_token_chunked_inductor():
    region = ops.register_region(torch.fx.symbolic_trace(swiglu))
    key = region.key
    x, params = _x(torch.float32), _params(swiglu, torch.float32)
    compiled = torch.compile(lambda x, *p: ops.token_chunked(key, [x], p, 1, 3),
                             backend="inductor", fullgraph=True)
    out, (code, *_) = run_and_get_code(compiled, x, *params)
    assert "torch.ops.tailorfx.token_chunked.default(" in code  # kept as one opaque fallback call
    ref = swiglu(x, *params)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), [x, *params])
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), [x, *params])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- chunked_linear_cross_entropy --------------------------------------------------------------


def _lce_inputs(n=203, h=24, v=61, dtype=torch.float32, bias=True, seed=2):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=dtype) / h ** 0.5).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = -100
    return hidden, weight, b, labels


def _reference_lce(hidden, weight, bias, labels, reduction, softcap=None):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lce_matches_cross_entropy(reduction, softcap, recompute):
    hidden, weight, bias, labels = _lce_inputs()  # N=203 is not divisible by 2, 3 or 8
    inputs = [hidden, weight, bias]
    ref = _reference_lce(hidden, weight, bias, labels, reduction, softcap)
    ref_grads = torch.autograd.grad(ref, inputs)
    for num_chunks in [1, 2, 3, 8]:
        loss = ops.chunked_linear_cross_entropy(hidden, weight, bias, labels, reduction=reduction,
                                                num_chunks=num_chunks, logit_softcap=softcap,
                                                recompute=recompute)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for got, want in zip(torch.autograd.grad(loss, inputs), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_lce_no_bias_frozen_weight_and_all_ignored():
    hidden, weight, _, labels = _lce_inputs(n=40, dtype=torch.float64, bias=False)
    weight.requires_grad_(False)
    loss = ops.chunked_linear_cross_entropy(hidden, weight, None, labels, num_chunks=3)
    ref = _reference_lce(hidden, weight, None, labels, "mean")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0],
                               torch.autograd.grad(ref, hidden)[0])
    # torch's convention when every label is ignored: mean is nan, sum is 0, grads are 0.
    ignored = torch.full_like(labels, -100)
    for reduction in ["mean", "sum"]:
        loss = ops.chunked_linear_cross_entropy(hidden, weight, None, ignored, num_chunks=3,
                                                reduction=reduction)
        ref = _reference_lce(hidden, weight, None, ignored, reduction)
        torch.testing.assert_close(loss, ref, equal_nan=True)
        torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0],
                                   torch.autograd.grad(ref, hidden)[0])


@pytest.mark.parametrize("logit_scale", [None, 0.5])
def test_lce_is_exact_where_the_targets_probability_underflows(logit_scale):
    """With gradients the CPU head takes each row's loss from its softmax (-log p_target); rows
    whose target logit sits so far below the max that p_target underflows in fp32 take theirs
    from the row's max logit instead (linear_ops._underflowed_losses): eager's finite loss, not inf."""
    from tailorfx.runtime.linear_ops import lce_chunks
    hidden, weight, bias, labels = _lce_inputs(n=64, h=16, v=50, dtype=torch.float64)
    hidden, weight, bias = hidden.detach(), weight.detach(), bias.detach()
    far = [3, 10, 40]
    for i in far:   # the target's weight row points away from the hidden row: logit about -160
        labels[i] = i % 50
        weight[labels[i]] = -hidden[i] / hidden[i].norm()
        hidden[i] *= 160 / hidden[i].norm() / (logit_scale or 1)
    inputs = [t.float().requires_grad_() for t in (hidden, weight, bias)]
    logits = F.linear(*inputs) * (logit_scale or 1)
    assert (torch.softmax(logits[far], 1).gather(1, labels[far, None]) == 0).all()   # fp32 underflows
    ref = F.cross_entropy(logits, labels)
    ref_grads = torch.autograd.grad(ref, inputs)
    loss, *grads = lce_chunks(*[t.detach() for t in inputs], labels, -100, "mean", 3, None, logit_scale,
                              True, True, True)
    assert torch.isfinite(loss) and ref.item() > 10
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_lce_bf16_close_to_fp32():
    hidden, weight, bias, labels = _lce_inputs(n=300, h=64, v=500, dtype=torch.bfloat16)
    loss = ops.chunked_linear_cross_entropy(hidden, weight, bias, labels, num_chunks=3)
    grads = torch.autograd.grad(loss, [hidden, weight, bias])
    # the loss as its math ran, in fp32 (eager's cross_entropy(logits.float())); grads in the inputs' dtype
    assert loss.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)
    ref_inputs = [t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
    ref = _reference_lce(*ref_inputs, labels, "mean")
    torch.testing.assert_close(loss.float(), ref, rtol=1e-2, atol=0)
    for got, want in zip(grads, torch.autograd.grad(ref, ref_inputs)):
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_lce_in_the_weights_dtype_is_eagers_bf16_head(softcap):
    """The CUDA path (GEMMs in bf16, logits upcast chunk by chunk, the weight's gradient summed in
    bf16), forced on CPU: eager's bf16 head (`cross_entropy(linear(h, w).float())`) to bf16's own
    rounding. (Its memory is measured on a GPU: benchmarks/gpu_check.py; CPU's bf16 GEMMs add
    scratch of their own.)"""
    from tailorfx.runtime.linear_ops import lce_chunks
    hidden, weight, bias, labels = _lce_inputs(n=300, h=64, v=500, dtype=torch.bfloat16)
    loss, gh, gw, gb = lce_chunks(hidden.detach(), weight.detach(), bias.detach(), labels, -100, "mean", 3,
                                  softcap, None, True, True, True, in_weight_dtype=True)
    assert (gh.dtype, gw.dtype, gb.dtype) == (torch.bfloat16,) * 3
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    ref = F.cross_entropy(logits, labels)
    assert loss.dtype == ref.dtype == torch.float32   # the loss as eager's, in fp32, not rounded to bf16
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for got, want in zip((gh, gw, gb), torch.autograd.grad(ref, [hidden, weight, bias])):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2



def test_lce_inference_computes_no_grads():
    hidden, weight, bias, labels = _lce_inputs()
    called = []

    class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            called.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), OpLog():
        loss = ops.chunked_linear_cross_entropy(hidden, weight, bias, labels, num_chunks=3)
    torch.testing.assert_close(loss, _reference_lce(hidden, weight, bias, labels, "mean"))
    assert torch.ops.tailorfx.chunked_linear_cross_entropy.default in called
    assert torch.ops.tailorfx.chunked_linear_cross_entropy_with_grads.default not in called


def test_lce_aot_graphs():
    hidden, weight, bias, labels = _lce_inputs()
    n, v = hidden.shape[0], weight.shape[0]
    for recompute, fw_op in [(False, "chunked_linear_cross_entropy_with_grads"),
                             (True, "chunked_linear_cross_entropy")]:
        rec = GraphRecorder()
        f = torch.compile(functools.partial(ops.chunked_linear_cross_entropy, num_chunks=4,
                                            recompute=recompute),
                          backend=rec.backend, fullgraph=True)
        loss = f(hidden, weight, bias, labels)
        grads = torch.autograd.grad(loss, [hidden, weight, bias])
        ref = _reference_lce(hidden, weight, bias, labels, "mean")
        for got, want in zip(grads, torch.autograd.grad(ref, [hidden, weight, bias])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert _targets(rec.fw[0]) == [getattr(torch.ops.tailorfx, fw_op).default]
        assert all(s.meta["val"].numel() < n * v for s in _saved_tensors(rec.fw[0]))
        bw_mm = [t for t in _targets(rec.bw[0]) if "mm" in str(t)]
        assert bw_mm == []  # grads were computed in the forward or by one opaque recompute op
        recomputes = _targets(rec.bw[0]).count(
            torch.ops.tailorfx.chunked_linear_cross_entropy_with_grads.default)
        assert recomputes == int(recompute)


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_lce_wrapper_as_fx_call_target(grad_enabled):
    # How a graph pass uses it: a call_function node, decided at AOT trace time by grad mode.
    hidden, weight, bias, labels = _lce_inputs()
    graph = torch.fx.Graph()
    args = [graph.placeholder(name) for name in ("hidden", "weight", "bias", "labels")]
    graph.output((graph.call_function(ops.chunked_linear_cross_entropy, tuple(args),
                                      {"num_chunks": 4}),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    fw_graphs = []

    def keep(gm, example_inputs):
        fw_graphs.append(gm)
        return make_boxed_func(gm.forward)

    with torch.set_grad_enabled(grad_enabled):
        (loss,) = aot_module_simplified(gm, [hidden, weight, bias, labels], fw_compiler=keep,
                                        bw_compiler=keep)(hidden, weight, bias, labels)
    torch.testing.assert_close(loss, _reference_lce(hidden, weight, bias, labels, "mean"))
    op = ("chunked_linear_cross_entropy_with_grads" if grad_enabled
          else "chunked_linear_cross_entropy")
    assert _targets(fw_graphs[0]) == [getattr(torch.ops.tailorfx, op).default]
    if grad_enabled:
        grads = torch.autograd.grad(loss, [hidden, weight, bias])
        ref = _reference_lce(hidden, weight, bias, labels, "mean")
        for got, want in zip(grads, torch.autograd.grad(ref, [hidden, weight, bias])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_lce_peak_memory_far_below_dense():
    # Measured with the profiler's allocator events; inputs are allocated before measuring.
    n, h, v = 4096, 64, 8000
    hidden, weight, bias, labels = _lce_inputs(n=n, h=h, v=v)

    def dense():
        torch.autograd.grad(_reference_lce(hidden, weight, bias, labels, "mean"),
                            [hidden, weight, bias])

    def chunked():
        torch.autograd.grad(ops.chunked_linear_cross_entropy(hidden, weight, bias, labels,
                                                             num_chunks=8),
                            [hidden, weight, bias])

    dense_peak, chunked_peak = _peak_bytes(dense), _peak_bytes(chunked)
    logits_bytes = n * v * 4
    assert dense_peak >= logits_bytes  # the dense version does materialise the logits
    assert chunked_peak < 0.3 * dense_peak, (chunked_peak, dense_peak)


# ---- linear_fp32_out ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fp32_out_keeps_the_fp32_accumulator(dtype, bias):
    """Forward: exactly the fp32 product of the low-precision operands (products of two 8- or
    11-bit mantissas are exact in fp32), not rounded to bf16. Backward: the low-precision matmuls
    torch.autocast runs, grads in the operands' dtypes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(8, 16, generator=g).to(dtype).requires_grad_()
    b = torch.randn(8, generator=g).to(dtype).requires_grad_() if bias else None
    y = ops.linear_fp32_out(x, w, b)
    ref = F.linear(x.detach().double(), w.detach().double(), b.detach().double() if bias else None)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-5)
    rounded = F.linear(x, w, b).float()
    assert (y - rounded).abs().max() > 0, "the result was rounded to the low dtype"
    go = torch.randn(y.shape, generator=g)
    y.backward(go)
    gl = go.to(dtype)
    torch.testing.assert_close(x.grad, gl @ w.detach())
    torch.testing.assert_close(w.grad, gl.reshape(-1, 8).t() @ x.detach().reshape(-1, 16))
    assert x.grad.dtype == w.grad.dtype == dtype
    if bias:
        torch.testing.assert_close(b.grad, go.reshape(-1, 8).sum(0).to(dtype))


def test_linear_fp32_out_opcheck():
    x = torch.randn(3, 4, 16).to(torch.bfloat16).requires_grad_()
    w = torch.randn(8, 16).to(torch.bfloat16).requires_grad_()
    torch.library.opcheck(ops.linear_fp32_out_op, (x, w, None))


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("with_grads", [False, True])
def test_fused_head_transient_matches_the_allocator(softcap, with_grads):
    """linear_ops.transient_bytes against the peak the allocator saw inside the fused head minus
    its outputs (fp32): one chunk's logits, and under a soft-cap the capped logits beside tanh's
    output (computed in the logits' own buffer); within the memory model's claim (-2% / +3%)."""
    import tailorfx
    from tailorfx.runtime import linear_ops
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(1023, 64, generator=g), torch.randn(8192, 64, generator=g)
    y = torch.randint(0, 8192, (1023,), generator=g)
    if with_grads:
        name, fn = "chunked_linear_cross_entropy_with_grads", torch.ops.tailorfx.chunked_linear_cross_entropy_with_grads
        args = [h, w, None, y, -100, "mean", 4, softcap, None, True, True, False]
    else:
        name, fn = "chunked_linear_cross_entropy", torch.ops.tailorfx.chunked_linear_cross_entropy
        args = [h, w, None, y, -100, "mean", 4, softcap, None]
    out = fn(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    measured = tailorfx.measure_peak(lambda: fn(*args)) - sum(t.numel() * t.element_size() for t in outs)
    predicted = linear_ops.transient_bytes(name, args, int)
    assert -0.02 * measured <= predicted - measured <= 0.03 * measured, (measured, predicted)


def test_a_gpu_budget_predicts_the_bf16_head_as_cuda_runs_it():
    """A GPU budget is predicted on CPU fake tensors: the bf16 head's transient is then CUDA's
    (bf16 GEMMs, a chunk's fp32 logits beside their bf16 gradient), not the CPU's fp32 copy of the
    weight and fp32 weight-gradient accumulator (2 x V x H x 4 bytes more)."""
    from tailorfx.runtime import linear_ops
    h, w = torch.empty(1024, 64, dtype=torch.bfloat16), torch.empty(8192, 64, dtype=torch.bfloat16)
    args = [h, w, None, torch.zeros(1024, dtype=torch.long), -100, "mean", 4, None, None, True, True, False]
    name = "chunked_linear_cross_entropy_with_grads"
    cuda = linear_ops.transient_bytes(name, args, int, cuda=True)
    assert cuda == 256 * 8192 * (4 + 2)
    assert linear_ops.transient_bytes(name, args, int) >= 2 * 8192 * 64 * 4   # CPU: the fp32 copies
