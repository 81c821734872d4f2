"""MaxPool2d / AvgPool2d (NCHW, floor mode, torch semantics), forward and backward.

API
    out_shape(x_shape, kernel, stride, padding) -> (N, C, OH, OW)
    forward(x, y, *, mode, kernel, stride, padding, argmax=None)   mode "max" | "avg"
    backward(x, y, dy, dx, *, mode, kernel, stride, padding, accumulate=False,
             workspace=None, argmax=None, x_is_relu_output=False)
    argmax_bytes(x_shape, *, mode, kernel, stride, padding) -> bytes of `argmax` (0: none)
    reads_input(mode, saves_argmax, x_is_relu_output) -> whether backward reads x
    workspace_bytes(*args) -> 0
kernel, stride and padding are ints or (h, w) pairs. As torch requires: padding <= kernel // 2
and kernel <= the padded input, else ValueError. Average pooling counts the padding
(count_include_pad=True, torch's default); in floor mode every window then has
kernel_h * kernel_w cells, so the divisor is constant.

Forward: one lane per output element scans its window (row-major). Max: the running maximum
is replaced when a value is greater, or is NaN, or is the first in-image cell of the window,
exactly torch's rule; so a NaN propagates and on ties the FIRST maximum in scan order wins.
Global pooling (the window covers the whole unpadded image) uses a reduction kernel that
reads each plane as one contiguous row.

Backward is a GATHER over input pixels, no atomics, so it is deterministic. Input pixels are
grouped into "cells" of stride_h x stride_w pixels: all pixels of a cell lie in the same
candidate windows (at most ceil(kh/sh) * ceil(kw/sw) of them). One lane handles one cell:
it loads dy of each candidate window once and adds it to the cell pixels that the window
covers (avg: dy / (kh*kw)) or that are the window's argmax (max).

Windows that tile the input (kernel = stride, no padding, H and W multiples of the kernel,
power-of-2 sides: VGG's 2x2/2) take a second backward kernel, which needs no cells: window
row o covers KH whole input rows, so a program loads [rows, KH, columns] tiles of x and
stores dx 16 bytes at a time (the gather's lanes read and write 4 bytes at a time), with
the same scan rule and the same bits.

Max pooling's argmax, three ways, the same bits each way (the gradient goes to the pixel
torch picks: the first maximum in scan order, or the last NaN; with ties the input is not
differentiable and torch's choice is reproduced exactly):
- Stored by the forward (`argmax`: one byte per window, its tap, so windows of at most 128
  taps; the runtime keeps it from forward to backward, ops.py, counted in the plan). The
  backward then reads dy, the argmax bytes and writes dx: not x, which the scheduler may
  free after the forward. The byte's top bit (NONPOSITIVE) says the window's maximum is
  <= 0, which is all a ReLU mask on x would say about the pixels the window sends its
  gradient to, so the backward through the ReLU before the pool does not read x either
  (but where dx accumulates: then pixels no window picks need the mask too). 1 byte per
  window against the int64 index tensor torch keeps (8 bytes). The gather for overlapping
  windows takes the input in groups of stride_h rows and stride_w columns (1 or 2;
  wider column strides keep no bytes, argmax_bytes), whose pixels share their windows'
  loads, a program's lanes along whole input rows, so dx is stored 16 bytes at a time;
  tiling windows take the tiles kernel, reading the bytes where it would read x.
- Found again from x, by the forward's scan and tie rule, in the cells' gather: each
  candidate window's kh*kw cells per cell of the grid -- for 3x3 stride 2, 4 windows x 9
  loads per 2x2 cell (9 cached loads per pixel); for stride 1 windows overlap more (3x3/1:
  81 cached loads per pixel), which makes it compute-bound rather than bandwidth-bound.
- Given a workspace of one byte per window (argmax_workspace_bytes), found once, into it
  (the forward kernel with STORE_ARG alone), then gathered as the stored ones: two
  launches, x read twice. Windows that do not overlap (kernel <= stride) take no
  workspace: a cell's one window is the cell, so the gather's scan reads x once, as the
  argmax pass would again.

Determinism: every output (and every dx) element is produced by one lane in a fixed order
(window scan; candidate windows i, j ascending), so the autotuned block sizes do not change
a bit of the results; the global-pool sum is a cross-lane reduction, so its tile is fixed.
The backward kernel declares restore=["dx"] so that autotuning an accumulating launch
(it runs the kernel several times) does not add twice.
"""
import torch
import triton
import triton.language as tl

from ._common import (INTERP_TILE, autotune, cdiv, check_device, check_no_overlap,
                      check_tensor, launch, next_power_of_2, pair, run)

_FWD_GPU = [
    triton.Config({"BLOCK": 256}, num_warps=4),
    triton.Config({"BLOCK": 512}, num_warps=4),
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 1024}, num_warps=8),
]
_FWD_INTERP = triton.Config({"BLOCK": INTERP_TILE}, num_warps=4)

# backward: LANES = elements of the program's [cells, CELLP] tile; the cell count BLOCK =
# LANES // CELLP follows (triton.heuristics), so that a tile stays in registers whatever the
# stride. The max backward unrolls kh*kw loads per candidate window: <= 8 lanes per thread.
_BWD_GPU = [
    triton.Config({"LANES": 512}, num_warps=4),
    triton.Config({"LANES": 1024}, num_warps=4),
    triton.Config({"LANES": 1024}, num_warps=8),
    triton.Config({"LANES": 2048}, num_warps=8),
]
_BWD_INTERP = triton.Config({"LANES": INTERP_TILE}, num_warps=4)

# the argmax backward's tiles: LANES pixels, BC columns of each of LANES // BC input rows
_ROWS_GPU = [
    triton.Config({"LANES": 1024}, num_warps=4),
    triton.Config({"LANES": 2048}, num_warps=4),
    triton.Config({"LANES": 2048}, num_warps=8),
    triton.Config({"LANES": 4096}, num_warps=8),
]
_ROWS_INTERP = triton.Config({"LANES": INTERP_TILE}, num_warps=4)

# global pooling sums across lanes (tl.sum), so its tile is fixed, not autotuned: the
# summation order, hence every bit of the result, must not depend on a timing race
_GLOBAL_LANES = 2048

_INT32_LIMIT = 2**31 - 1
# an argmax byte (_argmax_byte): the tap in its low 7 bits, NONPOSITIVE where the maximum <= 0
NONPOSITIVE = tl.constexpr(128)
MAX_ARGMAX_TAPS = 128


def workspace_bytes(*args, **kwargs) -> int:
    """Pooling needs no scratch memory (max pooling keeps no index tensor either); its
    backward can use some (argmax_workspace_bytes)."""
    return 0


# ----------------------------------------------------------------------------- arguments

def _params(kernel, stride, padding):
    kh, kw = pair(kernel, "pool: kernel", 1)
    sh, sw = pair(stride, "pool: stride", 1)
    ph, pw = pair(padding, "pool: padding", 0)
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"padding {(ph, pw)} must be at most half the kernel {(kh, kw)}")
    return kh, kw, sh, sw, ph, pw


def out_shape(x_shape, kernel, stride, padding):
    """(N, C, OH, OW) of a pooling of an NCHW input, floor mode as torch."""
    if len(tuple(x_shape)) != 4:
        raise ValueError(f"pooling input must be 4-D NCHW, got shape {tuple(x_shape)}")
    n, c, h, w = (int(s) for s in x_shape)
    kh, kw, sh, sw, ph, pw = _params(kernel, stride, padding)
    if h + 2 * ph < kh or w + 2 * pw < kw:
        raise ValueError(f"kernel {(kh, kw)} is larger than the padded input "
                         f"{(h + 2 * ph, w + 2 * pw)}")
    return (n, c, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1)


def _mode(mode):
    if mode not in ("max", "avg"):
        raise ValueError(f"mode must be 'max' or 'avg', got {mode!r}")
    return mode == "max"


def _check_io(x, y, kernel, stride, padding):
    check_tensor("x", x)
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D NCHW, got shape {tuple(x.shape)}")
    shape = out_shape(x.shape, kernel, stride, padding)
    check_tensor("y", y, shape)
    return shape

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _window_scan(xp, h0, w0, lanes, H, W, KH: tl.constexpr, KW: tl.constexpr,
                 IS_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """Each lane's KH x KW window whose top-left cell is (h0, w0) of the plane at xp, scanned
    row-major: IS_MAX, (its maximum, the maximum's tap kh * KW + kw), a value replacing the
    running maximum when it is greater, or NaN, or the window's first in-image cell (torch's
    rule: NaN propagates, on ties the first maximum wins); else (the sum of its in-image
    cells, 0)."""
    if IS_MAX:
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
    found = tl.zeros([BLOCK], tl.int1)
    arg = tl.zeros([BLOCK], tl.int32)
    for kh in range(KH):
        ih = h0 + kh
        hv = lanes & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = w0 + kw
            valid = hv & (iw >= 0) & (iw < W)
            if IS_MAX:
                v = tl.load(xp + ih * W + iw, mask=valid, other=float("-inf"))
                take = valid & ((v > acc) | (v != v) | (found == 0))
                acc = tl.where(take, v, acc)
                arg = tl.where(take, kh * KW + kw, arg)
                found = found | valid
            else:
                acc += tl.load(xp + ih * W + iw, mask=valid, other=0.0)
    return acc, arg


@autotune(_FWD_GPU, _FWD_INTERP,
                 key=["total", "H", "W", "KH", "KW", "SH", "SW"])
@triton.jit
def _pool_fwd_kernel(x, y, arg_out, total, H, W, OH, OW,
                     KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                     PH: tl.constexpr, PW: tl.constexpr, IS_MAX: tl.constexpr,
                     INDEX64: tl.constexpr, STORE_Y: tl.constexpr, STORE_ARG: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One lane per output element, flattened over N*C*OH*OW. STORE_Y: y gets the maximum
    (the mean). STORE_ARG (max): the uint8 `arg_out` gets each window's argmax byte, its tap
    kh * KW + kw, plus NONPOSITIVE where the maximum is <= 0 (_argmax_byte)."""
    if INDEX64:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    ow = offs % OW
    t = offs // OW
    oh = t % OH
    plane = t // OH
    xp = x + plane * H * W
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    out, arg = _window_scan(xp, h0, w0, mask, H, W, KH, KW, IS_MAX, BLOCK)
    if STORE_ARG:
        tl.store(arg_out + offs, _argmax_byte(arg, out), mask=mask)
    if STORE_Y:
        if IS_MAX:
            tl.store(y + offs, out, mask=mask)
        else:
            tl.store(y + offs, out / (KH * KW), mask=mask)


@triton.jit
def _argmax_byte(tap, top):
    """A window's argmax as one byte: its tap (< 128), plus 128 where the window's maximum
    `top` is <= 0. The max backward through the ReLU before the pool zeroes that window's
    gradient instead of reading x: the pixels a window sends its gradient to hold its
    maximum, so x <= 0 there exactly when it is <= 0 (NaN: neither)."""
    return (tap + tl.where(top <= 0.0, NONPOSITIVE, 0)).to(tl.uint8)


@triton.jit
def _pool_global_fwd_kernel(x, y, planes, HW, IS_MAX: tl.constexpr, INDEX64: tl.constexpr,
                            COLS: tl.constexpr, PLANES: tl.constexpr):
    """y[p] = max / mean of plane p (HW contiguous elements), PLANES planes per program."""
    if INDEX64:
        rows = tl.program_id(0).to(tl.int64) * PLANES + tl.arange(0, PLANES)
    else:
        rows = tl.program_id(0) * PLANES + tl.arange(0, PLANES)
    rmask = rows < planes
    cols = tl.arange(0, COLS)
    base = rows[:, None] * HW
    if IS_MAX:
        m = tl.full([PLANES, COLS], float("-inf"), tl.float32)
        nan = tl.zeros([PLANES, COLS], tl.int1)
    else:
        acc = tl.zeros([PLANES, COLS], tl.float32)
    for c0 in range(0, HW, COLS):
        cm = rmask[:, None] & ((c0 + cols) < HW)[None, :]
        if IS_MAX:
            v = tl.load(x + base + c0 + cols[None, :], mask=cm, other=float("-inf"))
            nan = nan | (v != v)
            m = tl.maximum(m, v)
        else:
            acc += tl.load(x + base + c0 + cols[None, :], mask=cm, other=0.0)
    if IS_MAX:
        out = tl.max(m, axis=1)
        out = tl.where(tl.max(nan.to(tl.int32), axis=1) > 0, float("nan"), out)
    else:
        out = tl.sum(acc, axis=1) / HW
    tl.store(y + rows, out, mask=rmask)


@autotune(_BWD_GPU, _BWD_INTERP,
                 key=["total", "H", "W", "KH", "KW", "SH", "SW"], restore=["dx"])
@triton.heuristics({"BLOCK": lambda a: max(2, a["LANES"] // a["CELLP"])})
@triton.jit
def _pool_bwd_kernel(x, dy, dx, total, H, W, OH, OW, NBH, NBW, OBH, OBW,
                     KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                     PH: tl.constexpr, PW: tl.constexpr, NH: tl.constexpr, NW: tl.constexpr,
                     CELLP: tl.constexpr, IS_MAX: tl.constexpr, ACC: tl.constexpr,
                     INDEX64: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
                     MASK: tl.constexpr = False):
    """Gather: one lane per cell of SH x SW input pixels (cell = pixels sharing windows);
    max: each candidate window's argmax is found again from x. MASK: x is a ReLU's output,
    and dx goes on through that ReLU's backward (0 where x <= 0).

    Cell (orow, ocol) holds rows orow*SH - PH + r (r < SH) and cols ocol*SW - PW + q; its
    candidate windows are (orow - i, ocol - j), i < NH = ceil(KH/SH), j < NW. Pixel (r, q)
    sits in window (orow - i, ocol - j) at window offset (r + i*SH, q + j*SW) when that is
    inside the KH x KW window.
    """
    if INDEX64:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cmask = offs < total
    ocol = offs % NBW + OBW
    t = offs // NBW
    orow = t % NBH + OBH
    plane = t // NBH
    xbase = plane * H * W
    xp = x + xbase
    gp = dy + plane * OH * OW

    e = tl.arange(0, CELLP)
    r = e // SW
    q = e % SW
    emask = e < SH * SW
    ih = orow[:, None] * SH - PH + r[None, :]
    iw = ocol[:, None] * SW - PW + q[None, :]
    inb = cmask[:, None] & emask[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)

    acc = tl.zeros([BLOCK, CELLP], tl.float32)
    for i in tl.static_range(NH):
        wr = orow - i
        rv = cmask & (wr >= 0) & (wr < OH)
        for j in tl.static_range(NW):
            wc = ocol - j
            wv = rv & (wc >= 0) & (wc < OW)
            inwin = ((r + i * SH) < KH) & ((q + j * SW) < KW) & emask
            g = tl.load(gp + wr * OW + wc, mask=wv, other=0.0)
            if IS_MAX:    # window (wr, wc) scanned as in the forward (first max wins)
                _, arg = _window_scan(xp, wr * SH - PH, wc * SW - PW, wv, H, W, KH, KW,
                                      True, BLOCK)
                rel = (r + i * SH) * KW + (q + j * SW)
                hit = inwin[None, :] & (arg[:, None] == rel[None, :]) & wv[:, None]
                acc += tl.where(hit, g[:, None], 0.0)
            else:
                g = g / (KH * KW)
                acc += tl.where(inwin[None, :] & wv[:, None], g[:, None], 0.0)
    dptrs = dx + xbase[:, None] + ih * W + iw
    if ACC:
        acc += tl.load(dptrs, mask=inb, other=0.0)
    if MASK:            # as kernels/act.py's backward: where(y <= 0, 0, g)
        xv = tl.load(x + xbase[:, None] + ih * W + iw, mask=inb, other=0.0)
        acc = tl.where(xv <= 0.0, 0.0, acc)
    tl.store(dptrs, acc, mask=inb)


@autotune(_BWD_GPU, _BWD_INTERP, key=["ROWS", "W", "KH", "KW"], restore=["dx"])
@triton.heuristics({"BR": lambda a: max(1, a["LANES"] // (a["KH"] * a["BC"]))})
@triton.jit
def _pool_tiles_bwd_kernel(x, argmax, dy, dx, ROWS, W, OW, KH: tl.constexpr,
                           KW: tl.constexpr, IS_MAX: tl.constexpr, ACC: tl.constexpr,
                           INDEX64: tl.constexpr, MASK: tl.constexpr, FROM_ARG: tl.constexpr,
                           FLAGS: tl.constexpr, BC: tl.constexpr, LANES: tl.constexpr,
                           BR: tl.constexpr):
    """The backward of windows that tile the input (kernel = stride, no padding, H and W
    multiples of the kernel, KH and KW powers of 2; VGG's 2x2/2): window row o of every
    plane covers KH whole input rows, one contiguous run of KH * W pixels, so a program
    takes BR window rows and BC columns of each of their KH input rows as one [BR, KH, BC]
    tile of contiguous rows (16-byte loads and stores, where the cell-per-lane gather
    reads and writes 4 bytes at a time). Each window's gradient goes to its argmax by the
    forward's scan rule (row-major; the first maximum, or the last NaN, wins); avg: dy /
    (KH * KW) to every cell. MASK and ACC as _pool_bwd_kernel. FROM_ARG (max): each
    window's argmax is read from `argmax` (one byte per window, as the forward stored it)
    instead of x; FLAGS as _pool_argmax_bwd_kernel's."""
    BW: tl.constexpr = BC // KW
    if INDEX64:
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    else:
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
    c0 = tl.program_id(1) * BC
    cols = c0 + tl.arange(0, BC)
    kh = tl.arange(0, KH)
    offs = (rows[:, None, None] * KH + kh[None, :, None]) * W + cols[None, None, :]
    ok = (rows < ROWS)[:, None, None] & (cols < W)[None, None, :]
    ok = ok & (kh >= 0)[None, :, None]          # every kh: only broadcasts to the tile's shape
    wcols = c0 // KW + tl.arange(0, BW)
    dok = (rows < ROWS)[:, None] & (wcols < OW)[None, :]
    g = tl.load(dy + rows[:, None] * OW + wcols[None, :], mask=dok, other=0.0)   # [BR, BW]
    if (IS_MAX and not FROM_ARG) or MASK:
        v = tl.load(x + offs, mask=ok, other=0.0)
    if IS_MAX:
        tap = (tl.arange(0, KH)[None, :, None, None] * KW
               + tl.arange(0, KW)[None, None, None, :])
        if FROM_ARG:
            a = tl.load(argmax + rows[:, None] * OW + wcols[None, :], mask=dok,
                        other=0).to(tl.int32)
            arg = a if FLAGS else a & (NONPOSITIVE - 1)     # flagged: matches no tap
        else:
            win = tl.reshape(v, (BR, KH, BW, KW))
            top = tl.max(tl.max(win, axis=3), axis=1)                               # [BR, BW]
            nan = win != win
            first = tl.min(tl.min(tl.where(win == top[:, None, :, None], tap, KH * KW),
                                  axis=3), axis=1)
            last_nan = tl.max(tl.max(tl.where(nan, tap, -1), axis=3), axis=1)
            arg = tl.where(last_nan >= 0, last_nan, first)
        grad = tl.where(tap == arg[:, None, :, None], g[:, None, :, None], 0.0)
    else:
        grad = tl.zeros((BR, KH, BW, KW), tl.float32) + (g / (KH * KW))[:, None, :, None]
    out = tl.reshape(grad, (BR, KH, BC))
    if ACC:
        out += tl.load(dx + offs, mask=ok, other=0.0)
    if MASK:            # as kernels/act.py's backward: where(y <= 0, 0, g)
        out = tl.where(v <= 0.0, 0.0, out)
    tl.store(dx + offs, out, mask=ok)


@triton.jit
def _window_adds(acc, arg, g, wv, tap_row, J: tl.constexpr, COL: tl.constexpr,
                 SW: tl.constexpr, KW: tl.constexpr, NW: tl.constexpr):
    """acc plus the dy `g` of the windows where a pixel is their J-th candidate column
    (0 <= J < NW), at column COL + J * SW of the window, and the window's argmax `arg` is
    that tap; acc itself where no such window holds the pixel (its column past KW)."""
    if J >= 0 and J < NW and COL + J * SW < KW:
        acc += tl.where(wv & (arg == tap_row + (COL + J * SW)), g, 0.0)
    return acc


@autotune(_ROWS_GPU, _ROWS_INTERP, key=["ROWS", "H", "W", "KH", "KW", "SH", "SW"],
          restore=["dx"])
@triton.heuristics({"BR": lambda a: max(1, a["LANES"] // (a["BQ"] * a["G"]))})
@triton.jit
def _pool_argmax_bwd_kernel(x, argmax, dy, dx, ROWS, H: tl.constexpr, W: tl.constexpr,
                            OH: tl.constexpr, OW: tl.constexpr, KH: tl.constexpr,
                            KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                            PH: tl.constexpr, PW: tl.constexpr, NH: tl.constexpr,
                            NW: tl.constexpr, ACC: tl.constexpr, INDEX64: tl.constexpr,
                            MASK: tl.constexpr, FLAGS: tl.constexpr, BQ: tl.constexpr,
                            G: tl.constexpr, LANES: tl.constexpr, BR: tl.constexpr):
    """The max backward from stored argmaxes (`argmax`: one byte per window, as
    _pool_fwd_kernel's STORE_ARG writes them), for column strides SW of 1 or 2 (G = SW):
    a program takes BR groups of SH input rows (of all planes, flattened; ROWS of them)
    and BQ groups of SW columns, so dx is stored (and x read, for MASK) along whole rows,
    16 bytes at a time. Pixel (gr * SH + D, q * SW + C) lies in windows
    (gr + (D + PH) // SH - i, q + (C + PW) // SW - j), i < NH, j < NW: every offset and
    tap is a constant of D, C, i and j, so a group's pixels share its windows' loads (one
    dy, one byte per window, read along the window row: 16 bytes at a time), each pixel
    compares the byte with a constant, and each column keeps its own accumulator, the two
    interleaved at the store of each of the group's rows. Each window whose argmax is the
    pixel's tap adds its dy, in _pool_bwd_kernel's order (i, then j, from 0.0), so the two
    kernels give the same bits. MASK and ACC as _pool_bwd_kernel. FLAGS: dx goes through
    the ReLU before the pool by the argmax bytes' NONPOSITIVE bit (a flagged window adds
    nothing), not reading x: the same bits as MASK where dx does not accumulate."""
    O_LAST: tl.constexpr = (G - 1 + PW) // SW       # window columns q + o a group reads,
    O_FIRST: tl.constexpr = PW // SW - (NW - 1)     # o from O_LAST down to O_FIRST
    GROUP_ROWS: tl.constexpr = (H + SH - 1) // SH  # row groups a plane has
    if INDEX64:
        grp = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    else:
        grp = tl.program_id(0) * BR + tl.arange(0, BR)
    q = tl.program_id(1) * BQ + tl.arange(0, BQ)
    plane = grp // GROUP_ROWS
    gr = grp % GROUP_ROWS                           # input rows gr * SH + D, D < SH
    cols = tl.program_id(1) * (BQ * G) + tl.arange(0, BQ * G)
    for D in tl.static_range(SH):
        E = (D + PH) // SH         # window row gr + E - i, its row R + i * SH in it
        R = (D + PH) % SH
        ih = gr * SH + D
        row_ok = (grp < ROWS) & (ih < H)
        at = (plane * (OH * OW) + (gr + E) * OW)[:, None] + q[None, :]
        dy_at, arg_at = dy + at, argmax + at
        acc0 = tl.zeros([BR, BQ], tl.float32)       # column q * SW
        acc1 = tl.zeros([BR, BQ], tl.float32)       # column q * SW + 1 (G == 2)
        for i in tl.static_range(NH):
            if R + i * SH < KH:
                rv = row_ok & (gr + E - i >= 0) & (gr + E - i < OH)
                for k in tl.static_range(O_LAST - O_FIRST + 1):
                    o = O_LAST - k      # right to left: each pixel's j ascending
                    wv = rv[:, None] & ((q + o >= 0) & (q + o < OW))[None, :]
                    g = tl.load(dy_at + (o - i * OW), mask=wv, other=0.0)
                    arg = tl.load(arg_at + (o - i * OW), mask=wv, other=0).to(tl.int32)
                    if not FLAGS:       # a flagged byte (>= 128) matches no tap: adds 0
                        arg = arg & (NONPOSITIVE - 1)
                    tap_row = (R + i * SH) * KW
                    acc0 = _window_adds(acc0, arg, g, wv, tap_row, PW // SW - o, PW % SW,
                                        SW, KW, NW)
                    if G == 2:
                        acc1 = _window_adds(acc1, arg, g, wv, tap_row, (1 + PW) // SW - o,
                                            (1 + PW) % SW, SW, KW, NW)
        offs = ((plane * H + ih) * W)[:, None] + cols[None, :]
        ok = row_ok[:, None] & (cols < W)[None, :]
        if G == 2:
            out = tl.reshape(tl.join(acc0, acc1), (BR, BQ * G))
        else:
            out = acc0
        if ACC:
            out += tl.load(dx + offs, mask=ok, other=0.0)
        if MASK:            # as kernels/act.py's backward: where(y <= 0, 0, g)
            xv = tl.load(x + offs, mask=ok, other=0.0)
            out = tl.where(xv <= 0.0, 0.0, out)
        tl.store(dx + offs, out, mask=ok)


# ----------------------------------------------------------------------------- launchers

def _is_global(h, w, kh, kw, ph, pw):
    return ph == 0 and pw == 0 and kh == h and kw == w


def forward(x, y, *, mode, kernel, stride, padding, argmax=None):
    """y = maxpool2d / avgpool2d(x) (count_include_pad=True), floor mode. `argmax` (max
    pooling where argmax_bytes keeps some, optional; uint8 of y's shape): also gets each
    window's argmax byte, which backward's `argmax` reads instead of x."""
    is_max = _mode(mode)
    kh, kw, sh, sw, ph, pw = _params(kernel, stride, padding)
    n, c, oh, ow = _check_io(x, y, kernel, stride, padding)
    check_device("pool", x, y=y)
    if argmax is not None:
        _check_argmax("pool.forward", argmax, x.shape, y.shape, is_max,
                      (kh, kw, sh, sw, ph, pw))
        check_device("pool", x, argmax=argmax)
        check_no_overlap("pool.forward", [("argmax", argmax)], [("x", x), ("y", y)])
    h, w = x.shape[2], x.shape[3]
    total = y.numel()
    if total == 0:
        return
    index64 = x.numel() > _INT32_LIMIT
    if argmax is None and _is_global(h, w, kh, kw, ph, pw):
        planes = n * c
        hw = h * w
        cols = min(next_power_of_2(hw), 1024)
        rows = max(2, _GLOBAL_LANES // cols)
        run(_pool_global_fwd_kernel, (cdiv(planes, rows),),
            x, y, planes, hw, IS_MAX=is_max, INDEX64=index64, COLS=cols, PLANES=rows,
            num_warps=4)
        return
    launch(_pool_fwd_kernel, lambda meta: (cdiv(total, meta["BLOCK"]),),
           (x, y, y if argmax is None else argmax, total, h, w, oh, ow),
           dict(KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, IS_MAX=is_max, INDEX64=index64,
                STORE_Y=True, STORE_ARG=argmax is not None))


def backward(x, y, dy, dx, *, mode, kernel, stride, padding, accumulate=False,
             workspace=None, argmax=None, x_is_relu_output=False):
    """dx (+)= d pool / dx . dy, a gather over input pixels (deterministic, no atomics).

    Max pooling finds each window's argmax in x again, or reads it from `argmax` (what the
    forward stored there): then it does not read x, but for a ReLU mask under `accumulate`.
    y is accepted for a uniform API but not read and may be None; average pooling reads
    neither, so x may be None too (the scheduler frees both before an average pool's
    backward). dx may be None (nothing to do).
    `workspace` (max pooling without `argmax`, optional; uint8, at least
    argmax_workspace_bytes): each window's argmax is found once, into it, and the gather
    reads it, instead of every cell finding its candidate windows' argmax again. Same bits
    every way.
    `x_is_relu_output`: x is a ReLU's output, and dx goes on through that ReLU's backward in
    the store (0 where x <= 0, after any accumulation; sched/fuse.py): from x, or, with
    argmaxes and no accumulation, from their NONPOSITIVE bits.
    """
    is_max = _mode(mode)
    kh, kw, sh, sw, ph, pw = _params(kernel, stride, padding)
    if not isinstance(x_is_relu_output, bool):
        raise ValueError(f"x_is_relu_output must be a bool, got {x_is_relu_output!r}")
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate must be a bool, got {accumulate!r}")
    reads_x = _reads_x(is_max, argmax is not None, x_is_relu_output, accumulate)
    if x is None and (reads_x or dx is None):
        raise ValueError(_why_x(is_max, argmax is not None, x_is_relu_output))
    ref = x if x is not None else dx
    check_tensor("x" if x is not None else "dx", ref)
    if ref.dim() != 4:
        raise ValueError(f"x must be 4-D NCHW, got shape {tuple(ref.shape)}")
    shape = out_shape(ref.shape, kernel, stride, padding)
    if y is not None:
        check_tensor("y", y, shape)
    check_tensor("dy", dy, shape)
    if dx is not None:
        check_tensor("dx", dx, ref.shape)
    check_device("pool", dy, x=x, y=y, dx=dx)
    if argmax is not None:
        if workspace is not None:
            raise ValueError("pool.backward: given the forward's argmax, pass no workspace")
        _check_argmax("pool.backward", argmax, ref.shape, shape, is_max,
                      (kh, kw, sh, sw, ph, pw))
        check_device("pool", dy, argmax=argmax)
    if dx is None or ref.numel() == 0:
        return
    params = (kh, kw, sh, sw, ph, pw)
    if not reads_x:
        x = dx                                  # a placeholder pointer, never read
    if argmax is None and workspace is not None:
        argmax = _argmax_buffer(workspace, shape, params, is_max, x, dx)
        _find_argmaxes(x, argmax, dy.shape[2], dy.shape[3], params)
    mask = x_is_relu_output and reads_x
    flags = x_is_relu_output and not reads_x
    if _tiles_input(dx.shape[2], dx.shape[3], *params):
        _launch_tiles_bwd(x, argmax, dy, dx, kh, kw, is_max, accumulate, mask, flags)
    elif argmax is not None:
        _launch_argmax_bwd(x, argmax, dy, dx, params, accumulate, mask, flags)
    else:
        _launch_cells_bwd(x, dy, dx, params, is_max, accumulate, x_is_relu_output)


def _why_x(is_max, has_argmax, x_is_relu_output) -> str:
    """The one line that says why a backward without x cannot run."""
    if is_max and not has_argmax:
        return ("pool.backward needs x: max pooling finds each window's argmax in it (or "
                "pass the argmax bytes its forward stored)")
    if x_is_relu_output:
        return ("pool.backward needs x: dx goes through a ReLU mask (x_is_relu_output), read "
                "from x" + (" where dx accumulates" if has_argmax else ""))
    return "pool.backward needs x or dx: average pooling takes the input shape from them"


def _reads_x(is_max, has_argmax, x_is_relu_output, accumulate) -> bool:
    """Whether a backward reads x: to find argmaxes, or for a ReLU mask that the argmax
    bytes cannot give (dx accumulates, or there are none: average pooling)."""
    if is_max and not has_argmax:
        return True
    return x_is_relu_output and (accumulate or not has_argmax)


def reads_input(mode, saves_argmax, x_is_relu_output) -> bool:
    """Whether the backward of a pool whose dx does not accumulate reads x (the scheduler
    keeps x alive for it): `saves_argmax`, the forward stored argmax bytes for it."""
    return _reads_x(_mode(mode), saves_argmax, x_is_relu_output, False)


def _launch_cells_bwd(x, dy, dx, params, is_max, accumulate, relu_mask):
    """dx by the gather over cells of SH x SW input pixels (_pool_bwd_kernel), each max
    window's argmax found again from x."""
    kh, kw, sh, sw, ph, pw = params
    n, c, h, w = dx.shape
    oh, ow = dy.shape[2], dy.shape[3]
    obh, obw = ph // sh, pw // sw                    # first cell's owner window row / col
    nbh = (h - 1 + ph) // sh - obh + 1
    nbw = (w - 1 + pw) // sw - obw + 1
    total = n * c * nbh * nbw
    cellp = max(2, next_power_of_2(sh * sw))
    launch(_pool_bwd_kernel, lambda meta: (cdiv(total, max(2, meta["LANES"] // cellp)),),
           (x, dy, dx, total, h, w, oh, ow, nbh, nbw, obh, obw),
           dict(KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, NH=-(-kh // sh), NW=-(-kw // sw),
                CELLP=cellp, IS_MAX=is_max, ACC=accumulate,
                INDEX64=x.numel() > _INT32_LIMIT, MASK=relu_mask))


def _launch_argmax_bwd(x, argmax, dy, dx, params, accumulate, mask, flags):
    """dx of max pooling from every window's argmax byte (columns that step by 1 or 2,
    _gathers_argmax): the gather over groups of SH whole input rows, BQ groups of SW
    columns at a time (up to 128 pixels of a row), that reads them
    (_pool_argmax_bwd_kernel)."""
    kh, kw, sh, sw, ph, pw = params
    n, c, h, w = dx.shape
    oh, ow = dy.shape[2], dy.shape[3]
    rows = n * c * cdiv(h, sh)                  # row groups: SH input rows each
    groups = cdiv(w, sw)
    bq = min(next_power_of_2(groups), 128 // sw)

    def grid(meta):
        return (cdiv(rows, max(1, meta["LANES"] // (bq * sw))), cdiv(groups, bq))
    launch(_pool_argmax_bwd_kernel, grid, (x, argmax, dy, dx, rows),
           dict(H=h, W=w, OH=oh, OW=ow, KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw,
                NH=-(-kh // sh), NW=-(-kw // sw), ACC=accumulate,
                INDEX64=dx.numel() > _INT32_LIMIT, MASK=mask, FLAGS=flags, BQ=bq, G=sw))


def _find_argmaxes(x, argmax, oh, ow, params):
    """The max backward's argmax pass, given a workspace (bench/kernels_norm.py times it
    alone): each window's argmax byte into `argmax`, one per window of the OH x OW output
    (_pool_fwd_kernel with STORE_ARG, not STORE_Y)."""
    kh, kw, sh, sw, ph, pw = params
    launch(_pool_fwd_kernel, lambda meta: (cdiv(argmax.numel(), meta["BLOCK"]),),
           (x, argmax, argmax, argmax.numel(), x.shape[2], x.shape[3], oh, ow),
           dict(KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, IS_MAX=True,
                INDEX64=x.numel() > _INT32_LIMIT, STORE_Y=False, STORE_ARG=True))


def _tiles_input(h, w, kh, kw, sh, sw, ph, pw):
    """The windows tile the input exactly, in power-of-2 sides (_pool_tiles_bwd_kernel)."""
    return ((kh, kw) == (sh, sw) and ph == pw == 0 and h % kh == 0 and w % kw == 0
            and kh * kw > 1 and kh & (kh - 1) == 0 and kw & (kw - 1) == 0)


def _launch_tiles_bwd(x, argmax, dy, dx, kh, kw, is_max, accumulate, mask, flags):
    """dx of kh x kw windows that tile x: [rows, kh, columns] tiles of whole input rows, a
    row of windows per tile row (columns: up to 256 pixels of a row); max pooling's argmaxes
    found in x, or read from `argmax`."""
    n, c, oh, ow = dy.shape
    rows, w = n * c * oh, dx.shape[3]
    bc = max(kw, min(next_power_of_2(w), 256))

    def grid(meta):
        return (cdiv(rows, max(1, meta["LANES"] // (kh * bc))), cdiv(w, bc))
    launch(_pool_tiles_bwd_kernel, grid,
           (x, dy if argmax is None else argmax, dy, dx, rows, w, ow),
           dict(KH=kh, KW=kw, IS_MAX=is_max, ACC=accumulate, INDEX64=dx.numel() > _INT32_LIMIT,
                MASK=mask, FROM_ARG=argmax is not None, FLAGS=flags, BC=bc))


def argmax_workspace_bytes(x_shape, *, mode, kernel, stride, padding) -> int:
    """Bytes of the optional backward workspace that holds every window's argmax (one byte
    per output element), or 0 where there is none: where argmax_bytes keeps none, and for
    windows that do not overlap (kernel <= stride on both axes, as VGG16's 2x2/2: each cell
    then lies in one window, so the gather's own scan reads x once, and the argmax pass
    would only read it a second time)."""
    kh, kw, sh, sw, _, _ = _params(kernel, stride, padding)
    if kh <= sh and kw <= sw:
        return 0
    return argmax_bytes(x_shape, mode=mode, kernel=kernel, stride=stride, padding=padding)


def argmax_bytes(x_shape, *, mode, kernel, stride, padding) -> int:
    """Bytes of the argmax that forward can store for backward (one byte per output
    element), or 0 where backward could not read it: average pooling, windows of more than
    128 taps, and columns that step by more than 2 in windows that do not tile the input
    (`_gathers_argmax`)."""
    params = _params(kernel, stride, padding)
    if not _mode(mode) or _argmax_refusal(x_shape, params):
        return 0
    n, c, oh, ow = out_shape(x_shape, kernel, stride, padding)
    return n * c * oh * ow


def _gathers_argmax(x_shape, params) -> bool:
    """Whether a backward can gather from argmax bytes: the windows tile the input
    (_pool_tiles_bwd_kernel) or their columns step by 1 or 2 (_pool_argmax_bwd_kernel's
    column groups, whose pixels share their windows' loads)."""
    return params[3] <= 2 or _tiles_input(x_shape[2], x_shape[3], *params)


def _argmax_refusal(x_shape, params):
    """Why max pooling over x_shape with these params keeps no argmax bytes, or None."""
    kh, kw, _, sw, _, _ = params
    if kh * kw > MAX_ARGMAX_TAPS:
        return f"a {kh}x{kw} window has more taps than an argmax byte holds ({MAX_ARGMAX_TAPS})"
    if not _gathers_argmax(x_shape, params):
        return (f"the gather from argmax bytes takes column strides of 1 or 2 (or windows "
                f"that tile the input), got stride {sw}")
    return None


def _check_argmax(where, argmax, x_shape, y_shape, is_max, params):
    """An argmax tensor: max pooling that keeps argmax bytes (_argmax_refusal), uint8 of
    y's shape."""
    if not is_max:
        raise ValueError(f"{where}: argmax is for max pooling; average pooling takes none")
    refusal = _argmax_refusal(x_shape, params)
    if refusal:
        raise ValueError(f"{where}: {refusal}; pass no argmax")
    if not isinstance(argmax, torch.Tensor) or argmax.dtype != torch.uint8 \
            or tuple(argmax.shape) != tuple(y_shape) or not argmax.is_contiguous():
        got = (f"{tuple(argmax.shape)} {argmax.dtype}" if isinstance(argmax, torch.Tensor)
               else type(argmax).__name__)
        raise ValueError(f"{where}: argmax must be a contiguous uint8 tensor of shape "
                         f"{tuple(y_shape)}, got {got}")


def _argmax_buffer(workspace, shape, params, is_max, x, dx):
    """The uint8 view of `workspace` that holds the argmaxes."""
    if not is_max:
        raise ValueError("pool.backward: a workspace is for max pooling's argmax; average "
                         "pooling takes none")
    refusal = _argmax_refusal(x.shape, params)
    if refusal:
        raise ValueError(f"pool.backward: {refusal}; pass no workspace")
    if not isinstance(workspace, torch.Tensor) or workspace.dim() != 1:
        raise ValueError("pool.backward: workspace must be a 1-D tensor")
    need = shape[0] * shape[1] * shape[2] * shape[3]
    flat = workspace.view(torch.uint8) if workspace.dtype != torch.uint8 else workspace
    if flat.numel() < need:
        raise ValueError(f"pool.backward: workspace holds {flat.numel():,} bytes, the "
                         f"argmax needs {need:,}")
    check_device("pool", x, workspace=workspace)
    buf = flat[:need].view(shape)
    check_no_overlap("pool.backward", [("workspace", buf)], [("x", x), ("dx", dx)])
    return buf
