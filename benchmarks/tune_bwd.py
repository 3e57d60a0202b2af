"""Sweep backward tile configs on the GPU for one benchmark shape; prints TFLOP/s per config.

    python benchmarks/tune_bwd.py --head-dim 128 --seqlen 16384 --jobs 16

The dK/dV kernel's tiles are swept in both modes with the shipped dQ tiles, the dQ kernel's
(deterministic mode only) with the shipped dK/dV tiles. Configs compile first in ``--jobs``
worker processes (Triton's on-disk cache is shared), then time one after another. The winners go
into ``fmha.configs.BWD_CONFIGS`` by hand (no autotuning at run time); with ``--feature`` the
trials fill that feature's row of ``BWD_FEATURE_CONFIGS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing

import torch

from fmha import bench, configs

DKDV_DEFAULT = ["32,128,8,2", "32,128,4,2", "32,128,4,3", "32,128,8,3", "64,128,8,2", "64,128,8,3",
                "64,64,4,3", "32,64,4,3"]
DQ_DEFAULT = ["128,32,8,3", "128,64,8,2", "128,64,8,3", "64,64,4,3", "128,32,4,3", "64,32,4,4"]


def _parse(text: str) -> tuple[int, int, int, int]:
    block_m, block_n, warps, stages = (int(x) for x in text.split(","))
    return block_m, block_n, warps, stages


def _variant(shipped: configs.BwdConfig, part: str, cfg: tuple[int, int, int, int]) -> configs.BwdConfig:
    names = ("block_m", "block_n", "num_warps", "num_stages")
    if part == "dq":
        names = tuple(f"{n}_dq" for n in names)
    return dataclasses.replace(shipped, **dict(zip(names, cfg)))


def _time(job: tuple) -> tuple[float, str]:
    """Runs in a worker (compile) or in the parent (timing): one config, one TFLOP/s figure."""
    key, variant, case, provider, _ = job
    # (kind, bucket) keys the plain table, (kind, bucket, feature) the feature table.
    (configs.BWD_CONFIGS if len(key) == 2 else configs.BWD_FEATURE_CONFIGS)[key] = variant
    rec = bench.time_case(case, provider)
    torch.cuda.empty_cache()
    return rec.get("tflops", 0.0), rec.get("error", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--causal", type=int, nargs="+", default=[0])
    parser.add_argument("--dkdv", nargs="*", default=DKDV_DEFAULT, help="BLOCK_M,BLOCK_N,warps,stages")
    parser.add_argument("--dq", nargs="*", default=DQ_DEFAULT, help="BLOCK_M,BLOCK_N,warps,stages")
    parser.add_argument("--jobs", type=int, default=8, help="processes that compile before timing")
    parser.add_argument("--feature", choices=["plain", "bias", "dropout", "bias+dropout"], default="plain",
                        help="tune this feature's row (BWD_FEATURE_CONFIGS) instead of the plain one")
    args = parser.parse_args()
    bucket = configs.head_dim_block(args.head_dim)
    key = ("half", bucket) if args.feature == "plain" else ("half", bucket, args.feature)
    shipped = configs.bwd_config(torch.bfloat16, args.head_dim, args.head_dim, "bias" in args.feature,
                                 "dropout" in args.feature)
    jobs = []
    for causal in args.causal:
        case = bench.Case(head_dim=args.head_dim, seqlen=args.seqlen, causal=bool(causal), direction="bwd",
                          feature=args.feature)
        jobs += [(key, _variant(shipped, "dkdv", _parse(c)), case, provider, "dkdv")
                 for c in args.dkdv for provider in ("fmha", "fmha_deterministic")]
        jobs += [(key, _variant(shipped, "dq", _parse(c)), case, "fmha_deterministic", "dq") for c in args.dq]
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            pool.map(_time, jobs)
    print(f"d={args.head_dim} s={args.seqlen} feature={args.feature} shipped={shipped}")
    for (_, variant, case, provider, part), (tflops, err) in zip(jobs, map(_time, jobs)):
        cfg = dataclasses.astuple(variant)[:4] if part == "dkdv" else dataclasses.astuple(variant)[4:]
        print(f"  causal={int(case.causal)} {provider:<18} {part:<4} {cfg}: {tflops:6.1f} TFLOP/s {err[:90]}",
              flush=True)


if __name__ == "__main__":
    main()
