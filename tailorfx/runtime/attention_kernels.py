"""Sparse, dilated and document-masked attention as opaque ``torch.library`` custom ops.

    tailorfx::sparse_attention(q, k, v, document_ids, kind, params, scale, causal) -> (out, lse)
    tailorfx::dilated_attention(q, k, v, document_ids, segments, rates, scale, causal) -> (out, lse)

each with a ``*_backward`` op, a fake kernel and an autograd registration, so a graph that calls
them keeps one node through AOTAutograd and Inductor (a plain-torch version would be decomposed
back into dense masked attention). Backward saves only (q, k, v, out, lse): flash-style.
``lse`` is returned for callers that merge partial attentions; it is not differentiable.

Shapes: q (B, H, S, D); k, v (B, H_kv, S, D) with H % H_kv == 0; document_ids (B, S) int.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch import Tensor

from tailorfx.runtime.attention_tiles import KV_CHUNK, TILE, Pattern, tile_backward, tile_forward

__all__ = ["sparse_attention", "dilated_attention"]

_NEG_INF = float("-inf")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Block-sparse patterns (full + documents, sliding window, BigBird): the tile engine.


@torch.library.custom_op("tailorfx::sparse_attention", mutates_args=())
def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], kind: str,
    params: Sequence[int], scale: float, causal: bool, tile: int = TILE, kv_chunk: int = KV_CHUNK,
) -> tuple[Tensor, Tensor]:
    pattern = Pattern(kind, tuple(params), causal, q.shape[2])
    return tile_forward(q, k, v, pattern, document_ids, scale, tile, kv_chunk)


@sparse_attention.register_fake
def _(q, k, v, document_ids, kind, params, scale, causal, tile=TILE, kv_chunk=KV_CHUNK):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("tailorfx::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    document_ids: Optional[Tensor], kind: str, params: Sequence[int], scale: float, causal: bool,
    tile: int = TILE, kv_chunk: int = KV_CHUNK,
) -> tuple[Tensor, Tensor, Tensor]:
    pattern = Pattern(kind, tuple(params), causal, q.shape[2])
    return tile_backward(dout, q, k, v, out, lse, pattern, document_ids, scale, tile, kv_chunk)


@sparse_attention_backward.register_fake
def _(dout, q, k, v, out, lse, document_ids, kind, params, scale, causal, tile=TILE, kv_chunk=KV_CHUNK):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sparse_setup(ctx, inputs, output) -> None:
    q, k, v, document_ids, kind, params, scale, causal, tile, kv_chunk = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], document_ids)
    ctx.args = (kind, list(params), scale, causal, tile, kv_chunk)
    ctx.mark_non_differentiable(output[1])


def _sparse_grad(ctx, dout, _dlse):
    q, k, v, out, lse, document_ids = ctx.saved_tensors
    grads = sparse_attention_backward(dout.contiguous(), q, k, v, out, lse, document_ids, *ctx.args)
    return (*grads, None, None, None, None, None, None, None)


sparse_attention.register_autograd(_sparse_grad, setup_context=_sparse_setup)


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
            m = -(-(w - o) // r)  # positions per whole segment
            per_segment = len(range(o, heads, r)) * min(m, tile) * min(m, kv_chunk)
            cap = max(1, heads * tile * kv_chunk // per_segment)
            for first in range(0, whole if o < w else 0, cap):
                yield r, o, first * w, min(cap, whole - first), w
            if seq % w > o:
                yield r, o, whole * w, 1, seq % w


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


def _dense_forward(q, k, v, doc, scale, causal, tiles):
    if doc is None and q.device.type == "cpu":  # the CPU flash kernel: fastest, O(S) memory
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.to(_lse_dtype(q.dtype))
    return tile_forward(q, k, v, Pattern("full", (), causal, q.shape[2]), doc, scale, *tiles)


def _dense_backward(dout, q, k, v, out, lse, doc, scale, causal, tiles):
    if doc is None and q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    pattern = Pattern("full", (), causal, q.shape[2])
    return tile_backward(dout, q, k, v, out, lse, pattern, doc, scale, *tiles)


def _group_inputs(tensors, doc, num_kv, group):
    """Pack q-like tensors (all H heads) and k, v (expanded from H_kv) for one group."""
    r, o, start, nseg, length = group
    heads = slice(o, None, r)
    *qlike, k, v = tensors
    h = qlike[0].shape[1]
    kv_heads = torch.arange(o, h, r, device=k.device) // (h // num_kv)
    packed = [_pack(_pick(t, heads, start, nseg, length, o, r)) for t in qlike]
    everything = slice(None)
    packed += [_pack(_pick(t, everything, start, nseg, length, o, r).index_select(1, kv_heads)) for t in (k, v)]
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
def _(q, k, v, document_ids, segments, rates, scale, causal, tile=TILE, kv_chunk=KV_CHUNK):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


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
        dqg, dkg, dvg = _dense_backward(dog, qg, kg, vg, outg, lseg, doc, scale, causal, (tile, kv_chunk))
        _pick(dq, slice(o, None, r), start, nseg, length, o, r).add_(_unpack(dqg, batch))
        everything = slice(None)
        _pick(dk, everything, start, nseg, length, o, r).index_add_(1, kv_heads, _unpack(dkg, batch).to(acc))
        _pick(dv, everything, start, nseg, length, o, r).index_add_(1, kv_heads, _unpack(dvg, batch).to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@dilated_attention_backward.register_fake
def _(dout, q, k, v, out, lse, document_ids, segments, rates, scale, causal, tile=TILE, kv_chunk=KV_CHUNK):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _dilated_setup(ctx, inputs, output) -> None:
    q, k, v, document_ids, segments, rates, scale, causal, tile, kv_chunk = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], document_ids)
    ctx.args = (list(segments), list(rates), scale, causal, tile, kv_chunk)
    ctx.mark_non_differentiable(output[1])


def _dilated_grad(ctx, dout, _dlse):
    q, k, v, out, lse, document_ids = ctx.saved_tensors
    grads = dilated_attention_backward(dout.contiguous(), q, k, v, out, lse, document_ids, *ctx.args)
    return (*grads, None, None, None, None, None, None, None)


dilated_attention.register_autograd(_dilated_grad, setup_context=_dilated_setup)
