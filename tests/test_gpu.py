"""Checks that only mean something on a GPU: bitwise determinism, peak memory, real shapes.

Run on the H200 with ``python -m pytest tests/test_gpu.py``; without CUDA they are skipped (CI
covers the same semantics through the interpreter in test_fwd.py and test_bwd.py).
"""

import pytest
import torch

import fmha
from fmha.testing import error_bound, max_error, random_qkv, random_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FEATURES = {
    "plain": {},
    "causal": dict(mask="b"),
    "window": dict(mask="t:200,17"),
    "alibi": dict(mask="b", alibi_slopes=fmha.alibi_slopes(8, device="cuda") if torch.cuda.is_available() else None),
    "dropout": dict(mask="t", dropout_p=0.2, seed=11, offset=3),
}


def _grads(q, k, v, bias, dout, **kwargs):
    leaves = [t.detach().requires_grad_() for t in (q, k, v) + ((bias,) if bias is not None else ())]
    out = fmha.attention(*leaves[:3], bias=leaves[3] if bias is not None else None, **kwargs)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("with_bias", [False, True])
def test_deterministic_is_bitwise_over_ten_runs(feature, with_bias):
    g = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(2, 777, 1031, 8, 2, 128, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    bias = torch.randn(8, 777, 1031, generator=g).to("cuda", torch.bfloat16) if with_bias else None
    dout = torch.randn(2, 777, 8, 128, generator=g).to("cuda", torch.bfloat16)
    first = _grads(q, k, v, bias, dout, deterministic=True, **FEATURES[feature])
    for _ in range(9):
        again = _grads(q, k, v, bias, dout, deterministic=True, **FEATURES[feature])
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_deterministic_varlen_gqa_is_bitwise():
    batch = random_varlen([300, 17, 900, 64], [512, 33, 700, 1], 8, 1, 64, 64, pad_q=[320, 32, 900, 64],
                          pad_k=[512, 40, 720, 8], dtype=torch.float16, device="cuda",
                          generator=torch.Generator().manual_seed(1))
    dout = torch.randn(batch.q.shape[0], 8, 64, device="cuda", dtype=torch.float16)

    def run():
        leaves = [t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
        out = fmha.attention_varlen(*leaves, batch.seqstart_q, batch.seqstart_k,
                                    seqstart_padded_q=batch.seqstart_padded_q,
                                    seqstart_padded_k=batch.seqstart_padded_k, mask="b:64,0",
                                    deterministic=True)
        return torch.autograd.grad(out, leaves, dout)

    first = run()
    assert all(torch.isfinite(g).all() for g in first)
    for _ in range(9):
        assert all(torch.equal(a, b) for a, b in zip(first, run()))


@pytest.mark.parametrize("deterministic", [False, True])
def test_no_seqlen_squared_buffers(deterministic):
    """Forward + backward at s=8192, h=1: an fp32 [s, s] buffer alone would be 256 MiB."""
    q, k, v = random_qkv(1, 8192, 8192, 1, 1, 64, 64, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _grads(q, k, v, None, dout, mask="b", dropout_p=0.1, seed=1, offset=0, deterministic=deterministic)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    assert extra < 4 * inputs  # out, lse, D, grads and the fp32 dQ accumulator: a few input sizes


@pytest.mark.parametrize("feature", list(FEATURES))
def test_backward_real_shapes(feature):
    q, k, v = random_qkv(2, 1000, 1500, 8, 2, 128, 128, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    kwargs = FEATURES[feature]
    got = _grads(q, k, v, None, dout, **kwargs)

    def ref(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fmha.reference.attention(*leaves, compute_dtype=dtype, **kwargs).out
        return torch.autograd.grad(out, leaves, dout.to(dtype))

    exact, low = ref(torch.float32), ref(torch.bfloat16)
    for g, e, lo in zip(got, exact, low):
        assert max_error(g, e) <= error_bound(torch.bfloat16, max_error(lo, e))
