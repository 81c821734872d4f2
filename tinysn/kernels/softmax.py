"""Softmax + mean cross-entropy (F.cross_entropy(logits, labels), reduction "mean").

forward(logits, labels, loss, workspace)
    loss[0] = mean_i (logsumexp(logits[i]) - logits[i, labels[i]])
    One program per row (per block of rows under the interpreter, _ROW_TILE) writes its row
    loss into the workspace (float32 [N]); a second, single-program kernel sums them in a
    fixed order and divides by N. No atomics: the loss is bitwise reproducible.
backward(logits, labels, dlogits, *, scale=1.0, accumulate=False)
    dlogits (+)= (softmax(logits) - onehot(labels)) * (scale / N)
    (the gradient of scale * loss; softmax is recomputed from the logits, nothing is saved).

Numerically stable (the row max is subtracted before exp). Rows of any length K: a row is
walked in blocks of at most _MAX_BLOCK_K columns (ImageNet's K = 1000 fits in one block).

Labels: the launcher checks shapes and dtypes only; reading the label values would need a
device sync, so the Runtime validates labels (0 <= label < K) when a batch arrives. A label
outside [0, K) does not read out of bounds here: its row loss (and so the loss) becomes NaN,
and backward treats it as matching no class. ignore_index is not supported.
"""
import torch
import triton
import triton.language as tl

from ._common import INTERP_TILE, INTERPRET, check_tensor, float_workspace, run
from ._common import cdiv, next_power_of_2

_MAX_BLOCK_K = 1024          # columns per block of a row (tests lower it to exercise the loop)
_REDUCE_BLOCK = 1024         # row losses summed per step of the final reduction
# elements of a program's [rows, BLOCK_K] tile: one row per program on the GPU; the
# interpreter pays per operation and per program, so there a program takes many rows
_ROW_TILE = INTERP_TILE if INTERPRET else 1


@triton.jit
def _row_max(row_ptr, row_ok, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The maximum of each of ROWS rows (row_ptr [ROWS]); 0 for a row that is not live."""
    cols = tl.arange(0, BLOCK_K)
    m = tl.full([ROWS, BLOCK_K], float("-inf"), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(row_ptr[:, None] + (k0 + cols)[None, :],
                    mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=float("-inf"))
        m = tl.maximum(m, x)
    return tl.where(row_ok, tl.max(m, axis=1), 0.0)


@triton.jit
def _row_sumexp(row_ptr, row_ok, K, m, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k exp(x[k] - m) of each row; 1 for a row that is not live (its log is finite)."""
    cols = tl.arange(0, BLOCK_K)
    s = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(row_ptr[:, None] + (k0 + cols)[None, :],
                    mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=float("-inf"))
        s += tl.exp(x - m[:, None])
    return tl.where(row_ok, tl.sum(s, axis=1), 1.0)


@triton.jit
def _rows(N, K, logits_ptr, ROWS: tl.constexpr):
    """This program's ROWS row indices (int64), which of them exist, and their logits rows."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    return rows, row_ok, logits_ptr + rows * K


@triton.jit
def _ce_rows_kernel(logits_ptr, labels_ptr, row_loss_ptr, N, K, ROWS: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """row_loss[i] = logsumexp(logits[i]) - logits[i, labels[i]], ROWS rows per program."""
    rows, row_ok, row_ptr = _rows(N, K, logits_ptr, ROWS)
    m = _row_max(row_ptr, row_ok, K, ROWS, BLOCK_K)
    s = _row_sumexp(row_ptr, row_ok, K, m, ROWS, BLOCK_K)
    lab = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    valid = row_ok & (lab >= 0) & (lab < K)
    x_lab = tl.load(row_ptr + tl.where(valid, lab, 0), mask=valid, other=float("nan"))
    tl.store(row_loss_ptr + rows, (m + tl.log(s)) - x_lab, mask=row_ok)


@triton.jit
def _mean_kernel(row_loss_ptr, loss_ptr, N, inv_n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i0 in range(0, N, BLOCK):
        acc += tl.load(row_loss_ptr + i0 + offs, mask=i0 + offs < N, other=0.0)
    tl.store(loss_ptr, tl.sum(acc, axis=0) * inv_n)


@triton.jit
def _ce_bwd_kernel(logits_ptr, labels_ptr, dlogits_ptr, N, K, coef, ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr, ACCUMULATE: tl.constexpr):
    """dlogits[i] (+)= (softmax(logits[i]) - onehot(labels[i])) * coef, ROWS rows per program."""
    rows, row_ok, row_ptr = _rows(N, K, logits_ptr, ROWS)
    drow_ptr = dlogits_ptr + rows * K
    m = _row_max(row_ptr, row_ok, K, ROWS, BLOCK_K)
    s = _row_sumexp(row_ptr, row_ok, K, m, ROWS, BLOCK_K)
    lab = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    cols = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + cols
        mask = row_ok[:, None] & (col < K)[None, :]
        x = tl.load(row_ptr[:, None] + col[None, :], mask=mask, other=float("-inf"))
        p = tl.exp(x - m[:, None]) / s[:, None]
        g = (p - tl.where(col[None, :] == lab[:, None], 1.0, 0.0)) * coef
        if ACCUMULATE:
            g = tl.load(drow_ptr[:, None] + col[None, :], mask=mask) + g
        tl.store(drow_ptr[:, None] + col[None, :], g, mask=mask)


def _block_k(k: int) -> int:
    return min(max(next_power_of_2(k), 16), _MAX_BLOCK_K)


def _rows_per_program(n: int, block_k: int) -> int:
    """As many rows as fit a tile of _ROW_TILE elements (at least one, at most n rounded up
    to a power of two)."""
    return min(next_power_of_2(n), max(1, _ROW_TILE // block_k))


def _num_warps(block_k: int) -> int:
    return 4 if block_k >= 512 else (2 if block_k >= 128 else 1)


def _check_logits_labels(logits, labels):
    check_tensor("logits", logits)
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"logits must be a non-empty [N, K] tensor, got shape "
                         f"{tuple(logits.shape)}")
    n = logits.shape[0]
    check_tensor("labels", labels, shape=(n,), dtype=torch.int64)
    if labels.device != logits.device:
        raise ValueError(f"labels is on {labels.device} but logits is on {logits.device}")


def workspace_bytes(n: int, k: int) -> int:
    """Scratch for forward: one float32 row loss per row (backward needs none)."""
    return 4 * int(n)

def forward(logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor,
            workspace: torch.Tensor) -> None:
    """loss[0] = F.cross_entropy(logits, labels) (mean). logits float32 [N, K], labels int64 [N],
    loss float32 [1], workspace uint8/float32 1-D of >= workspace_bytes(N, K) bytes."""
    _check_logits_labels(logits, labels)
    n, k = logits.shape
    check_tensor("loss", loss)
    if loss.numel() != 1 or loss.dim() > 1:
        raise ValueError(f"loss must be a float32 tensor of shape [1], got {tuple(loss.shape)}")
    if loss.device != logits.device:
        raise ValueError(f"loss is on {loss.device} but logits is on {logits.device}")
    rows = float_workspace("softmax", workspace, workspace_bytes(n, k), logits.device)
    bk = _block_k(k)
    per = _rows_per_program(n, bk)
    run(_ce_rows_kernel, (cdiv(n, per),), logits, labels, rows, n, k, ROWS=per, BLOCK_K=bk,
        num_warps=_num_warps(bk))
    run(_mean_kernel, (1,), rows, loss, n, 1.0 / n, BLOCK=_REDUCE_BLOCK, num_warps=4)


def backward(logits: torch.Tensor, labels: torch.Tensor, dlogits: torch.Tensor, *,
             scale: float = 1.0, accumulate: bool = False) -> None:
    """dlogits (+)= (softmax(logits) - onehot(labels)) * scale / N.

    dlogits may be logits itself (in place: every element is read before it is written).
    """
    _check_logits_labels(logits, labels)
    n, k = logits.shape
    check_tensor("dlogits", dlogits, shape=(n, k))
    if dlogits.device != logits.device:
        raise ValueError(f"dlogits is on {dlogits.device} but logits is on {logits.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number, got {scale!r}")
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate must be a bool, got {accumulate!r}")
    a0, b0, nb = logits.data_ptr(), dlogits.data_ptr(), 4 * n * k
    if a0 != b0 and a0 < b0 + nb and b0 < a0 + nb:
        raise ValueError("dlogits partly overlaps logits")
    bk = _block_k(k)
    per = _rows_per_program(n, bk)
    run(_ce_bwd_kernel, (cdiv(n, per),), logits, labels, dlogits, n, k, float(scale) / n,
        ROWS=per, BLOCK_K=bk, ACCUMULATE=accumulate,
        num_warps=_num_warps(bk))
