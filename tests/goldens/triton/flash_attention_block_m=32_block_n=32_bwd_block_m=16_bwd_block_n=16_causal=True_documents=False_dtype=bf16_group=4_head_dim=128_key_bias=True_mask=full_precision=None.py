"""tailorfx generated: flash_attention_block_m=32_block_n=32_bwd_block_m=16_bwd_block_n=16_causal=True_documents=False_dtype=bf16_group=4_head_dim=128_key_bias=True_mask=full_precision=None"""
import triton
import triton.language as tl

HEAD_DIM = tl.constexpr(128)
BLOCK_D = tl.constexpr(128)
BLOCK_M = tl.constexpr(32)
BLOCK_N = tl.constexpr(32)
DQ_BLOCK_M = tl.constexpr(32)
DQ_BLOCK_N = tl.constexpr(32)
BWD_BLOCK_M = tl.constexpr(16)
BWD_BLOCK_N = tl.constexpr(16)
GROUP = tl.constexpr(4)
LOG2E = tl.constexpr(1.4426950408889634)

# mask: full, causal, key bias


@triton.jit
def attn_fwd(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, kb_ptr, scale, seq_len, num_heads):
    scale = tl.cast(scale, tl.float32)
    qk_scale = scale * LOG2E   # natural scores to exp2's units
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    kv_bh = b * (num_heads // GROUP) + h // GROUP
    start_m = tl.program_id(0) * BLOCK_M
    n_keys = seq_len
    offs_m = start_m + tl.arange(0, BLOCK_M)
    pos_m = offs_m
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n_keys
    q_base = q_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM
    k_base = k_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    v_base = v_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    row_ptrs = pos_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_base + row_ptrs, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.cdiv(tl.minimum(start_m + BLOCK_M, n_keys), BLOCK_N)  # causal: no tile past the last row
    n_full = (start_m + 1) // BLOCK_N  # key tiles wholly at or before the first row
    for kt in range(0, n_full):
        offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_n = offs_n
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs)
        v = tl.load(v_base + col_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = s + tl.load(kb_ptr + bh * seq_len + pos_n)[None, :] * LOG2E
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new
    for kt in range(n_full, hi):
        offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_n = offs_n
        col_ok = offs_n < n_keys
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = s + tl.load(kb_ptr + bh * seq_len + pos_n, mask=col_ok, other=0.0)[None, :] * LOG2E
        mask = col_ok[None, :]
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(l_safe)) / LOG2E)
    tl.store(out_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + bh * seq_len + pos_m, lse, mask=row_ok)


@triton.jit
def attn_bwd_preprocess(out_ptr, do_ptr, delta_ptr, n_rows):
    # delta = rowsum(dout * out) over the rows of (B * H * S, D)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n_rows
    ptrs = offs_m.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(out_ptr + ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + offs_m, tl.sum(o * do, axis=1), mask=row_ok)


@triton.jit
def attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, kb_ptr, scale, seq_len, num_heads):
    scale = tl.cast(scale, tl.float32)
    qk_scale = scale * LOG2E   # natural scores to exp2's units
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    kv_bh = b * (num_heads // GROUP) + h // GROUP
    start_m = tl.program_id(0) * DQ_BLOCK_M
    n_keys = seq_len
    offs_m = start_m + tl.arange(0, DQ_BLOCK_M)
    pos_m = offs_m
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n_keys
    q_base = q_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM
    k_base = k_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    v_base = v_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    row_ptrs = pos_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_base + row_ptrs, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * seq_len + pos_m, mask=row_ok, other=float("inf"))
    lse2 = lse * LOG2E   # in exp2's units
    delta = tl.load(delta_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0)
    dq = tl.zeros([DQ_BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.cdiv(tl.minimum(start_m + DQ_BLOCK_M, n_keys), DQ_BLOCK_N)  # causal: no tile past the last row
    n_full = (start_m + 1) // DQ_BLOCK_N  # key tiles wholly at or before the first row
    for kt in range(0, n_full):
        offs_n = kt * DQ_BLOCK_N + tl.arange(0, DQ_BLOCK_N)
        pos_n = offs_n
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs)
        v = tl.load(v_base + col_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = s + tl.load(kb_ptr + bh * seq_len + pos_n)[None, :] * LOG2E
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(tl.bfloat16), k)
    for kt in range(n_full, hi):
        offs_n = kt * DQ_BLOCK_N + tl.arange(0, DQ_BLOCK_N)
        pos_n = offs_n
        col_ok = offs_n < n_keys
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = s + tl.load(kb_ptr + bh * seq_len + pos_n, mask=col_ok, other=0.0)[None, :] * LOG2E
        mask = col_ok[None, :]
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
        # lse is -inf only on rows with no allowed key, where the mask drops every p
        p = tl.where(mask, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(tl.bfloat16), k)
    tl.store(dq_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, kb_ptr, scale, seq_len, num_heads, KV_SPLIT: tl.constexpr):
    scale = tl.cast(scale, tl.float32)
    qk_scale = scale * LOG2E   # natural scores to exp2's units
    num_kv = num_heads // GROUP
    # KV_SPLIT programs share a kv head's query heads, each writing its fp32 part
    bkv = tl.program_id(1) // KV_SPLIT
    h0 = tl.program_id(1) % (num_kv * KV_SPLIT) * (GROUP // KV_SPLIT)   # its first query head
    start_n = tl.program_id(0) * BWD_BLOCK_N
    n_keys = seq_len
    offs_n = start_n + tl.arange(0, BWD_BLOCK_N)
    pos_n = offs_n
    b = bkv // num_kv
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < n_keys
    col_ptrs = bkv.to(tl.int64) * seq_len * HEAD_DIM + pos_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + col_ptrs, mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + col_ptrs, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BWD_BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BWD_BLOCK_N, BLOCK_D], dtype=tl.float32)
    for h in range(h0, h0 + GROUP // KV_SPLIT):
        bh = b * num_heads + h
        for qt in range(start_n // BWD_BLOCK_M, tl.cdiv(n_keys, BWD_BLOCK_M)):
            offs_m = qt * BWD_BLOCK_M + tl.arange(0, BWD_BLOCK_M)
            pos_m = offs_m
            row_ok = offs_m < n_keys
            row_ptrs = bh.to(tl.int64) * seq_len * HEAD_DIM + pos_m[:, None] * HEAD_DIM + offs_d[None, :]
            q = tl.load(q_ptr + row_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptr + row_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0)
            st = tl.dot(k, tl.trans(q)) * qk_scale
            st = st + tl.load(kb_ptr + bh * seq_len + pos_n, mask=col_ok, other=0.0)[:, None] * LOG2E
            mask = col_ok[:, None] & row_ok[None, :]
            mask = mask & (offs_n[:, None] <= offs_m[None, :])
            pt = tl.where(mask, tl.math.exp2(st - lse2[None, :]), 0.0)
            dv += tl.dot(pt.to(tl.bfloat16), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(tl.bfloat16), q)
    part_offset = (tl.program_id(1) % KV_SPLIT).to(tl.int64) * (tl.num_programs(1) // KV_SPLIT) * seq_len * HEAD_DIM
    tl.store(dk_ptr + part_offset + col_ptrs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + part_offset + col_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])
