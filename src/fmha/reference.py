"""Plain PyTorch attention, written from the formulas of SPEC.md: the oracle of the tests.

Everything is materialized (``[Hq, sq, sk]`` scores per batch) and computed in ``compute_dtype``
(float64 by default), one batch at a time. It runs on any device and is differentiable in q, k, v
and bias through ``torch.autograd``, which gives the reference gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .masks import Mask, MaskLike, MaskType, parse_mask

__all__ = [
    "AttentionResult",
    "attention",
    "dropout_randval",
    "philox4x32_7",
    "visible",
    "alibi_bias",
]

_M32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85


class AttentionResult(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor | None
    randval: torch.Tensor | None


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a 32-bit constant ``a`` and int64 ``b < 2^32``.

    Split ``a`` into 16-bit halves so that no partial product leaves int64.
    """
    p_low = (a & 0xFFFF) * b
    p_high = (a >> 16) * b
    mid = ((p_high & 0xFFFF) << 16) + p_low
    return (p_high >> 16) + (mid >> 32), mid & _M32


def philox4x32_7(
    key: tuple[int, int], counter: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32 with 7 rounds on int64 tensors holding uint32 words (Salmon et al., 2011).

    ``key = (k0, k1)``; ``counter = (c0, c1, c2, c3)``, broadcastable int64 tensors.
    """
    k0, k1 = key[0] & _M32, key[1] & _M32
    c0, c1, c2, c3 = (torch.as_tensor(c) & _M32 for c in counter)
    for round_index in range(7):
        hi0, lo0 = _mul_hi_lo(_ROUND_A, c0)
        hi1, lo1 = _mul_hi_lo(_ROUND_B, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if round_index < 6:
            k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def dropout_randval(
    seed: int,
    offset: int,
    batch_index: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """CK's dropout bytes ``[nheads, seqlen_q, seqlen_k]`` (uint8) of one batch (SPEC §5)."""
    i = torch.arange(seqlen_q, device=device, dtype=torch.int64)[:, None]
    j = torch.arange(seqlen_k, device=device, dtype=torch.int64)[None, :]
    row_tile, ii = i // 32, i % 32
    col_tile, jj = j // 32, j % 32
    lane = 32 * ((ii // 8) % 2) + jj
    r = 8 * (ii // 16) + ii % 8
    out = torch.empty(nheads, seqlen_q, seqlen_k, dtype=torch.uint8, device=device)
    for h in range(nheads):
        base = (offset + (batch_index * nheads + h) * 64) % 2**64
        lo = (base & _M32) + lane
        hi = ((base >> 32) + (lo >> 32)) & _M32
        words = philox4x32_7((seed, seed >> 32), (lo & _M32, hi, row_tile, col_tile))
        word = torch.stack(torch.broadcast_tensors(*words))
        picked = torch.gather(word, 0, (r // 4).expand(seqlen_q, seqlen_k)[None])[0]
        out[h] = ((picked >> (8 * (r % 4))) & 0xFF).to(torch.uint8)
    return out


def visible(mask: Mask, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean ``[seqlen_q, seqlen_k]``: which keys each query row sees (SPEC §3)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if mask.type == MaskType.NONE:
        return seen
    diagonal = i + mask.diagonal_offset(seqlen_q, seqlen_k)
    if mask.left >= 0:
        seen &= j >= diagonal - mask.left
    if mask.right >= 0:
        seen &= j <= diagonal + mask.right
    return seen


def alibi_bias(
    slopes: torch.Tensor, mask: Mask, seqlen_q: int, seqlen_k: int
) -> torch.Tensor:
    """ALiBi values ``[H, seqlen_q, seqlen_k]`` for per-head ``slopes [H]`` (SPEC §4 table)."""
    i = torch.arange(seqlen_q, device=slopes.device, dtype=slopes.dtype)[:, None]
    j = torch.arange(seqlen_k, device=slopes.device, dtype=slopes.dtype)[None, :]
    slopes = slopes[:, None, None]
    if mask.is_causal:
        return (slopes * j).expand(-1, seqlen_q, -1)
    if mask.type == MaskType.TOP_LEFT:
        return -slopes * (i - j).abs()
    return -slopes * (i + (seqlen_k - seqlen_q) - j).abs()


def _as_int(value) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0].item()) % 2**64
    return int(value) % 2**64


def _lengths(starts: torch.Tensor) -> list[int]:
    s = [int(x) for x in starts.tolist()]
    return [b - a for a, b in zip(s[:-1], s[1:])]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: MaskLike = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed=0,
    offset=0,
    cu_seqlen_q: torch.Tensor | None = None,
    cu_seqlen_k: torch.Tensor | None = None,
    seqstart_q: torch.Tensor | None = None,
    seqstart_k: torch.Tensor | None = None,
    seqlen_k: torch.Tensor | None = None,
    seqstart_padded_q: torch.Tensor | None = None,
    seqstart_padded_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> AttentionResult:
    """Forward attention of SPEC.md §1-5 in batch mode (4-D q) or group mode (``seqstart_q``).

    Returns ``(out, lse, randval)`` laid out like fmha's: ``out`` in ``compute_dtype`` with
    padding rows zero, ``lse`` (``-inf`` on padding and empty rows), and the dropout bytes
    (``None`` without dropout; positions outside ``[sq, sk]`` are 0). Matrix products run in
    ``compute_dtype``; softmax in at least float32.
    """
    mask = parse_mask(mask)
    group = seqstart_q is not None
    dq = q.shape[-1]
    scale = dq**-0.5 if scale is None else scale
    nhead_q, nhead_k = q.shape[-2], k.shape[-2]
    ratio = nhead_q // nhead_k
    softmax_dtype = torch.promote_types(compute_dtype, torch.float32)
    seed, offset = _as_int(seed), _as_int(offset)
    device = q.device

    if group:
        lens_q = _lengths(seqstart_q)
        lens_k = _lengths(seqstart_k) if seqlen_k is None else [int(x) for x in seqlen_k.tolist()]
        rows_q = [int(x) for x in (seqstart_padded_q if seqstart_padded_q is not None else seqstart_q).tolist()]
        rows_k = [int(x) for x in (seqstart_padded_k if seqstart_padded_k is not None else seqstart_k).tolist()]
        batch = len(lens_q)
        max_seqlen_k = max(lens_k, default=0) if max_seqlen_k is None else max_seqlen_k
        out = torch.zeros(q.shape[0], nhead_q, v.shape[-1], dtype=compute_dtype, device=device)
        lse = torch.full((nhead_q, int(seqstart_q[-1])), float("-inf"), dtype=softmax_dtype, device=device)
        randval_shape = (nhead_q, q.shape[0], max_seqlen_k)
        if bias is not None:
            bias = bias.expand(nhead_q, q.shape[0], max_seqlen_k)
    else:
        batch, full_q, _, _ = q.shape
        full_k = k.shape[1]
        lens_q = _lengths(cu_seqlen_q) if cu_seqlen_q is not None else [full_q] * batch
        lens_k = _lengths(cu_seqlen_k) if cu_seqlen_k is not None else [full_k] * batch
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=compute_dtype, device=device)
        lse = torch.full((batch, nhead_q, full_q), float("-inf"), dtype=softmax_dtype, device=device)
        randval_shape = (batch, nhead_q, full_q, full_k)
        if bias is not None:
            bias = bias.expand(batch, nhead_q, full_q, full_k)
    randval = None
    if dropout_p > 0:
        randval = torch.zeros(randval_shape, dtype=torch.uint8, device=device)

    for b in range(batch):
        sq, sk = lens_q[b], lens_k[b]
        if group:
            q_rows = slice(rows_q[b], rows_q[b] + sq)
            qb, kb, vb = q[q_rows], k[rows_k[b] : rows_k[b] + sk], v[rows_k[b] : rows_k[b] + sk]
        else:
            qb, kb, vb = q[b, :sq], k[b, :sk], v[b, :sk]
        qb = qb.transpose(0, 1).to(compute_dtype)
        kb = kb.transpose(0, 1).repeat_interleave(ratio, dim=0).to(compute_dtype)
        vb = vb.transpose(0, 1).repeat_interleave(ratio, dim=0).to(compute_dtype)
        s = (scale * (qb @ kb.transpose(1, 2))).to(softmax_dtype)
        if bias is not None:
            bias_b = bias[:, q_rows, :sk] if group else bias[b, :, :sq, :sk]
            s = s + bias_b.to(softmax_dtype)
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
            s = s + alibi_bias(slopes.to(softmax_dtype), mask, sq, sk)
        s = s.masked_fill(~visible(mask, sq, sk, device), float("-inf"))
        m = s.amax(dim=-1, keepdim=True) if sk > 0 else s.new_full((nhead_q, sq, 1), float("-inf"))
        m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe)
        row_sum = p.sum(dim=-1, keepdim=True)
        lse_b = (m + torch.log(row_sum)).squeeze(-1)
        if randval is not None:
            bytes_b = dropout_randval(seed, offset, b, nhead_q, sq, sk, device=device)
            keep = bytes_b <= int(255 * (1.0 - dropout_p))
            p = torch.where(keep, p / (1.0 - dropout_p), torch.zeros_like(p))
            if group:
                randval[:, q_rows, :sk] = bytes_b
            else:
                randval[b, :, :sq, :sk] = bytes_b
        # 1 / row_sum only where the row sees something: autograd differentiates both branches of a
        # where, and 1 / 0 there would turn the hidden rows' zero gradient into NaN.
        empty_row = row_sum == 0
        inv_sum = torch.where(empty_row, torch.zeros_like(row_sum),
                              1.0 / torch.where(empty_row, torch.ones_like(row_sum), row_sum))
        o = (p * inv_sum).to(compute_dtype) @ vb
        if group:
            out[q_rows] = o.transpose(0, 1)
            start = int(seqstart_q[b])
            lse[:, start : start + sq] = lse_b
        else:
            out[b, :sq] = o.transpose(0, 1)
            lse[b, :, :sq] = lse_b
    return AttentionResult(out, lse, randval)
