"""Rotary position embedding, forward and backward, in Hugging Face's `rotate_half` convention:

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])

x (B, H, S, D) (q, and k with its own H_kv: one launch rotates both), cos/sin (B or 1, S, R)
broadcast over heads (HF's `unsqueeze_dim=1`; (S, R) and (B, 1, S, R) are taken too). Partial rotary
(Phi, StableLM, GPT-NeoX): only the first R = rotary_dim of D channels rotate, the rest pass
through. With x1, x2 the two halves of the rotated part and c1, c2 / s1, s2 those of cos / sin:

    forward:   o1 = x1 c1 - x2 s1          backward (the transposed rotation, x = dout):
               o2 = x2 c2 + x1 s2                     o1 = x1 c1 + x2 s2,  o2 = x2 c2 - x1 s1

so any cos/sin (not only HF's duplicated halves) get the exact transposed map. No gradient is
computed for cos/sin (HF's are built under no_grad from position ids).

Spec: dtype ("fp32" | "fp16" | "bf16", of x; of out, cos and sin too unless `out_dtype`, `cos_dtype`
say otherwise), head_dim D, rotary_dim R (even, <= D), block_h (heads per program, a power of two).
Under autocast HF's q and k come out of their projections in bf16 and meet fp32 cos and sin: torch's
type promotion makes the rotation fp32, and its backward hands q a bf16 gradient; the kernel reads
and writes each pointer in its own dtype, so one spec serves each direction.

One program per (batch, position) row and block of heads, q's blocks then k's (a single tensor has
no k blocks); x and out may have any strides but a contiguous last dim (HF's q is a (B, S, H, D)
buffer transposed). Computed in fp32, rounded once on store; the pass-through channels are copied as
they are (their code is rendered only when R < D).
"""
from __future__ import annotations

import functools
from string import Template
from typing import Optional

import torch

from tailorfx.kernels import DTYPE_NAMES, POINTER_TYPES, KernelSpec, cached_kernel, cdiv, interpreted, next_pow2, tuning
from tailorfx.kernels.tuning import Tiles

_HEADER = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

HALF = tl.constexpr(${half})
BLOCK_HALF = tl.constexpr(${block_half})
BLOCK_H = tl.constexpr(${block_h})
${extra_constants}'''

_KERNEL = '''

@triton.jit
def _${fn}_heads(x_ptr, out_ptr, b, s, heads, n_heads, sxb, sxh, sxs, sob, soh, sos, c1, c2, s1, s2):
    # ${what}
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    hmask = heads < n_heads
    hh = heads.to(tl.int64)[:, None]
    x_row = x_ptr + b * sxb + s * sxs + hh * sxh
    o_row = out_ptr + b * sob + s * sos + hh * soh
    mask = hmask[:, None] & dmask[None, :]
    x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + d[None, :], (${o1}).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF + d[None, :], (${o2}).to(out_ptr.dtype.element_ty), mask=mask)
${pass_through}

@triton.jit
def ${fn}(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_heads_q, n_heads_k, sqb, sqh, sqs, skb, skh, sks,
          sqob, sqoh, sqos, skob, skoh, skos, scb, scs):
    # program (row, head block): q's head blocks first, then k's; each reads its row's cos/sin
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cs = b * scb + s * scs + d
    c1 = tl.load(cos_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    q_blocks = tl.cdiv(n_heads_q, BLOCK_H)
    hb = tl.program_id(1)
    if hb < q_blocks:
        _${fn}_heads(q_ptr, qo_ptr, b, s, hb * BLOCK_H + tl.arange(0, BLOCK_H), n_heads_q, sqb, sqh, sqs, sqob, sqoh,
                     sqos, c1, c2, s1, s2)
    else:
        _${fn}_heads(k_ptr, ko_ptr, b, s, (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H), n_heads_k, skb, skh,
                     sks, skob, skoh, skos, c1, c2, s1, s2)
'''

_PASS = '''    # channels [ROT_DIM, HEAD_DIM) pass through
    p = tl.arange(0, BLOCK_PASS)
    pmask = hmask[:, None] & (p < HEAD_DIM - ROT_DIM)[None, :]
    xp = tl.load(x_row + ROT_DIM + p[None, :], mask=pmask, other=0.0)
    tl.store(o_row + ROT_DIM + p[None, :], xp.to(out_ptr.dtype.element_ty), mask=pmask)
'''

_FORMULAS = {"rope_fwd": ("out = x * cos + rotate_half(x) * sin", "x1 * c1 - x2 * s1", "x2 * c2 + x1 * s2"),
             "rope_bwd": ("dx = the transposed rotation of dout (x_ptr)", "x1 * c1 + x2 * s2", "x2 * c2 - x1 * s1")}


def _params(spec):
    dtype, d, r, bh = spec.get("dtype", "fp32"), int(spec["head_dim"]), int(spec.get("rotary_dim", spec["head_dim"])), \
        int(spec.get("block_h", 4))
    for key in ("dtype", "cos_dtype", "out_dtype"):
        if spec.get(key, dtype) not in POINTER_TYPES:
            raise ValueError(f"rope {key} {spec.get(key)!r}: one of {list(POINTER_TYPES)}")
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
                 f"BLOCK_PASS = tl.constexpr({next_pow2(d - r)})\n")
    src = Template(_HEADER).substitute(name=spec.name, half=r // 2, block_half=next_pow2(r // 2), block_h=bh,
                                       extra_constants=extra)
    for fn, (what, o1, o2) in _FORMULAS.items():
        src += Template(_KERNEL).substitute(fn=fn, what=what, o1=o1, o2=o2, pass_through=_PASS if r < d else "")
    return src


def signatures(spec) -> dict[str, dict[str, str]]:
    t = "*" + spec.get("dtype", "fp32")
    c, o = "*" + spec.get("cos_dtype", t[1:]), "*" + spec.get("out_dtype", t[1:])
    sig = {"q_ptr": t, "k_ptr": t, "cos_ptr": c, "sin_ptr": c, "qo_ptr": o, "ko_ptr": o, "seq_len": "i32",
           "n_heads_q": "i32", "n_heads_k": "i32",
           **{f"s{x}{d}": "i32" for x in ("q", "k", "qo", "ko") for d in "bhs"}, "scb": "i32", "scs": "i32"}
    return {"rope_fwd": dict(sig), "rope_bwd": dict(sig)}


def num_warps(spec) -> int:
    _, d, r, bh = _params(spec)
    return _warps(bh, r)


def _warps(block_h: int, rotary_dim: int) -> int:
    values = block_h * next_pow2(rotary_dim // 2)   # of each half a program holds
    return 4 if values >= 256 else 2 if values >= 64 else 1


def layouts(heads: int, rotary_dim: int) -> list[Tiles]:
    """The launch layouts a GPU times (`choose_layout`): heads a program (`Tiles.block_m`; block_n
    unused) from 4, the default, up to all of a row's (Liger-Kernel's layout: cos and sin read once
    a row), each on `num_warps`' count, and on twice it where a program holds 1K values a half."""
    top = max(4, next_pow2(heads))
    out = []
    for bh in sorted({min(b, top) for b in (4, 8, 16, top)}):
        w = _warps(bh, rotary_dim)
        out += [Tiles(bh, 1, w)] + ([Tiles(bh, 1, 2 * w)] if bh * next_pow2(rotary_dim // 2) >= 1024 else [])
    return out


def layout_key(names: tuple, head_dim: int, rotary_dim: int, heads_q: int, heads_k: int, rows: int, arch: int) -> str:
    """What a layout choice is kept under: arch, dtypes (x, cos/sin, out), dims, heads of q and k,
    and the rows' bucket (batch x length: the grid's first dimension)."""
    return f"rope sm{arch} {'/'.join(names)} d{head_dim} r{rotary_dim} h{heads_q}+{heads_k} rows<={tuning.bucket(rows)}"


def choose_layout(names: tuple, head_dim: int, rotary_dim: int, heads_q: int, heads_k: int, rows: int, device,
                  run=None, timer=None) -> Tiles:
    """A launch's layout: off CUDA (the interpreter) 4 heads a program; on CUDA the fastest of
    `layouts` for its key, timed by `run(tiles)` the first time the key is seen (None: not timed
    now, the remembered choice or the first layout)."""
    cands = layouts(max(heads_q, heads_k), rotary_dim)
    if getattr(device, "type", device) != "cuda":
        return cands[0]
    key = layout_key(names, head_dim, rotary_dim, heads_q, heads_k, rows, tuning.arch_of(device))
    return tuning.choose(key, cands, run, timer)


def _spec(dtype: str, head_dim: int, rotary_dim: int, block_h: int, cos_dtype: Optional[str] = None,
          out_dtype: Optional[str] = None) -> KernelSpec:
    """A spec; cos_dtype and out_dtype are keys of it only where they differ from x's dtype."""
    more = {k: v for k, v in (("cos_dtype", cos_dtype), ("out_dtype", out_dtype)) if v not in (None, dtype)}
    return KernelSpec("rope", dtype=dtype, head_dim=head_dim, rotary_dim=rotary_dim, block_h=block_h, **more)


_kernel = cached_kernel(_spec)


def spec_for(x, rotary_dim: Optional[int] = None, cos=None, out_dtype: Optional[torch.dtype] = None,
             heads_k: int = 0) -> KernelSpec:
    """The spec serving x (B, H, S, D) (and a k of `heads_k` heads) with the first `rotary_dim`
    (default cos's last dim, else D) channels rotated, cos (and sin) of cos's dtype (default x's), the result in
    `out_dtype` (default x's), at the layout a launch takes now (`choose_layout`, untimed)."""
    from tailorfx import compat
    d = int(x.shape[-1])
    rot = int(rotary_dim if rotary_dim is not None else d if cos is None else cos.shape[-1])
    names = (DTYPE_NAMES[x.dtype], DTYPE_NAMES[x.dtype if cos is None else cos.dtype],
             DTYPE_NAMES[x.dtype if out_dtype is None else out_dtype])
    rows = compat.size_hint(x.shape[0]) * compat.size_hint(x.shape[2])
    layout = choose_layout(names, d, rot, compat.size_hint(x.shape[1]), heads_k, rows,
                           "interpreter" if interpreted() else x.device)
    return _spec(names[0], d, rot, layout.block_m, *names[1:])


def examples() -> list:
    """Representative specs: Llama/Qwen head dim 128 (fp32, bf16, 8 heads a program), head dim 64
    (fp16), Phi-3's 96 (R/2 = 48: a masked half block), and partial rotary: Phi-2 (D 80, R 32),
    StableLM (D 64, R 16), NeoX-style D 256 / R 64."""
    def spec(dtype, d, r=None, bh=4):
        return KernelSpec("rope", dtype=dtype, head_dim=d, rotary_dim=d if r is None else r, block_h=bh)
    return [spec("fp32", 128), spec("bf16", 128, bh=8), spec("fp16", 64), spec("bf16", 96),
            spec("fp16", 80, 32), spec("bf16", 64, 16, bh=8), spec("fp32", 256, 64),
            _spec("bf16", 128, 128, 8, cos_dtype="fp32", out_dtype="fp32"),   # autocast's forward
            _spec("fp32", 128, 128, 8, out_dtype="bf16")]                     # and its backward


@functools.lru_cache(maxsize=None)
def promoted(*dtypes: torch.dtype) -> torch.dtype:
    """torch's promotion of `dtypes` (`x * cos`'s dtype), cached: a warm launch dispatches no
    `promote_types`."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _cos_sin(t, batch: int, seq: int, rot: int, dtype, name: str):
    """cos/sin, (B or 1, S, R) as (S, R), (B or 1, S, R) or (B or 1, 1, S, R), read where it lies:
    the tensor (in `dtype`: its own, or cos's and sin's promoted where they differ; a contiguous
    last dim) and its batch (0 when broadcast) and position strides. No view is made."""
    shape = tuple(t.shape)
    rows = (1, *shape) if len(shape) == 2 else (shape[0], *shape[2:]) if len(shape) == 4 and shape[1] == 1 \
        else shape
    if len(rows) != 3 or rows[0] not in (1, batch) or rows[1] != seq or rows[2] != rot:
        raise ValueError(f"rope: {name} {rows} is not ({batch} or 1, {seq}, {rot})")
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return (t, *_cos_strides(t))


def _cos_strides(t) -> tuple:
    """cos's (or sin's) batch stride (0 where it is broadcast) and position stride."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(-2)


def output_like(x, dtype: Optional[torch.dtype] = None):
    """The tensor `apply` writes for x (in `dtype`, default x's): x's layout when its last dim is
    contiguous, else a contiguous one (the runtime op's fake kernel allocates the same)."""
    dtype = x.dtype if dtype is None else dtype
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, dtype=dtype)
    return out if out.stride(-1) == 1 else torch.empty(x.shape, dtype=dtype, device=x.device)


def apply(x, cos, sin, rotary_dim: Optional[int] = None, *, backward: bool = False, block_h: Optional[int] = None,
          out_dtype: Optional[torch.dtype] = None):
    """The rotation of x (B, H, S, D) (its transpose with `backward`: x is then the incoming grad),
    a new tensor with x's layout, in `out_dtype` (default x's). `rotary_dim` defaults to cos's last
    dim, as in HF (a partial rotary's cos/sin are (.., S, R))."""
    return apply_pair(x, None, cos, sin, rotary_dim, backward=backward, block_h=block_h, out_dtype=out_dtype)[0]


def apply_pair(q, k, cos, sin, rotary_dim: Optional[int] = None, *, backward: bool = False,
               block_h: Optional[int] = None, out_dtype: Optional[torch.dtype] = None):
    """`apply` to q (B, H, S, D) and k (B, H_kv, S, D) in one launch: (q's rotation, k's), new
    tensors with their layout, in `out_dtype` (default q's); k may be None (q's alone, None for k).
    cos and sin are read in their dtype (both in the promoted one where theirs differ). `block_h`:
    heads a program, else `choose_layout`'s (on a GPU timed once per shape)."""
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.dim() != 4:
            raise ValueError(f"rope: {name} {tuple(x.shape)} is not (B, H, S, D)")
    bsz, heads_q, seq, d = q.shape
    if k is not None and (k.shape[0] != bsz or k.shape[2:] != q.shape[2:] or k.dtype != q.dtype):
        raise ValueError(f"rope: k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    rot = int(cos.shape[-1] if rotary_dim is None else rotary_dim)
    out_dtype = q.dtype if out_dtype is None else out_dtype
    cs_dtype = promoted(cos.dtype, sin.dtype)
    try:
        names = DTYPE_NAMES[q.dtype], DTYPE_NAMES[cs_dtype], DTYPE_NAMES[out_dtype]
    except KeyError:
        raise ValueError(f"rope: x {q.dtype}, cos/sin {cs_dtype}, out {out_dtype}: each one of {list(DTYPE_NAMES)}") from None
    c, cb, cs = _cos_sin(cos, bsz, seq, rot, cs_dtype, "cos")
    s, sb, ss = _cos_sin(sin, bsz, seq, rot, cs_dtype, "sin")
    if (cb, cs) != (sb, ss):   # one set of offsets serves both
        c, s = (t.reshape(-1, seq, rot).expand(bsz, seq, rot).contiguous() for t in (c, s))
    if q.stride(-1) != 1:
        q = q.contiguous()
    qo = output_like(q, out_dtype)
    heads_k, ko = 0, None
    if k is not None:
        if k.stride(-1) != 1:
            k = k.contiguous()
        heads_k, ko = k.shape[1], output_like(k, out_dtype)
    if bsz * seq == 0:
        return qo, ko
    kk, kko = (k, ko) if k is not None else (q, qo)   # no k: no k blocks, its pointers unread
    fn = "rope_bwd" if backward else "rope_fwd"

    def launch(t: Tiles, q, k, c, s, qo, ko):
        kern = _kernel(names[0], int(d), rot, t.block_m, *names[1:])
        grid = (q.shape[0] * q.shape[2], cdiv(heads_q, t.block_m) + cdiv(heads_k, t.block_m))
        return tuning.spills(kern.fn(fn)[grid](
            q, k, c, s, qo, ko, q.shape[2], heads_q, heads_k, *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3],
            *ko.stride()[:3], *_cos_strides(c), num_warps=t.num_warps))
    if block_h is not None:
        tiles = Tiles(int(block_h), 1, _warps(int(block_h), rot))
    else:
        tiles = _layout(names, int(d), rot, heads_q, heads_k, bsz * seq, q.device, launch, (q, kk, c, s, qo, kko))
    launch(tiles, q, kk, c, s, qo, kko)
    return qo, ko


_LAYOUTS: dict = {}   # a call's (dtypes, dims, heads, rows' bucket, device) -> its layout: a warm launch looks it up


def _layout(names, head_dim, rot, heads_q, heads_k, rows, device, launch, tensors) -> Tiles:
    """`choose_layout` for a call, once per key: on a GPU each layout timed by `launch` the first
    time (on the call's tensors; under a trace, random ones of their shapes); the interpreter's off it."""
    from tailorfx import compat
    rows = compat.size_hint(rows)
    where = "interpreter" if interpreted() or device.type != "cuda" else device
    key = (names, head_dim, rot, heads_q, heads_k, tuning.bucket(rows), where)
    got = _LAYOUTS.get(key)
    if got is not None:
        return got
    if where == "interpreter" or not torch.cuda.is_available():   # (fake CUDA tensors: nothing to time on)
        got = choose_layout(names, head_dim, rot, heads_q, heads_k, rows, where)
    else:
        got = tuning.choose_on(tensors, launch, lambda run: choose_layout(names, head_dim, rot, heads_q, heads_k,
                                                                          rows, device, run))
        if got is None:   # too large to time beside what the GPU holds: the default, not kept
            return choose_layout(names, head_dim, rot, heads_q, heads_k, rows, device)
    _LAYOUTS[key] = got
    return got


def forward(q, k, cos, sin, rotary_dim: Optional[int] = None):
    """(q_embed, k_embed) as HF's `apply_rotary_pos_emb(q, k, cos, sin)`, one launch; k may be None."""
    return apply_pair(q, k, cos, sin, rotary_dim)


def backward(dq, dk, cos, sin, rotary_dim: Optional[int] = None):
    """(dq, dk) of forward's inputs from the grads of its outputs, one launch; dk may be None."""
    return apply_pair(dq, dk, cos, sin, rotary_dim, backward=True)
