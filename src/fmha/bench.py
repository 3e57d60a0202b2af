"""Time fmha against the attention implementations installed beside it; one JSON line per timing.

Shapes follow CK's benchmark: ``tokens`` per batch (``b = tokens // seqlen``), ``h = 2048 // d``,
bf16, ``[B, S, H, D]`` tensors (peers that want ``[B, H, S, D]`` get transposed views).
FLOPs count the visible area only: ``4 * b * h * visible * d`` forward, 2.5x that backward.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

import fmha

DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (1024, 4096, 16384)


@dataclass
class Case:
    head_dim: int
    seqlen: int
    causal: bool
    direction: str = "fwd"
    dtype: str = "bf16"
    tokens: int = 16384
    features: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return max(1, self.tokens // self.seqlen)

    @property
    def nheads(self) -> int:
        return max(1, 2048 // self.head_dim)

    def flops(self) -> float:
        s = self.seqlen
        visible = s * (s + 1) / 2 if self.causal else s * s
        fwd = 4.0 * self.batch * self.nheads * visible * self.head_dim
        return fwd * (2.5 if self.direction == "bwd" else 1.0)


def _inputs(case: Case, device: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    shape = (case.batch, case.seqlen, case.nheads, case.head_dim)
    grad = case.direction == "bwd"
    return [torch.randn(shape, dtype=dtype, device=device, requires_grad=grad) for _ in range(3)]


def _fmha(deterministic: bool):
    def make(case: Case, q, k, v):
        mask = "b" if case.causal else None
        return lambda: fmha.attention(q, k, v, mask=mask, deterministic=deterministic)

    return make


def _sdpa(backend_name: str):
    def make(case: Case, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=case.causal)

        return run

    return make


_flex_compiled = None


def _flex(case: Case, q, k, v):
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        # One compiled kernel per benchmark shape: allow more than dynamo's default 8 recompiles.
        torch._dynamo.config.recompile_limit = 64
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    block_mask = None
    if case.causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, case.seqlen,
                                       case.seqlen, device=q.device)
    return lambda: _flex_compiled(qt, kt, vt, block_mask=block_mask)


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

    # A copy of the tree without .git (a remote GPU machine) names its commit in FMHA_COMMIT.
    commit = os.environ.get("FMHA_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fmha": fmha.__version__,
        "commit": commit,
    }


def time_case(case: Case, provider: str, device: str = "cuda") -> dict:
    """One timing: ``{"ms", "tflops"}`` or ``{"error"}`` when the provider cannot run the case."""
    import triton.testing

    torch.manual_seed(0)
    q, k, v = _inputs(case, device)
    try:
        fn = PROVIDERS[provider](case, q, k, v)
        if case.direction == "bwd":
            out = fn()
            dout = torch.randn_like(out)
            fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # a peer that cannot run this case is reported, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
    return {"ms": ms, "tflops": case.flops() / ms / 1e9}


def run(cases: list[Case], providers: list[str], jsonl: str | None = None, log=print) -> list[dict]:
    """Time every case with every provider, add each fmha row's ratio to the best peer, write JSON lines."""
    env = _environment()
    rows = []
    for case in cases:
        cell = []
        for provider in providers:
            rec = {**env, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "provider": provider, **asdict(case), "batch": case.batch, "nheads": case.nheads,
                   **time_case(case, provider)}
            cell.append(rec)
        peers = [r["tflops"] for r in cell if not r["provider"].startswith("fmha") and "tflops" in r]
        for rec in cell:
            if rec["provider"].startswith("fmha") and "tflops" in rec and peers:
                rec["best_peer_tflops"] = max(peers)
                rec["ratio_to_best_peer"] = rec["tflops"] / max(peers)
        rows.extend(cell)
        log(format_cell(case, cell))
        if jsonl:  # cell by cell, so that an interrupted run keeps what it measured
            with open(jsonl, "a") as f:
                for rec in cell:
                    f.write(json.dumps(rec) + "\n")
    return rows


def format_cell(case: Case, cell: list[dict]) -> str:
    parts = [f"{case.direction} d={case.head_dim:<3} s={case.seqlen:<5} causal={int(case.causal)}"]
    for rec in cell:
        value = f"{rec['tflops']:6.1f}" if "tflops" in rec else "   n/a"
        parts.append(f"{rec['provider']}={value}")
    fm = next((r for r in cell if r["provider"] == "fmha" and "ratio_to_best_peer" in r), None)
    if fm:
        parts.append(f"ratio={fm['ratio_to_best_peer']:.2f}")
    return "  ".join(parts)
