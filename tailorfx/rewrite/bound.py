"""A lower bound on the peak of every plan of tailorfx's rewrites, read off the captured graph.

While the last block's attention runs backward, any plan (whatever it chunks, recomputes or
fuses, the optimizer step in backward included) holds at once:
  boundaries - each block's input, the residual stream where the block starts: the block's own
               backward needs its input, and every earlier block's is needed after it (saved, or
               recomputed from one that is: one per block either way);
  residual   - the gradient flowing down the residual stream, kept to add the attention path's;
  attention  - the attention kernel's backward operands at full length: q, k, v, its output, the
               output's gradient, and the gradients of q, k and v it writes (its log-sum-exp and
               workspaces left out: the bound stays below);
  tied       - the gradient of a weight used both before the first block and after the last (a
               tied embedding and LM head): the head's share exists, the embedding's not yet, so
               no optimizer step can have consumed it.
Token-wise segments chunked to the finest grain remove everything else; recompute cannot drop
these. Where checkpoints may be offloaded to host memory (rewrite/offload.py), the device holds
only the last block's input of the boundaries. So `static + sum(parts)` is what a plan would peak
at if nothing else were live: no plan's measured peak is below it (tests/test_bound.py), and the
longest sequence whose bound fits a budget is the longest any plan of these rewrites could reach.

The attention operands are found as the tensors crossing between the block's token-wise segments
(rewrite.regions.token_segments) and the ops that mix positions, so any attention form counts
(SDPA, eager matmul-softmax, a sparse or soft-capped kernel).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from tailorfx.rewrite import match
from tailorfx.rewrite.capture import SeqInfo, node_value
from tailorfx.rewrite.regions import RegionMap, find_regions, is_param, token_segments
from tailorfx.rewrite.trace import Sizer


@dataclass
class Bound:
    """The smallest peak any plan could reach at `seq_len`: static bytes + the parts that must be
    live at once."""
    seq_len: int
    static_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    offload: bool = False    # plans may keep checkpoints in host memory (else: on the device only)

    @property
    def kind(self) -> str:
        """Which plans the bound is over, as the report and the CLI name it."""
        return "host-offload" if self.offload else "device-only"   # host-offload: checkpoints in host memory

    @property
    def dynamic_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def peak_bytes(self) -> int:
        return self.static_bytes + self.dynamic_bytes

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get) if self.parts else ""


@dataclass(frozen=True)
class BoundShape:
    """What the bound sums, as graph values (sized at any length by a Sizer)."""
    boundaries: tuple      # one fake tensor per block: its input on the residual stream
    residual: object       # the last block's input (the residual stream's gradient has its shape)
    attention: tuple       # the last block's attention operands and output
    tied: tuple = ()       # trained weights used before the first block and after the last

    def parts(self, sizer: Sizer, offload: bool = False) -> dict[str, int]:
        size = lambda ts: sum(sizer(t) for t in ts)   # noqa: E731
        out = {"block boundaries": size(self.boundaries[-1:] if offload else self.boundaries),
               "residual-stream gradient": sizer(self.residual) if self.residual is not None else 0,
               "attention operands and their gradients": 2 * size(self.attention)}
        if self.tied:
            out["tied weights' gradient"] = size(self.tied)
        return out


def bound_shape(gm: fx.GraphModule, regions: RegionMap, seq: SeqInfo) -> Optional[BoundShape]:
    """The bound's terms for a graph with transformer blocks (best read off a graph whose attention
    the attention pass has swapped to an O(S) kernel: its operands are then the kernel's, k and v
    at their own head count); None when it has none."""
    blocks = regions.of_kind("block")
    if not blocks:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    cls = regions.node_class
    hint = Sizer(seq)

    def largest(vals):
        vals = [v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point() and len(seq.dims(v)) == 1]
        return max(vals, key=hint) if vals else None
    inputs = [largest(node_value(nodes[i]) for i in b.inputs) for b in blocks]
    if seq.depth is not None and len(blocks) == seq.depth.captured:   # a shallow capture: its repeats too
        d = seq.depth
        inputs += [inputs[b] for j, t in enumerate(d.times) for _ in range(t) for b in d.middle(j)]
    boundaries = [v for v in inputs if v is not None]
    last = blocks[-1]
    residual = boundaries[-1] if boundaries else None   # the residual stream's shape
    attention = []
    kernels = [nodes[n] for n in last.nodes if match.op_name(nodes[n]) in match.ATTENTION_OPS]
    if kernels:   # q, k, v and the output of the block's attention kernel
        k = kernels[0]
        # k and v at their own head count (a graph whose SDPA reads repeat_kv's copies)
        qkv = [a for a in (*k.args, *k.kwargs.values())
               if isinstance(a, fx.Node) and isinstance(node_value(a), torch.Tensor)][:3]
        attention = [node_value(match.unwrap_repeat_kv(a)) for a in qkv] + match.tensors_in(node_value(k))[:1]
    else:         # eager attention: what crosses between the token-wise segments and the mixing ops
        attn = [r for r in regions.of_kind("attention") if r.path.startswith(last.path + ".")]
        mixing = {n for n in (attn[0].nodes if attn else last.nodes) if cls.get(n) == "mix"}
        for seg in token_segments(gm, last, regions):
            attention += [node_value(nodes[o]) for o in seg.outputs if any(u.name in mixing for u in nodes[o].users)]
            attention += [node_value(nodes[i]) for i in seg.inputs if i in mixing and not is_param(nodes[i])]
    attention = [v for v in attention if isinstance(v, torch.Tensor) and len(seq.dims(v)) == 1]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inside = [order[nodes[n]] for b in blocks for n in b.nodes if n in nodes]
    first, end = min(inside), max(inside)
    tied = [node_value(p) for p in gm.graph.nodes if is_param(p) and getattr(node_value(p), "requires_grad", False)
            and any(order[u] < first for u in p.users) and any(order[u] > end for u in p.users)]
    return BoundShape(tuple(boundaries), residual, tuple(attention), tuple(tied))


def bound_at(gm: fx.GraphModule, seq: SeqInfo, static_bytes: int,
             offload: bool = False) -> Optional[Callable[[int], Bound]]:
    """The bound of a graph captured with a symbolic length, as a function of the length (None
    without transformer blocks or a sequence symbol); `static_bytes`: what the setup holds;
    `offload`: plans may keep checkpoints in host memory."""
    shape = bound_shape(gm, find_regions(gm, seq), seq) if seq.symbol is not None else None
    if shape is None:
        return None
    return lambda S: Bound(S, static_bytes, shape.parts(Sizer(seq, S), offload), offload)
