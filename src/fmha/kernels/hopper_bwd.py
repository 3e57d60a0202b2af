"""Backward attention for Hopper (sm_90a) in Triton's Gluon dialect, FlashAttention-3's split.

Three launches: ``hopper_bwd_preprocess`` (Triton) writes ``-delta`` and ``-lse / scale`` per query
row of each (sequence, head), padded to a multiple of 128 rows (padding: delta 0, lse +inf, so P = 0
there and the main loop needs no query bound, in group mode too) and in batch mode zeroes the dQ
accumulator; ``attention_bwd_hopper_kernel`` (Gluon); ``hopper_bwd_convert_dq``
(Triton) scales the fp32 dQ accumulator into dQ.

Main kernel at head dims 64/128 (at 256, ``attention_bwd_hopper_wide_kernel`` below splits the
head dim between the warpgroups instead): one CTA per (128-key tile, batch * head), roles by
``gl.warp_specialize``:

* a producer warp loads K and V once by TMA, then streams Q_i with its -lse slice and dO_i with its
  -delta slice through a ``STAGES``-deep ring;
* two consumer warpgroups each own 64 keys (keys on the wgmma M side). Per query tile:
  ``S^T = K Q^T`` and ``dP^T = V dO^T`` take in the folded statistics (S^T starts from -lse,
  dP^T from -delta or adds it after its wait), so ``P^T = exp2(S^T * scale * log2 e)`` and
  ``dS^T = P^T * dP^T``; then ``dV += P^T dO``,
  ``dK += dS^T Q`` and ``dQ_part = dS K``, which a TMA bulk reduce-add sums into the fp32
  accumulator. In the atomic mode the order of those adds varies; in the deterministic mode
  (``CHAINS``) they take turns in a fixed order that the producer warp keeps (see ``_rank``).
* the epilogue writes dV and ``dK * scale`` by TMA through this warpgroup's half of the V tile.

A sliding window (``WINDOW``) visits only the query tiles whose rows see some of the CTA's keys,
masked at both edges; ALiBi (``ALIBI``) adds its term to the exponent of P^T (the LSE folded into
S^T already holds it; dS^T needs nothing more); an elementwise bias (``BIAS``) joins -lse in the
start of S^T, its tile streamed per step by the producer, which also stores dS^T, its gradient,
where asked (``DBIAS``). With dropout (``DROPOUT``) the producer is a warpgroup that also makes
each step's CK masks, transposed (keys are S^T's rows), into a ring slot beside Q's.

Tensors are addressed like the forward's: 4-D descriptors over ``[B, S, H, D]``, boxes
``[1, rows, 1, cols]``, rows past the sequence zero-filled on load and clipped on store.
"""

import triton
import triton.language as tl
from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gl_builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import LOG2E
from .hopper_dropout import dropout_mask_query_pairs, philox_key_and_base
from .hopper_fwd import packed_sequence, widened

BLOCK_N = gl.constexpr(128)  # keys per CTA
WG_KEYS = gl.constexpr(64)  # keys per consumer warpgroup (one m64 wgmma)
DROP_KEYS = gl.constexpr(32)  # keys per chunk of a step's dropout masks
STAT_PAD = 128  # statistics rows are padded to a multiple of every BLOCK_M


# Gluon 3.6 has no wrapper for the TMA reduction; its op builder has one
# (ttng.async_tma_reduce -> cp.reduce.async.bulk.tensor.add.f32).
@_gl_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@triton.jit
def hopper_bwd_preprocess(O, DO, Lse, NegDelta, NegLse, Seqstart, Acc, seqlen, seqlen_pad, H, inv_scale,
                          delta_scale, stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_lb,
                          stride_lh, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                          ZERO_ACC: tl.constexpr, COPIES: tl.constexpr):
    """Statistics per (sequence, head), padded rows: in group mode ``seqlen`` is the longest
    sequence and sequence b the rows ``Seqstart[b] ..`` of the packed O, dO and LSE. ``ZERO_ACC``
    (batch mode): also zero these rows of the contiguous ``[B, S, H * COPIES, HEAD_DIM]`` dQ
    accumulator, which saves the host a fill's launch. -delta is stored times ``delta_scale`` (with
    dropout 1 - p, see the consumers' step)."""
    blocks = seqlen_pad // BLOCK  # 1-D grid: grid y stops at 65535, less than batch * heads can be
    bh = tl.program_id(0) // blocks
    b = bh // H
    h = bh % H
    rows = (tl.program_id(0) % blocks) * BLOCK + tl.arange(0, BLOCK)
    start = 0
    length = seqlen
    if GROUP:
        start = tl.load(Seqstart + b)
        length = tl.load(Seqstart + b + 1) - start
    cols = tl.arange(0, HEAD_DIM)
    ok = rows < length
    packed = (start + rows)[:, None].to(tl.int64)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + packed * stride_os + cols[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + packed * stride_dos + cols[None, :],
                 mask=ok[:, None], other=0.0).to(tl.float32)
    lse = tl.load(Lse + b.to(tl.int64) * stride_lb + h * stride_lh + start + rows, mask=ok, other=float("inf"))
    pad = bh.to(tl.int64) * seqlen_pad + rows
    # Negated: S^T's accumulator starts from -lse, dP^T's from -delta (or adds it). A row that sees no
    # key (a bias of -inf over all of them: lse = -inf) gets -inf too, so its P stays 0.
    tl.store(NegDelta + pad, tl.where(ok, -tl.sum(o * do, 1) * delta_scale, 0.0))
    tl.store(NegLse + pad, tl.where(lse == -float("inf"), -float("inf"), -lse * inv_scale))
    if ZERO_ACC:
        acc_rows = (b.to(tl.int64) * seqlen + rows) * (H * COPIES) + h * COPIES
        for c in tl.static_range(COPIES):
            tl.store(Acc + (acc_rows + c)[:, None] * HEAD_DIM + cols[None, :],
                     tl.zeros((BLOCK, HEAD_DIM), tl.float32), mask=ok[:, None])


@triton.jit
def hopper_bwd_convert_dq(Acc, DQ, n, scale, seqlen, H, BLOCK: tl.constexpr, COPIES: tl.constexpr,
                          HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, KEYS: tl.constexpr):
    """dQ = scale * the fp32 accumulator, ``[B, S, H * COPIES, HEAD_DIM]``: each head's COPIES
    copies (the deterministic mode's) summed in order. A copy's first add is a store (its rows are
    not zeroed), so a query tile with fewer key tiles than copies never wrote the last ones: the
    sum reads only the copies a tile got (query tiles of BLOCK_M rows, key tiles of KEYS)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    if COPIES == 1:
        acc = tl.load(Acc + offs, mask=keep, other=0.0)
    else:
        key_tiles = tl.cdiv(seqlen, KEYS)
        if CAUSAL:  # the key tiles that hold a key the tile's last row sees
            query_tile = (offs // (H * HEAD_DIM) % seqlen) // BLOCK_M
            key_tiles = tl.minimum(((query_tile + 1) * BLOCK_M - 1) // KEYS + 1, key_tiles)
        first = offs // HEAD_DIM * (COPIES * HEAD_DIM) + offs % HEAD_DIM
        acc = tl.load(Acc + first, mask=keep, other=0.0)
        for c in tl.static_range(1, COPIES):
            acc += tl.load(Acc + first + c * HEAD_DIM, mask=keep & (c < key_tiles), other=0.0)
    tl.store(DQ + offs, (acc * scale).to(DQ.dtype.element_ty), mask=keep)


@gluon.jit
def _this_program(seqlen, H, KEYS: gl.constexpr, LAST_FIRST: gl.constexpr = False):
    """(batch, head, batch * H + head, first key) of a CTA holding KEYS keys. The grid is 1-D
    (grid y stops at 65535, less than batch * heads can be), a head's key tiles adjacent so its
    Q/dO stay in L2; first to last, or (``LAST_FIRST``) last to first."""
    n_blocks = gl.cdiv(seqlen, KEYS)
    pid = gl.program_id(0)
    bh = pid // n_blocks
    n = pid % n_blocks
    if LAST_FIRST:
        n = n_blocks - 1 - n
    return bh // H, bh % H, bh, n * KEYS


@gluon.jit
def _key_tile_program(seqlen, H, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, CHAINS: gl.constexpr):
    """``_this_program`` of the narrow kernel's CTAs: in the deterministic mode under a causal mask
    with one query tile a key tile per step, last first (see ``_rank``)."""
    return _this_program(seqlen, H, BLOCK_N, CAUSAL and CHAINS > 0 and BLOCK_M == BLOCK_N)


@gluon.jit
def _query_tiles(n0, seqlen, BLOCK_M: gl.constexpr, KEYS: gl.constexpr, CAUSAL: gl.constexpr):
    """(m_lo, m_mask_end, m_hi) in query tiles for the KEYS keys from n0: tiles [m_lo, m_mask_end)
    need the mask (causal diagonal, or all tiles of a ragged key tile), the rest none."""
    m_hi = gl.cdiv(seqlen, BLOCK_M)
    if CAUSAL:
        m_lo = n0 // BLOCK_M
        # some key > some row iff the tile's first row < n0 + KEYS - 1; a ragged key tile is
        # the last, whose mask range then reaches m_hi anyway
        m_mask_end = gl.minimum(gl.cdiv(n0 + KEYS - 1, BLOCK_M), m_hi)
    else:
        m_lo = 0
        m_mask_end = 0
        if n0 + KEYS > seqlen:
            m_mask_end = m_hi
    return m_lo, m_mask_end, m_hi


@gluon.jit
def _band_query_tiles(n0, seqlen, left, right, BLOCK_M: gl.constexpr, KEYS: gl.constexpr, CAUSAL: gl.constexpr,
                      WINDOW: gl.constexpr):
    """(m_lo, inner_lo, inner_hi, m_hi) in query tiles for the KEYS keys from n0: it runs tiles
    [m_lo, m_hi); those in [inner_lo, inner_hi) need no mask. A window shows row i keys
    i - left .. i + right, so key j is seen by rows j - right .. j + left."""
    if WINDOW:
        last_key = gl.minimum(n0 + KEYS, seqlen) - 1
        m_lo = gl.maximum(n0 - right, 0) // BLOCK_M
        m_hi = gl.cdiv(gl.minimum(last_key + left + 1, seqlen), BLOCK_M)
        # unmasked: the first row sees the last key, the last row the first (a ragged last query
        # tile stays masked: cheap, and rows past the sequence have P = 0 anyway)
        inner_lo = gl.cdiv(gl.maximum(n0 + KEYS - 1 - right, 0), BLOCK_M)
        inner_hi = gl.minimum(n0 + left + 1, seqlen) // BLOCK_M
        if n0 + KEYS > seqlen:  # keys past the sequence: every tile masked
            inner_lo = m_hi
    else:
        m_lo, inner_lo, m_hi = _query_tiles(n0, seqlen, BLOCK_M, KEYS, CAUSAL)
        inner_hi = m_hi
    return m_lo, inner_lo, inner_hi, m_hi


@gluon.jit
def _group_step(it, n_m, m_lo, h, bh, kv_group):
    """(query tile, query head, batch * query heads + query head) of step ``it``: a CTA holds the
    K/V of one key/value head and runs the n_m query tiles of each of its kv_group query heads
    (GQA/MQA; 1 otherwise) in turn, so dK/dV sum over the group in registers."""
    if kv_group == 1:  # specialized at launch: the plain loop
        return m_lo + it, h, bh
    g = it // n_m
    return m_lo + it % n_m, h * kv_group + g, bh * kv_group + g


# The deterministic mode (CHAINS > 0). Each query tile's dQ adds go in an order fixed by the key
# tile, position r of ``_rank``: add r goes into accumulator copy r % CHAINS after add r - CHAINS
# there (one int32 semaphore per query tile and copy counts them), and the convert kernel sums the
# copies in order. The CTAs run so that add r - CHAINS comes CHAINS steps before add r, which
# leaves a CTA CHAINS - 1 steps of slack before it waits for its turn. The consumers still issue
# their TMA adds (made by the producer, they cost the consumers registers: 16-56 B of spills); the
# producer warp's lane 0 keeps the turns: it passes one on (release) or spins until one comes
# (acquire); -1 skips either. A turn may be held by a key tile launched later, which only runs
# once it has an SM: beside kernels that hold SMs (another stream's, a collective's) the spin waits
# for them, and after 2^26 reads (tens of seconds) it traps rather than hang for good (two such
# backwards at once can wait on each other). Labels are scoped by the braces.
_TAKE_TURN = gl.constexpr("""{
.reg .pred p;
.reg .b32 v;
.reg .b32 n;
.reg .b64 a;
setp.ne.s32 p, $1, 0;
@p bra DONE;
setp.lt.s32 p, $3, 0;
@p bra WAIT;
mad.wide.s32 a, $3, 4, $2;
red.release.gpu.global.add.s32 [a], 1;
WAIT:
setp.lt.s32 p, $4, 0;
@p bra DONE;
mad.wide.s32 a, $4, 4, $2;
mov.b32 n, 0;
SPIN:
ld.acquire.gpu.global.b32 v, [a];
setp.eq.s32 p, v, $5;
@p bra DONE;
add.s32 n, n, 1;
setp.lt.u32 p, n, 67108864;
@p bra SPIN;
trap;
DONE:
mov.b32 $0, 0;
}""")


@gluon.jit
def _take_turn(sem_ptr, done, wanted, turn):
    """In the producer warp: pass on the turn at ``sem_ptr[done]``, then wait until
    ``sem_ptr[wanted]`` is ``turn``."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    gl.inline_asm_elementwise(_TAKE_TURN, "=r,r,l,r,r,r", [lane, sem_ptr, done, wanted, turn], dtype=gl.int32,
                              is_pure=False, pack=1)


# The deterministic mode's hand-shake between the consumers and the producer, by mbarrier rings:
# the producer grants step j's turn (``grants`` slot wg * TURN_SLOTS + j % TURN_SLOTS) as soon as
# it has it, ahead of the consumers; the consumers report their adds complete (``dones`` slot
# j % TURN_SLOTS, both arrive), which the producer waits for a step later to pass the turns on.
# Each ring runs at most three uses ahead of its waiter: the producer grants step j after the
# report of step j - 2, which a consumer makes after its wait for the grant of step j - 3; a
# consumer reports step j after that grant of step j - 1, which follows the producer's wait for
# the report of step j - 3.
TURN_SLOTS = gl.constexpr(4)
_BULK_COMPLETE = gl.constexpr("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.b32 $0, 0;")


@gluon.jit
def _turn_barriers(stand_in, CHAINS: gl.constexpr):
    """(grants, dones): the deterministic mode's rings, initialized; else ``stand_in`` twice."""
    if CHAINS > 0:
        grants = gl.allocate_shared_memory(gl.int64, [2 * TURN_SLOTS, 1], mbarrier.MBarrierLayout())
        dones = gl.allocate_shared_memory(gl.int64, [TURN_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * TURN_SLOTS):
            mbarrier.init(grants.index(i), count=1)
        for i in gl.static_range(TURN_SLOTS):
            mbarrier.init(dones.index(i), count=2)  # one arrive per consumer warpgroup
    else:  # never read
        grants = stand_in
        dones = stand_in
    return grants, dones


@gluon.jit
def _adds_completed(dones, j):
    """A consumer warpgroup's report that its TMA adds up to step j - 1 have completed (its issuing
    thread waits for them, not just for their reads of shared memory)."""
    lane = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.inline_asm_elementwise(_BULK_COMPLETE, "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.arrive(dones.index(j % TURN_SLOTS))


@gluon.jit
def _rotation(n0, seqlen, n_m, BLOCK_M: gl.constexpr):
    """Deterministic mode without a mask: key tile n of N runs K = BLOCK_N / BLOCK_M virtual query
    tiles per key tile, K * N of them, from K * (N - 1 - n) on and wrapping around, so side by side
    the CTAs reach each query tile K steps apart and step t's add is the (t // K)-th into its tile.
    Returns (first tile, the step whose tile is the virtual one past the last, K * N): a ragged
    sequence has K * N - 1 query tiles when K is 2."""
    K: gl.constexpr = BLOCK_N // BLOCK_M
    n_blocks = gl.cdiv(seqlen, BLOCK_N)
    n_v = K * n_blocks
    rot = K * (n_blocks - 1 - n0 // BLOCK_N)
    t_skip = n_v
    if n_v > n_m:
        t_skip = n_v - 1 - rot
    return rot, t_skip, n_v


@gluon.jit
def _rotated(it, rot, t_skip, n_v):
    """(virtual step, query tile) of real step ``it`` in ``_rotation``'s order."""
    t = it + (it >= t_skip).to(gl.int32)
    m = rot + t
    return t, m - n_v * (m >= n_v).to(gl.int32)


@gluon.jit
def _rank(m, t, n0, seqlen, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """How many key tiles add into query tile m before this CTA (deterministic mode; t its virtual
    step there). Causal: from the tile's last key tile down; they run side by side, the later key
    tiles a step ahead each. Then key tile n waits for n + CHAINS to finish step it - CHAINS * K
    (K = BLOCK_N / BLOCK_M query tiles a key tile): launched longest first, n + CHAINS must start
    within CHAINS * K steps of n. With K = 1 (128-row tiles at d = 64, 16k) they often did not,
    so those launch last first (``_this_program``'s LAST_FIRST: 0.95 of atomic against 0.82);
    with K = 2 the longest-first order keeps its better balance (d = 128: 0.92 against 0.78 last
    first).
    Otherwise ``_rotation``'s order."""
    if CAUSAL:
        rank = gl.minimum(((m + 1) * BLOCK_M - 1) // BLOCK_N, gl.cdiv(seqlen, BLOCK_N) - 1) - n0 // BLOCK_N
    else:
        rank = t // (BLOCK_N // BLOCK_M)
    return rank


@gluon.jit
def _grant_turn(it, m, rank, grants, sem_ptr, bh, n_m, CHAINS: gl.constexpr):
    """The producer: wait for step ``it``'s turn (query tile m, ``_rank``) and grant it to both
    consumers; returns its semaphore."""
    sem = (bh * n_m + m) * CHAINS + rank % CHAINS
    _grant(it, sem, rank // CHAINS, grants, sem_ptr)
    return sem


@gluon.jit
def _grant(it, sem, turn, grants, sem_ptr):
    """The producer: wait until semaphore ``sem`` is ``turn``, then grant step ``it`` to both
    consumers."""
    _take_turn(sem_ptr, -1, sem, turn)
    for wg in gl.static_range(2):
        mbarrier.arrive(grants.index(wg * TURN_SLOTS + it % TURN_SLOTS))


@gluon.jit
def _pass_turn(j, sem, dones, sem_ptr):
    """The producer: once both consumers report the adds before step j complete, pass on the turn
    of step j - 1 (semaphore ``sem``; -1: none)."""
    mbarrier.wait(dones.index(j % TURN_SLOTS), (j // TURN_SLOTS) & 1)
    _take_turn(sem_ptr, sem, -1, 0)


@gluon.jit
def _store_dbias(j, m_lo, n_m, h, bh, kv_group, bd, n0, dbias_desc, ds_bufs, ds_ready, ds_empty, BLOCK_M: gl.constexpr,
                 DS_BUFS: gl.constexpr):
    """The producer: once both consumers wrote step j's dS^T tile, store it (it is dBias^T) and,
    once the store has read it, release the tile to the consumers (ds_empty's third arrive)."""
    m, hq, _ = _group_step(j, n_m, m_lo, h, bh, kv_group)
    buf = j % DS_BUFS
    mbarrier.wait(ds_ready.index(buf), (j // DS_BUFS) & 1)
    ds_buf = ds_bufs.index(buf)
    tma.async_copy_shared_to_global(dbias_desc, [bd, hq, n0, m * BLOCK_M],
                                    ds_buf.reshape([1, 1] + ds_buf.type.shape))
    tma.store_wait(0)
    mbarrier.arrive(ds_empty.index(buf))


@gluon.jit
def _init_rings(q_ready, q_empty, do_ready, do_empty, STAGES: gl.constexpr):
    """The Q and dO rings' barriers: ready by the producer's TMA, empty by both consumers."""
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(do_empty.index(i), count=2)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, bias_desc, dbias_desc, k_smem, v_smem, q_bufs,
              do_bufs, lse_bufs, delta_bufs, bias_bufs, ds_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty,
              bias_ready, bias_empty, ds_ready, ds_empty, seqstart_ptr, seqlen, H, kv_group, left, right, bias_step_b,
              bias_step_h, sem_ptr, grants, dones, philox_ptr, threshold, mask_bufs, mask_ready,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, DS_BUFS: gl.constexpr, CAUSAL: gl.constexpr,
              WINDOW: gl.constexpr, GROUP: gl.constexpr, BIAS: gl.constexpr, DBIAS: gl.constexpr,
              CHAINS: gl.constexpr, DROPOUT: gl.constexpr):
    b, h, bh, n0 = _key_tile_program(seqlen, H, BLOCK_M, CAUSAL, CHAINS)
    bd, row_base, seqlen_b = packed_sequence(b, seqlen, seqstart_ptr, GROUP)
    # Group mode: the grid covers the longest sequence; a CTA past its sequence loads its K/V and
    # runs no query tile (the consumers then add zero dK/dV), which keeps the control flow simple.
    m_lo, _, _, m_hi = _band_query_tiles(n0, seqlen_b, left, right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    n_k = row_base + n0

    # V as two 64-key halves: each is one warpgroup's operand and later its epilogue buffer.
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bd, n_k, h, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [bd, n_k, h, 0], kv_bar, v_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [bd, n_k + WG_KEYS, h, 0], kv_bar, v_smem.index(1))

    n_m = (m_hi - m_lo) * (n0 < seqlen_b).to(gl.int32)
    sem = -1  # deterministic mode: the semaphores of the last two steps
    last_sem = -1
    rot, t_skip, n_v = _rotation(n0, seqlen_b, m_hi, BLOCK_M)
    for it in range(kv_group * n_m):
        m, hq, bhq = _group_step(it, n_m, m_lo, h, bh, kv_group)
        if CHAINS > 0:
            t = it
            if not CAUSAL:
                t, m = _rotated(it, rot, t_skip, n_v)
            rank = _rank(m, t, n0, seqlen_b, BLOCK_M, CAUSAL)
        rows = row_base + m * BLOCK_M
        s = it % STAGES
        ph = ((it // STAGES) & 1) ^ 1  # a fresh mbarrier passes a wait on parity 1 at once
        mbarrier.wait(q_empty.index(s), ph)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bd, rows, hq, 0], q_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(lse_desc, [bhq, m * BLOCK_M], q_ready.index(s), lse_bufs.index(s))
        mbarrier.wait(do_empty.index(s), ph)
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [bd, rows, hq, 0], do_ready.index(s), do_bufs.index(s))
        tma.async_copy_global_to_shared(delta_desc, [bhq, m * BLOCK_M], do_ready.index(s), delta_bufs.index(s))
        if DROPOUT:  # both consumers freed the Q slot: they read its masks before
            _drop_step(s, m * BLOCK_M, bhq, n0, philox_ptr, threshold, mask_bufs, mask_ready)
        if BIAS:  # one slot: both consumers read theirs into registers as their step starts
            mbarrier.wait(bias_empty.index(0), (it & 1) ^ 1)
            mbarrier.expect(bias_ready.index(0), 2 * bias_desc.block_type.nbytes)
            for wg in gl.static_range(2):
                tma.async_copy_global_to_shared(bias_desc, [b * bias_step_b, hq * bias_step_h, m * BLOCK_M,
                                                            n0 + wg * WG_KEYS], bias_ready.index(0),
                                                bias_bufs.index(wg))
        if DBIAS:
            if it > 0:  # the step before's dS^T (its Q slot came back for this step's load: it is near)
                _store_dbias(it - 1, m_lo, n_m, h, bh, kv_group, bd, n0, dbias_desc, ds_bufs, ds_ready, ds_empty,
                             BLOCK_M, DS_BUFS)
        if CHAINS > 0:  # this step's turn, then the turn of the step before last passed on
            before_last = last_sem
            last_sem = sem
            sem = _grant_turn(it, m, rank, grants, sem_ptr, bh, m_hi, CHAINS)
            if it > 0:
                _pass_turn(it - 1, before_last, dones, sem_ptr)
    if DBIAS:
        if n_m > 0:
            _store_dbias(kv_group * n_m - 1, m_lo, n_m, h, bh, kv_group, bd, n0, dbias_desc, ds_bufs, ds_ready,
                         ds_empty, BLOCK_M, DS_BUFS)
    if CHAINS > 0:
        if n_m > 0:  # the last two steps' turns
            _pass_turn(n_m - 1, last_sem, dones, sem_ptr)
            _pass_turn(n_m, sem, dones, sem_ptr)


@gluon.jit
def _drop_step(s, m0, bhq, n0, philox_ptr, threshold, mask_bufs, mask_ready):
    """The producer warpgroup (dropout): the 16-bit masks of queries m0 + [0, 64) and the CTA's
    keys into slot s, ``[BLOCK_N keys, 64 queries]`` (all ones where kept), written two queries a
    word through a uint32 view of the slot: its rows are as many bytes, swizzled alike."""
    key_lo, key_hi, base_lo, base_hi = philox_key_and_base(philox_ptr, bhq)
    pair_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 32], gl.uint32)
    pairs = mask_bufs.index(s)._reinterpret(gl.uint32, [BLOCK_N, 32], pair_layout)
    for chunk in gl.static_range(BLOCK_N // DROP_KEYS):  # one Philox call a thread each: few registers
        masks = dropout_mask_query_pairs(key_lo, key_hi, base_lo, base_hi, m0, n0 + chunk * DROP_KEYS, threshold,
                                         DROP_KEYS)
        pairs.slice(chunk * DROP_KEYS, DROP_KEYS, dim=0).store(masks)
    gl.thread_barrier()  # every thread's stores are in before the slot is handed over
    mbarrier.arrive(mask_ready.index(s))


@gluon.jit
def _key_minus_query(keys, m0, BLOCK_M: gl.constexpr, sT_layout: gl.constexpr):
    """key - query at every element of S^T: keys are its rows, the tile's queries its columns."""
    return keys[:, None] - (m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sT_layout)))[None, :]


@gluon.jit
def _with_alibi(scores, rel, keys, slope, ALIBI: gl.constexpr):
    """Scores of S^T's layout plus ALiBi's term, ``slope`` in their units: ALIBI 1 -slope * |rel|
    (``rel`` = key - query), 2 slope * key, 0 none."""
    if ALIBI == 1:
        scores = scores - slope * gl.abs(rel).to(gl.float32)
    elif ALIBI == 2:  # one term per key: a row of S^T
        scores = scores + (slope * keys.to(gl.float32))[:, None]
    return scores


@gluon.jit
def _keep(keys, rel, seqlen, left, right, CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """Which elements of S^T a masked tile keeps (``rel`` = key - query)."""
    if WINDOW:  # -left <= rel <= right and key < seqlen: one unsigned compare with a key's limit
        limit = gl.where(keys < seqlen, left + right + 1, 0)
        keep = (rel + left).to(gl.uint32, bitcast=True) < limit.to(gl.uint32, bitcast=True)[:, None]
    else:
        keep = keys[:, None] < seqlen
        if CAUSAL:
            keep = keep & (rel <= 0)
    return keep


@gluon.jit
def _scores_start(WG: gl.constexpr, it, s, lse_bufs, bias_bufs, bias_ready, bias_empty, inv_scale,
                  sT_layout: gl.constexpr, BLOCK_M: gl.constexpr, BIAS: gl.constexpr):
    """S^T's initial value: -lse / scale per query, and with a bias this warpgroup's [queries,
    keys] tile of it, read transposed, over scale: exp2 of S^T * scale * log2 e is then P^T."""
    neg_lse = lse_bufs.index(s).load(sT_layout)
    if BIAS:
        mbarrier.wait(bias_ready.index(0), it & 1)
        bias_t = bias_bufs.index(WG).reshape([BLOCK_M, WG_KEYS]).permute((1, 0)).load(sT_layout)
        # The producer's next TMA load may overwrite the slot: the proxy fence makes these reads
        # complete first (the arrive alone could overtake them, and did: with dP^T issued beside
        # S^T the next step's tile landed under them, benchmarks/NOTES.md session 30).
        fence_async_shared()
        mbarrier.arrive(bias_empty.index(0))
        start = widened(bias_t) * inv_scale + neg_lse
    else:
        start = gl.zeros([WG_KEYS, BLOCK_M], gl.float32, sT_layout) + neg_lse
    return start


# P with its sign bit set where the 16-bit mask is 0 (dropped), opaque to the compiler: folded
# back into a select on the mask it would keep the mask live beside dP^T. Two elements a mask
# register (the first's mask in its low half), one lop3 (a | ~b & c) each, the first's mask
# shifted to the top.
_SIGN_DROPPED = gl.constexpr("""{
.reg .b32 t;
shl.b32 t, $4, 16;
lop3.b32 $0, $2, t, 0x80000000, 0xF2;
lop3.b32 $1, $3, $4, 0x80000000, 0xF2;
}""")


@gluon.jit
def _sign_dropped(p, keep):
    return gl.inline_asm_elementwise(_SIGN_DROPPED, "=r,=r,r,r,r", [p, keep], dtype=gl.float32, is_pure=True,
                                     pack=2)


@gluon.jit
def _consumer_step(WG: gl.constexpr, it, m, inner_lo, inner_hi, k_w, v_w, k_full, q_bufs, do_bufs, ds_bufs,
                   dq_smem, p_smem, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, dq_desc, lse_bufs,
                   delta_bufs, bias_bufs, bias_ready, bias_empty, bd, row_base, h, keys, seqlen, qk_scale, inv_scale,
                   left, right, slope, dk, dv, rank, grants, dones, mask_bufs, mask_ready, drop_scale,
                   sT_layout: gl.constexpr, dq_layout: gl.constexpr, kv_op_layout: gl.constexpr,
                   BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DS_BUFS: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr, GROUP: gl.constexpr,
                   BIAS: gl.constexpr, CHAINS: gl.constexpr, DKV_RS: gl.constexpr, DROPOUT: gl.constexpr):
    dtype: gl.constexpr = q_bufs.dtype
    s = it % STAGES
    ph = (it // STAGES) & 1
    m0 = m * BLOCK_M

    # The statistics start the accumulators (with keys on M they are per column, 16 registers
    # each that would otherwise stay live); they come from the ring slot, loaded with Q and dO.
    mbarrier.wait(q_ready.index(s), ph)
    q_s = q_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
    sT_start = _scores_start(WG, it, s, lse_bufs, bias_bufs, bias_ready, bias_empty, inv_scale, sT_layout, BLOCK_M,
                             BIAS)
    sT = warpgroup_mma(k_w, q_s.permute((1, 0)), sT_start, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    do_s = do_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
    # -delta joins dP^T after its wait where the registers allow (64-row tiles, atomic mode; with
    # dropout after the mask, see below): an accumulator started from loaded values made ptxas
    # wait for S^T before issuing dP^T (its note C7517), so the two never queued together.
    DPT_ZERO: gl.constexpr = BLOCK_M == 64 and CHAINS == 0 and not DROPOUT
    dpT_start = gl.zeros([WG_KEYS, BLOCK_M], gl.float32, sT_layout)
    if not DROPOUT and not DPT_ZERO:
        dpT_start += delta_bufs.index(s).load(sT_layout)
    dpT = warpgroup_mma(v_w, do_s.permute((1, 0)), dpT_start, use_acc=not DPT_ZERO, is_async=True)

    sT = warpgroup_mma_wait(1, deps=[sT])  # S^T done; dP^T may still run under the exp2
    # Queries past the sequence (the next sequence's rows in group mode) need no mask: their
    # padded statistics (-lse = -inf) make P^T zero.
    masked = m < inner_lo
    if WINDOW:
        masked = masked | (m >= inner_hi)
    if WINDOW or ALIBI != 0 or GROUP:
        # Each branch derives key - query itself, the masked one before its scores: computed once
        # for both (or ALiBi's term before the mask), it stays live beside dP^T and spills.
        if masked:  # uniform branch: a band's edge or causal diagonal tiles, or all of a ragged key tile
            rel = _key_minus_query(keys, m0, BLOCK_M, sT_layout)
            scores = _with_alibi(sT * qk_scale, rel, keys, slope, ALIBI)
            scores = gl.where(_keep(keys, rel, seqlen, left, right, CAUSAL, WINDOW), scores, -float("inf"))
        else:
            scores = _with_alibi(sT * qk_scale, _key_minus_query(keys, m0, BLOCK_M, sT_layout), keys, slope, ALIBI)
        pT = gl.exp2(scores)
    else:
        # Plain and causal: the mask after the exp2, so the unmasked tiles run no select (the
        # form above merges its two branches into 64 selects per thread; 4% at d=128, 16k).
        pT = gl.exp2(sT * qk_scale)
        if masked:
            pT = gl.where(_keep(keys, _key_minus_query(keys, m0, BLOCK_M, sT_layout), seqlen, left, right, CAUSAL,
                                WINDOW), pT, 0.0)
    # DKV_RS: P^T and dS^T feed dV and dK from registers (the accumulator's layout is the A
    # operand's), which spares the shared-memory bandwidth the wgmma share; dV's starts once dS^T
    # is made, so only the two 16-bit operands stay live beside dK and dV until they retire.
    # Else P^T goes through this warpgroup's own smem tile (with 128-row query tiles the register
    # operands spill).
    if DROPOUT:
        # The producer's 16-bit masks (all ones where kept) go into the sign bit of P^T / (1 - p)
        # (P >= 0 and exp2's NaN is positive, so the sign marks a drop). Its kept part is dV's
        # operand, and dS = P * (dP * keep / (1 - p) - delta) = kept * dP + |P^T / (1 - p)| *
        # (-delta * (1 - p)), the last factor the preprocess's (``delta_scale``). No mask
        # register stays live beside dP^T.
        mbarrier.wait(mask_ready.index(s), ph)  # (its slot is written again after Q's slot is freed)
        keep = mask_bufs.index(s).slice(WG * WG_KEYS, WG_KEYS, dim=0).load(sT_layout)
        pT = _sign_dropped(pT * drop_scale, keep)
        # -P and -0 give +0; a NaN stays NaN, dropped too (its row's dS^T, and so dK, is NaN anyway)
        kept = gl.maximum(pT, 0.0, propagate_nan=tl.PropagateNan.ALL)
        p_op = gl.convert_layout(kept.to(dtype), kv_op_layout)
        dpT = warpgroup_mma_wait(0, deps=[dpT])
        dsT = (kept * dpT + gl.abs(pT) * delta_bufs.index(s).load(sT_layout)).to(dtype)
    else:
        if DKV_RS:
            p_op = gl.convert_layout(pT.to(dtype), kv_op_layout)
        else:
            p_smem.store(pT.to(dtype))
            fence_async_shared()
            p_op = p_smem
        dpT = warpgroup_mma_wait(0, deps=[dpT])
        if DPT_ZERO:
            dpT += delta_bufs.index(s).load(sT_layout)
        dsT = (pT * dpT).to(dtype)
    dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
    if DKV_RS:  # dK needs only this warpgroup's dS^T: it runs while the warpgroups meet below
        ds_op = gl.convert_layout(dsT, kv_op_layout)
        dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)

    # dS^T goes to this warpgroup's half of a shared [128, BLOCK_M] tile that both dQ wgmma read.
    buf = it % DS_BUFS
    ph_ds = (it // DS_BUFS) & 1
    ds_buf = ds_bufs.index(buf)
    mbarrier.wait(ds_empty.index(buf), ph_ds ^ 1)  # both dQ wgmma of its previous use retired
    ds_buf.slice(WG * WG_KEYS, WG_KEYS, dim=0).store(dsT)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(buf))
    mbarrier.wait(ds_ready.index(buf), ph_ds)  # both halves written
    if not DKV_RS:
        dk = warpgroup_mma(ds_buf.slice(WG * WG_KEYS, WG_KEYS, dim=0), q_s, dk, is_async=True)
    ds_full = ds_buf.permute((1, 0))
    if BLOCK_M == 128:  # this warpgroup's 64 query rows, every head-dim column
        dq = warpgroup_mma(ds_full.slice(WG * 64, 64, dim=0), k_full,
                           gl.zeros([64, HEAD_DIM], gl.float32, dq_layout), use_acc=False, is_async=True)
    else:  # every query row, this warpgroup's half of the head-dim columns
        dq = warpgroup_mma(ds_full, k_full.slice(WG * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1),
                           gl.zeros([64, HEAD_DIM // 2], gl.float32, dq_layout), use_acc=False, is_async=True)

    if DKV_RS:  # dO and Q no longer read: free the slot (and the operands' registers)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(1, deps=[dv, dk, p_op, ds_op])
    else:
        dv, dk = warpgroup_mma_wait(1, deps=[dv, dk])
    mbarrier.arrive(do_empty.index(s))
    mbarrier.arrive(q_empty.index(s))
    dq = warpgroup_mma_wait(0, deps=[dq])
    mbarrier.arrive(ds_empty.index(buf))

    acc_h = h
    if CHAINS > 0:  # in its turn (see _TAKE_TURN), into the head's copy rank % CHAINS
        _adds_completed(dones, it)
        acc_h = h * CHAINS + rank % CHAINS
    tma.store_wait(0)  # the previous reduction has read dq_smem
    dq_smem.reshape([64, dq.shape[1]]).store(dq)
    fence_async_shared()
    if CHAINS > 0:
        mbarrier.wait(grants.index(WG * TURN_SLOTS + it % TURN_SLOTS), (it // TURN_SLOTS) & 1)
    if BLOCK_M == 128:
        coord = [bd, row_base + m0 + WG * 64, acc_h, 0]
    else:
        coord = [bd, row_base + m0, acc_h, WG * (HEAD_DIM // 2)]
    # A copy's first add is a store (its rows are not zeroed: a DRAM write and read saved; in
    # 128-row query tiles at d=64 the branch spilled 32 B)
    if CHAINS > 0:
        if rank < CHAINS:
            tma.async_copy_shared_to_global(dq_desc, coord, dq_smem)
        else:
            _tma_reduce_add(dq_desc, coord, dq_smem)
    else:
        _tma_reduce_add(dq_desc, coord, dq_smem)
    return dk, dv


@gluon.jit
def _unseen_edges(WG: gl.constexpr, n0, seqlen, kv_group, m_lo, m_hi, left, right, BLOCK_M: gl.constexpr):
    """(skip_first, skip_last): whether no row of the CTA's first / last query tile [m_lo, m_hi)
    sees a key of warpgroup WG under a window (two or more tiles, no GQA): its keys lie right of
    the first tile's windows, or left of the last's."""
    key0 = n0 + WG * WG_KEYS
    two = (m_hi - m_lo >= 2) & (kv_group == 1)
    skip_first = two & (key0 > m_lo * BLOCK_M + BLOCK_M - 1 + right)
    skip_last = two & (key0 + WG_KEYS - 1 < (m_hi - 1) * BLOCK_M - left)
    return skip_first, skip_last


@gluon.jit
def _dq_only_step(WG: gl.constexpr, it, m, k_full, ds_bufs, dq_smem, q_ready, q_empty, do_ready, do_empty, ds_ready,
                  ds_empty, dq_desc, bd, row_base, h, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DS_BUFS: gl.constexpr):
    """Step ``it`` (query tile m) of a warpgroup none of whose keys the tile's rows see: its dS^T
    half is zero, so it writes zeros there and runs only its part of the dQ wgmma, which reads
    both halves; the waits and releases of ``_consumer_step``, without S^T, dP^T, dV and dK."""
    s = it % STAGES
    ph = (it // STAGES) & 1
    # (the slots are released after their loads landed, as in a full step: a release before would
    # count toward the use before)
    mbarrier.wait(q_ready.index(s), ph)
    mbarrier.wait(do_ready.index(s), ph)
    buf = it % DS_BUFS
    ph_ds = (it // DS_BUFS) & 1
    ds_buf = ds_bufs.index(buf)
    mbarrier.wait(ds_empty.index(buf), ph_ds ^ 1)
    zeros_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ds_buf.slice(WG * WG_KEYS, WG_KEYS, dim=0).store(gl.zeros([WG_KEYS, BLOCK_M], ds_buf.dtype, zeros_layout))
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(buf))
    mbarrier.wait(ds_ready.index(buf), ph_ds)
    ds_full = ds_buf.permute((1, 0))
    if BLOCK_M == 128:
        dq = warpgroup_mma(ds_full.slice(WG * 64, 64, dim=0), k_full,
                           gl.zeros([64, HEAD_DIM], gl.float32, dq_layout), use_acc=False, is_async=True)
    else:
        dq = warpgroup_mma(ds_full, k_full.slice(WG * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1),
                           gl.zeros([64, HEAD_DIM // 2], gl.float32, dq_layout), use_acc=False, is_async=True)
    mbarrier.arrive(do_empty.index(s))
    mbarrier.arrive(q_empty.index(s))
    dq = warpgroup_mma_wait(0, deps=[dq])
    mbarrier.arrive(ds_empty.index(buf))
    tma.store_wait(0)  # the previous reduction has read dq_smem
    dq_smem.reshape([64, dq.shape[1]]).store(dq)
    fence_async_shared()
    m0 = m * BLOCK_M
    if BLOCK_M == 128:
        _tma_reduce_add(dq_desc, [bd, row_base + m0 + WG * 64, h, 0], dq_smem)
    else:
        _tma_reduce_add(dq_desc, [bd, row_base + m0, h, WG * (HEAD_DIM // 2)], dq_smem)


@gluon.jit
def _consumer(WG: gl.constexpr, dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs,
              lse_bufs, delta_bufs, ds_bufs, dq_bufs, p_bufs, bias_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty,
              ds_ready, ds_empty, bias_ready, bias_empty, seqstart_ptr, seqlen, H, kv_group, qk_scale, sm_scale,
              inv_scale, left, right, alibi_ptr, stride_ab, stride_ah, grants, dones, mask_bufs, mask_ready,
              drop_scale, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              DS_BUFS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr,
              GROUP: gl.constexpr, BIAS: gl.constexpr, CHAINS: gl.constexpr, DKV_RS: gl.constexpr,
              DROPOUT: gl.constexpr):
    b, h, bh, n0 = _key_tile_program(seqlen, H, BLOCK_M, CAUSAL, CHAINS)
    bd, row_base, seqlen_b = packed_sequence(b, seqlen, seqstart_ptr, GROUP)
    _consumer_keys(WG, dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs,
                   dq_bufs, p_bufs, bias_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty,
                   bias_ready, bias_empty, h, bh, n0, bd, b, row_base, seqlen_b, kv_group, qk_scale, sm_scale,
                   inv_scale, left, right, alibi_ptr, stride_ab, stride_ah, grants, dones, mask_bufs, mask_ready,
                   drop_scale, BLOCK_M, HEAD_DIM, STAGES, DS_BUFS, CAUSAL, WINDOW, ALIBI, GROUP, BIAS, CHAINS, DKV_RS,
                   DROPOUT)


@gluon.jit
def _consumer_keys(WG: gl.constexpr, dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs,
                   lse_bufs, delta_bufs, ds_bufs, dq_bufs, p_bufs, bias_bufs, kv_bar, q_ready, q_empty, do_ready,
                   do_empty, ds_ready, ds_empty, bias_ready, bias_empty, h, bh, n0, bd, b, row_base, seqlen, kv_group,
                   qk_scale, sm_scale, inv_scale, left, right, alibi_ptr, stride_ab, stride_ah, grants, dones,
                   mask_bufs, mask_ready, drop_scale, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, DS_BUFS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                   ALIBI: gl.constexpr, GROUP: gl.constexpr, BIAS: gl.constexpr, CHAINS: gl.constexpr,
                   DKV_RS: gl.constexpr, DROPOUT: gl.constexpr):
    """Warpgroup WG's 64 keys of the CTA's key tile; n0, keys and seqlen are the sequence's."""
    dtype: gl.constexpr = q_bufs.dtype
    sT_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    kv_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    DQ_COLS: gl.constexpr = HEAD_DIM if BLOCK_M == 128 else HEAD_DIM // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])

    m_lo, inner_lo, inner_hi, m_hi = _band_query_tiles(n0, seqlen, left, right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    keys = n0 + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, sT_layout))

    mbarrier.wait(kv_bar, 0)
    k_full = k_smem.reshape([BLOCK_N, HEAD_DIM])
    k_w = k_full.slice(WG * WG_KEYS, WG_KEYS, dim=0)
    v_w = v_smem.index(WG).reshape([WG_KEYS, HEAD_DIM])
    dq_smem = dq_bufs.index(WG)
    p_smem = p_bufs.index(WG)

    dk = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, kv_layout)
    n_m = (m_hi - m_lo) * (n0 < seqlen).to(gl.int32)  # none past the sequence (group mode)
    slope = 0.0  # ALiBi's, in log2 units like the scores
    rot, t_skip, n_v = _rotation(n0, seqlen, m_hi, BLOCK_M)
    # A step whose query tile sees none of this warpgroup's keys runs only its dQ part (its dS^T
    # half zero): in a band b:1024,0 the second warpgroup's first step and the first's last, 17
    # full steps each of the CTA's 18. Those steps are peeled off the loop (they leave dK and dV
    # alone, so the branches hold no accumulator); a window alone in batch mode, atomic.
    SKIPS: gl.constexpr = WINDOW and ALIBI == 0 and not (GROUP or BIAS or DROPOUT or CHAINS > 0)
    start = 0  # the full steps: [start, stop)
    stop = kv_group * n_m
    skip_first = False
    skip_last = False
    if SKIPS:
        skip_first, skip_last = _unseen_edges(WG, n0, seqlen, kv_group, m_lo, m_hi, left, right, BLOCK_M)
        start = skip_first.to(gl.int32)
        stop -= skip_last.to(gl.int32)
    if SKIPS and skip_first:
        _dq_only_step(WG, 0, m_lo, k_full, ds_bufs, dq_smem, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty,
                      dq_desc, bd, row_base, h, dq_layout, BLOCK_M, HEAD_DIM, STAGES, DS_BUFS)
    for it in range(start, stop):
        m, hq, _ = _group_step(it, n_m, m_lo, h, bh, kv_group)
        rank = 0
        if CHAINS > 0:
            t = it
            if not CAUSAL:
                t, m = _rotated(it, rot, t_skip, n_v)
            rank = _rank(m, t, n0, seqlen, BLOCK_M, CAUSAL)
        if ALIBI != 0:
            if it % n_m == 0:  # a new query head of the group: its slope
                slope = gl.load(alibi_ptr + b * stride_ab + hq * stride_ah) * LOG2E
        dk, dv = _consumer_step(WG, it, m, inner_lo, inner_hi, k_w, v_w, k_full, q_bufs, do_bufs, ds_bufs,
                                dq_smem, p_smem, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, dq_desc,
                                lse_bufs, delta_bufs, bias_bufs, bias_ready, bias_empty, bd, row_base, hq, keys,
                                seqlen, qk_scale, inv_scale, left, right, slope, dk, dv, rank, grants, dones,
                                mask_bufs, mask_ready, drop_scale, sT_layout, dq_layout, kv_op_layout, BLOCK_M,
                                HEAD_DIM, STAGES, DS_BUFS, CAUSAL, WINDOW, ALIBI, GROUP, BIAS, CHAINS, DKV_RS,
                                DROPOUT)
    if SKIPS and skip_last:
        _dq_only_step(WG, stop, m_hi - 1, k_full, ds_bufs, dq_smem, q_ready, q_empty, do_ready, do_empty, ds_ready,
                      ds_empty, dq_desc, bd, row_base, h, dq_layout, BLOCK_M, HEAD_DIM, STAGES, DS_BUFS)
    if CHAINS > 0:
        if n_m > 0:
            _adds_completed(dones, kv_group * n_m)

    # Epilogue through this warpgroup's V half: only its own dP^T wgmma read it, all retired. In
    # group mode the rows after a ragged key tile are the next sequence's; this tile's rows there
    # are exactly zero (P^T is masked for those keys), so it adds into the zeroed dK/dV instead of
    # storing, and whichever of the two CTAs comes second leaves the other's rows as they were.
    out_smem = v_smem.index(WG)
    out2 = out_smem.reshape([WG_KEYS, HEAD_DIM])
    key_row = row_base + n0 + WG * WG_KEYS
    out2.store(dv.to(dtype))
    fence_async_shared()
    if GROUP:
        _tma_reduce_add(dv_desc, [bd, key_row, h, 0], out_smem)
    else:
        tma.async_copy_shared_to_global(dv_desc, [bd, key_row, h, 0], out_smem)
    tma.store_wait(0)  # also drains the last dQ reduction
    out2.store((dk * sm_scale).to(dtype))
    fence_async_shared()
    if GROUP:
        _tma_reduce_add(dk_desc, [bd, key_row, h, 0], out_smem)
    else:
        tma.async_copy_shared_to_global(dk_desc, [bd, key_row, h, 0], out_smem)
    tma.store_wait(0)


# GROUP: group (varlen) mode, the tensors ``[1, T, H, D]`` views and ``seqlen`` the longest sequence.
# Like the forward: WINDOW, a sliding window of ``left`` keys back and ``right`` ahead (unbounded
# sides come as 2 * seqlen); ALIBI: 0 none, 1 -slope * |i - j|, 2 slope * j (causal), slopes [B?, H].
# kv_group stays specialized: 1 (no GQA) compiles the plain loop, every other ratio one more kernel.
# CHAINS > 0: the deterministic mode (batch mode, no GQA, no window), dQ accumulated in CHAINS
# copies per head, ``[B, S, H * CHAINS, D]``, with one int32 semaphore per (batch * head, query
# tile, copy) at ``sem_ptr``, zeroed.
# BIAS: an elementwise bias (batch mode, no window or ALiBi) through ``bias_desc`` over ``[B or 1,
# H or 1, S, S]``, boxes ``[1, 1, BLOCK_M, 64]``, coordinates as the forward's; else ``bias_desc``
# stands in as k_desc. ``inv_scale`` is 1 / sm_scale. DBIAS: its gradient dS, in q's dtype through
# ``dbias_desc`` over a ``[B, H, S_k, S_q]`` buffer (transposed: the dS^T tiles as they are in
# shared memory), boxes ``[1, 1, 128, BLOCK_M]``; else ``dbias_desc`` stands in as k_desc.
# DKV_RS: P^T and dS^T as register operands of the dV and dK wgmma (64-row query tiles only).
# DROPOUT (batch mode, 64-row query tiles, no bias, atomic mode): CK's bytes of the int64 (seed,
# offset) pair at ``philox_ptr``, kept where ``<= threshold``, kept values scaled by ``drop_scale``;
# the producer is then a warpgroup (the default partition) that also makes each step's masks.
@gluon.jit(do_not_specialize=["seqlen", "H", "left", "right", "stride_ab", "stride_ah", "bias_step_b", "bias_step_h",
                              "threshold"])
def attention_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc,
                                bias_desc, dbias_desc, alibi_ptr, seqstart_ptr, sem_ptr, philox_ptr, seqlen, H,
                                kv_group, qk_scale, sm_scale, inv_scale, left, right, stride_ab, stride_ah,
                                bias_step_b, bias_step_h, threshold, drop_scale, BLOCK_M: gl.constexpr,
                                HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DS_BUFS: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                                ALIBI: gl.constexpr, GROUP: gl.constexpr, BIAS: gl.constexpr, DBIAS: gl.constexpr,
                                CHAINS: gl.constexpr, DKV_RS: gl.constexpr, DROPOUT: gl.constexpr):
    gl.static_assert(BLOCK_M == 64 or BLOCK_M == 128)
    gl.static_assert(not DROPOUT or (DKV_RS and not BIAS and CHAINS == 0))
    # The producer holds a step's turn until it has the next one (see _producer): with fewer than
    # three steps between a query tile's adds into one copy, the CTAs' waits close a cycle and trap.
    gl.static_assert(CHAINS == 0 or CHAINS * (BLOCK_N // BLOCK_M) >= 3)
    dtype: gl.constexpr = q_desc.dtype
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_KEYS, BLOCK_M], dtype)

    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [DS_BUFS, BLOCK_N, BLOCK_M], ds_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    _init_rings(q_ready, q_empty, do_ready, do_empty, STAGES)
    for i in gl.static_range(DS_BUFS):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_empty.index(i), count=3 if DBIAS else 2)  # DBIAS: the producer's store read it too
    grants, dones = _turn_barriers(ds_ready, CHAINS)
    if DKV_RS:  # never read
        p_bufs = ds_bufs
    else:  # one P^T tile per warpgroup
        p_bufs = gl.allocate_shared_memory(dtype, [2, WG_KEYS, BLOCK_M], p_layout)
    if BIAS:  # one slot of both warpgroups' [BLOCK_M, 64] tiles: ready by TMA, empty by both consumers
        bias_bufs = gl.allocate_shared_memory(dtype, [2] + bias_desc.block_type.shape, bias_desc.layout)
        bias_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        bias_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bias_ready.index(0), count=1)
        mbarrier.init(bias_empty.index(0), count=2)
    else:  # never read
        bias_bufs = p_bufs
        bias_ready = ds_ready
        bias_empty = ds_ready
    if DROPOUT:  # slot s: the masks of Q's slot s, [keys, queries]
        mask_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.int16)
        mask_bufs = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, BLOCK_M], mask_layout)
        mask_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(mask_ready.index(i), count=1)
    else:  # never read
        mask_bufs = ds_bufs
        mask_ready = ds_ready

    if DROPOUT:  # the producer warpgroup first: the default partition (see DROPOUT above)
        gl.warp_specialize([
            (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, bias_desc, dbias_desc, k_smem, v_smem,
                         q_bufs, do_bufs, lse_bufs, delta_bufs, bias_bufs, ds_bufs, kv_bar, q_ready, q_empty,
                         do_ready, do_empty, bias_ready, bias_empty, ds_ready, ds_empty, seqstart_ptr, seqlen, H,
                         kv_group, left, right, bias_step_b, bias_step_h, sem_ptr, grants, dones, philox_ptr,
                         threshold, mask_bufs, mask_ready, BLOCK_M, STAGES, DS_BUFS, CAUSAL, WINDOW, GROUP, BIAS,
                         DBIAS, CHAINS, DROPOUT)),
            (_consumer, (0, dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs,
                          delta_bufs, ds_bufs, dq_bufs, p_bufs, bias_bufs, kv_bar, q_ready, q_empty, do_ready,
                          do_empty, ds_ready, ds_empty, bias_ready, bias_empty, seqstart_ptr, seqlen, H, kv_group,
                          qk_scale, sm_scale, inv_scale, left, right, alibi_ptr, stride_ab, stride_ah, grants, dones,
                          mask_bufs, mask_ready, drop_scale, BLOCK_M, HEAD_DIM, STAGES, DS_BUFS, CAUSAL, WINDOW,
                          ALIBI, GROUP, BIAS, CHAINS, DKV_RS, DROPOUT)),
            (_consumer, (1, dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs,
                          delta_bufs, ds_bufs, dq_bufs, p_bufs, bias_bufs, kv_bar, q_ready, q_empty, do_ready,
                          do_empty, ds_ready, ds_empty, bias_ready, bias_empty, seqstart_ptr, seqlen, H, kv_group,
                          qk_scale, sm_scale, inv_scale, left, right, alibi_ptr, stride_ab, stride_ah, grants, dones,
                          mask_bufs, mask_ready, drop_scale, BLOCK_M, HEAD_DIM, STAGES, DS_BUFS, CAUSAL, WINDOW,
                          ALIBI, GROUP, BIAS, CHAINS, DKV_RS, DROPOUT)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:  # one partition per consumer warpgroup (first argument: its index), each with its own barrier
        gl.warp_specialize([
            (_consumer, (0, dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs,
                          delta_bufs, ds_bufs, dq_bufs, p_bufs, bias_bufs, kv_bar, q_ready, q_empty, do_ready,
                          do_empty, ds_ready, ds_empty, bias_ready, bias_empty, seqstart_ptr, seqlen, H, kv_group,
                          qk_scale, sm_scale, inv_scale, left, right, alibi_ptr, stride_ab, stride_ah, grants, dones,
                          mask_bufs, mask_ready, drop_scale, BLOCK_M, HEAD_DIM, STAGES, DS_BUFS, CAUSAL, WINDOW,
                          ALIBI, GROUP, BIAS, CHAINS, DKV_RS, DROPOUT)),
            (_consumer, (1, dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs,
                          delta_bufs, ds_bufs, dq_bufs, p_bufs, bias_bufs, kv_bar, q_ready, q_empty, do_ready,
                          do_empty, ds_ready, ds_empty, bias_ready, bias_empty, seqstart_ptr, seqlen, H, kv_group,
                          qk_scale, sm_scale, inv_scale, left, right, alibi_ptr, stride_ab, stride_ah, grants, dones,
                          mask_bufs, mask_ready, drop_scale, BLOCK_M, HEAD_DIM, STAGES, DS_BUFS, CAUSAL, WINDOW,
                          ALIBI, GROUP, BIAS, CHAINS, DKV_RS, DROPOUT)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, bias_desc, dbias_desc, k_smem, v_smem,
                         q_bufs, do_bufs, lse_bufs, delta_bufs, bias_bufs, ds_bufs, kv_bar, q_ready, q_empty, do_ready,
                         do_empty, bias_ready, bias_empty, ds_ready, ds_empty, seqstart_ptr, seqlen, H, kv_group, left,
                         right, bias_step_b, bias_step_h, sem_ptr, grants, dones, philox_ptr, threshold, mask_bufs,
                         mask_ready, BLOCK_M, STAGES, DS_BUFS, CAUSAL, WINDOW, GROUP, BIAS, DBIAS, CHAINS, DROPOUT)),
        ], [4, 1], [CONSUMER_REGS, 24])


# Head dim 256. Two [64, 256] fp32 accumulators per warpgroup would need 256 registers a thread,
# so the warpgroups split the head dim instead of the keys (FlashAttention-3's hdim-256 layout):
# one CTA per 64 keys; each warpgroup computes S = Q K^T and dP = dO V^T for 32 of them (queries on
# M, N = 32), both halves of P^T and dS^T meet in shared memory, and each warpgroup then owns 128
# head-dim columns of dV += P^T dO, dK += dS^T Q and dQ = dS K (dQ in DQ_COLS-wide pieces).
# Its deterministic mode (CHAINS > 0) has two orders of a query tile's dQ adds:
# * aligned: by key tile, first to last (the launch order), every CTA walking its query tiles last
#   to first, so a head's CTAs visit them in the same order and a CTA waits only for ones launched
#   before it, which run or are done: any length runs. Those launched together trail each other
#   by about a step a copy apart (a pipeline's fill, paid again where a head's CTAs start
#   together: 0.75-0.77 of the atomic backward at 1k and 4k causal, 0.84 at 1k without a mask);
# * DIAGONAL: from the query tile's diagonal key tile down (wrapping around to the last), each CTA
#   walking from its diagonal up (and around), a head's key tiles launched last first, so key
#   tile n + CHAINS made its add CHAINS steps before key tile n, and under a causal mask started
#   before it (0.91-0.95 at 1k and 4k causal; at 16k 0.61, where a head no longer fits the SMs
#   and the short-first launch leaves the long CTAs to the end). Without a mask the walk wraps, so
#   a CTA may wait for one launched after it: a head's key tiles must fit the SMs, as in ``_rank``.
# The producer passes a turn on before it waits for the next, and the consumers report a step's
# adds complete as the next step's dQ starts (waited for earlier in the step, under S and dP or the
# softmax, the reductions' completion cost 0.81 of the atomic backward).
WIDE_KEYS = gl.constexpr(64)  # keys per CTA
WIDE_WG_KEYS = gl.constexpr(32)  # keys of S and dP per warpgroup


@gluon.jit
def _wide_step(it, n_m, m_lo, h, bh, kv_group, walk, CHAINS: gl.constexpr, DIAGONAL: gl.constexpr):
    """``_group_step`` of the wide kernel; in the deterministic mode (no GQA) the aligned order's
    walk is last to first, the diagonal one's query tile ``walk`` (see ``_walk_on``)."""
    if CHAINS > 0:
        if DIAGONAL:
            return walk, h, bh
        return m_lo + n_m - 1 - it, h, bh
    return _group_step(it, n_m, m_lo, h, bh, kv_group)


@gluon.jit
def _walk_on(m, m_hi):
    """The diagonal order's query tile after m: up from the CTA's diagonal and, without a mask,
    around from query tile 0 (carried from step to step: computed from the step, 52 B spilled)."""
    return gl.where(m + 1 == m_hi, 0, m + 1)


@gluon.jit
def _wide_producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, q_empty,
                   do_ready, do_empty, sem_ptr, grants, dones, seqlen, H, kv_group, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, CHAINS: gl.constexpr, DIAGONAL: gl.constexpr):
    b, h, bh, n0 = _this_program(seqlen, H, WIDE_KEYS, DIAGONAL)
    m_lo, _, m_hi = _query_tiles(n0, seqlen, BLOCK_M, WIDE_KEYS, CAUSAL)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, n0, h, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, n0, h, 0], kv_bar, v_smem)
    n_m = m_hi - m_lo
    sem = -1  # deterministic mode: the semaphores of the last two steps
    last_sem = -1
    if CHAINS > 0:  # query tile m's semaphores: sems + m * CHAINS + copy
        sems = bh * m_hi * CHAINS
        if not DIAGONAL:  # one place in every query tile (computed once: in the loop 8 B spilled)
            sems += (n0 // WIDE_KEYS) % CHAINS
            turn = n0 // WIDE_KEYS // CHAINS
    walk = n0 // WIDE_KEYS  # the diagonal order's query tile
    for it in range(kv_group * n_m):
        m, hq, _ = _wide_step(it, n_m, m_lo, h, bh, kv_group, walk, CHAINS, DIAGONAL)
        walk = _walk_on(m, m_hi)
        s = it % STAGES
        ph = ((it // STAGES) & 1) ^ 1  # a fresh mbarrier passes a wait on parity 1 at once
        mbarrier.wait(q_empty.index(s), ph)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, m * BLOCK_M, hq, 0], q_ready.index(s), q_bufs.index(s))
        mbarrier.wait(do_empty.index(s), ph)
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, m * BLOCK_M, hq, 0], do_ready.index(s), do_bufs.index(s))
        if CHAINS > 0:  # the turn of the step before last passed on, then this step's
            if it > 0:
                _pass_turn(it - 1, last_sem, dones, sem_ptr)
            last_sem = sem
            sem = sems + m * CHAINS
            if DIAGONAL:
                sem += it % CHAINS
                turn = it // CHAINS
            _grant(it, sem, turn, grants, sem_ptr)
    if CHAINS > 0:
        if n_m > 0:  # the last two steps' turns
            _pass_turn(n_m - 1, last_sem, dones, sem_ptr)
            _pass_turn(n_m, sem, dones, sem_ptr)


@gluon.jit
def _wide_consumer(WG: gl.constexpr, dk_ptr, dv_ptr, dq_desc, neg_lse_ptr, neg_delta_ptr, k_smem, v_smem, q_bufs,
                   do_bufs, pT_smem, dsT_smem, dq_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty, pds_ready,
                   pds_empty, grants, dones, seqlen, seqlen_pad, H, kv_group, qk_scale, sm_scale,
                   BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DQ_COLS: gl.constexpr,
                   CAUSAL: gl.constexpr, CHAINS: gl.constexpr, DIAGONAL: gl.constexpr):
    dtype: gl.constexpr = q_bufs.dtype
    COLS: gl.constexpr = HEAD_DIM // 2  # this warpgroup's head-dim columns of dK, dV, dQ
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, WIDE_WG_KEYS, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, COLS, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    b, h, bh, n0 = _this_program(seqlen, H, WIDE_KEYS, DIAGONAL)
    m_lo, m_mask_end, m_hi = _query_tiles(n0, seqlen, BLOCK_M, WIDE_KEYS, CAUSAL)
    keys = n0 + WG * WIDE_WG_KEYS + gl.arange(0, WIDE_WG_KEYS, layout=gl.SliceLayout(0, s_layout))

    mbarrier.wait(kv_bar, 0)
    k_full = k_smem.reshape([WIDE_KEYS, HEAD_DIM])
    k_t = k_full.slice(WG * WIDE_WG_KEYS, WIDE_WG_KEYS, dim=0).permute((1, 0))
    v_t = v_smem.reshape([WIDE_KEYS, HEAD_DIM]).slice(WG * WIDE_WG_KEYS, WIDE_WG_KEYS, dim=0).permute((1, 0))
    dq_smem = dq_bufs.index(WG)

    dk = gl.zeros([WIDE_KEYS, COLS], gl.float32, kv_layout)
    dv = gl.zeros([WIDE_KEYS, COLS], gl.float32, kv_layout)
    n_m = m_hi - m_lo
    rank = n0 // WIDE_KEYS  # deterministic mode: the place of its adds among a query tile's
    acc_h = h
    if CHAINS > 0:  # ... and its copy of dQ's accumulator
        acc_h = h * CHAINS + rank % CHAINS
    walk = n0 // WIDE_KEYS  # the diagonal order's query tile
    for it in range(kv_group * n_m):
        m, hq, bhq = _wide_step(it, n_m, m_lo, h, bh, kv_group, walk, CHAINS, DIAGONAL)
        walk = _walk_on(m, m_hi)
        s = it % STAGES
        ph = (it // STAGES) & 1
        m0 = m * BLOCK_M
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        if DIAGONAL:  # the step (query tiles as tall as key tiles are wide, walked from the diagonal)
            rank = it
            acc_h = h * CHAINS + rank % CHAINS
        # Row statistics straight from global memory (padded rows: -lse = -inf, -delta = 0); the
        # loads run under the S wgmma.
        stat_rows = bhq.to(gl.int64) * seqlen_pad + rows
        neg_lse = gl.load(neg_lse_ptr + stat_rows)
        neg_delta = gl.load(neg_delta_ptr + stat_rows)

        mbarrier.wait(q_ready.index(s), ph)
        q_s = q_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
        qk = warpgroup_mma(q_s, k_t, gl.zeros([BLOCK_M, WIDE_WG_KEYS], gl.float32, s_layout), use_acc=False,
                           is_async=True)
        mbarrier.wait(do_ready.index(s), ph)
        do_s = do_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
        dp = warpgroup_mma(do_s, v_t, gl.zeros([BLOCK_M, WIDE_WG_KEYS], gl.float32, s_layout), use_acc=False,
                           is_async=True)
        qk = warpgroup_mma_wait(1, deps=[qk])  # S done; dP may still run under the exp2
        p = gl.exp2((qk + neg_lse[:, None]) * qk_scale)
        if m < m_mask_end:  # uniform branch: diagonal tiles, or every tile of a ragged key tile
            keep = keys[None, :] < seqlen
            if CAUSAL:
                keep = keep & (keys[None, :] <= rows[:, None])
            p = gl.where(keep, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp])
        ds = p * (dp + neg_delta[:, None])

        # This warpgroup's 32 keys of P^T and dS^T into the shared [64 keys, 64 queries] tiles,
        # once both dQ/dK/dV wgmma of the previous step (both warpgroups) have read them.
        mbarrier.wait(pds_empty.index(0), (it & 1) ^ 1)
        pT_smem.slice(WG * WIDE_WG_KEYS, WIDE_WG_KEYS, dim=0).store(gl.permute(p.to(dtype), (1, 0)))
        dsT_smem.slice(WG * WIDE_WG_KEYS, WIDE_WG_KEYS, dim=0).store(gl.permute(ds.to(dtype), (1, 0)))
        fence_async_shared()
        mbarrier.arrive(pds_ready.index(0))
        mbarrier.wait(pds_ready.index(0), it & 1)

        dv = warpgroup_mma(pT_smem, do_s.slice(WG * COLS, COLS, dim=1), dv, is_async=True)
        dk = warpgroup_mma(dsT_smem, q_s.slice(WG * COLS, COLS, dim=1), dk, is_async=True)
        ds_full = dsT_smem.permute((1, 0))
        for piece in gl.static_range(COLS // DQ_COLS):
            dq = warpgroup_mma(ds_full, k_full.slice(WG * COLS + piece * DQ_COLS, DQ_COLS, dim=1),
                               gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout), use_acc=False, is_async=True)
            if piece == 0:
                dv, dk = warpgroup_mma_wait(1, deps=[dv, dk])  # dO and Q no longer read: free the slot
                mbarrier.arrive(do_empty.index(s))
                mbarrier.arrive(q_empty.index(s))
            dq = warpgroup_mma_wait(0, deps=[dq])
            if piece == COLS // DQ_COLS - 1:
                mbarrier.arrive(pds_empty.index(0))
            tma.store_wait(0)  # the previous reduction has read dq_smem
            dq_smem.reshape([BLOCK_M, DQ_COLS]).store(dq)
            fence_async_shared()
            col = WG * COLS + piece * DQ_COLS
            if CHAINS > 0:  # in its turn, into copy rank % CHAINS; a copy's first add is a store
                if piece == 0:  # the last step's adds complete (see above), then this step's turn
                    _adds_completed(dones, it)
                    mbarrier.wait(grants.index(WG * TURN_SLOTS + it % TURN_SLOTS), (it // TURN_SLOTS) & 1)
                if rank < CHAINS:
                    tma.async_copy_shared_to_global(dq_desc, [b, m0, acc_h, col], dq_smem)
                else:
                    _tma_reduce_add(dq_desc, [b, m0, acc_h, col], dq_smem)
            else:
                _tma_reduce_add(dq_desc, [b, m0, hq, col], dq_smem)
    if CHAINS > 0:
        _adds_completed(dones, kv_group * n_m)
    tma.store_wait(0)

    # Epilogue: dV and dK * scale from registers, rows past the sequence left out (once per CTA).
    out_rows = n0 + gl.arange(0, WIDE_KEYS, layout=gl.SliceLayout(1, kv_layout))
    out_cols = WG * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, kv_layout))
    offs = ((b.to(gl.int64) * seqlen + out_rows)[:, None] * H + h) * HEAD_DIM + out_cols[None, :]
    inside = (out_rows < seqlen)[:, None]
    gl.store(dv_ptr + offs, dv.to(dtype), mask=inside)
    gl.store(dk_ptr + offs, (dk * sm_scale).to(dtype), mask=inside)


# CHAINS > 0: the deterministic mode (no GQA), as the narrow kernel's (dQ copies, semaphores), in
# the DIAGONAL order or the aligned one.
@gluon.jit(do_not_specialize=["seqlen", "seqlen_pad", "H", "kv_group"])
def attention_bwd_hopper_wide_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_ptr, dv_ptr, neg_lse_ptr,
                                     neg_delta_ptr, sem_ptr, seqlen, seqlen_pad, H, kv_group, qk_scale, sm_scale,
                                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DQ_COLS: gl.constexpr,
                                     CONSUMER_REGS: gl.constexpr, CAUSAL: gl.constexpr, CHAINS: gl.constexpr,
                                     DIAGONAL: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]  # queries per step: the config's block_m
    gl.static_assert(BLOCK_M == 64)  # one m64 wgmma of S and dP per warpgroup
    # DIAGONAL: a turn C steps back in the walk; with one copy the wrapped walk's waits close a cycle
    gl.static_assert(not DIAGONAL or (CHAINS >= 2 and BLOCK_M == WIDE_KEYS))
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WIDE_KEYS, BLOCK_M], dtype)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    pT_smem = gl.allocate_shared_memory(dtype, [WIDE_KEYS, BLOCK_M], t_layout)
    dsT_smem = gl.allocate_shared_memory(dtype, [WIDE_KEYS, BLOCK_M], t_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pds_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    pds_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    _init_rings(q_ready, q_empty, do_ready, do_empty, STAGES)
    mbarrier.init(pds_ready.index(0), count=2)
    mbarrier.init(pds_empty.index(0), count=2)
    grants, dones = _turn_barriers(pds_ready, CHAINS)

    gl.warp_specialize([
        (_wide_consumer, (0, dk_ptr, dv_ptr, dq_desc, neg_lse_ptr, neg_delta_ptr, k_smem, v_smem, q_bufs, do_bufs,
                          pT_smem, dsT_smem, dq_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty, pds_ready,
                          pds_empty, grants, dones, seqlen, seqlen_pad, H, kv_group, qk_scale, sm_scale, BLOCK_M,
                          HEAD_DIM, STAGES, DQ_COLS, CAUSAL, CHAINS, DIAGONAL)),
        (_wide_consumer, (1, dk_ptr, dv_ptr, dq_desc, neg_lse_ptr, neg_delta_ptr, k_smem, v_smem, q_bufs, do_bufs,
                          pT_smem, dsT_smem, dq_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty, pds_ready,
                          pds_empty, grants, dones, seqlen, seqlen_pad, H, kv_group, qk_scale, sm_scale, BLOCK_M,
                          HEAD_DIM, STAGES, DQ_COLS, CAUSAL, CHAINS, DIAGONAL)),
        (_wide_producer, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, q_empty,
                          do_ready, do_empty, sem_ptr, grants, dones, seqlen, H, kv_group, BLOCK_M, STAGES, CAUSAL,
                          CHAINS, DIAGONAL)),
    ], [4, 1], [CONSUMER_REGS, 24])
