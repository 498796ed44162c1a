"""tailorfx generated: norm_bias=True_block=1024_dtype=fp16_kind=layer"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(1024)
OFFSET = tl.constexpr(0.0)


@triton.jit
def norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, n_cols, stride, eps):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + tl.cast(eps, tl.float32))  # fp64 from Inductor
    y = xc * rstd * w + b
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
    db = tl.zeros([BLOCK], dtype=tl.float32)
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
            db += dy
    tl.store(part_ptr + pid * n_cols + cols, dw, mask=mask)
    tl.store(part_ptr + (tl.num_programs(0) + pid) * n_cols + cols, db, mask=mask)  # below dw's
