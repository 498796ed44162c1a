"""runtime/inductor_region.py: a region run as Inductor compiles it alone, one opaque op each way."""
import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.runtime.inductor_region import inductor_region, region_of, register


def _rotary(q, cos, sin):
    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin


def _norm(x, w, eps: float):
    f = x.to(torch.float32)
    return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _traced(fn, names: tuple[str, ...]) -> fx.GraphModule:
    """fn's graph with its nodes renamed (as another layer's region is named in a capture)."""
    gm = fx.symbolic_trace(fn)
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            n.name = f"{names[0]}_{n.name}"
    gm.recompile()
    return gm


def test_a_form_is_registered_once_whatever_its_nodes_are_named_and_each_constant_apart():
    """Two layers' norms (the same ops on the same epsilon, nodes named apart) share a key, so one
    compiled forward and backward; another epsilon, or other inputs differentiated, is another."""
    def layer(eps):
        return lambda x, w: (_norm(x, w, eps),)
    a = register(_traced(layer(1e-6), ("layers_0",)), (True, True))
    b = register(_traced(layer(1e-6), ("layers_1",)), (True, True))
    assert a == b and region_of(a) is not None
    assert register(_traced(layer(1e-5), ("layers_0",)), (True, True)) != a
    assert register(_traced(layer(1e-6), ("layers_0",)), (True, False)) != a


def test_forward_and_backward_equal_eager_and_only_differentiated_inputs_get_gradients():
    """A rotary region whose cos and sin take no gradient: the op's output and q's gradient equal
    eager's (fp32), cos and sin get none, the backward is the one compiled op, and the graph of a
    step through the op keeps the two opaque nodes (AOTAutograd traces no further into them)."""
    key = register(fx.symbolic_trace(lambda q, cos, sin: (_rotary(q, cos, sin),)), (True, False, False))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 16, generator=g, requires_grad=True)
    cos, sin = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    dout = torch.randn(2, 4, 24, 16, generator=g)
    got = inductor_region(key, q, cos, sin)
    (got_grad,) = torch.autograd.grad(got, q, dout)
    want = _rotary(q, cos, sin)
    (want_grad,) = torch.autograd.grad(want, q, dout)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1.3e-6, atol=1e-5)
    assert type(got.grad_fn).__name__.startswith("GeneratedBackwardFor_tailorfx_inductor_region")
    assert set(region_of(key).compiled) >= {"fw", "bw"}

    seen = []

    def backend(gm, inputs):
        def keep(g, _):
            seen.append(g)
            return compat.make_boxed_func(g.forward)
        return compat.aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)
    step = torch.compile(lambda q: inductor_region(key, q * 2, cos, sin).sum(), backend=backend)
    step(q).backward()
    targets = [str(n.target) for g in seen for n in g.graph.nodes if n.op == "call_function"]
    assert "tailorfx.inductor_region.default" in targets and "tailorfx.inductor_region_backward.default" in targets
    assert not any("cat" in t for t in targets), targets   # the region's own ops stayed inside the op
    (want_step,) = torch.autograd.grad(_rotary(q * 2, cos, sin).sum(), q)
    torch.testing.assert_close(q.grad, want_step, rtol=1.3e-6, atol=1e-5)
