"""GPU hardening: tensors past 2^31 elements, 256k-token sequences, memory over many calls, peak
memory, concurrent streams, and bitwise determinism of features test_gpu.py does not cover.

Run on the H200 with ``python -m pytest tests/test_gpu_hardening.py`` (``-m "not huge"`` leaves out
the tests that need tens of GB and a minute or so each); without CUDA every test is skipped.
"""

import gc
import threading
from typing import NamedTuple

import pytest
import torch

import fmha
from fmha import hopper, reference
from fmha.inputs import check_inputs
from fmha.testing import error_bound, max_error, random_qkv, random_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

M32 = 0xFFFFFFFF


def _out_and_grads(fn, tensors, dout):
    """``(out, *grads)`` of ``fn(*leaves)`` for fresh leaves of ``tensors``."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


def _check(name, got, exact, low, dtype, magnitude=1.0):
    """FlashAttention's criterion, as in test_gpu.py: within twice the low-precision error."""
    bound = error_bound(dtype, max_error(low, exact), magnitude)
    err = max_error(got, exact)
    assert err <= bound, f"{name}: error {err:.3g} above the bound {bound:.3g}"


def _check_all(names, got, exact, low, dtype):
    for name, g, e, lo in zip(names, got, exact, low):
        assert torch.isfinite(g).all(), f"{name}: not finite"
        _check(name, g, e, lo, dtype)


# ---------------------------------------------------------------------------------------------
# Huge tensors: more than 2^31 elements, so any int32 offset on the way overflows.
# ---------------------------------------------------------------------------------------------

HUGE_BATCH, HUGE_SEQLEN, HUGE_HEADS, HUGE_DIM = 8300, 128, 16, 128
# Dropout (batch mode) and a causal mask (group mode) are kept apart: in a row that sees one key,
# D = dO . O is formed from O = v / (1 - p) rounded to bf16 (SPEC §6), so dS = P (dP - D) is off by
# that rounding where the exact dS is 0, an error the bf16 autograd reference does not share.
# The 256k tests combine them: their reference forms D the same way.
BATCH_KWARGS = dict(dropout_p=0.1, seed=17, offset=5)
GROUP_KWARGS = dict(mask="b")
NAMES = ["out", "lse", "dq", "dk", "dv", "dbias"]


def _randn(shape, gen):
    """bf16 normals drawn on the GPU: a CPU draw of 2e9 floats would take 9 GB and a minute."""
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def _reference(tensors, dout, dtype, **kwargs):
    """fmha.reference's ``(out, lse, dq, dk, dv, dbias)`` on a small batch-mode slice (no dbias
    when the bias, ``tensors[3]``, is None)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors if t is not None]
    res = reference.attention(*leaves[:3], bias=leaves[3] if len(leaves) > 3 else None, compute_dtype=dtype, **kwargs)
    return (res.out, res.lse, *torch.autograd.grad(res.out, leaves, dout.to(dtype)))


def d_scale(dout, out):
    """max |D| with D = dO . O per row: dS = P (dP - D) takes D from the stored bf16 O (SPEC §6,
    as CK and FlashAttention do), so where P is near 1 (rows that see few keys) dbias = dS carries
    a rounding error at D's scale, which the low-precision reference (exact cancellation) lacks."""
    return (dout.double() * out.double()).sum(-1).abs().max().item()


def _check_slice(label, got, tensors, dout, batch_index, **kwargs):
    """Compare one batch element (or sequence) with the reference run on that slice alone; the
    reference numbers its only batch 0, so dropout's offset moves by ``batch_index * 64`` per head
    to give that batch's bytes (SPEC §5: the counter base is ``offset + (b * H + h) * 64``)."""
    if "offset" in kwargs:
        kwargs["offset"] += batch_index * HUGE_HEADS * 64
    exact = _reference(tensors, dout, torch.float32, **kwargs)
    low = _reference(tensors, dout, torch.bfloat16, **kwargs)
    names = [f"{label}: {n}" for n in NAMES]
    _check_all(names[:5], got[:5], exact[:5], low[:5], torch.bfloat16)
    _check(names[5], got[5], exact[5], low[5], torch.bfloat16, magnitude=d_scale(dout, exact[0]))


@pytest.mark.huge
@pytest.mark.parametrize("deterministic", [False, True])
def test_huge_batch_mode(deterministic):
    """8300 x 128 tokens x 16 heads x d128, dropout, a [B, H, S, S] bias with its gradient: q, k,
    v, dout, out, the grads, the bias and dbias each hold 2.18e9 elements. Peak about 61 GB (deterministic 52 GB): q, k, v, dout, bias 21.8,
    out 4.4, dq/dk/dv 13.1, the atomic fp32 dQ accumulator 8.7, the fp32 dS buffer 8.7, dbias 4.4."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (HUGE_BATCH, HUGE_SEQLEN, HUGE_HEADS, HUGE_DIM)
    q, k, v, dout = (_randn(shape, gen) for _ in range(4))
    bias = _randn((HUGE_BATCH, HUGE_HEADS, HUGE_SEQLEN, HUGE_SEQLEN), gen)
    assert q.numel() > 2**31 and bias.numel() > 2**31
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    res = fmha.attention(*leaves[:3], bias=leaves[3], return_lse=True, deterministic=deterministic,
                         **BATCH_KWARGS)
    grads = torch.autograd.grad(res.out, leaves, dout)
    results = (res.out.detach(), res.lse, *grads)
    samples = {}
    for b in (0, HUGE_BATCH // 2, HUGE_BATCH - 1):
        *inputs, dout_b = (t[b : b + 1].detach().clone() for t in (q, k, v, bias, dout))
        samples[b] = inputs, dout_b, [t[b : b + 1].clone() for t in results]
    # Free the 60 GB before the references (and before a failure keeps this frame alive).
    del q, k, v, bias, dout, leaves, res, grads, results
    torch.cuda.empty_cache()
    for b, (tensors, dout_b, got) in samples.items():
        _check_slice(f"batch {b}", got, tensors, dout_b, b, **BATCH_KWARGS)


@pytest.mark.huge
@pytest.mark.parametrize("deterministic", [False, True])
def test_huge_batch_mode_plain(deterministic):
    """The same 2.18e9-element q, k, v without bias or dropout: on Hopper the fast path's kernels
    run it. Peak about 44 GB: q, k, v, dout 17.4, out 4.4, dq/dk/dv 13.1, the fp32 dQ accumulator
    8.7 (deterministic: its four copies, 34.8, so about 70 GB)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    shape = (HUGE_BATCH, HUGE_SEQLEN, HUGE_HEADS, HUGE_DIM)
    q, k, v, dout = (_randn(shape, gen) for _ in range(4))
    assert q.numel() > 2**31
    leaves = [t.requires_grad_() for t in (q, k, v)]
    res = fmha.attention(*leaves, return_lse=True, deterministic=deterministic)
    grads = torch.autograd.grad(res.out, leaves, dout)
    results = (res.out.detach(), res.lse, *grads)
    samples = {}
    for b in (0, HUGE_BATCH // 2, HUGE_BATCH - 1):
        *inputs, dout_b = (t[b : b + 1].detach().clone() for t in (q, k, v, dout))
        samples[b] = inputs, dout_b, [t[b : b + 1].clone() for t in results]
    del q, k, v, dout, leaves, res, grads, results
    torch.cuda.empty_cache()
    for b, (tensors, dout_b, got) in samples.items():
        exact, low = (_reference([*tensors, None], dout_b, dtype) for dtype in (torch.float32, torch.bfloat16))
        _check_all([f"batch {b}: {n}" for n in NAMES[:5]], got, exact[:5], low[:5], torch.bfloat16)


@pytest.mark.huge
@pytest.mark.parametrize("deterministic", [False, True])
def test_huge_group_mode(deterministic):
    """8300 sequences of alternately 100 and 156 tokens (1,062,400 in all) x 16 heads x d128, causal,
    an [H, total, 156] bias with its gradient: q etc. hold 2.18e9 elements, the bias 2.65e9. Peak about 65 GB: q, k, v, dout 17.4,
    bias 5.3, out 4.4, dq/dk/dv 13.1, the fp32 dQ accumulator 8.7, dS 10.6, dbias 5.3."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.tensor([100, 156], dtype=torch.int32, device="cuda").repeat(HUGE_BATCH // 2)
    seqstart = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    total = int(seqstart[-1])
    q, k, v, dout = (_randn((total, HUGE_HEADS, HUGE_DIM), gen) for _ in range(4))
    bias = _randn((HUGE_HEADS, total, 156), gen)
    assert q.numel() > 2**31 and bias.numel() > 2**31
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    res = fmha.attention_varlen(*leaves[:3], seqstart, seqstart, bias=leaves[3], return_lse=True,
                                deterministic=deterministic, **GROUP_KWARGS)
    out, lse = res.out.detach(), res.lse
    dq, dk, dv, dbias = torch.autograd.grad(res.out, leaves, dout)
    starts = seqstart.tolist()
    samples = {}
    for b in (0, HUGE_BATCH // 2, HUGE_BATCH - 2, HUGE_BATCH - 1):
        s0, s1 = starts[b], starts[b + 1]
        n = s1 - s0
        # Each sequence becomes batch 0 of a batch-mode problem for the reference.
        inputs = [t[s0:s1].detach()[None].clone() for t in (q, k, v)]
        inputs.append(bias[:, s0:s1, :n].detach()[None].clone())
        dout_b = dout[s0:s1][None].clone()
        got = [out[s0:s1], lse[:, s0:s1], dq[s0:s1], dk[s0:s1], dv[s0:s1], dbias[:, s0:s1, :n]]
        # Keys past a sequence's length (up to the bias's 156 columns) get no bias gradient.
        beyond = dbias[:, s0:s1, n:].any().item()
        samples[b] = inputs, dout_b, [t[None].clone() for t in got], beyond
    del q, k, v, bias, dout, leaves, res, out, lse, dq, dk, dv, dbias
    torch.cuda.empty_cache()
    for b, (tensors, dout_b, got, beyond) in samples.items():
        assert not beyond, f"sequence {b}: dbias nonzero past the sequence's keys"
        _check_slice(f"sequence {b}", got, tensors, dout_b, b, **GROUP_KWARGS)


# ---------------------------------------------------------------------------------------------
# One head of a 256k-token causal sequence: sq * sk = 6.9e10 score positions.
# ---------------------------------------------------------------------------------------------

LONG = 262144


class RowsReference(NamedTuple):
    out: torch.Tensor  # [len(rows), Dv] float32
    lse: torch.Tensor  # [len(rows)]
    dq: torch.Tensor  # [len(rows), Dq]
    dk: torch.Tensor  # [S, Dq]: the given rows' share (all of dK when the rows cover the sequence)
    dv: torch.Tensor  # [S, Dv]


def causal_rows_reference(q, k, v, dout, rows, *, scale, compute_dtype=torch.float32, keep=None, chunk=1024):
    """Causal attention (sq == sk, so both corners agree: row i sees keys j <= i) of one head
    ``q [S, Dq]``, ``k [S, Dq]``, ``v [S, Dv]`` for the sorted query rows ``rows`` (a CPU int64
    tensor), forming only ``[chunk, S]`` score blocks. Products run in ``compute_dtype`` and the
    softmax in float32, as in fmha.reference. ``keep(rows)`` gives the dropout factors (0 or
    1 / (1 - p)) of those rows against every key, or None. Gradients follow SPEC §6:
    dP = dO V^T (times the dropout factors), D = dO . O, dS = P (dP - D), dQ = scale dS K,
    dK = scale dS^T Q, dV = (P, dropped)^T dO."""
    f32 = torch.float32
    q, k, v, dout = (t.to(compute_dtype) for t in (q, k, v, dout))
    keys = torch.arange(q.shape[0], device=q.device)
    out = torch.empty(len(rows), v.shape[1], dtype=f32, device=q.device)
    lse = torch.empty(len(rows), dtype=f32, device=q.device)
    dq = torch.empty(len(rows), q.shape[1], dtype=f32, device=q.device)
    dk = torch.zeros(q.shape, dtype=f32, device=q.device)
    dv = torch.zeros(v.shape, dtype=f32, device=q.device)
    for c0 in range(0, len(rows), chunk):
        rows_c = rows[c0 : c0 + chunk]
        done = slice(c0, c0 + len(rows_c))
        r1 = int(rows_c[-1]) + 1  # no row of the chunk sees a key past its last row
        idx = rows_c.to(q.device)
        qc, doc, kc, vc = q[idx], dout[idx], k[:r1], v[:r1]
        s = (qc @ kc.T).mul_(scale).float()
        s.masked_fill_(keys[None, :r1] > idx[:, None], float("-inf"))
        lse[done] = torch.logsumexp(s, dim=-1)
        p = s.sub_(lse[done, None]).exp_()
        factor = None if keep is None else keep(rows_c)[:, :r1]
        dropped = p if factor is None else p * factor
        out[done] = (dropped.to(compute_dtype) @ vc).float()
        dp = (doc @ vc.T).float()
        if factor is not None:
            dp.mul_(factor)
        delta = (doc.float() * out[done]).sum(-1)
        ds = dp.sub_(delta[:, None]).mul_(p).to(compute_dtype).mul_(scale)
        dq[done] = (ds @ kc).float()
        dk[:r1] += (ds.T @ qc).float()
        dv[:r1] += (dropped.to(compute_dtype).T @ doc).float()
    return RowsReference(out, lse, dq, dk, dv)


def dropout_bytes(seed, offset, rows, seqlen_k):
    """reference.dropout_randval's bytes of batch 0, head 0, for the query rows ``rows`` (an int64
    tensor) only: the whole [sq, sk] array of a 256k sequence would be 68 GB. Same formulas."""
    i = rows.to(torch.int64)[:, None]
    j = torch.arange(seqlen_k, device=rows.device, dtype=torch.int64)[None, :]
    row_tile, ii = i // 32, i % 32
    col_tile, jj = j // 32, j % 32
    lane = 32 * ((ii // 8) % 2) + jj
    r = 8 * (ii // 16) + ii % 8
    lo = (offset & M32) + lane
    hi = ((offset >> 32) + (lo >> 32)) & M32
    words = reference.philox4x32_7((seed, seed >> 32), (lo & M32, hi, row_tile, col_tile))
    word = torch.stack(torch.broadcast_tensors(*words))
    picked = torch.gather(word, 0, (r // 4).expand(len(rows), seqlen_k)[None])[0]
    return ((picked >> (8 * (r % 4))) & 0xFF).to(torch.uint8)


def dropout_keep(seed, offset, p, seqlen_k, device):
    """``keep(rows)`` for causal_rows_reference: 1 / (1 - p) where the byte keeps, else 0."""
    threshold = int(255 * (1.0 - p))
    return lambda rows: (dropout_bytes(seed, offset, rows.to(device), seqlen_k) <= threshold).float() / (1 - p)


def test_chunked_reference_matches_fmha_reference(device):
    """The 256k tests' oracle against fmha.reference (float64) at 300 tokens, with and without dropout."""
    gen = torch.Generator().manual_seed(6)
    s, scale = 300, 0.3
    q, k, v = random_qkv(1, s, s, 1, 1, 16, 24, dtype=torch.float64, device=device, generator=gen)
    dout = torch.randn(1, s, 1, 24, generator=gen, dtype=torch.float64).to(device)
    flat = [t[0, :, 0] for t in (q, k, v, dout)]
    drop = dict(dropout_p=0.3, seed=2**40 + 9, offset=2**32 - 40)  # the offset's low word carries
    sampled = torch.tensor([0, 31, 32, 100, *range(s - 40, s)])
    for kwargs, rows in (({}, torch.arange(s)), (drop, sampled)):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        want = reference.attention(*leaves, mask="b", scale=scale, **kwargs)
        want_dq, want_dk, want_dv = torch.autograd.grad(want.out, leaves, dout)
        keep = dropout_keep(drop["seed"], drop["offset"], drop["dropout_p"], s, device) if kwargs else None
        got = causal_rows_reference(*flat, rows, scale=scale, keep=keep, chunk=64)
        idx = rows.to(device)
        tail = slice(s - 40 if kwargs else 0, None)  # keys whose every query row is in `rows`
        pairs = {"out": (got.out, want.out[0, idx, 0]), "lse": (got.lse, want.lse[0, 0, idx]),
                 "dq": (got.dq, want_dq[0, idx, 0]), "dk": (got.dk[tail], want_dk[0, tail, 0]),
                 "dv": (got.dv[tail], want_dv[0, tail, 0])}
        for name, (g, w) in pairs.items():
            assert max_error(g, w) < 1e-4, f"{name}, {'with' if kwargs else 'without'} dropout"
        if kwargs:
            assert torch.equal(dropout_bytes(drop["seed"], drop["offset"], idx, s), want.randval[0, 0, idx])


@pytest.fixture(scope="module")
def long_causal():
    """One head of 262144 tokens (bf16, d128) and its chunked references over every row, products
    in float32 and in bf16: about 5e13 fp32 FLOPs (seconds on the H200) and under 10 GB."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    tensors = [_randn((1, LONG, 1, 128), gen) for _ in range(4)]
    flat = [t[0, :, 0] for t in tensors]
    rows = torch.arange(LONG)
    exact = causal_rows_reference(*flat, rows, scale=128**-0.5)
    low = causal_rows_reference(*flat, rows, scale=128**-0.5, compute_dtype=torch.bfloat16)
    return tensors, exact, low


def _long_causal_fmha(q, k, v, dout, **kwargs):
    """fmha's ``(out, lse, dq, dk, dv)`` on the 256k problem, flattened to its one head."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    res = fmha.attention(*leaves, mask="b", return_lse=True, **kwargs)
    grads = torch.autograd.grad(res.out, leaves, dout)
    return (res.out.detach()[0, :, 0], res.lse[0, 0], *(g[0, :, 0] for g in grads))


@pytest.mark.huge
@pytest.mark.parametrize("deterministic", [False, True])
def test_256k_causal_every_row(long_causal, deterministic):
    """Every row and key of the 256k causal head: out, lse, dq, dk and dv against the chunked reference."""
    tensors, exact, low = long_causal
    got = _long_causal_fmha(*tensors, deterministic=deterministic)
    _check_all(["out", "lse", "dq", "dk", "dv"], got, exact, low, torch.bfloat16)


@pytest.mark.huge
def test_256k_causal_dropout(long_causal):
    """Dropout at row and column tiles up to 8191: out, lse and dq of sampled rows (the first and
    last, tile edges, the middle, the last 64), and dk/dv of the last 64 keys, which only those
    last rows reach. LSE is taken before dropout: every row equals the no-dropout reference."""
    tensors, exact_plain, low_plain = long_causal
    drop = dict(dropout_p=0.1, seed=2**40 + 1, offset=2**32 - 40)
    out, lse, dq, dk, dv = _long_causal_fmha(*tensors, **drop)
    for name, t in zip(["out", "lse", "dq", "dk", "dv"], (out, lse, dq, dk, dv)):
        assert torch.isfinite(t).all(), f"{name}: not finite"
    _check("lse, every row, against no dropout", lse, exact_plain.lse, low_plain.lse, torch.bfloat16)
    rows = torch.tensor([0, 1, 31, 32, 100003, LONG // 2 - 1, LONG // 2, *range(LONG - 64, LONG)])
    keep = dropout_keep(drop["seed"], drop["offset"], drop["dropout_p"], LONG, out.device)
    flat = [t[0, :, 0] for t in tensors]
    exact = causal_rows_reference(*flat, rows, scale=128**-0.5, keep=keep)
    low = causal_rows_reference(*flat, rows, scale=128**-0.5, keep=keep, compute_dtype=torch.bfloat16)
    idx, tail = rows.to(out.device), slice(LONG - 64, None)
    # Rows 0 and 1 see one or two keys: their out is about v / (1 - p), up to ~4, where one bf16
    # unit is 0.03, more than the sampled rows' low-precision error may show.
    _check("out", out[idx], exact.out, low.out, torch.bfloat16, magnitude=exact.out.abs().max().item())
    _check_all(["lse", "dq", "dk (last 64 keys)", "dv (last 64 keys)"],
               [lse[idx], dq[idx], dk[tail], dv[tail]],
               [exact.lse, exact.dq, exact.dk[tail], exact.dv[tail]],
               [low.lse, low.dq, low.dk[tail], low.dv[tail]], torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Memory over many calls, peak memory per feature.
# ---------------------------------------------------------------------------------------------


def test_memory_does_not_grow_over_1000_calls():
    gen = torch.Generator().manual_seed(2)
    q, k, v = random_qkv(2, 257, 257, 4, 4, 64, 64, dtype=torch.bfloat16, device="cuda", generator=gen)
    bias = torch.randn(4, 257, 257, generator=gen).to("cuda", torch.bfloat16)
    dout = torch.randn(2, 257, 4, 64, generator=gen).to("cuda", torch.bfloat16)

    def step():
        # No seed: every call draws its own, as a training loop's would.
        _out_and_grads(lambda q, k, v, b: fmha.attention(q, k, v, bias=b, mask="b", dropout_p=0.1),
                       (q, k, v, bias), dout)

    def allocated():
        # Garbage a cycle holds until Python's collector runs is not growth; memory still held
        # after a collection is.
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    for _ in range(3):
        step()
    before = allocated()
    for _ in range(1000):
        step()
    after = allocated()
    assert after == before, f"{after - before} bytes more allocated after 1000 calls"


def _peak_case(case, gen):
    """``(fn, tensors, allowance)``: the call, its inputs, and the bytes allowed beyond the ratio."""
    dtype = torch.bfloat16
    if case == "varlen_padded":
        batch = random_varlen([700, 1, 1024, 333], [1024, 5, 900, 333], 8, 8, 128, 128,
                              pad_q=[768, 8, 1024, 400], pad_k=[1024, 64, 1000, 333], dtype=dtype,
                              device="cuda", generator=gen)
        return (lambda q, k, v: fmha.attention_varlen(q, k, v, **batch.kwargs(), mask="b")), (
            batch.q, batch.k, batch.v), 0
    q, k, v = random_qkv(2, 1024, 1024, 8, 2 if case == "gqa" else 8, 128, 128, dtype=dtype, device="cuda",
                         generator=gen)
    if case == "bias":
        bias = torch.randn(1024, 1024, generator=gen).to("cuda", dtype)
        # The caller asked for dbias: the README's fp32 dS buffer [B, Hq, Sq, Sk], its fp32 sum
        # to the bias's [Sq, Sk] shape, and dbias itself.
        allowance = 4 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] + 4 * bias.numel() + bias.numel() * 2
        return (lambda q, k, v, b: fmha.attention(q, k, v, bias=b, mask="b")), (q, k, v, bias), allowance
    kwargs = {"plain": {}, "gqa": dict(mask="b"), "deterministic": dict(deterministic=True),
              "dropout": dict(mask="b", dropout_p=0.1, seed=1, offset=0)}[case]
    allowance = 0
    if case == "deterministic" and hopper.bwd_unsupported(check_inputs(q, k, v), deterministic=True) is None:
        # the fast path's documented workspace: an fp32 dQ accumulator per copy (the atomic mode's
        # one is within the ratio)
        allowance = 4 * q.numel() * (hopper._chains(check_inputs(q, k, v), deterministic=True) - 1)
    return (lambda q, k, v: fmha.attention(q, k, v, **kwargs)), (q, k, v), allowance


@pytest.mark.parametrize("case", ["plain", "deterministic", "dropout", "bias", "gqa", "varlen_padded"])
def test_peak_memory_against_tensor_sizes(case):
    """Forward + backward allocate out, dq/dk/dv, the atomic mode's fp32 dQ accumulator (twice q
    at d128) and row vectors: 1.5x the inputs (q, k, v, dout, bias), as much deterministic beside
    the fast path's further dQ copies, 1.8x with GQA 4:1 (where dq and the accumulator follow q
    alone). Any [B, H, Sq, Sk] buffer beyond
    the documented dbias one adds 1x (uint8) to 4x (fp32) and fails."""
    fn, tensors, allowance = _peak_case(case, torch.Generator().manual_seed(4))
    dout = torch.randn_like(tensors[0])  # head_dim_v == head_dim_q in every case
    _out_and_grads(fn, tensors, dout)  # compiles outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _out_and_grads(fn, tensors, dout)
    torch.cuda.synchronize()
    inputs = sum(t.numel() * t.element_size() for t in (*tensors, dout))
    ratio = (torch.cuda.max_memory_allocated() - base - allowance) / inputs
    assert ratio < 2.0, f"{case}: peak extra memory {ratio:.2f}x the {inputs} bytes of inputs (bound 2x)"


# ---------------------------------------------------------------------------------------------
# Streams, threads and determinism.
# ---------------------------------------------------------------------------------------------


def _causal_dropout_gqa8_dq96_dv160(gen):
    """Batch mode, GQA 8:1, head dims 96 (q, k) and 160 (v), causal, dropout, bf16."""
    q, k, v = random_qkv(2, 777, 1031, 8, 1, 96, 160, dtype=torch.bfloat16, device="cuda", generator=gen)
    dout = torch.randn(2, 777, 8, 160, generator=gen).to("cuda", torch.bfloat16)

    def fn(q, k, v):
        return fmha.attention(q, k, v, mask="b", dropout_p=0.1, seed=3, offset=4, deterministic=True)
    return lambda: _out_and_grads(fn, (q, k, v), dout)


def _varlen_gqa_bias_dropout(gen):
    """Group mode with padding, GQA 4:1, a [Hq, total_q, max_seqlen_k] fp32 bias, window, dropout, bf16."""
    batch = random_varlen([300, 17, 900, 64], [512, 33, 700, 1], 8, 2, 64, 64, pad_q=[320, 32, 900, 64],
                          pad_k=[512, 40, 720, 8], dtype=torch.bfloat16, device="cuda", generator=gen)
    bias = torch.randn(8, batch.q.shape[0], 700, generator=gen).to("cuda")
    dout = torch.randn(batch.q.shape[0], 8, 64, generator=gen).to("cuda", torch.bfloat16)

    def fn(q, k, v, b):
        return fmha.attention_varlen(q, k, v, **batch.kwargs(), bias=b, mask="b:128,0", dropout_p=0.2, seed=5,
                                     offset=6, deterministic=True)
    return lambda: _out_and_grads(fn, (batch.q, batch.k, batch.v, bias), dout)


def _fp32_window_bias_dropout(gen):
    """fp32 inputs, GQA 2:1, a broadcast [Sq, Sk] bias, sliding window, dropout."""
    q, k, v = random_qkv(2, 333, 517, 4, 2, 64, 64, dtype=torch.float32, device="cuda", generator=gen)
    bias = torch.randn(333, 517, generator=gen).to("cuda")
    dout = torch.randn(2, 333, 4, 64, generator=gen).to("cuda")

    def fn(q, k, v, b):
        return fmha.attention(q, k, v, bias=b, mask="t:64,16", dropout_p=0.1, seed=7, offset=8, deterministic=True)
    return lambda: _out_and_grads(fn, (q, k, v, bias), dout)


DETERMINISTIC_CASES = {
    "causal_dropout_gqa8_dq96_dv160": _causal_dropout_gqa8_dq96_dv160,
    "varlen_gqa_bias_dropout": _varlen_gqa_bias_dropout,
    "fp32_window_bias_dropout": _fp32_window_bias_dropout,
}


@pytest.mark.parametrize("case", list(DETERMINISTIC_CASES))
def test_deterministic_is_bitwise_for_more_features(case):
    run = DETERMINISTIC_CASES[case](torch.Generator().manual_seed(5))
    first = run()
    assert all(torch.isfinite(t).all() for t in first)  # NaN would make torch.equal fail anyway
    for i in range(9):
        assert all(torch.equal(a, b) for a, b in zip(first, run())), f"run {i + 2} differs from the first"


def test_two_threads_on_two_streams():
    """Each thread runs its own problem on its own stream, 20 times, while the other does too;
    every result must equal, bit for bit, the same call made alone on the default stream."""
    gen = torch.Generator().manual_seed(7)
    jobs = {name: DETERMINISTIC_CASES[name](gen) for name in ("causal_dropout_gqa8_dq96_dv160",
                                                              "varlen_gqa_bias_dropout")}
    expected = {name: job() for name, job in jobs.items()}  # also compiles, before the threads
    torch.cuda.synchronize()
    barrier = threading.Barrier(len(jobs), timeout=120)
    errors = []

    def worker(name):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                barrier.wait()
                for i in range(20):
                    got = jobs[name]()
                    if not all(torch.equal(a, b) for a, b in zip(got, expected[name])):
                        raise AssertionError(f"{name}: run {i + 1} on its own stream differs from the default stream's")
        except Exception as error:  # re-raised in the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish in 10 minutes"


def test_use_deterministic_algorithms_default_path_is_bitwise():
    gen = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(2, 777, 1031, 8, 2, 128, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
    bias = torch.randn(8, 777, 1031, generator=gen).to("cuda", torch.bfloat16)
    dout = torch.randn(2, 777, 8, 128, generator=gen).to("cuda", torch.bfloat16)

    def grads(**kwargs):
        return _out_and_grads(lambda q, k, v, b: fmha.attention(q, k, v, bias=b, **kwargs), (q, k, v, bias), dout)[1:]

    explicit = grads(deterministic=True)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [grads() for _ in range(10)]
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    # Equal to deterministic=True as well: the mode selected the fixed-order dQ (atomic dQ differs in
    # its last bits), and every row was written (the mode fills torch.empty with NaN).
    for i, run in enumerate(runs):
        assert all(torch.equal(a, b) for a, b in zip(run, explicit)), f"run {i + 1} differs from deterministic=True"


@pytest.mark.parametrize("path", ["fast", "portable"])
def test_cuda_graph_replays_match_eager_calls(path, monkeypatch):
    """A forward and backward captured in a CUDA graph (every launch through fmha.launch's cached
    launchers) and replayed on new inputs copied into its static tensors give what eager calls
    give on those inputs: the same output and dK/dV, dQ within its atomic adds' reordering
    (bitwise everywhere on the portable path, which runs deterministic here)."""
    if path == "portable":
        monkeypatch.setenv("FMHA_PORTABLE", "1")
    deterministic = path == "portable"
    gen = torch.Generator().manual_seed(5)

    def fresh():
        q, k, v = random_qkv(2, 1024, 1024, 8, 2, 128, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
        return q, k, v, torch.randn(2, 1024, 8, 128, generator=gen).to("cuda", torch.bfloat16)

    def step(q, k, v, dout):
        out = fmha.attention(q, k, v, mask="b", deterministic=deterministic)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    static = [t.detach().requires_grad_(i < 3) for i, t in enumerate(fresh())]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) on a side stream, as torch's capture asks
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    for trial in range(3):
        inputs = fresh()
        with torch.no_grad():
            for buffer, value in zip(static, inputs):
                buffer.copy_(value)
        graph.replay()
        eager = step(*(t.detach().requires_grad_(i < 3) for i, t in enumerate(inputs)))
        for name, got, want in zip(("out", "dq", "dk", "dv"), captured, eager):
            if name == "dq" and not deterministic:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())
            else:
                assert torch.equal(got, want), f"{path} replay {trial}: {name} differs from an eager call"
