"""tailorfx generated: flash_attention_bigbird_block=16_block_m=32_block_n=32_bwd_block_m=16_bwd_block_n=16_causal=True_documents=False_dtype=fp16_group=4_head_dim=128_mask=bigbird"""
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
BB_BLOCK = tl.constexpr(16)

# mask: bigbird, causal


@triton.jit
def attn_fwd(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, table_ptr, count_ptr, table_width, bm_ptr, num_blocks, scale, seq_len, num_heads):
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
    # key tiles: the host's table of those holding an allowed pair
    n_tiles = tl.load(count_ptr + tl.program_id(0))
    for j in range(0, n_tiles):
        kt = tl.load(table_ptr + tl.program_id(0) * table_width + j)
        offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_n = offs_n
        col_ok = offs_n < n_keys
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        mask = col_ok[None, :]
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
        allowed = tl.load(bm_ptr + (offs_m[:, None] // BB_BLOCK) * num_blocks + offs_n[None, :] // BB_BLOCK, mask=mask, other=0)
        mask = mask & (allowed != 0)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays 0
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
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
def attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, table_ptr, count_ptr, table_width, bm_ptr, num_blocks, scale, seq_len, num_heads):
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
    # key tiles: the host's table of those holding an allowed pair
    n_tiles = tl.load(count_ptr + tl.program_id(0))
    for j in range(0, n_tiles):
        kt = tl.load(table_ptr + tl.program_id(0) * table_width + j)
        offs_n = kt * DQ_BLOCK_N + tl.arange(0, DQ_BLOCK_N)
        pos_n = offs_n
        col_ok = offs_n < n_keys
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        mask = col_ok[None, :]
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
        allowed = tl.load(bm_ptr + (offs_m[:, None] // BB_BLOCK) * num_blocks + offs_n[None, :] // BB_BLOCK, mask=mask, other=0)
        mask = mask & (allowed != 0)
        # lse is -inf only on rows with no allowed key, where the mask drops every p
        p = tl.where(mask, tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(tl.float16), k)
    tl.store(dq_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, table_ptr, count_ptr, table_width, bm_ptr, num_blocks, scale, seq_len, num_heads, KV_SPLIT: tl.constexpr):
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
    # query tiles: the host's table of those that see this key tile
    n_tiles = tl.load(count_ptr + tl.program_id(0))
    for h in range(h0, h0 + GROUP // KV_SPLIT):
        bh = b * num_heads + h
        for j in range(0, n_tiles):
            qt = tl.load(table_ptr + tl.program_id(0) * table_width + j)
            offs_m = qt * BWD_BLOCK_M + tl.arange(0, BWD_BLOCK_M)
            pos_m = offs_m
            row_ok = offs_m < n_keys
            row_ptrs = bh.to(tl.int64) * seq_len * HEAD_DIM + pos_m[:, None] * HEAD_DIM + offs_d[None, :]
            q = tl.load(q_ptr + row_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptr + row_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0)
            st = tl.dot(k, tl.trans(q))
            mask = col_ok[:, None] & row_ok[None, :]
            mask = mask & (offs_n[:, None] <= offs_m[None, :])
            allowed = tl.load(bm_ptr + (offs_m[None, :] // BB_BLOCK) * num_blocks + offs_n[:, None] // BB_BLOCK, mask=mask, other=0)
            mask = mask & (allowed != 0)
            pt = tl.where(mask, tl.math.exp2(st * qk_scale - lse2[None, :]), 0.0)
            dv += tl.dot(pt.to(tl.float16), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(tl.float16), q)
    part_offset = (tl.program_id(1) % KV_SPLIT).to(tl.int64) * (tl.num_programs(1) // KV_SPLIT) * seq_len * HEAD_DIM
    tl.store(dk_ptr + part_offset + col_ptrs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + part_offset + col_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])
