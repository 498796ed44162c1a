"""FLOPs per node of a Dynamo (torch-level) graph, at a chosen sequence length; and the bytes a
mini-sequence region's pointwise ops move, which the step-time model prices apart from its matmuls.

Used by the planner to rank plans by the compute they add: recompute reruns the forward ops whose
values backward reads, and mini-sequence reruns each chunked MLP's matmuls but its last.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx

from tailorfx.attention import build_spec
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value


def _numel(t, as_int) -> int:
    return as_int(t.numel()) if isinstance(t, torch.Tensor) else 0


def node_flops(node: fx.Node, as_int) -> int:
    """Forward FLOPs of one node: 2*M*N*K for matmuls, 4*pairs*D for attention, numel otherwise."""
    name = match.op_name(node)
    out = node_value(node)
    ins = match.tensors_in((node.args, node.kwargs))
    if name in match.MATMUL_OPS and ins and isinstance(out, torch.Tensor):
        k = as_int(ins[0].shape[-1]) if name != "addmm" else as_int(ins[1].shape[-1])
        return 2 * _numel(out, as_int) * k
    if name == "attention_call" and len(ins) >= 3:   # a spec chosen by the attention pass
        spec = build_spec(node.kwargs["kind"], node.kwargs["params"], node.kwargs["causal"], node.kwargs["scale"])
        B, H, S, D = (as_int(d) for d in ins[0].shape)
        return spec.flops(B, H, S, D, backward=False)
    if name in match.ATTENTION_OPS and len(ins) >= 3:
        q, kk = ins[0], ins[1]
        B_H = _numel(q, as_int) // max(1, as_int(q.shape[-1]))   # B * H * S
        causal = bool(node.kwargs.get("is_causal", False))
        pairs = B_H * as_int(kk.shape[-2]) // (2 if causal else 1)
        return 4 * pairs * as_int(q.shape[-1])
    if name in ("token_chunked", "token_segment"):
        return region_flops(node.args[0], as_int)
    return sum(_numel(t, as_int) for t in match.tensors_in(out)) if node.op != "placeholder" else 0


def _region_nodes(key: str, recompute: bool = False) -> list[fx.Node]:
    """The nodes of a registered region's graph (a token_chunked / token_segment op's), if it has one;
    `recompute`: of the part its backward runs again (before a final linear: ChunkedRegion.tail)."""
    from tailorfx.runtime import ops
    region = ops.chunked_region(key)
    src = region.tail[0] if recompute and region.tail else region.fn
    return list(src.graph.nodes) if isinstance(src, fx.GraphModule) else []


def region_flops(key: str, as_int, matmuls_only: bool = False) -> int:
    """Forward FLOPs of a registered region's graph (a token_chunked / token_segment op's);
    `matmuls_only`: its matmuls' and attention's, without node_flops' numel of the other ops."""
    return _flops(_region_nodes(key), as_int, matmuls_only)


def region_recompute_flops(key: str, as_int, matmuls_only: bool = False) -> int:
    """Forward FLOPs a registered region's backward runs again: its graph's, or where it ends in a
    linear whose output the backward never needs (ChunkedRegion.tail), those before that linear."""
    return _flops(_region_nodes(key, recompute=True), as_int, matmuls_only)


_MATMULS = match.MATMUL_OPS | match.ATTENTION_OPS   # what `matmuls_only` keeps


def _flops(nodes: list, as_int, matmuls_only: bool) -> int:
    return sum(node_flops(n, as_int) for n in nodes if not matmuls_only or match.op_name(n) in _MATMULS)


# torch-level ops that move no bytes of their own (a view, a size)
_VIEWS = frozenset({"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "getitem", "size",
                    "t", "flatten", "unflatten", "split", "chunk", "narrow", "movedim", "view_as", "expand_as", "dim",
                    "contiguous", "placeholder", "output", "get_attr"})


def region_bytes(key: str, as_int) -> int:
    """Bytes that a registered region's ops other than its matmuls and attention read and write, at
    its graph's sizes (a token_chunked op's pointwise work over every chunk; views free)."""
    total = 0
    for n in _region_nodes(key):
        name = match.op_name(n)
        if name in _VIEWS or name in _MATMULS:
            continue
        total += sum(_numel(t, as_int) * t.element_size()
                     for t in match.tensors_in((n.args, n.kwargs)) + match.tensors_in(node_value(n)))
    return total


def region_input_numel(key: str, as_int, recompute: bool = False) -> int:
    """Elements of a registered region's first input, at its graph's sizes: one key serves every
    capture whose graph prints alike (a symbolic length), recorded at the first one's sizes (the
    part recomputed, `recompute`, at the last one's: each capture sets it)."""
    first = next((n for n in _region_nodes(key, recompute) if n.op == "placeholder"), None)
    value = node_value(first) if first is not None else None
    return _numel(value, as_int) if isinstance(value, torch.Tensor) else 0


# torch-level ops whose backward reads none of their inputs' values (a residual add, a cast, a view)
_READS_NOTHING = _VIEWS | match.FLOAT_CASTS | frozenset({"add", "sub", "neg", "clone", "output"})


def _rerun(n: fx.Node, memo: dict) -> bool:
    """Whether the partitioner runs recomputed `n` again in backward: some op reads its value there,
    directly or through recomputed ops that read nothing but are run again (a saved value is read
    where it is kept: a down projection ending in a block's saved output is not run again)."""
    from torch.utils.checkpoint import CheckpointPolicy
    if n not in memo:
        memo[n] = any(match.op_name(u) not in _READS_NOTHING
                      or (u.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE and _rerun(u, memo))
                      for u in n.users)
    return memo[n]


def recompute_flops(gm: fx.GraphModule, as_int, weight: Optional[Callable[[fx.Node], int]] = None,
                    matmuls_only: bool = False) -> int:
    """FLOPs rerun in backward: forward ops tagged for recompute whose values backward reads, and
    chunked regions' recompute (their tails, and their whole forward when so read). `weight(node)`:
    how many times the real model runs that op (a shallow capture's repeated blocks, rewrite/depth.py;
    default once); `matmuls_only`: matmuls' and attention's FLOPs only (a profiler's count)."""
    from torch.utils.checkpoint import CheckpointPolicy
    total, memo = 0, {}
    for n in gm.graph.nodes:
        again = n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE and _rerun(n, memo)
        if match.op_name(n) in ("token_chunked", "token_segment"):
            f = region_recompute_flops(n.args[0], as_int, matmuls_only)
            f += region_flops(n.args[0], as_int, matmuls_only) if again else 0
        elif again and (not matmuls_only or match.op_name(n) in _MATMULS):
            f = node_flops(n, as_int)
        else:
            continue
        total += f * (weight(n) if weight else 1)
    return total


def graph_flops(gm: fx.GraphModule, as_int) -> int:
    """Forward FLOPs of the whole graph (a training step is about 3x this, plus recompute)."""
    return sum(node_flops(n, as_int) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))


def fmt_flops(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.1f} {unit}FLOP" if unit else f"{n:.0f} FLOP"
        n /= 1000
    return f"{n:.1f} PFLOP"


__all__ = ["node_flops", "region_flops", "region_recompute_flops", "recompute_flops", "graph_flops", "fmt_flops"]
