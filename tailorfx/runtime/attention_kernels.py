"""Sparse, dilated and document-masked attention as opaque ``torch.library`` custom ops.

    tailorfx::sparse_attention(q, k, v, document_ids, kind, params, scale, causal, tile, kv_chunk)
    tailorfx::dilated_attention(q, k, v, document_ids, segments, rates, scale, causal, tile, kv_chunk)
    tailorfx::score_mod_attention(q, k, v, document_ids, mod_tensor, score_mod, scale, causal, tile,
                                  kv_chunk, softcap)
        -> (out (B, H, S, D), lse (B, H, S) fp32, fp64 for fp64 inputs)

each with a ``*_backward`` op, a fake kernel and an autograd registration, so a graph that calls
them keeps one node through AOTAutograd and Inductor (a plain-torch version would be decomposed
back into dense masked attention). Backward saves only (q, k, v, out, lse): flash-style.
``lse`` is returned for callers that merge partial attentions; it is not differentiable.

Shapes: q (B, H, S, D); k, v (B, H_kv, S, D) with H % H_kv == 0; document_ids (B, S) int.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch
from torch import Tensor

from tailorfx.runtime.attention_tiles import KV_CHUNK, TILE, Dropout, Pattern, ScoreMod, tile_backward, tile_forward

__all__ = ["sparse_attention", "dilated_attention", "dilated_workspace_bytes", "score_mod_attention",
           "register_score_mod", "SCORE_MODS"]

_NEG_INF = float("-inf")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Dense (causal) attention with documents: on CPU the ATen flash kernel (O(S) memory, returns
# lse, and its backward accepts a merged out/lse), one call per document when ids are sorted
# in each row (packed sequences); otherwise, or off CPU, the tile engine.

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_MAX_FLASH_CALLS = 256  # beyond this many documents, batched tile matmuls beat per-call overhead
MIN_BLOCK_TOKENS = 256  # a blocked flash backward's blocks are at least this long (per-call overhead)


def _document_runs(doc: Tensor) -> Optional[list[tuple[int, int, int]]]:
    """(row, start, stop) per document when ids are sorted within each row (packed sequences)."""
    if not bool((doc[:, 1:] >= doc[:, :-1]).all()):
        return None
    rows, cuts = (doc[:, 1:] != doc[:, :-1]).nonzero(as_tuple=True)
    starts: list[list[int]] = [[0] for _ in range(doc.shape[0])]
    for row, cut in zip(rows.tolist(), (cuts + 1).tolist()):
        starts[row].append(cut)
    return [(row, a, b) for row, s in enumerate(starts) for a, b in zip(s, [*s[1:], doc.shape[1]])]


def _flash_runs(q: Tensor, doc: Optional[Tensor]) -> Optional[list[tuple[slice, slice]]]:
    """(batch slice, sequence slice) per flash call, or None when the tile engine must run."""
    if q.device.type != "cpu":
        return None
    if doc is None:
        return [(slice(None), slice(None))]
    runs = _document_runs(doc)
    if runs is None or len(runs) > _MAX_FLASH_CALLS:
        return None
    return [(slice(r, r + 1), slice(a, b)) for r, a, b in runs]


def _dropout(p: float, seed: Optional[Tensor]) -> Optional[Dropout]:
    """The tiles' dropout from the op's arguments: `seed` an int64 scalar on the CPU (no sync)."""
    if not p:
        return None
    if seed is None:
        raise ValueError("attention dropout needs a seed tensor")
    return Dropout(float(p), int(seed))


def _dense_forward(q, k, v, doc, scale, causal, tiles, softcap=None, dropout=None):
    # torch's flash kernel has no soft-cap, and draws its own dropout mask
    runs = _flash_runs(q, doc) if softcap is None and dropout is None else None
    if runs is None:
        return tile_forward(q, k, v, Pattern("full", (), causal, q.shape[2]), doc, scale, *tiles, softcap=softcap,
                            dropout=dropout)
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))
    for rows, span in runs:
        o, l = _FLASH(q[rows, :, span], k[rows, :, span], v[rows, :, span], 0.0, causal, scale=scale)
        out[rows, :, span], lse[rows, :, span] = o, l
    return out, lse


def _dense_backward(dout, q, k, v, out, lse, doc, scale, causal, tiles, softcap=None, dropout=None):
    runs = _flash_runs(q, doc) if softcap is None and dropout is None else None
    if runs is None:
        pattern = Pattern("full", (), causal, q.shape[2])
        return tile_backward(dout, q, k, v, out, lse, pattern, doc, scale, *tiles, softcap=softcap, dropout=dropout)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rows, span in runs:  # documents do not overlap: each key's gradient comes from one call
        part = [t[rows, :, span] for t in (dout, q, k, v, out)]
        for g, d in zip(grads, _FLASH_BACKWARD(*part, lse[rows, :, span], 0.0, causal, scale=scale)):
            g[rows, :, span] = d
    return grads


def _one_flash_call(q: Tensor, kind: str, doc: Optional[Tensor], softcap, dropout) -> bool:
    """Dense attention without documents, soft-cap or dropout, on the CPU: one flash kernel call."""
    return kind == "full" and doc is None and softcap is None and dropout is None and q.device.type == "cpu"


def _block_step(seq: int, blocks: int) -> int:
    return max(-(-seq // blocks), MIN_BLOCK_TOKENS) if blocks > 1 else seq


def _flash_backward(dout, q, k, v, out, lse, scale, causal, repeat: bool):
    """The CPU flash backward of one call. `repeat`: grouped-query k and v repeated to every
    query head first, their gradients summed per group (the same sums, reassociated): ATen's
    grouped backward keeps threads idle where a full-head one uses them (measured, one kv head of
    four query heads: as long on 2 threads as on 1; repeated, 1.5-1.9x faster on 2)."""
    heads, num_kv = q.shape[1], k.shape[1]
    if not repeat or num_kv == heads:
        return _FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    group = heads // num_kv
    gq, gk, gv = _FLASH_BACKWARD(dout, q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), out, lse,
                                 0.0, causal, scale=scale)
    return gq, *(g.unflatten(1, (num_kv, group)).sum(2) for g in (gk, gv))


def _blocked_flash_backward(dout, q, k, v, out, lse, scale, causal, blocks: int, repeat: bool = False):
    """The flash backward over (query block x key block) pairs of ceil(S / blocks) tokens: the
    kernel's fp32 q-sized gradient accumulator shrinks to one block's. Exact: given the whole
    row's out and lse, a key block's share of dq and a query block's share of dk, dv are the
    kernel's own formulas restricted to the pair (P = exp(q k^T scale - lse), D = rowsum(dout *
    out)); under causality blocks left of the diagonal are dense, diagonal ones causal (square,
    top-left aligned), right of it skipped."""
    S = q.shape[2]
    step = _block_step(S, blocks)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, S, step):
        b = min(a + step, S)
        rows = (dout[:, :, a:b], q[:, :, a:b])
        for c in range(0, b if causal else S, step):
            d = min(c + step, S)
            gq, gk, gv = _flash_backward(*rows, k[:, :, c:d], v[:, :, c:d], out[:, :, a:b], lse[:, :, a:b], scale,
                                         causal and c == a, repeat)
            dq[:, :, a:b] += gq
            dk[:, :, c:d] += gk
            dv[:, :, c:d] += gv
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Block-sparse patterns: full + documents (dense engine above), sliding window, BigBird.


@torch.library.custom_op("tailorfx::sparse_attention", mutates_args=())
def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], kind: str,
    params: Sequence[int], scale: float, causal: bool, tile: int = TILE, kv_chunk: int = KV_CHUNK,
    softcap: Optional[float] = None, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    drop = _dropout(dropout_p, seed)
    if _one_flash_call(q, kind, document_ids, softcap, drop):
        return _contiguous(*_FLASH(q, k, v, 0.0, causal, scale=scale)[:2])
    if kind == "full":
        return _contiguous(*_dense_forward(q, k, v, document_ids, scale, causal, (tile, kv_chunk), softcap, drop))
    pattern = Pattern(kind, tuple(params), causal, q.shape[2])
    return _contiguous(*tile_forward(q, k, v, pattern, document_ids, scale, tile, kv_chunk, softcap, dropout=drop))


def _contiguous(*ts: Tensor) -> tuple[Tensor, ...]:
    """Outputs are always contiguous, whatever the inputs' strides, so fake and real agree."""
    return tuple(t.contiguous() for t in ts)


@sparse_attention.register_fake
def _(q, k, v, *_args, **_kwargs):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("tailorfx::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    document_ids: Optional[Tensor], kind: str, params: Sequence[int], scale: float, causal: bool,
    tile: int = TILE, kv_chunk: int = KV_CHUNK, softcap: Optional[float] = None, dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    drop = _dropout(dropout_p, seed)
    if _one_flash_call(q, kind, document_ids, softcap, drop):   # params: [blocks, repeat] of the backward, or none
        blocks, repeat = (list(params) + [0, 0])[:2]
        if blocks > 1:
            return _contiguous(*_blocked_flash_backward(dout, q, k, v, out, lse, scale, causal, blocks, bool(repeat)))
        return _contiguous(*_flash_backward(dout, q, k, v, out, lse, scale, causal, bool(repeat)))
    if kind == "full":
        return _contiguous(*_dense_backward(dout, q, k, v, out, lse, document_ids, scale, causal,
                                            (tile, kv_chunk), softcap, drop))
    pattern = Pattern(kind, tuple(params), causal, q.shape[2])
    return _contiguous(*tile_backward(dout, q, k, v, out, lse, pattern, document_ids, scale, tile, kv_chunk,
                                      softcap, dropout=drop))


@sparse_attention_backward.register_fake
def _(dout, q, k, v, *_args, **_kwargs):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _sparse_setup(ctx, inputs, output) -> None:
    q, k, v, document_ids, kind, params, scale, causal, tile, kv_chunk, softcap, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], document_ids, seed)
    ctx.args = (kind, list(params), scale, causal, tile, kv_chunk, softcap, dropout_p)
    ctx.mark_non_differentiable(output[1])


def _sparse_grad(ctx, dout, _dlse):
    q, k, v, out, lse, document_ids, seed = ctx.saved_tensors
    grads = sparse_attention_backward(dout.contiguous(), q, k, v, out, lse, document_ids, *ctx.args, seed)
    return (*grads, None, None, None, None, None, None, None, None, None, None)


sparse_attention.register_autograd(_sparse_grad, setup_context=_sparse_setup)


# ---------------------------------------------------------------------------------------------
# Exact attention with a score transform: FlexAttention's score_mod(score, b, h, q_idx, kv_idx,
# tensor), named in SCORE_MODS (an op's schema holds a name, not a function); the one tensor it
# may read (several: stack them) is the op's input, so its gradient flows. (One Optional[Tensor],
# not a Tensor[]: torch 2.13's register_autograd miscounts the gradients of an op with a tensor list.)


def _key_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, bias: Tensor) -> Tensor:
    """An additive bias per (batch, head, key), bias (B, H, S): ALiBi as Bloom and MPT build it
    (slope_h * key position; the query's own term is constant per row and cancels in softmax)."""
    return score + bias[b, h, kv_idx]


def _key_bias_grads(ds: Tensor, q0: int, q1: int, kpos: Tensor, tensors, grads) -> None:
    """key_bias's tensor gradient from a tile's d scores (B, H_kv, G * Tq, Tk): summed over the
    tile's queries, added at its keys."""
    batch, hkv, rows, tk = ds.shape
    per_key = ds.view(batch, hkv, rows // (q1 - q0), q1 - q0, tk).sum(3).reshape(batch, -1, tk)
    grads[0].index_add_(2, kpos, per_key.to(grads[0].dtype))


SCORE_MODS: dict[str, Callable[..., Tensor]] = {"key_bias": _key_bias}
# mods that add to the score: their tensors' gradients without a vjp through the mod
_ADDITIVE_GRADS: dict[str, Callable[..., None]] = {"key_bias": _key_bias_grads}


def register_score_mod(name: str, fn: Callable[..., Tensor]) -> None:
    """Make `fn(score, b, h, q_idx, kv_idx, *tensors) -> score` callable as score mod `name`.
    It gets broadcastable index tensors (a FlexAttention score_mod written with torch ops
    works as it is) and must be differentiable in `score` and in its floating-point tensors."""
    if name in SCORE_MODS and SCORE_MODS[name] is not fn:
        raise ValueError(f"score mod {name!r} is already registered")
    SCORE_MODS[name] = fn


def _score_mod(name: str, tensor: Optional[Tensor]) -> ScoreMod:
    if name not in SCORE_MODS:
        raise ValueError(f"unknown score mod {name!r}: register it with "
                         f"tailorfx.runtime.attention_kernels.register_score_mod (known: {sorted(SCORE_MODS)})")
    return ScoreMod(SCORE_MODS[name], () if tensor is None else (tensor,), _ADDITIVE_GRADS.get(name))


@torch.library.custom_op("tailorfx::score_mod_attention", mutates_args=())
def score_mod_attention(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], mod_tensor: Optional[Tensor],
    score_mod: str, scale: float, causal: bool, tile: int = TILE, kv_chunk: int = KV_CHUNK,
    softcap: Optional[float] = None, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    pattern = Pattern("full", (), causal, q.shape[2])
    return _contiguous(*tile_forward(q, k, v, pattern, document_ids, scale, tile, kv_chunk, softcap,
                                     _score_mod(score_mod, mod_tensor), _dropout(dropout_p, seed)))


@score_mod_attention.register_fake
def _(q, k, v, *_args, **_kwargs):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("tailorfx::score_mod_attention_backward", mutates_args=())
def score_mod_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, document_ids: Optional[Tensor],
    mod_tensor: Optional[Tensor], score_mod: str, scale: float, causal: bool, tile: int = TILE,
    kv_chunk: int = KV_CHUNK, softcap: Optional[float] = None, dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pattern = Pattern("full", (), causal, q.shape[2])
    dq, dk, dv, *dmod = tile_backward(dout, q, k, v, out, lse, pattern, document_ids, scale, tile, kv_chunk,
                                      softcap, _score_mod(score_mod, mod_tensor), _dropout(dropout_p, seed))
    # no tensor: an empty stand-in (an op's outputs are tensors)
    return (*_contiguous(dq, dk, dv), dmod[0].contiguous() if dmod else q.new_empty(0))


@score_mod_attention_backward.register_fake
def _(dout, q, k, v, out, lse, document_ids, mod_tensor, *_args, **_kwargs):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0) if mod_tensor is None else mod_tensor.new_empty(mod_tensor.shape))


def _mod_setup(ctx, inputs, output) -> None:
    q, k, v, document_ids, mod_tensor, *args, seed = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], document_ids, mod_tensor, seed)
    ctx.args = tuple(args)
    ctx.mark_non_differentiable(output[1])


def _mod_grad(ctx, dout, _dlse):
    q, k, v, out, lse, document_ids, mod_tensor, seed = ctx.saved_tensors
    dq, dk, dv, dmod = score_mod_attention_backward(dout.contiguous(), q, k, v, out, lse, document_ids,
                                                    mod_tensor, *ctx.args, seed)
    floating = mod_tensor is not None and mod_tensor.is_floating_point()
    return (dq, dk, dv, None, dmod if floating else None, *([None] * (len(ctx.args) + 1)))


score_mod_attention.register_autograd(_mod_grad, setup_context=_mod_setup)


# ---------------------------------------------------------------------------------------------
# Dilated (LongNet): per (segment w, rate r) group and head offset o = h % r, the positions
# p % r == o of each segment form a short dense sequence; groups merge through their lse.


def _groups(
    seq: int, heads: int, segments: Sequence[int], rates: Sequence[int], tile: int, kv_chunk: int
) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield (rate, offset, start, num_segments, segment_len): runs of whole segments, then the tail.

    A run packs as many segments as keep its (segments x heads x tile x keys) work within what
    one tile of all heads would use, so transients stay O(tile x kv_chunk), not O(S x w).
    """
    for w, r in zip(segments, rates):
        whole = seq // w
        for o in range(min(r, heads)):  # heads o, o + r, ... select offset o
            m = max(1, -(-(w - o) // r))  # positions per whole segment (none when o >= w)
            per_segment = len(range(o, heads, r)) * min(m, tile) * min(m, kv_chunk)
            cap = max(1, heads * tile * kv_chunk // per_segment)
            for first in range(0, whole if o < w else 0, cap):
                yield r, o, first * w, min(cap, whole - first), w
            if seq % w > o:
                yield r, o, whole * w, 1, seq % w


def dilated_workspace_bytes(
    batch: int, heads: int, seq: int, dim: int, dtype_bytes: int, segments: Sequence[int],
    rates: Sequence[int], tile: int = TILE, kv_chunk: int = KV_CHUNK,
) -> int:
    """Largest per-call packed copy the backward holds: q, dout, out, k, v and dq, dk, dv of
    one run of segments (the forward holds fewer)."""
    largest = 0
    for r, o, _, nseg, length in _groups(seq, heads, segments, rates, tile, kv_chunk):
        positions = len(range(o, length, r))
        largest = max(largest, nseg * len(range(o, heads, r)) * positions)
    return 8 * batch * largest * dim * dtype_bytes


def _pick(x: Tensor, heads: slice, start: int, nseg: int, length: int, o: int, r: int) -> Tensor:
    """Strided view (B, Hh, nseg, m, *rest) of x (B, H, S, *rest) at the group's positions."""
    return x[:, heads, start : start + nseg * length].unflatten(2, (nseg, length))[:, :, :, o::r]


def _pack(x: Tensor) -> Tensor:
    """(B, Hh, nseg, m, ...) -> (B * nseg, Hh, m, ...), a contiguous copy."""
    x = x.transpose(1, 2)
    return x.reshape(-1, *x.shape[2:])


def _unpack(x: Tensor, batch: int) -> Tensor:
    """(B * nseg, Hh, m, ...) -> (B, Hh, nseg, m, ...) view."""
    return x.reshape(batch, -1, *x.shape[1:]).transpose(1, 2)


def _group_inputs(tensors, doc, num_kv, group):
    """Pack q-like tensors (all H heads) and k, v (expanded from H_kv) for one group."""
    r, o, start, nseg, length = group
    heads = slice(o, None, r)
    *qlike, k, v = tensors
    h = qlike[0].shape[1]
    kv_heads = torch.arange(o, h, r, device=k.device) // (h // num_kv)
    packed = [_pack(_pick(t, heads, start, nseg, length, o, r)) for t in qlike]
    everything = slice(None)
    for t in (k, v):
        packed.append(_pack(_pick(t, everything, start, nseg, length, o, r).index_select(1, kv_heads)))
    if doc is not None:
        doc = doc[:, start : start + nseg * length].reshape(-1, length)[:, o::r].contiguous()
    return packed, doc, kv_heads


@torch.library.custom_op("tailorfx::dilated_attention", mutates_args=())
def dilated_attention(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], segments: Sequence[int],
    rates: Sequence[int], scale: float, causal: bool, tile: int = TILE, kv_chunk: int = KV_CHUNK,
) -> tuple[Tensor, Tensor]:
    batch, heads, seq, dim = q.shape
    acc = _lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((batch, heads, seq), _NEG_INF, dtype=acc, device=q.device)
    for group in _groups(seq, heads, segments, rates, tile, kv_chunk):
        r, o, start, nseg, length = group
        (qg, kg, vg), doc, _ = _group_inputs((q, k, v), document_ids, k.shape[1], group)
        out_g, lse_g = _dense_forward(qg, kg, vg, doc, scale, causal, (tile, kv_chunk))
        out_v = _pick(out, slice(o, None, r), start, nseg, length, o, r)
        lse_v = _pick(lse, slice(o, None, r), start, nseg, length, o, r)
        lse_g = _unpack(lse_g, batch)
        new = torch.logaddexp(lse_v, lse_g)
        new_safe = new.masked_fill(new == _NEG_INF, 0.0)  # rows no group has reached yet
        out_v.mul_(torch.exp(lse_v - new_safe)[..., None])
        out_v.add_(_unpack(out_g, batch).to(acc) * torch.exp(lse_g - new_safe)[..., None])
        lse_v.copy_(new)
    return out.to(q.dtype), lse


@dilated_attention.register_fake
def _(q, k, v, *_args, **_kwargs):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("tailorfx::dilated_attention_backward", mutates_args=())
def dilated_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    document_ids: Optional[Tensor], segments: Sequence[int], rates: Sequence[int], scale: float,
    causal: bool, tile: int = TILE, kv_chunk: int = KV_CHUNK,
) -> tuple[Tensor, Tensor, Tensor]:
    # Each group's keys get p = exp(s - lse_total) and delta = rowsum(dout * out_total): with the
    # merged out and lse, per-group flash backwards sum to the exact gradient.
    batch, heads = q.shape[:2]
    acc = _lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    lse = lse.to(_lse_dtype(q.dtype))
    for group in _groups(q.shape[2], heads, segments, rates, tile, kv_chunk):
        r, o, start, nseg, length = group
        (qg, dog, outg, kg, vg), doc, kv_heads = _group_inputs(
            (q, dout, out, k, v), document_ids, k.shape[1], group
        )
        lseg = _pack(_pick(lse, slice(o, None, r), start, nseg, length, o, r))
        tiles = (tile, kv_chunk)
        dqg, dkg, dvg = _dense_backward(dog, qg, kg, vg, outg, lseg, doc, scale, causal, tiles)
        _pick(dq, slice(o, None, r), start, nseg, length, o, r).add_(_unpack(dqg, batch))
        everything = slice(None)
        for grad, part in ((dk, dkg), (dv, dvg)):  # kv heads shared by several query heads add up
            view = _pick(grad, everything, start, nseg, length, o, r)
            view.index_add_(1, kv_heads, _unpack(part, batch).to(acc))
    return _contiguous(dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))


@dilated_attention_backward.register_fake
def _(dout, q, k, v, *_args, **_kwargs):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dilated_setup(ctx, inputs, output) -> None:
    q, k, v, document_ids, segments, rates, scale, causal, tile, kv_chunk = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], document_ids)
    ctx.args = (list(segments), list(rates), scale, causal, tile, kv_chunk)
    ctx.mark_non_differentiable(output[1])


def _dilated_grad(ctx, dout, _dlse):
    q, k, v, out, lse, document_ids = ctx.saved_tensors
    grads = dilated_attention_backward(
        dout.contiguous(), q, k, v, out, lse, document_ids, *ctx.args
    )
    return (*grads, None, None, None, None, None, None, None)


dilated_attention.register_autograd(_dilated_grad, setup_context=_dilated_setup)


# ---------------------------------------------------------------------------------------------
# What the memory model cannot see: bytes these ops allocate and free inside themselves.


def transient_bytes(op_name: str, args: list, as_int) -> int:
    """Bytes an op of this module allocates and frees inside itself (its outputs excluded).

    ``args`` are the node's arguments with tensors as fake values; ``as_int`` turns a size or
    SymInt into an int. Per query tile the engine holds (tile x keys) score tiles (2 forward,
    4 backward) and a few (tile x D) rows in the accumulation dtype, keys being what one tile
    can touch (at most ``kv_chunk``); narrow inputs add fp32 dk/dv accumulators. Documents run
    the CPU flash kernel once per document (copies of one call's outputs); dilated attention
    packs one run of segments at a time. Measured against the allocator's peak in
    ``tests/test_attention_pass.py``.
    """
    backward = op_name.endswith("_backward")
    base = op_name[: -len("_backward")] if backward else op_name
    if base not in ("sparse_attention", "dilated_attention", "score_mod_attention"):
        return 0
    rest = list(args[1:] if backward else args)
    q, k = rest[0], rest[1]
    extra = rest[5:] if backward else rest[3:]  # past (q, k, v) and the backward's (out, lse)
    modded = base == "score_mod_attention"
    additive = modded and extra[2] in _ADDITIVE_GRADS   # its backward needs no vjp (without a soft-cap)
    if modded:   # (doc, mod_tensor, score_mod, scale, causal, ...) read as the full pattern's arguments
        extra = [extra[0], "full", [], *extra[3:]]
    doc, pattern_args, tiles = extra[0], extra[1:3], extra[5:7]
    softcap = extra[7] if len(extra) > 7 else None
    dropout = bool(extra[8]) if len(extra) > 8 else False
    tile, kv_chunk = (list(tiles) + [TILE, KV_CHUNK][len(tiles):])[:2]
    batch, heads, seq, dim = (as_int(s) for s in q.shape)
    num_kv = as_int(k.shape[1])
    acc, item = _lse_dtype(q.dtype).itemsize, q.dtype.itemsize
    narrow = item < acc
    q_elems, kv_elems = batch * heads * seq * dim, batch * num_kv * seq * dim
    if base == "dilated_attention":
        segments, rates = pattern_args
        work = dilated_workspace_bytes(batch, heads, seq, dim, item, segments, rates, tile, kv_chunk)
        if not backward:
            return work * 6 // 8 + narrow * acc * q_elems
        return work * 13 // 8 + narrow * acc * (q_elems + 2 * kv_elems)
    kind, params = pattern_args
    if kind == "full" and doc is None and softcap is None and not modded and not dropout and q.device.type == "cpu":
        blocks, repeat = (int(p) for p in (list(params) + [0, 0])[:2])
        step = _block_step(seq, blocks) if backward else seq
        per_thread = torch.get_num_threads() * min(1 << 20, step * (256 if step < 192 else 512 if step < 768 else 1024))
        if not backward:
            return int(0.57 * per_thread)
        # repeated k, v: two q-sized copies and their q-sized gradients, less the kv-sized ones
        # they replace (measured, fp32, 1 and 2 kv heads of 4: to the KiB)
        qb, kb = q_elems * step // seq, kv_elems * step // seq
        repeated = (4 * item * qb - 2 * item * kb) if repeat and num_kv < heads else 0
        if step >= seq:
            # in the kernel: its fp32 q-sized accumulator; after it, the copies that make its
            # (B, S, H, D)-strided gradients contiguous (a one-head tensor is already)
            copies = item * (q_elems * (heads > 1) + 2 * kv_elems * (num_kv > 1))
            return 4 * q_elems + per_thread + repeated if repeated else max(4 * q_elems + per_thread, copies)
        # per block pair (measured, fp32): the accumulator and two q-block gradients, four k-blocks
        return 4 * qb + 2 * item * qb + 4 * item * kb + per_thread + repeated
    if kind == "full" and softcap is None and not modded and not dropout:   # CPU flash per document (sorted ids: packed sequences, the usual case)
        half = narrow * item * q_elems // 2   # narrow dtypes: measured +50% (fp32 work rows)
        return item * q_elems + half if not backward else item * (q_elems + 2 * kv_elems) + half
    tq = tile if kind != "bigbird" else params[0] * max(1, tile // params[0])
    tq = min(tq, seq)
    if kind == "full":   # soft-capped, a score mod or dropout: the tiles over every key
        keys, gathered = seq, False
    elif kind == "window":   # key units of `tile` tokens the band and the global tokens touch
        window, num_global = params
        keys = ((tq - 1) // tile + -(-(window - 1) // tile) + 1 + -(-num_global // tile)) * tile
        gathered = num_global > 0   # keys in two runs: index_select copies, not slices
    else:
        block, window, num_global, num_random = params[:4]
        keys = (tq // block * (1 + num_random) + 2 * window + num_global) * block
        gathered = True
    kc = min(kv_chunk, seq, keys)
    copies = narrow or gathered or doc is not None
    rows, chunk = acc * batch * heads * tq, acc * batch * num_kv * kc * dim
    mask = tq * kc * (batch if doc is not None else 1)
    # a score mod's gathered operand and its result (forward); under vjp, its residuals and their
    # gradients (backward): measured 4.0-4.6 and 6.2-7.4 score tiles in all (5.1-6.3 for key_bias,
    # whose backward needs no vjp)
    fwd_tiles, bwd_tiles = (4, 6 + (softcap is not None)) if modded else (2, 4 + (softcap is not None))
    if additive and softcap is None:
        bwd_tiles = 5
    if dropout:   # the tile's uniform draws and kept mask; in backward also the dropped probabilities
        fwd_tiles, bwd_tiles = fwd_tiles + 1, bwd_tiles + 3
    if not backward:
        return int(rows * (fwd_tiles * kc + 3 * dim + 6) + 2 * chunk * copies + mask)
    return int(rows * (bwd_tiles * kc + 4 * dim + 2) + 2 * chunk * (1 + copies) + mask
               + narrow * 2 * acc * kv_elems)
