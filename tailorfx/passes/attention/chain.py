"""Walking a softmax chain: down from the softmax to probs @ v (through casts and a dropout), up
to q @ k^T (through scales, a mask, a soft-cap, a per-key bias and casts), and back from the
operands of that matmul to the (B, H, S, D) q, k, v. Each walk says why, when it stops short.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value

_CASTS = frozenset({"to", "type", "float", "half", "bfloat16", "contiguous"})
_SCORE_OPS = _CASTS | {"mul", "truediv", "div", "add", "sub", "masked_fill", "where", "tanh", "view", "reshape"}


@dataclass(frozen=True)
class KeyBias:
    """An additive per-key bias met on the way up from the softmax."""
    node: fx.Node          # the bias tensor
    scale: float           # the constant scales between it and the softmax (times baddbmm's beta)
    after: fx.Node         # the 4-D scores node it is part of: where a mask below it is proved


def unfold_heads(x3: fx.Node) -> Optional[fx.Node]:
    """x for x.reshape(B * H, S, D) (or .view) of a (B, H, S, D) tensor x; else None."""
    if not isinstance(x3, fx.Node) or match.op_name(x3) not in ("reshape", "view") or \
            not x3.args or not isinstance(x3.args[0], fx.Node):
        return None
    x4, v3 = x3.args[0], node_value(x3)
    v4 = node_value(x4)
    if not (isinstance(v4, torch.Tensor) and isinstance(v3, torch.Tensor) and v4.dim() == 4 and v3.dim() == 3):
        return None
    b, h, s, d = v4.shape
    return x4 if match.all_same(v3.shape, (b * h, s, d)) else None


def key_bias_shape(bias: fx.Node, scores: fx.Node) -> Optional[str]:
    """Why `bias`, added to `scores`, is not a floating (.., 1, S) bias per key; None when it is."""
    bv, sv = node_value(bias), node_value(scores)
    if not isinstance(bv, torch.Tensor) or not bv.is_floating_point():
        return "not a floating-point tensor"
    if bv.dim() > sv.dim() or bv.dim() < 2:
        return f"shape {tuple(bv.shape)}"
    shape = (1,) * (sv.dim() - bv.dim()) + tuple(bv.shape)
    lead_ok = all(match.same_size(a, 1) or match.same_size(a, b) for a, b in zip(shape[:-2], sv.shape[:-2]))
    if not (lead_ok and match.same_size(shape[-2], 1) and match.same_size(shape[-1], sv.shape[-1])):
        return f"shape {tuple(bv.shape)} is not one value per key (its query dim must be 1)"
    return None


def probs_matmul(softmax: fx.Node) -> Union[tuple[fx.Node, float], str]:
    """Down from the softmax: casts and a dropout, then probs @ v: (that matmul, the dropout's p,
    0 for none or one not in training); nothing else may read the probabilities."""
    cur, drop = softmax, 0.0
    while True:
        if len(cur.users) != 1:
            return f"attention probabilities ({cur.name}) are used elsewhere, e.g. returned as attention weights"
        (user,) = cur.users
        name, first = match.op_name(user), bool(user.args) and user.args[0] is cur
        if name == "dropout" and first:
            d = match.named_args(user, ("input", "p", "training", "inplace"))
            p, training = d.get("p", 0.5), d.get("training", True)
            if not isinstance(training, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1 or drop:
                return f"attention dropout p={p}, training={training}: not one constant dropout"
            drop = float(p) if training else 0.0
        elif name in ("view", "reshape") and first and node_value(cur).dim() == 4 and node_value(user).dim() == 3:
            pass   # heads folded into the batch, (B * H, S, S), for a bmm with (B * H, S, D) values
        elif not (name in _CASTS and first):
            break
        cur = user
    if name not in ("matmul", "bmm") or not first or len(user.args) != 2:
        return f"softmax output feeds {name}, not a matmul with v"
    return user, drop


_MATMULS = frozenset({"matmul", "bmm", "baddbmm"})


def scores_matmul(x_in: fx.Node) -> Union[tuple, str]:
    """Up from the softmax input to the scores matmul: (that matmul, the constant scale, whether
    a mask is added on the way, the soft-cap c of a c * tanh(s / c) after the scale (Gemma-2),
    the capped scores node, a KeyBias or None); nothing else may read the scores. The matmul may
    be a bmm over heads folded into the batch, viewed back to (B, H, S, S), and a baddbmm whose
    added input is a per-key bias (Bloom's ALiBi: alibi.baddbmm(q, k^T, beta=1, alpha=c))."""
    scale, has_mask, cur, below = 1.0, False, x_in, None
    softcap, capped, last_mul, bias = None, None, None, None
    while match.op_name(cur) not in _MATMULS:
        name = match.op_name(cur)
        on = [a for a in cur.args if isinstance(a, fx.Node) and _leads_to_matmul(a)]
        if len(cur.users) != 1 or len(on) != 1:
            return f"scores pass through {name} ({cur.name}), or are used elsewhere, before the softmax"
        prev, first = on[0], cur.args[0] is on[0]
        other = cur.args[1] if first and len(cur.args) > 1 else cur.args[0]
        if name == "tanh" and softcap is None and last_mul is not None and scale == last_mul[1] \
                and match.op_name(prev) in ("truediv", "div") and len(prev.args) == 2 \
                and prev.args[1] == last_mul[1] and len(prev.users) == 1:
            # c * tanh(s / c), nothing but casts and the mask after it: a soft-cap, not a scale
            softcap, capped, scale = float(last_mul[1]), last_mul[0], 1.0
            below, cur = cur, prev.args[0]
            continue
        if name in ("mul", "truediv", "div") and len(cur.args) == 2 and (first or name == "mul"):
            if not isinstance(other, (int, float)):
                return f"scores are scaled by a non-constant ({cur.name})"
            if name == "mul" and scale == 1.0 and softcap is None:
                last_mul = (cur, other)
            scale = scale * other if name == "mul" else scale / other
        elif name == "add" and bias is None and isinstance(other, fx.Node) and key_bias_shape(other, cur) is None \
                and node_value(cur).dim() == 4:
            bias = KeyBias(other, scale, cur)
        elif name in ("add", "sub", "masked_fill", "where") and (first or name in ("add", "where")) \
                and not (name == "where" and first):
            if bias is not None:
                return f"a mask ({cur.name}) is added before the position bias {bias.node.name}"
            has_mask = True
        elif name in ("view", "reshape") and first and node_value(cur).dim() == 4 and node_value(prev).dim() == 3:
            pass   # (B * H, S, S) scores of a bmm viewed as (B, H, S, S)
        elif not (name in _CASTS and first):
            return f"scores pass through {name} ({cur.name}) before the softmax"
        below, cur = cur, prev
    if match.op_name(cur) == "baddbmm":
        a = match.named_args(cur, ("input", "batch1", "batch2"))
        beta, alpha = a.get("beta", 1), a.get("alpha", 1)
        if not all(isinstance(c, (int, float)) for c in (beta, alpha)):
            return f"baddbmm ({cur.name}) has non-constant beta or alpha"
        if not (isinstance(a.get("batch1"), fx.Node) and isinstance(a.get("batch2"), fx.Node)):
            return f"baddbmm ({cur.name}) operands are not graph tensors"
        if beta != 0:
            if bias is not None:
                return f"scores carry two biases ({bias.node.name}, {cur.name})"
            if below is None or node_value(below).dim() != 4 or match.op_name(below) not in ("view", "reshape"):
                return f"baddbmm ({cur.name}) scores are not viewed as (B, H, S, S) before the softmax"
            why = key_bias_shape(a["input"], cur) if isinstance(a["input"], fx.Node) else "not a tensor"
            if why:
                return f"the tensor baddbmm ({cur.name}) adds is not a per-key bias: {why}"
            bias = KeyBias(a["input"], scale * beta, below)
        scale *= alpha
    return cur, scale, has_mask, softcap, capped, bias


def _leads_to_matmul(a: fx.Node, depth: int = 8) -> bool:
    """Whether `a` comes from a matmul through scale, mask and cast ops: the scores operand,
    as opposed to the mask operand."""
    if match.op_name(a) in _MATMULS:
        return True
    if depth == 0 or match.op_name(a) not in _SCORE_OPS:
        return False
    return any(_leads_to_matmul(x, depth - 1) for x in a.args if isinstance(x, fx.Node))


def untranspose(kt: fx.Node) -> Optional[fx.Node]:
    """k for k.transpose(-2, -1) / transpose(2, 3) / permute(0, 1, 3, 2); else None."""
    if not isinstance(kt, fx.Node) or not kt.args or not isinstance(kt.args[0], fx.Node):
        return None
    name, dims = match.op_name(kt), tuple(kt.args[1:])
    if name == "transpose" and len(dims) == 2 and {d % 4 for d in dims} == {2, 3}:
        return kt.args[0]
    if name == "permute":
        perm = dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
        if tuple(d % 4 for d in perm) == (0, 1, 3, 2):
            return kt.args[0]
    return None
