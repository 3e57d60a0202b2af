"""Backward epilogue of the atomic mode: cast the fp32 dQ accumulator to dQ's dtype."""

import triton
import triton.language as tl

from .common import row_block


@triton.jit(do_not_specialize=["seqlen_q", "num_m_blocks"])
def attention_bwd_convert_dq_kernel(
    DQAcc,
    DQ,
    SeqstartQ,
    SeqstartPaddedQ,
    CuSeqlenQ,
    stride_ab,
    stride_as,
    stride_ah,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    seqlen_q,
    nhead_q,
    num_m_blocks,
    HEAD_DIM_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    IS_GROUP: tl.constexpr,
    HAS_PADDED_Q: tl.constexpr,
    HAS_CU_SEQLEN_Q: tl.constexpr,
):
    b, h, m0, sq, q_row0, _ = row_block(
        num_m_blocks, nhead_q, SeqstartQ, SeqstartPaddedQ, CuSeqlenQ, seqlen_q, BLOCK_M, IS_GROUP,
        HAS_PADDED_Q, HAS_CU_SEQLEN_Q,
    )
    if m0 >= sq:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DQ)
    ok = (offs_m < sq)[:, None] & (offs_d < HEAD_DIM_Q)[None, :]
    rows = (q_row0 + offs_m).to(tl.int64)[:, None]
    acc = tl.load(DQAcc + b64 * stride_ab + h64 * stride_ah + rows * stride_as + offs_d[None, :], mask=ok)
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + rows * stride_dqs + offs_d[None, :],
             acc.to(DQ.dtype.element_ty), mask=ok)
