"""Packaging: typed package, dependency ranges that do not fight a user's torch, the CPU path's numpy."""

import importlib.metadata
import importlib.resources

from fmha._backend import _interpreter_numpy_ok


def test_package_is_typed():
    assert importlib.resources.files("fmha").joinpath("py.typed").is_file()


def test_dependencies_are_ranges_without_upper_bounds():
    requires = [r for r in importlib.metadata.requires("fmha") if "extra ==" not in r]
    names = {r.split(">")[0].split("<")[0].split("=")[0].strip() for r in requires}
    assert {"torch", "triton", "numpy"} <= names
    assert not any("<" in r or "==" in r for r in requires), requires


def test_interpreter_numpy_check():
    assert _interpreter_numpy_ok("2.3.5", "3.6.0")
    assert not _interpreter_numpy_ok("2.4.0", "3.6.0")
    assert _interpreter_numpy_ok("2.4.0", "3.7.0")
