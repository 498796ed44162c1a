"""RMSNorm and LayerNorm, forward and backward, one row per program (the row fits one block).

Spec: kind ("rms" | "layer"), block (power of two >= the row length), offset (RMSNorm's weight
offset: 0.0, or 1.0 for Gemma's `x * (1 + w)`), bias (LayerNorm: whether it adds one). Inputs are loaded and computed in fp32 and
stored in the output's dtype. The forward writes one fp32 statistics buffer: rstd (rows,), or
for LayerNorm (2, rows), rstd then mean. The backward accumulates the weight (and bias) gradient
per program over `rows_per_program` rows in fp32 partials, and `partials`' kernel sums them in a
fixed order into the weight's dtype: two launches, no host arithmetic.
"""
from __future__ import annotations

from string import Template

import torch

from tailorfx.kernels import DTYPE_NAMES, POINTER_TYPES, KernelSpec, cached_kernel, cdiv, next_pow2, partials

_HEADER = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(${block})
OFFSET = tl.constexpr(${offset})
'''

_RMS = '''

@triton.jit
def norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, n_cols, stride, eps):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + tl.cast(eps, tl.float32))  # fp64 from Inductor
    y = x * rstd * (w + OFFSET)
    tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(stats_ptr + row, rstd)


@triton.jit
def norm_bwd(dy_ptr, x_ptr, w_ptr, stats_ptr, dx_ptr, part_ptr, n_rows, n_cols, stride, rows_per_program):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + OFFSET
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(stats_ptr + row)
            xhat = x * rstd
            wdy = w * dy
            dx = rstd * (wdy - xhat * (tl.sum(wdy * xhat, axis=0) / n_cols))
            tl.store(dx_ptr + row * stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
    tl.store(part_ptr + pid * n_cols + cols, dw, mask=mask)
'''

_LAYER = '''

@triton.jit
def norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, n_cols, stride, eps):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
${load_bias}
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + tl.cast(eps, tl.float32))  # fp64 from Inductor
    y = xc * rstd * w${add_bias}
    tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(stats_ptr + row, rstd)
    tl.store(stats_ptr + tl.num_programs(0) + row, mean)   # stats (2, rows): rstd, then mean


@triton.jit
def norm_bwd(dy_ptr, x_ptr, w_ptr, stats_ptr, dx_ptr, part_ptr, n_rows, n_cols, stride, rows_per_program):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
${zero_bias}
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(stats_ptr + row)
            mean = tl.load(stats_ptr + n_rows + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            wdy = w * dy
            dx = rstd * (wdy - (tl.sum(wdy, axis=0) + xhat * tl.sum(wdy * xhat, axis=0)) / n_cols)
            tl.store(dx_ptr + row * stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
${acc_bias}
    tl.store(part_ptr + pid * n_cols + cols, dw, mask=mask)
${store_bias}
'''


def render(spec) -> str:
    kind, block = spec["kind"], spec["block"]
    if kind not in ("rms", "layer"):
        raise ValueError(f"norm kind {kind!r}: 'rms' or 'layer'")
    if block & (block - 1):
        raise ValueError(f"norm block {block} is not a power of two")
    offset = float(spec.get("offset", 0.0))
    if kind == "layer" and offset:
        raise ValueError("LayerNorm has no weight offset")
    if kind == "rms" and spec.get("bias", False):
        raise ValueError("RMSNorm has no bias")
    head = Template(_HEADER).substitute(name=spec.name, block=block, offset=repr(offset))
    if kind == "rms":
        return head + _RMS
    bias = spec.get("bias", True)
    i4, i12 = " " * 4, " " * 12
    return head + Template(_LAYER).substitute(
        load_bias=f"{i4}b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)" if bias else "",
        add_bias=" + b" if bias else "",
        zero_bias=f"{i4}db = tl.zeros([BLOCK], dtype=tl.float32)" if bias else "",
        acc_bias=f"{i12}db += dy" if bias else "",
        store_bias=f"{i4}tl.store(part_ptr + (tl.num_programs(0) + pid) * n_cols + cols, db, mask=mask)  # below dw's"
        if bias else "")


def signatures(spec) -> dict[str, dict[str, str]]:
    t = POINTER_TYPES[spec.get("dtype", "fp32")]
    fwd = {"x_ptr": t, "w_ptr": t, "b_ptr": t, "y_ptr": t, "stats_ptr": "*fp32", "n_cols": "i32", "stride": "i32",
           "eps": "fp32"}
    bwd = {"dy_ptr": t, "x_ptr": t, "w_ptr": t, "stats_ptr": "*fp32", "dx_ptr": t, "part_ptr": "*fp32",
           "n_rows": "i32", "n_cols": "i32", "stride": "i32", "rows_per_program": "i32"}
    return {"norm_fwd": fwd, "norm_bwd": bwd}


def num_warps(spec) -> int:
    """More warps for longer rows, so a row's fp32 values stay in registers (no spills)."""
    return 4 if spec["block"] <= 1024 else 8 if spec["block"] <= 4096 else 16


def _spec(kind: str, block: int, dtype: str, offset: float, bias: bool) -> KernelSpec:
    extra = {"bias": bias} if kind == "layer" else {"offset": offset}
    return KernelSpec("norm", kind=kind, block=block, dtype=dtype, **extra)


_kernel = cached_kernel(_spec)


def spec_for(x, kind: str, offset: float = 0.0, bias: bool = False) -> KernelSpec:
    """The spec that serves rows of `x`'s last dim."""
    return _spec(kind, next_pow2(x.shape[-1]), DTYPE_NAMES[x.dtype], float(offset), bool(bias))


def _kernel_for(x, kind: str, offset: float, bias: bool):
    return _kernel(kind, next_pow2(x.shape[-1]), DTYPE_NAMES[x.dtype], float(offset), bool(bias))


def examples() -> list:
    """Representative specs: the goldens and the sm80/sm90 compile checks run over these."""
    return [KernelSpec("norm", kind="rms", block=4096, dtype="bf16", offset=0.0),
            KernelSpec("norm", kind="rms", block=2048, dtype="fp32", offset=1.0),
            KernelSpec("norm", kind="layer", block=1024, dtype="fp16", bias=True),
            KernelSpec("norm", kind="layer", block=8192, dtype="bf16", bias=False)]


def forward(x, weight, bias, eps: float, kind: str, offset: float = 0.0):
    """y, rstd, mean (None for RMSNorm) over the last dim of `x`; rstd and mean are rows of
    `forward_stats`'s statistics."""
    y, stats = forward_stats(x, weight, bias, eps, kind, offset)
    return (y, stats, None) if kind == "rms" else (y, stats[0], stats[1])


def forward_stats(x, weight, bias, eps: float, kind: str, offset: float = 0.0):
    """y (x's shape and dtype, contiguous) and the fp32 statistics the backward reads: rstd
    (rows,), or for LayerNorm (2, rows), rstd then mean. One launch; the two outputs are its only
    allocations."""
    k = _kernel_for(x, kind, offset, bias is not None)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    stats = torch.empty((rows,) if kind == "rms" else (2, rows), dtype=torch.float32, device=x.device)
    k.fn("norm_fwd")[(rows,)](x, weight, bias if bias is not None else weight, y, stats, n, n, eps,
                              num_warps=num_warps(k.spec))
    return y, stats


def backward(dy, x, weight, rstd, mean, kind: str, offset: float = 0.0, bias: bool = False,
             rows_per_program: int = 32):
    """dx, dw and db (LayerNorm with a bias, else None) from `forward`'s rstd and mean."""
    stats = rstd if kind == "rms" else torch.stack((rstd, mean))
    return backward_stats(dy, x, weight, stats, kind, offset, bias, rows_per_program)


def backward_stats(dy, x, weight, stats, kind: str, offset: float = 0.0, bias: bool = False,
                   rows_per_program: int = 32):
    """dx (x's dtype), dw and db (the weight's dtype; db None without a bias) from
    `forward_stats`'s statistics. Two launches: the rows, writing dx and fp32 partial sums of dw
    (and db) per program, then their column sums into dw (and db) (`partials.column_sums`)."""
    k = _kernel_for(x, kind, offset, bias)
    if not x.is_contiguous():
        x = x.contiguous()
    if not dy.is_contiguous():
        dy = dy.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    programs = cdiv(rows, rows_per_program)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    parts = torch.empty((2 * programs if bias else programs, n), dtype=torch.float32, device=x.device)
    dw = torch.empty(n, dtype=weight.dtype, device=weight.device)
    db = torch.empty(n, dtype=weight.dtype, device=weight.device) if bias else None
    k.fn("norm_bwd")[(programs,)](dy, x, weight, stats, dx, parts, rows, n, n, rows_per_program,
                                  num_warps=num_warps(k.spec))
    partials.column_sums(parts, dw, db)
    return dx, dw, db
