"""SGD update with torch.optim.SGD semantics (dampening 0, nesterov False, maximize False).

update(param, grad, momentum_buf, *, lr, momentum, weight_decay), element-wise, in place:
    d = grad + weight_decay * param          (skipped when weight_decay == 0: d = grad)
    if momentum != 0:
        buf = momentum * buf + d             (buf must start as zeros: momentum * 0 + d == d,
        d = buf                               exactly torch's first step, buf = clone(d))
    param = param - lr * d

The float32 operations follow torch's order and rounding (d_p = grad.add(param, alpha=wd) and
param.add_(d_p, alpha=-lr) are single FMAs in torch's kernels; buf.mul_(momentum).add_(d_p) is
two rounded ops), so results match torch.optim.SGD bitwise on the CPU interpreter and are
expected to on the GPU (torch's foreach kernels may round differently there: ~1 ulp).
One 1-D blocked memory-bound kernel: reads param, grad (and buf), writes param (and buf).
`lr` is a number, or a one-element float32 tensor on the parameters' device that the kernel
reads when it runs: the Runtime keeps the rate in its pool so that a replayed CUDA graph takes
each step's rate from there (a schedule needs no new capture; graphs.py). The two give the
same bits (a number is passed to the kernel as that float32).
update_many(items, ...) applies it to a list of (param, grad, buf), up to PER_LAUNCH (4)
tensors per launch (sched/liveness.py groups a batch norm's scale and shift with the next
layer's weight): the same bits as one update() each, with a fraction of the launches,
which a step's host pays for one by one and a replayed graph about 2 us of GPU time each.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import _CHECKED_BEFORE, INTERPRET, cdiv, check_tensor, gate, run

BLOCK = 4096
NUM_WARPS = 8
PER_LAUNCH = 4   # parameter tensors one launch updates (update_many)
# torch's add-with-alpha kernels compute a + alpha * b as one FMA (CPU vectorised fmadd; nvcc
# contracts it on CUDA) and buf.mul_(m).add_(d) as two rounded ops. The kernel spells the FMAs
# out with tl.fma and turns the compiler's own contraction off, so it rounds like torch.
NO_FP_FUSION = {} if INTERPRET else {"enable_fp_fusion": False}


@triton.jit
def _sgd_kernel(p0, g0, b0, n0, p1, g1, b1, n1, p2, g2, b2, n2, p3, g3, b3, n3, lr, momentum,
                weight_decay, skip_ptr, HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                GATED: tl.constexpr, LR_IN_MEMORY: tl.constexpr, BLOCK: tl.constexpr):
    """The update of up to four tensors in one launch: the grid's programs go to the first
    tensor's blocks (n0 elements), then the second's, and so on (n 0: no tensor there).
    GATED: where skip_ptr's float is non-zero (a bad batch) nothing is read or written.
    LR_IN_MEMORY: `lr` points at the rate's float32, else it is the rate."""
    if LR_IN_MEMORY:
        rate = tl.load(lr)
    else:
        rate = lr
    end0 = tl.cdiv(n0, BLOCK)
    end1 = end0 + tl.cdiv(n1, BLOCK)
    end2 = end1 + tl.cdiv(n2, BLOCK)
    if GATED:
        keep = tl.load(skip_ptr) == 0.0
        n0 = tl.where(keep, n0, 0)
        n1 = tl.where(keep, n1, 0)
        n2 = tl.where(keep, n2, 0)
        n3 = tl.where(keep, n3, 0)
    block = tl.program_id(0)
    if block < end0:
        _sgd_block(p0, g0, b0, n0, block, rate, momentum, weight_decay,
                   HAS_WD, HAS_MOMENTUM, BLOCK)
    elif block < end1:
        _sgd_block(p1, g1, b1, n1, block - end0, rate, momentum, weight_decay,
                   HAS_WD, HAS_MOMENTUM, BLOCK)
    elif block < end2:
        _sgd_block(p2, g2, b2, n2, block - end1, rate, momentum, weight_decay,
                   HAS_WD, HAS_MOMENTUM, BLOCK)
    else:
        _sgd_block(p3, g3, b3, n3, block - end2, rate, momentum, weight_decay,
                   HAS_WD, HAS_MOMENTUM, BLOCK)


@triton.jit
def _sgd_block(p_ptr, g_ptr, buf_ptr, n, block, lr, momentum, weight_decay,
               HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, BLOCK: tl.constexpr):
    """Block `block` of one tensor's update (the module docstring's arithmetic)."""
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    d = tl.load(g_ptr + offs, mask=mask)
    b = tl.load(buf_ptr + offs, mask=mask) if HAS_MOMENTUM else d
    p, b = sgd_step(p, d, b, lr, momentum, weight_decay, HAS_WD, HAS_MOMENTUM)
    if HAS_MOMENTUM:
        tl.store(buf_ptr + offs, b, mask=mask)
    tl.store(p_ptr + offs, p, mask=mask)


@triton.jit
def sgd_step(p, d, b, lr, momentum, weight_decay, HAS_WD: tl.constexpr,
             HAS_MOMENTUM: tl.constexpr):
    """(the new parameter, the new momentum buffer) from parameter p, gradient d and buffer
    b (returned as it is without momentum): the module docstring's arithmetic, in torch's
    order and rounding when the kernel is compiled without fp fusion (`NO_FP_FUSION`). The
    SGD kernel runs it, and so does a weight-gradient GEMM that updates the weight in its
    epilogue (kernels/linear.py: the gradient is never stored)."""
    if HAS_WD:
        d = tl.fma(p, weight_decay, d)           # torch: grad.add(param, alpha=wd)
    if HAS_MOMENTUM:
        b = momentum * b + d                    # two roundings (fp fusion is off)
        d = b
    return tl.fma(d, -lr, p), b                 # torch: param.add_(d, alpha=-lr)


def _number(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"sgd {name} must be a number, got {v!r}")
    v = float(v)
    if not (v >= 0.0) or v == float("inf"):
        raise ValueError(f"sgd {name} must be finite and >= 0, got {v!r}")
    return v


def update(param: torch.Tensor, grad: torch.Tensor, momentum_buf, *, lr,
           momentum: float, weight_decay: float, skip=None) -> None:
    """One SGD step, in place on param (and momentum_buf). See the module docstring.

    param, grad, momentum_buf: contiguous float32 of one shape on one device, non-overlapping.
    momentum_buf may be None only when momentum == 0 (it is then left untouched). `lr`: a
    number, or a one-element float32 tensor on their device holding it. `skip`: a
    one-element float32 tensor on their device; where it holds a non-zero value when the
    kernel runs (a bad batch's count), nothing changes (_common.gate).
    """
    update_many([(param, grad, momentum_buf)], lr=lr, momentum=momentum,
                weight_decay=weight_decay, skip=skip)


class Update(NamedTuple):
    """An SGD step a kernel applies to the parameter it computes the gradient of, in its
    epilogue (kernels/linear.py's weight gradient): the settings `update()` takes beside
    param and grad."""
    momentum_buf: object      # a tensor shaped like the parameter, or None without momentum
    lr: object                # a number, or a one-element float32 tensor holding it
    momentum: float
    weight_decay: float
    skip: object = None       # as update()'s


def fused_arguments(step: Update, param) -> tuple:
    """(buffer, rate, momentum, weight decay, skip pointer) and the constexpr flags
    (HAS_WD, HAS_MOMENTUM, GATED, LR_IN_MEMORY) a kernel running `sgd_step` on `param`
    takes for `step`, after update()'s checks of it: before anything launches."""
    in_memory = isinstance(step.lr, torch.Tensor)
    lr = step.lr if in_memory else _number("lr", step.lr)
    momentum = _number("momentum", step.momentum)
    weight_decay = _number("weight_decay", step.weight_decay)
    buf = _fused_buffer(param, step.momentum_buf, momentum)
    if in_memory:
        _check_rate_tensor(lr, param.device, [(param, None, buf)])
    skip_ptr, gated = gate(step.skip, param.device, param)
    flags = dict(HAS_WD=weight_decay != 0.0, HAS_MOMENTUM=momentum != 0.0, GATED=gated,
                 LR_IN_MEMORY=in_memory)
    return (buf, lr, momentum, weight_decay, skip_ptr), flags


def _fused_buffer(param, buf, momentum):
    """The momentum buffer a fused step reads (param, unread, without momentum), checked:
    shaped like param, on its device, apart from it."""
    if momentum == 0.0:
        return param
    if buf is None:
        raise ValueError("sgd: momentum_buf is required when momentum != 0")
    if not _CHECKED_BEFORE[0]:
        check_tensor("momentum_buf", buf, shape=param.shape)
        if buf.device != param.device:
            raise ValueError(f"sgd: momentum_buf is on {buf.device} but param is on "
                             f"{param.device}")
        a0, b0, n = param.data_ptr(), buf.data_ptr(), 4 * param.numel()
        if n and a0 < b0 + n and b0 < a0 + n:
            raise ValueError("sgd: param and momentum_buf overlap")
    return buf


def update_many(items, *, lr, momentum: float, weight_decay: float,
                skip=None) -> None:
    """update() on each (param, grad, momentum_buf) of `items`, PER_LAUNCH tensors per launch
    (the last launch takes the rest). Every item is checked before the first launch, so bad
    input changes nothing."""
    in_memory = isinstance(lr, torch.Tensor)
    lr = lr if in_memory else _number("lr", lr)
    momentum = _number("momentum", momentum)
    weight_decay = _number("weight_decay", weight_decay)
    todo = [t for t in (_checked(*item, momentum) for item in items) if t[0].numel()]
    if not todo:
        return
    device = todo[0][0].device
    if in_memory:
        _check_rate_tensor(lr, device, todo)
    skip_ptr, gated = gate(skip, device, todo[0][0])
    for group in (todo[i:i + PER_LAUNCH] for i in range(0, len(todo), PER_LAUNCH)):
        slots = group + [group[0]] * (PER_LAUNCH - len(group))    # unread: their n is 0
        sizes = [p.numel() for p, _, _ in group] + [0] * (PER_LAUNCH - len(group))
        args = [a for (p, g, b), n in zip(slots, sizes) for a in (p, g, b, n)]
        run(_sgd_kernel, (sum(cdiv(n, BLOCK) for n in sizes),), *args,
            lr, momentum, weight_decay, skip_ptr,
            HAS_WD=weight_decay != 0.0, HAS_MOMENTUM=momentum != 0.0, GATED=gated,
            LR_IN_MEMORY=in_memory, BLOCK=BLOCK, num_warps=NUM_WARPS, **NO_FP_FUSION)


def _check_rate_tensor(lr, device, todo) -> None:
    """A learning rate held in memory: one float32 on the parameters' device, apart from
    every tensor the launches write (each program reads it as the others update); skipped
    within `_common.checked_before`."""
    if _CHECKED_BEFORE[0]:
        return
    check_tensor("lr", lr, shape=(1,))
    if lr.device != device:
        raise ValueError(f"sgd: lr is on {lr.device} but param is on {device}")
    at = lr.data_ptr()
    for p, _, b in todo:
        for name, t in (("param", p), ("momentum_buf", b)):
            if t.data_ptr() <= at < t.data_ptr() + 4 * t.numel():
                raise ValueError(f"sgd: lr lies inside a {name}")


def _checked(param, grad, momentum_buf, momentum):
    """(param, grad, buf) after the checks update() documents (the tensors' skipped within
    `_common.checked_before`); buf is param (an unread pointer) where momentum is 0."""
    if momentum != 0.0 and momentum_buf is None:
        raise ValueError("sgd: momentum_buf is required when momentum != 0")
    if not _CHECKED_BEFORE[0]:
        _check_tensors(param, grad, momentum_buf, momentum)
    return param, grad, momentum_buf if momentum != 0.0 else param


def _check_tensors(param, grad, momentum_buf, momentum) -> None:
    check_tensor("param", param)
    check_tensor("grad", grad, shape=param.shape)
    tensors = [("param", param), ("grad", grad)]
    if momentum != 0.0:
        check_tensor("momentum_buf", momentum_buf, shape=param.shape)
        tensors.append(("momentum_buf", momentum_buf))
    n = param.numel()
    for name, t in tensors[1:]:
        if t.device != param.device:
            raise ValueError(f"sgd: {name} is on {t.device} but param is on {param.device}")
    for i, (na, a) in enumerate(tensors):
        for nb, b in tensors[i + 1:]:
            a0, b0 = a.data_ptr(), b.data_ptr()
            if n and a0 < b0 + 4 * n and b0 < a0 + 4 * n:
                raise ValueError(f"sgd: {na} and {nb} overlap")


def workspace_bytes(*args, **kwargs) -> int:
    """The update is element-wise in place: no scratch memory."""
    return 0
