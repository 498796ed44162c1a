"""Operator overloads and fx's codegen: what a graph's nodes are, and how a compiled graph frees its inputs."""
from __future__ import annotations

from typing import Optional

import torch
from torch._functorch.aot_autograd import make_boxed_func
try:  # fx's codegen for the boxed calling convention (torch >= 2.6; what Inductor's wrapper does)
    from torch.fx.graph import _BoxedCodeGen
except ImportError:
    _BoxedCodeGen = None


def args_clearing_func(g: "torch.fx.GraphModule"):
    """A boxed callable running `g` whose code empties its argument list once unpacked, so each
    input dies at its last use in the graph instead of when the call returns (AOTAutograd clears
    autograd's saved tensors before calling a backward: the list is then their last holder).
    Rewrites `g`'s code in place; make_boxed_func where fx lacks the boxed codegen."""
    if _BoxedCodeGen is None:
        return make_boxed_func(g.forward)
    g.graph.set_codegen(_BoxedCodeGen())
    g.recompile()
    forward = g.forward

    def run(args: list):
        return forward(args)
    run._boxed_call = True
    return run


# ---- operator overloads (checked on torch 2.13) --------------------------------------------------
def is_op_overload(t) -> bool:
    """An ATen/custom operator overload (torch.ops.ns.op.overload)."""
    return isinstance(t, torch._ops.OpOverload)


def op_short_name(t) -> Optional[str]:
    """'softmax' for torch.ops.aten._softmax.default or its packet (namespace and overload
    dropped); None for anything else."""
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return None


def op_argument(t, name: str, args: tuple, kwargs: dict, default=None):
    """The value a call of overload `t` gives its argument `name` (by position or keyword), or
    `default` when the call leaves it out or the overload has no such argument."""
    if not isinstance(t, torch._ops.OpOverload):
        return default
    for i, a in enumerate(t._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


def op_is_mutable(t) -> bool:
    """The overload writes one of its inputs (its schema says so)."""
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def op_returns_alias(t) -> bool:
    """An overload whose output shares an input's storage (a view or an in-place op; and a
    functional collective's wait_tensor, which returns the tensor it waited on, though its schema
    does not say so)."""
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return (any(r.alias_info is not None for r in t._schema.returns)
            or (t.namespace == "_c10d_functional" and t._opname == "wait_tensor"))


def tailorfx_op_name(t) -> Optional[str]:
    """'token_chunked' for torch.ops.tailorfx.token_chunked.default; None for other targets."""
    if isinstance(t, torch._ops.OpOverload) and t.namespace == "tailorfx":
        return t._opname
    return None


def flex_attention_role(t) -> Optional[str]:
    """'forward' or 'backward' for FlexAttention's higher-order ops in a traced graph; None for others."""
    name = getattr(t, "_name", None) if isinstance(t, torch._ops.HigherOrderOperator) else None
    return {"flex_attention": "forward", "flex_attention_backward": "backward"}.get(name)


def op_qualified_name(t) -> Optional[str]:
    """'transformers::grouped_mm_fallback' for a custom op (packet or overload) in a graph; None
    for other targets."""
    if isinstance(t, torch._ops.OpOverload):    # a custom op called through its CustomOpDef, or .default
        return t._schema.name
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name
    return None


def autocast_context_role(t) -> Optional[str]:
    """'enter' or 'exit' for Dynamo's call entering or leaving a `torch.autocast` block inside the
    model (its value is the context, not a tensor: transformers 5.17's rotary embedding turns
    autocast off so); None for other targets."""
    if t is _ENTER_AUTOCAST:
        return "enter"
    return "exit" if t is _EXIT_AUTOCAST else None


def is_autocast_context(t) -> bool:
    """Whether `t` enters or leaves an autocast block (autocast_context_role)."""
    return autocast_context_role(t) is not None


_ENTER_AUTOCAST = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
_EXIT_AUTOCAST = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
