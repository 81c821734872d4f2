"""The Runtime's input checks: each bad argument fails with one line naming it, before any
state changes (before planning, allocating or launching anything).

`check_options`, `check_graph_request`, `check_machine` and `pick_device` check the Runtime's
constructor arguments; `check_batch`, `check_images` and `check_labels` check a batch given to
`step`, `predict` or `evaluate` against the net it was planned for, and `check_values` a
training batch's values once it is in the pool.
"""
from __future__ import annotations

import math

import torch

from .kernels import check as check_k
from .pool.arena import check_available
from .sched.plan import POLICIES
from .units import parse_bytes


def pick_device(device) -> torch.device:
    """The torch device to run on: `device` ("cpu" or "cuda"), or CUDA when there is one."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no CUDA GPU is available")
    return device


def check_options(policy, lr, momentum, weight_decay, seed, precision,
                  fuse_relu=True, fuse_bn_relu=True, fuse_add_relu=True,
                  fuse_bn_add=True, group_updates=True, fuse_updates=True,
                  store_argmaxes=True) -> None:
    """A known policy, non-negative numbers for the optimizer, a non-negative int seed, a
    precision of None, "tf32" or "ieee" and bools fuse_relu, fuse_bn_relu, fuse_add_relu,
    fuse_bn_add, group_updates, fuse_updates and store_argmaxes."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    check_rates(lr, momentum, weight_decay)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if precision not in (None, "tf32", "ieee"):
        raise ValueError(f"precision must be None, 'tf32' or 'ieee', got {precision!r}")
    for name, flag in (("fuse_relu", fuse_relu), ("fuse_bn_relu", fuse_bn_relu),
                       ("fuse_add_relu", fuse_add_relu), ("fuse_bn_add", fuse_bn_add),
                       ("group_updates", group_updates), ("fuse_updates", fuse_updates),
                       ("store_argmaxes", store_argmaxes)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")


def check_rates(lr, momentum, weight_decay) -> None:
    """The optimizer's settings are finite non-negative numbers: at construction, and at each
    step (they are attributes a schedule sets), before the step changes anything."""
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")


def check_trainable(net) -> None:
    """Every batch norm has more than one value per channel to normalise: training-mode
    batch norm of one value has no variance (the kernel and PyTorch refuse it), so a net
    that would fail at its first step is refused when the Runtime is built. Planning it
    (sn.plan) is fine."""
    for layer in net.layers:
        if layer.op == "bn":
            n, _, h, w = layer.shape
            if n * h * w < 2:
                raise ValueError(f"bn {layer.name!r}: batch norm in training mode needs more "
                                 f"than one value per channel, its input has shape "
                                 f"{layer.shape}")


def check_graph_request(cuda_graph, device) -> None:
    """cuda_graph must be a bool; True needs a CUDA device (dropout is captured too: its
    kernels read the iteration from a counter in the pool, advanced by a captured kernel)."""
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be a bool, got {cuda_graph!r}")
    if not cuda_graph:
        return
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device, got {device}")


def check_machine(memory, host_memory, device) -> None:
    """OutOfMemory (one line) when `memory` is more than the device can give, or
    `host_memory` more than the host can pin: before anything is planned or allocated."""
    check_available(parse_bytes(memory), device, f"memory={memory!r}")
    if host_memory is not None:
        check_available(parse_bytes(host_memory), "cpu", f"host_memory={host_memory!r}",
                        pinned=device.type == "cuda")


def check_batch(net, images, labels, values: bool = True) -> None:
    """A training batch: net.batch images and as many labels; `values=False` leaves the
    images' finiteness and the labels' range to `check_values` (the Runtime checks them
    once the batch is in its pool)."""
    check_images(net, images, finite=values)
    check_labels(net, labels, net.batch, in_range=values)


def check_labels(net, labels, n, in_range: bool = True) -> None:
    """int64 labels of shape (n,), each in [0, net.classes) (unless `in_range` is False)."""
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
        raise ValueError(f"labels must be an int64 torch tensor, got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != (n,):
        raise ValueError(f"labels must have shape ({n},), got {tuple(labels.shape)}")
    if in_range:
        _check_label_range(labels, net.classes)


def _check_label_range(labels, classes) -> None:
    low, high = (int(v) for v in torch.aminmax(labels))   # a GPU tensor: two scalars
    if low < 0 or high >= classes:
        raise ValueError(f"labels must lie in [0, {classes}), got values in [{low}, {high}]")


def check_values(images, labels, classes, flag=None) -> None:
    """No NaN or infinity among the images, every label in [0, classes). With `flag` (a
    one-element float32 tensor on their device: the Runtime passes a float of its pool on a
    GPU) two Triton reductions count the bad values into it and one read of it decides
    (kernels/check.py): no device byte is allocated, where torch's reductions allocate
    their results outside the pool. Only when something is wrong are the two checked
    apart, for the message (the labels on the host). Without `flag`, torch reductions."""
    if flag is None:
        check_finite(images)
        _check_label_range(labels, classes)
        return
    count_bad_values(images, labels, classes, flag)
    if float(flag) > 0:
        check_finite(images, flag)
        _check_label_range(labels.cpu(), classes)


def count_bad_values(images, labels, classes, flag) -> None:
    """flag = how many images' values are NaN or infinite plus how many labels lie outside
    [0, classes), counted on their device by two Triton reductions (kernels/check.py),
    nothing read back: check_values reads it at once, a Runtime on one GPU with the loss."""
    check_k.nonfinite(images, flag)
    check_k.outside(labels, classes, flag)


def check_images(net, images, up_to=False, finite=True) -> int:
    """float32, finite (unless `finite` is False), shape (net.batch, *input_shape); with
    up_to, any batch from 1 to net.batch. Returns the batch."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.float32:
        raise ValueError(f"images must be a float32 torch tensor, got "
                         f"{getattr(images, 'dtype', type(images).__name__)}")
    n = images.shape[0] if up_to and images.dim() else net.batch
    want = (n, *net.input_shape)
    if tuple(images.shape) != want or not 1 <= n <= net.batch:
        sizes = f"(1..{net.batch}, " if up_to else f"({net.batch}, "
        raise ValueError(f"images must have shape {sizes}"
                         f"{', '.join(map(str, net.input_shape))}), got {tuple(images.shape)}")
    if finite:
        check_finite(images)
    return n


def check_finite(images, flag=None) -> None:
    """No NaN or infinity among the images. On a GPU with `flag` (a one-element float32
    tensor in the pool) one Triton reduction counts them into it (kernels/check.py), so the
    check allocates no device memory; otherwise the smallest and the largest value must be
    finite (both are NaN where any value is): two scalars, where isfinite() would allocate
    the batch's size and a float64 sum a float64 copy of it."""
    if flag is not None and images.is_cuda:
        check_k.nonfinite(images, flag)
        bad = float(flag) > 0
    else:
        low, high = torch.aminmax(images)
        bad = not (math.isfinite(low) and math.isfinite(high))
    if bad:
        raise ValueError("images contain NaN or infinite values")


def check_open(rt) -> None:
    """A closed Runtime (Runtime.close) has no pool: one line instead of a deep error."""
    if rt.arena is None:
        raise RuntimeError("this Runtime was closed (Runtime.close): make a new one")
