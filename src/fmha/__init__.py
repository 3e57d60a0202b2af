"""fmha: fused multi-head attention for PyTorch with Triton kernels and CK's semantics."""

from . import _backend  # noqa: F401  (must precede every triton import)
from . import reference
from .alibi import alibi_slopes
from .api import AttentionGrads, AttentionOutput, attention, attention_varlen, bwd, fwd
from .masks import Mask, MaskType, parse_mask

__version__ = "0.1.0"

__all__ = [
    "AttentionGrads",
    "AttentionOutput",
    "Mask",
    "MaskType",
    "alibi_slopes",
    "attention",
    "attention_varlen",
    "bwd",
    "fwd",
    "parse_mask",
    "reference",
]
