"""The forward and backward launches as torch.library custom ops, ``fmha::fwd`` and ``fmha::bwd``,
and the same pair as a plain ``torch.autograd.Function`` for eager calls.

Each op is one opaque node to torch.compile: a fake implementation gives its output shapes without
running anything, and ``register_autograd`` links ``fmha::fwd`` to ``fmha::bwd``. Validation
(``fmha.inputs.check_inputs``) runs before the ops, in plain Python that dynamo traces; the ops
take only tensors and plain scalars and never read index tensors on the host.

The dispatcher costs a custom op about 100 us of host time per call (argument schema handling in
Python), as much as a whole kernel at short sequences. Eager calls on plain tensors therefore go
through ``EagerAttention``, which runs the same implementations and backward; torch.compile,
fake tensors and dispatch modes get the ops (``use_custom_ops``).
"""

from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import ops
from .inputs import AttentionInputs, bias_target
from .masks import Mask, MaskType


def _inputs(
    q, k, v, bias, alibi_slopes, cu_seqlen_q, cu_seqlen_k, seqstart_q, seqstart_k, seqlen_k,
    seqstart_padded_q, seqstart_padded_k, scale, mask_type, window_left, window_right, dropout_p,
    max_seqlen_q, max_seqlen_k, lse_rows,
) -> AttentionInputs:
    """The launchers' view of already-validated op arguments (bias and slopes as given)."""
    group = seqstart_q is not None
    batch = seqstart_q.shape[0] - 1 if group else q.shape[0]
    nhead_q = q.shape[-2]
    return AttentionInputs(
        q=q, k=k, v=v, group=group, batch=batch, nhead_q=nhead_q, nhead_k=k.shape[-2],
        head_dim_q=q.shape[-1], head_dim_v=v.shape[-1], max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        scale=scale, mask=Mask(MaskType(mask_type), window_left, window_right),
        bias=None if bias is None else bias.expand(bias_target(q, k, group, batch, max_seqlen_k)),
        bias_shape=None if bias is None else tuple(bias.shape), bias_dtype=None if bias is None else bias.dtype,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.expand(batch, nhead_q),
        dropout_p=dropout_p, seed=None, offset=None, cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k,
        seqstart_q=seqstart_q, seqstart_k=seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
        seqstart_padded_k=seqstart_padded_k, lse_rows=lse_rows,
    )


def attention_fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], alibi_slopes: Optional[Tensor],
    philox: Optional[Tensor], cu_seqlen_q: Optional[Tensor], cu_seqlen_k: Optional[Tensor],
    seqstart_q: Optional[Tensor], seqstart_k: Optional[Tensor], seqlen_k: Optional[Tensor],
    seqstart_padded_q: Optional[Tensor], seqstart_padded_k: Optional[Tensor], scale: float, mask_type: int,
    window_left: int, window_right: int, dropout_p: float, max_seqlen_q: int, max_seqlen_k: int,
    lse_rows: int, return_randval: bool, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, randval)``; randval is empty unless asked for with dropout on.
    ``deterministic`` is only kept for the backward."""
    inputs = _inputs(q, k, v, bias, alibi_slopes, cu_seqlen_q, cu_seqlen_k, seqstart_q, seqstart_k, seqlen_k,
                     seqstart_padded_q, seqstart_padded_k, scale, mask_type, window_left, window_right,
                     dropout_p, max_seqlen_q, max_seqlen_k, lse_rows)
    out, lse, randval = ops.fwd(inputs, philox=philox, return_randval=return_randval)
    return out, lse, q.new_empty(0, dtype=torch.uint8) if randval is None else randval


attention_fwd = torch.library.custom_op("fmha::fwd", attention_fwd_impl, mutates_args=())


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, bias, alibi_slopes, philox, cu_seqlen_q, cu_seqlen_k, seqstart_q, seqstart_k,
                        seqlen_k, seqstart_padded_q, seqstart_padded_k, scale, mask_type, window_left,
                        window_right, dropout_p, max_seqlen_q, max_seqlen_k, lse_rows, return_randval,
                        deterministic):
    group = seqstart_q is not None
    nhead_q = q.shape[-2]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse_shape = (nhead_q, lse_rows) if group else (q.shape[0], nhead_q, q.shape[1])
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    randval_shape = (0,)
    if return_randval and dropout_p > 0:
        randval_shape = (nhead_q, q.shape[0], max_seqlen_k) if group else (q.shape[0], nhead_q, q.shape[1], k.shape[1])
    return out, lse, q.new_empty(randval_shape, dtype=torch.uint8)


def attention_bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Optional[Tensor],
    alibi_slopes: Optional[Tensor], philox: Optional[Tensor], cu_seqlen_q: Optional[Tensor],
    cu_seqlen_k: Optional[Tensor], seqstart_q: Optional[Tensor], seqstart_k: Optional[Tensor],
    seqlen_k: Optional[Tensor], seqstart_padded_q: Optional[Tensor], seqstart_padded_k: Optional[Tensor],
    scale: float, mask_type: int, window_left: int, window_right: int, dropout_p: float, max_seqlen_q: int,
    max_seqlen_k: int, lse_rows: int, deterministic: bool, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbias)``; dbias (in the bias's own shape) is empty unless ``bias_grad``."""
    inputs = _inputs(q, k, v, bias, alibi_slopes, cu_seqlen_q, cu_seqlen_k, seqstart_q, seqstart_k, seqlen_k,
                     seqstart_padded_q, seqstart_padded_k, scale, mask_type, window_left, window_right,
                     dropout_p, max_seqlen_q, max_seqlen_k, lse_rows)
    dq, dk, dv, dbias = ops.bwd(inputs, dout, out, lse, philox=philox, deterministic=deterministic,
                                bias_grad=bias_grad)
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


attention_bwd = torch.library.custom_op("fmha::bwd", attention_bwd_impl, mutates_args=())


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, bias, alibi_slopes, philox, cu_seqlen_q, cu_seqlen_k,
                        seqstart_q, seqstart_k, seqlen_k, seqstart_padded_q, seqstart_padded_k, scale, mask_type,
                        window_left, window_right, dropout_p, max_seqlen_q, max_seqlen_k, lse_rows,
                        deterministic, bias_grad):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


# Positions in fmha::fwd's argument list.
_BIAS = 3
_INDEX_ARGS = slice(6, 13)  # cu_seqlen_q .. seqstart_padded_k
_SCALARS = slice(13, 21)  # scale .. lse_rows


def _setup_context(ctx, inputs, output):
    q, k, v, bias, alibi_slopes, philox = inputs[:6]
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, philox, *inputs[_INDEX_ARGS])
    ctx.scalars = inputs[_SCALARS]
    ctx.deterministic = inputs[-1]
    ctx.bias_grad = bias is not None and ctx.needs_input_grad[_BIAS]


def _backward_through(bwd, ctx, dout):
    q, k, v, out, lse, bias, alibi_slopes, philox, *index_args = ctx.saved_tensors
    # torch.use_deterministic_algorithms(True) turns the fixed-order dQ reduction on.
    deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv, dbias = bwd(dout, q, k, v, out, lse, bias, alibi_slopes, philox, *index_args, *ctx.scalars,
                            deterministic, ctx.bias_grad)
    return (dq, dk, dv, dbias if ctx.bias_grad else None) + (None,) * 19


def _backward(ctx, dout, _dlse, _drandval):
    return _backward_through(torch.ops.fmha.bwd, ctx, dout)


torch.library.register_autograd("fmha::fwd", _backward, setup_context=_setup_context)


# The tensors of an AttentionInputs: the eager backward saves them with save_for_backward (version
# checks, saved-tensor hooks, freed after backward) and keeps only the rest of the problem; seed and
# offset (ints or tensors) are dropped, the backward has them in philox.
_PROBLEM_TENSORS = ("q", "k", "v", "bias", "alibi_slopes", "cu_seqlen_q", "cu_seqlen_k", "seqstart_q",
                    "seqstart_k", "seqlen_k", "seqstart_padded_q", "seqstart_padded_k")


class EagerAttention(torch.autograd.Function):
    """``fmha::fwd`` and its backward without the dispatcher, for eager calls: the same launches
    on the problem ``check_inputs`` validated, handed over whole (rebuilding it from the op's 23
    arguments, and autograd's unwrapping of each, cost a short call a fifth of its host time). q,
    k, v and the bias come again as arguments so that autograd sees them. (The context is set up
    in ``forward``: a separate ``setup_context`` makes ``apply`` bind the arguments through
    ``inspect.signature`` on every call.)"""

    @staticmethod
    def forward(ctx, inputs: AttentionInputs, q, k, v, bias, philox, return_randval: bool, deterministic: bool):
        out, lse, randval = ops.fwd(inputs, philox=philox, return_randval=return_randval)
        problem = [getattr(inputs, name) for name in _PROBLEM_TENSORS]
        ctx.save_for_backward(out, lse, philox, *problem)
        ctx.inputs = inputs.replaced(seed=None, offset=None, **dict.fromkeys(_PROBLEM_TENSORS))
        ctx.deterministic = deterministic
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[4]
        # The API detaches the LSE and randval, so only out brings a gradient: autograd need not
        # make zero tensors for the other two on every call.
        ctx.set_materialize_grads(False)
        return out, lse, q.new_empty(0, dtype=torch.uint8) if randval is None else randval

    @staticmethod
    def backward(ctx, dout, _dlse, _drandval):
        if dout is None:  # an undefined gradient of out (gradcheck's check_undefined_grad passes one)
            return (None,) * 8
        out, lse, philox, *problem = ctx.saved_tensors
        inputs = ctx.inputs.replaced(**dict(zip(_PROBLEM_TENSORS, problem)))
        # torch.use_deterministic_algorithms(True) turns the fixed-order dQ reduction on.
        deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dk, dv, dbias = ops.bwd(inputs, dout, out, lse, philox=philox, deterministic=deterministic,
                                    bias_grad=ctx.bias_grad)
        return None, dq, dk, dv, dbias, None, None, None


def use_custom_ops(q: Tensor) -> bool:
    """Whether a call must go through the custom ops: under torch.compile, for tensor subclasses
    (fake tensors), under dispatch modes (make_fx) and functorch transforms, which trace rather
    than run."""
    return (torch.compiler.is_compiling() or type(q) is not Tensor or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active())
