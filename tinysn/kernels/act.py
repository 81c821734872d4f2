"""ReLU (nn.ReLU) forward and backward.

forward(x, y)                         y = max(x, 0)            (NaN propagates, as torch.relu)
backward(y, dy, dx, *, accumulate)    dx = dy where y > 0, else 0
                                      computed from the OUTPUT y, so the input x can be freed
                                      right after the forward pass (torch's threshold_backward
                                      on the output gives the same values: y > 0 <=> x > 0).

Both are one-dimensional blocked kernels over the flat element index: contiguous, vectorisable
loads and stores, memory-bound. Nothing is allocated; no workspace.
"""
import torch
import triton
import triton.language as tl

from ._common import cdiv, check_tensor, run

BLOCK = 4096     # elements per program (16 per thread at 8 warps: four 16-byte loads in flight)
NUM_WARPS = 8


@triton.jit
def _relu_fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    # where(x < 0, 0, x) keeps NaN (torch.relu(nan) is nan) and is a plain select.
    tl.store(y_ptr + offs, tl.where(x < 0.0, 0.0, x), mask=mask)


@triton.jit
def _relu_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask)
    dy = tl.load(dy_ptr + offs, mask=mask)
    g = tl.where(y <= 0.0, 0.0, dy)          # torch: threshold_backward(dy, y, 0)
    if ACCUMULATE:
        g = tl.load(dx_ptr + offs, mask=mask) + g
    tl.store(dx_ptr + offs, g, mask=mask)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_same(ref_name, ref, **others):
    for name, t in others.items():
        check_tensor(name, t, shape=ref.shape)
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def forward(x: torch.Tensor, y: torch.Tensor) -> None:
    """y = relu(x). x and y: contiguous float32 of one shape, distinct (non-overlapping) buffers."""
    check_tensor("x", x)
    _check_same("x", x, y=y)
    if x.numel() and _overlap(x, y):
        raise ValueError("relu.forward: y must not alias x (the backward pass reads y, and x "
                         "may be freed)")
    n = x.numel()
    if n == 0:
        return
    run(_relu_fwd_kernel, (cdiv(n, BLOCK),), x, y, n, BLOCK=BLOCK, num_warps=NUM_WARPS)


def backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, *,
             accumulate: bool = False) -> None:
    """dx (+)= dy * (y > 0), from the forward OUTPUT y.

    dx may be dx is dy (in place); it must not partly overlap y or dy.
    """
    check_tensor("y", y)
    _check_same("y", y, dy=dy, dx=dx)
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate must be a bool, got {accumulate!r}")
    n = y.numel()
    if n == 0:
        return
    for name, t in (("y", y), ("dy", dy)):
        if _overlap(dx, t) and dx.data_ptr() != t.data_ptr():
            raise ValueError(f"relu.backward: dx partly overlaps {name}")
    run(_relu_bwd_kernel, (cdiv(n, BLOCK),), y, dy, dx, n, BLOCK=BLOCK,
        ACCUMULATE=accumulate, num_warps=NUM_WARPS)


def workspace_bytes(*args, **kwargs) -> int:
    """ReLU needs no scratch memory."""
    return 0
