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

from typing import Optional

import torch.fx as fx

from tailorfx import compat
from tailorfx.passes import register
from tailorfx.passes.minisequence.chunks import (MAX_CHUNKS, MIN_CHUNK_TOKENS, MIN_SEGMENT_CHUNK_TOKENS, NAME, Chunking,
                                                 Rewrite, auto_chunks)
from tailorfx.passes.minisequence.head import (LOGITS_NOTE, ByRequest, head_loss_transform, rewrite_head,
                                               size_log_prob_heads)
from tailorfx.passes.minisequence.mlp import rewrite_mlp
from tailorfx.passes.minisequence.segment import TooSmall, rewrite_segment
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext, PassResult
from tailorfx.rewrite.regions import token_segments

# what the package offers beside the pass: parallel/ reads MAX_CHUNKS and head_loss_transform here
__all__ = ["MiniSequence", "MAX_CHUNKS", "LOGITS_NOTE", "auto_chunks", "head_loss_transform"]


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

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        nodes = {n.name: n for n in gm.graph.nodes}
        chunking = Chunking(self.num_chunks, self.min_tokens)
        done: list[Rewrite] = []
        skipped: list[str] = []
        for block in ctx.regions.of_kind("block") if self.segments else ():
            for seg in token_segments(gm, block, ctx.regions):
                why = rewrite_segment(gm, nodes, seg, ctx, chunking, done)
                if why and not isinstance(why, TooSmall):   # a residual sum alone: nothing to save
                    skipped.append(f"{block.path} segment {seg.nodes[0]}..{seg.nodes[-1]}: {why}")
        for region in ctx.regions.of_kind("mlp") if self.chunk_mlps else ():
            if not all(n in nodes and nodes[n].graph is gm.graph for n in region.nodes):
                continue   # chunked inside a segment
            why = rewrite_mlp(gm, nodes, region, ctx, chunking, done)
            if why:
                skipped.append(f"{region.path}: {why}")
        if not ctx.regions.of_kind("mlp") and any(match.op_name(n) == "tag_activation_checkpoint"
                                                  for n in gm.graph.nodes):
            skipped.append("(graph): no MLP region is visible: the layers run under torch.utils.checkpoint "
                           "(model.gradient_checkpointing_enable()), opaque to tailorfx; call "
                           "model.gradient_checkpointing_disable() and add 'recompute' to passes instead")
        by_request = {}
        for region in ctx.regions.of_kind("lm_head_loss"):
            why = rewrite_head(gm, nodes, region, ctx, chunking, self.segments, done)
            if isinstance(why, ByRequest):
                by_request[region.path] = {"kind": region.kind, "note": str(why)}
            elif why:
                skipped.append(f"{region.path}: {why}")
        size_log_prob_heads(gm, ctx, chunking, self.segments, done)
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


def _describe(m) -> str:
    """M as the report shows it: a number, or the run-time rule."""
    if isinstance(m, fx.Node):
        v = node_value(m)
        return f"{compat.sym_expr(v)}".replace("Max", "max").replace("Min", "min")
    return str(m)


@register(NAME)
def _factory(options: dict) -> MiniSequence:
    return MiniSequence(options)
