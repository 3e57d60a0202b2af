"""Compile every shipped GPU kernel config for Hopper (sm_90) without a GPU and check resources.

    TRITON_INTERPRET=0 python -m fmha.compile_check [--only TEXT ...] [--allow-spills]

For each (dtype, head dim bucket) of ``fmha.configs`` and a few feature combinations, the forward
kernel and the backward's kernels (both dQ modes), and the Hopper fast path's Gluon kernels
(``--only hopper``), are specialized exactly as a real launch would
(same launcher code, CPU tensors standing in), compiled by Triton for sm_90, and their PTX
assembled by ``ptxas -v``. A compile failure, a register spill or shared memory over the sm_90
limit is reported and fails the check (spills only without ``--allow-spills``, and but for the
ones ``ACCEPTED_SPILLS`` names; CI runs the largest shipped tiles that way, tests/test_compile.py).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("fmha.compile_check needs TRITON_INTERPRET=0 (it compiles for sm_90)")
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from . import hopper, ops  # noqa: E402
from .configs import HOPPER_BWD_CONFIGS, HOPPER_FWD_CONFIGS  # noqa: E402
from .inputs import check_inputs  # noqa: E402
from .kernels.fwd import attention_fwd_kernel  # noqa: E402

SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on Hopper

# Spills kept because the kernel runs faster with them, by the end of a config's name: bytes at
# most. The persistent window forward at d=128 spills 40 B with 240 consumer registers, all outside
# its loops (values computed before the partitions split, stored 4 times and loaded 5 times a CTA);
# with 224 it spills none but runs 292 us against 274 (H100, 16k, b:1024,0; benchmarks/NOTES.md,
# session 42). With P rounded in pairs (packed_p) 44 B, still outside the loops, and the window
# runs 469 TFLOP/s against 456 without it (H100, medians of five runs, session 46).
# The persistent window forward at d=256 spills 72 B, outside its loops, since a warpgroup releases
# unread the edge key tiles its rows see none of (1 of 18 under b:1024,0); 16k, b:1024,0: 520
# TFLOP/s against 511 without (H100, medians of three runs, session 47).
# The backward with dropout at d=128 spills 8 B (causal 24 B), outside its loops, since it marks
# drops two a mask register and folds 1 - p into -delta; 16k: 485 TFLOP/s against 450 without
# (causal 465 against 443; H100, medians of two runs, session 48).
ACCEPTED_SPILLS = {
    "d=128 [plain] fwd window persistent": 44,
    "d=256 [plain] fwd window persistent": 72,
    "d=128 [plain] bwd attention_bwd_hopper_kernel dropout": 8,
    "d=128 [causal] bwd attention_bwd_hopper_kernel dropout": 24,
}


class _HopperCompileOnly:
    """Just enough of a Triton driver to compile for sm_90 where there is no GPU."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@dataclass
class Result:
    name: str
    registers: int
    spill_bytes: int
    shared: int
    error: str = ""

    @property
    def launches(self) -> bool:
        """Compiles and fits in shared memory: a launch would not fail."""
        return not self.error and self.shared <= SM90_MAX_SHARED

    @property
    def ok(self) -> bool:
        accepted = next((b for end, b in ACCEPTED_SPILLS.items() if self.name.endswith(end)), 0)
        return self.launches and self.spill_bytes <= accepted


def ptxas_log(ptx: str) -> str:
    """What ``ptxas -v`` (the one that ships with Triton) prints assembling this PTX for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr


def _ptxas_report(ptx: str) -> tuple[int, int]:
    log = ptxas_log(ptx)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills


def _fwd_problem(dtype, dq, dv, features: str):
    """CPU tensors and keyword arguments of a small forward problem with the given features."""
    group = "group" in features
    b, s, h, hk = 2, 64, 4, 2
    if group:
        q = torch.empty(2 * s, h, dq, dtype=dtype)
        k = torch.empty(2 * s, hk, dq, dtype=dtype)
        v = torch.empty(2 * s, hk, dv, dtype=dtype)
        starts = torch.tensor([0, s, 2 * s], dtype=torch.int32)
        kw = dict(seqstart_q=starts, seqstart_k=starts, seqlen_k=torch.tensor([s, s], dtype=torch.int32))
        bias_shape = (h, 2 * s, s)
    else:
        q = torch.empty(b, s, h, dq, dtype=dtype)
        k = torch.empty(b, s, hk, dq, dtype=dtype)
        v = torch.empty(b, s, hk, dv, dtype=dtype)
        kw = {}
        bias_shape = (h, s, s)
    if "mask" in features:
        kw["mask"] = "b:64,0"
    if "bias" in features:
        kw["bias"] = torch.empty(bias_shape, dtype=dtype)
    if "alibi" in features:
        kw["alibi_slopes"] = torch.empty(h, dtype=torch.float32)
    if "dropout" in features:
        kw["dropout_p"] = 0.1
    return q, k, v, kw


FEATURE_SETS = ("plain", "mask", "mask bias dropout", "group mask alibi dropout", "group bias dropout")


def check_fwd(dtype, dq, dv, features: str) -> Result:
    name = f"fwd {str(dtype).split('.')[-1]} d={dq}/{dv} [{features}]"
    q, k, v, kw = _fwd_problem(dtype, dq, dv, features)
    inputs = check_inputs(q, k, v, **kw)
    out = torch.empty(inputs.out_shape, dtype=dtype)
    lse = torch.empty(inputs.lse_shape, dtype=torch.float32)
    dropout = inputs.dropout_p > 0
    randval = torch.empty(inputs.randval_shape, dtype=torch.uint8) if dropout else None
    philox = torch.zeros(2, dtype=torch.int64) if dropout else None
    grid, kwargs = ops.fwd_kernel_args(inputs, out, lse, randval, philox)
    return _compile(name, attention_fwd_kernel, grid, kwargs)


def _compile(name: str, kernel, grid, kwargs) -> Result:
    """Compile one launch for sm_90 and measure it; a failure becomes a result, not an exception."""
    try:
        compiled = kernel.warmup(grid=grid, **kwargs)
        regs, spills = _ptxas_report(compiled.asm["ptx"])
    except Exception as exc:  # report every failing config, not just the first
        return Result(name, 0, 0, 0, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    return Result(name, regs, spills, compiled.metadata.shared)


def check_bwd(dtype, dq, dv, features: str, deterministic: bool) -> list[Result]:
    """One result per backward kernel (dot_do_o, dK/dV, then dQ or the dQ conversion)."""
    mode = "deterministic" if deterministic else "atomic"
    prefix = f"bwd {str(dtype).split('.')[-1]} d={dq}/{dv} [{features}] {mode}"
    q, k, v, kw = _fwd_problem(dtype, dq, dv, features)
    inputs = check_inputs(q, k, v, **kw)
    out = torch.empty(inputs.out_shape, dtype=dtype)
    lse = torch.empty(inputs.lse_shape, dtype=torch.float32)
    philox = torch.zeros(2, dtype=torch.int64) if inputs.dropout_p > 0 else None
    launches, _ = ops.bwd_launches(inputs, torch.empty_like(out), out, lse, philox=philox,
                                   deterministic=deterministic, bias_grad="bias" in features)
    return [_compile(f"{prefix} {launch.kernel.__name__.removeprefix('attention_bwd_').removesuffix('_kernel')}",
                     launch.kernel, launch.grid, launch.kwargs) for launch in launches]


def _hopper_name(dtype, head_dim: int, causal: bool) -> str:
    return f"hopper {str(dtype).split('.')[-1]} d={head_dim} [{'causal' if causal else 'plain'}]"


def check_hopper(dtype, head_dim: int, causal: bool) -> list[Result]:
    """The Hopper fast path's launches: the Gluon forward (persistent and one CTA per tile where
    the config has both) and the backward's three kernels where the head dim has a backward config;
    the forward and the backward's main kernel also with ALiBi (and without a causal mask a sliding
    window with ALiBi; the forward also a sliding window alone, and ALiBi alone where it runs it
    linearly; the backward also a window alone) where they take it, and in group mode (the forward
    also with a window); the forward with a bias, and with dropout (alone, with ALiBi, with a bias),
    each also with a sliding window where not causal; the backward with a bias (alone and with GQA,
    each with and without its gradient), with dropout (alone, and with ALiBi and with GQA) and the
    deterministic backward (alone and with ALiBi), where its config takes them."""
    prefix = _hopper_name(dtype, head_dim, causal)
    q = torch.empty(2, 1000, 4, head_dim, dtype=dtype)  # a ragged length: nothing specializes on it
    k, v = torch.empty_like(q), torch.empty_like(q)
    inputs = check_inputs(q, k, v, mask="t" if causal else None)
    with_alibi = check_inputs(q, k, v, mask="t" if causal else "b:100,0", alibi_slopes=torch.ones(4))
    alibi = "alibi" if causal else "window alibi"
    out, lse = torch.empty_like(q), torch.empty(inputs.lse_shape, dtype=torch.float32)
    kernel, grid, kwargs = hopper.fwd_launches(inputs, out, lse)[-1]
    results = [_compile(f"{prefix} fwd{' persistent' if kwargs['PERSISTENT'] else ''}", kernel, grid, kwargs)]
    if kwargs["PERSISTENT"]:  # longer sequences run one CTA per tile
        q_long = torch.empty(1, 4096, 4, head_dim, dtype=dtype)
        long_inputs = check_inputs(q_long, q_long, q_long, mask="t" if causal else None)
        kernel, grid, kwargs = hopper.fwd_launches(long_inputs, torch.empty_like(q_long),
                                                   torch.empty(long_inputs.lse_shape, dtype=torch.float32))[-1]
        results.append(_compile(f"{prefix} fwd", kernel, grid, kwargs))
    if HOPPER_FWD_CONFIGS[head_dim].causal_alibi or not causal:
        kernel, grid, kwargs = hopper.fwd_launches(with_alibi, out, lse)[-1]
        results.append(_compile(f"{prefix} fwd {alibi}", kernel, grid, kwargs))
    if not causal:  # a sliding window alone: persistent where its band is short, else one CTA per tile
        kernel, grid, kwargs = hopper.fwd_launches(check_inputs(q, k, v, mask="b:100,0"), out, lse)[-1]
        results.append(_compile(f"{prefix} fwd window{' persistent' if kwargs['PERSISTENT'] else ''}", kernel,
                                grid, kwargs))
        if kwargs["PERSISTENT"]:
            q_long = torch.empty(1, 4096, 4, head_dim, dtype=dtype)
            wide = check_inputs(q_long, q_long, q_long, mask="b:3000,0")
            kernel, grid, kwargs = hopper.fwd_launches(wide, torch.empty_like(q_long),
                                                       torch.empty(wide.lse_shape, dtype=torch.float32))[-1]
            results.append(_compile(f"{prefix} fwd window", kernel, grid, kwargs))
    if HOPPER_FWD_CONFIGS[head_dim].alibi_linear and not causal:  # ALiBi without a window: linear off the diagonal
        kernel, grid, kwargs = hopper.fwd_launches(check_inputs(q, k, v, alibi_slopes=torch.ones(4)), out, lse)[-1]
        results.append(_compile(f"{prefix} fwd alibi", kernel, grid, kwargs))
    if HOPPER_FWD_CONFIGS[head_dim].bias:  # a [H, S, S] bias, broadcast over the batch
        masks = [("bias", "t" if causal else None)]
        if not causal:  # and with a sliding window
            masks.append(("window bias", "b:100,0"))
        for name, mask in masks:
            biased = check_inputs(q, k, v, mask=mask, bias=torch.empty(4, 1000, 1000, dtype=dtype))
            kernel, grid, kwargs = hopper.fwd_launches(biased, out, lse)[-1]
            results.append(_compile(f"{prefix} fwd {name}", kernel, grid, kwargs))
    packed = torch.empty(1000, 4, head_dim, dtype=dtype)  # group mode: two sequences, one seqstart
    starts = torch.tensor([0, 400, 1000], dtype=torch.int32)
    grouped = check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts, mask="t" if causal else None)
    dropped = [("dropout", check_inputs(q, k, v, mask="t" if causal else None, dropout_p=0.1))]
    if not causal:  # with a sliding window
        dropped.append(("window dropout", check_inputs(q, k, v, mask="b:100,0", dropout_p=0.1)))
    cfg = HOPPER_FWD_CONFIGS[head_dim]
    if cfg.dropout_alibi and (cfg.causal_alibi or not causal):  # with ALiBi (and a window)
        dropped.append((f"{alibi} dropout", check_inputs(q, k, v, mask="t" if causal else "b:100,0",
                                                         alibi_slopes=torch.ones(4), dropout_p=0.1)))
    if cfg.bias_dropout_block_n:
        dropped.append(("bias dropout", check_inputs(q, k, v, mask="t" if causal else None, dropout_p=0.1,
                                                     bias=torch.empty(4, 1000, 1000, dtype=dtype))))
    for name, problem in dropped:
        kernel, grid, kwargs = hopper.fwd_launches(problem, out, lse, torch.zeros(2, dtype=torch.int64))[-1]
        results.append(_compile(f"{prefix} fwd {name}", kernel, grid, kwargs))
    (table, table_grid, table_kwargs), (kernel, grid, kwargs) = hopper.fwd_launches(
        grouped, torch.empty_like(packed), torch.empty(grouped.lse_shape, dtype=torch.float32))
    results.append(_compile(f"{prefix} fwd group {table.__name__}", table, table_grid, table_kwargs))
    results.append(_compile(f"{prefix} fwd group", kernel, grid, kwargs))
    if not causal:  # group mode with a sliding window
        windowed = check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts, mask="b:100,0")
        kernel, grid, kwargs = hopper.fwd_launches(windowed, torch.empty_like(packed),
                                                   torch.empty(windowed.lse_shape, dtype=torch.float32))[-1]
        results.append(_compile(f"{prefix} fwd group window", kernel, grid, kwargs))
    if head_dim != 256:  # the group-mode backward (main kernel; the other two are the same)
        grads = [torch.empty_like(packed) for _ in range(3)]
        kernel, grid, kwargs = hopper.bwd_launches(grouped, torch.empty_like(packed), torch.empty_like(packed),
                                                   torch.empty(grouped.lse_shape, dtype=torch.float32), *grads)[1]
        results.append(_compile(f"{prefix} bwd group", kernel, grid, kwargs))
    if head_dim in HOPPER_BWD_CONFIGS:
        grads = [torch.empty_like(q) for _ in range(3)]
        for kernel, grid, kwargs in hopper.bwd_launches(inputs, torch.empty_like(q), out, lse, *grads):
            results.append(_compile(f"{prefix} bwd {kernel.__name__}", kernel, grid, kwargs))
        kv = torch.empty(2, 1000, 2, head_dim, dtype=dtype)  # GQA 2:1: the grouped loop (kv_group > 1)
        grouped_heads = check_inputs(q, kv, kv, mask="t" if causal else None)
        kernel, grid, kwargs = hopper.bwd_launches(grouped_heads, torch.empty_like(q), out, lse, torch.empty_like(q),
                                                   torch.empty_like(kv), torch.empty_like(kv))[1]
        results.append(_compile(f"{prefix} bwd gqa", kernel, grid, kwargs))
        if HOPPER_BWD_CONFIGS[head_dim].windows_and_alibi:
            _, (kernel, grid, kwargs), _ = hopper.bwd_launches(with_alibi, torch.empty_like(q), out, lse, *grads)
            results.append(_compile(f"{prefix} bwd {kernel.__name__} {alibi}", kernel, grid, kwargs))
            if not causal:  # a window alone
                _, (kernel, grid, kwargs), _ = hopper.bwd_launches(check_inputs(q, k, v, mask="b:100,0"),
                                                                   torch.empty_like(q), out, lse, *grads)
                results.append(_compile(f"{prefix} bwd {kernel.__name__} window", kernel, grid, kwargs))
        bwd_cfg = HOPPER_BWD_CONFIGS[head_dim]
        if bwd_cfg.bias:  # a [H, S, S] bias, with and without its gradient; with GQA 2:1 (the grouped
            bias = torch.empty(4, 1000, 1000, dtype=dtype)  # loop) too
            dbias_t = torch.empty(2, 4, 1000, 1000, dtype=dtype)
            biased_cases = [("bias", k, grads[1:]), ("gqa bias", kv, [torch.empty_like(kv)] * 2)]
            for (name, kv_in, kv_grads), with_grad in itertools.product(biased_cases, (False, True)):
                biased = check_inputs(q, kv_in, kv_in, mask="t" if causal else None, bias=bias)
                _, (kernel, grid, kwargs), _ = hopper.bwd_launches(biased, torch.empty_like(q), out, lse, grads[0],
                                                                   *kv_grads, dbias_t=dbias_t if with_grad else None)
                results.append(_compile(f"{prefix} bwd {kernel.__name__} {name}{' dbias' if with_grad else ''}",
                                        kernel, grid, kwargs))
        if bwd_cfg.dropout:  # alone, and where the config takes them with ALiBi (and a window) and GQA 2:1
            mask = "t" if causal else None
            dropped_cases = [("dropout", check_inputs(q, k, v, mask=mask, dropout_p=0.1), k)]
            if bwd_cfg.dropout_features:
                dropped_cases += [
                    (f"{alibi} dropout", check_inputs(q, k, v, mask=mask if causal else "b:100,0",
                                                      alibi_slopes=torch.ones(4), dropout_p=0.1), k),
                    ("gqa dropout", check_inputs(q, kv, kv, mask=mask, dropout_p=0.1), kv),
                ]
            for name, problem, kv_in in dropped_cases:
                _, (kernel, grid, kwargs), _ = hopper.bwd_launches(
                    problem, torch.empty_like(q), out, lse, grads[0], torch.empty_like(kv_in),
                    torch.empty_like(kv_in), philox=torch.zeros(2, dtype=torch.int64))
                results.append(_compile(f"{prefix} bwd {kernel.__name__} {name}", kernel, grid, kwargs))
        if bwd_cfg.deterministic_chains:  # its three kernels: the dQ copies change each
            deterministic = [("deterministic", inputs)]
            if bwd_cfg.windows_and_alibi:
                deterministic.append(("alibi deterministic", check_inputs(q, k, v, mask="t" if causal else None,
                                                                          alibi_slopes=torch.ones(4))))
            if causal and bwd_cfg.long_causal_seqlen:  # a long causal problem's copies
                long_q = torch.empty(1, bwd_cfg.long_causal_seqlen, 4, head_dim, dtype=dtype)
                deterministic.append(("long deterministic", check_inputs(long_q, long_q, long_q, mask="t")))
            if bwd_cfg.diagonal_chains:  # the wide kernel's aligned order: more key tiles than SMs
                long_q = torch.empty(1, (hopper.HOPPER_SMS + 1) * 64, 4, head_dim, dtype=dtype)
                deterministic.append(("aligned deterministic",
                                      check_inputs(long_q, long_q, long_q, mask="t" if causal else None)))
            for name, problem in deterministic:
                outs = [torch.empty_like(problem.q) for _ in range(5)]
                for kernel, grid, kwargs in hopper.bwd_launches(problem, outs[0], outs[1],
                                                                torch.empty(problem.lse_shape, dtype=torch.float32),
                                                                *outs[2:], deterministic=True):
                    results.append(_compile(f"{prefix} bwd {kernel.__name__} {name}", kernel, grid, kwargs))
    return results


def _report(res: Result) -> None:
    status = "ok  " if res.ok else "FAIL" if not res.launches else "SPILL"
    print(f"{status} {res.name:75s} regs={res.registers:3d} spill={res.spill_bytes:5d}B "
          f"smem={res.shared:6d}B {res.error}", flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[],
                        help="check only configs whose name contains this (repeatable: any of them)")
    parser.add_argument("--allow-spills", action="store_true",
                        help="fail only on compile errors and shared memory overflow")
    args = parser.parse_args(argv)

    def wanted(name: str) -> bool:
        return not args.only or any(text in name for text in args.only)

    driver.set_active(_HopperCompileOnly())
    # Head dims off multiples of 16 (24, 40, 72) give strides without the divisibility hint:
    # element-wise loads and the heaviest spills (benchmarks/NOTES.md, 2026-11-30).
    dims = [(16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (40, 72), (192, 128), (24, 8), (72, 160)]
    results = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for dq, dv in dims:
            for features in FEATURE_SETS:
                name = f"fwd {str(dtype).split('.')[-1]} d={dq}/{dv} [{features}]"
                if wanted(name):
                    results.append(check_fwd(dtype, dq, dv, features))
                    _report(results[-1])
                for deterministic in (False, True):
                    mode = "deterministic" if deterministic else "atomic"
                    if wanted(f"b{name[1:]} {mode}"):
                        results += check_bwd(dtype, dq, dv, features, deterministic)
                        for res in results[-3:]:
                            _report(res)
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in HOPPER_FWD_CONFIGS:
            for causal in (False, True):
                if wanted(_hopper_name(dtype, head_dim, causal)):
                    checked = check_hopper(dtype, head_dim, causal)
                    results += checked
                    for res in checked:
                        _report(res)
    failed = [r for r in results if not (r.launches if args.allow_spills else r.ok)]
    limits = "shared memory" if args.allow_spills else "shared memory and without spills (but the accepted)"
    print(f"{len(results) - len(failed)}/{len(results)} kernel configs compile for sm_90 within {limits}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
