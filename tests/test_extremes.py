"""Extreme values: huge logits, LSE below fp32's exp range, all -inf bias rows, NaN and inf inputs.

The documented behaviour (README, "Numerics"): fmha is finite wherever the float64 reference is,
and within FlashAttention's criterion there; NaN appears only where the reference has NaN.
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


def assert_matches_where_finite(got, exact, low, dtype, name, recompute=0.0):
    """NaN only where the reference has NaN; where it is finite, fmha is finite and within bound
    (plus ``recompute`` times the largest value: see test_logits_of_magnitude_1e4)."""
    got, exact, low = (t.detach().cpu().double() for t in (got, exact, low))
    assert not (torch.isnan(got) & ~torch.isnan(exact)).any(), f"{name}: NaN where the reference has none"
    finite = torch.isfinite(exact)
    assert torch.isfinite(got[finite]).all(), f"{name}: non-finite where the reference is finite"
    if finite.any():
        magnitude = exact[finite].abs().max().item()
        bound = error_bound(dtype, max_error(low[finite].double(), exact[finite]), magnitude) + recompute * magnitude
        assert max_error(got[finite], exact[finite]) <= bound, name


def check(q, k, v, bias=None, deterministic=False, recompute=0.0, **kwargs):
    got_out, got_lse, got_grads = forward_and_grads(q, k, v, bias, deterministic, **kwargs)
    ex_out, ex_lse, ex_grads = reference_forward_and_grads(q, k, v, bias, **kwargs)
    lo_out, lo_lse, lo_grads = reference_forward_and_grads(q, k, v, bias, dtype=q.dtype, **kwargs)
    assert_matches_where_finite(got_out, ex_out, lo_out, q.dtype, "out")
    assert_matches_where_finite(got_lse, ex_lse, lo_lse, torch.float32, "lse")
    for name, g, e, lo in zip(["dq", "dk", "dv", "dbias"], got_grads, ex_grads, lo_grads):
        assert_matches_where_finite(g, e, lo, q.dtype, name, recompute)
    return got_out, got_lse, got_grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_logits_of_magnitude_1e4(dtype, device, gen):
    q, k, v = random_qkv(1, 33, 40, 2, 1, 16, 16, dtype=torch.float32, generator=gen)
    # scale * q.k reaches about 1e4: softmax is one-hot up to rounding.
    q, k = (q * 50).to(dtype), (k * 50).to(dtype)
    # The backward recomputes P = exp(S - LSE) from a stored fp32 LSE and S summed in another
    # order than the forward's: both carry fp32 rounding of |S| ~ 1e4, so P (and each gradient)
    # has a relative error of about |S| * 2^-23 on top of a plain fp32 softmax's (docs/numerics.md).
    # In fp16/bf16 the criterion's own bound is far larger than that.
    recompute = 1.5e4 * 2.0 ** -23 if dtype == torch.float32 else 0.0
    out, lse, _ = check(q.to(device), k.to(device), v.to(dtype).to(device), scale=1.0, mask="b", recompute=recompute)
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


def test_nan_in_one_query_row_stays_in_that_row_and_its_tiles(device, gen):
    """NaN in query row 300 under a +-3 window: out, lse and dQ are NaN in that row alone; dK and
    dV are NaN only for keys whose tiles (at most 256 keys on any config) meet that row's tiles, as
    the dense reference has them NaN for every key (0 * NaN in dS^T Q); far keys stay exact."""
    q, k, v = random_qkv(1, 600, 600, 2, 1, 16, 16, dtype=torch.float32, device=device, generator=gen)
    _, _, ex_grads = reference_forward_and_grads(q, k, v, mask="t:3,3")
    q[0, 300, 1, 3] = float("nan")
    out, lse, (dq, dk, dv) = forward_and_grads(q, k, v, mask="t:3,3")
    assert torch.isnan(out).any(-1).nonzero().tolist() == [[0, 300, 1]]
    assert torch.isnan(lse).nonzero().tolist() == [[0, 1, 300]]
    assert torch.isnan(dq).any(-1).nonzero().tolist() == [[0, 300, 1]]
    assert torch.isnan(dk[0, 297:304]).all() and torch.isnan(dv[0, 297:304]).all()
    far = torch.cat([torch.arange(0, 44), torch.arange(556, 600)])
    for g, e in zip((dk, dv), ex_grads[1:]):
        assert max_error(g[0, far], e[0, far]) <= 1e-4


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
    assert max_error(out[0, far], ex_out[0, far]) <= 2e-5
    for g, e in zip(grads, ex_grads):
        assert torch.isfinite(g[0, far]).all()
        assert max_error(g[0, far], e[0, far]) <= 1e-4
