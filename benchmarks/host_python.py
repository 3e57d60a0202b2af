"""fmha's own host cost per call, on any machine: the entry points with the Hopper fast path's
launches built but not run (so everything but Triton's launch itself), at d = 128, 1k, 16 heads.

    python benchmarks/host_python.py
"""

import time

import torch

import fmha
from fmha import hopper, ops
from fmha.inputs import check_inputs


class _NoLaunch:
    """Stands in for a kernel: ``kernel[grid](**kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda **kwargs: None


def _stub_launches() -> None:
    fwd_launches, bwd_launches = hopper.fwd_launches, hopper.bwd_launches
    hopper.fwd_unsupported = lambda *args: None
    hopper.bwd_unsupported = lambda *args: None
    hopper.fwd_launches = lambda *a: [(_NoLaunch(), grid, kw) for _, grid, kw in fwd_launches(*a)]
    hopper.bwd_launches = lambda *a: [(_NoLaunch(), grid, kw) for _, grid, kw in bwd_launches(*a)]
    ops.is_kernel_layout = lambda t: True  # CPU tensors: any layout passes, as aligned CUDA ones do


def per_call_us(fn, calls: int = 1000, repeats: int = 7) -> float:
    """The fastest of ``repeats`` runs of ``calls`` calls (other load on the machine only adds)."""
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    _stub_launches()
    # Small tensors: the CPU's allocations and memsets of real sizes would dominate.
    q = torch.empty(1, 128, 16, 128, dtype=torch.bfloat16)
    qg = q.clone().requires_grad_()
    inputs = check_inputs(q, q, q)
    lse = torch.empty(inputs.lse_shape)
    rows = [
        ("check_inputs", lambda: check_inputs(q, q, q)),
        ("fmha.fwd", lambda: fmha.fwd(q, q, q)),
        ("fmha.attention", lambda: fmha.attention(q, q, q)),
        ("fmha.attention, requires_grad", lambda: fmha.attention(qg, qg, qg)),
        ("ops.bwd", lambda: ops.bwd(inputs, q, q, lse)),
    ]
    for label, fn in rows:
        print(f"{label:32s} {per_call_us(fn):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
