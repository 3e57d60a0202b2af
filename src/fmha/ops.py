"""Host launchers: allocate outputs, pick a tile config, compute the grid, launch the kernels."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import hopper
from .configs import bwd_config, fwd_config, head_dim_block
from .inputs import AttentionInputs
from .kernels import INTERPRET
from .kernels.bwd_convert_dq import attention_bwd_convert_dq_kernel
from .kernels.bwd_dot_do_o import attention_bwd_dot_do_o_kernel
from .kernels.bwd_dq_dk_dv import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel
from .kernels.fwd import attention_fwd_kernel
from .kernels.transpose import transpose_last_two_kernel
from .launch import cdiv, launch
from .masks import MaskType

LOG2E = 1.4426950408889634


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


# Triton marks an integer argument "divisible by 16" only when it is, and only then loads rows as
# vectors: without those hints on the strides the kernels load element by element, spill heavily,
# and on Triton 3.6 / sm_90 have read out of range (benchmarks/NOTES.md, 2026-11-30).
STRIDE_ALIGNMENT = 16
# transposed_last_two's tile side and warps: 3.2 TB/s on the H200 (a plain copy 4.3, torch's
# copy of the transposed view 0.6); 32 or 128 and 4 or 16 warps measured slower
TRANSPOSE_BLOCK, TRANSPOSE_WARPS = 64, 8


def is_kernel_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s head dim is contiguous and its offset and other strides are multiples of 16."""
    return (t.stride(-1) == 1 and t.storage_offset() % STRIDE_ALIGNMENT == 0
            and all(stride % STRIDE_ALIGNMENT == 0 for stride in t.stride()[:-1]))


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when ``is_kernel_layout``; else a copy whose rows are padded to a multiple of
    16 (a view of the first ``D`` columns), as FlashAttention pads odd head dims."""
    if is_kernel_layout(t):
        return t
    d = t.shape[-1]
    rows = t.new_empty((*t.shape[:-1], -(-d // STRIDE_ALIGNMENT) * STRIDE_ALIGNMENT))
    return rows[..., :d].copy_(t)


def _aligned(inputs: AttentionInputs) -> AttentionInputs:
    """The problem with q, k and v in ``kernel_layout`` (itself when they are: no copy of the dataclass)."""
    q, k, v = kernel_layout(inputs.q), kernel_layout(inputs.k), kernel_layout(inputs.v)
    if q is inputs.q and k is inputs.k and v is inputs.v:
        return inputs
    return inputs.replaced(q=q, k=k, v=v)


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
    inputs = _aligned(inputs)
    q = inputs.q
    device = q.device
    # The kernel writes only the rows of sequences; padding rows are returned as zeros.
    if out is None:
        alloc = torch.zeros if inputs.has_padding_q else torch.empty
        out = alloc(inputs.out_shape, dtype=q.dtype, device=device)
    elif inputs.has_padding_q:
        out.zero_()
    # LSE is always written (it costs one float per row); callers that did not ask get None.
    lse = torch.empty(inputs.lse_shape, dtype=torch.float32, device=device)
    if inputs.has_padding_q:
        lse.fill_(float("-inf"))
    has_dropout = inputs.dropout_p > 0
    randval = None
    if has_dropout and return_randval:
        randval = torch.zeros(inputs.randval_shape, dtype=torch.uint8, device=device)
    # (a caller's ``out`` with misaligned strides takes the portable kernel, which writes any layout;
    # the fast path does not write the dropout bytes: return_randval takes the portable kernel)
    if is_kernel_layout(out) and randval is None and hopper.fwd_unsupported(inputs) is None:
        hopper.launch_fwd(inputs, out, lse, philox)
        return out, lse if return_lse else None, randval
    grid, kwargs = fwd_kernel_args(inputs, out, lse, randval, philox)
    if grid[0] > 0:
        launch(attention_fwd_kernel, grid, kwargs)
    return out, lse if return_lse else None, randval


def checked_philox(inputs: AttentionInputs, philox: torch.Tensor | None) -> torch.Tensor | None:
    """``philox`` when dropout is on (it must be given then), else None."""
    if inputs.dropout_p == 0:
        return None
    if philox is None:
        raise ValueError("philox: expected the (seed, offset) tensor when dropout_p > 0, got None")
    return philox


def _problem_args(inputs: AttentionInputs, philox: torch.Tensor | None) -> dict:
    """Kernel arguments every phase shares: sequences, strides of q/k/v/bias, mask, ALiBi, dropout."""
    q, k, v = inputs.q, inputs.k, inputs.v
    group = inputs.group
    bias = inputs.bias
    bias_strides = (0, 0, 0, 0)
    if bias is not None:
        bias_strides = (0, *bias.stride()) if group else tuple(bias.stride())
    alibi = inputs.alibi_slopes
    mode, alibi_from_bottom_right = alibi_mode(inputs)
    mask = inputs.mask
    has_dropout = inputs.dropout_p > 0
    log2_scores = q.dtype in (torch.float16, torch.bfloat16)
    return dict(
        Q=q, K=k, V=v, Bias=bias, AlibiSlopes=alibi,
        PhiloxSeedOffset=checked_philox(inputs, philox),
        SeqstartQ=inputs.seqstart_q, SeqstartK=inputs.seqstart_k, SeqlenK=inputs.seqlen_k,
        SeqstartPaddedQ=inputs.seqstart_padded_q, SeqstartPaddedK=inputs.seqstart_padded_k,
        CuSeqlenQ=inputs.cu_seqlen_q, CuSeqlenK=inputs.cu_seqlen_k,
        **_named("q", _row_strides(q, group)),
        **_named("k", _row_strides(k, group)),
        **_named("v", _row_strides(v, group)),
        stride_bb=bias_strides[0], stride_bh=bias_strides[1],
        stride_bs=bias_strides[2], stride_bk=bias_strides[3],
        stride_ab=alibi.stride(0) if alibi is not None else 0,
        stride_ah=alibi.stride(1) if alibi is not None else 0,
        seqlen_q=q.shape[1] if not group else 0,
        seqlen_k=k.shape[1] if not group else 0,
        nhead_q=inputs.nhead_q,
        head_ratio=inputs.nhead_q // inputs.nhead_k,
        # Scores in log2 units (exp2 of one subtraction) except for fp32/fp64, see to_score_units.
        qk_scale=inputs.scale * (LOG2E if log2_scores else 1.0),
        LOG2_SCORES=log2_scores,
        window_left=mask.left,
        window_right=mask.right,
        mask_bottom_right=int(mask.type == MaskType.BOTTOM_RIGHT),
        alibi_bottom_right=alibi_from_bottom_right,
        drop_threshold=dropout_threshold(inputs.dropout_p),
        HEAD_DIM_Q=inputs.head_dim_q,
        HEAD_DIM_V=inputs.head_dim_v,
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
        UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
    )


def _lse_strides(lse: torch.Tensor, group: bool) -> dict[str, int]:
    """(batch, head) strides of an LSE-shaped ``[B, Hq, Sq]`` or ``[Hq, rows]`` tensor (rows stride 1)."""
    if group:
        return dict(stride_lb=0, stride_lh=lse.stride(0))
    return dict(stride_lb=lse.stride(0), stride_lh=lse.stride(1))


def fwd_kernel_args(
    inputs: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    randval: torch.Tensor | None,
    philox: torch.Tensor | None,
) -> tuple[tuple[int], dict]:
    """Grid and keyword arguments of ``attention_fwd_kernel`` for one problem."""
    group = inputs.group
    cfg = fwd_config(inputs.q.dtype, inputs.head_dim_q, inputs.head_dim_v, has_bias=inputs.bias is not None,
                     has_dropout=inputs.dropout_p > 0)
    num_m_blocks = cdiv(inputs.max_seqlen_q, cfg.block_m)
    grid = (num_m_blocks * inputs.nhead_q * inputs.batch,)
    randval_strides = (0, 0, 0)
    if randval is not None:
        randval_strides = (0, randval.stride(0), randval.stride(1)) if group else randval.stride()[:3]
    kwargs = dict(
        **_problem_args(inputs, philox),
        Out=out, Lse=lse, RandVal=randval,
        **_named("o", _row_strides(out, group)),
        **_lse_strides(lse, group),
        stride_rb=randval_strides[0], stride_rh=randval_strides[1], stride_rs=randval_strides[2],
        num_m_blocks=num_m_blocks,
        drop_rescale=1.0 / (1.0 - inputs.dropout_p),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        STORE_RANDVAL=randval is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return grid, kwargs


def _named(prefix: str, strides: tuple[int, int, int]) -> dict[str, int]:
    return {f"stride_{prefix}b": strides[0], f"stride_{prefix}s": strides[1], f"stride_{prefix}h": strides[2]}


class Launch(NamedTuple):
    """One kernel launch: ``launch(kernel, grid, kwargs)``."""

    kernel: object
    grid: tuple[int]
    kwargs: dict


def bwd(
    inputs: AttentionInputs,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    philox: torch.Tensor | None = None,
    deterministic: bool = False,
    bias_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernels; returns ``(dq, dk, dv, dbias)``.

    ``dbias`` (when ``bias_grad``) is the true gradient reduced to the bias's own shape.
    """
    inputs, dout, out, grads, dbias_t, fast = _bwd_setup(inputs, dout, out, deterministic, bias_grad)
    if fast:
        hopper.launch_bwd(inputs, dout, out, lse, *grads[:3], deterministic, dbias_t, philox)
    else:
        for kernel, grid, kwargs in _portable_bwd_launches(inputs, dout, out, lse, grads, philox, deterministic):
            launch(kernel, grid, kwargs)
    dq, dk, dv, dbias_full = grads
    return dq, dk, dv, _reduce_dbias(inputs, dbias_full)


def bwd_launches(
    inputs: AttentionInputs,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    philox: torch.Tensor | None = None,
    deterministic: bool = False,
    bias_grad: bool = False,
) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Allocate the backward's outputs and workspaces; return its launches, in order, and
    ``(dq, dk, dv, dbias_full)`` (``dbias_full`` per (batch, head, row, key), before reduction).

    Atomic mode accumulates dQ in a padded fp32 buffer (see ``_dq_accumulator``); deterministic
    mode computes dQ in programs that own their query tile and needs no workspace. Problems the
    Hopper fast path covers (``hopper.bwd_unsupported``) take its three launches instead.
    """
    inputs, dout, out, grads, dbias_t, fast = _bwd_setup(inputs, dout, out, deterministic, bias_grad)
    if fast:
        return [Launch(*entry) for entry in hopper.bwd_launches(inputs, dout, out, lse, *grads[:3], deterministic,
                                                                dbias_t, philox)], grads
    return _portable_bwd_launches(inputs, dout, out, lse, grads, philox, deterministic), grads


def _bwd_setup(inputs: AttentionInputs, dout: torch.Tensor, out: torch.Tensor, deterministic: bool,
               bias_grad: bool):
    """The backward's inputs in the kernels' layouts, its outputs ``(dq, dk, dv, dbias_full)``,
    the fast path's transposed dS buffer (or None), and whether the fast path runs it."""
    inputs = _aligned(inputs)
    dout, out = kernel_layout(dout), kernel_layout(out)
    q, k, v = inputs.q, inputs.k, inputs.v
    group = inputs.group
    device = q.device
    # Rows no program writes must read as zero: padding, and every key row when no query exists.
    no_queries = inputs.batch * inputs.nhead_q == 0 or inputs.max_seqlen_q == 0
    padded_q = inputs.has_padding_q
    padded_k = group or inputs.cu_seqlen_k is not None or no_queries
    dq = (torch.zeros if padded_q else torch.empty)(q.shape, dtype=q.dtype, device=device)
    dk = (torch.zeros if padded_k else torch.empty)(k.shape, dtype=k.dtype, device=device)
    dv = (torch.zeros if padded_k else torch.empty)(v.shape, dtype=v.dtype, device=device)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    fast = not no_queries and hopper.bwd_unsupported(inputs, deterministic, bias_grad) is None
    dbias_full = dbias_t = None
    if bias_grad and fast:  # dS in q's dtype, written transposed (see hopper.bwd_launches)
        batch, nhead, seqlen_q, seqlen_k = inputs.bias.shape
        dbias_t = (torch.zeros if inputs.mask.is_causal else torch.empty)(
            (batch, nhead, seqlen_k, seqlen_q), dtype=q.dtype, device=device)
        dbias_full = dbias_t.transpose(-1, -2)
    elif bias_grad:
        dbias_full = torch.zeros(inputs.bias.shape, dtype=acc_dtype, device=device)
    return inputs, dout, out, (dq, dk, dv, dbias_full), dbias_t, fast


def _portable_bwd_launches(inputs: AttentionInputs, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           grads: tuple, philox: torch.Tensor | None, deterministic: bool) -> list[Launch]:
    """The portable kernels' backward launches into ``grads`` (none without a query row)."""
    if inputs.batch * inputs.nhead_q == 0 or inputs.max_seqlen_q == 0:
        return []
    dq, dk, dv, dbias_full = grads
    q, group = inputs.q, inputs.group
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    cfg = bwd_config(q.dtype, inputs.head_dim_q, inputs.head_dim_v, has_bias=inputs.bias is not None,
                     has_dropout=inputs.dropout_p > 0)
    common = _problem_args(inputs, philox)
    keep = 1.0 - inputs.dropout_p
    rescale = 1.0 / keep

    # D = (1 - p) * rowsum(dO * O), laid out like LSE.
    delta = torch.empty_like(lse)
    num_m_blocks = cdiv(inputs.max_seqlen_q, cfg.block_m_dq)
    grid_q = (num_m_blocks * inputs.nhead_q * inputs.batch,)
    launches = [Launch(attention_bwd_dot_do_o_kernel, grid_q, dict(
        Out=out, DOut=dout, Delta=delta, SeqstartQ=inputs.seqstart_q,
        SeqstartPaddedQ=inputs.seqstart_padded_q, CuSeqlenQ=inputs.cu_seqlen_q,
        **_named("o", _row_strides(out, group)), **_named("do", _row_strides(dout, group)),
        **_lse_strides(lse, group), seqlen_q=common["seqlen_q"], nhead_q=inputs.nhead_q,
        num_m_blocks=num_m_blocks, p_keep=keep, HEAD_DIM_V=inputs.head_dim_v,
        BLOCK_M=cfg.block_m_dq, BLOCK_DV=common["BLOCK_DV"], IS_GROUP=group,
        HAS_PADDED_Q=common["HAS_PADDED_Q"], HAS_CU_SEQLEN_Q=common["HAS_CU_SEQLEN_Q"],
    ))]

    dq_acc, dq_acc_desc = (dq, None)
    if not deterministic:
        dq_acc, dq_acc_desc = _dq_accumulator(inputs, acc_dtype, common["BLOCK_DQ"], cfg.block_m)
    dbias_strides = (0, 0, 0, 0)
    if dbias_full is not None:
        dbias_strides = (0, *dbias_full.stride()) if group else dbias_full.stride()
    num_n_blocks = cdiv(inputs.max_seqlen_k, cfg.block_n)
    grid_k = (num_n_blocks * inputs.nhead_k * inputs.batch,)
    launches.append(Launch(attention_bwd_dkdv_kernel, grid_k, dict(
        **common, DOut=dout, Lse=lse, Delta=delta, DQAcc=dq_acc, DQAccDesc=dq_acc_desc, DK=dk, DV=dv,
        DBias=dbias_full, **_named("do", _row_strides(dout, group)), **_lse_strides(lse, group),
        **_named("dq", _row_strides(dq_acc, group)),
        dq_desc_rows_per_batch=0 if group else q.shape[1], **_named("dk", _row_strides(dk, group)),
        **_named("dv", _row_strides(dv, group)),
        stride_dbb=dbias_strides[0], stride_dbh=dbias_strides[1],
        stride_dbs=dbias_strides[2], stride_dbk=dbias_strides[3],
        nhead_k=inputs.nhead_k, num_n_blocks=num_n_blocks,
        dq_scale=inputs.scale * rescale, dk_scale=inputs.scale * rescale, dv_scale=rescale,
        drop_rescale=rescale, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        STORE_DBIAS=dbias_full is not None, ATOMIC_DQ=not deterministic, DQ_TMA=dq_acc_desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )))
    if deterministic:
        launches.append(Launch(attention_bwd_dq_kernel, grid_q, dict(
            **common, DOut=dout, Lse=lse, Delta=delta, DQ=dq,
            **_named("do", _row_strides(dout, group)), **_lse_strides(lse, group),
            **_named("dq", _row_strides(dq, group)),
            num_m_blocks=num_m_blocks, dq_scale=inputs.scale * rescale,
            BLOCK_M=cfg.block_m_dq, BLOCK_N=cfg.block_n_dq,
            num_warps=cfg.num_warps_dq, num_stages=cfg.num_stages_dq,
        )))
    else:
        launches.append(Launch(attention_bwd_convert_dq_kernel, grid_q, dict(
            DQAcc=dq_acc, DQ=dq, SeqstartQ=inputs.seqstart_q, SeqstartPaddedQ=inputs.seqstart_padded_q,
            CuSeqlenQ=inputs.cu_seqlen_q, **_named("a", _row_strides(dq_acc, group)),
            **_named("dq", _row_strides(dq, group)), seqlen_q=common["seqlen_q"],
            nhead_q=inputs.nhead_q, num_m_blocks=num_m_blocks, HEAD_DIM_Q=inputs.head_dim_q,
            BLOCK_M=cfg.block_m_dq, BLOCK_DQ=common["BLOCK_DQ"], IS_GROUP=group,
            HAS_PADDED_Q=common["HAS_PADDED_Q"], HAS_CU_SEQLEN_Q=common["HAS_CU_SEQLEN_Q"],
        )))
    return launches


def _dq_accumulator(inputs: AttentionInputs, dtype: torch.dtype, block_dq: int, block_m: int):
    """The atomic mode's dQ accumulator (fp32, fp64 for fp64 inputs) and, with a TMA unit, its descriptor.

    Laid out like q with the head dim padded to ``block_dq`` (``q.numel() / head_dim_q * block_dq``
    values), so that every head's tile is a 16-byte-aligned box: interior tiles add into it with
    one bulk reduction, edge tiles with masked per-element atomics.
    """
    q = inputs.q
    acc = torch.zeros((*q.shape[:-1], block_dq), dtype=dtype, device=q.device)
    # Bulk reductions need Hopper's TMA; the interpreter and fp64 take the per-element path.
    # (CPU tensors outside the interpreter only occur in fmha.compile_check, which targets sm_90.)
    on_gpu = q.device.type == "cuda"
    if INTERPRET or dtype == torch.float64 or (on_gpu and torch.cuda.get_device_capability(q.device)[0] < 9):
        return acc, None
    rows = acc.view(-1, inputs.nhead_q * block_dq)
    return acc, TensorDescriptor.from_tensor(rows, [block_m, block_dq])


def _reduce_dbias(inputs: AttentionInputs, dbias_full: torch.Tensor | None) -> torch.Tensor | None:
    """Sum the per-(batch, head, row, key) gradient over the bias's broadcast dims (fixed order).
    The Hopper backward's is the transpose of a contiguous ``[B, H, S_k, S_q]`` buffer: summed
    there (contiguous), then transposed into a contiguous gradient (reading the strided view
    directly runs ~10x slower)."""
    if dbias_full is None:
        return None
    if dbias_full.stride(-2) == 1 and dbias_full.stride(-1) != 1:
        *lead, rows, keys = inputs.bias_shape  # the fast path's bias has full rows and keys
        summed = _summed_to(dbias_full.transpose(-1, -2), (*lead, keys, rows)).contiguous()
        return transposed_last_two(summed).to(inputs.bias_dtype)
    return _summed_to(dbias_full, inputs.bias_shape).to(inputs.bias_dtype)


def _summed_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t.sum_to_size(shape)``, but a reshape when only size-1 dims differ: torch runs a full
    reduction kernel even then (18 ms for a [1, 16, 16k, 16k] gradient on the H200)."""
    return t.reshape(shape) if t.numel() == math.prod(shape) else t.sum_to_size(shape)


def transposed_last_two(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t.transpose(-1, -2)`` for a contiguous ``t`` of at least 2 dims."""
    *lead, rows, cols = t.shape
    out = t.new_empty((*lead, cols, rows))
    count = t.numel() // max(rows * cols, 1)
    if t.numel():
        block = TRANSPOSE_BLOCK
        tiles_r, tiles_c = cdiv(rows, block), cdiv(cols, block)
        launch(transpose_last_two_kernel, (count * tiles_r * tiles_c,), dict(
            Src=t, Dst=out, rows=rows, cols=cols, tiles_r=tiles_r, tiles_c=tiles_c, BLOCK=block, num_warps=TRANSPOSE_WARPS))
    return out
