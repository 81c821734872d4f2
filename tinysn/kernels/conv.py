"""2-D convolution (nn.Conv2d semantics, groups=1, dilation=1) as implicit-GEMM Triton kernels.

Shapes: x [N, C, H, W], w [K, C, R, S] (torch's layout), b [K] or None, y [N, K, P, Q] with
P = (H + 2*ph - R) // sh + 1, Q = (W + 2*pw - S) // sw + 1. Kernels, strides and paddings are
(height, width) pairs (ints are accepted and used for both), so 1x7 / 7x1 convs work.

Every phase is a GEMM with one operand gathered on the fly (no layout change at the boundary):

  forward          Y[m=(n,p,q), k]    = sum_{(c,r,s)} X[n, c, p*sh-ph+r, q*sw-pw+s] W[k, (c,r,s)]
  backward_data    dX[m=(n,h,w), c]   = sum_{(k,r,s)} dY[n, k, (h+ph-r)/sh, (w+pw-s)/sw] W[k,c,r,s]
                                        (only taps where the division is exact)
  backward_weight  dW[k, (c,r,s)]     = sum_{(n,p,q)} dY[n, k, p, q] X[n, c, p*sh-ph+r, q*sw-pw+s]

Algorithms (like cuDNN's: workspace buys speed or parallelism), listed by `algos()` with their
workspace bytes, fastest-expected first (the channels-last ones only where they can win:
`_offered`):

  forward
    "implicit"   implicit GEMM, no workspace. The output-pixel dimension (contiguous in NCHW)
                 is the fast axis of every gathered load and of the store. A 1x1, stride-1,
                 pad-0 conv is a plain GEMM; the kernel specialises on it (IS_1X1 constexpr:
                 no tap arithmetic, no bounds masks beyond the tile edges).
    "im2col"     unfold x into a workspace col [N, C*R*S, P, Q] (one gather kernel), then the
                 same kernel's 1x1 GEMM path on col with w viewed as [K, C*R*S, 1, 1].
    "nhwc"       stride 1, C divisible by 4: copy x channels-last (Xt [N, H, W, C]) and the
                 weight as [K, R, S, C] into the workspace, then a tap-major GEMM whose
                 operand tiles the GPU's TMA unit copies into shared memory as boxes: for each
                 tap, the output patch's window shifted by the tap (zeros outside the image
                 are the padding). Both operands have the reduction axis (channels)
                 contiguous, as the MMA wants, and no address or mask is computed per element.
                 (In NCHW a tap's shift moves along the contiguous axis, and a TMA box must
                 start 16-byte aligned there, so the copy is what makes the boxes possible.)
  backward_data
    "implicit"   implicit GEMM, no workspace. The dx pixels are split into sh*sw residue
                 classes ((h+ph) % sh, (w+pw) % sw); each class has its own fixed set of
                 contributing taps (r = rho + sh*t, s = sigma + sw*u), so a strided conv does
                 no work on taps that do not touch a pixel (grid axis 1 = class).
    "transposed" first copy w into the workspace as wT [R, S, C, K] (k fastest; one small
                 transpose kernel, 4*K*C*R*S bytes), then an implicit GEMM whose reduction is
                 ordered tap-major: an outer loop over the contributing taps (r, s) (the same
                 residue classes as "implicit"), an inner loop over k (or both as one flat
                 loop, an autotuner choice). The tap is a scalar in the inner loop, so the dY
                 gather's offsets and bounds masks are computed per tap and row, not per
                 element, and the weight tile is read along k, its contiguous axis (the
                 K-major operand layout the GPU's MMA wants; the dY tile stays pixel-major).
                 Any stride.
    "flipped"    stride 1 only (and padding < kernel size): the data gradient of a stride-1
                 conv is a stride-1 conv of dY with the weight transposed and flipped,
                 wF[c, k, r, s] = W[k, c, R-1-r, S-1-s], padding (R-1-ph, S-1-pw). One small
                 kernel writes wF into the workspace (4*K*C*R*S bytes), then the forward
                 kernel runs on dY (its weight tile read along (k, r, s), contiguous in wF;
                 a 1x1 conv keeps the GEMM fast path). `algos()` offers it only where it
                 applies; asking for it elsewhere raises ValueError.
    "flipped_nhwc" "flipped" through the "nhwc" kernel: dY copied channels-last, the flipped
                 weight as [C, R, S, K] (needs K divisible by 4).
    "zero_insert" build dY with (sh-1) zeros inserted between pixels and R-1-ph / S-1-pw
                 zeros around it in the workspace ([N, K, H+R-1, W+S-1]), then run the
                 stride-1 implicit kernel on it (a stride-1 conv with the flipped weight). It
                 only makes sense for stride > 1, so `algos()` offers it only then; for
                 stride 1 it is still accepted and correct (a padded copy of dY).
  backward_weight
    "onepass"    one kernel, each dW tile reduces over all N*P*Q pixels. No workspace.
    "splitk"     the N*P*Q reduction is cut into `splitk_splits()` chunks; each writes its
                 partial dW into the workspace [splits, K, C*R*S] (and, with db, its
                 partial db after them, [splits, K]); a second kernel sums the chunks in a
                 fixed order. More programs when K*C*R*S is small.
                 Both take a column order from their config: (c, r, s) tiles, or (TAP) tiles
                 of channels at one tap, whose bounds masks are per pixel, not per element.
    "nhwc"       stride 1, C and Q divisible by 4: copy x channels-last into the workspace,
                 then "splitk"'s chunks (after the copy) from a kernel whose operand tiles the
                 TMA unit copies: per tap and patch of output pixels, dY's box (NCHW, pixels
                 contiguous, so Q % 4 == 0 keeps its rows 16-byte aligned) and the copy's
                 box of the patch shifted by the tap (zeros outside the image).
    "tma"        a "same" stride-1 conv (output as large as the input): each image's pixels
                 one flat row, so a tap is a shift along it, and the TMA unit copies both
                 operands' boxes (pixels, the reduction axis, contiguous in both: the MMA's
                 K-major operands). A box must start 16-byte aligned on that axis, so x is
                 first copied once per kernel column, shifted by it (zeros where the shift
                 leaves the row: the side padding), with rows widened to a multiple of 4
                 pixels (then dY is copied widened too); a tap is then a shift by whole
                 rows. A 1x1 conv whose rows need no widening reads x in place. Split-K
                 chunks after the copies (`tma_splits()`), summed in a fixed order.
  db (bias gradient): "onepass" and "splitk" sum it in their GEMM from the dY tiles they load
  (the programs of the first column tile; "splitk"'s partial sums per chunk, then their
  fixed-order sum), so it costs no pass over dY of its own (`gemm_sums_bias`). Otherwise it
  is a separate fixed-order reduce kernel over dY (one program per channel on the GPU, per
  block of channels under the interpreter); alongside dW it first sums groups of images into
  dW's own memory, so that the GPU has more programs (`bias_groups`).

Rules (docs/kernels.md): nothing is allocated here; workspace is a 1-D uint8 or
float32 tensor of at least `workspace_bytes(...)` bytes; outputs are overwritten (dx is added
to when accumulate=True); every result is deterministic (no atomics; split-K reduces through
the workspace). backward() runs the data gradient first, then the weight gradient, through the
same workspace, so it needs max(workspace_bytes(.., "backward_data", algo_data),
workspace_bytes(.., "backward_weight", algo_weight)) bytes (`backward_workspace_bytes`).

Precision: tl.dot input_precision = dot_precision(precision) ("tf32" by default on the GPU,
"ieee" exact float32). The autotuner picks tile sizes per shape on the GPU (the K-block size
and so the rounding may differ between configs; a process keeps its choice); under the
interpreter each phase runs one large-tile config (`_INTERP_*`). Problems too small to be
worth timing skip autotuning and take the first config. After a shape's first launch its
pick is launched directly (`_launch`), and the shape arithmetic is cached, to keep host time
per call low.

Compile-time constants: kernel size (R, S) and the spatial sizes (H, W, P, Q), so every
division in the index math is by a constant; a network has few distinct sizes. Strides and
paddings are runtime values (Triton still specialises the value 1). In-tile offsets are
32-bit, relative to a 64-bit base per program (its first image); the launchers reject shapes
where a tile's span of images could overflow that (never for real layers).

Design and shortfalls: docs/kernels.md; measurements: bench/README.md.
"""
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import _CHECKED_BEFORE, _TUNED, INTERP_TILE, INTERPRET  # noqa: F401
from ._common import autotune, check_device
from ._common import cdiv, next_power_of_2
from ._common import check_no_overlap, check_tensor, dot_precision, float_workspace, pair, run
from ._common import launch as _launch

PHASES = ("forward", "backward_data", "backward_weight")
_ALGOS = {"forward": ("implicit", "im2col", "nhwc", "splitk"),
          "backward_data": ("implicit", "flipped", "transposed", "zero_insert", "flipped_nhwc",
                            "flipped_splitk"),
          "backward_weight": ("onepass", "splitk", "nhwc", "tma")}

# split-K sizing: aim for about this many programs, counted in [64, 64] tiles (8 per SM of a
# 132-SM H200; a constant so that plans, workspaces and results do not depend on the device).
# On the H200 at batch 32, nine 3x3 "splitk" weight gradients (VGG16's, ResNet-50's 64@56, 128@28)
# took 7.2 ms in all at 264 programs, 5.9 at 528, 5.3 at 1056 and 5.5 at 2112: larger tiles
# leave fewer programs than the count assumes, and more per SM hide the gathers' latency.
# Chunks are whole 64s, at most _MAX_SPLITS of them (VGG16's first conv, [64, 27] columns
# over 1.6M pixels, is one tile: 256 chunks keep the whole GPU reading).
_TARGET_PROGRAMS = 1056
# the "tma" weight gradient's split count aims at this many programs counted in [128, 128]
# tiles (4 per SM of an H200; its chunks are whole images' pixel blocks, any count)
_TMA_TARGET_PROGRAMS = 528
_SPLIT_QUANTUM = 64
_MAX_SPLITS = 256
# the split-K forward: where a conv's output tiles, counted in [128, 128] tiles, are fewer
# than this (2 per SM of an H200: ResNet-50's 14- and 7-pixel layers at batch 32 have 49-98),
# the C*R*S reduction is cut into chunks of at least _FWD_MIN_CHUNK elements (whole
# _FWD_CHUNK_QUANTUM blocks, which every forward config's BLOCK_K divides) to fill the GPU
_FWD_TARGET_TILES = 264
_FWD_MIN_CHUNK = 256
_FWD_CHUNK_QUANTUM = 64
# problems with fewer multiply-adds than this take the first config without autotuning
_TUNE_MIN_MACS = 1 << 24


# --------------------------------------------------------------------------------------------
# shapes and workspaces
# --------------------------------------------------------------------------------------------
# Triton kernels one call of each (phase, algorithm) launches; a backward pass with a bias
# adds its own (`bias_launches`). The step-time model charges the host per launch (eager).
LAUNCHES = {("forward", "implicit"): 1, ("forward", "im2col"): 2, ("forward", "nhwc"): 3,
            ("forward", "splitk"): 2,
            ("backward_data", "implicit"): 1, ("backward_data", "transposed"): 2,
            ("backward_data", "flipped"): 2, ("backward_data", "zero_insert"): 2,
            ("backward_data", "flipped_nhwc"): 3, ("backward_data", "flipped_splitk"): 3,
            ("backward_weight", "onepass"): 1, ("backward_weight", "splitk"): 2,
            ("backward_weight", "nhwc"): 3, ("backward_weight", "tma"): 3}


def _hashable(v):
    """A cache key for a stride/padding argument (validation happens inside the cached call)."""
    v = tuple(v) if isinstance(v, list) else v
    try:
        hash(v)
    except TypeError:
        raise ValueError(f"conv: expected an int or a pair of ints, got {v!r}") from None
    return v

def _shape4(shape, name):
    if len(shape) != 4 or not all(isinstance(d, int) and d >= 1 for d in shape):
        raise ValueError(f"conv: {name} shape must be 4 positive ints, got {tuple(shape)}")
    return tuple(int(d) for d in shape)


def out_shape(x_shape, w_shape, stride, padding) -> tuple:
    """(N, K, P, Q) of the conv output; ValueError if the kernel is larger than the padded input
    or the channel counts of x [N, C, H, W] and w [K, C, R, S] differ."""
    return _out_shape(tuple(x_shape), tuple(w_shape), _hashable(stride), _hashable(padding))


@functools.lru_cache(maxsize=4096)
def _out_shape(x_shape, w_shape, stride, padding) -> tuple:
    n, c, h, w = _shape4(tuple(x_shape), "x")
    k, c2, r, s = _shape4(tuple(w_shape), "w")
    sh, sw = pair(stride, "conv: stride", 1)
    ph, pw = pair(padding, "conv: padding", 0)
    if c2 != c:
        raise ValueError(f"conv: w has {c2} input channels, x has {c}")
    if r > h + 2 * ph or s > w + 2 * pw:
        raise ValueError(f"conv: kernel {r}x{s} is larger than the padded input "
                         f"{h + 2 * ph}x{w + 2 * pw}")
    return n, k, (h + 2 * ph - r) // sh + 1, (w + 2 * pw - s) // sw + 1


def splitk_splits(x_shape, w_shape, stride, padding) -> int:
    """How many chunks the "splitk" weight gradient cuts the N*P*Q reduction into."""
    return _splitk_splits(tuple(x_shape), tuple(w_shape), _hashable(stride), _hashable(padding))


@functools.lru_cache(maxsize=4096)
def _splitk_splits(x_shape, w_shape, stride, padding) -> int:
    n, k, p, q = out_shape(x_shape, w_shape, stride, padding)
    _, c, r, s = w_shape
    npq = n * p * q
    tiles = cdiv(k, 64) * cdiv(c * r * s, 64)
    splits = max(1, min(_MAX_SPLITS, cdiv(_TARGET_PROGRAMS, tiles),
                        cdiv(npq, _SPLIT_QUANTUM)))
    chunk = cdiv(cdiv(npq, splits), _SPLIT_QUANTUM) * _SPLIT_QUANTUM
    return cdiv(npq, chunk)


def tma_splits(x_shape, w_shape) -> int:
    """How many chunks the "tma" weight gradient cuts the N*H*W reduction into."""
    n, c, h, w = x_shape
    k, _, r, s = w_shape
    tiles = cdiv(k, 128) * cdiv(c, 128) * r * s
    return max(1, min(_MAX_SPLITS, cdiv(_TMA_TARGET_PROGRAMS, tiles),
                      n * cdiv(h * w, 64)))


def forward_splits(x_shape, w_shape, stride, padding) -> int:
    """How many chunks the "splitk" forward cuts the C*R*S reduction into (1: the output
    alone fills the GPU, or the reduction is too short to cut)."""
    return _forward_splits(tuple(x_shape), tuple(w_shape), _hashable(stride),
                           _hashable(padding))


@functools.lru_cache(maxsize=4096)
def _forward_splits(x_shape, w_shape, stride, padding) -> int:
    n, k, p, q = out_shape(x_shape, w_shape, stride, padding)
    crs = w_shape[1] * w_shape[2] * w_shape[3]
    tiles = cdiv(n * p * q, 128) * cdiv(k, 128)
    splits = max(1, min(_FWD_TARGET_TILES // tiles, crs // _FWD_MIN_CHUNK))
    return cdiv(crs, _forward_chunk_blocks(crs, splits) * _FWD_CHUNK_QUANTUM)


def data_splits(x_shape, w_shape, stride, padding) -> int:
    """How many chunks the "flipped_splitk" data gradient cuts its K*R*S reduction into: the
    split-K forward's count for the flipped conv it runs (dY through the flipped weight);
    1 where that conv does not exist (stride above 1, padding not below the kernel)."""
    if not _flipped_applies(w_shape, stride, padding):
        return 1
    return forward_splits(*_flipped_conv(x_shape, w_shape, padding))


def _flipped_conv(x_shape, w_shape, padding):
    """(dY's shape, the flipped weight's, stride, padding) of the stride-1 forward conv that
    computes a stride-1 conv's data gradient ("flipped")."""
    n, k, p, q = out_shape(x_shape, w_shape, 1, padding)
    c, r, s = x_shape[1], w_shape[2], w_shape[3]
    ph, pw = pair(padding, "conv: padding", 0)
    return (n, k, p, q), (c, k, r, s), 1, (r - 1 - ph, s - 1 - pw)


def _forward_chunk_blocks(crs, splits) -> int:
    """The split-K forward's chunk length, in _FWD_CHUNK_QUANTUM blocks of the reduction."""
    return cdiv(cdiv(crs, splits), _FWD_CHUNK_QUANTUM)


def _flipped_weight_floats(w_shape) -> int:
    """Floats of "flipped_splitk"'s weight copy, rounded up to 64 bytes (its chunks follow)."""
    return cdiv(w_shape[0] * w_shape[1] * w_shape[2] * w_shape[3], 16) * 16


def _split_len(npq, splits):
    return cdiv(cdiv(npq, splits), _SPLIT_QUANTUM) * _SPLIT_QUANTUM


def workspace_bytes(x_shape, w_shape, stride, padding, phase, algo) -> int:
    """Bytes of workspace one launch of `phase` with `algo` needs (0 for the implicit ones)."""
    return _workspace_bytes(tuple(x_shape), tuple(w_shape), _hashable(stride),
                            _hashable(padding), phase, algo)


@functools.lru_cache(maxsize=4096)
def _workspace_bytes(x_shape, w_shape, stride, padding, phase, algo) -> int:
    n, k, p, q = out_shape(x_shape, w_shape, stride, padding)
    _, c, h, w = x_shape
    _, _, r, s = w_shape
    if phase not in _ALGOS:
        raise ValueError(f"conv: phase must be one of {PHASES}, got {phase!r}")
    if algo not in _ALGOS[phase]:
        raise ValueError(f"conv: {phase} algo must be one of {_ALGOS[phase]}, got {algo!r}")
    if algo in ("implicit", "onepass"):
        return 0
    if algo == "im2col":
        return 4 * n * c * r * s * p * q
    if algo == "zero_insert":
        return 4 * n * k * (h + r - 1) * (w + s - 1)
    if algo in ("transposed", "flipped"):
        return 4 * k * c * r * s
    if phase == "backward_weight" and algo == "nhwc":      # Xt, then "splitk"'s chunks
        return 4 * n * c * h * w + 4 * splitk_splits(x_shape, w_shape, stride, padding) * \
            k * c * r * s
    if algo == "nhwc":
        return 4 * (n * c * h * w + k * c * r * s)
    if algo == "tma":           # x's shifted copies, dY widened, the split-K chunks
        wp, copy_x, copy_dy = _tma_layout(x_shape, w_shape)
        return 4 * (copy_x * s * n * c * h * wp + copy_dy * n * k * h * wp +
                    tma_splits(x_shape, w_shape) * k * c * r * s)
    if algo == "flipped_nhwc":
        return 4 * (n * k * p * q + k * c * r * s)
    if phase == "forward":      # "splitk": one partial output per chunk
        return 4 * forward_splits(x_shape, w_shape, stride, padding) * n * k * p * q
    if algo == "flipped_splitk":    # the flipped weight, then a partial dx per chunk
        return 4 * (_flipped_weight_floats(w_shape) +
                    data_splits(x_shape, w_shape, stride, padding) * n * c * h * w)
    # splitk: a partial dW per chunk, then the bias gradient's partial per chunk (_run_bwd_weight)
    return 4 * splitk_splits(x_shape, w_shape, stride, padding) * k * (c * r * s + 1)


def algos(x_shape, w_shape, stride, padding, phase) -> dict:
    """{algo: workspace bytes} of the algorithms offered for `phase`, fastest-expected first
    (a fresh dict; memoized per shape, as the planner asks at every conv step it plans)."""
    return dict(_algos(tuple(x_shape), tuple(w_shape), _hashable(stride), _hashable(padding),
                       phase))


@functools.lru_cache(maxsize=4096)
def _algos(x_shape, w_shape, stride, padding, phase) -> dict:
    if phase not in _ALGOS:
        raise ValueError(f"conv: phase must be one of {PHASES}, got {phase!r}")
    sh, sw = pair(stride, "conv: stride", 1)
    ws = lambda a: workspace_bytes(x_shape, w_shape, stride, padding, phase, a)  # noqa: E731
    if phase == "backward_weight":
        if splitk_splits(x_shape, w_shape, stride, padding) > 1:
            offered = {"splitk": ws("splitk"), "onepass": 0}
        else:
            offered = {"onepass": 0, "splitk": ws("splitk")}
        for a in ("nhwc", "tma"):
            if _offered(a, x_shape, w_shape, (sh, sw), padding, phase):
                offered[a] = ws(a)
        return offered
    # the workspace algorithms after "implicit" until the GPU has measured them
    offered = {a: ws(a) for a in _ALGOS[phase]
               if _offered(a, x_shape, w_shape, (sh, sw), padding, phase)}
    if phase == "backward_data" and (sh, sw) == (1, 1):
        del offered["zero_insert"]          # a padded copy of dY: never faster at stride 1
    return offered


# The channels-last algorithms are offered (algos()) only on outputs of at least this many
# pixels per image, though they run any size they apply to: on the H200 at batch 32 they
# never beat the NCHW kernels below it (ResNet-50's 14- and 7-pixel layers 1.4-7x slower,
# VGG16's 14-pixel ones 2x, measured while a tile held one image: 14 of its 64 rows, 7 of
# 128; tiles over several images, _tile_h_cap, are not measured there), and each algorithm
# offered costs a first run one more compile and timing per conv shape. The weight
# gradient's won only on VGG16's 224x224 layer (1.25 against 1.46 ms) and lost by 13-31%
# from 112x112 down.
_NHWC_MIN_PIXELS = 28 * 28
_WEIGHT_NHWC_MIN_PIXELS = 112 * 112 + 1


def _offered(algo, x_shape, w_shape, stride, padding, phase) -> bool:
    """Whether algos() lists `algo`: it applies, and (channels-last) the output is large
    enough for it to have won somewhere."""
    if not _applies(algo, x_shape, w_shape, stride, padding, phase):
        return False
    if phase == "forward" and algo == "splitk":
        return forward_splits(x_shape, w_shape, stride, padding) > 1
    if algo == "flipped_splitk":
        return data_splits(x_shape, w_shape, stride, padding) > 1
    if algo not in ("nhwc", "flipped_nhwc"):
        return True
    _, _, p, q = out_shape(x_shape, w_shape, stride, padding)
    least = _WEIGHT_NHWC_MIN_PIXELS if phase == "backward_weight" else _NHWC_MIN_PIXELS
    return p * q >= least


def _flipped_applies(w_shape, stride, padding) -> bool:
    """"flipped" needs stride 1 and padding below the kernel size (its forward-conv padding
    R-1-ph must not be negative)."""
    sh, sw = pair(stride, "conv: stride", 1)
    ph, pw = pair(padding, "conv: padding", 0)
    return sh == 1 and sw == 1 and ph < w_shape[2] and pw < w_shape[3]


def _nhwc_applies(channels, stride) -> bool:
    """The channels-last kernels ("nhwc", "flipped_nhwc") need stride 1 and an input channel
    count divisible by 4: each pixel's channels start a TMA box row, 16-byte aligned."""
    return pair(stride, "conv: stride", 1) == (1, 1) and channels % 4 == 0


def _tma_applies(x_shape, w_shape, stride, padding) -> bool:
    """The "tma" weight gradient needs a "same" stride-1 conv: an output as large as the
    input, so that a tap is one shift of the flat pixel row."""
    _, _, h, w = x_shape
    _, _, p, q = out_shape(x_shape, w_shape, stride, padding)
    return pair(stride, "conv: stride", 1) == (1, 1) and (p, q) == (h, w)


def _applies(algo, x_shape, w_shape, stride, padding, phase="forward") -> bool:
    """Whether `algo` can run this conv in `phase` (the rest of the algorithms run any
    conv)."""
    if algo == "tma":
        return _tma_applies(x_shape, w_shape, stride, padding)
    if algo == "nhwc" and phase == "backward_weight":
        q = out_shape(x_shape, w_shape, stride, padding)[3]
        return _nhwc_applies(x_shape[1], stride) and q % 4 == 0
    if algo == "nhwc":
        return _nhwc_applies(x_shape[1], stride)
    if algo == "flipped_nhwc":
        return _nhwc_applies(w_shape[0], stride) and _flipped_applies(w_shape, stride, padding)
    if algo in ("flipped", "flipped_splitk"):
        return _flipped_applies(w_shape, stride, padding)
    return True


def _check_applies(phase, algo, x_shape, w_shape, geo):
    """One line naming what `algo` needs, where it cannot run this conv."""
    if _applies(algo, x_shape, w_shape, geo[:2], geo[2:4], phase):
        return
    nhwc = "stride 1 and input channels divisible by 4"
    if phase == "backward_weight":
        nhwc += " and an output width divisible by 4"
    need = {"flipped": "stride 1 and padding smaller than the kernel",
            "flipped_splitk": "stride 1 and padding smaller than the kernel",
            "nhwc": nhwc,
            "flipped_nhwc": "stride 1, padding smaller than the kernel and output channels "
                            "divisible by 4",
            "tma": "stride 1 and an output as large as the input"}[algo]
    raise ValueError(f"conv: {phase} algo '{algo}' needs {need}; got stride {geo[:2]}, "
                     f"padding {geo[2:4]}, kernel {tuple(w_shape[2:])}, "
                     f"{x_shape[1]} input and {w_shape[0]} output channels, output width "
                     f"{out_shape(x_shape, w_shape, geo[:2], geo[2:4])[3]}")


def backward_workspace_bytes(x_shape, w_shape, stride, padding, algo_data="implicit",
                             algo_weight="onepass", need_data=True, need_weight=True) -> int:
    """Workspace bytes backward() needs (its two phases share one workspace, in turn)."""
    a = workspace_bytes(x_shape, w_shape, stride, padding, "backward_data", algo_data) \
        if need_data else 0
    b = workspace_bytes(x_shape, w_shape, stride, padding, "backward_weight", algo_weight) \
        if need_weight else 0
    return max(a, b)


# --------------------------------------------------------------------------------------------
# autotuning
# --------------------------------------------------------------------------------------------

def _cfg(bm, bn, bk, warps, stages, pix=True, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
                          "PIX": pix}, num_warps=warps, num_stages=stages)


def _with(cfg, **flags):
    """`cfg` with one kernel's own flags added: the weight gradient's column order (TAP),
    the "transposed" data gradient's loop form (FLAT)."""
    return triton.Config({**cfg.kwargs, **flags}, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)


# Configs: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, PIX). The forward and weight-gradient
# lists are the eight (four) configs that together come closest to the best of a wider sweep
# on 17 VGG16 / ResNet-50 shapes at batch 32 on the H200 (bench/conv_configs.py: greedy,
# by total time); so are the two data-gradient lists. The first config of each list is the
# one an untuned run (TINYSN_AUTOTUNE=0) takes: the best single config of the sweep.
# Configs of one stage (no software pipeline) load the NCHW pixel operand 16 bytes at a
# time into registers, where the pipelined ones copy it to shared memory 4 bytes at a time
# (conv_configs.one_stage); with them in the sweep the forward list's best-per-shape total
# fell from 4.62 to 4.30 ms and the "transposed" data gradient's from 4.07 to 3.56
# (results/conv-configs-one-stage-NVIDIA-H200.json; cuDNN 2.91 and 3.03). These two lists
# were then picked over the H200's and the H100's sweeps together (bench/conv_configs.py
# --pick, each GPU's times divided by its cuDNN total), and are now the H100's greedy pick
# of that joint list beside the same configs with REG_A (the NCHW pixel operand handed to
# the wgmma from registers: `_pixel_operand`; conv_configs.short_sweeps,
# results/conv-configs-reg-a-NVIDIA-H100-80GB-HBM3.json): over the 17 shapes the forward's
# best-per-shape total went from 4.283 to 4.244 ms and the data gradient's from 3.614 to
# 3.601 (cuDNN 3.218 and 3.390), over ResNet-50's 12 from 0.702 to 0.676 and 0.655 to
# 0.643 (cuDNN 0.564 and 0.596): REG_A wins on 1x1 shapes and loses on 3x3 ones.
# forward: M = output pixels (large), N = output channels (64..512); also the "flipped" data
# gradient
_FWD_CONFIGS = [
    _with(_cfg(128, 128, 16, 8, 5, True), REG_A=True),
    _cfg(128, 256, 32, 8, 4, False),
    _cfg(128, 64, 32, 4, 1, True),
    _cfg(64, 128, 32, 4, 4, False),
    _cfg(64, 256, 32, 8, 4, True),
    _cfg(64, 128, 64, 4, 1, True),
    _cfg(64, 128, 64, 4, 4, True),
    _with(_cfg(64, 256, 32, 8, 4, True), REG_A=True),
]
# backward_data: M = input pixels, N = input channels ("implicit"; the same sweep's pick:
# 16% less time than the earlier hand-picked list)
_DATA_CONFIGS = [
    _cfg(128, 128, 16, 8, 5, True),
    _cfg(128, 64, 32, 4, 3, True),
    _cfg(128, 256, 32, 8, 4, False),
    _cfg(64, 128, 32, 8, 4, False),
    _cfg(256, 128, 32, 8, 3, True),
    _cfg(128, 128, 32, 8, 3, False),
    _cfg(128, 128, 32, 8, 3, True),
    _cfg(128, 64, 32, 8, 4, True),
]
# backward_weight: M = K, N = C*R*S, reduction over pixels (PIX=False never won here). The
# first is the same tiles tap-major (TAP): on the nine VGG16 / ResNet-50 3x3 shapes it took
# 14% off the best weight-gradient time of the other four (bench/conv_configs.py,
# --kernel-size 3); a 1x1 conv has one tap, so there it is the second config
_WGT_CONFIGS = [_with(_cfg(*c[:6]), TAP=c[6]) for c in [
    (128, 64, 32, 4, 3, True, True),
    (128, 64, 32, 4, 3, True, False),
    (64, 64, 128, 4, 3, True, False),
    (64, 64, 32, 4, 4, True, False),
    (128, 128, 32, 8, 4, True, False),
]]
# Under the interpreter (which pays per operation and per program, see INTERP_TILE) each
# phase runs one config with large tiles: a LeNet layer on 8x8 digits is one or a few
# programs of a few reduction steps. The GPU configs above still run on the CPU in the
# tests that pin every config (`_common.pinned`), which reach the loop tails.
_INTERP_FWD = _cfg(2048, 32, 32, 1, 1, group_m=2)       # M = pixels, N = K, BLOCK_K = C*R*S
_INTERP_DATA = _cfg(1024, 16, 64, 1, 1, group_m=2)      # M = pixels, N = C, BLOCK_K = K*taps
_INTERP_WGT = _with(_cfg(32, 64, 512, 1, 1, group_m=2), TAP=False)   # M = K, N = C*R*S


def _prune(macs_fn):
    """Early config prune: a problem too small to be worth timing keeps the first config;
    where the pixel axis is provably contiguous (1x1 stride-1 convs over a pixel count that
    is a multiple of 4) the PIX flag changes nothing, so only PIX=True configs are timed; a
    1x1 conv has one tap, so the TAP flag changes nothing there either."""
    def prune(configs, named_args, **kwargs):
        a = dict(named_args)
        a.update(kwargs)
        if macs_fn(a) < _TUNE_MIN_MACS:
            return configs[:1]
        if a.get("IS_1X1"):
            configs = [c for c in configs if not c.kwargs.get("TAP")] or configs[:1]
        if a.get("IS_1X1") and (a["P"] * a["Q"]) % 4 == 0:
            return [c for c in configs if c.kwargs["PIX"]]
        return configs
    return prune


def _fwd_macs(a):
    return a["N"] * a["P"] * a["Q"] * a["K"] * a["C"] * a["R"] * a["S"]


def _bwd_weight_macs(a):
    return a["N"] * a["P"] * a["Q"] * a["K"] * a["C"] * a["R"] * a["S"]


def _same_weight_macs(a):
    """A "same" conv's, over its rows widened to WP (the "tma" weight gradient's kernel)."""
    return a["N"] * a["HWP"] * a["K"] * a["C"] * a["R"] * a["S"]


def _autotune(configs, key, macs_fn, restore=None, interp=_INTERP_FWD, config_hook=None):
    kw = dict(key=key, restore=restore or (), config_hook=config_hook)
    if not INTERPRET:
        kw["prune_configs_by"] = {"early_config_prune": _prune(macs_fn)}
    return autotune(configs, interp, **kw)


_KEY = ["N", "C", "H", "W", "K", "P", "Q", "SH", "SW", "PH", "PW", "R", "S"]


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
#
# Pixel axis. Every gathered tile is laid out with the pixel axis (contiguous in NCHW for
# stride 1) second, and Triton's coalescing pass gives the lanes of a warp to the axis with the
# larger provable contiguity. A gathered offset has contiguity 1 on both axes, and Triton
# versions break that tie differently (3.6 gives the lanes to axis 0, 3.9 to the last axis).
# With PIX, a pixel-offset vector is declared contiguous (tl.max_contiguous) AND of
# divisibility 1 (tl.multiple_of): the lanes then go along the pixels under every version,
# while every access stays 4 bytes wide (vector width = min(contiguity, alignment)), so the
# declaration never merges two pixels that are not neighbours in memory (strided convs).
# Where the pixel axis is provably contiguous (1x1 stride 1 over P*Q % 4 == 0) nothing is
# declared and the stores are 16 bytes wide; a tile the dot reads is still copied into shared
# memory 4 bytes at a time (LDGSTS.E on sm_90, bench/sass.py): tf32 wgmma takes both operands
# K-major there, and in NCHW the pixel axis is the M (or N) axis, not K.

@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-tiles run together and share their operand tiles in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _ult(x, bound):
    """0 <= x < bound in one unsigned compare."""
    return x.to(tl.uint32, bitcast=True) < bound


@triton.jit
def _relu_gate(g, r):
    """g where the ReLU output r is > 0, else 0: the ReLU's backward (kernels/act.py) fused
    into the kernel that stores g, its input gradient."""
    return tl.where(r <= 0.0, 0.0, g)


@triton.jit
def _relu_mask(g, m_ptrs, mask):
    """_relu_gate with the ReLU output loaded from m_ptrs."""
    return _relu_gate(g, tl.load(m_ptrs, mask=mask, other=0.0))


@triton.jit
def _pixel_operand(a, REG_A: tl.constexpr):
    """The dot's A operand [BLOCK_M pixels, BLOCK_K] from a [BLOCK_K, BLOCK_M] NCHW tile
    (the forward's x, the "transposed" data gradient's dY), contiguous along the pixels.

    REG_A: the tile passes through an add of +0.0, so the wgmma takes it from registers:
    Triton gives a wgmma an operand loaded straight from memory from shared memory, K-major
    for TF32, which the pipelined configs fill 4 bytes at a time (LDGSTS.E) as the tile is
    contiguous along the pixels, not k. In the SASS (bench/sass.py, triton 3.6) the
    one-stage REG_A configs of the "transposed" kernel then also store dx 16 bytes at a
    time instead of 4; the pipelined ones still copy the tile 4 bytes at a time. Which is
    faster depends on the shape (bench/conv_configs.py's reg_a sweeps: on the H100 the 1x1
    layers gained, the 3x3 ones lost). The add turns -0.0 into +0.0, which changes no sum
    but one of zeros."""
    a = tl.trans(a)
    if REG_A:
        a = a + 0.0
    return a


@triton.jit(do_not_specialize=["CHUNK_BLOCKS"])
def _conv_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m_ptr,
                     N, C, K, SH, SW, PH, PW, CHUNK_BLOCKS,
                     H: tl.constexpr, W: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
                     R: tl.constexpr, S: tl.constexpr, IS_1X1: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PIX: tl.constexpr, RELU: tl.constexpr = False,
                     MASK: tl.constexpr = False, Y_NHWC: tl.constexpr = False,
                     REG_A: tl.constexpr = False):
    """Y[(n,p,q), k] (+)= sum_(c,r,s) X[n, c, p*SH-PH+r, q*SW-PW+s] * W[k, c, r, s] (+ b[k]),
    then max(Y, 0) where RELU (a ReLU fused into the conv; never with ACCUMULATE), or 0 where
    MASK and m_ptr's element at Y's place is <= 0 (a ReLU's backward fused into a data
    gradient that runs this kernel: m_ptr is that ReLU's output). Y_NHWC: Y is stored
    channels-last, [N, P, Q, K] (a forward pass alone: no ACCUMULATE, no MASK).

    Split-K ("splitk" forward): grid axis 1 is the chunk of the (c,r,s) reduction, each
    CHUNK_BLOCKS * 64 long; chunk j stores its partial Y as images j*N to j*N + N-1 of y
    (no bias, ReLU or mask: the in-order sum of the chunks applies them). With one chunk
    (CHUNK_BLOCKS covering C*R*S) the loop is the plain one. CHUNK_BLOCKS is not
    specialized, so both launches run one compiled kernel; counting it in blocks of 64 keeps
    each chunk's start a known multiple of 64 (the weight loads stay 16 bytes wide).

    The gathered x tile is [BLOCK_K, BLOCK_M] with the pixel axis fast; the weight tile is
    [BLOCK_N, BLOCK_K], read along (c,r,s), its contiguous axis (16-byte loads); REG_A:
    `_pixel_operand`. Addresses: one
    64-bit base per program (its first image), 32-bit offsets inside the tile. Spatial sizes
    are compile-time constants (divisions by them become multiplications).
    """
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    PQ: tl.constexpr = P * Q
    HW: tl.constexpr = H * W
    RS: tl.constexpr = R * S
    M = N * PQ
    CRS = C * RS
    k_first = chunk * CHUNK_BLOCKS * 64
    k_end = tl.minimum(k_first + CHUNK_BLOCKS * 64, CRS)
    pid_m, pid_n = _tile_ids(pid, M, K, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    img0 = m0 // PQ
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < K
    dimg = offs_m // PQ - img0
    pq = offs_m % PQ
    x_base = x_ptr + img0.to(tl.int64) * (C * HW)
    if IS_1X1:
        x_m = dimg * (C * HW) + pq
        if PIX and PQ % 4 != 0:
            x_m = tl.max_contiguous(tl.multiple_of(x_m, 1), BLOCK_M)
    else:
        # dead rows / taps get offsets that can never land inside, together or alone:
        # a dead row has ih0 = -(H+PH+R), a dead tap r = H+PH (live ih0 >= -PH, live r < R)
        ih0 = tl.where(m_ok, (pq // Q) * SH - PH, -(H + PH + R))
        iw0 = (pq % Q) * SW - PW
        x_m = dimg * (C * HW) + ih0 * W + iw0
        if PIX:
            x_m = tl.max_contiguous(tl.multiple_of(x_m, 1), BLOCK_M)
    w_n = offs_n * CRS

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < CRS
        if IS_1X1:
            a_ptrs = x_base + (x_m[None, :] + (offs_k * HW)[:, None])
            a_mask = k_ok[:, None] & m_ok[None, :]
        else:
            ku = offs_k.to(tl.uint32)                       # unsigned: cheaper division
            c = ku // RS
            rs = ku - c * RS
            r = rs // S
            s = (rs - r * S).to(tl.int32)
            r = tl.where(k_ok, r.to(tl.int32), H + PH)
            a_ptrs = x_base + (x_m[None, :] + (c.to(tl.int32) * HW + r * W + s)[:, None])
            a_mask = _ult(ih0[None, :] + r[:, None], H) & _ult(iw0[None, :] + s[:, None], W)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)                          # [BK, BM]
        bt = tl.load(w_ptr + (w_n[:, None] + offs_k[None, :]),
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)          # [BN, BK]
        acc = tl.dot(_pixel_operand(a, REG_A), tl.trans(bt), acc, input_precision=PRECISION)

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    y_base = (img0.to(tl.int64) + chunk * N) * (K * PQ)     # 64-bit base, 32-bit offsets
    if Y_NHWC:                     # [BM, BN] stored along the channels
        if RELU:
            acc = tl.where(acc < 0.0, 0.0, acc)
        y_rows = (dimg * PQ + pq) * K
        tl.store(y_ptr + y_base + (y_rows[:, None] + offs_n[None, :]), acc,
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        y_m = dimg * (K * PQ) + pq
        if PQ % 4 != 0:
            y_m = tl.max_contiguous(tl.multiple_of(y_m, 1), BLOCK_M)
        y_off = y_m[None, :] + (offs_n * PQ)[:, None]
        y_ptrs = y_ptr + y_base + y_off
        mask = n_ok[:, None] & m_ok[None, :]
        out = tl.trans(acc)                                                  # [BN, BM]
        if ACCUMULATE:
            out += tl.load(y_ptrs, mask=mask, other=0.0)
        if RELU:
            out = tl.where(out < 0.0, 0.0, out)      # as kernels/act.py: NaN propagates
        if MASK:
            out = _relu_mask(out, m_ptr + y_base + y_off, mask)
        tl.store(y_ptrs, out, mask=mask)


# keyed on the chunk length too: the split-K forward's best tile may differ from the plain one
_FWD_KEY = _KEY + ["CHUNK_BLOCKS"]
_conv_fwd = _autotune(_FWD_CONFIGS, _FWD_KEY, _fwd_macs)(_conv_fwd_kernel)
# the "flipped" data gradient's accumulating launch (the autotuner restores dx after timing;
# under the interpreter its x tile goes through registers, REG_A, so the CPU tests cover both)
_conv_fwd_acc = _autotune(_FWD_CONFIGS, _FWD_KEY, _fwd_macs, restore=["y_ptr"],
                          interp=_with(_INTERP_FWD, REG_A=True))(_conv_fwd_kernel)
assert all(_FWD_CHUNK_QUANTUM % c.kwargs["BLOCK_K"] == 0 for c in _FWD_CONFIGS + [_INTERP_FWD])


@triton.jit
def _im2col_kernel(x_ptr, col_ptr, N, C, SH, SW, PH, PW,
                   H: tl.constexpr, W: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
                   R: tl.constexpr, S: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """col[n, (c,r,s), p, q] = X[n, c, p*SH-PH+r, q*SW-PW+s] (0 in the padding)."""
    PQ: tl.constexpr = P * Q
    HW: tl.constexpr = H * W
    RS: tl.constexpr = R * S
    M = N * PQ
    CRS = C * RS
    m0 = tl.program_id(0) * BLOCK_M
    img0 = m0 // PQ
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    k_ok = offs_k < CRS
    dimg = offs_m // PQ - img0
    pq = offs_m % PQ
    ih0 = (pq // Q) * SH - PH
    iw0 = (pq % Q) * SW - PW
    x_m = tl.max_contiguous(tl.multiple_of(dimg * (C * HW) + ih0 * W + iw0, 1), BLOCK_M)
    col_m = dimg * (CRS * PQ) + pq
    if PQ % 4 != 0:
        col_m = tl.max_contiguous(tl.multiple_of(col_m, 1), BLOCK_M)
    ku = offs_k.to(tl.uint32)
    c = ku // RS
    rs = ku - c * RS
    r = (rs // S).to(tl.int32)
    s = (rs - (rs // S) * S).to(tl.int32)
    ok = k_ok[:, None] & m_ok[None, :]
    src = x_ptr + img0.to(tl.int64) * (C * HW) + \
        (x_m[None, :] + (c.to(tl.int32) * HW + r * W + s)[:, None])
    v = tl.load(src, mask=ok & _ult(ih0[None, :] + r[:, None], H) &
                _ult(iw0[None, :] + s[:, None], W), other=0.0)
    dst = col_ptr + img0.to(tl.int64) * (CRS * PQ) + (col_m[None, :] + (offs_k * PQ)[:, None])
    tl.store(dst, v, mask=ok)


@triton.jit
def _residue_class(cls, SH, SW, PH, PW, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
                   S: tl.constexpr):
    """Residue class `cls` = rho * SW + sigma of a strided data gradient: the dx pixels
    h = h0 + SH*i, w = w0 + SW*j with (h+PH) % SH = rho, (w+PW) % SW = sigma. Returns
    (rho, sigma, h0, w0, HC, WC, TC, UC, pb, qb): HC x WC pixels of dx in the class, TC x UC
    taps r = rho + SH*t, s = sigma + SW*u, and pixel (i, j) reads dY at (pb + i - t, qb + j - u)."""
    rho = cls // SW
    sig = cls % SW
    h0 = ((rho - PH) % SH + SH) % SH
    w0 = ((sig - PW) % SW + SW) % SW
    HC = (H - h0 + SH - 1) // SH
    WC = (W - w0 + SW - 1) // SW
    TC = (R - rho + SH - 1) // SH
    UC = (S - sig + SW - 1) // SW
    pb = (h0 + PH - rho) // SH
    qb = (w0 + PW - sig) // SW
    return rho, sig, h0, w0, HC, WC, TC, UC, pb, qb


@triton.jit
def _class_rows(pid, N, C, SH, SW, HC, WC, pb, qb, H: tl.constexpr, W: tl.constexpr,
                STRIDE1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """The program's tile of a data gradient: BLOCK_M dx pixels of the class (the grid's rows
    cover the largest class; rows past this class's N*HC*WC are dead) times BLOCK_N input
    channels. Returns (offs_n, m_ok, n_ok, img0, dimg, ij, i, j, p_m, q_m): the tile's first
    image img0, each row's image offset dimg, in-class pixel ij = (i, j), and the dY row
    p_m = pb + i (-1 for a dead row) and column q_m = qb + j of its tap (0, 0)."""
    if STRIDE1:
        M_GRID = N * H * W
    else:
        M_GRID = N * ((H + SH - 1) // SH) * ((W + SW - 1) // SW)
    pid_m, pid_n = _tile_ids(pid, M_GRID, C, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < N * HC * WC
    n_ok = offs_n < C
    if STRIDE1:
        HW: tl.constexpr = H * W
        img0 = m0 // HW
        dimg = offs_m // HW - img0
        ij = offs_m % HW
        i = ij // W
        j = ij % W
    else:
        hwc = tl.maximum(HC * WC, 1)
        wc = tl.maximum(WC, 1)
        img0 = m0 // hwc
        dimg = offs_m // hwc - img0
        ij = offs_m % hwc
        i = ij // wc
        j = ij % wc
    p_m = tl.where(m_ok, pb + i, -1)        # p = p_m - t < 0 for a dead row
    return offs_n, m_ok, n_ok, img0, dimg, ij, i, j, p_m, qb + j


@triton.jit
def _store_dx(acc, dx_ptr, m_ptr, img0, dimg, ij, i, j, h0, w0, offs_n, m_ok, n_ok, C, SH, SW,
              H: tl.constexpr, W: tl.constexpr, STRIDE1: tl.constexpr,
              ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr):
    """dx[pixel (h0 + SH*i, w0 + SW*j) of image img0 + dimg, channel offs_n] (+)= acc
    [BLOCK_M, BLOCK_N], stored along the pixels; where MASK, 0 where m_ptr's element is <= 0
    (x, a ReLU's output: that ReLU's backward, `_relu_mask`)."""
    HW: tl.constexpr = H * W
    if STRIDE1:
        dx_m = dimg * (C * HW) + ij
        if HW % 4 != 0:
            dx_m = tl.max_contiguous(tl.multiple_of(dx_m, 1), BLOCK_M)
    else:
        dx_m = dimg * (C * HW) + (h0 + SH * i) * W + w0 + SW * j
        dx_m = tl.max_contiguous(tl.multiple_of(dx_m, 1), BLOCK_M)
    dx_base = img0.to(tl.int64) * (C * HW)
    dx_off = dx_m[None, :] + (offs_n * HW)[:, None]
    dx_ptrs = dx_ptr + dx_base + dx_off
    mask = n_ok[:, None] & m_ok[None, :]
    out = tl.trans(acc)                                                      # [BN, BM]
    if ACCUMULATE:
        out += tl.load(dx_ptrs, mask=mask, other=0.0)
    if MASK:
        out = _relu_mask(out, m_ptr + dx_base + dx_off, mask)
    tl.store(dx_ptrs, out, mask=mask)


@triton.jit
def _conv_bwd_data_kernel(dy_ptr, w_ptr, dx_ptr, m_ptr,
                          N, C, K, SH, SW, PH, PW,
                          H: tl.constexpr, W: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
                          R: tl.constexpr, S: tl.constexpr, IS_1X1: tl.constexpr,
                          STRIDE1: tl.constexpr, ACCUMULATE: tl.constexpr,
                          PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, PIX: tl.constexpr, MASK: tl.constexpr = False):
    """dX[(n,h,w), c] (+)= sum over contributing (k, r, s) of dY[n,k,p,q] * W[k,c,r,s]
    (masked by m_ptr where MASK: `_store_dx`).

    Grid axis 1 is the residue class (rho, sigma) = ((h+PH) % SH, (w+PW) % SW) of the dx pixels;
    within a class the contributing taps are r = rho + SH*t, s = sigma + SW*u with
    p = pb + i - t, q = qb + j - u for the class's pixels h = h0 + SH*i, w = w0 + SW*j.
    STRIDE1 (SH = SW = 1) has one class and compile-time tap counts.
    """
    pid = tl.program_id(0)
    PQ: tl.constexpr = P * Q
    HW: tl.constexpr = H * W
    RS: tl.constexpr = R * S
    CRS = C * RS
    if STRIDE1:
        rho = 0
        sig = 0
        h0 = 0
        w0 = 0
        HC: tl.constexpr = H
        WC: tl.constexpr = W
        TC: tl.constexpr = R
        UC: tl.constexpr = S
        TUD: tl.constexpr = R * S               # divisors of the reduction index
        UCD: tl.constexpr = S
        pb = PH
        qb = PW
    else:
        rho, sig, h0, w0, HC, WC, TC, UC, pb, qb = _residue_class(tl.program_id(1), SH, SW,
                                                                  PH, PW, H, W, R, S)
        TUD = (TC * UC).to(tl.uint32)
        UCD = UC.to(tl.uint32)
    offs_n, m_ok, n_ok, img0, dimg, ij, i, j, p_m, q_m = _class_rows(
        pid, N, C, SH, SW, HC, WC, pb, qb, H, W, STRIDE1, BLOCK_M, BLOCK_N, GROUP_M)
    dy_base = dy_ptr + img0.to(tl.int64) * (K * PQ)
    if IS_1X1:
        dy_m = dimg * (K * PQ) + ij
        if PIX and HW % 4 != 0:
            dy_m = tl.max_contiguous(tl.multiple_of(dy_m, 1), BLOCK_M)
    else:
        dy_m = dimg * (K * PQ) + p_m * Q + q_m
        if PIX:
            dy_m = tl.max_contiguous(tl.multiple_of(dy_m, 1), BLOCK_M)
    TU = TC * UC
    RED = K * TU
    w_n = offs_n * RS

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, RED, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < RED
        if IS_1X1:
            a_ptrs = dy_base + (dy_m[None, :] + (offs_k * PQ)[:, None])
            a_mask = k_ok[:, None] & m_ok[None, :]
            b_ptrs = w_ptr + (offs_k[:, None] * C + offs_n[None, :])
        else:
            ku = offs_k.to(tl.uint32)                   # unsigned: cheaper division
            kc = ku // TUD
            tu = ku - kc * TUD
            t = tu // UCD
            u = (tu - t * UCD).to(tl.int32)
            kc = kc.to(tl.int32)
            t = tl.where(k_ok, t.to(tl.int32), H + PH + 1)    # a dead tap never lands inside
            a_ptrs = dy_base + (dy_m[None, :] + (kc * PQ - t * Q - u)[:, None])
            a_mask = _ult(p_m[None, :] - t[:, None], P) & _ult(q_m[None, :] - u[:, None], Q)
            b_ptrs = w_ptr + ((kc * CRS + (rho + SH * t) * S + sig + SW * u)[:, None]
                              + w_n[None, :])
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)                          # [BK, BM]
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)   # [BK, BN]
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)

    _store_dx(acc, dx_ptr, m_ptr, img0, dimg, ij, i, j, h0, w0, offs_n, m_ok, n_ok, C, SH, SW,
              H, W, STRIDE1, ACCUMULATE, BLOCK_M, MASK)


def _bwd_data_macs(a):
    return a["N"] * a["H"] * a["W"] * a["K"] * a["C"] * a["R"] * a["S"] // (a["SH"] * a["SW"])


_conv_bwd_data = _autotune(_DATA_CONFIGS, _KEY, _bwd_data_macs,
                           interp=_INTERP_DATA)(_conv_bwd_data_kernel)
# accumulate=True reads dx: autotuning must restore it after each timed trial
_conv_bwd_data_acc = _autotune(_DATA_CONFIGS, _KEY, _bwd_data_macs, restore=["dx_ptr"],
                               interp=_INTERP_DATA)(_conv_bwd_data_kernel)


@triton.jit
def _weight_rsck_kernel(w_ptr, wt_ptr, K, C, RS: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr):
    """wT[r, s, c, k] = W[k, c, r, s]: the "transposed" data gradient's K-major weight copy.

    A [BLOCK_K, BLOCK_J] tile, j = (c, r, s) flat: read along j (contiguous in W), written
    along k (contiguous in wT); on the GPU Triton transposes the tile through shared memory.
    """
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    CRS = C * RS
    ok = (offs_k < K)[:, None] & (offs_j < CRS)[None, :]
    c = offs_j // RS
    rs = offs_j - c * RS
    v = tl.load(w_ptr + (offs_k[:, None] * CRS + offs_j[None, :]), mask=ok)
    tl.store(wt_ptr + ((rs * C + c)[None, :] * K + offs_k[:, None]), v, mask=ok)


@triton.jit
def _weight_flip_kernel(w_ptr, wf_ptr, total, K, C, RS: tl.constexpr, BLOCK: tl.constexpr):
    """wF[c, k, r, s] = W[k, c, R-1-r, S-1-s]: the "flipped" data gradient's weight. Flipping
    both taps maps the flat tap index t = r*S + s to RS-1-t. Written along wF (contiguous)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    t = offs % RS
    ck = offs // RS
    k = ck % K
    c = ck // K
    v = tl.load(w_ptr + ((k * C + c) * RS + (RS - 1 - t)), mask=ok)
    tl.store(wf_ptr + offs, v, mask=ok)


@triton.jit
def _tap_rows(tu, dy_m, p_m, q_m, m_ok, wt_ptr, rho, sig, SH, SW, UC, CK,
              P: tl.constexpr, Q: tl.constexpr, S: tl.constexpr, IS_1X1: tl.constexpr,
              PIX: tl.constexpr, BLOCK_M: tl.constexpr):
    """For tap number tu of the class: the dY row offsets [BLOCK_M], the rows whose tap lands
    inside [0,P)x[0,Q) and the tap's wT slice (r = rho + SH*t, s = sig + SW*u)."""
    t = tu // UC
    u = tu - t * UC
    if IS_1X1:
        a_m = dy_m
        row_ok = m_ok
    else:
        a_m = dy_m - (t * Q + u)
        if PIX:
            a_m = tl.max_contiguous(tl.multiple_of(a_m, 1), BLOCK_M)
        row_ok = _ult(p_m - t, P) & _ult(q_m - u, Q)
    return a_m, row_ok, wt_ptr + ((rho + SH * t) * S + sig + SW * u) * CK


@triton.jit
def _tap_chunk(acc, dy_base, a_m, row_ok, b_base, wt_n, n_ok, k0, K, PQ: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, REG_A: tl.constexpr):
    """acc += dY[rows, k0:k0+BLOCK_K] @ wT[tap, cols, k0:k0+BLOCK_K]^T (k >= K masked);
    REG_A: `_pixel_operand`."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    a = tl.load(dy_base + (a_m[None, :] + (offs_k * PQ)[:, None]),
                mask=k_ok[:, None] & row_ok[None, :], other=0.0)            # [BK, BM]
    b = tl.load(b_base + (wt_n[None, :] + offs_k[:, None]),
                mask=k_ok[:, None] & n_ok[None, :], other=0.0)              # [BK, BN]
    return tl.dot(_pixel_operand(a, REG_A), b, acc, input_precision=PRECISION)


@triton.jit
def _conv_bwd_data_t_kernel(dy_ptr, wt_ptr, dx_ptr, m_ptr,
                            N, C, K, SH, SW, PH, PW,
                            H: tl.constexpr, W: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
                            R: tl.constexpr, S: tl.constexpr, IS_1X1: tl.constexpr,
                            STRIDE1: tl.constexpr, ACCUMULATE: tl.constexpr,
                            PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, PIX: tl.constexpr, FLAT: tl.constexpr,
                            MASK: tl.constexpr = False, REG_A: tl.constexpr = False):
    """dX[(n,h,w), c] (+)= sum_(t,u) sum_k dY[n, k, p_m - t, q_m - u] * wT[r, s, c, k].

    The residue classes, rows and the dx store are those of _conv_bwd_data_kernel (grid axis 1
    = class; taps r = rho + SH*t, s = sigma + SW*u). The reduction is tap-major: the outer loop
    runs over the class's taps, the inner one over k in BLOCK_K chunks. Per tap the dY row
    offsets and the bounds mask of the rows are computed once ([BLOCK_M] vectors); the inner
    loop only adds k*P*Q. The weight tile [BLOCK_K, BLOCK_N] is read from wT along k.
    FLAT runs the same (tap, k-chunk) steps in the same order as one loop (the tap is derived
    from the step index; the row offsets are then recomputed per step, still per row only):
    Triton software-pipelines only innermost loops, and with few channels (K = 64: two
    chunks) the nested form would drain the pipeline at every tap.
    """
    pid = tl.program_id(0)
    PQ: tl.constexpr = P * Q
    HW: tl.constexpr = H * W
    if STRIDE1:
        rho = 0
        sig = 0
        h0 = 0
        w0 = 0
        HC: tl.constexpr = H
        WC: tl.constexpr = W
        UC: tl.constexpr = S
        TU: tl.constexpr = R * S
        pb = PH
        qb = PW
    else:
        rho, sig, h0, w0, HC, WC, TC, UC, pb, qb = _residue_class(tl.program_id(1), SH, SW,
                                                                  PH, PW, H, W, R, S)
        TU = TC * UC                            # taps of this class
    offs_n, m_ok, n_ok, img0, dimg, ij, i, j, p_m, q_m = _class_rows(
        pid, N, C, SH, SW, HC, WC, pb, qb, H, W, STRIDE1, BLOCK_M, BLOCK_N, GROUP_M)
    dy_base = dy_ptr + img0.to(tl.int64) * (K * PQ)
    if IS_1X1:
        dy_m = dimg * (K * PQ) + ij
        if PIX and HW % 4 != 0:
            dy_m = tl.max_contiguous(tl.multiple_of(dy_m, 1), BLOCK_M)
    else:
        dy_m = dimg * (K * PQ) + p_m * Q + q_m
    wt_n = offs_n * K
    CK = C * K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FLAT:
        KCH = tl.cdiv(K, BLOCK_K)
        for step in range(0, TU * KCH):
            tu = step // KCH
            a_m, row_ok, b_base = _tap_rows(tu, dy_m, p_m, q_m, m_ok, wt_ptr, rho, sig, SH, SW,
                                            UC, CK, P, Q, S, IS_1X1, PIX, BLOCK_M)
            acc = _tap_chunk(acc, dy_base, a_m, row_ok, b_base, wt_n, n_ok,
                             (step - tu * KCH) * BLOCK_K, K, PQ, PRECISION, BLOCK_K, REG_A)
    else:
        for tu in range(0, TU):
            a_m, row_ok, b_base = _tap_rows(tu, dy_m, p_m, q_m, m_ok, wt_ptr, rho, sig, SH, SW,
                                            UC, CK, P, Q, S, IS_1X1, PIX, BLOCK_M)
            for k0 in range(0, K, BLOCK_K):
                acc = _tap_chunk(acc, dy_base, a_m, row_ok, b_base, wt_n, n_ok, k0, K, PQ,
                                 PRECISION, BLOCK_K, REG_A)

    _store_dx(acc, dx_ptr, m_ptr, img0, dimg, ij, i, j, h0, w0, offs_n, m_ok, n_ok, C, SH, SW,
              H, W, STRIDE1, ACCUMULATE, BLOCK_M, MASK)


# "transposed": the sweep's pick among the data configs, each as nested and as flat loop,
# and as one stage (above)
_T_CONFIGS = [_with(_cfg(*c[:6]), FLAT=c[6], **({"REG_A": True} if c[7:] else {})) for c in [
    (128, 64, 32, 4, 1, True, True),
    (64, 256, 32, 8, 4, True, True),
    (128, 64, 32, 4, 1, True, True, "REG_A"),
    (256, 128, 32, 8, 3, True, True),
    (64, 128, 64, 4, 4, True, True),
    (64, 256, 32, 8, 4, True, False, "REG_A"),
    (64, 256, 32, 8, 4, True, False),
    (64, 128, 64, 4, 4, True, True, "REG_A"),
]]
# under the interpreter BLOCK_K = 16 lets the CPU tests reach the k-chunk tail with small K,
# and the plain launch runs the nested loop, the accumulating one the flat loop with dY
# through registers (REG_A), so the CPU tests cover both forms
_T_INTERP = _cfg(128, 32, 16, 1, 1, group_m=2)
_conv_bwd_data_t = _autotune(_T_CONFIGS, _KEY, _bwd_data_macs,
                             interp=_with(_T_INTERP, FLAT=False))(_conv_bwd_data_t_kernel)
_conv_bwd_data_t_acc = _autotune(_T_CONFIGS, _KEY, _bwd_data_macs, restore=["dx_ptr"],
                                 interp=_with(_T_INTERP, FLAT=True, REG_A=True))(
    _conv_bwd_data_t_kernel)


# --------------------------------------------------------------------------------------------
# channels-last through the TMA unit ("nhwc" forward, "flipped_nhwc" data gradient)
# --------------------------------------------------------------------------------------------

@triton.jit
def _to_nhwc_kernel(x_ptr, xt_ptr, sum_ptr, C, HW, TILES, PER_PROGRAM,
                    SUM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """Xt[n, p, c] = X[n, c, p] (p: flat pixel) over the tiles [g*PER_PROGRAM,
    (g+1)*PER_PROGRAM) of g = program_id(0), in order (tile t: image t // cdiv(HW, BLOCK_P),
    its pixel block t % cdiv(HW, BLOCK_P)). A [BLOCK_C, BLOCK_P] tile is read along the
    pixels and written along the channels; Triton transposes it through shared memory.
    SUM: also sum[g, c] = the values of channel c the program moved (a bias gradient's
    partial sums, taken from dY on its way to channels-last instead of a second read)."""
    g = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    ptiles = tl.cdiv(HW, BLOCK_P)
    pix = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_C, BLOCK_P], dtype=tl.float32)
    t_lo = g * PER_PROGRAM
    for t in range(t_lo, tl.minimum(t_lo + PER_PROGRAM, TILES)):
        base = (t // ptiles).to(tl.int64) * C * HW
        offs_p = (t % ptiles) * BLOCK_P + pix
        ok = c_ok[:, None] & (offs_p < HW)[None, :]
        v = tl.load(x_ptr + base + (offs_c[:, None] * HW + offs_p[None, :]), mask=ok,
                    other=0.0)
        tl.store(xt_ptr + base + (offs_p[None, :] * C + offs_c[:, None]), v, mask=ok)
        if SUM:
            acc += v
    if SUM:
        tl.store(sum_ptr + g * C + offs_c, tl.sum(acc, axis=1), mask=c_ok)


@triton.jit
def _weight_ohwi_kernel(w_ptr, wt_ptr, K, C, RS: tl.constexpr, FLIP: tl.constexpr,
                        BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr):
    """The channels-last kernel's weight Wt[o, t, i] (out channel, flat tap, in channel):
    W[o, i, t] for the forward; under FLIP, the data gradient's (a conv of dY, so out = C,
    in = K, taps reversed): W[i, o, RS-1-t]. A program moves all taps of a [BLOCK_O,
    BLOCK_I] block: it reads W's runs of taps in their order (W's contiguous axis) and
    writes Wt along the in channels (Triton transposes the tile through shared memory); a
    program per tap read W at a stride of RS floats, 4x slower than its bytes (VGG16's
    512@28 weight: 21 us)."""
    offs_o = (tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O))[:, None, None]
    offs_i = (tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I))[None, :, None]
    taps = tl.arange(0, BLOCK_T)[None, None, :]            # W's tap order
    if FLIP:
        ok = (offs_o < C) & (offs_i < K) & (taps < RS)
        src = offs_i * (C * RS) + offs_o * RS + taps
        dst = (offs_o * RS + (RS - 1 - taps)) * K + offs_i
    else:
        ok = (offs_o < K) & (offs_i < C) & (taps < RS)
        src = offs_o * (C * RS) + offs_i * RS + taps
        dst = (offs_o * RS + taps) * C + offs_i
    tl.store(wt_ptr + dst, tl.load(w_ptr + src, mask=ok), mask=ok)


@triton.jit
def _conv_nhwc_kernel(x_desc, w_desc, b_ptr, y_ptr, m_ptr, yin_desc, m_desc, N, C, K, PH, PW,
                      H: tl.constexpr, W: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
                      R: tl.constexpr, S: tl.constexpr, TW: tl.constexpr, THC: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, RELU: tl.constexpr = False,
                      MASK: tl.constexpr = False, EPI_TMA: tl.constexpr = False,
                      Y_NHWC: tl.constexpr = False, M_NHWC: tl.constexpr = False):
    """Stride 1: Y[n, k, p, q] (+)= sum_(r,s,c) Xt[n, p-PH+r, q-PW+s, c] Wt[k, (r,s,c)] (+ b[k])
    from the channels-last Xt [N, H, W, C] (x's copy, or x itself where it is stored so) and
    Wt [K, R*S*C] (descriptors x_desc and w_desc; Y NCHW, or channels-last [N, P, Q, K]
    where Y_NHWC, a forward pass alone), then max(Y, 0) where RELU, or masked where MASK (as
    _conv_fwd_kernel; M_NHWC: the ReLU output is channels-last).

    A program's pixels are the same [TH, TW] patch of NB consecutive images (NB * TH * TW =
    BLOCK_M; TH is BLOCK_M // TW capped at THC, see _patch). For each tap and block of
    channels the TMA unit copies the patches' window, shifted by the tap, as a [NB, TH, TW,
    BLOCK_K] box of Xt, and a [BLOCK_N, BLOCK_K] box of Wt, into shared memory: both have the
    reduction axis contiguous (the MMA's K-major operands), and no address or mask is computed
    per element. Box elements outside Xt read as zeros: outside the image that is the padding
    (past the last image, rows the store drops); past channel C they cancel the weight box's
    run into the next tap.

    EPI_TMA: the epilogue's reads of Y (ACCUMULATE) and of the ReLU output (MASK) come through
    the TMA unit too, as [NB, BLOCK_N, TH, TW] boxes of yin_desc / m_desc (NCHW, Q a multiple
    of 4), not as per-element loads: on short rows (TW < 32) those, TW pixels apart by
    channel, made a masked data gradient about 1.4x as slow on the H200; on rows of 32
    pixels the boxes were the slower (bench/conv_gap.py; _launch_nhwc picks).
    """
    NB: tl.constexpr = (BLOCK_M // TW + THC - 1) // THC
    TH: tl.constexpr = BLOCK_M // TW // NB
    TP: tl.constexpr = (P + TH - 1) // TH
    TQ: tl.constexpr = (Q + TW - 1) // TW
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(N, NB) * (TP * TQ * BLOCK_M), K,
                             BLOCK_M, BLOCK_N, GROUP_M)
    img0 = (pid_m // (TP * TQ)) * NB
    patch = pid_m % (TP * TQ)
    p0 = (patch // TQ) * TH
    q0 = (patch % TQ) * TW
    k0 = pid_n * BLOCK_N
    blocks = tl.cdiv(C, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(R * S * blocks):
        tap = i // blocks
        c0 = (i - tap * blocks) * BLOCK_K
        r = tap // S
        a = x_desc.load([img0, p0 - PH + r, q0 - PW + (tap - r * S), c0])
        b = w_desc.load([k0, tap * C + c0])                                  # [BN, BK]
        acc = tl.dot(a.reshape(BLOCK_M, BLOCK_K), tl.trans(b), acc, input_precision=PRECISION)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = k0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    img = img0 + offs_m // (TH * TW)
    p = p0 + (offs_m // TW) % TH
    q = q0 + offs_m % TW
    PQ: tl.constexpr = P * Q
    pix = img.to(tl.int64) * PQ + p * Q + q
    pix_ok = (img < N) & (p < P) & (q < Q)
    if Y_NHWC:                     # [BM, BN] stored along the channels
        if RELU:
            acc = tl.where(acc < 0.0, 0.0, acc)
        tl.store(y_ptr + ((pix * K)[:, None] + offs_n[None, :]), acc,
                 mask=pix_ok[:, None] & n_ok[None, :])
    else:
        if MASK and M_NHWC:     # the ReLU output in the accumulator's [pixels, channels] order
            if EPI_TMA:
                r = m_desc.load([img0, p0, q0, k0]).reshape(BLOCK_M, BLOCK_N)
            else:
                r = tl.load(m_ptr + ((pix * K)[:, None] + offs_n[None, :]),
                            mask=pix_ok[:, None] & n_ok[None, :], other=0.0)
            if not ACCUMULATE:  # gated before the transposition: no tile transposed for it
                acc = _relu_gate(acc, r)
        y_off = (img.to(tl.int64) * (K * PQ) + p * Q + q)[None, :] + (offs_n * PQ)[:, None]
        y_ptrs = y_ptr + y_off
        mask = n_ok[:, None] & pix_ok[None, :]
        out = tl.trans(acc)                                                  # [BN, BM]
        if ACCUMULATE:
            if EPI_TMA:
                out += _nchw_box(yin_desc, img0, k0, p0, q0, BLOCK_N, BLOCK_M)
            else:
                out += tl.load(y_ptrs, mask=mask, other=0.0)
        if RELU:
            out = tl.where(out < 0.0, 0.0, out)      # as kernels/act.py: NaN propagates
        if MASK:
            if M_NHWC:
                if ACCUMULATE:      # after the addition: the mask transposed to Y's order
                    out = _relu_gate(out, tl.trans(r))
            elif EPI_TMA:
                out = _relu_gate(out, _nchw_box(m_desc, img0, k0, p0, q0, BLOCK_N, BLOCK_M))
            else:
                out = _relu_mask(out, m_ptr + y_off, mask)
        tl.store(y_ptrs, out, mask=mask)


@triton.jit
def _nchw_box(desc, img0, k0, p0, q0, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The [NB, BLOCK_N, TH, TW] box of an NCHW tensor at (img0, k0, p0, q0) through the TMA
    unit, as the [BLOCK_N, BLOCK_M] tile of the channels-last kernel's transposed
    accumulator (pixel m = (image, row, column) of the patch, column fastest); elements
    outside the tensor read as 0."""
    box = desc.load([img0, k0, p0, q0])
    return tl.permute(box, (1, 0, 2, 3)).reshape(BLOCK_N, BLOCK_M)


def _nhwc_boxes(nargs):
    """The TMA boxes of one config's tiles (a box shape is part of a descriptor): the
    autotuner's config hook."""
    tw = nargs["TW"]
    th, nb = _patch(nargs["BLOCK_M"], tw, nargs["THC"])
    nargs["x_desc"].block_shape = [nb, th, tw, nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if nargs.get("EPI_TMA"):        # the epilogue's boxes (else unread stand-ins)
        nargs["yin_desc"].block_shape = [nb, nargs["BLOCK_N"], th, tw]
        nargs["m_desc"].block_shape = [nb, th, tw, nargs["BLOCK_N"]] if nargs.get("M_NHWC") \
            else [nb, nargs["BLOCK_N"], th, tw]


def _nhwc_cfg(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                         num_warps=warps, num_stages=stages)


# picked by hand from a one-off sweep of 8 configs over 9 3x3 shapes (VGG16's and 512@7) at
# batch 32 on the H200 (bench/conv_configs.py's "nhwc" tuner redoes it): the winners and a
# larger tile. Left out because they computed wrong sums on the H200 (triton 3.6), differing
# from run to run (a race, apparently between the two warp groups that read the patch
# through registers from the ring of TMA buffers): [128, 128] tiles in 8 warps with 3 or 4
# stages (the sweep's most frequent winner: 0.41 ms at 512@28 against 0.46 for the next) at
# 512@14, 256->1024@14 (1x1) and 512@28 in 2-pixel-wide patches, errors up to 1.0 where
# TF32 rounding gives 0.01; and a [128, 256] tile (an accumulating data gradient, relative
# error 6e-2). A barrier in the loop cured the race and doubled the time; one after the loop
# did not cure it. test_channels_last_gpu_every_config_repeatable checks each config offered.
_NHWC_CONFIGS = [
    _nhwc_cfg(128, 64, 32, 4, 4),
    _nhwc_cfg(64, 128, 32, 4, 4),
    _nhwc_cfg(256, 128, 32, 8, 3),
    _nhwc_cfg(256, 64, 32, 8, 3),
]
_INTERP_NHWC = _nhwc_cfg(256, 32, 32, 1, 1)
_NHWC_KEY = [a for a in _KEY if a not in ("SH", "SW")]     # stride 1
_conv_nhwc = _autotune(_NHWC_CONFIGS, _NHWC_KEY, _fwd_macs, interp=_INTERP_NHWC,
                       config_hook=_nhwc_boxes)(_conv_nhwc_kernel)
# "flipped_nhwc" into a gradient that accumulates (the autotuner restores dx after timing)
_conv_nhwc_acc = _autotune(_NHWC_CONFIGS, _NHWC_KEY, _fwd_macs, restore=["y_ptr"],
                           interp=_INTERP_NHWC, config_hook=_nhwc_boxes)(_conv_nhwc_kernel)


@triton.jit
def _conv_bwd_weight_nhwc_kernel(x_desc, dy_desc, ws_ptr, N, C, K, PH, PW,
                                 P: tl.constexpr, Q: tl.constexpr, R: tl.constexpr,
                                 S: tl.constexpr, TW: tl.constexpr, PRECISION: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Stride 1: chunk program_id(1) of dW[k, c, r, s] = sum over pixels (n, p, q) of
    dY[n, k, p, q] Xt[n, p-PH+r, q-PW+s, c], into ws[chunk] ([K, C, R, S] each; summed in
    order by _splitk_reduce_kernel). Xt is x channels-last [N, H, W, C] (x_desc), dY stays
    NCHW (dy_desc).

    A program owns BLOCK_M channels c, BLOCK_N output channels k and one tap (the fastest
    grid index, so neighbouring programs read the same dY boxes). Its reduction walks
    [BLOCK_K // TW, TW] patches of output pixels: per patch the TMA unit copies dY's
    [BLOCK_N, patch] box (pixels contiguous: the MMA's K-major operand) and Xt's
    [patch shifted by the tap, BLOCK_M] box; coordinates outside either tensor read as zeros
    (the padding; a patch's overhang past P or Q meets dY's zeros). Xt's box, channels
    contiguous, is the MMA's first operand (taken through registers, which accept any
    layout), so the program accumulates dW^T [BLOCK_M, BLOCK_N]; as the second operand it
    ran up to 4x slower on the H200, never faster (a TF32 MMA reads only K-major operands
    from shared memory).
    """
    TH: tl.constexpr = BLOCK_K // TW
    TP: tl.constexpr = (P + TH - 1) // TH
    TQ: tl.constexpr = (Q + TW - 1) // TW
    RS: tl.constexpr = R * S
    pid = tl.program_id(0)
    tap = pid % RS
    pid_m, pid_n = _tile_ids(pid // RS, C, K, BLOCK_M, BLOCK_N, GROUP_M)
    r = tap // S
    s = tap - r * S
    c0 = pid_m * BLOCK_M
    k0 = pid_n * BLOCK_N
    total = N * (TP * TQ)
    per = tl.cdiv(total, tl.num_programs(1))
    lo = tl.program_id(1) * per
    hi = tl.minimum(lo + per, total)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(lo, hi):
        img = t // (TP * TQ)
        patch = t - img * (TP * TQ)
        p0 = (patch // TQ) * TH
        q0 = (patch % TQ) * TW
        xa = x_desc.load([img, p0 - PH + r, q0 - PW + s, c0]).reshape(BLOCK_K, BLOCK_M)
        dyb = dy_desc.load([img, k0, p0, q0]).reshape(BLOCK_N, BLOCK_K)
        acc = tl.dot(tl.trans(xa), tl.trans(dyb), acc, input_precision=PRECISION)

    _store_chunk_t(acc, ws_ptr, c0, k0, tap, C, K, RS, BLOCK_M, BLOCK_N)


@triton.jit
def _store_chunk_t(acc, ws_ptr, c0, k0, tap, C, K, RS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Store a tap's dW^T tile acc [BLOCK_M channels c from c0, BLOCK_N output channels k
    from k0] into split-K chunk program_id(1) of ws ([K, C, R, S] each)."""
    offs_c = c0 + tl.arange(0, BLOCK_M)
    offs_k = k0 + tl.arange(0, BLOCK_N)
    out = ws_ptr + tl.program_id(1).to(tl.int64) * (K * C * RS) + tap
    ptrs = out + (offs_c[:, None] * RS + offs_k[None, :] * (C * RS))
    tl.store(ptrs, acc, mask=(offs_c < C)[:, None] & (offs_k < K)[None, :])


def _weight_nhwc_boxes(nargs):
    """The weight-gradient kernel's TMA boxes for one config (see _nhwc_boxes)."""
    tw = nargs["TW"]
    th = nargs["BLOCK_K"] // tw
    nargs["x_desc"].block_shape = [1, th, tw, nargs["BLOCK_M"]]
    nargs["dy_desc"].block_shape = [1, nargs["BLOCK_N"], th, tw]


# (BLOCK_M channels, BLOCK_N output channels, BLOCK_K pixels): each shape's best of a one-off
# sweep of 16 configs over 9 3x3 shapes at batch 32 on the H200 (bench/conv_configs.py's
# "weight_nhwc" tuner redoes it)
_WGT_NHWC_CONFIGS = [
    _nhwc_cfg(64, 64, 64, 4, 3),
    _nhwc_cfg(128, 128, 64, 8, 3),
    _nhwc_cfg(256, 64, 32, 8, 3),
    _nhwc_cfg(64, 64, 32, 4, 4),
]
_INTERP_WGT_NHWC = _nhwc_cfg(64, 64, 64, 1, 1)
_conv_bwd_weight_nhwc = _autotune(_WGT_NHWC_CONFIGS, ["N", "C", "K", "P", "Q", "R", "S",
                                                     "PH", "PW"], _bwd_weight_macs,
                                  interp=_INTERP_WGT_NHWC,
                                  config_hook=_weight_nhwc_boxes)(_conv_bwd_weight_nhwc_kernel)


@triton.jit
def _shifted_rows_kernel(src_ptr, dst_ptr, ROWS, PW, W: tl.constexpr, WP: tl.constexpr,
                         BLOCK: tl.constexpr):
    """dst[i, row, w] = src[row, w + i - PW] where both w and w + i - PW are inside the row's
    W pixels, else 0, for rows of WP >= W pixels (i = program_id(1)): the "tma" weight
    gradient's copies of x shifted by each kernel column (the left and right padding
    written as zeros), and of dY widened to WP (i = PW = 0)."""
    i = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ROWS * WP
    row = offs // WP
    col = (offs - row * WP).to(tl.int32)
    src_col = col + (i - PW)
    take = ok & (col < W) & (src_col >= 0) & (src_col < W)
    v = tl.load(src_ptr + row * W + src_col, mask=take, other=0.0)
    tl.store(dst_ptr + i.to(tl.int64) * ROWS * WP + offs, v, mask=ok)


@triton.jit
def _shifted_from_nhwc_kernel(x_ptr, dst_ptr, N, C, PW, H: tl.constexpr, W: tl.constexpr,
                              WP: tl.constexpr, S: tl.constexpr, BLOCK_C: tl.constexpr,
                              BLOCK_W: tl.constexpr):
    """dst[i, n, c, h, w] = x[n, h, w + i - PW, c] where both w and w + i - PW are inside
    the row's W pixels, else 0, for rows of WP >= W pixels and each kernel column i < S:
    _shifted_rows_kernel's copies of x, from a channels-last x [N, H, W, C]. A program reads
    BLOCK_C channels of one image row (program_id(0) = n * H + h) once, along the channels,
    and writes each copy along the pixels (Triton transposes through shared memory), then
    the few columns no pixel lands on, as zeros."""
    row = tl.program_id(0)
    n = row // H
    h = row - n * H
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_w = tl.arange(0, BLOCK_W)
    c_ok = offs_c < C
    v = tl.load(x_ptr + row.to(tl.int64) * (W * C) + (offs_w * C)[None, :] + offs_c[:, None],
                mask=c_ok[:, None] & (offs_w < W)[None, :], other=0.0)
    rows = (offs_c * (H * WP))[:, None]
    for i in tl.static_range(S):
        dst = dst_ptr + ((i * N + n).to(tl.int64) * C * H + h) * WP + rows
        lands = offs_w - (i - PW)       # where pixel w lands in copy i
        tl.store(dst + lands[None, :], v,
                 mask=c_ok[:, None] & ((offs_w < W) & (lands >= 0) & (lands < W))[None, :])
        src = offs_w + (i - PW)         # column w of copy i, and the pixel it holds
        empty = (offs_w < WP) & ((offs_w >= W) | (src < 0) | (src >= W))
        tl.store(dst + offs_w[None, :], tl.zeros_like(v), mask=c_ok[:, None] & empty[None, :])


@triton.jit
def _conv_bwd_weight_tma_kernel(xs_desc, dy_desc, ws_ptr, N, C, K, PH,
                                HWP: tl.constexpr, WP: tl.constexpr, R: tl.constexpr,
                                S: tl.constexpr, PRECISION: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """A "same" stride-1 conv (P = H, Q = W): chunk program_id(1) of dW[k, c, r, s] = sum
    over pixels j = (n, h, w) of dY[n, k, j] Xs[s, n, c, j + (r - PH) * WP], into ws[chunk]
    ([K, C, R, S] each; summed in order by _splitk_reduce_kernel). Every image's pixels are
    one flat row of H rows of WP (a multiple of 4) pixels: dY as [N, K, H*WP] (dy_desc; rows
    past W are zeros) and Xs, x shifted by each kernel column s (Xs[s, n, c, h, w] =
    x[n, c, h, w + s - PW], zero outside the image), as [S, N, C, H*WP] (xs_desc), so a tap
    is a shift by whole rows, a multiple of 4 pixels: a TMA box must start 16-byte aligned
    on its contiguous axis.

    A program owns BLOCK_M channels c, BLOCK_N output channels k and one tap (the fastest
    grid index, so neighbouring programs read the same dY boxes). Per BLOCK_K pixels of one
    image the TMA unit copies Xs's [BLOCK_M, BLOCK_K] box, rows shifted by the tap, and dY's
    [BLOCK_N, BLOCK_K] box: both have the pixels, the reduction axis, contiguous (the
    K-major operands a TF32 MMA reads from shared memory), and no address or mask is
    computed per element. Rows shifted past the image read as zeros (the top and bottom
    padding). Past an image's last pixel dY's box is zeros; Xs's may not be (rows above the
    image's end), so an infinite x there makes NaN, where the other algorithms skip it.
    """
    RS: tl.constexpr = R * S
    CHUNKS: tl.constexpr = (HWP + BLOCK_K - 1) // BLOCK_K
    pid = tl.program_id(0)
    tap = pid % RS
    pid_m, pid_n = _tile_ids(pid // RS, C, K, BLOCK_M, BLOCK_N, GROUP_M)
    r = tap // S
    s = tap - r * S
    shift = (r - PH) * WP
    c0 = pid_m * BLOCK_M
    k0 = pid_n * BLOCK_N
    total = N * CHUNKS
    per = tl.cdiv(total, tl.num_programs(1))
    lo = tl.program_id(1) * per
    hi = tl.minimum(lo + per, total)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(lo, hi):
        img = t // CHUNKS
        j0 = (t - img * CHUNKS) * BLOCK_K
        xa = xs_desc.load([s, img, c0, j0 + shift]).reshape(BLOCK_M, BLOCK_K)
        dyb = dy_desc.load([img, k0, j0]).reshape(BLOCK_N, BLOCK_K)
        acc = tl.dot(xa, tl.trans(dyb), acc, input_precision=PRECISION)

    _store_chunk_t(acc, ws_ptr, c0, k0, tap, C, K, RS, BLOCK_M, BLOCK_N)


def _weight_tma_boxes(nargs):
    """The flat weight-gradient kernel's TMA boxes for one config (see _nhwc_boxes)."""
    nargs["xs_desc"].block_shape = [1, 1, nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["dy_desc"].block_shape = [1, nargs["BLOCK_N"], nargs["BLOCK_K"]]


# (BLOCK_M channels, BLOCK_N output channels, BLOCK_K pixels): the greedy pick of
# bench/conv_configs.py's "weight_tma" tuner from 12 configs over its 17 shapes at batch 32
# on the H200 (4.69 ms summed over the shapes' best, against 4.79 for the first list)
_WGT_TMA_CONFIGS = [
    _nhwc_cfg(64, 128, 32, 4, 4),
    _nhwc_cfg(64, 64, 128, 4, 3),
    _nhwc_cfg(128, 128, 32, 8, 3),
    _nhwc_cfg(128, 256, 32, 8, 3),
]
_INTERP_WGT_TMA = _nhwc_cfg(64, 64, 64, 1, 1)
_conv_bwd_weight_tma = _autotune(_WGT_TMA_CONFIGS, ["N", "C", "K", "HWP", "WP", "R", "S",
                                                   "PH"], _same_weight_macs,
                                 interp=_INTERP_WGT_TMA,
                                 config_hook=_weight_tma_boxes)(_conv_bwd_weight_tma_kernel)


@triton.jit
def _zero_insert_kernel(dy_ptr, z_ptr, P, Q, HZ, WZ, SH, SW, OFFH, OFFW, BLOCK: tl.constexpr):
    """z[n, k, a, b] = dY[n, k, (a-OFFH)/SH, (b-OFFW)/SW] where the division is exact and in
    range, else 0 (dY with zeros inserted between pixels and a zero border)."""
    nk = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < HZ * WZ
    a = offs // WZ - OFFH
    b = offs % WZ - OFFW
    p = a // SH
    q = b // SW
    take = ok & (a >= 0) & (b >= 0) & (a % SH == 0) & (b % SW == 0) & (p < P) & (q < Q)
    v = tl.load(dy_ptr + nk * (P * Q) + p * Q + q, mask=take, other=0.0)
    tl.store(z_ptr + nk * (HZ * WZ) + offs, v, mask=ok)


@triton.jit
def _conv_bwd_weight_kernel(x_ptr, dy_ptr, dw_ptr, db_ptr,
                            N, C, K, SH, SW, PH, PW, SPLIT_LEN,
                            H: tl.constexpr, W: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
                            R: tl.constexpr, S: tl.constexpr, IS_1X1: tl.constexpr,
                            PRECISION: tl.constexpr, HAS_DB: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, PIX: tl.constexpr, TAP: tl.constexpr):
    """dW[k, (c,r,s)] = sum over pixels j in chunk program_id(1) of dY[j, k] * Xcol[j, (c,r,s)].

    Both tiles are [rows, BLOCK_K pixels] with the pixel axis fast. Writes chunk `split` to
    dw_ptr + split*K*C*R*S (one chunk: dW itself; several: the split-K workspace, summed by
    _splitk_reduce_kernel). HAS_DB: the programs of the first column tile also sum the dY
    rows they load, the chunk's bias gradient, into db_ptr + split*K (every column tile loads
    the same dY tiles, so one of them takes it).

    TAP (a config flag): a program's columns are BLOCK_N channels of one tap (r, s) instead of
    BLOCK_N consecutive (c, r, s); the tap is then a scalar, so the x gather's bounds mask is
    a vector over the pixels (see _conv_fwd_kernel) and the columns a vector over channels.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    PQ: tl.constexpr = P * Q
    HW: tl.constexpr = H * W
    RS: tl.constexpr = R * S
    CRS = C * RS
    NPQ = N * PQ
    if TAP:     # column tiles: (channel block, tap), the tap fastest
        n_tiles = tl.cdiv(C, BLOCK_N) * RS
        pid_m, pid_n = _tile_ids(pid, K, n_tiles * BLOCK_N, BLOCK_M, BLOCK_N, GROUP_M)
        tap = pid_n % RS
        offs_c = (pid_n // RS) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_t = tap // S
        s_t = tap - r_t * S
        n_ok = offs_c < C
        offs_n = offs_c * RS + tap                       # dW columns (c, r, s)
        x_n = offs_c * HW
    else:
        pid_m, pid_n = _tile_ids(pid, K, CRS, BLOCK_M, BLOCK_N, GROUP_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)     # (c, r, s)
        n_ok = offs_n < CRS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)     # output channel k
    m_ok = offs_m < K
    if IS_1X1:
        x_n = offs_n * HW
    elif not TAP:
        nu = offs_n.to(tl.uint32)
        c = nu // RS
        rs = nu - c * RS
        r = rs // S
        s = (rs - r * S).to(tl.int32)
        r = tl.where(n_ok, r.to(tl.int32), H + PH)        # dead column: see _conv_fwd_kernel
        x_n = c.to(tl.int32) * HW + r * W + s
    dy_k = offs_m * PQ
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, NPQ)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dy_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_K):
        img0 = j0 // PQ
        offs_j = j0 + tl.arange(0, BLOCK_K)
        j_ok = offs_j < hi
        ju = offs_j.to(tl.uint32)                       # unsigned: cheaper division
        img = ju // PQ
        pq = (ju - img * PQ).to(tl.int32)
        dimg = img.to(tl.int32) - img0
        dy_j = dimg * (K * PQ) + pq
        if PIX and PQ % 4 != 0:
            dy_j = tl.max_contiguous(tl.multiple_of(dy_j, 1), BLOCK_K)
        a = tl.load(dy_ptr + img0.to(tl.int64) * (K * PQ) + (dy_j[None, :] + dy_k[:, None]),
                    mask=m_ok[:, None] & j_ok[None, :], other=0.0)            # [BM, BK]
        if HAS_DB:
            dy_sum += tl.sum(a, axis=1)
        x_base = x_ptr + img0.to(tl.int64) * (C * HW)
        if IS_1X1:
            x_j = dimg * (C * HW) + pq
            if PIX and PQ % 4 != 0:
                x_j = tl.max_contiguous(tl.multiple_of(x_j, 1), BLOCK_K)
            bt = tl.load(x_base + (x_j[None, :] + x_n[:, None]),
                         mask=n_ok[:, None] & j_ok[None, :], other=0.0)       # [BN, BK]
        else:
            pqu = pq.to(tl.uint32)
            oh = pqu // Q
            ih0 = tl.where(j_ok, oh.to(tl.int32) * SH - PH, -(H + PH + R))
            iw0 = (pqu - oh * Q).to(tl.int32) * SW - PW
            if TAP:
                ih0 += r_t
                iw0 += s_t
            x_j = dimg * (C * HW) + ih0 * W + iw0
            if PIX:
                x_j = tl.max_contiguous(tl.multiple_of(x_j, 1), BLOCK_K)
            if TAP:
                mask = n_ok[:, None] & (_ult(ih0, H) & _ult(iw0, W))[None, :]
            else:
                mask = _ult(ih0[None, :] + r[:, None], H) & _ult(iw0[None, :] + s[:, None], W)
            bt = tl.load(x_base + (x_j[None, :] + x_n[:, None]), mask=mask,
                         other=0.0)                                          # [BN, BK]
        acc = tl.dot(a, tl.trans(bt), acc, input_precision=PRECISION)

    out = dw_ptr + split.to(tl.int64) * (K * CRS) + (offs_m[:, None] * CRS + offs_n[None, :])
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])
    if HAS_DB:
        if pid_n == 0:
            tl.store(db_ptr + split * K + offs_m, dy_sum, mask=m_ok)


_conv_bwd_weight = _autotune(_WGT_CONFIGS, _KEY + ["SPLIT_LEN"], _bwd_weight_macs,
                             interp=_INTERP_WGT)(_conv_bwd_weight_kernel)


@triton.jit(do_not_specialize=["PLANE", "CHANNELS"])
def _splitk_reduce_kernel(ws_ptr, dw_ptr, b_ptr, m_ptr, TOTAL, SPLITS, PLANE, CHANNELS,
                          BLOCK: tl.constexpr, AHEAD: tl.constexpr,
                          HAS_BIAS: tl.constexpr = False, RELU: tl.constexpr = False,
                          ACCUMULATE: tl.constexpr = False, MASK: tl.constexpr = False):
    """dw[i] = sum_{s < SPLITS} ws[s, i], in order s = 0, 1, ... (deterministic); then,
    for the split-K forward, + b[(i // PLANE) % CHANNELS] where HAS_BIAS (dw is an NCHW
    output of CHANNELS planes of PLANE pixels) and max(., 0) where RELU; for the split-K data
    gradient, + dw[i] where ACCUMULATE, then 0 where MASK and m[i] <= 0 (as the data
    gradient kernels' stores do).

    AHEAD chunks' loads per step, issued ahead of the adds (the loop is unrolled and no
    load waits for an add): one load at a time waited a memory latency per chunk (a 1x1
    weight gradient over 256 chunks spent about 0.1 ms here on the H200). A small sum (a
    bias over a thousand groups: one program) is a chain of such steps, so the launcher
    takes AHEAD as large as the registers allow. The adds stay in chunk order, and a chunk
    past SPLITS adds +0.0, which changes no sum that starts at +0.0, so the bits are those
    of the plain loop."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < TOTAL
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = ws_ptr + offs
    for sp in range(0, SPLITS, AHEAD):
        left = tl.where(ok, SPLITS - sp, 0)             # chunks from sp on (0: none)
        for i in tl.static_range(AHEAD):
            acc += tl.load(base + i * TOTAL, mask=left > i, other=0.0)
        base += AHEAD * TOTAL
    if HAS_BIAS:
        acc += tl.load(b_ptr + (offs // PLANE) % CHANNELS, mask=ok, other=0.0)
    if RELU:
        acc = tl.where(acc < 0.0, 0.0, acc)          # as kernels/act.py: NaN propagates
    if ACCUMULATE:
        acc += tl.load(dw_ptr + offs, mask=ok, other=0.0)
    if MASK:
        acc = _relu_mask(acc, m_ptr + offs, ok)
    tl.store(dw_ptr + offs, acc, mask=ok)


_REDUCE_WARPS = 4
_REDUCE_IN_FLIGHT = 32       # loads ahead per thread: AHEAD * (floats per thread)


def _launch_splitk_reduce(chunks, out, total, splits, bias=None, plane=1, relu=False,
                          accumulate=False, mask=None):
    """out[:total] = the in-order sum of `splits` chunks of `total` floats
    (_splitk_reduce_kernel), in blocks small enough to give the GPU a few hundred programs
    where `total` is small (a 1x1 conv's weight, a bias), each thread loading
    _REDUCE_IN_FLIGHT floats ahead (4 chunks at 1,024 floats a block, 32 at 128). The
    split-K forward's sum adds `bias` (out: NCHW, `plane` pixels a channel) and its ReLU;
    the split-K data gradient's adds out's old value where `accumulate`, then `mask`'s."""
    block = _ELEM_BLOCK if INTERPRET else \
        max(128, min(_ELEM_BLOCK, next_power_of_2(cdiv(total, 264))))
    per_thread = max(1, block // (32 * _REDUCE_WARPS))
    channels = 1 if bias is None else bias.numel()
    run(_splitk_reduce_kernel, (cdiv(total, block),), chunks, out,
        out if bias is None else bias, out if mask is None else mask, total, splits, plane,
        channels, BLOCK=block, AHEAD=max(4, _REDUCE_IN_FLIGHT // per_thread),
        HAS_BIAS=bias is not None, RELU=relu, ACCUMULATE=accumulate, MASK=mask is not None,
        num_warps=_REDUCE_WARPS)


@triton.jit
def _bias_grad_kernel(dy_ptr, db_ptr, N, K, PQ, IMGS, BLOCK_C: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK: tl.constexpr):
    """db[g, k] = sum_{n in group g, pq} dY[n, k, pq] for BLOCK_C channels per program and the
    images [g*IMGS, (g+1)*IMGS) of group g = program_id(1), in a fixed order.

    Each step adds a [BLOCK_C channels, BLOCK_I images, BLOCK pixels] tile of dY into the
    accumulator; the sum over images and pixels comes last. On the GPU a program takes one
    channel and one image per step (BLOCK_C = BLOCK_I = 1); the interpreter pays per
    operation and per program, so there a program takes whole blocks of both.
    """
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < K
    n_lo = tl.program_id(1) * IMGS
    n_hi = tl.minimum(n_lo + IMGS, N)
    imgs = tl.arange(0, BLOCK_I)
    pix = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK_C, BLOCK_I, BLOCK), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_I):
        rows = n0 + imgs
        row = (rows[None, :].to(tl.int64) * K + offs_c[:, None]) * PQ        # [BC, BI]
        row_ok = c_ok[:, None] & (rows < n_hi)[None, :]
        for p0 in range(0, PQ, BLOCK):
            offs = p0 + pix
            acc += tl.load(dy_ptr + row[:, :, None] + offs[None, None, :],
                           mask=row_ok[:, :, None] & (offs < PQ)[None, None, :], other=0.0)
    tl.store(db_ptr + tl.program_id(1) * K + offs_c, tl.sum(tl.sum(acc, axis=2), axis=1),
             mask=c_ok)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

_ELEM_BLOCK = 16 if INTERPRET else 1024
_BIAS_TILE = INTERP_TILE if INTERPRET else 0     # see _bias_blocks
_BIAS_PROGRAMS = 1 if INTERPRET else 1056         # see bias_groups (8 per SM on an H200)


def _check_4d(name, t, shape=None, channels_last=False):
    """A contiguous float32 4-D tensor (of `shape`); where `channels_last`, one stored
    channels-last (`is_channels_last`) too. Skipped within `_common.checked_before`."""
    if _CHECKED_BEFORE[0]:
        return
    stored = _nhwc_storage(t) if channels_last and isinstance(t, torch.Tensor) and \
        t.dim() == 4 and is_channels_last(t) else t
    check_tensor(name, stored)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dim() != 4:
        raise ValueError(f"conv: {name} must be 4-D, got shape {tuple(t.shape)}")


# the algorithms that read x (forward, the data gradient's ReLU mask, the weight gradient)
# or write y (forward) stored channels-last
_READS_CHANNELS_LAST = {"forward": ("nhwc",), "backward_data": ("flipped_nhwc",),
                        "backward_weight": ("nhwc", "tma")}
WRITES_CHANNELS_LAST = ("implicit", "nhwc")


def reads_channels_last(phase, algo, x_shape, w_shape) -> bool:
    """True where `phase` run by `algo` can read a channels-last x (in place, or into the
    copy it makes anyway: "tma" only where it copies x, `_tma_layout`)."""
    if algo not in _READS_CHANNELS_LAST[phase]:
        return False
    return algo != "tma" or _tma_layout(x_shape, w_shape)[1]


def _check_reads(phase, algo, x, w_shape, name="x"):
    """One line naming what a channels-last `x` needs of `phase`'s algorithm, if anything."""
    if not is_channels_last(x):
        return
    if not reads_channels_last(phase, algo, x.shape, w_shape):
        tma = " (\"tma\" where it copies x)" if phase == "backward_weight" else ""
        raise ValueError(f"conv: a channels-last {name} needs {phase} algo among "
                         f"{_READS_CHANNELS_LAST[phase]}{tma}, got {algo!r}")
    if algo == "nhwc" and x.data_ptr() % 16:
        raise ValueError(f"conv: {phase} algo 'nhwc' reads a channels-last {name} in place "
                         f"(a TMA descriptor's base) and needs it 16-byte aligned; its "
                         f"address is {x.data_ptr()}")


def _workspace(workspace, need, device):
    """The first `need` bytes of `workspace` as float32 (None when need is 0)."""
    if need == 0:
        return None
    if workspace is None:
        raise ValueError(f"conv: this algorithm needs a workspace of {need} bytes, got None")
    return float_workspace("conv", workspace, need, device)


def _geometry(x_shape, w_shape, stride, padding):
    """(sh, sw, ph, pw, P, Q), validated; cached per shape (launch overhead matters)."""
    return _geometry_cached(tuple(x_shape), tuple(w_shape), _hashable(stride),
                            _hashable(padding))


@functools.lru_cache(maxsize=4096)
def _geometry_cached(x_shape, w_shape, stride, padding):
    sh, sw = pair(stride, "conv: stride", 1)
    ph, pw = pair(padding, "conv: padding", 0)
    n, k, p, q = out_shape(x_shape, w_shape, (sh, sw), (ph, pw))
    _, c, h, w = x_shape
    _, _, r, s = w_shape
    # in-tile offsets are 32-bit relative to a tile's first image: a tile of up to 256 pixels
    # spans at most 256 // (pixels per image, or per stride class) + 2 images
    per_image = max(c * h * w, k * p * q, c * r * s * p * q, k * (h + r - 1) * (w + s - 1))
    span = 256 // max(1, min(p * q, (h // sh) * (w // sw))) + 2
    if span * per_image >= 2 ** 31 or n * max(p * q, h * w) >= 2 ** 31 or \
            _splitk_splits(x_shape, w_shape, (sh, sw), (ph, pw)) * k * c * r * s >= 2 ** 31:
        raise ValueError(f"conv: shapes x {tuple(x_shape)}, w {tuple(w_shape)} exceed the "
                         "kernels' 32-bit in-tile offsets")
    return sh, sw, ph, pw, p, q


def _algo(phase, algo):
    if algo not in _ALGOS[phase]:
        raise ValueError(f"conv: {phase} algo must be one of {_ALGOS[phase]}, got {algo!r}")
    return algo


def _tile_grid(m, n, depth=1):
    """Grid of a GEMM over [m, n] tiles (axis 0, grouped by _tile_ids) times `depth` (axis 1:
    residue classes of the data gradient, split-K chunks of the weight gradient)."""
    return lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), depth)


def _weight_grid(k, c, rs, splits):
    """The weight gradient's grid: [K, C*R*S] tiles, or [K, (channel block, tap)] tiles under
    the TAP flag, times the split-K chunks."""
    def grid(meta):
        bn = meta["BLOCK_N"]
        cols = cdiv(c, bn) * rs if meta["TAP"] else cdiv(c * rs, bn)
        return cdiv(k, meta["BLOCK_M"]) * cols, splits
    return grid


def _launch_fwd(x, w, b, y, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s, prec,
                accumulate=False, relu=False, mask=None, y_nhwc=False, splits=1):
    """_conv_fwd_kernel on one conv; with `splits` > 1 (the "splitk" forward) y holds
    `splits` partial outputs, one per chunk of the reduction (no bias, ReLU or mask)."""
    is_1x1 = r == 1 and s == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0
    blocks = _forward_chunk_blocks(c * r * s, splits)
    _launch(_conv_fwd_acc if accumulate else _conv_fwd,
            _tile_grid(n * p * q, k, cdiv(c * r * s, blocks * _FWD_CHUNK_QUANTUM)),
            (x, w, b if b is not None else y, y, y if mask is None else mask,
             n, c, k, sh, sw, ph, pw, blocks),
            dict(H=h, W=wd, P=p, Q=q, R=r, S=s, IS_1X1=is_1x1, HAS_BIAS=b is not None,
                 ACCUMULATE=accumulate, PRECISION=prec, RELU=relu, MASK=mask is not None,
                 Y_NHWC=y_nhwc))


def forward(x, w, b, y, *, stride, padding, algo="implicit", workspace=None, precision=None,
            relu=False):
    """y = conv2d(x, w, b, stride, padding), or relu of it where `relu` (a ReLU fused into
    the conv's store: the same bits as the two layers, without the ReLU's pass over y).
    x [N,C,H,W], w [K,C,R,S], b [K] or None, y [N,K,P,Q] (overwritten). algo "implicit" (no
    workspace), "im2col", "nhwc" or "splitk" (workspace)."""
    prec = dot_precision(precision)
    _algo("forward", algo)
    if not isinstance(relu, bool):
        raise ValueError(f"relu must be a bool, got {relu!r}")
    _check_4d("x", x, channels_last=True)
    _check_4d("w", w)
    sh, sw, ph, pw, p, q = _geometry(x.shape, w.shape, stride, padding)
    _check_applies("forward", algo, x.shape, w.shape, (sh, sw, ph, pw))
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    _check_4d("y", y, (n, k, p, q), channels_last=True)
    _check_reads("forward", algo, x, w.shape)
    if is_channels_last(y) and algo not in WRITES_CHANNELS_LAST:
        raise ValueError(f"conv: a channels-last y needs forward algo among "
                         f"{WRITES_CHANNELS_LAST}, got {algo!r}")
    if b is not None:
        check_tensor("b", b, (k,))
    check_device("conv", x, w=w, b=b, y=y, workspace=workspace)
    ws = _workspace(workspace, workspace_bytes(x.shape, w.shape, (sh, sw), (ph, pw),
                                               "forward", algo), x.device)
    check_no_overlap("conv", [("y", y), ("workspace", ws)], [("x", x), ("w", w), ("b", b)])
    if algo == "implicit":
        _launch_fwd(x, w, b, y, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s, prec, relu=relu,
                    y_nhwc=is_channels_last(y))
        return
    if algo == "nhwc":
        _launch_nhwc(x, w, b, y, ws, ph, pw, prec, relu=relu)
        return
    if algo == "splitk":
        _launch_forward_splitk(x, w, b, y, ws, (sh, sw, ph, pw), prec, relu)
        return
    # im2col: col [N, C*R*S, P, Q], then a 1x1 conv of col with w as [K, C*R*S, 1, 1]
    crs = c * r * s
    bm, bk = (16, 16) if INTERPRET else (128, 32)
    run(_im2col_kernel, (cdiv(n * p * q, bm), cdiv(crs, bk)),
        x, ws, n, c, sh, sw, ph, pw, H=h, W=wd, P=p, Q=q, R=r, S=s, BLOCK_M=bm, BLOCK_K=bk,
        num_warps=4)
    _launch_fwd(ws, w, b, y, n, crs, p, q, k, p, q, 1, 1, 0, 0, 1, 1, prec, relu=relu)


def _launch_forward_splitk(x, w, b, y, ws, geo, prec, relu):
    """The "splitk" forward: each chunk of the C*R*S reduction writes its partial output
    into the workspace, then their in-order sum, the bias and the ReLU go into y."""
    (n, c, h, wd), (k, _, r, s) = x.shape, w.shape
    sh, sw, ph, pw = geo
    p, q = y.shape[2], y.shape[3]
    splits = forward_splits(x.shape, w.shape, (sh, sw), (ph, pw))
    _launch_fwd(x, w, None, ws, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s, prec,
                splits=splits)
    _launch_splitk_reduce(ws, y, y.numel(), splits, bias=b, plane=p * q, relu=relu)


def _tile_w(q):
    """The patch width of the channels-last kernel: the power of two up to 32 that wastes the
    fewest columns of a Q-wide output (the widest of equals: 32 for 224, 4 for 28)."""
    return min((32, 16, 8, 4, 2, 1), key=lambda tw: cdiv(q, tw) * tw - q)


def _patch(block_m, tw, thc):
    """(TH, NB): a channels-last forward tile of `block_m` pixels is a [TH, tw] patch of NB
    images, TH = block_m // tw rows capped at `thc` (as the kernel computes them)."""
    rows = block_m // tw
    th = min(rows, thc)
    return th, rows // th


@functools.lru_cache(maxsize=1024)
def _tile_h_cap(n, p, tw, block_m=128):
    """The cap on the channels-last forward's patch height (THC): the power of two that wastes
    the fewest rows of N images of P rows, for a tile of `block_m` pixels (the largest of
    equals: one image per tile, as tall as the tile, where that wastes nothing). A 28-row
    output is 4 rows of 8 images per 128-pixel tile, not 32 rows of one (4 past the image)."""
    def covered(cap):
        th, nb = _patch(block_m, tw, cap)
        return cdiv(p, th) * th * cdiv(n, nb) * nb
    caps = [1 << i for i in range((256 // tw).bit_length())]     # up to the largest tile's
    return min(reversed(caps), key=covered)


def _nhwc_tiles(x_shape, room=None):
    """(BLOCK_C, BLOCK_P, tiles, tiles per program, programs along the tiles) of
    _to_nhwc_kernel over x [N, C, H, W]. A plain copy takes one tile per program; summed
    (`room`: float32 partial sums that fit) it takes image-and-pixel groups, enough for about
    _BIAS_PROGRAMS programs (the interpreter: one group, the sum itself)."""
    n, c, h, wd = x_shape
    bc, bp = (min(64, next_power_of_2(c)), 256) if INTERPRET else (64, 64)
    tiles = n * cdiv(h * wd, bp)
    want = tiles if room is None else \
        max(1, min(tiles, room // c, cdiv(_BIAS_PROGRAMS, cdiv(c, bc))))
    per = cdiv(tiles, want)
    return bc, bp, tiles, per, cdiv(tiles, per)


def fuses_bias_grad(algo_data) -> bool:
    """True for the data-gradient algorithm that sums the bias gradient as it copies dY
    (conv.backward does so where it computes dx, dW and db)."""
    return algo_data == "flipped_nhwc"


def nhwc_bias_launches(dy_shape, room) -> int:
    """Kernels the bias gradient adds to a "flipped_nhwc" data gradient that sums it on the
    way (`room` floats of dW for the partial sums): their fixed-order sum, where there are
    several groups."""
    return int(_nhwc_tiles(dy_shape, room)[4] > 1)


def _launch_to_nhwc(x, xt, db=None, room=None):
    """xt (flat) = x [N, C, H, W] channels-last, [N, H, W, C]; with `db` also db = x summed
    over images and pixels per channel, through partial sums in `room` (float32) where it
    takes several groups (_nhwc_tiles), then their fixed-order sum."""
    c = x.shape[1]
    bc, bp, tiles, per, groups = _nhwc_tiles(x.shape, None if db is None else room.numel())
    sums = db if groups == 1 or db is None else room
    run(_to_nhwc_kernel, (groups, cdiv(c, bc)), x, xt, xt if sums is None else sums,
        c, x.shape[2] * x.shape[3], tiles, per, SUM=db is not None, BLOCK_C=bc, BLOCK_P=bp,
        num_warps=4)
    if db is not None and groups > 1:
        _launch_splitk_reduce(room, db, c, groups)


def _launch_weight_ohwi(w, wt, o, i, rs, flip):
    """wt = w as the channels-last kernel reads it, [o, rs, i] (_weight_ohwi_kernel)."""
    bo, bi = min(16, next_power_of_2(o)), min(32, next_power_of_2(i))
    run(_weight_ohwi_kernel, (cdiv(o, bo), cdiv(i, bi)), w, wt, w.shape[0], w.shape[1],
        RS=rs, FLIP=flip, BLOCK_O=bo, BLOCK_I=bi, BLOCK_T=next_power_of_2(rs), num_warps=4)


def _launch_nhwc(x, w, b, y, ws, ph, pw, prec, flip=False, accumulate=False, relu=False,
                 mask=None, bias_grad=None):
    """"nhwc": X [N, C, H, W] -> Xt [N, H, W, C] and w -> Wt [O, R*S, C] in the workspace
    `ws`, then the TMA kernel into Y [N, O, P, Q] (stride 1, padding (ph, pw)). flip: the
    "flipped_nhwc" data gradient, X = dY, Y = dX, Wt from the flipped weight; `mask`: Y
    zeroed where it is <= 0 (a ReLU's backward, `_relu_mask`); `bias_grad` (db, room): db =
    X's per-channel sum, taken as X is copied (_launch_to_nhwc)."""
    n, c, h, wd = x.shape
    _, o, p, q = y.shape
    r, s = w.shape[2:]
    wt = ws[n * h * wd * c:n * h * wd * c + o * r * s * c]
    if is_channels_last(x):     # read in place: no copy (and no bias gradient taken on one)
        xt = _nhwc_storage(x)
    else:
        xt = ws[:n * h * wd * c]
        _launch_to_nhwc(x, xt, *(bias_grad or ()))
    _launch_weight_ohwi(w, wt, o, c, r * s, flip)
    tw = _tile_w(q)
    thc = _tile_h_cap(n, p, tw)
    # boxes: placeholders, set per config by _nhwc_boxes
    x_desc = TensorDescriptor(xt, [n, h, wd, c], [h * wd * c, wd * c, c, 1], [1, 1, 1, 4])
    w_desc = TensorDescriptor(wt, [o, r * s * c], [r * s * c, 1], [1, 4])
    tq = cdiv(q, tw)

    def grid(meta):
        th, nb = _patch(meta["BLOCK_M"], tw, thc)
        return (cdiv(n, nb) * cdiv(p, th) * tq * cdiv(o, meta["BLOCK_N"]),)
    m = y if mask is None else mask
    # the epilogue reads through the TMA unit where it reads at all, TMA can (16-byte aligned
    # rows, then TW >= 4) and its rows are short: per-element loads, TW pixels apart by
    # channel, took a masked data gradient 0.64 ms against 0.47 at 512@28 (TW 4) and 0.66
    # against 0.47 at 256@56 (TW 8), but 0.81 against 1.08 at 64@224 (TW 32; VGG16's shapes
    # at batch 32 on the H200, bench/conv_gap.py); else the descriptors are unread stand-ins
    # a channels-last mask's box rows are BLOCK_N channels long whatever the patch's width:
    # through the TMA unit unless Y is read too on long rows (or the mask's rows misalign)
    m_nhwc = mask is not None and is_channels_last(mask)
    short_rows = tw < _EPI_LOAD_TW or (m_nhwc and not accumulate)
    epi_tma = (accumulate or mask is not None) and q % 4 == 0 and short_rows and \
        y.data_ptr() % 16 == 0 and m.data_ptr() % 16 == 0 and not (m_nhwc and o % 4)
    if epi_tma:
        yin_desc = _nchw_desc(y)
        m_desc = _nhwc_desc(_nhwc_storage(m)) if m_nhwc else _nchw_desc(m)
    else:
        yin_desc = m_desc = _nchw_desc(wt[:4].view(1, 1, 1, 4))
    _launch(_conv_nhwc_acc if accumulate else _conv_nhwc, grid,
            (x_desc, w_desc, b if b is not None else y, y, m, yin_desc, m_desc,
             n, c, o, ph, pw),
            dict(H=h, W=wd, P=p, Q=q, R=r, S=s, TW=tw, THC=thc, HAS_BIAS=b is not None,
                 ACCUMULATE=accumulate, PRECISION=prec, RELU=relu, MASK=mask is not None,
                 EPI_TMA=epi_tma, Y_NHWC=is_channels_last(y), M_NHWC=m_nhwc))


# rows of this many pixels or more: the channels-last kernel's epilogue loads Y and the ReLU
# mask per element, as it stores (see _launch_nhwc)
_EPI_LOAD_TW = 32


def _nchw_desc(t):
    """A TMA descriptor over the NCHW tensor `t` (its box is set per config, _nhwc_boxes)."""
    n, c, h, w = t.shape
    return TensorDescriptor(t, [n, c, h, w], [c * h * w, h * w, w, 1], [1, 1, 1, 4])


def _nhwc_desc(t):
    """A TMA descriptor over the contiguous [N, H, W, C] tensor `t` (box set per config)."""
    n, h, w, c = t.shape
    return TensorDescriptor(t, [n, h, w, c], [h * w * c, w * c, c, 1], [1, 1, 1, 4])


def is_channels_last(t) -> bool:
    """True for a 4-D tensor [N, C, H, W] stored channels-last (torch.channels_last strides,
    not also contiguous): the layout a plan keeps a conv's output in where only a conv reads
    it (sched/channels_last.py). The kernels that accept one say so."""
    return t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last)


def channels_last_view(t):
    """The contiguous [N, C, H, W] tensor `t` (a block of memory) read as the channels-last
    tensor it holds: shape [N, C, H, W], torch.channels_last strides."""
    n, c, h, w = t.shape
    return t.view(n, h, w, c).permute(0, 3, 1, 2)


def _nhwc_storage(t):
    """The channels-last tensor `t` [N, C, H, W] as its storage's contiguous [N, H, W, C]."""
    return t.permute(0, 2, 3, 1)


def _launch_bwd_data(dy, w, dx, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s, accumulate, prec,
                     mask=None, kernels=(_conv_bwd_data, _conv_bwd_data_acc)):
    """The data-gradient GEMM over the residue classes (grid axis 1): `kernels` is the
    (plain, accumulating) autotuner pair, implicit by default, "transposed" with wT as w;
    `mask`: dx zeroed where it is <= 0."""
    is_1x1 = r == 1 and s == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0
    m_grid = n * cdiv(h, sh) * cdiv(wd, sw)
    _launch(kernels[1] if accumulate else kernels[0], _tile_grid(m_grid, c, sh * sw),
            (dy, w, dx, dx if mask is None else mask, n, c, k, sh, sw, ph, pw),
            dict(H=h, W=wd, P=p, Q=q, R=r, S=s, IS_1X1=is_1x1, STRIDE1=sh == 1 and sw == 1,
                 ACCUMULATE=accumulate, PRECISION=prec, MASK=mask is not None))


def _launch_bwd_data_t(dy, w, wt, dx, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s, accumulate,
                       prec, mask):
    """"transposed": w -> wT [R, S, C, K] in the workspace `wt`, then the tap-major GEMM."""
    if INTERPRET:   # few programs: the interpreter pays per program, not per element
        bk, bj = min(64, next_power_of_2(k)), min(1024, next_power_of_2(c * r * s))
    else:
        bk, bj = 64, 64
    run(_weight_rsck_kernel, (cdiv(k, bk), cdiv(c * r * s, bj)),
        w, wt, k, c, RS=r * s, BLOCK_K=bk, BLOCK_J=bj, num_warps=4)
    _launch_bwd_data(dy, wt, dx, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s, accumulate, prec,
                     mask, kernels=(_conv_bwd_data_t, _conv_bwd_data_t_acc))


def _run_bwd_data(dy, w, dx, x_shape, geo, algo, ws, accumulate, prec, mask=None,
                  bias_grad=None):
    """dx (+)= the data gradient by `algo`; where `mask` (a ReLU's output, dx's shape), then
    zeroed where mask <= 0, in the store. `bias_grad` (db, room; "flipped_nhwc" only): the
    bias gradient too, summed as dY is copied channels-last."""
    sh, sw, ph, pw, p, q = geo
    n, c, h, wd = x_shape
    k, _, r, s = w.shape
    if algo == "implicit":
        _launch_bwd_data(dy, w, dx, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s, accumulate, prec,
                         mask)
        return
    if algo == "transposed":
        _launch_bwd_data_t(dy, w, ws, dx, n, c, h, wd, k, p, q, sh, sw, ph, pw, r, s,
                           accumulate, prec, mask)
        return
    if algo == "flipped_nhwc":
        _launch_nhwc(dy, w, None, dx, ws, r - 1 - ph, s - 1 - pw, prec, flip=True,
                     accumulate=accumulate, mask=mask, bias_grad=bias_grad)
        return
    if algo in ("flipped", "flipped_splitk"):
        # dx = conv(dY, wF [C, K, R, S], stride 1, padding (R-1-ph, S-1-pw)): the forward
        # kernel with C <-> K and (H, W) <-> (P, Q); split-K: a partial dx per chunk of the
        # K*R*S reduction after the weight copy, then their in-order sum
        total = k * c * r * s
        run(_weight_flip_kernel, (cdiv(total, _ELEM_BLOCK),),
            w, ws, total, k, c, RS=r * s, BLOCK=_ELEM_BLOCK, num_warps=4)
        if algo == "flipped":
            _launch_fwd(dy, ws, None, dx, n, k, p, q, c, h, wd, 1, 1, r - 1 - ph, s - 1 - pw,
                        r, s, prec, accumulate, mask=mask)
            return
        splits = data_splits(x_shape, w.shape, 1, (ph, pw))
        chunks = ws[_flipped_weight_floats(w.shape):]
        _launch_fwd(dy, ws, None, chunks, n, k, p, q, c, h, wd, 1, 1, r - 1 - ph, s - 1 - pw,
                    r, s, prec, splits=splits)
        _launch_splitk_reduce(chunks, dx, dx.numel(), splits, accumulate=accumulate, mask=mask)
        return
    # zero_insert: z [N, K, H+R-1, W+S-1], then a stride-1 conv of z with the flipped weight,
    # which is the implicit stride-1 kernel with padding (R-1, S-1) over z
    hz, wz = h + r - 1, wd + s - 1
    run(_zero_insert_kernel, (n * k, cdiv(hz * wz, _ELEM_BLOCK)),
        dy, ws, p, q, hz, wz, sh, sw, r - 1 - ph, s - 1 - pw, BLOCK=_ELEM_BLOCK, num_warps=4)
    _launch_bwd_data(ws, w, dx, n, c, h, wd, k, hz, wz, 1, 1, r - 1, s - 1, r, s, accumulate,
                     prec, mask)


def _check_dy(dy, x_shape, w_shape, stride, padding):
    geo = _geometry(x_shape, w_shape, stride, padding)
    _check_4d("dy", dy, (x_shape[0], w_shape[0], geo[4], geo[5]))
    return geo


def backward_data(dy, w, dx, *, stride, padding, algo="implicit", workspace=None,
                  accumulate=False, precision=None, relu_output=None):
    """dx (+)= conv2d_input(dx.shape, w, dy). dy [N,K,P,Q], w [K,C,R,S], dx [N,C,H,W].
    algo "implicit" (no workspace), "flipped", "transposed", "zero_insert", "flipped_nhwc"
    or "flipped_splitk" (workspace). relu_output (dx's shape): the conv's input when it is a
    ReLU's output; dx then goes on through that ReLU's backward in the store (0 where
    relu_output <= 0, after any accumulation), the same bits as the ReLU's own backward pass
    would give."""
    prec = dot_precision(precision)
    _algo("backward_data", algo)
    if not isinstance(accumulate, bool):
        raise ValueError(f"conv: accumulate must be a bool, got {accumulate!r}")
    _check_4d("w", w)
    _check_4d("dx", dx)
    if relu_output is not None:
        _check_4d("relu_output", relu_output, tuple(dx.shape), channels_last=True)
        _check_reads("backward_data", algo, relu_output, w.shape, "relu_output")
    geo = _check_dy(dy, dx.shape, w.shape, stride, padding)
    _check_applies("backward_data", algo, dx.shape, w.shape, geo)
    check_device("conv", dx, dy=dy, w=w, workspace=workspace, relu_output=relu_output)
    ws = _workspace(workspace, workspace_bytes(dx.shape, w.shape, geo[:2], geo[2:4],
                                               "backward_data", algo), dx.device)
    check_no_overlap("conv", [("dx", dx), ("workspace", ws)],
                     [("dy", dy), ("w", w), ("relu_output", relu_output)])
    _run_bwd_data(dy, w, dx, dx.shape, geo, algo, ws, accumulate, prec, relu_output)


def _bias_blocks(n, k, pq, tile):
    """(BLOCK_C, BLOCK_I, BLOCK) of the bias gradient's [channels, images, pixels] tile step.
    tile 0: the GPU's one channel and one image per program step, up to 1024 pixels; else
    blocks of pixels, channels and images up to `tile` elements (the interpreter pays per
    operation and per program, not per element)."""
    if not tile:
        return 1, 1, min(1024, next_power_of_2(pq))
    blk = min(tile, next_power_of_2(pq))
    bc = min(next_power_of_2(k), max(1, tile // blk))
    return bc, min(next_power_of_2(n), max(1, tile // (blk * bc))), blk


def bias_groups(n, k, pq, room) -> int:
    """Image groups the bias gradient of dY [n, k, pq] is cut into, given room for `room`
    float32 partial sums (0: none). One program per channel leaves most of the GPU idle
    (64 programs over VGG16's largest activations), so, where there is room,
    each (channel, group) program sums its images into a partial and a second kernel adds
    the groups in order; enough groups for about _BIAS_PROGRAMS programs. The interpreter
    (1 program target) takes one group: one kernel, as few programs as its tiles allow."""
    bc = _bias_blocks(n, k, pq, _BIAS_TILE)[0]
    return max(1, min(n, room // k, cdiv(_BIAS_PROGRAMS, cdiv(k, bc))))


def bias_grad_launches(n, k, pq, room) -> int:
    """Triton kernels one bias gradient launches (see bias_groups)."""
    return 1 if bias_groups(n, k, pq, room) == 1 else 2


def _launch_bias_grad(dy, db, n, k, pq, scratch=None):
    """db = dY summed over images and pixels, BLOCK_C channels per program; with `scratch`
    (float32 room for partial sums) in image groups, then the groups summed in order."""
    groups = bias_groups(n, k, pq, 0 if scratch is None else scratch.numel())
    bc, bi, blk = _bias_blocks(n, k, pq, _BIAS_TILE)
    out = db if groups == 1 else scratch
    run(_bias_grad_kernel, (cdiv(k, bc), groups), dy, out, n, k, pq,
        cdiv(n, groups), BLOCK_C=bc, BLOCK_I=bi, BLOCK=blk, num_warps=4)
    if groups > 1:
        _launch_splitk_reduce(scratch, db, k, groups)


def gemm_sums_bias(algo_weight) -> bool:
    """True where the weight gradient's GEMM also sums the bias gradient from the dY tiles
    it loads ("onepass", "splitk": `_conv_bwd_weight_kernel`'s HAS_DB), so that no kernel
    reads dY for it alone (VGG16's largest bias gradients took 0.15 ms each that way on
    the H100, at copy bandwidth)."""
    return algo_weight in ("onepass", "splitk")


def bias_launches(algo_data, algo_weight, x_shape, w_shape, stride, padding,
                  has_dx=True, has_dw=True) -> int:
    """Triton kernels a conv backward's bias gradient launches beside its passes' own: none
    or the partial sums' fixed-order sum where a pass sums it on the way (the dY copy of a
    "flipped_nhwc" data gradient, the GEMM of a "onepass" or "splitk" weight gradient), else
    `bias_grad_launches` (its partial sums in dW's room where there is a dW)."""
    n, k, p, q = out_shape(x_shape, w_shape, stride, padding)
    room = k * w_shape[1] * w_shape[2] * w_shape[3] if has_dw else 0
    if has_dx and has_dw and fuses_bias_grad(algo_data):
        return nhwc_bias_launches((n, k, p, q), room)
    if has_dw and gemm_sums_bias(algo_weight):
        return int(algo_weight == "splitk")
    return bias_grad_launches(n, k, p * q, room)


def _run_bwd_weight(x, dy, dw, db, geo, algo, ws, prec):
    sh, sw, ph, pw, p, q = geo
    n, c, h, wd = x.shape
    k = dy.shape[1]
    if db is not None and (dw is None or not gemm_sums_bias(algo)):
        # first: dW is not written yet, so it holds the partial sums
        _launch_bias_grad(dy, db, n, k, p * q, None if dw is None else dw.view(-1))
        db = None
    if dw is None:
        return
    if algo == "nhwc":
        _launch_weight_nhwc(x, dy, dw, ws, ph, pw, prec)
        return
    if algo == "tma":
        _launch_weight_tma(x, dy, dw, ws, ph, pw, prec)
        return
    _, _, r, s = dw.shape
    is_1x1 = r == 1 and s == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0
    npq = n * p * q
    crs = c * r * s
    if algo == "onepass":
        splits, out, db_out = 1, dw, db
    else:           # the chunks, then the bias gradient's partial per chunk
        splits, out = splitk_splits(x.shape, dw.shape, (sh, sw), (ph, pw)), ws
        db_out = None if db is None else ws[splits * k * crs:splits * k * (crs + 1)]
    split_len = _split_len(npq, splits)
    _launch(_conv_bwd_weight, _weight_grid(k, c, r * s, splits),
            (x, dy, out, out if db_out is None else db_out, n, c, k, sh, sw, ph, pw,
             split_len),
            dict(H=h, W=wd, P=p, Q=q, R=r, S=s, IS_1X1=is_1x1, PRECISION=prec,
                 HAS_DB=db_out is not None))
    if algo == "splitk":
        if db is not None:
            _launch_splitk_reduce(db_out, db, k, splits)
        _launch_splitk_reduce(ws, dw, k * crs, splits)


def _launch_weight_nhwc(x, dy, dw, ws, ph, pw, prec):
    """"nhwc": X [N, C, H, W] -> Xt [N, H, W, C] in the workspace `ws`, then the TMA kernel
    into the split-K chunks after Xt, then their fixed-order sum into dw (stride 1)."""
    n, c, h, wd = x.shape
    _, k, p, q = dy.shape
    _, _, r, s = dw.shape
    splits = splitk_splits(x.shape, dw.shape, 1, (ph, pw))
    chunks = ws[n * h * wd * c:n * h * wd * c + splits * k * c * r * s]
    if is_channels_last(x):     # read in place
        xt = _nhwc_storage(x)
    else:
        xt = ws[:n * h * wd * c]
        _launch_to_nhwc(x, xt)
    tw = _tile_w(q)
    # boxes: placeholders, set per config by _weight_nhwc_boxes
    x_desc = TensorDescriptor(xt, [n, h, wd, c], [h * wd * c, wd * c, c, 1], [1, 1, 1, 4])
    dy_desc = _nchw_desc(dy)

    def grid(meta):
        return (cdiv(c, meta["BLOCK_M"]) * cdiv(k, meta["BLOCK_N"]) * r * s,
                splits)
    _launch(_conv_bwd_weight_nhwc, grid, (x_desc, dy_desc, chunks, n, c, k, ph, pw),
            dict(P=p, Q=q, R=r, S=s, TW=tw, PRECISION=prec))
    total = k * c * r * s
    _launch_splitk_reduce(chunks, dw, total, splits)


def _tma_layout(x_shape, w_shape):
    """(WP, copy x, copy dY) of the "tma" weight gradient: rows widened to WP, a multiple of
    4 pixels; x copied once per kernel column unless it is 1x1 and needs no widening; dY
    copied where it needs widening."""
    _, _, _, w = x_shape
    wp = cdiv(w, 4) * 4
    return wp, w_shape[3] > 1 or wp != w, wp != w


def _launch_weight_tma(x, dy, dw, ws, ph, pw, prec):
    """"tma": x's shifted copies (and dY widened, where its rows are not a multiple of 4
    pixels) in the workspace, then the TMA kernel into the split-K chunks after them, then
    their fixed-order sum into dw (a "same" stride-1 conv)."""
    n, c, h, wd = x.shape
    k, _, r, s = dw.shape
    wp, copy_x, copy_dy = _tma_layout(x.shape, dw.shape)
    used = 0
    if copy_x:
        xs, used = ws[:s * n * c * h * wp], s * n * c * h * wp
        if is_channels_last(x):
            _launch_shifted_from_nhwc(x, xs, pw, wp, s)
        else:
            _launch_shifted_rows(x, xs, n * c * h, pw, wd, wp, s)
    else:
        xs = x
    if copy_dy:
        dyw, used = ws[used:used + n * k * h * wp], used + n * k * h * wp
        _launch_shifted_rows(dy, dyw, n * k * h, 0, wd, wp, 1)
    else:
        dyw = dy
    splits = tma_splits(x.shape, dw.shape)
    total = k * c * r * s
    chunks = ws[used:used + splits * total]
    hwp = h * wp
    cols = s if copy_x else 1
    # boxes: placeholders, set per config by _weight_tma_boxes
    xs_desc = TensorDescriptor(xs, [cols, n, c, hwp], [n * c * hwp, c * hwp, hwp, 1],
                               [1, 1, 1, 4])
    dy_desc = TensorDescriptor(dyw, [n, k, hwp], [k * hwp, hwp, 1], [1, 1, 4])

    def grid(meta):
        return (cdiv(c, meta["BLOCK_M"]) * cdiv(k, meta["BLOCK_N"]) * r * s,
                splits)
    _launch(_conv_bwd_weight_tma, grid, (xs_desc, dy_desc, chunks, n, c, k, ph),
            dict(HWP=hwp, WP=wp, R=r, S=s, PRECISION=prec))
    _launch_splitk_reduce(chunks, dw, total, splits)


def _launch_shifted_rows(src, dst, rows, pw, w, wp, copies):
    """dst = `copies` copies of src's rows of w pixels, widened to wp and shifted by
    i - pw pixels in copy i (_shifted_rows_kernel)."""
    run(_shifted_rows_kernel, (cdiv(rows * wp, _ELEM_BLOCK), copies),
        src, dst, rows, pw, W=w, WP=wp, BLOCK=_ELEM_BLOCK, num_warps=4)


def _launch_shifted_from_nhwc(x, dst, pw, wp, copies):
    """dst = `copies` copies of the channels-last x's rows, as _launch_shifted_rows makes
    them from an NCHW x (_shifted_from_nhwc_kernel)."""
    n, c, h, wd = x.shape
    bw = next_power_of_2(wp)
    bc = min(next_power_of_2(c), max(1, (1 << 15 if INTERPRET else 1 << 13) // bw))
    run(_shifted_from_nhwc_kernel, (n * h, cdiv(c, bc)),
        _nhwc_storage(x), dst, n, c, pw, H=h, W=wd, WP=wp, S=copies, BLOCK_C=bc, BLOCK_W=bw,
        num_warps=4)


def _check_weight_algo(algo, x, dy, w_shape, geo):
    """One line naming what the weight-gradient `algo` needs, where it cannot run."""
    _check_applies("backward_weight", algo, x.shape, w_shape, geo)
    if algo == "nhwc" and dy.data_ptr() % 16:
        raise ValueError("conv: backward_weight algo 'nhwc' needs dy 16-byte aligned "
                         f"(a TMA descriptor's base); its address is {dy.data_ptr()}")
    if algo == "tma":       # a tensor the kernel reads in place, not through a copy
        _, copy_x, copy_dy = _tma_layout(x.shape, w_shape)
        for name, t, copied in (("x", x, copy_x), ("dy", dy, copy_dy)):
            if not copied and t.data_ptr() % 16:
                raise ValueError(f"conv: backward_weight algo 'tma' needs {name} 16-byte "
                                 f"aligned here (a TMA descriptor's base); its address is "
                                 f"{t.data_ptr()}")


def backward_weight(x, dy, dw, db, *, stride, padding, algo="onepass", workspace=None,
                    precision=None):
    """dw = conv2d_weight(x, dw.shape, dy), db = dy.sum((0, 2, 3)) (db may be None; dw may be
    None too, then only db is computed). algo "onepass" (no workspace), "splitk", "nhwc" or
    "tma" (workspace)."""
    prec = dot_precision(precision)
    _algo("backward_weight", algo)
    _check_4d("x", x, channels_last=True)
    if dw is None and db is None:
        return
    if dw is not None:
        _check_4d("dw", dw)
        w_shape = tuple(dw.shape)
    else:
        _check_4d("dy", dy)
        w_shape = (dy.shape[1], x.shape[1], 1, 1)   # only the bias gradient: any valid kernel
        stride, padding = 1, 0
    geo = _check_dy(dy, x.shape, w_shape, stride, padding)
    if dw is not None:
        _check_weight_algo(algo, x, dy, w_shape, geo)
        _check_reads("backward_weight", algo, x, w_shape)
    if db is not None:
        check_tensor("db", db, (w_shape[0],))
    check_device("conv", x, dy=dy, dw=dw, db=db, workspace=workspace)
    need = workspace_bytes(x.shape, w_shape, geo[:2], geo[2:4], "backward_weight", algo) \
        if dw is not None else 0
    ws = _workspace(workspace, need, x.device)
    check_no_overlap("conv", [("dw", dw), ("db", db), ("workspace", ws)], [("x", x), ("dy", dy)])
    _run_bwd_weight(x, dy, dw, db, geo, algo, ws, prec)


def backward(x, w, dy, dx, dw, db, *, stride, padding, algo_data="implicit",
             algo_weight="onepass", workspace=None, accumulate=False, precision=None,
             x_is_relu_output=False):
    """All gradients of y = conv2d(x, w, b): dx (+)= ..., dw = ..., db = ... . Any of dx, dw,
    db may be None (that gradient is skipped). accumulate applies to dx only. The workspace
    serves both phases in turn: backward_workspace_bytes(...) bytes. x_is_relu_output: dx
    goes on through the backward of the ReLU whose output x is (backward_data's
    relu_output)."""
    prec = dot_precision(precision)
    _algo("backward_data", algo_data)
    _algo("backward_weight", algo_weight)
    if not isinstance(accumulate, bool):
        raise ValueError(f"conv: accumulate must be a bool, got {accumulate!r}")
    if not isinstance(x_is_relu_output, bool):
        raise ValueError(f"conv: x_is_relu_output must be a bool, got {x_is_relu_output!r}")
    _check_4d("x", x, channels_last=True)
    _check_4d("w", w)
    geo = _check_dy(dy, x.shape, w.shape, stride, padding)
    if dx is not None:
        _check_4d("dx", dx, tuple(x.shape))
        _check_applies("backward_data", algo_data, x.shape, w.shape, geo)
        if x_is_relu_output:
            _check_reads("backward_data", algo_data, x, w.shape)
    if dw is not None:
        _check_4d("dw", dw, tuple(w.shape))
        _check_weight_algo(algo_weight, x, dy, w.shape, geo)
        _check_reads("backward_weight", algo_weight, x, w.shape)
    if db is not None:
        check_tensor("db", db, (w.shape[0],))
    check_device("conv", x, w=w, dy=dy, dx=dx, dw=dw, db=db, workspace=workspace)
    need = backward_workspace_bytes(x.shape, w.shape, geo[:2], geo[2:4], algo_data,
                                    algo_weight, dx is not None, dw is not None)
    ws = _workspace(workspace, need, x.device)
    check_no_overlap("conv", [("dx", dx), ("dw", dw), ("db", db), ("workspace", ws)],
                      [("x", x), ("w", w), ("dy", dy)])
    # "flipped_nhwc" copies all of dY: the bias gradient is summed on the way, its partial
    # sums in dW's room (dW is written after)
    fuse_bias = fuses_bias_grad(algo_data) and all(t is not None for t in (dx, dw, db))
    if dx is not None:
        _run_bwd_data(dy, w, dx, x.shape, geo, algo_data, ws, accumulate, prec,
                      x if x_is_relu_output else None,
                      (db, dw.view(-1)) if fuse_bias else None)
    if dw is not None or (db is not None and not fuse_bias):
        _run_bwd_weight(x, dy, dw, None if fuse_bias else db, geo, algo_weight, ws, prec)
