"""The reference itself: Philox known answers, CK's byte mapping, masks, ALiBi, softmax guards."""

import math

import pytest
import torch

import fmha
from fmha import reference
from fmha.masks import Mask, MaskType

# Random123's kat_vectors for philox4x32 with 7 rounds: counter, key -> output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    words = reference.philox4x32_7(key, tuple(torch.tensor([c]) for c in counter))
    assert [int(w) for w in words] == list(expected)


def test_randval_inverts_ck_host_loop():
    """CK's host reference fills tile bytes with i = (16*(r//8))%32 + 8*(lane//32) + r%8, j = lane%32."""
    seed, offset, b, nheads, h = 77, 1000, 1, 3, 2
    randval = reference.dropout_randval(seed, offset, b, nheads, 64, 64)[h]
    for row_tile in range(2):
        for col_tile in range(2):
            for lane in range(64):
                ctr = offset + (b * nheads + h) * 64 + lane
                words = reference.philox4x32_7(
                    (seed, 0), (torch.tensor(ctr), torch.tensor(0), torch.tensor(row_tile), torch.tensor(col_tile)))
                data = b"".join(int(w).to_bytes(4, "little") for w in words)
                for r in range(16):
                    i = (16 * (r // 8)) % 32 + 8 * (lane // 32) + r % 8
                    j = lane % 32
                    assert randval[32 * row_tile + i, 32 * col_tile + j] == data[r]


def test_alibi_slopes():
    torch.testing.assert_close(fmha.alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)]))
    six = [2.0 ** (-2 * (h + 1)) for h in range(4)] + [2.0**-1, 2.0**-3]
    torch.testing.assert_close(fmha.alibi_slopes(6), torch.tensor(six))
    with pytest.raises(ValueError, match="nhead"):
        fmha.alibi_slopes(0)


@pytest.mark.parametrize(
    "text,mask",
    [
        ("0", Mask()), ("n", Mask()), ("1", Mask(MaskType.TOP_LEFT, -1, 0)), ("t", Mask(MaskType.TOP_LEFT, -1, 0)),
        ("2", Mask(MaskType.BOTTOM_RIGHT, -1, 0)), ("b", Mask(MaskType.BOTTOM_RIGHT, -1, 0)),
        ("t:3,5", Mask(MaskType.TOP_LEFT, 3, 5)), ("b:10,11", Mask(MaskType.BOTTOM_RIGHT, 10, 11)),
        ("xt:4", Mask(MaskType.TOP_LEFT, 2, 1)), ("xb:16", Mask(MaskType.BOTTOM_RIGHT, 8, 7)),
        ("xt:-1", Mask(MaskType.TOP_LEFT, -1, 0)), ("xb:0", Mask(MaskType.BOTTOM_RIGHT, -1, 0)),
        ("g:3,2", Mask(MaskType.TOP_LEFT, 3, 2)), (None, Mask()),
    ],
)
def test_parse_mask(text, mask):
    assert fmha.parse_mask(text) == mask


def test_mask_printing():
    assert str(fmha.parse_mask("b:4,35")) == "b(4:35)"
    assert str(fmha.parse_mask("t")) == "t(-1:0)"
    assert str(fmha.parse_mask(None)) == "n"


def test_visible_worked_examples():
    v = reference.visible(fmha.parse_mask("t"), 3, 5)
    assert v[0].nonzero().flatten().tolist() == [0] and v[2].nonzero().flatten().tolist() == [0, 1, 2]
    v = reference.visible(fmha.parse_mask("b"), 3, 5)
    assert v[0].nonzero().flatten().tolist() == [0, 1, 2] and v[2].all()
    v = reference.visible(fmha.parse_mask("b"), 5, 3)
    assert not v[:2].any() and v[2].tolist() == [True, False, False] and v[4].all()
    v = reference.visible(fmha.parse_mask("t:128,30"), 200, 520)
    i, j = torch.arange(200)[:, None], torch.arange(520)[None, :]
    assert torch.equal(v, (j >= i - 128) & (j <= i + 30))


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = reference.attention(q, k, v, mask="t" if causal else None).out
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_fully_masked_rows_give_zero_and_minus_inf():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g) for _ in range(3))
    res = reference.attention(q, k[:, :3], v[:, :3], mask="b")
    assert torch.equal(res.out[0, :2], torch.zeros_like(res.out[0, :2]))
    assert torch.isneginf(res.lse[0, :, :2]).all() and torch.isfinite(res.lse[0, :, 2:]).all()
    empty = reference.attention(q, k[:, :0], v[:, :0])
    assert torch.equal(empty.out, torch.zeros_like(empty.out)) and torch.isneginf(empty.lse).all()


def test_rows_a_bias_hides_entirely_get_zero_gradients():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 6, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    bias[:, 2] = -float("inf")  # row 2 sees no key
    out = reference.attention(q, k, v, bias=bias).out
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g, dtype=torch.float64))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2])) and torch.equal(dq[0, 2], torch.zeros_like(dq[0, 2]))


def test_alibi_values():
    slopes = torch.tensor([0.5])
    causal = reference.alibi_bias(slopes, fmha.parse_mask("t"), 2, 3)
    torch.testing.assert_close(causal[0], torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.5, 1.0]]))
    bottom_right = reference.alibi_bias(slopes, fmha.parse_mask(None), 2, 3)
    torch.testing.assert_close(bottom_right[0], -0.5 * torch.tensor([[1.0, 0.0, 1.0], [2.0, 1.0, 0.0]]))
    top_left = reference.alibi_bias(slopes, fmha.parse_mask("t:1,1"), 2, 3)
    torch.testing.assert_close(top_left[0], -0.5 * torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0]]))


def test_dropout_scaling_in_reference():
    """With every byte kept, dropout only rescales O by 1/(1-p)... unless bytes drop elements."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 1, 8, generator=g, dtype=torch.float64) for _ in range(3))
    p = 0.25
    res = reference.attention(q, k, v, dropout_p=p, seed=1, offset=2)
    keep = res.randval[0, 0] <= math.floor(255 * (1 - p))
    s = (q[0, :, 0] @ k[0, :, 0].T) / math.sqrt(8)
    probs = torch.softmax(s, dim=-1)
    expected = (probs * keep / (1 - p)) @ v[0, :, 0]
    torch.testing.assert_close(res.out[0, :, 0], expected)
    plain = reference.attention(q, k, v)
    torch.testing.assert_close(res.lse, plain.lse)  # LSE is taken before dropout
