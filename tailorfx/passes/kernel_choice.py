"""The region's own code or the runtime's Triton kernel, per region, by measurement: under
`kernels="triton"` on a GPU, a norm, gated activation or rotary region is timed both ways (forward
and backward, on random tensors of its shapes) the first time its key is seen: against the code
Inductor compiles for it under the Inductor lowering, against its ATen ops as captured under the
eager lowering. Where its own code is faster it is left as it was; the report lists it among the
regions left unchanged, with the key. The choice is kept with the attention tiles' (kernels/tuning.py).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite.capture import node_value

TIMED = ("norm", "glu", "rope")   # kernels whose region's own code may be the faster: small, memory-bound
LEFT_TO = {"inductor": "left to Inductor: its own code was measured faster",
           "eager": "left as its ATen ops: they were measured faster than the Triton kernel"}
TIMED_ON = ("cuda",)              # device types a choice is timed on
TIMER: Optional[Callable] = None  # timer(fn) -> ms; None: triton.testing.do_bench


def subgraph(inputs: list[fx.Node], outputs: list[fx.Node], within: Optional[set] = None) -> Optional[fx.GraphModule]:
    """The nodes between `inputs` and `outputs` as a graph f(*inputs) -> tuple of outputs, or None
    when they read anything else (a parameter, another graph input, a node not `within` a region)."""
    need: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in need or n in inputs:
            continue
        if n.op not in ("call_function", "call_method") or (within is not None and n not in within):
            return None
        need.add(n)
        stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env = {n: g.placeholder(f"in_{i}") for i, n in enumerate(inputs)}
    for n in outputs[0].graph.nodes:
        if n in need:
            env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def _key(swap, values: list[torch.Tensor], lowering: str) -> str:
    from tailorfx.kernels.flash_tiles import arch_of
    device = values[0].device
    where = f"sm{arch_of(device)}" if device.type == "cuda" else device.type
    shapes = " ".join(f"{tuple(compat.size_hint(d) for d in v.shape)}:{str(v.dtype).removeprefix('torch.')}"
                      for v in values)
    options = ",".join(f"{k}={v}" for k, v in sorted(swap.kwargs.items()))
    return f"kernels.{swap.kernel} {where} {options} {shapes} vs {lowering}"


def _runs(swap, fn: fx.GraphModule, inputs: list[fx.Node], values: list[torch.Tensor], lowering: str) -> dict:
    """Both implementations of the region, forward and backward, on random tensors of its shapes:
    the Triton op, and the region's nodes as `lowering` runs them."""
    xs = [torch.randn(tuple(compat.size_hint(d) for d in v.shape), dtype=v.dtype, device=v.device)
          .requires_grad_(bool(v.requires_grad)) for v in values]
    wrt = [x for x in xs if x.requires_grad]
    args = [xs[inputs.index(a)] if isinstance(a, fx.Node) else a for a in swap.args]
    # a function, not the module: inside a capture a nested torch.compile of a module compiles no frame
    own = torch.compile(lambda *a: fn(*a), fullgraph=True, dynamic=False) if lowering == "inductor" else fn

    def step(outs):
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        if wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs])

    def triton():
        step(swap.fn(*args, **swap.kwargs))

    def region():
        step(own(*xs))
    region.__name__ = lowering
    return {"triton": triton, lowering: region}


def own_code_wins(swap, lowering: Optional[str]) -> Optional[str]:
    """Why this swap is not made (the region's own code, Inductor's or its ATen ops as the lowering
    runs it, measured faster at its key), or None: the swap is made (not timed: no GPU,
    TAILORFX_AUTOTUNE=0, a region that cannot be cut out on its own; or the Triton kernel measured
    faster)."""
    from tailorfx.kernels import tuning
    if lowering not in LEFT_TO or swap.kernel not in TIMED or not tuning.enabled():
        return None
    inputs = [a for a in swap.args if isinstance(a, fx.Node)]
    values = [node_value(a) for a in inputs]
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    device = values[0].device.type
    if device not in TIMED_ON or (device == "cuda" and not torch.cuda.is_available()):
        return None
    fn = subgraph(inputs, [swap.out, *swap.more])
    if fn is None:
        return None
    key = _key(swap, values, lowering)
    got = tuning.pick_apart(key, ("triton", lowering), lambda: _runs(swap, fn, inputs, values, lowering), TIMER)
    return f"{LEFT_TO[lowering]} ({key})" if got == lowering else None
