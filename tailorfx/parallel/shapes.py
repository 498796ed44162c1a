"""Shape arithmetic for the tensor-parallel analysis: where a sharded dim lands through views,
transposes and indexing (tp_plan.py, sequence_plan.py)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx

from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value


def shape_of(n: Any) -> Optional[tuple]:
    v = node_value(n) if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def view_dim(src: Optional[tuple], out: Optional[tuple], dim: int) -> Optional[int]:
    """Where sharded dim `dim` of `src` lands in `out` (a view, expand, or an indexing that keeps
    it). Shapes are aligned by their common prefix and suffix; a sharded dim in the changed middle
    survives only as its outermost dim (features -> (heads, head_dim) keeps heads; (kv, n_rep) ->
    kv * n_rep keeps kv outermost), else None."""
    if src is None or out is None:
        return None
    p = 0
    while p < min(len(src), len(out)) and same(src[p], out[p]):
        p += 1
    q = 0
    while q < min(len(src), len(out)) - p and same(src[-1 - q], out[-1 - q]):
        q += 1
    if dim < p:
        return dim
    if dim >= len(src) - q:
        return dim + len(out) - len(src)
    mid_src, mid_out = src[p:len(src) - q], out[p:len(out) - q]
    if dim == p and mid_out and same(math.prod(mid_src), math.prod(mid_out)):
        return p
    return None


def perm_dim(n: fx.Node, dim: int, nd: int) -> Optional[int]:
    name = match.op_name(n)
    if name in ("transpose", "swapaxes"):
        a, b = (x % nd for x in n.args[1:3])
        return b if dim == a else a if dim == b else dim
    if name == "permute":
        perm = n.args[1] if isinstance(n.args[1], (list, tuple)) else n.args[1:]
        perm = [p % nd for p in perm]
        return perm.index(dim)
    return None


def getitem_keeps(n: fx.Node, dim: int) -> bool:
    src = shape_of(n.args[0])
    if src is None:
        return False
    idx = match.getitem_dims(n.args[1], len(src))
    return dim not in idx or match.is_full_slice(idx[dim])
