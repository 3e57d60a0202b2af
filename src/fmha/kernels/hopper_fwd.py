"""Forward attention for Hopper (sm_90a) in Triton's Gluon dialect, FlashAttention-3's structure.

A query tile is ``64 * NUM_CONSUMERS`` rows of one (batch, head). A CTA runs one tile, or
(``PERSISTENT``, short sequences) several in turn with the rings' slots and phases running on
across them (see ``_tile``), each tile's Q loaded during the tile before where two Q buffers fit
(``Q_BUFS``). Warp roles (``gl.warp_specialize``):

* consumer warpgroups (4 warps each; consumer 0 is the default partition) own 64 query rows. Per
  key tile j they issue ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` as async wgmma, run the online
  softmax of S_j while the PV wgmma runs, then rescale O. So each warpgroup overlaps its softmax
  with its own matrix work, and the warpgroups overlap each other.
* a producer warp streams K_j and V_j by TMA into ``STAGES``-deep rings, with a ready (TMA byte
  count) and an empty (one arrive per consumer) mbarrier per slot.

q/k/v/out are addressed through 4-D TMA descriptors over ``[B, S, H, D]`` with their own strides and
boxes ``[1, rows, 1, D]``: rows past the sequence are zero-filled on load and clipped on store,
per batch, so ragged tiles need no bounds but the key mask. K/V heads are ``h // kv_group`` (GQA).
A sliding window (``WINDOW``) runs only the key tiles of the CTA's band, masked at both edges;
ALiBi (``ALIBI``) adds its term to the scaled scores; dropout (``DROPOUT``) zeroes P's dropped
elements after the row sums (see ``hopper_dropout``).
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import LN2, LOG2E
from .hopper_dropout import dropout_mask_pairs, philox_key_and_base

ROWS_PER_CONSUMER = gl.constexpr(64)  # one m64 wgmma per consumer warpgroup


@gluon.jit
def _key_tiles(m0, seqlen, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               WINDOW: gl.constexpr):
    """(first, inner_lo, inner_hi, end) key tiles of the CTA whose first query row is m0: it runs
    tiles [first, end); those in [inner_lo, inner_hi) need no mask (every key < seqlen and in
    every row's window), the others are masked. A window shows row i keys i - left .. i + right."""
    if WINDOW:
        last_row = gl.minimum(m0 + BLOCK_M, seqlen) - 1
        first = gl.maximum(m0 - left, 0) // BLOCK_N
        end = gl.cdiv(gl.minimum(last_row + right + 1, seqlen), BLOCK_N)
        inner_lo = gl.cdiv(gl.maximum(last_row - left, 0), BLOCK_N)
        inner_hi = gl.minimum(m0 + right + 1, seqlen) // BLOCK_N
    elif CAUSAL:
        first = 0
        end = gl.cdiv(gl.minimum(seqlen, m0 + BLOCK_M), BLOCK_N)
        inner_lo = 0
        inner_hi = gl.minimum(m0 // BLOCK_N, seqlen // BLOCK_N)
    else:
        first = 0
        end = gl.cdiv(seqlen, BLOCK_N)
        inner_lo = 0
        inner_hi = seqlen // BLOCK_N
    return first, inner_lo, inner_hi, end


@gluon.jit
def _warpgroup_tiles(row0, seqlen, left, right, first, end, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                     WINDOW: gl.constexpr):
    """Of the CTA's key tiles [first, end), the run [wg_first, wg_end) that a warpgroup's rows from
    row0 see keys of (at least one tile)."""
    key_first = 0
    key_last = seqlen - 1
    if CAUSAL:
        key_last = gl.minimum(key_last, row0 + ROWS_PER_CONSUMER - 1)
    if WINDOW:
        key_first = gl.maximum(row0 - left, 0)
        key_last = gl.minimum(key_last, row0 + ROWS_PER_CONSUMER - 1 + right)
    wg_first = gl.minimum(gl.maximum(key_first // BLOCK_N, first), end - 1)
    wg_end = gl.maximum(gl.minimum(key_last // BLOCK_N + 1, end), wg_first + 1)
    return wg_first, wg_end


@gluon.jit
def _release_tiles(u0, u1, k_ready, k_empty, v_ready, v_empty, STAGES: gl.constexpr):
    """Hand ring positions u0 .. u1 - 1 back unread, each once it has landed (an arrive before then
    could count in the phase of the slot's previous tile)."""
    for u in range(u0, u1):
        s = u % STAGES
        phase = (u // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        mbarrier.arrive(k_empty.index(s))
        mbarrier.wait(v_ready.index(s), phase)
        mbarrier.arrive(v_empty.index(s))


# Group mode's tile table: one int64 entry per CTA, ``b << 40 | h << 20 | m`` (query tile m of head
# h of sequence b), -1 past the last tile.
TABLE_B_SHIFT = tl.constexpr(40)
TABLE_H_SHIFT = tl.constexpr(20)
TABLE_FIELD = tl.constexpr((1 << 20) - 1)


@triton.jit
def hopper_fwd_varlen_schedule(Seqstart, Table, B, H, table_len, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program b writes the table entries of sequence b. Sequences run longest first (ties by
    index), each as H runs of its query tiles, last first; so the grid holds no CTA without a
    tile (one per tile of the longest sequence would leave most empty), and the hardware's
    dispatch fills the tail with the short sequences. Program 0 also marks the entries past the
    last tile. O(B) per program: B programs read all lengths once."""
    b = tl.program_id(0)
    length = tl.load(Seqstart + b + 1) - tl.load(Seqstart + b)
    n_m = tl.cdiv(length, BLOCK_M)
    before = 0  # tiles of the sequences that run ahead of this one
    total = 0
    for c in range(0, B, CHUNK):
        i = c + tl.arange(0, CHUNK)
        inside = i < B
        lens = tl.load(Seqstart + i + 1, mask=inside, other=0) - tl.load(Seqstart + i, mask=inside, other=0)
        tiles = tl.where(inside, tl.cdiv(lens, BLOCK_M), 0)
        ahead = (lens > length) | ((lens == length) & (i < b))
        before += tl.sum(tl.where(ahead, tiles, 0))
        total += tl.sum(tiles)
    for c in range(0, H * n_m, CHUNK):
        j = c + tl.arange(0, CHUNK)
        h = j // n_m
        m = n_m - 1 - j % n_m
        entry = (b.to(tl.int64) << TABLE_B_SHIFT) | (h.to(tl.int64) << TABLE_H_SHIFT) | m.to(tl.int64)
        slot = H * before + j
        tl.store(Table + slot, entry, mask=(j < H * n_m) & (slot < table_len))  # a bad seqstart stays inside
    if b == 0:
        for c in range(H * total, table_len, CHUNK):
            j = c + tl.arange(0, CHUNK)
            tl.store(Table + j, tl.full([CHUNK], -1, tl.int64), mask=j < table_len)


@gluon.jit
def _tile(t, seqlen, H, tiles, table_ptr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
          GROUP: gl.constexpr):
    """(batch, head, first query row) of query tile t (the grid is 1-D: grid y stops at 65535).

    One tile per CTA: a head's tiles are adjacent, so its K/V stay in L2, and last-first, so that
    under a causal mask the longest start first and the hardware's dispatch balances the rest.
    Persistent CTAs run tiles c, c + G, c + 2G, ... of a grid of G: the tiles in flight stay
    contiguous, and a CTA's next tile loads K/V while it finishes the last. Under a causal mask
    they go query-tile major, longest first across all (batch, head) pairs: head-major, CTA
    c's tiles would be a run of adjacent lengths, the first CTAs' all long (0.64 of the work
    balanced at 16k)."""
    if GROUP:  # from the table; an entry past the last tile gives (0, 0, 2^30), past every sequence even
        # when max_seqlen_q understates one (it is not checked while tracing)
        entry = gl.load(table_ptr + t)
        valid = entry >= 0
        b = gl.where(valid, entry >> TABLE_B_SHIFT, 0).to(gl.int32)
        h = gl.where(valid, (entry >> TABLE_H_SHIFT) & TABLE_FIELD, 0).to(gl.int32)
        m0 = gl.where(valid, (entry & TABLE_FIELD).to(gl.int32) * BLOCK_M, 1 << 30)
        return b, h, m0
    n_m = gl.cdiv(seqlen, BLOCK_M)
    if PERSISTENT and CAUSAL:
        n_bh = tiles // n_m
        bh = t % n_bh
        pid_m = n_m - 1 - t // n_bh
    else:
        bh = t // n_m
        pid_m = n_m - 1 - t % n_m
    return bh // H, bh % H, pid_m * BLOCK_M


@gluon.jit
def packed_sequence(b, seqlen, seqstart_ptr, GROUP: gl.constexpr):
    """(batch coordinate, first row, length) of sequence b. Group (varlen) mode: the tensors are
    ``[1, total, H, D]`` views, sequence b is rows ``seqstart[b] .. seqstart[b + 1]`` of them and
    ``seqlen`` is the longest; rows past a sequence are the next one's, so they are masked (keys)
    or never stored (queries), not clipped."""
    if GROUP:
        start = gl.load(seqstart_ptr + b)
        return 0, start, gl.load(seqstart_ptr + b + 1) - start
    return b, 0, seqlen


@gluon.jit
def _producer(k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, seqstart_ptr,
              table_ptr, seqlen, H, kv_group, tiles, bias_step_b, bias_step_h, left, right, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              GROUP: gl.constexpr, PERSISTENT: gl.constexpr, BIAS: gl.constexpr):
    if PERSISTENT:
        pos = 0  # key tiles through the ring so far: slots and phases run on across the CTA's tiles
        for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
            pos = _produce_tile(t, pos, k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty,
                                v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, kv_group, tiles, bias_step_b,
                                bias_step_h, left, right, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW, GROUP, PERSISTENT,
                                BIAS)
    else:  # one tile per CTA (the ring position a tensor: the tile's branch returns one)
        _produce_tile(gl.program_id(0), gl.to_tensor(0), k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs,
                      k_ready, k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, kv_group, tiles,
                      bias_step_b, bias_step_h, left, right, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW, GROUP,
                      PERSISTENT, BIAS)


@gluon.jit
def _produce_tile(t, pos, k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty,
                  seqstart_ptr, table_ptr, seqlen, H, kv_group, tiles, bias_step_b, bias_step_h, left, right,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, GROUP: gl.constexpr, PERSISTENT: gl.constexpr, BIAS: gl.constexpr):
    """K/V (and a bias) of tile t into the rings from ring position ``pos``; returns the position
    after them."""
    b, h, m0 = _tile(t, seqlen, H, tiles, table_ptr, BLOCK_M, CAUSAL, PERSISTENT, GROUP)
    bd, row_base, seqlen_b = packed_sequence(b, seqlen, seqstart_ptr, GROUP)
    if m0 < seqlen_b:  # group mode: the tiles cover the longest sequence
        first, _, _, end = _key_tiles(m0, seqlen_b, left, right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
        for it in range(end - first):
            n0 = row_base + (first + it) * BLOCK_N
            _load_k_tile(pos + it, b, h, m0, bd, n0, h // kv_group, k_desc, bias_desc, k_bufs, bias_bufs, k_ready,
                         k_empty, bias_step_b, bias_step_h, BLOCK_M, STAGES, BIAS)
            _load_v_tile(pos + it, bd, n0, h // kv_group, v_desc, v_bufs, v_ready, v_empty, STAGES)
        pos += end - first
    return pos


@gluon.jit
def _load_k_tile(u, b, h, m0, bd, n0, h_kv, k_desc, bias_desc, k_bufs, bias_bufs, k_ready, k_empty, bias_step_b,
                 bias_step_h, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, BIAS: gl.constexpr):
    """K rows n0.. (the key tile at ring position u) into slot u % STAGES of K's ring. A bias comes
    with K, one 64-row box per consumer warpgroup on K's barrier: the consumers read it before they
    release the K slot."""
    s = u % STAGES
    # Use u // STAGES of slot s waits for the consumers' release of the use before; a fresh
    # mbarrier counts as having completed the phase before its first, so use 0 passes at once.
    mbarrier.wait(k_empty.index(s), ((u // STAGES) & 1) ^ 1)
    if BIAS:
        consumers: gl.constexpr = BLOCK_M // 64
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes + consumers * bias_desc.block_type.nbytes)
        for wg in gl.static_range(consumers):
            tma.async_copy_global_to_shared(bias_desc, [b * bias_step_b, h * bias_step_h, m0 + wg * 64, n0],
                                            k_ready.index(s), bias_bufs.index(wg * STAGES + s))
    else:
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bd, n0, h_kv, 0], k_ready.index(s), k_bufs.index(s))


@gluon.jit
def _load_v_tile(u, bd, n0, h_kv, v_desc, v_bufs, v_ready, v_empty, STAGES: gl.constexpr):
    """V rows n0.. (the key tile at ring position u) into slot u % STAGES of V's ring."""
    s = u % STAGES
    mbarrier.wait(v_empty.index(s), ((u // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [bd, n0, h_kv, 0], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _halves_max(x):
    """[rows, n] -> [rows, n / 2]: the left and right halves maxed elementwise."""
    left, right = x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute((0, 2, 1)).split()
    return gl.maximum(left, right)


@gluon.jit
def _row_max(x, row_layout: gl.constexpr):
    """gl.max(x, 1) with a shorter chain of dependent maxima (ptxas chains one a column): halves
    maxed elementwise first, down to 32 columns (a column index's top bits are the thread's own n8
    chunks, so this stays in registers). The row maximum gates every exponential of the step. Used
    without features only: on the H200 it gains 2-6% there (d = 128, 16k) but costs 2-3% with a
    bias, ALiBi or dropout and 5-9% with a window."""
    if x.shape[1] > 64:
        x = _halves_max(x)
    if x.shape[1] > 32:
        x = _halves_max(x)
    return gl.convert_layout(gl.max(x, 1), row_layout)


@gluon.jit
def _softmax_update(qk, bias, m_i, l_i, kv0, row0, rows, seqlen, qk_scale, left, right, slope,
                    s_layout: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr, DIAG: gl.constexpr,
                    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr, BIAS: gl.constexpr,
                    ROW_TREE: gl.constexpr):
    """Online softmax of one tile of raw q.k (rows ``row0``..). m is in log2 units of the scaled
    scores, so p = exp2(qk * qk_scale - m) is one FMA and one ex2 per element (the row maximum by
    ``_row_max`` under ``ROW_TREE``). ALiBi (``slope`` in log2 units) adds -slope * |i - j|
    (ALIBI 1, or 3: linear in j off the diagonal; 4: as 3 with the column term already in qk) or,
    under a causal mask, slope * j (ALIBI 2); a bias tile (``BIAS``) adds itself. ``DIAG``: the
    tile may straddle the diagonal (masked tiles may too)."""
    tile_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    cols = kv0 + tile_cols
    # Without ALiBi the scale stays in the exponent's FMA; with it the scores are scaled first.
    scores = qk
    scale = qk_scale
    ALIBI_LINEAR: gl.constexpr = (ALIBI == 3 or ALIBI == 4) and not (MASKED or DIAG)
    if ALIBI_LINEAR:
        # Off the diagonal |i - j| is linear: the column term slope * (j - kv0) joins the scale's
        # FMA (ALIBI 3; ALIBI 4: qk holds it already, see _alibi_slope_operand) and the row's term
        # shifts m, so only tiles on the diagonal pay a per-element distance (its int-to-float
        # conversions share the ex2's quarter-rate pipe).
        above = kv0 >= row0 + ROWS_PER_CONSUMER - 1  # every key j >= every row i, else every j <= i
        signed = slope * (1.0 - 2.0 * above.to(gl.float32))  # -slope * (i - j), or (j - i) above
        if ALIBI == 3:
            scores = qk * qk_scale + (signed * tile_cols.to(gl.float32))[None, :]
            scale = 1.0
        row_shift = signed * (kv0 - rows).to(gl.float32)
    elif ALIBI == 1 or ALIBI >= 3:
        scores = qk * qk_scale - slope * gl.abs(rows[:, None] - cols[None, :]).to(gl.float32)
        scale = 1.0
    elif ALIBI == 2:  # one term per column
        scores = qk * qk_scale + (slope * cols.to(gl.float32))[None, :]
        scale = 1.0
    if BIAS:
        if ALIBI == 0:  # in natural units: the exponent's FMA applies LOG2E as it applies the scale
            scores = qk * (qk_scale * LN2) + bias
            scale = LOG2E
        else:
            scores = scores + bias * LOG2E
            scale = 1.0
    if MASKED:
        if WINDOW:
            rel = cols[None, :] - rows[:, None]
            keep = (cols[None, :] < seqlen) & (rel >= -left) & (rel <= right)
        else:
            last = seqlen - 1
            if CAUSAL:
                last = gl.minimum(rows, last)[:, None]
            if ALIBI == 0:
                # One compare a score, of a constant against a bound per row: a column's index in
                # the tile is its lane's part (bits 1-2 in the wgmma layout) plus its register's
                # constant, which ptxas folds into the compare (726 instructions a causal masked
                # step, 605 so).
                lane_cols = tile_cols[None, :] & 6
                keep = tile_cols[None, :] - lane_cols <= last - kv0 - lane_cols
            else:  # ALiBi's terms keep the columns live (with dropout the form above spills 1.3 KB)
                keep = cols[None, :] <= last
        scores = gl.where(keep, scores, -float("inf"))
    if ROW_TREE:
        row_max = _row_max(scores, gl.SliceLayout(1, s_layout))
    else:
        row_max = gl.max(scores, 1)
    if ALIBI_LINEAR:
        m_new = gl.maximum(m_i, row_max * scale + row_shift)
    else:
        m_new = gl.maximum(m_i, row_max * scale)
    # Without a window every row sees key 0 in the first tile: m is finite from then on, and a
    # later fully masked tile gives alpha = 1, p = 0. A window's first tiles can show a row
    # nothing yet, and a bias of -inf can hide any keys: exponentiate against 0 while m is -inf.
    m_use = m_new
    if (MASKED and WINDOW) or BIAS:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    if ALIBI_LINEAR:
        p = gl.exp2(scores * scale - (m_use - row_shift)[:, None])
    else:
        p = gl.exp2(scores * scale - m_use[:, None])
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _bias_tile(bias_bufs, WG: gl.constexpr, s, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               BIAS: gl.constexpr):
    """Warpgroup WG's bias rows of ring slot s (0 without a bias)."""
    bias = 0.0
    if BIAS:
        tile = bias_bufs.index(WG * STAGES + s).reshape([ROWS_PER_CONSUMER, BLOCK_N])
        bias = widened(tile.load(s_layout))
        fence_async_shared()  # these reads complete before K's slot goes back to the producer's TMA
    return bias


@gluon.jit
def widened(x):
    """A 16-bit tensor as f32. A bf16 is the top half of its f32: one shift or mask per element of a
    register's pair (ptxas's own conversion takes 1.6 instructions an element)."""
    if x.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r",
                                         [x.to(gl.int16, bitcast=True)], dtype=gl.float32, is_pure=True, pack=2)
    return x.to(gl.float32)


@gluon.jit
def _rounded_pairs(p, dtype: gl.constexpr, PACKED_P: gl.constexpr):
    """p.to(dtype); with ``PACKED_P`` two elements a cvt. Rounded one at a time, ptxas packs each
    pair reversed and swaps it back with a PRMT before the PV wgmma: 32 instructions a d=128 step."""
    if not PACKED_P:
        pairs = p.to(dtype)
    elif dtype == gl.bfloat16:
        pairs = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
    else:
        pairs = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                          is_pure=True, pack=2)
    return pairs


@gluon.jit
def _drop_p(p_op, mask_bufs, mask_ready, WG: gl.constexpr, it, p_layout: gl.constexpr,
            STAGES: gl.constexpr, DROPOUT: gl.constexpr):
    """P as the PV wgmma's operand, the dropped elements of key tile ``it`` (ring position) zeroed:
    ANDed with the dropout warpgroup's 16-bit mask, all ones where kept. The 1 / (1 - p) rescale
    waits for the epilogue, since l is the sum before dropout."""
    if DROPOUT:
        s = it % STAGES
        mbarrier.wait(mask_ready.index(s), (it // STAGES) & 1)
        # (no release: the slot is written again after V's slot of this tile comes back, see
        # _produce_and_drop, and the mask is applied before the PV wgmma that holds V's slot)
        mask = mask_bufs.index(WG * STAGES + s).load(p_layout)
        p_op = (p_op.to(gl.int16, bitcast=True) & mask).to(p_op.dtype, bitcast=True)
    return p_op


ALIBI_PIECES = gl.constexpr(16)  # the k of the ALiBi wgmma (its least): three slope pieces, then zeros


@gluon.jit
def _write_alibi_columns(cols_smem, BLOCK_N: gl.constexpr):
    """ALIBI 4: the B operand of the ALiBi wgmma, ``[BLOCK_N, ALIBI_PIECES]`` bf16: each key's column
    in its tile (0 .. BLOCK_N - 1, exact) against the three slope pieces, zeros after."""
    layout: gl.constexpr = gl.BlockedLayout([1, ALIBI_PIECES], [32, 1], [4, 1], [1, 0])
    col = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))[:, None]
    piece = gl.arange(0, ALIBI_PIECES, layout=gl.SliceLayout(0, layout))[None, :]
    cols_smem.store(gl.where(piece < 3, col, 0).to(cols_smem.dtype))
    fence_async_shared()


@gluon.jit
def _alibi_slope_operand(slope, qk_scale, above, s_layout: gl.constexpr):
    """ALIBI 4: the A operand of the ALiBi wgmma, ``[64, ALIBI_PIECES]``: the raw scores' column
    coefficient ``slope / qk_scale`` (negated above the diagonal) as three bf16 pieces whose sum is
    it exactly (24 bits, an f32's), so that ``S += A B`` adds ``coefficient * column`` in the
    accumulator and the softmax needs no per-score ALiBi work. bf16 whatever q's dtype: f32's range."""
    dtype: gl.constexpr = gl.bfloat16
    layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    a = slope / qk_scale
    hi = a.to(dtype)
    rest = a - hi.to(gl.float32)
    mid = rest.to(dtype)
    lo = (rest - mid.to(gl.float32)).to(dtype)
    piece = gl.arange(0, ALIBI_PIECES, layout=gl.SliceLayout(0, layout))[None, :]
    zero = gl.zeros([ROWS_PER_CONSUMER, ALIBI_PIECES], dtype, layout)
    x = gl.where(piece == 0, hi, gl.where(piece == 1, mid, gl.where(piece == 2, lo, zero)))
    return gl.where(above, -x, x)


@gluon.jit
def _consumer_step(WG: gl.constexpr, j, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty,
                   o_acc, p_op, m_i, l_i, row0, rows, seqlen, qk_scale, left, right, slope, mask_bufs, mask_ready,
                   alibi_cols, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                   DIAG: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr,
                   BIAS: gl.constexpr, DROPOUT: gl.constexpr, PACKED_P: gl.constexpr):
    """Key tile j > first: S_j = Q K_j^T beside O += P_{j-1} V_{j-1}, then the softmax of S_j; key
    tile j is at ring position ring0 + j."""
    it = ring0 + j
    s = it % STAGES
    sp = (it - 1) % STAGES
    mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
    k_t = k_bufs.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    qk = warpgroup_mma(q_tile, k_t, gl.zeros([ROWS_PER_CONSUMER, BLOCK_N], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    if ALIBI == 4 and not (MASKED or DIAG):
        above = j * BLOCK_N >= row0 + ROWS_PER_CONSUMER - 1
        qk = warpgroup_mma(_alibi_slope_operand(slope, qk_scale, above, s_layout),
                           alibi_cols.index(WG).permute((1, 0)), qk, is_async=True)
    mbarrier.wait(v_ready.index(sp), ((it - 1) // STAGES) & 1)
    o_acc = warpgroup_mma(p_op, v_bufs.index(sp).reshape([BLOCK_N, HEAD_DIM]), o_acc, is_async=True)

    # wgmma groups retire in order: at most one outstanding means S_j is done, PV may still run.
    qk = warpgroup_mma_wait(1, deps=[qk])
    bias = _bias_tile(bias_bufs, WG, s, s_layout, BLOCK_N, STAGES, BIAS)  # it shares K's slot
    mbarrier.arrive(k_empty.index(s))
    p, m_i, l_i, alpha = _softmax_update(qk, bias, m_i, l_i, j * BLOCK_N, row0, rows, seqlen, qk_scale, left,
                                         right, slope, s_layout, BLOCK_N, MASKED, DIAG, CAUSAL, WINDOW, ALIBI, BIAS,
                                         not (WINDOW or ALIBI > 0 or BIAS or DROPOUT))
    o_acc, p_op = warpgroup_mma_wait(0, deps=[o_acc, p_op])
    mbarrier.arrive(v_empty.index(sp))
    o_acc = o_acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(_rounded_pairs(p, q_tile.dtype, PACKED_P), p_layout)
    p_op = _drop_p(p_op, mask_bufs, mask_ready, WG, it, p_layout, STAGES, DROPOUT)
    return o_acc, p_op, m_i, l_i


@gluon.jit
def _consumer_steps(j0, j1, WG: gl.constexpr, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready,
                    v_empty, o_acc, p_op, m_i, l_i, row0, rows, seqlen, qk_scale, left, right, slope, mask_bufs,
                    mask_ready, alibi_cols, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                    DIAG: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr,
                    BIAS: gl.constexpr, DROPOUT: gl.constexpr, PACKED_P: gl.constexpr):
    """``_consumer_step`` for key tiles j0 .. j1 - 1."""
    for j in range(j0, j1):
        o_acc, p_op, m_i, l_i = _consumer_step(WG, j, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty,
                                               v_ready, v_empty, o_acc, p_op, m_i, l_i, row0, rows, seqlen, qk_scale,
                                               left, right, slope, mask_bufs, mask_ready, alibi_cols, s_layout,
                                               o_layout, p_layout, BLOCK_N, HEAD_DIM, STAGES, MASKED, DIAG, CAUSAL,
                                               WINDOW, ALIBI, BIAS, DROPOUT, PACKED_P)
    return o_acc, p_op, m_i, l_i


@gluon.jit
def _consumer(WG: gl.constexpr, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
              k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
              lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah, mask_bufs,
              mask_ready, alibi_cols, drop_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr,
              GROUP: gl.constexpr, PERSISTENT: gl.constexpr, BIAS: gl.constexpr, DROPOUT: gl.constexpr,
              PACKED_P: gl.constexpr):
    if PERSISTENT:
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        pos = 0  # key tiles through the ring so far, as in the producer
        # Two Q buffers a consumer (where they fit): tile n + 1's Q loads while tile n runs.
        Q_BUFS: gl.constexpr = q_bufs.shape[0] // (BLOCK_M // ROWS_PER_CONSUMER)
        if Q_BUFS == 2:
            _prefetch_q(WG, pid, 0, q_desc, q_bufs, q_bars, table_ptr, seqlen, H, tiles, BLOCK_M, CAUSAL)
        for t in range(pid, tiles, grid):
            done = (t - pid) // grid
            if Q_BUFS == 2:
                if t + grid < tiles:  # into the buffer of tile done - 1, once its O store has read it
                    tma.store_wait(0)
                    _prefetch_q(WG, t + grid, (done + 1) % 2, q_desc, q_bufs, q_bars, table_ptr, seqlen, H, tiles,
                                BLOCK_M, CAUSAL)
            pos = _consume_tile(WG, t, pos, done, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars,
                                k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, seqstart_ptr,
                                table_ptr, seqlen, H, tiles, stride_os, stride_oh, lse_stride_b, lse_stride_h,
                                qk_scale, left, right, alibi_ptr, stride_ab, stride_ah, mask_bufs, mask_ready,
                                alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, WINDOW, ALIBI,
                                GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)
        if Q_BUFS == 2:  # the last O store has read its buffer before the CTA ends
            tma.store_wait(0)
    else:  # one tile per CTA
        _consume_tile(WG, gl.program_id(0), gl.to_tensor(0), 0, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars,
                      k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen,
                      H, tiles, stride_os, stride_oh, lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr,
                      stride_ab, stride_ah, mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N,
                      HEAD_DIM, STAGES, CAUSAL, WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)


@gluon.jit
def _load_q(q_desc, q_bufs, q_bars, i, b, row, h):
    """Q rows from ``row`` of (batch coordinate b, head h) into Q buffer i, on its barrier."""
    mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, row, h, 0], q_bars.index(i), q_bufs.index(i))


@gluon.jit
def _prefetch_q(WG: gl.constexpr, t, slot, q_desc, q_bufs, q_bars, table_ptr, seqlen, H, tiles,
                BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """Persistent, batch mode: warpgroup WG's Q rows of tile t into its buffer of pair ``slot``."""
    b, h, m0 = _tile(t, seqlen, H, tiles, table_ptr, BLOCK_M, CAUSAL, True, False)
    _load_q(q_desc, q_bufs, q_bars, slot * (BLOCK_M // ROWS_PER_CONSUMER) + WG, b, m0 + WG * ROWS_PER_CONSUMER, h)


@gluon.jit
def _consume_tile(WG: gl.constexpr, t, pos, done, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs,
                  bias_bufs, k_ready, k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os,
                  stride_oh, lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                  mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                  ALIBI: gl.constexpr, GROUP: gl.constexpr, PERSISTENT: gl.constexpr, BIAS: gl.constexpr,
                  DROPOUT: gl.constexpr, PACKED_P: gl.constexpr):
    """Tile t, the CTA's tile number ``done``, its key tiles from ring position ``pos``; returns
    the position after them."""
    b, h, m0 = _tile(t, seqlen, H, tiles, table_ptr, BLOCK_M, CAUSAL, PERSISTENT, GROUP)
    bd, row_base, seqlen_b = packed_sequence(b, seqlen, seqstart_ptr, GROUP)
    if m0 < seqlen_b:  # group mode: the tiles cover the longest sequence
        pos = _consumer_tile(WG, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                             k_empty, v_ready, v_empty, pos, done, b, h, m0, bd, row_base, seqlen_b, stride_os,
                             stride_oh, lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab,
                             stride_ah, mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                             STAGES, CAUSAL, WINDOW, ALIBI, GROUP, BIAS, DROPOUT, PACKED_P)
    return pos


@gluon.jit
def _consumer_tile(WG: gl.constexpr, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs,
                   k_ready, k_empty, v_ready, v_empty, pos, done, b, h, m0, bd, row_base, seqlen, stride_os,
                   stride_oh, lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                   mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                   ALIBI: gl.constexpr, GROUP: gl.constexpr, BIAS: gl.constexpr, DROPOUT: gl.constexpr,
                   PACKED_P: gl.constexpr):
    """Warpgroup WG's 64 query rows of one tile; rows, keys and seqlen are the sequence's. Its first
    key tile is at ring position ``pos``, and ``done`` tiles came before it; returns the position
    after its last key tile."""
    ROWS: gl.constexpr = ROWS_PER_CONSUMER
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    # P feeds the PV wgmma from registers (k_width 2: two 16-bit values per 32-bit register).
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    first, inner_lo, inner_hi, end = _key_tiles(m0, seqlen, left, right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    row0 = m0 + WG * ROWS
    # Where a warpgroup's 64 rows are not the key tile's width (d = 64: 192-row CTAs, d = 256:
    # 64-key tiles), a causal or windowed CTA's first or last key tiles can hold no key its rows
    # see: it releases them unread. Not with dropout, whose mask slots follow V's releases, nor in
    # group mode, where it spills (d = 64, causal: 8 B) and measured no gain.
    SKIP: gl.constexpr = (CAUSAL or WINDOW) and not (DROPOUT or GROUP) and BLOCK_M != BLOCK_N
    wg_first = first
    wg_end = end
    if SKIP:
        wg_first, wg_end = _warpgroup_tiles(row0, seqlen, left, right, first, end, BLOCK_N, CAUSAL, WINDOW)
    rows = row0 + gl.arange(0, ROWS, layout=row_layout)
    slope = 0.0
    if ALIBI != 0:  # in log2 units, like the scores
        slope = gl.load(alibi_ptr + b * stride_ab + h * stride_ah) * LOG2E
    if ALIBI == 4:
        _write_alibi_columns(alibi_cols.index(WG), BLOCK_N)

    # Q buffers: one a consumer (loaded here), or two a consumer in turn (loaded ahead, _consumer)
    Q_BUFS: gl.constexpr = q_bufs.shape[0] // (BLOCK_M // ROWS)
    q_index = (done % Q_BUFS) * (BLOCK_M // ROWS) + WG
    q_smem = q_bufs.index(q_index)
    if Q_BUFS == 1:
        _load_q(q_desc, q_bufs, q_bars, q_index, bd, row_base + row0, h)
    mbarrier.wait(q_bars.index(q_index), (done // Q_BUFS) & 1)
    q_tile = q_smem.reshape([ROWS, HEAD_DIM])

    # The first tile is always masked: cheap, and it keeps the loops below uniform.
    ring0 = pos - first  # the ring position of key tile 0
    if SKIP:
        _release_tiles(pos, ring0 + wg_first, k_ready, k_empty, v_ready, v_empty, STAGES)
        pos = ring0 + wg_first
    s0 = pos % STAGES
    mbarrier.wait(k_ready.index(s0), (pos // STAGES) & 1)
    k_t = k_bufs.index(s0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    qk = warpgroup_mma(q_tile, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False,
                       is_async=True)
    qk = warpgroup_mma_wait(0, deps=[qk])
    bias = _bias_tile(bias_bufs, WG, s0, s_layout, BLOCK_N, STAGES, BIAS)
    mbarrier.arrive(k_empty.index(s0))
    m_i = gl.full([ROWS], -float("inf"), gl.float32, row_layout)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_layout)
    p, m_i, l_i, alpha = _softmax_update(qk, bias, m_i, l_i, wg_first * BLOCK_N, row0, rows, seqlen, qk_scale, left,
                                         right, slope, s_layout, BLOCK_N, True, True, CAUSAL, WINDOW, ALIBI, BIAS,
                                         not (WINDOW or ALIBI > 0 or BIAS or DROPOUT))
    p_op = gl.convert_layout(_rounded_pairs(p, dtype, PACKED_P), p_layout)
    p_op = _drop_p(p_op, mask_bufs, mask_ready, WG, pos, p_layout, STAGES, DROPOUT)
    o_acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    # Masked tiles before the unmasked interior (a window's left edge), the interior, masked after;
    # with ALiBi's distance the interior's tile on the diagonal apart.
    lo = gl.minimum(gl.maximum(inner_lo, wg_first + 1), wg_end)
    hi = gl.minimum(gl.maximum(inner_hi, lo), wg_end)
    diag_lo = hi
    diag_hi = hi
    if ALIBI >= 3:
        diag_lo = gl.minimum(gl.maximum((row0 + 1) // BLOCK_N, lo), hi)
        diag_hi = gl.minimum(gl.maximum(gl.cdiv(row0 + ROWS - 1, BLOCK_N), diag_lo), hi)
    if WINDOW:
        o_acc, p_op, m_i, l_i = _consumer_steps(
            wg_first + 1, lo, WG, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, o_acc,
            p_op, m_i, l_i, row0, rows, seqlen, qk_scale, left, right, slope, mask_bufs, mask_ready, alibi_cols,
            s_layout, o_layout, p_layout, BLOCK_N, HEAD_DIM, STAGES, True, False, CAUSAL, WINDOW, ALIBI, BIAS, DROPOUT,
            PACKED_P)
    o_acc, p_op, m_i, l_i = _consumer_steps(
        lo, diag_lo, WG, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, o_acc, p_op,
        m_i, l_i, row0, rows, seqlen, qk_scale, left, right, slope, mask_bufs, mask_ready, alibi_cols, s_layout,
        o_layout, p_layout, BLOCK_N, HEAD_DIM, STAGES, False, False, CAUSAL, WINDOW, ALIBI, BIAS, DROPOUT, PACKED_P)
    if ALIBI >= 3:
        o_acc, p_op, m_i, l_i = _consumer_steps(
            diag_lo, diag_hi, WG, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, o_acc,
            p_op, m_i, l_i, row0, rows, seqlen, qk_scale, left, right, slope, mask_bufs, mask_ready, alibi_cols,
            s_layout, o_layout, p_layout, BLOCK_N, HEAD_DIM, STAGES, False, True, CAUSAL, WINDOW, ALIBI, BIAS, DROPOUT,
            PACKED_P)
        o_acc, p_op, m_i, l_i = _consumer_steps(
            diag_hi, hi, WG, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, o_acc,
            p_op, m_i, l_i, row0, rows, seqlen, qk_scale, left, right, slope, mask_bufs, mask_ready, alibi_cols,
            s_layout, o_layout, p_layout, BLOCK_N, HEAD_DIM, STAGES, False, False, CAUSAL, WINDOW, ALIBI, BIAS, DROPOUT,
            PACKED_P)
    o_acc, p_op, m_i, l_i = _consumer_steps(
        hi, wg_end, WG, ring0, q_tile, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, o_acc, p_op,
        m_i, l_i, row0, rows, seqlen, qk_scale, left, right, slope, mask_bufs, mask_ready, alibi_cols, s_layout,
        o_layout, p_layout, BLOCK_N, HEAD_DIM, STAGES, True, False, CAUSAL, WINDOW, ALIBI, BIAS, DROPOUT, PACKED_P)

    jl = ring0 + wg_end - 1
    sl = jl % STAGES
    mbarrier.wait(v_ready.index(sl), (jl // STAGES) & 1)
    o_acc = warpgroup_mma(p_op, v_bufs.index(sl).reshape([BLOCK_N, HEAD_DIM]), o_acc, is_async=True)
    o_acc = warpgroup_mma_wait(0, deps=[o_acc, p_op])[0]
    mbarrier.arrive(v_empty.index(sl))
    if SKIP:
        _release_tiles(ring0 + wg_end, ring0 + end, k_ready, k_empty, v_ready, v_empty, STAGES)

    # Epilogue: O / l and the natural-log LSE; O leaves through the Q buffer (its last reader,
    # the wgmma, has retired) and a TMA store that clips rows past the batch's sequence. In group
    # mode the rows past a sequence belong to the next: a ragged tile stores row by row instead.
    inv_l = 1.0 / l_i
    if BIAS:  # a row whose bias hides every key: O = 0 (and LSE = -inf)
        inv_l = gl.where(l_i == 0.0, 0.0, inv_l)
    if DROPOUT:
        inv_l = inv_l * drop_scale
    o_acc = o_acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]
    lse = (m_i + gl.log2(l_i)) * LN2
    lse_rows = lse_ptr + b.to(gl.int64) * lse_stride_b + h.to(gl.int64) * lse_stride_h + row_base
    gl.store(lse_rows + rows, lse, mask=rows < seqlen)
    if GROUP and row0 + ROWS > seqlen:
        out_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        offs = (row_base + out_rows).to(gl.int64)[:, None] * stride_os + h * stride_oh + cols[None, :]
        gl.store(out_ptr + offs, o_acc.to(dtype), mask=(out_rows < seqlen)[:, None])
    else:
        q_tile.store(o_acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [bd, row_base + row0, h, 0], q_smem)
        if Q_BUFS == 1:
            tma.store_wait(0)  # before the next tile's Q lands in this buffer
    return ring0 + end


@gluon.jit
def _produce_and_drop(k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty,
                      philox_ptr, threshold, mask_bufs, mask_ready, seqlen, H, kv_group, tiles, left, right,
                      bias_step_b, bias_step_h, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, WINDOW: gl.constexpr, BIAS: gl.constexpr):
    """With dropout (batch mode, one tile per CTA) one warpgroup streams K/V and makes CK's masks:
    a producer warp of its own would be padded to a warpgroup (16 warps), which holds the launch to
    128 registers a thread, too few for ptxas at d = 256. Per key tile u the order is K of u + 1,
    the mask of u, V of u + 1:
    - the mask of u starts once V's slot of u is free (consumer step u - STAGES + 1 releases it
      just before it reads mask u - STAGES + 1), at least a whole consumer step before step u
      needs it;
    - K of u + 1 waits for K's slot, released early in step u - STAGES + 1, so Philox work never
      holds K back; V of u + 1 is needed only in step u + 2;
    - a mask slot needs no release of its own: mask u follows the wait for V's slot of tile u,
      which the consumers release after the PV wgmma of tile u - STAGES, after its mask was read."""
    b, h, m0 = _tile(gl.program_id(0), seqlen, H, tiles, philox_ptr, BLOCK_M, CAUSAL, False, False)  # (no table)
    first, _, _, end = _key_tiles(m0, seqlen, left, right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    key_lo, key_hi, base_lo, base_hi = philox_key_and_base(philox_ptr, b * H + h)
    h_kv = h // kv_group
    _load_k_tile(0, b, h, m0, b, first * BLOCK_N, h_kv, k_desc, bias_desc, k_bufs, bias_bufs, k_ready, k_empty,
                 bias_step_b, bias_step_h, BLOCK_M, STAGES, BIAS)
    _load_v_tile(0, b, first * BLOCK_N, h_kv, v_desc, v_bufs, v_ready, v_empty, STAGES)
    for it in range(end - first):
        n1 = (first + it + 1) * BLOCK_N
        if it + 1 < end - first:
            _load_k_tile(it + 1, b, h, m0, b, n1, h_kv, k_desc, bias_desc, k_bufs, bias_bufs, k_ready, k_empty,
                         bias_step_b, bias_step_h, BLOCK_M, STAGES, BIAS)
        _drop_key_tile(it, m0, (first + it) * BLOCK_N, key_lo, key_hi, base_lo, base_hi, threshold, mask_bufs,
                       mask_ready, BLOCK_M, BLOCK_N, STAGES)
        if it + 1 < end - first:
            _load_v_tile(it + 1, b, n1, h_kv, v_desc, v_bufs, v_ready, v_empty, STAGES)


@gluon.jit
def _drop_key_tile(u, m0, kv0, key_lo, key_hi, base_lo, base_hi, threshold, mask_bufs, mask_ready,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The masks of key tile kv0 (ring position u) for the query tile from row m0, one 64-row mask
    per consumer (16-bit, all ones where kept) in slot ``wg * STAGES + u % STAGES``. They are
    written two columns a word, through a uint32 view of the slot: its rows are as many bytes,
    swizzled alike."""
    pair_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, BLOCK_N // 2], gl.uint32)
    s = u % STAGES
    for wg in gl.static_range(BLOCK_M // ROWS_PER_CONSUMER):
        masks = dropout_mask_pairs(key_lo, key_hi, base_lo, base_hi, m0 + wg * ROWS_PER_CONSUMER, kv0, threshold,
                                   BLOCK_N)
        mask_bufs.index(wg * STAGES + s)._reinterpret(gl.uint32, [ROWS_PER_CONSUMER, BLOCK_N // 2],
                                                      pair_layout).store(masks)
    gl.thread_barrier()  # every thread's stores are in before the slot is handed over
    mbarrier.arrive(mask_ready.index(s))


# Lengths, head counts and window sizes are not specialized: one compile serves every shape of a
# config. WINDOW: a sliding window of ``left`` keys back and ``right`` ahead (unbounded sides come
# as 2 * seqlen); ALIBI: 0 none, 1 -slope * |i - j|, 3 the same computed linearly off the diagonal
# (no window), 4 as 3 with the column term added by the tensor cores, 2 slope * j (causal), slopes
# [B?, H] strided;
# BIAS: an elementwise bias through ``bias_desc`` over ``[B or 1, H or 1, S, S]`` (coordinates b *
# bias_step_b, h * bias_step_h: 0 for a broadcast dim), else ``bias_desc`` stands in as k_desc.
# Q_BUFS: Q buffers a consumer, 2 (persistent, batch mode) to load a tile's Q during the tile before.
# PACKED_P: P rounded to the PV operand two elements a cvt (``HopperFwdConfig.packed_p``).
@gluon.jit(do_not_specialize=["seqlen", "H", "kv_group", "tiles", "left", "right", "stride_ab", "stride_ah",
                              "stride_os", "stride_oh", "lse_stride_b", "lse_stride_h", "bias_step_b", "bias_step_h",
                              "threshold"])
def attention_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, bias_desc, out_ptr, lse_ptr, alibi_ptr, seqstart_ptr,
                                table_ptr, philox_ptr, seqlen, H, kv_group, tiles, qk_scale, left, right, stride_ab,
                                stride_ah, stride_os, stride_oh, lse_stride_b, lse_stride_h, bias_step_b, bias_step_h,
                                threshold, drop_scale, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                                STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, Q_BUFS: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                                ALIBI: gl.constexpr, GROUP: gl.constexpr, PERSISTENT: gl.constexpr, BIAS: gl.constexpr,
                                DROPOUT: gl.constexpr, PACKED_P: gl.constexpr):
    gl.static_assert(NUM_CONSUMERS == 2 or (NUM_CONSUMERS == 3 and not DROPOUT))
    gl.static_assert(Q_BUFS == 1 or (Q_BUFS == 2 and PERSISTENT and not GROUP))
    BLOCK_M: gl.constexpr = ROWS_PER_CONSUMER * NUM_CONSUMERS
    dtype: gl.constexpr = q_desc.dtype

    q_bufs = gl.allocate_shared_memory(dtype, [Q_BUFS * NUM_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if BIAS:  # slot wg * STAGES + s: consumer wg's rows for K's slot s
        bias_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS * STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
    else:
        bias_bufs = k_bufs  # never read
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_BUFS * NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS * NUM_CONSUMERS):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    if DROPOUT:  # slot wg * STAGES + s: consumer wg's mask for K's slot s
        mask_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, BLOCK_N], gl.int16)
        mask_bufs = gl.allocate_shared_memory(gl.int16, [NUM_CONSUMERS * STAGES, ROWS_PER_CONSUMER, BLOCK_N],
                                              mask_layout)
        mask_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(mask_ready.index(i), count=1)
    else:  # never read
        mask_bufs = k_bufs
        mask_ready = k_ready
    if ALIBI == 4:  # consumer wg's ALiBi wgmma operand (see _write_alibi_columns)
        alibi_cols = gl.allocate_shared_memory(
            gl.bfloat16, [NUM_CONSUMERS, BLOCK_N, ALIBI_PIECES],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, ALIBI_PIECES], gl.bfloat16))
    else:  # never read
        alibi_cols = k_bufs

    # Each consumer warpgroup is a partition of its own (the first argument is its index), so it
    # gets its own named barrier and one warpgroup's mbarrier arrive never waits on another. The
    # argument tuples stay inline: a tuple assigned to a local first turns its constexprs into
    # tensors, which then cannot build layouts.
    if DROPOUT:  # loads and masks in the default partition (see _produce_and_drop)
        gl.warp_specialize([
            (_produce_and_drop, (k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready,
                                 v_empty, philox_ptr, threshold, mask_bufs, mask_ready, seqlen, H, kv_group, tiles,
                                 left, right, bias_step_b, bias_step_h, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW,
                                 BIAS)),
            (_consumer, (0, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                          k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
                          lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                          mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                          WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)),
            (_consumer, (1, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                          k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
                          lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                          mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                          WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    elif NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                          k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
                          lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                          mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                          WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)),
            (_consumer, (1, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                          k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
                          lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                          mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                          WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)),
            (_producer, (k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty,
                         seqstart_ptr, table_ptr, seqlen, H, kv_group, tiles, bias_step_b, bias_step_h, left, right,
                         BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW, GROUP, PERSISTENT, BIAS)),
        ], [4, 1], [CONSUMER_REGS, 504 - 2 * CONSUMER_REGS])  # the producer: what the consumers leave of 64K
    else:
        gl.warp_specialize([
            (_consumer, (0, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                          k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
                          lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                          mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                          WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)),
            (_consumer, (1, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                          k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
                          lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                          mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                          WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)),
            (_consumer, (2, q_desc, o_desc, out_ptr, lse_ptr, q_bufs, q_bars, k_bufs, v_bufs, bias_bufs, k_ready,
                          k_empty, v_ready, v_empty, seqstart_ptr, table_ptr, seqlen, H, tiles, stride_os, stride_oh,
                          lse_stride_b, lse_stride_h, qk_scale, left, right, alibi_ptr, stride_ab, stride_ah,
                          mask_bufs, mask_ready, alibi_cols, drop_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                          WINDOW, ALIBI, GROUP, PERSISTENT, BIAS, DROPOUT, PACKED_P)),
            (_producer, (k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty,
                         seqstart_ptr, table_ptr, seqlen, H, kv_group, tiles, bias_step_b, bias_step_h, left, right,
                         BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW, GROUP, PERSISTENT, BIAS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
