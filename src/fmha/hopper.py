"""Hopper fast path: launch the Gluon kernels (``kernels/hopper_fwd.py``, ``kernels/hopper_bwd.py``)
for the problems they cover; everything else runs the portable Triton kernels.

``fwd_unsupported`` and ``bwd_unsupported`` return why a problem takes the portable path, or None
when the fast path runs it: its kernels do not cover it, or (the forward's ``min_seqlen*`` in
``configs``) the portable kernels measured faster on such a problem. ``FMHA_PORTABLE=1`` turns
the fast path off; ``FMHA_PORTABLE=0`` runs it on everything its kernels cover, short sequences
too (its tests and ``fmha.fuzz --fast-path`` check the kernels that way). The Gluon modules are
imported only when a launch needs them: Triton's interpreter has no Gluon.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .configs import HOPPER_BWD_CONFIGS, HOPPER_FWD_CONFIGS
from .inputs import AttentionInputs
from .launch import cdiv, compiled_for, launch, run_compiled, still_valid
from .kernels import INTERPRET

LOG2E = 1.4426950408889634
# The Gluon dialect changes between Triton releases; these kernels are written against 3.6.
GLUON_TRITON = "3.6."
CONVERT_BLOCK = 4096
SCHEDULE_CHUNK = 1024  # sequences (and table entries) per step of the group-mode tile table
# The forward with dropout runs 12 warps (see HopperFwdConfig.dropout_consumer_regs), as does a
# group-mode window in two consumers (HopperFwdConfig.group_window_two_consumers).
DROPOUT_MAXNREG = 168


def device_unsupported(device: torch.device) -> str | None:
    """Why nothing runs the fast path on ``device``, or None."""
    if os.environ.get("FMHA_PORTABLE", "0") == "1":
        return "FMHA_PORTABLE=1"
    if INTERPRET or device.type != "cuda":
        return "not on a CUDA device"
    return _cuda_device_unsupported(_device_index(device))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _cuda_device_unsupported(index: int) -> str | None:
    """``device_unsupported`` of CUDA device ``index`` (cached: reading the capability costs a
    short call's host time every time)."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return "needs compute capability 9.0 (Hopper)"
    if not triton.__version__.startswith(GLUON_TRITON):
        return f"the Gluon kernels are written for Triton 3.6, this is {triton.__version__}"
    return None


def _problem_reason(inputs: AttentionInputs, head_dims, windows_and_alibi: bool = False,
                    group: bool = False, bias: bool = False, dropout: bool = False) -> str | None:
    """Why the fast path's kernels do not cover a problem; with ``windows_and_alibi`` they also
    take sliding windows and ALiBi, with ``group`` group mode whose queries and keys share one
    ``seqstart``, with ``bias`` an elementwise bias that TMA can read (see ``_bias_reason``), with
    ``dropout`` dropout."""
    q, k = inputs.q, inputs.k
    group_rows = group and inputs.group and _shared_sequences(inputs)
    bias_why = _bias_reason(inputs) if bias else None
    checks = [
        (q.dtype not in (torch.float16, torch.bfloat16), "fp16 and bf16 only"),
        (inputs.group and not group, "group (varlen) mode"),
        (inputs.group and not group_rows, "group mode without one seqstart shared by queries and keys, or padded"),
        (inputs.cu_seqlen_q is not None or inputs.cu_seqlen_k is not None or inputs.seqlen_k is not None,
         "per-batch sequence lengths"),
        (not inputs.group and q.shape[1] != k.shape[1], "seqlen_q != seqlen_k"),
        (inputs.head_dim_q != inputs.head_dim_v or inputs.head_dim_q not in head_dims,
         f"head dims {sorted(head_dims)} with dq == dv only"),
        (inputs.bias is not None and not bias, "elementwise bias"),
        (bias_why is not None, bias_why),
        (inputs.alibi_slopes is not None and not windows_and_alibi, "ALiBi"),
        (inputs.dropout_p > 0 and not dropout, "dropout"),
        (inputs.mask.is_window and not windows_and_alibi,
         "sliding-window mask"),
        (inputs.max_seqlen_q == 0 or inputs.batch * inputs.nhead_q == 0, "empty problem"),
    ]
    return next((why for failed, why in checks if failed), None)


def _bias_reason(inputs: AttentionInputs) -> str | None:
    """Why TMA cannot read this bias tile by tile: it wants batch mode, q's dtype, contiguous keys,
    a row stride (no broadcast over query rows) and 16-byte aligned strides and base."""
    bias = inputs.bias
    if bias is None:
        return None
    if inputs.group:
        return "elementwise bias in group mode"
    stride_b, stride_h, stride_row, stride_col = bias.stride()
    if bias.dtype != inputs.q.dtype:
        return f"an elementwise bias of dtype {bias.dtype}, not q's"
    if inputs.alibi_slopes is not None or inputs.mask.is_window:
        return "an elementwise bias with ALiBi or a sliding window"  # not compile-checked or tested together
    aligned = all(st * bias.element_size() % 16 == 0 for st in (stride_b, stride_h, stride_row))
    if stride_col != 1 or stride_row == 0 or not aligned or bias.data_ptr() % 16:
        return "an elementwise bias without contiguous keys, broadcast over query rows, or not 16-byte aligned"
    return None


def _shared_sequences(inputs: AttentionInputs) -> bool:
    """Group mode whose queries and keys are the same sequences (one ``seqstart`` tensor, checked
    without reading it) and whose rows are not padded."""
    q_starts, k_starts = inputs.seqstart_q, inputs.seqstart_k
    return (q_starts.data_ptr() == k_starts.data_ptr() and q_starts.shape == k_starts.shape
            and inputs.seqstart_padded_q is None and inputs.seqstart_padded_k is None)


def _slower_reason(inputs: AttentionInputs, min_seqlen: int, min_seqlen_causal: int) -> str | None:
    """Why the portable kernels run a problem the fast path covers: they measured faster there."""
    if os.environ.get("FMHA_PORTABLE") == "0":
        return None
    causal = inputs.mask.is_causal
    shortest = min_seqlen_causal if causal else min_seqlen
    if inputs.max_seqlen_q < shortest:
        kind = "causal " if causal else ""
        return (f"d={inputs.head_dim_q} {kind}sequences under {shortest} tokens: the portable kernels "
                "measured faster there (FMHA_PORTABLE=0 forces the fast path)")
    return None


def fwd_unsupported(inputs: AttentionInputs) -> str | None:
    """Why the Hopper forward does not run this problem, or None."""
    reason = device_unsupported(inputs.q.device) or _problem_reason(
        inputs, HOPPER_FWD_CONFIGS, windows_and_alibi=True, group=True, bias=True, dropout=True)
    if reason is None:
        cfg = HOPPER_FWD_CONFIGS[inputs.head_dim_q]
        if inputs.alibi_slopes is not None and inputs.mask.is_causal and not cfg.causal_alibi:
            return f"ALiBi under a causal mask at head dim {inputs.head_dim_q}"
        if inputs.bias is not None and not cfg.bias:
            return f"elementwise bias at head dim {inputs.head_dim_q}"
        if inputs.dropout_p > 0 and inputs.alibi_slopes is not None and not cfg.dropout_alibi:
            return f"ALiBi with dropout at head dim {inputs.head_dim_q}"
        if inputs.dropout_p > 0 and inputs.bias is not None and not cfg.bias_dropout_block_n:
            return f"an elementwise bias with dropout at head dim {inputs.head_dim_q}"
        if inputs.dropout_p > 0 and inputs.group:  # its consumers spill 1164 B at d=128
            return "dropout in group mode"
        if inputs.group and (inputs.batch >= 1 << 23 or inputs.nhead_q >= 1 << 20
                             or inputs.max_seqlen_q >= (1 << 20) * 64):
            return "group mode beyond the tile table's fields (2^23 sequences, 2^20 heads or query tiles)"
        if not fwd_persistent(inputs):
            reason = _slower_reason(inputs, cfg.min_seqlen, cfg.min_seqlen_causal)
    return reason


def bwd_unsupported(inputs: AttentionInputs, deterministic: bool, bias_grad: bool = False) -> str | None:
    """Why the Hopper backward does not run this problem, or None; ``bias_grad``: the bias's
    gradient is wanted too."""
    reason = device_unsupported(inputs.q.device) or _problem_reason(
        inputs, HOPPER_BWD_CONFIGS, windows_and_alibi=True, group=True, bias=True, dropout=True)
    if reason is None and inputs.dropout_p > 0:
        reason = _dropout_bwd_reason(inputs, deterministic)
    if reason is None and inputs.bias is not None:
        cfg = HOPPER_BWD_CONFIGS[inputs.head_dim_q]
        if not cfg.bias:
            reason = f"elementwise bias at head dim {inputs.head_dim_q}"
        elif deterministic:
            reason = "deterministic mode with an elementwise bias"
        elif bias_grad and not cfg.bias_grad:
            reason = f"the gradient of an elementwise bias at head dim {inputs.head_dim_q}"
    if reason is None and not HOPPER_BWD_CONFIGS[inputs.head_dim_q].windows_and_alibi:
        # everything else passed: what is left to refuse is a window, ALiBi or group mode
        reason = _problem_reason(inputs, HOPPER_BWD_CONFIGS)
        if reason is not None:
            reason = f"{reason} at head dim {inputs.head_dim_q}"
    if reason is None and deterministic:
        reason = _deterministic_reason(inputs)
    return reason


def _dropout_bwd_reason(inputs: AttentionInputs, deterministic: bool) -> str | None:
    """Why the backward with dropout cannot take the fast path, or None (its producer warpgroup
    makes the masks; see kernels/hopper_bwd's DROPOUT)."""
    cfg = HOPPER_BWD_CONFIGS[inputs.head_dim_q]
    features = inputs.alibi_slopes is not None or inputs.nhead_q != inputs.nhead_k or inputs.mask.is_window
    why = [
        (not cfg.dropout, f"at head dim {inputs.head_dim_q}"),
        (features and not cfg.dropout_features, f"with a sliding window, ALiBi or GQA at head dim {inputs.head_dim_q}"),
        (inputs.group, "in group mode"),
        (inputs.bias is not None, "with an elementwise bias"),
        (deterministic, "in deterministic mode"),
    ]
    return next((f"dropout {what}" for refused, what in why if refused), None)


def _deterministic_reason(inputs: AttentionInputs) -> str | None:
    """Why the deterministic mode cannot take the fast path, or None. Each query tile's dQ adds go
    in a fixed order of its key tiles: the narrow kernel's (``kernels/hopper_bwd._rank``) has a CTA
    wait for one launched after it, so a head's key tiles must all be resident at once, one CTA per
    SM; the wide kernel's (head dim 256) too where they fit (``_diagonal_order``), else only for
    ones launched before it."""
    from .kernels.hopper_bwd import BLOCK_N

    why = [
        (not HOPPER_BWD_CONFIGS[inputs.head_dim_q].deterministic_chains, f"at head dim {inputs.head_dim_q}"),
        (inputs.group, "in group mode"),
        (inputs.nhead_q != inputs.nhead_k, "with GQA/MQA"),
        (inputs.mask.is_window, "with a sliding window"),
    ]
    for refused, what in why:
        if refused:
            return f"deterministic mode {what}"
    key_tiles = cdiv(inputs.max_seqlen_q, BLOCK_N.value)
    sms = _sm_count(_device_index(inputs.q.device))
    if inputs.head_dim_q != 256 and key_tiles > sms:
        return f"deterministic mode over {key_tiles} key tiles of {BLOCK_N.value}: more than the {sms} SMs"
    return None


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype, swizzle: bool):
    """The shared-memory layout of a TMA box (cached: building one costs more than the launch)."""
    from triton.experimental.gluon import language as gl

    if not swizzle:  # fp32 statistics and the dQ staging tile: a 128B swizzle of those spills
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=len(block))
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


@functools.lru_cache(maxsize=4096)
def _desc_fields(shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype, block: tuple[int, ...],
                 swizzle: bool) -> dict | None:
    """A TMA descriptor's fields but its base, or None where TMA does not take these strides (the
    last 1, the others multiples of 16 bytes) or shape; shared by every descriptor of this
    geometry (nothing writes them). Keyed by the swizzle, not the layout: hashing a layout costs
    a microsecond."""
    from triton._utils import validate_block_shape

    validate_block_shape(list(block))  # raises for a dim that is not a power of two, or too many elements
    element_size = dtype.itemsize
    if 0 in shape or strides[-1] != 1 or any(st * element_size % 16 for st in strides[:-1]):
        return None
    return dict(shape=list(shape), strides=list(strides), block_shape=list(block),
                layout=_smem_layout(block, dtype, swizzle), padding="zero")


@functools.cache
def _descriptor_class():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor


def _tma_desc(base: torch.Tensor, shape, strides, block: tuple[int, ...], swizzle: bool):
    """``TensorDescriptor(base, shape, strides, block, _smem_layout(block, base.dtype, swizzle))``
    without its constructor's checks when they pass (they cost more host time than the launch: 13
    descriptors in a forward and backward at 1k; the checks' verdict and the fields are cached per
    geometry); when one fails, the constructor itself raises."""
    fields = _desc_fields(tuple(shape), tuple(strides), base.dtype, block, swizzle)
    if fields is None or base.data_ptr() % 16:
        return _descriptor_class()(base, list(shape), list(strides), list(block),
                                   _smem_layout(block, base.dtype, swizzle))
    return _rebased(fields, base)


def _rebased(fields: dict, base: torch.Tensor):
    """A TMA descriptor with these fields over ``base``, its constructor's checks passed before."""
    desc = object.__new__(_descriptor_class())
    desc.__dict__.update(fields, base=base)
    return desc


def _desc(t: torch.Tensor, rows: int, cols: int, swizzle: bool = True):
    """A TMA descriptor over a ``[B, S, H, D]`` tensor with its own strides, box ``[1, rows, 1, cols]``."""
    return _box_desc(t, (1, rows, 1, cols), swizzle)


def _box_desc(t: torch.Tensor, block: tuple[int, ...], swizzle: bool = True):
    """A TMA descriptor over ``t`` with its own shape and strides and this box."""
    return _tma_desc(t, t.shape, t.stride(), block, swizzle)


def _stat_desc(rows: torch.Tensor, block_m: int):
    """``[B*H, S_pad]`` fp32 statistics (the rows of ``[B, H, S_pad]``), unswizzled boxes ``[1, block_m]``."""
    return _tma_desc(rows, rows.shape, rows.stride(), (1, block_m), False)


def _window_and_alibi_args(inputs: AttentionInputs, placeholder: torch.Tensor) -> dict:
    """The window and ALiBi arguments of the forward and the narrow backward; ``placeholder``, any
    fp32 tensor, stands in for absent slopes (never read)."""
    from .ops import alibi_mode

    mask = inputs.mask
    # seqlen_q == seqlen_k here, so both corners align; an unbounded side reaches past every key.
    reach = 2 * inputs.max_seqlen_q
    slopes = inputs.alibi_slopes
    alibi_strides = (0, 0) if slopes is None else slopes.stride()  # [B, H], expanded over the batch
    return dict(
        alibi_ptr=placeholder if slopes is None else slopes,
        left=reach if mask.left < 0 else min(mask.left, reach),
        right=reach if mask.right < 0 else min(mask.right, reach),
        stride_ab=alibi_strides[0], stride_ah=alibi_strides[1],
        WINDOW=mask.is_window, ALIBI=alibi_mode(inputs)[0],
    )


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _bias_args(inputs: AttentionInputs, rows: int, block_n: int) -> dict:
    """The bias arguments of the forward and the narrow backward: a descriptor over ``[B or 1,
    H or 1, S, S]`` with boxes ``[1, 1, rows, block_n]``, and the coordinate step of batch and head
    (0 where the bias is broadcast); without a bias the K descriptor stands in (never read)."""
    bias = inputs.bias
    if bias is None:
        return dict(BIAS=False, bias_step_b=0, bias_step_h=0)
    batch, nhead, seqlen_q, seqlen_k = bias.shape
    stride_b, stride_h, stride_row, _ = bias.stride()
    # A broadcast dim is one row of the descriptor, read at coordinate 0; its stride only needs to
    # be valid for TMA.
    shape = [batch if stride_b else 1, nhead if stride_h else 1, seqlen_q, seqlen_k]
    strides = [stride_b or stride_row * seqlen_q, stride_h or stride_row * seqlen_q, stride_row, 1]
    block = (1, 1, rows, block_n)
    desc = _tma_desc(bias, shape, strides, block, True)
    return dict(bias_desc=desc, BIAS=True, bias_step_b=int(stride_b != 0), bias_step_h=int(stride_h != 0))


def _dropout_args(inputs: AttentionInputs, philox: torch.Tensor | None, placeholder: torch.Tensor) -> dict:
    """The dropout arguments; ``placeholder``, any tensor, stands in for ``philox`` without dropout."""
    from .ops import checked_philox, dropout_threshold

    if checked_philox(inputs, philox) is None:
        return dict(philox_ptr=placeholder, threshold=0, drop_scale=1.0, DROPOUT=False)
    return dict(philox_ptr=philox, threshold=dropout_threshold(inputs.dropout_p),
                drop_scale=1.0 / (1.0 - inputs.dropout_p), DROPOUT=True)


def fwd_persistent(inputs: AttentionInputs) -> bool:
    """Whether the fast forward runs persistent CTAs (one per SM, each running query tiles in
    turn) rather than one CTA per tile: where a tile's keys are few, so its fill and drain weigh
    most: short sequences (``persistent_max_seqlen*`` in the config), and a sliding window alone
    whose band is as short (``persistent_window_regs``). Not in group mode (most tiles of the longest
    sequence's grid are empty there), nor with ALiBi, a bias or dropout (persistent, ALiBi spills
    16-128 B; the others were not measured so)."""
    from .kernels.hopper_fwd import ROWS_PER_CONSUMER

    cfg = HOPPER_FWD_CONFIGS[inputs.head_dim_q]
    features = inputs.alibi_slopes is not None or inputs.bias is not None or inputs.dropout_p > 0
    if inputs.group or features:
        return False
    keys = inputs.max_seqlen_q
    if inputs.mask.is_window:
        if not cfg.persistent_window_regs:
            return False
        left, right = inputs.mask.left, inputs.mask.right
        if left >= 0 and right >= 0:  # the band of one query tile: at most left + rows + right keys
            keys = min(keys, left + right + ROWS_PER_CONSUMER.value * cfg.consumers)
    limit = cfg.persistent_max_seqlen_causal if inputs.mask.is_causal else cfg.persistent_max_seqlen
    return keys <= limit


def fwd_launches(inputs: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, philox: torch.Tensor | None = None):
    """The forward's (kernel, grid, kwargs), in order: in group mode the tile table's, then the
    forward's; ``out`` ``[B, S, H, D]`` (group mode ``[T, H, D]``) and ``lse`` ``[B, H, S]``
    (``[H, T]``) contiguous; ``philox`` the int64 (seed, offset) pair when dropout is on.

    A plain batch-mode problem (no bias, ALiBi or dropout) whose geometry was built before is
    rebuilt from its plan (``_Plan``): the launch with the tensors and descriptor bases of this
    call. Short calls are bound by the host, and building the launch cost it an eighth of such a
    call."""
    tensors = (inputs.q, inputs.k, inputs.v, out, lse)
    plan = _fwd_plan(inputs, tensors)
    if plan is None:
        return _build_fwd_launches(inputs, out, lse, philox)
    return plan.launches(tensors)


def launch_fwd(inputs: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, philox: torch.Tensor | None = None):
    """Launch ``fwd_launches``; a planned one, after its first launch, straight through its
    compiled kernel (no launch key to build: the plan's signature fixes it)."""
    tensors = (inputs.q, inputs.k, inputs.v, out, lse)
    plan = _fwd_plan(inputs, tensors)
    if plan is None:
        for kernel, grid, kwargs in _build_fwd_launches(inputs, out, lse, philox):
            launch(kernel, grid, kwargs)
    else:
        plan.launch(tensors)


def _fwd_plan(inputs: AttentionInputs, tensors: tuple) -> _Plan | None:
    """The forward's plan for (q, k, v, out, lse), built on its geometry's first call."""
    return _plan("fwd", HOPPER_FWD_CONFIGS[inputs.head_dim_q], inputs, tensors,
                 lambda: _build_fwd_launches(inputs, *tensors[3:]))


def _plan(direction: str, cfg, inputs: AttentionInputs, tensors: tuple, build) -> _Plan | None:
    """The plan of a plain problem's launches over ``tensors`` (None for other problems), built
    from ``build()`` on its geometry's first call and again when its head dim's config object
    changes (a tuning sweep swaps the configs)."""
    signature = _plain_signature(inputs, tensors)
    if signature is None:
        return None
    plan = _PLANS.get((direction, signature))
    if plan is None or plan.cfg is not cfg:
        plan = _new_plan((direction, signature), cfg, build(), tensors)
    return plan


class _PlannedLaunch:
    """One launch as a template: kernel, grid, the arguments that are no tensor (``static``) and
    for the others (their names, the index of their tensor in the call's tensors, a descriptor's
    fields or None), one entry per object. After its first launch it also holds the compiled
    kernel and the same template in launch order."""

    def __init__(self, kernel, grid: tuple, static: dict, args: list):
        self.kernel, self.grid, self.static, self.args = kernel, grid, static, args
        self.compiled = None
        self.values: list = []  # the static values in launch order, the others' places None
        self.places: list = []  # ([their places in launch order], index, fields), as ``args``

    def kwargs(self, tensors: tuple) -> dict:
        kwargs = dict(self.static)
        for names, index, fields in self.args:
            value = _argument(tensors, index, fields)
            for name in names:
                kwargs[name] = value
        return kwargs

    def launch(self, tensors: tuple) -> None:
        if self.compiled is None or not still_valid(self.compiled):
            kwargs = self.kwargs(tensors)
            launch(self.kernel, self.grid, kwargs)
            found = compiled_for(self.kernel, kwargs)
            if found is not None:
                compiled, names = found
                place = {name: i for i, name in enumerate(names)}
                self.values = [self.static.get(name) for name in names]
                self.places = [([place[name] for name in names_], index, fields)
                               for names_, index, fields in self.args]
                self.compiled = compiled  # last: another thread may launch from it at once
            return
        values = self.values.copy()
        for places, index, fields in self.places:
            value = _argument(tensors, index, fields)
            for i in places:
                values[i] = value
        run_compiled(self.compiled, self.grid, values)


def _argument(tensors: tuple, index: int, fields: dict | None):
    """A planned tensor argument of this call: ``tensors[index]``, or a descriptor over it."""
    return tensors[index] if fields is None else _rebased(fields, tensors[index])


class _Plan:
    """A plain problem's launches as templates over its tensors (``_PlannedLaunch``), and the
    config they were built with (a plan built with another is stale)."""

    def __init__(self, cfg, launches: list[_PlannedLaunch]):
        self.cfg, self.planned = cfg, launches

    def launches(self, tensors: tuple) -> list:
        return [(p.kernel, p.grid, p.kwargs(tensors)) for p in self.planned]

    def launch(self, tensors: tuple) -> None:
        for planned in self.planned:
            planned.launch(tensors)


# Launch plans by direction and ``_plain_signature``; cleared at 1024 plans.
_PLANS: dict[tuple, _Plan] = {}


def _plain_signature(inputs: AttentionInputs, tensors: tuple) -> tuple | None:
    """Everything the launch builders read of a plain batch-mode problem (no bias, ALiBi or
    dropout) but its tensors' addresses (all 16-byte aligned here, which is what the launches
    specialize on), or None for other problems. ``tensors``: every tensor the launches take.
    Which of them are one object is part of it: a plan finds its arguments' tensors by identity,
    so one built from ``attention(x, x, x)`` must not serve three tensors."""
    if inputs.group or inputs.bias is not None or inputs.alibi_slopes is not None or inputs.dropout_p > 0:
        return None
    aligned = 0
    for t in tensors:
        aligned |= t.data_ptr()
    if aligned % 16:
        return None
    first: dict[int, int] = {}
    aliases = tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))
    return (aliases, *[(t.shape, t.stride(), t.dtype) for t in tensors], inputs.q.device, inputs.batch, inputs.nhead_q,
            inputs.nhead_k, inputs.head_dim_q, inputs.max_seqlen_q, inputs.scale, inputs.mask)


def _new_plan(key: tuple, cfg, launches: list, tensors: tuple) -> _Plan | None:
    """The plan of ``launches`` (built with ``cfg``) whose tensor arguments are ``tensors`` or TMA
    descriptors over them, stored by ``key``; None if some argument is another tensor."""
    planned = []
    for kernel, grid, kwargs in launches:
        static, args = {}, {}
        for name, value in kwargs.items():
            base = value.base if type(value) is _descriptor_class() else value
            if not isinstance(base, torch.Tensor):
                static[name] = value
                continue
            index = next((i for i, t in enumerate(tensors) if t is base), None)
            if index is None:
                return None
            if id(value) not in args:
                fields = None if base is value else {f: x for f, x in value.__dict__.items() if f != "base"}
                args[id(value)] = ([], index, fields)
            args[id(value)][0].append(name)
        planned.append(_PlannedLaunch(kernel, grid, static, [(tuple(names), index, fields)
                                                             for names, index, fields in args.values()]))
    if len(_PLANS) >= 1024:
        _PLANS.clear()
    plan = _PLANS[key] = _Plan(cfg, planned)
    return plan


def _build_fwd_launches(inputs: AttentionInputs, out: torch.Tensor, lse: torch.Tensor,
                        philox: torch.Tensor | None = None):
    """``fwd_launches`` built from the problem."""
    from .kernels.hopper_fwd import ROWS_PER_CONSUMER, attention_fwd_hopper_kernel, hopper_fwd_varlen_schedule

    q, k, v = inputs.q, inputs.k, inputs.v
    if inputs.group:  # [1, T, H, D] views: sequence b is a row range of the one "batch"
        q, k, v, out = (t.unsqueeze(0) for t in (q, k, v, out))
    batch, seqlen, nhead, head_dim = inputs.batch, inputs.max_seqlen_q, inputs.nhead_q, inputs.head_dim_q
    lse_strides = (0, lse.stride(0)) if inputs.group else (lse.stride(0), lse.stride(1))
    cfg = HOPPER_FWD_CONFIGS[head_dim]
    dropout = inputs.dropout_p > 0
    persistent = fwd_persistent(inputs)
    # (consumers, registers a consumer thread, kernel-wide maxnreg): see HopperFwdConfig's dropout
    # and group-window fields
    if dropout:
        consumers, consumer_regs, maxnreg = 2, cfg.dropout_consumer_regs, DROPOUT_MAXNREG
    elif inputs.group and inputs.mask.is_window and inputs.alibi_slopes is None and cfg.group_window_two_consumers:
        consumers, consumer_regs, maxnreg = 2, 240, DROPOUT_MAXNREG
    else:
        consumers, consumer_regs, maxnreg = cfg.consumers, cfg.consumer_regs, cfg.maxnreg
        if inputs.mask.is_window and persistent:
            consumer_regs = cfg.persistent_window_regs
    if dropout and inputs.bias is not None:  # (see HopperFwdConfig.bias_dropout_block_n)
        block_n, stages = cfg.bias_dropout_block_n, cfg.bias_dropout_stages
    else:
        block_n, stages = cfg.block_n, cfg.stages
    rows = ROWS_PER_CONSUMER.value
    block_m = rows * consumers
    launches = []
    if inputs.group:
        # One CTA per tile of the table: each sequence has at most one ragged tile, so total rows //
        # block_m + batch tiles per head bound them, as do the longest sequence's tiles for every
        # sequence (the old grid, mostly empty when lengths vary).
        tiles = min(q.shape[1] // block_m + batch, cdiv(seqlen, block_m) * batch) * nhead
        table = torch.empty(tiles, dtype=torch.int64, device=q.device)
        launches.append((hopper_fwd_varlen_schedule, (batch,), dict(
            Seqstart=inputs.seqstart_q, Table=table, B=batch, H=nhead, table_len=tiles, BLOCK_M=block_m,
            CHUNK=SCHEDULE_CHUNK, num_warps=4)))
    else:
        tiles = cdiv(seqlen, block_m) * batch * nhead
        table = lse  # never read
    features = _window_and_alibi_args(inputs, lse)
    if features["ALIBI"] == 1 and not features["WINDOW"] and not dropout and cfg.alibi_linear:
        features["ALIBI"] = 4 if cfg.alibi_mma else 3  # (see HopperFwdConfig.alibi_linear, alibi_mma)
    if persistent and q.device.type == "cuda":  # (compiling for sm_90a on a CPU: one tile per CTA)
        grid = (min(tiles, _sm_count(_device_index(q.device))),)
    else:
        grid = (tiles,)  # 1-D: grid y stops at 65535
    k_desc = _desc(k, block_n, head_dim)
    kwargs = dict(
        q_desc=_desc(q, rows, head_dim), k_desc=k_desc, bias_desc=k_desc,
        v_desc=_desc(v, block_n, head_dim), o_desc=_desc(out, rows, head_dim), out_ptr=out, lse_ptr=lse,
        seqstart_ptr=inputs.seqstart_q if inputs.group else lse, table_ptr=table, seqlen=seqlen, H=nhead,
        kv_group=inputs.nhead_q // inputs.nhead_k, tiles=tiles, qk_scale=inputs.scale * LOG2E,
        stride_os=out.stride(1), stride_oh=out.stride(2), lse_stride_b=lse_strides[0], lse_stride_h=lse_strides[1],
        BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages, NUM_CONSUMERS=consumers,
        Q_BUFS=cfg.persistent_q_bufs if persistent else 1,
        CONSUMER_REGS=consumer_regs, PACKED_P=cfg.packed_p,
        CAUSAL=inputs.mask.is_causal, GROUP=inputs.group, PERSISTENT=persistent, num_warps=4,
        maxnreg=maxnreg, **features, **_dropout_args(inputs, philox, lse),
    )
    kwargs.update(_bias_args(inputs, rows, block_n))
    return launches + [(attention_fwd_hopper_kernel, grid, kwargs)]


def bwd_launches(inputs: AttentionInputs, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, deterministic: bool = False,
                 dbias_t: torch.Tensor | None = None, philox: torch.Tensor | None = None):
    """The backward's three (kernel, grid, kwargs), in order; dq, dk, dv contiguous ``[B, S, H, D]``
    (group mode ``[T, H, D]``, dk and dv zeroed: the kernel adds into them). ``deterministic``:
    dQ's adds in a fixed order (where ``bwd_unsupported`` allows it). ``dbias_t``: the bias's
    gradient is wanted, into this contiguous ``[B, Hq, S_k, S_q]`` tensor of q's dtype (its
    transpose is dS; zeroed under a causal mask, whose tiles above the diagonal never run).
    ``philox``: the int64 (seed, offset) pair when dropout is on.

    A plain batch-mode problem in atomic mode is rebuilt from its plan, as the forward's are."""
    tensors = _bwd_tensors(inputs, dout, out, lse, dq, dk, dv, deterministic, dbias_t)
    plan = _bwd_plan(inputs, tensors, deterministic, dbias_t)
    if plan is None:
        return _build_bwd_launches(inputs, tensors, deterministic, dbias_t, philox)
    return plan.launches(tensors)


def launch_bwd(inputs: AttentionInputs, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, deterministic: bool = False,
               dbias_t: torch.Tensor | None = None, philox: torch.Tensor | None = None) -> None:
    """Launch ``bwd_launches``; planned ones, after their first launch, straight through their
    compiled kernels."""
    tensors = _bwd_tensors(inputs, dout, out, lse, dq, dk, dv, deterministic, dbias_t)
    plan = _bwd_plan(inputs, tensors, deterministic, dbias_t)
    if plan is None:
        for kernel, grid, kwargs in _build_bwd_launches(inputs, tensors, deterministic, dbias_t, philox):
            launch(kernel, grid, kwargs)
    else:
        plan.launch(tensors)


def _bwd_tensors(inputs: AttentionInputs, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, deterministic: bool,
                 dbias_t: torch.Tensor | None) -> tuple:
    """Every tensor the backward's launches take (``[B, S, H, D]`` views in group mode, see
    ``fwd_launches``): q, k, v, dout, out, lse, dq, dk, dv, then its workspaces: -delta and -lse
    per (sequence, head) with padded rows, as in batch mode (the next sequence's rows in a ragged
    query tile then see -lse = -inf), both as ``[B * H, S_pad]`` rows too, dQ's fp32 accumulator
    and the deterministic mode's turn counters (else -lse again: never read)."""
    from .kernels.hopper_bwd import STAT_PAD

    q, k, v = inputs.q, inputs.k, inputs.v
    lse = lse.contiguous()
    if inputs.group:  # [1, T, H, D] views: sequence b is a row range of the one "batch" (see fwd_launches)
        q, k, v, dout, out, dq, dk, dv = (t.unsqueeze(0) for t in (q, k, v, dout, out, dq, dk, dv))
        lse = lse.unsqueeze(0)
    batch, seqlen, nhead = inputs.batch, inputs.max_seqlen_q, q.shape[2]
    seqlen_pad = cdiv(seqlen, STAT_PAD) * STAT_PAD
    neg_delta = torch.empty((batch, nhead, seqlen_pad), dtype=torch.float32, device=q.device)
    neg_lse = torch.empty_like(neg_delta)
    chains = _chains(inputs, deterministic)
    # In batch mode the preprocess's rows cover every row of dQ's accumulator, so it zeroes them
    # (atomic mode: the deterministic mode stores each copy's first add).
    dq_acc = (torch.zeros if inputs.group else torch.empty)(
        (*q.shape[:2], q.shape[2] * max(chains, 1), q.shape[3]), dtype=torch.float32, device=q.device)
    # deterministic: one turn counter per (batch * head, query tile, dQ copy)
    sems = torch.zeros((batch * nhead, cdiv(seqlen, _bwd_block_m(inputs, deterministic)), chains), dtype=torch.int32,
                       device=q.device) if chains else neg_lse
    return (q, k, v, dout, out, lse, dq, dk, dv, neg_delta, neg_lse, neg_delta.view(-1, seqlen_pad),
            neg_lse.view(-1, seqlen_pad), dq_acc, sems)


def _chains(inputs: AttentionInputs, deterministic: bool) -> int:
    """The deterministic mode's dQ copies per head (0: atomic mode)."""
    cfg = HOPPER_BWD_CONFIGS[inputs.head_dim_q]
    if not deterministic:
        return 0
    if _diagonal_order(inputs):
        return cfg.diagonal_chains
    return cfg.chains_for(inputs.mask.is_causal, inputs.max_seqlen_q)


# The SMs of an H100 or H200: where the fast path's launches are built without a GPU (the compile
# check), their SM-dependent choices are made for these.
HOPPER_SMS = 132


def _diagonal_order(inputs: AttentionInputs) -> bool:
    """Whether the wide kernel's deterministic mode takes its DIAGONAL order (see
    ``kernels/hopper_bwd``): where a head's key tiles fit the SMs."""
    from .kernels.hopper_bwd import WIDE_KEYS

    if not HOPPER_BWD_CONFIGS[inputs.head_dim_q].diagonal_chains:
        return False
    device = inputs.q.device
    sms = _sm_count(_device_index(device)) if device.type == "cuda" else HOPPER_SMS
    return cdiv(inputs.max_seqlen_q, WIDE_KEYS.value) <= sms


def _bwd_block_m(inputs: AttentionInputs, deterministic: bool) -> int:
    """The narrow backward's query tile: the config's feature tile in group mode, with a window,
    ALiBi, a bias or dropout, its deterministic tile in that mode."""
    cfg = HOPPER_BWD_CONFIGS[inputs.head_dim_q]
    if deterministic and cfg.deterministic_block_m:
        return cfg.deterministic_block_m
    return cfg.block_m_for(inputs.group or inputs.mask.is_window or inputs.alibi_slopes is not None
                           or inputs.bias is not None or inputs.dropout_p > 0)


def _bwd_plan(inputs: AttentionInputs, tensors: tuple, deterministic: bool, dbias_t: torch.Tensor | None):
    """The backward's plan for a plain batch-mode problem in atomic mode (its workspaces are
    allocated uninitialized), built on its geometry's first call; None for other problems."""
    if deterministic or dbias_t is not None:
        return None
    return _plan("bwd", HOPPER_BWD_CONFIGS[inputs.head_dim_q], inputs, tensors,
                 lambda: _build_bwd_launches(inputs, tensors, False, None, None))


def _build_bwd_launches(inputs: AttentionInputs, tensors: tuple, deterministic: bool,
                        dbias_t: torch.Tensor | None, philox: torch.Tensor | None):
    """``bwd_launches`` built from the problem, over ``_bwd_tensors``."""
    from .kernels.hopper_bwd import (
        BLOCK_N,
        STAT_PAD,
        WG_KEYS,
        WIDE_KEYS,
        attention_bwd_hopper_kernel,
        attention_bwd_hopper_wide_kernel,
        hopper_bwd_convert_dq,
        hopper_bwd_preprocess,
    )

    q, k, v, dout, out, lse, dq, dk, dv, neg_delta, neg_lse, neg_delta_rows, neg_lse_rows, dq_acc, sems = tensors
    nhead, head_dim = q.shape[2], q.shape[3]
    batch, seqlen, seqlen_pad = inputs.batch, inputs.max_seqlen_q, neg_lse.shape[-1]
    cfg = HOPPER_BWD_CONFIGS[head_dim]
    # One CTA per key tile of each key/value head; it runs the query tiles of every query head
    # of its group (GQA/MQA) with its K/V resident.
    nhead_k = inputs.nhead_k
    kv_group = nhead // nhead_k
    chains = _chains(inputs, deterministic)
    copies = max(chains, 1)  # the deterministic mode's dQ copies per head
    block_m = _bwd_block_m(inputs, deterministic)
    zero_acc = not inputs.group and not chains  # (see _bwd_tensors)
    per_sequence = 0 if inputs.group else 1  # group mode: one packed "batch", sequences by seqstart
    preprocess = dict(
        O=out, DO=dout, Lse=lse, NegDelta=neg_delta, NegLse=neg_lse,
        Seqstart=inputs.seqstart_q if inputs.group else neg_lse, Acc=dq_acc, seqlen=seqlen, seqlen_pad=seqlen_pad,
        H=nhead, inv_scale=1.0 / inputs.scale, delta_scale=1.0 - inputs.dropout_p,
        stride_ob=out.stride(0) * per_sequence, stride_os=out.stride(1),
        stride_oh=out.stride(2), stride_dob=dout.stride(0) * per_sequence, stride_dos=dout.stride(1),
        stride_doh=dout.stride(2), stride_lb=lse.stride(0) * per_sequence, stride_lh=lse.stride(1),
        HEAD_DIM=head_dim, BLOCK=STAT_PAD, GROUP=inputs.group, ZERO_ACC=zero_acc, COPIES=copies,
        num_warps=8 if head_dim <= 128 else 16,
    )
    convert = dict(Acc=dq_acc, DQ=dq, n=dq.numel(), scale=inputs.scale, seqlen=seqlen, H=nhead, BLOCK=CONVERT_BLOCK,
                   COPIES=copies, HEAD_DIM=head_dim, CAUSAL=inputs.mask.is_causal and copies > 1, BLOCK_M=block_m,
                   KEYS=WIDE_KEYS.value if head_dim == 256 else BLOCK_N.value, num_warps=8)
    if head_dim == 256:  # the head-dim-split kernel: 64 keys per CTA
        wide = dict(
            q_desc=_desc(q, cfg.block_m, head_dim), k_desc=_desc(k, WIDE_KEYS.value, head_dim),
            v_desc=_desc(v, WIDE_KEYS.value, head_dim), do_desc=_desc(dout, cfg.block_m, head_dim),
            dq_desc=_desc(dq_acc, cfg.block_m, cfg.dq_cols, swizzle=False), dk_ptr=dk, dv_ptr=dv,
            neg_lse_ptr=neg_lse, neg_delta_ptr=neg_delta, sem_ptr=sems, seqlen=seqlen, seqlen_pad=seqlen_pad,
            H=nhead_k, kv_group=kv_group, qk_scale=inputs.scale * LOG2E, sm_scale=inputs.scale, HEAD_DIM=head_dim,
            STAGES=cfg.stages, DQ_COLS=cfg.dq_cols, CONSUMER_REGS=cfg.consumer_regs, CAUSAL=inputs.mask.is_causal,
            CHAINS=chains, DIAGONAL=bool(chains) and _diagonal_order(inputs), num_warps=4, maxnreg=cfg.maxnreg,
        )
        main = (attention_bwd_hopper_wide_kernel, (cdiv(seqlen, WIDE_KEYS.value) * batch * nhead_k,), wide)
    else:
        features = _window_and_alibi_args(inputs, neg_lse)
        dropout = _dropout_args(inputs, philox, neg_lse)
        dq_cols = head_dim if block_m == 128 else head_dim // 2
        k_desc = _desc(k, BLOCK_N.value, head_dim)
        narrow = dict(
            q_desc=_desc(q, block_m, head_dim), k_desc=k_desc, bias_desc=k_desc,
            v_desc=_desc(v, WG_KEYS.value, head_dim), do_desc=_desc(dout, block_m, head_dim),
            dk_desc=_desc(dk, WG_KEYS.value, head_dim), dv_desc=_desc(dv, WG_KEYS.value, head_dim),
            dq_desc=_desc(dq_acc, 64, dq_cols, swizzle=False), lse_desc=_stat_desc(neg_lse_rows, block_m),
            delta_desc=_stat_desc(neg_delta_rows, block_m),
            seqstart_ptr=inputs.seqstart_q if inputs.group else neg_lse,
            sem_ptr=sems, seqlen=seqlen, H=nhead_k, kv_group=kv_group, qk_scale=inputs.scale * LOG2E,
            sm_scale=inputs.scale, inv_scale=1.0 / inputs.scale, BLOCK_M=block_m,
            HEAD_DIM=head_dim, STAGES=cfg.stages, DS_BUFS=cfg.ds_bufs, CAUSAL=inputs.mask.is_causal,
            GROUP=inputs.group, CHAINS=chains, DKV_RS=cfg.dkv_rs and block_m == 64, num_warps=4,
            # dropout: 12 warps (see HopperBwdConfig.dropout_consumer_regs)
            CONSUMER_REGS=cfg.dropout_consumer_regs if dropout["DROPOUT"] else cfg.consumer_regs,
            maxnreg=DROPOUT_MAXNREG if dropout["DROPOUT"] else cfg.maxnreg, **features, **dropout,
        )
        narrow.update(_bias_args(inputs, block_m, WG_KEYS.value))
        narrow.update(dbias_desc=k_desc, DBIAS=dbias_t is not None)
        if dbias_t is not None:
            narrow["dbias_desc"] = _box_desc(dbias_t, (1, 1, BLOCK_N.value, block_m))
        main = (attention_bwd_hopper_kernel, (cdiv(seqlen, BLOCK_N.value) * batch * nhead_k,), narrow)
    return [
        (hopper_bwd_preprocess, (seqlen_pad // STAT_PAD * batch * nhead,), preprocess),
        main,
        (hopper_bwd_convert_dq, (cdiv(dq.numel(), CONVERT_BLOCK),), convert),
    ]
