"""Inverted dropout (nn.Dropout in training mode) with no stored mask.

forward(x, y, *, p, seed, iteration, layer, offset=0)                y = x * keep / (1 - p)
backward(dy, dx, *, p, seed, iteration, layer, offset=0, accumulate)  dx (+)= dy * keep / (1 - p)
advance(iteration)                                                   iteration += 1 (on the device)

The keep mask is regenerated from (seed, iteration, layer, offset) by the backward pass (and
by a recomputed forward), so it never occupies memory. An element is kept when its uniform
draw u >= p. `iteration` is a one-element int64 device tensor that the kernel reads (the
Runtime's iteration counter, in the pool): a CUDA graph that captured the launch draws a new
mask on each replay once `advance` (captured too) has moved the counter on.

Random numbers: Philox-4x32-10 (`tl.philox`, 32-bit counter words); one Philox call gives four
32-bit outputs, used by four consecutive elements. With i the counter's value, element e of a
launch (flat index, 0 <= e < numel) takes
    key     = (seed, i >> 32)                  (k0 = seed, k1 = the high word of i)
    counter = (offset + e // 4, layer, i mod 2**32)
              (the 64-bit element counter is c0 (low word) and c1; c2 = layer; c3 = i's low word)
    draw    = output e % 4 of that call
    u       = int31(draw) * 4.6566127342e-10   (triton's uint_to_uniform_float: [0, 1))
and is kept when u >= p. (seed, iteration, layer, e) is packed into Philox's key and counter
without loss, so no two of them share a draw, and the mask depends only on (seed, iteration,
layer, offset, e, p): not on the block size, the device or the triton version (tests pin it
against a numpy Philox).

p == 0 is an exact copy (y = x bitwise). p must lie in [0, 1); seed in [0, 2**31); layer in
[0, 2**31); offset >= 0; the counter's value >= 0 (not read on the host: a capture cannot).
"""
import torch
import triton
import triton.language as tl

from ._common import cdiv, check_tensor, gate, run

BLOCK = 4096      # elements per program (BLOCK // 4 Philox calls); any multiple of 4 gives
NUM_WARPS = 8     # the same mask


@triton.jit
def _uniform(r):
    """A uint32 Philox output -> float32 in [0, 1) (as triton's uint_to_uniform_float)."""
    i = r.to(tl.int32, bitcast=True)
    i = tl.where(i < 0, ~i, i)              # a 31-bit non-negative integer
    return i.to(tl.float32) * 4.6566127342e-10


@triton.jit(do_not_specialize=["seed", "layer", "offset"])   # one variant for every layer
def _dropout_kernel(src_ptr, dst_ptr, it_ptr, n, p, scale, seed, layer, offset,
                    BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):
    Q: tl.constexpr = BLOCK // 4
    pid = tl.program_id(0).to(tl.int64)
    it = tl.load(it_ptr)                                        # the iteration (int64)
    key = ((it >> 32) << 32) + seed.to(tl.int64)                # k0 = seed, k1 = it >> 32
    ctr = offset + pid * Q + tl.arange(0, Q).to(tl.int64)      # 64-bit element counter
    c0 = ctr.to(tl.uint32)                                      # low word (truncating cast)
    c1 = (ctr >> 32).to(tl.uint32)                              # high word
    zero = c0 * 0
    c2 = zero + layer.to(tl.uint32)
    c3 = zero + it.to(tl.uint32)                                # the iteration's low word
    r0, r1, r2, r3 = tl.philox(key, c0, c1, c2, c3)
    # element 4*i + j of the block takes output j of counter i: each thread then holds four
    # contiguous elements (one 16-byte load) together with the Philox call that covers them
    r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src_ptr + offs, mask=mask)
    out = tl.where(_uniform(r) >= p, v * scale, 0.0)
    if ACCUMULATE:
        out = tl.load(dst_ptr + offs, mask=mask) + out
    tl.store(dst_ptr + offs, out, mask=mask)


@triton.jit
def _advance_kernel(it_ptr, skip_ptr, GATED: tl.constexpr):
    if GATED:
        tl.store(it_ptr, tl.load(it_ptr) + 1, mask=tl.load(skip_ptr) == 0.0)
    else:
        tl.store(it_ptr, tl.load(it_ptr) + 1)


def _check_iteration(iteration, device):
    """A one-element int64 tensor on `device` (its value is not read: no host sync)."""
    if (not isinstance(iteration, torch.Tensor) or iteration.dtype != torch.int64
            or iteration.numel() != 1 or iteration.device != device):
        got = (f"{iteration.dtype} {tuple(iteration.shape)} on {iteration.device}"
               if isinstance(iteration, torch.Tensor) else type(iteration).__name__)
        raise ValueError(f"dropout iteration must be a one-element int64 tensor on {device}, "
                         f"got {got}")


def _check_args(src_name, src, dst_name, dst, p, seed, iteration, layer, offset,
                accumulate=False):
    check_tensor(src_name, src)
    check_tensor(dst_name, dst, shape=src.shape)
    if dst.device != src.device:
        raise ValueError(f"{dst_name} is on {dst.device} but {src_name} is on {src.device}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p < 1.0):
        raise ValueError(f"dropout p must be a number in [0, 1), got {p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**31):
        raise ValueError(f"dropout seed must be an int in [0, 2**31), got {seed!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not (0 <= layer < 2**31):
        raise ValueError(f"dropout layer must be an int in [0, 2**31), got {layer!r}")
    _check_iteration(iteration, src.device)
    if (isinstance(offset, bool) or not isinstance(offset, int)
            or not (0 <= offset and offset + src.numel() < 2**63)):
        raise ValueError(f"dropout offset must be an int >= 0 (offset + numel < 2**63), "
                         f"got {offset!r}")
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate must be a bool, got {accumulate!r}")
    n = src.numel()
    if n:
        a0, b0 = src.data_ptr(), dst.data_ptr()
        if a0 != b0 and a0 < b0 + 4 * n and b0 < a0 + 4 * n:
            raise ValueError(f"dropout: {dst_name} partly overlaps {src_name}")


def _launch(src, dst, p, seed, iteration, layer, offset, accumulate):
    n = src.numel()
    if n == 0:
        return
    p = float(p)
    scale = 1.0 / (1.0 - p)
    run(_dropout_kernel, (cdiv(n, BLOCK),), src, dst, iteration, n, p, scale, seed,
        layer, offset, BLOCK=BLOCK, ACCUMULATE=accumulate, num_warps=NUM_WARPS)


def forward(x: torch.Tensor, y: torch.Tensor, *, p: float, seed: int,
            iteration: torch.Tensor, layer: int, offset: int = 0) -> None:
    """y = x * keep / (1 - p) with keep drawn from (seed, iteration, layer, offset). y may
    be x (in place)."""
    _check_args("x", x, "y", y, p, seed, iteration, layer, offset)
    _launch(x, y, p, seed, iteration, layer, offset, False)


def backward(dy: torch.Tensor, dx: torch.Tensor, *, p: float, seed: int,
             iteration: torch.Tensor, layer: int, offset: int = 0,
             accumulate: bool = False) -> None:
    """dx (+)= dy * keep / (1 - p), regenerating the forward's mask from the same (seed,
    iteration, layer, offset)."""
    _check_args("dy", dy, "dx", dx, p, seed, iteration, layer, offset, accumulate)
    _launch(dy, dx, p, seed, iteration, layer, offset, accumulate)


def advance(iteration: torch.Tensor, skip=None) -> None:
    """iteration += 1, by one tiny kernel on its device (so a captured graph advances it on
    every replay); not where `skip` (a one-element float32 tensor there) holds a non-zero
    value, a bad batch's count (_common.gate)."""
    _check_iteration(iteration, iteration.device if isinstance(iteration, torch.Tensor)
                     else None)
    skip_ptr, gated = gate(skip, iteration.device, iteration)
    run(_advance_kernel, (1,), iteration, skip_ptr, GATED=gated)


def workspace_bytes(*args, **kwargs) -> int:
    """Dropout stores no mask and needs no scratch memory."""
    return 0
