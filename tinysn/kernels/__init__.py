"""Handwritten Triton kernels, one module per layer type.

Each module exposes launchers that write into preallocated outputs and a
`workspace_bytes(...)` telling the scheduler how much scratch memory a launch needs.
"""
from ._common import INTERPRET, dot_precision  # noqa: F401
