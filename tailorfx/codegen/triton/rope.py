"""Rotary position embedding, forward and backward, in Hugging Face's `rotate_half` convention:

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])

x (B, H, S, D) (q, or k with its own H_kv: one launch per tensor), cos/sin (B or 1, S, R) broadcast
over heads (HF's `unsqueeze_dim=1`; (S, R) and (B, 1, S, R) are taken too). Partial rotary
(Phi, StableLM, GPT-NeoX): only the first R = rotary_dim of D channels rotate, the rest pass
through. With x1, x2 the two halves of the rotated part and c1, c2 / s1, s2 those of cos / sin:

    forward:   o1 = x1 c1 - x2 s1          backward (the transposed rotation, x = dout):
               o2 = x2 c2 + x1 s2                     o1 = x1 c1 + x2 s2,  o2 = x2 c2 - x1 s1

so any cos/sin (not only HF's duplicated halves) get the exact transposed map. No gradient is
computed for cos/sin (HF's are built under no_grad from position ids).

Spec: dtype ("fp32" | "fp16" | "bf16", of x, out, cos and sin), head_dim D, rotary_dim R (even,
<= D), block_h (heads per program, a power of two). One program per (batch, position) row and
block of heads; x and out may have any strides but a contiguous last dim (HF's q is a
(B, S, H, D) buffer transposed). Computed in fp32, rounded once on store; the pass-through
channels are copied as they are (their code is rendered only when R < D).
"""
from __future__ import annotations

from string import Template
from typing import Optional

_HEADER = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

HALF = tl.constexpr(${half})
BLOCK_HALF = tl.constexpr(${block_half})
BLOCK_H = tl.constexpr(${block_h})
${extra_constants}'''

_KERNEL = '''

@triton.jit
def ${fn}(x_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, n_heads, sxb, sxh, sxs, sob, soh, sos, scb, scs):
    # ${what}
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cs = b * scb + s * scs + d
    c1 = tl.load(cos_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    hmask = heads < n_heads
    hh = heads.to(tl.int64)[:, None]
    x_row = x_ptr + b * sxb + s * sxs + hh * sxh
    o_row = out_ptr + b * sob + s * sos + hh * soh
    mask = hmask[:, None] & dmask[None, :]
    x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + d[None, :], (${o1}).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF + d[None, :], (${o2}).to(out_ptr.dtype.element_ty), mask=mask)
${pass_through}'''

_PASS = '''    # channels [ROT_DIM, HEAD_DIM) pass through
    p = tl.arange(0, BLOCK_PASS)
    pmask = hmask[:, None] & (p < HEAD_DIM - ROT_DIM)[None, :]
    xp = tl.load(x_row + ROT_DIM + p[None, :], mask=pmask, other=0.0)
    tl.store(o_row + ROT_DIM + p[None, :], xp.to(out_ptr.dtype.element_ty), mask=pmask)
'''

_FORMULAS = {"rope_fwd": ("out = x * cos + rotate_half(x) * sin", "x1 * c1 - x2 * s1", "x2 * c2 + x1 * s2"),
             "rope_bwd": ("dx = the transposed rotation of dout (x_ptr)", "x1 * c1 + x2 * s2", "x2 * c2 - x1 * s1")}
_DTYPES = ("fp32", "fp16", "bf16")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _params(spec):
    dtype, d, r, bh = spec.get("dtype", "fp32"), int(spec["head_dim"]), int(spec.get("rotary_dim", spec["head_dim"])), \
        int(spec.get("block_h", 4))
    if dtype not in _DTYPES:
        raise ValueError(f"rope dtype {dtype!r}: one of {list(_DTYPES)}")
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"rope rotary_dim {r}: even, in (0, head_dim={d}]")
    if bh & (bh - 1):
        raise ValueError(f"rope block_h {bh} is not a power of two")
    return dtype, d, r, bh


def render(spec) -> str:
    _, d, r, bh = _params(spec)
    extra = ""
    if r < d:
        extra = (f"HEAD_DIM = tl.constexpr({d})\nROT_DIM = tl.constexpr({r})\n"
                 f"BLOCK_PASS = tl.constexpr({_next_pow2(d - r)})\n")
    src = Template(_HEADER).substitute(name=spec.name, half=r // 2, block_half=_next_pow2(r // 2), block_h=bh,
                                       extra_constants=extra)
    for fn, (what, o1, o2) in _FORMULAS.items():
        src += Template(_KERNEL).substitute(fn=fn, what=what, o1=o1, o2=o2, pass_through=_PASS if r < d else "")
    return src


def signatures(spec) -> dict[str, dict[str, str]]:
    t = "*" + spec.get("dtype", "fp32")
    sig = {"x_ptr": t, "cos_ptr": t, "sin_ptr": t, "out_ptr": t, "seq_len": "i32", "n_heads": "i32",
           "sxb": "i32", "sxh": "i32", "sxs": "i32", "sob": "i32", "soh": "i32", "sos": "i32",
           "scb": "i32", "scs": "i32"}
    return {"rope_fwd": dict(sig), "rope_bwd": dict(sig)}


def num_warps(spec) -> int:
    _, d, r, bh = _params(spec)
    return 4 if bh * _next_pow2(r // 2) >= 256 else 2 if bh * _next_pow2(r // 2) >= 64 else 1


def _dtype_name(dtype) -> str:
    import torch
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def spec_for(x, rotary_dim: Optional[int] = None, block_h: int = 4):
    """The spec serving x (..., D) with the first `rotary_dim` (default D) channels rotated."""
    from tailorfx.codegen.triton import KernelSpec
    d = x.shape[-1]
    return KernelSpec("rope", dtype=_dtype_name(x.dtype), head_dim=int(d),
                      rotary_dim=int(d if rotary_dim is None else rotary_dim), block_h=int(block_h))


def examples() -> list:
    """Representative specs: Llama/Qwen head dim 128 (fp32, bf16, 8 heads a program), head dim 64
    (fp16), Phi-3's 96 (R/2 = 48: a masked half block), and partial rotary: Phi-2 (D 80, R 32),
    StableLM (D 64, R 16), NeoX-style D 256 / R 64."""
    from tailorfx.codegen.triton import KernelSpec

    def spec(dtype, d, r=None, bh=4):
        return KernelSpec("rope", dtype=dtype, head_dim=d, rotary_dim=d if r is None else r, block_h=bh)
    return [spec("fp32", 128), spec("bf16", 128, bh=8), spec("fp16", 64), spec("bf16", 96),
            spec("fp16", 80, 32), spec("bf16", 64, 16, bh=8), spec("fp32", 256, 64)]


def _cos_sin(t, batch: int, seq: int, rot: int, dtype, name: str):
    """cos/sin as (B or 1, S, R) with a contiguous last dim, in x's dtype (HF's rotary embedding
    returns them in x's dtype already)."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    elif t.dim() == 4 and t.shape[1] == 1:
        t = t.squeeze(1)
    if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq or t.shape[2] != rot:
        raise ValueError(f"rope: {name} {tuple(t.shape)} is not ({batch} or 1, {seq}, {rot})")
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def output_like(x):
    """The tensor `apply` writes for x: x's layout when its last dim is contiguous, else a
    contiguous one (the runtime op's fake kernel allocates the same)."""
    import torch
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def apply(x, cos, sin, rotary_dim: Optional[int] = None, *, backward: bool = False, block_h: int = 4):
    """The rotation of x (B, H, S, D) (its transpose with `backward`: x is then the incoming grad),
    a new tensor with x's dtype and layout. `rotary_dim` defaults to cos's last dim, as in HF (a
    partial rotary's cos/sin are (.., S, R))."""
    from tailorfx.codegen.triton import load
    if x.dim() != 4:
        raise ValueError(f"rope: x {tuple(x.shape)} is not (B, H, S, D)")
    bsz, heads, seq, d = x.shape
    k = load(spec_for(x, cos.shape[-1] if rotary_dim is None else rotary_dim, block_h))
    rot = k.spec["rotary_dim"]
    c = _cos_sin(cos, bsz, seq, rot, x.dtype, "cos")
    s = _cos_sin(sin, bsz, seq, rot, x.dtype, "sin")
    if c.stride() != s.stride():
        c, s = c.expand(bsz, seq, rot).contiguous(), s.expand(bsz, seq, rot).contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = output_like(x)
    if x.numel() == 0:
        return out
    scb = c.stride(0) if c.shape[0] > 1 else 0
    grid = (bsz * seq, -(-heads // k.spec["block_h"]))
    k.fn("rope_bwd" if backward else "rope_fwd")[grid](
        x, c, s, out, seq, heads, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        scb, c.stride(1), num_warps=num_warps(k.spec))
    return out


def forward(q, k, cos, sin, rotary_dim: Optional[int] = None):
    """(q_embed, k_embed) as HF's `apply_rotary_pos_emb(q, k, cos, sin)`; k may be None."""
    return apply(q, cos, sin, rotary_dim), (apply(k, cos, sin, rotary_dim) if k is not None else None)


def backward(dq, dk, cos, sin, rotary_dim: Optional[int] = None):
    """(dq, dk) of forward's inputs from the grads of its outputs; dk may be None."""
    return (apply(dq, cos, sin, rotary_dim, backward=True),
            apply(dk, cos, sin, rotary_dim, backward=True) if dk is not None else None)
