"""Matching: each rule is a (name, match) pair that finds one attention spelling at an anchor node,
as a Match, a reason it cannot be rewritten, or None (not this spelling); a match never mutates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from tailorfx.passes.attention.chain import key_bias_shape, probs_matmul, scores_matmul, unfold_heads, untranspose
from tailorfx.passes.attention.documents import DOC_RULE_TEXT
from tailorfx.passes.attention.mask import MaskProof, prove_mask
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import autocast_of, clone, node_value, seq_info
from tailorfx.rewrite.passes import PassContext
from tailorfx.rewrite.regions import find_regions
from tailorfx.runtime.flash_cpu import grouped_on_cuda_math


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
    doc_rule: Optional[str] = None        # how document ids follow from it (documents.DOC_RULES)
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
    if not (qv.dtype == kv.dtype == vv.dtype) and autocast_of(qv) is None:   # autocast: cast as it casts them
        return f"q, k, v dtypes differ ({qv.dtype}, {kv.dtype}, {vv.dtype})"
    return None


SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")   # its signature


def _match_sdpa(node: fx.Node, ctx: PassContext) -> Union[Match, str, None]:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)."""
    if not match.is_functional_call(node, F.scaled_dot_product_attention):
        return None
    a = match.named_args(node, SDPA_ARGS)
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
        key = ("attn_mask proof", mask, bias, dtype)   # every layer's attention shares one mask
        if key not in ctx.memo:   # masked_fill(bias, hidden, min): the bias proved per key, the fill a mask
            ctx.memo[key] = (prove_mask(ctx, bias, mask, 1.0, node_value(mask).dtype, None) if bias is not None
                             else prove_mask(ctx, None, mask, 1.0, dtype, _sdpa_mask_fn(node_value(mask).dtype, dtype)))
        proof = ctx.memo[key]
        if isinstance(proof, str):
            return proof
        how = _described(proof, "attn_mask") + (f"; key bias {bias.name} (ALiBi)" if bias is not None else "")
        if bias is not None and proof.positions is not None:
            return "a per-key bias in a packed-document mask"
        return Match("sdpa", node, q, k, v, True, float(scale), how, True, proof.positions, proof.rule,
                     window=proof.window, key_bias=bias, dropout=float(p))
    # SDPA's math kernel makes S x S scores: on the CPU with dropout, on CUDA for grouped k, v
    # that neither flash nor the memory-efficient kernel takes (fp32 ones)
    qv, given_k = node_value(q), node_value(a["key"])   # the k SDPA is given (grouped, or repeated by the model)
    dense = (bool(p) and qv.device.type == "cpu") or grouped_on_cuda_math(qv, given_k)
    return Match("sdpa", node, q, k, v, causal, float(scale), how, dense, dropout=float(p))


def _masked_bias(mask: fx.Node) -> Optional[fx.Node]:
    """b for an attn_mask masked_fill(b, hidden, fill) whose b is a floating bias with one value
    per key (Falcon folds its ALiBi into the mask so); else None."""
    if match.op_name(mask) != "masked_fill" or not mask.args or not isinstance(mask.args[0], fx.Node):
        return None
    b = mask.args[0]
    return b if key_bias_shape(b, mask) is None else None


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
    got = probs_matmul(node)
    if isinstance(got, str):
        return got
    out, drop = got
    up = scores_matmul(x_in)
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
    q, k, v = q_arg, untranspose(kt_arg), out.args[1]
    if k is None:
        return "the scores matmul is not q @ k.transpose(-2, -1)"
    if folded:   # (B * H, S, D) operands: the (B, H, S, D) tensors they were reshaped from
        q, k, v = (unfold_heads(t) for t in (q, k, v))
        if None in (q, k, v):
            return "heads are folded into the batch from something other than (B, H, S, D) tensors"
    k, v = match.unwrap_repeat_kv(k), match.unwrap_repeat_kv(v)
    why = _check_qkv(q, k, v)
    if why:
        return why
    dtype = node_value(q).dtype
    if node_value(out).dtype != dtype:
        if autocast_of(node_value(q)) is None:
            return f"attention output dtype {node_value(out).dtype} differs from q's {dtype}"
        dtype = node_value(out).dtype   # autocast ran the matmuls in its dtype: the rewrite casts q, k, v to it
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


rules_attention = (Rule("sdpa", _match_sdpa), Rule("softmax_chain", _match_softmax_chain))


def drop_causal_sdpa_masks(gm: fx.GraphModule, single_document: frozenset = frozenset()) -> fx.GraphModule:
    """A copy of `gm` where each F.scaled_dot_product_attention call whose attn_mask is proved
    plainly causal (no document, window or per-key bias) takes is_causal=True without it, and its
    grouped k, v unrepeated (enable_gqa=True), as transformers' eager forward calls it: what a
    traced forward runs where it could not drop the mask (with a mask transformers repeats k and v
    to every head, and autograd saves them so); kept repeated where CUDA would run grouped ones on
    its math kernel (fp32). A copy: a static capture is Dynamo's, reused by the next capture at
    these shapes. `single_document`: names of position_ids inputs whose batch holds one document a
    row; eager transformers finds no packed rows there and skips their document mask too (for a
    prediction of that batch only: a later batch may be packed)."""
    gm = clone(gm)
    seq = seq_info(gm, None)
    ctx = PassContext(regions=find_regions(gm, seq), seq=seq)
    for n in list(gm.graph.nodes):
        m = _match_sdpa(n, ctx)
        if (isinstance(m, Match) and m.causal and m.removes_dense and m.window is None and m.key_bias is None
                and (m.positions is None or m.positions.name in single_document)):
            a = match.named_args(n, SDPA_ARGS)
            q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
            if m.k is not k and m.v is not v and not grouped_on_cuda_math(node_value(q), node_value(m.k)):
                k, v, a["enable_gqa"] = m.k, m.v, True
            n.args = (q, k, v)
            n.kwargs = {**a, "attn_mask": None, "is_causal": True}
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
