"""RMSNorm and LayerNorm, forward and backward, one row per program (the row fits one block).

Spec: kind ("rms" | "layer"), block (power of two >= the row length), offset (RMSNorm's weight
offset: 0.0, or 1.0 for Gemma's `x * (1 + w)`), bias (LayerNorm: whether it adds one). Inputs are loaded and computed in fp32 and
stored in the output's dtype; the backward accumulates the weight (and bias) gradient per
program over `rows_per_program` rows in fp32 and the host sums the partials.
"""
from __future__ import annotations

from string import Template

_HEADER = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(${block})
OFFSET = tl.constexpr(${offset})
'''

_RMS = '''

@triton.jit
def norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, rstd_ptr, n_cols, stride, eps):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + tl.cast(eps, tl.float32))  # fp64 from Inductor
    y = x * rstd * (w + OFFSET)
    tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def norm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, n_cols, stride, rows_per_program):
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
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            wdy = w * dy
            dx = rstd * (wdy - xhat * (tl.sum(wdy * xhat, axis=0) / n_cols))
            tl.store(dx_ptr + row * stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)
'''

_LAYER = '''

@triton.jit
def norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, rstd_ptr, mean_ptr, n_cols, stride, eps):
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
    tl.store(rstd_ptr + row, rstd)
    tl.store(mean_ptr + row, mean)


@triton.jit
def norm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, mean_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, n_cols, stride,
             rows_per_program):
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
            rstd = tl.load(rstd_ptr + row)
            mean = tl.load(mean_ptr + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            wdy = w * dy
            dx = rstd * (wdy - (tl.sum(wdy, axis=0) + xhat * tl.sum(wdy * xhat, axis=0)) / n_cols)
            tl.store(dx_ptr + row * stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
${acc_bias}
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)
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
        store_bias=f"{i4}tl.store(db_ptr + pid * n_cols + cols, db, mask=mask)" if bias else "")


def signatures(spec) -> dict[str, dict[str, str]]:
    t = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}[spec.get("dtype", "fp32")]
    if spec["kind"] == "rms":
        fwd = {"x_ptr": t, "w_ptr": t, "b_ptr": t, "y_ptr": t, "rstd_ptr": "*fp32", "n_cols": "i32", "stride": "i32",
               "eps": "fp32"}
        bwd = {"dy_ptr": t, "x_ptr": t, "w_ptr": t, "rstd_ptr": "*fp32", "dx_ptr": t, "dw_ptr": "*fp32",
               "db_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "stride": "i32", "rows_per_program": "i32"}
    else:
        fwd = {"x_ptr": t, "w_ptr": t, "b_ptr": t, "y_ptr": t, "rstd_ptr": "*fp32", "mean_ptr": "*fp32",
               "n_cols": "i32", "stride": "i32", "eps": "fp32"}
        bwd = {"dy_ptr": t, "x_ptr": t, "w_ptr": t, "rstd_ptr": "*fp32", "mean_ptr": "*fp32", "dx_ptr": t,
               "dw_ptr": "*fp32", "db_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "stride": "i32",
               "rows_per_program": "i32"}
    return {"norm_fwd": fwd, "norm_bwd": bwd}


def num_warps(spec) -> int:
    """More warps for longer rows, so a row's fp32 values stay in registers (no spills)."""
    return 4 if spec["block"] <= 1024 else 8 if spec["block"] <= 4096 else 16


def spec_for(x, kind: str, offset: float = 0.0, bias: bool = False):
    """The spec that serves rows of `x`'s last dim."""
    from tailorfx.codegen.triton import KernelSpec
    import triton
    extra = {"bias": bool(bias)} if kind == "layer" else {"offset": float(offset)}
    return KernelSpec("norm", kind=kind, block=triton.next_power_of_2(x.shape[-1]), dtype=_dtype_name(x.dtype),
                      **extra)


def examples() -> list:
    """Representative specs: the goldens and the sm80/sm90 compile checks run over these."""
    from tailorfx.codegen.triton import KernelSpec
    return [KernelSpec("norm", kind="rms", block=4096, dtype="bf16", offset=0.0),
            KernelSpec("norm", kind="rms", block=2048, dtype="fp32", offset=1.0),
            KernelSpec("norm", kind="layer", block=1024, dtype="fp16", bias=True),
            KernelSpec("norm", kind="layer", block=8192, dtype="bf16", bias=False)]


def _dtype_name(dtype) -> str:
    import torch
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def forward(x, weight, bias, eps: float, kind: str, offset: float = 0.0):
    """y, rstd, mean (None for RMSNorm) over the last dim of `x` (contiguous rows)."""
    import torch
    from tailorfx.codegen.triton import load
    k = load(spec_for(x, kind, offset, bias is not None))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    rows, n = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else weight
    if kind == "rms":
        k.fn("norm_fwd")[(rows,)](x2, weight, b, y, rstd, n, x2.stride(0), eps, num_warps=num_warps(k.spec))
        return y.view_as(x), rstd, None
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    k.fn("norm_fwd")[(rows,)](x2, weight, b, y, rstd, mean, n, x2.stride(0), eps, num_warps=num_warps(k.spec))
    return y.view_as(x), rstd, mean


def backward(dy, x, weight, rstd, mean, kind: str, offset: float = 0.0, bias: bool = False,
             rows_per_program: int = 32):
    """dx, dw (fp32 sum of per-program partials, cast to the weight's dtype), db (LayerNorm with
    a bias, else None)."""
    import torch
    from tailorfx.codegen.triton import load
    k = load(spec_for(x, kind, offset, bias))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    dy2 = dy.reshape(-1, x.shape[-1]).contiguous()
    rows, n = x2.shape
    programs = triton_cdiv(rows, rows_per_program)
    dx = torch.empty_like(x2)
    dw = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    db = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    if kind == "rms":
        k.fn("norm_bwd")[(programs,)](dy2, x2, weight, rstd, dx, dw, db, rows, n, x2.stride(0), rows_per_program,
                                      num_warps=num_warps(k.spec))
        return dx.view_as(x), dw.sum(0).to(weight.dtype), None
    k.fn("norm_bwd")[(programs,)](dy2, x2, weight, rstd, mean, dx, dw, db, rows, n, x2.stride(0), rows_per_program,
                                  num_warps=num_warps(k.spec))
    return dx.view_as(x), dw.sum(0).to(weight.dtype), (db.sum(0).to(weight.dtype) if bias else None)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
