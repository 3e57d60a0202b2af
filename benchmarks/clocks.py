"""Sustained speed of fmha bench cases beside the GPU's SM clock, power and clock-event reasons.

    python benchmarks/clocks.py [--direction bwd] 128:16384:0:plain 128:16384:0:bias 128:16384:0:plain:sdpa_cudnn

A case is ``head_dim:seqlen:causal:feature[:provider]`` (``fmha bench``'s problems; the provider
fmha unless named). Each runs back to back for ``--seconds`` while ``nvidia-smi`` samples every 20
ms; it prints TFLOP/s over the whole run and the medians of the samples taken while it ran. Reason
``0x4`` is the software power cap: at 700 W the SM clock, not the kernel alone, sets the speed, so
two kernels compare per clock as well as per second (benchmarks/NOTES.md, session 50).
"""

import argparse
import statistics
import subprocess
import tempfile
import time

import torch

from fmha.bench import Case, Unsupported, error_text, timed_call

FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


def parse_case(text: str, direction: str) -> tuple[Case, str]:
    head_dim, seqlen, causal, feature, *provider = text.split(":")
    case = Case(head_dim=int(head_dim), seqlen=int(seqlen), causal=causal == "1", direction=direction,
                feature=feature)
    return case, provider[0] if provider else "fmha"


def sustained(fn, seconds: float) -> tuple[float, list[list[str]]]:
    """ms a call over ``seconds`` of back-to-back calls, and nvidia-smi's samples meanwhile."""
    with tempfile.NamedTemporaryFile("w+") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                                "-lms", "20"], stdout=log, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # nvidia-smi's first samples
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls, t0 = 0, time.time()
        start.record()
        while time.time() - t0 < seconds:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        smi.terminate()
        smi.wait()
        log.seek(0)
        rows = [line.split(", ") for line in log.read().splitlines()]
    # the samples of the run: past the idle lead-in, before the tail
    return start.elapsed_time(end) / calls, [r for r in rows if len(r) == len(FIELDS)][15:-5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="head_dim:seqlen:causal:feature[:provider]")
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each case runs")
    args = parser.parse_args()
    for text in args.cases:
        case, provider = parse_case(text, args.direction)
        try:
            fn = timed_call(case, provider)
            for _ in range(5):  # compile and warm up
                fn()
            torch.cuda.synchronize()
        except (Unsupported, RuntimeError) as exc:  # a peer without the feature, or no kernel for it
            print(f"{text:34s} n/a: {error_text(exc)}", flush=True)
            continue
        ms, rows = sustained(fn, args.seconds)
        if not rows:
            print(f"{text:34s} no nvidia-smi samples")
            continue
        clock, watts, celsius = (statistics.median(float(r[i]) for r in rows) for i in range(3))
        reasons = statistics.mode(r[3] for r in rows)
        tflops = case.flops() / ms / 1e9
        print(f"{text:34s} {tflops:6.1f} TFLOP/s  {clock:5.0f} MHz  {tflops / clock * 1e3:6.1f} GFLOP/s a MHz  "
              f"{watts:4.0f} W  {celsius:3.0f} C  reasons {reasons}", flush=True)


if __name__ == "__main__":
    main()
