"""Backward preprocessing: ``D = (1 - p_drop) * rowsum(dO * O)`` in fp32, laid out like LSE."""

import triton
import triton.language as tl

from .common import row_block


@triton.jit(do_not_specialize=["seqlen_q", "num_m_blocks"])
def attention_bwd_dot_do_o_kernel(
    Out,
    DOut,
    Delta,
    SeqstartQ,
    SeqstartPaddedQ,
    CuSeqlenQ,
    stride_ob,
    stride_os,
    stride_oh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_lb,
    stride_lh,
    seqlen_q,
    nhead_q,
    num_m_blocks,
    p_keep,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_GROUP: tl.constexpr,
    HAS_PADDED_Q: tl.constexpr,
    HAS_CU_SEQLEN_Q: tl.constexpr,
):
    b, h, m0, sq, q_row0, lse_row0 = row_block(
        num_m_blocks, nhead_q, SeqstartQ, SeqstartPaddedQ, CuSeqlenQ, seqlen_q, BLOCK_M, IS_GROUP,
        HAS_PADDED_Q, HAS_CU_SEQLEN_Q,
    )
    if m0 >= sq:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    ok = (offs_m < sq)[:, None] & (offs_d < HEAD_DIM_V)[None, :]
    rows = (q_row0 + offs_m).to(tl.int64)[:, None]
    o = tl.load(Out + b64 * stride_ob + h64 * stride_oh + rows * stride_os + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DOut + b64 * stride_dob + h64 * stride_doh + rows * stride_dos + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1) * p_keep
    tl.store(Delta + b64 * stride_lb + h64 * stride_lh + lse_row0 + offs_m, delta, mask=offs_m < sq)
