"""A weight's gradient summed over chunks, `acc += g^T a`: the one GEMM the chunked ops share (the
fused LM head's chunks, the mini-sequence MLP's). On CUDA a 16-bit pair summed into an fp32 `acc`
is one tensor-core GEMM that accumulates into it (cuBLAS, fp32 result): no fp32 GEMM on CUDA cores
on upcast copies, no weight-sized temporary, no separate add.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["add_weight_grad"]

_LOW = (torch.bfloat16, torch.float16)


def add_weight_grad(acc: Tensor, g: Tensor, a: Tensor, slab: Optional[int] = None) -> None:
    """acc += g^T a, for a chunk's output gradient `g` (rows x out) and input `a` (rows x in).

    One dtype: `addmm_`. A 16-bit pair into fp32 on CUDA: `addmm(out_dtype=float32, out=acc)`,
    each bf16/fp16 product exact in fp32, the same sums (where cuBLAS refuses it, the upcast below).
    Elsewhere the operands are upcast, `slab` output rows at a time
    when given (a vocabulary-sized `g` is not copied whole)."""
    if acc.dtype == g.dtype == a.dtype:
        acc.addmm_(g.t(), a)
        return
    if acc.is_cuda and acc.dtype == torch.float32 and g.dtype == a.dtype and g.dtype in _LOW:
        try:
            torch.addmm(acc, g.t(), a, out_dtype=torch.float32, out=acc)
            return
        except RuntimeError:   # a torch before 2.9 (`acc` in g's dtype only), a GPU before sm80's bf16
            pass
    a_up = a.to(acc.dtype)
    if slab is None or slab >= g.shape[1]:
        acc.addmm_(g.t().to(acc.dtype), a_up)
        return
    for s in range(0, g.shape[1], slab):
        acc[s:s + slab].addmm_(g[:, s:s + slab].t().to(acc.dtype), a_up)
