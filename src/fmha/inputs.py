"""Normalize and validate every argument of an attention call, before any kernel runs.

``check_inputs(...)`` returns an ``AttentionInputs`` whose fields the launchers use as they are;
bad input raises ``ValueError`` naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ._backend import INTERPRET
from .masks import Mask, MaskLike, parse_mask

# float64 exists for gradcheck and as a high-precision oracle; it is slow on GPUs.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


@dataclass
class AttentionInputs:
    """One attention problem, normalized. Shapes use the notation of SPEC.md."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    group: bool
    batch: int
    nhead_q: int
    nhead_k: int
    head_dim_q: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    mask: Mask
    bias: torch.Tensor | None  # batch [B, Hq, Sq, Sk], group [Hq, total_q, max_seqlen_k] (expanded)
    bias_shape: tuple[int, ...] | None  # the bias as given, before broadcasting (dbias has it)
    bias_dtype: torch.dtype | None
    alibi_slopes: torch.Tensor | None  # [B, Hq] fp32 (expanded)
    dropout_p: float
    seed: int | torch.Tensor | None
    offset: int | torch.Tensor | None
    cu_seqlen_q: torch.Tensor | None = None
    cu_seqlen_k: torch.Tensor | None = None
    seqstart_q: torch.Tensor | None = None
    seqstart_k: torch.Tensor | None = None
    seqlen_k: torch.Tensor | None = None
    seqstart_padded_q: torch.Tensor | None = None
    seqstart_padded_k: torch.Tensor | None = None
    lse_rows: int = 0  # group mode: seqstart_q[-1], the logical rows of lse

    def replaced(self, **fields) -> "AttentionInputs":
        """``dataclasses.replace`` without running ``__init__`` again: a copy of the fields with
        these changed (a third of the time; the eager backward makes two a call)."""
        copy = object.__new__(AttentionInputs)
        copy.__dict__.update(self.__dict__, **fields)
        return copy

    @property
    def has_padding_q(self) -> bool:
        """Whether some rows of ``out`` lie outside every sequence (the kernel leaves them)."""
        return self.cu_seqlen_q is not None or self.seqstart_padded_q is not None or (
            self.group and self.lse_rows != self.q.shape[0]
        )

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.q.shape[:-1], self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.group:
            return (self.nhead_q, self.lse_rows)
        return (self.batch, self.nhead_q, self.q.shape[1])

    @property
    def randval_shape(self) -> tuple[int, ...]:
        if self.group:
            return (self.nhead_q, self.q.shape[0], self.max_seqlen_k)
        return (self.batch, self.nhead_q, self.q.shape[1], self.k.shape[1])


def bias_target(q: torch.Tensor, k: torch.Tensor, group: bool, batch: int, max_seqlen_k: int) -> tuple[int, ...]:
    """The shape a bias broadcasts to: batch ``[B, Hq, Sq, Sk]``, group ``[Hq, total_q, max_seqlen_k]``."""
    if group:
        return (q.shape[-2], q.shape[0], int(max_seqlen_k))
    return (batch, q.shape[-2], q.shape[1], k.shape[1])


def _fail(name: str, expected: str, got) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {got}")


def check_kernel_device(q: torch.Tensor) -> None:
    """Kernels compiled for the GPU read CUDA memory; CPU tensors run only in Triton's interpreter,
    which fmha selects when it is imported on a machine without CUDA (or with TRITON_INTERPRET=1)."""
    if not INTERPRET and q.device.type not in ("cuda", "meta"):
        raise _fail("q", "a CUDA tensor (CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before importing fmha)", f"one on {q.device}")


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _trace_safe() -> bool:
    """True while tracing or capturing, when index tensors must not be read on the host."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_index(name: str, t, length: int, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "an int32 tensor", type(t).__name__)
    if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != length:
        raise _fail(name, f"an int32 tensor of shape ({length},)", _describe(t))
    if t.device != device:
        raise _fail(name, f"a tensor on {device} (where q is)", f"one on {t.device}")
    return t.contiguous()


# Index tensors already read, by identity: id -> (weak reference, version, values). PyTorch bumps a
# tensor's version on every in-place write, so an unchanged (tensor, version) still holds the values
# read before, and a model's layers, which all get the same seqstart tensor, wait for the GPU once
# rather than once a call. Writes that bypass PyTorch's in-place ops (through ``.data`` or a custom
# kernel) are not seen.
_READ_INDICES: dict[int, tuple[weakref.ref, int, list[int]]] = {}


def _host_values(t: torch.Tensor) -> list[int]:
    """``t.tolist()``, read once per (tensor, version): reading a CUDA tensor waits for the GPU."""
    if t.is_inference():  # inference tensors have no version counter
        return t.tolist()
    key = id(t)
    entry = _READ_INDICES.get(key)
    if entry is not None and entry[0]() is t and entry[1] == t._version:
        return entry[2]
    values = t.tolist()
    _READ_INDICES[key] = (weakref.ref(t, lambda _, key=key: _READ_INDICES.pop(key, None)), t._version, values)
    return values


def _check_starts(name: str, starts: list[int], lengths: list[int], total: int, what: str) -> None:
    """Sequences must lie inside the tensor, in order, without overlapping."""
    if any(n < 0 for n in lengths):
        raise _fail(name, "non-negative sequence lengths", lengths)
    for b, (start, n) in enumerate(zip(starts, lengths)):
        if start < 0 or start + n > starts[b + 1] or starts[b + 1] > total:
            raise _fail(
                name,
                f"non-decreasing starts with each sequence inside {what} ({total} rows)",
                starts,
            )


def _check_head_tensor(name: str, t, rank: int, dtype: torch.dtype | None, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != rank:
        layout = "[B, S, H, D]" if rank == 4 else "[total, H, D]"
        raise _fail(name, f"a {rank}-D tensor {layout}", _describe(t))
    if dtype is None and t.dtype not in SUPPORTED_DTYPES:
        raise _fail(name, "dtype float16, bfloat16, float32 or float64", t.dtype)
    if dtype is not None and t.dtype != dtype:
        raise _fail(name, f"dtype {dtype} (as q)", t.dtype)
    if device is not None and t.device != device:
        raise _fail(name, f"a tensor on {device} (where q is)", f"one on {t.device}")
    if t.shape[-1] < 1 or t.shape[-1] > MAX_HEAD_DIM:
        raise _fail(f"{name} head dim", f"1..{MAX_HEAD_DIM}", t.shape[-1])
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check_seed(name: str, value, device: torch.device):
    if value is None:
        return None
    if isinstance(value, bool):
        raise _fail(name, "an int or a one-element int64 tensor", value)
    if isinstance(value, int):
        if not 0 <= value < 2**64:
            raise _fail(name, "an integer in [0, 2^64)", value)
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.int64:
            raise _fail(name, "a one-element int64 tensor", _describe(value))
        if value.device != device:
            raise _fail(name, f"a tensor on {device} (where q is)", f"one on {value.device}")
        return value.reshape(1)
    raise _fail(name, "an int or a one-element int64 tensor", type(value).__name__)


def check_inputs(
    q,
    k,
    v,
    *,
    scale=None,
    mask: MaskLike = None,
    bias=None,
    alibi_slopes=None,
    dropout_p: float = 0.0,
    seed=None,
    offset=None,
    cu_seqlen_q=None,
    cu_seqlen_k=None,
    seqstart_q=None,
    seqstart_k=None,
    seqlen_k=None,
    seqstart_padded_q=None,
    seqstart_padded_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> AttentionInputs:
    """Validate an attention call (batch mode unless ``seqstart_q`` is given) and normalize it."""
    group = seqstart_q is not None or seqstart_k is not None
    rank = 3 if group else 4
    q = _check_head_tensor("q", q, rank, None, None)
    device, dtype = q.device, q.dtype
    k = _check_head_tensor("k", k, rank, dtype, device)
    v = _check_head_tensor("v", v, rank, dtype, device)
    if k.shape[-1] != q.shape[-1]:
        raise _fail("k head dim", f"{q.shape[-1]} (q's head dim)", k.shape[-1])
    if k.shape[:-1] != v.shape[:-1]:
        raise _fail("v shape", f"{tuple(k.shape[:-1])} + (head_dim_v,) to match k", tuple(v.shape))
    nhead_q, nhead_k = q.shape[-2], k.shape[-2]
    if nhead_k < 1 or nhead_q % nhead_k != 0:
        raise _fail("nhead_k", f"a divisor of nhead_q={nhead_q}", nhead_k)
    head_dim_q, head_dim_v = q.shape[-1], v.shape[-1]

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim_q)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise _fail("scale", "a finite float or None", scale)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise _fail("dropout_p", "a float in [0, 1)", dropout_p)
    seed = _check_seed("seed", seed, device)
    offset = _check_seed("offset", offset, device)
    mask = parse_mask(mask)
    # (only index tensors need it: a batch-mode call without cu_seqlens skips the query)
    read_indices = (group or cu_seqlen_q is not None or cu_seqlen_k is not None) and not _trace_safe()

    inputs = dict(q=q, k=k, v=v, group=group, nhead_q=nhead_q, nhead_k=nhead_k,
                  head_dim_q=head_dim_q, head_dim_v=head_dim_v, scale=float(scale), mask=mask,
                  dropout_p=float(dropout_p), seed=seed, offset=offset)
    if group:
        if cu_seqlen_q is not None or cu_seqlen_k is not None:
            raise _fail("cu_seqlen_q/cu_seqlen_k", "None in group mode (use seqstart_*)", "a tensor")
        if seqstart_q is None or seqstart_k is None:
            raise _fail("seqstart_q/seqstart_k", "both tensors in group mode", "only one")
        if not isinstance(seqstart_q, torch.Tensor) or seqstart_q.dim() != 1 or seqstart_q.shape[0] < 2:
            raise _fail("seqstart_q", "an int32 tensor of shape (batch + 1,)", seqstart_q)
        batch = seqstart_q.shape[0] - 1
        seqstart_q = _check_index("seqstart_q", seqstart_q, batch + 1, device)
        seqstart_k = _check_index("seqstart_k", seqstart_k, batch + 1, device)
        seqlen_k = _check_index("seqlen_k", seqlen_k, batch, device)
        seqstart_padded_q = _check_index("seqstart_padded_q", seqstart_padded_q, batch + 1, device)
        seqstart_padded_k = _check_index("seqstart_padded_k", seqstart_padded_k, batch + 1, device)
        total_q, total_k = q.shape[0], k.shape[0]
        need_host = max_seqlen_q is None or max_seqlen_k is None or seqstart_padded_q is not None
        if need_host and not read_indices:
            if seqstart_padded_q is not None:
                raise _fail("seqstart_padded_q", "None while tracing or capturing (LSE's row count, "
                            "seqstart_q[-1], would have to be read on the host)", "a tensor")
            raise ValueError(
                "max_seqlen_q/max_seqlen_k: expected ints while tracing or capturing (the "
                "seqstarts cannot be read on the host then), got None"
            )
        lse_rows = total_q
        if need_host or read_indices:
            starts_q = _host_values(seqstart_q)
            starts_k = _host_values(seqstart_k)
            lens_q = [b - a for a, b in zip(starts_q[:-1], starts_q[1:])]
            lens_k = _host_values(seqlen_k) if seqlen_k is not None else [
                b - a for a, b in zip(starts_k[:-1], starts_k[1:])]
            if starts_q[0] != 0 or any(n < 0 for n in lens_q):
                raise _fail("seqstart_q", "non-decreasing prefix sums starting at 0", starts_q)
            if seqlen_k is None and (starts_k[0] != 0 or any(n < 0 for n in lens_k)):
                raise _fail("seqstart_k", "non-decreasing prefix sums starting at 0", starts_k)
            rows_q = _host_values(seqstart_padded_q) if seqstart_padded_q is not None else starts_q
            rows_k = _host_values(seqstart_padded_k) if seqstart_padded_k is not None else starts_k
            _check_starts("seqstart_padded_q" if seqstart_padded_q is not None else "seqstart_q",
                          rows_q, lens_q, total_q, "q")
            _check_starts("seqstart_padded_k" if seqstart_padded_k is not None else
                          ("seqlen_k" if seqlen_k is not None else "seqstart_k"),
                          rows_k, lens_k, total_k, "k")
            lse_rows = starts_q[-1]
            for name, given, actual in (("max_seqlen_q", max_seqlen_q, max(lens_q)),
                                        ("max_seqlen_k", max_seqlen_k, max(lens_k))):
                if given is not None and given < actual:
                    raise _fail(name, f"at least the longest sequence ({actual})", given)
            max_seqlen_q = max(lens_q) if max_seqlen_q is None else max_seqlen_q
            max_seqlen_k = max(lens_k) if max_seqlen_k is None else max_seqlen_k
        inputs.update(seqstart_q=seqstart_q, seqstart_k=seqstart_k, seqlen_k=seqlen_k,
                      seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
                      lse_rows=lse_rows)
    else:
        for name, value in (("seqlen_k", seqlen_k), ("seqstart_padded_q", seqstart_padded_q),
                            ("seqstart_padded_k", seqstart_padded_k)):
            if value is not None:
                raise _fail(name, "None in batch mode (it needs seqstart_q/seqstart_k)", "a tensor")
        batch = q.shape[0]
        if k.shape[0] != batch:
            raise _fail("k batch", f"{batch} (q's batch)", k.shape[0])
        seqlen_q_full, seqlen_k_full = q.shape[1], k.shape[1]
        cu_seqlen_q = _check_index("cu_seqlen_q", cu_seqlen_q, batch + 1, device)
        cu_seqlen_k = _check_index("cu_seqlen_k", cu_seqlen_k, batch + 1, device)
        for name, cu, full in (("cu_seqlen_q", cu_seqlen_q, seqlen_q_full),
                               ("cu_seqlen_k", cu_seqlen_k, seqlen_k_full)):
            if cu is not None and read_indices:
                starts = _host_values(cu)
                lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
                if starts[0] != 0 or any(n < 0 or n > full for n in lengths):
                    raise _fail(name, f"prefix sums from 0 of lengths in [0, {full}]", starts)
        inputs.update(cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k)
        max_seqlen_q, max_seqlen_k = seqlen_q_full, seqlen_k_full

    target = bias_target(q, k, group, batch, max_seqlen_k)
    bias_shape = bias_dtype = None
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise _fail("bias", "a torch.Tensor", type(bias).__name__)
        if bias.dtype not in (dtype, torch.float32):
            raise _fail("bias", f"dtype {dtype} (as q) or torch.float32", bias.dtype)
        if bias.device != device:
            raise _fail("bias", f"a tensor on {device} (where q is)", f"one on {bias.device}")
        bias_given, bias_dtype = tuple(bias.shape), bias.dtype
        try:
            if bias.dim() > len(target):
                raise RuntimeError
            bias = bias.expand(target)
        except RuntimeError:
            raise _fail("bias", f"a shape that broadcasts to {target}", tuple(bias.shape)) from None
        bias_shape = bias_given
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise _fail("alibi_slopes", "a float32 tensor", getattr(alibi_slopes, "dtype", alibi_slopes))
        if alibi_slopes.device != device:
            raise _fail("alibi_slopes", f"a tensor on {device} (where q is)", f"one on {alibi_slopes.device}")
        if tuple(alibi_slopes.shape) not in ((nhead_q,), (batch, nhead_q)):
            raise _fail("alibi_slopes", f"shape ({nhead_q},) or ({batch}, {nhead_q})", tuple(alibi_slopes.shape))
        alibi_slopes = alibi_slopes.expand(batch, nhead_q)
    return AttentionInputs(batch=batch, max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                           bias=bias, bias_shape=bias_shape, bias_dtype=bias_dtype,
                           alibi_slopes=alibi_slopes, **inputs)
