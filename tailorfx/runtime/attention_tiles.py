"""Block-sparse attention in plain torch: query tiles over the key runs a mask pattern touches.

A pattern (``full``, ``window``, ``bigbird``) says, for a query tile ``[q0, q1)``, which key units
it may touch (``unit_row``) and the exact element mask inside them (``element_mask``). The
engine gathers those keys in chunks of at most ``kv_chunk`` and runs an online (log-sum-exp)
softmax: work is O(S x keys per query), memory O(S) plus an O(tile x kv_chunk) transient. The
backward recomputes each tile from ``out`` and ``lse`` (flash-style) and scatter-adds dk, dv.
Every kind includes the diagonal, so no query row is empty and lse stays finite.

A ``score_mod`` (FlexAttention's signature, ``score_mod(score, b, h, q_idx, kv_idx, *tensors)``)
transforms each tile's scaled scores before the mask: it is called with broadcastable index
tensors instead of FlexAttention's vmapped scalars, so a mod written for one runs on the other
(an ALiBi slope table ``s + slopes[h] * (kv_idx - q_idx)``, a bias read from the graph
``s + bias[b, h, kv_idx]``). Its backward is torch.func.vjp through the mod on the tile (custom
ops run below autograd; functorch still differentiates there), the captured ``tensors``'
gradients included; a mod that only adds to the score gives them without a vjp (``add_grads``).
``Dropout`` drops probabilities with masks drawn per tile from the call's seed, so the backward
redraws the forward's masks.

Everything is torch ops on whatever device the inputs live on; no CPU-only calls here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from tailorfx.kernels.bigbird import block_rows as bigbird_block_rows
from tailorfx.kernels.bigbird import random_blocks as bigbird_random_blocks

__all__ = ["Pattern", "ScoreMod", "Dropout", "bigbird_random_blocks", "tile_forward", "tile_backward", "TILE", "KV_CHUNK"]

TILE = 128  # query rows per tile; 64-256 measured within 15% on CPU at S=4K
KV_CHUNK = 1024  # keys per matmul; bounds the (tile x keys) score transient

KeyIndex = Union[slice, Tensor]


@dataclass(frozen=True)
class Pattern:
    """A mask pattern over a self-attention of length ``seq_len`` (see module docstring).

    kind ``full``: no params; ``window``: (window, num_global); ``bigbird``: (block, window,
    num_global, num_random, seed). Causality is applied on top of every kind.
    """

    kind: str
    params: tuple[int, ...]
    causal: bool
    seq_len: int

    def __post_init__(self) -> None:
        arity = {"full": 0, "window": 2, "bigbird": 5}
        if arity.get(self.kind) != len(self.params):
            raise ValueError(f"Pattern: kind {self.kind!r} with params {self.params}")

    def query_tile(self, tile: int) -> int:
        if self.kind == "bigbird":  # whole BigBird blocks per tile keeps the key sets tight
            return self.params[0] * max(1, tile // self.params[0])
        return tile

    def key_unit(self, tile: int) -> int:
        return self.params[0] if self.kind == "bigbird" else tile

    def unit_row(self, q0: int, q1: int, unit: int) -> Tensor:
        """Bool (num_units,): key units of ``unit`` tokens that queries q0..q1-1 may touch."""
        n = -(-self.seq_len // unit)
        start = torch.arange(n) * unit
        last = torch.clamp(start + unit, max=self.seq_len) - 1
        if self.kind == "full":
            row = torch.ones(n, dtype=torch.bool)
        elif self.kind == "window":
            w, g = self.params
            if q0 < g:
                row = torch.ones(n, dtype=torch.bool)
            else:
                row = (last > q0 - w) & (start < q1 - 1 + w) | (start < g)
        else:
            row = self._bigbird_rows(q0 // unit, -(-q1 // unit), n).any(0)
        if self.causal:
            row &= start <= q1 - 1
        return row

    def _bigbird_rows(self, qb0: int, qb1: int, num_blocks: int) -> Tensor:
        """Bool (qb1-qb0, num_blocks): the BigBird block pattern of query blocks qb0..qb1-1."""
        return bigbird_block_rows(self.params, self.causal, qb0, qb1, num_blocks)

    def element_mask(self, q0: int, q1: int, kpos: Tensor, kmin: int, kmax: int) -> Optional[Tensor]:
        """Bool (q1-q0, len(kpos)) mask, or None when every pair is known to be allowed."""
        qpos = torch.arange(q0, q1, device=kpos.device)[:, None]
        k = kpos[None, :]
        causal_free = not self.causal or kmax <= q0
        if self.kind == "full":
            return None if causal_free else k <= qpos
        if self.kind == "window":
            w, g = self.params
            band_free = (kmin > q1 - 1 - w) and (self.causal or kmax < q0 + w)
            if causal_free and (band_free or q1 <= g or kmax < g):
                return None
            near = (k > qpos - w) if self.causal else ((k - qpos).abs() < w)
            mask = near | (qpos < g) | (k < g)
        else:
            b = self.params[0]
            n = -(-self.seq_len // b)
            rows = self._bigbird_rows(q0 // b, -(-q1 // b), n).to(kpos.device)
            mask = rows[(qpos // b - q0 // b), k // b]
        return mask & (k <= qpos) if self.causal else mask


def _unit_doc_ranges(doc: Tensor, unit: int) -> tuple[Tensor, Tensor]:
    """Per batch row and key unit, the min and max document id: (B, num_units) each."""
    batch, seq = doc.shape
    pad = -seq % unit
    if pad:
        doc = torch.cat([doc, doc[:, -1:].expand(batch, pad)], 1)
    doc = doc.reshape(batch, -1, unit)
    return doc.amin(-1), doc.amax(-1)


def _runs(row: Tensor, unit: int, seq_len: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) position ranges of the True units of ``row``."""
    idx = row.nonzero().flatten().tolist()
    runs: list[tuple[int, int]] = []
    for u in idx:
        if runs and runs[-1][1] == u * unit:
            runs[-1] = (runs[-1][0], min((u + 1) * unit, seq_len))
        else:
            runs.append((u * unit, min((u + 1) * unit, seq_len)))
    return runs


def _chunks(runs: list[tuple[int, int]], kv_chunk: int) -> Iterator[list[tuple[int, int]]]:
    chunk: list[tuple[int, int]] = []
    size = 0
    for a, b in runs:
        while a < b:
            take = min(b - a, kv_chunk - size)
            chunk.append((a, a + take))
            size, a = size + take, a + take
            if size == kv_chunk:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def plan(
    pattern: Pattern, doc: Optional[Tensor], tile: int, kv_chunk: int, device: torch.device
) -> Iterator[tuple[int, int, list[tuple[KeyIndex, Optional[Tensor]]]]]:
    """Yield (q0, q1, [(key index, mask (Bm, 1, 1, Tq, Tk) or None), ...]) per query tile."""
    seq = pattern.seq_len
    tq, unit = pattern.query_tile(tile), pattern.key_unit(tile)
    if doc is not None:
        doc_lo, doc_hi = (t.cpu() for t in _unit_doc_ranges(doc, unit))
        doc_cpu = doc.cpu()
    for q0 in range(0, seq, tq):
        q1 = min(q0 + tq, seq)
        row = pattern.unit_row(q0, q1, unit)
        if doc is not None:  # a unit whose id range misses the tile's in every batch row is dead
            qd = doc_cpu[:, q0:q1]
            row &= ((doc_lo <= qd.amax(1, keepdim=True)) & (doc_hi >= qd.amin(1, keepdim=True))).any(0)
        chunks = []
        for chunk in _chunks(_runs(row, unit, seq), kv_chunk):
            if len(chunk) == 1:
                index: KeyIndex = slice(*chunk[0])
                kpos = torch.arange(*chunk[0], device=device)
            else:
                index = kpos = torch.cat([torch.arange(a, b, device=device) for a, b in chunk])
            mask = pattern.element_mask(q0, q1, kpos, chunk[0][0], chunk[-1][1] - 1)
            if doc is not None:
                same = doc[:, q0:q1, None] == doc[:, kpos][:, None, :]
                mask = same if mask is None else same & mask
            chunks.append((index, None if mask is None else mask.view(-1, 1, 1, *mask.shape[-2:])))
        yield q0, q1, chunks


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_rows(x: Tensor, q0: int, q1: int, num_kv: int, dtype: torch.dtype) -> Tensor:
    """x[:, :, q0:q1] as (B, H_kv, G * Tq, D): the G query heads of a KV head share one matmul."""
    b, h, _, d = x.shape
    return x[:, :, q0:q1].reshape(b, num_kv, (h // num_kv) * (q1 - q0), d).to(dtype)


def _take(x: Tensor, index: KeyIndex, dtype: torch.dtype) -> Tensor:
    return (x[:, :, index] if isinstance(index, slice) else x.index_select(2, index)).to(dtype)


@dataclass(frozen=True)
class ScoreMod:
    """A score transform in FlexAttention's signature and the tensors it reads (see module doc)."""

    fn: Callable[..., Tensor]
    tensors: tuple[Tensor, ...] = ()
    # for a mod that adds to the score (d mod / d score = 1): add_grads(ds, q0, q1, kpos, tensors,
    # grads) adds the tile's gradients of the tensors into `grads`; the backward then needs no vjp
    add_grads: Optional[Callable[..., None]] = None

    def apply(self, s: Tensor, q0: int, q1: int, kpos: Tensor, tensors=None) -> Tensor:
        """fn over a tile's scores s (B, H_kv, G * Tq, Tk), rows ordered (group, query)."""
        batch, hkv, rows, tk = s.shape
        tq = q1 - q0
        row = torch.arange(rows, device=s.device)
        b = torch.arange(batch, device=s.device).view(-1, 1, 1, 1)
        h = (torch.arange(hkv, device=s.device).view(1, -1, 1, 1) * (rows // tq) + (row // tq).view(1, 1, -1, 1))
        q_idx = (q0 + row % tq).view(1, 1, -1, 1)
        return self.fn(s, b, h, q_idx, kpos.view(1, 1, 1, -1), *(self.tensors if tensors is None else tensors))


@dataclass(frozen=True)
class Dropout:
    """Dropout on the attention probabilities: each (b, h, i, j) kept with probability 1 - p, the
    kept ones scaled by 1 / (1 - p). A tile's mask is drawn from a generator seeded by `seed` and
    the tile's place (its first query and first key), so the backward draws the forward's mask
    tile by tile (as flash-attention's Philox offsets do) without storing it."""

    p: float
    seed: int

    def keep(self, s: Tensor, q0: int, index: KeyIndex) -> Tensor:
        """Bool, s's shape: which probabilities of the tile (queries from q0, keys `index`) stay."""
        k0 = index.start if isinstance(index, slice) else int(index[0])
        g = torch.Generator(device=s.device)
        g.manual_seed((self.seed * 1_000_003 + q0 * 65_537 + k0) % (1 << 63))
        return torch.rand(s.shape, generator=g, device=s.device, dtype=torch.float32) >= self.p


def _key_positions(index: KeyIndex, device) -> Tensor:
    return torch.arange(index.start, index.stop, device=device) if isinstance(index, slice) else index


def _scores(qt: Tensor, kc: Tensor, mask: Optional[Tensor], tq: int, softcap: Optional[float] = None,
            mod: Optional[tuple] = None) -> Tensor:
    """Masked scores of pre-scaled query rows against one key chunk, soft-capped
    (softcap * tanh(s / softcap), Gemma-2) before the mask when `softcap` is given, transformed
    by a score mod (`mod` = (ScoreMod, q0, key index)) after it."""
    s = torch.matmul(qt, kc.transpose(-1, -2))
    if softcap is not None:
        s = s.div_(softcap).tanh_().mul_(softcap)
    if mod is not None:
        score_mod, q0, index = mod
        s = score_mod.apply(s, q0, q0 + tq, _key_positions(index, s.device))
    if mask is not None:
        b, hkv, rows, tk = s.shape
        s.view(b, hkv, rows // tq, tq, tk).masked_fill_(~mask, float("-inf"))
    return s


def tile_forward(
    q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, doc: Optional[Tensor], scale: float,
    tile: int = TILE, kv_chunk: int = KV_CHUNK, softcap: Optional[float] = None,
    score_mod: Optional[ScoreMod] = None, dropout: Optional[Dropout] = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, S, D) in q's dtype, lse (B, H, S) in fp32/fp64; -inf and 0 for empty rows).
    With `dropout`, lse is the undropped softmax's (what the backward recomputes p from)."""
    batch, heads, seq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, dtype=_acc_dtype(q.dtype), device=q.device)
    for q0, q1, chunks in plan(pattern, doc, tile, kv_chunk, q.device):
        _forward_tile(q, k, v, out, lse, q0, q1, chunks, scale, softcap, score_mod, dropout)
        del chunks   # before the plan makes the next tile's masks
    return out, lse


def _forward_tile(q, k, v, out, lse, q0, q1, chunks, scale, softcap, score_mod, dropout) -> None:
    """One query tile of ``tile_forward``, written into out and lse; its temporaries die with it."""
    batch, heads, _, dim = q.shape
    num_kv, acc = k.shape[1], _acc_dtype(q.dtype)
    qt = _tile_rows(q, q0, q1, num_kv, acc) * scale  # scaling D columns, not Tk
    m = torch.full(qt.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    l = torch.zeros_like(m)
    o = torch.zeros_like(qt)
    for index, mask in chunks:
        m, l = _forward_chunk(qt, k, v, o, m, l, q0, q1, index, mask, softcap, score_mod, dropout)
    m_safe = m.masked_fill(m == float("-inf"), 0.0)
    o = o.div_(torch.where(l == 0, 1.0, l)[..., None])
    out[:, :, q0:q1] = o.view(batch, heads, q1 - q0, dim).to(q.dtype)
    lse[:, :, q0:q1] = (m_safe + torch.log(l)).view(batch, heads, q1 - q0)


def _forward_chunk(qt, k, v, o, m, l, q0, q1, index, mask, softcap, score_mod, dropout) -> tuple[Tensor, Tensor]:
    """One key chunk of the online softmax: o updated in place, the new (max, sum) returned; the
    chunk's score tile is freed on return, before the next one exists."""
    acc = qt.dtype
    s = _scores(qt, _take(k, index, acc), mask, q1 - q0, softcap,
                None if score_mod is None else (score_mod, q0, index))
    m_new = torch.maximum(m, s.amax(-1))
    m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # all-masked rows stay 0
    p = s.sub_(m_safe[..., None]).exp_()
    alpha = torch.exp(m - m_safe)
    l = l * alpha + p.sum(-1)
    if dropout is not None:
        p = p.mul_(dropout.keep(p, q0, index)).mul_(1.0 / (1.0 - dropout.p))
    o.mul_(alpha[..., None]).add_(torch.matmul(p, _take(v, index, acc)))
    return m_new, l


def tile_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pattern: Pattern,
    doc: Optional[Tensor], scale: float, tile: int = TILE, kv_chunk: int = KV_CHUNK,
    softcap: Optional[float] = None, score_mod: Optional[ScoreMod] = None, dropout: Optional[Dropout] = None,
) -> tuple[Tensor, ...]:
    """Gradients of ``tile_forward``'s out wrt q, k, v, recomputing each tile's probabilities
    (through the soft-cap: d(c tanh(s/c))/ds = 1 - tanh(s/c)^2), then, with a score mod, wrt
    each of its tensors (autograd through the mod, tile by tile; zeros where none flows)."""
    acc = _acc_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    leaves, dmods = (), []
    if score_mod is not None:
        leaves = tuple(t.detach() for t in score_mod.tensors)
        dmods = [torch.zeros_like(t) if t.is_floating_point() else None for t in leaves]
    for q0, q1, chunks in plan(pattern, doc, tile, kv_chunk, q.device):
        _backward_tile(dout, q, k, v, out, lse, dq, dk, dv, q0, q1, chunks, scale, softcap, score_mod, dropout,
                       leaves, dmods)
        del chunks
    dk = dk.to(k.dtype)   # one accumulator cast at a time: the fp32 dk is freed before dv's cast
    dv = dv.to(v.dtype)
    if score_mod is None:
        return dq, dk, dv
    return (dq, dk, dv, *(torch.zeros_like(t) if d is None else d for t, d in zip(score_mod.tensors, dmods)))


def _backward_tile(dout, q, k, v, out, lse, dq, dk, dv, q0, q1, chunks, scale, softcap, score_mod, dropout,
                   leaves, dmods) -> None:
    """One query tile of ``tile_backward``: dq written, dk and dv accumulated."""
    batch, heads, _, dim = q.shape
    num_kv, acc = k.shape[1], dk.dtype
    qt = _tile_rows(q, q0, q1, num_kv, acc) * scale  # so ds^T @ qt is already dk
    dot = _tile_rows(dout, q0, q1, num_kv, acc)
    delta = (dot * _tile_rows(out, q0, q1, num_kv, acc)).sum(-1, keepdim=True)
    lt = lse[:, :, q0:q1].reshape(batch, num_kv, -1, 1).to(acc)  # finite: every query sees itself
    dqt = torch.zeros_like(qt)
    for index, mask in chunks:
        _backward_chunk(qt, dot, delta, lt, dqt, k, v, dk, dv, q0, q1, index, mask, softcap, score_mod, dropout,
                        leaves, dmods)
    dq[:, :, q0:q1] = dqt.mul_(scale).view(batch, heads, q1 - q0, dim).to(q.dtype)


def _backward_chunk(qt, dot, delta, lt, dqt, k, v, dk, dv, q0, q1, index, mask, softcap, score_mod, dropout,
                    leaves, dmods) -> None:
    """One key chunk: the tile's probabilities recomputed, dq's share added into dqt, dk's and dv's
    into theirs; its score tiles are freed on return, before the next chunk's exist."""
    acc = qt.dtype
    kc, vc = _take(k, index, acc), _take(v, index, acc)
    additive = score_mod is not None and score_mod.add_grads is not None and softcap is None
    if score_mod is not None and not additive:
        p, ds = _mod_tile_grads(qt, kc, vc, dot, delta, lt, mask, q0, q1, index, softcap, score_mod,
                                leaves, dmods, dropout)
    else:
        s = _scores(qt, kc, mask, q1 - q0, softcap, (score_mod, q0, index) if additive else None)
        p = s.sub_(lt).exp_() if softcap is None else s.sub(lt).exp_()
        dp, p_v = _dropped(torch.matmul(dot, vc.transpose(-1, -2)), p, dropout, q0, index)
        ds = dp.sub_(delta).mul_(p)   # in dp's buffer
        del dp
        p = p_v
        if softcap is not None:   # s = c * t where unmasked: 1 - t^2 = 1 - (s / c)^2 (masked: p = 0)
            t = s.div_(softcap).nan_to_num_(0.0, 0.0, 0.0)
            ds.mul_(t.mul_(t).neg_().add_(1.0))
            del t
        del s
        if additive:
            score_mod.add_grads(ds, q0, q1, _key_positions(index, ds.device), leaves, dmods)
    dvc = torch.matmul(p.transpose(-1, -2), dot)
    del p
    if isinstance(index, slice):
        dv[:, :, index] += dvc
    else:
        dv.index_add_(2, index, dvc)
    del dvc
    dkc = torch.matmul(ds.transpose(-1, -2), qt)
    dqt.add_(torch.matmul(ds, kc))
    del ds
    if isinstance(index, slice):
        dk[:, :, index] += dkc
    else:
        dk.index_add_(2, index, dkc)


def _dropped(dp: Tensor, p: Tensor, dropout: Optional[Dropout], q0: int, index: KeyIndex) -> tuple[Tensor, Tensor]:
    """(dL/dp through the dropout, the probabilities as the forward applied them to v)."""
    if dropout is None:
        return dp, p
    keep = dropout.keep(p, q0, index).to(p.dtype).mul_(1.0 / (1.0 - dropout.p))
    return dp.mul_(keep), p * keep


def _mod_tile_grads(qt, kc, vc, dot, delta, lt, mask, q0, q1, index, softcap, score_mod, leaves, dmods,
                    dropout=None):
    """(probabilities, d scores before the soft-cap and the mod) of one tile with a score mod,
    by torch.func.vjp through the mod (custom ops run below autograd; functorch's transforms
    still differentiate there); its floating tensors' gradients are added to `dmods`."""
    kpos = _key_positions(index, qt.device)
    floats = [i for i, t in enumerate(leaves) if t.is_floating_point()]

    def modded(raw, *diff):
        tensors = list(leaves)
        for i, t in zip(floats, diff):
            tensors[i] = t
        s = raw if softcap is None else torch.tanh(raw / softcap) * softcap
        s = score_mod.apply(s, q0, q1, kpos, tensors)
        if mask is not None:
            b, hkv, rows, tk = s.shape
            tq = q1 - q0
            s = s.view(b, hkv, rows // tq, tq, tk).masked_fill(~mask, float("-inf")).view(b, hkv, rows, tk)
        return s

    s, vjp = torch.func.vjp(modded, torch.matmul(qt, kc.transpose(-1, -2)), *(leaves[i] for i in floats))
    p = s.sub_(lt).exp_()
    dp, p_v = _dropped(torch.matmul(dot, vc.transpose(-1, -2)), p, dropout, q0, index)
    grads = vjp(dp.sub_(delta).mul_(p))
    del dp
    for i, g in zip(floats, grads[1:]):
        dmods[i] += g
    return p_v, grads[0]
