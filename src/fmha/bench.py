"""Time fmha against the attention implementations installed beside it; one JSON line per timing.

Shapes follow CK's benchmark: ``tokens`` per batch (``b = tokens // seqlen``), ``h = 2048 // d``,
bf16, ``[B, S, H, D]`` tensors (peers that want ``[B, H, S, D]`` get transposed views).
FLOPs count the visible area only: ``4 * b * h * visible * d`` forward, 2.5x that backward.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import random
import subprocess
from dataclasses import asdict, astuple, dataclass
from typing import Callable

import torch

import fmha

from . import reference
from .masks import Mask, parse_mask

DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (1024, 4096, 16384)


# Feature variants of a case (issue 4's feature costs): what each turns on in fmha.
FEATURES = ("plain", "bias", "alibi", "window", "dropout", "gqa", "varlen", "bias+dropout")
WINDOW = "b:1024,0"  # the window feature's mask: 1024 keys back and the diagonal
GQA_RATIO = 8  # query heads per key/value head in the gqa feature
VARLEN_SEQUENCES = 16  # the varlen feature packs this many sequences of random lengths
DROPOUT_P = 0.1


@dataclass
class Case:
    head_dim: int
    seqlen: int
    causal: bool
    direction: str = "fwd"
    dtype: str = "bf16"
    tokens: int = 16384
    feature: str = "plain"

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"feature: expected one of {', '.join(FEATURES)}, got {self.feature!r}")

    @property
    def batch(self) -> int:
        return max(1, self.tokens // self.seqlen)

    @property
    def nheads(self) -> int:
        return max(1, 2048 // self.head_dim)

    @property
    def nheads_k(self) -> int:
        return max(1, self.nheads // GQA_RATIO) if self.feature == "gqa" else self.nheads

    @property
    def mask(self) -> str | None:
        if self.feature == "window":
            return WINDOW
        return "b" if self.causal else None

    @property
    def dropout_p(self) -> float:
        return DROPOUT_P if "dropout" in self.feature else 0.0

    def varlen_lengths(self) -> list[int]:
        """The varlen feature's sequence lengths: ``tokens`` cut at random (fixed) places."""
        cuts = sorted(random.Random(0).sample(range(1, self.tokens), VARLEN_SEQUENCES - 1))
        return [b - a for a, b in zip([0, *cuts], [*cuts, self.tokens])]

    def flops(self) -> float:
        mask = parse_mask(self.mask)
        if self.feature == "varlen":
            visible = sum(visible_pairs(mask, n, n) for n in self.varlen_lengths())
        else:
            visible = self.batch * visible_pairs(mask, self.seqlen, self.seqlen)
        fwd = 4.0 * self.nheads * visible * self.head_dim
        return fwd * (2.5 if self.direction == "bwd" else 1.0)


def visible_pairs(mask: Mask, seqlen_q: int, seqlen_k: int) -> int:
    """How many (query, key) pairs ``mask`` leaves visible (SPEC §3), without an [sq, sk] tensor."""
    i = torch.arange(seqlen_q, dtype=torch.int64)
    diagonal = i + mask.diagonal_offset(seqlen_q, seqlen_k)
    lo = (diagonal - mask.left).clamp(min=0) if mask.left >= 0 else torch.zeros_like(i)
    hi = (diagonal + mask.right).clamp(max=seqlen_k - 1) if mask.right >= 0 else torch.full_like(i, seqlen_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


@dataclass
class Problem:
    """Inputs of one case: q, k, v (``[B, S, H, D]``, or packed ``[T, H, D]`` for varlen) and what
    the feature adds (a bias ``[H, S, S]``, ALiBi slopes, varlen seqstarts)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    seqstart: torch.Tensor | None = None
    max_seqlen: int = 0


def make_problem(case: Case, device: str) -> Problem:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    grad = case.direction == "bwd"
    rows = (case.tokens,) if case.feature == "varlen" else (case.batch, case.seqlen)

    def tensor(heads):
        return torch.randn((*rows, heads, case.head_dim), dtype=dtype, device=device, requires_grad=grad)

    problem = Problem(tensor(case.nheads), tensor(case.nheads_k), tensor(case.nheads_k))
    if "bias" in case.feature:
        # A fixed (no-gradient) bias, broadcast over the batch.
        problem.bias = torch.randn(case.nheads, case.seqlen, case.seqlen, dtype=dtype, device=device)
    if case.feature == "alibi":
        problem.alibi_slopes = fmha.alibi_slopes(case.nheads, device=device)
    if case.feature == "varlen":
        lengths = case.varlen_lengths()
        problem.seqstart = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        problem.max_seqlen = max(lengths)
    return problem


def _fmha(deterministic: bool):
    def make(case: Case, p: Problem):
        kwargs = dict(mask=case.mask, bias=p.bias, alibi_slopes=p.alibi_slopes, dropout_p=case.dropout_p,
                      deterministic=deterministic)
        if case.feature == "varlen":
            return lambda: fmha.attention_varlen(p.q, p.k, p.v, p.seqstart, p.seqstart, max_seqlen_q=p.max_seqlen,
                                                 max_seqlen_k=p.max_seqlen, **kwargs)
        return lambda: fmha.attention(p.q, p.k, p.v, **kwargs)

    return make


class Unsupported(Exception):
    """A peer that cannot express the case's feature (reported as n/a)."""


def _sdpa(backend_name: str):
    def make(case: Case, p: Problem):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.feature in ("alibi", "varlen"):
            raise Unsupported(f"SDPA has no {case.feature} (only through an [S, S] bias or nested tensors)")
        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (x.transpose(1, 2) for x in (p.q, p.k, p.v))
        attn_mask = p.bias
        if case.feature == "window":
            attn_mask = reference.visible(parse_mask(case.mask), case.seqlen, case.seqlen, device=p.q.device)
        if case.causal and attn_mask is not None:
            raise Unsupported("SDPA takes is_causal or attn_mask, not both")

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=attn_mask, dropout_p=case.dropout_p, is_causal=case.causal,
                    enable_gqa=case.feature == "gqa")

        return run

    return make


_flex_compiled = None


def _flex(case: Case, p: Problem):
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if case.dropout_p or case.feature == "varlen":
        raise Unsupported(f"FlexAttention has no {case.feature}")
    if _flex_compiled is None:
        # One compiled kernel per benchmark shape: allow more than dynamo's default 8 recompiles.
        torch._dynamo.config.recompile_limit = 64
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2) for x in (p.q, p.k, p.v))
    block_mask = None
    if case.feature == "window":
        left = parse_mask(case.mask).left
        block_mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= left), None, None,
                                       case.seqlen, case.seqlen, device=p.q.device)
    elif case.causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, case.seqlen,
                                       case.seqlen, device=p.q.device)
    score_mod = None
    if p.bias is not None:
        bias = p.bias
        score_mod = lambda score, b, h, qi, ki: score + bias[h, qi, ki]  # noqa: E731
    elif p.alibi_slopes is not None:
        slopes, causal = p.alibi_slopes, case.causal
        # ALiBi as fmha applies it (SPEC §4): slope * j under a causal mask, -slope * |i - j| otherwise.
        score_mod = ((lambda score, b, h, qi, ki: score + slopes[h] * ki) if causal else  # noqa: E731
                     (lambda score, b, h, qi, ki: score - slopes[h] * (qi - ki).abs()))
    return lambda: _flex_compiled(qt, kt, vt, score_mod=score_mod, block_mask=block_mask,
                                  enable_gqa=case.feature == "gqa")


PROVIDERS: dict[str, Callable] = {
    "fmha": _fmha(False),
    "fmha_deterministic": _fmha(True),
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex": _flex,
}


def _environment() -> dict:
    import triton

    # The commit, "-dirty" when the files differ from it (a copy of an edited tree on a remote GPU
    # machine); FMHA_COMMIT names it where there is no .git.
    commit = os.environ.get("FMHA_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                                    text=True, check=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fmha": fmha.__version__,
        "commit": commit,
    }


def timed_call(case: Case, provider: str, device: str = "cuda"):
    """The call a timing of ``case`` repeats: the forward, or the backward alone through autograd
    (its forward run once here)."""
    torch.manual_seed(0)
    p = make_problem(case, device)
    fn = PROVIDERS[provider](case, p)
    if case.direction == "bwd":
        out = fn()
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (p.q, p.k, p.v), dout, retain_graph=True)
    return fn


def error_text(exc: Exception) -> str:
    """An exception as one short line: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def time_case(case: Case, provider: str, device: str = "cuda") -> dict:
    """One timing: ``{"ms", "tflops"}`` or ``{"error"}`` when the provider cannot run the case."""
    import triton.testing

    try:
        fn = timed_call(case, provider, device)
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # a peer that cannot run this case is reported, not fatal
        return {"error": error_text(exc)}
    return {"ms": ms, "tflops": case.flops() / ms / 1e9}


def plain_reference(case: Case) -> Case:
    """The plain case a feature's cost is measured against: the same shape without the feature;
    for varlen, a batch of ``VARLEN_SEQUENCES`` equal sequences of the same total length."""
    seqlen = case.tokens // VARLEN_SEQUENCES if case.feature == "varlen" else case.seqlen
    return Case(head_dim=case.head_dim, seqlen=seqlen, causal=case.causal, direction=case.direction,
                dtype=case.dtype, tokens=case.tokens)


def run(cases: list[Case], providers: list[str], jsonl: str | None = None, log=print) -> list[dict]:
    """Time every case with every provider, add each fmha row's ratio to the best peer (and, for a
    feature timed after its plain reference, to fmha's plain speed), write JSON lines."""
    env = _environment()
    rows = []
    plain: dict[tuple, float] = {}
    for case in cases:
        cell = []
        for provider in providers:
            rec = {**env, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "provider": provider, **asdict(case), "batch": case.batch, "nheads": case.nheads,
                   "nheads_k": case.nheads_k, "mask": case.mask, "dropout_p": case.dropout_p,
                   **time_case(case, provider)}
            cell.append(rec)
        peers = [r["tflops"] for r in cell if not r["provider"].startswith("fmha") and "tflops" in r]
        for rec in cell:
            if not rec["provider"].startswith("fmha") or "tflops" not in rec:
                continue
            if peers:
                rec["best_peer_tflops"] = max(peers)
                rec["ratio_to_best_peer"] = rec["tflops"] / max(peers)
            key = (astuple(plain_reference(case)), rec["provider"])  # a plain case is its own reference
            if case.feature == "plain":
                plain[key] = rec["tflops"]
            elif key in plain:
                rec["ratio_to_plain"] = rec["tflops"] / plain[key]
        rows.extend(cell)
        log(format_cell(case, cell))
        if jsonl:  # cell by cell, so that an interrupted run keeps what it measured
            with open(jsonl, "a") as f:
                for rec in cell:
                    f.write(json.dumps(rec) + "\n")
    return rows


def format_cell(case: Case, cell: list[dict]) -> str:
    parts = [f"{case.direction} d={case.head_dim:<3} s={case.seqlen:<5} causal={int(case.causal)}"]
    if case.feature != "plain":
        parts.append(f"feature={case.feature}")
    for rec in cell:
        value = f"{rec['tflops']:6.1f}" if "tflops" in rec else "   n/a"
        parts.append(f"{rec['provider']}={value}")
    fm = next((r for r in cell if r["provider"] == "fmha" and "tflops" in r), {})
    if "ratio_to_best_peer" in fm:
        parts.append(f"ratio={fm['ratio_to_best_peer']:.2f}")
    if "ratio_to_plain" in fm:
        parts.append(f"of_plain={fm['ratio_to_plain']:.2f}")
    return "  ".join(parts)
