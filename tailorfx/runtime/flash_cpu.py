"""The ATen CPU flash attention kernel as the attention ops run it: one call, one per document
of a packed row, per (query block, key block) pair, or with grouped k, v repeated to every query
head; and the bytes each way holds beyond its outputs (the memory model's transients). Also
`grouped_sdpa`: torch's SDPA with grouped k, v as exact attention calls it on every device.

ATen's kernel is O(S) memory, returns the log-sum-exp, and its backward accepts a merged out and
lse, so a row's documents and a backward's block pairs are exact pieces of one call.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from tailorfx import compat
from tailorfx.runtime.attention_tiles import Pattern, tile_backward, tile_forward
from tailorfx.runtime.cpu_scratch import SIXTEEN_BIT, measured_once
from tailorfx.runtime.measure import peak_and_net

__all__ = ["FLASH", "FLASH_BACKWARD", "MIN_BLOCK_TOKENS", "lse_dtype", "flash_runs", "dense_forward", "dense_backward",
           "one_flash_call", "block_step", "flash_backward", "blocked_flash_backward", "flash_split",
           "flash_gemm_scratch", "flash_pack_bytes", "flash_thread_bytes", "flash_transient_bytes", "grouped_sdpa"]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
MAX_FLASH_CALLS = 256  # beyond this many documents, batched tile matmuls beat per-call overhead
MIN_BLOCK_TOKENS = 256  # a blocked flash backward's blocks are at least this long (per-call overhead)


def grouped_on_cuda_math(q: Tensor, k: Tensor) -> bool:
    """Whether CUDA's SDPA takes these grouped k, v (fewer heads than q) on its math kernel only,
    (B, H, S, S) scores: flash runs fp16/bf16 up to head dim 256, the memory-efficient kernel no
    grouped heads (16K fp32 tokens of Qwen2 needed 8.4 GiB on an H200)."""
    return (q.dim() == k.dim() == 4 and k.shape[1] != q.shape[1] and q.device.type == "cuda"
            and (q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256))


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float]) -> Tensor:
    """F.scaled_dot_product_attention with k, v of H_kv <= H heads; where CUDA would run them on
    its math kernel (grouped_on_cuda_math) k and v are repeated to every query head first, so the
    memory-efficient kernel runs in O(S)."""
    if grouped_on_cuda_math(q, k):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def document_runs(doc: Tensor) -> Optional[list[tuple[int, int, int]]]:
    """(row, start, stop) per document when ids are sorted within each row (packed sequences)."""
    if not bool((doc[:, 1:] >= doc[:, :-1]).all()):
        return None
    rows, cuts = (doc[:, 1:] != doc[:, :-1]).nonzero(as_tuple=True)
    starts: list[list[int]] = [[0] for _ in range(doc.shape[0])]
    for row, cut in zip(rows.tolist(), (cuts + 1).tolist()):
        starts[row].append(cut)
    return [(row, a, b) for row, s in enumerate(starts) for a, b in zip(s, [*s[1:], doc.shape[1]])]


def flash_runs(q: Tensor, doc: Optional[Tensor]) -> Optional[list[tuple[slice, slice]]]:
    """(batch slice, sequence slice) per flash call, or None when the tile engine must run."""
    if q.device.type != "cpu":
        return None
    if doc is None:
        return [(slice(None), slice(None))]
    runs = document_runs(doc)
    if runs is None or len(runs) > MAX_FLASH_CALLS:
        return None
    return [(slice(r, r + 1), slice(a, b)) for r, a, b in runs]


def dense_forward(q, k, v, doc, scale, causal, tiles, softcap=None, dropout=None):
    # torch's flash kernel has no soft-cap, and draws its own dropout mask
    runs = flash_runs(q, doc) if softcap is None and dropout is None else None
    if runs is None:
        return tile_forward(q, k, v, Pattern("full", (), causal, q.shape[2]), doc, scale, *tiles, softcap=softcap,
                            dropout=dropout)
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
    for rows, span in runs:
        o, l = FLASH(q[rows, :, span], k[rows, :, span], v[rows, :, span], 0.0, causal, scale=scale)
        out[rows, :, span], lse[rows, :, span] = o, l
    return out, lse


def dense_backward(dout, q, k, v, out, lse, doc, scale, causal, tiles, softcap=None, dropout=None):
    runs = flash_runs(q, doc) if softcap is None and dropout is None else None
    if runs is None:
        pattern = Pattern("full", (), causal, q.shape[2])
        return tile_backward(dout, q, k, v, out, lse, pattern, doc, scale, *tiles, softcap=softcap, dropout=dropout)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rows, span in runs:  # documents do not overlap: each key's gradient comes from one call
        part = [t[rows, :, span] for t in (dout, q, k, v, out)]
        for g, d in zip(grads, FLASH_BACKWARD(*part, lse[rows, :, span], 0.0, causal, scale=scale)):
            g[rows, :, span] = d
    return grads


def one_flash_call(q: Tensor, kind: str, doc: Optional[Tensor], softcap, dropout) -> bool:
    """Dense attention without documents, soft-cap or dropout, on the CPU: one flash kernel call."""
    return kind == "full" and doc is None and softcap is None and dropout is None and q.device.type == "cpu"


def block_step(seq: int, blocks: int) -> int:
    return max(-(-seq // blocks), MIN_BLOCK_TOKENS) if blocks > 1 else seq


def flash_backward(dout, q, k, v, out, lse, scale, causal, repeat: bool):
    """The CPU flash backward of one call. `repeat`: grouped-query k and v repeated to every
    query head first, their gradients summed per group (the same sums, reassociated): ATen's
    grouped backward keeps threads idle where a full-head one uses them (measured, one kv head of
    four query heads: as long on 2 threads as on 1; repeated, 1.5-1.9x faster on 2)."""
    heads, num_kv = q.shape[1], k.shape[1]
    if not repeat or num_kv == heads:
        return FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    group = heads // num_kv
    gq, gk, gv = FLASH_BACKWARD(dout, q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), out, lse,
                                 0.0, causal, scale=scale)
    return gq, *(g.unflatten(1, (num_kv, group)).sum(2) for g in (gk, gv))


def blocked_flash_backward(dout, q, k, v, out, lse, scale, causal, blocks: int, repeat: bool = False):
    """The flash backward over (query block x key block) pairs of ceil(S / blocks) tokens: the
    kernel's fp32 q-sized gradient accumulator shrinks to one block's. Exact: given the whole
    row's out and lse, a key block's share of dq and a query block's share of dk, dv are the
    kernel's own formulas restricted to the pair (P = exp(q k^T scale - lse), D = rowsum(dout *
    out)); under causality blocks left of the diagonal are dense, diagonal ones causal (square,
    top-left aligned), right of it skipped."""
    S = q.shape[2]
    step = block_step(S, blocks)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, S, step):
        b = min(a + step, S)
        rows = (dout[:, :, a:b], q[:, :, a:b])
        for c in range(0, b if causal else S, step):
            d = min(c + step, S)
            gq, gk, gv = flash_backward(*rows, k[:, :, c:d], v[:, :, c:d], out[:, :, a:b], lse[:, :, a:b], scale,
                                         causal and c == a, repeat)
            dq[:, :, a:b] += gq
            dk[:, :, c:d] += gk
            dv[:, :, c:d] += gv
    return dq, dk, dv


def flash_split(q_len: int, kv_len: int) -> tuple[int, int]:
    """(query block, key block) of ATen's CPU flash kernel, forward and backward: 32 queries under
    192, 64 under 768, else 256; 512 keys; neither longer than its sequence."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def flash_thread_bytes(backward: bool, q_len: int, kv_len: int, dim: int, dtype: torch.dtype) -> int:
    """The scratch one call of ATen's CPU flash kernel allocates for its torch.get_num_threads()
    intra-op threads, a slice each: forward, an fp32 (query block x key block) score tile, the
    block's row max and sum and its fp32 (query block x D) output rows; backward, two fp32 tiles
    (probabilities and their gradient) and a row sum. 16-bit inputs add each tile once more in
    their dtype (fp64 ones hold them in fp64), and a 16-bit backward oneDNN's matmul scratch
    (flash_gemm_scratch). Measured against the allocator (fp32, fp64, bf16, fp16; 32 to 2048
    tokens, D 16 to 128; 1 and 2 threads): to the byte, and to 256 bytes on two threads (the second
    thread's row sum is allocated where the profiler does not look)."""
    scratch = flash_gemm_scratch(q_len, kv_len, dim, dtype) if backward else 0
    return _own_buffers(backward, q_len, kv_len, dim, dtype) + scratch


def _own_buffers(backward: bool, q_len: int, kv_len: int, dim: int, dtype: torch.dtype) -> int:
    qs, ks = flash_split(q_len, kv_len)
    item, acc = dtype.itemsize, lse_dtype(dtype).itemsize
    tiles = 2 if backward else 1
    per_thread = tiles * qs * ks * (acc + item * (item < acc))
    per_thread += qs * acc if backward else qs * (2 + dim) * acc
    return torch.get_num_threads() * per_thread


def flash_gemm_scratch(q_len: int, kv_len: int, dim: int, dtype: torch.dtype) -> int:
    """What oneDNN allocates through torch's allocator in the CPU flash backward of 16-bit inputs,
    whose matmuls write fp32 tiles: one scratchpad per matmul, freed before the next, sized by
    oneDNN for the intra-op threads and for the ISA it runs on (AVX-512, AVX512-FP16, AMX; none on
    AVX2). Measured, not modelled: the most one backward call of one head holds on this CPU with
    the same tiles (query and key blocks, their tails, D) beyond its gradients and the kernel's own
    buffers; cached per shape and thread count. The profiler sees the calling thread's scratchpads
    only, and so does this figure: on two threads the other thread's is allocated unseen."""
    if dtype not in SIXTEEN_BIT:
        return 0   # fp32 and fp64 matmuls run in MKL, whose buffers torch's allocator never sees
    probes = [(_probe_length(q_len), _probe_length(kv_len), dim, dtype, causal)
              for causal in ((False, True) if q_len == kv_len else (False,))]
    measured = [measured_once(("flash backward", *p, torch.get_num_threads()),
                              functools.partial(_measure_gemm_scratch, *p)) for p in probes]
    return max(m or 0 for m in measured)


def _probe_length(length: int) -> int:
    """A length with the same flash tiles as `length` (256-query and 512-key blocks from 768 up,
    so the same tails modulo 512), short enough to run in milliseconds."""
    return length if length < 1536 else 1024 + length % 512


def _measure_gemm_scratch(q_len: int, kv_len: int, dim: int, dtype: torch.dtype, causal: bool) -> int:
    q, dout = (torch.full((1, 1, q_len, dim), 0.5, dtype=dtype) for _ in range(2))
    k = v = torch.full((1, 1, kv_len, dim), 0.5, dtype=dtype)
    out, lse = FLASH(q, k, v, 0.0, causal)[:2]
    peak = peak_and_net(lambda: FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, causal), collect=False)[0]
    grads = dtype.itemsize * dim * (q_len + 2 * kv_len)
    return max(0, peak - grads - _own_buffers(True, q_len, kv_len, dim, dtype))


def flash_pack_bytes(shape: tuple, num_kv: int, kv_len: int, dtype: torch.dtype, causal: bool) -> int:
    """What ATen's CPU flash forward allocates to pack k and v for oneDNN's brgemm, where its
    16-bit matmuls pack (a CPU with AMX) and the matmuls outweigh the packing: k and v reordered
    per kv head, a transposed key block per thread (a padded query block for an odd D); q `shape`
    (B, H, S, D). Read off FlashAttentionKernel.cpp (`need_pack`); measured to the byte (bf16,
    AMX, 128 to 2048 tokens, D 16 to 128, 1 and 2 threads). 0 where it does not pack."""
    batch, heads, q_len, dim = shape
    if kv_len < (thresh := 64 if dtype == torch.bfloat16 else 16) or q_len < thresh \
            or not compat.cpu_packs_16bit_matmuls(dtype):
        return 0
    qs, ks = flash_split(q_len, kv_len)
    threads = torch.get_num_threads()
    blocks_per_thread = -(-batch * heads * -(-q_len // qs) // threads)
    gemm = blocks_per_thread * qs * (min(q_len, kv_len) if causal else kv_len) * dim
    if gemm < batch * num_kv * kv_len * dim * (4 if dtype == torch.bfloat16 else 1):
        return 0
    tail = (kv_len - 1) % ks + 1
    padded = (kv_len - 1) // ks * (ks + ks % 2) + tail + tail % 2
    per_thread = ks * dim + qs * (dim + 1) * (dim % 2) + qs * (ks % 2)   # (the score tile's odd column)
    return dtype.itemsize * (batch * num_kv * ((dim + dim % 2) * kv_len + padded * dim) + threads * per_thread)


def flash_transient_bytes(backward: bool, shape: tuple, num_kv: int, dtype: torch.dtype, params,
                          causal: bool = True) -> int:
    """Bytes one call of the CPU flash kernel (the op's forward, or its backward as `params`
    [blocks, repeat] says) holds beyond its outputs: q `shape` (B, H, S, D) of `dtype`, `num_kv`
    kv heads. Measured against the allocator in tests/test_attention_kernels.py."""
    batch, heads, seq, dim = shape
    item = dtype.itemsize
    q_elems, kv_elems = batch * heads * seq * dim, batch * num_kv * seq * dim
    blocks, repeat = (int(p) for p in (list(params) + [0, 0])[:2])
    step = min(block_step(seq, blocks), seq) if backward else seq
    buffers = flash_thread_bytes(backward, step, step, dim, dtype)
    if not backward:
        return buffers + flash_pack_bytes(shape, num_kv, seq, dtype, causal)
    # repeated k, v: two q-sized copies and their q-sized gradients, less the kv-sized ones
    # they replace (measured, fp32, 1 and 2 kv heads of 4: to the KiB)
    qb, kb = q_elems * step // seq, kv_elems * step // seq
    repeated = (4 * item * qb - 2 * item * kb) if repeat and num_kv < heads else 0
    if step >= seq:
        # in the kernel: the output gradient copied (B, S, H, D)-contiguous; after it, the copies
        # that make its (B, S, H, D)-strided gradients contiguous (a one-head tensor is already)
        copies = item * (q_elems * (heads > 1) + 2 * kv_elems * (num_kv > 1))
        dout = item * q_elems * (heads > 1)
        return dout + buffers + repeated if repeated else max(dout + buffers, copies)
    # per block pair (measured, fp32 and bf16): the output gradient's copy and two q-block
    # gradients, four k-blocks
    return item * qb * (heads > 1) + 2 * item * qb + 4 * item * kb + buffers + repeated
