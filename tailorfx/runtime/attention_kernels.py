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
from tailorfx.runtime.flash_cpu import (FLASH, block_step, blocked_flash_backward, dense_backward, dense_forward,
                                        flash_backward, flash_transient_bytes, lse_dtype, one_flash_call)

__all__ = ["sparse_attention", "dilated_attention", "dilated_workspace_bytes", "score_mod_attention",
           "register_score_mod", "SCORE_MODS"]

_NEG_INF = float("-inf")


def _dropout(p: float, seed: Optional[Tensor]) -> Optional[Dropout]:
    """The tiles' dropout from the op's arguments: `seed` an int64 scalar on the CPU (no sync)."""
    if not p:
        return None
    if seed is None:
        raise ValueError("attention dropout needs a seed tensor")
    return Dropout(float(p), int(seed))


# ---------------------------------------------------------------------------------------------
# Block-sparse patterns: full + documents (flash_cpu's dense engine), sliding window, BigBird.


@torch.library.custom_op("tailorfx::sparse_attention", mutates_args=())
def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], kind: str,
    params: Sequence[int], scale: float, causal: bool, tile: int = TILE, kv_chunk: int = KV_CHUNK,
    softcap: Optional[float] = None, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    drop = _dropout(dropout_p, seed)
    if one_flash_call(q, kind, document_ids, softcap, drop):
        return _contiguous(*FLASH(q, k, v, 0.0, causal, scale=scale)[:2])
    if kind == "full":
        return _contiguous(*dense_forward(q, k, v, document_ids, scale, causal, (tile, kv_chunk), softcap, drop))
    pattern = Pattern(kind, tuple(params), causal, q.shape[2])
    return _contiguous(*tile_forward(q, k, v, pattern, document_ids, scale, tile, kv_chunk, softcap, dropout=drop))


def _contiguous(*ts: Tensor) -> tuple[Tensor, ...]:
    """Outputs are always contiguous, whatever the inputs' strides, so fake and real agree."""
    return tuple(t.contiguous() for t in ts)


@sparse_attention.register_fake
def _(q, k, v, *_args, **_kwargs):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("tailorfx::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    document_ids: Optional[Tensor], kind: str, params: Sequence[int], scale: float, causal: bool,
    tile: int = TILE, kv_chunk: int = KV_CHUNK, softcap: Optional[float] = None, dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    drop = _dropout(dropout_p, seed)
    if one_flash_call(q, kind, document_ids, softcap, drop):   # params: [blocks, repeat] of the backward, or none
        blocks, repeat = (list(params) + [0, 0])[:2]
        if block_step(q.shape[2], blocks) < q.shape[2]:   # one block would only add zeros to its gradients
            return _contiguous(*blocked_flash_backward(dout, q, k, v, out, lse, scale, causal, blocks, bool(repeat)))
        return _contiguous(*flash_backward(dout, q, k, v, out, lse, scale, causal, bool(repeat)))
    if kind == "full":
        return _contiguous(*dense_backward(dout, q, k, v, out, lse, document_ids, scale, causal,
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
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


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
    acc = lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((batch, heads, seq), _NEG_INF, dtype=acc, device=q.device)
    for group in _groups(seq, heads, segments, rates, tile, kv_chunk):
        r, o, start, nseg, length = group
        (qg, kg, vg), doc, _ = _group_inputs((q, k, v), document_ids, k.shape[1], group)
        out_g, lse_g = dense_forward(qg, kg, vg, doc, scale, causal, (tile, kv_chunk))
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
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("tailorfx::dilated_attention_backward", mutates_args=())
def dilated_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    document_ids: Optional[Tensor], segments: Sequence[int], rates: Sequence[int], scale: float,
    causal: bool, tile: int = TILE, kv_chunk: int = KV_CHUNK,
) -> tuple[Tensor, Tensor, Tensor]:
    # Each group's keys get p = exp(s - lse_total) and delta = rowsum(dout * out_total): with the
    # merged out and lse, per-group flash backwards sum to the exact gradient.
    batch, heads = q.shape[:2]
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    lse = lse.to(lse_dtype(q.dtype))
    for group in _groups(q.shape[2], heads, segments, rates, tile, kv_chunk):
        r, o, start, nseg, length = group
        (qg, dog, outg, kg, vg), doc, kv_heads = _group_inputs(
            (q, dout, out, k, v), document_ids, k.shape[1], group
        )
        lseg = _pack(_pick(lse, slice(o, None, r), start, nseg, length, o, r))
        tiles = (tile, kv_chunk)
        dqg, dkg, dvg = dense_backward(dog, qg, kg, vg, outg, lseg, doc, scale, causal, tiles)
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
    SymInt into an int. The tile engine holds one key chunk's (tile x keys) score tiles at a
    time, keys being what one tile can touch (at most ``kv_chunk``), and a few (tile x D) rows;
    documents run the CPU flash kernel once per document (copies of one call's outputs);
    dilated attention packs one run of segments at a time. Measured against the allocator in
    tests/test_attention_pass.py and tests/test_attention_kernels.py (docs/memory.md)."""
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
    acc, item = lse_dtype(q.dtype).itemsize, q.dtype.itemsize
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
        return flash_transient_bytes(backward, (batch, heads, seq, dim), num_kv, q.dtype, params, bool(extra[4]))
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
    copies = narrow or gathered   # each chunk's k and v copied (to acc, or gathered)
    rows, chunk = acc * batch * heads * tq, acc * batch * num_kv * kc * dim
    mask = tq * kc * (batch if doc is not None else 1) * (2 + (doc is not None))
    # score tiles (rows x kc) live at once, one key chunk's at a time (the engine frees a chunk's
    # before the next exists). Forward: the scores; a score mod's gathered operand and its result
    # (+2; narrow, +0.5: its copy in acc); dropout's uniform draws and kept mask (+1.25). Backward:
    # the probabilities and d scores; the soft-capped scores beside them (+1); a score mod's as in
    # forward, or under vjp (a soft-cap before it) 6; dropout's draws, mask and dropped
    # probabilities (+2). Fitted to the allocator over 64-2048 tokens, tiles 64/128 (see the test)
    if not backward:
        tiles = (3 + narrow / 2 if modded else 1) + 1.25 * dropout
        return int(rows * (tiles * kc + 3 * dim + 8) + chunk * copies + mask)
    if modded:
        tiles = 3 + narrow / 2 if additive and softcap is None else 6
    else:
        tiles = 2 + (softcap is not None) + 2 * dropout
    # (rows x D) blocks: q's, the output gradient's and the output's rows copied out of the heads
    # (views where one tile spans the sequence in acc), d q's accumulator and its partial
    row_blocks = 3 if tq == seq and not narrow else 4
    loop = int(rows * (tiles * kc + row_blocks * dim + 8) + chunk * (1 + 2 * copies) + mask)
    if not narrow:
        return loop
    # the acc dk, dv accumulators beside the narrow outputs (less one: the outputs are counted
    # elsewhere); at the end, one cast at a time (1.5)
    return max(loop + acc * kv_elems, 3 * acc * kv_elems // 2)
