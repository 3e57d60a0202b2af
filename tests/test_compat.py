"""Drop-in functions against their peers' own semantics.

FlashAttention-style functions against a direct PyTorch transcription of FlashAttention 2's
definitions (bottom-right causal and windows, ALiBi ``-slope * |i + sk - sq - j|``); the SDPA-style
function against torch's own scaled_dot_product_attention (the math backend on the CPU).
"""

import warnings

import pytest
import torch

from fmha import compat
from fmha.testing import error_bound, max_error, prefix_sums, random_qkv


def assert_close_to(got, exact, low):
    """FlashAttention's criterion (fmha.testing): within twice fp32 PyTorch's error, plus a floor."""
    bound = error_bound(torch.float32, max_error(low, exact), exact.abs().max().item())
    assert max_error(got, exact) <= bound


def fa_reference(q, k, v, scale=None, causal=False, window=(-1, -1), alibi=None, dtype=torch.float64):
    """FlashAttention 2's definition in ``dtype``: ``[B, S, H, D]``, GQA by head groups."""
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    ratio = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)
    sq, sk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)
    i = torch.arange(sq)[:, None] + sk - sq  # query position aligned to the bottom-right corner
    j = torch.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    if alibi is not None:
        slopes = alibi.to(dtype).reshape(-1, q.shape[1], 1, 1) if alibi.dim() == 2 else alibi.to(dtype)[:, None, None]
        s = s - slopes * (i - j).abs()
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(causal=True), dict(window_size=(5, 2)), dict(causal=True, window_size=(7, -1)),
    dict(alibi=True), dict(alibi=True, causal=True), dict(softmax_scale=0.3),
])
@pytest.mark.parametrize("seqlens", [(23, 40), (40, 23)])
def test_flash_attn_func(kwargs, seqlens, device, gen):
    kwargs = dict(kwargs)
    q, k, v = random_qkv(2, *seqlens, 4, 2, 32, 32, dtype=torch.float32, generator=gen)
    alibi = torch.rand(2, 4, generator=gen) if kwargs.pop("alibi", False) else None
    out = compat.flash_attn_func(q.to(device), k.to(device), v.to(device),
                                 alibi_slopes=alibi.to(device) if alibi is not None else None, **kwargs).cpu()
    ref = dict(scale=kwargs.get("softmax_scale"), causal=kwargs.get("causal", False),
               window=kwargs.get("window_size", (-1, -1)), alibi=alibi)
    assert_close_to(out, fa_reference(q, k, v, **ref), fa_reference(q, k, v, dtype=torch.float32, **ref))


def test_flash_attn_qkvpacked_func_gradients_reach_qkv(device, gen):
    qkv = torch.randn(2, 30, 3, 4, 16, generator=gen).requires_grad_()
    out, lse, s_dmask = compat.flash_attn_qkvpacked_func(qkv.to(device), causal=True, return_attn_probs=True)
    assert lse.shape == (2, 4, 30) and s_dmask is None
    out.sum().backward()
    grads = []
    for dtype in (torch.float64, torch.float32):
        ref_qkv = qkv.detach().clone().requires_grad_()
        fa_reference(*ref_qkv.unbind(2), causal=True, dtype=dtype).sum().backward()
        grads.append(ref_qkv.grad)
    assert_close_to(qkv.grad, *grads)


def test_flash_attn_varlen_func(device, gen):
    lens_q, lens_k = [7, 30, 1], [12, 25, 9]
    q = torch.randn(sum(lens_q), 4, 32, generator=gen)
    k, v = (torch.randn(sum(lens_k), 2, 32, generator=gen) for _ in range(2))
    out = compat.flash_attn_varlen_func(q.to(device), k.to(device), v.to(device), prefix_sums(lens_q).to(device),
                                        prefix_sums(lens_k).to(device), 30, 25, causal=True,
                                        window_size=(6, 0)).cpu()
    starts_q, starts_k = prefix_sums(lens_q).tolist(), prefix_sums(lens_k).tolist()
    for b in range(3):
        seq = (q[None, starts_q[b]:starts_q[b + 1]], k[None, starts_k[b]:starts_k[b + 1]],
               v[None, starts_k[b]:starts_k[b + 1]])
        assert_close_to(out[starts_q[b]:starts_q[b + 1]], fa_reference(*seq, causal=True, window=(6, 0))[0],
                        fa_reference(*seq, causal=True, window=(6, 0), dtype=torch.float32)[0])


def test_flash_attn_rejects_what_fmha_lacks(gen):
    q, k, v = random_qkv(1, 8, 8, 2, 2, 16, 16, dtype=torch.float32, generator=gen)
    with pytest.raises(ValueError, match=r"^softcap: expected 0.0"):
        compat.flash_attn_func(q, k, v, softcap=30.0)
    with pytest.raises(ValueError, match=r"^qkv: expected a tensor of shape \[B, S, 3, H, D\]"):
        compat.flash_attn_qkvpacked_func(q)


def _sdpa_inputs(gen, b=2, hq=4, hk=4, sq=21, sk=33, d=16):
    return [torch.randn(shape, generator=gen).requires_grad_()
            for shape in ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, d))]


@pytest.mark.parametrize("case", ["plain", "causal", "bool mask", "float mask", "gqa", "scale"])
def test_sdpa_matches_torch(case, device, gen):
    tensors = _sdpa_inputs(gen, hk=2 if case == "gqa" else 4)
    kwargs = {"causal": dict(is_causal=True), "gqa": dict(enable_gqa=True), "scale": dict(scale=0.7)}.get(case, {})
    if case == "bool mask":
        mask = torch.rand(21, 33, generator=gen) > 0.3
        mask[:, 0] = True  # no fully masked row (torch's and fmha's conventions differ there)
        kwargs = dict(attn_mask=mask)
    if case == "float mask":
        kwargs = dict(attn_mask=torch.randn(2, 1, 21, 33, generator=gen).requires_grad_())
    on_device = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
    out = compat.scaled_dot_product_attention(*(t.to(device) for t in tensors), **on_device).cpu()
    dout = torch.randn(out.shape, generator=gen)
    mask_leaf = [kwargs["attn_mask"]] if case == "float mask" else []
    got = [out, *torch.autograd.grad(out, tensors + mask_leaf, dout)]
    refs = []
    for dtype in (torch.float64, torch.float32):  # torch's own function: exact, and in fp32
        leaves = [t.detach().to(dtype).requires_grad_() for t in tensors + mask_leaf]
        ref_kwargs = dict(kwargs, attn_mask=leaves[3]) if mask_leaf else kwargs
        expected = torch.nn.functional.scaled_dot_product_attention(*leaves[:3], **ref_kwargs)
        refs.append([expected, *torch.autograd.grad(expected, leaves, dout.to(dtype))])
    for g, exact, low in zip(got, *refs):
        assert g.shape == exact.shape
        assert_close_to(g, exact, low)


def test_sdpa_falls_back_to_torch_and_says_so_once(device, gen):
    compat._warned.clear()
    q = torch.randn(3, 10, 16, generator=gen).to(device)  # [H, S, D]: not a 4-D call
    with pytest.warns(UserWarning, match="only \\[B, H, S, D\\] tensors run on fmha"):
        out = compat.scaled_dot_product_attention(q, q, q)
    assert max_error(out, torch.nn.functional.scaled_dot_product_attention(q, q, q)) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.scaled_dot_product_attention(q, q, q)


def test_sdpa_falls_back_for_cpu_tensors_when_kernels_are_compiled(monkeypatch, gen):
    """With kernels compiled for the GPU (no interpreter), CPU tensors go to torch, with a warning."""
    monkeypatch.setattr(compat, "INTERPRET", False)
    compat._warned.clear()
    q = torch.randn(1, 2, 10, 16, generator=gen)
    with pytest.warns(UserWarning, match="tensors on cpu run on fmha only in Triton's interpreter"):
        out = compat.scaled_dot_product_attention(q, q, q)
    assert max_error(out, torch.nn.functional.scaled_dot_product_attention(q, q, q)) == 0
