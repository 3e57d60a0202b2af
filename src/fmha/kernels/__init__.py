"""Triton kernels (``@triton.jit`` code only), one module per phase."""

from .._backend import INTERPRET

__all__ = ["INTERPRET"]
