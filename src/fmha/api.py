"""Public entry points: ``attention``, ``attention_varlen`` and the lower-level ``fwd``/``bwd``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import ops
from . import autograd
from .inputs import check_inputs, check_kernel_device
from .masks import MaskLike


class AttentionOutput(NamedTuple):
    """``out``, and ``lse``/``randval`` where asked for (else ``None``)."""

    out: torch.Tensor
    lse: torch.Tensor | None
    randval: torch.Tensor | None


def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: MaskLike = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    cu_seqlen_q: torch.Tensor | None = None,
    cu_seqlen_k: torch.Tensor | None = None,
    seqstart_q: torch.Tensor | None = None,
    seqstart_k: torch.Tensor | None = None,
    seqlen_k: torch.Tensor | None = None,
    seqstart_padded_q: torch.Tensor | None = None,
    seqstart_padded_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = True,
    return_randval: bool = False,
    out: torch.Tensor | None = None,
) -> AttentionOutput:
    """Forward attention without autograd: ``(out, lse, randval)``.

    Batch mode takes ``q [B, Sq, Hq, Dq]``, ``k [B, Sk, Hk, Dq]``, ``v [B, Sk, Hk, Dv]``; group
    (varlen) mode, selected by ``seqstart_q``/``seqstart_k``, takes packed ``[total, H, D]``
    tensors. ``lse`` is fp32 ``[B, Hq, Sq]`` (group: ``[Hq, seqstart_q[-1]]``); ``randval`` the
    uint8 dropout bytes when ``return_randval`` and ``dropout_p > 0``. ``out`` may be given
    (any strides with a contiguous head dim) and is written in place.

    With dropout, pass ``seed``/``offset`` explicitly if you will call ``fmha.bwd``: ``None``
    draws fresh values from PyTorch's generator that are not returned.
    """
    inputs = check_inputs(
        q, k, v, scale=scale, mask=mask, bias=bias, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlen_q=cu_seqlen_q,
        cu_seqlen_k=cu_seqlen_k, seqstart_q=seqstart_q, seqstart_k=seqstart_k, seqlen_k=seqlen_k,
        seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    if out is not None:
        _check_out(out, inputs.out_shape, q)
    check_kernel_device(q)
    philox = None
    if inputs.dropout_p > 0:
        philox = ops.philox_seed_offset(inputs.seed, inputs.offset, q.device)
    result = ops.fwd(inputs, philox=philox, out=out, return_lse=return_lse,
                     return_randval=return_randval)
    return AttentionOutput(*result)


def _check_out(out, shape, q) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected a tensor of shape {tuple(shape)}, got {getattr(out, 'shape', out)}")
    if out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: expected {q.dtype} on {q.device} (as q), got {out.dtype} on {out.device}")
    if out.stride(-1) != 1 and out.shape[-1] > 1:
        raise ValueError(f"out: expected a contiguous head dim (stride 1), got strides {out.stride()}")


def _needs_grad(*tensors) -> bool:
    """Whether autograd must record a call on these tensors (``None`` for an absent bias)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _differentiable(q, k, v, *, deterministic, return_lse, return_randval, **kwargs):
    """The autograd path shared by ``attention`` and ``attention_varlen``: validate, then run the
    ``fmha::fwd`` custom op (whose registered backward is ``fmha::bwd``) when tracing, its eager
    twin when a gradient is wanted, and the forward alone when none is."""
    inputs = check_inputs(q, k, v, **kwargs)
    check_kernel_device(q)
    philox = None
    if inputs.dropout_p > 0:
        philox = ops.philox_seed_offset(inputs.seed, inputs.offset, q.device)
    if autograd.use_custom_ops(q):
        mask = inputs.mask
        out, lse, randval = torch.ops.fmha.fwd(
            inputs.q, inputs.k, inputs.v, kwargs.get("bias"), kwargs.get("alibi_slopes"), philox,
            inputs.cu_seqlen_q, inputs.cu_seqlen_k, inputs.seqstart_q, inputs.seqstart_k, inputs.seqlen_k,
            inputs.seqstart_padded_q, inputs.seqstart_padded_k, inputs.scale, int(mask.type), mask.left,
            mask.right, inputs.dropout_p, inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.lse_rows,
            bool(return_randval), bool(deterministic))
    elif _needs_grad(q, k, v, kwargs.get("bias")):
        out, lse, randval = autograd.EagerAttention.apply(
            inputs, inputs.q, inputs.k, inputs.v, kwargs.get("bias"), philox, bool(return_randval),
            bool(deterministic))
    else:  # nothing to differentiate: autograd's Function would only add host time
        out, lse, randval = ops.fwd(inputs, philox=philox, return_randval=bool(return_randval))
    if return_lse or return_randval:
        randval = randval if return_randval and inputs.dropout_p > 0 else None
        return AttentionOutput(out, lse.detach() if return_lse else None, randval)
    return out


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
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    deterministic: bool = False,
    cu_seqlen_q: torch.Tensor | None = None,
    cu_seqlen_k: torch.Tensor | None = None,
    return_lse: bool = False,
    return_randval: bool = False,
):
    """Batch-mode attention ``softmax(scale * q k^T + bias + alibi, masked) @ v``.

    ``q [B, Sq, Hq, Dq]``, ``k [B, Sk, Hk, Dq]``, ``v [B, Sk, Hk, Dv]`` with ``Hq % Hk == 0``
    (MQA/GQA). ``mask`` is a CK mask string (``"t"``, ``"b"``, ``"t:l,r"``, ``"b:l,r"``, ...) or
    an ``fmha.Mask``. ``cu_seqlen_q``/``cu_seqlen_k`` (int32 ``[B+1]``) shorten each batch.
    Returns ``out [B, Sq, Hq, Dv]``, or ``(out, lse, randval)`` when either is asked for.
    ``deterministic`` selects the backward's fixed-order dQ reduction (so does
    ``torch.use_deterministic_algorithms(True)``).
    """
    return _differentiable(
        q, k, v, scale=scale, mask=mask, bias=bias, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlen_q=cu_seqlen_q,
        cu_seqlen_k=cu_seqlen_k, deterministic=deterministic, return_lse=return_lse,
        return_randval=return_randval,
    )


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqstart_q: torch.Tensor,
    seqstart_k: torch.Tensor,
    *,
    seqlen_k: torch.Tensor | None = None,
    seqstart_padded_q: torch.Tensor | None = None,
    seqstart_padded_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    scale: float | None = None,
    mask: MaskLike = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_randval: bool = False,
):
    """Group-mode (varlen) attention over packed ``q [total_q, Hq, Dq]``, ``k``/``v [total_k, Hk, D]``.

    ``seqstart_q``/``seqstart_k`` (int32 ``[B+1]``) are prefix sums of the logical lengths;
    ``seqlen_k`` overrides the key lengths; ``seqstart_padded_q/k`` give the physical row starts
    when sequences are padded. Masks, ALiBi and dropout use each sequence's local indices.
    Passing ``max_seqlen_q``/``max_seqlen_k`` lets tracing skip reading the seqstarts.
    """
    return _differentiable(
        q, k, v, scale=scale, mask=mask, bias=bias, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=seed, offset=offset, seqstart_q=seqstart_q,
        seqstart_k=seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
        seqstart_padded_k=seqstart_padded_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic, return_lse=return_lse,
        return_randval=return_randval,
    )


class AttentionGrads(NamedTuple):
    """Gradients of q, k, v (in their shapes) and of the bias (in its own shape, else ``None``)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None


def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float | None = None,
    mask: MaskLike = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    deterministic: bool = False,
    cu_seqlen_q: torch.Tensor | None = None,
    cu_seqlen_k: torch.Tensor | None = None,
    seqstart_q: torch.Tensor | None = None,
    seqstart_k: torch.Tensor | None = None,
    seqlen_k: torch.Tensor | None = None,
    seqstart_padded_q: torch.Tensor | None = None,
    seqstart_padded_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> AttentionGrads:
    """Backward attention without autograd: ``(dq, dk, dv, dbias)`` from ``fwd``'s ``out``/``lse``.

    Takes the forward's keywords; with dropout, ``seed`` and ``offset`` must be the forward's
    (the backward regenerates the same bytes). ``dbias`` is returned when ``bias`` is given,
    summed to the bias's own shape. ``deterministic=True`` (or
    ``torch.use_deterministic_algorithms(True)``) gives bitwise-repeatable gradients.
    """
    inputs = check_inputs(
        q, k, v, scale=scale, mask=mask, bias=bias, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlen_q=cu_seqlen_q,
        cu_seqlen_k=cu_seqlen_k, seqstart_q=seqstart_q, seqstart_k=seqstart_k, seqlen_k=seqlen_k,
        seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    for name, t, shape, dtype in (("dout", dout, inputs.out_shape, q.dtype), ("out", out, inputs.out_shape, q.dtype),
                                  ("lse", lse, inputs.lse_shape, torch.float32)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: expected a tensor of shape {tuple(shape)}, got {getattr(t, 'shape', t)}")
        if t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{name}: expected {dtype} on {q.device}, got {t.dtype} on {t.device}")
    if inputs.dropout_p > 0 and (inputs.seed is None or inputs.offset is None):
        raise ValueError("seed/offset: expected the forward's dropout seed and offset, got None")
    check_kernel_device(q)
    philox = None
    if inputs.dropout_p > 0:
        philox = ops.philox_seed_offset(inputs.seed, inputs.offset, q.device)
    # dout and out get the kernels' layout in the launcher (ops.kernel_layout); lse only needs rows.
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    return AttentionGrads(*ops.bwd(inputs, dout, out, lse, philox=philox, deterministic=deterministic,
                                   bias_grad=bias is not None))
