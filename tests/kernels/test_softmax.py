"""Softmax + mean cross-entropy against F.cross_entropy (float64 references)."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import softmax

GPU = torch.cuda.is_available()


@contextlib.contextmanager
def _blocks(max_block_k=None, reduce_block=None, row_tile=None):
    """Shrink the block sizes so that small shapes exercise the multi-block loops; row_tile=1
    runs one row per program (the GPU's layout), a small one several programs of rows."""
    saved = softmax._MAX_BLOCK_K, softmax._REDUCE_BLOCK, softmax._ROW_TILE
    softmax._MAX_BLOCK_K = max_block_k or saved[0]
    softmax._REDUCE_BLOCK = reduce_block or saved[1]
    softmax._ROW_TILE = row_tile or saved[2]
    try:
        yield
    finally:
        softmax._MAX_BLOCK_K, softmax._REDUCE_BLOCK, softmax._ROW_TILE = saved


def _inputs(n, k, seed, device="cpu", spread=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, k, generator=g) * spread).to(device)
    labels = torch.randint(0, k, (n,), generator=g).to(device)
    return logits, labels


def _workspace(n, k, device, dtype=torch.uint8):
    nbytes = softmax.workspace_bytes(n, k)
    ws = torch.empty(nbytes if dtype == torch.uint8 else nbytes // 4, dtype=dtype, device=device)
    return ws.fill_(255 if dtype == torch.uint8 else float("nan"))


def _check(n, k, seed=0, device="cpu", scale=1.0, accumulate=False, spread=3.0,
           ws_dtype=torch.uint8):
    logits, labels = _inputs(n, k, seed, device, spread)
    loss = torch.full((1,), float("nan"), device=device)
    softmax.forward(logits, labels, loss, _workspace(n, k, device, ws_dtype))

    ref_logits = logits.double().requires_grad_(True)
    ref_loss = F.cross_entropy(ref_logits, labels)
    (ref_loss * scale).backward()
    tol = 1e-5 * math.sqrt(k)
    torch.testing.assert_close(loss.double()[0], ref_loss.detach(), rtol=tol, atol=tol)

    ref_grad = ref_logits.grad
    if accumulate:
        before = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)).to(device)
        dlogits = before.clone()
        ref_grad = before.double() + ref_grad
    else:
        dlogits = torch.full_like(logits, float("nan"))
    softmax.backward(logits, labels, dlogits, scale=scale, accumulate=accumulate)
    torch.testing.assert_close(dlogits.double(), ref_grad, rtol=1e-5,
                               atol=1e-6 * max(1.0, abs(scale)))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), k=st.integers(1, 70), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 0.5, 1024.0]), accumulate=st.booleans(),
       small_blocks=st.booleans(), row_tile=st.sampled_from([None, 1, 32]))
def test_cross_entropy_random(n, k, seed, scale, accumulate, small_blocks, row_tile):
    with _blocks(16 if small_blocks else None, 2 if small_blocks else None, row_tile):
        _check(n, k, seed, scale=scale, accumulate=accumulate)


@pytest.mark.parametrize("n,k", [(1, 1), (4, 1), (1, 2), (3, 16), (2, 17), (5, 1000), (2, 1500),
                                 (33, 10)])
def test_cross_entropy_edge_shapes(n, k):
    _check(n, k, seed=n * 1000 + k)
    _check(n, k, seed=n, accumulate=True, ws_dtype=torch.float32)


def test_cross_entropy_multi_block_rows_and_reduce():
    with _blocks(16, 4):
        _check(9, 53, seed=3)
        _check(1, 16, seed=4)
        _check(9, 48, seed=5, accumulate=True)
    for row_tile in (1, 32):     # one row per program; two rows per program, the last half dead
        with _blocks(16, 4, row_tile):
            _check(9, 53, seed=6)
            _check(9, 48, seed=7, accumulate=True)


def test_cross_entropy_large_logits_are_stable():
    _check(4, 37, seed=1, spread=1e4)        # exp would overflow without the max shift
    logits, labels = _inputs(3, 20, 2)
    logits += 3e4
    loss = torch.empty(1)
    softmax.forward(logits, labels, loss, _workspace(3, 20, "cpu"))
    torch.testing.assert_close(loss[0].double(), F.cross_entropy(logits.double(), labels),
                               rtol=1e-3, atol=1e-3)


def test_cross_entropy_deterministic_and_in_place():
    logits, labels = _inputs(17, 300, 9)
    losses, grads = [], []
    for _ in range(2):
        loss = torch.empty(1)
        softmax.forward(logits, labels, loss, _workspace(17, 300, "cpu"))
        g = torch.empty_like(logits)
        softmax.backward(logits, labels, g, scale=2.0)
        losses.append(loss)
        grads.append(g)
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    with _blocks(16):
        inplace = logits.clone()
        softmax.backward(inplace, labels, inplace, scale=2.0)   # dlogits may be logits
        torch.testing.assert_close(inplace, grads[0], rtol=1e-6, atol=1e-7)


def test_out_of_range_label_gives_nan_not_a_fault():
    logits, labels = _inputs(3, 5, 0)
    labels[1] = 7
    loss = torch.empty(1)
    softmax.forward(logits, labels, loss, _workspace(3, 5, "cpu"))
    assert loss.isnan().all()
    labels[1] = -100
    softmax.forward(logits, labels, loss, _workspace(3, 5, "cpu"))
    assert loss.isnan().all()


def test_workspace_bytes():
    assert softmax.workspace_bytes(32, 1000) == 128
    assert softmax.workspace_bytes(1, 5) == 4


def test_cross_entropy_bad_input():
    logits, labels = _inputs(4, 6, 0)
    loss, ws = torch.empty(1), _workspace(4, 6, "cpu")
    with pytest.raises(ValueError):
        softmax.forward(logits, labels.int(), loss, ws)                # labels dtype
    with pytest.raises(ValueError):
        softmax.forward(logits, labels[:3], loss, ws)                  # labels shape
    with pytest.raises(ValueError):
        softmax.forward(logits.reshape(-1), labels, loss, ws)          # logits not 2-D
    with pytest.raises(ValueError):
        softmax.forward(logits.double(), labels, loss, ws)             # logits dtype
    with pytest.raises(ValueError):
        softmax.forward(logits, labels, torch.empty(2), ws)            # loss shape
    with pytest.raises(ValueError):
        softmax.forward(logits, labels, loss, ws[:8])                  # workspace too small
    with pytest.raises(ValueError):
        softmax.forward(logits, labels, loss, torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError):
        softmax.forward(logits, labels, loss, torch.empty(40, dtype=torch.uint8)[1:])  # misaligned
    with pytest.raises(ValueError):
        softmax.backward(logits, labels, torch.empty(4, 5))            # dlogits shape
    with pytest.raises(ValueError):
        softmax.backward(logits, labels, torch.empty(6, 4).t())        # non-contiguous
    with pytest.raises(ValueError):
        softmax.backward(logits, labels, torch.empty(4, 6), scale="1")
    big = torch.randn(50)
    with pytest.raises(ValueError):
        softmax.backward(big[:24].view(4, 6), labels, big[2:26].view(4, 6))  # partial overlap


@pytest.mark.parametrize("n,k", [(32, 1000), (256, 10), (3, 5000), (1, 1)])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_cross_entropy_gpu(n, k, accumulate):
    _check(n, k, seed=k, device="cuda", accumulate=accumulate, scale=0.5)
