"""Join layers: elementwise add (residual) and channel concat (inception, densenet).

add
    add_forward(xs, y, relu=...)  y = ((x0 + x1) + x2) + ...   (left fold, fixed order);
                                  relu=True stores max(y, 0): a ReLU after the add fused
                                  into it (sched/fuse.py), one pass over memory fewer
    add_backward(dy, dxs, accumulate=..., y=None)   dx_i = g  or  dx_i += g  (per input),
                                  g = dy, or where `y` (a fused ReLU's output) is given,
                                  dy where y > 0 else 0: the ReLU's backward in the same
                                  pass, the same bits as kernels/act.py's
concat (NCHW, along channels)
    concat_forward(xs, y)         y[:, c0:c0+Ci] = x_i
    concat_backward(dy, dxs, accumulate=..., channels=None)   dx_i = dy[:, c0:c0+Ci]  (or +=)
accumulate is a bool or a list with one bool per input; entries of dxs may be None (no
gradient wanted). A None concat entry has no shape to read C_i from: one None is inferred,
with several pass channels=[C_0, C_1, ...].

One kernel launch sums up to four inputs (reading each once and writing y once); more
inputs chain in place on y, keeping the left-fold order. The add backward writes up to four
gradients per launch from one read of dy. A channel slice of an NCHW tensor is N rows of
Ci*H*W contiguous elements, the rows C*H*W apart: the concat kernels copy those rows
directly (a strided row copy), no torch copy or temporary is made. One launch copies up to
four slices (grid axis 1 picks the slice), so a two-way concat is one launch, like torch.cat.

Every output element is computed by one lane in a fixed order, so the results do not depend
on the autotuned block size (bitwise deterministic). Autotuning benchmarks a kernel several
times, so kernels that update in place (y chained over >4 inputs, accumulating gradients)
declare restore: the tuner saves those tensors to host memory and puts them back after
timing (on the first call of a shape only; _common.HostRestore).

No workspace: workspace_bytes(...) is 0.
"""
import triton
import triton.language as tl

from ._common import autotune, cdiv, check_device, check_tensor, launch

_MAX_PTRS = 4  # inputs summed / gradients written per launch

_GPU_CONFIGS = [
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
]
_SMALL_CONFIG = triton.Config({"BLOCK": 1024}, num_warps=4)


def workspace_bytes(*args, **kwargs) -> int:
    """Join layers need no scratch memory."""
    return 0


# ----------------------------------------------------------------------------- kernels


@autotune(_GPU_CONFIGS, _SMALL_CONFIG, key=["n"],
                 restore=["y_ptr"])
@triton.jit
def _sum_kernel(y_ptr, a0, a1, a2, a3, n, NUM: tl.constexpr, RELU: tl.constexpr,
                BLOCK: tl.constexpr):
    """y = ((a0 + a1) + a2) + a3 over the first NUM inputs (y may alias a0); RELU: y =
    max(that, 0), as kernels/act.py's forward computes it (NaN kept)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(a0 + offs, mask=mask)
    if NUM > 1:
        acc = acc + tl.load(a1 + offs, mask=mask)
    if NUM > 2:
        acc = acc + tl.load(a2 + offs, mask=mask)
    if NUM > 3:
        acc = acc + tl.load(a3 + offs, mask=mask)
    if RELU:
        acc = tl.where(acc < 0.0, 0.0, acc)
    tl.store(y_ptr + offs, acc, mask=mask)


@autotune(_GPU_CONFIGS, _SMALL_CONFIG, key=["n"],
                 restore=["d0", "d1", "d2", "d3"])
@triton.jit
def _fanout_kernel(g_ptr, y_ptr, d0, d1, d2, d3, n, NUM: tl.constexpr, MASK: tl.constexpr,
                   ACC0: tl.constexpr, ACC1: tl.constexpr, ACC2: tl.constexpr,
                   ACC3: tl.constexpr, BLOCK: tl.constexpr):
    """d_i = g (or d_i += g when ACCi) for the first NUM outputs, reading g once; MASK: g is
    first put through the backward of the ReLU whose output y is (kernels/act.py's rule)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask)
    if MASK:
        g = tl.where(tl.load(y_ptr + offs, mask=mask) <= 0.0, 0.0, g)
    if ACC0:
        tl.store(d0 + offs, tl.load(d0 + offs, mask=mask) + g, mask=mask)
    else:
        tl.store(d0 + offs, g, mask=mask)
    if NUM > 1:
        if ACC1:
            tl.store(d1 + offs, tl.load(d1 + offs, mask=mask) + g, mask=mask)
        else:
            tl.store(d1 + offs, g, mask=mask)
    if NUM > 2:
        if ACC2:
            tl.store(d2 + offs, tl.load(d2 + offs, mask=mask) + g, mask=mask)
        else:
            tl.store(d2 + offs, g, mask=mask)
    if NUM > 3:
        if ACC3:
            tl.store(d3 + offs, tl.load(d3 + offs, mask=mask) + g, mask=mask)
        else:
            tl.store(d3 + offs, g, mask=mask)


@triton.jit
def _pick(i, v0, v1, v2, v3):
    """v_i for a runtime i in 0..3."""
    v = v0
    if i == 1:
        v = v1
    if i == 2:
        v = v2
    if i == 3:
        v = v3
    return v


@triton.jit
def _slices_kernel(wide, n0, n1, n2, n3, ch0, ch1, ch2, ch3, off0, off1, off2, off3,
                   acc0, acc1, acc2, acc3, wide_c, HW, row_max,
                   TO_WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Copy between the channel slices of one NCHW tensor `wide` (wide_c channels) and up to
    four narrow tensors n_i (ch_i channels, at channel offset off_i of wide):
    wide[:, off_i:off_i+ch_i] (+)= n_i when TO_WIDE (concat forward), else n_i (+)= that slice
    (backward; acc_i says whether n_i accumulates).

    Grid (N * cdiv(row_max, BLOCK), slices): a program copies BLOCK contiguous elements of one
    image's slice row (ch_i*HW elements; row_max is the longest row).
    """
    i = tl.program_id(1)
    narrow = _pick(i, n0, n1, n2, n3)
    row_len = _pick(i, ch0, ch1, ch2, ch3) * HW
    wide_off = _pick(i, off0, off1, off2, off3) * HW
    acc = _pick(i, acc0, acc1, acc2, acc3)
    nblk = tl.cdiv(row_max, BLOCK)
    pid = tl.program_id(0)
    row = (pid // nblk).to(tl.int64)
    offs = (pid % nblk) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_len
    narrow_ptrs = narrow + row * row_len + offs
    wide_ptrs = wide + (row * wide_c * HW + wide_off) + offs
    if TO_WIDE:
        src, dst = narrow_ptrs, wide_ptrs
    else:
        src, dst = wide_ptrs, narrow_ptrs
    v = tl.load(src, mask=mask)
    if acc != 0:
        v = v + tl.load(dst, mask=mask)
    tl.store(dst, v, mask=mask)


_concat_fwd = autotune(_GPU_CONFIGS, _SMALL_CONFIG, key=["row_max", "HW"],
                       restore=["wide"])(_slices_kernel)
_concat_bwd = autotune(_GPU_CONFIGS, _SMALL_CONFIG, key=["row_max", "HW"],
                       restore=["n0", "n1", "n2", "n3"])(_slices_kernel)


# ----------------------------------------------------------------------------- helpers


def _check_list(name, ts, allow_none=False):
    if not isinstance(ts, (list, tuple)):
        raise ValueError(f"{name} must be a list or tuple of tensors, got {type(ts).__name__}")
    for i, t in enumerate(ts):
        if t is None and allow_none:
            continue
        check_tensor(f"{name}[{i}]", t)

def _accumulate_list(accumulate, n):
    if isinstance(accumulate, (list, tuple)):
        if len(accumulate) != n:
            raise ValueError(f"accumulate has {len(accumulate)} entries for {n} gradients")
        flags = list(accumulate)
    else:
        flags = [accumulate] * n
    for f in flags:
        if not isinstance(f, (bool, int)) or f not in (0, 1):
            raise ValueError(f"accumulate entries must be bool, got {f!r}")
    return [bool(f) for f in flags]


def _grid1(n):
    return lambda meta: (cdiv(n, meta["BLOCK"]),)


# ----------------------------------------------------------------------------- add


def add_forward(xs, y, *, relu=False):
    """y = x0 + x1 + ... (2 or more same-shape tensors), summed left to right; `relu`:
    y = max(that sum, 0) (a ReLU after the add fused into it)."""
    if not isinstance(relu, bool):
        raise ValueError(f"relu must be a bool, got {relu!r}")
    _check_list("xs", xs)
    if len(xs) < 2:
        raise ValueError(f"add needs at least 2 inputs, got {len(xs)}")
    check_tensor("y", y)
    for i, x in enumerate(xs):
        if x.shape != y.shape:
            raise ValueError(f"xs[{i}] has shape {tuple(x.shape)} but y has {tuple(y.shape)}")
    check_device("join", y, **{f"xs[{i}]": t for i, t in enumerate(xs)})
    n = y.numel()
    if n == 0:
        return
    rest = list(xs)
    first = True
    while rest:
        take = _MAX_PTRS if first else _MAX_PTRS - 1
        group, rest = rest[:take], rest[take:]
        ins = group if first else [y] + group
        ptrs = ins + [ins[0]] * (_MAX_PTRS - len(ins))
        last = not rest             # the ReLU goes on the final sum alone
        launch(_sum_kernel, _grid1(n), (y, *ptrs, n), dict(NUM=len(ins), RELU=relu and last))
        first = False


def add_backward(dy, dxs, *, accumulate=False, y=None):
    """dx_i = g (accumulate False) or dx_i += g (True) for every non-None dx_i, where g is
    dy, or with `y` (the output of a ReLU fused into the add) dy where y > 0, else 0.

    accumulate: one bool for all inputs, or a list with one bool per entry of dxs.
    A dx that shares memory with dy is rejected when it accumulates, and one that shares
    memory with y always (y is read after the first outputs are written).
    """
    check_tensor("dy", dy)
    _check_list("dxs", dxs, allow_none=True)
    flags = _accumulate_list(accumulate, len(dxs))
    if y is not None:
        check_tensor("y", y)
        if y.shape != dy.shape:
            raise ValueError(f"y has shape {tuple(y.shape)} but dy has {tuple(dy.shape)}")
    for i, d in enumerate(dxs):
        if d is None:
            continue
        if d.shape != dy.shape:
            raise ValueError(f"dxs[{i}] has shape {tuple(d.shape)} but dy has {tuple(dy.shape)}")
        if flags[i] and d.data_ptr() == dy.data_ptr():
            raise ValueError(f"dxs[{i}] aliases dy; it cannot accumulate")
        if y is not None and d.numel() and d.data_ptr() == y.data_ptr():
            raise ValueError(f"dxs[{i}] aliases y, the ReLU output it is masked by")
    check_device("join", dy, y=y, **{f"dxs[{i}]": t for i, t in enumerate(dxs)})
    n = dy.numel()
    work = [(d, f) for d, f in zip(dxs, flags) if d is not None]
    if n == 0:
        return
    for s in range(0, len(work), _MAX_PTRS):
        group = work[s:s + _MAX_PTRS]
        outs = [d for d, _ in group]
        accs = [f for _, f in group]
        num = len(outs)
        outs = outs + [outs[0]] * (_MAX_PTRS - num)
        accs = accs + [False] * (_MAX_PTRS - num)
        launch(_fanout_kernel, _grid1(n), (dy, dy if y is None else y, *outs, n),
               dict(NUM=num, MASK=y is not None, ACC0=accs[0], ACC1=accs[1], ACC2=accs[2],
                    ACC3=accs[3]))


# ----------------------------------------------------------------------------- concat


def _concat_check(xs, y, xname, yname, allow_none):
    _check_list(xname, xs, allow_none=allow_none)
    if len(xs) < 1:
        raise ValueError(f"concat needs at least 1 input, got {len(xs)}")
    check_tensor(yname, y)
    if y.dim() != 4:
        raise ValueError(f"{yname} must be 4-D NCHW, got shape {tuple(y.shape)}")
    n, c, h, w = y.shape
    return n, c, h, w


def _channel_counts(xs, shapes_from, n, c, h, w, xname, yname):
    counts = []
    for i, x in enumerate(xs):
        if x is None:
            counts.append(shapes_from[i])
            continue
        if x.dim() != 4 or x.shape[0] != n or x.shape[2] != h or x.shape[3] != w:
            raise ValueError(f"{xname}[{i}] has shape {tuple(x.shape)}; expected "
                             f"[{n}, C_i, {h}, {w}] to match {yname}")
        counts.append(x.shape[1])
    if sum(counts) != c:
        raise ValueError(f"{xname} channels sum to {sum(counts)} but {yname} has {c}")
    return counts


def _copy_slices(wide, slices, to_wide):
    """slices: [(narrow tensor, channels, channel offset in wide, accumulate)], launched four
    at a time (empty slices skipped)."""
    n, c, h, w = wide.shape
    hw = h * w
    slices = [sl for sl in slices if sl[1] > 0]
    if n == 0 or hw == 0:
        return
    kern = _concat_fwd if to_wide else _concat_bwd
    for s in range(0, len(slices), _MAX_PTRS):
        group = slices[s:s + _MAX_PTRS]
        num = len(group)
        group = group + [group[0]] * (_MAX_PTRS - num)
        narrow, chans, offs, accs = zip(*group)
        row_max = max(chans) * hw
        launch(kern, lambda meta: (n * cdiv(row_max, meta["BLOCK"]), num),
               (wide, *narrow, *chans, *offs, *(int(a) for a in accs), c, hw, row_max),
               dict(TO_WIDE=to_wide))


def concat_forward(xs, y):
    """y[:, c0:c0+C_i] = xs[i] for NCHW tensors, channel offsets in list order."""
    n, c, h, w = _concat_check(xs, y, "xs", "y", allow_none=False)
    counts = _channel_counts(xs, None, n, c, h, w, "xs", "y")
    check_device("join", y, **{f"xs[{i}]": t for i, t in enumerate(xs)})
    starts = [sum(counts[:i]) for i in range(len(counts))]
    _copy_slices(y, [(x, ci, c0, False) for x, ci, c0 in zip(xs, counts, starts)], True)


def concat_backward(dy, dxs, *, accumulate=False, channels=None):
    """dx_i = dy[:, c0:c0+C_i] (or dx_i += ... when accumulate) for every non-None dx_i.

    accumulate: one bool, or a list with one bool per entry of dxs.
    channels: optional list of C_i, one per entry of dxs. A None entry of dxs has no
    shape to read its channel count from: with one None entry it is inferred (dy's
    channels minus the others); with two or more, `channels` must be given.
    """
    n, c, h, w = _concat_check(dxs, dy, "dxs", "dy", allow_none=True)
    flags = _accumulate_list(accumulate, len(dxs))
    if channels is not None:
        if not isinstance(channels, (list, tuple)) or len(channels) != len(dxs):
            raise ValueError("channels must be a list with one entry per dxs entry")
        for i, (d, ci) in enumerate(zip(dxs, channels)):
            if not isinstance(ci, int) or ci < 0:
                raise ValueError(f"channels[{i}] must be a non-negative int, got {ci!r}")
            if d is not None and d.dim() == 4 and d.shape[1] != ci:
                raise ValueError(f"dxs[{i}] has {d.shape[1]} channels but channels[{i}] = {ci}")
        fill = list(channels)
    else:
        nones = [i for i, d in enumerate(dxs) if d is None]
        if len(nones) > 1:
            raise ValueError("several dxs entries are None: pass channels= to locate the others")
        fill = [None] * len(dxs)
        if nones:
            known = sum(d.shape[1] for d in dxs if d is not None and d.dim() == 4)
            fill[nones[0]] = c - known
            if fill[nones[0]] < 0:
                raise ValueError(f"dxs channels exceed dy's {c}")
    counts = _channel_counts(dxs, fill, n, c, h, w, "dxs", "dy")
    check_device("join", dy, **{f"dxs[{i}]": t for i, t in enumerate(dxs)})
    starts = [sum(counts[:i]) for i in range(len(counts))]
    _copy_slices(dy, [(d, ci, c0, acc) for d, ci, c0, acc in zip(dxs, counts, starts, flags)
                      if d is not None], False)
