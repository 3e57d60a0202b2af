"""Extreme values: huge logits, LSE below fp32's exp range, all -inf bias rows, NaN and inf inputs.

The documented behaviour (README, "Numerics"): fmha is finite wherever the float64 reference is,
and within FlashAttention's criterion there; NaN appears only where the reference has NaN. Two
known gaps are strict xfails, so that fixing them shows.
"""

import pytest
import torch

import fmha
from fmha import reference
from fmha.testing import error_bound, max_error, random_qkv

# NaN/inf inputs make the interpreter's numpy warn about the very values under test.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def forward_and_grads(q, k, v, bias=None, deterministic=False, **kwargs):
    """fmha's (out, lse) and gradients of q, k, v (and bias) for a fixed dout."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + (
        [bias.detach().requires_grad_()] if bias is not None else [])
    res = fmha.attention(*leaves[:3], bias=leaves[3] if bias is not None else None, return_lse=True,
                         deterministic=deterministic, **kwargs)
    dout = torch.ones_like(res.out)
    return res.out, res.lse, torch.autograd.grad(res.out, leaves, dout)


def reference_forward_and_grads(q, k, v, bias=None, dtype=torch.float64, **kwargs):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)] + (
        [bias.detach().to(dtype).requires_grad_()] if bias is not None else [])
    res = reference.attention(*leaves[:3], bias=leaves[3] if bias is not None else None, compute_dtype=dtype,
                              **kwargs)
    dout = torch.ones_like(res.out)
    return res.out, res.lse, torch.autograd.grad(res.out, leaves, dout)


def assert_matches_where_finite(got, exact, low, dtype, name):
    """NaN only where the reference has NaN; where it is finite, fmha is finite and within bound."""
    got = got.detach().cpu().double()
    assert not (torch.isnan(got) & ~torch.isnan(exact)).any(), f"{name}: NaN where the reference has none"
    finite = torch.isfinite(exact)
    assert torch.isfinite(got[finite]).all(), f"{name}: non-finite where the reference is finite"
    if finite.any():
        magnitude = exact[finite].abs().max().item()
        bound = error_bound(dtype, max_error(low[finite].double(), exact[finite]), magnitude)
        assert max_error(got[finite], exact[finite]) <= bound, name


def check(q, k, v, bias=None, deterministic=False, **kwargs):
    got_out, got_lse, got_grads = forward_and_grads(q, k, v, bias, deterministic, **kwargs)
    ex_out, ex_lse, ex_grads = reference_forward_and_grads(q, k, v, bias, **kwargs)
    lo_out, lo_lse, lo_grads = reference_forward_and_grads(q, k, v, bias, dtype=q.dtype, **kwargs)
    assert_matches_where_finite(got_out, ex_out, lo_out, q.dtype, "out")
    assert_matches_where_finite(got_lse, ex_lse, lo_lse, torch.float32, "lse")
    for name, g, e, lo in zip(["dq", "dk", "dv", "dbias"], got_grads, ex_grads, lo_grads):
        assert_matches_where_finite(g, e, lo, q.dtype, name)
    return got_out, got_lse, got_grads


FP32_HUGE_LOGITS = pytest.mark.xfail(strict=True, reason=(
    "known: fp32 dV error 2.4x the fp32 reference's at logits near 1e4; the kernels form "
    "exp2(s*scale*log2e - lse*log2e) from two terms near 1.4e4 (fp32 ulp 1e-3). Fix pending a GPU check"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, pytest.param(torch.float32, marks=FP32_HUGE_LOGITS)])
def test_logits_of_magnitude_1e4(dtype, device, gen):
    q, k, v = random_qkv(1, 33, 40, 2, 1, 16, 16, dtype=torch.float32, generator=gen)
    # scale * q.k reaches about 1e4: softmax is one-hot up to rounding.
    q, k = (q * 50).to(dtype), (k * 50).to(dtype)
    out, lse, _ = check(q.to(device), k.to(device), v.to(dtype).to(device), scale=1.0, mask="b")
    assert lse.abs().max() > 1e3


def test_rows_whose_lse_is_below_fp32_exp_range(device, gen):
    q, k, v = random_qkv(1, 24, 30, 2, 2, 16, 16, dtype=torch.float32, device=device, generator=gen)
    bias = torch.zeros(2, 24, 30)
    bias[:, ::2] = -200.0  # exp(-200) underflows fp32; LSE about -200 on even rows
    _, lse, _ = check(q, k, v, bias.to(device))
    assert lse[0, :, ::2].max() < -88


@pytest.mark.parametrize("deterministic", [False, True])
def test_all_minus_inf_bias_rows(deterministic, device, gen):
    q, k, v = random_qkv(2, 20, 26, 2, 1, 16, 16, dtype=torch.float16, device=device, generator=gen)
    bias = torch.randn(2, 2, 20, 26, generator=gen)
    bias[0, 1, 3] = float("-inf")  # one row sees nothing
    bias[1, :, 7:9] = float("-inf")
    bias[1, 0, 10, :5] = float("-inf")  # a row with some keys gone
    out, lse, grads = check(q, k, v, bias.to(device=device, dtype=torch.float16), deterministic=deterministic)
    assert (out[0, 3, 1] == 0).all() and lse[0, 1, 3] == float("-inf")
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][0, 3, 1] == 0).all() and (grads[3][0, 1, 3] == 0).all()


@pytest.mark.xfail(strict=True, reason=(
    "known: dS outside the mask is 0 * (dP - NaN) = NaN in edge tiles, so a NaN query row turns dK "
    "NaN for every key of the tiles it visits, not only the keys it sees. Fix (zero dS outside the "
    "mask in edge tiles) pending a GPU check"))
def test_nan_in_one_query_row_stays_in_that_row(device, gen):
    q, k, v = random_qkv(1, 20, 26, 2, 1, 16, 16, dtype=torch.float32, device=device, generator=gen)
    q[0, 5, 1, 3] = float("nan")
    out, lse, (dq, dk, dv) = check(q, k, v, mask="t:4,4")
    nan_rows = torch.isnan(out).any(-1)
    assert nan_rows[0, 5, 1] and nan_rows.sum() == 1
    assert torch.isnan(dq).any(-1).sum() == 1 and torch.isnan(dq[0, 5, 1]).all()
    # dK and dV: exactly the keys row 5 sees (window 1..9), through query head 1's group.
    assert torch.isnan(dk).any(-1)[0, :, 0].nonzero().flatten().tolist() == list(range(1, 10))


@pytest.mark.parametrize("where", ["k", "v"])
def test_inf_in_one_key_row_reaches_only_nearby_rows(where, device, gen):
    """inf in key row 12 under a +-3 window: the rows that see it are non-finite; rows whose key
    tiles (at most 256 keys on any config) never include key 12 stay finite and exact."""
    q, k, v = random_qkv(1, 600, 600, 2, 1, 16, 16, dtype=torch.float32, device=device, generator=gen)
    # Far rows do not depend on key 12: their exact values come from inputs with a finite key 12
    # (a dense reference would spread 0 * inf = NaN over every row).
    ex_out, _, ex_grads = reference_forward_and_grads(q, k, v, mask="t:3,3")
    (k if where == "k" else v)[0, 12, 0, 2] = float("inf")
    out, lse, grads = forward_and_grads(q, k, v, mask="t:3,3")
    assert not torch.isfinite(out[0, 9:16]).all()
    far = slice(300, None)
    assert torch.isfinite(out[0, far]).all() and torch.isfinite(lse[0, :, far]).all()
    assert max_error(out[0, far].cpu(), ex_out[0, far]) <= 2e-5
    for g, e in zip(grads, ex_grads):
        assert torch.isfinite(g[0, far]).all()
        assert max_error(g[0, far].cpu(), e[0, far]) <= 1e-4
