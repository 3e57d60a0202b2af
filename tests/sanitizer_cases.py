"""Small forward + backward launches for NVIDIA's compute-sanitizer, each checked against fmha.reference.

    compute-sanitizer --tool memcheck python tests/sanitizer_cases.py
    compute-sanitizer --tool racecheck python tests/sanitizer_cases.py [NAME_PART ...]

Not a pytest module. Each case runs the atomic and then the deterministic backward: ragged lengths
(1, 17, 259: not multiples of any tile), padded varlen, GQA, dropout (with the randval store), bias
with dbias, ALiBi, windows, head dims 32 to 256 and dq != dv, fp16, bf16 and fp32, and the Hopper
fast path's kernels (``fast path`` in the name). Out, LSE, the
dropout bytes and every gradient must meet FlashAttention's criterion against the float64
reference (run on the CPU, outside the sanitizer), else the script exits 1. Add
``--error-exitcode 1`` for sanitizer findings to fail the run too. Run it once without the
sanitizer first: Triton then compiles the kernels into its cache, which is most of the time.

``control`` as the only argument launches ``sanitizer_control.py``'s kernel, which holds nothing
but ``gl.warp_specialize``: what racecheck reports there belongs to Triton's scaffolding, not to
fmha's kernels.
"""

import os

# memcheck only flags accesses outside cudaMalloc'd blocks: with PyTorch's caching allocator an
# overrun into a neighbouring tensor of the same segment would pass unseen.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
# The "fast path" cases are short: run them on the Hopper kernels, not on the portable ones that
# fmha prefers for short d=64 forwards.
os.environ.setdefault("FMHA_PORTABLE", "0")

import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

import fmha  # noqa: E402
from fmha import reference  # noqa: E402
from fmha.testing import error_bound, max_error, random_qkv, random_varlen  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton's interpreter
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@dataclass
class Case:
    name: str
    tensors: tuple  # q, k, v and, when there is one, the bias (which then gets a gradient)
    kwargs: dict  # keywords of both fmha and the reference: mask, dropout, ALiBi, sequence layout

    @property
    def group(self) -> bool:
        return "seqstart_q" in self.kwargs


def batch(name, b, sq, sk, hq, hk, dq, dv, dtype, rng, bias_shape=None, bias_dtype=None, **kwargs):
    gen = torch.Generator().manual_seed(rng)  # rng: the inputs' seed (seed= is dropout's)
    tensors = random_qkv(b, sq, sk, hq, hk, dq, dv, dtype=dtype, device=DEVICE, generator=gen)
    if bias_shape is not None:
        bias = torch.randn(bias_shape, generator=gen).to(DEVICE, bias_dtype or dtype)
        tensors = (*tensors, bias)
    return Case(name, tensors, kwargs)


def group(name, lens_q, lens_k, hq, hk, dq, dv, dtype, rng, with_bias=False, pad_q=None, pad_k=None,
          key_lengths_override=False, **kwargs):
    gen = torch.Generator().manual_seed(rng)
    varlen = random_varlen(lens_q, lens_k, hq, hk, dq, dv, pad_q=pad_q, pad_k=pad_k,
                           key_lengths_override=key_lengths_override, dtype=dtype, device=DEVICE, generator=gen)
    tensors = (varlen.q, varlen.k, varlen.v)
    if with_bias:
        # Group-mode bias: [Hq, total_q, max_seqlen_k], fp32 (the other accepted dtype).
        tensors = (*tensors, torch.randn(hq, varlen.q.shape[0], max(lens_k), generator=gen).to(DEVICE))
    layout = {k: v for k, v in varlen.kwargs().items() if v is not None}
    return Case(name, tensors, {**layout, **kwargs})


def build_cases() -> list[Case]:
    slopes2 = fmha.alibi_slopes(2, device=DEVICE)
    cu = lambda *starts: torch.tensor(starts, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return [
        batch("b1 s1/1 h1 d32 fp16", 1, 1, 1, 1, 1, 32, 32, F16, 0),
        batch("b2 s17/259 h4:1 d64 bf16 causal-br", 2, 17, 259, 4, 1, 64, 64, BF16, 1, mask="b"),
        batch("b1 s259/17 h2 d128 fp16 causal-tl", 1, 259, 17, 2, 2, 128, 128, F16, 2, mask="t"),
        batch("b2 s130/259 h4:2 d128 bf16 window dropout bias[sq,sk]", 2, 130, 259, 4, 2, 128, 128, BF16, 3,
              bias_shape=(130, 259), mask="b:40,8", dropout_p=0.2, seed=9, offset=2**32 - 7),
        batch("b1 s77/129 h2 d64/32 fp16 bias[b,h,sq,sk] fp32", 1, 77, 129, 2, 2, 64, 32, F16, 4,
              bias_shape=(1, 2, 77, 129), bias_dtype=F32, mask="t:-1,20"),
        batch("b1 s200 h2 d256 fp16 alibi causal", 1, 200, 200, 2, 2, 256, 256, F16, 5, mask="b",
              alibi_slopes=slopes2),
        batch("b2 s100/150 h2:1 d64 fp32 window alibi[b,h]", 2, 100, 150, 2, 1, 64, 64, F32, 6, mask="t:20,7",
              alibi_slopes=torch.stack([slopes2, slopes2.flip(0)])),
        batch("b1 s137/259 h4:1 d96/160 bf16", 1, 137, 259, 4, 1, 96, 160, BF16, 7, mask="b:-1,3"),
        batch("b2 s259 h2:1 d64 fp16 cu_seqlen", 2, 259, 259, 2, 1, 64, 64, F16, 8, mask="t",
              cu_seqlen_q=cu(0, 259, 359), cu_seqlen_k=cu(0, 17, 276)),
        batch("b1 s300 h1 d256 bf16 dropout", 1, 300, 300, 1, 1, 256, 256, BF16, 9, dropout_p=0.3, seed=1,
              offset=0),
        group("group [1,17,259]/[17,259,1] padded h4:2 d64 fp16", [1, 17, 259], [17, 259, 1], 4, 2, 64, 64, F16, 10,
              pad_q=[8, 17, 300], pad_k=[32, 260, 8], mask="b"),
        group("group seqlen_k h2:1 d128 bf16 bias, rows without keys", [33, 259, 5], [259, 40, 1], 2, 1, 128, 128,
              BF16, 11, with_bias=True, pad_k=[260, 64, 8], key_lengths_override=True, mask="t:50,50"),
        # Dropout cases in fp16/bf16 keep every row on many keys: in a row that sees one key, dS
        # carries O's rounding (D = dO . O, SPEC §6) where the exact dS is 0, beyond the criterion.
        group("group [130,65]/[259,200] padded h4:1 d64 bf16 dropout", [130, 65], [259, 200], 4, 1, 64, 64, BF16, 12,
              pad_q=[140, 65], pad_k=[259, 210], mask="b", dropout_p=0.2, seed=5, offset=6),
        group("group [65,130]/[70,129] h2 d32 fp32 alibi window dropout", [65, 130], [70, 129], 2, 2, 32, 32, F32,
              13, mask="b:16,4", alibi_slopes=slopes2, dropout_p=0.1, seed=7, offset=8),
        # The Hopper fast path's kernels (on other devices these run the portable ones): TMA
        # boxes past ragged ends, a single row, GQA in the forward, windows and ALiBi.
        batch("fast path b2 s259 h4 d128 bf16", 2, 259, 259, 4, 4, 128, 128, BF16, 14),
        batch("fast path b1 s1 h2 d64 fp16 causal", 1, 1, 1, 2, 2, 64, 64, F16, 15, mask="t"),
        batch("fast path b1 s333 h2 d64 bf16 causal", 1, 333, 333, 2, 2, 64, 64, BF16, 16, mask="b"),
        batch("fast path b3 s200 h6:2 d256 fp16 causal", 3, 200, 200, 6, 2, 256, 256, F16, 17, mask="b"),
        batch("fast path b2 s259 h2 d256 bf16 causal", 2, 259, 259, 2, 2, 256, 256, BF16, 18, mask="t"),
        batch("fast path b2 s259 h2 d64 bf16 window alibi[b,h]", 2, 259, 259, 2, 2, 64, 64, BF16, 19,
              mask="t:100,17", alibi_slopes=torch.stack([slopes2, slopes2.flip(0)])),
        batch("fast path b1 s333 h2 d128 fp16 alibi causal", 1, 333, 333, 2, 2, 128, 128, F16, 20, mask="b",
              alibi_slopes=slopes2),
    ]


def _cpu(kwargs):
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def reference_results(case, dout, dtype):
    """The reference's ``(out, lse, randval, grads)`` in ``dtype`` on the CPU."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in case.tensors]
    res = reference.attention(*leaves[:3], bias=leaves[3] if len(leaves) > 3 else None, compute_dtype=dtype,
                              **_cpu(case.kwargs))
    grads = torch.autograd.grad(res.out, leaves, dout.cpu().to(dtype))
    # NaN padding rows are never read, but 0 * NaN in the reference's dense products is NaN.
    return res.out, res.lse, res.randval, [torch.nan_to_num(g) for g in grads]


def expected(case):
    """``(dout, exact, low)``: a fixed dout and the reference's results in float64 and in q's dtype."""
    q, v = case.tensors[0], case.tensors[2]
    dout = torch.randn((*q.shape[:-1], v.shape[-1]), generator=torch.Generator().manual_seed(99))
    dout = dout.to(DEVICE, q.dtype)
    return dout, reference_results(case, dout, torch.float64), reference_results(case, dout, q.dtype)


def _length(cu, b, full):
    return full if cu is None else int(cu[b + 1] - cu[b])


def visible_bytes(case, shape):
    """Where the randval tensor holds bytes fmha must store: the visible part of each sequence."""
    kw = case.kwargs
    mask = fmha.parse_mask(kw.get("mask"))
    seen = torch.zeros(shape, dtype=torch.bool)
    if case.group:
        rows = kw.get("seqstart_padded_q", kw["seqstart_q"])
        for b in range(len(rows) - 1):
            sq = int(kw["seqstart_q"][b + 1] - kw["seqstart_q"][b])
            sk = int(kw["seqlen_k"][b]) if "seqlen_k" in kw else int(kw["seqstart_k"][b + 1] - kw["seqstart_k"][b])
            seen[:, int(rows[b]) : int(rows[b]) + sq, :sk] = reference.visible(mask, sq, sk)
    else:
        for b in range(shape[0]):
            sq, sk = _length(kw.get("cu_seqlen_q"), b, shape[2]), _length(kw.get("cu_seqlen_k"), b, shape[3])
            seen[b, :, :sq, :sk] = reference.visible(mask, sq, sk)
    return seen


def run(case: Case, deterministic: bool, dout, exact, low) -> float:
    """One forward + backward against ``expected(case)``; returns the worst error / bound (at
    most 1, else AssertionError)."""
    q = case.tensors[0]
    dropout = case.kwargs.get("dropout_p", 0) > 0
    attention = fmha.attention_varlen if case.group else fmha.attention
    leaves = [t.detach().requires_grad_() for t in case.tensors]
    res = attention(*leaves[:3], bias=leaves[3] if len(leaves) > 3 else None, deterministic=deterministic,
                    return_lse=True, return_randval=dropout, **case.kwargs)
    grads = torch.autograd.grad(res.out, leaves, dout)
    # dS = P (dP - D) takes D = dO . O from the stored O (SPEC §6, as CK and FlashAttention do):
    # where P is near 1 (rows that see few keys) dbias = dS carries O's rounding at D's scale,
    # which the low-precision reference (exact cancellation there) lacks.
    d_scale = (dout.cpu().double() * exact[0]).sum(-1).abs().max().item()
    worst = 0.0
    names = ["dq", "dk", "dv", "dbias"]
    for name, got, e, lo in [("out", res.out, exact[0], low[0]), ("lse", res.lse, exact[1], low[1]),
                             *zip(names, grads, exact[3], low[3])]:
        got = got.detach().cpu()
        if name == "lse":
            assert torch.equal(torch.isneginf(got), torch.isneginf(e)), "lse: -inf rows differ"
        else:
            assert torch.isfinite(got).all(), f"{name}: not finite"
        magnitude = d_scale if name == "dbias" else 1.0
        err, bound = max_error(got, e), error_bound(q.dtype, max_error(lo, e), magnitude)
        assert err <= bound, f"{name}: error {err:.3g} above the bound {bound:.3g}"
        worst = max(worst, err / bound)
    if dropout:
        seen = visible_bytes(case, res.randval.shape)
        assert torch.equal(res.randval.cpu()[seen], exact[2][seen]), "randval: bytes differ"
    return worst


def warp_specialize_control() -> int:
    """Launches the scaffolding-only kernels (plain, with a default-partition barrier, with an
    mbarrier handshake) over 264 CTAs each and checks what they stored."""
    from sanitizer_control import warp_specialize_control_kernel

    want = torch.cat([torch.ones(128), torch.full((32,), 2.0)]).cuda()
    failed = 0
    for barrier, handshake in [(False, False), (True, False), (False, True), (True, True)]:
        out = torch.zeros(160, device="cuda")
        warp_specialize_control_kernel[(264,)](out, BARRIER=barrier, MBARRIER=handshake, num_warps=4)
        ok = torch.equal(out, want)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} warp_specialize control, barrier={barrier}, mbarrier={handshake}", flush=True)
    return 1 if failed else 0


def main(names: list[str]) -> int:
    """Runs every case, or those whose name contains one of ``names``."""
    if names == ["control"]:
        return warp_specialize_control()
    failed = passed = 0
    for case in build_cases():
        if names and not any(name in case.name for name in names):
            continue
        want = expected(case)
        for deterministic in (False, True):
            label = f"{case.name}, {'deterministic' if deterministic else 'atomic'}"
            try:
                worst = run(case, deterministic, *want)
            except AssertionError as error:
                failed += 1
                print(f"FAIL {label}: {error}", flush=True)
                continue
            passed += 1
            print(f"ok   {label}: worst error / bound {worst:.2f}", flush=True)
    if failed:
        print(f"{failed} of {failed + passed} cases FAILED")
        return 1
    print(f"{passed} cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
