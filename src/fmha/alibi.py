"""ALiBi slopes (Press et al.), as CK's ``get_alibi_slopes`` and FlashAttention compute them."""

from __future__ import annotations

import math

import torch


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (h + 1) for h in range(n)]


def alibi_slopes(nhead: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The standard fp32 ALiBi slopes ``[nhead]``.

    For a power of two ``n`` the slopes are ``2^(-8/n)`` raised to ``h + 1``; otherwise the
    slopes of the largest power of two ``p < n`` come first, followed by every other slope of
    ``2p`` until ``n`` are taken.
    """
    if not isinstance(nhead, int) or nhead < 1:
        raise ValueError(f"nhead: expected a positive int, got {nhead!r}")
    p = 2 ** int(math.floor(math.log2(nhead)))
    slopes = _power_of_two_slopes(p)
    if p < nhead:
        slopes += _power_of_two_slopes(2 * p)[0::2][: nhead - p]
    return torch.tensor(slopes, dtype=torch.float32, device=device)
