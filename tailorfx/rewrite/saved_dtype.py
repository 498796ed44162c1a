"""Activations saved for backward in a lower precision than the forward computed them in.

Under the precision policy ``matmul_output="fp32"`` the ops between low-precision matmuls compute
in fp32, so what they save for backward (SwiGLU's gate and up projections) would be fp32 too.
The precision pass tags those Dynamo nodes (``node.meta["custom"][SAVE_AS]``); AOTAutograd copies
the tag onto the ATen nodes traced from them. After partitioning, every tagged fp32 tensor the
forward saves is cast down at the end of the forward and back up where the backward reads it:

    fw: return (loss, mul_3)          fw: mul_3_low = convert(mul_3, bf16); return (loss, mul_3_low)
    bw: mul_3 (placeholder)    -->    bw: mul_3 (placeholder, bf16); mul_3_up = convert(mul_3, fp32)

The forward keeps its fp32 values; only the backward reads rounded copies, as it would if the
region had computed wholly in bf16. Under Inductor, whose own partitioner decides what is saved,
the same round trip goes into the joint graph before it partitions (`round_trip_backward_reads`):
every backward read of a tagged fp32 value reads `convert(convert(x, bf16), fp32)`, and the
partitioner, cutting where the fewest bytes cross, saves the bf16 copy where that is its
cheapest cut. Not always: SwiGLU's gate crosses in fp32, since the partitioner weighs a cut at a
matmul's output at half a cut at a fusible cast (measured on tailorfx's Llama, hidden 128, 2048
tokens, "fp32 out": peak 31.4 MiB without the round trip, 28.7 MiB with it; eager lowering 43.8).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.saved_route import Route, reroute_saved

SAVE_AS = "tailorfx_save_as"   # key in node.meta["custom"]: the dtype's name ("bfloat16")
_convert = torch.ops.prims.convert_element_type.default


def tag(node: fx.Node, dtype: torch.dtype) -> None:
    """Ask that what `node` computes be saved for backward in `dtype` (if it is saved as fp32)."""
    node.meta.setdefault("custom", {})[SAVE_AS] = str(dtype).removeprefix("torch.")


def _save_as(node: fx.Node) -> Optional[torch.dtype]:
    name = (node.meta.get("custom") or {}).get(SAVE_AS)
    return getattr(torch, name) if name else None


def store_saved_low(fw: fx.GraphModule, bw: Optional[fx.GraphModule], num_fwd_outputs: int) -> int:
    """Rewrite `fw` and `bw` in place (and recompile them); returns how many saved tensors now
    cross from forward to backward in their tagged dtype."""
    def route(o: fx.Node) -> Optional[Route]:
        dtype, v = _save_as(o), node_value(o)
        if dtype is None or not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            return None
        return Route(None, _convert, (dtype,), v.to(dtype), _convert, (torch.float32,))   # upcast when first read
    return reroute_saved(fw, bw, num_fwd_outputs, route)


def tagged(gm: fx.GraphModule) -> bool:
    """Whether any node of `gm` asks to be saved in a lower dtype."""
    return any(_save_as(n) is not None for n in gm.graph.nodes)


def round_trip_backward_reads(graph: fx.Graph) -> int:
    """In a joint forward+backward graph (Inductor's joint_custom_post_pass), route every
    backward read of a tagged fp32 forward value through a cast down to its tagged dtype and
    back up; returns how many values were routed. A backward read: by a node that depends on a
    tangent, or by a forward node no forward output needs (the partitioner recomputes such nodes
    in the backward, or saves what they make)."""
    backward: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and "tangents" in str(n.target)) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    forward: set[fx.Node] = set()
    todo = [a for a in out.all_input_nodes if a not in backward]
    while todo:
        n = todo.pop()
        if n not in forward:
            forward.add(n)
            todo.extend(n.all_input_nodes)
    count = 0
    for n in list(graph.nodes):
        dtype = _save_as(n)
        v = node_value(n) if dtype is not None else None
        readers = ([u for u in n.users if u is not out and (u in backward or u not in forward)]
                   if isinstance(v, torch.Tensor) else [])
        if n in backward or not readers or v.dtype != torch.float32:
            continue
        with graph.inserting_after(n):
            low = graph.call_function(_convert, (n, dtype))
        with graph.inserting_after(low):
            up = graph.call_function(_convert, (low, torch.float32))
        low.meta["val"], up.meta["val"] = v.to(dtype), v
        for u in readers:
            u.replace_input_with(n, up)
        count += 1
    return count
