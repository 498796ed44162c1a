"""An attention mask on its own: the subgraph producing it (or why it depends on more than sizes
and graph inputs), an evaluator running that subgraph on small CPU tensors, and the check that what
it keeps is a wanted pattern. mask.py and documents.py build their proofs from these.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional, Union

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
# A static graph's mask is evaluated at the graph's own length up to this; past it (S x S tensors
# of gigabytes at 32K), at the lengths above, that length replaced by each in the mask's arguments.
STATIC_EVAL_LEN = 2048


@dataclass(frozen=True)
class Subgraph:
    nodes: list            # the nodes producing the mask, in graph order
    leaves: list           # SymInt nodes the mask reads (sizes)
    consts: dict           # int-valued nodes -> their value
    inputs: list           # graph-input tensors the mask reads (a padding mask, position_ids)
    blocker: Optional[str]  # why the mask is not a function of the sequence length alone, if so
    symbol: Any = None     # the sequence length's symbol, which the size leaves are functions of

    def sizes(self, L: int) -> list[int]:
        """The size leaves' values at sequence length L (s, or Max(0, M - s) for a table of M
        sliced to its last s entries)."""
        return leaf_sizes(self.leaves, {self.symbol: L})


def leaf_sizes(leaves: list, values: dict) -> list[int]:
    """The values of size leaves (SymInt nodes) with their symbols replaced by `values`."""
    return [int(compat.sym_expr(node_value(leaf)).subs(values)) for leaf in leaves]


def mask_subgraph(ctx: PassContext, out: fx.Node, x: Optional[fx.Node]) -> Union[Subgraph, str]:
    """The nodes producing `out` from sizes and graph inputs, or why it depends on more
    (parameters, random ops, an in-place write). `blocker` is the first reason, in the order the
    walk meets them, that `out` is not a function of the sequence length alone (a graph input or
    another size): what the causal proof reports; the document proof may still go on."""
    nodes, leaves, consts, inputs, seen, stack = [], [], {}, [], set(), [out]
    first: Optional[str] = None
    while stack:
        n = stack.pop()
        if n in seen or n is x:
            continue
        seen.add(n)
        val = node_value(n)
        if isinstance(val, torch.SymInt):
            if ctx.seq.symbol is None or not compat.sym_expr(val).free_symbols <= {ctx.seq.symbol}:
                first = first or f"mask depends on size {n.name} = {compat.sym_expr(val)}, not the sequence length"
            leaves.append(n)
            continue
        if type(val) is int:   # a size the graph was specialised on
            consts[n] = val
            continue
        if n.op in ("placeholder", "get_attr"):
            what = "parameter or buffer" if is_param(n) else "graph input"
            why = (f"mask depends on {what} {n.name} (a padding attention_mask?): it cannot be "
                   "proved causal, so attention is left as it is")
            if n.op == "get_attr" or is_param(n):
                return first or why
            first = first or why
            inputs.append(n)
            continue
        if match.draws_random(n):
            return first or f"mask uses random op {n.name}"
        nodes.append(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    why = _mutation(nodes)
    if why:
        return first or why
    return Subgraph(nodes, leaves, consts, inputs, first, ctx.seq.symbol)


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


def largest_constant(nodes: list[fx.Node], skip: Optional[int] = None) -> int:
    """The largest |integer| in the nodes' arguments (a window, an offset, a size) other than
    +-`skip` (a static graph's length) and the bounds of a table sliced to the length (its extent
    M, M - 1 and M + 1: `table_extents`), 0 if none."""
    consts: list[int] = []
    for n in nodes:
        fx.node.map_aggregate((n.args, n.kwargs), lambda a: consts.append(abs(a)) if type(a) is int else None)
    bounds = {abs(skip)} if skip is not None else set()
    bounds |= {b for m in table_extents(nodes) for b in (m - 1, m, m + 1)}
    return max((c for c in consts if c not in bounds), default=0)


_SLICES = frozenset({"getitem", "slice", "narrow"})


def table_extents(nodes: Collection[fx.Node]) -> set[int]:
    """The fixed lengths M of tables built at a maximum and sliced to the sequence (a mask of
    M x M sliced [:s, :s], an ALiBi table sliced to its last s keys): a dim of static size M that
    a slice among `nodes` cuts to a symbolic size. Its M is the table's bound, not a window: the
    mask is evaluated as built, at lengths up to M (the graph's guards hold s <= M)."""
    out: set[int] = set()
    for n in nodes:
        if match.op_name(n) not in _SLICES or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        src, val = node_value(n.args[0]), node_value(n)
        if isinstance(src, torch.Tensor) and isinstance(val, torch.Tensor) and src.dim() == val.dim():
            out |= {a for a, b in zip(src.shape, val.shape) if type(a) is int and isinstance(b, torch.SymInt)}
    return out


def masked_scores(fn: fx.GraphModule, args: list, L: int, gen: torch.Generator, dtype: torch.dtype,
                  scale: float, combine: Optional[Callable]) -> tuple[torch.Tensor, Any]:
    """(random scores xs (1, 1, L, L), the mask evaluator's masked scores for them): fn(*args, xs),
    with `combine` applying a mask node as SDPA applies its attn_mask."""
    xs = torch.randn(1, 1, L, L, generator=gen).to(dtype) * 4
    with torch.no_grad():
        got = fn(*args, xs)
        return xs, (combine(got, xs * scale) if combine is not None else got)


@dataclass(frozen=True)
class Lengths:
    """The lengths a mask is evaluated at. `static`: a static graph's length, replaced by each of
    them in the mask's arguments (None: the mask reads the length as a SymInt, or is evaluated at
    its own static length)."""
    values: list
    text: str
    static: Optional[int] = None

    def subst(self, L: int) -> dict:
        """The integer arguments to replace when evaluating at L."""
        return length_subst(self.static, L)


def length_subst(static: Optional[int], L: int) -> dict:
    """A static graph's length (and its negation) -> L, to evaluate its mask at L; {} for None."""
    return {} if static is None else {static: L, -static: -L}


def static_length(sub: Subgraph, x: Optional[fx.Node], out: fx.Node) -> Optional[int]:
    """The length of a mask that reads no size (a static graph's), None for one that does."""
    return None if sub.leaves else int(node_value(x if x is not None else out).shape[-1])


def check_lengths(ctx: PassContext, nodes: list[fx.Node], static: Optional[int]) -> Union[Lengths, str]:
    """Lengths that decide causality: small ones, and ones past every integer constant used. A
    static graph's mask (of length `static`) is evaluated at that length up to STATIC_EVAL_LEN,
    past it as a dynamic one is, with its length replaced."""
    dynamic = static is None
    if not dynamic and static <= STATIC_EVAL_LEN:
        return Lengths([static], "static")
    c = largest_constant(nodes, skip=static)
    if 2 * c + 1 > MAX_CHECK_LEN:
        return (f"mask uses the constant {c}: proving it causal needs lengths past it "
                f"(over {MAX_CHECK_LEN}); a window or offset, left unchanged")
    values = sorted(set(CHECK_LENGTHS) | {c + 1, c + 2, 2 * c + 1} |
                    ({ctx.seq.length} if dynamic and 0 < ctx.seq.length <= MAX_CHECK_LEN else set()))
    extents = table_extents(nodes)
    values = [v for v in values if v <= min(extents, default=v)]   # the lengths its tables hold
    text = ",".join(map(str, values)) + (f" (tables of {','.join(map(str, sorted(extents)))} sliced to each)"
                                         if extents else "")
    return Lengths(values, text if dynamic else f"{text} (static length {static} replaced by each)", static)


def masked_floor(dtype: torch.dtype) -> float:
    """Scores at or below this are masked exactly: softmax gives them a probability of 0."""
    fi = torch.finfo(dtype)
    return fi.min * (1e-4 if fi.max > 1e30 else 0.45)


def _to_cpu(v: Any) -> Any:
    """A device (or device string) as the CPU, a tensor on it; anything else as it is."""
    if isinstance(v, torch.device) or (isinstance(v, str) and v.split(":")[0] in ("cuda", "xpu", "mps")):
        return torch.device("cpu")
    if isinstance(v, torch.Tensor):
        return v.cpu()
    if isinstance(v, (tuple, list)):
        return type(v)(_to_cpu(a) for a in v)
    if isinstance(v, dict):
        return {k: _to_cpu(a) for k, a in v.items()}
    return v


def evaluator(sub: Subgraph, x: Optional[fx.Node], out: fx.Node, subst: Optional[dict] = None) -> fx.GraphModule:
    """The mask's nodes on their own: (*size leaves, *graph inputs, scores) -> masked scores, on
    the CPU whatever device the model is on (the proof evaluates it on small CPU tensors; the
    `device=` of a CUDA model's aranges and `.to(device)` calls would mix the two). `subst`
    replaces integer constants in the nodes' arguments (a window by a small one, a static graph's
    length by the one evaluated)."""
    g = fx.Graph()
    env: dict[fx.Node, Any] = {k: _to_cpu(subst.get(v, v) if subst and type(v) is int else v)
                               for k, v in sub.consts.items()}
    for leaf in sub.leaves:
        env[leaf] = g.placeholder(leaf.name)
    for inp in sub.inputs:
        env[inp] = g.placeholder(inp.name)
    x_in = g.placeholder("scores")
    if x is not None:
        env[x] = x_in
    for n in sub.nodes:
        new = g.node_copy(n, lambda a: env[a])
        new.args, new.kwargs = _to_cpu(new.args), _to_cpu(new.kwargs)
        if subst:
            new.args, new.kwargs = fx.node.map_aggregate(
                (new.args, new.kwargs), lambda a: subst.get(a, a) if type(a) is int else a)
        env[n] = new
    g.output(env[out])
    return fx.GraphModule(torch.nn.Module(), g)


def compare(got: Any, xs: torch.Tensor, scale: float, keep: torch.Tensor, L: int,
            documents: Optional[str] = None) -> Optional[str]:
    """Why the masked scores `got` are not xs * scale where `keep` and masked (-inf, or at most
    the dtype's floor) elsewhere; None when they are. `keep` broadcasts against `got`. With
    `documents` (where the mask was evaluated: the length and position_ids) the reasons speak of
    documents."""
    shape = None
    if isinstance(got, torch.Tensor) and got.dim() >= 2 and tuple(got.shape[-2:]) == (L, L):
        try:
            shape = torch.broadcast_shapes(got.shape, keep.shape)
        except RuntimeError:
            pass
    if shape is None:
        return f"masked scores at S={L} have shape {tuple(getattr(got, 'shape', ()))}"
    got = got.expand(shape)
    want = (xs * scale).expand(shape).to(got.dtype)
    keep = keep.expand(shape)
    masked = torch.isneginf(got) | (got <= masked_floor(got.dtype))
    if (masked & keep).any():
        if documents:
            return f"at {documents} it hides keys of the query's own document (padding, a window or a custom mask)"
        return f"mask hides past keys at S={L} (padding, a window or a custom mask): not plain causal"
    if (~masked & ~keep).any():
        v = got[~keep & ~masked].flatten()[0].item()
        if documents:
            return f"at {documents} it lets queries see later keys or keys of other documents (score {v:.3g})"
        return f"mask lets queries see later keys at S={L} (score {v:.3g}): not causal"
    eps = torch.finfo(got.dtype).eps
    if not torch.allclose(got[keep], want[keep], rtol=8 * eps, atol=0):
        return f"mask changes the scores it keeps at {documents or f'S={L}'} (a bias such as ALiBi)"
    return None
