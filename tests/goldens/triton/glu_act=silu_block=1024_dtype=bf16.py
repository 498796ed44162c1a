"""tailorfx generated: glu_act=silu_block=1024_dtype=bf16"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(1024)


@triton.jit
def glu_fwd(gate_ptr, up_ptr, out_ptr, n):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    a = g * s
    tl.store(out_ptr + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    a = g * s
    da = s * (1.0 + g * (1.0 - s))
    tl.store(dup_ptr + offs, (do * a).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (do * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)
