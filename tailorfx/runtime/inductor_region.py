"""A region of a graph run as Inductor compiles it, inside a graph that another lowering runs
(`kernels="triton"` under the eager lowering, where a norm, gated activation or rotary region was
measured fastest this way: passes/kernel_choice.py).

    tailorfx::inductor_region(key, xs) -> outputs            torch.compile(region)(*xs)
    tailorfx::inductor_region_backward(key, xs, grads) -> the inputs' gradients
                                                             torch.compile(vjp of region)(*xs, *grads)

The two ops are opaque to the capture and AOTAutograd: the graph around them keeps one node each
way. The backward saves only the region's inputs and recomputes its forward inside the one compiled
backward, where Inductor fuses it with the gradient's math (as Liger's kernels and the runtime's
Triton norm do). Each region form is registered once under a key made from its code, so the layers
of a model share one compiled forward and backward; torch.compile recompiles one per new shape.
"""
from __future__ import annotations

import hashlib
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch import Tensor

from tailorfx import compat


@dataclass
class Region:
    """A region's graph f(*xs) -> tuple of outputs, which inputs it is differentiated in, its
    compiled forward and backward (made at their first call), and its outputs' strides run eagerly,
    per input layout."""
    fn: fx.GraphModule
    wrt: tuple[bool, ...]
    compiled: dict = field(default_factory=dict)
    strides: dict = field(default_factory=dict)


_REGIONS: dict[str, Region] = {}


def register(fn: fx.GraphModule, wrt: tuple[bool, ...]) -> str:
    """The key of region `fn` differentiated in the inputs `wrt` marks (registered if new): the
    same for the same ops on the same constants, whatever the nodes are named (each layer's)."""
    key = hashlib.sha1(f"{_ops(fn)}\n{wrt}".encode()).hexdigest()[:16]
    if key not in _REGIONS:
        g = fx.Graph()
        env: dict = {}
        for n in fn.graph.nodes:   # a copy without the capture's fake values in its meta
            env[n] = g.node_copy(n, env.__getitem__)
            env[n].meta = {}
        _REGIONS[key] = Region(fx.GraphModule(fn, g), tuple(wrt))   # fn: the root its constants come from
    return key


def _ops(fn: fx.GraphModule) -> str:
    """The region's ops, their constants and how they connect, one line a node."""
    index: dict = {}
    lines = []
    for i, n in enumerate(fn.graph.nodes):
        index[n] = i
        target = n.target if isinstance(n.target, str) else \
            f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', n.target)}"
        if "<" in target:   # a lambda or a local function: its name says not which
            target += f"@{id(n.target)}"
        elif n.op == "get_attr":   # a constant of the graph: which one, not its name
            target += f"@{id(getattr(fn, n.target))}"
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        lines.append(f"{n.op} {target} {args}")
    return "\n".join(lines)


def _own_code(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: torch.compile keeps its caches and recompile limit per
    code object, and every region's forward (and backward) is the same Python function."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def _forward(r: Region, key: str) -> Callable:
    if "fw" not in r.compiled:
        fn = r.fn

        def forward(*xs):
            return fn(*xs)
        r.compiled["fw"] = torch.compile(_own_code(forward, f"region_{key}"), fullgraph=True)
    return r.compiled["fw"]


def _backward(r: Region, key: str) -> Callable:
    if "bw" not in r.compiled:
        fn, wrt, n = r.fn, r.wrt, len(r.wrt)

        def backward(*args):
            xs, grads = args[:n], args[n:]

            def differentiable(*d):
                it = iter(d)
                return fn(*(next(it) if w else x for x, w in zip(xs, wrt)))
            _, vjp = torch.func.vjp(differentiable, *(x for x, w in zip(xs, wrt) if w))
            return vjp(tuple(grads))
        r.compiled["bw"] = torch.compile(_own_code(backward, f"region_{key}_backward"), fullgraph=True)
    return r.compiled["bw"]


def _eager_strides(r: Region, xs: list[Tensor]) -> list[tuple]:
    """The strides of the region's outputs run eagerly on `xs` (what the fake kernel promised),
    found on fake tensors once per input layout."""
    sig = tuple((tuple(x.shape), x.stride(), x.dtype, x.device) for x in xs)
    got = r.strides.get(sig)
    if got is None:
        with compat.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            like = r.fn(*(mode.from_tensor(x) for x in xs))
        got = r.strides[sig] = [o.stride() for o in like]
    return got


def _laid_out(t: Tensor, like_stride: tuple, xs: list[Tensor]) -> Tensor:
    """`t` with the strides the fake kernel promised and its own storage (a custom op's outputs
    may not alias its inputs)."""
    if t.stride() == like_stride and not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                                             for x in xs if x.numel()):
        return t
    return torch.empty_strided(t.shape, like_stride, dtype=t.dtype, device=t.device).copy_(t)


@torch.library.custom_op("tailorfx::inductor_region", mutates_args=())
def _region_op(key: str, xs: list[Tensor]) -> list[Tensor]:
    r = _REGIONS[key]
    with torch.no_grad():   # an inference graph: nothing saved for a backward of its own
        outs = _forward(r, key)(*xs)
    return [_laid_out(o, s, xs) for o, s in zip(outs, _eager_strides(r, xs))]


@_region_op.register_fake
def _(key: str, xs: list[Tensor]) -> list[Tensor]:
    outs = _REGIONS[key].fn(*xs)
    return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device) for o in outs]


@torch.library.custom_op("tailorfx::inductor_region_backward", mutates_args=())
def _region_backward_op(key: str, xs: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    r = _REGIONS[key]
    with torch.no_grad():   # the vjp inside is a function transform: an outer no_grad leaves it be
        got = _backward(r, key)(*xs, *grads)
    wanted = [x for x, w in zip(xs, r.wrt) if w]
    return [_laid_out(g, torch.empty_like(x, device="meta").stride(), xs + grads) for g, x in zip(got, wanted)]


@_region_backward_op.register_fake
def _(key: str, xs: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(x) for x, w in zip(xs, _REGIONS[key].wrt) if w]


def _setup(ctx, inputs, output) -> None:
    ctx.key = inputs[0]
    ctx.save_for_backward(*inputs[1])


def _grads(ctx, grads: list[Tensor]):
    xs = list(ctx.saved_tensors)
    wrt = _REGIONS[ctx.key].wrt
    got = iter(_region_backward_op(ctx.key, xs, list(grads)) if any(wrt) else ())
    return None, [next(got) if w else None for w in wrt]


_region_op.register_autograd(_grads, setup_context=_setup)


def inductor_region(key: str, *xs: Tensor):
    """The region registered under `key` on `xs`: its one output, or a tuple of its outputs."""
    outs = _region_op(key, list(xs))
    return outs[0] if len(outs) == 1 else tuple(outs)


def region_of(key: str) -> Optional[Region]:
    return _REGIONS.get(key)
