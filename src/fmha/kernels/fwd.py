"""Forward attention: one program per (query tile, query head, batch), online softmax.

Scores are in log2 units for fp16/bf16 and natural units for fp32/fp64 (``to_score_units``).

Key tiles come in two kinds: interior tiles, which every row of the query tile sees whole (no
per-element checks), and edge tiles on either side of them (window or sequence boundary),
checked element by element. Tiles outside the window are never visited.
"""

import triton
import triton.language as tl

from .common import (
    ALIBI_NONE,
    LN2,
    alibi_scores,
    dropout_bytes,
    exp_of_scores,
    load_philox,
    sequence_bounds,
    to_score_units,
    visible,
    window_bounds,
)


@triton.jit
def _fwd_tile(
    acc,
    l_i,
    m_i,
    q,
    start_n,
    k_base,
    v_base,
    k_offs,
    v_offs,
    bias_base,
    bias_offs,
    randval_base,
    randval_offs,
    offs_m,
    m0,
    sq,
    sk,
    diag,
    left,
    right,
    qk_scale,
    slope,
    alibi_diag,
    seed,
    offset,
    bh_index,
    drop_threshold,
    stride_ks,
    stride_vs,
    stride_bk,
    dq_ok,
    dv_ok,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EDGE: tl.constexpr,
    EVEN_DQ: tl.constexpr,
    EVEN_DV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_RANDVAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    LOG2_SCORES: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < sk
    k_ptrs = k_base + tl.cast(start_n, tl.int64) * stride_ks + k_offs
    v_ptrs = v_base + tl.cast(start_n, tl.int64) * stride_vs + v_offs
    if EDGE:
        k = tl.load(k_ptrs, mask=key_ok[None, :] & dq_ok[:, None], other=0.0)
    elif EVEN_DQ:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=dq_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale
    if HAS_BIAS:
        bias_ptrs = bias_base + tl.cast(start_n, tl.int64) * stride_bk + bias_offs
        if EDGE:
            bias = tl.load(bias_ptrs, mask=key_ok[None, :], other=0.0)
        else:
            bias = tl.load(bias_ptrs)
        s += to_score_units(bias.to(ACC_DTYPE), LOG2_SCORES)
    if ALIBI_MODE != ALIBI_NONE:
        s += alibi_scores(slope, offs_m[:, None], offs_n[None, :], alibi_diag, ALIBI_MODE)
    if EDGE:
        s = tl.where(visible(offs_m[:, None], offs_n[None, :], sk, diag, left, right), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EDGE or HAS_BIAS:
        # A row with nothing visible yet keeps m = -inf; exponentiate against 0 instead.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = exp_of_scores(s, m_use[:, None], LOG2_SCORES)
    alpha = exp_of_scores(m_i, m_use, LOG2_SCORES)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        rand = dropout_bytes(seed, offset, bh_index, m0, offs_n, BLOCK_M, BLOCK_N)
        if STORE_RANDVAL:
            in_range = (offs_m[:, None] < sq) & key_ok[None, :]
            tl.store(randval_base + start_n + randval_offs, rand.to(tl.uint8), mask=in_range)
        p = tl.where(rand <= drop_threshold, p, 0.0)
    if EDGE:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
    elif EVEN_DV:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, l_i, m_new


# Lengths, window sizes and dropout threshold stay runtime values: a new length never recompiles.
@triton.jit(
    do_not_specialize=[
        "seqlen_q", "seqlen_k", "num_m_blocks", "window_left", "window_right",
        "mask_bottom_right", "alibi_bottom_right", "drop_threshold",
    ]
)
def attention_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Bias,
    AlibiSlopes,
    RandVal,
    PhiloxSeedOffset,
    SeqstartQ,
    SeqstartK,
    SeqlenK,
    SeqstartPaddedQ,
    SeqstartPaddedK,
    CuSeqlenQ,
    CuSeqlenK,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_bb,
    stride_bh,
    stride_bs,
    stride_bk,
    stride_ab,
    stride_ah,
    stride_rb,
    stride_rh,
    stride_rs,
    seqlen_q,
    seqlen_k,
    nhead_q,
    head_ratio,
    num_m_blocks,
    qk_scale,
    window_left,
    window_right,
    mask_bottom_right,
    alibi_bottom_right,
    drop_threshold,
    drop_rescale,
    HEAD_DIM_Q: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_GROUP: tl.constexpr,
    HAS_SEQLEN_K: tl.constexpr,
    HAS_PADDED_Q: tl.constexpr,
    HAS_PADDED_K: tl.constexpr,
    HAS_CU_SEQLEN_Q: tl.constexpr,
    HAS_CU_SEQLEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_RANDVAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOG2_SCORES: tl.constexpr,
):
    # float64 inputs accumulate in float64 (for gradcheck); everything else in float32.
    ACC_DTYPE: tl.constexpr = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32
    pid = tl.program_id(0)
    # A head's query tiles run next to each other (its K/V stay in L2), the last first: under a
    # causal mask they see the most keys, so the short ones fill the final wave.
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    bh_index = pid // num_m_blocks
    h = bh_index % nhead_q
    b = bh_index // nhead_q
    sq, sk, q_row0, k_row0, lse_row0 = sequence_bounds(
        b, SeqstartQ, SeqstartK, SeqlenK, SeqstartPaddedQ, SeqstartPaddedK, CuSeqlenQ, CuSeqlenK,
        seqlen_q, seqlen_k, IS_GROUP, HAS_SEQLEN_K, HAS_PADDED_Q, HAS_PADDED_K,
        HAS_CU_SEQLEN_Q, HAS_CU_SEQLEN_K,
    )
    m0 = m_block * BLOCK_M
    if m0 >= sq:
        return

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = (h // head_ratio).to(tl.int64)
    q_base = Q + b64 * stride_qb + q_row0.to(tl.int64) * stride_qs + h64 * stride_qh
    k_base = K + b64 * stride_kb + k_row0.to(tl.int64) * stride_ks + hk64 * stride_kh
    v_base = V + b64 * stride_vb + k_row0.to(tl.int64) * stride_vs + hk64 * stride_vh

    offs_m = m0 + tl.arange(0, BLOCK_M)
    # Rows past the sequence read its last row instead (always in bounds) and are never stored.
    tile_rows = tl.minimum(offs_m, sq - 1) - m0
    rows = (m0 + tile_rows).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQ)
    offs_dv = tl.arange(0, BLOCK_DV)
    dq_ok = offs_dq < HEAD_DIM_Q
    dv_ok = offs_dv < HEAD_DIM_V
    EVEN_DQ: tl.constexpr = BLOCK_DQ == HEAD_DIM_Q
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V

    q_ptrs = q_base + rows[:, None] * stride_qs + offs_dq[None, :]
    if EVEN_DQ:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=dq_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_offs = offs_n[None, :] * stride_ks + offs_dq[:, None]
    v_offs = offs_n[:, None] * stride_vs + offs_dv[None, :]

    bias_base = Bias
    bias_offs = offs_n[None, :]
    if HAS_BIAS:
        bias_base = Bias + b64 * stride_bb + h64 * stride_bh + (q_row0 + m0).to(tl.int64) * stride_bs
        bias_offs = tile_rows[:, None] * stride_bs + offs_n[None, :] * stride_bk
    slope = 0.0
    alibi_diag = 0
    if ALIBI_MODE != ALIBI_NONE:
        slope = to_score_units(tl.load(AlibiSlopes + b * stride_ab + h * stride_ah), LOG2_SCORES)
        alibi_diag = alibi_bottom_right * (sk - sq)
    seed = tl.zeros((), dtype=tl.uint64)
    offset = tl.zeros((), dtype=tl.uint64)
    randval_base = RandVal
    randval_offs = offs_n[None, :]
    if HAS_DROPOUT:
        seed, offset = load_philox(PhiloxSeedOffset)
        if STORE_RANDVAL:
            randval_base = RandVal + b64 * stride_rb + h64 * stride_rh + (q_row0 + m0).to(tl.int64) * stride_rs
            randval_offs = tl.arange(0, BLOCK_M)[:, None] * stride_rs + offs_n[None, :]

    # Key range of this query tile, and the interior that all of its rows see whole.
    diag, left, right = window_bounds(sq, sk, window_left, window_right, mask_bottom_right)
    first_row = m0
    last_row = tl.minimum(m0 + BLOCK_M, sq) - 1
    kv_lo = tl.maximum(first_row + diag - left, 0)
    kv_hi = tl.minimum(last_row + diag + right + 1, sk)
    full_lo = tl.maximum(last_row + diag - left, 0)
    full_hi = tl.minimum(first_row + diag + right + 1, sk)
    tile_lo = (kv_lo // BLOCK_N) * BLOCK_N
    inner_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    inner_hi = (full_hi // BLOCK_N) * BLOCK_N
    empty = kv_hi <= kv_lo
    tile_lo = tl.where(empty, 0, tile_lo)
    kv_hi = tl.where(empty, 0, kv_hi)
    has_inner = inner_hi > inner_lo
    split_lo = tl.where(has_inner, inner_lo, kv_hi)
    split_hi = tl.where(has_inner, inner_hi, kv_hi)
    edge_before = tl.cdiv(split_lo - tile_lo, BLOCK_N)
    edge_tiles = edge_before + tl.cdiv(kv_hi - split_hi, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC_DTYPE)
    for start_n in range(split_lo, split_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, start_n, k_base, v_base, k_offs, v_offs, bias_base, bias_offs,
            randval_base, randval_offs, offs_m, m0, sq, sk, diag, left, right, qk_scale, slope,
            alibi_diag, seed, offset, bh_index, drop_threshold, stride_ks, stride_vs, stride_bk,
            dq_ok, dv_ok, BLOCK_M, BLOCK_N, False, EVEN_DQ, EVEN_DV, HAS_BIAS, ALIBI_MODE,
            HAS_DROPOUT, STORE_RANDVAL, UPCAST, DOT_PRECISION, ACC_DTYPE, LOG2_SCORES,
        )
    # Edge tiles on both sides of the interior, in one loop (softmax order does not matter).
    for t in range(0, edge_tiles):
        start_n = tl.where(t < edge_before, tile_lo + t * BLOCK_N, split_hi + (t - edge_before) * BLOCK_N)
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, start_n, k_base, v_base, k_offs, v_offs, bias_base, bias_offs,
            randval_base, randval_offs, offs_m, m0, sq, sk, diag, left, right, qk_scale, slope,
            alibi_diag, seed, offset, bh_index, drop_threshold, stride_ks, stride_vs, stride_bk,
            dq_ok, dv_ok, BLOCK_M, BLOCK_N, True, EVEN_DQ, EVEN_DV, HAS_BIAS, ALIBI_MODE,
            HAS_DROPOUT, STORE_RANDVAL, UPCAST, DOT_PRECISION, ACC_DTYPE, LOG2_SCORES,
        )

    # Empty rows (l = 0) give O = 0 and LSE = -inf.
    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    inv_l = tl.where(empty_row, 0.0, 1.0 / l_safe)
    if HAS_DROPOUT:
        inv_l = inv_l * drop_rescale
    out = acc * inv_l[:, None]
    row_ok = offs_m < sq
    o_base = Out + b64 * stride_ob + q_row0.to(tl.int64) * stride_os + h64 * stride_oh
    o_ptrs = o_base + offs_m[:, None].to(tl.int64) * stride_os + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    if LOG2_SCORES:
        lse = (m_i + tl.math.log2(l_safe)) * LN2
    else:
        lse = m_i + tl.math.log2(l_safe) * LN2
    lse = tl.where(empty_row, float("-inf"), lse)
    lse_ptrs = Lse + b64 * stride_lb + h64 * stride_lh + lse_row0 + offs_m
    tl.store(lse_ptrs, lse.to(tl.float32), mask=row_ok)
