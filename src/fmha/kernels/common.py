"""Pieces shared by the forward and backward kernels: batch geometry, mask, ALiBi, dropout."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

ALIBI_NONE = tl.constexpr(0)
ALIBI_DISTANCE = tl.constexpr(1)  # -slope * |i + off - j|
ALIBI_VERTICAL = tl.constexpr(2)  # +slope * j (causal masks)


@triton.jit
def sequence_bounds(
    b,
    SeqstartQ,
    SeqstartK,
    SeqlenK,
    SeqstartPaddedQ,
    SeqstartPaddedK,
    CuSeqlenQ,
    CuSeqlenK,
    seqlen_q,
    seqlen_k,
    IS_GROUP: tl.constexpr,
    HAS_SEQLEN_K: tl.constexpr,
    HAS_PADDED_Q: tl.constexpr,
    HAS_PADDED_K: tl.constexpr,
    HAS_CU_SEQLEN_Q: tl.constexpr,
    HAS_CU_SEQLEN_K: tl.constexpr,
):
    """Logical lengths of batch ``b`` and where its rows start: ``(sq, sk, q_row0, k_row0, lse_row0)``.

    ``q_row0``/``k_row0`` are the physical first rows of Q/O/bias/randval and K/V; ``lse_row0``
    the logical first row of LSE (group mode). In batch mode all three are 0.
    """
    if IS_GROUP:
        lse_row0 = tl.load(SeqstartQ + b)
        sq = tl.load(SeqstartQ + b + 1) - lse_row0
        k_start = tl.load(SeqstartK + b)
        if HAS_SEQLEN_K:
            sk = tl.load(SeqlenK + b)
        else:
            sk = tl.load(SeqstartK + b + 1) - k_start
        if HAS_PADDED_Q:
            q_row0 = tl.load(SeqstartPaddedQ + b)
        else:
            q_row0 = lse_row0
        if HAS_PADDED_K:
            k_row0 = tl.load(SeqstartPaddedK + b)
        else:
            k_row0 = k_start
    else:
        lse_row0 = 0
        q_row0 = 0
        k_row0 = 0
        if HAS_CU_SEQLEN_Q:
            sq = tl.load(CuSeqlenQ + b + 1) - tl.load(CuSeqlenQ + b)
        else:
            sq = seqlen_q
        if HAS_CU_SEQLEN_K:
            sk = tl.load(CuSeqlenK + b + 1) - tl.load(CuSeqlenK + b)
        else:
            sk = seqlen_k
    return sq, sk, q_row0, k_row0, lse_row0


@triton.jit
def row_block(
    num_m_blocks,
    nhead_q,
    SeqstartQ,
    SeqstartPaddedQ,
    CuSeqlenQ,
    seqlen_q,
    BLOCK_M: tl.constexpr,
    IS_GROUP: tl.constexpr,
    HAS_PADDED_Q: tl.constexpr,
    HAS_CU_SEQLEN_Q: tl.constexpr,
):
    """For row-wise kernels (one program per query tile, head, batch): ``(b, h, m0, sq, q_row0,
    lse_row0)`` of this program; the caller returns when ``m0 >= sq``."""
    pid = tl.program_id(0)
    bh_index = pid // num_m_blocks
    sq, _, q_row0, _, lse_row0 = sequence_bounds(
        bh_index // nhead_q, SeqstartQ, SeqstartQ, None, SeqstartPaddedQ, None, CuSeqlenQ, None,
        seqlen_q, 0, IS_GROUP, False, HAS_PADDED_Q, False, HAS_CU_SEQLEN_Q, False,
    )
    return bh_index // nhead_q, bh_index % nhead_q, (pid % num_m_blocks) * BLOCK_M, sq, q_row0, lse_row0


@triton.jit
def window_bounds(sq, sk, window_left, window_right, mask_bottom_right):
    """``(diag, left, right)``: row i sees keys ``i + diag - left <= j <= i + diag + right``.

    Negative (unbounded) sides become ``sq + sk``, which reaches past every key; no mask is
    ``left = right = -1``.
    """
    reach = sq + sk
    diag = mask_bottom_right * (sk - sq)
    left = tl.where(window_left < 0, reach, tl.minimum(window_left, reach))
    right = tl.where(window_right < 0, reach, tl.minimum(window_right, reach))
    return diag, left, right


@triton.jit
def visible(i, j, sk, diag, left, right):
    """Whether key ``j`` exists and lies in the window of row ``i`` (broadcastable index tensors)."""
    rel = j - i - diag
    return (j < sk) & (rel >= -left) & (rel <= right)


@triton.jit
def to_score_units(x, LOG2_SCORES: tl.constexpr):
    """A natural-log quantity (bias, ALiBi slope, LSE) in the units the scores are held in.

    fp16/bf16 inputs hold scores in log2 units, ``S * scale * log2(e)``, so that ``P`` costs one
    subtraction and an exp2. fp32/fp64 inputs keep natural units and convert after subtracting
    the row max or LSE: with logits near 1e4, rounding ``S * log2(e)`` alone shifts the exponent
    by 1e-3, twice the error of a plain fp32 softmax.
    """
    if LOG2_SCORES:
        return x * LOG2E
    return x


@triton.jit
def exp_of_scores(s, m, LOG2_SCORES: tl.constexpr):
    """``exp(s - m)`` for scores and row max/LSE in score units."""
    if LOG2_SCORES:
        return tl.math.exp2(s - m)
    return tl.math.exp2((s - m) * LOG2E)


@triton.jit
def alibi_scores(slope, i, j, alibi_diag, ALIBI_MODE: tl.constexpr):
    """ALiBi term for rows ``i``, keys ``j`` (``slope`` already in score units)."""
    if ALIBI_MODE == ALIBI_VERTICAL:
        return slope * (j + 0 * i).to(tl.float32)
    return -slope * tl.abs(i + alibi_diag - j).to(tl.float32)


@triton.jit
def dropout_bytes(seed, offset, bh_index, m0, offs_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """CK's random bytes for rows ``m0 + [0, BLOCK_M)`` and columns ``offs_n`` (SPEC §5).

    ``seed``/``offset`` are uint64, ``bh_index = b * nheads + h``, rows and columns are local
    indices in the sequence; ``m0`` and ``BLOCK_M`` are multiples of 32. Row ``ii`` of a 32-row
    tile is ``16c + 8a + e``: Philox call ``lane = 32a + j % 32`` of tile ``(i // 32, j // 32)``
    yields the bytes of its 16 rows ``(c, e)``, byte ``r = 8c + e``. Here one call serves the 8
    rows of one ``(c, a)`` group, an eighth of one call per element.
    """
    GROUPS: tl.constexpr = BLOCK_M // 8
    g = tl.arange(0, GROUPS)[:, None]  # local row // 8 = 4 * row_tile + 2c + a
    row_tile = (m0 // 32 + g // 4).to(tl.uint32)
    a = (g % 2).to(tl.uint32)
    upper = (g // 2) % 2 == 1  # c == 1: the call's words 2 and 3
    j = offs_n.to(tl.uint32)[None, :]
    base = offset + bh_index.to(tl.uint64) * 64
    base_lo = (base & 0xFFFFFFFF).to(tl.uint32)
    base_hi = (base >> 32).to(tl.uint32)
    ctr_lo = base_lo + 32 * a + j % 32
    ctr_hi = base_hi + (ctr_lo < base_lo).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, ctr_lo, ctr_hi, row_tile + 0 * j, j // 32 + 0 * row_tile, 7)
    first = tl.where(upper, w2, w0)[:, None, :]  # rows e < 4
    second = tl.where(upper, w3, w1)[:, None, :]  # rows e >= 4
    e = tl.arange(0, 8)[None, :, None]
    word = tl.where(e < 4, first, second)
    byte = (word >> (8 * (e % 4)).to(tl.uint32)) & 0xFF
    return tl.reshape(byte, (BLOCK_M, BLOCK_N))


@triton.jit
def load_philox(PhiloxSeedOffset):
    """Seed and offset as uint64, read from the device so graph replays can advance them."""
    seed = tl.load(PhiloxSeedOffset).to(tl.uint64, bitcast=True)
    offset = tl.load(PhiloxSeedOffset + 1).to(tl.uint64, bitcast=True)
    return seed, offset
