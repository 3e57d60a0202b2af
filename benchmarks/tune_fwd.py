"""Sweep forward tile configs on the GPU for the benchmark shapes; prints TFLOP/s per config.

    python benchmarks/tune_fwd.py --head-dims 64 128 256 --seqlens 4096 16384
    python benchmarks/tune_fwd.py --head-dims 128 --feature bias+dropout

The winners go into ``fmha.configs.FWD_CONFIGS`` by hand (no autotuning at run time); with
``--feature`` the trials fill that feature's row of ``FWD_FEATURE_CONFIGS``.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from fmha import bench, configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--feature", choices=["plain", "bias", "dropout", "bias+dropout"], default="plain",
                        help="tune this feature's row (FWD_FEATURE_CONFIGS) instead of the plain one")
    args = parser.parse_args()
    for d in args.head_dims:
        bucket = configs.head_dim_block(d)
        table, key = ((configs.FWD_CONFIGS, ("half", bucket)) if args.feature == "plain" else
                      (configs.FWD_FEATURE_CONFIGS, ("half", bucket, args.feature)))
        shipped = configs.fwd_config(torch.bfloat16, d, d, "bias" in args.feature, "dropout" in args.feature)
        for s, causal in itertools.product(args.seqlens, args.causal):
            case = bench.Case(head_dim=d, seqlen=s, causal=bool(causal), feature=args.feature)
            results = []
            saved = table.get(key)
            for bm, bn, w, st in itertools.product(args.block_m, args.block_n, args.warps, args.stages):
                table[key] = configs.TileConfig(bm, bn, w, st)
                rec = bench.time_case(case, "fmha")
                results.append((rec.get("tflops", 0.0), (bm, bn, w, st), rec.get("error", "")))
                torch.cuda.empty_cache()
            if saved is None:
                del table[key]
            else:
                table[key] = saved
            results.sort(reverse=True)
            print(f"d={d} s={s} causal={causal} feature={args.feature} shipped={shipped}")
            for tflops, cfg, err in results[:5]:
                print(f"    {cfg}: {tflops:6.1f} TFLOP/s {err[:80]}")


if __name__ == "__main__":
    main()
