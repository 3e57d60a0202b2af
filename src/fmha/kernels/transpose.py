"""Swap the last two dims of a contiguous tensor in square tiles: the Hopper backward writes the
bias's gradient as dS^T, tile by tile as it lies in shared memory."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rows", "cols", "tiles_r", "tiles_c"])
def transpose_last_two_kernel(Src, Dst, rows, cols, tiles_r, tiles_c, BLOCK: tl.constexpr):
    """``Dst[n, c, r] = Src[n, r, c]``, both contiguous (``[N, rows, cols]`` and ``[N, cols, rows]``);
    one BLOCK x BLOCK tile per program, a 1-D grid (grid y and z stop at 65535)."""
    pid = tl.program_id(0)
    n = pid // (tiles_r * tiles_c)
    r = (pid // tiles_c) % tiles_r * BLOCK + tl.arange(0, BLOCK)
    c = pid % tiles_c * BLOCK + tl.arange(0, BLOCK)
    base = n.to(tl.int64) * rows * cols
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(Src + base + r[:, None].to(tl.int64) * cols + c[None, :], mask=inside)
    tl.store(Dst + base + c[None, :].to(tl.int64) * rows + r[:, None], tile, mask=inside)
