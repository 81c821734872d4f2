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


@pytest.fixture
def conv_phase():
    """run(phase, algo, x, w, dy): one call of a conv phase ("forward", "backward_data",
    "backward_weight") by `algo`, stride 1, padding 1, no bias, into fresh outputs and a
    workspace of the size it needs (tests that count what a call launches)."""
    from tinysn.kernels import conv

    def run(phase, algo, x, w, dy):
        need = conv.workspace_bytes(x.shape, w.shape, 1, 1, phase, algo)
        kw = dict(stride=1, padding=1, algo=algo,
                  workspace=torch.empty(max(need, 4), dtype=torch.uint8))
        if phase == "forward":
            conv.forward(x, w, None, torch.empty(dy.shape), **kw)
        elif phase == "backward_data":
            conv.backward_data(dy, w, torch.empty(x.shape), **kw)
        else:
            conv.backward_weight(x, dy, torch.empty(w.shape), None, **kw)
    return run
