"""fmha.launch caches compiled kernels by its own key: that key must refine Triton's specialization
(two launches with one key get one compiled kernel), checked here against Triton's own binder for
sm_90, which runs without a GPU."""

import itertools

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor

from fmha.launch import _arg_key, _Launcher


def _probe(ptr, n, x, flag, maybe, desc, C: tl.constexpr):
    pass


PROBE = JITFunction(_probe)
BINDER = create_function_from_signature(PROBE.signature, PROBE.params, make_backend(GPUTarget("cuda", 90, 32)))

_BASE = torch.empty(4096, dtype=torch.bfloat16)
VALUES = {
    "ptr": [_BASE, _BASE[1:], _BASE[8:], _BASE[9:], _BASE.float(), _BASE.float()[1:], _BASE.half()[8:]],
    "n": [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 16,
          2**40, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16, True, False],
    "x": [0.0, 1.0, -2.5, 1e30, 1, 16],
    "flag": [True, False],
    "maybe": [None, 0, 1],
    "desc": [TensorDescriptor.from_tensor(_BASE.view(64, 64), [16, 64]),
             TensorDescriptor.from_tensor(_BASE.view(64, 64), [32, 64]),
             TensorDescriptor.from_tensor(_BASE[8:8 + 2048].view(32, 64), [16, 64]),
             TensorDescriptor.from_tensor(_BASE.float().view(64, 64), [16, 64])],
}
DEFAULTS = {name: values[0] for name, values in VALUES.items()}


def _triton_spec(**changed):
    args = {**DEFAULTS, "C": 3, **changed}
    return BINDER(**args)[1]


@pytest.mark.parametrize("name", list(VALUES))
def test_key_refines_triton_specialization(name):
    """Values of one argument with equal keys get equal specializations from Triton."""
    values = VALUES[name]
    for a, b in itertools.combinations(values, 2):
        if _arg_key(a) == _arg_key(b):
            assert _triton_spec(**{name: a}) == _triton_spec(**{name: b}), (name, a, b)


@pytest.mark.parametrize("name", list(VALUES))
def test_key_separates_what_triton_specializes(name):
    """The key is not needlessly fine: values Triton specializes alike share one key, except bools
    (keyed by value, all one ``u1`` to Triton)."""
    values_per_spec = {}
    for value in VALUES[name]:
        values_per_spec.setdefault(str(_triton_spec(**{name: value})), []).append(value)
    assert len(values_per_spec) > 1 or name == "flag"
    for spec, values in values_per_spec.items():
        keys = {_arg_key(value) for value in values}
        assert len(keys) == 1 or all(type(value) is bool for value in values), (spec, values)


def test_launch_key_takes_constexprs_and_options():
    launcher = _Launcher(PROBE)
    args = {**DEFAULTS, "C": 3}
    assert launcher.key(args) == launcher.key(dict(args))
    assert launcher.key(args) != launcher.key({**args, "C": 4})
    assert launcher.key({**args, "num_warps": 4}) != launcher.key({**args, "num_warps": 8})
    assert launcher.key(args) != launcher.key({**args, "n": 1})
    assert launcher.key(args) == launcher.key({**args, "x": 3.0, "n": 32})
