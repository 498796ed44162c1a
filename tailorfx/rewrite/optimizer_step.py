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


def _tensor_of(node: fx.Node):
    """A tensor `node` computes (itself, or one of its outputs), None if it computes none."""
    if isinstance(node_value(node), torch.Tensor):
        return node
    return next((u for u in node.users if isinstance(node_value(u), torch.Tensor)), None)


_OWN_BUFFER = ("mm", "bmm", "addmm", "baddbmm", "convolution", "_scaled_dot_product", "_flash_attention",
               "_efficient_attention", "_cudnn_attention")


def _own_buffer(node: fx.Node) -> bool:
    """An op whose output Inductor always computes into a buffer of its own (an extern kernel or a
    custom op): what reads that output does not recompute the op's inputs."""
    t = node.target
    if not compat.is_op_overload(t):
        return node.op == "call_function" and t.__module__ != "_operator"
    return t.namespace not in ("aten", "prims") or compat.op_short_name(t).startswith(_OWN_BUFFER)


def _held_reads(readers: set, index: dict, at: int, out: fx.Node) -> list:
    """What Inductor must compute before an update of the weight inserted at position `at`: each
    op reading the weight, whose output then has a user there (Inductor's post-grad patterns would
    otherwise fuse it with a later op: `add(x, mm(y, w))` became an `addmm` after the update), and
    each value computed from the weight (what fuses with its readers) that a node at or after `at`
    reads. Inductor could otherwise inline that computation there, reading the updated weight: it
    realizes a mutated buffer's pending readers only after it has placed the mutating op."""
    seen: set = set()
    todo = [r for r in readers if index[r] < at]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if not _own_buffer(n):
            todo.extend(u for u in n.users if u in index and u is not out and index[u] < at)

    def read_later(n: fx.Node) -> bool:   # (a step put in for another weight is in no `index`: later)
        return any(u is out or index.get(u, at) >= at for u in n.users)
    return [_tensor_of(n) for n in sorted(seen, key=index.__getitem__)
            if n in readers or (not _own_buffer(n) and read_later(n))]


def _placed(readers: set, index: dict, at: int, out: fx.Node) -> tuple[int, list]:
    """(position, _held_reads) of an update inserted no earlier than `at`: after the last value it
    holds (a reader's output can come after the reader: a getitem)."""
    while True:
        deps = _held_reads(readers, index, at, out)
        late = max((index[d] for d in deps if d is not None), default=-1)
        if late < at:
            return at, deps
        at = late + 1


def is_step(node: fx.Node) -> bool:
    """A parameter's optimizer step that fuse_into_backward put in a backward graph (either form)."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") in ("grad_ready", "grad_ready.default")


def _outputs(g: fx.GraphModule) -> tuple[fx.Node, list]:
    out = next(n for n in reversed(g.graph.nodes) if n.op == "output")
    vals = out.args[0]
    return out, list(vals) if isinstance(vals, (list, tuple)) else [vals]


def _num_placeholders(nodes: list) -> int:
    return sum(1 for n in nodes if n.op == "placeholder")


RNG_STATE_INPUT = "fwd_rng_state_"
STEPS_NOT_FUSED = ("tailorfx: the optimizer steps could not be put inside the backward graph (its inputs do not "
                   "line up with the captured graph's); they run from hooks after it, every gradient alive at its "
                   "end, more than the memory model predicts")


def forward_inputs(fw: fx.GraphModule) -> list[fx.Node]:
    """The placeholders of AOTAutograd's forward that stand for the Dynamo graph's inputs, in order.
    On CUDA its partitioner appends to them one generator (`fwd_rng_state_<i>`) per recomputed op
    that draws random numbers (SDPA's flash kernel is one: full recompute of an attention block)."""
    return [n for n in fw.graph.nodes if n.op == "placeholder" and not n.name.startswith(RNG_STATE_INPUT)]


def fuse_into_backward(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                       trainable: Sequence[bool], handle: int, op: bool = False) -> int:
    """Rewrite `bw` in place (and recompile it): one grad_ready per trainable input's gradient.

    `trainable[i]`: forward placeholder i is a parameter being trained (bw output i is its
    gradient). `op`: for Inductor, the `tailorfx::grad_ready` op (it returns nothing, and the
    graph returns None for the gradient). It is declared to write the weight's inputs to the
    backward, so that Inductor's schedule runs every kernel reading them first, and it takes the
    values computed from the weight that later nodes read (_held_reads), so that no later kernel
    recomputes one from the updated weight. Returns the number of gradients handed over; 0 when
    the graphs do not line up.
    """
    from tailorfx.runtime.optim import GRAD_READY_OP, grad_ready
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
    readers: dict[int, set] = {}   # slot -> the nodes computing from its weight (not views of it)
    inputs_of: dict[int, list] = {}   # slot -> the backward's inputs sharing its weight's storage
    for n in nodes:
        if n.op == "placeholder" and n.name in saved_slot:
            alias[n] = saved_slot[n.name]
            inputs_of.setdefault(alias[n], []).append(n)
        elif n.op == "call_function" and aliases_input(n) and n.args and n.args[0] in alias:
            alias[n] = alias[n.args[0]]
        for a in n.all_input_nodes:
            if a in alias and n is not out:
                reads[alias[a]] = max(reads.get(alias[a], -1), index[n])
                if n not in alias:
                    readers.setdefault(alias[a], set()).add(n)
    count = 0
    new_outs = list(grads)
    for slot, g in enumerate(grads):
        if not (trainable[slot] and isinstance(g, fx.Node) and isinstance(node_value(g), torch.Tensor)):
            continue
        at, deps = max(index[g], reads.get(slot, -1), _num_placeholders(nodes) - 1) + 1, []
        if op:
            at, deps = _placed(readers.get(slot, set()), index, at, out)
            if any(d is None for d in deps):
                continue   # a read Inductor could move past the update: the gradient goes back to autograd
        with bw.graph.inserting_after(nodes[at - 1]):
            ready = bw.graph.call_function(GRAD_READY_OP, (handle, slot, g, deps, inputs_of.get(slot, []))) if op \
                else bw.graph.call_function(grad_ready, (handle, slot, g))
        ready.meta["val"] = None
        ready.meta["tailorfx_pass"] = "optimizer_in_backward"
        new_outs[slot] = None if op else ready
        count += 1
    out.args = (tuple(new_outs),)
    bw.graph.lint()
    bw.recompile()
    return count
