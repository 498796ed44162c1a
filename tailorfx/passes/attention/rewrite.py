"""The one rewriter: a Match becomes one attention_call (document ids and a dropout seed computed
in the graph where it needs them; on CUDA, a mask SDPA has no kernel for goes to the Triton flash
kernel), and what only the old attention read is erased.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from tailorfx.attention import attention_call, draw_seed
from tailorfx.passes.attention.documents import DOC_RULES
from tailorfx.passes.attention.rules import Match
from tailorfx.rewrite.capture import autocast_of, node_value
from tailorfx.rewrite.passes import annotate, insert_cast

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


KERNELS = ("auto", "flex", "triton")   # optimize(attention_kernel=...)


def _kernel_for(m: Match, kwargs: dict, wanted: str = "auto", inductor: bool = False,
                training: bool = True) -> tuple[Callable, dict, str]:
    """(the call, its keyword arguments, what the report says). A form torch's SDPA runs stays
    attention_call (SDPA's flash kernel on a GPU). On CUDA, a mask SDPA has no kernel for (a window,
    packed documents, a soft-cap, ALiBi) runs on the Triton flash kernel or, under Inductor, on
    FlexAttention: the faster at this form and shape, timed once (`wanted="auto"`), or the one asked
    for. Elsewhere the runtime's tiles (a Python loop per tile on the CPU), or FlexAttention when
    asked: on the CPU that is torch's unfused reference, to check the form, not to train long."""
    from tailorfx.runtime.flex import flex_attention, flex_supports
    q = node_value(m.q)
    flex_why = flex_supports(kwargs)
    if wanted == "flex" and flex_why is None:
        if inductor and not _on_cuda(q) and training:
            raise ValueError("attention_kernel='flex' with lowering='inductor' on the CPU: Inductor has no CPU "
                             "FlexAttention backward. Train on a GPU, or pass lowering='eager' (torch's unfused "
                             "FlexAttention, to check a form), or leave attention_kernel='auto'")
        fused = _on_cuda(q) and inductor
        where = "" if fused else ": torch's unfused reference (S x S scores; fused by Inductor on a GPU)"
        return flex_attention, kwargs, f"FlexAttention (asked){where}"
    sdpa = kwargs["kind"] == "Exact" and not kwargs["params"] and "document_ids" not in kwargs
    if sdpa or not _on_cuda(q):
        return attention_call, kwargs, ("SDPA" if sdpa else "tiles") + (f"; not FlexAttention: {flex_why}"
                                                                        if wanted == "flex" else "")
    from tailorfx.runtime.triton_ops import triton_attention, triton_attention_kwargs, triton_attention_supports
    triton_why = triton_attention_supports(kwargs)
    flex_why = flex_why or (None if inductor else "FlexAttention is fused only under the Inductor lowering")
    if triton_why is not None and flex_why is not None:   # a per-key bias with a gradient, dropout: the tiles
        return attention_call, kwargs, f"tiles (Triton: {triton_why}; FlexAttention: {flex_why})"
    if flex_why is not None or wanted == "triton":
        if triton_why is None:
            return triton_attention, triton_attention_kwargs(kwargs), "Triton flash kernel" + (
                " (asked)" if wanted == "triton" else f"; not FlexAttention: {flex_why}")
        return attention_call, kwargs, f"tiles (asked for Triton: {triton_why})"
    if triton_why is not None:
        return flex_attention, kwargs, f"FlexAttention; not Triton: {triton_why}"
    name, why = _measured(q, node_value(m.k), kwargs)
    if name == "flex":
        return flex_attention, kwargs, f"FlexAttention ({why})"
    return triton_attention, triton_attention_kwargs(kwargs), f"Triton flash kernel ({why})"


def _measured(q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> tuple[str, str]:
    """'flex' or 'triton' for this form and shape on this GPU, and how it was decided: timed forward
    and backward once per key (kernels/tuning.py keeps it), else the remembered choice, else the
    Triton kernel, saying why it was not timed."""
    from tailorfx.kernels import tuning
    from tailorfx.runtime import flex
    from tailorfx.runtime.triton_ops import triton_attention, triton_attention_kwargs
    key = "attention_kernel " + flex.form_key(q, k, kwargs)
    known = tuning.known_pick(key, ("flex", "triton"))
    if known is not None:
        return known, "chosen by measurement: " + key
    if not torch.cuda.is_available():
        return "triton", "not timed: no GPU here"
    if not tuning.enabled():
        return "triton", "not timed: TAILORFX_AUTOTUNE=0"
    if not flex.memory_ok(q, k):
        return "triton", "not timed: timing at this shape would take over a quarter of the free memory"
    compiled = torch.compile(flex.flex_attention, fullgraph=True, dynamic=False)
    runs = {"triton": lambda q, k, v, **kw: triton_attention(q, k, v, **triton_attention_kwargs(kw)),
            "flex": compiled}
    try:
        return flex.pick(q, k, kwargs, runs, key), "chosen by measurement: " + key
    except Exception as e:   # noqa: BLE001 - neither ran: keep the kernel the pass always had, and say why
        return "triton", f"not timed: {type(e).__name__}: {e}"


def rewrite_match(gm: fx.GraphModule, m: Match, kind: str, params: tuple, erased: set[str],
                  made: dict, wanted: str = "auto", inductor: bool = False,
                  training: bool = True) -> tuple[fx.Node, str]:
    """m.out replaced by one attention_call of the spec (kind, params), or the kernel `_kernel_for`
    chooses; what only the old attention read is erased (its names added to `erased`). Returns the
    new node and what runs it."""
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
    m = _cast_as_autocast(gm, m)
    target, kwargs, kernel = _kernel_for(m, kwargs, wanted, inductor, training)
    with gm.graph.inserting_before(m.out):
        new = gm.graph.call_function(target, (m.q, m.k, m.v), kwargs)
        if m.folded:   # the (B, H, S, D) result as the (B * H, S, D) the bmm made
            annotate(new, m.out, val=node_value(m.q).new_empty(node_value(m.q).shape), pass_name=NAME)
            new = gm.graph.call_method("flatten", (new, 0, 1))
    annotate(new, m.out, pass_name=NAME)
    m.out.replace_all_uses_with(new)
    _erase_dead(gm, m.out, erased)
    return new, kernel


def _cast_as_autocast(gm: fx.GraphModule, m: Match) -> Match:
    """Under torch.autocast, q, k and v cast to the dtype the attention they replace computed in
    (its output's: SDPA, and an eager spelling's matmuls, run in autocast's dtype): the kernels
    that replace it are custom ops, which autocast does not cast."""
    out = node_value(m.out)
    if autocast_of(node_value(m.q)) is None or not isinstance(out, torch.Tensor):
        return m
    cast = {}
    for name in ("q", "k", "v"):
        if node_value(getattr(m, name)).dtype != out.dtype:
            cast[name] = insert_cast(gm, getattr(m, name), out.dtype, m.out, pass_name=NAME)
    return dataclasses.replace(m, **cast) if cast else m


def _fake_seed(q: fx.Node):
    """The fake value of a draw_seed() node: an int64 scalar on the CPU, in q's fake mode."""
    fake = node_value(q)
    mode = getattr(fake, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty((), dtype=torch.int64, device="cpu")
