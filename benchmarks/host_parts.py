"""Where a short call's host time goes: each part of an fmha forward and backward timed alone
(best of 9 batches of 40 calls), beside cuDNN's whole call. Needs a CUDA GPU.

    python benchmarks/host_parts.py [--cases 128,1024,0 128,1024,1]

Parts: the whole call, ``check_inputs``, ``ops.fwd`` / ``ops.bwd``, the launch builders, and for
each kernel Triton's ``JITFunction.run``, ``fmha.launch.launch``, Triton's binder alone and the
compiled kernel's launcher alone (with its TMA descriptors' ``make_tensordesc_arg``).
"""

import argparse

import fmha  # noqa: F401  (before triton: it picks Triton's backend)
import torch
import triton.backends.nvidia.driver as nvidia_driver
from triton.runtime import driver

from fmha import hopper, ops
from fmha.bench import PROVIDERS, Case, make_problem
from fmha.inputs import check_inputs
from fmha.kernels.fwd import attention_fwd_kernel
from fmha.launch import launch
from host_time import host_us as best_us  # (run as a script, benchmarks/ is on the path)


def report(tag: str, part: str, us: float) -> None:
    print(f"{tag:18s} {part:34s} {us:8.1f} us", flush=True)


def launch_parts(tag: str, kernel, grid, kwargs) -> None:
    """One kernel's launch through Triton, through fmha.launch, and its pieces."""
    device = driver.active.get_current_device()
    compiled = kernel[grid](**kwargs)
    binder = kernel.device_caches[device][-1]
    args = [kwargs[p.name] for p in kernel.params]
    grid3 = (*grid, 1, 1)
    stream = driver.active.get_current_stream(device)
    report(tag, "JITFunction.run", best_us(lambda: kernel[grid](**kwargs)))
    report(tag, "fmha.launch", best_us(lambda: launch(kernel, grid, kwargs)))
    report(tag, "  Triton's binder", best_us(lambda: binder(**kwargs)))
    report(tag, "  compiled launcher", best_us(lambda: compiled.run(
        grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args)))
    descs = [a for a in args if type(a).__name__ == "TensorDescriptor"]
    meta = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descs)
    if descs:
        report(tag, f"    {len(descs)} x make_tensordesc_arg", best_us(
            lambda: [nvidia_driver.make_tensordesc_arg(d, m) for d, m in zip(descs, meta)]))


def forward_parts(d: int, s: int, causal: bool) -> None:
    case = Case(d, s, causal)
    tag = f"fwd d={d} s={s}{' causal' if causal else ''}"
    p = make_problem(case, "cuda")
    report(tag, "fmha.attention", best_us(PROVIDERS["fmha"](case, p)))
    report(tag, "cuDNN (SDPA)", best_us(PROVIDERS["sdpa_cudnn"](case, p)))
    inputs = check_inputs(p.q, p.k, p.v, mask=case.mask)
    report(tag, "check_inputs", best_us(lambda: check_inputs(p.q, p.k, p.v, mask=case.mask)))
    report(tag, "ops.fwd", best_us(lambda: ops.fwd(inputs)))
    out, lse = torch.empty_like(p.q), torch.empty(inputs.lse_shape, device="cuda")
    if hopper.fwd_unsupported(inputs) is None:
        report(tag, "hopper.fwd_launches", best_us(lambda: hopper.fwd_launches(inputs, out, lse)))
        launches = hopper.fwd_launches(inputs, out, lse)
    else:  # the portable kernel
        report(tag, "ops.fwd_kernel_args", best_us(lambda: ops.fwd_kernel_args(inputs, out, lse, None, None)))
        grid, kwargs = ops.fwd_kernel_args(inputs, out, lse, None, None)
        launches = [(attention_fwd_kernel, grid, kwargs)]
    for i, (kernel, grid, kwargs) in enumerate(launches):
        launch_parts(f"{tag} k{i}", kernel, grid, kwargs)


def backward_parts(d: int, s: int, causal: bool) -> None:
    case = Case(d, s, causal, direction="bwd")
    tag = f"bwd d={d} s={s}{' causal' if causal else ''}"
    p = make_problem(case, "cuda")
    for label, provider in (("fmha autograd.grad", "fmha"), ("cuDNN (SDPA) autograd.grad", "sdpa_cudnn")):
        out = PROVIDERS[provider](case, p)()
        dout = torch.randn_like(out)
        report(tag, label, best_us(lambda: torch.autograd.grad(out, (p.q, p.k, p.v), dout, retain_graph=True)))
    inputs = check_inputs(p.q.detach(), p.k.detach(), p.v.detach(), mask=case.mask)
    out, lse, _ = ops.fwd(inputs)
    dout = torch.randn_like(out)
    report(tag, "ops.bwd", best_us(lambda: ops.bwd(inputs, dout, out, lse)))
    report(tag, "ops.bwd_launches", best_us(lambda: ops.bwd_launches(inputs, dout, out, lse)))
    for i, (kernel, grid, kwargs) in enumerate(ops.bwd_launches(inputs, dout, out, lse)[0]):
        launch_parts(f"{tag} k{i}", kernel, grid, kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["128,1024,0", "128,1024,1"], help="head_dim,seqlen,causal")
    args = parser.parse_args()
    for spec in args.cases:
        d, s, causal = map(int, spec.split(","))
        forward_parts(d, s, bool(causal))
        backward_parts(d, s, bool(causal))


if __name__ == "__main__":
    main()
