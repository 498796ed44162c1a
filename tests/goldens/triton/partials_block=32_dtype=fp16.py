"""tailorfx generated: partials_block=32_dtype=fp16"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(32)
ROWS = tl.constexpr(16)


@triton.jit
def partials_sum(part_ptr, out_ptr, out2_ptr, n_parts, n_cols):
    # rows of ROWS partials a step, summed down the rows at the end: one order for every launch
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < n_cols
    second = tl.program_id(1) == 1
    if second:
        part_ptr += n_parts * n_cols
    parts = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, ROWS):
        p = start + parts
        acc += tl.load(part_ptr + p[:, None] * n_cols + cols[None, :], mask=(p < n_parts)[:, None] & cmask[None, :],
                       other=0.0)
    total = tl.sum(acc, axis=0)
    if second:
        tl.store(out2_ptr + cols, total.to(out2_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cmask)
