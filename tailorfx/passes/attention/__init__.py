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

import dataclasses
from typing import Optional, Union

import torch.fx as fx

from tailorfx.attention import SPECS, AttentionSpec, Dilated, Exact, SlidingWindow, spec_params
from tailorfx.passes import register
from tailorfx.passes.attention.rewrite import NAME, rewrite_match
from tailorfx.passes.attention.rules import Match, rules_attention
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext, PassResult


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


def region_matches(gm: fx.GraphModule, ctx: PassContext, erased: set = frozenset()):
    """(attention region, what the first matching rule said of each of its nodes: a Match or why
    not), region by region; nodes in `erased` (rewritten away, read when the region is reached)
    are skipped."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for region in ctx.regions.of_kind("attention"):
        found = []
        for name in region.nodes:
            for rule in rules_attention:
                got = None if name in erased else rule.match(nodes[name], ctx)
                if got is not None:
                    found.append(got)
                    break
        yield region, found


def grouped_query(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether an attention the pass would rewrite has fewer kv heads than query heads (GQA)."""
    return any(isinstance(got, Match) and node_value(got.k).shape[1] != node_value(got.q).shape[1]
               for _, found in region_matches(gm, ctx) for got in found)


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
        self.kernel = options.get("attention_kernel") or "auto"
        self.inductor = options.get("lowering") == "inductor"
        self.training = options.get("training", True) is not False

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        stats, touched, skipped, erased, made = {}, [], [], set(), {}
        for region, found in region_matches(gm, ctx, erased):
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
                _, kernel = rewrite_match(gm, got, kind, params, erased, made, self.kernel, self.inductor,
                                          self.training)
                touched.append(region.path)
                stats[region.path] = _stats(got, kind, params) | {"kernel": kernel}
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
