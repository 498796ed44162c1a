"""Triton flash attention (tailorfx/kernels/flash_attention.py) under Triton's CPU
interpreter, against the runtime's own definitions:

* full / window / BigBird: a dense fp64 masked softmax whose mask is
  `Pattern(kind, params, causal, S).element_mask` (tailorfx/runtime/attention_tiles.py) and the
  documents' equality, gradients by torch autograd;
* dilated (LongNet): the runtime's `tailorfx::dilated_attention` op in fp64 (its forward and
  its registered autograd), one (segment, rate) branch and several merged through the lse; with
  softcap (which that op lacks) a reference from the definition, checked against the op;
* empty rows (no NaN), skipped tiles (never loaded: NaN planted in them stays out), the
  rendered source holding only the spec's mask, and one spec compiled for sm90.

Tolerances. Inputs are rounded to the kernel's dtype first and the reference runs in fp64 on
the rounded values, so what remains is the kernel's own arithmetic. fp32: errors are a few fp32
ulps of the accumulations (<= 80 keys, D <= 32; measured ~1e-6); 1e-4 relative to the largest
reference value (at least 1) leaves 10x+ margin and still catches any mask or tile mistake, which
shows as errors of order 0.1. fp16: P and dS are rounded to fp16 for the dots and every output
once on store (2^-11 relative each; measured <= 1e-3 of the max): 1e-2 of the max. bf16: fp32
compute, one rounding to bf16 on store (2^-9 relative) plus the rounded `out` entering
delta = rowsum(dout * out): 2e-2 of the max (about 5 bf16 ulps). lse is fp32 in every case: 1e-4.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: kernels run on CPU

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import tailorfx.runtime.attention_kernels  # noqa: E402,F401  (registers tailorfx::dilated_attention)
from tailorfx import kernels as tt  # noqa: E402
from tailorfx.kernels import flash_attention as fa  # noqa: E402
from tailorfx.kernels import flash_launch as fl  # noqa: E402
from tailorfx.runtime.attention_tiles import Pattern  # noqa: E402

NEG_INF = float("-inf")
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


# ---- references --------------------------------------------------------------------------------

def dense_mask(mask, params, causal, seq, doc=None):
    """Bool (B or 1, 1, S, S): the runtime's element mask of (mask, params, causal) and documents."""
    if mask == "full":
        m = torch.ones(seq, seq, dtype=torch.bool)
        m = torch.tril(m) if causal else m
    else:
        m = Pattern(mask, tuple(params), causal, seq).element_mask(0, seq, torch.arange(seq), 0, seq - 1)
        m = torch.ones(seq, seq, dtype=torch.bool) if m is None else m
    m = m[None, None]
    if doc is not None:
        m = m & (doc[:, None, :, None] == doc[:, None, None, :])
    return m


def masked_attention(q, k, v, allowed, scale, softcap=None, key_bias=None):
    """(out, lse) of softmax attention under a bool mask broadcasting to (B, H, S, S); K/V
    repeated over the query heads of their group; a per-key bias (B, H, S) added after the
    soft-cap; empty rows: out 0, lse -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if key_bias is not None:
        s = s + key_bias.to(s.dtype)[:, :, None, :]
    s = s.masked_fill(~allowed, NEG_INF)
    top = s.amax(-1, keepdim=True).detach()
    top = top.masked_fill(top == NEG_INF, 0.0)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    out = p / total.masked_fill(total == 0, 1.0) @ v
    return out, (top + torch.log(total)).squeeze(-1)


def dilated_reference(q, k, v, segments, rates, causal, scale, doc=None, softcap=None):
    """LongNet from its definition: per branch (w, r), head h attends within each segment of w
    positions among those at offset h % r (mod r, from the segment's start); branches merge
    through their lse."""
    heads, seq = q.shape[1], q.shape[2]
    pos = torch.arange(seq)
    outs, lses = [], []
    for w, r in zip(segments, rates):
        on = (pos % w % r)[None, :] == (torch.arange(heads) % r)[:, None]               # (H, S)
        allowed = on[:, :, None] & on[:, None, :] & ((pos // w)[:, None] == (pos // w)[None, :])
        allowed = allowed[None] & dense_mask("full", (), causal, seq, doc)
        o, l = masked_attention(q, k, v, allowed, scale, softcap)
        outs.append(o)
        lses.append(l)
    lse = torch.logsumexp(torch.stack(lses), 0)
    safe = lse.masked_fill(lse == NEG_INF, 0.0)
    return sum(o * torch.exp(l - safe)[..., None] for o, l in zip(outs, lses)), lse


def reference(q, k, v, mask, params, causal, scale, doc=None, softcap=None, key_bias=None):
    """(out, lse) as the runtime defines them (dilated without softcap: the runtime's op itself)."""
    if mask == "dilated":
        assert key_bias is None
        segs, rates = fl.normalize_params(mask, params)
        if softcap is not None:
            return dilated_reference(q, k, v, segs, rates, causal, scale, doc, softcap)
        return torch.ops.tailorfx.dilated_attention(q, k, v, doc, list(segs), list(rates), scale, causal)
    return masked_attention(q, k, v, dense_mask(mask, params, causal, q.shape[2], doc), scale, softcap, key_bias)


def make_inputs(batch, heads, kv_heads, seq, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim), (batch, heads, seq, dim)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def assert_close(got, want, tol, what):
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), f"{what}: NaN"
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def check(batch, heads, kv_heads, seq, dim, mask, params, causal, doc=None, softcap=None, dtype=torch.float32,
          blocks=(16, 16), seed=0, key_bias=None, kv_split=None):
    """Forward and backward of the kernels against the reference (autograd for its gradients)."""
    q, k, v, dout = make_inputs(batch, heads, kv_heads, seq, dim, dtype, seed)
    scale = 1.0 / math.sqrt(dim)
    kw = dict(mask=mask, params=params, causal=causal, scale=scale, document_ids=doc, softcap=softcap, blocks=blocks,
              key_bias=key_bias, kv_split=kv_split)
    out, lse = fl.forward(q, k, v, **kw)
    dq, dk, dv = fl.backward(dout, q, k, v, out, lse, **kw)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and dk.shape == k.shape and lse.shape == q.shape[:3]

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = reference(qr, kr, vr, mask, params, causal, scale, doc, softcap,
                       None if key_bias is None else key_bias.double().expand(batch, heads, seq))
    ro.backward(dout.double())
    tol = TOL[dtype]
    empty = rl == NEG_INF
    assert torch.equal(lse == NEG_INF, empty), "rows that see no key differ"
    assert_close(lse.masked_fill(empty, 0.0), rl.detach().masked_fill(empty, 0.0), 1e-4, "lse")
    for name, got, want in (("out", out, ro.detach()), ("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert_close(got, want, tol, name)
    return out, lse, (dq, dk, dv)


# ---- property test over shapes and masks -------------------------------------------------------

@st.composite
def mask_specs(draw, seq):
    kind = draw(st.sampled_from(["full", "window", "bigbird", "dilated"]))
    if kind == "full":
        return kind, ()
    if kind == "window":
        return kind, (draw(st.integers(1, 40)), draw(st.integers(0, 8)))
    if kind == "bigbird":   # blocks of 8 or 24 do not line up with the tiles: the kernel reads the block mask
        return kind, (draw(st.sampled_from([8, 16, 24, 32])), draw(st.integers(0, 2)), draw(st.integers(0, 2)),
                      draw(st.integers(0, 2)), draw(st.integers(0, 9)))
    n = draw(st.integers(1, 2))
    return kind, (tuple(draw(st.lists(st.sampled_from([8, 16, 32, 64]), min_size=n, max_size=n))),
                  tuple(draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), batch=st.integers(1, 2), heads=st.sampled_from([1, 2, 4]), seq=st.integers(16, 80),
       dim=st.sampled_from([16, 32]), causal=st.booleans(), docs=st.sampled_from([None, "packed", "random"]),
       softcap=st.sampled_from([None, 2.0]), blocks=st.sampled_from([(16, 16), (32, 16), (16, 32, 32, 16), (32, 32)]))
def test_matches_reference(data, batch, heads, seq, dim, causal, docs, softcap, blocks):
    """fp32 forward and backward against the runtime's mask definitions, over shapes that are no
    multiple of the tiles, GQA/MQA, documents (sorted runs or arbitrary ids), softcap."""
    kv_heads = data.draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]), label="kv_heads")
    mask, params = data.draw(mask_specs(seq), label="mask")
    doc = None
    if docs:
        g = torch.Generator().manual_seed(seq)
        doc = torch.randint(0, 3, (batch, seq), generator=g)
        doc = doc.sort(-1).values if docs == "packed" else doc
    check(batch, heads, kv_heads, seq, dim, mask, params, causal, doc, softcap, blocks=blocks, seed=seq * 7 + dim)


@pytest.mark.parametrize("mask,params,causal,docs,softcap,kv_heads", [
    ("full", (), True, False, None, 2),
    ("window", (9, 2), True, True, 2.0, 1),
    ("full", (), False, False, None, 4),
], ids=["causal-gqa", "window-documents-softcap", "bidirectional"])
def test_key_bias(mask, params, causal, docs, softcap, kv_heads):
    """ALiBi's per-key bias (slope_h x key position, as Bloom and MPT build it; broadcast over the
    batch) added to every query's scores after the soft-cap: fp32 forward and backward against
    the reference with the bias in its scores. Without the bias the outputs differ by far more
    than the tolerance, so the kernel read it."""
    heads, seq = 4, 50
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])
    bias = (slopes[:, None] * torch.arange(seq))[None]
    doc = torch.tensor([[0] * 20 + [1] * 30, [0] * 5 + [1] * 45]) if docs else None
    out, _, _ = check(2, heads, kv_heads, seq, 32, mask, params, causal, doc, softcap, blocks=(32, 16), key_bias=bias)
    q, k, v, _ = make_inputs(2, heads, kv_heads, seq, 32, torch.float32, 0)
    plain, _ = fl.forward(q, k, v, mask=mask, params=params, causal=causal, scale=32 ** -0.5, document_ids=doc,
                          softcap=softcap, blocks=(32, 16))
    assert (plain - out).abs().max() > 100 * TOL[torch.float32]


@pytest.mark.parametrize("kv_split", [2, 4])
@pytest.mark.parametrize("mask,params,causal,docs,softcap,dtype", [
    ("full", (), True, False, None, torch.float32),
    ("window", (9, 2), True, True, 2.0, torch.float32),
    ("bigbird", (16, 1, 1, 1, 3), False, False, None, torch.float32),
    ("full", (), True, True, None, torch.bfloat16),
], ids=["causal", "window-documents-softcap", "bigbird", "bf16-documents"])
def test_query_heads_split_over_dkdv_programs(kv_split, mask, params, causal, docs, softcap, dtype):
    """GQA's query heads in parallel: a KV head's 4 query heads over 2 or 4 dk/dv programs, each
    storing its fp32 part, summed by the host. The reference's gradients, and the parts were made
    (split x the KV heads' shape, fp32): the launch did split."""
    from torch.utils._python_dispatch import TorchDispatchMode
    made = []

    class Parts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format:
                made.append((tuple(out.shape), out.dtype))
            return out
    doc = torch.tensor([[0] * 20 + [1] * 30, [0] * 5 + [1] * 45]) if docs else None
    with Parts():
        check(2, 8, 2, 50, 32, mask, params, causal, doc, softcap, dtype=dtype, blocks=(16, 16), kv_split=kv_split)
    assert ((kv_split, 2, 2, 50, 32), torch.float32) in made, made
    with pytest.raises(ValueError, match="kv_split=3: a divisor of the GQA group 4"):
        check(1, 8, 2, 20, 32, mask, params, causal, None, softcap, dtype=dtype, kv_split=3)


# ---- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask,params,causal,softcap", [
    ("full", (), True, None),
    ("window", (9, 2), False, 2.0),
    ("bigbird", (16, 1, 1, 1, 3), True, None),
], ids=["full-causal", "window-softcap", "bigbird-causal"])
def test_half_precision_inputs(dtype, mask, params, causal, softcap):
    """16-bit inputs (GQA, documents), fp32 compute: the fp64 reference on the rounded inputs."""
    doc = torch.tensor([[0] * 20 + [1] * 30, [0] * 5 + [1] * 45])
    check(2, 4, 2, 50, 32, mask, params, causal, doc, softcap, dtype=dtype, blocks=(32, 16))


def test_dilated_half_precision():
    check(1, 4, 2, 48, 32, "dilated", ((16, 32), (1, 2)), True, dtype=torch.bfloat16, blocks=(16, 16))


# ---- dilated: the runtime op, one branch and merged branches -----------------------------------

@pytest.mark.parametrize("heads,kv_heads,seq,segments,rates,causal,docs", [
    (2, 1, 40, (16,), (2,), False, False),            # one branch, tail segment, MQA
    (4, 2, 50, (16,), (3,), True, True),              # one branch, rate > group
    (4, 2, 70, (16, 32, 64), (1, 2, 4), True, False),  # merged branches, segment > S
    (3, 1, 50, (8, 50), (1, 5), False, True),         # rate > heads: offsets beyond the heads stay empty
])
def test_dilated_matches_runtime_op(heads, kv_heads, seq, segments, rates, causal, docs):
    doc = torch.tensor([[0] * (seq // 3) + [1] * (seq - seq // 3)]) if docs else None
    check(1, heads, kv_heads, seq, 16, "dilated", (segments, rates), causal, doc, blocks=(16, 16))


def test_dilated_reference_is_the_runtime_op():
    """The definition-level reference (used with softcap, which the runtime op lacks) agrees with
    `tailorfx::dilated_attention`."""
    q, k, v, _ = (t.double() for t in make_inputs(2, 4, 2, 70, 8, torch.float32, 4))
    doc = torch.randint(0, 2, (2, 70), generator=torch.Generator().manual_seed(0)).sort(-1).values
    for segs, rates, causal in (((16, 32, 64), (1, 2, 4), True), ((20, 40), (3, 5), False)):
        want = torch.ops.tailorfx.dilated_attention(q, k, v, doc, list(segs), list(rates), 0.3, causal)
        got = dilated_reference(q, k, v, segs, rates, causal, 0.3, doc)
        torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


def test_dilated_softcap():
    check(1, 4, 2, 50, 16, "dilated", ((16, 32), (2, 3)), True, softcap=2.0, blocks=(16, 16))


# ---- empty rows ------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_rows_that_see_nothing(causal):
    """Window 0 leaves only the global tokens: rows of documents without one see no key. No NaN:
    out and dq are 0 there, lse -inf, and every other row matches the reference."""
    doc = torch.tensor([[0] * 10 + [1] * 20 + [2] * 15])
    out, lse, (dq, dk, dv) = check(1, 2, 1, 45, 16, "window", (0, 2), causal, doc, blocks=(16, 16))
    empty = torch.zeros(45, dtype=torch.bool)
    empty[10:] = True   # documents 1 and 2 hold no global token
    assert bool((lse[0, :, empty] == NEG_INF).all()) and bool(torch.isfinite(lse[0, :, ~empty]).all())
    assert bool((out[0, :, empty] == 0).all()) and bool((dq[0, :, empty] == 0).all())
    for t in (dk, dv):   # keys of those documents are seen by no row either
        assert bool((t[0, :, empty] == 0).all()) and not torch.isnan(t).any()


def test_rows_that_see_only_themselves():
    """Window 1, no global token, documents: each row attends itself alone (out = v, lse = q.k)."""
    q, k, v, _ = make_inputs(1, 2, 2, 33, 16, torch.float32, 3)
    doc = torch.arange(33)[None] % 4
    out, lse = fl.forward(q, k, v, mask="window", params=(1, 0), causal=False, scale=0.5, document_ids=doc,
                          blocks=(16, 16))
    torch.testing.assert_close(out, v, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, (q * k).sum(-1) * 0.5, rtol=1e-5, atol=1e-5)


# ---- tiles that are skipped, not masked --------------------------------------------------------

def _tile_pairs(mask, params, causal, seq, bm, bn):
    """Bool (query tiles, key tiles): the pairs holding at least one allowed element."""
    m = dense_mask(mask, params, causal, seq)[0, 0]
    nq, nk = -(-seq // bm), -(-seq // bn)
    pad = torch.zeros(nq * bm, nk * bn, dtype=torch.bool)
    pad[:seq, :seq] = m
    return pad.view(nq, bm, nk, bn).any(3).any(1)


@pytest.mark.parametrize("mask,params,causal", [
    ("full", (), True), ("window", (7, 3), True), ("window", (7, 3), False), ("window", (20, 0), False),
    ("bigbird", (16, 1, 1, 1, 5), False), ("bigbird", (8, 0, 1, 1, 2), True),
])
def test_masked_tiles_are_never_loaded(mask, params, causal):
    """NaN planted in one key tile of V reaches exactly the query tiles whose loop visits it
    (0 * NaN is NaN in P @ V), so the visited tiles must be exactly those with an allowed pair;
    likewise NaN in one query tile of dout reaches dv of exactly the key tiles that see it."""
    seq, bm, bn = 80, 16, 16
    q, k, v, dout = make_inputs(1, 2, 1, seq, 16, torch.float32, 5)
    need = _tile_pairs(mask, params, causal, seq, bm, bn)
    kw = dict(mask=mask, params=params, causal=causal, blocks=(bm, bn))
    kt, qt = 2, 3
    poisoned = v.clone()
    poisoned[:, :, kt * bn:(kt + 1) * bn] = float("nan")
    out, _ = fl.forward(q, k, poisoned, **kw)
    visited = out[0, 0].isnan().any(-1).view(-1, bm).any(-1)
    assert torch.equal(visited, need[:, kt]), f"query tiles visiting key tile {kt}: {visited} != {need[:, kt]}"
    out, lse = fl.forward(q, k, v, **kw)
    bad = dout.clone()
    bad[:, :, qt * bm:(qt + 1) * bm] = float("nan")
    _, _, dv = fl.backward(bad, q, k, v, out, lse, **kw)
    visited = dv[0, 0].isnan().any(-1).view(-1, bn).any(-1)
    assert torch.equal(visited, need[qt, :]), f"key tiles visiting query tile {qt}: {visited} != {need[qt, :]}"


@pytest.mark.parametrize("block", [8, 64], ids=["block-mask", "aligned"])
def test_bigbird_tables_trace_as_constants(block):
    """Inductor traces a triton_op's host code on fake tensors (Dynamo first runs it under its own
    fake mode): BigBird's block tables, cached as real tensors by an eager launch, must come out
    as constants of the traced graph, equal to the eager launch's."""
    from torch.fx.experimental.proxy_tensor import make_fx
    spec = dict(_spec("bigbird", bigbird_block=block, causal=True, bwd_block_m=32, bwd_block_n=16).params)
    params = fl.normalize_params("bigbird", (block, 1, 1, 1, 3))

    def tables(x):
        mode = fl._mode_args(spec, params, True, 256, x.device, "dkdv")
        return [t + x for t in mode if isinstance(t, torch.Tensor)]
    x = torch.zeros((), dtype=torch.int32)
    want = tables(x)   # an eager launch first: its tables are cached, real tensors
    graph = make_fx(tables, tracing_mode="fake")(x)
    assert "_tensor_constant" in graph.code
    assert len(want) == (2 if block == 64 else 3)
    for got, ref in zip(graph(x), want):
        assert torch.equal(got, ref)
    # as Dynamo runs an op's host code on its fake tensors (on CUDA: triton_attention's)
    op = _TABLE_OPS.setdefault(block, _table_op(f"bigbird_tables_{block}", tables))
    compiled = torch.compile(lambda x: op(x) * 1, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), op(x))


def test_bigbird_tables_go_to_the_device_once_per_pattern():
    """An eager launch copies BigBird's block tables to the device once per (pattern, length,
    tiles, device): the next launch gets the same device tensors, no copy (here the meta device,
    where every `.to` makes a new tensor), equal to the host tables."""
    spec = dict(_spec("bigbird", bigbird_block=8, causal=True, bwd_block_m=32, bwd_block_n=16).params)
    params = fl.normalize_params("bigbird", (8, 1, 1, 1, 3))
    for role in ("fwd", "dq", "dkdv"):
        first = fl._mode_args(spec, params, True, 256, torch.device("meta"), role)
        again = fl._mode_args(spec, params, True, 256, "meta", role)
        tensors = [t for t in first if isinstance(t, torch.Tensor)]
        assert len(tensors) == 3 and all(t.device.type == "meta" for t in tensors), first
        assert all(a is b for a, b in zip(tensors, (t for t in again if isinstance(t, torch.Tensor)))), role
        host = fl._mode_args(spec, params, True, 256, torch.device("cpu"), role)
        assert [t.shape for t in tensors] == [t.shape for t in host if isinstance(t, torch.Tensor)]
        assert first[2] == host[2] and first[4] == host[4], (first, host)


_TABLE_OPS: dict = {}


def _table_op(name, tables):
    """A custom op whose fake kernel runs `tables` (host code) under Dynamo's fake mode."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return sum(t.sum() for t in tables(x)) + x
    op = torch.library.custom_op(f"tailorfx_test::{name}", fn, mutates_args=())
    op.register_fake(fn)
    return op


# ---- rendering, specs, compile -----------------------------------------------------------------

def _spec(mask, **kw):
    base = dict(dtype="fp32", head_dim=64, mask=mask, causal=False, documents=False, group=1, block_m=32, block_n=32)
    return tt.KernelSpec("flash_attention", **{**base, **kw})


def test_source_holds_only_the_chosen_mask():
    full, window = tt.render(_spec("full")), tt.render(_spec("window"))
    bigbird = tt.render(_spec("bigbird", bigbird_block=16))   # 16 < 32: blocks inside a tile
    aligned = tt.render(_spec("bigbird", bigbird_block=64))   # whole tiles: no element lookups
    dilated = tt.render(_spec("dilated"))
    for src in (full, window, bigbird, aligned, dilated):
        assert "doc_ptr" not in src and "SOFTCAP" not in src and "offs_n[None, :] <= offs_m" not in src
    assert "num_global" not in full and "table_ptr" not in full and "segment" not in full
    assert "num_global" in window and "table_ptr" not in window and "bm_ptr" not in window and "segment" not in window
    assert "table_ptr" in bigbird and "bm_ptr" in bigbird and "num_global" not in bigbird
    assert "table_ptr" in aligned and "bm_ptr" not in aligned and "BB_BLOCK" not in aligned
    assert "offs_n * rate" in dilated and "table_ptr" not in dilated and "num_global" not in dilated
    rich = tt.render(_spec("window", causal=True, documents=True, softcap=30.0))
    assert "doc_ptr" in rich and "SOFTCAP = tl.constexpr(30.0)" in rich and "offs_n[None, :] <= offs_m[:, None]" in rich
    assert "(tl.abs(" not in rich   # the causal band test replaces the symmetric one


def test_interior_tiles_run_without_the_positional_mask():
    """A full mask splits each key loop: tiles wholly before the query tile's first row (causal)
    or wholly in range run without the causal and range masks, the diagonal and the tail with
    them; dk/dv of a bidirectional full mask runs unmasked."""
    src = tt.render(_spec("full", causal=True))
    fwd = src[src.index("def attn_fwd"):src.index("def attn_bwd_preprocess")]
    interior, diagonal = fwd.split("for kt in range(0, n_full):")[1].split("for kt in range(n_full, hi):")
    assert "mask" not in interior and "m_safe = m_new" in interior   # no load is masked either
    assert "offs_n[None, :] <= offs_m[:, None]" in diagonal
    bidir = tt.render(_spec("full"))
    dkdv = bidir[bidir.index("def attn_bwd_dkdv"):].split("tl.store")[0]
    assert "mask =" not in dkdv and "tl.where" not in dkdv
    docs = tt.render(_spec("full", causal=True, documents=True))
    interior = docs.split("for kt in range(0, n_full):")[1].split("for kt in range(n_full, hi):")[0]
    assert "mask = doc_m[:, None] == doc_n[None, :]" in interior and "<=" not in interior
    for mode in ("window", "bigbird", "dilated"):   # their loops are not split
        assert "n_full" not in tt.render(_spec(mode, causal=True, **({"bigbird_block": 16} if mode == "bigbird" else {})))


@pytest.mark.parametrize("causal", [True, False])
def test_a_large_key_bias_leaves_no_nan_in_unmasked_tiles(causal):
    """Bloom's ALiBi grows with the key (here 2 x position, up to 98): rows past the end of an
    unmasked interior tile read lse = inf, so their p is 0, not exp(98) x 0; 50 tokens are no
    multiple of the tiles."""
    bias = (2.0 * torch.arange(50.0))[None, None].expand(1, 2, 50)
    check(1, 2, 1, 50, 16, "full", (), causal, blocks=(16, 32, 16, 16), key_bias=bias)


def test_spec_and_argument_errors():
    with pytest.raises(ValueError, match="mask 'nope'"):
        tt.render(_spec("nope"))
    with pytest.raises(ValueError, match="power of two"):
        tt.render(_spec("full", block_m=24))
    with pytest.raises(ValueError, match="bigbird_block"):
        tt.render(_spec("bigbird"))
    q, k, v, _ = make_inputs(1, 3, 2, 16, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        fl.forward(q, k, v)
    with pytest.raises(ValueError, match="window"):
        fl.forward(q, k[:, :1], v[:, :1], mask="window", params=(3,))
    with pytest.raises(ValueError, match="scale=-1.0: must be positive"):   # the kernels scale each row's max
        fl.forward(q, q, q, scale=-1.0)


def test_examples_cover_the_family():
    ex = fa.examples()
    assert {s["mask"] for s in ex} == set(fa.MODES)
    assert {s["dtype"] for s in ex} == {"fp32", "fp16", "bf16"}
    assert {s["head_dim"] for s in ex} >= {64, 128}
    assert any(s["group"] > 1 for s in ex) and any(s.get("softcap") for s in ex) and any(not s.get("softcap") for s in ex)
    assert any(s["causal"] for s in ex) and any(not s["causal"] for s in ex) and any(s["documents"] for s in ex)
    assert any(s.get("key_bias") for s in ex) and any(s.get("key_bias") and s.get("softcap") for s in ex)
    for s in ex:
        assert set(tt.render(s).count(f"def {n}(") for n in fa.signatures(s)) == {1}


def test_autograd_wrapper():
    q, k, v, dout = make_inputs(1, 2, 1, 24, 16, torch.float32, 1)
    kw = dict(mask="window", params=(5, 1), causal=True, blocks=(16, 16))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = fl.attention(q, k, v, **kw)
    out.backward(dout)
    o2, l2 = fl.forward(q.detach(), k.detach(), v.detach(), **kw)
    grads = fl.backward(dout, q.detach(), k.detach(), v.detach(), o2, l2, **kw)
    assert torch.equal(out.detach(), o2) and not lse.requires_grad
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.ptxas   # make test-torch211 (CI) runs it under the GPU machines' Triton
def test_compiles_for_sm90_without_spills():
    """One example (bf16, head dim 128, causal, GQA 4) through triton.compile and ptxas for sm90."""
    spec = fa.examples()[0]
    assert spec["head_dim"] == 128 and spec["dtype"] == "bf16" and spec["group"] == 4
    res = tt.load(spec).compile(90)
    assert set(res["functions"]) == set(fa.signatures(spec))
    assert res["n_spills"] == 0, res["functions"]
    assert 0 < res["n_regs"] <= 255
    assert res["shared_bytes"] <= tt.SHARED_LIMIT[90]

