"""A block's token-wise segments: each (several inputs and outputs, each with its own sequence
dim) becomes tailorfx::token_segment, chunked in forward and recomputed per chunk in backward.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.passes.tools_common import legalize_graph

from tailorfx import compat
from tailorfx.passes.minisequence.chunks import MAX_CHUNKS, NAME, Chunking, Rewrite
from tailorfx.passes.minisequence.cost import cached_segment_backward_cost, hint_bytes, hint_tokens, region_cost
from tailorfx.passes.minisequence.extract import Unsupported, extract
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext, annotate, own
from tailorfx.rewrite.regions import Region, Segment, is_param, token_producers
from tailorfx.runtime import ops


class TooSmall(str):
    """A segment left whole: chunking it would save nothing worth a kernel launch per chunk."""


def rewrite_segment(gm, nodes, seg: Segment, ctx: PassContext, chunking: Chunking, done) -> Optional[str]:
    """One token-wise segment (several inputs and outputs, each with its own sequence dim) as
    tailorfx::token_segment: chunks in forward, each chunk recomputed in backward."""
    members = _with_producers(gm, nodes, [nodes[n] for n in seg.nodes], ctx)
    outs = [nodes[n] for n in seg.outputs]
    group = set(members)   # inputs read off the graph as it is now: an earlier segment's outputs were replaced
    ins = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in group
                             and isinstance(node_value(a), torch.Tensor) and not is_param(a)))
    params = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in group
                                and isinstance(node_value(a), torch.Tensor) and is_param(a)))
    ovs, ivs = [node_value(o) for o in outs], [node_value(i) for i in ins]
    if not all(isinstance(v, torch.Tensor) for v in ovs):
        return "an output is not a tensor"
    out_dims, in_dims = [ctx.seq.dims(v) for v in ovs], [ctx.seq.dims(v) for v in ivs]
    if any(len(d) != 1 for d in out_dims) or any(len(d) > 1 for d in in_dims):
        return "a tensor has no single sequence dim"
    # the first chunked input sets M: the one whose dims before the sequence are fewest (B, S,
    # ...), not an attention output still laid out (B, heads, S, ...)
    xs = sorted((i for i, d in zip(ins, in_dims) if d),
                key=lambda i: (not node_value(i).is_floating_point(), ctx.seq.dims(node_value(i))[0]))
    if not xs:
        return "no input carries the sequence"
    lengths = {str(compat.sym_expr(v.shape[d[0]])) for v, d in (*zip(ovs, out_dims), *zip(ivs, in_dims)) if d}
    if len(lengths) != 1:
        return f"its tensors' sequence dims differ in length ({sorted(lengths)})"
    whole = [i for i, d in zip(ins, in_dims) if not d] + params
    x_dims = [ctx.seq.dims(node_value(x))[0] for x in xs]
    o_dims = [d[0] for d in out_dims]
    io_bytes = sum(hint_bytes(v, ctx) for v in (*ivs, *ovs))
    inner = sum(hint_bytes(v, ctx) for n in members if n not in outs for v in match.tensors_in(node_value(n)))
    if inner < 2 * io_bytes:
        return TooSmall(f"intermediates ({inner} B) are not much larger than inputs+outputs ({io_bytes} B)")
    try:
        sub = extract(gm, members, xs + whole, list(outs), ctx.seq.symbol, x_dims[0], ctx.seq.hints)
    except Unsupported as e:
        return str(e)
    chunked = ops.register_region(sub)
    own(gm, chunked.key, chunked)
    tokens = hint_tokens(node_value(xs[0]), x_dims[0], ctx)
    fwd, bwd = region_cost(members, set(outs), ctx, tokens)
    chunked.cost = (fwd, cached_segment_backward_cost(chunked, sub, xs, whole, x_dims, ctx, tokens) or ((bwd, 0.0),))
    anchor = members[-1].next
    # as many chunks as min_tokens allows (up to MAX_CHUNKS): in backward a chunk's recompute
    # (a whole MLP's intermediates) is live beside the block's full-length tensors
    m = chunking.count(gm, xs[0], x_dims[0], MAX_CHUNKS, anchor)
    g = gm.graph
    with g.inserting_before(anchor):
        call = g.call_function(torch.ops.tailorfx.token_segment.default, (chunked.key, xs, whole, x_dims, o_dims, m))
    annotate(call, outs[0], val=list(ovs), pass_name=NAME)
    getters = []
    with g.inserting_after(call):
        for j in reversed(range(len(outs))):
            getters.insert(0, annotate(g.call_function(operator.getitem, (call, j)), outs[j], pass_name=NAME))
    for o, new in zip(outs, getters):
        o.replace_all_uses_with(new)
    call.update_arg(1, xs)
    call.update_arg(2, whole)
    for n in reversed(members):
        if not n.users:
            g.erase_node(n)
    if any(u.op != "output" and _before(u, call) for new in getters for u in new.users):
        legalize_graph(gm)   # a user of an early output sat among the segment's nodes: re-sorted
        nodes.clear()
        nodes.update((n.name, n) for n in gm.graph.nodes)
    done.append(Rewrite(Region("segment", f"{seg.block} [{seg.nodes[0]}..{seg.nodes[-1]}]", seg.nodes, True),
                        m, inner))
    return None


def _with_producers(gm, nodes, members: list[fx.Node], ctx: PassContext) -> list[fx.Node]:
    """The segment's nodes, with the model-level token-wise ops feeding it (the rotary tables
    computed from the positions) run per chunk inside it when what it then takes is smaller:
    the tables never exist at full length (regions.token_producers)."""
    group = set(members)
    outer = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in group
                               and isinstance(node_value(a), torch.Tensor) and not is_param(a)))
    blocked = {nodes[n] for b in ctx.regions.of_kind("block") for n in b.nodes if n in nodes}
    inside: set = set()
    for a in outer:   # each input on its own: sunk where what it is made from is smaller
        chain = set(token_producers([a], ctx.regions.node_class, ctx.seq, blocked))
        leaves = {x for p in chain for x in p.all_input_nodes
                  if x not in chain and isinstance(node_value(x), torch.Tensor) and not is_param(x)}
        if chain and sum(hint_bytes(node_value(x), ctx) for x in leaves) < hint_bytes(node_value(a), ctx):
            inside |= chain
    if not inside:
        return members
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(inside | group, key=order.__getitem__)


def _before(a: fx.Node, b: fx.Node) -> bool:
    """Node a comes before node b in their graph."""
    n = a
    while n.op != "root":
        if n is b:
            return False
        n = n.next
    return True
