"""Mini-sequence (MST, NeurIPS 2024): token-wise regions run in chunks along the sequence.

Invariant: the model computes the same values (exact up to float reassociation of the sums over
chunks); only which intermediates exist at once changes.

    before:  y = down(silu(gate(x)) * up(x))                # S x I intermediates, saved for bw
    after:   y = tailorfx::token_chunked(key, [x], [Wg, Wu, Wd], seq_dim=1, num_chunks=M)

    before:  loss = cross_entropy(linear(h, W).float().view(-1, V), labels)   # S x V logits
    after:   loss = chunked_linear_cross_entropy(h.reshape(-1, H), W, None, labels, num_chunks=M)

A model that also returns the logits (Hugging Face's) returns None for them in training; with
keep_logits=True, in eval mode or under no_grad the head is left as it is.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.passes.tools_common import legalize_graph

from tailorfx.passes import register
from tailorfx.passes.minisequence.cost import (_cached_backward_cost, _cached_segment_backward_cost, _hint_bytes,
                                               _region_cost, _tokens)
from tailorfx import compat
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext, PassResult, annotate, own
from tailorfx.rewrite.regions import Region, Segment, is_param, param_source, token_producers, token_segments
from tailorfx.runtime import ops

NAME = "minisequence"
MAX_CHUNKS = 64
# Fewer tokens per chunk than this costs throughput (each chunk re-reads the weights and, for the
# LM head, re-accumulates a V x H weight gradient) for little memory: below it, fewer chunks.
MIN_CHUNK_TOKENS = 1024
MIN_SEGMENT_CHUNK_TOKENS = 256
SEGMENTS_HEAD_CHUNKS = 4096   # with segments the head chunks by MIN_SEGMENT_CHUNK_TOKENS alone (1M tokens)
# Between the LM head and the loss only these may appear (dtype casts and reshapes).
_PASSTHROUGH = frozenset({"float", "to", "view", "reshape", "contiguous", "type"})
LOGITS_NOTE = ("logits=None: the LM head is fused with the loss in training with labels (as Liger-Kernel's "
               "skip_logits); optimize(..., keep_logits=True) returns them, with the head unfused")


@dataclass
class _Rewrite:
    region: Region
    num_chunks: int
    saved_bytes: int
    logits_dropped: bool = False   # the model's logits output became None (fused head)


def auto_chunks(intermediate_bytes: int, io_bytes: int) -> int:
    """Enough chunks that one chunk's intermediates are no larger than the region's input."""
    if io_bytes <= 0:
        return 1
    return max(1, min(MAX_CHUNKS, math.ceil(intermediate_bytes / io_bytes)))


class MiniSequence:
    """Chunk MLP regions and fuse LM head + cross-entropy, choosing M per region unless given."""
    name = NAME
    after = ("attention", "precision", "kernels")

    def __init__(self, options: dict):
        self.num_chunks: Optional[int] = options.get("minisequence_chunks")
        # False: fuse the LM head with the loss only (no recompute: its gradient is taken in forward)
        self.chunk_mlps: bool = options.get("minisequence_mlps", True)
        # True: chunk each block's whole token-wise segments (the norm and projections before
        # attention, the output projection, residual, norm and MLP after it), not only its MLP;
        # the plan that saves the most, so its chunks (the LM head's too) may be finer
        self.segments: bool = bool(options.get("minisequence_segments")) and self.chunk_mlps
        self.min_tokens: int = options.get("minisequence_min_tokens") or (
            MIN_SEGMENT_CHUNK_TOKENS if self.segments else MIN_CHUNK_TOKENS)

    def _chunks(self, gm: fx.GraphModule, x: fx.Node, seq_dim: int, ideal: int, before: fx.Node):
        """M: as given, else min(ideal, tokens // min_tokens) computed at run time from the
        (symbolic) length, so one graph chunks 2K and 64K tokens each sensibly."""
        if self.num_chunks:
            return self.num_chunks
        xv = node_value(x)
        other = math.prod(int(d) for i, d in enumerate(xv.shape[:seq_dim + 1]) if i != seq_dim)
        length = xv.shape[seq_dim]
        if not isinstance(length, torch.SymInt):
            return max(1, min(ideal, int(length) * other // self.min_tokens))
        g = gm.graph
        with g.inserting_before(before):
            n_len = g.call_method("size", (x, seq_dim))
            n_tok = g.call_function(operator.mul, (n_len, other))
            n_div = g.call_function(operator.floordiv, (n_tok, self.min_tokens))
            n_min = g.call_function(torch.sym_min, (ideal, n_div))
            n_max = g.call_function(torch.sym_max, (1, n_min))
        tok = length * other
        for node, val in ((n_len, length), (n_tok, tok), (n_div, tok // self.min_tokens),
                          (n_min, torch.sym_min(ideal, tok // self.min_tokens)),
                          (n_max, torch.sym_max(1, torch.sym_min(ideal, tok // self.min_tokens)))):
            annotate(node, val=val, pass_name=NAME)
        return n_max

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        nodes = {n.name: n for n in gm.graph.nodes}
        done: list[_Rewrite] = []
        skipped: list[str] = []
        for block in ctx.regions.of_kind("block") if self.segments else ():
            for seg in token_segments(gm, block, ctx.regions.node_class):
                why = self._rewrite_segment(gm, nodes, seg, ctx, done)
                if why and not isinstance(why, _TooSmall):   # a residual sum alone: nothing to save
                    skipped.append(f"{block.path} segment {seg.nodes[0]}..{seg.nodes[-1]}: {why}")
        for region in ctx.regions.of_kind("mlp") if self.chunk_mlps else ():
            if not all(n in nodes and nodes[n].graph is gm.graph for n in region.nodes):
                continue   # chunked inside a segment
            why = self._rewrite_mlp(gm, nodes, region, ctx, done)
            if why:
                skipped.append(f"{region.path}: {why}")
        if not ctx.regions.of_kind("mlp") and any(match.op_name(n) == "tag_activation_checkpoint"
                                                  for n in gm.graph.nodes):
            skipped.append("(graph): no MLP region is visible: the layers run under torch.utils.checkpoint "
                           "(model.gradient_checkpointing_enable()), opaque to tailorfx; call "
                           "model.gradient_checkpointing_disable() and add 'recompute' to passes instead")
        by_request = {}
        for region in ctx.regions.of_kind("lm_head_loss"):
            why = self._rewrite_head(gm, nodes, region, ctx, done)
            if isinstance(why, _ByRequest):
                by_request[region.path] = {"kind": region.kind, "note": str(why)}
            elif why:
                skipped.append(f"{region.path}: {why}")
        if done:
            gm.graph.eliminate_dead_code()
        stats = {r.region.path: {"kind": r.region.kind, "num_chunks": _describe(r.num_chunks),
                                 "intermediate_bytes_saved": r.saved_bytes} for r in done}
        stats.update(by_request)
        for r in done:
            if r.logits_dropped:
                stats[r.region.path]["note"] = LOGITS_NOTE
        return PassResult(gm, bool(done), stats,
                          tuple(f"{r.region.path} (M={_describe(r.num_chunks)})" for r in done),
                          tuple(skipped))

    # ---- MLP-like regions -------------------------------------------------------------------
    def _rewrite_mlp(self, gm, nodes, region: Region, ctx: PassContext, done) -> Optional[str]:
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
        io_bytes = sum(_hint_bytes(v, ctx) for v in xvs) + _hint_bytes(ov, ctx)
        inner = sum(_hint_bytes(v, ctx) for n in members if n is not out
                    for v in match.tensors_in(node_value(n)))
        if inner < 2 * io_bytes:
            return f"intermediates ({inner} B) are not much larger than input+output ({io_bytes} B)"
        random = any(match.draws_random(n) for n in members)   # dropout: its draws replayed in backward
        try:
            sub = _extract(gm, members, xs + [nodes[p] for p in region.params], out,
                           ctx.seq.symbol, x_dims[0], ctx.seq.hints)
        except _Unsupported as e:
            return str(e)
        chunked = ops.register_region(sub)   # an equal region already live: that one
        own(gm, chunked.key, chunked)         # the graph calls it by key: it keeps it registered
        self._declare_linear_tail(gm, chunked, members, xs, region, nodes, out, ctx, x_dims[0])
        tokens = _tokens(xv, x_dims[0], ctx)
        fwd, bwd = _region_cost(members, out, ctx, tokens)
        bwd, bwd_const = _cached_backward_cost(chunked, sub, ctx, tokens) or (bwd, 0.0)
        chunked.cost = (fwd, bwd, bwd_const)
        m = self._chunks(gm, x, x_dims[0], auto_chunks(inner, _hint_bytes(xv, ctx)), out)
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
        done.append(_Rewrite(region, m, inner))
        return None

    # ---- a block's token-wise segments --------------------------------------------------------
    def _rewrite_segment(self, gm, nodes, seg: Segment, ctx: PassContext, done) -> Optional[str]:
        """One token-wise segment (several inputs and outputs, each with its own sequence dim) as
        tailorfx::token_segment: chunks in forward, each chunk recomputed in backward."""
        members = self._with_producers(gm, nodes, [nodes[n] for n in seg.nodes], ctx)
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
        io_bytes = sum(_hint_bytes(v, ctx) for v in (*ivs, *ovs))
        inner = sum(_hint_bytes(v, ctx) for n in members if n not in outs for v in match.tensors_in(node_value(n)))
        if inner < 2 * io_bytes:
            return _TooSmall(f"intermediates ({inner} B) are not much larger than inputs+outputs ({io_bytes} B)")
        try:
            sub = _extract(gm, members, xs + whole, list(outs), ctx.seq.symbol, x_dims[0], ctx.seq.hints)
        except _Unsupported as e:
            return str(e)
        chunked = ops.register_region(sub)
        own(gm, chunked.key, chunked)
        tokens = _tokens(node_value(xs[0]), x_dims[0], ctx)
        fwd, bwd = _region_cost(members, set(outs), ctx, tokens)
        bwd, bwd_const = _cached_segment_backward_cost(chunked, sub, xs, whole, x_dims, ctx, tokens) or (bwd, 0.0)
        chunked.cost = (fwd, bwd, bwd_const)
        anchor = members[-1].next
        # as many chunks as min_tokens allows (up to MAX_CHUNKS): in backward a chunk's recompute
        # (a whole MLP's intermediates) is live beside the block's full-length tensors
        m = self._chunks(gm, xs[0], x_dims[0], MAX_CHUNKS, anchor)
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
        done.append(_Rewrite(Region("segment", f"{seg.block} [{seg.nodes[0]}..{seg.nodes[-1]}]", seg.nodes, True),
                             m, inner))
        return None

    @staticmethod
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
            if chain and sum(_hint_bytes(node_value(x), ctx) for x in leaves) < _hint_bytes(node_value(a), ctx):
                inside |= chain
        if not inside:
            return members
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        return sorted(inside | group, key=order.__getitem__)

    @staticmethod
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
            pre = _extract(gm, members[:members.index(out)], xs + params, a, ctx.seq.symbol, seq_dim,
                           ctx.seq.hints)
        except _Unsupported:
            return
        chunked.tail = (pre, params.index(w), params.index(b) if b is not None else -1)

    # ---- LM head + cross-entropy ------------------------------------------------------------
    def _rewrite_head(self, gm, nodes, region: Region, ctx: PassContext, done) -> Optional[str]:
        head = nodes[region.nodes[0]]
        if match.op_name(head) not in match.LINEAR_OPS:
            return f"the LM head is a {match.op_name(head)}, only F.linear heads are fused"
        chain, side = _head_chain(head)
        loss = chain[-1]
        returned = [n for n in chain if any(u.op == "output" for u in n.users)]
        if match.op_name(loss) != "cross_entropy":
            if not ctx.options.get("training", True):
                return _ByRequest("eval mode or no_grad: no loss to fuse the LM head with; left unfused")
            if loss is head or (returned and len(chain) == len(returned)):
                return ("the logits leave the graph before any loss (a graph break, or no labels given), "
                        "so the LM head cannot be fused with a loss; left unchanged")
            return f"the logits feed {match.op_name(loss)!r}, not cross_entropy"
        returned += side
        if returned and ctx.options.get("keep_logits"):
            return _ByRequest("logits returned (keep_logits=True): LM head and loss left unfused")
        if returned and not ctx.options.get("training", True):
            return _ByRequest("logits returned (eval mode or no_grad): LM head and loss left unfused")
        transform = _logit_transform(chain[1:-1])
        if isinstance(transform, str):
            return transform
        softcap, logit_scale = transform
        kw = _loss_kwargs(loss)
        if isinstance(kw, str):
            return kw
        reduction = kw.get("reduction", "mean")
        h, w = head.args[0], head.args[1]
        b = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
        if not (isinstance(w, fx.Node) and is_param(w, through_casts=True)):
            return "the LM head weight is not a parameter"
        # A low-precision head (precision pass) reads W.to(bf16): the fused op takes the fp32
        # master instead, computes in fp32 and accumulates W's gradient in fp32 (no V x H copy).
        w = param_source(w)
        b = param_source(b) if isinstance(b, fx.Node) and is_param(b, through_casts=True) else b
        hv = node_value(h)
        hidden = hv.shape[-1]
        h_dims = ctx.seq.dims(hv)
        if len(h_dims) != 1:
            return f"sequence dim of the LM head input not found ({h_dims})"
        # the plan that saves the most: chunks of min_tokens however long the sequence (a chunk's
        # logits and their gradient are the head's transient); else as many as keep a chunk's
        # logits within the size of the head's input, up to MAX_CHUNKS
        ideal = SEGMENTS_HEAD_CHUNKS if self.segments else auto_chunks(_hint_bytes(node_value(head), ctx),
                                                                        _hint_bytes(hv, ctx))
        m = self._chunks(gm, h, h_dims[0], ideal, loss)
        options = {"ignore_index": int(kw.get("ignore_index", -100)), "reduction": reduction, "num_chunks": m}
        options.update({k: v for k, v in (("logit_softcap", softcap), ("logit_scale", logit_scale)) if v is not None})
        with gm.graph.inserting_before(loss):
            flat = gm.graph.call_method("reshape", (h, -1, hidden))
            new = gm.graph.call_function(_lce_fn(ctx), (flat, w, b, kw["target"]), options)
        with hv.fake_mode:
            flat_val = hv.reshape(-1, hidden)
        annotate(flat, head, flat_val, pass_name=NAME)
        annotate(new, loss, pass_name=NAME)
        loss.replace_all_uses_with(new)
        if returned:   # Liger's skip_logits: in training with labels the model returns logits=None
            out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
            out.args = fx.node.map_arg(out.args, lambda a: None if a in returned else a)
        for n in reversed(side + chain):
            if not n.users:
                gm.graph.erase_node(n)
        done.append(_Rewrite(region, m, 3 * _hint_bytes(node_value(head), ctx), bool(returned)))
        return None


def head_loss_transform(gm: fx.GraphModule, region: Region):
    """(softcap, logit_scale) when the LM head region's linear feeds cross_entropy through casts,
    reshapes, a scale and a soft-cap only (what a fused head computes), else the reason not."""
    head = {n.name: n for n in gm.graph.nodes}[region.nodes[0]]
    if match.op_name(head) not in match.LINEAR_OPS:
        return f"the LM head is a {match.op_name(head)}, only F.linear heads are fused"
    chain, _ = _head_chain(head)
    if match.op_name(chain[-1]) != "cross_entropy":
        return f"the logits feed {match.op_name(chain[-1])!r}, not cross_entropy"
    kw = _loss_kwargs(chain[-1])
    return kw if isinstance(kw, str) else _logit_transform(chain[1:-1])


def _lce_fn(ctx: PassContext):
    """The fused head's implementation: the Triton kernel under kernels="triton", else torch's."""
    if ctx.options.get("kernels") == "triton":
        from tailorfx.runtime.triton_ops import triton_linear_cross_entropy
        return triton_linear_cross_entropy
    return ops.chunked_linear_cross_entropy


# Between the LM head and the loss: a logit scale (Cohere) and a soft-cap c*tanh(z/c) (Gemma-2),
# fused into the chunks; anything else leaves the head unfused.
_LOGIT_OPS = frozenset({"mul", "truediv", "div", "tanh"})


def _head_chain(head: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes from the LM head down to the first that is neither a cast/reshape nor a logit
    transform (the loss, if fusable), and the returned casts of the logits met on the way."""
    chain, side, cur = [head], [], head
    while True:
        users = [u for u in cur.users if u.op != "output"]
        # a cast whose only use is the output (the precision pass restoring the logits' dtype)
        # is a returned copy of the logits, not a second consumer
        returned_casts = [u for u in users if len(users) > 1 and match.op_name(u) in _PASSTHROUGH
                          and all(x.op == "output" for x in u.users)]
        users = [u for u in users if u not in returned_casts]
        if len(users) != 1:
            return chain, side
        side += returned_casts
        chain.append(users[0])
        if match.op_name(users[0]) not in _PASSTHROUGH | _LOGIT_OPS:
            return chain, side
        cur = users[0]


def _loss_kwargs(loss: fx.Node):
    """cross_entropy's arguments by name, or why this loss is not fused."""
    kw = dict(zip(("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                   "label_smoothing"), loss.args))
    kw.update(loss.kwargs)
    if kw.get("weight") is not None or kw.get("label_smoothing", 0.0) or kw.get("size_average") is not None \
            or kw.get("reduce") is not None:
        return "cross_entropy with class weights or label smoothing is not fused"
    if kw.get("reduction", "mean") not in ("mean", "sum"):
        return f"reduction={kw.get('reduction')!r} is not fused"
    logits2d = node_value(kw["input"])
    if not isinstance(logits2d, torch.Tensor) or logits2d.dim() != 2:
        return "cross_entropy input is not (tokens, vocab)"
    return kw


def _logit_transform(chain: list[fx.Node]):
    """(softcap, logit_scale) of the ops between head and loss, or the reason they are not fused:
    multiplications and divisions by constants (one scale, Cohere's `* logit_scale`, Granite's
    `/ logits_scaling`), then at most one soft-cap c*tanh(z/c) (Gemma-2)."""
    steps = []
    for n in chain:
        name = match.op_name(n)
        if name in _PASSTHROUGH:
            continue
        scalars = [a for a in n.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        const = float(scalars[0]) if len(scalars) == 1 and len(n.args) == 2 else None
        if name in ("truediv", "div") and const is not None and not isinstance(n.args[1], (int, float)):
            const = None   # c / z is not a scale
        steps.append((name, const))
    tanh = [i for i, (name, _) in enumerate(steps) if name == "tanh"]
    softcap, scaled = None, steps
    if len(tanh) == 1 and 1 <= tanh[0] == len(steps) - 2:
        (d, c), (m, c2) = steps[tanh[0] - 1], steps[tanh[0] + 1]
        if d in ("truediv", "div") and m == "mul" and c is not None and c == c2:
            softcap, scaled = c, steps[:tanh[0] - 1]
    scale = 1.0
    for name, c in scaled:
        if c is None or name not in ("mul", "truediv", "div") or c == 0:
            return (f"the logits pass through {[s[0] for s in steps]} before the loss; only scales by constants "
                    "and a soft-cap c*tanh(z/c) after them are fused")
        scale = scale * c if name == "mul" else scale / c
    return softcap, (scale if scaled else None)


def _before(a: fx.Node, b: fx.Node) -> bool:
    """Node a comes before node b in their graph."""
    n = a
    while n.op != "root":
        if n is b:
            return False
        n = n.next
    return True


def _routes(region: Region, nodes: dict) -> bool:
    """An MoE layer: a top-k router over experts."""
    return any(match.op_name(nodes[n]) == "topk" for n in region.nodes)


def _describe(m) -> str:
    """M as the report shows it: a number, or the run-time rule."""
    if isinstance(m, fx.Node):
        v = node_value(m)
        return f"{compat.sym_expr(v)}".replace("Max", "max").replace("Min", "min")
    return str(m)


class _TooSmall(str):
    """A segment left whole: chunking it would save nothing worth a kernel launch per chunk."""


class _ByRequest(str):
    """A region left as it was because the user asked for what it computes (not a failure)."""


class _Unsupported(Exception):
    """The region cannot be chunked; the message says why."""



def _extract(gm: fx.GraphModule, members: list[fx.Node], inputs: list[fx.Node], out,
             seq_symbol, seq_dim: int, seq_hints: Optional[dict] = None) -> fx.GraphModule:
    """The region as its own GraphModule: f(x, *params) -> out (a tuple when `out` is a list).

    A size taken from outside (Dynamo passes the sequence length as a SymInt graph input; inputs
    of the same length, such as labels, may carry a symbol of their own) is re-read from the
    chunk, `x.size(seq_dim)`, so the region is correct on any chunk length.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in_{i}")
        env[n].meta = dict(n.meta)
    member_set = set(members)

    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":   # a submodule the region calls (an autograd.Function's bodies)
            env[a] = g.get_attr(a.target)
            env[a].meta = dict(a.meta)
        if a not in env:
            v = node_value(a)
            same_length = isinstance(v, torch.SymInt) and (
                compat.sym_expr(v) == seq_symbol
                or (seq_hints is not None and seq_hints.get(compat.sym_expr(v)) == seq_hints.get(seq_symbol)))
            # another dim of the input (a dynamic batch size) is re-read from the chunk as well
            xv = node_value(inputs[0])
            other = [d for d, size in enumerate(getattr(xv, "shape", ())) if d != seq_dim and isinstance(v, torch.SymInt)
                     and compat.sym_expr(size) == compat.sym_expr(v)]
            if a in member_set or not (same_length or other):
                raise _Unsupported(f"uses {a.name} from outside the region")
            env[a] = g.call_method("size", (env[inputs[0]], seq_dim if same_length else other[0]))
        return env[a]

    for n in members:
        env[n] = g.node_copy(n, arg)
        if n.target is torch.ops.higher_order.autograd_function_apply:
            env[n].target = ops.function_apply   # the same autograd.Function, without the HOP's leak
    g.output(tuple(env[o] for o in out) if isinstance(out, (list, tuple)) else env[out])
    sub = fx.GraphModule(gm, g)
    sub.meta = {}
    return sub


@register(NAME)
def _factory(options: dict) -> MiniSequence:
    return MiniSequence(options)
