"""Sweep the Hopper fast path's forward configs on an H100/H200; prints TFLOP/s per config.

    python benchmarks/tune_hopper_fwd.py --head-dim 64 --seqlens 1024 4096 16384
    python benchmarks/tune_hopper_fwd.py --head-dim 128 --configs 128,2,2,240,168 64,3,2,240,168
    python benchmarks/tune_hopper_fwd.py --head-dim 64 --seqlens 1024 2048 --configs 128,2,2,240,168 --persistent 0 0

Each config is ``block_n,stages,consumers,consumer_regs,maxnreg`` (``fmha.configs.HopperFwdConfig``;
(consumers + 1) * 128 * maxnreg must stay within 65,536 registers); every candidate runs persistent
CTAs up to the shipped config's lengths unless ``--persistent MAX MAX_CAUSAL`` sets them (0 0: one
CTA per tile everywhere). Per shape it prints CUDA-graph
replay (the kernel alone) / ``do_bench`` (host time included) TFLOP/s, after checking the output
against the reference on one batch. ``FMHA_PORTABLE=0`` is set, so short sequences run the fast
path too; ``FMHA_PORTABLE=1 fmha bench`` gives the portable kernel's figures to compare. Winners,
and the ``min_seqlen`` thresholds below which the portable kernel wins, go into ``HOPPER_FWD_CONFIGS``
by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

import fmha  # before triton: it picks Triton's backend
import triton.testing
from fmha import configs
from fmha.testing import error_bound, max_error


def _time(q, k, v, mask) -> tuple[float, float]:
    """(graph replay ms, do_bench ms) of one forward, after checking its first batch."""
    fn = lambda: fmha.fwd(q, k, v, mask=mask)  # noqa: E731
    out = fn().out
    exact = fmha.reference.attention(q[:1], k[:1], v[:1], mask=mask, compute_dtype=torch.float32).out
    low = fmha.reference.attention(q[:1], k[:1], v[:1], mask=mask, compute_dtype=q.dtype).out
    if max_error(out[:1], exact) > error_bound(q.dtype, max_error(low, exact)):
        raise AssertionError("output outside the error bound")
    return (triton.testing.do_bench_cudagraph(fn, rep=100),
            triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, choices=list(configs.HOPPER_FWD_CONFIGS), default=128)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[0, 1])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch (b = tokens // seqlen)")
    parser.add_argument("--configs", nargs="+", help="candidates as block_n,stages,consumers,consumer_regs,maxnreg "
                                                     "(default: the shipped one)")
    parser.add_argument("--persistent", type=int, nargs=2, metavar=("MAX", "MAX_CAUSAL"),
                        help="persistent CTAs up to these lengths (default: the shipped config's)")
    args = parser.parse_args()
    os.environ["FMHA_PORTABLE"] = "0"
    d = args.head_dim
    shipped = configs.HOPPER_FWD_CONFIGS[d]
    limits = args.persistent or (shipped.persistent_max_seqlen, shipped.persistent_max_seqlen_causal)
    candidates = [configs.HopperFwdConfig(*map(int, c.split(","))) for c in args.configs or []] or [shipped]
    candidates = [dataclasses.replace(c, persistent_max_seqlen=limits[0], persistent_max_seqlen_causal=limits[1])
                  for c in candidates]
    for cfg in candidates:
        configs.HOPPER_FWD_CONFIGS[d] = cfg
        cells = []
        for s in args.seqlens:
            for causal in args.causal:
                b, h = args.tokens // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                mask = "b" if causal else None
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                name = f"{s // 1024}k{'c' if causal else ' '}"
                try:
                    graph, eager = _time(q, k, v, mask)
                    cells.append(f"{name} {flops / graph / 1e9:5.0f}/{flops / eager / 1e9:5.0f}")
                except Exception as exc:  # a config that fails to compile or is wrong is reported
                    cells.append(f"{name} {type(exc).__name__}")
        fields = (f"{cfg.block_n},{cfg.stages},{cfg.consumers},{cfg.consumer_regs},{cfg.maxnreg} persistent "
                  f"{cfg.persistent_max_seqlen}/{cfg.persistent_max_seqlen_causal}")
        print(f"d={d} {fields}: " + "  ".join(cells), flush=True)
    configs.HOPPER_FWD_CONFIGS[d] = shipped


if __name__ == "__main__":
    main()
