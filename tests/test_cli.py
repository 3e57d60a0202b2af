"""The ``fmha`` command line: CK's fwd flags and result line, validation, ``check fwd``, ``bench``.

Without a GPU every run goes through Triton's interpreter, so the problems stay tiny.
"""

from __future__ import annotations

import json
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
    return cli.fwd_problem(cli.parse_ck_flags(list(flags)))


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
    cases = cli.smoke_cases()
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
