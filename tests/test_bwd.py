"""Gradients against the reference: FlashAttention's criterion in low precision, gradcheck in float64."""

import pytest
import torch

import fmha
from fmha import ops, reference
from fmha.inputs import check_inputs
from fmha.testing import error_bound, max_error, random_qkv, random_varlen


def grads(fn, tensors, dout):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dout)


def reference_grads(q, k, v, bias, dout, dtype, **kwargs):
    def fn(q, k, v, *rest):
        b = rest[0] if rest else None
        return reference.attention(q, k, v, bias=b, compute_dtype=dtype, **kwargs).out
    tensors = [t.cpu().to(dtype) for t in (q, k, v)] + ([bias.cpu().to(dtype)] if bias is not None else [])
    return grads(fn, tensors, dout.cpu().to(dtype))


def check_bwd(q, k, v, *, bias=None, deterministic=False, attention=fmha.attention, **kwargs):
    """fmha's dq, dk, dv (and dbias) within twice the error of PyTorch in the input dtype."""
    def fn(q, k, v, *rest):
        return attention(q, k, v, bias=rest[0] if rest else None, deterministic=deterministic, **kwargs)
    tensors = [q, k, v] + ([bias] if bias is not None else [])
    dout = torch.randn(fn(*tensors).shape, generator=torch.Generator().manual_seed(7)).to(q.dtype).to(q.device)
    got = grads(fn, tensors, dout)
    exact = reference_grads(q, k, v, bias, dout, torch.float64, **kwargs)
    low = reference_grads(q, k, v, bias, dout, q.dtype, **kwargs)
    for name, g, e, lo in zip(["dq", "dk", "dv", "dbias"], got, exact, low):
        assert g.shape == e.shape, name
        assert torch.isfinite(g).all(), name
        assert max_error(g.cpu(), e) <= error_bound(q.dtype, max_error(lo, e)), name
    return got


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask", [None, "t", "b", "t:6,3", "b:4,35"])
def test_masks_dtypes_modes(mask, dtype, deterministic, device, gen):
    q, k, v = random_qkv(2, 37, 45, 4, 2, 40, 24, dtype=dtype, device=device, generator=gen)
    check_bwd(q, k, v, mask=mask, deterministic=deterministic)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 50), (50, 1), (65, 33), (33, 65), (7, 0), (0, 7)])
def test_lengths(seqlen_q, seqlen_k, device, gen):
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 1, 32, 32, device=device, generator=gen)
    check_bwd(q, k, v, mask="b")


@pytest.mark.parametrize("head_dim_q,head_dim_v", [(1, 1), (72, 40), (192, 128)])
def test_head_dims(head_dim_q, head_dim_v, device, gen):
    q, k, v = random_qkv(1, 19, 37, 2, 1, head_dim_q, head_dim_v, device=device, generator=gen)
    check_bwd(q, k, v, mask="t:10,3")


@pytest.mark.parametrize("bias_shape", [(37, 45), (1, 4, 37, 45), (2, 1, 1, 45), (2, 4, 37, 45)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bias_gradient_reduced_to_its_shape(bias_shape, deterministic, device, gen):
    q, k, v = random_qkv(2, 37, 45, 4, 2, 32, 32, device=device, generator=gen)
    bias = torch.randn(bias_shape, generator=gen).to(device=device, dtype=q.dtype)
    dq, dk, dv, dbias = check_bwd(q, k, v, bias=bias, mask="b:9,4", deterministic=deterministic)
    assert dbias.shape == bias_shape and dbias.dtype == bias.dtype


@pytest.mark.parametrize("mask", [None, "t", "b:6,2"])
def test_alibi(mask, device, gen):
    q, k, v = random_qkv(2, 31, 43, 4, 2, 32, 32, device=device, generator=gen)
    slopes = torch.stack([fmha.alibi_slopes(4), fmha.alibi_slopes(4).flip(0)]).to(device)
    check_bwd(q, k, v, alibi_slopes=slopes, mask=mask)


@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout_gradients_given_the_bytes(deterministic, device, gen):
    q, k, v = random_qkv(2, 45, 70, 4, 2, 32, 16, device=device, generator=gen)
    bias = torch.randn(45, 70, generator=gen).to(device=device, dtype=q.dtype)
    check_bwd(q, k, v, bias=bias, mask="b:30,5", dropout_p=0.3, seed=2**40 + 3, offset=99,
              deterministic=deterministic)


def test_dropout_seed_drawn_in_forward_is_reused_in_backward(device, gen):
    q, k, v = random_qkv(1, 40, 40, 2, 2, 16, 16, device=device, generator=gen)
    dout = torch.randn(1, 40, 2, 16, generator=gen).to(device=device, dtype=q.dtype)
    torch.manual_seed(3)
    res = fmha.attention(*[t.detach().requires_grad_() for t in (q, k, v)], dropout_p=0.4, return_randval=True)
    torch.manual_seed(3)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device).tolist()
    got = grads(lambda *t: fmha.attention(*t, dropout_p=0.4, seed=seed, offset=offset), (q, k, v), dout)
    again = grads(lambda *t: fmha.attention(*t, dropout_p=0.4), (q, k, v), dout)
    torch.manual_seed(3)
    drawn = grads(lambda *t: fmha.attention(*t, dropout_p=0.4), (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(got, drawn))
    assert not all(torch.equal(a, b) for a, b in zip(got, again))
    assert torch.equal(res.randval.cpu(), reference.attention(q.cpu(), k.cpu(), v.cpu(), dropout_p=0.4, seed=seed,
                                                             offset=offset).randval)


@pytest.mark.parametrize("nhead_q,nhead_k", [(4, 1), (6, 2), (8, 2)])
def test_gqa_matches_expanded_heads(nhead_q, nhead_k, device, gen):
    q, k, v = random_qkv(1, 29, 33, nhead_q, nhead_k, 16, 16, dtype=torch.float32, device=device, generator=gen)
    dout = torch.randn(1, 29, nhead_q, 16, generator=gen).to(device)
    got = grads(lambda *t: fmha.attention(*t, mask="b"), (q, k, v), dout)
    ratio = nhead_q // nhead_k
    expanded = grads(lambda q, k, v: fmha.attention(q, k.repeat_interleave(ratio, 2), v.repeat_interleave(ratio, 2),
                                                    mask="b"), (q, k, v), dout)
    for g, e in zip(got, expanded):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("padding", ["padded", "seqlen_k"])
def test_group_mode(padding, deterministic, device, gen):
    kw = dict(pad_q=[20, 4, 40, 3], pad_k=[32, 30, 8, 16]) if padding == "padded" else dict(
        pad_k=[30, 33, 5, 12], key_lengths_override=True)
    batch = random_varlen([17, 1, 40, 0], [23, 30, 5, 9], 4, 2, 32, 24, device=device, generator=gen, **kw)

    def attention(q, k, v, **kwargs):
        return fmha.attention_varlen(q, k, v, batch.seqstart_q, batch.seqstart_k, seqlen_k=batch.seqlen_k,
                                     seqstart_padded_q=batch.seqstart_padded_q,
                                     seqstart_padded_k=batch.seqstart_padded_k, **kwargs)

    def ref_kwargs():
        return {k: v for k, v in batch.kwargs().items() if v is not None}

    bias = torch.randn(4, batch.q.shape[0], 30, generator=gen).to(device=device, dtype=batch.q.dtype)
    dout = torch.randn(batch.q.shape[0], 4, 24, generator=gen).to(device=device, dtype=batch.q.dtype)
    got = grads(lambda q, k, v, b: attention(q, k, v, bias=b, mask="b", dropout_p=0.2, seed=1, offset=2,
                                             deterministic=deterministic), (batch.q, batch.k, batch.v, bias), dout)
    kw = dict(mask="b", dropout_p=0.2, seed=1, offset=2, **{k: v.cpu() for k, v in ref_kwargs().items()})
    exact = reference_grads(batch.q, batch.k, batch.v, bias, dout, torch.float64, **kw)
    low = reference_grads(batch.q, batch.k, batch.v, bias, dout, batch.q.dtype, **kw)
    for g, e, lo in zip(got, exact, low):
        assert torch.isfinite(g).all()  # NaN in q/k/v padding never reaches a gradient
        e = torch.nan_to_num(e)  # the reference never reads padding either, but 0 * NaN there is NaN
        assert max_error(g.cpu(), e) <= error_bound(batch.q.dtype, max_error(torch.nan_to_num(lo), e))


def test_cu_seqlen_padding_gradients_are_zero(device, gen):
    q, k, v = random_qkv(2, 30, 40, 2, 1, 16, 16, device=device, generator=gen)
    cu_q = torch.tensor([0, 30, 41], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 7, 47], dtype=torch.int32, device=device)
    dq, dk, dv = check_bwd(q, k, v, cu_seqlen_q=cu_q, cu_seqlen_k=cu_k, mask="t")
    assert not dq[1, 11:].any() and not dk[0, 7:].any() and not dv[0, 7:].any()


def test_fully_masked_rows_have_zero_gradients(device, gen):
    q, k, v = random_qkv(1, 12, 5, 2, 2, 16, 16, device=device, generator=gen)
    dq, dk, dv = check_bwd(q, k, v, mask="b")  # rows 0..6 see nothing
    assert not dq[0, :7].any()


def test_atomic_and_deterministic_agree(device, gen):
    q, k, v = random_qkv(2, 70, 90, 4, 1, 32, 32, dtype=torch.float32, device=device, generator=gen)
    dout = torch.randn(2, 70, 4, 32, generator=gen).to(device)
    atomic = grads(lambda *t: fmha.attention(*t, mask="b:20,3"), (q, k, v), dout)
    determ = grads(lambda *t: fmha.attention(*t, mask="b:20,3", deterministic=True), (q, k, v), dout)
    again = grads(lambda *t: fmha.attention(*t, mask="b:20,3", deterministic=True), (q, k, v), dout)
    for a, d, r in zip(atomic, determ, again):
        torch.testing.assert_close(a, d, atol=1e-5, rtol=1e-5)
        assert torch.equal(d, r)


GRADCHECK_CASES = {
    "plain": dict(),
    "causal_br": dict(mask="b"),
    "window_tl": dict(mask="t:3,1"),
    "alibi_causal": dict(mask="t", alibi_slopes=torch.tensor([0.5, 0.25], dtype=torch.float32)),
    "alibi_window": dict(mask="b:4,2", alibi_slopes=torch.tensor([[0.5, 0.25]], dtype=torch.float32)),
    "dropout": dict(dropout_p=0.3, seed=5, offset=6),
    "dropout_deterministic": dict(dropout_p=0.3, seed=5, offset=6, deterministic=True),
    "cu_seqlen": dict(cu_seqlen_q=torch.tensor([0, 7], dtype=torch.int32),
                      cu_seqlen_k=torch.tensor([0, 8], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_float64(case, gen):
    kwargs = GRADCHECK_CASES[case]
    q, k, v = random_qkv(1, 9, 11, 2, 1, 8, 4, dtype=torch.float64, generator=gen)
    bias = torch.randn(9, 11, generator=gen, dtype=torch.float64)
    tensors = [t.requires_grad_() for t in (q, k, v, bias)]
    assert torch.autograd.gradcheck(lambda q, k, v, b: fmha.attention(q, k, v, bias=b, **kwargs), tensors,
                                    fast_mode=True)


def test_gradcheck_float64_group_mode(gen):
    batch = random_varlen([3, 5], [4, 6], 2, 1, 8, 4, pad_q=[4, 6], pad_k=[5, 6], dtype=torch.float64, generator=gen)
    q, k, v = (torch.nan_to_num(t).requires_grad_() for t in (batch.q, batch.k, batch.v))
    bias = torch.randn(2, q.shape[0], 6, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: fmha.attention_varlen(
            q, k, v, batch.seqstart_q, batch.seqstart_k, seqstart_padded_q=batch.seqstart_padded_q,
            seqstart_padded_k=batch.seqstart_padded_k, bias=b, mask="b", dropout_p=0.2, seed=1, offset=0),
        (q, k, v, bias), fast_mode=True)


def test_bwd_function_and_its_errors(device, gen):
    q, k, v = random_qkv(1, 20, 24, 2, 1, 16, 16, device=device, generator=gen)
    res = fmha.fwd(q, k, v, mask="b", dropout_p=0.1, seed=4, offset=5)
    dout = torch.randn_like(res.out)
    g = fmha.bwd(dout, q, k, v, res.out, res.lse, mask="b", dropout_p=0.1, seed=4, offset=5)
    auto = grads(lambda *t: fmha.attention(*t, mask="b", dropout_p=0.1, seed=4, offset=5), (q, k, v), dout)
    for a, b in zip(g[:3], auto):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert g.dbias is None
    with pytest.raises(ValueError, match=r"^dout: expected a tensor of shape \(1, 20, 2, 16\)"):
        fmha.bwd(dout[:, :10], q, k, v, res.out, res.lse, mask="b")
    with pytest.raises(ValueError, match=r"^out: expected a tensor of shape"):
        fmha.bwd(dout, q, k, v, res.out[..., :8], res.lse)
    with pytest.raises(ValueError, match=r"^lse: expected a tensor of shape \(1, 2, 20\)"):
        fmha.bwd(dout, q, k, v, res.out, res.lse[:, :1])
    with pytest.raises(ValueError, match=r"^lse: expected torch.float32"):
        fmha.bwd(dout, q, k, v, res.out, res.lse.double())
    with pytest.raises(ValueError, match=r"^seed/offset: expected the forward's dropout seed and offset"):
        fmha.bwd(dout, q, k, v, res.out, res.lse, dropout_p=0.1)


def test_torch_deterministic_algorithms_select_the_deterministic_mode(monkeypatch, device, gen):
    """torch.use_deterministic_algorithms(True) makes the default backward the fixed-order one."""
    from fmha import ops

    seen = []
    real_bwd = ops.bwd

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real_bwd(*args, **kwargs)

    monkeypatch.setattr(ops, "bwd", spy)
    q, k, v = random_qkv(1, 20, 24, 2, 1, 16, 16, device=device, generator=gen)
    dout = torch.randn(1, 20, 2, 16, generator=gen).to(device=device, dtype=q.dtype)
    plain = grads(fmha.attention, (q, k, v), dout)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        under_flag = grads(fmha.attention, (q, k, v), dout)
        res = fmha.fwd(q, k, v)
        fmha.bwd(dout, q, k, v, res.out, res.lse)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert seen == [False, True, True]
    for a, b in zip(plain, under_flag):
        assert max_error(a, b) <= 1e-3


@pytest.mark.parametrize("index", ["cu_seqlen_q", "seqstart", "alibi_slopes"])
def test_backward_refuses_index_tensors_modified_after_the_forward(index, device, gen):
    """The eager backward saves every tensor of the problem, so reusing a cu_seqlens buffer in place
    between forward and backward raises instead of differentiating other lengths."""
    slopes = torch.rand(2, generator=gen).to(device)
    if index == "seqstart":
        q, k, v = (t[0].clone().requires_grad_() for t in random_qkv(1, 10, 10, 2, 2, 16, 16, device=device,
                                                                         generator=gen))
        starts = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
        out = fmha.attention_varlen(q, k, v, starts, starts)
        starts[1] = 6
    else:
        q, k, v = (t.requires_grad_() for t in random_qkv(2, 8, 8, 2, 2, 16, 16, device=device, generator=gen))
        cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
        out = fmha.attention(q, k, v, cu_seqlen_q=cu, alibi_slopes=slopes)
        if index == "cu_seqlen_q":
            cu[1] = 2
        else:
            slopes.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_backward_frees_the_inputs_it_saved(device, gen):
    """Held outputs do not keep q alive once the backward has run (saved tensors are freed then)."""
    import weakref

    x = random_qkv(1, 8, 8, 2, 2, 16, 16, device=device, generator=gen)[0].requires_grad_()
    q = x * 2
    alive = weakref.ref(q)
    out = fmha.attention(q, x, x)
    del q
    out.sum().backward()
    assert alive() is None
    assert out.shape == x.shape


def test_graph_only_where_a_gradient_is_wanted(device, gen):
    """Without a gradient to take (no input requires one, or under no_grad) the call records no
    graph, and its outputs equal those of the differentiable call."""
    q, k, v = random_qkv(1, 8, 8, 2, 2, 16, 16, device=device, generator=gen)
    bias = torch.randn(2, 8, 8, generator=gen).to(device)
    kwargs = dict(bias=bias, mask="t", return_lse=True)
    plain = fmha.attention(q, k, v, **kwargs)
    with torch.no_grad():
        quiet = fmha.attention(q.requires_grad_(), k, v, **kwargs)
    graded = fmha.attention(q, k, v, **kwargs)
    assert not plain.out.requires_grad and plain.out.grad_fn is None
    assert not quiet.out.requires_grad
    assert graded.out.grad_fn is not None and not graded.lse.requires_grad
    for got in (plain, quiet):
        torch.testing.assert_close(got.out, graded.out.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got.lse, graded.lse, rtol=0, atol=0)
    bias_only = fmha.attention(q.detach(), k, v, bias=bias.requires_grad_())
    assert bias_only.grad_fn is not None


@pytest.mark.parametrize("shape", [(3, 70, 130), (1, 2, 64, 64), (5, 1), (0, 4, 4)])
def test_transposed_last_two_copies_the_transpose(shape, device):
    t = torch.randn(shape).to(device=device, dtype=torch.bfloat16)
    got = ops.transposed_last_two(t)
    assert got.is_contiguous() and torch.equal(got, t.transpose(-1, -2))


@pytest.mark.parametrize("bias_shape", [(2, 3, 70, 90), (3, 70, 90), (70, 90), (1, 3, 70, 90)])
def test_dbias_from_a_transposed_buffer_is_reduced_like_the_plain_one(bias_shape, device):
    """The Hopper backward's dS is the transpose of a contiguous [B, H, S_k, S_q] buffer."""
    q = torch.empty(2, 70, 3, 16, dtype=torch.bfloat16, device=device)
    k = torch.empty(2, 90, 3, 16, dtype=torch.bfloat16, device=device)
    inputs = check_inputs(q, k, k, bias=torch.empty(bias_shape, dtype=torch.bfloat16, device=device))
    full = torch.randn(2, 3, 70, 90).to(device=device, dtype=torch.bfloat16)
    transposed_buffer = full.transpose(-1, -2).contiguous()
    got = ops._reduce_dbias(inputs, transposed_buffer.transpose(-1, -2))
    assert got.is_contiguous() and torch.equal(got, full.sum_to_size(bias_shape))
