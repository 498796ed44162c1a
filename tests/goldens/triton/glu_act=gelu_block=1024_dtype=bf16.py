"""tailorfx generated: glu_act=gelu_block=1024_dtype=bf16"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(1024)


@triton.jit
def _cdf2(g):
    # 2 Phi(g) = erfc(-g / sqrt 2); erfc(z), z >= 0, by Numerical Recipes' erfcc
    u = g * 0.7071067811865476
    z = tl.abs(u)
    t = 1.0 / (1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    r = t * tl.math.exp(-z * z - 1.26551223 + t * p)
    return tl.where(u >= 0.0, 2.0 - r, r)


@triton.jit
def glu_fwd(gate_ptr, up_ptr, out_ptr, n):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c = _cdf2(g)
    a = 0.5 * g * c
    tl.store(out_ptr + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c = _cdf2(g)
    a = 0.5 * g * c
    da = 0.5 * c + 0.3989422804014327 * g * tl.math.exp(-0.5 * g * g)
    tl.store(dup_ptr + offs, (do * a).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (do * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)
