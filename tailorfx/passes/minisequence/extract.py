"""A region cut out of the graph as its own GraphModule, the function each chunk runs."""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite.capture import autocast_of, node_value
from tailorfx.runtime import ops


class Unsupported(Exception):
    """The region cannot be chunked; the message says why."""


def extract(gm: fx.GraphModule, members: list[fx.Node], inputs: list[fx.Node], out,
            seq_symbol, seq_dim: int, seq_hints: Optional[dict] = None) -> fx.GraphModule:
    """The region as its own GraphModule: f(x, *params) -> out (a tuple when `out` is a list).

    A size taken from outside (Dynamo passes the sequence length as a SymInt graph input; inputs
    of the same length, such as labels, may carry a symbol of their own) is re-read from the
    chunk, `x.size(seq_dim)`, so the region is correct on any chunk length. A region captured
    under torch.autocast enters it itself: the compiled graph around it runs with autocast off.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in_{i}")
        env[n].meta = dict(n.meta)
    member_set = set(members)
    amp = autocast_of(node_value(inputs[0])) if inputs else None
    entered = g.call_function(ops.enter_autocast, (env[inputs[0]], amp)) if amp is not None else None

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
                raise Unsupported(f"uses {a.name} from outside the region")
            env[a] = g.call_method("size", (env[inputs[0]], seq_dim if same_length else other[0]))
        return env[a]

    for n in members:
        env[n] = g.node_copy(n, arg)
        if n.target is torch.ops.higher_order.autograd_function_apply:
            env[n].target = ops.function_apply   # the same autograd.Function, without the HOP's leak
    if entered is not None:
        g.call_function(ops.exit_autocast, (entered,))
    g.output(tuple(env[o] for o in out) if isinstance(out, (list, tuple)) else env[out])
    sub = fx.GraphModule(gm, g)
    sub.meta = {}
    return sub
