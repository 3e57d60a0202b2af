"""The ``fmha`` command line.

``fmha fwd``        one forward problem, with the flags of CK's ``tile_example_fmha_fwd``
                    (``-name=value``), printing CK's result line;
``fmha check fwd``  CK's forward smoke-test matrix, every case through the ``fmha fwd`` path;
``fmha bench``      fmha timed against the attention implementations installed beside it.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

import fmha
from fmha import bench
from fmha.masks import Mask
from fmha.reference import visible

NO_CUDA_NOTE = "fmha: no CUDA device, running through Triton's interpreter on a small default problem"


class UsageError(ValueError):
    """A command-line flag that is unknown, malformed or out of range."""


@dataclass(frozen=True)
class Flag:
    default: str
    meaning: str


# CK's flags and defaults (ck-reference.md section 8.1), in CK's order.
FWD_FLAGS: dict[str, Flag] = {
    "v": Flag("1", "0 no validation; 1 (or 2) compare with fmha.reference on the device"),
    "mode": Flag("0", "0 batch mode, 1 group (varlen) mode"),
    "b": Flag("2", "batch size (number of sequences)"),
    "h": Flag("8", "query heads"),
    "h_k": Flag("-1", "key/value heads, a divisor of h; -1: h"),
    "s": Flag("3328", "seqlen_q; group mode: comma list per batch, the last value repeats"),
    "s_k": Flag("-1", "seqlen_k; -1: s; comma list per batch in group mode"),
    "s_qpad": Flag("-1", "group mode: physical q rows per batch (>= s), comma list; -1: none"),
    "s_kpad": Flag("-1", "group mode: physical k/v rows per batch (>= s_k), comma list; -1: none"),
    "d": Flag("128", "head dim of q and k"),
    "d_v": Flag("-1", "head dim of v and o; -1: d"),
    "scale_s": Flag("0", "softmax scale; 0: 1/sqrt(d)"),
    "iperm": Flag("1", "q/k/v memory layout: 1 b*h*s*d, 0 b*s*h*d"),
    "operm": Flag("1", "o memory layout: 1 b*h*s*d, 0 b*s*h*d"),
    "bias": Flag("n", "n none; e (e:1, e:2, 1) elementwise [1,1,s,s_k]; a (2) ALiBi [h]; a:1 ALiBi [b,h]"),
    "prec": Flag("fp16", "fp16, bf16 or fp32"),
    "mask": Flag("0", "0/n none, 1/t causal top-left, 2/b causal bottom-right, "
                      "t:l,r, b:l,r, xt:w, xb:w, g:y,x"),
    "lse": Flag("0", "1: store the LSE (and validate it)"),
    "init": Flag("uf", "uf uniform [0,1), ui uniform int [-3,3], ni normal int, nf normal(0,3), tf trig"),
    "seed": Flag("11939", "seed of the input values; 0: random"),
    "p_drop": Flag("0", "dropout probability in [0, 1)"),
    "drop_seed": Flag("1", "dropout seed"),
    "drop_offset": Flag("0", "dropout offset"),
    "drop_prefs": Flag("0", "1: pass the dropout seed and offset as device tensors"),
    "warmup": Flag("5", "untimed launches"),
    "repeat": Flag("20", "timed launches; the time printed is their average"),
    "timer": Flag("gpu", "gpu: CUDA events, cpu: wall clock"),
    "json": Flag("0", "1: write a JSON record to -jsonfile"),
    "jsonfile": Flag("fmha_fwd.json", "where -json=1 writes"),
    "q_eff_lens": Flag("", "batch mode: effective q length per batch, comma list"),
    "kv_eff_lens": Flag("", "batch mode: effective k/v length per batch, comma list"),
    "kname": Flag("0", "accepted for CK scripts; fmha prints no kernel names"),
}

# CK flags of features fmha lacks: accepted only at the values that turn the feature off.
OFF_FEATURES: dict[str, tuple[tuple[str, ...], str]] = {
    "vlayout": (("r",), "column-major V"),
    "num_splits": (("1",), "split-KV"),
    "page_block_size": (("0",), "paged KV cache"),
    "cache_batch_idx": (("0",), "KV-cache batch index"),
    "s_knew": (("0",), "append-KV"),
    "rotary_dim": (("0",), "rotary embedding"),
    "logits_soft_cap": (("0",), "logits soft-cap"),
    "squant": (("0", "auto"), "fp8 static quantization"),
}

# Without a GPU the interpreter runs the kernels: CK's default problem would take hours.
SMALL_DEFAULTS = {"b": "1", "h": "2", "s": "100", "d": "64", "warmup": "0", "repeat": "1"}

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCES = {"fp16": (1e-3, 1e-3), "bf16": (1e-2, 1e-2), "fp32": (1e-5, 1e-5)}  # (rtol, atol)
INITS = {"uf": "uf", "1": "uf", "ui": "ui", "0": "ui", "ni": "ni", "nf": "nf", "tf": "tf", "2": "tf"}
LAYOUTS = {True: "bhsd", False: "bshd"}


# ---------------------------------------------------------------------------------------------
# Flags


def parse_ck_flags(tokens: list[str]) -> dict[str, str]:
    """``["-b=2", ...]`` -> ``{"b": "2", ...}``, rejecting anything but known ``-name=value``."""
    given = {}
    for token in tokens:
        name, sep, value = token.partition("=")
        if not sep or not name.startswith("-") or name.startswith("--"):
            raise UsageError(f"expected -name=value, got {token!r}")
        name = name[1:]
        if name in OFF_FEATURES:
            allowed, feature = OFF_FEATURES[name]
            if value not in allowed:
                raise UsageError(f"-{name}={value}: fmha has no {feature} (only -{name}={allowed[0]})")
        elif name not in FWD_FLAGS:
            valid = " ".join(f"-{n}" for n in FWD_FLAGS)
            raise UsageError(f"unknown flag -{name}; valid flags: {valid} (fmha fwd -? explains them)")
        given[name] = value
    return given


def fwd_help() -> str:
    lines = ["usage: fmha fwd [-name=value ...]  (the flags of CK's tile_example_fmha_fwd)", ""]
    lines += [f"  {f'-{name}={flag.default}':<24} {flag.meaning}" for name, flag in FWD_FLAGS.items()]
    lines += [f"  {f'-{name}={allowed[0]}':<24} only {'/'.join(allowed)}: fmha has no {feature}"
              for name, (allowed, feature) in OFF_FEATURES.items()]
    small = " ".join(f"-{name}={value}" for name, value in SMALL_DEFAULTS.items())
    lines += ["", f"Without a CUDA device, flags not given default to {small}."]
    return "\n".join(lines)


def _int(name: str, text: str, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"-{name}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise UsageError(f"-{name}: expected an integer >= {minimum}, got {value}")
    return value


def _int_or_default(name: str, text: str, default: int) -> int:
    """CK's ``-1`` means "the default" (``-h_k=-1`` is h, ``-d_v=-1`` is d)."""
    return default if text == "-1" else _int(name, text, minimum=1)


def _float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"-{name}: expected a number, got {text!r}") from None


def _choice(name: str, text: str, choices) -> str:
    if text not in choices:
        raise UsageError(f"-{name}: expected one of {', '.join(choices)}, got {text!r}")
    return text


def _switch(name: str, text: str) -> bool:
    return _choice(name, text, ("0", "1")) == "1"


def _uint64(name: str, text: str) -> int:
    value = _int(name, text)
    if value >= 2**64:
        raise UsageError(f"-{name}: expected an integer in [0, 2^64), got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# The problem a set of flags describes


@dataclass
class FwdProblem:
    """One ``fmha fwd`` run, resolved from its flags (``flags`` keeps every value as text)."""

    flags: dict[str, str]
    prec: str
    group: bool
    batch: int
    nhead_q: int
    nhead_k: int
    lens_q: list[int]  # logical length of each batch
    lens_k: list[int]
    slots_q: list[int]  # physical rows of each batch: padded (group) or the full -s (batch)
    slots_k: list[int]
    ragged_q: bool  # pass the logical lengths apart: -q_eff_lens (batch) or -s_qpad (group)
    ragged_k: bool
    hdim_q: int
    hdim_v: int
    scale: float
    bhsd_in: bool
    bhsd_out: bool
    bias: str  # "n", "e" or "a"
    bias_rank: int  # CK's hint after the colon (e:1, a:1); a:1 means per-batch ALiBi slopes
    mask: Mask
    lse: bool
    p_drop: float
    drop_seed: int
    drop_offset: int
    drop_prefs: bool
    init: str
    seed: int
    validate: bool
    warmup: int
    repeat: int
    gpu_timer: bool
    write_json: bool
    jsonfile: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.prec]

    def leading_shape(self, slots: list[int]) -> tuple[int, ...]:
        """Dims before [H, D]: ``(total_rows,)`` in group mode, ``(B, S)`` in batch mode."""
        return (sum(slots),) if self.group else (self.batch, slots[0])


def fwd_problem(given: dict[str, str], *, small: bool = False) -> FwdProblem:
    """Resolve parsed flags into a problem; ``small`` uses SMALL_DEFAULTS for flags not given."""
    flags = {name: flag.default for name, flag in FWD_FLAGS.items()}
    if small:
        flags.update(SMALL_DEFAULTS)
    flags.update({name: value for name, value in given.items() if name in FWD_FLAGS})
    group = _switch("mode", flags["mode"])
    batch = _int("b", flags["b"], minimum=1)
    nhead_q = _int("h", flags["h"], minimum=1)
    hdim_q = _int("d", flags["d"], minimum=1)
    scale = _float("scale_s", flags["scale_s"])
    bias, bias_rank = _bias(flags["bias"])
    p_drop = _float("p_drop", flags["p_drop"])
    if not 0 <= p_drop < 1:
        raise UsageError(f"-p_drop: expected a probability in [0, 1), got {p_drop}")
    prec = flags["prec"]
    if prec not in DTYPES:
        raise UsageError(f"-prec: expected fp16, bf16 or fp32 (fmha has no fp8/mx kernels), got {prec!r}")
    try:
        mask = fmha.parse_mask(flags["mask"])
    except ValueError as exc:
        raise UsageError(f"-mask: {str(exc).removeprefix('mask: ')}") from None
    return FwdProblem(
        flags=flags, prec=prec, group=group, batch=batch, nhead_q=nhead_q,
        nhead_k=_int_or_default("h_k", flags["h_k"], nhead_q),
        **_sequence_lengths(flags, group, batch),
        hdim_q=hdim_q, hdim_v=_int_or_default("d_v", flags["d_v"], hdim_q),
        scale=scale if scale != 0 else 1 / math.sqrt(hdim_q),
        bhsd_in=_switch("iperm", flags["iperm"]), bhsd_out=_switch("operm", flags["operm"]),
        bias=bias, bias_rank=bias_rank, mask=mask, lse=_switch("lse", flags["lse"]), p_drop=p_drop,
        drop_seed=_uint64("drop_seed", flags["drop_seed"]),
        drop_offset=_uint64("drop_offset", flags["drop_offset"]),
        drop_prefs=_switch("drop_prefs", flags["drop_prefs"]),
        init=INITS[_choice("init", flags["init"], INITS)], seed=_int("seed", flags["seed"]),
        validate=_choice("v", flags["v"], ("0", "1", "2")) != "0",
        warmup=_int("warmup", flags["warmup"]), repeat=_int("repeat", flags["repeat"], minimum=1),
        gpu_timer=_choice("timer", flags["timer"], ("gpu", "cpu")) == "gpu",
        write_json=_switch("json", flags["json"]), jsonfile=flags["jsonfile"],
    )


def _bias(text: str) -> tuple[str, int]:
    """CK's bias strings: ``n``/``0``; ``e``/``1``[``:rank``]; ``a``/``2``[``:rank``]."""
    kind, _, rank = text.partition(":")
    kinds = {"n": "n", "0": "n", "e": "e", "1": "e", "elementwise": "e", "a": "a", "2": "a", "alibi": "a"}
    ranks = {"n": ("",), "e": ("", "0", "1", "2"), "a": ("", "0", "1")}
    if kind not in kinds or rank not in ranks[kinds[kind]]:
        raise UsageError(f"-bias: expected n, e, e:1, e:2, a or a:1, got {text!r}")
    return kinds[kind], int(rank or 0)


def _per_batch(name: str, text: str, batch: int) -> list[int]:
    """A comma list of lengths, its last value repeated up to ``batch`` values (CK's rule)."""
    values = [_int(name, part) for part in text.split(",")]
    if len(values) > batch:
        raise UsageError(f"-{name}: expected at most b={batch} values, got {len(values)}")
    return values + values[-1:] * (batch - len(values))


def _sequence_lengths(flags: dict[str, str], group: bool, batch: int) -> dict:
    if not group:
        for name in ("s", "s_k"):
            if "," in flags[name]:
                raise UsageError(f"-{name}: a comma list needs group mode (-mode=1)")
    elif flags["q_eff_lens"] or flags["kv_eff_lens"]:
        raise UsageError("-q_eff_lens/-kv_eff_lens: batch mode only (group mode pads with -s_qpad/-s_kpad)")
    lens_q = _per_batch("s", flags["s"], batch)
    lens_k = lens_q if flags["s_k"] == "-1" else _per_batch("s_k", flags["s_k"], batch)
    if group:
        return dict(lens_q=lens_q, lens_k=lens_k,
                    slots_q=_padded("s_qpad", flags["s_qpad"], lens_q),
                    slots_k=_padded("s_kpad", flags["s_kpad"], lens_k),
                    ragged_q=flags["s_qpad"] != "-1", ragged_k=flags["s_kpad"] != "-1")
    # Batch mode: every batch has a slot of s (s_k) rows; effective lengths may be shorter.
    return dict(lens_q=_effective("q_eff_lens", flags["q_eff_lens"], lens_q),
                lens_k=_effective("kv_eff_lens", flags["kv_eff_lens"], lens_k),
                slots_q=lens_q, slots_k=lens_k,
                ragged_q=bool(flags["q_eff_lens"]), ragged_k=bool(flags["kv_eff_lens"]))


def _padded(name: str, text: str, lens: list[int]) -> list[int]:
    if text == "-1":
        return lens
    pads = _per_batch(name, text, len(lens))
    if any(pad < n for pad, n in zip(pads, lens)):
        raise UsageError(f"-{name}: expected each batch's padded length >= its length {lens}, got {pads}")
    return pads


def _effective(name: str, text: str, slots: list[int]) -> list[int]:
    if not text:
        return slots
    lens = _per_batch(name, text, len(slots))
    if any(n > slots[0] for n in lens):
        raise UsageError(f"-{name}: expected lengths <= {slots[0]} (the batch slot), got {lens}")
    return lens


# ---------------------------------------------------------------------------------------------
# The result line and its numbers


def describe(p: FwdProblem) -> str:
    """CK's result line up to the timings, e.g. ``[fp16|batch|bhsd] b:2, h:8/8, ..., v:r``."""
    layout = LAYOUTS[p.bhsd_in] if p.bhsd_in == p.bhsd_out else f"{LAYOUTS[p.bhsd_in]}-{LAYOUTS[p.bhsd_out]}"
    # CK prints the first batch's lengths: logical in group mode, the slot in batch mode.
    shown_q, shown_k = (p.lens_q[0], p.lens_k[0]) if p.group else (p.slots_q[0], p.slots_k[0])
    kpad = f"({p.slots_k[0]})" if p.group and p.ragged_k else ""
    bias = {"n": "n", "e": "e", "a": "alibi"}[p.bias] + (f"[{p.bias_rank}]" if p.bias_rank else "")
    return (f"[{p.prec}|{'group' if p.group else 'batch'}|{layout}] b:{p.batch}, "
            f"h:{p.nhead_q}/{p.nhead_k}, s:{shown_q}/{shown_k}{kpad}, d:{p.hdim_q}/{p.hdim_v}, "
            f"scale_s:{p.scale:g}, bias:{bias}, p_drop:{p.p_drop:g}, lse:{int(p.lse)}, squant:0, "
            f"mask:{p.mask}, v:r")


def fwd_flops(mask: Mask, lens_q: list[int], lens_k: list[int], nhead: int, hdim_q: int,
              hdim_v: int, device=None) -> int:
    """``sum_b nhead * 2 * A_b * (dq + dv)``, ``A_b`` the visible (i, j) pairs of batch ``b``."""
    pairs = collections.Counter(zip(lens_q, lens_k))
    area = sum(count * int(visible(mask, sq, sk, device).sum()) for (sq, sk), count in pairs.items())
    return nhead * 2 * area * (hdim_q + hdim_v)


def fwd_bytes(lens_q: list[int], lens_k: list[int], nhead_q: int, nhead_k: int, hdim_q: int,
              hdim_v: int, element_size: int) -> int:
    """Bytes of Q, O (per query head) and K, V (per key head) over the logical lengths."""
    per_row_q, per_row_k = nhead_q * (hdim_q + hdim_v), nhead_k * (hdim_q + hdim_v)
    return (per_row_q * sum(lens_q) + per_row_k * sum(lens_k)) * element_size


def format_line(p: FwdProblem, ms: float, tflops: float, gb_per_s: float, valid: bool | None) -> str:
    line = f"{describe(p)}, {ms:.3f} ms, {tflops:.2f} TFlops, {gb_per_s:.2f} GB/s"
    return line if valid is None else f"{line}, valid:{'y' if valid else 'n'}"


# ---------------------------------------------------------------------------------------------
# Running one problem


@dataclass
class FwdResult:
    line: str
    valid: bool | None  # None: not validated (-v=0)
    ms: float = math.nan
    tflops: float = math.nan
    gb_per_s: float = math.nan
    flop: int = 0
    bytes: int = 0


def _laid_out(shape: tuple[int, ...], bhsd: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of logical shape ``[..., S, H, D]``, stored as ``[..., H, S, D]`` when ``bhsd``."""
    if not bhsd:
        return torch.empty(shape, dtype=dtype, device=device)
    *lead, s, h, d = shape
    return torch.empty(*lead, h, s, d, dtype=dtype, device=device).transpose(-3, -2)


def _init_values(shape, init: str, generator: torch.Generator, device) -> torch.Tensor:
    if init == "uf":
        return torch.rand(shape, generator=generator, device=device)
    if init == "ui":
        return torch.randint(-3, 4, shape, generator=generator, device=device).float()
    if init in ("nf", "ni"):
        values = 3 * torch.randn(shape, generator=generator, device=device)
        return values.round() if init == "ni" else values
    return torch.sin(torch.arange(math.prod(shape), device=device, dtype=torch.float32)).reshape(shape)


def _prefix_sums(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _dropout_number(value: int, as_tensor: bool, device):
    """An int, or (``-drop_prefs=1``) a one-element int64 device tensor of the same bits."""
    if not as_tensor:
        return value
    return torch.tensor([value - 2**64 if value >= 2**63 else value], dtype=torch.int64, device=device)


def make_inputs(p: FwdProblem, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """``q, k, v`` in the requested layouts, built on ``device``, and the keywords that
    ``fmha.fwd`` and ``fmha.reference.attention`` share."""
    generator = torch.Generator(device=device)
    if p.seed:
        generator.manual_seed(p.seed)
    else:
        generator.seed()

    def tensor(shape, bhsd):
        t = _laid_out(shape, bhsd, p.dtype, device)
        return t.copy_(_init_values(t.shape, p.init, generator, device))

    lead_q, lead_k = p.leading_shape(p.slots_q), p.leading_shape(p.slots_k)
    q = tensor((*lead_q, p.nhead_q, p.hdim_q), p.bhsd_in)
    k = tensor((*lead_k, p.nhead_k, p.hdim_q), p.bhsd_in)
    v = tensor((*lead_k, p.nhead_k, p.hdim_v), p.bhsd_in)
    common = dict(scale=p.scale, mask=p.mask, dropout_p=p.p_drop,
                  seed=_dropout_number(p.drop_seed, p.drop_prefs, device),
                  offset=_dropout_number(p.drop_offset, p.drop_prefs, device))
    if p.bias == "e":
        # CK's example: one [seqlen_q, max_seqlen_k] matrix broadcast over batches and heads.
        shape = (1, sum(p.slots_q), max(p.lens_k)) if p.group else (1, 1, p.slots_q[0], p.slots_k[0])
        common["bias"] = _init_values(shape, p.init, generator, device).to(p.dtype)
    elif p.bias == "a":
        slopes = fmha.alibi_slopes(p.nhead_q, device=device)
        common["alibi_slopes"] = slopes.repeat(p.batch, 1) if p.bias_rank == 1 else slopes
    if p.group:
        common.update(seqstart_q=_prefix_sums(p.lens_q, device), seqstart_k=_prefix_sums(p.lens_k, device))
        if p.ragged_q:
            common["seqstart_padded_q"] = _prefix_sums(p.slots_q, device)
        if p.ragged_k:
            common["seqstart_padded_k"] = _prefix_sums(p.slots_k, device)
    else:
        if p.ragged_q:
            common["cu_seqlen_q"] = _prefix_sums(p.lens_q, device)
        if p.ragged_k:
            common["cu_seqlen_k"] = _prefix_sums(p.lens_k, device)
    return q, k, v, common


def _time_launches(launch, warmup: int, repeat: int, cuda_events: bool):
    """Average milliseconds of ``repeat`` launches after ``warmup``, and the last result."""
    for _ in range(warmup):
        launch()
    if cuda_events:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            result = launch()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeat, result
    began = time.perf_counter()
    for _ in range(repeat):
        result = launch()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3 / repeat, result


def run_fwd(p: FwdProblem) -> FwdResult:
    """Run, time and (with ``-v``) validate one problem on the GPU, or the CPU without one."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v, common = make_inputs(p, device)
    # NaN until written, so that a row the kernel misses fails validation.
    out = _laid_out((*p.leading_shape(p.slots_q), p.nhead_q, p.hdim_v), p.bhsd_out, p.dtype, device)
    out.fill_(math.nan)
    launch = functools.partial(fmha.fwd, q, k, v, **common, out=out, return_lse=p.lse,
                               return_randval=p.validate and p.p_drop > 0)
    ms, result = _time_launches(launch, p.warmup, p.repeat, device.type == "cuda" and p.gpu_timer)
    valid = outputs_match(p, q, k, v, common, result) if p.validate else None
    flop = fwd_flops(p.mask, p.lens_q, p.lens_k, p.nhead_q, p.hdim_q, p.hdim_v, device)
    nbytes = fwd_bytes(p.lens_q, p.lens_k, p.nhead_q, p.nhead_k, p.hdim_q, p.hdim_v, q.element_size())
    tflops, gb_per_s = flop / 1e9 / ms, nbytes / 1e6 / ms
    line = format_line(p, ms, tflops, gb_per_s, valid)
    return FwdResult(line, valid, ms, tflops, gb_per_s, flop, nbytes)


# ---------------------------------------------------------------------------------------------
# Validation (CK's check_err: |out - ref| <= atol + rtol * |ref|, everything finite)


def _all_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
               allow_infinity: bool = False) -> bool:
    actual = actual.to(expected.dtype)
    if allow_infinity:
        same_infinity = torch.isinf(expected) & (actual == expected)
        actual = actual.masked_fill(same_infinity, 0)
        expected = expected.masked_fill(same_infinity, 0)
    close = (actual - expected).abs() <= atol + rtol * expected.abs()
    return bool(torch.isfinite(actual).all() and close.all())


def _logical_rows(p: FwdProblem, device) -> torch.Tensor:
    """Boolean over the leading dims of q/out: the rows that belong to a sequence."""
    if not p.group:
        lens = torch.tensor(p.lens_q, device=device)
        return torch.arange(p.slots_q[0], device=device)[None, :] < lens[:, None]
    rows = torch.zeros(sum(p.slots_q), dtype=torch.bool, device=device)
    for start, n in zip(itertools.accumulate([0, *p.slots_q]), p.lens_q):
        rows[start : start + n] = True
    return rows


def _visible_randval(p: FwdProblem, shape, device) -> torch.Tensor:
    """Boolean of randval's shape: the positions the mask shows, which the kernel must visit."""
    seen = torch.zeros(shape, dtype=torch.bool, device=device)
    starts = itertools.accumulate([0, *p.slots_q])
    for b, (start, sq, sk) in enumerate(zip(starts, p.lens_q, p.lens_k)):
        shown = visible(p.mask, sq, sk, device)
        if p.group:
            seen[:, start : start + sq, :sk] = shown
        else:
            seen[b, :, :sq, :sk] = shown
    return seen


def outputs_match(p: FwdProblem, q, k, v, common: dict, result: fmha.AttentionOutput) -> bool:
    """Compare out (and lse, randval where produced) with ``fmha.reference.attention``."""
    compute_dtype = torch.float32 if q.is_cuda else torch.float64
    ref = fmha.reference.attention(q, k, v, **common, compute_dtype=compute_dtype)
    rtol, atol = TOLERANCES[p.prec]
    rows = _logical_rows(p, q.device)
    valid = _all_close(result.out[rows], ref.out[rows], rtol, atol)
    if result.lse is not None:
        valid &= _all_close(result.lse, ref.lse, rtol, atol, allow_infinity=True)
    if result.randval is not None:
        seen = _visible_randval(p, result.randval.shape, q.device)
        valid &= torch.equal(result.randval[seen], ref.randval[seen])
    return valid


# ---------------------------------------------------------------------------------------------
# fmha fwd


def _environment() -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "fmha": fmha.__version__}


def _write_json(p: FwdProblem, result: FwdResult) -> None:
    record = {"command": "fwd", "flags": p.flags, **asdict(result), **_environment()}
    with open(p.jsonfile, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


def fwd_command(tokens: list[str]) -> int:
    if any(token in ("-?", "--help", "-help") for token in tokens):
        print(fwd_help())
        return 0
    no_cuda = not torch.cuda.is_available()
    try:
        problem = fwd_problem(parse_ck_flags(tokens), small=no_cuda)
        if no_cuda:
            print(NO_CUDA_NOTE)
        result = run_fwd(problem)
    except UsageError as exc:
        print(f"fmha fwd: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, NotImplementedError) as exc:  # fmha's own input checks
        print(f"fmha fwd: error: {exc}", file=sys.stderr)
        return 1
    print(result.line)
    if problem.write_json:
        _write_json(problem, result)
    return 0 if result.valid in (True, None) else 1


# ---------------------------------------------------------------------------------------------
# fmha check fwd


SMOKE_HEAD_DIMS = (32, 64, 128, 256)
# ck-reference.md section 10.1; {d} is the head dim of the loop.
SMOKE_SHAPES = (
    "-b=2 -h=2 -h_k=1 -d=16 -d_v={d} -s=55 -s_k=256",
    "-b=1 -h=3 -d={d} -s=100 -s_k=51",
    "-b=2 -h=1 -d=16 -d_v={d} -s=99 -s_k=256 -mask=1",
    "-b=1 -h=2 -h_k=1 -d={d} -s=1024 -s_k=256 -mask=2",
    "-b=2 -h=1 -d={d} -d_v=24 -s=3 -s_k=99 -mask=2",
    "-b=3 -h=2 -h_k=1 -d={d} -s=200 -s_k=520 -mask=t:128,30",
    "-b=2 -h=1 -d={d} -s=99 -s_k=32 -mask=b:4,35",
    "-b=1 -h=2 -h_k=1 -d={d} -s=33 -s_k=0 -mask=2",
    "-b=1 -h=2 -h_k=1 -d={d} -s=1 -s_k=10 -s_kpad=32 -mask=2",  # s_kpad: group mode only
)


def smoke_cases() -> list[str]:
    """The option strings of CK's forward smoke matrix, in its loop order."""
    loops = itertools.product(("fp16", "bf16"), (0, 1), (0, 1), SMOKE_HEAD_DIMS, (0, 1), "nea",
                              ("0", "0.2"), SMOKE_SHAPES)
    return [
        f"-prec={prec} -mode={mode} -iperm={perm} -operm={perm} {shape.format(d=hdim)} "
        f"-lse={lse} -bias={bias} -p_drop={p_drop} -v=1 -warmup=0 -repeat=1"
        for prec, mode, perm, hdim, lse, bias, p_drop, shape in loops
    ]


def run_case(options: str) -> FwdResult:
    """``fmha fwd <options>`` as a smoke case; an exception is this case's failure."""
    try:
        return run_fwd(fwd_problem(parse_ck_flags(options.split())))
    except Exception as exc:  # one broken case is reported, it does not end the matrix
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return FwdResult(f"{options}: error: {type(exc).__name__}: {message}", valid=False)


def _run_cases(cases: list[str], jobs: int):
    """Results in case order; with ``jobs > 1`` from that many spawned workers sharing the GPU."""
    if jobs <= 1 or len(cases) <= 1:
        yield from map(run_case, cases)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(cases)), mp_context=context) as pool:
        futures = [pool.submit(run_case, case) for case in cases]
        for case, future in zip(cases, futures):
            try:
                yield future.result()
            except concurrent.futures.process.BrokenProcessPool as exc:
                yield FwdResult(f"{case}: error: a worker died ({exc})", valid=False)


def _matches(case: str, text: str) -> bool:
    return text in case or text in describe(fwd_problem(parse_ck_flags(case.split())))


def check_command(args: argparse.Namespace) -> int:
    cases = smoke_cases()
    if args.filter:
        cases = [case for case in cases if _matches(case, args.filter)]
    if args.limit is not None:
        cases = cases[: args.limit]
    log_file = open(args.log, "w") if args.log else None

    def emit(line: str) -> None:
        print(line, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    passed = 0
    try:
        for case, result in zip(cases, _run_cases(cases, args.jobs)):
            emit(result.line)
            if result.valid:
                passed += 1
            else:
                emit(f"    rerun: fmha fwd {case}")
        emit(f"{passed}/{len(cases)} passed")
    finally:
        if log_file:
            log_file.close()
    return 0 if cases and passed == len(cases) else 1


# ---------------------------------------------------------------------------------------------
# fmha bench


def bench_command(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("fmha bench: error: needs a CUDA device, and none is available", file=sys.stderr)
        return 1
    cases = [bench.Case(head_dim=d, seqlen=s, causal=bool(c), direction=args.direction, tokens=args.tokens)
             for d, s, c in itertools.product(args.head_dims, args.seqlens, args.causal)]
    providers = args.providers or [p for p in bench.PROVIDERS
                                   if args.direction == "bwd" or p != "fmha_deterministic"]
    bench.run(cases, providers, jsonl=args.jsonl)
    return 0


# ---------------------------------------------------------------------------------------------
# Entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fmha",
                                     description="Fused multi-head attention with CK's semantics.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fwd", add_help=False,
                        help="one forward problem with CK's tile_example_fmha_fwd flags "
                             "(fmha fwd -? lists them)")
    check = commands.add_parser("check", help="CK's forward smoke-test matrix")
    check.add_argument("direction", choices=["fwd"])
    check.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                       help="worker processes sharing the GPU (default: min(8, CPUs))")
    check.add_argument("--filter", help="only cases whose options or result line contain this text")
    check.add_argument("--limit", type=int, help="only the first N cases")
    check.add_argument("--log", help="also write every line to this file")
    timing = commands.add_parser("bench", help="time fmha against the attention implementations installed")
    timing.add_argument("--head-dims", type=int, nargs="+", default=list(bench.DEFAULT_HEAD_DIMS))
    timing.add_argument("--seqlens", type=int, nargs="+", default=list(bench.DEFAULT_SEQLENS))
    timing.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[0, 1])
    timing.add_argument("--direction", choices=["fwd", "bwd"], default="fwd",
                        help="bwd times the backward alone (2.5x the forward's FLOPs)")
    timing.add_argument("--providers", nargs="+", choices=list(bench.PROVIDERS),
                        help="default: all (fmha_deterministic only with --direction bwd)")
    timing.add_argument("--tokens", type=int, default=16384, help="tokens per batch (b = tokens // seqlen)")
    timing.add_argument("--jsonl", help="append one JSON line per timing to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``fmha <command> ...`` and return its exit code (argparse usage errors exit as usual)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "fwd":
        return fwd_command(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        return check_command(args)
    return bench_command(args)
