"""Decide, before Triton is first imported, whether kernels run on a GPU or in Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` once, when its own language module and each ``@triton.jit``
function are defined, so this module must be imported before anything imports triton.
"""

import importlib.metadata
import importlib.util
import os
import sys
import warnings

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    if "triton" in sys.modules:
        raise ImportError(
            "fmha: no CUDA device, so kernels must run in Triton's interpreter, but triton was "
            "imported before fmha; set TRITON_INTERPRET=1 or import fmha first"
        )
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_numpy_ok(numpy_version: str, triton_version: str) -> bool:
    """Triton 3.6's interpreter mishandles loops with runtime bounds on numpy 2.4 and newer."""
    major_minor = tuple(int(x) for x in numpy_version.split(".")[:2])
    return not (triton_version.startswith("3.6.") and major_minor >= (2, 4))


if INTERPRET and importlib.util.find_spec("numpy") is not None:
    _numpy, _triton = importlib.metadata.version("numpy"), importlib.metadata.version("triton")
    if not _interpreter_numpy_ok(_numpy, _triton):
        warnings.warn(f"fmha: Triton {_triton}'s interpreter gives wrong results with numpy {_numpy}; "
                      "install numpy<2.4 to run on the CPU", RuntimeWarning, stacklevel=2)
