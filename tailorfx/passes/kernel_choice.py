"""The region's own code, torch's fused kernel, Inductor's code for it or the runtime's Triton
kernel, per region, by measurement: under `kernels="triton"` on a GPU, a norm, gated activation,
rotary or attention region is timed each way (forward and backward, on random tensors of its
shapes, where those take under a quarter of the free memory) the first time its key is seen:
against the code Inductor compiles for it under the Inductor lowering, against its ATen ops as
captured under the eager lowering (an attention's: SDPA's flash kernel). Under the eager lowering a
norm, gated activation or rotary region is also timed as Inductor compiles it alone
(runtime/inductor_region.py: one opaque op each way, the backward recomputing the forward), and a
norm on torch's fused kernel (runtime/triton_ops.torch_norm: F.rms_norm, F.layer_norm). Where its
own code is fastest it is left as it was; the report lists it among the regions left unchanged,
with the key. Where torch's fused kernel or Inductor's code is, the region is lowered to it; the
report counts it as `torch_norm` or `inductor_region`. The choice is kept with the attention
tiles' (kernels/tuning.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite.capture import node_value

# kernels whose region's own code may be the faster: the small, memory-bound ones, and attention
# (its own code: SDPA's flash kernel where the form has no mask SDPA cannot take)
TIMED = ("norm", "glu", "rope", "flash_attention")
LEFT_TO = {"inductor": "left to Inductor: its own code was measured faster",
           "eager": "left as its ATen ops: they were measured the fastest"}
TIMED_ON = ("cuda",)              # device types a choice is timed on
FUSED = "torch"                   # a norm on torch's fused kernel (under the eager lowering)
COMPILED = "inductor"             # a region as Inductor compiles it alone (under the eager lowering)
COMPILED_KINDS = ("norm", "glu", "rope")
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


def _key(swap, values: list[torch.Tensor], names: tuple) -> str:
    from tailorfx.kernels.tuning import arch_of
    device = values[0].device
    where = f"sm{arch_of(device)}" if device.type == "cuda" else device.type
    shapes = " ".join(f"{_hinted(v)}:{str(v.dtype).removeprefix('torch.')}"
                      for v in values)
    options = ",".join(f"{k}={v}" for k, v in sorted(swap.kwargs.items()))
    return f"kernels.{swap.kernel} {where} {options} {shapes} vs {'+'.join(n for n in names if n != 'triton')}"


def _runs(swap, fn: fx.GraphModule, inputs: list[fx.Node], values: list[torch.Tensor], lowering: str,
          fused: Optional[Callable], compiled: Optional[object]) -> dict:
    """Each implementation of the region, forward and backward, on random tensors of its shapes:
    the Triton op, torch's fused kernel (`fused`, a norm's), Inductor's code for it (`compiled`, a
    swap) and the region's nodes as `lowering` runs them."""
    xs = [torch.randn(_hinted(v), dtype=v.dtype, device=v.device).requires_grad_(bool(v.requires_grad))
          if v.is_floating_point() else torch.zeros(_hinted(v), dtype=v.dtype, device=v.device) for v in values]
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

    def torch_fused():
        step(fused(*args, **swap.kwargs))

    def inductor():
        step(compiled.fn(*compiled.args[:1], *xs))

    def region():
        step(own(*xs))
    region.__name__, torch_fused.__name__, inductor.__name__ = lowering, FUSED, COMPILED
    return {"triton": triton, **({FUSED: torch_fused} if fused is not None else {}),
            **({COMPILED: inductor} if compiled is not None else {}), lowering: region}


def _compiled_of(swap, fn: fx.GraphModule, inputs: list[fx.Node], values: list[torch.Tensor],
                 lowering: str) -> Optional[object]:
    """The swap running the region as Inductor compiles it alone, under the eager lowering (the
    Inductor lowering compiles it with the rest of the graph)."""
    if lowering != "eager" or swap.kernel not in COMPILED_KINDS:
        return None
    from tailorfx.runtime.inductor_region import inductor_region, register
    key = register(fn, tuple(bool(v.requires_grad) and v.is_floating_point() for v in values))
    return dataclasses.replace(swap, fn=inductor_region, args=(key, *inputs), kwargs={}, kernel="inductor_region")


def _fused_of(swap, values: list[torch.Tensor], lowering: str) -> Optional[Callable]:
    """torch's fused kernel for a norm region under the eager lowering (Inductor fuses its own),
    where it computes what the Triton kernel does: weight and bias in x's dtype, no weight offset."""
    if lowering != "eager" or swap.kernel != "norm" or swap.kwargs.get("offset"):
        return None
    if any(v.dtype != values[0].dtype for v in values):
        return None
    from tailorfx.runtime.triton_ops import torch_norm
    return torch_norm


def _room(values: list[torch.Tensor]) -> bool:
    """Whether timing at these shapes (inputs, their gradients, outputs and theirs: four times the
    inputs' bytes) leaves the GPU room (tuning.room_to_time)."""
    from tailorfx.kernels.tuning import room_to_time
    return room_to_time(4 * sum(math.prod(_hinted(v)) * v.element_size() for v in values), values[0].device)


def _hinted(v: torch.Tensor) -> tuple[int, ...]:
    return tuple(compat.size_hint(d) for d in v.shape)   # a traced length, read without a guard


def choose(swap, lowering: Optional[str]) -> tuple[Optional[object], Optional[str]]:
    """(the swap to make, or None; why not, for the report): the Triton swap as it is (not timed:
    no GPU, TAILORFX_AUTOTUNE=0, a region that cannot be cut out on its own; or the Triton kernel
    measured the fastest), the norm on torch's fused kernel or the region on Inductor's code alone
    where that was, or None where the region's own code (Inductor's, or its ATen ops as the
    lowering runs them) was."""
    from tailorfx.kernels import tuning
    if lowering not in LEFT_TO or swap.kernel not in TIMED or not tuning.enabled():
        return swap, None
    inputs = [a for a in swap.args if isinstance(a, fx.Node)]
    values = [node_value(a) for a in inputs]
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return swap, None
    device = values[0].device.type
    if device not in TIMED_ON or (device == "cuda" and not (torch.cuda.is_available() and _room(values))):
        return swap, None
    fn = subgraph(inputs, [swap.out, *swap.more])
    if fn is None:
        return swap, None
    fused = _fused_of(swap, values, lowering)
    compiled = _compiled_of(swap, fn, inputs, values, lowering)
    names = ("triton", *((FUSED,) if fused is not None else ()), *((COMPILED,) if compiled is not None else ()),
             lowering)
    key = _key(swap, values, names)
    try:
        got = tuning.pick_apart(key, names, lambda: _runs(swap, fn, inputs, values, lowering, fused, compiled),
                                TIMER)
    except RuntimeError:   # no implementation ran at this shape here: the swap, untimed, as without a GPU
        return swap, None
    if got == lowering:
        return None, f"{LEFT_TO[lowering]} ({key})"
    if got == FUSED:
        return dataclasses.replace(swap, fn=fused, kernel="torch_norm"), None
    if got == COMPILED:
        return compiled, None
    return swap, None
