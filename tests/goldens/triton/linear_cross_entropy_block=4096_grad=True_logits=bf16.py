"""tailorfx generated: linear_cross_entropy_block=4096_grad=True_logits=bf16"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(4096)


@triton.jit
def lce_fwd(logits_ptr, labels_ptr, loss_ptr, scale_ptr, n_cols, stride, ignore_index):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK)
    if label != ignore_index:
        # pass 1: online max and sum of exp over the vocabulary
        m = float("-inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.math.exp(m - m_new) + tl.sum(tl.math.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.math.log(d)
        zt = tl.load(row_ptr + label).to(tl.float32)
        tl.store(loss_ptr + row, lse - zt)
        # pass 2: d(loss)/d(logits) in place
        scale = tl.load(scale_ptr)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.math.exp(z - lse)
            g = tl.where(offs == label, p - 1.0, p) * scale
            tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(loss_ptr + row, 0.0)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            tl.store(row_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32).to(logits_ptr.dtype.element_ty),
                     mask=offs < n_cols)
