"""Logits-like outputs leave the compiled graph detached; their gradient path is rebuilt on demand.

A training graph of a Hugging Face causal LM returns its loss *and* the logits. AOTAutograd makes
every differentiable output an input of the backward: when the caller backpropagates the loss
only, autograd hands the backward a zero gradient for the logits (S x V) and the backward adds it
in, one logits-sized tensor more than eager. Here such an output is returned detached, with the
input of its head chain (`linear(h, W)` followed by casts, views, a scale or a soft-cap) as an
extra output; the lowering reattaches the gradient path with an autograd node that costs nothing
unless a gradient reaches it, and then recomputes the chain (runtime/lazy_grad.py). Exact.
Other such outputs (the KV cache a model returns in training) are recomputed from the graph's
inputs when a gradient reaches them, so they need no extra output.

    before:  return (loss, logits)                  logits = linear(h, W) ... (also feeds the loss)
    after:   return (loss, logits.detach(), h)      run time: logits = lazy_vjp(chain, logits, h, W)

Only graphs that also return a scalar loss are split: without one the output's gradient is the
whole point, and recomputing its chain would only cost time.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import clone
from tailorfx.rewrite.regions import is_param, param_source

# Ops a head chain may contain after its linear: each has exactly one tensor input that needs a
# gradient (scalars and parameters aside) and is cheap to recompute.
_CHAIN_OPS = frozenset({"float", "to", "type", "contiguous", "view", "reshape", "mul", "truediv", "div",
                        "tanh", "getitem", "redistribute", "to_local"})
_MAX_CHAIN = 12
META = "tailorfx_lazy_output"


class Chain:
    """([anchor,] *graph inputs) -> a lazy output: the graph's nodes that compute it, made into a
    GraphModule the first time it runs (a gradient reached the output). A KV cache's chain reaches
    back to the inputs: built up front, 2 x layers modules of O(layers) nodes each, that training
    rarely runs, were most of a deep model's lowering."""

    def __init__(self, gm: fx.GraphModule, anchor: Optional[fx.Node], params: list[fx.Node],
                 members: list[fx.Node], out: fx.Node):
        self._source = (gm, anchor, params, members, out)
        self._module: Optional[fx.GraphModule] = None

    @property
    def module(self) -> fx.GraphModule:
        if self._module is None:
            self._module = _build(*self._source)
        return self._module

    def __call__(self, *args):
        return self.module(*args)


@dataclass(frozen=True)
class LazyOutput:
    """One output returned detached: `chain(anchor, *graph inputs)` recomputes it."""
    index: int                       # position among the graph's outputs
    anchor_index: Optional[int]      # position of the chain's input among the split graph's outputs
    chain: Chain                     # ([anchor,] *inputs) -> the output
    input_indices: tuple[int, ...]   # placeholder positions of the chain's other inputs


@dataclass(frozen=True)
class Split:
    gm: fx.GraphModule
    lazy: tuple[LazyOutput, ...] = ()
    num_outputs: int = 0             # outputs of the original graph


def _requires_grad(n) -> bool:
    v = node_value(n) if isinstance(n, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.requires_grad


def _numel_is_one(v: torch.Tensor) -> bool:
    e = compat.sym_expr(v.numel())
    return bool(e.is_Integer) and int(e) == 1


def _head_chain(out: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """(anchor, members in graph order) when `out` is linear(anchor, W[, b]) then chain ops."""
    members, cur = [], out
    for _ in range(_MAX_CHAIN):
        if cur.op not in ("call_function", "call_method"):
            return None
        name = match.op_name(cur)
        if name == "linear" and cur.op == "call_function":
            a = cur.args[0]
            w = cur.args[1] if len(cur.args) > 1 else cur.kwargs.get("weight")
            b = cur.args[2] if len(cur.args) > 2 else cur.kwargs.get("bias")
            if not (isinstance(a, fx.Node) and _requires_grad(a) and isinstance(w, fx.Node)
                    and is_param(w, through_casts=True)):
                return None
            if b is not None and not (isinstance(b, fx.Node) and is_param(b, through_casts=True)):
                return None
            members.append(cur)
            for p in (w, b):   # a low-precision copy W.to(bf16) is recomputed with the chain
                while isinstance(p, fx.Node) and p.op != "placeholder" and p is not param_source(p):
                    members.append(p)
                    p = p.args[0]
            return a, members[::-1]
        if name not in _CHAIN_OPS:
            return None
        grad_inputs = [a for a in cur.all_input_nodes if _requires_grad(a)]
        if len(grad_inputs) != 1 or any(isinstance(node_value(a), torch.Tensor) and a not in grad_inputs
                                         and not is_param(a) for a in cur.all_input_nodes):
            return None
        members.append(cur)
        cur = grad_inputs[0]
    return None


def _unread(out: fx.Node) -> bool:
    """Whether the nodes of `out`'s head chain are read only by each other and the output."""
    chain = _head_chain(out)
    members = set(chain[1]) if chain else set()
    return bool(members) and all(u in members or u.op == "output" for n in members for u in n.users)


def _prefix_chain(out: fx.Node) -> Optional[list[fx.Node]]:
    """Everything `out` is computed from, back to the graph inputs (a KV-cache output), unless a
    random op is among it (a recompute would draw other values)."""
    members, todo, seen = [], [out], set()
    while todo:
        n = todo.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method") or match.draws_random(n):
            return None
        members.append(n)
        todo.extend(n.all_input_nodes)
    return members



def _extract(gm: fx.GraphModule, anchor: Optional[fx.Node], members: list[fx.Node], out: fx.Node):
    """The chain ([anchor,] *graph inputs) -> out, built when first run, with the graph inputs'
    positions; None if it reads a value other than the anchor and graph inputs (with an anchor,
    parameters only)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    members = sorted(set(members), key=order.__getitem__)
    member_set = set(members)
    params = []
    for n in members:
        for a in n.all_input_nodes:
            if a is anchor or a in member_set:
                continue
            if a.op != "placeholder" or (anchor is not None and not is_param(a)):
                return None
            if a not in params:
                params.append(a)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return Chain(gm, anchor, params, members, out), tuple(placeholders.index(p) for p in params)


def _build(gm: fx.GraphModule, anchor: Optional[fx.Node], params: list[fx.Node], members: list[fx.Node],
           out: fx.Node) -> fx.GraphModule:
    """A Chain's module, copied from `gm`'s nodes (the lowering compiles a copy of `gm`: these stay)."""
    alive = set(gm.graph.nodes)
    if any(n not in alive for n in (*members, *params)):
        raise RuntimeError(f"the graph of the lazy output {out.name} changed after it was split: its chain "
                           "cannot be rebuilt (split_lazy_outputs must see the graph that is lowered)")
    g = fx.Graph()
    env = {anchor: g.placeholder("anchor")} if anchor is not None else {}
    for i, p in enumerate(params):
        env[p] = g.placeholder(f"input_{i}")
    for n in members:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    sub = fx.GraphModule(gm, g)
    sub.meta = {}
    return sub


def split_lazy_outputs(gm: fx.GraphModule) -> Split:
    """A copy of `gm` whose logits-like outputs are detached, or `gm` itself when none qualifies.
    Their recompute chains are built when first run (Chain)."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)):
        return Split(gm, (), 1)
    has_loss = any(isinstance(o, fx.Node) and _requires_grad(o) and _numel_is_one(node_value(o)) for o in outs)
    if not has_loss:
        return Split(gm, (), len(outs))
    found = []
    for i, o in enumerate(outs):
        if not (isinstance(o, fx.Node) and _requires_grad(o)) or _numel_is_one(node_value(o)):
            continue
        chain = _head_chain(o)
        extracted = _extract(gm, chain[0], chain[1], o) if chain else None
        if extracted is not None:
            found.append((i, o, chain[0], *extracted))
        elif (prefix := _prefix_chain(o)) is not None and (extracted := _extract(gm, None, prefix, o)):
            found.append((i, o, None, *extracted))
    # a tensor subclass output (a DTensor's logits in a tensor-parallel graph traced for the memory
    # model) only when nothing else reads its chain (a loss fused from the head's input): eager
    # autograd then never computes its gradient; logits that feed DTensor's loss_parallel are kept
    found = [f for f in found if hasattr(node_value(f[1]), "fake_mode") or _unread(f[1])]
    if not found:
        return Split(gm, (), len(outs))
    new = clone(gm)
    by_name = {n.name: n for n in new.graph.nodes}
    new_out = next(n for n in reversed(new.graph.nodes) if n.op == "output")
    values = list(new_out.args[0])
    anchors: list[str] = []
    held: list[str] = []
    lazy = []
    for i, o, anchor, chain, param_idx in found:
        node = by_name[o.name]
        with new.graph.inserting_before(new_out):
            det = new.graph.call_method("detach", (node,))
        v = node_value(node)
        # a DTensor's logits (a tensor-parallel graph traced for the memory model) detach through
        # their fake local tensor's own mode
        with getattr(v, "fake_mode", None) or contextlib.nullcontext():
            det.meta["val"] = det.meta["example_value"] = v.detach()
        det.meta[META] = True
        values[i] = det
        if anchor is not None and anchor.name not in anchors:
            anchors.append(anchor.name)
        if not hasattr(v, "fake_mode"):
            # eager autograd keeps what the chain's ops save (tanh its output) while the caller
            # holds the logits: returned too, so the memory model holds them as long
            held += [n.name for n in _head_chain(o)[1] if match.op_name(n) == "tanh" and n.name not in held]
        anchor_index = len(outs) + anchors.index(anchor.name) if anchor is not None else None
        lazy.append(LazyOutput(i, anchor_index, chain, param_idx))
    values += [by_name[a] for a in anchors]
    for name in held:    # detached: no gradient flows into them
        with new.graph.inserting_before(new_out):
            det = new.graph.call_method("detach", (by_name[name],))
        det.meta["val"] = det.meta["example_value"] = node_value(by_name[name]).detach()
        values.append(det)
    new_out.args = (tuple(values),)
    new.recompile()
    return Split(new, tuple(lazy), len(outs))
