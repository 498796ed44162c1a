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
    if bw is None:
        return 0
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    bw_ph = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    count = 0
    for i in range(num_fwd_outputs, len(outs)):
        o = outs[i]
        dtype = _save_as(o) if isinstance(o, fx.Node) else None
        v = node_value(o) if dtype is not None else None
        ph = bw_ph.get(o.name) if dtype is not None else None
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and ph is not None and ph.users):
            continue
        with fw.graph.inserting_before(out):
            low = fw.graph.call_function(_convert, (o, dtype))
        low.meta["val"] = v.to(dtype)
        outs[i] = low
        with bw.graph.inserting_before(min(ph.users, key=order.__getitem__)):   # upcast when first read
            up = bw.graph.call_function(_convert, (ph, torch.float32))
        ph.replace_all_uses_with(up, delete_user_cb=lambda u: u is not up)
        up.meta["val"] = node_value(ph)
        ph.meta["val"] = node_value(ph).to(dtype)
        count += 1
    if count:
        out.args = (tuple(outs),)
        for g in (fw, bw):
            g.graph.lint()
            g.recompile()
    return count


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
