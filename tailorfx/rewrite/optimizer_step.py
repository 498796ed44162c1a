"""Optimizer in backward, inside the compiled backward graph.

A compiled backward graph returns every gradient at once, so hooks that fire after it would see
all gradients alive together. Instead, right after a parameter's gradient is final *and* the last
read of that parameter (or a view of it saved from forward) in the backward graph, a call to
`runtime.optim.grad_ready` updates the parameter and the graph returns None for it:

    mm_3 = mm(t_5, view_2)                 mm_3 = mm(t_5, view_2)
    mm_4 = mm(permute_3, tangents_1)  -->  mm_4 = mm(permute_3, tangents_1)   # last read of the weight
    return (None, mm_3, ...)               ready_0 = grad_ready(7, 0, mm_3)     # frees mm_3
                                           return (None, ready_0, ...)

The update is in place, so it must come after every read of the weight in this graph; a
parameter read by several graphs (tied weights across a graph break) is left to autograd, which
sums its gradients first (grad_ready returns it).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite.capture import node_value


def aliases_input(node: fx.Node) -> bool:
    """An ATen op whose output shares its input's storage (a view or an in-place op)."""
    t = node.target
    return compat.op_returns_alias(t)


def storage_root(node: fx.Node) -> fx.Node:
    """Follow view ops back to the tensor whose storage `node` shares."""
    while node.op == "call_function" and aliases_input(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _outputs(g: fx.GraphModule) -> tuple[fx.Node, list]:
    out = next(n for n in reversed(g.graph.nodes) if n.op == "output")
    vals = out.args[0]
    return out, list(vals) if isinstance(vals, (list, tuple)) else [vals]


def _num_placeholders(nodes: list) -> int:
    return sum(1 for n in nodes if n.op == "placeholder")


RNG_STATE_INPUT = "fwd_rng_state_"


def forward_inputs(fw: fx.GraphModule) -> list[fx.Node]:
    """The placeholders of AOTAutograd's forward that stand for the Dynamo graph's inputs, in order.
    On CUDA its partitioner appends to them one generator (`fwd_rng_state_<i>`) per recomputed op
    that draws random numbers (SDPA's flash kernel is one: full recompute of an attention block)."""
    return [n for n in fw.graph.nodes if n.op == "placeholder" and not n.name.startswith(RNG_STATE_INPUT)]


def fuse_into_backward(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                       trainable: Sequence[bool], handle: int) -> int:
    """Rewrite `bw` in place (and recompile it): one grad_ready per trainable input's gradient.

    `trainable[i]`: forward placeholder i is a parameter being trained (bw output i is its
    gradient). Returns the number of gradients handed over; 0 when the graphs do not line up.
    """
    from tailorfx.runtime.optim import grad_ready
    fw_ph = forward_inputs(fw)   # one backward output each
    out, grads = _outputs(bw)
    if len(grads) != len(fw_ph) or len(trainable) != len(fw_ph):
        return 0
    slot_of = {n: i for i, n in enumerate(fw_ph)}
    _, fw_outs = _outputs(fw)
    saved_slot = {}   # name of a saved forward output -> the input slot whose storage it shares
    for o in fw_outs[num_fwd_outputs:]:
        if isinstance(o, fx.Node) and storage_root(o) in slot_of:
            saved_slot[o.name] = slot_of[storage_root(o)]
    nodes = list(bw.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    reads: dict[int, int] = {}     # slot -> index of the last node reading its weight
    alias: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder" and n.name in saved_slot:
            alias[n] = saved_slot[n.name]
        elif n.op == "call_function" and aliases_input(n) and n.args and n.args[0] in alias:
            alias[n] = alias[n.args[0]]
        for a in n.all_input_nodes:
            if a in alias and n is not out:
                reads[alias[a]] = max(reads.get(alias[a], -1), index[n])
    count = 0
    new_outs = list(grads)
    for slot, g in enumerate(grads):
        if not (trainable[slot] and isinstance(g, fx.Node) and isinstance(node_value(g), torch.Tensor)):
            continue
        after = nodes[max(index[g], reads.get(slot, -1), _num_placeholders(nodes) - 1)]
        with bw.graph.inserting_after(after):
            ready = bw.graph.call_function(grad_ready, (handle, slot, g))
        ready.meta["val"] = None
        ready.meta["tailorfx_pass"] = "optimizer_in_backward"
        new_outs[slot] = ready
        count += 1
    out.args = (tuple(new_outs),)
    bw.graph.lint()
    bw.recompile()
    return count
