"""Triton kernels of the fused LM head + cross-entropy, the gated MLP activations (SwiGLU/GeGLU)
and rotary embeddings, forward and backward, against torch references (autograd for the
backward) under Triton's CPU interpreter; what their rendered source leaves out; one sm90 compile
per family (no spills, shared memory within the limit).

Tolerances (max abs error over the reference's max abs value, or elementwise where stated):
    linear_cross_entropy  fp32 1e-4 (loss and grads; the grads also 16 ulps of the softmax - one-hot
                          cancellation, _cancellation); fp16/bf16 inputs with fp32 compute against the
                          fp32 reference on the same (rounded) values, to the rounding of the
                          loss and grads to the inputs' dtype (fp16 2e-3, bf16 1e-2)
    glu                   against fp64 autograd: fp32 elementwise rtol 1e-5, atol 1e-6; fp16/bf16 the
                          outputs' rounding (rtol 2e-3 / 1.6e-2)
    rope                  fp32 elementwise rtol 1e-5, atol 1e-5; fp16/bf16 the outputs' rounding
"""
import math
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton or the kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from tailorfx import kernels as tt  # noqa: E402
from tailorfx.kernels import glu, linear_cross_entropy as lce, rope  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LP_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _close(got, ref, tol, name, atol=0.0):
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, name
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol * max(ref.abs().max().item() if ref.numel() else 0.0, 1e-6) + atol, \
        f"{name}: max error {err:.3g} over max |ref| {ref.abs().max().item():.3g} (atol {atol:.3g})"


def _cancellation(other: torch.Tensor) -> float:
    """fp32 rounding of a gradient (softmax - one-hot) @ `other` whose terms nearly cancel (a
    confident row: p = 1 - 5e-6): 16 ulps of 1 times the largest column sum of |other| it
    multiplies. Exact arithmetic in both, so reference and kernel each carry it; tiny next to
    tol x max|grad| unless the gradient itself is that small."""
    return 16 * torch.finfo(torch.float32).eps * other.float().abs().sum(0).max().item() if other.numel() else 0.0


def _loss_cancellation(z: torch.Tensor, valid: torch.Tensor, divisor: float, z_loss: float) -> float:
    """fp32 rounding of a loss whose rows' log-sum-exp and label logit nearly cancel (a confident
    row's loss of 1.7e-5 from terms of order |z|): 4 ulps of each valid row's largest term
    (max |logit| + log V, and the z-loss's square of it), summed and divided as the loss is. Both
    reference and kernel carry it; tiny next to tol x the loss unless the loss itself is that small."""
    if not valid.any():
        return 0.0
    m = z.detach().abs().amax(-1) + math.log(z.shape[-1])
    return 4 * torch.finfo(torch.float32).eps * ((m + z_loss * m * m) * valid).sum().item() / divisor


# ---- linear + cross-entropy ------------------------------------------------------------------

def _lce_ref(h, w, b, y, ignore_index, reduction, softcap, logit_scale, z_loss, normalizer):
    """Materialised fp32 logits, F.cross_entropy, plus the z-loss of the non-ignored rows."""
    z = F.linear(h, w, b)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    total = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")
    valid = y != ignore_index
    if z_loss:
        total = total + z_loss * (torch.logsumexp(z, -1).pow(2) * valid).sum()
    if reduction == "sum":
        return total
    # torch: a mean over no valid row is nan and its grads zero; clamp here, check the nan apart
    return total / (valid.sum().clamp(min=1) if normalizer is None else normalizer)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 19), hid=st.integers(1, 11), vocab=st.integers(1, 70), chunk=st.integers(1, 8),
       bias=st.booleans(), softcap=st.sampled_from([None, 4.0]), logit_scale=st.sampled_from([None, 0.7]),
       z_loss=st.sampled_from([0.0, 0.01]), reduction=st.sampled_from(["mean", "sum"]),
       normalizer=st.sampled_from([None, 6.5]), ignore=st.sampled_from([-100, 0]),
       first_chunk_ignored=st.booleans(), dtype=st.sampled_from(DTYPES), block=st.sampled_from([16, None]),
       seed=st.integers(0, 2 ** 16))
def test_linear_cross_entropy_matches_torch(n, hid, vocab, chunk, bias, softcap, logit_scale, z_loss, reduction,
                                            normalizer, ignore, first_chunk_ignored, dtype, block, seed):
    """Loss and grad_hidden/grad_weight/grad_bias for d(loss) = 1 against autograd through
    F.cross_entropy on materialised fp32 logits; vocab blocks of 16 (V not a multiple), chunks
    of rows with ignored labels (a whole chunk of them when first_chunk_ignored); block None: the
    default, one block over the whole (small) vocabulary."""
    if reduction == "sum":
        normalizer = None
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hid, generator=g) * 2).to(dtype)
    w = torch.randn(vocab, hid, generator=g).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.3] = ignore
    if ignore == -100:
        y[torch.rand(n, generator=g) < 0.2] = -100
    if first_chunk_ignored:
        y[:chunk] = ignore
    hr, wr = h.float().clone().requires_grad_(), w.float().clone().requires_grad_()
    br = b.float().clone().requires_grad_() if b is not None else None
    ref = _lce_ref(hr, wr, br, y, ignore, reduction, softcap, logit_scale, z_loss, normalizer)
    ref.backward()

    loss, gh, gw, gb = lce.forward(h, w, b, y, ignore_index=ignore, reduction=reduction, softcap=softcap,
                                   logit_scale=logit_scale, z_loss=z_loss, chunk=chunk, normalizer=normalizer,
                                   block=block)
    assert loss.dtype == torch.promote_types(dtype, torch.float32) and gh.dtype == dtype and gw.dtype == dtype
    if reduction == "mean" and normalizer is None and not (y != ignore).any():
        assert loss.isnan()   # as F.cross_entropy's mean over no valid row; the grads are zero
    else:
        z = F.linear(hr, wr, br) * (1.0 if logit_scale is None else logit_scale)
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        valid = y != ignore
        divisor = 1.0 if reduction == "sum" else float(normalizer or max(int(valid.sum()), 1))
        _close(loss, ref.detach(), LP_TOL[dtype], "loss",   # in fp32, the GEMMs in the inputs' dtype
               _loss_cancellation(z, valid, divisor, z_loss))
    tol = LP_TOL[dtype]
    _close(gh, hr.grad, tol, "grad_hidden", _cancellation(w))
    _close(gw, wr.grad, tol, "grad_weight", _cancellation(h))
    if b is not None:
        assert gb.dtype == dtype
        _close(gb, br.grad, tol, "grad_bias")
    else:
        assert gb is None


def test_linear_cross_entropy_matches_the_runtime_op():
    """The same numbers as the torch implementation it mirrors (linear_ops: logit_scale then the
    soft-cap, mean over non-ignored rows), and a loss-only launch gives the same loss."""
    from tailorfx.runtime.linear_ops import lce_chunks
    g = torch.Generator().manual_seed(3)
    h, w, b = torch.randn(23, 12, generator=g), torch.randn(50, 12, generator=g), torch.randn(50, generator=g)
    y = torch.randint(0, 50, (23,), generator=g)
    y[::4] = -100
    want = lce_chunks(h, w, b, y, -100, "mean", 3, 3.0, 0.5, True, True, True)
    got = lce.forward(h, w, b, y, softcap=3.0, logit_scale=0.5, chunk=8, block=16)
    for a, r, name in zip(got, want, ["loss", "grad_hidden", "grad_weight", "grad_bias"]):
        _close(a, r, 1e-5, name)
    loss_only = lce.forward(h, w, b, y, softcap=3.0, logit_scale=0.5, chunk=8, block=16, grads=False)
    assert loss_only[1:] == (None, None, None)
    _close(loss_only[0], want[0], 1e-5, "loss-only")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_linear_cross_entropy_in_the_weights_dtype_in_place(dtype, softcap):
    """The CUDA path (forced here: `in_weight_dtype=True`): each chunk's logits stay in the
    weight's 16-bit dtype and the kernel overwrites them with their gradient, as eager's bf16 head
    does (logits.float() for the loss, its backward rounding the gradient once): no fp32 tensor of
    a chunk's logits is made. Against autograd through that eager form, to the inputs' rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode
    g = torch.Generator().manual_seed(7)
    n, hid, vocab, chunk = 19, 12, 70, 8
    h = (torch.randn(n, hid, generator=g) * 2).to(dtype)
    w = torch.randn(vocab, hid, generator=g).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::5] = -100
    hr, wr, br = (t.clone().requires_grad_() for t in (h, w, b))
    z = F.linear(hr, wr, br).float()   # eager: the head in the weight's dtype, the loss in fp32
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(z, y, ignore_index=-100)
    ref.backward()

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32_logits = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape[-1:] == (vocab,) and t.dim() == 2:
                    self.fp32_logits += 1
            return out
    made = Made()
    with made:
        loss, gh, gw, gb = lce.forward(h, w, b, y, softcap=softcap, chunk=chunk, block=16, in_weight_dtype=True)
    assert made.fp32_logits == 0
    with Made() as upcast:   # the fp32 path makes one per chunk: the check can fail
        lce.forward(h, w, b, y, softcap=softcap, chunk=chunk, block=16, in_weight_dtype=False)
    assert upcast.fp32_logits >= 1
    tol = LP_TOL[dtype]
    _close(loss, ref.detach(), tol, "loss")
    _close(gh, hr.grad, tol, "grad_hidden")
    _close(gb, br.grad, tol, "grad_bias")
    # eager rounds grad_W once; the chunks' sum in the weight's dtype rounds once per chunk (3)
    _close(gw, wr.grad, 2 * tol, "grad_weight")
    assert gh.dtype == gw.dtype == gb.dtype == dtype and loss.dtype == torch.float32   # the loss as eager's .float()


def test_linear_cross_entropy_refuses():
    h, w, y = torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction 'none'"):
        lce.forward(h, w, None, y, reduction="none")
    with pytest.raises(ValueError, match="normalizer"):
        lce.forward(h, w, None, y, reduction="sum", normalizer=2)


# ---- SwiGLU / GeGLU --------------------------------------------------------------------------

_ACT_REF = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 7), cols=st.integers(1, 45), act=st.sampled_from(list(_ACT_REF)),
       dtype=st.sampled_from(DTYPES), block=st.sampled_from([16, 64, 1024]), seed=st.integers(0, 2 ** 16))
def test_glu_matches_torch(rows, cols, act, dtype, block, seed):
    """out, dgate, dup against torch autograd in fp64: fp32 to rtol 1e-5, atol 1e-6; fp16/bf16
    inputs (fp32 compute) against the reference on the same values, to the outputs' rounding."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    up = torch.randn(rows, cols, generator=g).to(dtype)
    dout = torch.randn(rows, cols, generator=g).to(dtype)
    # fp64 reference: torch's fp32 tanh-GELU backward loses 1 - tanh^2 to cancellation for g < -5
    gr, ur = gate.double().requires_grad_(), up.double().requires_grad_()
    ref = _ACT_REF[act](gr) * ur
    ref.backward(dout.double())
    out = glu.forward(gate, up, act, block=block)
    dg, du = glu.backward(dout, gate, up, act, block=block)
    assert out.dtype == dg.dtype == du.dtype == dtype
    rtol, atol = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-3)}[dtype]
    for a, r, name in [(out, ref.detach(), "out"), (dg, gr.grad, "dgate"), (du, ur.grad, "dup")]:
        torch.testing.assert_close(a.double(), r, rtol=rtol, atol=atol, msg=lambda m: f"{act} {name}: {m}")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # numpy's exp in the interpreter: inf, as on a GPU
def test_glu_extreme_gates():
    """Large |gate| saturates without inf/nan (sigmoid and erfc built from exp)."""
    gate = torch.tensor([-90.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 90.0])
    up = torch.ones_like(gate)
    for act, f in _ACT_REF.items():
        gr = gate.double().requires_grad_()
        ref = f(gr) * up.double()
        ref.backward(torch.ones_like(gr))
        out, dg = glu.forward(gate, up, act), glu.backward(torch.ones_like(gate), gate, up, act)[0]
        assert out.isfinite().all() and dg.isfinite().all()
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dg.double(), gr.grad, rtol=1e-5, atol=1e-6)


# ---- rotary embedding ------------------------------------------------------------------------

def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _hf_rope(q, k, cos, sin, rot):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1), with Phi/NeoX's partial rotary."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x in (q, k):
        xr, xp = x[..., :rot], x[..., rot:]
        out.append(torch.cat([xr * cos + _rotate_half(xr) * sin, xp], dim=-1))
    return out


@settings(max_examples=25, deadline=None)
@given(bsz=st.integers(1, 2), heads=st.integers(1, 5), kv_div=st.sampled_from([1, 2, 5]), seq=st.integers(1, 6),
       half=st.integers(1, 10), pass_dims=st.sampled_from([0, 0, 3, 8]), cos_batch=st.booleans(),
       transposed=st.booleans(), dtype=st.sampled_from(DTYPES), block_h=st.sampled_from([1, 2, 4]),
       hf_cos=st.booleans(), explicit_rot=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rope_matches_hf(bsz, heads, kv_div, seq, half, pass_dims, cos_batch, transposed, dtype, block_h, hf_cos,
                         explicit_rot, seed):
    """q (B, H, S, D) and k (B, H_kv, S, D) (optionally HF's transposed (B, S, H, D) buffers),
    cos/sin (B or 1, S, R) (HF's duplicated halves, or arbitrary: the backward must be the exact
    transpose), partial rotary R < D (given, or read off cos as HF does); forward and backward
    against autograd through HF's formula."""
    rot = 2 * half
    d = rot + pass_dims
    kv = max(1, heads // kv_div)
    g = torch.Generator().manual_seed(seed)

    def make(h):
        x = torch.randn(bsz, seq, h, d, generator=g) if transposed else torch.randn(bsz, h, seq, d, generator=g)
        return (x.transpose(1, 2) if transposed else x).to(dtype)
    q, k = make(heads), make(kv)
    cb = bsz if cos_batch else 1
    if hf_cos:
        freqs = torch.rand(cb, seq, half, generator=g) * 5
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos(), emb.sin()
    else:
        cos, sin = torch.randn(cb, seq, rot, generator=g), torch.randn(cb, seq, rot, generator=g)
    cos, sin = cos.to(dtype), sin.to(dtype)
    dq, dk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    qr, kr = q.float().clone().requires_grad_(), k.float().clone().requires_grad_()
    ref_q, ref_k = _hf_rope(qr, kr, cos.float(), sin.float(), rot)
    torch.autograd.backward([ref_q, ref_k], [dq.float(), dk.float()])

    spec_dim = rot if explicit_rot else None   # None: cos's last dim, as HF
    oq, ok = rope.forward(q, k, cos, sin, spec_dim) if block_h == 4 else \
        (rope.apply(q, cos, sin, spec_dim, block_h=block_h), rope.apply(k, cos, sin, spec_dim, block_h=block_h))
    gq, gk = rope.backward(dq, dk, cos, sin, spec_dim) if block_h == 4 else \
        (rope.apply(dq, cos, sin, spec_dim, backward=True, block_h=block_h),
         rope.apply(dk, cos, sin, spec_dim, backward=True, block_h=block_h))
    rtol, atol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]
    for a, r, name in [(oq, ref_q, "q"), (ok, ref_k, "k"), (gq, qr.grad, "dq"), (gk, kr.grad, "dk")]:
        assert a.dtype == dtype and a.shape == r.shape
        torch.testing.assert_close(a.float(), r.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_rope_layouts_reach_a_rows_every_head_and_each_is_exact():
    """The layouts a GPU times (rope.layouts, rope.choose_layout): from 4 heads a program, the
    default and the interpreter's, up to Llama-3-8B's 32 query heads in one program (Liger-Kernel's
    layout), on 4 and 8 warps; each rotates q and k (32 and 8 heads, head dim 128, bf16) as HF's
    formula does, forward and backward, bit for bit alike."""
    from tailorfx.kernels.tuning import Tiles
    cands = rope.layouts(32, 128)
    assert cands[0] == Tiles(4, 1, 4) and len(set(cands)) == len(cands)
    assert [t.block_m for t in cands] == sorted(t.block_m for t in cands) and cands[-1].block_m == 32
    assert {t.num_warps for t in cands if t.block_m == 32} == {4, 8}
    assert rope.layouts(2, 16) == [Tiles(4, 1, 1)]   # fewer heads than the default's block: one
    assert rope.choose_layout(("bf16",) * 3, 128, 128, 32, 8, 8192, "interpreter") == cands[0]
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 32, 3, 128, generator=g).bfloat16(), torch.randn(1, 8, 3, 128, generator=g).bfloat16()
    emb = torch.rand(1, 3, 64, generator=g).repeat(1, 1, 2) * 5
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    ref = _hf_rope(q.float(), k.float(), cos.float(), sin.float(), 128)
    first = None
    for t in cands:
        got = rope.apply_pair(q, k, cos, sin, block_h=t.block_m) + \
            rope.apply_pair(q, k, cos, sin, backward=True, block_h=t.block_m)
        for a, r in zip(got[:2], ref):
            torch.testing.assert_close(a.float(), r, rtol=1.6e-2, atol=1.6e-2)
        if first is None:
            first = got
        assert all(torch.equal(a, b) for a, b in zip(got, first)), t


def test_the_rope_layout_is_chosen_by_timing_once_per_key(tmp_path, monkeypatch):
    """rope.choose_layout on a (stand-in) CUDA device: each layout timed by the launch it is given,
    the fastest kept under its key (remembered in the process and on disk), untimed after; another
    row bucket starts from the default."""
    import uuid
    from tailorfx.kernels import tuning
    monkeypatch.setenv("TAILORFX_TRITON_CACHE", str(tmp_path))
    heads = 1000 + uuid.uuid4().int % 10_000_000   # a key no other call used
    names, ran = ("bf16", "bf16", "bf16"), []
    cands = rope.layouts(heads, 128)
    fastest = cands[-2]

    def timer(fn):
        fn()
        return 1.0 if ran[-1] == fastest else 2.0
    got = rope.choose_layout(names, 128, 128, heads, 8, 8192, "cuda", run=lambda t: ran.append(t), timer=timer)
    assert got == fastest and ran == cands
    assert rope.choose_layout(names, 128, 128, heads, 8, 5000, "cuda") == fastest   # the same bucket, untimed
    assert rope.choose_layout(names, 128, 128, heads, 8, 20000, "cuda") == cands[0]   # another: the default
    key = rope.layout_key(names, 128, 128, heads, 8, 8192, 90)
    assert key.endswith(f"h{heads}+8 rows<=8192") and tuning.choices()[key]["tiles"]["block_m"] == fastest.block_m


def test_a_choice_traced_on_fake_tensors_is_timed_on_real_stand_ins(monkeypatch):
    """tuning.choose_on under a trace (fake tensors, as Inductor runs a triton_op's host code):
    each candidate's launch gets real tensors of the call's shapes and dtypes, made once; where
    those would not fit beside what the GPU holds, nothing is launched and the caller keeps its
    default (None)."""
    import uuid
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from tailorfx.kernels import tuning
    from tailorfx.kernels.tuning import Tiles
    cands, seen = [Tiles(4, 1), Tiles(8, 1)], []

    def launch(t, x, ids):
        seen.append((t, type(x), tuple(x.shape), x.dtype, ids.dtype, id(x)))
    with FakeTensorMode():
        fake = torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(3, dtype=torch.int32)
        monkeypatch.setattr(tuning, "room_to_time", lambda need, device: need == 3 * 5 * 2 + 3 * 4)
        got = tuning.choose_on(fake, launch, lambda run: tuning.choose(f"test {uuid.uuid4()}", cands, run,
                                                                       lambda fn: (fn(), 1.0)[1]))
        assert got == cands[0] and [s[0] for s in seen] == cands
        assert {s[1:5] for s in seen} == {(torch.Tensor, (3, 5), torch.bfloat16, torch.int32)}
        assert isinstance(fake[0], FakeTensor) and len({s[5] for s in seen}) == 1   # real ones, made once
        monkeypatch.setattr(tuning, "room_to_time", lambda need, device: False)
        seen.clear()
        assert tuning.choose_on(fake, launch, lambda run: tuning.choose(f"test {uuid.uuid4()}", cands, run,
                                                                        lambda fn: (fn(), 1.0)[1])) is None
        assert seen == []


def test_rope_of_bf16_q_by_fp32_cos_is_promoted_as_torch_promotes_it():
    """Under autocast HF's q and k are bf16 and cos, sin fp32: eager's rotation is fp32 (type
    promotion) and its backward hands q a bf16 gradient. The kernel's forward is eager's to fp32
    rounding; its backward rounds the fp32 sum once, eager's each product (within one bf16 ulp)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 4, 3, 32, generator=g).to(torch.bfloat16)[:, :, :, 0].transpose(1, 2)   # (2, 4, 8, 32)
    k = torch.randn(2, 2, 8, 32, generator=g).to(torch.bfloat16)
    angle = torch.rand(1, 8, 16, generator=g) * 5
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    ref_q, ref_k = _hf_rope(qr, kr, cos, sin, 32)
    dq, dk = torch.randn(ref_q.shape, generator=g), torch.randn(ref_k.shape, generator=g)
    torch.autograd.backward([ref_q, ref_k], [dq, dk])
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    oq, ok = rope.apply_pair(q, k, cos, sin, out_dtype=out_dtype)
    gq, gk = rope.apply_pair(dq, dk, cos, sin, backward=True, out_dtype=q.dtype)
    assert ref_q.dtype == oq.dtype == ok.dtype == torch.float32 and gq.dtype == gk.dtype == torch.bfloat16
    for a, r in ((oq, ref_q), (ok, ref_k)):
        torch.testing.assert_close(a, r.detach(), rtol=1e-6, atol=1e-6)
    for a, r in ((gq, qr.grad), (gk, kr.grad)):
        torch.testing.assert_close(a.float(), r.float(), rtol=2 ** -7, atol=2 ** -7)


def test_rope_written_narrow_is_its_fp32_result_rounded_once():
    """The kernels pass fuses the cast that follows an fp32 rotation (autocast's q before attention)
    into the kernel: its bf16 output is the fp32 output rounded once (to nearest even on a GPU;
    Triton's interpreter converts fp32 to bf16 by truncation, ignoring `fp_downcast_rounding`),
    and its backward from the bf16 gradient is the backward from that gradient upcast, bit for bit."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 16, 32, generator=g).to(torch.bfloat16)
    angle = torch.rand(1, 16, 16, generator=g) * 5
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    wide, narrow = (rope.apply(q, cos, sin, out_dtype=dt) for dt in (torch.float32, torch.bfloat16))
    if tt.interpreted():
        want = (wide.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    else:
        want = wide.to(torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, want)
    grad = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    dx = rope.apply(grad, cos, sin, backward=True, out_dtype=torch.bfloat16)
    assert torch.equal(dx, rope.apply(grad.float(), cos, sin, backward=True, out_dtype=torch.bfloat16))


def test_rope_backward_is_the_transpose():
    """<rope(x), y> == <x, rope_bwd(y)> for arbitrary cos/sin, partial rotary."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, 5, 12, generator=g), torch.randn(2, 3, 5, 12, generator=g)
    cos, sin = torch.randn(1, 5, 8, generator=g), torch.randn(1, 5, 8, generator=g)
    lhs = (rope.apply(x, cos, sin, 8) * y).sum()
    rhs = (x * rope.apply(y, cos, sin, 8, backward=True)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)


# ---- rendered source: only what the spec asks for ------------------------------------------

def test_render_leaves_out_what_is_not_asked_for():
    plain = tt.render(lce.spec_for(32000))
    assert "tanh" not in plain and "SOFTCAP" not in plain and "LOGIT_SCALE" not in plain and "Z_LOSS" not in plain
    capped = tt.render(lce.spec_for(32000, softcap=30.0))
    assert "_tanh(z / SOFTCAP)" in capped and "(1.0 - t * t)" in capped and "LOGIT_SCALE" not in capped
    full = tt.render(lce.spec_for(32000, softcap=30.0, logit_scale=0.0625, z_loss=1e-4))
    assert "Z_LOSS * lse * lse" in full and "2.0 * Z_LOSS * lse" in full and "* LOGIT_SCALE" in full
    loss_only = tt.render(lce.spec_for(32000, softcap=30.0, grad=False))
    assert "pass 2" not in loss_only and "1.0 - t * t" not in loss_only and "tl.zeros" not in loss_only
    assert "\x00" not in full + plain + loss_only

    def glu_src(act):
        return tt.render(tt.KernelSpec("glu", act=act, block=1024, dtype="bf16"))
    assert "_cdf2" not in glu_src("silu") and "0.044715" not in glu_src("silu")
    assert "0.044715" in glu_src("gelu_tanh") and "_cdf2" not in glu_src("gelu_tanh")
    assert "_cdf2" in glu_src("gelu") and "0.044715" not in glu_src("gelu")

    def rope_src(rot):
        return tt.render(tt.KernelSpec("rope", dtype="bf16", head_dim=128, rotary_dim=rot, block_h=4))
    assert "ROT_DIM" not in rope_src(128) and "pass through" not in rope_src(128)
    assert rope_src(64).count("pass through") == 2 and "ROT_DIM = tl.constexpr(64)" in rope_src(64)


def test_specs_refuse_bad_values():
    with pytest.raises(ValueError, match="power of two"):
        tt.render(tt.KernelSpec("linear_cross_entropy", block=100, grad=True))
    with pytest.raises(ValueError, match="softcap"):
        tt.render(tt.KernelSpec("linear_cross_entropy", block=64, grad=True, softcap=-1.0))
    with pytest.raises(ValueError, match="rotary_dim"):
        tt.render(tt.KernelSpec("rope", dtype="fp32", head_dim=64, rotary_dim=33, block_h=4))
    with pytest.raises(ValueError, match="glu act"):
        tt.render(tt.KernelSpec("glu", act="relu", block=64, dtype="fp32"))


# ---- ahead-of-time compile ---------------------------------------------------------------------

COMPILED = {"linear_cross_entropy": lce.examples()[4],                        # every option, block 8192
            "glu": tt.KernelSpec("glu", act="gelu", block=1024, dtype="bf16"),
            "rope": tt.KernelSpec("rope", dtype="bf16", head_dim=80, rotary_dim=32, block_h=8)}


@pytest.fixture(scope="module")
def compiled_sm90():
    """One compile process for the three families (the interpreter's process cannot compile)."""
    specs = list(COMPILED.values())
    return dict(zip(COMPILED, tt.compile_many([(s, 90) for s in specs])))


@pytest.mark.ptxas   # make test-torch211 (CI) runs it under the GPU machines' Triton
@pytest.mark.parametrize("fam", list(COMPILED))
def test_compiles_for_sm90(fam, compiled_sm90):
    res = compiled_sm90[fam]
    assert set(res["cubin"]) == set(tt.family(fam).signatures(COMPILED[fam]))
    assert all(len(c) > 0 for c in res["cubin"].values())
    assert 0 < res["n_regs"] <= 255 and res["n_spills"] == 0
    assert res["shared_bytes"] <= tt.SHARED_LIMIT[90]


@pytest.mark.slow
@pytest.mark.ptxas   # make test-torch211 (CI) runs it under the GPU machines' Triton
def test_every_rope_layout_compiles_without_spills():
    """Each layout a GPU times for RoPE (rope.layouts at Llama's 32 heads, head dims 128 and 64),
    at its warps, in bf16 and autocast's two mixed forms, compiled for sm80 and sm90: no spills."""
    forms = [("bf16", None, None), ("bf16", "fp32", "fp32"), ("fp32", None, "bf16")]
    jobs = [(rope._spec(dt, d, d, t.block_m, cos_dtype=cd, out_dtype=od), arch, {"num_warps": t.num_warps})
            for arch in tt.ARCHS for d in (128, 64) for dt, cd, od in forms for t in rope.layouts(32, d)]
    results = tt.compile_many(jobs)
    bad = [f"{spec.name} sm{arch} {opts}: {res['n_spills']} B spilled" for (spec, arch, opts), res in zip(jobs, results)
           if res["n_spills"] or not res["cubin"] or res["shared_bytes"] > tt.SHARED_LIMIT[arch]]
    assert len(results) == len(jobs) >= 40 and bad == [], "\n".join(bad)
