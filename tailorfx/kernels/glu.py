"""Gated activations of MLPs: SwiGLU `silu(gate) * up`, GeGLU `gelu_tanh(gate) * up` and GeGLU
with the exact (erf) GELU `gelu(gate) * up`, forward and backward as elementwise kernels over flat
blocks (the backward recomputes the activation from gate instead of saving it).

Spec: act ("silu" | "gelu_tanh" | "gelu"), block (elements per program, a power of two), dtype.
Computed in fp32, stored in the inputs' dtype. No libdevice: the tanh GELU is written as
g * sigmoid(2 k (g + 0.044715 g^3)) (= 0.5 g (1 + tanh(k (...))), without the cancellation of
1 + tanh for negative g), and the exact GELU's erfc is Numerical Recipes' `erfcc` (a Chebyshev
fit, relative error < 1.2e-7 everywhere): gelu(g) = g/2 erfc(-g/sqrt 2), rendered only for it.
"""
from __future__ import annotations

from string import Template

import torch

from tailorfx.kernels import DTYPE_NAMES, POINTER_TYPES, KernelSpec, cached_kernel

_SRC = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(${block})
${helpers}

@triton.jit
def glu_fwd(gate_ptr, up_ptr, out_ptr, n):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
${act_fwd}
    tl.store(out_ptr + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
${act_bwd}
    tl.store(dup_ptr + offs, (do * a).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (do * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)
'''

_SILU_FWD = '''    s = tl.sigmoid(g)
    a = g * s'''
_SILU_BWD = '''    s = tl.sigmoid(g)
    a = g * s
    da = s * (1.0 + g * (1.0 - s))'''
# gelu_tanh(g) = 0.5 g (1 + tanh(y / 2)) = g sigmoid(y), y = 2k (g + 0.044715 g^3), k = sqrt(2 / pi):
# no 1 + tanh cancellation for negative g; sigmoid(y) (1 - sigmoid(y)) as sigmoid(y) sigmoid(-y)
_GELU_FWD = '''    s = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    a = g * s'''
_GELU_BWD = '''    y = 1.5957691216057308 * (g + 0.044715 * g * g * g)
    s = tl.sigmoid(y)
    a = g * s
    da = s + g * s * tl.sigmoid(-y) * 1.5957691216057308 * (1.0 + 0.134145 * g * g)'''
# gelu(g) = g Phi(g) = 0.5 g erfc(-g / sqrt 2); gelu'(g) = Phi(g) + g exp(-g^2 / 2) / sqrt(2 pi)
_ERF_FWD = '''    c = _cdf2(g)
    a = 0.5 * g * c'''
_ERF_BWD = '''    c = _cdf2(g)
    a = 0.5 * g * c
    da = 0.5 * c + 0.3989422804014327 * g * tl.math.exp(-0.5 * g * g)'''

_CDF2_DEF = '''

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
'''
ACTS = {"silu": (_SILU_FWD, _SILU_BWD, ""), "gelu_tanh": (_GELU_FWD, _GELU_BWD, ""),
        "gelu": (_ERF_FWD, _ERF_BWD, _CDF2_DEF)}


def render(spec) -> str:
    act, block = spec["act"], spec["block"]
    if act not in ACTS:
        raise ValueError(f"glu act {act!r}: one of {list(ACTS)}")
    if block & (block - 1):
        raise ValueError(f"glu block {block} is not a power of two")
    fwd, bwd, helpers = ACTS[act]
    return Template(_SRC).substitute(name=spec.name, block=block, act_fwd=fwd, act_bwd=bwd, helpers=helpers)


def signatures(spec) -> dict[str, dict[str, str]]:
    t = POINTER_TYPES[spec.get("dtype", "fp32")]
    return {"glu_fwd": {"gate_ptr": t, "up_ptr": t, "out_ptr": t, "n": "i64"},
            "glu_bwd": {"dout_ptr": t, "gate_ptr": t, "up_ptr": t, "dgate_ptr": t, "dup_ptr": t, "n": "i64"}}


def num_warps(spec) -> int:
    """8 values a thread at 4 warps up to block 1024, then more warps: no spills, modest registers."""
    return max(4, min(16, spec["block"] // 256))



def _spec(act: str, block: int, dtype: str) -> KernelSpec:
    return KernelSpec("glu", act=act, block=block, dtype=dtype)


_kernel = cached_kernel(_spec)


def spec_for(gate, act: str, block: int = 1024) -> KernelSpec:
    return _spec(act, block, DTYPE_NAMES[gate.dtype])


def examples() -> list:
    return [KernelSpec("glu", act="silu", block=1024, dtype="bf16"),
            KernelSpec("glu", act="gelu_tanh", block=1024, dtype="fp16"),
            KernelSpec("glu", act="silu", block=1024, dtype="fp32"),
            KernelSpec("glu", act="gelu", block=1024, dtype="bf16"),
            KernelSpec("glu", act="gelu_tanh", block=2048, dtype="fp32")]


def _check(gate, up):
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"glu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         f"must have one shape and dtype")


def forward(gate, up, act: str, block: int = 1024):
    """act(gate) * up, in gate's dtype (act "silu" | "gelu_tanh" | "gelu"). One launch; the output
    is its only allocation."""
    _check(gate, up)
    k = _kernel(act, block, DTYPE_NAMES[gate.dtype])
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    k.fn("glu_fwd")[(-(-n // block),)](g, u, out, n, num_warps=num_warps(k.spec))
    return out


def backward(dout, gate, up, act: str, block: int = 1024):
    """(dgate, dup) of forward, recomputing act(gate). One launch; the two gradients are its only
    allocations."""
    _check(gate, up)
    k = _kernel(act, block, DTYPE_NAMES[gate.dtype])
    g, u, do = gate.contiguous(), up.contiguous(), dout.contiguous()
    if do.dtype != g.dtype:
        do = do.to(g.dtype)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    k.fn("glu_bwd")[(-(-n // block),)](do, g, u, dg, du, n, num_warps=num_warps(k.spec))
    return dg, du
