"""Kernel launches with less host work than Triton's ``JITFunction.run``.

At short sequences an attention call is host-bound (benchmarks/NOTES.md, session 10): on every
launch ``run`` binds all ~40 arguments and specializes each, builds its cache key with
``str(options)``, re-checks the kernel's globals and builds launch metadata for hooks nobody set.
``launch`` keys the compiled kernel by what Triton specializes on instead (``_Launcher.key``, a
refinement of Triton's own key), and after the first launch of a key calls the compiled
kernel's launcher directly: on the H200's host the forward's kernel took 68-92 us through
``run`` and takes 42-54 through ``launch``, 21-27 of them in the compiled launcher itself. The
first launch of each key, every launch while a launch hook (a profiler such as Proton) is set,
and the interpreter go through ``run``. Skipped on the direct path is what fmha does not use:
pre-run hooks, and the check that the globals a kernel read have not changed since it compiled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver

from .kernels import INTERPRET

def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids on the host (``triton.cdiv`` is a constexpr function, about 7 us
    a call there)."""
    return -(-a // b)


def _arg_key(value):
    """What Triton's specialization of one non-constexpr argument depends on (or finer); never
    the tensor itself (the cache would keep it alive)."""
    kind = type(value)
    if kind is int:  # 1 becomes a constant; divisibility by 16 an attribute; the range picks i32/i64/u64
        return kind, value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63
    if kind is torch.Tensor:
        return value.dtype, value.data_ptr() % 16 == 0
    if kind is float:  # always fp32, whatever the value
        return kind
    if kind.__name__ == "TensorDescriptor":  # host-side TMA descriptors (Triton's and Gluon's)
        base = value.base
        return (kind, base.dtype, base.data_ptr() % 16 == 0, tuple(value.block_shape),
                getattr(value, "layout", None), value.padding)
    if isinstance(value, torch.Tensor):  # subclasses (nn.Parameter): specialized as tensors
        return value.dtype, value.data_ptr() % 16 == 0
    return kind, value  # bool, None, str: by value


class _Launcher:
    """One kernel (held, so that its id stays its own), its parameters' names (all in order, the
    constexprs and the others apart) and its compiled kernels by (device, ``key``)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.params = [p.name for p in kernel.params]  # in order
        self.names = frozenset(self.params)
        self.constexprs = [p.name for p in kernel.params if p.is_constexpr]
        self.runtime_args = [p.name for p in kernel.params if not p.is_constexpr]
        self.compiled = {}

    def key(self, kwargs: dict) -> tuple:
        """The constexprs' values, ``_arg_key`` of every other argument, then the options
        ``JITFunction.run`` compiles with: keyword arguments that are no parameter (e.g.
        ``num_warps``), and the debug and instrumentation settings it reads on every call. Two
        launches with one key get one compiled kernel from Triton. (``map`` over bound methods: a
        loop over ~40 arguments cost a third more host time.)"""
        get = kwargs.__getitem__
        return (*map(get, self.constexprs), *map(_arg_key, map(get, self.runtime_args)),
                *[item for item in kwargs.items() if item[0] not in self.names],
                (knobs.runtime.debug, knobs.compilation.instrumentation_mode))


_LAUNCHERS: dict[int, _Launcher] = {}  # by id(kernel) (hashing a JITFunction costs a lock)


def _hooks_set() -> bool:
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(type(hook) is not HookChain or hook.calls for hook in hooks)


def _launcher(kernel) -> _Launcher:
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _LAUNCHERS[id(kernel)] = _Launcher(kernel)
    return launcher


def launch(kernel, grid: tuple[int, ...], kwargs: dict) -> None:
    """``kernel[grid](**kwargs)``, through the compiled kernel's launcher once Triton has built it.

    Every parameter must be given in ``kwargs`` (no defaults), as fmha's launchers do. While a
    launch hook is set every launch goes through ``run`` and nothing is cached."""
    if INTERPRET:
        kernel[grid](**kwargs)
        return
    launcher = _launcher(kernel)
    device = driver.active.get_current_device()
    key = (device, launcher.key(kwargs))
    compiled = launcher.compiled.get(key)
    if compiled is None or _hooks_set():
        compiled = kernel[grid](**kwargs)
        if getattr(compiled, "function", None) is not None and not _hooks_set():  # loaded, and no hook
            launcher.compiled[key] = compiled
        return
    _run(compiled, device, grid, map(kwargs.__getitem__, launcher.params))


class Compiled(NamedTuple):
    """A compiled kernel as ``launch`` found it for one key: the device it was loaded on and the
    debug and instrumentation settings it was compiled under (the key's last item)."""

    kernel: object
    device: int
    settings: tuple


def compiled_for(kernel, kwargs: dict) -> tuple[Compiled, list[str]] | None:
    """What ``launch(kernel, grid, kwargs)`` would call on the current device, with the kernel's
    parameter names in launch order, or None before its first launch there: a caller that
    launches the same key again can keep these and call ``run_compiled`` without the key."""
    if INTERPRET:
        return None
    launcher = _launcher(kernel)
    device = driver.active.get_current_device()
    key = launcher.key(kwargs)
    compiled = launcher.compiled.get((device, key))
    return None if compiled is None else (Compiled(compiled, device, key[-1]), launcher.params)


def still_valid(compiled: Compiled) -> bool:
    """Whether ``launch`` would call ``compiled`` now, for arguments of the key it was found by:
    the same device, the same debug settings, and no launch hook set."""
    return (driver.active.get_current_device() == compiled.device and not _hooks_set()
            and (knobs.runtime.debug, knobs.compilation.instrumentation_mode) == compiled.settings)


def run_compiled(compiled: Compiled, grid: tuple[int, ...], args) -> None:
    """Launch ``compiled`` with every parameter's value (``args``, in the kernel's order)."""
    _run(compiled.kernel, compiled.device, grid, args)


def _run(kernel, device: int, grid: tuple[int, ...], args) -> None:
    grid = (*grid, 1, 1)
    kernel.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *args)
