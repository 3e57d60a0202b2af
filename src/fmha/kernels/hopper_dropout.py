"""CK's dropout bytes (SPEC §5) for the Gluon kernels, as 16-bit masks for P's wgmma operand.

A Philox call yields the 16 bytes of one column in 16 rows of a 32-row tile: rows ``16c + 8a + e``
(c in 0..1, e in 0..7) for its ``a``. A wgmma accumulator spreads those 16 rows over two warps and
eight lanes, so each call runs once, in a blocked layout that holds a call's bytes in one thread
(``[row tile, c, a, e, column]``), and the masks reach the accumulator's layout through shared
memory. A word's four bytes are compared at once (SWAR) and prmt spreads each result bit over a
16-bit half: 280 fewer instructions (SASS) per 128 elements than byte-by-byte compares and selects.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

PHILOX_ROUNDS = gl.constexpr(7)
PHILOX_ROUND_A = gl.constexpr(0xD2511F53)
PHILOX_ROUND_B = gl.constexpr(0xCD9E8D57)
PHILOX_KEY_A = gl.constexpr(0x9E3779B9)
PHILOX_KEY_B = gl.constexpr(0xBB67AE85)


@gluon.jit
def philox_key_and_base(philox_ptr, bh_index):
    """(key low, key high, counter base low, counter base high) as uint32: the key is the seed,
    the base ``offset + bh_index * 64``, from the int64 (seed, offset) pair at ``philox_ptr``."""
    seed = gl.load(philox_ptr).to(gl.uint64, bitcast=True)
    base = gl.load(philox_ptr + 1).to(gl.uint64, bitcast=True) + bh_index.to(gl.uint64) * 64
    return ((seed & 0xFFFFFFFF).to(gl.uint32), (seed >> 32).to(gl.uint32),
            (base & 0xFFFFFFFF).to(gl.uint32), (base >> 32).to(gl.uint32))


@gluon.jit
def _philox(c0, c1, c2, c3, k0, k1):
    for _ in gl.static_range(PHILOX_ROUNDS):
        lo1, hi0 = _mul_wide(c2, PHILOX_ROUND_B)
        lo3, hi2 = _mul_wide(c0, PHILOX_ROUND_A)
        c0 = hi0 ^ c1 ^ k0
        c2 = hi2 ^ c3 ^ k1
        c1 = lo1
        c3 = lo3
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
    return c0, c1, c2, c3


@gluon.jit
def _ck_words(key_lo, key_hi, base_lo, base_hi, row_tile, a, col, col0, zero):
    """The four words of the Philox call of 32-row tile ``row_tile``, ``a`` and column ``col0 +
    col`` (``col0`` a multiple of 32), broadcast to ``zero``'s shape: counter ``base + 32a + col %
    32`` (64-bit), then the row and column tiles."""
    ctr_lo = base_lo + (32 * a + col % 32).to(gl.uint32)
    ctr_hi = base_hi + (ctr_lo < base_lo).to(gl.uint32)
    return _philox(ctr_lo + zero, ctr_hi + zero, row_tile.to(gl.uint32) + zero,
                   ((col0 + col) // 32).to(gl.uint32) + zero, key_lo, key_hi)


@gluon.jit
def _mul_wide(x, M: gl.constexpr):
    """(low, high) words of x * M: one 32x32->64 multiply (IMAD.WIDE) where umulhi and a
    multiply make two."""
    if M == 0xD2511F53:
        asm: gl.constexpr = "{ .reg .b64 w; mul.wide.u32 w, $2, 0xD2511F53; mov.b64 {$0, $1}, w; }"
    else:
        asm: gl.constexpr = "{ .reg .b64 w; mul.wide.u32 w, $2, 0xCD9E8D57; mov.b64 {$0, $1}, w; }"
    return gl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def _byte_le(word, threshold_bytes):
    """Per byte of ``word``: its top bit set where the byte is <= the threshold byte (SWAR; the
    other bits are noise). ``threshold_bytes`` holds the threshold in each byte."""
    d = (threshold_bytes | 0x80808080) - (word & 0x7F7F7F7F)  # per byte: t_lo + 128 - x_lo, no borrow out
    return (threshold_bytes & ~word) | (~(threshold_bytes ^ word) & d)


@gluon.jit
def _pair(lo, hi, BYTE: gl.constexpr):
    """Two 16-bit masks in one word: byte BYTE's top bit of ``lo`` spread over the low half, of
    ``hi`` over the high half (prmt's sign-replicating selectors)."""
    if BYTE == 0:
        out = gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0xCC88;", "=r,r,r", [lo, hi], gl.uint32, True, 1)
    elif BYTE == 1:
        out = gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0xDD99;", "=r,r,r", [lo, hi], gl.uint32, True, 1)
    elif BYTE == 2:
        out = gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0xEEAA;", "=r,r,r", [lo, hi], gl.uint32, True, 1)
    else:
        out = gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0xFFBB;", "=r,r,r", [lo, hi], gl.uint32, True, 1)
    return out


@gluon.jit
def dropout_mask_pairs(key_lo, key_hi, base_lo, base_hi, row0, col0, threshold, COLS: gl.constexpr):
    """CK's dropout masks of rows ``row0 + [0, 64)`` and columns ``col0 + [0, COLS)`` (local indices
    in the sequence, multiples of 32): 16 bits each, all ones where the byte is ``<= threshold``,
    two adjacent columns a word, ``[64, COLS // 2]`` uint32 over 4 warps."""
    gl.static_assert(COLS % 32 == 0)
    calls: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2, 1, 8, COLS // 64], threads_per_warp=[1, 1, 1, 1, 32],
                                           warps_per_cta=[2, 1, 2, 1, 1], order=[4, 3, 2, 1, 0])
    pairs: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, calls))  # [row tile, a, column pair]
    by_call: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, COLS // 64, 2], threads_per_warp=[1, 1, 32, 1],
                                             warps_per_cta=[2, 2, 1, 1], order=[3, 2, 1, 0])
    call3: gl.constexpr = gl.SliceLayout(3, by_call)
    tile = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, call3)))[:, None, None, None]
    a = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, call3)))[None, :, None, None]
    pair = gl.arange(0, COLS // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, call3)))[None, None, :, None]
    half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, by_call))))[None, None, None, :]
    col = 2 * pair + half  # [1, 1, COLS // 2, 2]
    zero = gl.zeros([2, 2, COLS // 2, 2], gl.uint32, by_call)
    w0, w1, w2, w3 = _ck_words(key_lo, key_hi, base_lo, base_hi, row0 // 32 + tile, a, col, col0, zero)
    t = threshold.to(gl.uint32) * 0x01010101
    c = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, calls)))))
    e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, calls)))))
    c = c[None, :, None, None, None]
    e = e[None, None, None, :, None]
    out = gl.zeros([2, 2, 2, 8, COLS // 2], gl.uint32, calls)
    out = _place_word(out, w0, t, 0, c, e, pairs)
    out = _place_word(out, w1, t, 1, c, e, pairs)
    out = _place_word(out, w2, t, 2, c, e, pairs)
    out = _place_word(out, w3, t, 3, c, e, pairs)
    return gl.reshape(out, [64, COLS // 2])


@gluon.jit
def _place_word(out, word, threshold_bytes, K: gl.constexpr, c, e, pairs: gl.constexpr):
    """``out`` ``[row tile, c, a, e, column pair]`` with the masks of each call's word K, which
    holds rows c = K // 2, e = 4 * (K % 2) + byte."""
    lo, hi = gl.split(_byte_le(word, threshold_bytes))  # even and odd columns
    lo = gl.convert_layout(lo, pairs)
    hi = gl.convert_layout(hi, pairs)
    for byte in gl.static_range(4):
        masks = gl.expand_dims(gl.expand_dims(_pair(lo, hi, byte), 1), 3)
        out = gl.where((c == K // 2) & (e == 4 * (K % 2) + byte), masks, out)
    return out


@gluon.jit
def dropout_mask_query_pairs(key_lo, key_hi, base_lo, base_hi, row0, col0, threshold, COLS: gl.constexpr):
    """The backward's masks, transposed: ``[COLS, 32]`` uint32 over 4 warps for rows ``row0 +
    [0, 64)`` and columns ``col0 + [0, COLS)`` (multiples of 32), word p of column j holding the
    16-bit masks of rows 2p (low half) and 2p + 1. A call's word holds four adjacent rows of one
    column, so prmt pairs its own bytes and each thread's words land in place: the pair index
    ``16 * row tile + 8c + 4a + 2 * (K % 2) + half`` comes from a reshape, no shuffle."""
    gl.static_assert(COLS % 32 == 0)
    calls: gl.constexpr = gl.BlockedLayout(size_per_thread=[COLS // 32, 1, 1], threads_per_warp=[32, 1, 1],
                                           warps_per_cta=[1, 2, 2], order=[0, 1, 2])  # [column, row tile, a]
    col = gl.arange(0, COLS, layout=gl.SliceLayout(1, gl.SliceLayout(2, calls)))[:, None, None]
    tile = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, calls)))[None, :, None]
    a = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, calls)))[None, None, :]
    zero = gl.zeros([COLS, 2, 2], gl.uint32, calls)
    w0, w1, w2, w3 = _ck_words(key_lo, key_hi, base_lo, base_hi, row0 // 32 + tile, a, col, col0, zero)
    t = threshold.to(gl.uint32) * 0x01010101
    # [column, row tile, a, half, K % 2, c] -> [column, row tile, c, a, K % 2, half]
    c0 = gl.join(_row_pairs(w0, t), _row_pairs(w1, t))
    c1 = gl.join(_row_pairs(w2, t), _row_pairs(w3, t))
    out = gl.permute(gl.join(c0, c1), (0, 1, 5, 2, 4, 3))
    return gl.reshape(out, [COLS, 32])


@gluon.jit
def _row_pairs(word, threshold_bytes):
    """A call's word as two words of 16-bit masks, its bytes 0-1 and 2-3 (four adjacent rows),
    joined on a new last dim."""
    le = _byte_le(word, threshold_bytes)
    lo = gl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0x9988;", "=r,r", [le], gl.uint32, True, 1)
    hi = gl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0xBBAA;", "=r,r", [le], gl.uint32, True, 1)
    return gl.join(lo, hi)
