"""The Hopper fast path (Gluon kernels) against the reference, at shapes that exercise its edges:
ragged tiles, a single row, GQA/MQA, causal, strided and head-major layouts, fp16 and bf16.

Run on an H100/H200 with ``python -m pytest tests/test_gpu_hopper.py``; skipped elsewhere (the
portable kernels cover the same semantics there).
"""

import dataclasses

import pytest
import torch

import fmha
from fmha import hopper
from fmha.inputs import check_inputs
from fmha.testing import error_bound, max_error, random_qkv, random_varlen

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")]


@pytest.fixture(autouse=True)
def fast_path_on_short_sequences(monkeypatch):
    """These shapes are short: check the Hopper kernels on them, not the portable ones fmha prefers
    for short d=64 forwards."""
    monkeypatch.setenv("FMHA_PORTABLE", "0")

# (batch, seqlen, nhead_q, nhead_k, head_dim, mask, dtype, layout)
CASES = [
    (2, 1000, 8, 8, 128, None, torch.bfloat16, "bshd"),
    (2, 1000, 8, 8, 128, "t", torch.bfloat16, "bshd"),
    (1, 4096, 4, 4, 128, "b", torch.bfloat16, "bhsd"),
    (2, 259, 4, 4, 64, None, torch.float16, "bhsd"),
    (2, 333, 6, 6, 64, "t", torch.bfloat16, "strided"),
    (3, 1, 4, 4, 64, "t", torch.bfloat16, "bshd"),
    (1, 517, 8, 2, 128, "t", torch.bfloat16, "bshd"),
    (2, 300, 4, 1, 256, None, torch.float16, "bshd"),
    (2, 1000, 8, 1, 64, "t", torch.bfloat16, "bshd"),
    (1, 700, 6, 2, 128, None, torch.float16, "bhsd"),
    (1, 640, 4, 2, 256, "b", torch.bfloat16, "strided"),
    (1, 1100, 4, 4, 256, "t", torch.bfloat16, "strided"),
    (2, 259, 2, 2, 256, None, torch.bfloat16, "bshd"),
    (1, 640, 3, 3, 256, "b", torch.float16, "bhsd"),
    (3, 1, 2, 2, 256, "t", torch.bfloat16, "bshd"),
]
# More query tiles than SMs: each persistent forward CTA runs several, its rings and Q buffers
# running on (d = 64/128 at 2048 non-causal; longer and causal ones run one CTA per tile since
# fwd_persistent's limits).
PERSISTENT_CASES = [
    (4, 2048, 8, 8, 128, None, torch.bfloat16, "bshd"),
    (8, 1024, 8, 8, 128, "t", torch.bfloat16, "bshd"),
    (4, 2048, 8, 8, 64, None, torch.float16, "bshd"),
    (4, 2000, 8, 8, 128, "t", torch.bfloat16, "bshd"),
    (2, 3000, 8, 2, 64, None, torch.float16, "bshd"),
    (2, 2000, 8, 8, 256, "b", torch.bfloat16, "bshd"),
]
CASES += PERSISTENT_CASES
IDS = [f"b{b}-s{s}-h{hq}/{hk}-d{d}-{mask or 'n'}-{str(dt)[6:]}-{layout}" for b, s, hq, hk, d, mask, dt, layout in CASES]


def _problem(case):
    batch, seqlen, nhead_q, nhead_k, head_dim, mask, dtype, layout = case
    g = torch.Generator().manual_seed(seqlen)
    q, k, v = random_qkv(batch, seqlen, seqlen, nhead_q, nhead_k, head_dim, head_dim, dtype=dtype,
                         device="cuda", layout=layout, generator=g)
    dout = torch.randn(batch, seqlen, nhead_q, head_dim, generator=g).to("cuda", dtype)
    return q, k, v, dout, dict(mask=mask)


def _reference(q, k, v, dout, kwargs, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    result = fmha.reference.attention(*leaves, compute_dtype=dtype, **kwargs)
    grads = torch.autograd.grad(result.out, leaves, dout.to(dtype))
    return result.out, result.lse, grads


def _assert_grads_match_reference(grads, q, k, v, dout, kwargs):
    """dq, dk, dv finite and against the fp32 reference, within the error of the reference run in
    q's dtype."""
    _, _, exact_grads = _reference(q, k, v, dout, kwargs, torch.float32)
    _, _, low_grads = _reference(q, k, v, dout, kwargs, q.dtype)
    for name, got, exact, low in zip("qkv", grads, exact_grads, low_grads):
        assert torch.isfinite(got).all(), f"d{name}"
        assert max_error(got, exact) <= error_bound(q.dtype, max_error(low, exact)), f"d{name}"


def _assert_matches_reference(q, k, v, dout, kwargs):
    """fmha's forward (out, LSE) and gradients against the fp32 reference, within the error of the
    reference run in q's dtype."""
    dtype = q.dtype
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    result = fmha.fwd(*leaves, **kwargs, return_lse=True)
    grads = torch.autograd.grad(fmha.attention(*leaves, **kwargs), leaves, dout)

    exact_out, exact_lse, exact_grads = _reference(q, k, v, dout, kwargs, torch.float32)
    low_out, _, low_grads = _reference(q, k, v, dout, kwargs, dtype)
    assert max_error(result.out, exact_out) <= error_bound(dtype, max_error(low_out, exact_out))
    assert max_error(result.lse, exact_lse) <= 2e-3
    for name, got, exact, low in zip("qkv", grads, exact_grads, low_grads):
        assert max_error(got, exact) <= error_bound(dtype, max_error(low, exact)), f"d{name}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fast_path_takes_these_problems(case):
    q, k, v, _, kwargs = _problem(case)
    inputs = check_inputs(q, k, v, **kwargs)
    assert hopper.fwd_unsupported(inputs) is None
    assert hopper.bwd_unsupported(inputs, deterministic=False) is None
    deterministic = hopper.bwd_unsupported(inputs, deterministic=True)
    if inputs.nhead_q == inputs.nhead_k:
        assert deterministic is None
    else:
        assert deterministic.startswith("deterministic mode")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_backward_against_reference(case):
    q, k, v, dout, kwargs = _problem(case)
    dtype = q.dtype
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    result = fmha.fwd(*leaves, **kwargs, return_lse=True)
    out = fmha.attention(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)

    exact_out, exact_lse, exact_grads = _reference(q, k, v, dout, kwargs, torch.float32)
    low_out, _, low_grads = _reference(q, k, v, dout, kwargs, dtype)
    assert torch.equal(result.out, out.detach())
    assert max_error(result.out, exact_out) <= error_bound(dtype, max_error(low_out, exact_out))
    assert max_error(result.lse, exact_lse) <= 2e-3
    for name, got, exact, low in zip("qkv", grads, exact_grads, low_grads):
        assert torch.isfinite(got).all(), f"d{name}"
        assert max_error(got, exact) <= error_bound(dtype, max_error(low, exact)), f"d{name}"


@pytest.mark.parametrize("seqlen", [1024, 1000])
def test_persistent_causal_forward_against_reference(monkeypatch, seqlen):
    """The persistent causal forward (query-tile major turns, longest first), which no shipped
    config runs but a tuning sweep may (``tune_hopper_fwd.py --persistent``)."""
    cfg = dataclasses.replace(hopper.HOPPER_FWD_CONFIGS[128], persistent_max_seqlen_causal=1024)
    monkeypatch.setitem(hopper.HOPPER_FWD_CONFIGS, 128, cfg)
    q, k, v, dout, kwargs = _problem((8, seqlen, 8, 8, 128, "t", torch.bfloat16, "bshd"))
    assert hopper.fwd_persistent(check_inputs(q, k, v, **kwargs))
    _assert_matches_reference(q, k, v, dout, kwargs)


@pytest.mark.parametrize("head_dim, seqlen, mask", [(128, 1024, "t"), (64, 1000, None), (256, 1024, "b"),
                                                     (128, 2048, "b:300,0")])
def test_repeated_calls_through_the_plans_against_reference(head_dim, seqlen, mask):
    """Three calls of one geometry on fresh tensors: the first builds the launch plans, the others
    launch their compiled kernels directly; the first is one tensor as q, k and v (a plan must
    not take it for three)."""
    g = torch.Generator().manual_seed(head_dim + seqlen)
    x = torch.randn(2, seqlen, 4, head_dim, generator=g).to("cuda", torch.bfloat16)
    fmha.attention(*[x.detach().requires_grad_()] * 3, mask=mask).sum().backward()
    for _ in range(3):
        q, k, v, dout = (torch.randn(2, seqlen, 4, head_dim, generator=g).to("cuda", torch.bfloat16)
                         for _ in range(4))
        _assert_matches_reference(q, k, v, dout, dict(mask=mask))


def test_logits_of_magnitude_1e4():
    """Scores near 1e4 (max subtraction in log2 units must keep them finite), causal, d=64 bf16."""
    g = torch.Generator().manual_seed(4)
    q, k, v = random_qkv(1, 300, 300, 2, 2, 64, 64, dtype=torch.float32, generator=g)
    q = (q * 12).to("cuda", torch.bfloat16)  # |q.k| up to about 1e4 at scale 1
    k, v = k.to("cuda", torch.bfloat16), v.to("cuda", torch.bfloat16)
    result = fmha.fwd(q, k, v, scale=1.0, mask="b", return_lse=True)
    exact = fmha.reference.attention(q, k, v, scale=1.0, mask="b", compute_dtype=torch.float32)
    low = fmha.reference.attention(q, k, v, scale=1.0, mask="b", compute_dtype=torch.bfloat16)
    assert torch.isfinite(result.out).all() and torch.isfinite(result.lse).all()
    assert max_error(result.out, exact.out) <= error_bound(torch.bfloat16, max_error(low.out, exact.out))
    # fp32 dot products of magnitude 1e4 round at about 1e-3 (the reference's as well as fmha's)
    assert max_error(result.lse, exact.lse) <= 0.05


def test_nan_in_one_query_row_stays_in_that_row():
    """Each query row is its own softmax: a NaN row leaves every other row bit for bit unchanged."""
    q, k, v = random_qkv(2, 500, 500, 4, 4, 128, 128, dtype=torch.bfloat16, device="cuda",
                         generator=torch.Generator().manual_seed(5))
    clean = fmha.attention(q, k, v, mask="t")
    q = q.clone()
    q[1, 200, 3] = float("nan")
    out = fmha.attention(q, k, v, mask="t")
    assert torch.isnan(out[1, 200, 3]).all()
    others = torch.ones(out.shape[:3], dtype=torch.bool, device="cuda")
    others[1, 200, 3] = False
    assert torch.equal(out[others], clean[others])


# The forward with a sliding window and/or ALiBi (the backward of these: the fast one at d=64/128,
# the portable one at d=256, from the fast forward's LSE): ragged windows from both corners, both
# ALiBi forms, every head dim.
WINDOW_ALIBI_CASES = [
    (2, 1000, 4, 128, "b:100,0", False, torch.bfloat16),
    (1, 3000, 2, 128, "b:1024,0", False, torch.bfloat16),
    (2, 777, 4, 64, "t:200,17", False, torch.float16),
    # edge tiles half of which a warpgroup does not see, which it skips (d = 64/128; the 1090-row
    # sequence ends in the left half of its last tile)
    (1, 2000, 2, 64, "b:1024,0", False, torch.bfloat16),
    (1, 1090, 2, 128, "b:500,0", False, torch.bfloat16),
    (2, 900, 2, 128, "b:200,70", False, torch.float16),
    (1, 1500, 2, 256, "b:300,50", False, torch.bfloat16),
    # short bands run persistent CTAs, several tiles each (more tiles than SMs); a wide one does not
    (4, 4096, 8, 128, "b:1024,0", False, torch.bfloat16),
    (2, 4096, 8, 64, "t:300,40", False, torch.bfloat16),
    (2, 4096, 8, 256, "b:1024,0", False, torch.float16),
    (1, 5000, 2, 128, "b:2500,0", False, torch.float16),
    (1, 5000, 2, 64, "b:2500,17", False, torch.bfloat16),  # 192-row CTAs, one a tile: edge tiles skipped
    (2, 1000, 4, 128, None, True, torch.bfloat16),
    (2, 1000, 4, 128, "t", True, torch.bfloat16),
    (1, 1100, 2, 256, "b:256,0", True, torch.float16),
    (2, 600, 4, 64, None, True, torch.bfloat16),
    # d=128/256 take ALiBi without a mask linearly off the diagonal: long distances, steep slopes
    (1, 4100, 8, 128, None, True, torch.float16),
    (1, 2500, 8, 256, None, True, torch.bfloat16),
]


@pytest.mark.parametrize("case", WINDOW_ALIBI_CASES, ids=[
    f"s{c[1]}-d{c[3]}-{c[4] or 'n'}-{'alibi' if c[5] else 'plain'}-{str(c[6])[6:]}" for c in WINDOW_ALIBI_CASES])
def test_forward_with_window_or_alibi_against_reference(case):
    batch, seqlen, nhead, head_dim, mask, alibi, dtype = case
    q, k, v, dout, _ = _problem((batch, seqlen, nhead, nhead, head_dim, mask, dtype, "bshd"))
    kwargs = dict(mask=mask)
    if alibi:
        kwargs["alibi_slopes"] = fmha.alibi_slopes(nhead, device="cuda")
    assert hopper.fwd_unsupported(check_inputs(q, k, v, **kwargs)) is None
    _assert_matches_reference(q, k, v, dout, kwargs)


def _bias(form, batch, nhead, seqlen, dtype, seed, pad, inf_share, inf_row, magnitude=1):
    """A random bias of ``form`` ("ss", "hss", "bhss", or "bhss-pad": a view of rows ``pad`` keys
    wider, sliced on the device so the row stride stays), with ``inf_share`` of its entries and the
    whole row ``inf_row`` -inf when ``inf_share`` is not 0."""
    g = torch.Generator().manual_seed(seed)
    rows = {"ss": (seqlen,), "hss": (nhead, seqlen), "bhss": (batch, nhead, seqlen),
            "bhss-pad": (batch, nhead, seqlen)}[form]
    full = magnitude * torch.randn(*rows, seqlen + (pad if form == "bhss-pad" else 0), generator=g)
    if inf_share:
        full[torch.rand(full.shape, generator=g) < inf_share] = -float("inf")
        full[..., inf_row, :] = -float("inf")  # a row that sees nothing
    return full.to("cuda", dtype)[..., :seqlen]


# The forward with an elementwise bias (through the K ring by TMA; the backward runs the fast
# kernels at d = 128 without dropout, else the portable ones from the fast forward's LSE): every broadcast form TMA reads, a causal mask, ragged lengths,
# d = 128/256, and -inf entries, whole rows of them included (O = 0, LSE = -inf).
# Lengths are multiples of 8 (TMA wants 16-byte row strides; others stay portable) but not of the
# tiles; "pad" rows are a view of wider rows (row stride != seqlen).
# With dropout too (p > 0) the keys come in tiles of 64 (HopperFwdConfig.bias_dropout_block_n).
# (batch, seqlen, nhead_q, nhead_k, head_dim, mask, bias shape, -inf entries, dtype, dropout p)
BIAS_CASES = [
    (2, 1000, 4, 4, 128, None, "hss", False, torch.bfloat16, 0.0),
    (2, 776, 4, 4, 128, "t", "bhss", False, torch.float16, 0.0),
    (1, 1496, 2, 2, 256, None, "ss", False, torch.bfloat16, 0.0),
    (2, 1000, 4, 4, 128, None, "hss", True, torch.bfloat16, 0.0),
    (2, 1200, 2, 2, 256, "b", "bhss", True, torch.bfloat16, 0.0),
    (2, 520, 8, 2, 128, "t", "bhss-pad", False, torch.bfloat16, 0.0),
    (2, 1000, 4, 4, 128, None, "hss", False, torch.bfloat16, 0.2),
    (1, 1496, 4, 2, 128, "t", "bhss", True, torch.float16, 0.2),
]


@pytest.mark.parametrize("case", BIAS_CASES, ids=[
    f"s{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-{c[5] or 'n'}-{c[6]}{'-inf' if c[7] else ''}-{str(c[8])[6:]}"
    f"{f'-p{c[9]}' if c[9] else ''}" for c in BIAS_CASES])
def test_forward_with_bias_against_reference(case):
    batch, seqlen, nhead, nhead_k, head_dim, mask, form, with_inf, dtype, p = case
    q, k, v, dout, _ = _problem((batch, seqlen, nhead, nhead_k, head_dim, mask, dtype, "bshd"))
    bias = _bias(form, batch, nhead, seqlen, dtype, seed=7, pad=24, inf_share=0.2 if with_inf else 0, inf_row=5)
    kwargs = dict(mask=mask, dropout_p=p, **DROPOUT_SEEDS) if p else dict(mask=mask)
    inputs = check_inputs(q, k, v, bias=bias, **kwargs)
    assert hopper.fwd_unsupported(inputs) is None
    fast_bwd = head_dim == 128 and not p
    assert (hopper.bwd_unsupported(inputs, deterministic=False) is None) == fast_bwd
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    result = fmha.fwd(*leaves, bias=bias, **kwargs, return_lse=True)
    grads = torch.autograd.grad(fmha.attention(*leaves, bias=bias, **kwargs), leaves, dout)

    def reference(compute):
        return _reference(q, k, v, dout, dict(kwargs, bias=bias.to(compute)), compute)

    (exact_out, exact_lse, exact_grads), (low_out, _, low_grads) = reference(torch.float32), reference(dtype)
    assert max_error(result.out, exact_out) <= error_bound(dtype, max_error(low_out, exact_out))
    assert max_error(result.lse, exact_lse) <= 2e-3
    if with_inf:
        assert torch.all(result.out[:, 5] == 0) and torch.all(result.lse[..., 5] == -float("inf"))
    for name, got, exact, low in zip("qkv", grads, exact_grads, low_grads):
        assert max_error(got, exact) <= error_bound(dtype, max_error(low, exact)), f"d{name}"


# The fast backward with an elementwise bias, with and without its gradient: its [queries, keys]
# tiles read transposed into S^T's start, dS^T stored as dBias^T. d = 64/128, every broadcast form
# (dbias summed over the broadcast dims), a padded row stride, causal, GQA (under a causal mask at
# d = 64 only) and MQA, ragged lengths, -inf entries and a row of them. A query head's first step
# after a ragged query tile once read its bias tile while the next step's TMA load overwrote it
# (benchmarks/NOTES.md, session 30): the GQA and MQA cases with lengths off a multiple of 64.
# (batch, seqlen, nhead_q, nhead_k, head_dim, mask, bias shape, -inf entries, dtype)
BWD_BIAS_CASES = [
    (2, 1000, 4, 4, 64, None, "hss", False, torch.bfloat16),
    (2, 776, 4, 4, 64, "t", "bhss", True, torch.float16),
    (1, 1496, 4, 2, 64, "t", "ss", False, torch.bfloat16),
    (2, 1000, 4, 4, 128, "t", "hss", True, torch.bfloat16),
    (2, 520, 8, 2, 128, None, "bhss-pad", False, torch.bfloat16),
    (3, 264, 2, 2, 128, None, "bhss", True, torch.float16),
    (2, 392, 4, 1, 128, None, "hss", False, torch.float16),
]


@pytest.mark.parametrize("with_grad", [False, True], ids=["no-dbias", "dbias"])
@pytest.mark.parametrize("case", BWD_BIAS_CASES, ids=[
    f"s{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-{c[5] or 'n'}-{c[6]}{'-inf' if c[7] else ''}-{str(c[8])[6:]}"
    for c in BWD_BIAS_CASES])
def test_backward_with_bias_against_reference(case, with_grad):
    batch, seqlen, nhead, nhead_k, head_dim, mask, form, with_inf, dtype = case
    q, k, v, dout, _ = _problem((batch, seqlen, nhead, nhead_k, head_dim, mask, dtype, "bshd"))
    # with -inf entries, row 70 sees nothing: P = 0, every gradient of it 0
    bias = _bias(form, batch, nhead, seqlen, dtype, seed=11, pad=40, inf_share=0.3 if with_inf else 0, inf_row=70,
                 magnitude=2).requires_grad_(with_grad)
    assert hopper.bwd_unsupported(check_inputs(q, k, v, mask=mask, bias=bias), False, with_grad) is None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([bias] if with_grad else [])
    grads = torch.autograd.grad(fmha.attention(*leaves[:3], mask=mask, bias=bias), leaves, dout)
    if with_inf:
        assert torch.all(grads[0][:, 70] == 0)
    kwargs = dict(mask=mask, bias=bias.detach())
    _assert_grads_match_reference(grads[:3], q, k, v, dout, kwargs)
    if with_grad:
        def reference_dbias(compute):
            inputs = [t.detach().to(compute).requires_grad_() for t in (q, k, v, bias)]
            out = fmha.reference.attention(*inputs[:3], mask=mask, bias=inputs[3], compute_dtype=compute).out
            return torch.autograd.grad(out, inputs[3], dout.to(compute))[0]

        exact, low = reference_dbias(torch.float32), reference_dbias(dtype)
        assert grads[3].shape == bias.shape and torch.isfinite(grads[3]).all()
        assert max_error(grads[3], exact) <= error_bound(dtype, max_error(low, exact))


# Group (varlen) mode on the fast path: queries and keys share one seqstart. Sequences of one
# row, ragged ones, one longer than the rest (most CTAs of the others exit at once); GQA, masks
# and ALiBi. The backward takes the fast path at d = 64/128.
VARLEN_CASES = [
    ([1, 300, 129, 1000, 64], 128, None, False, torch.bfloat16),
    ([700, 5, 1300], 64, "b", False, torch.float16),
    ([700, 5, 1300, 129], 64, None, False, torch.bfloat16),
    ([256, 511, 90], 256, "b:100,0", False, torch.bfloat16),
    ([900, 2100, 130], 64, "b:1024,0", False, torch.bfloat16),  # two consumers (see HopperFwdConfig)
    ([400, 1000, 33], 128, "t", True, torch.bfloat16),
    ([300, 0, 300, 5, 0, 129], 128, None, False, torch.float16),  # empty sequences, ties
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[
    f"{len(c[0])}seq-d{c[1]}-{c[2] or 'n'}-{'alibi' if c[3] else 'plain'}-{str(c[4])[6:]}" for c in VARLEN_CASES])
def test_group_mode_forward_against_reference(case):
    lengths, head_dim, mask, alibi, dtype = case
    batch = random_varlen(lengths, lengths, 4, 2, head_dim, head_dim, dtype=dtype, device="cuda",
                          generator=torch.Generator().manual_seed(len(lengths)))
    starts = batch.seqstart_q
    kwargs = dict(mask=mask)
    if alibi:
        kwargs["alibi_slopes"] = fmha.alibi_slopes(4, device="cuda")
    inputs = check_inputs(batch.q, batch.k, batch.v, seqstart_q=starts, seqstart_k=starts, **kwargs)
    assert hopper.fwd_unsupported(inputs) is None
    if head_dim != 256:  # the fast backward takes group mode at d = 64/128
        assert hopper.bwd_unsupported(inputs, deterministic=False) is None
    dout = torch.randn(batch.q.shape[0], 4, head_dim, device="cuda", dtype=dtype)
    leaves = [t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    result = fmha.fwd(*leaves, seqstart_q=starts, seqstart_k=starts, **kwargs, return_lse=True)
    out = fmha.attention_varlen(*leaves, starts, starts, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    assert torch.equal(result.out, out.detach())
    bounds = starts.tolist()
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        one = [t[lo:hi].unsqueeze(0) for t in (batch.q, batch.k, batch.v)]
        seq_kwargs = dict(kwargs, alibi_slopes=kwargs["alibi_slopes"][None]) if alibi else kwargs
        exact_out, exact_lse, exact_grads = _reference(*one, dout[lo:hi].unsqueeze(0), seq_kwargs, torch.float32)
        low_out, _, low_grads = _reference(*one, dout[lo:hi].unsqueeze(0), seq_kwargs, dtype)
        assert max_error(result.out[lo:hi], exact_out[0]) <= error_bound(dtype, max_error(low_out, exact_out)), b
        assert max_error(result.lse[:, lo:hi], exact_lse[0]) <= 2e-3, b
        for name, got, exact, low in zip("qkv", grads, exact_grads, low_grads):
            assert max_error(got[lo:hi], exact[0]) <= error_bound(dtype, max_error(low, exact)), f"d{name} {b}"


# The narrow fast backward (d=64/128) with a sliding window and/or ALiBi: windows narrower than a
# query tile, one side unbounded, ragged lengths, [B, H] slopes, causal ALiBi at d=64 (whose forward
# is portable: the fast backward then starts from the portable forward's LSE), a single row.
# (batch, seqlen, nhead, head_dim, mask, slopes: None, "h" [H] or "bh" [B, H], dtype)
BWD_WINDOW_ALIBI_CASES = [
    (2, 1000, 4, 128, "b:100,0", "h", torch.bfloat16),
    (1, 3000, 2, 128, "b:1024,0", None, torch.bfloat16),
    (1, 2000, 2, 64, "b:1024,0", None, torch.bfloat16),
    (2, 900, 2, 128, "b:200,70", None, torch.float16),
    (2, 777, 4, 64, "t:200,17", "h", torch.float16),
    (1, 1100, 2, 64, "t:0,0", "bh", torch.bfloat16),
    (2, 600, 4, 64, "t:-1,16", None, torch.bfloat16),
    (1, 700, 2, 128, "t:16,-1", "h", torch.float16),
    (2, 1000, 4, 128, None, "bh", torch.bfloat16),
    (2, 1000, 4, 128, "t", "h", torch.bfloat16),
    (1, 1500, 2, 64, "b", "h", torch.bfloat16),
    (2, 259, 2, 64, "b:64,63", "bh", torch.float16),
    (3, 1, 2, 64, "t:3,2", "h", torch.bfloat16),
]


@pytest.mark.parametrize("case", BWD_WINDOW_ALIBI_CASES, ids=[
    f"s{c[1]}-d{c[3]}-{c[4] or 'n'}-{f'alibi[{c[5]}]' if c[5] else 'plain'}-{str(c[6])[6:]}"
    for c in BWD_WINDOW_ALIBI_CASES])
def test_backward_with_window_or_alibi_against_reference(case):
    batch, seqlen, nhead, head_dim, mask, slopes, dtype = case
    q, k, v, dout, _ = _problem((batch, seqlen, nhead, nhead, head_dim, mask, dtype, "bshd"))
    kwargs = dict(mask=mask)
    if slopes == "h":
        kwargs["alibi_slopes"] = fmha.alibi_slopes(nhead, device="cuda")
    elif slopes == "bh":  # a different slope per batch and head
        kwargs["alibi_slopes"] = fmha.alibi_slopes(nhead, device="cuda") * torch.linspace(
            0.5, 1.5, batch, device="cuda")[:, None]
    assert hopper.bwd_unsupported(check_inputs(q, k, v, **kwargs), deterministic=False) is None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _assert_grads_match_reference(torch.autograd.grad(fmha.attention(*leaves, **kwargs), leaves, dout),
                                  q, k, v, dout, kwargs)


# The deterministic backward: dQ's adds in a fixed order over the config's copies per head.
# Ragged lengths (a virtual query tile skipped in the rotation), masks, ALiBi, a single row, fewer
# key tiles than copies (a copy never stored, which the sum skips); bitwise the same over three
# runs, and against the reference.
# (batch, seqlen, nhead, head_dim, mask, alibi, dtype)
DETERMINISTIC_CASES = [
    (2, 1000, 4, 128, None, False, torch.bfloat16),
    (1, 2049, 4, 128, "t", False, torch.float16),
    (1, 4096, 8, 128, None, False, torch.bfloat16),
    (2, 777, 2, 64, None, True, torch.bfloat16),
    (1, 1500, 4, 64, "b", False, torch.bfloat16),
    (2, 1100, 2, 128, "t", True, torch.bfloat16),
    (3, 1, 2, 128, "t", False, torch.bfloat16),
    (2, 200, 2, 64, None, False, torch.bfloat16),
    (1, 130, 2, 128, "b", False, torch.float16),
    (1, 16000, 2, 128, "t", False, torch.bfloat16),  # long causal problems' copies
    (1, 12300, 2, 64, "b", False, torch.float16),
    # head dim 256 (the wide kernel's order): more key tiles than SMs, one key tile (fewer than
    # copies), a single row
    (2, 1000, 4, 256, None, False, torch.bfloat16),
    (1, 2049, 2, 256, "t", False, torch.float16),
    (1, 9000, 2, 256, None, False, torch.bfloat16),
    (1, 9001, 1, 256, "b", False, torch.bfloat16),
    (2, 60, 2, 256, None, False, torch.float16),
    (3, 1, 2, 256, "t", False, torch.bfloat16),
]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=[
    f"b{c[0]}-s{c[1]}-d{c[3]}-{c[4] or 'n'}-{'alibi' if c[5] else 'plain'}-{str(c[6])[6:]}"
    for c in DETERMINISTIC_CASES])
def test_deterministic_backward_repeats_bitwise_and_matches_the_reference(case):
    batch, seqlen, nhead, head_dim, mask, alibi, dtype = case
    q, k, v, dout, _ = _problem((batch, seqlen, nhead, nhead, head_dim, mask, dtype, "bshd"))
    kwargs = dict(mask=mask)
    if alibi:
        kwargs["alibi_slopes"] = fmha.alibi_slopes(nhead, device="cuda")
    assert hopper.bwd_unsupported(check_inputs(q, k, v, **kwargs), deterministic=True) is None

    def grads():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fmha.attention(*leaves, deterministic=True, **kwargs), leaves, dout)

    first = grads()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    _assert_grads_match_reference(first, q, k, v, dout, kwargs)


# The forward with dropout. Exact bytes: with q = 0 every visible key weighs 1/n, and V's rows are
# one-hot (key j in column j), so O[i, j] * n * (1 - p) is 1 where CK's byte keeps (i, j), else 0.
# The seed and offset make the counter's low word carry for the later batches and heads.
DROPOUT_SEEDS = dict(seed=2**40 + 9, offset=2**32 - 200)
# (batch, head_dim = seqlen, mask, dtype, p, a zero bias [H, n, n]): thresholds above and below 128
# (the compare's top bit); with the bias, keys in tiles of 64.
DROPOUT_BYTE_CASES = [
    (2, 128, None, torch.bfloat16, 0.3, False),
    (2, 128, "t", torch.float16, 0.7, False),
    (3, 128, "b:40,7", torch.bfloat16, 0.1, False),
    (2, 256, "t", torch.bfloat16, 0.3, False),
    (2, 64, None, torch.float16, 0.2, False),
    (2, 128, "t", torch.bfloat16, 0.3, True),
]


@pytest.mark.parametrize("case", DROPOUT_BYTE_CASES, ids=[
    f"b{c[0]}-d{c[1]}-{c[2] or 'n'}-{str(c[3])[6:]}-p{c[4]}{'-bias' if c[5] else ''}" for c in DROPOUT_BYTE_CASES])
def test_forward_dropout_keeps_ck_bytes(case):
    batch, n, mask, dtype, p, with_bias = case
    nhead = 3
    q = torch.zeros(batch, n, nhead, n, device="cuda", dtype=dtype)
    v = torch.zeros_like(q)
    v[:, torch.arange(n), :, torch.arange(n)] = 1  # key j's value is column j
    kwargs = dict(mask=mask, dropout_p=p, **DROPOUT_SEEDS)
    if with_bias:
        kwargs["bias"] = torch.zeros(nhead, n, n, device="cuda", dtype=dtype)
    assert hopper.fwd_unsupported(check_inputs(q, q, v, **kwargs)) is None
    out = fmha.fwd(q, q, v, **kwargs).out
    seen = fmha.reference.visible(fmha.masks.parse_mask(mask), n, n, device="cuda")
    weight = seen.sum(1, keepdim=True) * (1 - p)  # [n, 1]: visible keys per row
    for b in range(batch):
        keep = fmha.reference.dropout_randval(DROPOUT_SEEDS["seed"], DROPOUT_SEEDS["offset"], b, nhead, n, n,
                                              device="cuda") <= int(255 * (1 - p))
        want = (keep & seen).to(torch.float32)  # [H, n, n]
        scaled = out[b].float().permute(1, 0, 2) * weight
        assert torch.all((scaled - want).abs() < 0.05), f"batch {b}"


# Dropout at real shapes against the reference: ragged lengths, GQA, masks, ALiBi. The backward
# takes the fast path at d = 64 and at d = 128 without a window, ALiBi or GQA (HopperBwdConfig's
# dropout fields), its masks made by the producer; the portable one elsewhere, with the same bytes.
# (batch, seqlen, nhead_q, nhead_k, head_dim, mask, alibi, dtype, fast backward)
DROPOUT_CASES = [
    (2, 1000, 4, 4, 128, None, False, torch.bfloat16, True),
    (2, 1000, 4, 4, 128, "t", False, torch.float16, True),
    (1, 1500, 4, 2, 128, "t", False, torch.float16, False),
    (2, 700, 2, 2, 128, "b", True, torch.bfloat16, False),
    (1, 1000, 4, 4, 128, "b:100,0", True, torch.bfloat16, False),
    (2, 700, 2, 2, 256, "b", False, torch.bfloat16, False),
    (1, 900, 2, 2, 256, "b:100,0", False, torch.float16, False),
    (2, 2100, 3, 1, 64, None, False, torch.bfloat16, True),
    (1, 1000, 4, 4, 64, "t", False, torch.bfloat16, True),
    (1, 777, 4, 2, 64, "b:100,20", True, torch.float16, True),
    (3, 70, 2, 2, 128, "t", False, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[
    f"s{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-{c[5] or 'n'}-{'alibi' if c[6] else 'plain'}-{str(c[7])[6:]}"
    for c in DROPOUT_CASES])
def test_forward_and_backward_with_dropout_against_reference(case):
    batch, seqlen, nhead, nhead_k, head_dim, mask, alibi, dtype, fast_bwd = case
    q, k, v, dout, _ = _problem((batch, seqlen, nhead, nhead_k, head_dim, mask, dtype, "bshd"))
    kwargs = dict(mask=mask, dropout_p=0.2, **DROPOUT_SEEDS)
    if alibi:
        kwargs["alibi_slopes"] = fmha.alibi_slopes(nhead, device="cuda")
    inputs = check_inputs(q, k, v, **kwargs)
    assert hopper.fwd_unsupported(inputs) is None
    assert (hopper.bwd_unsupported(inputs, deterministic=False) is None) == fast_bwd
    _assert_matches_reference(q, k, v, dout, kwargs)
