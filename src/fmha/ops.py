"""Host launchers: allocate outputs, pick a tile config, compute the grid, launch the kernels."""

from __future__ import annotations

import math

import torch
import triton

from .configs import fwd_config, head_dim_block
from .inputs import AttentionInputs
from .kernels import INTERPRET
from .kernels.fwd import attention_fwd_kernel
from .masks import MaskType



def _signed64(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def philox_seed_offset(seed, offset, device: torch.device) -> torch.Tensor:
    """``int64 [2]`` on ``device`` holding (seed, offset), read by the kernels.

    ``None`` seeds are drawn from PyTorch's generator for the device; ``None`` offsets too when
    the seed was drawn, else 0. Building it launches small fills, never a host synchronisation.
    """
    if seed is None:
        drawn = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)
        return drawn if offset is None else torch.cat([drawn[:1], _as_device(offset, device)])
    offset = 0 if offset is None else offset
    return torch.cat([_as_device(seed, device), _as_device(offset, device)])


def _as_device(value, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.reshape(1).to(device=device, dtype=torch.int64)
    return torch.full((1,), _signed64(value), dtype=torch.int64, device=device)


def dropout_threshold(p: float) -> int:
    """Largest random byte that keeps an element: ``floor(255 * (1 - p))``."""
    return int(math.floor(255.0 * (1.0 - p)))


def alibi_mode(inputs: AttentionInputs) -> tuple[int, int]:
    """(kernel ALiBi mode, whether its distance is measured from the bottom-right corner)."""
    if inputs.alibi_slopes is None:
        return 0, 0
    mask = inputs.mask
    if mask.is_causal:
        return 2, 0
    return 1, int(mask.type != MaskType.TOP_LEFT)


def _row_strides(t: torch.Tensor, group: bool) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of a ``[B, S, H, D]`` or ``[total, H, D]`` tensor."""
    if group:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def fwd(
    inputs: AttentionInputs,
    *,
    philox: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = True,
    return_randval: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel. ``philox`` is the int64 (seed, offset) pair when dropout is on."""
    q, k, v = inputs.q, inputs.k, inputs.v
    device, group = q.device, inputs.group
    if out is None:
        alloc = torch.zeros if inputs.has_padding_q else torch.empty
        out = alloc(inputs.out_shape, dtype=q.dtype, device=device)
    # LSE is always written (it costs one float per row); callers that did not ask get None.
    lse = torch.empty(inputs.lse_shape, dtype=torch.float32, device=device)
    if inputs.has_padding_q:
        lse.fill_(float("-inf"))
    has_dropout = inputs.dropout_p > 0
    randval = None
    if has_dropout and return_randval:
        randval = torch.zeros(inputs.randval_shape, dtype=torch.uint8, device=device)
    if has_dropout and philox is None:
        raise ValueError("philox: expected the (seed, offset) tensor when dropout_p > 0, got None")

    grid, kwargs = fwd_kernel_args(inputs, out, lse, randval, philox)
    if grid[0] > 0:
        attention_fwd_kernel[grid](**kwargs)
    return out, lse if return_lse else None, randval


def fwd_kernel_args(
    inputs: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    randval: torch.Tensor | None,
    philox: torch.Tensor | None,
) -> tuple[tuple[int], dict]:
    """Grid and keyword arguments of ``attention_fwd_kernel`` for one problem."""
    q, k, v = inputs.q, inputs.k, inputs.v
    group = inputs.group
    has_dropout = inputs.dropout_p > 0
    cfg = fwd_config(q.dtype, inputs.head_dim_q, inputs.head_dim_v)
    num_m_blocks = triton.cdiv(inputs.max_seqlen_q, cfg.block_m)
    grid = (num_m_blocks * inputs.nhead_q * inputs.batch,)

    bias = inputs.bias
    bias_strides = (0, 0, 0, 0)
    if bias is not None:
        bias_strides = (0, *bias.stride()) if group else tuple(bias.stride())
    alibi = inputs.alibi_slopes
    randval_strides = (0, 0, 0)
    if randval is not None:
        randval_strides = (0, randval.stride(0), randval.stride(1)) if group else randval.stride()[:3]
    lse_strides = (0, lse.stride(0)) if group else (lse.stride(0), lse.stride(1))
    mode, alibi_from_bottom_right = alibi_mode(inputs)
    mask = inputs.mask
    upcast = INTERPRET and q.dtype == torch.bfloat16

    kwargs = dict(
        Q=q, K=k, V=v, Out=out, Lse=lse, Bias=bias, AlibiSlopes=alibi, RandVal=randval,
        PhiloxSeedOffset=philox if has_dropout else None,
        SeqstartQ=inputs.seqstart_q, SeqstartK=inputs.seqstart_k, SeqlenK=inputs.seqlen_k,
        SeqstartPaddedQ=inputs.seqstart_padded_q, SeqstartPaddedK=inputs.seqstart_padded_k,
        CuSeqlenQ=inputs.cu_seqlen_q, CuSeqlenK=inputs.cu_seqlen_k,
        **_named("q", _row_strides(q, group)),
        **_named("k", _row_strides(k, group)),
        **_named("v", _row_strides(v, group)),
        **_named("o", _row_strides(out, group)),
        stride_lb=lse_strides[0], stride_lh=lse_strides[1],
        stride_bb=bias_strides[0], stride_bh=bias_strides[1],
        stride_bs=bias_strides[2], stride_bk=bias_strides[3],
        stride_ab=alibi.stride(0) if alibi is not None else 0,
        stride_ah=alibi.stride(1) if alibi is not None else 0,
        stride_rb=randval_strides[0], stride_rh=randval_strides[1], stride_rs=randval_strides[2],
        seqlen_q=q.shape[1] if not group else 0,
        seqlen_k=k.shape[1] if not group else 0,
        nhead_q=inputs.nhead_q,
        head_ratio=inputs.nhead_q // inputs.nhead_k,
        num_m_blocks=num_m_blocks,
        qk_scale=inputs.scale * 1.4426950408889634,
        window_left=mask.left,
        window_right=mask.right,
        mask_bottom_right=int(mask.type == MaskType.BOTTOM_RIGHT),
        alibi_bottom_right=alibi_from_bottom_right,
        drop_threshold=dropout_threshold(inputs.dropout_p),
        drop_rescale=1.0 / (1.0 - inputs.dropout_p),
        HEAD_DIM_Q=inputs.head_dim_q,
        HEAD_DIM_V=inputs.head_dim_v,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_DQ=head_dim_block(inputs.head_dim_q),
        BLOCK_DV=head_dim_block(inputs.head_dim_v),
        IS_GROUP=group,
        HAS_SEQLEN_K=inputs.seqlen_k is not None,
        HAS_PADDED_Q=inputs.seqstart_padded_q is not None,
        HAS_PADDED_K=inputs.seqstart_padded_k is not None,
        HAS_CU_SEQLEN_Q=inputs.cu_seqlen_q is not None,
        HAS_CU_SEQLEN_K=inputs.cu_seqlen_k is not None,
        HAS_BIAS=bias is not None,
        ALIBI_MODE=mode,
        HAS_DROPOUT=has_dropout,
        STORE_RANDVAL=randval is not None,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return grid, kwargs


def _named(prefix: str, strides: tuple[int, int, int]) -> dict[str, int]:
    return {f"stride_{prefix}b": strides[0], f"stride_{prefix}s": strides[1], f"stride_{prefix}h": strides[2]}

