"""The precision pass's cleanup: rules over the casts it made, applied to a fixpoint.

    before:  y = x.to(bfloat16).to(float32)      # x is fp32, the first cast one of ours
    after:   y = x
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PASS_META

NAME = "precision"
MAX_CLEANUP_ROUNDS = 16
_CAST_METHODS = frozenset({"to", "type", "float", "half", "bfloat16", "double", "type_as"})


def _ours(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.meta.get(PASS_META) == NAME and is_cast(n)


def rule_cast_to_own_dtype(n: fx.Node) -> Optional[fx.Node]:
    """x.to(d) where x already is d -> x."""
    src = n.args[0]
    return src if node_value(src).dtype == node_value(n).dtype else None


def rule_cast_round_trip(n: fx.Node) -> Optional[fx.Node]:
    """x.to(a).to(dtype(x)) -> x, when the first cast is ours or lossless (bf16 -> fp32 -> bf16)."""
    inner = n.args[0]
    if not (isinstance(inner, fx.Node) and is_cast(inner) and inner.args and isinstance(inner.args[0], fx.Node)):
        return None
    x = inner.args[0]
    xv, iv = node_value(x), node_value(inner)
    if not (isinstance(xv, torch.Tensor) and xv.dtype == node_value(n).dtype and xv.is_floating_point()
            and iv.is_floating_point()):
        return None
    lossless = torch.finfo(iv.dtype).bits >= torch.finfo(xv.dtype).bits and \
        {iv.dtype, xv.dtype} != {torch.float16, torch.bfloat16}
    return x if (lossless or _ours(inner)) else None


def rule_duplicate_cast(n: fx.Node) -> Optional[fx.Node]:
    """Two casts of one value to one dtype in one module -> the earlier one (it dominates n's uses:
    same input, earlier in the graph)."""
    for other in n.args[0].users:
        if other is not n and other < n and _ours(other) and node_value(other).dtype == node_value(n).dtype \
                and other.meta.get("nn_module_stack") == n.meta.get("nn_module_stack"):
            return other
    return None


rules_cleanup: tuple[tuple[str, Callable[[fx.Node], Optional[fx.Node]]], ...] = (
    ("cast_to_own_dtype", rule_cast_to_own_dtype),
    ("cast_round_trip", rule_cast_round_trip),
    ("duplicate_cast", rule_duplicate_cast),
)


def cleanup(gm: fx.GraphModule, rules=rules_cleanup) -> tuple[dict[str, int], str]:
    """Apply the rules to this pass's casts until none fires; returns (fires per rule, stop reason).

    Matching (the rules) never mutates; this loop replaces uses and erases dead casts.
    """
    fired = {name: 0 for name, _ in rules}
    for _ in range(MAX_CLEANUP_ROUNDS):
        changed = False
        for n in list(gm.graph.nodes):
            if not _ours(n):
                continue
            for name, rule in rules:
                rep = rule(n)
                if rep is not None and rep is not n:
                    n.replace_all_uses_with(rep)
                    fired[name] += 1
                    changed = True
                    break
            if not n.users:
                gm.graph.erase_node(n)
                changed = True
        if not changed:
            return fired, "fixpoint"
    return fired, f"iteration cap ({MAX_CLEANUP_ROUNDS} rounds)"




def is_cast(n: fx.Node) -> bool:
    """A node whose result dtype is its own explicit choice (a model cast or one of ours)."""
    return n.op == "call_method" and n.target in _CAST_METHODS and (n.target != "to" or to_dtype(n) is not None)


def to_dtype(n: fx.Node) -> Optional[tuple[str, Any]]:
    """Where a `.to`/`.type` call keeps its dtype: ("kw", "dtype") or ("arg", i)."""
    if isinstance(n.kwargs.get("dtype"), torch.dtype):
        return ("kw", "dtype")
    for i, a in enumerate(n.args[1:3], start=1):
        if isinstance(a, torch.dtype):
            return ("arg", i)
    return None
