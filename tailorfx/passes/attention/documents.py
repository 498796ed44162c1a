"""Packed sequences: a mask built from the sequence length and ONE (B, S) integer graph input -- the
position_ids of a packed batch, from which transformers' `create_causal_mask` builds a
block-diagonal causal mask -- is proved a document mask (`document_proof`): evaluated on random
position_ids, it must keep exactly key <= query within the query's document, where the documents
are those of one of DOC_RULES (transformers' rule first). The attention pass then computes the same
document ids in the graph from that input and hands them to the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.passes.attention.mask_eval import Subgraph, check_lengths, compare, evaluator, leaf_sizes
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext


def one_document_per_row(position_ids) -> bool:
    """Whether a real (B, S) integer position_ids tensor steps by 1 along every row: no row packs a
    second document (transformers' find_packed_sequence_indices finds none and skips the mask);
    False for anything else, fake tensors included."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        return False
    try:
        return not bool(_documents_by_step(position_ids).any())   # every token in document 0
    except Exception:   # a fake tensor holds no values
        return False


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
class PositionSource:
    """The (B, S) position_ids input a document mask reads, and what each size symbol stands for."""
    node: fx.Node
    batch: Optional[int]                   # the rows the graph was specialised on, or None (free)
    sizes: dict                            # size symbol -> "L" (sequence) or "B" (batch)


def position_source(ctx: PassContext, sub: Subgraph) -> Optional[PositionSource]:
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
    return PositionSource(node, int(b) if b.is_Integer else None, sizes)


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


def document_proof(ctx: PassContext, sub: Subgraph, x: Optional[fx.Node], out: fx.Node, scale: float,
                   dtype: torch.dtype, combine: Optional[Callable],
                   src: PositionSource) -> Union[tuple[str, str], str]:
    """(what was checked, the DOC_RULES key) if the mask, evaluated on position patterns from
    `src`, is causal within the documents of a rule (prove_mask says how); else why not."""
    # position_ids of a symbolic length: every length, even for a mask that reads no size
    S = node_value(src.node).shape[1]
    lengths = check_lengths(ctx, sub.nodes, None if sub.leaves or isinstance(S, torch.SymInt) else int(S))
    if isinstance(lengths, str):
        return lengths
    B = src.batch if src.batch is not None else DOC_BATCH
    pos_dtype = node_value(src.node).dtype
    gen = torch.Generator().manual_seed(0)
    cases = []
    for L in lengths.values:
        fn = evaluator(sub, x, out, lengths.subst(L))
        xs = torch.randn(1, 1, L, L, generator=gen).to(dtype) * 4
        value = {sym: (L if role == "L" else B) for sym, role in src.sizes.items()}
        sizes = leaf_sizes(sub.leaves, value)
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
            why = compare(got, xs, scale, _document_keep(documents(pos)), L, documents=where)
            if why:
                failed[rule] = (c, why)
                break
        else:
            return f"{lengths.text} ({len(cases) // len(lengths.values)} position patterns of {B} rows each)", rule
    rule = max(failed, key=lambda r: failed[r][0])   # the rule the mask came closest to (the first on ties)
    return f"{failed[rule][1]} (documents: {DOC_RULE_TEXT[rule]})"
