"""The forward kernel against fmha.reference (float64), feature by feature.

Shapes are small and ragged (lengths not multiples of the tiles) because on CPU the kernel runs in
Triton's interpreter. Outputs must be within FlashAttention's criterion: twice the error of the
same computation done by PyTorch in the input dtype, plus a small floor.
"""

import math

import pytest
import torch

import fmha
from fmha import reference
from fmha.testing import error_bound, max_error, random_qkv, random_varlen, reference_pair

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MASKS = [None, "t", "b", "t:5,3", "b:4,2", "b:-1,3", "t:2,-1", "xt:8", "xb:5", "g:3,2"]


def check_fwd(q, k, v, *, ref_kwargs=None, **kwargs):
    """Run fmha.fwd and assert out and lse are within the error bound; return the result."""
    res = fmha.fwd(q, k, v, return_randval=kwargs.get("dropout_p", 0) > 0, **kwargs)
    exact, low = reference_pair(q.cpu(), k.cpu(), v.cpu(), **_cpu(ref_kwargs or kwargs))
    out_bound = error_bound(q.dtype, max_error(low.out, exact.out))
    assert torch.isfinite(res.out).all()
    assert max_error(res.out.cpu(), exact.out) <= out_bound
    # LSE is fp32 in both; its error is that of the scores, bounded through the same criterion.
    lse_bound = error_bound(q.dtype, max_error(low.lse, exact.lse))
    assert torch.equal(torch.isneginf(res.lse.cpu()), torch.isneginf(exact.lse))
    assert max_error(res.lse.cpu(), exact.lse) <= lse_bound
    return res, exact


def _cpu(kwargs):
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", MASKS)
def test_masks_and_dtypes(dtype, mask, device, gen):
    q, k, v = random_qkv(2, 37, 45, 4, 2, 40, 24, dtype=dtype, device=device, generator=gen)
    check_fwd(q, k, v, mask=mask)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 70), (70, 1), (65, 33), (33, 65), (64, 64), (5, 0)])
@pytest.mark.parametrize("mask", [None, "t", "b", "b:4,35"])
def test_lengths(seqlen_q, seqlen_k, mask, device, gen):
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 1, 32, 32, device=device, generator=gen)
    res, _ = check_fwd(q, k, v, mask=mask)
    if seqlen_k == 0:
        assert torch.equal(res.out.cpu(), torch.zeros_like(res.out.cpu()))
        assert torch.isneginf(res.lse).all()


def test_worked_examples_of_spec():
    """SPEC §3's worked examples, read off the kernel's LSE rows (which rows see nothing)."""
    ones = torch.ones(1, 5, 1, 16)
    # b, sq=5, sk=3: rows 0 and 1 see nothing -> O = 0, LSE = -inf; row 4 sees all three keys.
    res = fmha.fwd(ones[:, :5], ones[:, :3], ones[:, :3], mask="b")
    assert torch.isneginf(res.lse[0, 0, :2]).all()
    assert torch.equal(res.out[0, :2], torch.zeros_like(res.out[0, :2]))
    # With q = k = 1 every visible logit is scale * 16 = 4: LSE = 4 + log(#visible).
    torch.testing.assert_close(res.lse[0, 0, 2:], 4 + torch.log(torch.tensor([1.0, 2.0, 3.0])))
    # t, sq=3, sk=5: row 0 sees {0}, row 2 sees {0, 1, 2}.
    res = fmha.fwd(ones[:, :3], ones, ones, mask="t")
    torch.testing.assert_close(res.lse[0, 0], 4 + torch.log(torch.tensor([1.0, 2.0, 3.0])))
    # b, sq=3, sk=5: row 0 sees {0, 1, 2}, row 2 sees {0..4}.
    res = fmha.fwd(ones[:, :3], ones, ones, mask="b")
    torch.testing.assert_close(res.lse[0, 0], 4 + torch.log(torch.tensor([3.0, 4.0, 5.0])))
    # b:4,35 with sq=99, sk=32: row i sees i-71 <= j <= i-32.
    seen = reference.visible(fmha.parse_mask("b:4,35"), 99, 32)
    i = torch.arange(99)[:, None]
    j = torch.arange(32)[None, :]
    assert torch.equal(seen, (j >= i - 71) & (j <= i - 32))


@pytest.mark.parametrize("nhead_q,nhead_k", [(4, 4), (4, 2), (4, 1), (6, 2)])
def test_gqa(nhead_q, nhead_k, device, gen):
    q, k, v = random_qkv(2, 33, 47, nhead_q, nhead_k, 32, 32, device=device, generator=gen)
    check_fwd(q, k, v, mask="b")


@pytest.mark.parametrize("head_dim_q,head_dim_v", [(1, 1), (8, 8), (40, 24), (72, 40), (100, 100), (192, 128), (256, 256)])
def test_head_dims(head_dim_q, head_dim_v, device, gen):
    q, k, v = random_qkv(1, 19, 37, 2, 1, head_dim_q, head_dim_v, device=device, generator=gen)
    check_fwd(q, k, v, mask="t:10,3")


@pytest.mark.parametrize("layout", ["bhsd", "strided"])
def test_non_contiguous_inputs(layout, device, gen):
    q, k, v = random_qkv(2, 29, 41, 4, 2, 48, 32, device=device, layout=layout, generator=gen)
    assert not q.is_contiguous()
    check_fwd(q, k, v, mask="b")


@pytest.mark.parametrize(
    "bias_shape",
    [(37, 45), (1, 4, 37, 45), (2, 1, 37, 45), (2, 4, 1, 45), (45,), (2, 4, 37, 1)],
    ids=["sq_sk", "1_h_sq_sk", "b_1_sq_sk", "b_h_1_sk", "sk", "b_h_sq_1"],
)
@pytest.mark.parametrize("bias_dtype", ["input", "fp32"])
def test_bias_broadcast(bias_shape, bias_dtype, device, gen):
    q, k, v = random_qkv(2, 37, 45, 4, 2, 32, 32, device=device, generator=gen)
    dtype = q.dtype if bias_dtype == "input" else torch.float32
    bias = torch.randn(bias_shape, generator=gen).to(device=device, dtype=dtype)
    check_fwd(q, k, v, bias=bias, mask="t:9,4")


def test_bias_with_minus_inf_masks_like_a_mask(device, gen):
    q, k, v = random_qkv(1, 20, 30, 2, 2, 16, 16, device=device, generator=gen)
    bias = torch.randn(20, 30, generator=gen)
    bias[3] = float("-inf")  # a fully masked row
    bias[5, ::2] = float("-inf")
    res, _ = check_fwd(q, k, v, bias=bias.to(device))
    assert torch.equal(res.out[0, 3].cpu(), torch.zeros_like(res.out[0, 3].cpu()))
    assert torch.isneginf(res.lse[0, :, 3]).all()


@pytest.mark.parametrize("mask", [None, "t", "b", "t:6,2", "b:6,2", "t:-1,4", "b:3,-1"])
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(mask, per_batch, device, gen):
    q, k, v = random_qkv(2, 31, 43, 4, 2, 32, 32, device=device, generator=gen)
    slopes = fmha.alibi_slopes(4, device=device)
    if per_batch:
        slopes = torch.stack([slopes, slopes.flip(0)])
    check_fwd(q, k, v, alibi_slopes=slopes, mask=mask)


def test_alibi_causal_uses_vertical_form(device, gen):
    """Causal ALiBi adds +slope*j: same O as the distance form, LSE shifted by slope*i per row."""
    q, k, v = random_qkv(1, 24, 24, 2, 2, 16, 16, device=device, generator=gen)
    slopes = torch.tensor([0.5, 0.25], device=device)
    causal = fmha.fwd(q, k, v, mask="t", alibi_slopes=slopes)
    window = fmha.fwd(q, k, v, mask="t:100,0", alibi_slopes=slopes)  # not causal: distance form
    torch.testing.assert_close(causal.out, window.out, atol=2e-3, rtol=0)
    shift = slopes[:, None] * torch.arange(24, device=device)[None, :]
    torch.testing.assert_close(causal.lse[0], window.lse[0] + shift, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mask", [None, "t", "b:7,3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dropout_bytes_and_output(mask, dtype, device, gen):
    q, k, v = random_qkv(2, 45, 70, 4, 2, 32, 16, dtype=dtype, device=device, generator=gen)
    kw = dict(dropout_p=0.3, seed=2**40 + 17, offset=123457, mask=mask)
    res, exact = check_fwd(q, k, v, **kw)
    seen = reference.visible(fmha.parse_mask(mask), 45, 70)
    assert torch.equal(res.randval.cpu()[..., seen], exact.randval[..., seen])


def test_dropout_keep_fraction_and_scaling(device, gen):
    p = 0.2
    q, k, v = random_qkv(1, 64, 96, 4, 4, 16, 16, device=device, generator=gen)
    res = fmha.fwd(q, k, v, dropout_p=p, seed=7, offset=0, return_randval=True)
    threshold = math.floor(255 * (1 - p))
    keep = (res.randval <= threshold).double().mean().item()
    expected = (threshold + 1) / 256  # bytes are uniform: keep probability 205/256
    n = res.randval.numel()
    assert abs(keep - expected) < 5 * math.sqrt(expected * (1 - expected) / n)


def test_dropout_seed_forms_and_generator(device, gen):
    q, k, v = random_qkv(1, 40, 40, 2, 2, 16, 16, device=device, generator=gen)
    seed, offset = 2**63 + 5, 2**64 - 70  # uint64 values past int64's range; counters wrap
    as_ints = fmha.fwd(q, k, v, dropout_p=0.5, seed=seed, offset=offset, return_randval=True)
    as_tensors = fmha.fwd(
        q, k, v, dropout_p=0.5, return_randval=True,
        seed=torch.tensor([seed - 2**64], device=device), offset=torch.tensor([offset - 2**64], device=device),
    )
    assert torch.equal(as_ints.randval, as_tensors.randval)
    assert torch.equal(as_ints.out, as_tensors.out)
    ref = reference.attention(q.cpu(), k.cpu(), v.cpu(), dropout_p=0.5, seed=seed, offset=offset)
    assert torch.equal(as_ints.randval.cpu(), ref.randval)
    # Drawn from PyTorch's generator: reproducible under manual_seed, fresh otherwise.
    torch.manual_seed(0)
    first = fmha.fwd(q, k, v, dropout_p=0.5, return_randval=True).randval
    second = fmha.fwd(q, k, v, dropout_p=0.5, return_randval=True).randval
    torch.manual_seed(0)
    again = fmha.fwd(q, k, v, dropout_p=0.5, return_randval=True).randval
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_cu_seqlen_batch_mode(device, gen):
    q, k, v = random_qkv(3, 40, 50, 4, 2, 32, 24, device=device, generator=gen)
    cu_q = torch.tensor([0, 40, 57, 57], dtype=torch.int32, device=device)  # 40, 17, 0 rows
    cu_k = torch.tensor([0, 9, 59, 88], dtype=torch.int32, device=device)  # 9, 50, 29 keys
    q[1, 17:] = float("nan")  # padding must never be read
    k[0, 9:] = float("nan")
    v[0, 9:] = float("nan")
    res, _ = check_fwd(q, k, v, cu_seqlen_q=cu_q, cu_seqlen_k=cu_k, mask="b")
    assert torch.equal(res.out[1, 17:].cpu(), torch.zeros_like(res.out[1, 17:].cpu()))
    assert torch.equal(res.out[2].cpu(), torch.zeros_like(res.out[2].cpu()))
    assert torch.isneginf(res.lse[1, :, 17:]).all() and torch.isneginf(res.lse[2]).all()


@pytest.mark.parametrize("padding", ["none", "padded", "seqlen_k"])
@pytest.mark.parametrize("mask", [None, "t", "b:5,2"])
def test_group_mode(padding, mask, device, gen):
    lengths_q, lengths_k = [17, 1, 40, 0], [23, 30, 5, 9]
    kw = {}
    if padding == "padded":
        kw = dict(pad_q=[20, 4, 40, 3], pad_k=[32, 30, 8, 16])
    elif padding == "seqlen_k":
        kw = dict(pad_k=[30, 33, 5, 12], key_lengths_override=True)
    batch = random_varlen(lengths_q, lengths_k, 4, 2, 32, 24, device=device, generator=gen, **kw)
    bias = torch.randn(4, batch.q.shape[0], max(lengths_k), generator=gen).to(device)
    slopes = fmha.alibi_slopes(4, device=device)
    res, _ = check_fwd(batch.q, batch.k, batch.v, mask=mask, bias=bias, alibi_slopes=slopes,
                       dropout_p=0.1, seed=9, offset=4, **batch.kwargs())
    assert res.lse.shape == (4, sum(lengths_q))
    # Padding rows of out are zero (NaN in q's padding never leaks).
    valid = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    starts = (batch.seqstart_padded_q if batch.seqstart_padded_q is not None else batch.seqstart_q).tolist()
    for start, n in zip(starts, lengths_q):
        valid[start : start + n] = True
    assert torch.equal(res.out[~valid.to(device)].cpu(), torch.zeros_like(res.out[~valid.to(device)].cpu()))


def test_group_mode_matches_per_sequence_batch_calls(device, gen):
    """Varlen equals a loop of batch-mode calls, one per sequence (masks use local indices)."""
    lengths_q, lengths_k = [13, 30, 7], [21, 9, 40]
    batch = random_varlen(lengths_q, lengths_k, 2, 2, 16, 16, device=device, generator=gen)
    res = fmha.fwd(batch.q, batch.k, batch.v, mask="b:3,1", **batch.kwargs())
    rows_q, rows_k = batch.seqstart_q.tolist(), batch.seqstart_k.tolist()
    for b in range(3):
        q = batch.q[rows_q[b] : rows_q[b + 1]][None]
        k = batch.k[rows_k[b] : rows_k[b + 1]][None]
        v = batch.v[rows_k[b] : rows_k[b + 1]][None]
        single = fmha.fwd(q, k, v, mask="b:3,1")
        torch.testing.assert_close(res.out[rows_q[b] : rows_q[b + 1]], single.out[0], atol=0, rtol=0)
        torch.testing.assert_close(res.lse[:, rows_q[b] : rows_q[b + 1]], single.lse[0], atol=0, rtol=0)


def test_nan_prefilled_out_is_fully_written(device, gen):
    q, k, v = random_qkv(2, 37, 45, 4, 2, 32, 24, device=device, generator=gen)
    out = torch.full((2, 4, 37, 24), float("nan"), dtype=q.dtype, device=device).transpose(1, 2)
    res = fmha.fwd(q, k, v, mask="b:7,0", out=out)
    assert res.out is out
    assert torch.isfinite(out).all()
    exact, low = reference_pair(q.cpu(), k.cpu(), v.cpu(), mask="b:7,0")
    assert max_error(out.cpu(), exact.out) <= error_bound(q.dtype, max_error(low.out, exact.out))


def test_scale(device, gen):
    q, k, v = random_qkv(1, 20, 20, 2, 2, 16, 16, device=device, generator=gen)
    check_fwd(q, k, v, scale=0.37, mask="t")


def test_attention_api_return_forms(device, gen):
    q, k, v = random_qkv(1, 20, 25, 2, 1, 16, 16, device=device, generator=gen)
    out = fmha.attention(q, k, v, mask="b")
    assert isinstance(out, torch.Tensor) and out.shape == (1, 20, 2, 16)
    res = fmha.attention(q, k, v, mask="b", return_lse=True)
    assert res.randval is None and res.lse.shape == (1, 2, 20)
    torch.testing.assert_close(res.out, out, atol=0, rtol=0)
    batch = random_varlen([5, 9], [7, 3], 2, 1, 16, 16, device=device, generator=gen)
    out = fmha.attention_varlen(batch.q, batch.k, batch.v, batch.seqstart_q, batch.seqstart_k, mask="t")
    assert out.shape == (14, 2, 16)


def test_kernel_layout_pads_strides_to_multiples_of_16():
    """Kernels get strides Triton marks divisible by 16: aligned tensors as they are, others copied."""
    from fmha.ops import kernel_layout

    aligned = torch.randn(2, 5, 3, 32)
    assert kernel_layout(aligned) is aligned
    for t in (torch.randn(2, 5, 3, 72), torch.randn(2, 5, 4, 40)[:, :, :3, :33], torch.randn(2, 5, 3, 48)[..., 1:41],
              torch.randn(2, 3, 5, 32).transpose(1, 2)[..., :1]):
        got = kernel_layout(t)
        assert torch.equal(got, t) and got.stride(-1) == 1
        assert got.storage_offset() % 16 == 0 and all(s % 16 == 0 for s in got.stride()[:-1]), got.stride()
