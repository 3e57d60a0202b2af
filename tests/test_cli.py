"""The ``fmha`` command line: CK's fwd and bwd flags and result lines, validation, ``check``, ``bench``.

Without a GPU every run goes through Triton's interpreter, so the problems stay tiny.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

import fmha
from fmha import cli

RESULT_LINE = re.compile(
    r"^\[(fp16|bf16|fp32)\|(batch|group)\|(bhsd|bshd)(-(bhsd|bshd))?\] b:\d+, h:\d+/\d+, "
    r"s:\d+/\d+(\(\d+\))?, d:\d+/\d+, scale_s:[0-9.e+-]+, bias:(n|e|e\[\d\]|alibi|alibi\[\d\]), "
    r"p_drop:[0-9.]+, lse:[01], squant:0, mask:(n|[tb]\(-?\d+:-?\d+\)), v:r, "
    r"\d+\.\d{3} ms, \d+\.\d{2} TFlops, \d+\.\d{2} GB/s(, valid:[yn])?$"
)


def fwd(capsys, *flags: str) -> tuple[int, str, str]:
    """``fmha fwd <flags>`` in-process: (exit code, the result line, stderr)."""
    code = cli.main(["fwd", *flags])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    return code, lines[-1] if lines else "", captured.err


def problem(*flags: str) -> cli.FwdProblem:
    return cli.fwd_problem(cli.parse_ck_flags(list(flags), cli.FWD))


@pytest.fixture
def fwd_calls(monkeypatch):
    """Record the arguments of every ``fmha.fwd`` call the command line makes."""
    calls = []
    real = fmha.fwd

    def spy(q, k, v, **kwargs):
        calls.append(dict(q=q, k=k, v=v, **kwargs))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fmha, "fwd", spy)
    return calls


def test_default_problem_prints_ck_line(capsys):
    code = cli.main(["fwd"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    if torch.cuda.is_available():
        expected = "[fp16|batch|bhsd] b:2, h:8/8, s:3328/3328, d:128/128, scale_s:0.0883883,"
        assert lines[-1].startswith(expected)
    else:
        assert lines[0] == cli.NO_CUDA_NOTE
        assert lines[-1].startswith("[fp16|batch|bhsd] b:1, h:2/2, s:100/100, d:64/64, scale_s:0.125,")
    assert RESULT_LINE.match(lines[-1]), lines[-1]
    assert lines[-1].endswith(", valid:y")
    assert ", bias:n, p_drop:0, lse:0, squant:0, mask:n, v:r, " in lines[-1]


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "fmha", "fwd", "-b=1", "-h=1", "-s=17", "-d=16"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[-1]
    assert RESULT_LINE.match(line), line
    assert line.startswith("[fp16|batch|bhsd] b:1, h:1/1, s:17/17, d:16/16, scale_s:0.25,")
    assert line.endswith("valid:y")


def test_group_mode_with_padding_and_mask(capsys, fwd_calls):
    code, line, _ = fwd(capsys, "-mode=1", "-b=2", "-h=2", "-s=3,17", "-s_k=20,9", "-s_kpad=24,16",
                        "-d=16", "-mask=b")
    assert code == 0
    assert RESULT_LINE.match(line), line
    assert line.startswith("[fp16|group|bhsd] b:2, h:2/2, s:3/20(24), d:16/16,")
    assert "mask:b(-1:0)" in line and line.endswith("valid:y")
    call = fwd_calls[-1]
    assert call["seqstart_q"].tolist() == [0, 3, 20]
    assert call["seqstart_k"].tolist() == [0, 20, 29]  # logical
    assert call["seqstart_padded_k"].tolist() == [0, 24, 40]  # physical
    assert "seqstart_padded_q" not in call
    assert call["k"].shape == (40, 2, 16)
    assert call["q"].transpose(0, 1).is_contiguous()  # bhsd memory: [H, total, D]


def test_group_lengths_repeat_the_last_value():
    p = problem("-mode=1", "-b=3", "-s=3,17", "-s_qpad=8,20")
    assert p.lens_q == [3, 17, 17]
    assert p.lens_k == [3, 17, 17]
    assert p.slots_q == [8, 20, 20]
    assert p.ragged_q and not p.ragged_k


@pytest.mark.parametrize("bias, shown, key, shape", [
    ("e", "bias:e", "bias", (1, 1, 9, 12)),
    ("a:1", "bias:alibi[1]", "alibi_slopes", (2, 3)),
])
def test_bias_and_alibi(capsys, fwd_calls, bias, shown, key, shape):
    code, line, _ = fwd(capsys, "-b=2", "-h=3", "-s=9", "-s_k=12", "-d=16", "-mask=t", f"-bias={bias}")
    assert code == 0 and line.endswith("valid:y"), line
    assert f", {shown}, " in line
    value = fwd_calls[-1][key]
    assert tuple(value.shape) == shape
    if key == "alibi_slopes":
        assert torch.equal(value[1], fmha.alibi_slopes(3))
    else:
        assert value.dtype == torch.float16


def test_group_mode_bias_is_one_matrix_over_padded_rows(fwd_calls, capsys):
    code, line, _ = fwd(capsys, "-mode=1", "-b=2", "-h=1", "-s=3,5", "-s_qpad=4,8", "-s_k=7,2", "-d=16",
                        "-bias=e")
    assert code == 0 and line.endswith("valid:y"), line
    assert tuple(fwd_calls[-1]["bias"].shape) == (1, 12, 7)  # [1, total_q physical, max seqlen_k]


def test_dropout_with_device_seed_and_offset(capsys, fwd_calls):
    code, line, _ = fwd(capsys, "-b=1", "-h=2", "-s=40", "-d=16", "-p_drop=0.2", "-drop_prefs=1",
                        "-drop_seed=123456789012", "-drop_offset=77")
    assert code == 0 and line.endswith("valid:y"), line
    assert ", p_drop:0.2, " in line
    call = fwd_calls[-1]
    assert call["return_randval"] and call["dropout_p"] == 0.2
    for name, value in (("seed", 123456789012), ("offset", 77)):
        assert call[name].dtype == torch.int64 and call[name].tolist() == [value]


def test_input_and_output_layouts(capsys, fwd_calls):
    code, line, _ = fwd(capsys, "-b=2", "-h=2", "-s=9", "-d=16", "-iperm=0", "-operm=1")
    assert code == 0 and line.endswith("valid:y"), line
    assert line.startswith("[fp16|batch|bshd-bhsd] ")
    call = fwd_calls[-1]
    assert call["q"].is_contiguous() and call["v"].is_contiguous()  # b*s*h*d memory
    assert call["out"].transpose(1, 2).is_contiguous()  # b*h*s*d memory
    assert not call["out"].is_contiguous()


def test_lse_is_returned_and_checked(capsys, fwd_calls):
    code, line, _ = fwd(capsys, "-b=1", "-h=2", "-s=5", "-s_k=3", "-d=16", "-mask=b", "-lse=1")
    assert code == 0 and line.endswith("valid:y"), line
    assert ", lse:1, " in line
    assert fwd_calls[-1]["return_lse"] is True


def test_effective_lengths_in_batch_mode(capsys, fwd_calls):
    code, line, _ = fwd(capsys, "-b=3", "-h=1", "-s=20", "-s_k=30", "-d=16", "-lse=1",
                        "-q_eff_lens=5,20", "-kv_eff_lens=30,3,0")
    assert code == 0 and line.endswith("valid:y"), line
    assert line.startswith("[fp16|batch|bhsd] b:3, h:1/1, s:20/30, ")
    call = fwd_calls[-1]
    assert call["cu_seqlen_q"].tolist() == [0, 5, 25, 45]
    assert call["cu_seqlen_k"].tolist() == [0, 30, 33, 33]
    assert call["q"].shape == (3, 20, 1, 16)


@pytest.mark.parametrize("prec", ["bf16", "fp32"])
def test_other_precisions(capsys, fwd_calls, prec):
    code, line, _ = fwd(capsys, f"-prec={prec}", "-b=1", "-h=2", "-s=20", "-d=16", "-init=nf")
    assert code == 0 and line.endswith("valid:y"), line
    assert line.startswith(f"[{prec}|batch|bhsd] ")
    assert fwd_calls[-1]["q"].dtype == cli.DTYPES[prec]


def test_ck_flags_without_effect_are_accepted(capsys):
    code, line, _ = fwd(capsys, "-b=1", "-h=1", "-s=8", "-d=16", "-vlayout=r", "-kname=1", "-timer=cpu",
                        "-num_splits=1", "-v=0")
    assert code == 0
    assert RESULT_LINE.match(line) and "valid" not in line, line


def test_json_record(capsys, tmp_path):
    path = tmp_path / "fwd.json"
    code, line, _ = fwd(capsys, "-b=1", "-h=1", "-s=17", "-d=16", "-mask=t", "-json=1", f"-jsonfile={path}")
    assert code == 0
    record = json.loads(path.read_text())
    assert record["line"] == line
    assert record["valid"] is True
    assert record["flags"]["s"] == "17" and record["flags"]["mask"] == "t"
    assert record["flop"] == cli.fwd_flops(fmha.parse_mask("t"), [17], [17], 1, 16, 16)
    assert record["tflops"] == pytest.approx(record["flop"] / 1e9 / record["ms"])
    assert record["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert record["torch"] == torch.__version__ and record["fmha"] == fmha.__version__


@pytest.mark.parametrize("flag, message", [
    ("-foo=1", "unknown flag -foo; valid flags: -v -mode -b"),
    ("-b=x", "-b: expected an integer, got 'x'"),
    ("b=2", "expected -name=value, got 'b=2'"),
    ("-p_drop=1.5", "-p_drop: expected a probability in [0, 1)"),
    ("-vlayout=c", "fmha has no column-major V"),
    ("-prec=fp8", "-prec: expected fp16, bf16 or fp32"),
    ("-mask=q", "-mask: expected one of"),
    ("-bias=x", "-bias: expected n, e, e:1, e:2, a or a:1"),
])
def test_bad_flags_are_rejected(capsys, flag, message):
    code, line, err = fwd(capsys, flag)
    assert code == 2
    assert message in err
    assert not RESULT_LINE.match(line)


def test_help_lists_flags_with_defaults(capsys):
    assert cli.main(["fwd", "-?"]) == 0
    out = capsys.readouterr().out
    for text in ("-s=3328", "-mask=0", "-init=uf", "-jsonfile=fmha_fwd.json", "-q_eff_lens="):
        assert text in out


@pytest.mark.parametrize("part, flags", [
    ("out", ()),
    ("lse", ("-lse=1",)),
    ("randval", ("-p_drop=0.2",)),
])
def test_validation_catches_a_wrong_output(capsys, monkeypatch, part, flags):
    real = fmha.fwd

    def wrong(*args, **kwargs):
        result = real(*args, **kwargs)
        getattr(result, part)[0, 0, 0] += 1
        return result

    monkeypatch.setattr(fmha, "fwd", wrong)
    code, line, _ = fwd(capsys, "-b=1", "-h=1", "-s=8", "-d=16", *flags)
    assert line.endswith("valid:n"), line
    assert code == 1


def test_flops_count_the_visible_area():
    # Causal top-left, sq = sk = 4: 1 + 2 + 3 + 4 = 10 visible pairs.
    assert cli.fwd_flops(fmha.parse_mask("t"), [4], [4], 3, 16, 8) == 2 * 3 * 10 * (16 + 8)
    assert cli.fwd_flops(fmha.parse_mask("0"), [4, 2], [5, 3], 1, 8, 8) == 2 * (20 + 6) * 16
    # b:4,35 with sq=99, sk=32: row i sees i-71 <= j <= i-32 (SPEC section 3), counted by hand.
    area = sum(1 for i in range(99) for j in range(32) if i - 71 <= j <= i - 32)
    assert cli.fwd_flops(fmha.parse_mask("b:4,35"), [99], [32], 1, 16, 16) == 2 * area * 32


def test_line_rates_use_the_visible_flops_and_logical_bytes():
    result = cli.run_fwd(problem("-b=1", "-h=2", "-s=4", "-d=16", "-mask=t", "-warmup=0", "-repeat=1"))
    assert result.valid is True
    assert result.flop == 2 * 2 * 10 * (16 + 16)
    assert result.bytes == (2 * 4 * 32 + 2 * 4 * 32) * 2
    assert result.tflops == pytest.approx(result.flop / 1e9 / result.ms)
    assert result.gb_per_s == pytest.approx(result.bytes / 1e6 / result.ms)


def test_check_fwd_runs_the_first_cases(capsys):
    assert cli.main(["check", "fwd", "--limit", "3", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "3/3 passed"
    assert len(lines) == 4
    for line in lines[:3]:
        assert RESULT_LINE.match(line) and line.endswith("valid:y"), line


def test_check_fwd_in_worker_processes_with_filter_and_log(capsys, tmp_path):
    log = tmp_path / "check.log"
    code = cli.main(["check", "fwd", "--filter", "mask:b(4:35)", "--limit", "2", "--jobs", "2",
                     "--log", str(log)])
    out = capsys.readouterr().out
    assert code == 0
    assert log.read_text() == out
    lines = out.splitlines()
    assert lines[-1] == "2/2 passed"
    assert all("s:99/32" in line and "mask:b(4:35)" in line for line in lines[:2])


def test_smoke_matrix_matches_ck():
    cases = cli.fwd_smoke_cases()
    assert len(cases) == len(set(cases)) == 2 * 2 * 2 * 4 * 2 * 3 * 2 * 9
    assert cases[0] == ("-prec=fp16 -mode=0 -iperm=0 -operm=0 -b=2 -h=2 -h_k=1 -d=16 -d_v=32 -s=55 "
                        "-s_k=256 -lse=0 -bias=n -p_drop=0 -v=1 -warmup=0 -repeat=1")
    # s_kpad only pads in group mode.
    padded = [problem(*case.split()) for case in cases if "-s_kpad=32" in case]
    assert {(p.group, tuple(p.slots_k)) for p in padded} == {(False, (10,)), (True, (32,))}


def test_check_with_no_matching_case_fails(capsys):
    assert cli.main(["check", "fwd", "--filter", "no such case"]) == 1
    assert capsys.readouterr().out.splitlines() == ["0/0 passed"]


def test_bench_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--head-dims", "64", "--direction", "fwd"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# fmha bwd

BWD_RESULT_LINE = re.compile(
    r"^\[(fp16|bf16|fp32)\|(batch|group)\|(bhsd|bshd)(-(bhsd|bshd))?\] b:\d+, h:\d+/\d+, "
    r"s:\d+/\d+(\(\d+\))?, d:\d+/\d+, scale:[0-9.e+-]+, bias:(n|e|e\[\d\]|alibi|alibi\[\d\]), "
    r"dbias:[01], p_drop:[0-9.]+, s_randval:[01], deterministic:[01], mask:(n|[tb]\(-?\d+:-?\d+\)), "
    r"\d+\.\d{3} ms, \d+\.\d{2} TFlops, \d+\.\d{2} GB/s(, valid:[yn])?$"
)
SMALL_BWD = ("-b=1", "-h=2", "-s=20", "-d=16")


def bwd(capsys, *flags: str) -> tuple[int, str, str]:
    """``fmha bwd <flags>`` in-process: (exit code, the result line, stderr)."""
    code = cli.main(["bwd", *flags])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    return code, lines[-1] if lines else "", captured.err


def bwd_problem(*flags: str) -> cli.BwdProblem:
    return cli.bwd_problem(cli.parse_ck_flags(list(flags), cli.BWD))


@pytest.fixture
def bwd_calls(monkeypatch):
    """Record the arguments and results of every ``fmha.bwd`` call the command line makes."""
    calls = []
    real = fmha.bwd

    def spy(dout, q, k, v, out, lse, **kwargs):
        grads = real(dout, q, k, v, out, lse, **kwargs)
        calls.append(dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, grads=grads, **kwargs))
        return grads

    monkeypatch.setattr(fmha, "bwd", spy)
    return calls


def test_bwd_default_problem_prints_ck_line(capsys, bwd_calls):
    code = cli.main(["bwd"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert BWD_RESULT_LINE.match(lines[-1]), lines[-1]
    if torch.cuda.is_available():
        expected = "[fp16|batch|bhsd] b:2, h:8/8, s:3328/3328, d:128/128, scale:0.0883883, bias:n, "
    else:
        assert lines[0] == cli.NO_CUDA_NOTE
        expected = "[fp16|batch|bhsd] b:1, h:2/2, s:64/64, d:32/32, scale:0.176777, bias:n, "
    assert lines[-1].startswith(expected + "dbias:0, p_drop:0, s_randval:0, deterministic:0, mask:n, ")
    assert lines[-1].endswith(", valid:y")
    assert len(bwd_calls) == (25 if torch.cuda.is_available() else 1)  # warmup + repeat
    call = bwd_calls[-1]
    assert call["deterministic"] is False and "bias" not in call
    assert call["dout"].transpose(1, 2).is_contiguous()  # -operm=1: b*h*s*d memory, like out
    assert call["out"].transpose(1, 2).is_contiguous()


def test_bwd_group_mode_with_padding_and_mask(capsys, bwd_calls):
    code, line, _ = bwd(capsys, "-mode=1", "-b=2", "-h=2", "-h_k=1", "-s=13,7", "-s_k=20,9", "-s_kpad=24,16",
                        "-d=16", "-mask=t:5,3")
    assert code == 0
    assert BWD_RESULT_LINE.match(line), line
    assert line.startswith("[fp16|group|bhsd] b:2, h:2/1, s:13/20(24), d:16/16, ")
    assert "mask:t(5:3)" in line and line.endswith("valid:y")
    call = bwd_calls[-1]
    assert call["seqstart_q"].tolist() == [0, 13, 20]
    assert call["seqstart_k"].tolist() == [0, 20, 29]
    assert call["seqstart_padded_k"].tolist() == [0, 24, 40]
    dq, dk, dv, dbias = call["grads"]
    assert dq.shape == (20, 2, 16) and dk.shape == dv.shape == (40, 1, 16) and dbias is None
    assert not dk[20:24].any() and not dv[36:40].any()  # padding rows, which validation checks too


def test_bwd_elementwise_bias_gradient(capsys, bwd_calls):
    code, line, _ = bwd(capsys, "-b=2", "-h=2", "-s=9", "-s_k=12", "-d=16", "-mask=b", "-bias=e", "-dbias=1")
    assert code == 0 and line.endswith("valid:y"), line
    assert ", bias:e, dbias:1, " in line
    call = bwd_calls[-1]
    assert call["bias"].shape == (1, 1, 9, 12)
    dbias = call["grads"].dbias
    assert dbias.shape == (1, 1, 9, 12) and dbias.dtype == torch.float16
    assert dbias.abs().sum() > 0


def test_bwd_alibi_per_batch(capsys, bwd_calls):
    code, line, _ = bwd(capsys, "-b=2", "-h=3", "-s=9", "-s_k=12", "-d=16", "-mask=t", "-bias=a:1")
    assert code == 0 and line.endswith("valid:y"), line
    assert ", bias:alibi[1], dbias:0, " in line
    slopes = bwd_calls[-1]["alibi_slopes"]
    assert slopes.shape == (2, 3) and torch.equal(slopes[1], fmha.alibi_slopes(3))
    assert bwd_calls[-1]["grads"].dbias is None


def test_bwd_dropout_reuses_the_forward_seed_and_offset(capsys, fwd_calls, bwd_calls):
    code, line, _ = bwd(capsys, *SMALL_BWD, "-s=40", "-p_drop=0.2", "-drop_prefs=1",
                        "-drop_seed=123456789012", "-drop_offset=77")
    assert code == 0 and line.endswith("valid:y"), line
    assert ", p_drop:0.2, s_randval:1, " in line
    forward, backward = fwd_calls[-1], bwd_calls[-1]
    assert forward["return_randval"] and backward["dropout_p"] == 0.2
    for name, value in (("seed", 123456789012), ("offset", 77)):
        assert backward[name].dtype == torch.int64 and backward[name].tolist() == [value]
        assert forward[name] is backward[name]


def test_bwd_deterministic_runs_ten_times(capsys, bwd_calls):
    code, line, _ = bwd(capsys, *SMALL_BWD, "-mask=b", "-bias=e", "-dbias=1", "-deterministic=1")
    assert code == 0 and line.endswith("valid:y"), line
    assert ", deterministic:1, " in line
    assert len(bwd_calls) == cli.DETERMINISM_RUNS == 10
    assert all(call["deterministic"] is True for call in bwd_calls)
    first = bwd_calls[0]["grads"]
    assert all(torch.equal(a, b) for call in bwd_calls[1:] for a, b in zip(first, call["grads"]))


def test_bwd_deterministic_check_catches_a_changing_bit(capsys, monkeypatch):
    real, runs = fmha.bwd, []

    def drifting(*args, **kwargs):
        grads = real(*args, **kwargs)
        runs.append(None)
        if len(runs) == 5:  # one run's dV off by one ulp: within tolerance, not bitwise equal
            grads.dv[0, 0, 0] = torch.nextafter(grads.dv[0, 0, 0], torch.tensor(math.inf, dtype=grads.dv.dtype))
        return grads

    monkeypatch.setattr(fmha, "bwd", drifting)
    code, line, _ = bwd(capsys, *SMALL_BWD, "-deterministic=1")
    assert line.endswith("valid:n"), line
    assert code == 1
    assert len(runs) == 5  # the check stops at the first run that differs


@pytest.mark.parametrize("prec", ["bf16", "fp32"])
def test_bwd_other_precisions(capsys, bwd_calls, prec):
    code, line, _ = bwd(capsys, f"-prec={prec}", *SMALL_BWD, "-init=nf")
    assert code == 0 and line.endswith("valid:y"), line
    assert line.startswith(f"[{prec}|batch|bhsd] ")
    assert all(g.dtype == cli.DTYPES[prec] for g in bwd_calls[-1]["grads"][:3])


def test_bwd_input_and_output_layouts(capsys, bwd_calls):
    code, line, _ = bwd(capsys, "-b=2", "-h=2", "-s=9", "-d=16", "-iperm=0", "-operm=1")
    assert code == 0 and line.endswith("valid:y"), line
    assert line.startswith("[fp16|batch|bshd-bhsd] ")
    call = bwd_calls[-1]
    assert call["q"].is_contiguous() and call["k"].is_contiguous()  # b*s*h*d memory
    for name in ("out", "dout"):  # b*h*s*d memory
        assert call[name].transpose(1, 2).is_contiguous() and not call[name].is_contiguous()
    assert call["grads"].dq.shape == call["q"].shape


def test_bwd_json_record(capsys, tmp_path):
    path = tmp_path / "bwd.json"
    code, line, _ = bwd(capsys, *SMALL_BWD, "-s=17", "-mask=t", "-json=1", f"-jsonfile={path}")
    assert code == 0
    record = json.loads(path.read_text())
    assert record["command"] == "bwd" and record["line"] == line and record["valid"] is True
    assert record["flags"]["s"] == "17" and record["flags"]["scale"] == "0"
    assert record["flop"] == cli.bwd_flops(fmha.parse_mask("t"), [17], [17], 2, 16, 16)
    assert record["bytes"] == cli.bwd_bytes([17], [17], 2, 2, 16, 16, 2)
    assert record["tflops"] == pytest.approx(record["flop"] / 1e9 / record["ms"])
    assert record["gb_per_s"] == pytest.approx(record["bytes"] / 1e6 / record["ms"])


def test_bwd_jsonfile_default():
    assert bwd_problem("-json=1").jsonfile == "fmha_bwd.json"
    assert problem("-json=1").jsonfile == "fmha_fwd.json"


@pytest.mark.parametrize("flags, message", [
    (("-dbias=1",), "-dbias=1: needs an elementwise bias (-bias=e), got -bias=n"),
    (("-dbias=1", "-bias=a"), "-dbias=1: needs an elementwise bias (-bias=e), got -bias=a"),
    (("-scale_s=0.5",), "unknown flag -scale_s; valid flags: -v -mode -b"),
    (("-lse=1",), "unknown flag -lse"),
    (("-sink_grad=1",), "fmha has no sink-token gradient"),
    (("-deterministic=2",), "-deterministic: expected one of 0, 1"),
])
def test_bwd_bad_flags_are_rejected(capsys, flags, message):
    code, line, err = bwd(capsys, *flags)
    assert code == 2
    assert message in err and err.startswith("fmha bwd: error: ")
    assert not BWD_RESULT_LINE.match(line)


def test_bwd_scale_flag():
    assert bwd_problem("-scale=0.5").scale == 0.5
    assert bwd_problem("-d=64").scale == 0.125


def test_bwd_help_lists_its_flags(capsys):
    assert cli.main(["bwd", "-?"]) == 0
    out = capsys.readouterr().out
    assert "tile_example_fmha_bwd" in out
    for text in ("-scale=0", "-dbias=0", "-deterministic=0", "-jsonfile=fmha_bwd.json", "-s=64"):
        assert text in out
    assert "-scale_s" not in out and "-lse" not in out


@pytest.mark.parametrize("part, flags", [
    ("dq", ()),
    ("dk", ()),
    ("dbias", ("-bias=e", "-dbias=1")),
])
def test_bwd_validation_catches_a_wrong_gradient(capsys, monkeypatch, part, flags):
    real = fmha.bwd

    def wrong(*args, **kwargs):
        grads = real(*args, **kwargs)
        getattr(grads, part).view(-1)[3] += 0.5
        return grads

    monkeypatch.setattr(fmha, "bwd", wrong)
    code, line, _ = bwd(capsys, *SMALL_BWD, *flags)
    assert line.endswith("valid:n"), line
    assert code == 1


def test_bwd_validation_requires_zero_padding_rows(capsys, monkeypatch):
    real = fmha.bwd

    def dirty(*args, **kwargs):
        grads = real(*args, **kwargs)
        grads.dq[0, 15] = 1e-3  # batch 0 has 5 logical rows: row 15 is padding
        return grads

    monkeypatch.setattr(fmha, "bwd", dirty)
    code, line, _ = bwd(capsys, "-b=2", "-h=1", "-s=16", "-d=16", "-q_eff_lens=5,16")
    assert line.endswith("valid:n"), line
    assert code == 1


def test_reference_backward_takes_d_from_the_given_out():
    # SPEC section 6 by hand in float64, for the bf16-rounded O that the backward is given.
    p = bwd_problem("-prec=bf16", "-b=1", "-h=1", "-s=7", "-s_k=5", "-d=8", "-init=nf", "-mask=b")
    cpu = torch.device("cpu")
    q, k, v, common = cli.make_inputs(p, cpu, torch.Generator().manual_seed(1))
    exact_out = fmha.reference.attention(q, k, v, **common).out
    out = exact_out.to(p.dtype)
    dout = torch.randn(p.out_shape, generator=torch.Generator().manual_seed(2)).to(p.dtype)
    Q, K, V, O, dO = (t[0, :, 0].double() for t in (q, k, v, out, dout))
    seen = fmha.reference.visible(p.mask, 7, 5)  # rows 0 and 1 see no key
    P = torch.softmax((p.scale * Q @ K.T).masked_fill(~seen, -math.inf), -1).nan_to_num(0)
    dS = P * (dO @ V.T - (dO * O).sum(-1, keepdim=True))
    grads = cli.reference_backward(p, q, k, v, common, out, dout).grads
    torch.testing.assert_close(grads.dq[0, :, 0], p.scale * dS @ K)
    torch.testing.assert_close(grads.dk[0, :, 0], p.scale * dS.T @ Q)
    torch.testing.assert_close(grads.dv[0, :, 0], P.T @ dO)
    # Plain autograd takes D from the exact O: a different dQ.
    plain = cli.reference_backward(p, q, k, v, common, exact_out, dout).grads
    assert not torch.allclose(plain.dq[0, :, 0], p.scale * dS @ K)


def test_bwd_flops_count_the_visible_area():
    # Causal top-left, sq = sk = 4: 1 + 2 + 3 + 4 = 10 visible pairs; per pair 6*dq + 4*dv.
    assert cli.bwd_flops(fmha.parse_mask("t"), [4], [4], 3, 16, 8) == 3 * 10 * (6 * 16 + 4 * 8)
    assert cli.bwd_flops(fmha.parse_mask("0"), [4, 2], [5, 3], 2, 8, 8) == 2 * (20 + 6) * 80
    # Without a mask it is CK's formula, 2.5x the forward's FLOPs when dq == dv.
    flops = cli.bwd_flops(fmha.parse_mask("0"), [7], [9], 2, 32, 32)
    assert flops == 2 * (3 * 2 * 7 * 9 * 32 + 2 * 2 * 7 * 9 * 32)
    assert flops == 2.5 * cli.fwd_flops(fmha.parse_mask("0"), [7], [9], 2, 32, 32)


def test_bwd_bytes():
    # Q, O, dO, dQ per query head; K, V, dK, dV per key head; 16 fp32 bytes a row and head.
    nbytes = cli.bwd_bytes([4, 2], [5, 3], 4, 2, 16, 8, 2)
    q_side = 4 * (16 + 8 + 8 + 16) * 6 * 2
    k_side = 2 * (16 + 8) * 2 * 8 * 2
    assert nbytes == q_side + k_side + 4 * 4 * 6 * 4


def test_bwd_smoke_matrix_matches_ck():
    base, deterministic, dbias = (cli.bwd_smoke_cases(v) for v in ("base", "deterministic", "dbias"))
    assert len(base) == len(deterministic) == 2 * 2 * 4 * 2 * 2 * 2 * 6
    assert len(dbias) == len(base) // 2
    assert cli.bwd_smoke_cases() == base + deterministic + dbias
    assert len(set(base + deterministic + dbias)) == len(base + deterministic + dbias)
    assert base[0] == ("-prec=fp16 -mode=0 -iperm=0 -operm=0 -b=1 -h=4 -h_k=2 -d=32 -s=259 -bias=n -dbias=0 "
                       "-p_drop=0 -deterministic=0 -v=1 -warmup=0 -repeat=1")
    assert base[5].startswith("-prec=fp16 -mode=0 -iperm=0 -operm=0 -b=2 -h=3 -h_k=1 -d=32 -s=244 -s_k=499 "
                              "-mask=b:4,35 ")
    assert all("-deterministic=1" in case and "-dbias=0" in case for case in deterministic)
    assert all("-bias=e -dbias=1" in case and "-deterministic=0" in case for case in dbias)
    for case in base + dbias:  # every case resolves
        bwd_problem(*case.split())


def test_check_bwd_runs_the_first_cases(capsys, tmp_path):
    log = tmp_path / "check.log"
    assert cli.main(["check", "bwd", "--limit", "2", "--jobs", "2", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    assert log.read_text() == out
    lines = out.splitlines()
    assert lines[-1] == "2/2 passed" and len(lines) == 3
    assert lines[0].startswith("[fp16|batch|bshd] b:1, h:4/2, s:259/259, d:32/32, ")
    assert lines[1].startswith("[fp16|batch|bshd] b:2, h:2/2, s:516/253, d:32/32, ")
    for line in lines[:2]:
        assert BWD_RESULT_LINE.match(line) and line.endswith("valid:y"), line


def test_check_bwd_dbias_variant(capsys):
    assert cli.main(["check", "bwd", "--variant", "dbias", "--limit", "1", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "1/1 passed"
    assert ", bias:e, dbias:1, " in lines[0] and lines[0].endswith("valid:y"), lines[0]


def test_check_fwd_has_no_variants(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "fwd", "--variant", "dbias"])
    assert "--variant: only check bwd has variants" in capsys.readouterr().err


def test_info_reports_versions_device_and_features(capsys, device):
    import triton

    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"torch    {torch.__version__}" in text and f"triton   {triton.__version__}" in text
    assert ("interpreter" in text) == (device == "cpu")
    lines = [line for line in text.splitlines() if line[:3] in ("yes", "no ")]
    assert len(lines) >= 8 and all(": " in line for line in lines)
    assert any(line.startswith("yes  torch.compile") for line in lines)
