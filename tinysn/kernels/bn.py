"""BatchNorm2d in training mode (nn.BatchNorm2d: affine, biased batch variance for the
normalisation, unbiased for the running variance), NCHW float32, forward and backward.

API
    forward(x, gamma, beta, y, running_mean, running_var, saved, workspace, *,
            eps=1e-5, momentum=0.1, update_running=True, relu=False, residual=None)
        y = (x - mean) * inv_std * gamma + beta, per channel over (N, H, W);
        saved[0] = mean, saved[1] = inv_std = 1 / sqrt(var + eps)   (saved is [2, C]);
        running_mean = (1 - m) running_mean + m mean,
        running_var  = (1 - m) running_var  + m var * n / (n - 1)   when update_running.
        update_running=False (a recomputed bn) gives the same y and saved, stats untouched.
        relu=True stores max(y, 0) instead (a ReLU after the batch norm fused into it,
        sched/fuse.py: kernels/act.py's bits, NaN kept); the statistics are y's before it.
        residual (x's shape): y + residual is stored instead (before any ReLU), the
        residual add that alone reads the batch norm's output fused into it
        (sched/fuse.py; kernels/join.py's bits: one float add).
    backward(x, gamma, dy, saved, dx, dgamma, dbeta, workspace, *, accumulate=False,
             relu_output=None, dy_out=None)
        dbeta = sum dy, dgamma = sum dy * xhat,
        dx (+)= gamma * inv_std / n * (n dy - dbeta - xhat dgamma).
        dx, dgamma, dbeta may each be None; dgamma / dbeta always overwrite.
        dx may be dy (in place: the sums are taken before dx is written), unless it
        accumulates; it must not otherwise overlap x, dy, saved or the workspace.
        dy_out (x's shape): the dy used is also stored there by the first pass, which the
        last then reads instead; with relu_output, that dy is first masked by the ReLU
        whose output relu_output is (0 where relu_output <= 0): a residual add fused into
        the batch norm gives its residual the add's gradient so (sched/fuse.py). dy_out
        may be dy; it must not overlap x, dx, saved, relu_output or the workspace.
    rebuild(x, gamma, beta, y, saved, *, relu=False, residual=None)
        the forward's y again from the statistics it saved (the recompute policy rebuilding
        a dropped output): the normalisation pass alone, no workspace, the same bits as
        the forward's y for the same x; saved and the running statistics are not written.
    workspace_bytes(shape, phase) -> bytes of scratch, phase "forward" | "backward"
        (a rebuild needs none).
    forward_eval(x, gamma, beta, y, running_mean, running_var, *, eps=1e-5, relu=False,
                 residual=None)
        eval mode (nn.BatchNorm2d after .eval()): one elementwise pass,
        y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta; no workspace,
        no statistics written, any batch (even one value per channel); relu and residual
        as in forward.

Reductions (three launches per phase, no atomics, bitwise deterministic):
  1. partials: channel c's N x HW values are cut into chunks (row ranges x column ranges of
     the [N, HW] view, picked from the shape alone, about 2048 programs over all channels);
     one program per (channel, chunk) reads its chunk as [ROWS, COLS] tiles of contiguous HW
     rows. Forward: shifted sums, the shift being the mean of the chunk's first tile, give
     the chunk's (count, mean, M2) without the cancellation of E[x^2] - E[x]^2. Backward:
     sum dy and sum dy * (x - mean).
  2. finalize: one lane row per channel merges its chunks in a fixed order (Chan et al.:
     mean = sum n_i mean_i / n, M2 = sum M2_i + sum n_i (mean_i - mean)^2) and writes saved,
     the running statistics (forward) or dgamma, dbeta (backward).
  3. an elementwise pass over tiles of R channels of one image by COLS of HW:
     y = (x - mean) * (inv_std gamma) + beta (+ residual, then the ReLU, where asked), or
     dx = gamma inv_std (dy - dbeta / n - (x - mean) inv_std dgamma / n). Its programs go
     channel block by channel block, the last first: step 1 read the channels in order, so
     the pass starts on what the L2 cache still holds of x (and dy).
The merge is a pass of its own: merged inside step 3's programs instead (two launches each
way) it ran about 30x slower on the H200 (bench/README.md, the eager step's host time).
Small channels, many of them (`_one_program`: at most _CHANNEL_MAX values, at least
_CHANNEL_PROGRAMS channels), can instead take one launch each way, a program per channel:
its shifted sums (or backward sums), its statistics, then its elementwise pass over the
same tiles, read again from the cache. On the H100 that took ResNet-50's batch norms from
4.65 to 4.37 ms a step (bench/bn_configs.py --channel-max: its 14x14 and 7x7 stages); the
tests run every case both ways.
Block shapes come from the tensor shape (no autotuning), so the summation order, and hence
every bit of the result, does not depend on timing. x is read twice in the forward (stats,
normalise) and x, dy twice in the backward.

The workspace (uint8 or float32, 1-D, at least workspace_bytes) holds per-(channel, chunk)
partials ([C, chunks, 3] floats forward, [C, chunks, 2] + [2, C] backward); its contents on
entry do not matter.
"""
import functools
import triton
import triton.language as tl

from ._common import _CHECKED_BEFORE, check_no_overlap, check_tensor, float_workspace
from ._common import cdiv, gate, next_power_of_2, run

# The fastest of 16 combinations on ResNet-50's batch norms at batch 32 (bench/bn_configs.py
# on the H100, three processes: 4.80-4.84 ms a step of batch norm; 2048-element tiles of 8
# warps, the shapes before, 5.01; of 4 warps 5.05-5.09)
_TILE = 1024                                 # elements per tile of the streaming passes
_WARPS = 4
_TARGET_PROGRAMS = 2048                      # partial-sum programs over all channels
_MIN_CHUNK = 4096                            # elements per chunk, at least (when possible)
# The elementwise pass after a channel-ordered one visits the channels last first
# (_elementwise_tile): it starts on what the L2 cache kept
_LAST_FIRST = True
# One launch each way, a program per channel (_one_program), where a channel holds at most
# _CHANNEL_MAX values and there are at least _CHANNEL_PROGRAMS channels (0: never). 8192
# and 256 won the H100's sweep on ResNet-50 (results/bn-configs-channel-NVIDIA-H100-80GB-
# HBM3.json): 4.37 ms of batch norm a step, 4.65 without; 32768, which also takes the
# 28x28 stage, 4.61
_CHANNEL_MAX = 8192
_CHANNEL_PROGRAMS = 256


# ----------------------------------------------------------------------------- geometry
@functools.lru_cache(maxsize=4096)
def _chunks(n, c, hw):
    """(rows per chunk, row groups, cols per chunk, col groups) of a channel's [n, hw] view.

    From the shape alone (the workspace size must not depend on the machine); memoized, as
    the planner asks for every batch-norm step of every plan it tries.
    """
    want = max(1, min(cdiv(_TARGET_PROGRAMS, c), cdiv(n * hw, _MIN_CHUNK)))
    nr = min(n, want)
    rpc = cdiv(n, nr)
    nr = cdiv(n, rpc)
    nh = max(1, min(cdiv(want, nr), cdiv(hw, 1024)))
    cpc = cdiv(cdiv(hw, nh), 128) * 128
    nh = cdiv(hw, cpc)
    return rpc, nr, cpc, nh


def _tile_shape(rows_max, cols_max):
    """[ROWS, COLS] tile of about _TILE elements for a rows_max x cols_max region."""
    cols = min(next_power_of_2(cols_max), _TILE)
    rows = max(1, min(_TILE // cols, next_power_of_2(rows_max)))
    return rows, cols


def _shape4(shape):
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4:
        raise ValueError(f"batch norm input must be 4-D NCHW, got shape {shape}")
    return shape


def _one_program(n, c, hw) -> bool:
    """Whether a batch norm of this shape runs as one launch each way, a program per channel
    (_bn_channel_fwd_kernel, _bn_channel_bwd_kernel), instead of three: small channels, many
    of them (ResNet-50's 14x14 and 7x7 stages), where three launches cost more than the
    bytes. From the shape alone, as the chunks are: every run of a shape sums in one order."""
    return n * hw <= _CHANNEL_MAX and c >= _CHANNEL_PROGRAMS


def workspace_bytes(shape, phase) -> int:
    """Scratch bytes for a bn of an NCHW `shape`; phase "forward" or "backward"."""
    n, c, h, w = _shape4(shape)
    rpc, nr, cpc, nh = _chunks(n, c, h * w)
    if phase == "forward":
        return 4 * c * nr * nh * 3
    if phase == "backward":
        return 4 * (c * nr * nh * 2 + 2 * c)
    raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _chunk_bounds(pid, N, HW, RPC, CPC, NCH, NHC):
    c = pid // NCH
    ch = pid % NCH
    r0 = (ch // NHC) * RPC
    h0 = (ch % NHC) * CPC
    r1 = tl.minimum(r0 + RPC, N)
    h1 = tl.minimum(h0 + CPC, HW)
    return c, r0, r1, h0, h1


@triton.jit
def _shifted_sums(x, c, C, HW, r0, r1, h0, h1, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(shift, sum d, sum d^2), d = x - shift, over rows [r0, r1) of N and columns [h0, h1)
    of HW of channel c, in [ROWS, COLS] tiles; shift = the mean of the first tile, so the
    sums keep the variance's digits where the mean is large."""
    ri = tl.arange(0, ROWS)
    ci = tl.arange(0, COLS)
    rows = r0 + ri
    cols = h0 + ci
    m = (rows < r1)[:, None] & (cols < h1)[None, :]
    ptr = x + ((rows.to(tl.int64) * C + c) * HW)[:, None] + cols[None, :]
    v = tl.load(ptr, mask=m, other=0.0)
    n0 = (tl.minimum(r1 - r0, ROWS) * tl.minimum(h1 - h0, COLS)).to(tl.float32)
    shift = tl.sum(tl.sum(v, axis=1), axis=0) / n0
    s1 = tl.zeros([ROWS, COLS], tl.float32)
    s2 = tl.zeros([ROWS, COLS], tl.float32)
    for r in range(r0, r1, ROWS):
        rows = r + ri
        rbase = ((rows.to(tl.int64) * C + c) * HW)[:, None]
        rm = (rows < r1)[:, None]
        for h in range(h0, h1, COLS):
            cols = h + ci
            m = rm & (cols < h1)[None, :]
            v = tl.load(x + rbase + cols[None, :], mask=m, other=0.0)
            d = tl.where(m, v - shift, 0.0)
            s1 += d
            s2 += d * d
    return shift, tl.sum(tl.sum(s1, axis=1), axis=0), tl.sum(tl.sum(s2, axis=1), axis=0)


@triton.jit
def _bn_stats_kernel(x, ws, N, C, HW, RPC, CPC, NCH, NHC,
                     ROWS: tl.constexpr, COLS: tl.constexpr):
    """ws[c, chunk] = (count, mean, M2) of one chunk of channel c (_shifted_sums)."""
    pid = tl.program_id(0)
    c, r0, r1, h0, h1 = _chunk_bounds(pid, N, HW, RPC, CPC, NCH, NHC)
    shift, t1, t2 = _shifted_sums(x, c, C, HW, r0, r1, h0, h1, ROWS, COLS)
    cnt = ((r1 - r0) * (h1 - h0)).to(tl.float32)
    dm = t1 / cnt
    m2 = tl.maximum(t2 - t1 * dm, 0.0)
    out = ws + pid * 3
    tl.store(out, cnt)
    tl.store(out + 1, shift + dm)
    tl.store(out + 2, m2)


@triton.jit
def _bn_finalize_kernel(ws, saved, rmean, rvar, C, NCH, total, unbias, eps, momentum,
                        skip_ptr, UPDATE: tl.constexpr, GATED: tl.constexpr,
                        CB: tl.constexpr, NCHP: tl.constexpr):
    """Merge each channel's chunk partials; write saved (mean, inv_std) and running stats
    (GATED: not where skip_ptr's float is non-zero, a bad batch's count)."""
    c = tl.program_id(0) * CB + tl.arange(0, CB)
    cm = c < C
    k = tl.arange(0, NCHP)
    m = cm[:, None] & (k < NCH)[None, :]
    p = ws + (c[:, None] * NCH + k[None, :]) * 3
    cnt = tl.load(p, mask=m, other=0.0)
    mu = tl.load(p + 1, mask=m, other=0.0)
    m2 = tl.load(p + 2, mask=m, other=0.0)
    mean = tl.sum(cnt * mu, axis=1) / total
    d = tl.where(m, mu - mean[:, None], 0.0)
    var = (tl.sum(m2, axis=1) + tl.sum(cnt * d * d, axis=1)) / total
    inv_std = 1.0 / tl.sqrt(var + eps)
    tl.store(saved + c, mean, mask=cm)
    tl.store(saved + C + c, inv_std, mask=cm)
    if UPDATE:
        if GATED:
            cm = cm & (tl.load(skip_ptr + c * 0) == 0.0)      # the flag, per channel
        rm = tl.load(rmean + c, mask=cm, other=0.0)
        rv = tl.load(rvar + c, mask=cm, other=0.0)
        tl.store(rmean + c, (1.0 - momentum) * rm + momentum * mean, mask=cm)
        tl.store(rvar + c, (1.0 - momentum) * rv + momentum * (var * unbias), mask=cm)


@triton.jit
def _elementwise_tile(N, C, HW, R: tl.constexpr, COLS: tl.constexpr,
                      LAST_FIRST: tl.constexpr):
    """(rows of the [N*C, HW] view, their mask, their channels, columns) of this program's
    tile: R channels of one image, COLS of its HW. Programs go channel block by channel
    block, each over every image; LAST_FIRST: the last block first, so a pass after a
    channel-ordered one (stats, partial sums) starts on what that pass read last, which
    the L2 cache still holds. The order changes which program computes what, never a bit."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(HW, COLS)
    t = pid // col_blocks
    block = t // N
    if LAST_FIRST:
        block = tl.cdiv(C, R) - 1 - block
    c = block * R + tl.arange(0, R)
    rows = (t % N).to(tl.int64) * C + c
    cols = (pid % col_blocks) * COLS + tl.arange(0, COLS)
    return rows, c < C, c, cols


@triton.jit
def _bn_norm_kernel(x, y, saved, gamma, beta, res, N, C, HW,
                    R: tl.constexpr, COLS: tl.constexpr, LAST_FIRST: tl.constexpr,
                    RELU: tl.constexpr = False, RESIDUAL: tl.constexpr = False):
    """y = (x - mean) * (inv_std * gamma) + beta over [R channels of an image, COLS of HW]
    tiles (_elementwise_tile); RESIDUAL: + res (a residual add fused into the batch norm),
    RELU: then max(y, 0) stored instead (a ReLU fused into it, sched/fuse.py)."""
    rows, rm, c, cols = _elementwise_tile(N, C, HW, R, COLS, LAST_FIRST)
    mean = tl.load(saved + c, mask=rm, other=0.0)
    inv = tl.load(saved + C + c, mask=rm, other=0.0)
    scale = inv * tl.load(gamma + c, mask=rm, other=0.0)
    b = tl.load(beta + c, mask=rm, other=0.0)
    m = rm[:, None] & (cols < HW)[None, :]
    offs = (rows * HW)[:, None] + cols[None, :]
    _normalise(x, y, res, offs, m, mean[:, None], scale[:, None], b[:, None], RELU, RESIDUAL)


@triton.jit
def _normalise(x, y, res, offs, m, mean, scale, b, RELU: tl.constexpr,
               RESIDUAL: tl.constexpr):
    """y[offs] = (x - mean) * scale + b (+ res[offs] where RESIDUAL, then the ReLU where
    RELU: kernels/act.py's, NaN propagates) over one tile, where m: the normalisation of
    the three-launch and the one-program forms alike, so rebuild's bits are both's."""
    out = (tl.load(x + offs, mask=m, other=0.0) - mean) * scale + b
    if RESIDUAL:
        out = out + tl.load(res + offs, mask=m, other=0.0)
    if RELU:
        out = tl.where(out < 0.0, 0.0, out)
    tl.store(y + offs, out, mask=m)


@triton.jit
def _bn_eval_kernel(x, y, rmean, rvar, gamma, beta, res, N, C, HW, eps,
                    R: tl.constexpr, COLS: tl.constexpr, RELU: tl.constexpr = False,
                    RESIDUAL: tl.constexpr = False):
    """y = (x - rmean) * (gamma / sqrt(rvar + eps)) + beta over _elementwise_tile's tiles
    (channels in order: no pass before it); RESIDUAL and RELU as _bn_norm_kernel."""
    rows, rm, c, cols = _elementwise_tile(N, C, HW, R, COLS, False)
    mean = tl.load(rmean + c, mask=rm, other=0.0)
    var = tl.load(rvar + c, mask=rm, other=1.0)
    scale = tl.load(gamma + c, mask=rm, other=0.0) / tl.sqrt_rn(var + eps)
    b = tl.load(beta + c, mask=rm, other=0.0)
    m = rm[:, None] & (cols < HW)[None, :]
    offs = (rows * HW)[:, None] + cols[None, :]
    v = tl.load(x + offs, mask=m, other=0.0)
    out = (v - mean[:, None]) * scale[:, None] + b[:, None]
    if RESIDUAL:
        out = out + tl.load(res + offs, mask=m, other=0.0)
    if RELU:
        out = tl.where(out < 0.0, 0.0, out)
    tl.store(y + offs, out, mask=m)


@triton.jit
def _dy_sums(x, dy, y, dyo, mean, c, C, HW, r0, r1, h0, h1, ROWS: tl.constexpr,
             COLS: tl.constexpr, MASK: tl.constexpr, WRITE: tl.constexpr):
    """(sum dy, sum dy * (x - mean)) over rows [r0, r1) of N and columns [h0, h1) of HW of
    channel c, in [ROWS, COLS] tiles; MASK: dy first put through the backward of the ReLU
    whose output y is (kernels/act.py's rule), WRITE: the dy so used stored in dyo."""
    ri = tl.arange(0, ROWS)
    ci = tl.arange(0, COLS)
    s1 = tl.zeros([ROWS, COLS], tl.float32)
    s2 = tl.zeros([ROWS, COLS], tl.float32)
    for r in range(r0, r1, ROWS):
        rows = r + ri
        rbase = ((rows.to(tl.int64) * C + c) * HW)[:, None]
        rm = (rows < r1)[:, None]
        for h in range(h0, h1, COLS):
            cols = h + ci
            m = rm & (cols < h1)[None, :]
            offs = rbase + cols[None, :]
            g = tl.load(dy + offs, mask=m, other=0.0)
            if MASK:
                g = tl.where(tl.load(y + offs, mask=m, other=0.0) <= 0.0, 0.0, g)
            if WRITE:
                tl.store(dyo + offs, g, mask=m)
            v = tl.load(x + offs, mask=m, other=0.0)
            s1 += g
            s2 += g * tl.where(m, v - mean, 0.0)
    return tl.sum(tl.sum(s1, axis=1), axis=0), tl.sum(tl.sum(s2, axis=1), axis=0)


@triton.jit
def _bn_bwd_partial_kernel(x, dy, saved, ws, y, dyo, N, C, HW, RPC, CPC, NCH, NHC,
                           ROWS: tl.constexpr, COLS: tl.constexpr, MASK: tl.constexpr = False,
                           WRITE: tl.constexpr = False):
    """ws[c, chunk] = (sum dy, sum dy * (x - mean)) over one chunk of channel c (_dy_sums;
    the chunks cover each element once)."""
    pid = tl.program_id(0)
    c, r0, r1, h0, h1 = _chunk_bounds(pid, N, HW, RPC, CPC, NCH, NHC)
    t1, t2 = _dy_sums(x, dy, y, dyo, tl.load(saved + c), c, C, HW, r0, r1, h0, h1, ROWS, COLS,
                      MASK, WRITE)
    out = ws + pid * 2
    tl.store(out, t1)
    tl.store(out + 1, t2)


@triton.jit
def _bn_bwd_finalize_kernel(ws, sums, saved, dgamma, dbeta, C, NCH,
                            HAS_DG: tl.constexpr, HAS_DB: tl.constexpr,
                            CB: tl.constexpr, NCHP: tl.constexpr):
    """sums[0, c] = dbeta = sum dy, sums[1, c] = dgamma = inv_std * sum dy (x - mean)."""
    c = tl.program_id(0) * CB + tl.arange(0, CB)
    cm = c < C
    k = tl.arange(0, NCHP)
    m = cm[:, None] & (k < NCH)[None, :]
    p = ws + (c[:, None] * NCH + k[None, :]) * 2
    db = tl.sum(tl.load(p, mask=m, other=0.0), axis=1)
    dg = tl.sum(tl.load(p + 1, mask=m, other=0.0), axis=1) * tl.load(saved + C + c, mask=cm)
    tl.store(sums + c, db, mask=cm)
    tl.store(sums + C + c, dg, mask=cm)
    if HAS_DB:
        tl.store(dbeta + c, db, mask=cm)
    if HAS_DG:
        tl.store(dgamma + c, dg, mask=cm)


@triton.jit
def _bn_dx_kernel(x, dy, dx, saved, gamma, sums, N, C, HW, inv_n,
                  ACC: tl.constexpr, R: tl.constexpr, COLS: tl.constexpr,
                  LAST_FIRST: tl.constexpr):
    """dx (+)= gamma inv_std (dy - dbeta/n - (x - mean) inv_std dgamma/n) over
    _elementwise_tile's tiles."""
    rows, rm, c, cols = _elementwise_tile(N, C, HW, R, COLS, LAST_FIRST)
    mean = tl.load(saved + c, mask=rm, other=0.0)
    inv = tl.load(saved + C + c, mask=rm, other=0.0)
    a = inv * tl.load(gamma + c, mask=rm, other=0.0)
    mb = tl.load(sums + c, mask=rm, other=0.0) * inv_n
    kg = tl.load(sums + C + c, mask=rm, other=0.0) * inv * inv_n
    m = rm[:, None] & (cols < HW)[None, :]
    offs = (rows * HW)[:, None] + cols[None, :]
    _dx_tile(x, dy, dx, offs, m, mean[:, None], a[:, None], mb[:, None], kg[:, None], ACC)


@triton.jit
def _dx_tile(x, dy, dx, offs, m, mean, a, mb, kg, ACC: tl.constexpr):
    """dx[offs] (+)= a (dy - mb - (x - mean) kg) over one tile, where m (a = gamma inv_std,
    mb = dbeta / n, kg = inv_std dgamma / n): both forms' last pass."""
    g = tl.load(dy + offs, mask=m, other=0.0)
    v = tl.load(x + offs, mask=m, other=0.0)
    out = a * (g - mb - (v - mean) * kg)
    if ACC:
        out += tl.load(dx + offs, mask=m, other=0.0)
    tl.store(dx + offs, out, mask=m)


@triton.jit
def _bn_channel_fwd_kernel(x, y, saved, gamma, beta, res, rmean, rvar, skip_ptr, N, C, HW,
                           total, unbias, eps, momentum, ROWS: tl.constexpr,
                           COLS: tl.constexpr, UPDATE: tl.constexpr, GATED: tl.constexpr,
                           RELU: tl.constexpr = False, RESIDUAL: tl.constexpr = False):
    """A whole batch norm forward of one channel in one program (`_one_program`): its
    shifted sums over its [N, HW] view (_shifted_sums), then saved and the running
    statistics (as _bn_finalize_kernel), then y (_normalise) over the same tiles again,
    read from the cache the first loop filled."""
    c = tl.program_id(0)
    shift, t1, t2 = _shifted_sums(x, c, C, HW, 0, N, 0, HW, ROWS, COLS)
    dm = t1 / total
    mean = shift + dm
    var = tl.maximum(t2 - t1 * dm, 0.0) / total
    inv = 1.0 / tl.sqrt(var + eps)
    tl.store(saved + c, mean)
    tl.store(saved + C + c, inv)
    if UPDATE:
        write = True
        if GATED:
            write = tl.load(skip_ptr) == 0.0
        if write:
            tl.store(rmean + c, (1.0 - momentum) * tl.load(rmean + c) + momentum * mean)
            tl.store(rvar + c, (1.0 - momentum) * tl.load(rvar + c) + momentum * (var * unbias))
    scale = inv * tl.load(gamma + c)
    b = tl.load(beta + c)
    ri = tl.arange(0, ROWS)
    ci = tl.arange(0, COLS)
    for r in range(0, N, ROWS):
        rows = r + ri
        rbase = ((rows.to(tl.int64) * C + c) * HW)[:, None]
        for h in range(0, HW, COLS):
            cols = h + ci
            m = (rows < N)[:, None] & (cols < HW)[None, :]
            _normalise(x, y, res, rbase + cols[None, :], m, mean, scale, b, RELU, RESIDUAL)


@triton.jit
def _bn_channel_bwd_kernel(x, dy, dx, saved, gamma, dgamma, dbeta, y, dyo, N, C, HW, inv_n,
                           ROWS: tl.constexpr, COLS: tl.constexpr, HAS_DX: tl.constexpr,
                           HAS_DG: tl.constexpr, HAS_DB: tl.constexpr, ACC: tl.constexpr,
                           MASK: tl.constexpr = False, WRITE: tl.constexpr = False):
    """A whole batch norm backward of one channel in one program (`_one_program`): its sums
    (_dy_sums over its [N, HW] view), dbeta and dgamma (as _bn_bwd_finalize_kernel), then
    dx (_dx_tile) over the same tiles again (dy from dyo where WRITE stored it there)."""
    c = tl.program_id(0)
    mean = tl.load(saved + c)
    inv = tl.load(saved + C + c)
    db, dg = _dy_sums(x, dy, y, dyo, mean, c, C, HW, 0, N, 0, HW, ROWS, COLS, MASK, WRITE)
    dg = dg * inv
    if HAS_DB:
        tl.store(dbeta + c, db)
    if HAS_DG:
        tl.store(dgamma + c, dg)
    if HAS_DX:
        if WRITE:
            tl.debug_barrier()              # the program's dyo stores before its loads
        a = inv * tl.load(gamma + c)
        mb = db * inv_n
        kg = dg * inv * inv_n
        ri = tl.arange(0, ROWS)
        ci = tl.arange(0, COLS)
        for r in range(0, N, ROWS):
            rows = r + ri
            rbase = ((rows.to(tl.int64) * C + c) * HW)[:, None]
            for h in range(0, HW, COLS):
                cols = h + ci
                m = (rows < N)[:, None] & (cols < HW)[None, :]
                _dx_tile(x, dyo if WRITE else dy, dx, rbase + cols[None, :], m, mean, a, mb,
                         kg, ACC)


# ----------------------------------------------------------------------------- launchers

def _check_shaped(name, t, shape, device):
    """`t` a contiguous float32 tensor of `shape` on `device` (x's); skipped within
    `_common.checked_before`."""
    if _CHECKED_BEFORE[0]:
        return
    check_tensor(name, t, shape)
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def _check_vec(name, t, c, device):
    _check_shaped(name, t, (c,), device)


def _check_x(x):
    check_tensor("x", x)
    n, c, h, w = _shape4(x.shape)
    if n * h * w < 2:
        raise ValueError(f"batch norm in training mode needs more than 1 value per channel, "
                         f"got input shape {tuple(x.shape)}")
    return n, c, h, w


def _check_x_with_saved(x, name, t, saved):
    """x's shape (as _check_x), `t` (named `name`) shaped like x and saved [2, C], both on
    x's device: what the rebuild and the backward pass read beside x."""
    n, c, h, w = _check_x(x)
    check_tensor(name, t, x.shape)
    check_tensor("saved", saved, (2, c))
    for nm, u in ((name, t), ("saved", saved)):
        if u.device != x.device:
            raise ValueError(f"{nm} is on {u.device} but x is on {x.device}")
    return n, c, h, w


def _finalize_shape(c, nch):
    """(channels per program, padded chunk count) of a merge pass: one lane row per channel
    over its chunks rounded up to a power of two, a tile of about _TILE."""
    nchp = max(2, next_power_of_2(nch))
    cb = max(2, min(next_power_of_2(c), _TILE // nchp))
    return cb, nchp


def _elementwise_grid(n, c, hw):
    """(grid, R, COLS) of an elementwise pass: _elementwise_tile's tiles of about _TILE,
    R channels (at most c's power of two) by COLS columns, one program each."""
    cols = min(next_power_of_2(hw), _TILE)
    r = max(1, min(_TILE // cols, next_power_of_2(c)))
    return (cdiv(c, r) * n * cdiv(hw, cols),), r, cols


def _check_relu(relu) -> None:
    if not isinstance(relu, bool):
        raise ValueError(f"relu must be a bool, got {relu!r}")


def _residual(residual, x):
    """The tensor the normalisation pass reads as its residual (x itself, unread, where
    there is none) after checking a given one is shaped like x and on x's device."""
    if residual is None:
        return x
    _check_shaped("residual", residual, x.shape, x.device)
    return residual


def forward(x, gamma, beta, y, running_mean, running_var, saved, workspace, *,
            eps=1e-5, momentum=0.1, update_running=True, relu=False, residual=None,
            skip=None):
    """Training-mode batch norm; see the module docstring. `relu`: store max(y, 0), a ReLU
    after the batch norm fused into it (sched/fuse.py; the same bits as the two layers).
    `residual`: store y + residual (before the ReLU), the residual add after it fused in.
    `skip`: a one-element float32 tensor on x's device; where it holds a non-zero value
    (a bad batch's count) the running statistics stay as they were (_common.gate)."""
    n, c, h, w = _check_x(x)
    _check_relu(relu)
    res = _residual(residual, x)
    dev = x.device
    _check_shaped("y", y, x.shape, dev)
    _check_vec("gamma", gamma, c, dev)
    _check_vec("beta", beta, c, dev)
    check_tensor("saved", saved, (2, c))
    if saved.device != dev:
        raise ValueError(f"saved is on {saved.device} but x is on {dev}")
    if not isinstance(update_running, bool):
        raise ValueError(f"update_running must be a bool, got {update_running!r}")
    if update_running:
        _check_vec("running_mean", running_mean, c, dev)
        _check_vec("running_var", running_var, c, dev)
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if not (isinstance(momentum, (int, float)) and 0.0 <= momentum <= 1.0):
        raise ValueError(f"momentum must be a number in [0, 1], got {momentum!r}")
    ws = float_workspace("bn", workspace, workspace_bytes(x.shape, "forward"), x.device)
    if ws.device != dev:
        raise ValueError(f"workspace is on {ws.device} but x is on {dev}")
    skip_ptr, gated = gate(skip, dev, saved)
    hw = h * w
    total = n * hw
    rm = running_mean if update_running else saved
    rv = running_var if update_running else saved
    if _one_program(n, c, hw):
        rows, cols = _tile_shape(n, hw)
        run(_bn_channel_fwd_kernel, (c,), x, y, saved, gamma, beta, res, rm, rv, skip_ptr,
            n, c, hw, float(total), total / (total - 1), float(eps), float(momentum),
            ROWS=rows, COLS=cols, UPDATE=update_running, GATED=gated, RELU=relu,
            RESIDUAL=residual is not None, num_warps=_WARPS)
        return
    rpc, nr, cpc, nh = _chunks(n, c, hw)
    nch = nr * nh
    rows, cols = _tile_shape(rpc, min(cpc, hw))
    run(_bn_stats_kernel, (c * nch,), x, ws, n, c, hw, rpc, cpc, nch, nh,
        ROWS=rows, COLS=cols, num_warps=_WARPS)
    cb, nchp = _finalize_shape(c, nch)
    run(_bn_finalize_kernel, (cdiv(c, cb),), ws, saved, rm, rv, c, nch, float(total),
        total / (total - 1), float(eps), float(momentum), skip_ptr,
        UPDATE=update_running, GATED=gated, CB=cb, NCHP=nchp)
    grid, r, cols = _elementwise_grid(n, c, hw)
    run(_bn_norm_kernel, grid, x, y, saved, gamma, beta, res, n, c, hw, R=r, COLS=cols,
        LAST_FIRST=_LAST_FIRST, RELU=relu, RESIDUAL=residual is not None, num_warps=_WARPS)


def rebuild(x, gamma, beta, y, saved, *, relu=False, residual=None):
    """y again from the mean and inverse deviation the forward pass saved: its third
    kernel alone (x read once, not twice; one launch, not three), on the same inputs and
    statistics, so the same bits (`relu` and `residual` as in forward)."""
    n, c, h, w = _check_x_with_saved(x, "y", y, saved)
    _check_relu(relu)
    res = _residual(residual, x)
    dev = x.device
    _check_vec("gamma", gamma, c, dev)
    _check_vec("beta", beta, c, dev)
    check_no_overlap("bn.rebuild", [("y", y)],
                     [("x", x), ("gamma", gamma), ("beta", beta), ("saved", saved),
                      ("residual", residual)])
    grid, r, cols = _elementwise_grid(n, c, h * w)
    run(_bn_norm_kernel, grid, x, y, saved, gamma, beta, res, n, c, h * w, R=r,
        COLS=cols, LAST_FIRST=_LAST_FIRST, RELU=relu, RESIDUAL=residual is not None,
        num_warps=_WARPS)


def forward_eval(x, gamma, beta, y, running_mean, running_var, *, eps=1e-5, relu=False,
                 residual=None):
    """Eval-mode batch norm with the running statistics; see the module docstring (`relu`
    and `residual` as in forward)."""
    check_tensor("x", x)
    _check_relu(relu)
    n, c, h, w = _shape4(x.shape)
    res = _residual(residual, x)
    dev = x.device
    _check_shaped("y", y, x.shape, dev)
    for name, t in (("gamma", gamma), ("beta", beta), ("running_mean", running_mean),
                    ("running_var", running_var)):
        _check_vec(name, t, c, dev)
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    grid, r, cols = _elementwise_grid(n, c, h * w)
    run(_bn_eval_kernel, grid, x, y, running_mean, running_var, gamma, beta, res, n, c,
        h * w, float(eps), R=r, COLS=cols, RELU=relu, RESIDUAL=residual is not None,
        num_warps=_WARPS)


def _check_dx(dx, x, dy, saved, ws, accumulate):
    """dx is dy (in place, not accumulating) or apart from every other operand."""
    in_place = dx.numel() > 0 and dx.data_ptr() == dy.data_ptr()
    if in_place and accumulate:
        raise ValueError("bn.backward: dx is dy, so it cannot accumulate")
    check_no_overlap("bn.backward", [("dx", dx)],
                     [("x", x), ("saved", saved), ("workspace", ws)]
                     + ([] if in_place else [("dy", dy)]))


def _check_dy_out(x, dy, dx, saved, ws, relu_output, dy_out):
    """relu_output and dy_out shaped like x, on its device; relu_output only with dy_out;
    dy_out is dy or apart from every other operand."""
    for name, t in (("relu_output", relu_output), ("dy_out", dy_out)):
        if t is not None:
            _check_shaped(name, t, x.shape, x.device)
    if relu_output is not None and dy_out is None:
        raise ValueError("bn.backward: relu_output needs dy_out (the masked dy is read there)")
    if dy_out is not None:
        same = dy_out.numel() > 0 and dy_out.data_ptr() == dy.data_ptr()
        check_no_overlap("bn.backward", [("dy_out", dy_out)],
                         [("x", x), ("saved", saved), ("workspace", ws), ("dx", dx),
                          ("relu_output", relu_output)] + ([] if same else [("dy", dy)]))


def backward(x, gamma, dy, saved, dx, dgamma, dbeta, workspace, *, accumulate=False,
             relu_output=None, dy_out=None):
    """Training-mode batch norm backward; see the module docstring. `dy_out` (x's shape):
    the dy the pass uses is also stored there, by its first kernel, and its last reads it
    there; `relu_output` (with dy_out): that dy is first put through the backward of the
    ReLU whose output it is, 0 where relu_output <= 0 (kernels/act.py's bits). A residual
    add fused into the batch norm (sched/fuse.py) so gives its residual the add's gradient
    (masked by the add's ReLU) in the batch norm's own pass. dy_out may be dy (in place)."""
    n, c, h, w = _check_x_with_saved(x, "dy", dy, saved)
    dev = x.device
    if dx is not None:
        _check_shaped("dx", dx, x.shape, dev)
        _check_vec("gamma", gamma, c, dev)
    if dgamma is not None:
        _check_vec("dgamma", dgamma, c, dev)
    if dbeta is not None:
        _check_vec("dbeta", dbeta, c, dev)
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate must be a bool, got {accumulate!r}")
    ws = float_workspace("bn", workspace, workspace_bytes(x.shape, "backward"), x.device)
    if ws.device != dev:
        raise ValueError(f"workspace is on {ws.device} but x is on {dev}")
    if dx is not None:
        _check_dx(dx, x, dy if dy_out is None else dy_out, saved, ws, accumulate)
    _check_dy_out(x, dy, dx, saved, ws, relu_output, dy_out)
    if dx is None and dgamma is None and dbeta is None and dy_out is None:
        return
    hw = h * w
    if _one_program(n, c, hw):
        rows, cols = _tile_shape(n, hw)
        run(_bn_channel_bwd_kernel, (c,), x, dy, dy if dx is None else dx, saved,
            dy if gamma is None else gamma, dgamma if dgamma is not None else saved,
            dbeta if dbeta is not None else saved,
            dy if relu_output is None else relu_output, dy if dy_out is None else dy_out,
            n, c, hw, 1.0 / (n * hw), ROWS=rows, COLS=cols, HAS_DX=dx is not None,
            HAS_DG=dgamma is not None, HAS_DB=dbeta is not None, ACC=accumulate,
            MASK=relu_output is not None, WRITE=dy_out is not None, num_warps=_WARPS)
        return
    rpc, nr, cpc, nh = _chunks(n, c, hw)
    nch = nr * nh
    rows, cols = _tile_shape(rpc, min(cpc, hw))
    run(_bn_bwd_partial_kernel, (c * nch,), x, dy, saved, ws,
        dy if relu_output is None else relu_output, dy if dy_out is None else dy_out,
        n, c, hw, rpc, cpc, nch, nh, ROWS=rows, COLS=cols, MASK=relu_output is not None,
        WRITE=dy_out is not None, num_warps=_WARPS)
    if dy_out is not None:
        dy = dy_out
    sums = ws[c * nch * 2: c * nch * 2 + 2 * c]
    cb, nchp = _finalize_shape(c, nch)
    run(_bn_bwd_finalize_kernel, (cdiv(c, cb),),
        ws, sums, saved, dgamma if dgamma is not None else sums,
        dbeta if dbeta is not None else sums, c, nch,
        HAS_DG=dgamma is not None, HAS_DB=dbeta is not None, CB=cb, NCHP=nchp)
    if dx is None:
        return
    grid, r, cols = _elementwise_grid(n, c, hw)
    run(_bn_dx_kernel, grid, x, dy, dx, saved, gamma, sums, n, c, hw, 1.0 / (n * hw),
        ACC=accumulate, R=r, COLS=cols, LAST_FIRST=_LAST_FIRST, num_warps=_WARPS)
