import os

import pytest
import torch

# Kernels run through Triton's interpreter where there is no GPU; this must be decided before
# triton is imported (fmha does the same on import, this makes the choice explicit for tests).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: fresh but reproducible inputs for every test."""
    return torch.Generator().manual_seed(1234)
