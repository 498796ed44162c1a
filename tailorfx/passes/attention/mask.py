"""Proving an attention mask causal: the mask's subgraph is evaluated at small lengths (and past
the integer constants it holds) and compared with the causal mask; an attention whose mask is not
proved causal is left as it was.

Packed sequences: a mask built from the sequence length and ONE (B, S) integer graph input -- the
position_ids of a packed batch, from which transformers' `create_causal_mask` builds a
block-diagonal causal mask -- is proved a document mask instead (`prove_mask`): evaluated on random
position_ids, it must keep exactly key <= query within the query's document, where the documents
are those of one of DOC_RULES (transformers' rule first). The attention pass then computes the same
document ids in the graph from that input and hands them to the kernel.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Subgraph:
    nodes: list            # the nodes producing the mask, in graph order
    leaves: list           # SymInt nodes the mask reads (sizes)
    consts: dict           # int-valued nodes -> their value
    inputs: list           # graph-input tensors the mask reads (a padding mask, position_ids)
    blocker: Optional[str]  # why the mask is not a function of the sequence length alone, if so


def _mask_subgraph(ctx: PassContext, out: fx.Node, x: Optional[fx.Node]) -> Union[_Subgraph, str]:
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
            if ctx.seq.symbol is None or compat.sym_expr(val) != ctx.seq.symbol:
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
    return _Subgraph(nodes, leaves, consts, inputs, first)


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


def _largest_constant(nodes: list[fx.Node]) -> int:
    """The largest |integer| in the nodes' arguments (a window, an offset, a size), 0 if none."""
    consts: list[int] = []
    for n in nodes:
        fx.node.map_aggregate((n.args, n.kwargs), lambda a: consts.append(abs(a)) if type(a) is int else None)
    return max(consts, default=0)


def _masked_scores(fn: fx.GraphModule, args: list, L: int, gen: torch.Generator, dtype: torch.dtype,
                   scale: float, combine: Optional[Callable]) -> tuple[torch.Tensor, Any]:
    """(random scores xs (1, 1, L, L), the mask evaluator's masked scores for them): fn(*args, xs),
    with `combine` applying a mask node as SDPA applies its attn_mask."""
    xs = torch.randn(1, 1, L, L, generator=gen).to(dtype) * 4
    with torch.no_grad():
        got = fn(*args, xs)
        return xs, (combine(got, xs * scale) if combine is not None else got)


def _check_lengths(ctx: PassContext, nodes: list[fx.Node], dynamic: Any) -> Union[list[int], str]:
    """Lengths that decide causality: small ones, and ones past every integer constant used; []
    for a mask whose length is not `dynamic` (a static graph: its one length is checked)."""
    if not dynamic:
        return []
    c = _largest_constant(nodes)
    if 2 * c + 1 > MAX_CHECK_LEN:
        return (f"mask uses the constant {c}: proving it causal needs lengths past it "
                f"(over {MAX_CHECK_LEN}); a window or offset, left unchanged")
    return sorted(set(CHECK_LENGTHS) | {c + 1, c + 2, 2 * c + 1} |
                  ({ctx.seq.length} if 0 < ctx.seq.length <= MAX_CHECK_LEN else set()))


def _masked_floor(dtype: torch.dtype) -> float:
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


def _evaluator(sub: _Subgraph, x: Optional[fx.Node], out: fx.Node, subst: Optional[dict] = None) -> fx.GraphModule:
    """The mask's nodes on their own: (*size leaves, *graph inputs, scores) -> masked scores, on
    the CPU whatever device the model is on (the proof evaluates it on small CPU tensors; the
    `device=` of a CUDA model's aranges and `.to(device)` calls would mix the two). `subst`
    replaces integer constants in the nodes' arguments (a window, by a small one)."""
    g = fx.Graph()
    env: dict[fx.Node, Any] = {k: _to_cpu(v) for k, v in sub.consts.items()}
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


def _compare(got: Any, xs: torch.Tensor, scale: float, keep: torch.Tensor, L: int,
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
    masked = torch.isneginf(got) | (got <= _masked_floor(got.dtype))
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


def _prove_causal(ctx: PassContext, x: Optional[fx.Node], out: fx.Node, scale: float,
                  dtype: torch.dtype, combine: Optional[Callable]) -> tuple[str, Optional[str]]:
    """(lengths checked, None) if at every length checked the masked scores `out`, a function of
    the raw scores x and of the sequence length only, equal x * scale where key <= query and are
    -inf or about the dtype minimum where key > query; else ("", why not). `combine(mask, x)`
    applies a mask node as SDPA applies its attn_mask."""
    found = _mask_subgraph(ctx, out, x)
    if isinstance(found, str):
        return "", found
    if found.blocker:
        return "", found.blocker
    return _causal_proof(ctx, found, x, out, scale, dtype, combine)


def _causal_proof(ctx: PassContext, sub: _Subgraph, x: Optional[fx.Node], out: fx.Node, scale: float,
                  dtype: torch.dtype, combine: Optional[Callable]) -> tuple[str, Optional[str]]:
    lengths = _check_lengths(ctx, sub.nodes, sub.leaves)
    if isinstance(lengths, str):
        return "", lengths
    text = ",".join(map(str, lengths)) or "static"
    fn = _evaluator(sub, x, out)
    if not lengths:   # static shapes: the length the graph was traced at
        ref = node_value(x if x is not None else out)
        lengths = [int(ref.shape[-1])]
    gen = torch.Generator().manual_seed(0)
    for L in lengths:
        try:
            xs, got = _masked_scores(fn, [L] * len(sub.leaves), L, gen, dtype, scale, combine)
        except Exception as e:  # a mask we cannot run on its own is a mask we cannot prove
            return "", f"mask could not be evaluated at S={L}: {type(e).__name__}: {str(e)[:80]}"
        why = _compare(got, xs, scale, torch.ones(L, L, dtype=torch.bool).tril(), L)
        if why:
            return "", why
    return text, None


# ---- sliding windows: a mask whose constant is too large to evaluate past -------------------------
WINDOW_PROBES = (3, 5)   # the constant replaced by each of these; the mask must be that window each time


def _window_proof(ctx: PassContext, sub: _Subgraph, x: Optional[fx.Node], out: fx.Node, scale: float,
                  dtype: torch.dtype, combine: Optional[Callable]) -> Union[tuple[str, int], str]:
    """(lengths checked, w) if the mask is a causal sliding window of w keys (query i keeps keys
    i - w < j <= i), w its largest integer constant c plus a fixed offset (`j > i - c`: w = c;
    `j >= i - c`: w = c + 1): with c replaced by each of WINDOW_PROBES, c', the mask evaluated at
    lengths past its window is exactly a window of c' + d, the same d for every probe (a constant
    used as a window is used the same way whatever its value); else why not."""
    c = _largest_constant(sub.nodes)
    texts, offsets = [], set()
    gen = torch.Generator().manual_seed(0)
    for probe in WINDOW_PROBES:
        fn = _evaluator(sub, x, out, {c: probe, -c: -probe})

        def masked(L: int):
            return _masked_scores(fn, [L] * len(sub.leaves), L, gen, dtype, scale, combine)
        lengths = sorted(set(CHECK_LENGTHS) | {probe + 1, probe + 2, 2 * probe + 1, 3 * probe + 4})
        try:
            _, got = masked(lengths[-1])
            if not isinstance(got, torch.Tensor) or got.dim() < 2:
                return f"with its constant {c} as {probe} the mask is not a (.., S, S) tensor"
            last = got.reshape(-1, lengths[-1], lengths[-1])[0, -1]
            w = int((~(torch.isneginf(last) | (last <= _masked_floor(last.dtype)))).sum())
            for L in lengths:
                xs, got = masked(L)
                i = torch.arange(L)
                keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
                why = _compare(got, xs, scale, keep, L)
                if why:
                    return f"with its constant {c} as {probe}, it is not a sliding window of {w}: {why}"
        except Exception as e:
            return f"mask with its constant {c} as {probe} could not be evaluated: {type(e).__name__}"
        offsets.add(w - probe)
        texts.append(f"{c}->{probe}: window {w} at S={','.join(map(str, lengths))}")
    if len(offsets) != 1 or c + next(iter(offsets)) < 1:
        return f"its window does not follow its constant {c} ({'; '.join(texts)})"
    return "; ".join(texts), c + offsets.pop()


# ---- packed sequences: masks built from position_ids -------------------------------------------
def _documents_by_step(position_ids: torch.Tensor) -> torch.Tensor:
    """transformers' find_packed_sequence_indices: a document starts wherever a position is not
    the previous position + 1 (the first token continues document 0)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def _documents_by_restart(position_ids: torch.Tensor) -> torch.Tensor:
    """A document starts at every position 0."""
    return (position_ids == 0).cumsum(-1)


# name -> (B, S) position_ids -> (B, S) document ids (equal ids: same document). Tried in this order;
# the attention pass computes the proved one in the graph (these functions, traced).
DOC_RULES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "step": _documents_by_step, "restart": _documents_by_restart}
DOC_RULE_TEXT = {"step": "a document starts where a position is not the previous one + 1",
                 "restart": "a document starts at each position 0"}
# Position patterns per length checked: packed rows (documents of 1 token and longer, a row of one
# document, a row continuing a document from past 0) and rows that are not packed (jumps to other
# positions, repeats, steps back), which tell the rules apart. A batch the graph left free gets
# DOC_BATCH rows.
DOC_PACKED_PATTERNS, DOC_OTHER_PATTERNS, DOC_BATCH = 4, 2, 3


@dataclass(frozen=True)
class MaskProof:
    """A mask `prove_mask` accepted: causal, or (with `positions`) causal within documents."""
    text: str                              # the lengths checked ("static" for a static graph)
    positions: Optional[fx.Node] = None    # the (B, S) position_ids input of a document mask
    rule: Optional[str] = None             # its DOC_RULES key: how document ids follow from it
    window: Optional[int] = None           # a causal sliding window of this many keys (i - w < j <= i)


@dataclass(frozen=True)
class _PositionSource:
    node: fx.Node
    batch: Optional[int]                   # the rows the graph was specialised on, or None (free)
    sizes: dict                            # size symbol -> "L" (sequence) or "B" (batch)


def prove_mask(ctx: PassContext, x: Optional[fx.Node], out: fx.Node, scale: float, dtype: torch.dtype,
               combine: Optional[Callable]) -> Union[MaskProof, str]:
    """A MaskProof if the masked scores `out` are causal (as `_prove_causal` proves), or causal
    within documents of one (B, S) integer graph input, position_ids; else why not.

    The document proof covers masks whose subgraph reads only size SymInts (the sequence length,
    position_ids' own sizes) and that one input. It evaluates the mask at the lengths the causal
    proof uses, each on DOC_PACKED_PATTERNS + DOC_OTHER_PATTERNS random position_ids of B rows
    (the traced batch, else DOC_BATCH), every row its own pattern, and compares it with the
    document-causal mask: query i keeps key j iff j <= i and doc[j] == doc[i], doc = rule(position_ids)
    for a rule of DOC_RULES (transformers' rule, "step", first); kept scores must be unchanged,
    the others -inf or below the dtype's floor. Only a rule that matches on every pattern, packed
    or not, is accepted: the document ids it computes at run time are what the mask would hide.
    """
    found = _mask_subgraph(ctx, out, x)
    if isinstance(found, str):
        return found
    if found.blocker is None:
        text, why = _causal_proof(ctx, found, x, out, scale, dtype, combine)
        if why and why.startswith(("mask uses the constant", "mask hides past keys")):
            window = _window_proof(ctx, found, x, out, scale, dtype, combine)
            if isinstance(window, str):
                return f"{why}; {window}"
            return MaskProof(window[0], window=window[1])
        return why if why else MaskProof(text)
    src = _position_source(ctx, found)
    if src is None:
        return found.blocker
    got = _document_proof(ctx, found, x, out, scale, dtype, combine, src)
    if isinstance(got, str):
        return f"{found.blocker}; read as packed position_ids it is not a document mask either: {got}"
    return got


def _position_source(ctx: PassContext, sub: _Subgraph) -> Optional[_PositionSource]:
    """The one (B, S) integer graph input the mask reads, if every size it reads is the sequence
    length or a size of that input; else None."""
    if len(sub.inputs) != 1:
        return None
    node = sub.inputs[0]
    v = node_value(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 2 or v.dtype == torch.bool or \
            v.dtype.is_floating_point or v.dtype.is_complex:
        return None
    b, s = (compat.sym_expr(d) for d in v.shape)
    seq = ctx.seq.symbol
    if s.is_Integer:
        if int(s) != ctx.seq.length or seq is not None and sub.leaves:
            return None
    elif not (s == seq or (s.is_Symbol and ctx.seq.hints.get(s) == ctx.seq.length)):
        return None
    sizes = {sym: "L" for sym in (seq, s) if sym is not None and not sym.is_Integer}
    if not b.is_Integer:
        if not b.is_Symbol or b in sizes:
            return None
        sizes[b] = "B"
    for leaf in sub.leaves:
        if not compat.sym_expr(node_value(leaf)).free_symbols <= set(sizes):
            return None
    return _PositionSource(node, int(b) if b.is_Integer else None, sizes)


def _position_patterns(B: int, L: int, gen: torch.Generator) -> list[torch.Tensor]:
    """(B, L) position_ids: packed rows and rows that are not packed (see DOC_PACKED_PATTERNS)."""
    def draw(hi: int) -> int:
        return int(torch.randint(0, hi, (), generator=gen))

    def packed_row() -> torch.Tensor:
        parts, n = [], 0
        while n < L:
            d = 1 if draw(10) < 3 else 1 + draw(max(L // 2, 1))
            d = min(d, L - n)
            parts.append(torch.arange(d))
            n += d
        return torch.cat(parts)
    pats = []
    for p in range(DOC_PACKED_PATTERNS):
        rows = [packed_row() for _ in range(B)]
        if p == 0:
            rows[0] = torch.arange(L)                    # one document, no restart
        elif p == 1:
            rows[-1] = torch.arange(L) + 1 + draw(5)     # a document continued from past 0
        pats.append(torch.stack(rows))
    for p in range(DOC_OTHER_PATTERNS):
        if p % 2 == 0:   # mostly +1 steps, some repeats, jumps and steps back
            steps = torch.randint(-2, 4, (B, L), generator=gen)
            steps[:, 0] = torch.randint(0, 4, (B,), generator=gen)
            pats.append(steps.cumsum(-1).clamp_min(0))
        else:
            pats.append(torch.randint(0, L + 2, (B, L), generator=gen))
    return pats


def _document_keep(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool: key j <= query i within i's document."""
    S = doc.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return causal & (doc[:, None, :, None] == doc[:, None, None, :])


def _document_proof(ctx: PassContext, sub: _Subgraph, x: Optional[fx.Node], out: fx.Node, scale: float,
                    dtype: torch.dtype, combine: Optional[Callable],
                    src: _PositionSource) -> Union[MaskProof, str]:
    # position_ids of a symbolic length: every length, even for a mask that reads no size
    lengths = _check_lengths(ctx, sub.nodes, sub.leaves or isinstance(node_value(src.node).shape[1], torch.SymInt))
    if isinstance(lengths, str):
        return lengths
    text = ",".join(map(str, lengths)) or "static"
    if not lengths:
        lengths = [int(node_value(src.node).shape[1])]
    B = src.batch if src.batch is not None else DOC_BATCH
    pos_dtype = node_value(src.node).dtype
    fn = _evaluator(sub, x, out)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for L in lengths:
        xs = torch.randn(1, 1, L, L, generator=gen).to(dtype) * 4
        value = {sym: (L if role == "L" else B) for sym, role in src.sizes.items()}
        sizes = [int(compat.sym_expr(node_value(leaf)).subs(value)) for leaf in sub.leaves]
        for pos in _position_patterns(B, L, gen):
            pos = pos.to(pos_dtype)
            try:
                with torch.no_grad():
                    got = fn(*sizes, pos, xs)
                    if combine is not None:
                        got = combine(got, xs * scale)
            except Exception as e:  # a mask we cannot run on its own is a mask we cannot prove
                return f"mask could not be evaluated at S={L}: {type(e).__name__}: {str(e)[:80]}"
            cases.append((L, pos, xs, got))
    failed = {}   # rule -> (cases it passed, why it failed)
    for rule, documents in DOC_RULES.items():
        for c, (L, pos, xs, got) in enumerate(cases):
            where = f"S={L}, position_ids {pos.tolist()}" if B * L <= 32 else f"S={L}"
            why = _compare(got, xs, scale, _document_keep(documents(pos)), L, documents=where)
            if why:
                failed[rule] = (c, why)
                break
        else:
            return MaskProof(f"{text} ({len(cases) // len(lengths)} position patterns of {B} rows each)",
                             src.node, rule)
    rule = max(failed, key=lambda r: failed[r][0])   # the rule the mask came closest to (the first on ties)
    return f"{failed[rule][1]} (documents: {DOC_RULE_TEXT[rule]})"
