"""Saved tensors rerouted between a partitioned forward and backward: each chosen one leaves the
forward through an op and is read back in the backward through another (saved_dtype.py: a cast
down and back up; offload.py: a copy to host memory and back to the device)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch.fx as fx

from tailorfx.rewrite.capture import node_value


class Route(NamedTuple):
    """How one saved tensor crosses: `forward(saved, *forward_args)`, inserted after `after` (None:
    just before the forward's output), crosses instead of it; the backward's readers read
    `backward(placeholder, *backward_args)`, inserted before the first of them."""
    after: Optional[fx.Node]
    forward: Any
    forward_args: tuple
    forward_value: Any                # the crossing value's fake (the placeholder's new value)
    backward: Any
    backward_args: tuple = ()


def reroute_saved(fw: fx.GraphModule, bw: Optional[fx.GraphModule], num_fwd_outputs: int,
                  route: Callable[[fx.Node], Optional[Route]]) -> int:
    """Rewrite `fw` and `bw` in place (and recompile them): each saved tensor the backward reads
    crosses as `route(saved)` says (None: as it is). Returns how many were rerouted."""
    if bw is None:
        return 0
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    bw_ph = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    count = 0
    for i in range(num_fwd_outputs, len(outs)):
        o = outs[i]
        ph = bw_ph.get(o.name) if isinstance(o, fx.Node) else None
        r = route(o) if ph is not None and ph.users else None
        if r is None:
            continue
        with fw.graph.inserting_after(r.after) if r.after is not None else fw.graph.inserting_before(out):
            crossing = fw.graph.call_function(r.forward, (o, *r.forward_args))
        crossing.meta["val"] = r.forward_value
        outs[i] = crossing
        with bw.graph.inserting_before(min(ph.users, key=order.__getitem__)):
            back = bw.graph.call_function(r.backward, (ph, *r.backward_args))
        ph.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        back.meta["val"] = node_value(ph)
        ph.meta["val"] = r.forward_value
        count += 1
    if count:
        out.args = (tuple(outs),)
        for g in (fw, bw):
            g.graph.lint()
            g.recompile()
    return count
