"""Which problems the Hopper fast path takes (the selection logic runs anywhere; the kernels are
checked on the GPU in test_gpu_hopper.py)."""

import dataclasses

import pytest
import torch

from fmha import hopper
from fmha.configs import HOPPER_BWD_CONFIGS
from fmha.inputs import check_inputs


def _inputs(seqlen_k=64, nhead_k=4, head_dim=128, head_dim_v=None, dtype=torch.bfloat16, **kwargs):
    q = torch.empty(2, 64, 4, head_dim, dtype=dtype)
    k = torch.empty(2, seqlen_k, nhead_k, head_dim, dtype=dtype)
    v = torch.empty(2, seqlen_k, nhead_k, head_dim_v or head_dim, dtype=dtype)
    return check_inputs(q, k, v, **kwargs)


def test_cpu_tensors_take_the_portable_kernels():
    assert hopper.fwd_unsupported(_inputs()) == "not on a CUDA device"
    assert hopper.bwd_unsupported(_inputs(), deterministic=False) == "not on a CUDA device"
    assert hopper.device_unsupported(torch.device("cpu")) == "not on a CUDA device"


@pytest.mark.parametrize("kwargs", [{}, dict(mask="t"), dict(mask="b"), dict(nhead_k=1), dict(head_dim=64),
                                    dict(head_dim=256, mask="t")])
def test_problems_it_covers(kwargs):
    assert hopper._problem_reason(_inputs(**kwargs), hopper.HOPPER_FWD_CONFIGS) is None


@pytest.mark.parametrize("kwargs, reason", [
    (dict(dtype=torch.float32), "fp16 and bf16 only"),
    (dict(seqlen_k=80), "seqlen_q != seqlen_k"),
    (dict(head_dim=96), "head dims [64, 128, 256] with dq == dv only"),
    (dict(head_dim=128, head_dim_v=64), "head dims [64, 128, 256] with dq == dv only"),
    (dict(bias=torch.empty(64, 64, dtype=torch.bfloat16)), "elementwise bias"),
    (dict(alibi_slopes=torch.ones(4)), "ALiBi"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(mask="t:16,0"), "sliding-window mask"),
])
def test_problems_it_leaves_to_the_portable_kernels(kwargs, reason):
    assert hopper._problem_reason(_inputs(**kwargs), hopper.HOPPER_FWD_CONFIGS) == reason


@pytest.mark.parametrize("kwargs", [dict(alibi_slopes=torch.ones(4)), dict(mask="t:16,0"), dict(mask="b:1024,0"),
                                    dict(mask="t", alibi_slopes=torch.ones(4))])
def test_the_forward_also_takes_windows_and_alibi(kwargs):
    assert hopper._problem_reason(_inputs(**kwargs), hopper.HOPPER_FWD_CONFIGS, windows_and_alibi=True) is None


def test_causal_alibi_at_d64_is_left_to_the_portable_forward(monkeypatch):
    _on_cuda(monkeypatch)
    q = torch.empty(1, 4096, 2, 64, dtype=torch.bfloat16)
    slopes = torch.ones(2)
    assert hopper.fwd_unsupported(check_inputs(q, q, q, mask="t", alibi_slopes=slopes)) == \
        "ALiBi under a causal mask at head dim 64"
    assert hopper.fwd_unsupported(check_inputs(q, q, q, alibi_slopes=slopes)) is None


def test_the_forward_takes_dropout_in_batch_mode(monkeypatch):
    _on_cuda(monkeypatch)
    q = torch.empty(1, 4096, 2, 128, dtype=torch.bfloat16)
    windowed = check_inputs(q, q, q, dropout_p=0.1, mask="b:100,0", alibi_slopes=torch.ones(2))
    assert hopper.fwd_unsupported(windowed) is None
    bias = torch.empty(2, 4096, 4096, dtype=torch.bfloat16)
    assert hopper.fwd_unsupported(check_inputs(q, q, q, dropout_p=0.1, bias=bias)) is None
    packed = torch.empty(4096, 2, 128, dtype=torch.bfloat16)
    starts = torch.tensor([0, 1000, 4096], dtype=torch.int32)
    assert hopper.fwd_unsupported(check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts,
                                               dropout_p=0.1)) == "dropout in group mode"
    q256 = torch.empty(1, 4096, 2, 256, dtype=torch.bfloat16)
    assert hopper.fwd_unsupported(check_inputs(q256, q256, q256, dropout_p=0.1)) is None
    assert hopper.fwd_unsupported(check_inputs(q256, q256, q256, dropout_p=0.1, alibi_slopes=torch.ones(2))) == \
        "ALiBi with dropout at head dim 256"
    bias256 = torch.empty(2, 4096, 4096, dtype=torch.bfloat16)
    assert hopper.fwd_unsupported(check_inputs(q256, q256, q256, dropout_p=0.1, bias=bias256)) == \
        "an elementwise bias with dropout at head dim 256"


def test_the_backward_takes_dropout_in_batch_mode_atomic_without_a_bias(monkeypatch):
    _on_cuda(monkeypatch)
    q = torch.empty(1, 4096, 4, 128, dtype=torch.bfloat16)
    kv = torch.empty(1, 4096, 2, 128, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(q, q, q, dropout_p=0.1), deterministic=False) is None
    assert hopper.bwd_unsupported(check_inputs(q, q, q, dropout_p=0.1, mask="t"), deterministic=False) is None
    assert hopper.bwd_unsupported(check_inputs(q, q, q, dropout_p=0.1), deterministic=True) == \
        "dropout in deterministic mode"
    bias = torch.empty(4, 4096, 4096, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(q, q, q, dropout_p=0.1, bias=bias), deterministic=False) == \
        "dropout with an elementwise bias"
    packed = torch.empty(4096, 4, 128, dtype=torch.bfloat16)
    starts = torch.tensor([0, 1000, 4096], dtype=torch.int32)
    assert hopper.bwd_unsupported(check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts,
                                               dropout_p=0.1), deterministic=False) == "dropout in group mode"
    features = "dropout with a sliding window, ALiBi or GQA at head dim 128"
    for kwargs in (dict(mask="b:100,0"), dict(alibi_slopes=torch.ones(4))):
        assert hopper.bwd_unsupported(check_inputs(q, q, q, dropout_p=0.1, **kwargs), deterministic=False) == features
    assert hopper.bwd_unsupported(check_inputs(q, kv, kv, dropout_p=0.1), deterministic=False) == features
    q64, kv64 = q[..., :64].contiguous(), kv[..., :64].contiguous()
    assert hopper.bwd_unsupported(check_inputs(q64, kv64, kv64, dropout_p=0.1, mask="b:100,0",
                                               alibi_slopes=torch.ones(4)), deterministic=False) is None
    q256 = torch.empty(1, 4096, 2, 256, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(q256, q256, q256, dropout_p=0.1), deterministic=False) == \
        "dropout at head dim 256"


def test_group_mode_takes_the_fast_path_when_queries_and_keys_share_their_sequences():
    q = torch.empty(100, 4, 64, dtype=torch.bfloat16)
    starts = torch.tensor([0, 40, 100], dtype=torch.int32)
    inputs = check_inputs(q, q, q, seqstart_q=starts, seqstart_k=starts)
    assert hopper._problem_reason(inputs, hopper.HOPPER_FWD_CONFIGS, windows_and_alibi=True, group=True) is None
    assert hopper._problem_reason(inputs, hopper.HOPPER_BWD_CONFIGS, group=True) is None
    assert hopper._problem_reason(inputs, hopper.HOPPER_FWD_CONFIGS) == "group (varlen) mode"
    other = check_inputs(q, q, q, seqstart_q=starts, seqstart_k=starts.clone())
    assert hopper._problem_reason(other, hopper.HOPPER_FWD_CONFIGS, group=True).startswith("group mode without")


def test_portable_switch(monkeypatch):
    monkeypatch.setenv("FMHA_PORTABLE", "1")
    assert hopper.fwd_unsupported(_inputs()) == "FMHA_PORTABLE=1"


def _on_cuda(monkeypatch):
    """Pretend to be on a Hopper GPU: only the problem and speed checks remain."""
    monkeypatch.setattr(hopper, "device_unsupported", lambda device: None)


def _with_sms(monkeypatch, sms):
    """Pretend the GPU has ``sms`` SMs."""
    monkeypatch.setattr(hopper, "_device_index", lambda device: 0)
    monkeypatch.setattr(hopper, "_sm_count", lambda index: sms)


@pytest.mark.parametrize("seqlen, mask, portable", [
    (1024, None, False),  # persistent CTAs
    (1024, "b:100,0", False),  # a short band: persistent CTAs too
    (4096, None, False), (2048, "b", True), (4096, "t", False)])
def test_short_d64_forwards_take_the_faster_portable_kernels(monkeypatch, seqlen, mask, portable):
    _on_cuda(monkeypatch)
    q = torch.empty(1, seqlen, 2, 64, dtype=torch.bfloat16)
    reason = hopper.fwd_unsupported(check_inputs(q, q, q, mask=mask))
    assert (reason is not None) == portable, reason
    if portable:
        assert reason.startswith("d=64 ") and "measured faster" in reason
    monkeypatch.setenv("FMHA_PORTABLE", "0")
    assert hopper.fwd_unsupported(check_inputs(q, q, q, mask=mask)) is None


def test_short_backward_stays_on_the_fast_path(monkeypatch):
    _on_cuda(monkeypatch)
    short = torch.empty(1, 1024, 2, 64, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(short, short, short, mask="t"), False) is None


@pytest.mark.parametrize("nhead_k", [1, 2])
def test_gqa_and_mqa_backward_take_the_fast_path(monkeypatch, nhead_k):
    _on_cuda(monkeypatch)
    assert hopper.bwd_unsupported(_inputs(nhead_k=nhead_k), deterministic=False) is None


def test_group_mode_backward_at_d256_is_left_to_the_portable_kernels(monkeypatch):
    _on_cuda(monkeypatch)
    starts = torch.tensor([0, 40, 100], dtype=torch.int32)
    wide = torch.empty(100, 4, 256, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(wide, wide, wide, seqstart_q=starts, seqstart_k=starts),
                                  False) == "group (varlen) mode at head dim 256"
    spare = torch.empty(120, 4, 64, dtype=torch.bfloat16)  # 20 rows after the last sequence
    assert hopper.bwd_unsupported(check_inputs(spare, spare, spare, seqstart_q=starts, seqstart_k=starts),
                                  False) is None


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kwargs", [dict(alibi_slopes=torch.ones(4)), dict(mask="t:16,0"), dict(mask="b:100,7"),
                                    dict(mask="t:-1,16"), dict(mask="t", alibi_slopes=torch.ones(4)),
                                    dict(mask="b:1024,0", alibi_slopes=torch.ones(2, 4))])
def test_the_narrow_backward_takes_windows_and_alibi(monkeypatch, head_dim, kwargs):
    _on_cuda(monkeypatch)
    _with_sms(monkeypatch, 132)
    inputs = _inputs(head_dim=head_dim, **kwargs)
    assert hopper.bwd_unsupported(inputs, deterministic=False) is None
    windowed = not inputs.mask.is_causal and inputs.mask.type != 0
    assert hopper.bwd_unsupported(inputs, deterministic=True) == (
        "deterministic mode with a sliding window" if windowed else None)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(), None),
    (dict(mask="t"), None),
    (dict(head_dim=64, mask="b"), None),
    (dict(head_dim=256), None),
    (dict(head_dim=256, mask="t"), None),
    (dict(head_dim=256, nhead_k=2), "deterministic mode with GQA/MQA"),
    (dict(nhead_k=2), "deterministic mode with GQA/MQA"),
    (dict(mask="b:100,0"), "deterministic mode with a sliding window"),
])
def test_the_deterministic_backward_on_the_fast_path(monkeypatch, kwargs, reason):
    _on_cuda(monkeypatch)
    _with_sms(monkeypatch, 132)
    assert hopper.bwd_unsupported(_inputs(**kwargs), deterministic=True) == reason


@pytest.mark.parametrize("mask", [None, "t"])
def test_the_deterministic_backward_wants_a_heads_key_tiles_resident_together(monkeypatch, mask):
    _on_cuda(monkeypatch)
    _with_sms(monkeypatch, 132)
    fits = torch.empty(1, 132 * 128, 2, 128, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(fits, fits, fits, mask=mask), deterministic=True) is None
    longer = torch.empty(1, 132 * 128 + 1, 2, 128, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(longer, longer, longer, mask=mask), deterministic=True) == \
        "deterministic mode over 133 key tiles of 128: more than the 132 SMs"


@pytest.mark.parametrize("mask", [None, "t"])
def test_the_wide_deterministic_backward_runs_any_number_of_key_tiles(monkeypatch, mask):
    """At head dim 256, past the SMs, a CTA waits only for key tiles launched before it (the
    aligned order): no residency limit."""
    _on_cuda(monkeypatch)
    _with_sms(monkeypatch, 132)
    longer = torch.empty(1, 4 * 132 * 64 + 1, 1, 256, dtype=torch.bfloat16)
    assert hopper.bwd_unsupported(check_inputs(longer, longer, longer, mask=mask), deterministic=True) is None


def test_the_deterministic_backward_leaves_group_mode_to_the_portable_kernels(monkeypatch):
    _on_cuda(monkeypatch)
    _with_sms(monkeypatch, 132)
    packed = torch.empty(100, 4, 128, dtype=torch.bfloat16)
    starts = torch.tensor([0, 40, 100], dtype=torch.int32)
    inputs = check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts)
    assert hopper.bwd_unsupported(inputs, deterministic=False) is None
    assert hopper.bwd_unsupported(inputs, deterministic=True) == "deterministic mode in group mode"


@pytest.mark.parametrize("kwargs, reason", [
    (dict(alibi_slopes=torch.ones(4)), "ALiBi at head dim 256"),
    (dict(mask="t", alibi_slopes=torch.ones(4)), "ALiBi at head dim 256"),
    (dict(mask="b:100,0"), "sliding-window mask at head dim 256"),
])
def test_the_d256_backward_leaves_windows_and_alibi_to_the_portable_kernels(monkeypatch, kwargs, reason):
    _on_cuda(monkeypatch)
    assert hopper.bwd_unsupported(_inputs(head_dim=256, **kwargs), deterministic=False) == reason
    assert hopper.fwd_unsupported(_inputs(head_dim=256, **kwargs)) is None


def test_gqa_backward_with_a_window_and_alibi_takes_the_fast_path(monkeypatch):
    _on_cuda(monkeypatch)
    inputs = _inputs(nhead_k=2, mask="b:100,0", alibi_slopes=torch.ones(4))
    assert hopper.bwd_unsupported(inputs, deterministic=False) is None


def test_forward_and_backward_pass_the_same_window_and_alibi_arguments():
    q = torch.empty(2, 300, 4, 64, dtype=torch.bfloat16)
    inputs = check_inputs(q, q, q, mask="t:-1,16", alibi_slopes=torch.ones(4))
    out, lse = torch.empty_like(q), torch.empty(inputs.lse_shape)
    _, _, fwd = hopper.fwd_launches(inputs, out, lse)[-1]
    grads = [torch.empty_like(q) for _ in range(3)]
    _, (_, _, bwd), _ = hopper.bwd_launches(inputs, torch.empty_like(q), out, lse, *grads)
    expected = dict(left=600, right=16, stride_ab=0, stride_ah=1, WINDOW=True, ALIBI=1)
    for kwargs in (fwd, bwd):
        assert {name: kwargs[name] for name in expected} == expected
        assert kwargs["alibi_ptr"] is inputs.alibi_slopes


@pytest.mark.parametrize("head_dim, seqlen, kwargs, persistent", [
    (128, 1000, {}, True),
    (128, 2048, {}, True),
    (128, 4096, {}, False),
    (128, 1024, dict(mask="t"), False),  # causal: measured slower (persistent turns balance worse)
    (128, 2000, dict(mask="t"), False),
    (64, 2048, {}, True),
    (64, 1000, dict(mask="t"), False),  # persistent under a causal mask it spills
    (256, 1000, {}, True),
    (256, 1000, dict(mask="t"), False),  # measured slower
    (128, 1000, dict(alibi_slopes=torch.ones(4)), False),  # ALiBi spills persistent
    # a window alone: persistent where its band is short, whatever the length
    (128, 1000, dict(mask="b:100,0"), True),
    (128, 16384, dict(mask="b:1024,0"), True),
    (64, 16384, dict(mask="t:1024,700"), True),
    (128, 16384, dict(mask="b:3000,0"), False),
    (128, 16384, dict(mask="b:-1,8"), False),
    (128, 2000, dict(mask="b:-1,8"), True),
    (128, 16384, dict(mask="b:1024,0", alibi_slopes=torch.ones(4)), False),
])
def test_short_forwards_run_persistent_ctas(head_dim, seqlen, kwargs, persistent):
    q = torch.empty(2, seqlen, 4, head_dim, dtype=torch.bfloat16)
    assert hopper.fwd_persistent(check_inputs(q, q, q, **kwargs)) is persistent


def test_a_persistent_window_takes_its_consumer_registers():
    q = torch.empty(1, 16384, 4, 128, dtype=torch.bfloat16)
    cfg = hopper.HOPPER_FWD_CONFIGS[128]
    for mask, persistent, regs in (("b:1024,0", True, cfg.persistent_window_regs),
                                   ("b:3000,0", False, cfg.consumer_regs)):
        inputs = check_inputs(q, q, q, mask=mask)
        _, _, kwargs = hopper.fwd_launches(inputs, torch.empty_like(q), torch.empty(inputs.lse_shape))[-1]
        assert (kwargs["PERSISTENT"], kwargs["CONSUMER_REGS"]) == (persistent, regs)


def test_group_mode_forward_runs_one_cta_per_tile():
    packed = torch.empty(1000, 4, 128, dtype=torch.bfloat16)
    starts = torch.tensor([0, 400, 1000], dtype=torch.int32)
    assert not hopper.fwd_persistent(check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts))


@pytest.mark.parametrize("bias_shape", [(64, 64), (4, 64, 64), (2, 1, 64, 64), (2, 4, 64, 64)])
def test_the_forward_takes_a_bias_that_tma_can_read(monkeypatch, bias_shape):
    _on_cuda(monkeypatch)
    inputs = _inputs(bias=torch.empty(bias_shape, dtype=torch.bfloat16))
    assert hopper.fwd_unsupported(inputs) is None
    assert hopper.bwd_unsupported(inputs, deterministic=False) is None
    assert not hopper.fwd_persistent(inputs)


@pytest.mark.parametrize("head_dim, kwargs, reason", [
    (128, dict(deterministic=True), "deterministic mode with an elementwise bias"),
    (256, {}, "elementwise bias at head dim 256"),
    (128, dict(mask="t", nhead_k=2), None),  # the grouped loop under a causal mask
    (128, dict(bias_grad=True), None),
    (64, dict(mask="t", nhead_k=2, bias_grad=True), None),
    (128, dict(nhead_k=2), None),
])
def test_which_biases_the_fast_backward_takes(monkeypatch, head_dim, kwargs, reason):
    _on_cuda(monkeypatch)
    kwargs = dict(kwargs)
    selection = {key: kwargs.pop(key) for key in ("bias_grad", "deterministic") if key in kwargs}
    inputs = _inputs(head_dim=head_dim, bias=torch.empty(4, 64, 64, dtype=torch.bfloat16), **kwargs)
    assert hopper.bwd_unsupported(inputs, **{"deterministic": False, **selection}) == reason


def test_a_config_without_the_bias_gradient_leaves_it_to_the_portable_backward(monkeypatch):
    _on_cuda(monkeypatch)
    monkeypatch.setitem(HOPPER_BWD_CONFIGS, 128, dataclasses.replace(HOPPER_BWD_CONFIGS[128], bias_grad=False))
    inputs = _inputs(head_dim=128, bias=torch.empty(4, 64, 64, dtype=torch.bfloat16))
    assert hopper.bwd_unsupported(inputs, False, bias_grad=True) == "the gradient of an elementwise bias at head dim 128"
    assert hopper.bwd_unsupported(inputs, False) is None


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_backward_reads_the_bias_in_64_row_query_tiles(head_dim):
    bias = torch.empty(4, 1000, 1000, dtype=torch.bfloat16)  # [H, S, S], broadcast over the batch
    q = torch.empty(2, 1000, 4, head_dim, dtype=torch.bfloat16)
    inputs = check_inputs(q, q, q, bias=bias)
    grads = [torch.empty_like(q) for _ in range(3)]
    _, (_, _, kwargs), _ = hopper.bwd_launches(inputs, torch.empty_like(q), torch.empty_like(q),
                                               torch.empty(inputs.lse_shape), *grads)
    assert kwargs["BIAS"] and kwargs["BLOCK_M"] == 64 and (kwargs["bias_step_b"], kwargs["bias_step_h"]) == (0, 1)
    assert kwargs["bias_desc"].shape == [1, 4, 1000, 1000]
    assert kwargs["bias_desc"].block_shape == [1, 1, 64, 64]


@pytest.mark.parametrize("kwargs, reason", [
    (dict(bias=torch.empty(64, 64)), "an elementwise bias of dtype torch.float32, not q's"),
    (dict(bias=torch.empty(64, 1, dtype=torch.bfloat16)), "an elementwise bias without contiguous keys"),
    (dict(bias=torch.empty(1, 64, dtype=torch.bfloat16)), "an elementwise bias without contiguous keys"),
    (dict(bias=torch.empty(64, 72, dtype=torch.bfloat16)[:, :64]), None),
    (dict(bias=torch.empty(64, 68, dtype=torch.bfloat16)[:, :64]), "an elementwise bias without contiguous keys"),
    (dict(head_dim=64, bias=torch.empty(64, 64, dtype=torch.bfloat16)), "elementwise bias at head dim 64"),
    (dict(bias=torch.empty(64, 64, dtype=torch.bfloat16), alibi_slopes=torch.ones(4)),
     "an elementwise bias with ALiBi or a sliding window"),
    (dict(bias=torch.empty(64, 64, dtype=torch.bfloat16), mask="t:16,0"),
     "an elementwise bias with ALiBi or a sliding window"),
])
def test_biases_the_forward_leaves_to_the_portable_kernel(monkeypatch, kwargs, reason):
    _on_cuda(monkeypatch)
    got = hopper.fwd_unsupported(_inputs(**kwargs))
    assert got == reason if reason is None else got.startswith(reason)


def test_bias_descriptor_reads_broadcast_dims_at_coordinate_zero():
    bias = torch.empty(4, 1000, 1000, dtype=torch.bfloat16)  # [H, S, S], broadcast over the batch
    q = torch.empty(2, 1000, 4, 128, dtype=torch.bfloat16)
    inputs = check_inputs(q, q, q, bias=bias)
    _, _, kwargs = hopper.fwd_launches(inputs, torch.empty_like(q), torch.empty(inputs.lse_shape))[-1]
    assert kwargs["BIAS"] and (kwargs["bias_step_b"], kwargs["bias_step_h"]) == (0, 1)
    assert kwargs["bias_desc"].shape == [1, 4, 1000, 1000]
    assert kwargs["bias_desc"].block_shape == [1, 1, 64, 128]


@pytest.mark.parametrize("head_dim, kwargs, mode", [
    (128, {}, 4), (256, {}, 4),  # -slope * |i - j| linearly off the diagonal, its column term by wgmma
    (64, {}, 1),  # (its column terms would spill)
    (128, dict(mask="b:100,0"), 1), (128, dict(dropout_p=0.1), 1),
    (128, dict(mask="t"), 2),  # slope * j
])
def test_forward_alibi_mode(head_dim, kwargs, mode):
    q = torch.empty(2, 1000, 4, head_dim, dtype=torch.bfloat16)
    inputs = check_inputs(q, q, q, alibi_slopes=torch.ones(4), **kwargs)
    _, _, fwd = hopper.fwd_launches(inputs, torch.empty_like(q), torch.empty(inputs.lse_shape),
                                    torch.zeros(2, dtype=torch.int64))[-1]
    assert fwd["ALIBI"] == mode


@pytest.mark.parametrize("head_dim, packed", [(64, False), (128, True), (256, True)])
def test_forward_rounds_p_in_pairs_where_configured(head_dim, packed):
    """P is rounded two elements a cvt at d=128/256; at d=64 that spills (HopperFwdConfig.packed_p)."""
    q = torch.empty(1, 4096, 4, head_dim, dtype=torch.bfloat16)
    inputs = check_inputs(q, q, q)
    _, _, fwd = hopper.fwd_launches(inputs, torch.empty_like(q), torch.empty(inputs.lse_shape))[-1]
    assert fwd["PACKED_P"] is packed


def test_group_mode_forward_with_a_bias_is_left_to_the_portable_kernel():
    packed = torch.empty(100, 4, 128, dtype=torch.bfloat16)
    starts = torch.tensor([0, 40, 100], dtype=torch.int32)
    inputs = check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts,
                          bias=torch.empty(4, 100, 60, dtype=torch.bfloat16))
    assert hopper._problem_reason(inputs, hopper.HOPPER_FWD_CONFIGS, True, True, True) == \
        "elementwise bias in group mode"


@pytest.mark.parametrize("lengths", [[1000, 400], [1, 300, 129, 1000, 64, 1000], [5] * 7, [0, 700, 0, 1300],
                                     [0, 3, 130, 3] * 300])
def test_group_mode_tile_table_lists_every_tile_once_longest_sequence_first(lengths):
    """The table the group-mode forward's CTAs read (runs on the CPU through Triton's interpreter)."""
    from fmha.kernels import INTERPRET
    if not INTERPRET:
        pytest.skip("the tile table kernel runs here through TRITON_INTERPRET=1")
    nhead = 3
    packed = torch.empty(sum(lengths), nhead, 128, dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = check_inputs(packed, packed, packed, seqstart_q=starts, seqstart_k=starts)
    (table_kernel, grid, kwargs), (_, fwd_grid, fwd) = hopper.fwd_launches(
        inputs, torch.empty_like(packed), torch.empty(inputs.lse_shape))
    table_kernel[grid](**kwargs)
    table = kwargs["Table"].tolist()
    assert fwd_grid == (len(table),) and fwd["tiles"] == len(table)
    block_m = 128
    order = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))
    expected = [(b << 40) | (h << 20) | m for b in order for h in range(nhead)
                for m in reversed(range(-(-lengths[b] // block_m)))]
    assert table == expected + [-1] * (len(table) - len(expected))


def _same_launches(got, want):
    """Launches equal argument by argument: tensors the same objects, descriptors the same fields
    over the same tensor, anything else equal."""
    assert len(got) == len(want)
    for (kernel, grid, kwargs), (kernel_w, grid_w, kwargs_w) in zip(got, want):
        assert kernel is kernel_w and grid == grid_w and kwargs.keys() == kwargs_w.keys()
        for name, value in kwargs.items():
            expected = kwargs_w[name]
            if isinstance(expected, torch.Tensor):
                assert value is expected, name
            elif type(expected).__name__ == "TensorDescriptor":
                assert value.base is expected.base, name
                assert {k: f for k, f in vars(value).items() if k != "base"} == \
                    {k: f for k, f in vars(expected).items() if k != "base"}, name
            else:
                assert type(value) is type(expected) and value == expected, name


@pytest.mark.parametrize("head_dim, seqlen, mask, layout", [
    (128, 1000, None, "bshd"), (128, 1024, "t", "bshd"), (64, 3000, "b", "bhsd"), (256, 4096, "t", "bshd"),
    (128, 1000, "b:100,0", "bshd"), (64, 517, None, "bhsd"),
])
def test_a_repeated_plain_forward_is_launched_from_its_plan(head_dim, seqlen, mask, layout):
    """A second problem of the same geometry (other tensors) gets from the plan exactly what the
    launch builder gives it; its descriptors are over its own tensors."""
    def problem():
        shape = (2, seqlen, 4, head_dim) if layout == "bshd" else (2, 4, seqlen, head_dim)
        q, k, v = (torch.empty(shape, dtype=torch.bfloat16) for _ in range(3))
        if layout == "bhsd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        inputs = check_inputs(q, k, v, mask=mask)
        return inputs, torch.empty(inputs.out_shape, dtype=q.dtype), torch.empty(inputs.lse_shape)

    hopper._PLANS.clear()
    first = problem()
    _same_launches(hopper.fwd_launches(*first), hopper._build_fwd_launches(*first))
    plan = hopper._fwd_plan(first[0], _fwd_tensors(*first))
    assert plan is not None and len(hopper._PLANS) == 1
    second = problem()
    assert hopper._fwd_plan(second[0], _fwd_tensors(*second)) is plan
    _same_launches(hopper.fwd_launches(*second), hopper._build_fwd_launches(*second))


def _fwd_tensors(inputs, out, lse):
    return inputs.q, inputs.k, inputs.v, out, lse


def _bwd_problem(head_dim, seqlen, mask, **kwargs):
    """A backward's arguments to ``hopper.bwd_launches``: inputs, dout, out, lse, dq, dk, dv."""
    q, k, v, dout, out = (torch.empty(2, seqlen, 4, head_dim, dtype=torch.bfloat16) for _ in range(5))
    inputs = check_inputs(q, k, v, mask=mask, **kwargs)
    return inputs, dout, out, torch.empty(inputs.lse_shape), *(torch.empty_like(q) for _ in range(3))


@pytest.mark.parametrize("head_dim, seqlen, mask", [
    (128, 1000, None), (64, 1024, "t"), (256, 1000, "b"), (128, 3000, "b:100,0"), (64, 517, None),
])
def test_a_repeated_plain_backward_is_launched_from_its_plan(head_dim, seqlen, mask):
    """The backward's three launches from its plan equal the builder's over the same tensors (its
    workspaces allocated anew each call); one plan per geometry."""
    hopper._PLANS.clear()
    plans = []
    for _ in range(2):
        problem = _bwd_problem(head_dim, seqlen, mask)
        tensors = hopper._bwd_tensors(*problem, False, None)
        plans.append(hopper._bwd_plan(problem[0], tensors, False, None))
        assert plans[-1] is not None
        _same_launches(plans[-1].launches(tensors), hopper._build_bwd_launches(problem[0], tensors, False, None, None))
    assert plans[0] is plans[1] and len(hopper._PLANS) == 1
    launches = hopper.bwd_launches(*_bwd_problem(head_dim, seqlen, mask))
    assert [kernel for kernel, _, _ in launches] == [p.kernel for p in plans[0].planned]


def test_a_planned_forward_calls_its_compiled_kernel_after_the_first_launch(monkeypatch):
    """The first launch of a plan goes through ``launch``; the next ones call the compiled kernel it
    found with the builder's arguments in the kernel's order, until that kernel is no longer
    valid (another device, debug settings, a launch hook)."""
    def problem():
        q, k, v = (torch.empty(2, 1024, 4, 128, dtype=torch.bfloat16) for _ in range(3))
        inputs = check_inputs(q, k, v, mask="t")
        return inputs, torch.empty(inputs.out_shape, dtype=q.dtype), torch.empty(inputs.lse_shape)

    calls, valid = _fake_compiled_launches(monkeypatch)
    for valid[0], expected in ((True, "launch"), (True, "compiled"), (False, "launch")):
        current = problem()
        hopper.launch_fwd(*current)
        (kernel, grid, kwargs), = hopper._build_fwd_launches(*current)
        (how, got_grid, args), = calls
        calls.clear()
        assert how == expected and got_grid == grid
        _same_launches([(kernel, grid, _as_kwargs(how, kernel, args))],
                       [(kernel, grid, _as_kwargs(how, kernel, kwargs))])


def test_a_planned_backward_calls_its_compiled_kernels_after_the_first_launch(monkeypatch):
    calls, _ = _fake_compiled_launches(monkeypatch)
    made = []
    real_tensors = hopper._bwd_tensors
    monkeypatch.setattr(hopper, "_bwd_tensors", lambda *a: made.append(real_tensors(*a)) or made[-1])
    for expected in ("launch", "compiled"):
        problem = _bwd_problem(128, 1024, "t")
        hopper.launch_bwd(*problem)
        want = hopper._build_bwd_launches(problem[0], made[-1], False, None, None)
        assert [how for how, _, _ in calls] == [expected] * 3
        for (how, grid, args), (kernel, grid_w, kwargs) in zip(calls, want):
            _same_launches([(kernel, grid, _as_kwargs(how, kernel, args))],
                           [(kernel, grid_w, _as_kwargs(how, kernel, kwargs))])
        calls.clear()


def _fake_compiled_launches(monkeypatch):
    """Record the fast path's launches as ("launch", grid, kwargs) through ``launch`` or
    ("compiled", grid, args in launch order) straight through a compiled kernel, which is valid
    while the returned flag's one item is true; no plans at the start."""
    calls, valid = [], [True]
    compiled = object()
    monkeypatch.setattr(hopper, "launch", lambda kernel, grid, kwargs: calls.append(("launch", grid, kwargs)))
    monkeypatch.setattr(hopper, "compiled_for", lambda kernel, kwargs: (compiled, _param_names(kernel)))
    monkeypatch.setattr(hopper, "still_valid", lambda found: found is compiled and valid[0])
    monkeypatch.setattr(hopper, "run_compiled", lambda found, grid, args: calls.append(("compiled", grid, args)))
    hopper._PLANS.clear()
    return calls, valid


def _as_kwargs(how: str, kernel, args) -> dict:
    """A recorded launch's arguments by name; a compiled launch has the kernel's parameters only
    (the options, num_warps and maxnreg, are the compiled kernel's), so a builder's keyword
    arguments (a dict) are cut to those."""
    if how == "launch":
        return args
    names = _param_names(kernel)
    if isinstance(args, dict):
        return {name: args[name] for name in names}
    return dict(zip(names, args, strict=True))


def _param_names(kernel):
    """A kernel's parameter names (on the CPU the Triton ones are the interpreter's functions)."""
    return [p.name for p in kernel.params] if hasattr(kernel, "params") else kernel.arg_names


def test_a_plan_built_from_one_tensor_as_q_k_and_v_does_not_serve_three():
    """Plans find their arguments' tensors by identity: which tensors are one object is part of
    the signature, in both directions."""
    hopper._PLANS.clear()
    x = torch.empty(2, 1024, 4, 128, dtype=torch.bfloat16)
    same = check_inputs(x, x, x, mask="t")
    hopper.fwd_launches(same, torch.empty_like(x), torch.empty(same.lse_shape))
    hopper.bwd_launches(same, *(torch.empty_like(x) for _ in range(2)), torch.empty(same.lse_shape),
                        *(torch.empty_like(x) for _ in range(3)))
    first = _bwd_problem(128, 1024, "t")
    inputs = first[0]
    out, lse = torch.empty_like(inputs.q), torch.empty(inputs.lse_shape)
    _same_launches(hopper.fwd_launches(inputs, out, lse), hopper._build_fwd_launches(inputs, out, lse))
    tensors = hopper._bwd_tensors(*first, False, None)
    plan = hopper._bwd_plan(inputs, tensors, False, None)
    _same_launches(plan.launches(tensors), hopper._build_bwd_launches(inputs, tensors, False, None, None))
    assert len(hopper._PLANS) == 4


def test_plans_are_not_used_for_features_or_after_a_config_changes(monkeypatch):
    q = torch.empty(2, 1000, 4, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 1000)
    for kwargs in (dict(alibi_slopes=torch.ones(4)), dict(dropout_p=0.1), dict(bias=torch.empty(4, 1000, 1000,
                                                                                                dtype=q.dtype))):
        inputs = check_inputs(q, q, q, **kwargs)
        assert hopper._plain_signature(inputs, (q, q, q, torch.empty_like(q), lse)) is None
        problem = _bwd_problem(128, 1000, None, **kwargs)
        assert hopper._bwd_plan(problem[0], hopper._bwd_tensors(*problem, False, None), False, None) is None
    misaligned = torch.empty(2 * 1000 * 4 * 128 + 1, dtype=q.dtype)[1:].view(q.shape)
    assert hopper._plain_signature(check_inputs(misaligned, q, q), (misaligned, q, q, torch.empty_like(q), lse)) is None
    problem = _bwd_problem(128, 1000, None)
    for deterministic, dbias_t in ((True, None), (False, torch.empty(2, 4, 1000, 1000, dtype=q.dtype))):
        tensors = hopper._bwd_tensors(*problem, deterministic, dbias_t)
        assert hopper._bwd_plan(problem[0], tensors, deterministic, dbias_t) is None
    inputs, out = check_inputs(q, q, q), torch.empty_like(q)
    hopper.fwd_launches(inputs, out, lse)
    hopper.bwd_launches(*problem)
    monkeypatch.setitem(hopper.HOPPER_FWD_CONFIGS, 128, dataclasses.replace(hopper.HOPPER_FWD_CONFIGS[128], stages=3))
    monkeypatch.setitem(hopper.HOPPER_BWD_CONFIGS, 128, dataclasses.replace(hopper.HOPPER_BWD_CONFIGS[128], stages=3))
    _, _, kwargs = hopper.fwd_launches(inputs, out, lse)[-1]
    assert kwargs["STAGES"] == 3
    _, (_, _, kwargs), _ = hopper.bwd_launches(*problem)
    assert kwargs["STAGES"] == 3
