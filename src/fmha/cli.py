"""The ``fmha`` command line.

``fmha fwd``            one forward problem, with the flags of CK's ``tile_example_fmha_fwd``
                        (``-name=value``), printing CK's result line;
``fmha bwd``            one backward problem, with the flags of CK's ``tile_example_fmha_bwd``;
``fmha check fwd|bwd``  CK's forward or backward smoke-test matrix, every case through that path;
``fmha bench``          fmha timed against the attention implementations installed beside it.
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
from typing import ClassVar, NamedTuple

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


def _as_in_fwd(*names: str) -> dict[str, Flag]:
    return {name: FWD_FLAGS[name] for name in names}


# CK's backward flags and defaults (ck-reference.md section 9), in CK's order.
BWD_FLAGS: dict[str, Flag] = {
    **_as_in_fwd("v", "mode", "b", "h", "h_k", "s", "s_k", "s_qpad", "s_kpad", "d", "d_v"),
    "scale": Flag("0", "softmax scale; 0: 1/sqrt(d)"),
    "iperm": Flag("1", "q/k/v memory layout: 1 b*h*s*d, 0 b*s*h*d (dq/dk/dv come back in their shapes)"),
    "operm": Flag("1", "o and do memory layout: 1 b*h*s*d, 0 b*s*h*d"),
    **_as_in_fwd("bias"),
    "dbias": Flag("0", "1: validate the bias gradient too (needs -bias=e)"),
    **_as_in_fwd("prec", "mask", "kname", "init", "seed", "p_drop", "drop_seed", "drop_offset",
                 "drop_prefs", "timer", "warmup", "repeat"),
    "deterministic": Flag("0", "1: fixed-order dQ reduction; -v=1 then also requires 10 bitwise equal runs"),
    **_as_in_fwd("json"),
    "jsonfile": Flag("fmha_bwd.json", "where -json=1 writes"),
    **_as_in_fwd("q_eff_lens", "kv_eff_lens"),
}

# CK flags of features fmha lacks: accepted only at the values that turn the feature off.
OffFeatures = dict[str, tuple[tuple[str, ...], str]]
FWD_OFF_FEATURES: OffFeatures = {
    "vlayout": (("r",), "column-major V"),
    "num_splits": (("1",), "split-KV"),
    "page_block_size": (("0",), "paged KV cache"),
    "cache_batch_idx": (("0",), "KV-cache batch index"),
    "s_knew": (("0",), "append-KV"),
    "rotary_dim": (("0",), "rotary embedding"),
    "logits_soft_cap": (("0",), "logits soft-cap"),
    "squant": (("0", "auto"), "fp8 static quantization"),
}
BWD_OFF_FEATURES: OffFeatures = {"sink_grad": (("0",), "sink-token gradient")}


@dataclass(frozen=True)
class CkExample:
    """The flags of one of CK's example programs, as ``fmha <command>`` takes them."""

    command: str
    program: str
    flags: dict[str, Flag]
    off_features: OffFeatures
    # Without a GPU the interpreter runs the kernels: CK's default problem would take hours.
    small_defaults: dict[str, str]


FWD = CkExample("fwd", "tile_example_fmha_fwd", FWD_FLAGS, FWD_OFF_FEATURES,
                {"b": "1", "h": "2", "s": "100", "d": "64", "warmup": "0", "repeat": "1"})
BWD = CkExample("bwd", "tile_example_fmha_bwd", BWD_FLAGS, BWD_OFF_FEATURES,
                {"b": "1", "h": "2", "s": "64", "d": "32", "warmup": "0", "repeat": "1"})
EXAMPLES = {example.command: example for example in (FWD, BWD)}

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (rtol, atol) of CK's get_elimit: forward (section 8.4) and backward (section 9).
FWD_TOLERANCES = {"fp16": (1e-3, 1e-3), "bf16": (1e-2, 1e-2), "fp32": (1e-5, 1e-5)}
BWD_TOLERANCES = {"fp16": (1e-2, 1e-2), "bf16": (1e-2, 1e-2), "fp32": (1e-4, 1e-4)}
BWD_BF16_LARGE_HDIM_TOLERANCE = (3.2e-2, 3.2e-2)  # bf16 with both head dims above 128
INITS = {"uf": "uf", "1": "uf", "ui": "ui", "0": "ui", "ni": "ni", "nf": "nf", "tf": "tf", "2": "tf"}
LAYOUTS = {True: "bhsd", False: "bshd"}
HELP_TOKENS = ("-?", "--help", "-help")
DETERMINISM_RUNS = 10  # backward runs that -deterministic=1 -v=1 requires to agree bit for bit


# ---------------------------------------------------------------------------------------------
# Flags


def parse_ck_flags(tokens: list[str], example: CkExample) -> dict[str, str]:
    """``["-b=2", ...]`` -> ``{"b": "2", ...}``, rejecting anything but ``example``'s ``-name=value``."""
    given = {}
    for token in tokens:
        name, sep, value = token.partition("=")
        if not sep or not name.startswith("-") or name.startswith("--"):
            raise UsageError(f"expected -name=value, got {token!r}")
        name = name[1:]
        if name in example.off_features:
            allowed, feature = example.off_features[name]
            if value not in allowed:
                raise UsageError(f"-{name}={value}: fmha has no {feature} (only -{name}={allowed[0]})")
        elif name not in example.flags:
            valid = " ".join(f"-{n}" for n in example.flags)
            raise UsageError(f"unknown flag -{name}; valid flags: {valid} "
                             f"(fmha {example.command} -? explains them)")
        given[name] = value
    return given


def ck_help(example: CkExample) -> str:
    lines = [f"usage: fmha {example.command} [-name=value ...]  (the flags of CK's {example.program})", ""]
    lines += [f"  {f'-{name}={flag.default}':<24} {flag.meaning}" for name, flag in example.flags.items()]
    lines += [f"  {f'-{name}={allowed[0]}':<24} only {'/'.join(allowed)}: fmha has no {feature}"
              for name, (allowed, feature) in example.off_features.items()]
    small = " ".join(f"-{name}={value}" for name, value in example.small_defaults.items())
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
class Problem:
    """What ``fmha fwd`` and ``fmha bwd`` share, resolved from the flags (``flags`` keeps every
    value as text)."""

    command: ClassVar[str]
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

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.leading_shape(self.slots_q), self.nhead_q, self.hdim_v)

    def settings(self) -> str:
        """The result line's fields after ``d:``, which differ between fwd and bwd."""
        raise NotImplementedError


@dataclass
class FwdProblem(Problem):
    """One ``fmha fwd`` run."""

    command: ClassVar[str] = "fwd"
    lse: bool

    def settings(self) -> str:
        return (f"scale_s:{self.scale:g}, bias:{_bias_text(self)}, p_drop:{self.p_drop:g}, "
                f"lse:{int(self.lse)}, squant:0, mask:{self.mask}, v:r")


@dataclass
class BwdProblem(Problem):
    """One ``fmha bwd`` run."""

    command: ClassVar[str] = "bwd"
    dbias: bool
    deterministic: bool

    @property
    def s_randval(self) -> bool:
        """CK validates the dropout bytes whenever there is dropout to validate."""
        return self.p_drop > 0 and self.validate

    def settings(self) -> str:
        return (f"scale:{self.scale:g}, bias:{_bias_text(self)}, dbias:{int(self.dbias)}, "
                f"p_drop:{self.p_drop:g}, s_randval:{int(self.s_randval)}, "
                f"deterministic:{int(self.deterministic)}, mask:{self.mask}")


def fwd_problem(given: dict[str, str], *, small: bool = False) -> FwdProblem:
    """Resolve parsed flags into a problem; ``small`` uses the small defaults for flags not given."""
    flags = _flag_values(FWD, given, small)
    return FwdProblem(**_shared_fields(flags, scale_flag="scale_s"), lse=_switch("lse", flags["lse"]))


def bwd_problem(given: dict[str, str], *, small: bool = False) -> BwdProblem:
    """Resolve parsed flags into a problem; ``small`` uses the small defaults for flags not given."""
    flags = _flag_values(BWD, given, small)
    fields = _shared_fields(flags, scale_flag="scale")
    dbias = _switch("dbias", flags["dbias"])
    if dbias and fields["bias"] != "e":
        raise UsageError(f"-dbias=1: needs an elementwise bias (-bias=e), got -bias={flags['bias']}")
    return BwdProblem(**fields, dbias=dbias, deterministic=_switch("deterministic", flags["deterministic"]))


def _flag_values(example: CkExample, given: dict[str, str], small: bool) -> dict[str, str]:
    """Every flag of ``example`` as text: given, else (``small``) the small default, else CK's."""
    flags = {name: flag.default for name, flag in example.flags.items()}
    if small:
        flags.update(example.small_defaults)
    flags.update({name: value for name, value in given.items() if name in example.flags})
    return flags


def _shared_fields(flags: dict[str, str], scale_flag: str) -> dict:
    """The fields of ``Problem`` (the scale flag is ``-scale_s`` in fwd, ``-scale`` in bwd)."""
    group = _switch("mode", flags["mode"])
    batch = _int("b", flags["b"], minimum=1)
    nhead_q = _int("h", flags["h"], minimum=1)
    hdim_q = _int("d", flags["d"], minimum=1)
    scale = _float(scale_flag, flags[scale_flag])
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
    return dict(
        flags=flags, prec=prec, group=group, batch=batch, nhead_q=nhead_q,
        nhead_k=_int_or_default("h_k", flags["h_k"], nhead_q),
        **_sequence_lengths(flags, group, batch),
        hdim_q=hdim_q, hdim_v=_int_or_default("d_v", flags["d_v"], hdim_q),
        scale=scale if scale != 0 else 1 / math.sqrt(hdim_q),
        bhsd_in=_switch("iperm", flags["iperm"]), bhsd_out=_switch("operm", flags["operm"]),
        bias=bias, bias_rank=bias_rank, mask=mask, p_drop=p_drop,
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


def describe(p: Problem) -> str:
    """CK's result line up to the timings, e.g. ``[fp16|batch|bhsd] b:2, h:8/8, ..., mask:n``."""
    layout = LAYOUTS[p.bhsd_in] if p.bhsd_in == p.bhsd_out else f"{LAYOUTS[p.bhsd_in]}-{LAYOUTS[p.bhsd_out]}"
    # CK prints the first batch's lengths: logical in group mode, the slot in batch mode.
    shown_q, shown_k = (p.lens_q[0], p.lens_k[0]) if p.group else (p.slots_q[0], p.slots_k[0])
    kpad = f"({p.slots_k[0]})" if p.group and p.ragged_k else ""
    return (f"[{p.prec}|{'group' if p.group else 'batch'}|{layout}] b:{p.batch}, "
            f"h:{p.nhead_q}/{p.nhead_k}, s:{shown_q}/{shown_k}{kpad}, d:{p.hdim_q}/{p.hdim_v}, "
            f"{p.settings()}")


def _bias_text(p: Problem) -> str:
    return {"n": "n", "e": "e", "a": "alibi"}[p.bias] + (f"[{p.bias_rank}]" if p.bias_rank else "")


def _visible_area(mask: Mask, lens_q: list[int], lens_k: list[int], device=None) -> int:
    """The (i, j) pairs the mask shows, summed over the batches."""
    pairs = collections.Counter(zip(lens_q, lens_k))
    return sum(count * int(visible(mask, sq, sk, device).sum()) for (sq, sk), count in pairs.items())


def fwd_flops(mask: Mask, lens_q: list[int], lens_k: list[int], nhead: int, hdim_q: int,
              hdim_v: int, device=None) -> int:
    """``sum_b nhead * 2 * A_b * (dq + dv)``, ``A_b`` the visible (i, j) pairs of batch ``b``."""
    return nhead * 2 * _visible_area(mask, lens_q, lens_k, device) * (hdim_q + hdim_v)


def bwd_flops(mask: Mask, lens_q: list[int], lens_k: list[int], nhead: int, hdim_q: int,
              hdim_v: int, device=None) -> int:
    """``sum_b nhead * (6 * A_b * dq + 4 * A_b * dv)``: CK's ``3*2*sq*sk*dq + 2*2*sq*sk*dv``
    (S and dP recomputed, dQ, dK, dV) over the visible area ``A_b``."""
    return nhead * _visible_area(mask, lens_q, lens_k, device) * (6 * hdim_q + 4 * hdim_v)


def fwd_bytes(lens_q: list[int], lens_k: list[int], nhead_q: int, nhead_k: int, hdim_q: int,
              hdim_v: int, element_size: int) -> int:
    """Bytes of Q, O (per query head) and K, V (per key head) over the logical lengths."""
    per_row_q, per_row_k = nhead_q * (hdim_q + hdim_v), nhead_k * (hdim_q + hdim_v)
    return (per_row_q * sum(lens_q) + per_row_k * sum(lens_k)) * element_size


def bwd_bytes(lens_q: list[int], lens_k: list[int], nhead_q: int, nhead_k: int, hdim_q: int,
              hdim_v: int, element_size: int) -> int:
    """Bytes of Q, dQ, O, dO (per query head), K, V, dK, dV (per key head) over the logical
    lengths, plus 16 fp32 bytes a query row and head for LSE and D."""
    per_row_q, per_row_k = nhead_q * 2 * (hdim_q + hdim_v), nhead_k * 2 * (hdim_q + hdim_v)
    return ((per_row_q * sum(lens_q) + per_row_k * sum(lens_k)) * element_size
            + nhead_q * 4 * 4 * sum(lens_q))


def format_line(p: Problem, ms: float, tflops: float, gb_per_s: float, valid: bool | None) -> str:
    line = f"{describe(p)}, {ms:.3f} ms, {tflops:.2f} TFlops, {gb_per_s:.2f} GB/s"
    return line if valid is None else f"{line}, valid:{'y' if valid else 'n'}"


# ---------------------------------------------------------------------------------------------
# Running one problem


@dataclass
class Result:
    line: str
    valid: bool | None  # None: not validated (-v=0)
    ms: float = math.nan
    tflops: float = math.nan
    gb_per_s: float = math.nan
    flop: int = 0
    bytes: int = 0


def _timed_result(p: Problem, ms: float, flop: int, nbytes: int, valid: bool | None) -> Result:
    tflops, gb_per_s = flop / 1e9 / ms, nbytes / 1e6 / ms
    return Result(format_line(p, ms, tflops, gb_per_s, valid), valid, ms, tflops, gb_per_s, flop, nbytes)


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


def _generator(p: Problem, device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if p.seed:
        generator.manual_seed(p.seed)
    else:
        generator.seed()
    return generator


def _random(p: Problem, shape: tuple[int, ...], bhsd: bool, generator: torch.Generator, device) -> torch.Tensor:
    """A ``-init`` tensor of logical shape ``[..., S, H, D]`` in the layout ``bhsd`` asks for."""
    t = _laid_out(shape, bhsd, p.dtype, device)
    return t.copy_(_init_values(t.shape, p.init, generator, device))


def _nan_output(p: Problem, device) -> torch.Tensor:
    """O in the ``-operm`` layout, NaN until written: a row the forward misses, or that the
    backward reads though it should not, turns into a failure."""
    return _laid_out(p.out_shape, p.bhsd_out, p.dtype, device).fill_(math.nan)


def _prefix_sums(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _dropout_number(value: int, as_tensor: bool, device):
    """An int, or (``-drop_prefs=1``) a one-element int64 device tensor of the same bits."""
    if not as_tensor:
        return value
    return torch.tensor([value - 2**64 if value >= 2**63 else value], dtype=torch.int64, device=device)


def make_inputs(p: Problem, device, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """``q, k, v`` in the requested layouts, built on ``device``, and the keywords that
    ``fmha.fwd``, ``fmha.bwd`` and ``fmha.reference.attention`` share."""
    lead_q, lead_k = p.leading_shape(p.slots_q), p.leading_shape(p.slots_k)
    q = _random(p, (*lead_q, p.nhead_q, p.hdim_q), p.bhsd_in, generator, device)
    k = _random(p, (*lead_k, p.nhead_k, p.hdim_q), p.bhsd_in, generator, device)
    v = _random(p, (*lead_k, p.nhead_k, p.hdim_v), p.bhsd_in, generator, device)
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


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_fwd(p: FwdProblem) -> Result:
    """Run, time and (with ``-v``) validate one forward problem on the GPU, or the CPU without one."""
    device = _device()
    q, k, v, common = make_inputs(p, device, _generator(p, device))
    launch = functools.partial(fmha.fwd, q, k, v, **common, out=_nan_output(p, device), return_lse=p.lse,
                               return_randval=p.validate and p.p_drop > 0)
    ms, result = _time_launches(launch, p.warmup, p.repeat, device.type == "cuda" and p.gpu_timer)
    valid = outputs_match(p, q, k, v, common, result) if p.validate else None
    flop = fwd_flops(p.mask, p.lens_q, p.lens_k, p.nhead_q, p.hdim_q, p.hdim_v, device)
    nbytes = fwd_bytes(p.lens_q, p.lens_k, p.nhead_q, p.nhead_k, p.hdim_q, p.hdim_v, q.element_size())
    return _timed_result(p, ms, flop, nbytes, valid)


def run_bwd(p: BwdProblem) -> Result:
    """Run the forward once, then time (and with ``-v`` validate) the backward alone."""
    device = _device()
    generator = _generator(p, device)
    q, k, v, common = make_inputs(p, device, generator)
    forward = fmha.fwd(q, k, v, **common, out=_nan_output(p, device), return_lse=True,
                       return_randval=p.s_randval)
    dout = _random(p, p.out_shape, p.bhsd_out, generator, device)
    launch = functools.partial(fmha.bwd, dout, q, k, v, forward.out, forward.lse, **common,
                               deterministic=p.deterministic)
    ms, grads = _time_launches(launch, p.warmup, p.repeat, device.type == "cuda" and p.gpu_timer)
    valid = None
    if p.validate:
        valid = gradients_match(p, q, k, v, common, forward, dout, grads)
        if p.deterministic:
            valid = valid and _repeatable(launch, grads)
    flop = bwd_flops(p.mask, p.lens_q, p.lens_k, p.nhead_q, p.hdim_q, p.hdim_v, device)
    nbytes = bwd_bytes(p.lens_q, p.lens_k, p.nhead_q, p.nhead_k, p.hdim_q, p.hdim_v, q.element_size())
    return _timed_result(p, ms, flop, nbytes, valid)


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


def _reference_dtype(device: torch.device) -> torch.dtype:
    """float32 on the GPU; the CPU can afford float64."""
    return torch.float32 if device.type == "cuda" else torch.float64


def _logical_rows(p: Problem, lens: list[int], slots: list[int], device) -> torch.Tensor:
    """Boolean over the leading dims of q/out (or k/v): the rows that belong to a sequence."""
    if not p.group:
        return torch.arange(slots[0], device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    rows = torch.zeros(sum(slots), dtype=torch.bool, device=device)
    for start, n in zip(itertools.accumulate([0, *slots]), lens):
        rows[start : start + n] = True
    return rows


def _visible_randval(p: Problem, shape, device) -> torch.Tensor:
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


def _randval_match(p: Problem, actual: torch.Tensor, expected: torch.Tensor) -> bool:
    seen = _visible_randval(p, actual.shape, actual.device)
    return torch.equal(actual[seen], expected[seen])


def outputs_match(p: FwdProblem, q, k, v, common: dict, result: fmha.AttentionOutput) -> bool:
    """Compare out (and lse, randval where produced) with ``fmha.reference.attention``."""
    ref = fmha.reference.attention(q, k, v, **common, compute_dtype=_reference_dtype(q.device))
    rtol, atol = FWD_TOLERANCES[p.prec]
    rows = _logical_rows(p, p.lens_q, p.slots_q, q.device)
    valid = _all_close(result.out[rows], ref.out[rows], rtol, atol)
    if result.lse is not None:
        valid &= _all_close(result.lse, ref.lse, rtol, atol, allow_infinity=True)
    if result.randval is not None:
        valid &= _randval_match(p, result.randval, ref.randval)
    return valid


class ReferenceBackward(NamedTuple):
    grads: fmha.AttentionGrads
    randval: torch.Tensor | None


def reference_backward(p: BwdProblem, q, k, v, common: dict, out: torch.Tensor,
                       dout: torch.Tensor) -> ReferenceBackward:
    """The backward of SPEC section 6 for the forward's ``out``, by ``torch.autograd`` through
    ``fmha.reference.attention``, and the reference's dropout bytes."""
    compute_dtype = _reference_dtype(q.device)
    tensors = [q, k, v, common["bias"]] if p.dbias else [q, k, v]
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in tensors]
    keywords = dict(common, bias=leaves[3]) if p.dbias else common
    ref = fmha.reference.attention(*leaves[:3], **keywords, compute_dtype=compute_dtype)
    dout = dout.to(compute_dtype)
    # materialize: a tensor the mask hides entirely still has a (zero) gradient
    grads = torch.autograd.grad((ref.out, ref.lse), leaves, (dout, _lse_gradient(p, out, ref, dout)),
                                allow_unused=True, materialize_grads=True)
    return ReferenceBackward(fmha.AttentionGrads(*grads[:3], grads[3] if p.dbias else None), ref.randval)


def _lse_gradient(p: BwdProblem, out: torch.Tensor, ref: fmha.reference.AttentionResult,
                  dout: torch.Tensor) -> torch.Tensor:
    """``-rowsum(dO * (out - O_exact))`` in the LSE's layout.

    The backward's ``D = rowsum(dO * O)`` uses the O it is given, rounded to the input type, while
    autograd's uses the exact O; in ``dS = P * (dP - D)`` the two nearly cancel, so bf16's rounding
    of O alone can exceed CK's tolerance. As ``dLSE_i / dS_ij = P_ij``, this gradient on the LSE
    moves autograd's D to the given O's (CK's host reference also takes D from the rounded O)."""
    shift = ((out.to(dout.dtype) - ref.out.detach()) * dout).sum(-1)  # [B, S, H] or [rows, H]
    rows = _logical_rows(p, p.lens_q, p.slots_q, out.device)
    if p.group:  # the LSE has the logical rows only, in order: [H, seqstart_q[-1]]
        return -shift[rows].transpose(0, 1).to(ref.lse.dtype)
    return -shift.masked_fill(~rows[..., None], 0).transpose(1, 2).to(ref.lse.dtype)


def _bwd_tolerances(p: BwdProblem) -> tuple[float, float]:
    if p.prec == "bf16" and p.hdim_q > 128 and p.hdim_v > 128:
        return BWD_BF16_LARGE_HDIM_TOLERANCE
    return BWD_TOLERANCES[p.prec]


def gradients_match(p: BwdProblem, q, k, v, common: dict, forward: fmha.AttentionOutput,
                    dout: torch.Tensor, grads: fmha.AttentionGrads) -> bool:
    """dQ, dK, dV (and dBias, and the forward's dropout bytes) against the reference: logical
    rows within CK's tolerances, padding rows exactly zero."""
    ref = reference_backward(p, q, k, v, common, forward.out, dout)
    rtol, atol = _bwd_tolerances(p)
    rows_q = _logical_rows(p, p.lens_q, p.slots_q, q.device)
    rows_k = _logical_rows(p, p.lens_k, p.slots_k, q.device)
    valid = all(
        _all_close(got[rows], expected[rows], rtol, atol) and not got[~rows].any()
        for got, expected, rows in zip(grads[:3], ref.grads[:3], (rows_q, rows_k, rows_k))
    )
    if p.dbias:
        valid &= _all_close(grads.dbias, ref.grads.dbias, rtol, atol)
    if forward.randval is not None:
        valid &= _randval_match(p, forward.randval, ref.randval)
    return valid


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: fmha.AttentionGrads, b: fmha.AttentionGrads) -> bool:
    """Bitwise equality (``torch.equal`` would let -0.0 pass for 0.0); dbias may be absent in both."""
    return all(x is None or torch.equal(x.view(_SAME_SIZE_INTS[x.element_size()]),
                                        y.view(_SAME_SIZE_INTS[y.element_size()]))
               for x, y in zip(a, b))


def _repeatable(launch, first: fmha.AttentionGrads) -> bool:
    """CK's determinism criterion: the backward, run DETERMINISM_RUNS times in all, gives the
    same bits every time (``first`` is the timed run's)."""
    return all(_same_bits(first, launch()) for _ in range(DETERMINISM_RUNS - 1))


# ---------------------------------------------------------------------------------------------
# fmha fwd, fmha bwd

# command -> (resolve its parsed flags into a problem, run the problem)
RUNNERS = {"fwd": (fwd_problem, run_fwd), "bwd": (bwd_problem, run_bwd)}


def parse_problem(command: str, tokens: list[str], *, small: bool = False) -> Problem:
    resolve, _ = RUNNERS[command]
    return resolve(parse_ck_flags(tokens, EXAMPLES[command]), small=small)


def run_problem(p: Problem) -> Result:
    _, run = RUNNERS[p.command]
    return run(p)


def _environment() -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "fmha": fmha.__version__}


def _write_json(p: Problem, result: Result) -> None:
    record = {"command": p.command, "flags": p.flags, **asdict(result), **_environment()}
    with open(p.jsonfile, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


def ck_command(command: str, tokens: list[str]) -> int:
    """``fmha fwd|bwd -name=value ...``; exit 0 valid (or not validated), 1 invalid, 2 bad flags."""
    if any(token in HELP_TOKENS for token in tokens):
        print(ck_help(EXAMPLES[command]))
        return 0
    no_cuda = not torch.cuda.is_available()
    try:
        problem = parse_problem(command, tokens, small=no_cuda)
        if no_cuda:
            print(NO_CUDA_NOTE)
        result = run_problem(problem)
    except UsageError as exc:
        print(f"fmha {command}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, NotImplementedError) as exc:  # fmha's own input checks
        print(f"fmha {command}: error: {exc}", file=sys.stderr)
        return 1
    print(result.line)
    if problem.write_json:
        _write_json(problem, result)
    return 0 if result.valid in (True, None) else 1


# ---------------------------------------------------------------------------------------------
# fmha check fwd, fmha check bwd


SMOKE_HEAD_DIMS = (32, 64, 128, 256)
# ck-reference.md section 10.1; {d} is the head dim of the loop.
FWD_SMOKE_SHAPES = (
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
# ck-reference.md section 10.2.
BWD_SMOKE_SHAPES = (
    "-b=1 -h=4 -h_k=2 -d={d} -s=259",
    "-b=2 -h=2 -d={d} -s=516 -s_k=253",
    "-b=1 -h=4 -h_k=1 -d={d} -s=500 -s_k=251 -mask=1",
    "-b=1 -h=2 -d={d} -s=900 -s_k=258 -mask=2",
    "-b=2 -h=1 -d={d} -s=987 -s_k=219 -mask=t:128,30",
    "-b=2 -h=3 -h_k=1 -d={d} -s=244 -s_k=499 -mask=b:4,35",
)


class BwdVariant(NamedTuple):
    biases: tuple[str, ...]
    dbias: int
    deterministic: int


# CK's backward matrix (bias n/a), again with -deterministic=1, then with a bias and its gradient.
BWD_VARIANTS = {
    "base": BwdVariant(("n", "a"), dbias=0, deterministic=0),
    "deterministic": BwdVariant(("n", "a"), dbias=0, deterministic=1),
    "dbias": BwdVariant(("e",), dbias=1, deterministic=0),
}


def fwd_smoke_cases() -> list[str]:
    """The option strings of CK's forward smoke matrix, in its loop order."""
    loops = itertools.product(("fp16", "bf16"), (0, 1), (0, 1), SMOKE_HEAD_DIMS, (0, 1), "nea",
                              ("0", "0.2"), FWD_SMOKE_SHAPES)
    return [
        f"-prec={prec} -mode={mode} -iperm={perm} -operm={perm} {shape.format(d=hdim)} "
        f"-lse={lse} -bias={bias} -p_drop={p_drop} -v=1 -warmup=0 -repeat=1"
        for prec, mode, perm, hdim, lse, bias, p_drop, shape in loops
    ]


def bwd_smoke_cases(variant: str = "all") -> list[str]:
    """The option strings of CK's backward smoke matrix and its variants, in CK's loop order."""
    variants = BWD_VARIANTS.values() if variant == "all" else [BWD_VARIANTS[variant]]
    return [
        f"-prec={prec} -mode={mode} -iperm={perm} -operm={perm} {shape.format(d=hdim)} "
        f"-bias={bias} -dbias={v.dbias} -p_drop={p_drop} -deterministic={v.deterministic} "
        f"-v=1 -warmup=0 -repeat=1"
        for v in variants
        for prec, perm, hdim, mode, bias, p_drop, shape in itertools.product(
            ("fp16", "bf16"), (0, 1), SMOKE_HEAD_DIMS, (0, 1), v.biases, ("0", "0.2"), BWD_SMOKE_SHAPES)
    ]


def run_case(command: str, options: str) -> Result:
    """``fmha <command> <options>`` as a smoke case; an exception is this case's failure."""
    try:
        return run_problem(parse_problem(command, options.split()))
    except Exception as exc:  # one broken case is reported, it does not end the matrix
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Result(f"{options}: error: {type(exc).__name__}: {message}", valid=False)


def _run_cases(command: str, cases: list[str], jobs: int):
    """Results in case order; with ``jobs > 1`` from that many spawned workers sharing the GPU."""
    if jobs <= 1 or len(cases) <= 1:
        yield from (run_case(command, case) for case in cases)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(cases)), mp_context=context) as pool:
        futures = [pool.submit(run_case, command, case) for case in cases]
        for case, future in zip(cases, futures):
            try:
                yield future.result()
            except concurrent.futures.process.BrokenProcessPool as exc:
                yield Result(f"{case}: error: a worker died ({exc})", valid=False)


def _matches(command: str, case: str, text: str) -> bool:
    return text in case or text in describe(parse_problem(command, case.split()))


def check_command(args: argparse.Namespace) -> int:
    command = args.direction
    cases = fwd_smoke_cases() if command == "fwd" else bwd_smoke_cases(args.variant)
    if args.filter:
        cases = [case for case in cases if _matches(command, case, args.filter)]
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
        for case, result in zip(cases, _run_cases(command, cases, args.jobs)):
            emit(result.line)
            if result.valid:
                passed += 1
            else:
                emit(f"    rerun: fmha {command} {case}")
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
    cases: list[bench.Case] = []
    for d, s, c, feature in itertools.product(args.head_dims, args.seqlens, args.causal, args.features):
        if feature == "window" and c:
            continue  # the window is its own mask
        case = bench.Case(head_dim=d, seqlen=s, causal=bool(c), direction=args.direction, tokens=args.tokens,
                          feature=feature)
        # A feature's cost is measured against its plain reference, timed first.
        for x in (bench.plain_reference(case), case):
            if x not in cases:
                cases.append(x)
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
    commands.add_parser("bwd", add_help=False,
                        help="one backward problem with CK's tile_example_fmha_bwd flags "
                             "(fmha bwd -? lists them)")
    check = commands.add_parser("check", help="CK's forward or backward smoke-test matrix")
    check.add_argument("direction", choices=list(EXAMPLES))
    check.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                       help="worker processes sharing the GPU (default: min(8, CPUs))")
    check.add_argument("--filter", help="only cases whose options or result line contain this text")
    check.add_argument("--limit", type=int, help="only the first N cases")
    check.add_argument("--log", help="also write every line to this file")
    check.add_argument("--variant", choices=["all", *BWD_VARIANTS], default="all",
                       help="bwd only: CK's matrix (base), it again with -deterministic=1, or with "
                            "-bias=e -dbias=1 (default: all three)")
    commands.add_parser("info", help="versions, the GPU, and which features run here (and why not)")
    timing = commands.add_parser("bench", help="time fmha against the attention implementations installed")
    timing.add_argument("--head-dims", type=int, nargs="+", default=list(bench.DEFAULT_HEAD_DIMS))
    timing.add_argument("--seqlens", type=int, nargs="+", default=list(bench.DEFAULT_SEQLENS))
    timing.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[0, 1])
    timing.add_argument("--direction", choices=["fwd", "bwd"], default="fwd",
                        help="bwd times the backward alone (2.5x the forward's FLOPs)")
    timing.add_argument("--providers", nargs="+", choices=list(bench.PROVIDERS),
                        help="default: all (fmha_deterministic only with --direction bwd)")
    timing.add_argument("--tokens", type=int, default=16384, help="tokens per batch (b = tokens // seqlen)")
    timing.add_argument("--features", nargs="+", choices=list(bench.FEATURES), default=["plain"],
                        help=f"time these feature variants too, each beside its plain reference: bias "
                             f"([H, S, S], no dbias), alibi, window ({bench.WINDOW}), dropout "
                             f"(p={bench.DROPOUT_P}), gqa ({bench.GQA_RATIO}:1), varlen "
                             f"({bench.VARLEN_SEQUENCES} sequences of random lengths, against a batch of "
                             f"equal ones), bias+dropout")
    timing.add_argument("--jsonl", help="append one JSON line per timing to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``fmha <command> ...`` and return its exit code (argparse usage errors exit as usual)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in EXAMPLES:
        return ck_command(args.command, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "info":
        from .info import report

        print(report())
        return 0
    if args.command == "check":
        if args.direction == "fwd" and args.variant != "all":
            parser.error("--variant: only check bwd has variants")
        return check_command(args)
    return bench_command(args)
