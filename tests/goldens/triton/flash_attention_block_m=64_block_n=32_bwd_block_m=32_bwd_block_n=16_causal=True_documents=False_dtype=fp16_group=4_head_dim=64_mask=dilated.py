"""tailorfx generated: flash_attention_block_m=64_block_n=32_bwd_block_m=32_bwd_block_n=16_causal=True_documents=False_dtype=fp16_group=4_head_dim=64_mask=dilated"""
import triton
import triton.language as tl

HEAD_DIM = tl.constexpr(64)
BLOCK_D = tl.constexpr(64)
BLOCK_M = tl.constexpr(64)
BLOCK_N = tl.constexpr(32)
DQ_BLOCK_M = tl.constexpr(64)
DQ_BLOCK_N = tl.constexpr(32)
BWD_BLOCK_M = tl.constexpr(32)
BWD_BLOCK_N = tl.constexpr(16)
GROUP = tl.constexpr(4)
LOG2E = tl.constexpr(1.4426950408889634)

# mask: dilated, causal


@triton.jit
def attn_fwd(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, segment, rate, scale, seq_len, num_heads):
    scale = tl.cast(scale, tl.float32)
    qk_scale = scale * LOG2E   # natural scores to exp2's units
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    kv_bh = b * (num_heads // GROUP) + h // GROUP
    # one dilated branch: this head's offset o = h % rate within each segment
    tiles_per_segment = tl.cdiv(tl.cdiv(segment, rate), BLOCK_M)
    seg = tl.program_id(0) // tiles_per_segment
    start_m = (tl.program_id(0) % tiles_per_segment) * BLOCK_M
    base = seg * segment + h % rate
    n_keys = (tl.minimum(segment, seq_len - seg * segment) - h % rate + rate - 1) // rate
    offs_m = start_m + tl.arange(0, BLOCK_M)
    pos_m = base + offs_m * rate
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
    for kt in range(0, hi):
        offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_n = base + offs_n * rate
        col_ok = offs_n < n_keys
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        mask = col_ok[None, :]
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * LOG2E)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays 0
        p = tl.math.exp2(s * LOG2E - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(l_safe)) / LOG2E)
    out_ptrs = out_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs
    lse_ptrs = lse_ptr + bh * seq_len + pos_m
    lse_old = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
    o_old = tl.load(out_ptrs, mask=row_ok[:, None], other=0.0)
    top = tl.maximum(lse_old, lse)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.math.exp2((lse_old - top_safe) * LOG2E) + tl.math.exp2((lse - top_safe) * LOG2E)
    new = tl.where(total == 0.0, float("-inf"), top_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    new_safe = tl.where(new == float("-inf"), 0.0, new)
    o = o_old * tl.math.exp2((lse_old - new_safe) * LOG2E)[:, None] + out * tl.math.exp2((lse - new_safe) * LOG2E)[:, None]
    tl.store(out_ptrs, o, mask=row_ok[:, None])
    tl.store(lse_ptrs, new, mask=row_ok)


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
def attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, segment, rate, scale, seq_len, num_heads):
    scale = tl.cast(scale, tl.float32)
    qk_scale = scale * LOG2E   # natural scores to exp2's units
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    kv_bh = b * (num_heads // GROUP) + h // GROUP
    # one dilated branch: this head's offset o = h % rate within each segment
    tiles_per_segment = tl.cdiv(tl.cdiv(segment, rate), DQ_BLOCK_M)
    seg = tl.program_id(0) // tiles_per_segment
    start_m = (tl.program_id(0) % tiles_per_segment) * DQ_BLOCK_M
    base = seg * segment + h % rate
    n_keys = (tl.minimum(segment, seq_len - seg * segment) - h % rate + rate - 1) // rate
    offs_m = start_m + tl.arange(0, DQ_BLOCK_M)
    pos_m = base + offs_m * rate
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
    for kt in range(0, hi):
        offs_n = kt * DQ_BLOCK_N + tl.arange(0, DQ_BLOCK_N)
        pos_n = base + offs_n * rate
        col_ok = offs_n < n_keys
        col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + col_ptrs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        mask = col_ok[None, :]
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
        # lse is -inf only on rows with no allowed key, where the mask drops every p
        p = tl.where(mask, tl.math.exp2(s * LOG2E - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(tl.float16), k)
    dq_ptrs = dq_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs
    dq = dq * scale + tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
    tl.store(dq_ptrs, dq, mask=row_ok[:, None])


@triton.jit
def attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, segment, rate, scale, seq_len, num_heads):
    scale = tl.cast(scale, tl.float32)
    qk_scale = scale * LOG2E   # natural scores to exp2's units
    num_kv = num_heads // GROUP
    # one dilated branch: this kv head's query heads with one offset (h % rate), at most
    # min(GROUP, rate) offsets per kv head, one program each
    n_off = tl.minimum(GROUP, rate)
    bkv = tl.program_id(1) // n_off
    offset = ((bkv % num_kv) * GROUP + tl.program_id(1) % n_off) % rate
    tiles_per_segment = tl.cdiv(tl.cdiv(segment, rate), BWD_BLOCK_N)
    seg = tl.program_id(0) // tiles_per_segment
    start_n = (tl.program_id(0) % tiles_per_segment) * BWD_BLOCK_N
    base = seg * segment + offset
    n_keys = (tl.minimum(segment, seq_len - seg * segment) - offset + rate - 1) // rate
    offs_n = start_n + tl.arange(0, BWD_BLOCK_N)
    pos_n = base + offs_n * rate
    b = bkv // num_kv
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < n_keys
    col_ptrs = bkv.to(tl.int64) * seq_len * HEAD_DIM + pos_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + col_ptrs, mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + col_ptrs, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BWD_BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BWD_BLOCK_N, BLOCK_D], dtype=tl.float32)
    for h in range((bkv % num_kv) * GROUP, (bkv % num_kv) * GROUP + GROUP):
        bh = b * num_heads + h
        for qt in range(start_n // BWD_BLOCK_M, tl.where(h % rate == offset, tl.cdiv(n_keys, BWD_BLOCK_M), 0)):
            offs_m = qt * BWD_BLOCK_M + tl.arange(0, BWD_BLOCK_M)
            pos_m = base + offs_m * rate
            row_ok = offs_m < n_keys
            row_ptrs = bh.to(tl.int64) * seq_len * HEAD_DIM + pos_m[:, None] * HEAD_DIM + offs_d[None, :]
            q = tl.load(q_ptr + row_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptr + row_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0)
            st = tl.dot(k, tl.trans(q)) * scale
            mask = col_ok[:, None] & row_ok[None, :]
            mask = mask & (offs_n[:, None] <= offs_m[None, :])
            pt = tl.where(mask, tl.math.exp2(st * LOG2E - lse2[None, :]), 0.0)
            dv += tl.dot(pt.to(tl.float16), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(tl.float16), q)
    dk = dk * scale + tl.load(dk_ptr + col_ptrs, mask=col_ok[:, None], other=0.0)
    dv = dv + tl.load(dv_ptr + col_ptrs, mask=col_ok[:, None], other=0.0)
    tl.store(dk_ptr + col_ptrs, dk, mask=col_ok[:, None])
    tl.store(dv_ptr + col_ptrs, dv, mask=col_ok[:, None])
