"""Seeded random problems against the reference (fmha.fuzz): a bounded number on every CI run.

The H200 runs the same generator at full size: ``python -m fmha.fuzz --examples 1000 --jobs 14``.
"""

import pytest
import torch

from fmha import fuzz, hopper
from fmha.inputs import check_inputs

EXAMPLES = 40


@pytest.mark.parametrize("index", range(EXAMPLES))
def test_random_problem_matches_reference(index, device):
    case = fuzz.random_case(seed=2026, index=index, max_len=48)
    assert fuzz.run_case(case, device) == [], case.describe()


def test_generator_covers_the_feature_space():
    cases = [fuzz.random_case(seed=2026, index=i, max_len=48) for i in range(EXAMPLES)]
    assert {c.group for c in cases} == {False, True}
    assert {c.dtype for c in cases} == set(fuzz.DTYPES)
    assert {c.layout for c in cases} == {"bshd", "bhsd", "strided"}
    assert any(c.head_dim_q != c.head_dim_v for c in cases)
    assert any(c.nhead_q != c.nhead_k for c in cases)
    assert any(c.bias_shape is not None for c in cases) and any(c.alibi != "none" for c in cases)
    assert any(c.dropout_p > 0 for c in cases) and any(c.deterministic for c in cases)
    assert any(0 in c.lengths_q + c.lengths_k for c in cases)
    assert any(1 in c.lengths_q + c.lengths_k for c in cases)
    assert any(c.slots_q or c.slots_k or c.effective for c in cases)
    assert {c.mask.split(":")[0] if c.mask else None for c in cases} == {None, "t", "b"}
    assert any(c.mask and ":" in c.mask for c in cases)


def test_a_wrong_result_is_reported(monkeypatch, device):
    """An attention that is off by 2 % must fail the check (output and gradients)."""
    def off_by_two_percent(fn):
        def wrong(*args, **kwargs):
            out, lse, randval = fn(*args, **kwargs)
            return out * 1.02, lse, randval
        return wrong

    monkeypatch.setattr(fuzz, "attention", off_by_two_percent(fuzz.attention))
    monkeypatch.setattr(fuzz, "attention_varlen", off_by_two_percent(fuzz.attention_varlen))
    case = next(c for c in (fuzz.random_case(seed=2026, index=i, max_len=48) for i in range(EXAMPLES))
                if min(c.lengths_q) > 1 and min(c.lengths_k) > 1 and c.dtype == "fp32")
    failures = fuzz.run_case(case, device)
    assert any(f.startswith("out:") for f in failures), failures
    assert any(f.startswith("dq:") for f in failures), failures


def test_worker_processes_split_the_examples_and_sum_the_results(device):
    lines = []
    failed = fuzz.run_in_workers(4, seed=2026, max_len=24, device=device, first=3, jobs=2, log=lines.append)
    assert failed == 0 and lines[-1].startswith("4/4 examples passed (seed 2026, max length 24")


def test_fast_path_cases_are_what_the_hopper_path_takes():
    cases = [fuzz.random_case(seed=2026, index=i, max_len=48, fast_path=True) for i in range(EXAMPLES)]
    for case in cases:
        q, k, v, _, kwargs = fuzz._problem(case, "cpu", torch.Generator().manual_seed(0))
        assert hopper._problem_reason(check_inputs(q, k, v, **kwargs), hopper.HOPPER_FWD_CONFIGS) is None, \
            case.describe()
    assert {c.head_dim_q for c in cases} == {64, 128, 256} and {c.dtype for c in cases} == {"fp16", "bf16"}
    assert {c.mask for c in cases} == {None, "t", "b"} and any(c.nhead_q != c.nhead_k for c in cases)
    assert {c.layout for c in cases} == {"bshd", "bhsd", "strided"} and any(c.seqlen_q == 1 for c in cases)


def test_a_fast_path_problem_matches_reference(device):
    """One fast-path example end to end (the portable kernels run it off Hopper, the fast path on it)."""
    case = next(c for c in (fuzz.random_case(seed=2026, index=i, max_len=24, fast_path=True) for i in range(EXAMPLES))
                if c.head_dim_q == 64 and c.seqlen_q > 1)
    assert fuzz.run_case(case, device) == [], case.describe()
