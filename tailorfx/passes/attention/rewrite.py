"""The one rewriter: a Match becomes one attention_call (document ids and a dropout seed computed
in the graph where it needs them; on CUDA, a mask SDPA has no kernel for goes to the Triton flash
kernel), and what only the old attention read is erased.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx as fx

from tailorfx.attention import attention_call, draw_seed
from tailorfx.passes.attention.documents import DOC_RULES
from tailorfx.passes.attention.rules import Match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import annotate

NAME = "attention"


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


def _on_cuda(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _kernel_for(m: Match, kwargs: dict) -> tuple[Callable, dict]:
    """attention_call, or on CUDA the Triton flash kernel for what torch's SDPA has no kernel for
    (a sparse spec, packed documents, a soft-cap): the runtime's tile engine is the CPU path (a
    Python loop per tile, host copies of the document ids)."""
    sdpa = kwargs["kind"] == "Exact" and not kwargs["params"] and "document_ids" not in kwargs
    if sdpa or not _on_cuda(node_value(m.q)):
        return attention_call, kwargs
    from tailorfx.runtime.triton_ops import triton_attention, triton_attention_kwargs, triton_attention_supports
    if triton_attention_supports(kwargs) is not None:   # a per-key bias, dropout: the tiles
        return attention_call, kwargs
    return triton_attention, triton_attention_kwargs(kwargs)


def rewrite_match(gm: fx.GraphModule, m: Match, kind: str, params: tuple, erased: set[str],
                  made: dict) -> fx.Node:
    """m.out replaced by one attention_call of the spec (kind, params); what only the old attention
    read is erased (its names added to `erased`)."""
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
    target, kwargs = _kernel_for(m, kwargs)
    with gm.graph.inserting_before(m.out):
        new = gm.graph.call_function(target, (m.q, m.k, m.v), kwargs)
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
