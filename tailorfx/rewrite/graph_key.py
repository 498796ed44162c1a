"""A key for what a graph module computes and how AOTAutograd traces it, so that a trace serves
every module that has the key, not only the object it was made on: a model optimized again (the
budget a BudgetError suggests, a copy compared with eager) or a step sized twice traces each
rewritten graph once per process. The key holds the autocast and grad mode it is traced under,
every node (its op, target, arguments and metadata: recompute tags, offload and precision tags,
module stacks), each input's dtype, device, sizes as expressions and at their hints, and the
module's constants; a module that holds what it cannot describe (a module it calls that is no
graph, a DTensor, an opaque attribute) has no key and is traced each time."""
from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
from torch import fx

from tailorfx import compat
from tailorfx.rewrite.capture import autocast_state, node_value

# node metadata that is a value (described from its sizes instead) or provenance no trace reads
_NOT_KEYED = frozenset({"val", "example_value", "tensor_meta", "grapharg", "from_node"})
_CONSTANT_NUMEL = 1 << 16    # constant tensors up to this size are keyed by their bytes


class Unkeyable(Exception):
    """Something in the module the key cannot describe."""


def graph_key(gm: fx.GraphModule) -> Optional[str]:
    """A digest of `gm`, equal only for modules that trace alike; None when `gm` holds something
    the key cannot describe."""
    try:
        text = repr(_module(gm))
    except Unkeyable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _module(gm: fx.GraphModule) -> tuple:
    codegen = gm.graph._codegen
    # AOTAutograd traces under the caller's autocast, which puts its casts in the trace, and grad
    # mode: under no_grad (an evaluation's graph, Dynamo's recompile for it) the trace has no backward
    amp = list(autocast_state())
    rows = [type(codegen).__name__, repr(getattr(codegen, "pytree_info", None)), gm.code, repr(amp),
            torch.is_grad_enabled()]
    for n in gm.graph.nodes:
        meta = sorted((k, _meta(k, v)) for k, v in n.meta.items() if k not in _NOT_KEYED)
        value = _value(node_value(n)) if n.op == "placeholder" else None
        rows.append((n.op, n.name, str(n.target), repr(n.args), repr(n.kwargs), meta, value,
                     _attribute(gm, n.target) if n.op in ("get_attr", "call_module") else None))
    return tuple(rows)


def _meta(key: str, v: Any) -> str:
    if key.endswith("nn_module_stack") and isinstance(v, dict):
        return repr(list(v.values()))    # (path, class) per module; its keys are ids of the modules
    if key == "stack_trace" and isinstance(v, str):   # under torch 2.11 each capture's frame has a name of its own
        return repr(compat.without_apart_numbers(v))
    return repr(v)


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, fx.GraphModule):
        return _module(obj)
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, compat.FakeTensor) or obj.device.type == "meta":
            return _value(obj), None
        if type(obj) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) or obj.device.type != "cpu" \
                or obj.numel() > _CONSTANT_NUMEL:
            raise Unkeyable(target)
        return _value(obj), hashlib.sha256(obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                                           .tobytes()).hexdigest()
    raise Unkeyable(target)


def _size(d: Any) -> Any:
    if isinstance(d, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(d.node.expr), d.node.hint
    return d


def _value(v: Any) -> Any:
    """An input's description: a tensor's type, whether it is a parameter, its dtype, device, sizes,
    strides and offset (each as its expression and hint), whether it takes a gradient; a symbol's
    expression and hint."""
    if isinstance(v, torch.Tensor):
        if type(v).__name__ not in ("Tensor", "Parameter", "Buffer", "FakeTensor"):
            raise Unkeyable(type(v).__name__)        # DTensor and other subclasses: their layout is not here
        return ("tensor", type(v).__name__, isinstance(v, torch.nn.Parameter), str(v.dtype), str(v.device),
                tuple(_size(d) for d in v.shape), tuple(_size(d) for d in v.stride()), _size(v.storage_offset()),
                v.requires_grad)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _size(v)
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    raise Unkeyable(type(v).__name__)
