"""Recompute (activation checkpointing) as tags the partitioner honours.

Invariant: values are unchanged; only which forward tensors are saved for backward and which are
recomputed changes. Decisions are made where saved tensors are explicit: the pass tags nodes of the
chosen blocks with `CheckpointPolicy` in `meta["recompute"]` (AOTAutograd copies the tag onto
every ATen node it traces from them), and the lowering then partitions the joint graph with the
min-cut partitioner, which must recompute what is tagged so and must save what is tagged so.

    policy "full":      every op of the block is recomputed but its outputs; the block saves
                        only its input (the block before's output)
    policy "selective": matmuls and attention are saved, pointwise ops and norms recomputed
                        (Megatron's selective recompute, torch SAC's usual policy)
    policy "full-except-attention": every op recomputed but the block's outputs and its attention
                        (the attention's output and the statistics its backward reads are saved):
                        a q-sized tensor per block more than "full", and no attention forward
                        again, the most of a full recompute's time at long sequences
    policy "full" (or "full-except-attention") on the first k blocks, "selective" on the rest
                        (`recompute_rest`): the planner's ladders past selective recompute of every
                        block, which costs little (pointwise ops) and saves much, so the full
                        recompute of k blocks (a forward of each) is spent only on what selective
                        cannot save
    offload "checkpoints": each block's input (its checkpoint) waits for the backward in host memory
                        (ALST's checkpoint offload; rewrite/offload.py)
    offload "activations": every tensor the chosen blocks save (their inputs too) waits in host
                        memory, a block's reloaded together one block ahead (torchtune's
                        activation offload): memory selective recompute keeps, freed without the
                        FLOPs of a full recompute, for the host link's time

    before:  %mm_4 = mm(%view_8, %t_4)                       (saved for backward)
    after:   %mm_4 = mm(%view_8, %t_4)  {recompute: MUST_RECOMPUTE, ac_graph_id: 1}
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from tailorfx import compat
from tailorfx.passes import register
from tailorfx.rewrite import match, offload
from tailorfx.rewrite.passes import PASS_META, PassContext, PassResult
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.regions import module_paths

NAME = "recompute"
POLICIES = ("full", "full-except-attention", "selective")
OFFLOADS = (None, "checkpoints", "activations")
RESTS = (None, "selective")
SAVE_OPS = match.MATMUL_OPS | match.ATTENTION_OPS | {"token_chunked", "token_segment", "chunked_linear_cross_entropy",
                                                     "triton_linear_cross_entropy", "triton_attention"}
SAVED_BY = {"full": frozenset(), "full-except-attention": match.ATTENTION_OPS, "selective": SAVE_OPS}


def has_recompute_tags(gm: fx.GraphModule) -> bool:
    """Whether a graph needs the tag-honouring (min-cut) partitioner."""
    return any("recompute" in n.meta for n in gm.graph.nodes)


class Recompute:
    """Tag the ops of the chosen transformer blocks for recomputation under a policy."""
    name = NAME
    after = ("minisequence",)   # chunked ops are tagged like the ops they replaced

    def __init__(self, options: dict):
        self.offload: Optional[str] = options.get("offload")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, got {self.offload!r}")
        # offloaded activations stand in for a full recompute: selective unless asked otherwise
        self.policy: str = options.get("recompute_policy") or ("selective" if self.offload == "activations" else "full")
        if self.policy not in POLICIES:
            raise ValueError(f"recompute_policy must be one of {POLICIES}, got {self.policy!r}")
        blocks = options.get("recompute_blocks")   # None: all blocks; an int k: the first k
        self.num_blocks: Optional[int] = blocks
        self.rest: Optional[str] = options.get("recompute_rest")   # the policy of the blocks past the first k
        if self.rest not in RESTS:
            raise ValueError(f"recompute_rest must be one of {RESTS}, got {self.rest!r}")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        blocks = [r.path for r in ctx.regions.of_kind("block")]
        chosen = blocks if self.num_blocks is None else blocks[:self.num_blocks]
        policy = {p: self.policy for p in chosen}
        if self.rest is not None:
            policy.update({p: self.rest for p in blocks[len(chosen):]})
        if not policy:
            why = "no transformer blocks found" if not blocks else "recompute_blocks=0"
            return PassResult(gm, False, {}, (), (f"(graph): {why}",))
        index = {p: i for i, p in enumerate(policy)}
        counts = {"recomputed": 0, "saved": 0}
        block_of = {n: next((p for p in module_paths(n) if p in index), None) for n in gm.graph.nodes
                    if n.op in ("call_function", "call_method")}
        # A block's outputs (read by a later op outside it, not by the graph's output or a size
        # computation) are saved: the next block's recompute starts from them. AOTAutograd
        # gives the items of a multi-output op (a chunked segment) the op's own tag, so such an
        # output saves through its op; else all blocks would be recomputed at once, from the first.
        outputs = set()
        for n, block in block_of.items():
            if block is not None and isinstance(node_value(n), torch.Tensor) \
                    and any(block_of.get(u) != block for u in n.users
                            if u.op != "output" and not isinstance(node_value(u), (int, torch.SymInt))):
                outputs.add(n)
                if match.is_getitem(n) and isinstance(n.args[0], fx.Node):
                    outputs.add(n.args[0])
        for n, block in block_of.items():
            if block is None:
                continue
            save = n in outputs or match.op_name(n) in SAVED_BY[policy[block]]
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = index[block] + 1
            n.meta[PASS_META] = n.meta.get(PASS_META, NAME)
            counts["saved" if save else "recomputed"] += 1
        if self.offload:
            regions = [r for r in ctx.regions.of_kind("block") if r.path in chosen]
            if self.offload == "activations":   # a block's outputs wait as the next block's checkpoint (if chosen)
                for n, block in block_of.items():
                    if block in chosen and n not in outputs:
                        offload.tag(n, index[block] + 1)
            counts["offloaded"] = self._tag_checkpoints(gm, regions, self.offload == "activations", index)
        stats = {"policy": self.policy, "blocks": len(chosen), **counts}
        if self.rest is not None:
            stats["rest"] = {"policy": self.rest, "blocks": len(policy) - len(chosen)}
        ckpt = {None: "", "checkpoints": ", its checkpoint offloaded to host",
                "activations": ", its saved activations offloaded to host"}[self.offload]
        # an attention left as matmuls and softmax (not swapped to one op) has nothing to save: recomputed whole
        kept = {block for n, block in block_of.items() if match.op_name(n) in match.ATTENTION_OPS}
        skipped = tuple(f"{p}: no attention op to save (attention not swapped to one op): recomputed whole"
                        for p, pol in policy.items() if pol == "full-except-attention" and p not in kept)
        return PassResult(gm, True, stats, tuple(f"{p} ({pol}{ckpt if p in chosen else ''})" for p, pol in policy.items()),
                          skipped)

    @staticmethod
    def _tag_checkpoints(gm: fx.GraphModule, blocks: list, grouped: bool = False, index: Optional[dict] = None) -> int:
        """Tag each block's input on the residual stream (its largest input: the embedding's
        output, or the block before's) for host memory: the checkpoint the block is recomputed
        from. The last block's output is not one (the final norm reads it first in backward).
        `grouped`: in the block's group (`index`: block path -> position), reloaded with it."""
        nodes = {n.name: n for n in gm.graph.nodes}
        count = 0
        for b in blocks:
            ins = [nodes[i] for i in b.inputs if i in nodes and isinstance(node_value(nodes[i]), torch.Tensor)
                   and node_value(nodes[i]).is_floating_point()]
            if not ins:
                continue
            x = max(ins, key=lambda n: compat.size_hint(node_value(n).numel()))
            group = index[b.path] + 1 if grouped else None
            offload.tag(x, group)
            if match.is_getitem(x) and isinstance(x.args[0], fx.Node):
                offload.tag(x.args[0], group)
            count += 1
        return count


@register(NAME)
def _factory(options: dict) -> Recompute:
    return Recompute(options)
