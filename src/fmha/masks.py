"""Attention masks: ``Mask(type, left, right)`` and CK's mask strings.

Query row ``i`` sees key ``j`` iff ``0 <= j < sk`` and ``i + off - left <= j <= i + off + right``
where ``off = 0`` for a top-left mask and ``sk - sq`` for a bottom-right one; a negative
``left`` or ``right`` leaves that side unbounded. With ``sq = 3, sk = 5``::

    causal top-left ("t")       causal bottom-right ("b")
        j: 0 1 2 3 4                j: 0 1 2 3 4
    i=0    x . . . .            i=0    x x x . .
    i=1    x x . . .            i=1    x x x x .
    i=2    x x x . .            i=2    x x x x x
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Union

import torch


class MaskType(enum.IntEnum):
    """Which corner the diagonal of a mask starts from (CK's ``mask_enum``)."""

    NONE = 0
    TOP_LEFT = 1
    BOTTOM_RIGHT = 2


class Mask(NamedTuple):
    """A causal or sliding-window mask: ``(type, left, right)`` in FlashAttention's window terms."""

    type: MaskType = MaskType.NONE
    left: int = -1
    right: int = -1

    @property
    def is_causal(self) -> bool:
        """True for ``left < 0 and right == 0`` from either corner (CK's "vertical" ALiBi case)."""
        return self.type != MaskType.NONE and self.left < 0 and self.right == 0

    @property
    def is_window(self) -> bool:
        """A mask that is neither absent nor causal: a sliding window."""
        return self.type != MaskType.NONE and not self.is_causal

    def diagonal_offset(self, seqlen_q: int, seqlen_k: int) -> int:
        """``off`` in the visibility rule: 0 from the top-left, ``sk - sq`` from the bottom-right."""
        return seqlen_k - seqlen_q if self.type == MaskType.BOTTOM_RIGHT else 0

    def __str__(self) -> str:
        if self.type == MaskType.NONE:
            return "n"
        corner = "t" if self.type == MaskType.TOP_LEFT else "b"
        return f"{corner}({self.left}:{self.right})"


NO_MASK = Mask()
MaskLike = Union[Mask, str, None]


def _ints(text: str, count: int, spec: str) -> list[int]:
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != count:
        raise ValueError(f"mask: expected {spec}, got {text!r}")
    return values


def parse_mask(spec: MaskLike) -> Mask:
    """Turn a CK mask string, a ``Mask`` or ``None`` into a ``Mask``.

    Strings: ``0``/``n`` none; ``1``/``t`` causal top-left; ``2``/``b`` causal bottom-right;
    ``t:l,r`` / ``b:l,r`` sliding window from that corner; ``xt:w`` / ``xb:w`` xformers window
    (``l = w // 2``, ``r = w - 1 - w // 2``, ``w <= 0`` causal); ``g:y,x`` CK's debug form,
    read as ``t:y,x``.
    """
    if spec is None:
        return NO_MASK
    if isinstance(spec, Mask):
        if spec.type == MaskType.NONE:
            return NO_MASK
        return Mask(MaskType(spec.type), int(spec.left), int(spec.right))
    if not isinstance(spec, str):
        raise ValueError(f"mask: expected a mask string or fmha.Mask, got {type(spec).__name__}")
    text = spec.strip()
    simple = {
        "0": NO_MASK,
        "n": NO_MASK,
        "1": Mask(MaskType.TOP_LEFT, -1, 0),
        "t": Mask(MaskType.TOP_LEFT, -1, 0),
        "2": Mask(MaskType.BOTTOM_RIGHT, -1, 0),
        "b": Mask(MaskType.BOTTOM_RIGHT, -1, 0),
    }
    if text in simple:
        return simple[text]
    head, sep, rest = text.partition(":")
    if sep:
        if head in ("t", "b", "g"):
            left, right = _ints(rest, 2, f"'{head}:left,right' with two integers")
            corner = MaskType.BOTTOM_RIGHT if head == "b" else MaskType.TOP_LEFT
            return Mask(corner, left, right)
        if head in ("xt", "xb"):
            (width,) = _ints(rest, 1, f"'{head}:window' with one integer")
            corner = MaskType.TOP_LEFT if head == "xt" else MaskType.BOTTOM_RIGHT
            if width <= 0:
                return Mask(corner, -1, 0)
            return Mask(corner, width // 2, width - 1 - width // 2)
    raise ValueError(
        f"mask: expected one of 0/n, 1/t, 2/b, t:l,r, b:l,r, xt:w, xb:w, g:y,x, got {spec!r}"
    )


def boolean_mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True = takes part) as an additive fp32 bias of its own shape: 0 or -inf."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
