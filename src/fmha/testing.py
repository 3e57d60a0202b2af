"""Input generators and error criteria shared by the tests, the CLI and the benchmarks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from . import reference


def _randn(shape, dtype, device, generator) -> torch.Tensor:
    """Normal samples drawn on the CPU (so a CPU generator serves any device), then moved."""
    return torch.randn(shape, generator=generator).to(dtype=dtype, device=device)


def random_tensor(shape, dtype, device, layout: str, generator=None) -> torch.Tensor:
    """Random ``[..., S, H, D]`` tensor laid out as asked: ``bshd`` (contiguous), ``bhsd``
    (heads outer, a transposed view) or ``strided`` (rows padded, head dim still contiguous)."""
    *lead, s, h, d = shape
    if layout == "bshd":
        return _randn(shape, dtype, device, generator)
    if layout == "bhsd":
        return _randn((*lead, h, s, d), dtype, device, generator).transpose(-3, -2)
    if layout == "strided":
        return _randn((*lead, s, h + 1, d + 8), dtype, device, generator)[..., :h, :d]
    raise ValueError(f"layout: expected bshd, bhsd or strided, got {layout!r}")


def random_qkv(batch, seqlen_q, seqlen_k, nhead_q, nhead_k, head_dim_q, head_dim_v, *,
               dtype=torch.float16, device="cpu", layout="bshd", generator=None):
    """Batch-mode ``q [B, Sq, Hq, Dq]``, ``k [B, Sk, Hk, Dq]``, ``v [B, Sk, Hk, Dv]``."""
    q = random_tensor((batch, seqlen_q, nhead_q, head_dim_q), dtype, device, layout, generator)
    k = random_tensor((batch, seqlen_k, nhead_k, head_dim_q), dtype, device, layout, generator)
    v = random_tensor((batch, seqlen_k, nhead_k, head_dim_v), dtype, device, layout, generator)
    return q, k, v


def prefix_sums(lengths, device="cpu") -> torch.Tensor:
    """int32 ``[len(lengths) + 1]`` prefix sums starting at 0."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


@dataclass
class VarlenBatch:
    """Packed group-mode tensors whose padding rows hold NaN, with every seqstart tensor."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seqstart_q: torch.Tensor
    seqstart_k: torch.Tensor
    seqlen_k: torch.Tensor | None
    seqstart_padded_q: torch.Tensor | None
    seqstart_padded_k: torch.Tensor | None

    def kwargs(self) -> dict:
        return dict(seqstart_q=self.seqstart_q, seqstart_k=self.seqstart_k, seqlen_k=self.seqlen_k,
                    seqstart_padded_q=self.seqstart_padded_q, seqstart_padded_k=self.seqstart_padded_k)


def random_varlen(lengths_q, lengths_k, nhead_q, nhead_k, head_dim_q, head_dim_v, *,
                  pad_q=None, pad_k=None, key_lengths_override=False,
                  dtype=torch.float16, device="cpu", generator=None) -> VarlenBatch:
    """Group-mode problem. ``pad_q``/``pad_k`` are per-sequence physical slot sizes (>= the
    lengths) given as ``seqstart_padded_*``; with ``key_lengths_override`` the key lengths go in
    ``seqlen_k`` instead. Every row outside a sequence is NaN, so a read of padding shows."""
    slots_q = list(pad_q) if pad_q is not None else list(lengths_q)
    slots_k = list(pad_k) if pad_k is not None else list(lengths_k)
    q = torch.full((sum(slots_q), nhead_q, head_dim_q), float("nan"), dtype=dtype, device=device)
    k = torch.full((sum(slots_k), nhead_k, head_dim_q), float("nan"), dtype=dtype, device=device)
    v = torch.full((sum(slots_k), nhead_k, head_dim_v), float("nan"), dtype=dtype, device=device)
    rows_q = prefix_sums(slots_q).tolist()
    rows_k = prefix_sums(slots_k).tolist()
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        q[rows_q[b] : rows_q[b] + n_q] = _randn((n_q, nhead_q, head_dim_q), dtype, device, generator)
        k[rows_k[b] : rows_k[b] + n_k] = _randn((n_k, nhead_k, head_dim_q), dtype, device, generator)
        v[rows_k[b] : rows_k[b] + n_k] = _randn((n_k, nhead_k, head_dim_v), dtype, device, generator)
    seqlen_k = None
    seqstart_k = prefix_sums(lengths_k, device)
    if key_lengths_override:
        seqlen_k = torch.tensor(list(lengths_k), dtype=torch.int32, device=device)
        seqstart_k = prefix_sums(slots_k, device)
    return VarlenBatch(
        q, k, v,
        seqstart_q=prefix_sums(lengths_q, device),
        seqstart_k=seqstart_k,
        seqlen_k=seqlen_k,
        seqstart_padded_q=prefix_sums(slots_q, device) if pad_q is not None else None,
        seqstart_padded_k=prefix_sums(slots_k, device) if pad_k is not None and not key_lengths_override else None,
    )


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, treating equal infinities as equal and NaN as infinite error
    (``expected`` may live on another device than ``actual``)."""
    actual, expected = actual.double(), expected.double().to(actual.device)
    same_inf = torch.isinf(actual) & torch.isinf(expected) & (actual == expected)
    diff = torch.where(same_inf, torch.zeros_like(actual), (actual - expected).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return diff.max().item() if diff.numel() else 0.0


def error_bound(q_dtype: torch.dtype, low_precision_error: float, magnitude: float = 1.0) -> float:
    """FlashAttention's criterion: twice the error of a PyTorch computation in the input dtype,
    plus a floor for the rounding of the output itself: about one unit in the last place of the
    dtype at ``max(1, magnitude)``, where ``magnitude`` is the largest value of the exact result
    (a gradient summed over many rows, such as a broadcast bias's, rounds at its own scale)."""
    floor = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 2e-5}[q_dtype]
    return 2 * low_precision_error + floor * max(1.0, magnitude)


def d_rounding_term(dout: torch.Tensor, out: torch.Tensor) -> float:
    """What the fp32 rounding of ``D = rowsum(dO * O)`` (SPEC.md §6) may add to dQ, dK and dBias,
    on top of ``error_bound``: the fp32 floor at the largest ``sum |dO * O|`` of a row. In a row
    that sees a single key, P = 1 and the exact dS = dP - D is 0; the kernel computes dP as a dot
    and D as a row sum, which round differently, and dK or dBias sum that difference over rows.
    Large only against fp32's floor; for fp16/bf16 it is far below theirs."""
    return error_bound(torch.float32, 0.0) * (dout.double() * out.double()).abs().sum(-1).max().item()


def reference_pair(q, k, v, **kwargs):
    """The exact (float64) reference and the same computation in q's dtype."""
    exact = reference.attention(q, k, v, **kwargs)
    low = reference.attention(q, k, v, compute_dtype=q.dtype, **kwargs)
    return exact, low
