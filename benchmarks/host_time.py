"""Where short problems lose: per call, what ``fmha bench`` reports (do_bench), the GPU's kernel
time (profiler: device time summed per call) and the host's wall time without a sync, for fmha
and cuDNN, forward and backward. Needs a CUDA GPU.

    python benchmarks/host_time.py [--cases 128,1024,0 128,1024,1 ...] [--direction fwd bwd]
"""

import argparse
import time

import fmha  # noqa: F401  (before triton: it picks Triton's backend)
import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from fmha.bench import PROVIDERS, Case, make_problem


def kernel_us(fn, calls: int = 10) -> tuple[float, dict[str, float]]:
    """Device time per call, in total and per kernel name."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = {e.key[:28]: e.device_time_total / calls for e in prof.key_averages()
           if e.device_type.name == "CUDA" and e.count}
    return sum(per.values()), per


def host_us(fn, calls: int = 40, batches: int = 9) -> float:
    """Wall time per call with the GPU left to catch up afterwards (a sync inside a call shows
    here): the best of ``batches`` batches, since this host's speed moves by 2x between runs."""
    fn()
    best = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["128,1024,0", "128,1024,1", "256,1024,0", "64,1024,1",
                                                       "128,16384,0"], help="head_dim,seqlen,causal")
    parser.add_argument("--direction", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    parser.add_argument("--providers", nargs="+", default=["fmha", "sdpa_cudnn"], choices=list(PROVIDERS))
    args = parser.parse_args()
    for direction in args.direction:
        for spec in args.cases:
            d, s, causal = map(int, spec.split(","))
            case = Case(d, s, bool(causal), direction=direction)
            for provider in args.providers:
                p = make_problem(case, "cuda")
                fn = PROVIDERS[provider](case, p)
                if direction == "bwd":
                    out = fn()
                    dout = torch.randn_like(out)
                    fn = lambda: torch.autograd.grad(out, (p.q, p.k, p.v), dout, retain_graph=True)  # noqa: E731
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                total, per = kernel_us(fn)
                print(f"{direction} d={d} s={s} causal={causal} {provider:10s} do_bench {ms * 1e3:7.1f} us "
                      f"({case.flops() / ms / 1e9:5.1f})  kernels {total:7.1f} us ({case.flops() / total / 1e6:5.1f})  "
                      f"host {host_us(fn):6.1f} us | " + " ".join(f"{k}={v:.0f}" for k, v in per.items()), flush=True)


if __name__ == "__main__":
    main()
