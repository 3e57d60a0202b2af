"""Backward main kernels: dK/dV per key tile (with dQ by atomics), and dQ per query tile.

``attention_bwd_dkdv_kernel``: one program per (key tile, key/value head, batch). It walks the
query heads of its GQA group and, for each, the query tiles that see its keys, accumulating
dK and dV in registers (so GQA sums need no per-query-head buffers). With ``ATOMIC_DQ`` it also
adds each tile's dQ contribution to an fp32 accumulator with atomics. It writes the true
``dBias = dS`` when asked.

``attention_bwd_dq_kernel`` (deterministic mode): one program per (query tile, query head, batch)
that walks the key tiles in a fixed order and keeps dQ in registers: no atomics, no workspace.

Both hold scores in the forward's units (``to_score_units``): ``P = exp(S * scale + ... - LSE)``.
With ``D = (1 - p) * rowsum(dO * O)`` and ``Z`` the keep mask, the true ``dS = P * (Z * dP - D) / (1 - p)``.
"""

import triton
import triton.language as tl

from .common import (
    ALIBI_NONE,
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
def _dkdv_tile(
    dk,
    dv,
    k,
    v,
    m0,
    n0,
    q_base,
    do_base,
    lse_base,
    delta_base,
    dq_base,
    dq_desc,
    dq_desc_row,
    dq_desc_col,
    bias_base,
    dbias_base,
    offs_n,
    sq,
    sk,
    diag,
    left,
    right,
    qk_scale,
    dq_scale,
    slope,
    alibi_diag,
    seed,
    offset,
    bh_index,
    drop_threshold,
    drop_rescale,
    stride_qs,
    stride_dos,
    stride_dqs,
    stride_bs,
    stride_bk,
    stride_dbs,
    stride_dbk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HEAD_DIM_Q: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    EDGE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_DBIAS: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DQ_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    LOG2_SCORES: tl.constexpr,
):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQ)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < sq
    dq_ok = offs_dq < HEAD_DIM_Q
    dv_ok = offs_dv < HEAD_DIM_V
    # 64-bit tile origins, 32-bit offsets inside the tile (fewer live registers).
    m64 = tl.cast(m0, tl.int64)
    local_m = tl.arange(0, BLOCK_M)
    q_ptrs = q_base + m64 * stride_qs + (local_m[:, None] * stride_qs + offs_dq[None, :])
    do_ptrs = do_base + m64 * stride_dos + (local_m[:, None] * stride_dos + offs_dv[None, :])
    if EDGE:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dq_ok[None, :], other=0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
    else:
        if BLOCK_DQ == HEAD_DIM_Q:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=dq_ok[None, :], other=0.0)
        if BLOCK_DV == HEAD_DIM_V:
            do = tl.load(do_ptrs)
        else:
            do = tl.load(do_ptrs, mask=dv_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # Fully masked rows carry LSE = -inf: read it as 0 so that P = exp2(-inf) = 0.
    lse_s = tl.where(lse == float("-inf"), 0.0, to_score_units(lse, LOG2_SCORES))

    # Scores transposed, [keys, queries]: every product but dQ's has the key tile as its rows,
    # so the matrix units see BLOCK_N (not the short query tile) as their M dimension.
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale
    i = offs_m[None, :]
    j = offs_n[:, None]
    if HAS_BIAS:
        bias_ptrs = (bias_base + m64 * stride_bs + tl.cast(n0, tl.int64) * stride_bk
                     + (local_m[None, :] * stride_bs + tl.arange(0, BLOCK_N)[:, None] * stride_bk))
        if EDGE:
            bias = tl.load(bias_ptrs, mask=(j < sk) & (i < sq), other=0.0)
        else:
            bias = tl.load(bias_ptrs)
        s_t += to_score_units(bias.to(ACC_DTYPE), LOG2_SCORES)
    if ALIBI_MODE != ALIBI_NONE:
        s_t += alibi_scores(slope, i, j, alibi_diag, ALIBI_MODE)
    if EDGE:
        s_t = tl.where(visible(i, j, sk, diag, left, right) & (i < sq), s_t, float("-inf"))
    p_t = exp_of_scores(s_t, lse_s[None, :], LOG2_SCORES)

    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_DROPOUT:
        keep_t = tl.trans(dropout_bytes(seed, offset, bh_index, m0, offs_n, BLOCK_M, BLOCK_N)) <= drop_threshold
        dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION,
                    out_dtype=ACC_DTYPE)
        dp_t = tl.where(keep_t, dp_t, 0.0)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    ds_t = p_t * (dp_t - delta[None, :])  # (1 - p) * the true dS^T
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if STORE_DBIAS:
        dbias_ptrs = (dbias_base + m64 * stride_dbs + tl.cast(n0, tl.int64) * stride_dbk
                      + (local_m[None, :] * stride_dbs + tl.arange(0, BLOCK_N)[:, None] * stride_dbk))
        tl.store(dbias_ptrs, ds_t * drop_rescale, mask=(i < sq) & (j < sk))
    if ATOMIC_DQ:
        # dQ^T = K^T dS^T keeps the head dim as M, so this product also runs on wgmma.
        dq_t = tl.dot(tl.trans(k), ds_t.to(k.dtype), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * dq_scale
        if DQ_TMA and not EDGE:
            # Interior tiles: one bulk reduction through the tensor memory accelerator, no
            # per-element addresses held in registers.
            dq_desc.atomic_add([dq_desc_row + m0, dq_desc_col], tl.trans(dq_t))
        else:
            dq_ptrs = dq_base + m64 * stride_dqs + (local_m[None, :] * stride_dqs + offs_dq[:, None])
            tl.atomic_add(dq_ptrs, dq_t, mask=row_ok[None, :] & dq_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit(
    do_not_specialize=[
        "seqlen_q", "seqlen_k", "num_n_blocks", "window_left", "window_right",
        "mask_bottom_right", "alibi_bottom_right", "drop_threshold",
    ]
)
def attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    Bias,
    AlibiSlopes,
    PhiloxSeedOffset,
    DOut,
    Lse,
    Delta,
    DQAcc,
    DQAccDesc,
    DK,
    DV,
    DBias,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_lb,
    stride_lh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    dq_desc_rows_per_batch,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_bb,
    stride_bh,
    stride_bs,
    stride_bk,
    stride_dbb,
    stride_dbh,
    stride_dbs,
    stride_dbk,
    stride_ab,
    stride_ah,
    seqlen_q,
    seqlen_k,
    nhead_q,
    nhead_k,
    head_ratio,
    num_n_blocks,
    qk_scale,
    dq_scale,
    dk_scale,
    dv_scale,
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
    STORE_DBIAS: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DQ_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOG2_SCORES: tl.constexpr,
):
    # float64 inputs accumulate in float64 (for gradcheck); everything else in float32.
    ACC_DTYPE: tl.constexpr = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32
    pid = tl.program_id(0)
    n_block = pid % num_n_blocks
    bhk = pid // num_n_blocks
    hk = bhk % nhead_k
    b = bhk // nhead_k
    sq, sk, q_row0, k_row0, lse_row0 = sequence_bounds(
        b, SeqstartQ, SeqstartK, SeqlenK, SeqstartPaddedQ, SeqstartPaddedK, CuSeqlenQ, CuSeqlenK,
        seqlen_q, seqlen_k, IS_GROUP, HAS_SEQLEN_K, HAS_PADDED_Q, HAS_PADDED_K,
        HAS_CU_SEQLEN_Q, HAS_CU_SEQLEN_K,
    )
    n0 = n_block * BLOCK_N
    if n0 >= sk:
        return

    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQ)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n < sk
    dq_ok = offs_dq < HEAD_DIM_Q
    dv_ok = offs_dv < HEAD_DIM_V
    key_rows = (k_row0 + offs_n).to(tl.int64)
    # Keys past the sequence load as zeros (padding may hold NaN) and are never stored.
    k = tl.load(K + b64 * stride_kb + hk64 * stride_kh + key_rows[:, None] * stride_ks + offs_dq[None, :],
                mask=key_ok[:, None] & dq_ok[None, :], other=0.0)
    v = tl.load(V + b64 * stride_vb + hk64 * stride_vh + key_rows[:, None] * stride_vs + offs_dv[None, :],
                mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    # Query range of this key tile, and its interior: query tiles whose every row sees every key.
    diag, left, right = window_bounds(sq, sk, window_left, window_right, mask_bottom_right)
    last_key = tl.minimum(n0 + BLOCK_N, sk) - 1
    q_lo = tl.maximum(n0 - diag - right, 0)
    q_hi = tl.minimum(last_key - diag + left + 1, sq)
    full_lo = tl.maximum(last_key - diag - right, 0)
    full_hi = tl.minimum(n0 - diag + left + 1, sq)
    tile_lo = (q_lo // BLOCK_M) * BLOCK_M
    inner_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    inner_hi = (full_hi // BLOCK_M) * BLOCK_M
    empty = q_hi <= q_lo
    tile_lo = tl.where(empty, 0, tile_lo)
    q_hi = tl.where(empty, 0, q_hi)
    has_inner = (inner_hi > inner_lo) & (n0 + BLOCK_N <= sk)
    split_lo = tl.where(has_inner, inner_lo, q_hi)
    split_hi = tl.where(has_inner, inner_hi, q_hi)
    edge_before = tl.cdiv(split_lo - tile_lo, BLOCK_M)
    edge_tiles = edge_before + tl.cdiv(q_hi - split_hi, BLOCK_M)

    slope = 0.0
    alibi_diag = 0
    if ALIBI_MODE != ALIBI_NONE:
        alibi_diag = alibi_bottom_right * (sk - sq)
    seed = tl.zeros((), dtype=tl.uint64)
    offset = tl.zeros((), dtype=tl.uint64)
    if HAS_DROPOUT:
        seed, offset = load_philox(PhiloxSeedOffset)

    dk = tl.zeros([BLOCK_N, BLOCK_DQ], dtype=ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC_DTYPE)
    for h in range(hk * head_ratio, (hk + 1) * head_ratio):
        h64 = tl.cast(h, tl.int64)
        q_base = Q + b64 * stride_qb + h64 * stride_qh + q_row0.to(tl.int64) * stride_qs
        do_base = DOut + b64 * stride_dob + h64 * stride_doh + q_row0.to(tl.int64) * stride_dos
        dq_base = DQAcc + b64 * stride_dqb + h64 * stride_dqh + q_row0.to(tl.int64) * stride_dqs
        lse_base = Lse + b64 * stride_lb + h64 * stride_lh + lse_row0
        delta_base = Delta + b64 * stride_lb + h64 * stride_lh + lse_row0
        bias_base = Bias
        dbias_base = DBias
        if HAS_BIAS:
            bias_base = Bias + b64 * stride_bb + h64 * stride_bh + q_row0.to(tl.int64) * stride_bs
        if STORE_DBIAS:
            dbias_base = DBias + b64 * stride_dbb + h64 * stride_dbh + q_row0.to(tl.int64) * stride_dbs
        if ALIBI_MODE != ALIBI_NONE:
            slope = to_score_units(tl.load(AlibiSlopes + b * stride_ab + h * stride_ah), LOG2_SCORES)
        bh_index = b * nhead_q + h
        # The fp32 dQ accumulator seen as [rows, nhead_q * BLOCK_DQ]: this head's tile origin.
        dq_desc_row = b * dq_desc_rows_per_batch + q_row0
        dq_desc_col = h * BLOCK_DQ
        for m0 in range(split_lo, split_hi, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, m0, n0, q_base, do_base, lse_base, delta_base, dq_base, DQAccDesc,
                dq_desc_row, dq_desc_col, bias_base, dbias_base, offs_n, sq, sk, diag, left, right, qk_scale, dq_scale, slope,
                alibi_diag, seed, offset, bh_index, drop_threshold, drop_rescale, stride_qs, stride_dos,
                stride_dqs, stride_bs, stride_bk, stride_dbs, stride_dbk, BLOCK_M, BLOCK_N,
                BLOCK_DQ, BLOCK_DV, HEAD_DIM_Q, HEAD_DIM_V, False, HAS_BIAS, STORE_DBIAS,
                ALIBI_MODE, HAS_DROPOUT, ATOMIC_DQ, DQ_TMA, UPCAST, DOT_PRECISION, ACC_DTYPE, LOG2_SCORES,
            )
        for t in range(0, edge_tiles):
            m0 = tl.where(t < edge_before, tile_lo + t * BLOCK_M, split_hi + (t - edge_before) * BLOCK_M)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, m0, n0, q_base, do_base, lse_base, delta_base, dq_base, DQAccDesc,
                dq_desc_row, dq_desc_col, bias_base, dbias_base, offs_n, sq, sk, diag, left, right, qk_scale, dq_scale, slope,
                alibi_diag, seed, offset, bh_index, drop_threshold, drop_rescale, stride_qs, stride_dos,
                stride_dqs, stride_bs, stride_bk, stride_dbs, stride_dbk, BLOCK_M, BLOCK_N,
                BLOCK_DQ, BLOCK_DV, HEAD_DIM_Q, HEAD_DIM_V, True, HAS_BIAS, STORE_DBIAS,
                ALIBI_MODE, HAS_DROPOUT, ATOMIC_DQ, DQ_TMA, UPCAST, DOT_PRECISION, ACC_DTYPE, LOG2_SCORES,
            )

    dk_ptrs = DK + b64 * stride_dkb + hk64 * stride_dkh + key_rows[:, None] * stride_dks + offs_dq[None, :]
    dv_ptrs = DV + b64 * stride_dvb + hk64 * stride_dvh + key_rows[:, None] * stride_dvs + offs_dv[None, :]
    tl.store(dk_ptrs, (dk * dk_scale).to(DK.dtype.element_ty), mask=key_ok[:, None] & dq_ok[None, :])
    tl.store(dv_ptrs, (dv * dv_scale).to(DV.dtype.element_ty), mask=key_ok[:, None] & dv_ok[None, :])


@triton.jit
def _dq_tile(
    dq,
    q,
    do,
    lse_s,
    delta,
    start_n,
    k_base,
    v_base,
    bias_base,
    bias_rows,
    offs_m,
    m0,
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
    stride_bs,
    stride_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HEAD_DIM_Q: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    EDGE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    LOG2_SCORES: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQ)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n < sk
    n64 = tl.cast(start_n, tl.int64)
    local_n = tl.arange(0, BLOCK_N)
    k_ptrs = k_base + n64 * stride_ks + (local_n[:, None] * stride_ks + offs_dq[None, :])
    v_ptrs = v_base + n64 * stride_vs + (local_n[:, None] * stride_vs + offs_dv[None, :])
    if EDGE:
        k = tl.load(k_ptrs, mask=key_ok[:, None] & (offs_dq < HEAD_DIM_Q)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    else:
        if BLOCK_DQ == HEAD_DIM_Q:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=(offs_dq < HEAD_DIM_Q)[None, :], other=0.0)
        if BLOCK_DV == HEAD_DIM_V:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=(offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale
    i = offs_m[:, None]
    j = offs_n[None, :]
    if HAS_BIAS:
        bias_ptrs = bias_base + n64 * stride_bk + (bias_rows[:, None] * stride_bs + local_n[None, :] * stride_bk)
        if EDGE:
            bias = tl.load(bias_ptrs, mask=j < sk, other=0.0)
        else:
            bias = tl.load(bias_ptrs)
        s += to_score_units(bias.to(ACC_DTYPE), LOG2_SCORES)
    if ALIBI_MODE != ALIBI_NONE:
        s += alibi_scores(slope, i, j, alibi_diag, ALIBI_MODE)
    if EDGE:
        s = tl.where(visible(i, j, sk, diag, left, right), s, float("-inf"))
    p = exp_of_scores(s, lse_s[:, None], LOG2_SCORES)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_DROPOUT:
        keep = dropout_bytes(seed, offset, bh_index, m0, offs_n, BLOCK_M, BLOCK_N) <= drop_threshold
        dp = tl.where(keep, dp, 0.0)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)


@triton.jit(
    do_not_specialize=[
        "seqlen_q", "seqlen_k", "num_m_blocks", "window_left", "window_right",
        "mask_bottom_right", "alibi_bottom_right", "drop_threshold",
    ]
)
def attention_bwd_dq_kernel(
    Q,
    K,
    V,
    Bias,
    AlibiSlopes,
    PhiloxSeedOffset,
    DOut,
    Lse,
    Delta,
    DQ,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_lb,
    stride_lh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_bb,
    stride_bh,
    stride_bs,
    stride_bk,
    stride_ab,
    stride_ah,
    seqlen_q,
    seqlen_k,
    nhead_q,
    head_ratio,
    num_m_blocks,
    qk_scale,
    dq_scale,
    window_left,
    window_right,
    mask_bottom_right,
    alibi_bottom_right,
    drop_threshold,
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
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOG2_SCORES: tl.constexpr,
):
    # float64 inputs accumulate in float64 (for gradcheck); everything else in float32.
    ACC_DTYPE: tl.constexpr = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32
    pid = tl.program_id(0)
    # Last query tile first, as in the forward: under a causal mask it sees the most keys.
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
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQ)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < sq
    dq_ok = offs_dq < HEAD_DIM_Q
    dv_ok = offs_dv < HEAD_DIM_V
    rows = (q_row0 + offs_m).to(tl.int64)[:, None]
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + rows * stride_qs + offs_dq[None, :],
                mask=row_ok[:, None] & dq_ok[None, :], other=0.0)
    do = tl.load(DOut + b64 * stride_dob + h64 * stride_doh + rows * stride_dos + offs_dv[None, :],
                 mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + b64 * stride_lb + h64 * stride_lh + lse_row0 + offs_m, mask=row_ok, other=0.0)
    lse_s = tl.where(lse == float("-inf"), 0.0, to_score_units(lse, LOG2_SCORES))
    delta = tl.load(Delta + b64 * stride_lb + h64 * stride_lh + lse_row0 + offs_m, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_row0.to(tl.int64) * stride_ks
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_row0.to(tl.int64) * stride_vs
    bias_base = Bias
    # Rows past the sequence read its last bias row (in bounds); their dS is zero anyway.
    bias_rows = tl.minimum(offs_m, sq - 1) - m0
    if HAS_BIAS:
        bias_base = Bias + b64 * stride_bb + h64 * stride_bh + (q_row0 + m0).to(tl.int64) * stride_bs
    slope = 0.0
    alibi_diag = 0
    if ALIBI_MODE != ALIBI_NONE:
        slope = to_score_units(tl.load(AlibiSlopes + b * stride_ab + h * stride_ah), LOG2_SCORES)
        alibi_diag = alibi_bottom_right * (sk - sq)
    seed = tl.zeros((), dtype=tl.uint64)
    offset = tl.zeros((), dtype=tl.uint64)
    if HAS_DROPOUT:
        seed, offset = load_philox(PhiloxSeedOffset)

    # Key tiles of this query tile: the forward's ranges (rows past the sequence see nothing,
    # so edge tiles also cover the last, partial query tile).
    diag, left, right = window_bounds(sq, sk, window_left, window_right, mask_bottom_right)
    last_row = tl.minimum(m0 + BLOCK_M, sq) - 1
    kv_lo = tl.maximum(m0 + diag - left, 0)
    kv_hi = tl.minimum(last_row + diag + right + 1, sk)
    full_lo = tl.maximum(last_row + diag - left, 0)
    full_hi = tl.minimum(m0 + diag + right + 1, sk)
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

    dq = tl.zeros([BLOCK_M, BLOCK_DQ], dtype=ACC_DTYPE)
    for start_n in range(split_lo, split_hi, BLOCK_N):
        dq = _dq_tile(
            dq, q, do, lse_s, delta, start_n, k_base, v_base, bias_base, bias_rows, offs_m, m0, sk, diag,
            left, right, qk_scale, slope, alibi_diag, seed, offset, bh_index, drop_threshold,
            stride_ks, stride_vs, stride_bs, stride_bk, BLOCK_M, BLOCK_N, BLOCK_DQ, BLOCK_DV,
            HEAD_DIM_Q, HEAD_DIM_V, False, HAS_BIAS, ALIBI_MODE, HAS_DROPOUT, UPCAST, DOT_PRECISION, ACC_DTYPE, LOG2_SCORES,
        )
    for t in range(0, edge_tiles):
        start_n = tl.where(t < edge_before, tile_lo + t * BLOCK_N, split_hi + (t - edge_before) * BLOCK_N)
        dq = _dq_tile(
            dq, q, do, lse_s, delta, start_n, k_base, v_base, bias_base, bias_rows, offs_m, m0, sk, diag,
            left, right, qk_scale, slope, alibi_diag, seed, offset, bh_index, drop_threshold,
            stride_ks, stride_vs, stride_bs, stride_bk, BLOCK_M, BLOCK_N, BLOCK_DQ, BLOCK_DV,
            HEAD_DIM_Q, HEAD_DIM_V, True, HAS_BIAS, ALIBI_MODE, HAS_DROPOUT, UPCAST, DOT_PRECISION, ACC_DTYPE, LOG2_SCORES,
        )
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + rows * stride_dqs + offs_dq[None, :]
    tl.store(dq_ptrs, (dq * dq_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & dq_ok[None, :])
