"""Seeded random problems, forward and backward, checked against ``fmha.reference``.

    python -m fmha.fuzz --examples 1000 --max-len 300 --jobs 14   # on a GPU
    python -m fmha.fuzz --examples 20 --max-len 40 --seed 7  # on a CPU (Triton's interpreter)

Every example draws batch or group mode, lengths including 0 and 1, padded slots, GQA ratios,
head dims 1-256 with ``dq != dv``, every mask form, broadcast bias shapes, ALiBi, dropout,
fp16/bf16/fp32, transposed and strided layouts and a ``dout`` with strides unlike ``out``'s. The
output and LSE must meet FlashAttention's criterion (``fmha.testing``) against the float64
reference, the gradients against the float64 gradients of SPEC.md §6 (which read D from the
forward's stored O, as CK and FlashAttention do). Example ``i`` of seed ``s`` is reproducible on
its own: ``--seed s --first i --examples 1``.

``--fast-path`` draws only problems the Hopper fast path's kernels cover (``fmha.hopper``): batch
mode, ``seqlen_q == seqlen_k``, no mask or a causal one, head dims 64/128/256, fp16/bf16, no bias,
ALiBi or dropout; GQA ratios, layouts, ``dout`` strides and both backward modes stay random. It
sets ``FMHA_PORTABLE=0``, so the short sequences it draws run those kernels too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from . import reference
from .api import attention, attention_varlen
from .configs import HOPPER_FWD_CONFIGS
from .testing import d_rounding_term, error_bound, max_error, prefix_sums, random_tensor, random_varlen

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (1, 8, 16, 24, 32, 40, 64, 72, 96, 128, 160, 192, 256)


@dataclass
class Case:
    """One random problem; ``describe()`` prints everything needed to rebuild it."""

    index: int
    group: bool
    lengths_q: list[int]
    lengths_k: list[int]
    slots_q: list[int] | None  # group: physical slot sizes (seqstart_padded_q); batch: None
    slots_k: list[int] | None
    key_lengths_override: bool  # group: key lengths through seqlen_k
    seqlen_q: int  # batch: the tensor's Sq (>= every effective length)
    seqlen_k: int
    effective: bool  # batch: lengths given through cu_seqlen_q/k
    nhead_q: int
    nhead_k: int
    head_dim_q: int
    head_dim_v: int
    dtype: str
    mask: str | None
    bias_shape: tuple[int, ...] | None
    alibi: str  # "none", "h" ([Hq]) or "bh" ([B, Hq])
    dropout_p: float
    layout: str
    dout_layout: str
    deterministic: bool
    seed: int = 0
    offset: int = 0

    def describe(self) -> str:
        mode = "group" if self.group else "batch"
        lens = (f"lens_q={self.lengths_q} lens_k={self.lengths_k} slots_q={self.slots_q} slots_k={self.slots_k}"
                f"{' seqlen_k' if self.key_lengths_override else ''}" if self.group else
                f"s={self.seqlen_q}/{self.seqlen_k}"
                + (f" cu_seqlen {self.lengths_q}/{self.lengths_k}" if self.effective else ""))
        return (f"#{self.index} {mode} {self.dtype} {lens} h={self.nhead_q}/{self.nhead_k} "
                f"d={self.head_dim_q}/{self.head_dim_v} mask={self.mask} bias={self.bias_shape} "
                f"alibi={self.alibi} p_drop={self.dropout_p} layout={self.layout} dout={self.dout_layout} "
                f"deterministic={self.deterministic}")


def _length(rng: random.Random, max_len: int) -> int:
    return rng.choice([0, 1] + [rng.randint(2, max_len)] * 6)


def _mask(rng: random.Random, max_len: int) -> str | None:
    left = rng.choice([-1, 0, rng.randint(1, max_len)])
    right = rng.choice([-1, 0, rng.randint(1, max_len)])
    return rng.choice([None, "t", "b", f"t:{left},{right}", f"b:{left},{right}"])


def random_case(seed: int, index: int, max_len: int, fast_path: bool = False) -> Case:
    """Example ``index`` of the stream ``seed`` (independent of the other examples); with
    ``fast_path``, narrowed to the problems the Hopper fast path takes."""
    rng = random.Random(seed * 1_000_003 + index)
    group = rng.random() < 0.4
    batch = rng.randint(1, 3)
    nhead_k = rng.choice([1, 2])
    nhead_q = nhead_k * rng.choice([1, 2, 3])
    head_dim_q = rng.choice(HEAD_DIMS)
    head_dim_v = head_dim_q if rng.random() < 0.5 else rng.choice(HEAD_DIMS)
    lengths_q = [_length(rng, max_len) for _ in range(batch)]
    lengths_k = [_length(rng, max_len) for _ in range(batch)]
    slots_q = slots_k = None
    key_override = effective = False
    seqlen_q, seqlen_k = max(lengths_q), max(lengths_k)
    if group:
        if rng.random() < 0.3:
            slots_q = [n + rng.choice([0, 1, 7]) for n in lengths_q]
        key_override = rng.random() < 0.2
        if key_override or rng.random() < 0.3:
            slots_k = [n + rng.choice([0, 1, 7]) for n in lengths_k]
    else:
        effective = rng.random() < 0.3
        if effective:
            seqlen_q += rng.choice([0, 3])
            seqlen_k += rng.choice([0, 5])
        else:
            lengths_q, lengths_k = [seqlen_q] * batch, [seqlen_k] * batch
    if group:
        total_q = sum(slots_q or lengths_q)
        bias_shapes = [None, (nhead_q, total_q, max(lengths_k)), (1, total_q, max(lengths_k)),
                       (nhead_q, 1, max(lengths_k))]
    else:
        bias_shapes = [None, (seqlen_q, seqlen_k), (nhead_q, seqlen_q, seqlen_k), (batch, 1, seqlen_q, seqlen_k),
                       (1, nhead_q, 1, seqlen_k), (batch, nhead_q, seqlen_q, seqlen_k)]
    bias_shape = rng.choice(bias_shapes)
    if bias_shape is not None and 0 in bias_shape:
        bias_shape = None
    case = Case(
        index=index, group=group, lengths_q=lengths_q, lengths_k=lengths_k, slots_q=slots_q, slots_k=slots_k,
        key_lengths_override=key_override, seqlen_q=seqlen_q, seqlen_k=seqlen_k, effective=effective,
        nhead_q=nhead_q, nhead_k=nhead_k, head_dim_q=head_dim_q, head_dim_v=head_dim_v,
        dtype=rng.choice(list(DTYPES)), mask=_mask(rng, max_len), bias_shape=bias_shape,
        alibi=rng.choice(["none", "none", "h", "bh"]), dropout_p=rng.choice([0.0, 0.0, 0.2, 0.5]),
        layout=rng.choice(["bshd", "bhsd", "strided"]), dout_layout=rng.choice(["bshd", "bhsd", "strided"]),
        deterministic=rng.random() < 0.5, seed=rng.randrange(2**63), offset=rng.randrange(2**40),
    )
    if not fast_path:
        return case
    seqlen = rng.choice([1, rng.randint(2, max_len), rng.randint(2, max_len)])
    head_dim = rng.choice(list(HOPPER_FWD_CONFIGS))
    return dataclasses.replace(
        case, group=False, lengths_q=[seqlen] * batch, lengths_k=[seqlen] * batch, slots_q=None, slots_k=None,
        key_lengths_override=False, seqlen_q=seqlen, seqlen_k=seqlen, effective=False, head_dim_q=head_dim,
        head_dim_v=head_dim, dtype=rng.choice(["fp16", "bf16"]), mask=rng.choice([None, "t", "b"]),
        bias_shape=None, alibi="none", dropout_p=0.0,
    )


def _strided_rows(x: torch.Tensor) -> torch.Tensor:
    """A copy of packed ``[total, H, D]`` whose rows and heads are padded (head dim contiguous)."""
    t, h, d = x.shape
    out = torch.full((t, h + 1, d + 8), float("nan"), dtype=x.dtype, device=x.device)[:, :h, :d]
    return out.copy_(x)


def _problem(case: Case, device: str, gen: torch.Generator):
    """(q, k, v, fmha function, keyword arguments shared by fmha and the reference)."""
    dtype = DTYPES[case.dtype]
    b = len(case.lengths_q)
    kwargs: dict = dict(mask=case.mask, dropout_p=case.dropout_p, seed=case.seed, offset=case.offset)
    if case.group:
        batch = random_varlen(case.lengths_q, case.lengths_k, case.nhead_q, case.nhead_k, case.head_dim_q,
                              case.head_dim_v, pad_q=case.slots_q, pad_k=case.slots_k,
                              key_lengths_override=case.key_lengths_override, dtype=dtype, device=device,
                              generator=gen)
        q, k, v = batch.q, batch.k, batch.v
        if case.layout == "strided":
            q, k, v = (_strided_rows(x) for x in (q, k, v))
        kwargs.update(batch.kwargs())
        fn = attention_varlen
    else:
        q = random_tensor((b, case.seqlen_q, case.nhead_q, case.head_dim_q), dtype, device, case.layout, gen)
        k = random_tensor((b, case.seqlen_k, case.nhead_k, case.head_dim_q), dtype, device, case.layout, gen)
        v = random_tensor((b, case.seqlen_k, case.nhead_k, case.head_dim_v), dtype, device, case.layout, gen)
        if case.effective:
            kwargs["cu_seqlen_q"] = prefix_sums(case.lengths_q, device)
            kwargs["cu_seqlen_k"] = prefix_sums(case.lengths_k, device)
        fn = attention
    if case.bias_shape is not None:
        kwargs["bias"] = torch.randn(case.bias_shape, generator=gen).to(device=device, dtype=dtype)
    if case.alibi != "none":
        slopes = torch.rand((case.nhead_q,) if case.alibi == "h" else (b, case.nhead_q), generator=gen)
        kwargs["alibi_slopes"] = slopes.to(device)
    return q, k, v, fn, kwargs


def _leaves(q, k, v, kwargs, dtype):
    """Fresh leaves in ``dtype`` (q, k, v and the bias, if any) and kwargs that use them."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    kwargs = dict(kwargs)
    if "bias" in kwargs:
        leaves.append(kwargs["bias"].detach().to(dtype).requires_grad_())
        kwargs["bias"] = leaves[-1]
    return leaves, kwargs


def _row_delta(case: Case, dout, out, exact_out) -> torch.Tensor:
    """``dO · (O - O_exact)`` per row, laid out like LSE (group mode: logical rows)."""
    delta = (dout.double() * (out.double() - exact_out.double())).sum(-1)
    if not case.group:
        return delta.permute(0, 2, 1)  # [B, Sq, Hq] -> [B, Hq, Sq]
    starts = prefix_sums(case.slots_q or case.lengths_q).tolist()
    rows = [r for b, n in enumerate(case.lengths_q) for r in range(starts[b], starts[b] + n)]
    return delta[torch.tensor(rows, dtype=torch.long, device=delta.device)].T


def _reference_grads(case: Case, q, k, v, dout, kwargs, dtype, delta):
    """Gradients of the backward SPEC.md §6 defines, in ``dtype``: the one that reads D from the
    forward's stored O. Autograd of the reference gives the exact-O gradient; the extra term
    ``-sum(delta * LSE)``, with ``delta = dO · (O - O_exact)``, adds ``-P * delta`` to dS, which
    turns ``D_exact`` into ``D(O)``."""
    leaves, ref_kwargs = _leaves(q, k, v, kwargs, dtype)
    result = reference.attention(*leaves[:3], compute_dtype=dtype, **ref_kwargs)
    lse = torch.where(torch.isfinite(result.lse), result.lse, torch.zeros_like(result.lse))
    loss = (result.out * dout.to(dtype)).sum() - (delta.to(lse.dtype) * lse).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def _dout(case: Case, shape, dtype, device, gen) -> torch.Tensor:
    """``dout`` of ``shape`` laid out as ``case.dout_layout`` (strides unlike a contiguous ``out``)."""
    if len(shape) == 4:
        return random_tensor(shape, dtype, device, case.dout_layout, gen)
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    if case.dout_layout == "bshd":
        return x
    if case.dout_layout == "bhsd":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    return _strided_rows(x)


def run_case(case: Case, device: str) -> list[str]:
    """Check one example; returns the failures (empty when everything meets the criterion)."""
    gen = torch.Generator().manual_seed(case.seed % 2**63)
    q, k, v, fn, kwargs = _problem(case, device, gen)
    dtype = q.dtype
    leaves, fmha_kwargs = _leaves(q, k, v, kwargs, dtype)
    out, lse, _ = fn(*leaves[:3], deterministic=case.deterministic, return_lse=True, **fmha_kwargs)
    dout = _dout(case, tuple(out.shape), dtype, device, gen)
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

    plain = [t.detach() for t in (q, k, v)]
    ref = reference.attention(*plain, **kwargs)
    low_ref = reference.attention(*plain, compute_dtype=dtype, **kwargs)
    delta = _row_delta(case, dout, out.detach(), ref.out)
    ref_grads = _reference_grads(case, q, k, v, dout, kwargs, torch.float64, delta)
    low_grads = _reference_grads(case, q, k, v, dout, kwargs, dtype, delta)
    failures = []
    d_term = d_rounding_term(dout, out.detach()) if out.numel() else 0.0
    named = [("out", out, ref.out, low_ref.out), ("lse", lse, ref.lse, low_ref.lse)]
    named += list(zip(["dq", "dk", "dv", "dbias"], grads, ref_grads, low_grads))
    for name, got, exact, low in named:
        if tuple(got.shape) != tuple(exact.shape):
            failures.append(f"{name}: shape {tuple(got.shape)}, reference {tuple(exact.shape)}")
            continue
        if torch.isnan(got).any() and not torch.isnan(exact).any():
            failures.append(f"{name}: NaN where the reference has none")
            continue
        err = max_error(got.detach(), exact)
        finite = exact[torch.isfinite(exact)]
        magnitude = finite.abs().max().item() if finite.numel() else 0.0
        # LSE is fp32 in fmha and in the low-precision reference: fp32's floor.
        bound = error_bound(torch.float32 if name == "lse" else dtype, max_error(low, exact), magnitude)
        if name in ("dq", "dk", "dbias"):
            bound += d_term
        if err > bound:
            failures.append(f"{name}: error {err:.3g} > bound {bound:.3g}")
    return failures


def _context_lost() -> bool:
    """After an illegal memory access every later CUDA call fails too."""
    try:
        torch.cuda.synchronize()
    except Exception:  # torch.AcceleratorError; older torch raise RuntimeError
        return True
    return False


def run(examples: int, seed: int, max_len: int, device: str, first: int = 0, seconds: float | None = None,
        log=print, fast_path: bool = False) -> list[tuple[Case, list[str]]]:
    """Run examples ``first .. first + examples - 1`` (stopping early after ``seconds``); returns
    the failing ones with their failures."""
    failed = []
    start = time.time()
    done = 0
    for index in range(first, first + examples):
        if seconds is not None and time.time() - start > seconds:
            break
        done += 1
        case = random_case(seed, index, max_len, fast_path)
        try:
            failures = run_case(case, device)
        except Exception as exc:  # a crash is a finding too; keep going
            failures = [f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"]
        if failures:
            failed.append((case, failures))
            log(f"FAIL {case.describe()}\n     " + "\n     ".join(failures))
            if device != "cpu" and _context_lost():
                log(f"the CUDA context is lost, so no later example can run in this process: "
                    f"resume with --first {index + 1}")
                break
    ran = f"examples {first}-{first + done - 1}" if done else "no examples"
    kind = ", fast path" if fast_path else ""
    log(f"{done - len(failed)}/{done} examples passed (seed {seed}, max length {max_len}{kind}, "
        f"{device}, {ran}, {time.time() - start:.0f} s)")
    return failed


def _merged(ranges: list[tuple[int, int]]) -> str:
    """``[(0, 3), (4, 9), (12, 12)]`` -> ``"0-9, 12-12"``."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return ", ".join(f"{lo}-{hi}" for lo, hi in merged) or "none"


def run_in_workers(examples: int, seed: int, max_len: int, device: str, first: int, jobs: int,
                   seconds: float | None = None, log=print, fast_path: bool = False) -> int:
    """``run`` split over ``jobs`` worker processes (``python -m fmha.fuzz`` on a slice each), which
    compile kernels in parallel and keep a lost CUDA context to one worker: that worker stops and a
    new one resumes after the example that lost it. Returns the number of failing examples."""
    start = time.time()
    bounds = [first + examples * i // jobs for i in range(jobs + 1)]
    pending = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    running: list[tuple[subprocess.Popen, object, int]] = []
    done = passed = 0
    ranges: list[tuple[int, int]] = []
    with tempfile.TemporaryDirectory() as logs:
        while pending or running:
            while pending and len(running) < jobs:
                lo, hi = pending.pop(0)
                args = [sys.executable, "-m", "fmha.fuzz", "--first", str(lo), "--examples", str(hi - lo),
                        "--seed", str(seed), "--max-len", str(max_len), "--device", device]
                if seconds is not None:
                    args += ["--seconds", str(max(0.0, seconds - (time.time() - start)))]
                if fast_path:
                    args.append("--fast-path")
                out = open(os.path.join(logs, f"{lo}.log"), "w+")
                running.append((subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, text=True), out, hi))
            time.sleep(0.2)
            for proc, out, hi in [r for r in running if r[0].poll() is not None]:
                running.remove((proc, out, hi))
                out.seek(0)
                for line in out.read().splitlines():
                    summary = re.match(r"(\d+)/(\d+) examples passed", line)
                    resume = re.search(r"resume with --first (\d+)", line)
                    if summary:
                        passed, done = passed + int(summary[1]), done + int(summary[2])
                        ranges += [tuple(map(int, r)) for r in re.findall(r"examples (\d+)-(\d+)", line)]
                    elif resume and int(resume[1]) < hi:
                        pending.append((int(resume[1]), hi))
                    elif line.strip():
                        log(line)
                out.close()
    kind = ", fast path" if fast_path else ""
    log(f"{passed}/{done} examples passed (seed {seed}, max length {max_len}{kind}, {device}, "
        f"{time.time() - start:.0f} s, {jobs} workers; examples {_merged(ranges)})")
    return done - passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="index of the first example")
    parser.add_argument("--max-len", type=int, default=300, help="longest sequence drawn")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seconds", type=float, help="stop starting new examples after this long")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (each compiles its own kernels)")
    parser.add_argument("--fast-path", action="store_true",
                        help="only problems the Hopper fast path takes (fmha.hopper)")
    args = parser.parse_args(argv)
    if args.fast_path:  # the workers inherit it
        os.environ["FMHA_PORTABLE"] = "0"
    if args.jobs > 1:
        return 1 if run_in_workers(args.examples, args.seed, args.max_len, args.device, args.first, args.jobs,
                                   args.seconds, fast_path=args.fast_path) else 0
    failed = run(args.examples, args.seed, args.max_len, args.device, args.first, args.seconds,
                 fast_path=args.fast_path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
