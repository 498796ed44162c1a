"""Proving an attention mask causal: the mask's subgraph is evaluated at small lengths (and past
the integer constants it holds) and compared with the causal mask; an attention whose mask is not
proved causal is left as it was. A mask whose constant is too large to evaluate past may be proved
a causal sliding window instead, and one built from packed position_ids a document mask
(documents.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.fx as fx

from tailorfx.passes.attention.documents import document_proof, position_source
from tailorfx.passes.attention.mask_eval import (CHECK_LENGTHS, Subgraph, check_lengths, compare, evaluator,
                                                 largest_constant, length_subst, mask_subgraph, masked_floor,
                                                 masked_scores, static_length)
from tailorfx.rewrite.passes import PassContext


@dataclass(frozen=True)
class MaskProof:
    """A mask `prove_mask` accepted: causal, or (with `positions`) causal within documents."""
    text: str                              # the lengths checked ("static" for a static graph)
    positions: Optional[fx.Node] = None    # the (B, S) position_ids input of a document mask
    rule: Optional[str] = None             # its DOC_RULES key: how document ids follow from it
    window: Optional[int] = None           # a causal sliding window of this many keys (i - w < j <= i)


def prove_mask(ctx: PassContext, x: Optional[fx.Node], out: fx.Node, scale: float, dtype: torch.dtype,
               combine: Optional[Callable]) -> Union[MaskProof, str]:
    """A MaskProof if the masked scores `out` are causal (`_causal_proof`), or causal
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
    found = mask_subgraph(ctx, out, x)
    if isinstance(found, str):
        return found
    if found.blocker is None:
        text, why = _causal_proof(ctx, found, x, out, scale, dtype, combine)
        if why and why.startswith(("mask uses the constant", "mask hides past keys")):
            window = _window_proof(found, x, out, scale, dtype, combine, static_length(found, x, out))
            if isinstance(window, str):
                return f"{why}; {window}"
            return MaskProof(window[0], window=window[1])
        return why if why else MaskProof(text)
    src = position_source(ctx, found)
    if src is None:
        return found.blocker
    got = document_proof(ctx, found, x, out, scale, dtype, combine, src)
    if isinstance(got, str):
        return f"{found.blocker}; read as packed position_ids it is not a document mask either: {got}"
    text, rule = got
    return MaskProof(text, src.node, rule)


def _causal_proof(ctx: PassContext, sub: Subgraph, x: Optional[fx.Node], out: fx.Node, scale: float,
                  dtype: torch.dtype, combine: Optional[Callable]) -> tuple[str, Optional[str]]:
    lengths = check_lengths(ctx, sub.nodes, static_length(sub, x, out))
    if isinstance(lengths, str):
        return "", lengths
    gen = torch.Generator().manual_seed(0)
    for L in lengths.values:
        try:
            fn = evaluator(sub, x, out, lengths.subst(L))
            xs, got = masked_scores(fn, sub.sizes(L), L, gen, dtype, scale, combine)
        except Exception as e:  # a mask we cannot run on its own is a mask we cannot prove
            return "", f"mask could not be evaluated at S={L}: {type(e).__name__}: {str(e)[:80]}"
        why = compare(got, xs, scale, torch.ones(L, L, dtype=torch.bool).tril(), L)
        if why:
            return "", why
    return lengths.text, None


# ---- sliding windows: a mask whose constant is too large to evaluate past -------------------------
WINDOW_PROBES = (3, 5)   # the constant replaced by each of these; the mask must be that window each time


def _window_proof(sub: Subgraph, x: Optional[fx.Node], out: fx.Node, scale: float, dtype: torch.dtype,
                  combine: Optional[Callable], static: Optional[int]) -> Union[tuple[str, int], str]:
    """(lengths checked, w) if the mask is a causal sliding window of w keys (query i keeps keys
    i - w < j <= i), w its largest integer constant c plus a fixed offset (`j > i - c`: w = c;
    `j >= i - c`: w = c + 1): with c replaced by each of WINDOW_PROBES, c', the mask evaluated at
    lengths past its window is exactly a window of c' + d, the same d for every probe (a constant
    used as a window is used the same way whatever its value); else why not. A static graph's
    length, `static`, is replaced by each length evaluated."""
    c = largest_constant(sub.nodes, skip=static)
    texts, offsets = [], set()
    gen = torch.Generator().manual_seed(0)
    for probe in WINDOW_PROBES:
        def masked(L: int):
            fn = evaluator(sub, x, out, {**length_subst(static, L), c: probe, -c: -probe})
            return masked_scores(fn, sub.sizes(L), L, gen, dtype, scale, combine)
        lengths = sorted(set(CHECK_LENGTHS) | {probe + 1, probe + 2, 2 * probe + 1, 3 * probe + 4})
        try:
            _, got = masked(lengths[-1])
            if not isinstance(got, torch.Tensor) or got.dim() < 2:
                return f"with its constant {c} as {probe} the mask is not a (.., S, S) tensor"
            last = got.reshape(-1, lengths[-1], lengths[-1])[0, -1]
            w = int((~(torch.isneginf(last) | (last <= masked_floor(last.dtype)))).sum())
            for L in lengths:
                xs, got = masked(L)
                i = torch.arange(L)
                keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
                why = compare(got, xs, scale, keep, L)
                if why:
                    return f"with its constant {c} as {probe}, it is not a sliding window of {w}: {why}"
        except Exception as e:
            return f"mask with its constant {c} as {probe} could not be evaluated: {type(e).__name__}"
        offsets.add(w - probe)
        texts.append(f"{c}->{probe}: window {w} at S={','.join(map(str, lengths))}")
    if len(offsets) != 1 or c + next(iter(offsets)) < 1:
        return f"its window does not follow its constant {c} ({'; '.join(texts)})"
    if static is not None:
        texts.append(f"static length {static} replaced by each")
    return "; ".join(texts), c + offsets.pop()
