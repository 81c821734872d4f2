"""Fully connected layer (tl.dot GEMMs) against F.linear in float64: output and every gradient."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import linear
from tinysn.kernels._common import config_count, pinned

GPU = torch.cuda.is_available()


def _rand(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def _close(out, ref, red_len, precision):
    """ieee: atol = rtol = 1e-5 * sqrt(reduction length); tf32: 2e-3 of the output's norm."""
    if precision == "tf32":
        err = (out.double() - ref).norm().item()
        assert err <= 2e-3 * ref.norm().item() + 1e-6, (err, ref.norm().item())
    else:
        tol = 1e-5 * math.sqrt(red_len)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def _check(n, f, o, *, bias=True, accumulate=False, want=("dx", "dw", "db"), seed=0,
           device="cpu", precision="ieee"):
    x, w = _rand((n, f), seed, device), _rand((o, f), seed + 1, device)
    dy = _rand((n, o), seed + 2, device)
    b = _rand((o,), seed + 3, device) if bias else None
    y = torch.full((n, o), float("nan"), device=device)
    linear.forward(x, w, b, y, precision=precision)

    xr = x.double().requires_grad_(True)
    wr = w.double().requires_grad_(True)
    br = b.double().requires_grad_(True) if bias else None
    yr = F.linear(xr, wr, br)
    yr.backward(dy.double())
    _close(y, yr.detach(), f, precision)

    nan = lambda *s: torch.full(s, float("nan"), device=device)  # noqa: E731
    dx = dw = db = None
    ref_dx = xr.grad
    if "dx" in want:
        if accumulate:
            before = _rand((n, f), seed + 4, device)
            dx = before.clone()
            ref_dx = before.double() + ref_dx
        else:
            dx = nan(n, f)
    if "dw" in want:
        dw = nan(o, f)
    if "db" in want:
        db = nan(o)
    linear.backward(x, w, dy, dx, dw, db, accumulate=accumulate, precision=precision)
    if dx is not None:
        _close(dx, ref_dx, o, precision)
    if dw is not None:
        _close(dw, wr.grad, n, precision)
    if db is not None:
        ref_db = dy.double().sum(0)
        _close(db, ref_db, n, precision)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 4), f=st.integers(1, 45), o=st.integers(1, 45), bias=st.booleans(),
       accumulate=st.booleans(),
       want=st.sampled_from([("dx", "dw", "db"), ("dx",), ("dw",), ("db",), ("dx", "db"),
                             ("dw", "db"), ()]),
       seed=st.integers(0, 2**16))
def test_linear_random(n, f, o, bias, accumulate, want, seed):
    _check(n, f, o, bias=bias, accumulate=accumulate, want=want, seed=seed)


@pytest.mark.parametrize("n,f,o", [(1, 1, 1), (1, 1, 17), (4, 33, 1), (16, 16, 16), (33, 50, 20),
                                   (2, 130, 3), (40, 7, 37)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_linear_edge_shapes(n, f, o, accumulate):
    _check(n, f, o, accumulate=accumulate, seed=n + f + o)


def test_linear_tf32_default_runs():
    _check(5, 40, 9, precision="tf32")
    _check(5, 40, 9, precision=None)            # the default: tf32


def test_linear_deterministic():
    x, w, dy = _rand((6, 70), 0), _rand((30, 70), 1), _rand((6, 30), 2)
    outs = []
    for _ in range(2):
        y, dx, dw, db = torch.empty(6, 30), torch.empty(6, 70), torch.empty(30, 70), torch.empty(30)
        linear.forward(x, w, None, y, precision="ieee")
        linear.backward(x, w, dy, dx, dw, db, precision="ieee")
        outs.append((y, dx, dw, db))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert linear.workspace_bytes(32, 2048, 1000, "forward") == 0
    assert linear.workspace_bytes(32, 2048, 1000, "backward") == 0


def test_linear_backward_needs_only_what_it_uses():
    x, w, dy = _rand((3, 20), 0), _rand((5, 20), 1), _rand((3, 5), 2)
    dx, dw, db = torch.empty(3, 20), torch.empty(5, 20), torch.empty(5)
    linear.backward(None, w, dy, dx, None, db, precision="ieee")     # no x: dx and db only
    linear.backward(x, None, dy, None, dw, None, precision="ieee")   # no w: dw only
    torch.testing.assert_close(dx, dy @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, dy.t() @ x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, dy.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("momentum,weight_decay,rate_in_memory,gated",
                         [(0.0, 0.0, False, False), (0.9, 1e-3, True, False),
                          (0.9, 0.0, False, True), (0.0, 5e-4, True, True)])
def test_linear_backward_with_update_is_dw_then_sgd_bitwise(momentum, weight_decay,
                                                           rate_in_memory, gated,
                                                           device="cpu", n=3, f=150, o=70):
    """backward(update=...) leaves w (and its momentum buffer) as backward(dw) followed by
    sgd.update(w, dw, ...) does, bit for bit, and dx and db as well: dx read w before its
    step. A bad batch's count in `skip` leaves w and the buffer as they were."""
    from tinysn.kernels import sgd
    x, dy = _rand((n, f), 0, device), _rand((n, o), 1, device)
    lr = torch.tensor([0.05], device=device) if rate_in_memory else 0.05
    skip = torch.tensor([2.0 if gated else 0.0], device=device)
    runs = []
    for fused in (False, True):
        w, buf = _rand((o, f), 2, device), _rand((o, f), 3, device) * 0.1
        dx, db = torch.empty(n, f, device=device), torch.empty(o, device=device)
        step = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                    skip=skip if gated else None)
        if fused:
            linear.backward(x, w, dy, dx, None, db, precision="ieee",
                            update=sgd.Update(buf, **step))
        else:
            dw = torch.empty(o, f, device=device)
            linear.backward(x, w, dy, dx, dw, db, precision="ieee")
            sgd.update(w, dw, buf, **step)
        runs.append((w, buf, dx, db))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    if gated:
        assert torch.equal(runs[1][0], _rand((o, f), 2, device))
    else:
        assert not torch.equal(runs[1][0], _rand((o, f), 2, device))


def test_linear_backward_update_checks_before_any_launch():
    """A fused step with dw, without x, with a buffer of the wrong shape or overlapping w,
    or a negative rate, is named before anything changes."""
    from tinysn.kernels import sgd
    x, w, dy = _rand((3, 20), 0), _rand((5, 20), 1), _rand((3, 5), 2)
    before, dx = w.clone(), torch.zeros(3, 20)
    good = sgd.Update(torch.zeros(5, 20), 0.1, 0.9, 0.0)
    for args, step, match in (
            ((x, w, dy, dx, torch.empty(5, 20), None), good, "no dw"),
            ((None, w, dy, dx, None, None), good, "no dw"),
            ((x, w, dy, dx, None, None), good._replace(momentum_buf=torch.zeros(5, 21)),
             "momentum_buf must have shape"),
            ((x, w, dy, dx, None, None), good._replace(momentum_buf=w), "overlap"),
            ((x, w, dy, dx, None, None), good._replace(momentum_buf=None), "required"),
            ((x, w, dy, dx, None, None), good._replace(lr=-0.1), "lr"),
            ((x, w, dy, w[:3], None, None), good, "overlap")):
        with pytest.raises(ValueError, match=match):
            linear.backward(*args, update=step)
        assert torch.equal(w, before) and not dx.any()


def test_linear_bad_input():
    x, w, b = _rand((3, 20), 0), _rand((5, 20), 1), _rand((5,), 2)
    y, dy = torch.empty(3, 5), _rand((3, 5), 3)
    with pytest.raises(ValueError):
        linear.forward(x, _rand((5, 21), 1), b, y)                     # feature mismatch
    with pytest.raises(ValueError):
        linear.forward(x, w, _rand((4,), 2), y)                        # bias shape
    with pytest.raises(ValueError):
        linear.forward(x, w, b, torch.empty(3, 6))                     # output shape
    with pytest.raises(ValueError):
        linear.forward(x.double(), w, b, y)                            # dtype
    with pytest.raises(ValueError):
        linear.forward(_rand((20, 3), 0).t(), w, b, y)                 # non-contiguous
    with pytest.raises(ValueError):
        linear.forward(x.view(3, 4, 5), w, b, y)                       # not [N, F]
    with pytest.raises(ValueError):
        linear.forward(x, w, b, y, precision="fp16")                   # unknown precision
    buf = torch.empty(100)
    with pytest.raises(ValueError):
        linear.forward(buf[:60].view(3, 20), w, b, buf[50:65].view(3, 5))   # y overlaps x
    with pytest.raises(ValueError):
        linear.backward(x, w, dy, torch.empty(3, 21), None, None)      # dx shape
    with pytest.raises(ValueError):
        linear.backward(x, w, dy, None, torch.empty(5, 19), None)      # dw shape
    with pytest.raises(ValueError):
        linear.backward(x, w, dy, None, None, torch.empty(6))          # db shape
    with pytest.raises(ValueError):
        linear.backward(None, w, dy, None, torch.empty(5, 20), None)   # dw needs x
    with pytest.raises(ValueError):
        linear.backward(x, w, dy, dy, None, None)                      # dx is dy (shape)
    with pytest.raises(ValueError):
        linear.backward(x, w, dy, torch.empty(3, 20), None, None, accumulate="yes")


@pytest.mark.parametrize("n,f,o", [(32, 2048, 1000), (32, 25088, 4096), (3, 45, 17),
                                   (200, 130, 70)])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_linear_gpu(n, f, o, precision, accumulate):
    _check(n, f, o, accumulate=accumulate, seed=f, device="cuda", precision=precision)
    _check(n, f, o, accumulate=accumulate, want=("db",), bias=False, seed=o, device="cuda",
           precision=precision)


# ----------------------------------------------------------------------------- every config

# every dimension larger than the largest tile's and not a multiple of any tile
CONFIG_CASES = [(37, 150, 70), (260, 45, 17), (3, 300, 270)]


@pytest.mark.parametrize("momentum,weight_decay,rate_in_memory,gated",
                         [(0.9, 1e-3, True, False), (0.9, 0.0, False, True)])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_linear_gpu_backward_with_update_is_dw_then_sgd_bitwise(momentum, weight_decay,
                                                               rate_in_memory, gated):
    """On the GPU, at VGG16's fc6 shape (its K, the batch, one block of every config), the
    fused step's bits are the SGD kernel's: the GEMM runs without fp fusion there too."""
    test_linear_backward_with_update_is_dw_then_sgd_bitwise(
        momentum, weight_decay, rate_in_memory, gated, device="cuda", n=32, f=25088, o=4096)


def _every_config(index, device, precision="ieee"):
    with pinned(linear, index):
        for j, (n, f, o) in enumerate(CONFIG_CASES):
            _check(n, f, o, accumulate=(index + j) % 2 == 1, seed=index, device=device,
                   precision=precision)


@pytest.mark.parametrize("index", range(config_count(linear)))
def test_linear_every_config(index):
    _every_config(index, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("index", range(config_count(linear)))
def test_linear_gpu_every_config(index, precision):
    _every_config(index, "cuda", precision)
