"""The custom ops fmha::fwd / fmha::bwd: opcheck, and torch.compile(fullgraph=True) against eager.

On the CPU torch.compile uses the ``aot_eager`` backend (no C++ toolchain needed): it traces
through dynamo and AOTAutograd exactly as inductor would, which is where graph breaks, fake-tensor
shapes and the autograd registration are exercised.
"""

import os
import subprocess
import sys

import pytest
import torch

import fmha
from fmha import ops
from fmha.testing import random_qkv, random_varlen

BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"


def _fwd_args(q, k, v, bias=None, philox=None, dropout_p=0.0, group=None, mask=(2, -1, 0), return_randval=True):
    """fmha::fwd's positional arguments for a batch problem, or a group one from ``random_varlen``."""
    index = [None] * 7
    max_q, max_k, lse_rows = q.shape[1] if q.dim() == 4 else 0, k.shape[1] if k.dim() == 4 else 0, 0
    if group is not None:
        index = [None, None, group.seqstart_q, group.seqstart_k, group.seqlen_k, group.seqstart_padded_q,
                 group.seqstart_padded_k]
        max_q, max_k, lse_rows = group.max_q, group.max_k, int(group.seqstart_q[-1])
    return (q, k, v, bias, None, philox, *index, q.shape[-1] ** -0.5, *mask, dropout_p, max_q, max_k, lse_rows,
            return_randval, False)


def test_opcheck_fwd_and_bwd_batch(device, gen):
    q, k, v = random_qkv(2, 37, 45, 4, 2, 32, 16, dtype=torch.float32, device=device, generator=gen)
    bias = torch.randn(37, 45, generator=gen).to(device)
    philox = ops.philox_seed_offset(3, 1, q.device)
    args = _fwd_args(*(t.requires_grad_() for t in (q, k, v, bias)), philox=philox, dropout_p=0.2)
    torch.library.opcheck(torch.ops.fmha.fwd.default, args)
    out, lse, _ = torch.ops.fmha.fwd(*args)
    bwd_args = (torch.randn(out.shape, generator=gen).to(device), q.detach(), k.detach(), v.detach(), out.detach(),
                lse.detach(), bias.detach(), *args[4:21], False, True)
    torch.library.opcheck(torch.ops.fmha.bwd.default, bwd_args)


def test_opcheck_fwd_group_with_padding(device, gen):
    batch = random_varlen([5, 0, 9], [7, 3, 8], 2, 1, 16, 16, pad_q=[6, 1, 9], pad_k=[8, 3, 8],
                          dtype=torch.float32, device=device, generator=gen)
    batch.q, batch.k, batch.v = (torch.nan_to_num(t) for t in (batch.q, batch.k, batch.v))
    batch.max_q, batch.max_k = 9, 8
    args = _fwd_args(*(t.requires_grad_() for t in (batch.q, batch.k, batch.v)), group=batch, mask=(1, 3, 2),
                     return_randval=False)
    torch.library.opcheck(torch.ops.fmha.fwd.default, args)


def _compare_compiled(fn, tensors):
    """fullgraph compile (a graph break raises), then the same outputs and gradients as eager."""
    compiled = torch.compile(fn, fullgraph=True, backend=BACKEND)
    eager_leaves = [t.detach().clone().requires_grad_() for t in tensors]
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    expected, got = fn(*eager_leaves), compiled(*leaves)
    dout = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5)).to(expected)
    expected_grads = torch.autograd.grad(expected, eager_leaves, dout)
    got_grads = torch.autograd.grad(got, leaves, dout)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


BATCH_CASES = {
    "gqa causal": dict(mask="b"),
    "bias dropout": dict(bias=True, mask="t:5,3", dropout_p=0.2, seed=7, offset=2),
    "alibi window": dict(alibi=True, mask="b:4,0"),
    "cu_seqlen": dict(cu_seqlen_q=torch.tensor([0, 20, 57], dtype=torch.int32),
                      cu_seqlen_k=torch.tensor([0, 45, 60], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_compiled_attention_matches_eager(case, device, gen):
    torch._dynamo.reset()
    kwargs = dict(BATCH_CASES[case])
    q, k, v = random_qkv(2, 37, 45, 4, 2, 32, 16, dtype=torch.float32, device=device, generator=gen)
    tensors = [q, k, v]
    if kwargs.pop("bias", False):
        tensors.append(torch.randn(4, 37, 45, generator=gen).to(device))
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = fmha.alibi_slopes(4, device=device)
    kwargs = {key: val.to(device) if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}

    def fn(q, k, v, *bias):
        return fmha.attention(q, k, v, bias=bias[0] if bias else None, **kwargs)

    _compare_compiled(fn, tensors)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_compiled_varlen_matches_eager(dropout_p, device, gen):
    torch._dynamo.reset()
    batch = random_varlen([5, 0, 19], [7, 3, 18], 4, 2, 16, 24, pad_k=[8, 3, 18], dtype=torch.float32,
                          device=device, generator=gen)
    q, k, v = (torch.nan_to_num(t) for t in (batch.q, batch.k, batch.v))
    bias = torch.randn(1, q.shape[0], 18, generator=gen).to(device)

    def fn(q, k, v, bias):
        return fmha.attention_varlen(q, k, v, batch.seqstart_q, batch.seqstart_k,
                                     seqstart_padded_k=batch.seqstart_padded_k, max_seqlen_q=19,
                                     max_seqlen_k=18, bias=bias, mask="b", dropout_p=dropout_p, seed=1,
                                     offset=0)

    _compare_compiled(fn, [q, k, v, bias])


def test_compiled_varlen_needs_max_seqlen_and_no_padded_q(device, gen):
    """Both would need the seqstarts on the host: a clear error instead of a graph break."""
    batch = random_varlen([5, 9], [7, 8], 2, 1, 16, 16, pad_q=[6, 9], dtype=torch.float32, device=device,
                          generator=gen)
    for kwargs, message in ((dict(), "max_seqlen_q/max_seqlen_k: expected ints while tracing"),
                            (dict(seqstart_padded_q=batch.seqstart_padded_q, max_seqlen_q=9, max_seqlen_k=8),
                             "seqstart_padded_q: expected None while tracing")):
        torch._dynamo.reset()

        def fn(q, k, v):
            return fmha.attention_varlen(q, k, v, batch.seqstart_q, batch.seqstart_k, **kwargs)

        with pytest.raises(Exception, match=message):
            torch.compile(fn, fullgraph=True, backend=BACKEND)(batch.q, batch.k, batch.v)


# The largest tiles of each shape class: the configs nearest the sm_90 shared-memory limit.
LARGEST_TILES = ["bfloat16 d=128/128 [mask bias dropout]", "bfloat16 d=256/256 [mask bias dropout]",
                 "bfloat16 d=256/256 [group bias dropout]", "float32 d=256/256 [mask bias dropout]"]


def test_largest_shipped_tiles_compile_for_hopper_within_shared_memory():
    """Triton compiles for sm_90 without a GPU: every kernel of these cells must build and fit in
    shared memory (spills are reported, not failed: benchmarks/NOTES.md lists them)."""
    only = [arg for cell in LARGEST_TILES for arg in ("--only", cell)]
    proc = subprocess.run([sys.executable, "-m", "fmha.compile_check", "--allow-spills", *only],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "28/28 kernel configs compile for sm_90 within shared memory" in proc.stdout, proc.stdout


def test_hopper_fast_path_compiles_for_sm90_without_spills():
    """The Gluon kernels of every shipped Hopper config build for sm_90a, fit in shared memory and
    do not spill (warp specialization hands each role its registers; a spill would mean the
    register split no longer fits) beyond the spills ``ACCEPTED_SPILLS`` names."""
    proc = subprocess.run([sys.executable, "-m", "fmha.compile_check", "--only", "hopper"],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # fp16/bf16 x plain/causal x (3 forwards + 3 backwards of three launches each), the forward
    # with a window alone and in group mode with a window where not causal, with ALiBi (and a
    # window where not causal) but for causal ALiBi at d=64, the same (and a window alone) for the
    # backward's main kernel at d=64/128, group mode (forward; backward at d=64/128), the
    # backward's main kernel under GQA, and the forward with dropout alone and with ALiBi (not at
    # d=256, nor causal at d=64), and the forward with ALiBi alone without a mask at d=128/256;
    # the backward with dropout: alone at d=64/128, with ALiBi and with GQA at d=64 (16 more); each
    # plain forward also persistent where its config runs short problems so (not causal); the
    # deterministic backward's three kernels at d=64/128, alone, with ALiBi, and under a causal
    # mask with a long problem's dQ copies, and at d=256 alone in both orders (84 in all); the
    # window alone both persistent (a short band) and one CTA per tile (a wide one), and the forward
    # with a window and dropout, and with a window and a bias at d=128/256 (not causal)
    assert "314/314 kernel configs compile for sm_90 within shared memory and without spills (but the accepted)" in proc.stdout, proc.stdout
