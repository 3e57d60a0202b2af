"""torch.autograd glue: run the forward, save what the backward needs, run the backward."""

from __future__ import annotations

import torch

from . import ops
from .inputs import AttentionInputs


class AttentionFunction(torch.autograd.Function):
    """Differentiable in q, k, v and bias; lse and randval are returned without gradient."""

    @staticmethod
    def forward(ctx, q, k, v, bias, inputs: AttentionInputs, philox, deterministic: bool, return_randval: bool):
        out, lse, randval = ops.fwd(inputs, philox=philox, return_randval=return_randval)
        ctx.inputs = inputs
        ctx.deterministic = deterministic
        ctx.save_for_backward(out, lse, philox)
        ctx.mark_non_differentiable(lse)
        if randval is not None:
            ctx.mark_non_differentiable(randval)
        return out, lse, randval

    @staticmethod
    def backward(ctx, dout, _dlse, _drandval):
        out, lse, philox = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        # torch.use_deterministic_algorithms(True) turns the fixed-order dQ reduction on.
        deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dk, dv, dbias = ops.bwd(
            ctx.inputs, dout, out, lse, philox=philox, deterministic=deterministic,
            bias_grad=ctx.needs_input_grad[3],
        )
        return dq, dk, dv, dbias, None, None, None, None
