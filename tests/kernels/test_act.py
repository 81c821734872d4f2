"""ReLU kernels against torch (float64 references), on the interpreter and (marked gpu) CUDA."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import act

GPU = torch.cuda.is_available()


def _rand(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def _check(shape, seed=0, device="cpu", accumulate=False):
    x = _rand(shape, seed, device)
    dy = _rand(shape, seed + 1, device)
    y = torch.full_like(x, float("nan"))
    act.forward(x, y)
    ref_y = torch.relu(x.double())
    torch.testing.assert_close(y.double(), ref_y, rtol=0, atol=0)

    ref_dx = torch.ops.aten.threshold_backward(dy.double(), ref_y, 0.0)
    if accumulate:
        before = _rand(shape, seed + 2, device)
        dx = before.clone()
        ref_dx = before.double() + ref_dx
    else:
        dx = torch.full_like(x, float("nan"))
    act.backward(y, dy, dx, accumulate=accumulate)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-6, atol=1e-6)


def _capped(shape, limit=20000):
    """Keep hypothesis shapes small for the interpreter: drop trailing dims past `limit`."""
    while len(shape) > 1 and math.prod(shape) > limit:
        shape = shape[:-1]
    return tuple(shape)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=4).map(_capped),
       seed=st.integers(0, 2**16), accumulate=st.booleans())
def test_relu_random_shapes(shape, seed, accumulate):
    _check(tuple(shape), seed, accumulate=accumulate)


@pytest.mark.parametrize("shape", [(1,), (1, 1, 1, 1), (act.BLOCK,), (act.BLOCK + 1,),
                                   (2, 3, 29, 31), (3 * act.BLOCK - 7,)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_relu_edge_shapes(shape, accumulate):
    _check(shape, 7, accumulate=accumulate)


def test_relu_special_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -2.0])
    y = torch.full_like(x, 3.0)
    act.forward(x, y)
    assert torch.equal(y.isnan(), torch.relu(x).isnan())
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(torch.relu(x)))
    dy = torch.arange(1.0, 8.0)
    dx = torch.full_like(x, float("nan"))
    act.backward(y, dy, dx)
    assert torch.equal(dx, torch.ops.aten.threshold_backward(dy, torch.relu(x), 0.0))


def test_relu_backward_in_place_and_empty():
    y = torch.relu(_rand((5, 7), 3))
    dy = _rand((5, 7), 4)
    ref = dy * (y > 0)
    act.backward(y, dy, dy)               # dx is dy: allowed
    assert torch.equal(dy, ref)
    e = torch.empty(0, 3)
    act.forward(e, torch.empty(0, 3))
    act.backward(e, e.clone(), torch.empty(0, 3))


def test_relu_deterministic():
    x = _rand((3, 1000), 11)
    y1, y2 = torch.empty_like(x), torch.empty_like(x)
    act.forward(x, y1)
    act.forward(x, y2)
    assert torch.equal(y1, y2)
    assert act.workspace_bytes((3, 1000)) == 0


def test_relu_bad_input():
    x = _rand((4, 5), 0)
    with pytest.raises(ValueError):
        act.forward(x, torch.empty(4, 6))                           # shape mismatch
    with pytest.raises(ValueError):
        act.forward(x.double(), torch.empty(4, 5, dtype=torch.float64))   # dtype
    with pytest.raises(ValueError):
        act.forward(x.t(), torch.empty(5, 4))                       # non-contiguous
    with pytest.raises(ValueError):
        act.forward(x, x)                                           # y aliases x
    big = _rand((10,), 0)
    with pytest.raises(ValueError):
        act.forward(big[:8], big[2:])                               # partial overlap
    with pytest.raises(ValueError):
        act.backward(x, x.clone(), torch.empty(4, 5), accumulate=1)  # accumulate not a bool
    with pytest.raises(ValueError):
        act.backward(big[:8], big[2:].clone(), big[1:9])            # dx partly overlaps y


@pytest.mark.parametrize("shape", [(32, 256, 56, 56), (3, 5, 7, 11), (act.BLOCK * 5 + 3,)])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_relu_gpu(shape, accumulate):
    _check(shape, 5, device="cuda", accumulate=accumulate)
