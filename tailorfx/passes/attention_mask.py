"""Proving an attention mask causal: the mask's subgraph is evaluated at small lengths (and past
the integer constants it holds) and compared with the causal mask; an attention whose mask is not
proved causal is left as it was.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext
from tailorfx.rewrite.regions import is_param

# Lengths at which a mask is evaluated to prove it causal; integer constants in the mask's
# subgraph (a window, an offset) add lengths past them, up to MAX_CHECK_LEN.
CHECK_LENGTHS = (1, 2, 3, 5, 8, 13)
MAX_CHECK_LEN = 512


def _mask_subgraph(ctx: PassContext, out: fx.Node, x: Optional[fx.Node]):
    """(nodes producing `out` from the sequence length alone, in graph order; their size leaves;
    int-valued nodes -> their value), or why `out` depends on more (an attention_mask input...)."""
    nodes, leaves, consts, seen, stack = [], [], {}, set(), [out]
    while stack:
        n = stack.pop()
        if n in seen or n is x:
            continue
        seen.add(n)
        val = node_value(n)
        if isinstance(val, torch.SymInt):
            if ctx.seq.symbol is None or compat.sym_expr(val) != ctx.seq.symbol:
                return f"mask depends on size {n.name} = {compat.sym_expr(val)}, not the sequence length"
            leaves.append(n)
            continue
        if type(val) is int:   # a size the graph was specialised on
            consts[n] = val
            continue
        if n.op in ("placeholder", "get_attr"):
            what = "parameter or buffer" if is_param(n) else "graph input"
            return (f"mask depends on {what} {n.name} (a padding attention_mask?): it cannot be "
                    "proved causal, so attention is left as it is")
        if match.draws_random(n):
            return f"mask uses random op {n.name}"
        nodes.append(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    why = _mutation(nodes)
    return why if why else (nodes, leaves, consts)


_VIEW_OPS = frozenset({"getitem", "view", "reshape", "expand", "expand_as", "view_as", "transpose",
                       "permute", "unsqueeze", "squeeze", "narrow", "select", "t", "contiguous", "to",
                       "type", "detach", "as_strided", "unflatten", "flatten", "movedim", "swapaxes",
                       "diagonal", "split", "chunk", "unbind", "float", "bool"})


def _mutation(nodes: list[fx.Node]) -> Optional[str]:
    """Why a value of the mask (or a view of one) is written in place later, if it is: evaluating
    the nodes that produce it would then not give the mask attention sees."""
    stack, seen = list(nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if _writes(u, n):
                return f"the mask ({n.name}) is modified in place by {u.name} ({match.op_name(u)})"
            if u.args and u.args[0] is n and match.op_name(u) in _VIEW_OPS:
                stack.append(u)
    return None


_INPLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.imatmul})


def _writes(u: fx.Node, n: fx.Node) -> bool:
    """Whether node u writes into n: x.add_(...), x[i] = v, x |= m, an ATen op mutating x, out=x."""
    if u.kwargs.get("out") is n:
        return True
    if not u.args or u.args[0] is not n:
        return False
    t = u.target
    if u.op == "call_method":
        return (t.endswith("_") and not t.startswith("_")) or t.startswith("__i")
    if compat.is_op_overload(t):
        return compat.op_is_mutable(t)
    if t in _INPLACE_OPERATORS:
        return True
    name = getattr(t, "__name__", "")
    return u.op == "call_function" and getattr(t, "__module__", "") != "_operator" and name.endswith("_") \
        and not name.startswith("_")


def _check_lengths(ctx: PassContext, nodes: list[fx.Node], leaves: list) -> Union[list[int], str]:
    """Lengths that decide causality: small ones, and ones past every integer constant used."""
    if not leaves:
        return []   # a static graph: its one length is checked
    consts: list[int] = []
    for n in nodes:
        fx.node.map_aggregate((n.args, n.kwargs), lambda a: consts.append(abs(a)) if type(a) is int else None)
    c = max(consts, default=0)
    if 2 * c + 1 > MAX_CHECK_LEN:
        return (f"mask uses the constant {c}: proving it causal needs lengths past it "
                f"(over {MAX_CHECK_LEN}); a window or offset, left unchanged")
    return sorted(set(CHECK_LENGTHS) | {c + 1, c + 2, 2 * c + 1} |
                  ({ctx.seq.length} if 0 < ctx.seq.length <= MAX_CHECK_LEN else set()))


def _masked_floor(dtype: torch.dtype) -> float:
    """Scores at or below this are masked exactly: softmax gives them a probability of 0."""
    fi = torch.finfo(dtype)
    return fi.min * (1e-4 if fi.max > 1e30 else 0.45)


def _prove_causal(ctx: PassContext, x: Optional[fx.Node], out: fx.Node, scale: float,
                  dtype: torch.dtype, combine: Optional[Callable]) -> tuple[str, Optional[str]]:
    """(lengths checked, None) if at every length checked the masked scores `out`, a function of
    the raw scores x and of the sequence length only, equal x * scale where key <= query and are
    -inf or about the dtype minimum where key > query; else ("", why not). `combine(mask, x)`
    applies a mask node as SDPA applies its attn_mask."""
    found = _mask_subgraph(ctx, out, x)
    if isinstance(found, str):
        return "", found
    nodes, leaves, consts = found
    lengths = _check_lengths(ctx, nodes, leaves)
    if isinstance(lengths, str):
        return "", lengths
    text = ",".join(map(str, lengths)) or "static"
    g = fx.Graph()
    env: dict[fx.Node, Any] = dict(consts)
    for leaf in leaves:
        env[leaf] = g.placeholder(leaf.name)
    x_in = g.placeholder("scores")
    if x is not None:
        env[x] = x_in
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    fn = fx.GraphModule(torch.nn.Module(), g)
    if not lengths:   # static shapes: the length the graph was traced at
        ref = node_value(x if x is not None else out)
        lengths = [int(ref.shape[-1])]
    gen = torch.Generator().manual_seed(0)
    for L in lengths:
        xs = torch.randn(1, 1, L, L, generator=gen).to(dtype) * 4
        try:
            with torch.no_grad():
                got = fn(*([L] * len(leaves)), xs)
                if combine is not None:
                    got = combine(got, xs * scale)
        except Exception as e:  # a mask we cannot run on its own is a mask we cannot prove
            return "", f"mask could not be evaluated at S={L}: {type(e).__name__}: {str(e)[:80]}"
        if not isinstance(got, torch.Tensor) or got.dim() < 2 or tuple(got.shape[-2:]) != (L, L):
            return "", f"masked scores at S={L} have shape {tuple(getattr(got, 'shape', ()))}"
        want = (xs * scale).expand_as(got).to(got.dtype)
        keep = torch.ones(L, L, dtype=torch.bool).tril().expand_as(got)
        masked = torch.isneginf(got) | (got <= _masked_floor(got.dtype))
        if (masked & keep).any():
            return "", f"mask hides past keys at S={L} (padding, a window or a custom mask): not plain causal"
        if (~masked & ~keep).any():
            v = got[~keep & ~masked].flatten()[0].item()
            return "", f"mask lets queries see later keys at S={L} (score {v:.3g}): not causal"
        eps = torch.finfo(got.dtype).eps
        if not torch.allclose(got[keep], want[keep], rtol=8 * eps, atol=0):
            return "", f"mask changes the scores it keeps at S={L} (a bias such as ALiBi)"
    return text, None
