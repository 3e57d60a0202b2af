"""``fmha bench``'s cases without a GPU: visible FLOPs, feature problems, the plain references.

Timing itself needs CUDA (benchmarks belong on the H200); here the fmha provider of every feature
runs once under the interpreter and is checked against the reference.
"""

import functools
import importlib.util
import pathlib

import pytest
import torch

import fmha
from fmha import bench, cli, reference
from fmha.masks import parse_mask
from fmha.testing import error_bound, max_error, reference_pair


@pytest.mark.parametrize("spec", [None, "t", "b", "b:1024,0", "t:3,5", "b:-1,2", "t:0,0", "b:4,-1"])
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 5), (40, 40)])
def test_visible_pairs_counts_the_reference_mask(spec, sq, sk):
    mask = parse_mask(spec)
    assert bench.visible_pairs(mask, sq, sk) == int(reference.visible(mask, sq, sk).sum())


def test_flops_count_the_visible_area():
    plain = bench.Case(128, 16384, causal=False)
    assert plain.flops() == 4 * 16 * 16384**2 * 128
    assert bench.Case(128, 16384, causal=True).flops() == 4 * 16 * 16384 * 16385 // 2 * 128
    window = bench.Case(128, 16384, causal=False, feature="window")
    assert window.flops() == 4 * 16 * 128 * (1025 * 16384 - 1024 * 1025 // 2)
    varlen = bench.Case(128, 16384, causal=True, feature="varlen")
    lengths = varlen.varlen_lengths()
    assert len(lengths) == bench.VARLEN_SEQUENCES and sum(lengths) == 16384 and min(lengths) > 0
    assert varlen.flops() == 4 * 16 * 128 * sum(n * (n + 1) // 2 for n in lengths)
    assert bench.Case(128, 16384, causal=False, direction="bwd").flops() == 2.5 * plain.flops()


def test_plain_reference_of_a_feature():
    case = bench.Case(64, 4096, causal=True, direction="bwd", feature="gqa")
    assert bench.plain_reference(case) == bench.Case(64, 4096, causal=True, direction="bwd")
    varlen = bench.Case(64, 16384, causal=False, feature="varlen")
    assert bench.plain_reference(varlen).seqlen == 16384 // bench.VARLEN_SEQUENCES


def test_unknown_feature_is_rejected():
    with pytest.raises(ValueError, match="feature: expected one of"):
        bench.Case(64, 1024, causal=False, feature="sparse")


def _reference_pair(case, p):
    kwargs = dict(mask=case.mask, bias=p.bias, alibi_slopes=p.alibi_slopes, dropout_p=case.dropout_p)
    if case.feature == "varlen":
        kwargs.update(seqstart_q=p.seqstart, seqstart_k=p.seqstart)
    if case.dropout_p:
        kwargs.update(seed=0, offset=0)
    return reference_pair(p.q.detach(), p.k.detach(), p.v.detach(), **kwargs)


@pytest.mark.parametrize("feature", bench.FEATURES)
def test_fmha_provider_computes_each_feature(feature, monkeypatch):
    # d=256 keeps h = 2048 / d at 8 heads (1 key head for GQA); 2 x 32 tokens, or 16 sequences.
    case = bench.Case(256, 32, causal=True, tokens=64, feature=feature)
    p = bench.make_problem(case, "cpu")
    assert p.q.shape[-2] == 8 and p.k.shape[-2] == (1 if feature == "gqa" else 8)
    # The benchmark draws a dropout seed per call; fix it to compare with the reference.
    for name in ("attention", "attention_varlen"):
        monkeypatch.setattr(fmha, name, functools.partial(getattr(fmha, name), seed=0, offset=0))
    out = bench.PROVIDERS["fmha"](case, p)()
    exact, low = _reference_pair(case, p)
    assert max_error(out, exact.out) <= error_bound(torch.bfloat16, max_error(low.out, exact.out))


def test_bench_command_times_each_feature_after_its_plain_reference(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", lambda cases, providers, jsonl=None: seen.extend(cases))
    assert cli.main(["bench", "--head-dims", "128", "--seqlens", "16384", "--features", "plain", "window",
                     "varlen", "bias"]) == 0
    names = [(c.feature, c.seqlen, int(c.causal)) for c in seen]
    assert names == [("plain", 16384, 0), ("window", 16384, 0), ("plain", 1024, 0), ("varlen", 16384, 0),
                     ("bias", 16384, 0), ("plain", 16384, 1), ("plain", 1024, 1), ("varlen", 16384, 1),
                     ("bias", 16384, 1)]


def _ab_module():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ab.py"
    spec = importlib.util.spec_from_file_location("fmha_benchmarks_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_summary_gives_each_trees_median_range_and_ratio():
    ab = _ab_module()
    cell = dict(direction="fwd", head_dim=128, seqlen=16384, causal=False, feature="window", provider="fmha")
    peer = dict(cell, feature="plain", provider="sdpa_cudnn")
    runs = [(0, dict(cell, tflops=t)) for t in (450.0, 470.0, 460.0)]
    runs += [(1, dict(cell, tflops=t)) for t in (500.0, 480.0, 490.0)]
    runs += [(0, dict(peer, tflops=600.0)), (1, dict(peer, tflops=606.0)), (1, dict(peer, error="oom"))]
    lines = ab.summarize(runs, ["src", "other/src"])
    assert len(lines) == 2
    window = next(line for line in lines if "window fmha" in line)
    assert "460.0 [450-470] n=3" in window and "490.0 [480-500] n=3" in window and "x1.065" in window
    control = next(line for line in lines if "sdpa_cudnn" in line)
    assert "x1.010" in control


def test_ab_refuses_a_single_tree_a_tree_without_fmha_and_a_bench_jsonl(tmp_path):
    ab = _ab_module()
    src = str(pathlib.Path(fmha.__file__).parents[1])
    with pytest.raises(SystemExit):
        ab.main(["--tree", src, "--", "--direction", "fwd"])
    with pytest.raises(SystemExit):
        ab.main(["--tree", src, "--tree", str(tmp_path), "--", "--direction", "fwd"])
    with pytest.raises(SystemExit):
        ab.main(["--tree", src, "--tree", src, "--", "--jsonl=x.jsonl"])
