"""LocalResponseNorm kernels against torch float64 references; interpreter and (gpu) CUDA."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import lrn
from tinysn.kernels._common import config_count, pinned

GPU = torch.cuda.is_available()
NAN = float("nan")


def _rand(shape, seed, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device)


def _check(shape, size, alpha, beta, k, seed=0, accumulate=False, device="cpu", scale=1.0):
    x = _rand(shape, seed, device, scale)
    y = torch.full_like(x, NAN)
    p = dict(size=size, alpha=alpha, beta=beta, k=k)
    lrn.forward(x, y, **p)
    xd = x.double().requires_grad_()
    ref = F.local_response_norm(xd, size, alpha=alpha, beta=beta, k=k)
    tol = 1e-5 * size ** 0.5
    torch.testing.assert_close(y.double(), ref.detach(), rtol=tol, atol=tol)

    dy = _rand(shape, seed + 1, device)
    ref.backward(dy.double())
    ref_dx = xd.grad
    if accumulate:
        before = _rand(shape, seed + 2, device)
        dx = before.clone()
        ref_dx = before.double() + ref_dx
    else:
        dx = torch.full_like(x, NAN)
    lrn.backward(x, dy, dx, accumulate=accumulate, **p)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=tol, atol=tol)


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(1, 9), st.integers(1, 9)),
       size=st.integers(1, 7), alpha=st.floats(1e-4, 1.0), beta=st.floats(0.1, 1.5),
       k=st.floats(0.5, 3.0), seed=st.integers(0, 2**16), accumulate=st.booleans())
def test_lrn_random(shape, size, alpha, beta, k, seed, accumulate):
    _check(shape, size, alpha, beta, k, seed, accumulate)


@pytest.mark.parametrize("shape,size", [((1, 1, 1, 1), 5), ((2, 1, 3, 3), 2), ((1, 3, 1, 1), 1),
                                        ((2, 6, 3, 4), 4), ((2, 6, 3, 4), 6), ((1, 4, 2, 2), 9),
                                        ((2, 20, 5, 3), 5), ((1, 17, 2, 3), 8)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_lrn_edge(shape, size, accumulate):
    _check(shape, size, 1e-2, 0.75, 2.0, 3, accumulate)


def test_lrn_alexnet_params_large_values():
    # AlexNet's constants on large activations, where the scale really matters
    _check((2, 9, 4, 4), 5, 1e-4, 0.75, 2.0, 7, scale=30.0)
    _check((2, 9, 4, 4), 5, 1e-4, 0.75, 1.0, 8, scale=100.0)


def test_lrn_deterministic_and_workspace():
    x = _rand((2, 5, 6, 6), 1)
    dy = _rand((2, 5, 6, 6), 2)
    outs = []
    for _ in range(2):
        y, dx = torch.empty_like(x), torch.empty_like(x)
        lrn.forward(x, y, size=3, alpha=0.1, beta=0.75, k=1.0)
        lrn.backward(x, dy, dx, size=3, alpha=0.1, beta=0.75, k=1.0)
        outs.append((y, dx))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    lrn.backward(x, dy, None, size=3, alpha=0.1, beta=0.75, k=1.0)        # dx None: no-op
    assert lrn.workspace_bytes((2, 5, 6, 6)) == 0


def test_lrn_bad_input():
    x = _rand((2, 5, 6, 6), 0)
    y = torch.empty_like(x)
    p = dict(size=5, alpha=1e-4, beta=0.75, k=2.0)
    with pytest.raises(ValueError):
        lrn.forward(x, y, size=0, alpha=1e-4, beta=0.75, k=2.0)
    with pytest.raises(ValueError):
        lrn.forward(x, y, size=2.5, alpha=1e-4, beta=0.75, k=2.0)
    with pytest.raises(ValueError):
        lrn.forward(x, y, size=5, alpha=float("nan"), beta=0.75, k=2.0)
    with pytest.raises(ValueError):
        lrn.forward(x, torch.empty(2, 5, 6, 5), **p)
    with pytest.raises(ValueError):
        lrn.forward(x.view(2, 5, 36), torch.empty(2, 5, 36), **p)
    with pytest.raises(ValueError):
        lrn.forward(x.double(), y.double(), **p)
    with pytest.raises(ValueError):
        lrn.backward(x, torch.empty(2, 5, 6, 5), torch.empty_like(x), **p)
    with pytest.raises(ValueError):
        lrn.backward(x, x, torch.empty_like(x).transpose(2, 3), **p)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape,size", [((32, 96, 55, 55), 5), ((4, 256, 27, 27), 5),
                                        ((2, 7, 3, 5), 4), ((1, 1, 1, 1), 3)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_lrn_gpu(shape, size, accumulate):
    _check(shape, size, 1e-4, 0.75, 2.0, 5, accumulate, device="cuda", scale=10.0)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 40), st.integers(1, 20),
                      st.integers(1, 20)),
       size=st.integers(1, 9), alpha=st.floats(1e-4, 1.0), beta=st.floats(0.1, 1.5),
       k=st.floats(0.5, 3.0), seed=st.integers(0, 2**16), accumulate=st.booleans())
def test_lrn_random_gpu(shape, size, alpha, beta, k, seed, accumulate):
    _check(shape, size, alpha, beta, k, seed, accumulate, device="cuda")


# ----------------------------------------------------------------------------- every config

# more pixels than the largest block, more channels than the largest channel block
CONFIG_CASES = [((1, 9, 33, 33), 5), ((2, 3, 5, 7), 4)]


def _every_config(index, device):
    with pinned(lrn, index):
        for j, (shape, size) in enumerate(CONFIG_CASES):
            _check(shape, size, 1e-2, 0.75, 2.0, index, (index + j) % 2 == 1, device=device)


@pytest.mark.parametrize("index", range(config_count(lrn)))
def test_lrn_every_config(index):
    _every_config(index, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("index", range(config_count(lrn)))
def test_lrn_gpu_every_config(index):
    _every_config(index, "cuda")
