"""Whether a batch holds bad values, reduced on its device into one float the caller owns.

nonfinite(x, flag)          flag = how many values of x are NaN or infinite (0.0: none)
outside(labels, high, flag) flag += how many int64 labels lie outside [0, high): added, so
                            the batch's two checks share one read of the flag

On a GPU the Runtime checks each batch where it copied it, in the pool, and passes a pool
float as `flag` (its `check` tensor): the check then allocates nothing outside the cap,
where a torch reduction allocates its result (a few kilobytes per step, over `memory=`).
These are the step's first kernels there: the kernels that write training state read the
count and write nothing where it is not zero (_common.gate), and the Runtime reads it with
the loss. On the CPU a torch reduction allocates host memory only and is far faster than
the interpreter (inputs.check_finite).

Each program counts the values of its tile that are not below infinity in magnitude (a
comparison with NaN is false) and adds its count into the flag atomically: whole numbers,
so the order of the additions does not change the sum.
"""
import torch
import triton
import triton.language as tl

from ._common import INTERPRET, INTERP_TILE, cdiv, check_tensor, run

BLOCK = INTERP_TILE if INTERPRET else 4096   # elements per program
NUM_WARPS = 8


@triton.jit
def _nonfinite_kernel(x, flag, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + offs, mask=offs < n, other=0.0)
    bad = tl.where(tl.abs(v) < float("inf"), 0.0, 1.0)
    tl.atomic_add(flag, tl.sum(bad, axis=0))


def _check_flag(flag, whose: str, device) -> None:
    """`flag` is a one-element float32 tensor on `device` (`whose`: the tensor it counts)."""
    check_tensor("flag", flag, shape=(1,))
    if flag.device != device:
        raise ValueError(f"flag must be on {whose} device ({device}), got {flag.device}")


def nonfinite(x: torch.Tensor, flag: torch.Tensor) -> None:
    """flag[0] = how many values of `x` (contiguous float32) are NaN or infinite; on x's
    device, with no allocation (`flag`: a one-element float32 tensor there)."""
    check_tensor("x", x)
    _check_flag(flag, "x's", x.device)
    flag.zero_()
    if x.numel():
        run(_nonfinite_kernel, (cdiv(x.numel(), BLOCK),), x, flag, x.numel(),
            BLOCK=BLOCK, num_warps=NUM_WARPS)


@triton.jit
def _outside_kernel(x, flag, n, high, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + offs, mask=offs < n, other=0)
    bad = tl.where((v >= 0) & (v < high), 0.0, 1.0)
    tl.atomic_add(flag, tl.sum(bad, axis=0))


def outside(labels: torch.Tensor, high: int, flag: torch.Tensor) -> None:
    """flag[0] += how many values of `labels` (contiguous int64) lie outside [0, high); on
    their device, with no allocation."""
    check_tensor("labels", labels, dtype=torch.int64)
    _check_flag(flag, "labels'", labels.device)
    if isinstance(high, bool) or not isinstance(high, int) or high < 1:
        raise ValueError(f"high must be an int >= 1, got {high!r}")
    if labels.numel():
        run(_outside_kernel, (cdiv(labels.numel(), BLOCK),), labels, flag,
            labels.numel(), high, BLOCK=BLOCK, num_warps=NUM_WARPS)
