"""tailorfx generated: rope_block_h=8_cos_dtype=fp32_dtype=bf16_head_dim=128_out_dtype=fp32_rotary_dim=128"""
import triton
import triton.language as tl

HALF = tl.constexpr(64)
BLOCK_HALF = tl.constexpr(64)
BLOCK_H = tl.constexpr(8)


@triton.jit
def _rope_fwd_heads(x_ptr, out_ptr, b, s, heads, n_heads, sxb, sxh, sxs, sob, soh, sos, c1, c2, s1, s2):
    # out = x * cos + rotate_half(x) * sin
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    hmask = heads < n_heads
    hh = heads.to(tl.int64)[:, None]
    x_row = x_ptr + b * sxb + s * sxs + hh * sxh
    o_row = out_ptr + b * sob + s * sos + hh * soh
    mask = hmask[:, None] & dmask[None, :]
    x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + d[None, :], (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF + d[None, :], (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_fwd(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_heads_q, n_heads_k, sqb, sqh, sqs, skb, skh, sks,
          sqob, sqoh, sqos, skob, skoh, skos, scb, scs):
    # program (row, head block): q's head blocks first, then k's; each reads its row's cos/sin
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cs = b * scb + s * scs + d
    c1 = tl.load(cos_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    q_blocks = tl.cdiv(n_heads_q, BLOCK_H)
    hb = tl.program_id(1)
    if hb < q_blocks:
        _rope_fwd_heads(q_ptr, qo_ptr, b, s, hb * BLOCK_H + tl.arange(0, BLOCK_H), n_heads_q, sqb, sqh, sqs, sqob, sqoh,
                     sqos, c1, c2, s1, s2)
    else:
        _rope_fwd_heads(k_ptr, ko_ptr, b, s, (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H), n_heads_k, skb, skh,
                     sks, skob, skoh, skos, c1, c2, s1, s2)


@triton.jit
def _rope_bwd_heads(x_ptr, out_ptr, b, s, heads, n_heads, sxb, sxh, sxs, sob, soh, sos, c1, c2, s1, s2):
    # dx = the transposed rotation of dout (x_ptr)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    hmask = heads < n_heads
    hh = heads.to(tl.int64)[:, None]
    x_row = x_ptr + b * sxb + s * sxs + hh * sxh
    o_row = out_ptr + b * sob + s * sos + hh * soh
    mask = hmask[:, None] & dmask[None, :]
    x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + d[None, :], (x1 * c1 + x2 * s2).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF + d[None, :], (x2 * c2 - x1 * s1).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_bwd(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_heads_q, n_heads_k, sqb, sqh, sqs, skb, skh, sks,
          sqob, sqoh, sqos, skob, skoh, skos, scb, scs):
    # program (row, head block): q's head blocks first, then k's; each reads its row's cos/sin
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cs = b * scb + s * scs + d
    c1 = tl.load(cos_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    q_blocks = tl.cdiv(n_heads_q, BLOCK_H)
    hb = tl.program_id(1)
    if hb < q_blocks:
        _rope_bwd_heads(q_ptr, qo_ptr, b, s, hb * BLOCK_H + tl.arange(0, BLOCK_H), n_heads_q, sqb, sqh, sqs, sqob, sqoh,
                     sqos, c1, c2, s1, s2)
    else:
        _rope_bwd_heads(k_ptr, ko_ptr, b, s, (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H), n_heads_k, skb, skh,
                     sks, skob, skoh, skos, c1, c2, s1, s2)
