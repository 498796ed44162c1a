"""MLP-like regions: a token-wise region with one output becomes tailorfx::token_chunked, its
intermediates made one chunk at a time in forward and recomputed per chunk in backward.
"""
from __future__ import annotations

import copy
import operator
from typing import Optional

import torch
import torch.fx as fx

from tailorfx.passes.minisequence.chunks import NAME, Chunking, Rewrite, auto_chunks
from tailorfx.passes.minisequence.cost import cached_backward_cost, hint_bytes, hint_tokens, region_cost
from tailorfx.passes.minisequence.extract import Unsupported, extract
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext, annotate, own
from tailorfx.rewrite.regions import Region
from tailorfx.runtime import ops


def rewrite_mlp(gm, nodes, region: Region, ctx: PassContext, chunking: Chunking, done) -> Optional[str]:
    """One MLP-like region as tailorfx::token_chunked, recorded in `done`; else why not."""
    if not region.token_wise:
        mixing = sorted({match.op_name(nodes[n]) for n in region.nodes
                         if ctx.regions.node_class.get(n) not in ("token", "const", None)})
        return f"mixes sequence positions ({', '.join(mixing)}{'; MoE token routing' if _routes(region, nodes) else ''})"
    if len(region.outputs) != 1:
        return f"needs one output, has {len(region.outputs)}"
    xs, out = [nodes[i] for i in region.inputs], nodes[region.outputs[0]]
    xvs, ov = [node_value(x) for x in xs], node_value(out)
    if not xs or not all(isinstance(v, torch.Tensor) for v in (*xvs, ov)):
        return "an input or the output is not a tensor"
    out_dims = ctx.seq.dims(ov)
    dims = [ctx.seq.dims(v) for v in xvs]
    if len(out_dims) != 1 or any(d != out_dims for d in dims) \
            or any(v.shape[out_dims[0]] != ov.shape[out_dims[0]] for v in xvs):
        return f"sequence dim not found consistently (inputs {dims}, output {out_dims})"
    x, x_dims = xs[0], out_dims   # several token-wise inputs (a residual passed in) chunk alike
    xv = xvs[0]
    members = [nodes[n] for n in region.nodes]
    io_bytes = sum(hint_bytes(v, ctx) for v in xvs) + hint_bytes(ov, ctx)
    inner = sum(hint_bytes(v, ctx) for n in members if n is not out
                for v in match.tensors_in(node_value(n)))
    if inner < 2 * io_bytes:
        return f"intermediates ({inner} B) are not much larger than input+output ({io_bytes} B)"
    random = any(match.draws_random(n) for n in members)   # dropout: its draws replayed in backward
    try:
        sub = extract(gm, members, xs + [nodes[p] for p in region.params], out,
                      ctx.seq.symbol, x_dims[0], ctx.seq.hints)
    except Unsupported as e:
        return str(e)
    chunked = ops.register_region(sub)   # an equal region already live: that one
    own(gm, chunked.key, chunked)         # the graph calls it by key: it keeps it registered
    _declare_linear_tail(gm, chunked, members, xs, region, nodes, out, ctx, x_dims[0])
    tokens = hint_tokens(xv, x_dims[0], ctx)
    fwd, bwd = region_cost(members, out, ctx, tokens)
    chunked.cost = (fwd, cached_backward_cost(chunked, sub, ctx, tokens) or ((bwd, 0.0),))
    m = chunking.count(gm, x, x_dims[0], auto_chunks(inner, hint_bytes(xv, ctx)), out)
    op = torch.ops.tailorfx.token_chunked_random.default if random else torch.ops.tailorfx.token_chunked.default
    with gm.graph.inserting_after(out):
        call = gm.graph.call_function(op, (chunked.key, xs, [nodes[p] for p in region.params], x_dims[0], m))
    new = call
    if random:   # (output, the RNG state the chunks started from, which backward replays)
        state = ov.new_empty((ops.rng_state_bytes(ov.device),), dtype=torch.uint8, device="cpu")
        annotate(call, val=(ov, state), pass_name=NAME)
        with gm.graph.inserting_after(call):
            new = gm.graph.call_function(operator.getitem, (call, 0))
    annotate(new, out, pass_name=NAME)
    out.replace_all_uses_with(new)
    call.update_arg(1, xs)   # replace_all_uses_with does not touch the call's own args
    for n in reversed(members):
        if not n.users:
            gm.graph.erase_node(n)
    done.append(Rewrite(region, m, inner))
    return None


def _declare_linear_tail(gm, chunked: ops.ChunkedRegion, members, xs, region, nodes, out, ctx,
                         seq_dim) -> None:
    """If the region ends in F.linear(a, W, b) of its own parameters, let backward skip it."""
    if match.op_name(out) not in match.LINEAR_OPS or out.op != "call_function":
        return
    a = out.args[0]
    w = out.args[1] if len(out.args) > 1 else out.kwargs.get("weight")
    b = out.args[2] if len(out.args) > 2 else out.kwargs.get("bias")
    params = [nodes[p] for p in region.params]
    if a not in members or w not in params or (b is not None and b not in params):
        return
    try:
        pre = extract(gm, members[:members.index(out)], xs + params, a, ctx.seq.symbol, seq_dim,
                      ctx.seq.hints)
    except Unsupported:
        return
    chunked.tail = (pre, params.index(w), params.index(b) if b is not None else -1)
    chunked.heads = linear_heads(pre, len(xs))


def linear_heads(pre: fx.GraphModule, num_seq: int) -> Optional[tuple[fx.GraphModule, tuple]]:
    """(core, specs) when `pre` applies F.linear(x, W, b) to its seq inputs with weights it uses
    nowhere else (an MLP's gate and up projections): `core` is `pre` with those linears' outputs as
    inputs, so backward sums their weight gradients in place (ChunkedRegion.heads). None where a
    linear runs under the region's own autocast (its casts are the region's)."""
    if any(n.target is ops.enter_autocast for n in pre.graph.nodes):
        return None
    core = fx.GraphModule(pre, copy.deepcopy(pre.graph))
    phs = [n for n in core.graph.nodes if n.op == "placeholder"]
    seq, params = phs[:num_seq], phs[num_seq:]
    specs, heads = [], []
    for n in core.graph.nodes:
        if n.op != "call_function" or match.op_name(n) != "linear":
            continue
        x, w = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if x in seq and w in params and len(w.users) == 1 and (b is None or (b in params and len(b.users) == 1)):
            specs.append((seq.index(x), params.index(w), params.index(b) if b is not None else -1))
            heads.append(n)
    if not heads:
        return None
    last = phs[-1]
    for i, n in enumerate(heads):
        with core.graph.inserting_after(last):
            last = core.graph.placeholder(f"head_{i}")
        last.meta = dict(n.meta)
        n.replace_all_uses_with(last)
        core.graph.erase_node(n)
    core.recompile()
    return core, tuple(specs)


def _routes(region: Region, nodes: dict) -> bool:
    """An MoE layer: a top-k router over experts."""
    return any(match.op_name(nodes[n]) == "topk" for n in region.nodes)
