"""Attention: each attention the pass recognises becomes one call that runs an attention spec.

Invariant: with the exact spec (the default) the model computes the same values (up to float
reassociation inside the kernel) without an S x S tensor; a sparse spec changes which keys each
query sees and runs only when the user passed one. An attention whose mask is not proved causal
(padding from a real attention_mask, custom masks) is left as it was, and the pass says why. A
mask proved a causal sliding window of w (its constant w too large to evaluate past: the proof
evaluates it with w replaced by small windows) becomes SlidingWindow(w), the same keys; a bias
with one value per key added to the scores (Bloom's ALiBi) becomes the exact spec's score_mod
"key_bias", reading that bias. A mask proved causal within the documents of a packed batch (transformers builds
one from restarting position_ids when there is no attention_mask and no cache) becomes the same
call with document ids computed in the graph from that position_ids input, so every batch the
graph serves gets its own documents:

    before:  mask = <block-diagonal causal mask built from position_ids>          # B 1 S S
             out = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    after:   doc = (diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
             out = attention_call(q, k, v, kind='Exact', params=(), causal=True, scale=0.25,
                                  document_ids=doc)

    before:  s = matmul(q, repeat_kv(k).transpose(2, 3)) * 0.25 + causal_mask     # B H S S
             out = matmul(softmax(s, dim=-1, dtype=float32).to(float32), repeat_kv(v))
    after:   out = attention_call(q, k, v, kind='Exact', params=(), causal=True, scale=0.25)

    before:  out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    after:   out = attention_call(q, k, v, kind='SlidingWindow', params=(('window', 8),),
                                  causal=True, scale=0.25)
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from tailorfx.attention import (SPECS, AttentionSpec, Dilated, Exact, SlidingWindow, attention_call, draw_seed,
                                spec_params)
from tailorfx.passes import register
from tailorfx.passes.attention.documents import DOC_RULE_TEXT, DOC_RULES
from tailorfx.passes.attention.mask import MaskProof, prove_mask
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext, PassResult, annotate

NAME = "attention"


# ---- matching: rules are (name, match) pairs; a match never mutates ----------------------------
@dataclass(frozen=True)
class Match:
    """One attention, found: out = attention(q, k, v) with k, v of H_kv heads."""
    spelling: str
    out: fx.Node                 # the node the call replaces
    q: fx.Node
    k: fx.Node
    v: fx.Node
    causal: bool
    scale: float
    mask: str                    # how the mask was handled, for the report
    removes_dense: bool          # an S x S tensor (scores or mask) the graph no longer makes
    positions: Optional[fx.Node] = None   # a document mask's position_ids input (packed batches)
    doc_rule: Optional[str] = None        # how document ids follow from it (attention_mask.DOC_RULES)
    softcap: Optional[float] = None       # scores soft-capped, c * tanh(s / c), before the mask
    key_bias: Optional[fx.Node] = None    # an additive bias per key (ALiBi), query dim of size 1
    key_bias_scale: float = 1.0           # what multiplies it on its way to the softmax
    folded: bool = False                  # heads folded into the batch: (B * H, S, D) operands
    window: Optional[int] = None          # the mask is a causal sliding window of this many keys
    dropout: float = 0.0                  # dropout on the probabilities (training)


@dataclass(frozen=True)
class Rule:
    """`match(anchor, ctx)` -> a Match, a reason it cannot be rewritten (str), or None (not this)."""
    name: str
    match: Callable[[fx.Node, PassContext], Union[Match, str, None]]


def _check_qkv(q: fx.Node, k: fx.Node, v: fx.Node) -> Optional[str]:
    qv, kv, vv = (node_value(n) for n in (q, k, v))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv, vv)):
        return "q, k, v are not all (B, H, S, D) tensors"
    if not (match.same_size(kv.shape[0], qv.shape[0]) and match.same_size(kv.shape[2], qv.shape[2])
            and match.same_size(kv.shape[3], qv.shape[3])):
        return (f"k {tuple(kv.shape)} does not match q {tuple(qv.shape)} in batch, length or head dim "
                "(cross-attention or a KV cache)")
    if not all(match.same_size(i, j) for i, j in zip(kv.shape, vv.shape)):
        return f"v {tuple(vv.shape)} differs from k {tuple(kv.shape)}"
    if not isinstance(qv.shape[1], int) or not isinstance(kv.shape[1], int) or qv.shape[1] % kv.shape[1]:
        return f"{qv.shape[1]} query heads are not a multiple of {kv.shape[1]} kv heads"
    if not (qv.dtype == kv.dtype == vv.dtype):
        return f"q, k, v dtypes differ ({qv.dtype}, {kv.dtype}, {vv.dtype})"
    return None


def _match_sdpa(node: fx.Node, ctx: PassContext) -> Union[Match, str, None]:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)."""
    if not match.is_functional_call(node, F.scaled_dot_product_attention):
        return None
    a = match.named_args(node, ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))
    p = a.get("dropout_p", 0.0)
    if not isinstance(p, (int, float)) or not 0 <= p < 1:
        return f"attention dropout p={p} is not a constant in [0, 1)"
    causal, scale, mask = a.get("is_causal", False), a.get("scale"), a.get("attn_mask")
    if not isinstance(causal, bool):
        return f"is_causal is not a constant ({causal})"
    q, k, v = a["query"], match.unwrap_repeat_kv(a["key"]), match.unwrap_repeat_kv(a["value"])
    why = _check_qkv(q, k, v)
    if why:
        return why
    if scale is None:
        d = node_value(q).shape[-1]
        if not isinstance(d, int):
            return "head dim is symbolic"
        scale = d ** -0.5
    if not isinstance(scale, (int, float)):
        return f"scale is not a constant ({scale})"
    how = "is_causal" if causal else "none"
    if mask is not None:
        if causal or not isinstance(mask, fx.Node):
            return "attn_mask together with is_causal"
        dtype = node_value(q).dtype
        bias = _masked_bias(mask)
        if bias is not None:   # masked_fill(bias, hidden, min): the bias proved per key, the fill a mask
            proof = prove_mask(ctx, bias, mask, 1.0, node_value(mask).dtype, None)
        else:
            proof = prove_mask(ctx, None, mask, 1.0, dtype, _sdpa_mask_fn(node_value(mask).dtype, dtype))
        if isinstance(proof, str):
            return proof
        how = _described(proof, "attn_mask") + (f"; key bias {bias.name} (ALiBi)" if bias is not None else "")
        if bias is not None and proof.positions is not None:
            return "a per-key bias in a packed-document mask"
        return Match("sdpa", node, q, k, v, True, float(scale), how, True, proof.positions, proof.rule,
                     window=proof.window, key_bias=bias, dropout=float(p))
    # with dropout, SDPA on the CPU takes its math path: S x S probabilities and mask
    on_cpu = node_value(q).device.type == "cpu"
    return Match("sdpa", node, q, k, v, causal, float(scale), how, bool(p) and on_cpu, dropout=float(p))


def _masked_bias(mask: fx.Node) -> Optional[fx.Node]:
    """b for an attn_mask masked_fill(b, hidden, fill) whose b is a floating bias with one value
    per key (Falcon folds its ALiBi into the mask so); else None."""
    if match.op_name(mask) != "masked_fill" or not mask.args or not isinstance(mask.args[0], fx.Node):
        return None
    b = mask.args[0]
    return b if _key_bias_shape(b, mask) is None else None


def _described(proof: MaskProof, what: str) -> str:
    """How a proved mask is reported: causal, a sliding window, or a packed-document mask."""
    if proof.window is not None:
        return f"{what} proved a causal sliding window of {proof.window} ({proof.text})"
    if proof.positions is None:
        return f"{what} proved causal at S={proof.text}"
    return (f"packed: document ids from position_ids ({proof.positions.name}: "
            f"{DOC_RULE_TEXT[proof.rule]}); {what} proved a document mask at S={proof.text}")


def _sdpa_mask_fn(mask_dtype: torch.dtype, dtype: torch.dtype) -> Callable:
    """What SDPA does with the scaled scores x and a mask m: add it, or keep where True."""
    if mask_dtype == torch.bool:
        return lambda m, x: torch.where(m, x, float("-inf"))
    return lambda m, x: x + m.to(dtype)


_CASTS = frozenset({"to", "type", "float", "half", "bfloat16", "contiguous"})
_SCORE_OPS = _CASTS | {"mul", "truediv", "div", "add", "sub", "masked_fill", "where", "tanh", "view", "reshape"}


def _match_softmax_chain(node: fx.Node, ctx: PassContext) -> Union[Match, str, None]:
    """softmax(matmul(q, k^T) [* c | / c] [+ mask], dim=-1) [casts] [dropout p=0] @ v."""
    if match.op_name(node) != "softmax" or node.op not in ("call_function", "call_method"):
        return None
    x_in = node.args[0] if node.args else node.kwargs.get("input")
    sv = node_value(node)
    if not isinstance(x_in, fx.Node) or not isinstance(sv, torch.Tensor) or sv.dim() != 4:
        return None
    if match.dim_arg(node) not in (-1, 3):
        return "softmax is not over the last dim (keys)"
    got = _probs_matmul(node)
    if isinstance(got, str):
        return got
    out, drop = got
    up = _scores_matmul(x_in)
    if isinstance(up, str):
        return up
    scores, scale, has_mask, softcap, capped, bias = up
    folded = node_value(scores).dim() == 3
    if folded != (node_value(out).dim() == 3):
        return "scores and output differ in whether heads are folded into the batch"
    if match.op_name(scores) == "baddbmm":
        a = match.named_args(scores, ("input", "batch1", "batch2"))
        q_arg, kt_arg = a["batch1"], a["batch2"]
    elif len(scores.args) == 2:
        q_arg, kt_arg = scores.args
    else:
        return f"the scores matmul ({scores.name}) is not q @ k^T"
    if len(scores.users) != 1:
        return f"attention scores ({scores.name}) are used elsewhere"
    q, k, v = q_arg, _untranspose(kt_arg), out.args[1]
    if k is None:
        return "the scores matmul is not q @ k.transpose(-2, -1)"
    if folded:   # (B * H, S, D) operands: the (B, H, S, D) tensors they were reshaped from
        q, k, v = (_unfold_heads(t) for t in (q, k, v))
        if None in (q, k, v):
            return "heads are folded into the batch from something other than (B, H, S, D) tensors"
    k, v = match.unwrap_repeat_kv(k), match.unwrap_repeat_kv(v)
    why = _check_qkv(q, k, v)
    if why:
        return why
    dtype = node_value(q).dtype
    if node_value(out).dtype != dtype:
        return f"attention output dtype {node_value(out).dtype} differs from q's {dtype}"
    extra = {"softcap": softcap, "folded": folded, "dropout": drop}
    if bias is not None:
        if softcap is not None:
            return "scores carry both a soft-cap and a position bias"
        extra.update(key_bias=bias.node, key_bias_scale=float(bias.scale))
    if not has_mask:   # softmax(q k^T * c) v: every query sees every key
        return Match("softmax_chain", out, q, k, v, False, float(scale), "none", True, **extra)
    # the mask is proved on the scores it is added to: after the soft-cap or the bias, past any scale
    x, x_scale = (scores, scale) if capped is None and bias is None else (
        (capped, 1.0) if bias is None else (bias.after, bias.scale))
    proof = prove_mask(ctx, x, x_in, x_scale, dtype, None)
    if isinstance(proof, str):
        return proof
    how = (f"proved causal at S={proof.text}" if proof.positions is None and proof.window is None
           else _described(proof, "mask"))
    extra["window"] = proof.window
    if bias is not None:
        how += f"; key bias {bias.node.name} (ALiBi)"
    return Match("softmax_chain", out, q, k, v, True, float(scale), how, True, proof.positions, proof.rule, **extra)


@dataclass(frozen=True)
class _Bias:
    """An additive per-key bias met on the way up from the softmax."""
    node: fx.Node          # the bias tensor
    scale: float           # the constant scales between it and the softmax (times baddbmm's beta)
    after: fx.Node         # the 4-D scores node it is part of: where a mask below it is proved


def _unfold_heads(x3: fx.Node) -> Optional[fx.Node]:
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


def _key_bias_shape(bias: fx.Node, scores: fx.Node) -> Optional[str]:
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


def _probs_matmul(softmax: fx.Node) -> Union[tuple[fx.Node, float], str]:
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


def _scores_matmul(x_in: fx.Node) -> Union[tuple, str]:
    """Up from the softmax input to the scores matmul: (that matmul, the constant scale, whether
    a mask is added on the way, the soft-cap c of a c * tanh(s / c) after the scale (Gemma-2),
    the capped scores node, a _Bias or None); nothing else may read the scores. The matmul may
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
        elif name == "add" and bias is None and isinstance(other, fx.Node) and _key_bias_shape(other, cur) is None \
                and node_value(cur).dim() == 4:
            bias = _Bias(other, scale, cur)
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
            why = _key_bias_shape(a["input"], cur) if isinstance(a["input"], fx.Node) else "not a tensor"
            if why:
                return f"the tensor baddbmm ({cur.name}) adds is not a per-key bias: {why}"
            bias = _Bias(a["input"], scale * beta, below)
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


def _untranspose(kt: fx.Node) -> Optional[fx.Node]:
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


rules_attention = (Rule("sdpa", _match_sdpa), Rule("softmax_chain", _match_softmax_chain))


# ---- the one rewriter -----------------------------------------------------------------------
def _erase_dead(gm: fx.GraphModule, start: fx.Node, erased: set[str]) -> None:
    """Erase `start` and every ancestor left without users (scores, mask, repeat_kv copies)."""
    stack = [start]
    while stack:
        n = stack.pop()
        if n.name in erased or n.users or n.op in ("placeholder", "output") or n.is_impure():
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        erased.add(n.name)
        stack.extend(inputs)


def _document_ids(gm: fx.GraphModule, positions: fx.Node, rule: str, made: dict) -> fx.Node:
    """The node computing DOC_RULES[rule](positions) in the graph, right after the graph's inputs
    (once per input and rule: every attention of the graph shares it), each new node annotated
    with its fake value."""
    key = (positions, rule)
    if key in made:
        return made[key]
    g = gm.graph
    last_input = [n for n in g.nodes if n.op == "placeholder"][-1]
    traced = fx.symbolic_trace(DOC_RULES[rule])
    fake = node_value(positions)
    mode = getattr(fake, "fake_mode", None)
    env: dict = {}
    with g.inserting_before(last_input.next), (mode if mode is not None else contextlib.nullcontext()):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                env[n] = positions
                continue
            if n.op == "output":
                doc = env[n.args[0]]
                break
            new = g.node_copy(n, lambda a: env[a])
            args, kwargs = fx.node.map_arg((new.args, new.kwargs), node_value)
            fn = new.target if new.op == "call_function" else getattr(type(args[0]), new.target)
            annotate(new, val=fn(*args, **kwargs), pass_name=NAME)
            env[n] = new
    made[key] = doc
    return doc


def _rewrite(gm: fx.GraphModule, m: Match, kind: str, params: tuple, erased: set[str], made: dict) -> fx.Node:
    kwargs = {"kind": kind, "params": params, "causal": m.causal, "scale": m.scale}
    if m.positions is not None:
        kwargs["document_ids"] = _document_ids(gm, m.positions, m.doc_rule, made)
    if m.key_bias is not None:
        kwargs.update(key_bias=m.key_bias, key_bias_scale=m.key_bias_scale)
    if dict(params).get("dropout"):   # the seed, a random op of its own: a recompute partition saves it
        with gm.graph.inserting_before(m.out):
            seed = gm.graph.call_function(draw_seed, ())
        annotate(seed, m.out, val=_fake_seed(m.q), pass_name=NAME)
        kwargs["dropout_seed"] = seed
    with gm.graph.inserting_before(m.out):
        new = gm.graph.call_function(attention_call, (m.q, m.k, m.v), kwargs)
        if m.folded:   # the (B, H, S, D) result as the (B * H, S, D) the bmm made
            annotate(new, m.out, val=node_value(m.q).new_empty(node_value(m.q).shape), pass_name=NAME)
            new = gm.graph.call_method("flatten", (new, 0, 1))
    annotate(new, m.out, pass_name=NAME)
    m.out.replace_all_uses_with(new)
    _erase_dead(gm, m.out, erased)
    return new


def _fake_seed(q: fx.Node):
    """The fake value of a draw_seed() node: an int64 scalar on the CPU, in q's fake mode."""
    fake = node_value(q)
    mode = getattr(fake, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty((), dtype=torch.int64, device="cpu")


def _fit(spec: Optional[AttentionSpec], m: Match) -> Union[AttentionSpec, str]:
    """The spec to run for this attention: the user's, checked against what the model computes
    (the spec brings the pattern; causality and scale are the model's), or why it does not fit."""
    if m.window is not None and m.key_bias is not None:
        return f"its mask is a sliding window of {m.window} and its scores carry a per-key bias"
    if _backward_only(spec):   # the model's own exact attention, its backward in blocks or with k, v repeated
        own = _fit(None, m)
        return (dataclasses.replace(own, backward_blocks=spec.backward_blocks, repeat_kv=spec.repeat_kv)
                if isinstance(own, Exact) else own)
    if spec is None:
        if m.window is not None:   # the model's own window: the same keys, in O(S x window)
            return SlidingWindow(m.window, causal=True, softcap=m.softcap, dropout=m.dropout)
        return Exact(causal=m.causal, softcap=m.softcap, dropout=m.dropout)
    if m.dropout:
        if isinstance(spec, Dilated):
            return f"attention dropout p={m.dropout}: the dilated kernel has no dropout"
        spec = dataclasses.replace(spec, dropout=m.dropout)
    if m.window is not None:
        return f"its mask is a sliding window of {m.window}: only the default (exact) spec runs that"
    if m.softcap is not None:
        return f"its scores are soft-capped (c={m.softcap}): only the exact spec (the default) runs that"
    if m.key_bias is not None:
        return f"its scores carry a per-key bias ({m.key_bias.name}, ALiBi): only the exact spec (the default) runs that"
    if spec.causal != m.causal:
        return (f"the model's attention is {'causal' if m.causal else 'bidirectional'} but the spec "
                f"has causal={spec.causal}")
    if spec.scale is not None and abs(spec.scale - m.scale) > 1e-6 * abs(m.scale):
        return f"the spec's scale {spec.scale} differs from the model's {m.scale}"
    return spec


def _backward_only(spec: Optional[AttentionSpec]) -> bool:
    """Exact(backward_blocks=N, repeat_kv=...) with nothing else of the model's attention restated."""
    return (isinstance(spec, Exact) and (spec.backward_blocks > 1 or spec.repeat_kv) and spec.softcap is None
            and spec.score_mod is None
            and not spec.dropout and spec.scale is None)


def grouped_query(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether an attention the pass would rewrite has fewer kv heads than query heads (GQA)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for region in ctx.regions.of_kind("attention"):
        for name in region.nodes:
            for rule in rules_attention:
                got = rule.match(nodes[name], ctx)
                if isinstance(got, Match) and node_value(got.k).shape[1] != node_value(got.q).shape[1]:
                    return True
    return False


class AttentionPass:
    """Replace each recognised attention (SDPA, or an explicit softmax chain) by one spec call."""
    name = NAME
    after = ()

    def __init__(self, options: dict):
        spec = options.get("attention")
        if spec is not None and type(spec).__name__ not in SPECS:
            raise ValueError(f"attention= takes one of {', '.join(SPECS)} (tailorfx.attention), "
                             f"got {type(spec).__name__}")
        self.spec: Optional[AttentionSpec] = spec
        # in the default plan (no attention= given): the exact swap only where it removes an S x S
        # tensor (scores, or a mask an SDPA call reads); an SDPA that makes none is left as it is
        self.only_dense = spec is None and bool(options.get("attention_only_dense"))

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        nodes = {n.name: n for n in gm.graph.nodes}
        stats, touched, skipped, erased, made = {}, [], [], set(), {}
        for region in ctx.regions.of_kind("attention"):
            found = []
            for name in region.nodes:
                for rule in rules_attention:
                    got = None if name in erased else rule.match(nodes[name], ctx)
                    if got is not None:
                        found.append(got)
                        break
            if not found:
                skipped.append(f"{region.path}: no attention spelling recognised "
                               "(scaled_dot_product_attention or softmax(q @ k^T) @ v)")
            for got in found:
                if self.only_dense and isinstance(got, Match) and not got.removes_dense:
                    continue
                spec = _fit(self.spec, got) if isinstance(got, Match) else got
                if isinstance(spec, str):
                    skipped.append(f"{region.path}: {spec}")
                    continue
                kind, params = spec_params(spec)
                _rewrite(gm, got, kind, params, erased, made)
                touched.append(region.path)
                stats[region.path] = _stats(got, kind, params)
        return PassResult(gm, bool(touched), stats, tuple(dict.fromkeys(touched)), tuple(skipped))


def _stats(m: Match, kind: str, params: tuple) -> dict:
    qv, kv = node_value(m.q), node_value(m.k)
    return {"spelling": m.spelling, "spec": f"{kind}({', '.join(f'{a}={b}' for a, b in params)})",
            "causal": m.causal, "scale": m.scale, "mask": m.mask, "num_heads": int(qv.shape[1]),
            "num_kv_heads": int(kv.shape[1]), "dense_removed": m.removes_dense,
            **({"document_ids": f"{m.doc_rule} rule on {m.positions.name}"} if m.positions is not None else {}),
            **({"dropout": f"p={m.dropout}: the kernel draws its own masks (eager's law, not eager's random "
                           "stream; its backward redraws them from the call's seed)"} if m.dropout else {})}


@register(NAME)
def _factory(options: dict) -> AttentionPass:
    return AttentionPass(options)
