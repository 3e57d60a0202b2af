"""Every bad input raises ValueError naming the argument, what was expected and what was given."""

from unittest import mock

import pytest
import torch

import fmha
import fmha.inputs
from fmha.testing import prefix_sums


def qkv(b=2, sq=8, sk=8, hq=4, hk=2, d=16, dv=16, dtype=torch.float16):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, dv, dtype=dtype))


def packed(total_q=10, total_k=12, hq=2, hk=1, d=16):
    return (torch.randn(total_q, hq, d, dtype=torch.float16), torch.randn(total_k, hk, d, dtype=torch.float16),
            torch.randn(total_k, hk, d, dtype=torch.float16))


def expect_error(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    assert "expected" in str(info.value)


Q, K, V = qkv()


BATCH_ERRORS = [
    ((Q[0], K, V), {}, r"^q: expected a 4-D tensor"),
    ((Q, K.float(), V), {}, r"^k: expected dtype torch.float16 \(as q\), got torch.float32"),
    ((Q.int(), K.int(), V.int()), {}, r"^q: expected dtype float16, bfloat16, float32 or float64"),
    ((Q.to("meta"), K, V), {}, r"^k: expected a tensor on meta"),
    ((Q, K[..., :8], V), {}, r"^k head dim: expected 16 \(q's head dim\), got 8"),
    ((Q, K, V[:, :4]), {}, r"^v shape: expected"),
    ((*qkv(hq=4, hk=3),), {}, r"^nhead_k: expected a divisor of nhead_q=4, got 3"),
    ((*qkv(d=300, dv=16),), {}, r"^q head dim: expected 1..256, got 300"),
    ((*qkv(dv=257),), {}, r"^v head dim: expected 1..256, got 257"),
    ((Q, K[:1], V[:1]), {}, r"^k batch: expected 2 \(q's batch\), got 1"),
    ((Q, K, V), {"dropout_p": 1.0}, r"^dropout_p: expected a float in \[0, 1\), got 1.0"),
    ((Q, K, V), {"dropout_p": -0.1}, r"^dropout_p: expected a float in \[0, 1\)"),
    ((Q, K, V), {"scale": float("nan")}, r"^scale: expected a finite float"),
    ((Q, K, V), {"bias": torch.randn(3, 8, 8)}, r"^bias: expected a shape that broadcasts to \(2, 4, 8, 8\), got \(3, 8, 8\)"),
    ((Q, K, V), {"bias": torch.randn(1, 2, 4, 8, 8)}, r"^bias: expected a shape that broadcasts"),
    ((Q, K, V), {"bias": torch.randn(8, 8, dtype=torch.float64)}, r"^bias: expected dtype torch.float16 \(as q\) or torch.float32"),
    ((Q, K, V), {"alibi_slopes": torch.ones(3)}, r"^alibi_slopes: expected shape \(4,\) or \(2, 4\), got \(3,\)"),
    ((Q, K, V), {"alibi_slopes": torch.ones(4, dtype=torch.float16)}, r"^alibi_slopes: expected a float32 tensor"),
    ((Q, K, V), {"mask": "q:1,2"}, r"^mask: expected one of"),
    ((Q, K, V), {"mask": "t:1"}, r"^mask: expected 't:left,right' with two integers, got '1'"),
    ((Q, K, V), {"mask": 3}, r"^mask: expected a mask string or fmha.Mask, got int"),
    ((Q, K, V), {"seed": -1, "dropout_p": 0.1}, r"^seed: expected an integer in \[0, 2\^64\)"),
    ((Q, K, V), {"offset": torch.ones(2, dtype=torch.int64), "dropout_p": 0.1}, r"^offset: expected a one-element int64 tensor"),
    ((Q, K, V), {"cu_seqlen_q": torch.tensor([0, 3, 12], dtype=torch.int32)}, r"^cu_seqlen_q: expected prefix sums from 0 of lengths in \[0, 8\]"),
    ((Q, K, V), {"cu_seqlen_k": torch.tensor([0, 3], dtype=torch.int32)}, r"^cu_seqlen_k: expected an int32 tensor of shape \(3,\)"),
    ((Q, K, V), {"cu_seqlen_k": torch.tensor([0, 3, 5])}, r"^cu_seqlen_k: expected an int32 tensor"),
    ((Q, K, V), {"seqlen_k": torch.tensor([3, 5], dtype=torch.int32)}, r"^seqlen_k: expected None in batch mode"),
    ((Q, K, V), {"out": torch.empty(2, 8, 4, 8, dtype=torch.float16)}, r"^out: expected a tensor of shape \(2, 8, 4, 16\)"),
]


@pytest.mark.parametrize("args,kwargs,match", BATCH_ERRORS)
def test_batch_mode_errors(args, kwargs, match):
    expect_error(match, fmha.fwd, *args, **kwargs)


P_Q, P_K, P_V = packed()
STARTS_Q = prefix_sums([4, 6])
STARTS_K = prefix_sums([5, 7])


GROUP_ERRORS = [
    ({"seqstart_q": torch.tensor([0, 6, 4], dtype=torch.int32)}, r"^seqstart_q: expected non-decreasing prefix sums"),
    ({"seqstart_q": torch.tensor([1, 4, 10], dtype=torch.int32)}, r"^seqstart_q: expected non-decreasing prefix sums starting at 0"),
    ({"seqstart_q": prefix_sums([4, 9])}, r"^seqstart_q: expected non-decreasing starts with each sequence inside q \(10 rows\)"),
    ({"seqstart_k": prefix_sums([5, 9])}, r"^seqstart_k: expected non-decreasing starts with each sequence inside k \(12 rows\)"),
    ({"seqstart_k": prefix_sums([5])}, r"^seqstart_k: expected an int32 tensor of shape \(3,\)"),
    ({"seqlen_k": torch.tensor([5, 8], dtype=torch.int32)}, r"^seqlen_k: expected non-decreasing starts with each sequence inside k"),
    ({"seqlen_k": torch.tensor([5], dtype=torch.int32)}, r"^seqlen_k: expected an int32 tensor of shape \(2,\)"),
    ({"seqstart_padded_q": torch.tensor([0, 3, 10], dtype=torch.int32)}, r"^seqstart_padded_q: expected non-decreasing starts"),
    ({"seqstart_padded_k": prefix_sums([5, 9])}, r"^seqstart_padded_k: expected non-decreasing starts"),
    ({"max_seqlen_q": 5}, r"^max_seqlen_q: expected at least the longest sequence \(6\), got 5"),
    ({"cu_seqlen_q": STARTS_Q}, r"^cu_seqlen_q/cu_seqlen_k: expected None in group mode"),
    ({"bias": torch.randn(2, 10, 9)}, r"^bias: expected a shape that broadcasts to \(2, 10, 7\)"),
]


@pytest.mark.parametrize("kwargs,match", GROUP_ERRORS)
def test_group_mode_errors(kwargs, match):
    args = dict(seqstart_q=STARTS_Q, seqstart_k=STARTS_K)
    args.update(kwargs)
    expect_error(match, fmha.fwd, P_Q, P_K, P_V, **args)


def test_group_mode_needs_both_seqstarts_and_3d_tensors():
    expect_error(r"^seqstart_q/seqstart_k: expected both tensors", fmha.fwd, P_Q, P_K, P_V, seqstart_q=STARTS_Q)
    expect_error(r"^q: expected a 3-D tensor \[total, H, D\]", fmha.fwd, Q, K, V, seqstart_q=STARTS_Q,
                 seqstart_k=STARTS_K)


def test_an_index_tensor_is_read_once_per_version(monkeypatch):
    """Reading a CUDA index tensor waits for the GPU: the same tensor, unchanged, is not read again,
    and an in-place write (which bumps its version) is seen at the next call."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    starts = torch.tensor([0, 3, 7], dtype=torch.int32)
    first = fmha.inputs.check_inputs(P_Q, P_K, P_V, seqstart_q=starts, seqstart_k=starts)
    again = fmha.inputs.check_inputs(P_Q, P_K, P_V, seqstart_q=starts, seqstart_k=starts)
    assert len(reads) == 1 and (first.max_seqlen_q, first.lse_rows) == (again.max_seqlen_q, again.lse_rows) == (4, 7)
    starts[1] = 5  # lengths 5 and 2
    assert fmha.inputs.check_inputs(P_Q, P_K, P_V, seqstart_q=starts, seqstart_k=starts).max_seqlen_q == 5
    starts[2] = 4  # a negative length
    expect_error(r"^seqstart_q: expected non-decreasing prefix sums", fmha.inputs.check_inputs, P_Q, P_K, P_V,
                 seqstart_q=starts, seqstart_k=starts)
    assert len(reads) == 3
    copy = starts.clone()  # another tensor with the same values is read for itself
    expect_error(r"^seqstart_q", fmha.inputs.check_inputs, P_Q, P_K, P_V, seqstart_q=copy, seqstart_k=copy)
    assert len(reads) == 4


def test_errors_come_before_any_kernel(monkeypatch):
    """Validation happens first: a bad argument never reaches the launcher."""
    from fmha import ops

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(ops, "fwd", no_launch)
    expect_error(r"^dropout_p", fmha.attention, Q, K, V, dropout_p=2.0)
    expect_error(r"^bias", fmha.attention, Q, K, V, bias=torch.randn(5, 5))


OUT = torch.empty(2, 8, 4, 16, dtype=torch.float16)
LSE = torch.empty(2, 4, 8)
BWD_ERRORS = [
    ((OUT[:, :4], Q, K, V, OUT, LSE), {}, r"^dout: expected a tensor of shape \(2, 8, 4, 16\)"),
    ((OUT, Q, K, V, OUT[..., :8], LSE), {}, r"^out: expected a tensor of shape \(2, 8, 4, 16\)"),
    ((OUT, Q, K, V, OUT, LSE[:, :1]), {}, r"^lse: expected a tensor of shape \(2, 4, 8\)"),
    ((OUT, Q, K, V, OUT, LSE.half()), {}, r"^lse: expected torch.float32"),
    ((OUT, Q, K, V, OUT.float(), LSE), {}, r"^out: expected torch.float16"),
    ((OUT, Q, K, V, OUT, LSE), {"dropout_p": 0.1}, r"^seed/offset: expected the forward's dropout seed and offset"),
]


@pytest.mark.parametrize("args,kwargs,match", BWD_ERRORS)
def test_bwd_errors(args, kwargs, match):
    expect_error(match, fmha.bwd, *args, **kwargs)


# Where the kernels are compiled for the GPU (no interpreter), CPU tensors are refused up front.
DEVICE_ERRORS = [
    ("fmha.attention", fmha.attention, (Q, K, V)),
    ("fmha.bwd", fmha.bwd, (OUT, Q, K, V, OUT, LSE)),
]


@pytest.mark.parametrize("call", DEVICE_ERRORS, ids=[name for name, _, _ in DEVICE_ERRORS])
def test_cpu_tensors_need_the_interpreter(call, monkeypatch):
    monkeypatch.setattr(fmha.inputs, "INTERPRET", False)
    _, fn, args = call
    expect_error(r"^q: expected a CUDA tensor \(CPU tensors run only in Triton's interpreter", fn, *args)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        text = f"{value.dtype}".removeprefix("torch.") + str(tuple(value.shape))
        if value.device.type != "cpu":
            text += f" on {value.device.type}"
        if value.dim() == 1 and value.numel() <= 4 and value.device.type == "cpu" and not value.is_floating_point():
            text += " " + str(value.tolist())
        return text
    return repr(value)


def _rows():
    """(call, the input as the test passes it, the message) for every rejection above."""
    calls = [("fmha.fwd", fmha.fwd, args, kwargs, ("q", "k", "v")) for args, kwargs, _ in BATCH_ERRORS]
    group_base = dict(seqstart_q=STARTS_Q, seqstart_k=STARTS_K)
    calls += [("fmha.fwd (group)", fmha.fwd, (P_Q, P_K, P_V), {**group_base, **kwargs}, ("q", "k", "v"))
              for kwargs, _ in GROUP_ERRORS]
    calls += [("fmha.bwd", fmha.bwd, args, kwargs, ("dout", "q", "k", "v", "out", "lse"))
              for args, kwargs, _ in BWD_ERRORS]
    calls += [(f"{name} (GPU build)", fn, args, {}, ("dout", "q", "k", "v", "out", "lse") if name == "fmha.bwd"
               else ("q", "k", "v")) for name, fn, args in DEVICE_ERRORS]
    for name, fn, args, kwargs, arg_names in calls:
        given = [f"{n}={_describe(a)}" for n, a in zip(arg_names, args)]
        given += [f"{k}={_describe(v)}" for k, v in kwargs.items()]
        try:
            with mock.patch.object(fmha.inputs, "INTERPRET", fmha.inputs.INTERPRET and "GPU build" not in name):
                fn(*args, **kwargs)
        except ValueError as exc:
            yield name, ", ".join(given), str(exc)


def render_table() -> str:
    lines = [
        "# Inputs fmha rejects",
        "",
        "Every row is a case of `tests/test_inputs.py`, which checks the message and that this table",
        "is current (`python tests/test_inputs.py` rewrites it). Each message names the argument, what",
        "was expected and what was given; all are `ValueError`s raised before any kernel runs.",
        "",
        "| call | input | message |",
        "|---|---|---|",
    ]
    for call, given, message in _rows():
        cell = message.replace("|", "\\|")
        lines.append(f"| `{call}` | {given.replace('|', chr(92) + '|')} | {cell} |")
    return "\n".join(lines) + "\n"


DOCS_TABLE = __import__("pathlib").Path(__file__).resolve().parent.parent / "docs" / "rejected-inputs.md"


def test_docs_table_is_current():
    assert len(list(_rows())) == len(BATCH_ERRORS) + len(GROUP_ERRORS) + len(BWD_ERRORS) + len(DEVICE_ERRORS)
    assert DOCS_TABLE.read_text() == render_table(), "docs/rejected-inputs.md is stale: python tests/test_inputs.py"


if __name__ == "__main__":
    DOCS_TABLE.write_text(render_table())
