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
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from fmha.launch import _arg_key, _Launcher


def _probe(ptr, n, x, flag, maybe, desc, C: tl.constexpr):
    pass


PROBE = JITFunction(_probe)
BINDER = create_function_from_signature(PROBE.signature, PROBE.params, make_backend(GPUTarget("cuda", 90, 32)))

_BASE = torch.empty(4096, dtype=torch.bfloat16)
_SWIZZLED = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
_UNSWIZZLED = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
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
             TensorDescriptor.from_tensor(_BASE.float().view(64, 64), [16, 64]),
             # Gluon's (the fast path's): the layout is part of Triton's type
             GluonDescriptor.from_tensor(_BASE.view(64, 64), [16, 64], _SWIZZLED),
             GluonDescriptor.from_tensor(_BASE.view(64, 64), [16, 64], _UNSWIZZLED),
             GluonDescriptor.from_tensor(_BASE[8:8 + 2048].view(32, 64), [16, 64], _SWIZZLED),
             GluonDescriptor.from_tensor(_BASE.view(64, 64), [32, 64], _SWIZZLED)],
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


# launch() itself, on a fake driver that compiles for sm_90 and records what the launcher gets.


def _scale_copy(src, dst, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * scale, mask=offs < n)


SCALE_COPY = JITFunction(_scale_copy)


class _RecordingLauncher:
    calls: list = []

    def __init__(self, src, metadata):
        self.metadata = metadata

    def __call__(self, gx, gy, gz, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
        self.calls.append(dict(grid=(gx, gy, gz), stream=stream, function=function, args=args,
                               through_run=enter_hook is not None, debug=self.metadata.debug,
                               instrumentation=self.metadata.instrumentation_mode))


class _FakeUtils:
    def load_binary(self, name, kernel, shared, device):
        return object(), ("function", name, device), 32, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448}


class _FakeDriver:
    launcher_cls = _RecordingLauncher
    utils = _FakeUtils()

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 1234

    def get_active_torch_device(self):
        return torch.device("cpu")


# Triton 3.6's interpreter patches triton.language's builtins for each kernel it runs, and for a
# library function a kernel calls (tl.sum, tl.cdiv) it never restores them: a real compile after
# such a kernel fails unless its cache is warm. Taken at collection, before any kernel runs.
_LANGUAGE_BUILTINS = [(owner, name, member) for owner in (tl, tl.core, tl.math, tl.tensor,
                                                         tl.core.tensor_descriptor_base)
                      for name, member in vars(owner).items() if tl.core.is_builtin(member)]


@pytest.fixture
def fake_gpu(monkeypatch):
    import fmha.launch
    from triton.runtime.driver import driver

    for owner, name, member in _LANGUAGE_BUILTINS:
        monkeypatch.setattr(owner, name, member)
    monkeypatch.setattr(fmha.launch, "INTERPRET", False)
    monkeypatch.setattr(driver, "_active", _FakeDriver())  # (restored afterwards as it was)
    _RecordingLauncher.calls.clear()
    yield _RecordingLauncher.calls
    SCALE_COPY.device_caches.clear()
    fmha.launch._LAUNCHERS.pop(id(SCALE_COPY), None)


def _copy_args(src=None, n=1000, scale=0.5):
    src = torch.empty(1024, dtype=torch.float32) if src is None else src
    return dict(src=src, dst=torch.empty(1024, dtype=torch.float32), n=n, scale=scale, BLOCK=256, num_warps=4)


def test_launch_reuses_the_kernel_with_the_arguments_run_passes(fake_gpu):
    from fmha.launch import _LAUNCHERS, launch

    first, second = _copy_args(), _copy_args(scale=2.0)
    launch(SCALE_COPY, (4,), first)
    launch(SCALE_COPY, (4,), second)
    assert [call["through_run"] for call in fake_gpu] == [True, False]
    assert len(_LAUNCHERS[id(SCALE_COPY)].compiled) == 1
    via_run, direct = fake_gpu
    assert via_run["grid"] == direct["grid"] == (4, 1, 1)
    assert via_run["stream"] == direct["stream"] == 1234
    assert via_run["function"] is direct["function"]
    for call, args in ((via_run, first), (direct, second)):
        assert len(call["args"]) == 5
        assert all(a is b for a, b in zip(call["args"], [args[name] for name in ("src", "dst", "n", "scale", "BLOCK")]))


def test_launch_compiles_each_specialization(fake_gpu):
    from fmha.launch import _LAUNCHERS, launch

    base = torch.empty(1040, dtype=torch.float32)
    for args in (_copy_args(base), _copy_args(base[1:]), _copy_args(base, n=1), _copy_args(base[4:]),
                 _copy_args(base[1:]), _copy_args(base, n=1)):
        launch(SCALE_COPY, (4,), args)
    # aligned, misaligned, n == 1; then base[4:] (16-byte aligned) and the two repeats take the cache
    assert [call["through_run"] for call in fake_gpu] == [True, True, True, False, False, False]
    assert len(_LAUNCHERS[id(SCALE_COPY)].compiled) == 3


def test_launch_follows_debug_and_instrumentation_settings(fake_gpu, monkeypatch):
    from triton import knobs

    from fmha.launch import launch

    launch(SCALE_COPY, (4,), _copy_args())
    monkeypatch.setattr(knobs.runtime, "debug", True)
    launch(SCALE_COPY, (4,), _copy_args())
    monkeypatch.setattr(knobs.runtime, "debug", False)
    launch(SCALE_COPY, (4,), _copy_args())
    assert [(call["through_run"], call["debug"]) for call in fake_gpu] == [(True, False), (True, True), (False, False)]


def test_launch_caches_nothing_while_a_hook_is_set(fake_gpu):
    from triton import knobs

    from fmha.launch import _LAUNCHERS, launch

    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        launch(SCALE_COPY, (4,), _copy_args())
        launch(SCALE_COPY, (4,), _copy_args())
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert [call["through_run"] for call in fake_gpu] == [True, True]
    assert not _LAUNCHERS[id(SCALE_COPY)].compiled
    launch(SCALE_COPY, (4,), _copy_args())
    launch(SCALE_COPY, (4,), _copy_args())
    assert [call["through_run"] for call in fake_gpu[2:]] == [True, False]


def test_a_compiled_kernel_found_once_is_launched_while_it_stays_valid(fake_gpu, monkeypatch):
    from triton import knobs

    from fmha.launch import compiled_for, launch, run_compiled, still_valid

    args = _copy_args()
    assert compiled_for(SCALE_COPY, args) is None  # before its first launch
    launch(SCALE_COPY, (4,), args)
    compiled, names = compiled_for(SCALE_COPY, args)
    assert names == ["src", "dst", "n", "scale", "BLOCK"] and still_valid(compiled)
    again = _copy_args(scale=3.0)
    run_compiled(compiled, (4,), [again[name] for name in names])
    via_run, direct = fake_gpu
    assert not direct["through_run"] and direct["function"] is via_run["function"]
    assert direct["grid"] == (4, 1, 1) and direct["stream"] == 1234
    assert all(a is again[name] for a, name in zip(direct["args"], names, strict=True))
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert not still_valid(compiled)
    monkeypatch.setattr(knobs.runtime, "debug", False)
    monkeypatch.setattr(_FakeDriver, "get_current_device", lambda self: 1)
    assert not still_valid(compiled) and compiled_for(SCALE_COPY, again) is None  # not compiled on device 1
    monkeypatch.setattr(_FakeDriver, "get_current_device", lambda self: 0)
    knobs.runtime.launch_enter_hook.add(print)
    try:
        assert not still_valid(compiled)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert still_valid(compiled)


def test_tensor_subclasses_are_keyed_as_tensors_and_not_kept_alive(fake_gpu):
    import gc
    import weakref

    from fmha.launch import launch

    param = torch.nn.Parameter(torch.empty(1024, dtype=torch.float32), requires_grad=False)
    assert _arg_key(param) == _arg_key(torch.empty(1024, dtype=torch.float32))
    launch(SCALE_COPY, (4,), _copy_args(param))
    alive = weakref.ref(param)
    del param
    fake_gpu.clear()  # the recorded call holds the arguments too
    gc.collect()
    assert alive() is None
