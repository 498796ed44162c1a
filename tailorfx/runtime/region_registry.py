"""The regions the chunked ops run, by key: a custom op's schema holds a string, not a function,
so a rewritten graph registers each region it calls here and owns it (the index is weak: a region
lives exactly as long as a graph that can run it). Also `function_apply`, how a region's traced
autograd.Function runs eagerly inside a chunk.
"""
from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
from torch import Tensor

__all__ = ["ChunkedRegion", "register_region", "chunked_region", "live_region", "get_region", "function_apply",
           "enter_autocast", "exit_autocast"]


@dataclass(eq=False)
class ChunkedRegion:
    """A region ``fn(*seq_inputs, *whole_inputs) -> Tensor`` that token_chunked runs by key, with
    what the memory model and the backward need to know about it. The rewritten graph that calls
    it owns it (rewrite.passes.own): it lives exactly as long as a graph that can run it.

    `cost`: the bytes a chunk holds inside the op, so the memory model sees the transients: in
    forward per token of the chunk; in backward as lines ((per token, constant, first token), ...),
    a chunk of t tokens holding the last line whose first token is at most t
    (passes/minisequence/cost.py). `tail`: (pre, weight
    index, bias index or -1) when the region is
    ``F.linear(pre(*inputs), whole[weight_index], whole[bias_index])``: backward then recomputes
    only `pre`, not the last matmul whose output it never needs. `heads`: (core, ((seq input
    index, weight index, bias index or -1), ...)) when `pre` starts with linears of seq inputs by
    its own weights, `core(*seq_inputs, *whole_inputs, *their outputs)` the rest: backward then
    sums those weights' gradients in place (kernels/weight_grad.py), not through autograd.
    """
    key: str
    fn: Callable[..., Tensor]
    cost: tuple[float, tuple] = (0.0, ((0.0, 0.0),))
    tail: Optional[tuple[Callable[..., Tensor], int, int]] = None
    heads: Optional[tuple[Callable[..., Tensor], tuple[tuple[int, int, int], ...]]] = None


# The only module-level state: a weak index, key -> the live region of that key, owned elsewhere
# (by the graphs that call it). Graphs store keys, stable strings, because custom ops cannot take
# callables as arguments.
_INDEX: "weakref.WeakValueDictionary[str, ChunkedRegion]" = weakref.WeakValueDictionary()


def register_region(fn: Callable[..., Tensor], key: Optional[str] = None) -> ChunkedRegion:
    """The live region of ``fn`` under ``key``: the caller must hold it (a graph owns it) for the
    key to stay registered.

    Without ``key``, a GraphModule gets a content hash of its code and tensor attributes. Equal
    hashes mean equal functions, so an equal region already live is returned as it is: every graph
    that calls the key then holds the same object, and the key stays registered while any of them
    lives. Other callables need ``key``.
    """
    if key is None:
        if not isinstance(fn, torch.fx.GraphModule):
            raise TypeError("register_region: pass key= for callables that are not GraphModules")
        key = "region_" + _graph_module_hash(fn)
        region = _INDEX.get(key)
    else:
        region = _INDEX.get(key)
        if region is not None and region.fn is not fn:
            raise ValueError(f"register_region: key {key!r} already names a different region")
    if region is None:
        region = _INDEX[key] = ChunkedRegion(key, fn)
    return region


def chunked_region(key: str) -> ChunkedRegion:
    """The live region of `key`; a KeyError names the missing key."""
    region = _INDEX.get(key)
    if region is None:
        raise KeyError(f"tailorfx region {key!r} is not registered in this process (no live graph "
                       "owns it)")
    return region


def live_region(key: str) -> Optional[ChunkedRegion]:
    """The live region of `key`, or None when no graph owns one."""
    return _INDEX.get(key)


def get_region(key: str) -> Callable[..., Tensor]:
    """The function of a registered region; a KeyError names the missing key."""
    return chunked_region(key).fn


def _graph_module_hash(gm: torch.fx.GraphModule) -> str:
    # Comment lines carry provenance (source file/line), which must not split equal regions.
    code = "\n".join(ln for ln in gm.code.splitlines() if not ln.lstrip().startswith("#"))
    h = hashlib.sha256(code.encode())
    # The recorded shapes too: the same code at other sizes (another model, another capture) has
    # other costs and FLOPs, which are read from this graph's metadata and set per key.
    for n in gm.graph.nodes:
        v = n.meta.get("val", n.meta.get("example_value"))
        if isinstance(v, torch.Tensor):
            h.update(f"{n.name}:{tuple(v.shape)}:{v.dtype}".encode())
    # Tensor attributes (get_attr constants) are part of the function, not of its code.
    for name, t in sorted([*gm.named_parameters(), *gm.named_buffers()], key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


class _FunctionApply(torch.autograd.Function):
    """An autograd.Function traced by Dynamo (fwd and bwd bodies), run eagerly: what
    torch.ops.higher_order.autograd_function_apply does, without its per-call class whose
    closure keeps the saved values alive until the garbage collector runs (a region chunk's
    activations outliving the chunk: measured +1 MiB per chunk of Bloom's GeLU)."""

    @staticmethod
    def forward(ctx, fwd, bwd, non_differentiable_idx, *args):
        output, saved = fwd(*args)
        ctx.bwd, ctx.saved = bwd, saved
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if i in non_differentiable_idx))
        return output

    @staticmethod
    def backward(ctx, *grads):
        got = ctx.bwd(*grads, *ctx.saved)
        return (None, None, None, *(got if isinstance(got, (tuple, list)) else (got,)))


def function_apply(fwd: fx.GraphModule, bwd: fx.GraphModule, *args, non_differentiable_idx=(), **_kwargs):
    """torch.ops.higher_order.autograd_function_apply for regions run eagerly (see _FunctionApply)."""
    return _FunctionApply.apply(fwd, bwd, tuple(non_differentiable_idx), *args)


@fx.node.has_side_effect
def enter_autocast(x: Tensor, dtype: torch.dtype) -> torch.autocast:
    """torch.autocast to `dtype` on `x`'s device, entered where a region captured under it starts:
    the compiled graph that calls the region runs with autocast off (AOTAutograd put its casts in
    the graph), and a chunk's recompute in backward runs outside the caller's context. Its cache
    off: a weight's cast lives for its chunk, not in the caller's cache to the forward's end."""
    ctx = torch.autocast(x.device.type, dtype=dtype, cache_enabled=False)
    ctx.__enter__()
    return ctx


@fx.node.has_side_effect
def exit_autocast(ctx: torch.autocast) -> None:
    """Leave what enter_autocast entered, where the region ends."""
    ctx.__exit__(None, None, None)
