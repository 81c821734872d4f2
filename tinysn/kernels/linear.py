"""Fully connected layer (nn.Linear on the flattened input), as tiled tl.dot GEMMs.

Shapes: x [N, F] (the runtime passes 4-D activations already viewed as [N, F]),
w [O, F] (torch's layout), b [O] or None, y [N, O].

forward(x, w, b, y, *, precision=None)                      y = x @ w.T + b
backward(x, w, dy, dx, dw, db, *, accumulate=False, precision=None)
    dx (+)= dy @ w          [N, F]   (skipped when dx is None; accumulate applies to dx only)
    dw   = dy.T @ x         [O, F]   (skipped when dw is None; reduces over the batch)
    db   = dy.sum(0)        [O]      (skipped when db is None; fused into the dw GEMM: the
                                      programs of the first column-tile sum the dy tile they
                                      already load, so db costs no extra pass over dy)
All three GEMMs run one kernel, `_gemm_kernel`, with different strides (MODE picks the layout
for the autotuner key). Each output element is accumulated by one program over K in a fixed
order: deterministic, no atomics, no split-K, so workspace_bytes is 0.

Precision: tl.dot input_precision = dot_precision(precision) ("tf32" by default on the GPU,
"ieee" for exact float32). The autotuner picks tile sizes per shape on the GPU (the K-block
size, and so the rounding, can differ between configs; a process keeps its choice); under
the interpreter it runs one large-tile config.
"""
import torch
import triton
import triton.language as tl

from ._common import autotune, check_device, check_no_overlap, check_tensor, dot_precision
from ._common import cdiv, next_power_of_2
from ._common import launch, run
from .sgd import NO_FP_FUSION, fused_arguments, sgd_step

_FWD, _DX, _DW = 0, 1, 2


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# (256, 128, 32, 8 warps) was dropped: on the H200 with triton 3.6 it gave the weight
# gradient (A = dy transposed) a 10% error in tf32 while ieee was exact
# (tests/kernels/test_linear.py::test_linear_gpu_every_config, 2026-11-30).
_GPU_CONFIGS = [
    _cfg(128, 128, 32, 8, 3),
    _cfg(128, 256, 32, 8, 3),
    _cfg(128, 64, 32, 4, 4),
    _cfg(64, 128, 32, 4, 4),
    _cfg(64, 64, 32, 4, 4),
    _cfg(64, 32, 64, 4, 4),
    _cfg(32, 128, 64, 4, 4),
    _cfg(32, 64, 64, 4, 4),
    _cfg(32, 32, 128, 4, 4),
    _cfg(16, 64, 128, 4, 4),
    # one reduction step (a weight gradient's K = the batch, 32): no stages to pipeline, so
    # a single buffer; the shared memory left lets more programs overlap their stores
    _cfg(128, 128, 32, 8, 1),
    _cfg(64, 128, 32, 4, 1),
    # a weight gradient that goes into the weight's SGD step (K = the batch): bound by
    # moving the weight and its momentum, 16 bytes an element; thin tiles, the operands
    # loaded through a 2-stage pipeline, the tiles in row-major order (GROUP_M 1, so
    # programs side by side stream along the weight's rows), found by a sweep of tile,
    # warps, stages and order (the one bench/linear_configs.py --grid runs): VGG16's fc6
    # step at batch 32 takes 0.556 ms (2.96 TB/s, the copy's bandwidth) against 0.791 at
    # best with the configs above (H100, bench/linear_configs.py,
    # results/linear-configs-NVIDIA-H100-80GB-HBM3.json)
    _cfg(16, 128, 32, 4, 2, group_m=1),
]
# under the interpreter (it pays per operation and per program): a small network's GEMMs are
# one program of one reduction step
_INTERP_CONFIG = _cfg(64, 128, 128, 1, 1, group_m=2)


@autotune(_GPU_CONFIGS, _INTERP_CONFIG,
                 key=["M", "N", "K", "MODE"], restore=["c_ptr", "buf_ptr"])
@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, rowsum_ptr, M, N, K,
                 sam, sak, sbk, sbn, scm, buf_ptr, lr, momentum, weight_decay, skip_ptr,
                 MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROWSUM: tl.constexpr,
                 ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, UPDATE: tl.constexpr,
                 HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, GATED: tl.constexpr,
                 LR_IN_MEMORY: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """C[M, N] (+)= A[M, K] @ B[K, N] (+ bias[N]); rowsum[M] = A.sum(1) when HAS_ROWSUM.
    UPDATE: C is a parameter (buf_ptr its momentum buffer) and A @ B its gradient, which
    goes into one SGD step of C (sgd.sgd_step; lr, momentum, weight_decay and skip_ptr as
    the SGD kernel takes them) instead of being stored.

    A[m, k] at a_ptr + m*sam + k*sak, B[k, n] at b_ptr + k*sbk + n*sbn, C row-major (scm, 1).
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # grouped ordering: GROUP_M row-tiles share their B column-tiles in L2
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    # rows and columns past the edge are masked (loaded as 0, never stored): unlike a wrap
    # (`% M`), the mask keeps a tile's rows contiguous to the compiler, so an operand that is
    # contiguous along M or N (dy transposed in dW, w in dx) loads 16 bytes at a time
    m_in = offs_m < M
    n_in = offs_n < N
    am = offs_m.to(tl.int64)
    bn = offs_n.to(tl.int64)
    kk = offs_k.to(tl.int64)
    a_ptrs = a_ptr + am[:, None] * sam + kk[None, :] * sak
    b_ptrs = b_ptr + kk[:, None] * sbk + bn[None, :] * sbn
    c_offs = am[:, None] * scm + bn[None, :]
    c_mask = m_in[:, None] & n_in[None, :]
    if UPDATE:
        # the step's parameter and momentum tiles are requested before the reduction, so
        # their loads (the pass's traffic: K is the batch, one or two steps) are in flight
        # while the GEMM runs, not issued after it
        p_tile, buf_tile = _step_operands(c_ptr + c_offs, buf_ptr + c_offs, c_mask,
                                          HAS_MOMENTUM)

    acc = tl.zeros([BM, BN], dtype=tl.float32)
    rs = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_in[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_in[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_ROWSUM:
            rs += tl.sum(a, axis=1)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0)[None, :]
    if UPDATE:
        _update_tile(c_ptr + c_offs, buf_ptr + c_offs, c_mask, acc, p_tile, buf_tile, lr,
                     momentum, weight_decay, skip_ptr, HAS_WD, HAS_MOMENTUM, GATED,
                     LR_IN_MEMORY)
    else:
        if ACCUMULATE:
            acc += tl.load(c_ptr + c_offs, mask=c_mask, other=0.0)
        tl.store(c_ptr + c_offs, acc, mask=c_mask)
    if HAS_ROWSUM:
        if pid_n == 0:
            tl.store(rowsum_ptr + offs_m, rs, mask=m_in)


@triton.jit
def _step_operands(p_ptrs, buf_ptrs, mask, HAS_MOMENTUM: tl.constexpr):
    """A parameter tile and its momentum buffer's (the parameter again without momentum:
    `sgd_step` then ignores it)."""
    p = tl.load(p_ptrs, mask=mask, other=0.0)
    b = tl.load(buf_ptrs, mask=mask, other=0.0) if HAS_MOMENTUM else p
    return p, b


@triton.jit
def _update_tile(p_ptrs, buf_ptrs, mask, grad, p, b, lr, momentum, weight_decay, skip_ptr,
                 HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, GATED: tl.constexpr,
                 LR_IN_MEMORY: tl.constexpr):
    """One SGD step of a parameter tile p (momentum tile b, both loaded by `_step_operands`)
    from its gradient `grad` (in registers), as the SGD kernel takes it: where GATED and
    skip_ptr's float is not zero, the tile is written back as it was (the same bits: a
    store masked by the flag compiles to 4-byte stores where these are 16 bytes wide,
    bench/sass.py)."""
    rate = tl.load(lr) if LR_IN_MEMORY else lr
    new_p, new_b = sgd_step(p, grad, b, rate, momentum, weight_decay, HAS_WD, HAS_MOMENTUM)
    if GATED:
        keep = tl.load(skip_ptr) == 0.0
        new_p = tl.where(keep, new_p, p)
        new_b = tl.where(keep, new_b, b)
    if HAS_MOMENTUM:
        tl.store(buf_ptrs, new_b, mask=mask)
    tl.store(p_ptrs, new_p, mask=mask)


@triton.jit
def _colsum_kernel(dy_ptr, db_ptr, N, O, BLOCK_O: tl.constexpr, ROWS: tl.constexpr):
    """db[o] = sum_i dy[i, o], a fixed-order loop over the rows (used when dw is not wanted)."""
    offs_o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = offs_o < O
    rows = tl.arange(0, ROWS).to(tl.int64)
    acc = tl.zeros([ROWS, BLOCK_O], dtype=tl.float32)
    for i0 in range(0, N, ROWS):
        ptrs = dy_ptr + (i0 + rows)[:, None] * O + offs_o[None, :]
        acc += tl.load(ptrs, mask=((i0 + rows) < N)[:, None] & o_ok[None, :], other=0.0)
    tl.store(db_ptr + offs_o, tl.sum(acc, axis=0), mask=o_ok)


_NO_UPDATE = dict(UPDATE=False, HAS_WD=False, HAS_MOMENTUM=False, GATED=False,
                  LR_IN_MEMORY=False)


def _launch(a, b, c, bias, rowsum, M, N, K, sam, sak, sbk, sbn, mode, accumulate, precision,
            fused=None):
    """One GEMM; `fused` (sgd.fused_arguments of a step of c): c is updated, not written."""
    grid = lambda meta: (cdiv(M, meta["BM"]) * cdiv(N, meta["BN"]),)  # noqa: E731
    if fused is None:   # a (read-only) and zeros stand for the step's unread arguments
        step, flags = (a, 0.0, 0.0, 0.0, a), _NO_UPDATE
    else:
        step, flags = fused[0], dict(fused[1], UPDATE=True, **NO_FP_FUSION)
    launch(_gemm_kernel, grid,
           (a, b, c, bias if bias is not None else c, rowsum if rowsum is not None else c,
            M, N, K, sam, sak, sbk, sbn, N, *step),
           dict(MODE=mode, HAS_BIAS=bias is not None, HAS_ROWSUM=rowsum is not None,
                ACCUMULATE=accumulate, PRECISION=precision, **flags))


def forward(x: torch.Tensor, w: torch.Tensor, b, y: torch.Tensor, *, precision=None) -> None:
    """y = x @ w.T + b (b may be None). x [N, F], w [O, F], b [O], y [N, O], all float32."""
    prec = dot_precision(precision)
    check_tensor("x", x)
    check_tensor("w", w)
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"linear: x must be [N, F] and w [O, F], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    n, f = x.shape
    o = w.shape[0]
    if n == 0 or f == 0 or o == 0:
        raise ValueError(f"linear: empty shapes x {tuple(x.shape)}, w {tuple(w.shape)}")
    if w.shape[1] != f:
        raise ValueError(f"linear: w has {w.shape[1]} input features, x has {f}")
    if b is not None:
        check_tensor("b", b, shape=(o,))
    check_tensor("y", y, shape=(n, o))
    check_device("linear", x, w=w, b=b, y=y)
    check_no_overlap("linear", [("y", y)], [("x", x), ("w", w), ("b", b)])
    _launch(x, w, y, b, None, n, o, f, f, 1, 1, f, _FWD, False, prec)


def backward(x, w, dy: torch.Tensor, dx, dw, db, *, accumulate: bool = False,
             precision=None, update=None) -> None:
    """dx (+)= dy @ w, dw = dy.T @ x, db = dy.sum(0); any of dx, dw, db may be None.

    x is needed only for dw and w only for dx (either may be None when its output is).
    accumulate=True adds into dx; dw and db are always overwritten.
    update (an sgd.Update, with dw None): the weight gradient is not stored but goes into
    one SGD step of w, in place, in the GEMM's epilogue (after dx has read w): the bits
    sgd.update gives w and its buffer from that dw, without dw's memory or its round trip.
    """
    prec = dot_precision(precision)
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate must be a bool, got {accumulate!r}")
    if update is not None and (dw is not None or x is None or w is None):
        raise ValueError("linear.backward: update takes x and w and no dw (the weight "
                         "gradient goes into w's step, not into memory)")
    check_tensor("dy", dy)
    if dy.dim() != 2 or dy.shape[0] == 0 or dy.shape[1] == 0:
        raise ValueError(f"linear: dy must be a non-empty [N, O] tensor, got {tuple(dy.shape)}")
    n, o = dy.shape
    f = None
    if dx is not None and w is None:
        raise ValueError("linear.backward: w is required to compute dx")
    if dw is not None and x is None:
        raise ValueError("linear.backward: x is required to compute dw")
    if w is not None:
        check_tensor("w", w)
        if w.dim() != 2 or w.shape[0] != o or w.shape[1] == 0:
            raise ValueError(f"linear: w must be [{o}, F], got {tuple(w.shape)}")
        f = w.shape[1]
    if x is not None:
        check_tensor("x", x)
        if (x.dim() != 2 or x.shape[0] != n or x.shape[1] == 0
                or (f is not None and x.shape[1] != f)):
            raise ValueError(f"linear: x must be [{n}, {f if f is not None else 'F'}], got "
                             f"{tuple(x.shape)}")
        f = x.shape[1]
    if dx is not None:
        check_tensor("dx", dx, shape=(n, f))
    if dw is not None:
        check_tensor("dw", dw, shape=(o, f))
    if db is not None:
        check_tensor("db", db, shape=(o,))
    check_device("linear", dy, x=x, w=w, dx=dx, dw=dw, db=db)
    written = [("w", w)] if update is not None else []
    check_no_overlap("linear", [("dx", dx), ("dw", dw), ("db", db)] + written,
                     [("x", x), ("dy", dy)] + ([] if written else [("w", w)]))
    fused = None if update is None else fused_arguments(update, w)
    if fused is not None:
        check_no_overlap("linear", [("w's momentum_buf", update.momentum_buf)],
                         [("x", x), ("dy", dy), ("dx", dx), ("db", db)])

    if dx is not None:      # dx[N, F] = dy[N, O] @ w[O, F]
        _launch(dy, w, dx, None, None, n, f, o, o, 1, f, 1, _DX, accumulate, prec)
    if dw is not None or fused is not None:   # dw[O, F] = dy.T[O, N] @ x[N, F] (+ db)
        _launch(dy, x, dw if fused is None else w, None, db, o, f, n, 1, o, f, 1, _DW, False,
                prec, fused)
    elif db is not None:
        block_o = min(next_power_of_2(o), 256)
        run(_colsum_kernel, (cdiv(o, block_o),), dy, db, n, o, BLOCK_O=block_o, ROWS=8,
            num_warps=4)


def workspace_bytes(n: int, f: int, o: int, phase=None) -> int:
    """No split-K: every GEMM writes its output directly, so no scratch memory."""
    return 0
