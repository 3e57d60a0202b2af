"""Decide, before Triton is first imported, whether kernels run on a GPU or in Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` once, when its own language module and each ``@triton.jit``
function are defined, so this module must be imported before anything imports triton.
"""

import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    if "triton" in sys.modules:
        raise ImportError(
            "fmha: no CUDA device, so kernels must run in Triton's interpreter, but triton was "
            "imported before fmha; set TRITON_INTERPRET=1 or import fmha first"
        )
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
