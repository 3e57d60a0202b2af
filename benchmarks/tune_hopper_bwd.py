"""A/B the Hopper fast path's backward configs on an H100/H200; prints TFLOP/s per variant.

    python benchmarks/tune_hopper_bwd.py --head-dim 128 --variants "" dkv_rs=0 stages=3
    python benchmarks/tune_hopper_bwd.py --head-dim 64 --seqlens 4096 16384 --features plain alibi bias

Each variant is a space-separated list of ``field=value`` overrides of the shipped
``fmha.configs.HopperBwdConfig`` ("" is the shipped config itself). The variants run interleaved,
``--rounds`` times, so drift in the GPU's clocks hits each alike; each cell prints the median of
the rounds' ``do_bench`` medians (the backward alone: ``fmha.bwd`` from a saved forward). Before
timing, every variant's gradients are compared with the first variant's: a relative difference over
1e-2 (bf16 rounding of differently ordered sums stays far under it) is reported instead of a time.
Correctness against the reference is tests/test_gpu_hopper.py's job. Winners go into
``HOPPER_BWD_CONFIGS`` by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch

import fmha  # before triton: it picks Triton's backend
import triton.testing
from fmha import configs

FEATURES = ("plain", "alibi", "bias", "gqa", "window", "deterministic")


def _variant(shipped: configs.HopperBwdConfig, spec: str) -> configs.HopperBwdConfig:
    fields = {f.name: f.type for f in dataclasses.fields(shipped)}
    changes = {}
    for item in spec.split():
        name, value = item.split("=")
        if name not in fields:
            raise SystemExit(f"--variants: {name!r} is not a HopperBwdConfig field ({', '.join(fields)})")
        changes[name] = bool(int(value)) if fields[name] in ("bool", bool) else int(value)
    return dataclasses.replace(shipped, **changes)


def _problem(d: int, s: int, causal: bool, feature: str, tokens: int):
    b, h = tokens // s, 2048 // d
    hk = h // 8 if feature == "gqa" else h
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kwargs = dict(mask="b:1024,0" if feature == "window" else "b" if causal else None,
                  deterministic=feature == "deterministic")
    if feature == "alibi":
        kwargs["alibi_slopes"] = fmha.alibi_slopes(h, device="cuda")
    if feature == "bias":
        kwargs["bias"] = torch.randn(h, s, s, device="cuda", dtype=torch.bfloat16)
    visible = min(s, 1025) * s - 1024 * 1025 // 2 if feature == "window" else s * (s + 1) // 2 if causal else s * s
    flops = 2.5 * 4 * b * h * visible * d
    return q, k, v, kwargs, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, choices=list(configs.HOPPER_BWD_CONFIGS), default=128)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    parser.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[0, 1])
    parser.add_argument("--features", nargs="+", choices=FEATURES, default=["plain"])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch (b = tokens // seqlen)")
    parser.add_argument("--variants", nargs="+", default=[""], help='overrides, e.g. "dkv_rs=0 stages=3"')
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ["FMHA_PORTABLE"] = "0"
    d = args.head_dim
    shipped = configs.HOPPER_BWD_CONFIGS[d]
    variants = [(spec or "shipped", _variant(shipped, spec)) for spec in args.variants]
    for feature in args.features:
        for s in args.seqlens:
            for causal in args.causal if feature != "window" else [0]:
                torch.manual_seed(0)
                q, k, v, kwargs, flops = _problem(d, s, bool(causal), feature, args.tokens)
                fwd = fmha.fwd(q, k, v, **{n: a for n, a in kwargs.items() if n != "deterministic"})
                dout = torch.randn_like(fwd.out)
                runs, results = {}, {}
                for name, cfg in variants:
                    configs.HOPPER_BWD_CONFIGS[d] = cfg
                    try:
                        grads = fmha.bwd(dout, q, k, v, fwd.out, fwd.lse, **kwargs)
                        torch.cuda.synchronize()
                    except Exception as exc:  # a variant that fails to compile or launch is reported
                        results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                        continue
                    if not runs:
                        first = grads
                    else:  # the same function as the first variant, within bf16 rounding
                        for got, want in zip(grads[:3], first[:3]):
                            if not (got.float() - want.float()).norm() <= 1e-2 * want.float().norm():
                                results[name] = "gradients differ from the first variant's"
                    runs[name] = (cfg, lambda: fmha.bwd(dout, q, k, v, fwd.out, fwd.lse, **kwargs))
                times = {name: [] for name in runs if name not in results}
                for _ in range(args.rounds):
                    for name in times:
                        configs.HOPPER_BWD_CONFIGS[d] = runs[name][0]
                        times[name].append(triton.testing.do_bench(runs[name][1], warmup=25, rep=100,
                                                                   return_mode="median"))
                configs.HOPPER_BWD_CONFIGS[d] = shipped
                for name, ms in times.items():
                    results[name] = f"{flops / statistics.median(ms) / 1e9:6.1f}"
                label = f"d={d} s={s} {'causal' if causal else 'plain '} {feature:13s}"
                print(label + "  ".join(f"{name}: {r}" for name, r in results.items()), flush=True)


if __name__ == "__main__":
    main()
