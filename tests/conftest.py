"""Shared test settings: tinysn is imported first so Triton picks the interpreter on CPU."""
import os

import pytest
import torch

import tinysn  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

GPU = torch.cuda.is_available()


@pytest.fixture
def device():
    """The device the kernels run on: cuda when present, else the CPU interpreter."""
    return "cuda" if GPU else "cpu"
