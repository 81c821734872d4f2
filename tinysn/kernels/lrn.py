"""LocalResponseNorm across channels (nn.LocalResponseNorm), NCHW, forward and backward.

    s_c = k + alpha / size * sum_{c' = c - size//2 .. c + (size-1)//2, 0 <= c' < C} x_c'^2
    y_c = x_c * s_c^(-beta)

exactly torch's window (it zero-pads the squared input by size//2 in front and
(size-1)//2 behind, then averages over `size` channels), for odd and even sizes.

Backward, recomputed from x alone (no saved scale tensor, so y can be freed after use):

    dx_j = dy_j s_j^(-beta)
           - 2 beta alpha / size * x_j * sum_{c: j in window(c)} dy_c x_c s_c^(-beta-1)

where j is in window(c) for c = j - (size-1)//2 .. j + size//2. Each lane re-derives the
size scales s_c it needs (size x size cached loads of x per pixel: fine for size 5).

API
    forward(x, y, *, size, alpha, beta, k)
    backward(x, dy, dx, *, size, alpha, beta, k, accumulate=False)
    workspace_bytes(*args) -> 0

Layout: one program takes a [CB channels, BLOCK pixels] tile of one image (pixel rows
contiguous); the neighbouring channels' rows that the windows read again are cache hits.
Powers are computed as exp2(-beta * log2(s)).
"""
import math

import triton
import triton.language as tl

from ._common import autotune, cdiv, check_tensor, launch

_GPU_CONFIGS = [
    triton.Config({"BLOCK": 256, "CB": 4}, num_warps=4),
    triton.Config({"BLOCK": 512, "CB": 2}, num_warps=4),
    triton.Config({"BLOCK": 256, "CB": 8}, num_warps=8),
    triton.Config({"BLOCK": 1024, "CB": 2}, num_warps=8),
]
_GPU_BWD_CONFIGS = [   # the backward unrolls size*size loads: fewer elements per thread
    triton.Config({"BLOCK": 128, "CB": 2}, num_warps=4),
    triton.Config({"BLOCK": 256, "CB": 2}, num_warps=4),
    triton.Config({"BLOCK": 128, "CB": 4}, num_warps=4),
    triton.Config({"BLOCK": 512, "CB": 2}, num_warps=8),
    triton.Config({"BLOCK": 256, "CB": 4}, num_warps=8),
]
_SMALL_CONFIG = triton.Config({"BLOCK": 128, "CB": 8}, num_warps=4)


def workspace_bytes(*args, **kwargs) -> int:
    """LRN needs no scratch memory."""
    return 0


@triton.jit
def _scale(x_ptr, c, C, HW, mask, alpha_n, k, SIZE: tl.constexpr, LO: tl.constexpr):
    """s_c = k + alpha/size * sum of x^2 over the channel window of c (zeros outside).

    x_ptr: pointers to channel 0 of each lane's pixel; c: each lane's channel.
    """
    ssum = tl.zeros(mask.shape, tl.float32)
    for d in tl.static_range(SIZE):
        cc = c - LO + d
        v = tl.load(x_ptr + cc * HW, mask=mask & (cc >= 0) & (cc < C), other=0.0)
        ssum += v * v
    return k + alpha_n * ssum


@triton.jit
def _tile(C, HW, CB: tl.constexpr, BLOCK: tl.constexpr):
    """This program's [CB channels, BLOCK pixels] tile: channel ids, pixel ids, mask, base."""
    hw = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * CB + tl.arange(0, CB)
    base = tl.program_id(2).to(tl.int64) * C * HW
    c2 = c[:, None] + tl.zeros([CB, BLOCK], tl.int32)
    mask = (c2 < C) & (hw[None, :] < HW)
    return c2, hw[None, :] + base, mask


@autotune(_GPU_CONFIGS, _SMALL_CONFIG, key=["C", "HW", "SIZE"])
@triton.jit
def _lrn_fwd_kernel(x, y, C, HW, alpha_n, beta, k, SIZE: tl.constexpr, LO: tl.constexpr,
                    BLOCK: tl.constexpr, CB: tl.constexpr):
    c, pix, m = _tile(C, HW, CB, BLOCK)
    s = _scale(x + pix, c, C, HW, m, alpha_n, k, SIZE, LO)
    xc = tl.load(x + pix + c * HW, mask=m, other=0.0)
    tl.store(y + pix + c * HW, xc * tl.exp2(-beta * tl.log2(s)), mask=m)


@autotune(_GPU_BWD_CONFIGS, _SMALL_CONFIG,
                 key=["C", "HW", "SIZE"], restore=["dx"])
@triton.jit
def _lrn_bwd_kernel(x, dy, dx, C, HW, alpha_n, beta, k, SIZE: tl.constexpr, LO: tl.constexpr,
                    HI: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr):
    j, pix, m = _tile(C, HW, CB, BLOCK)
    total = tl.zeros([CB, BLOCK], tl.float32)
    lg_j = tl.zeros([CB, BLOCK], tl.float32)
    for d in tl.static_range(SIZE):
        c = j - HI + d                          # the channels whose window holds j
        cm = m & (c >= 0) & (c < C)
        lg = tl.log2(_scale(x + pix, c, C, HW, cm, alpha_n, k, SIZE, LO))
        if d == HI:
            lg_j = lg                           # c == j: keep log2(s_j)
        xc = tl.load(x + pix + c * HW, mask=cm, other=0.0)
        gc = tl.load(dy + pix + c * HW, mask=cm, other=0.0)
        total += tl.where(cm, gc * xc * tl.exp2((-beta - 1.0) * lg), 0.0)
    xj = tl.load(x + pix + j * HW, mask=m, other=0.0)
    gj = tl.load(dy + pix + j * HW, mask=m, other=0.0)
    grad = gj * tl.exp2(-beta * lg_j) - (2.0 * beta * alpha_n) * xj * total
    if ACC:
        grad += tl.load(dx + pix + j * HW, mask=m, other=0.0)
    tl.store(dx + pix + j * HW, grad, mask=m)


def _check_params(size, alpha, beta, k):
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    for name, v in (("alpha", alpha), ("beta", beta), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")


def _check_x(x):
    check_tensor("x", x)
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D NCHW, got shape {tuple(x.shape)}")


def _grid(x):
    n, c, h, w = x.shape
    hw = h * w
    if n > 65535:
        raise ValueError(f"batch {n} exceeds the grid limit 65535")
    return lambda meta: (cdiv(hw, meta["BLOCK"]), cdiv(c, meta["CB"]), n)


def forward(x, y, *, size, alpha, beta, k):
    """y = local_response_norm(x, size, alpha, beta, k) across channels."""
    _check_params(size, alpha, beta, k)
    _check_x(x)
    check_tensor("y", y, x.shape)
    if y.device != x.device:
        raise ValueError(f"y is on {y.device} but x is on {x.device}")
    if x.numel() == 0:
        return
    n, c, h, w = x.shape
    launch(_lrn_fwd_kernel, _grid(x), (x, y, c, h * w, float(alpha) / size, float(beta),
                                        float(k)), dict(SIZE=size, LO=size // 2))


def backward(x, dy, dx, *, size, alpha, beta, k, accumulate=False):
    """dx (+)= d lrn / dx . dy, recomputing the scales from x. dx may be None."""
    _check_params(size, alpha, beta, k)
    _check_x(x)
    check_tensor("dy", dy, x.shape)
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate must be a bool, got {accumulate!r}")
    if dx is not None:
        check_tensor("dx", dx, x.shape)
    for nm, t in (("dy", dy), ("dx", dx)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{nm} is on {t.device} but x is on {x.device}")
    if dx is None or x.numel() == 0:
        return
    n, c, h, w = x.shape
    launch(_lrn_bwd_kernel, _grid(x), (x, dy, dx, c, h * w, float(alpha) / size, float(beta),
                                        float(k)),
           dict(SIZE=size, LO=size // 2, HI=(size - 1) // 2, ACC=accumulate))
