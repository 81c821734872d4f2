"""Max / avg pooling kernels against torch float64 references; interpreter and (gpu) CUDA."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import pool
from tinysn.kernels._common import config_count, pinned

GPU = torch.cuda.is_available()
NAN = float("nan")


def _rand(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def _torch_pool(x, mode, kernel, stride, padding):
    if mode == "max":
        return F.max_pool2d(x, kernel, stride, padding)
    return F.avg_pool2d(x, kernel, stride, padding)          # count_include_pad=True


def _check(shape, mode, kernel, stride, padding, seed=0, accumulate=False, device="cpu"):
    x = _rand(shape, seed, device)
    oshape = pool.out_shape(shape, kernel, stride, padding)
    y = torch.full(oshape, NAN, device=device)
    pool.forward(x, y, mode=mode, kernel=kernel, stride=stride, padding=padding)
    xd = x.double().requires_grad_()
    ref = _torch_pool(xd, mode, kernel, stride, padding)
    assert tuple(ref.shape) == oshape
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    tol = 1e-5 * (kh * kw) ** 0.5
    torch.testing.assert_close(y.double(), ref.detach(), rtol=tol, atol=tol)

    dy = _rand(oshape, seed + 1, device)
    ref.backward(dy.double())
    ref_dx = xd.grad
    before = _rand(shape, seed + 2, device) if accumulate else torch.full_like(x, NAN)
    if accumulate:
        ref_dx = before.double() + ref_dx
    dx = before.clone()
    pool.backward(x, y, dy, dx, mode=mode, kernel=kernel, stride=stride, padding=padding,
                  accumulate=accumulate)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=tol, atol=tol)
    size = pool.argmax_workspace_bytes(shape, mode=mode, kernel=kernel, stride=stride,
                                       padding=padding)
    if size:       # the argmaxes found once into a workspace (poisoned): the same bits
        ws = torch.full((size + 3,), 0xAB, dtype=torch.uint8, device=device)
        dx_ws = before.clone()
        pool.backward(x, None, dy, dx_ws, mode=mode, kernel=kernel, stride=stride,
                      padding=padding, accumulate=accumulate, workspace=ws)
        assert torch.equal(dx_ws, dx)
    # x as a ReLU's output: dx goes on through that ReLU's backward in the store, the same
    # bits as the ReLU's own backward after the pool's
    for ws in ([None, ws] if size else [None]):
        masked = before.clone()
        pool.backward(x, None, dy, masked, mode=mode, kernel=kernel, stride=stride,
                      padding=padding, accumulate=accumulate, x_is_relu_output=True,
                      workspace=ws)
        assert torch.equal(masked, torch.where(x <= 0, 0.0, dx))
    if pool.argmax_bytes(shape, mode=mode, kernel=kernel, stride=stride, padding=padding):
        _check_stored_argmax(x, y, dy, dx, before, kernel, stride, padding, accumulate)


def _check_stored_argmax(x, y, dy, dx, before, kernel, stride, padding, accumulate):
    """The forward's argmax bytes (into a poisoned buffer) are torch's indices and the
    maximum's sign; the backward from them reads no x (None), but for a ReLU mask under
    accumulate, and gives the bits of the backward that finds them in x."""
    kw_ = dict(mode="max", kernel=kernel, stride=stride, padding=padding)
    arg = torch.full(y.shape, 0xAB, dtype=torch.uint8, device=x.device)
    y2 = torch.full_like(y, NAN)
    pool.forward(x, y2, argmax=arg, **kw_)
    assert torch.equal(y2.view(torch.int32), y.view(torch.int32))      # NaNs too
    _, index = F.max_pool2d(x.cpu(), kernel, stride, padding, return_indices=True)
    assert torch.equal(_input_index(arg.cpu() % 128, x.shape, kernel, stride, padding), index)
    assert torch.equal(arg.cpu() >= 128, y.cpu() <= 0)
    got = before.clone()
    pool.backward(None, None, dy, got, accumulate=accumulate, argmax=arg, **kw_)
    assert torch.equal(got, dx)
    masked = before.clone()
    pool.backward(x if accumulate else None, None, dy, masked, accumulate=accumulate,
                  argmax=arg, x_is_relu_output=True, **kw_)
    assert torch.equal(masked, torch.where(x <= 0, 0.0, dx))


def _input_index(tap, x_shape, kernel, stride, padding):
    """torch's max-pool index (h * W + w in the input plane) of each window's tap."""
    kh, kw, sh, sw, ph, pw = pool._params(kernel, stride, padding)
    oh = torch.arange(tap.shape[2])[:, None]
    ow = torch.arange(tap.shape[3])[None, :]
    t = tap.long()
    return (oh * sh - ph + t // kw) * x_shape[3] + ow * sw - pw + t % kw


@st.composite
def pool_cases(draw, max_hw=9, max_k=4):
    n = draw(st.integers(1, 4), label="n")
    c = draw(st.integers(1, 7), label="c")
    h = draw(st.integers(1, max_hw), label="h")
    w = draw(st.integers(1, max_hw), label="w")
    kh = draw(st.integers(1, max_k), label="kh")
    kw = draw(st.one_of(st.just(kh), st.integers(1, max_k)), label="kw")
    sh = draw(st.integers(1, 3), label="sh")
    sw = draw(st.one_of(st.just(sh), st.integers(1, 3)), label="sw")
    ph = draw(st.integers(0, kh // 2), label="ph")
    pw = draw(st.integers(0, kw // 2), label="pw")
    assume(h + 2 * ph >= kh and w + 2 * pw >= kw)
    kernel = kh if kh == kw else (kh, kw)
    stride = sh if sh == sw else (sh, sw)
    padding = ph if ph == pw else (ph, pw)
    return (n, c, h, w), kernel, stride, padding


@settings(max_examples=120, deadline=None)
@given(case=pool_cases(), mode=st.sampled_from(["max", "avg"]), seed=st.integers(0, 2**16),
       accumulate=st.booleans())
def test_pool_random(case, mode, seed, accumulate):
    shape, kernel, stride, padding = case
    _check(shape, mode, kernel, stride, padding, seed, accumulate)


EDGE = [
    ((1, 1, 1, 1), 1, 1, 0),            # 1x1 image
    ((2, 3, 1, 1), 3, 2, 1),            # 1x1 image, kernel = padded input
    ((1, 1, 5, 5), 5, 1, 0),            # kernel as large as the input (global pooling)
    ((2, 2, 4, 6), (6, 8), 3, (1, 1)),  # kernel as large as the padded input, rectangular
    ((1, 1, 9, 9), 3, 2, 1),            # single channel, ResNet stem pool
    ((2, 5, 7, 7), 7, 7, 0),            # ResNet's global 7x7 avg pool
    ((3, 2, 8, 8), 2, 2, 0),            # VGG pool (windows tile the input)
    ((1, 3, 7, 5), 1, 3, 0),            # stride > kernel: pixels in no window get 0
    ((2, 2, 6, 7), (3, 1), (1, 2), (1, 0)),
    ((1, 2, 9, 8), 4, 1, 2),
    ((1, 2, 5, 131), 3, 2, 1),          # rows wider than the argmax gather's 128 columns
]


@pytest.mark.parametrize("case", EDGE)
@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_pool_edge(case, mode, accumulate):
    shape, kernel, stride, padding = case
    _check(shape, mode, kernel, stride, padding, 3, accumulate)


@pytest.mark.parametrize("kernel,stride,padding,size", [
    (3, 2, 1, 7), (3, 1, 1, 7), (2, 2, 0, 7), (4, 3, 2, 7), (5, 5, 0, 7),
    (2, 2, 0, 8)])          # windows that tile the input (_pool_tiles_bwd_kernel)
def test_max_pool_ties_and_nan_match_torch(kernel, stride, padding, size):
    # Ties: the first maximum in scan order gets the gradient, as in torch (so the result is
    # bitwise torch's, float32 against float32). NaN propagates, and of two NaNs in a window
    # the later in scan order gets the gradient; -inf windows still pick their first
    # in-image cell.
    g = torch.Generator().manual_seed(kernel * 10 + stride)
    x = torch.randint(0, 3, (2, 3, size, size), generator=g).float()
    x[0, 0, 2, 3] = NAN
    x[0, 1, 2, 2] = x[0, 1, 3, 3] = NAN
    x[1, 2, 0, 0] = NAN
    x[1, 1] = float("-inf")
    x[1, 0, 4, 4] = float("-inf")
    oshape = pool.out_shape(x.shape, kernel, stride, padding)
    y = torch.empty(oshape)
    pool.forward(x, y, mode="max", kernel=kernel, stride=stride, padding=padding)
    xr = x.clone().requires_grad_()
    ref = F.max_pool2d(xr, kernel, stride, padding)
    dy = torch.randn(oshape, generator=g)
    ref.backward(dy)
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y.nan_to_num(), ref.detach().nan_to_num())
    dx = torch.full_like(x, NAN)
    pool.backward(x, y, dy, dx, mode="max", kernel=kernel, stride=stride, padding=padding)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-6, atol=1e-6)
    # the argmax bytes pick torch's pixels, and flag the windows whose maximum is <= 0
    # (zeros, -inf; NaN not), here where ties and NaNs are common (where a backward can
    # gather them: not 4x4/3)
    if pool.argmax_bytes(x.shape, mode="max", kernel=kernel, stride=stride, padding=padding):
        _check_stored_argmax(x, y, dy, dx, torch.full_like(x, NAN), kernel, stride, padding,
                             False)


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool_int64_index_path(monkeypatch, mode):
    # tensors over 2**31 elements switch the index math to int64; force it on a small one
    monkeypatch.setattr(pool, "_INT32_LIMIT", 0)
    _check((2, 3, 9, 8), mode, 3, 2, 1, 4, accumulate=True)
    _check((2, 3, 5, 5), mode, 5, 5, 0, 5)            # global path


def test_max_backward_does_not_read_y():
    x = _rand((2, 3, 9, 9), 1)
    dy = _rand((2, 3, 5, 5), 2)
    dx1 = torch.empty_like(x)
    dx2 = torch.empty_like(x)
    y = torch.empty(2, 3, 5, 5)
    pool.forward(x, y, mode="max", kernel=3, stride=2, padding=1)
    pool.backward(x, y, dy, dx1, mode="max", kernel=3, stride=2, padding=1)
    pool.backward(x, torch.full_like(y, NAN), dy, dx2, mode="max", kernel=3, stride=2, padding=1)
    assert torch.equal(dx1, dx2)
    pool.backward(x, y, dy, None, mode="max", kernel=3, stride=2, padding=1)   # dx None: no-op


@pytest.mark.parametrize("h,w,kernel,stride,padding",
                         [(7, 7, 3, 2, 1), (5, 9, (2, 3), (1, 2), (1, 0)), (4, 4, 4, 4, 0),
                          (3, 3, 3, 1, 1), (9, 4, 3, 3, 0)])
def test_out_shape_matches_torch(h, w, kernel, stride, padding):
    ref = F.max_pool2d(torch.zeros(2, 3, h, w), kernel, stride, padding).shape
    assert pool.out_shape((2, 3, h, w), kernel, stride, padding) == tuple(ref)


def test_pool_deterministic_and_workspace():
    x = _rand((2, 3, 11, 11), 4)
    dy = _rand((2, 3, 5, 5), 5)
    outs = []
    for _ in range(2):
        y = torch.empty(2, 3, 5, 5)
        dx = torch.empty_like(x)
        pool.forward(x, y, mode="avg", kernel=3, stride=2, padding=0)
        pool.backward(x, y, dy, dx, mode="avg", kernel=3, stride=2, padding=0)
        outs.append((y, dx))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert pool.workspace_bytes((2, 3, 11, 11), 3, 2, 0) == 0
    kw = dict(kernel=3, stride=2, padding=0)
    assert pool.argmax_workspace_bytes((2, 3, 11, 11), mode="max", **kw) == 2 * 3 * 5 * 5
    assert pool.argmax_workspace_bytes((2, 3, 11, 11), mode="avg", **kw) == 0
    assert pool.argmax_workspace_bytes((1, 1, 17, 17), mode="max", kernel=17, stride=1,
                                       padding=0) == 0                  # 289 taps
    assert pool.argmax_workspace_bytes((1, 1, 12, 12), mode="max", kernel=(12, 11),
                                       stride=1, padding=0) == 0        # 132: over 128
    # windows that do not overlap: the gather's own scan reads x once; no argmax pass
    assert pool.argmax_workspace_bytes((2, 3, 12, 12), mode="max", kernel=2, stride=2,
                                       padding=0) == 0
    assert pool.argmax_workspace_bytes((2, 3, 12, 12), mode="max", kernel=(3, 2),
                                       stride=(2, 2), padding=0) == 2 * 3 * 5 * 6


def test_max_backward_workspace_bad_input():
    x, dy = _rand((2, 3, 7, 7), 0), _rand((2, 3, 3, 3), 1)
    kw = dict(kernel=3, stride=2, padding=0)
    ws = torch.empty(2 * 3 * 3 * 3, dtype=torch.uint8)
    pool.backward(x, None, dy, torch.empty_like(x), mode="max", workspace=ws, **kw)   # valid
    for mode, bad in (("max", ws[:-1]),                         # one byte short
                      ("max", ws.view(2, -1)),                  # not 1-D
                      ("avg", ws)):                             # avg takes none
        with pytest.raises(ValueError):
            pool.backward(x, None, dy, torch.empty_like(x), mode=mode, workspace=bad, **kw)


def test_pool_bad_input():
    x = _rand((2, 3, 6, 6), 0)
    y = torch.empty(2, 3, 3, 3)
    with pytest.raises(ValueError):
        pool.out_shape((2, 3, 6, 6), 3, 2, 2)              # padding > kernel // 2
    with pytest.raises(ValueError):
        pool.out_shape((2, 3, 2, 2), 5, 1, 1)              # kernel > padded input
    with pytest.raises(ValueError):
        pool.out_shape((2, 3, 6, 6), 0, 1, 0)
    with pytest.raises(ValueError):
        pool.out_shape((2, 3, 6, 6), 2, 0, 0)
    with pytest.raises(ValueError):
        pool.out_shape((2, 3, 6, 6), (2, 2, 2), 1, 0)
    with pytest.raises(ValueError):
        pool.out_shape((3, 6, 6), 2, 2, 0)                 # not NCHW
    with pytest.raises(ValueError):
        pool.forward(x, y, mode="min", kernel=2, stride=2, padding=0)
    with pytest.raises(ValueError):
        pool.forward(x, torch.empty(2, 3, 2, 2), mode="max", kernel=2, stride=2, padding=0)
    with pytest.raises(ValueError):
        pool.forward(x.double(), y, mode="max", kernel=2, stride=2, padding=0)
    with pytest.raises(ValueError):
        pool.forward(x.transpose(2, 3), y, mode="avg", kernel=2, stride=2, padding=0)
    with pytest.raises(ValueError):
        pool.backward(x, y, torch.empty(2, 3, 3, 4), torch.empty_like(x), mode="max",
                      kernel=2, stride=2, padding=0)
    with pytest.raises(ValueError):
        pool.backward(x, y, torch.empty_like(y), torch.empty(2, 3, 6, 5), mode="avg",
                      kernel=2, stride=2, padding=0)
    dx = torch.full_like(x, 7.0)
    with pytest.raises(ValueError, match="x_is_relu_output must be a bool"):
        pool.backward(x, y, torch.empty_like(y), dx, mode="max", kernel=2, stride=2,
                      padding=0, x_is_relu_output=1)
    with pytest.raises(ValueError, match="through a ReLU"):
        pool.backward(None, y, torch.empty_like(y), dx, mode="avg", kernel=2, stride=2,
                      padding=0, x_is_relu_output=True)
    assert (dx == 7.0).all()


def test_pool_argmax_bad_input():
    """A wrong argmax tensor, or x missing where it is still read, is refused before any
    launch: y, the argmax and dx keep their bytes."""
    x, dy = _rand((2, 3, 7, 7), 0), _rand((2, 3, 3, 3), 1)
    kw = dict(kernel=3, stride=2, padding=0)
    arg = torch.full((2, 3, 3, 3), 5, dtype=torch.uint8)
    y, dx = torch.full((2, 3, 3, 3), 7.0), torch.full_like(x, 7.0)
    for mode, bad, match in (
            ("max", arg.view(-1), "shape"), ("max", arg.to(torch.int32), "uint8"),
            ("max", arg.transpose(2, 3), "contiguous"), ("avg", arg, "average")):
        with pytest.raises(ValueError, match=match):
            pool.forward(x, y, mode=mode, argmax=bad, **kw)
        with pytest.raises(ValueError, match=match):
            pool.backward(None, None, dy, dx, mode=mode, argmax=bad, **kw)
    with pytest.raises(ValueError, match="more taps than an argmax byte"):
        pool.forward(torch.zeros(1, 1, 12, 12), torch.zeros(1, 1, 1, 1), mode="max",
                     kernel=12, stride=1, padding=0, argmax=torch.zeros(1, 1, 1, 1,
                                                                          dtype=torch.uint8))
    with pytest.raises(ValueError, match="pass no workspace"):
        pool.backward(x, None, dy, dx, mode="max", argmax=arg,
                      workspace=torch.empty(54, dtype=torch.uint8), **kw)
    with pytest.raises(ValueError, match="where dx accumulates"):
        pool.backward(None, None, dy, dx, mode="max", argmax=arg, accumulate=True,
                      x_is_relu_output=True, **kw)
    with pytest.raises(ValueError, match="finds each window's argmax"):
        pool.backward(None, None, dy, dx, mode="max", **kw)
    assert (y == 7.0).all() and (dx == 7.0).all() and (arg == 5).all()
    assert pool.argmax_bytes((2, 3, 7, 7), mode="max", **kw) == 54
    assert pool.argmax_bytes((2, 3, 7, 7), mode="avg", **kw) == 0
    assert pool.argmax_bytes((1, 1, 12, 12), mode="max", kernel=12, stride=1, padding=0) == 0


def test_pool_argmax_bytes_only_where_a_backward_gathers_them():
    """Overlapping windows whose columns step by 3 keep no argmax bytes (the gather's column
    groups are of 1 or 2 pixels): refused in forward and backward before any launch, no
    bytes to plan; windows that tile the input keep them at any stride."""
    x, dy = _rand((2, 3, 7, 7), 0), _rand((2, 3, 2, 2), 1)
    kw = dict(mode="max", kernel=4, stride=3, padding=0)
    arg = torch.full((2, 3, 2, 2), 5, dtype=torch.uint8)
    y, dx = torch.full((2, 3, 2, 2), 7.0), torch.full_like(x, 7.0)
    with pytest.raises(ValueError, match="column strides of 1 or 2"):
        pool.forward(x, y, argmax=arg, **kw)
    with pytest.raises(ValueError, match="column strides of 1 or 2"):
        pool.backward(None, None, dy, dx, argmax=arg, **kw)
    with pytest.raises(ValueError, match="pass no workspace"):
        pool.backward(x, None, dy, dx, workspace=torch.empty(24, dtype=torch.uint8), **kw)
    assert (y == 7.0).all() and (dx == 7.0).all() and (arg == 5).all()
    assert pool.argmax_bytes(x.shape, **kw) == pool.argmax_workspace_bytes(x.shape, **kw) == 0
    assert pool.argmax_bytes((2, 3, 7, 7), mode="max", kernel=4, stride=(2, 3),
                             padding=0) == 0
    assert pool.argmax_bytes((2, 3, 7, 7), mode="max", kernel=4, stride=(3, 2),
                             padding=0) == 2 * 3 * 2 * 2
    assert pool.argmax_bytes((1, 2, 8, 8), mode="max", kernel=4, stride=4, padding=0) == 8


# ----------------------------------------------------------------------------- GPU


GPU_CASES = [
    ((32, 64, 112, 112), "max", 3, 2, 1),
    ((32, 2048, 7, 7), "avg", 7, 7, 0),
    ((4, 96, 55, 55), "max", 3, 2, 0),
    ((4, 64, 56, 56), "avg", 2, 2, 0),
    ((4, 32, 35, 35), "max", 3, 1, 1),
    ((4, 32, 35, 35), "avg", 3, 1, 1),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES + [(c[0], m, *c[1:]) for c in EDGE
                                  for m in ("max", "avg")])
@pytest.mark.parametrize("accumulate", [False, True])
def test_pool_gpu(case, accumulate):
    shape, mode, kernel, stride, padding = case
    _check(shape, mode, kernel, stride, padding, 5, accumulate, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("part", range(6))     # 60 draws as 6 tests (see below)
@settings(max_examples=10, deadline=None)
@given(case=pool_cases(max_hw=20, max_k=7), mode=st.sampled_from(["max", "avg"]),
       seed=st.integers(0, 2**16), accumulate=st.booleans())
def test_pool_random_gpu(part, case, mode, seed, accumulate):
    """Most draws are a new window shape, which compiles the pooling kernels anew, so the
    draws are split over `part`s that parallel workers take (as one test of 60 draws it was
    still running when the GPU run's 430 s limit cut it off)."""
    shape, kernel, stride, padding = case
    _check(shape, mode, kernel, stride, padding, seed, accumulate, device="cuda")


# ----------------------------------------------------------------------------- every config

# more outputs than the largest forward block and more cells than the largest backward tile
CONFIG_CASES = [((2, 3, 19, 21), "max", 3, 2, 1), ((2, 3, 19, 21), "avg", 3, 1, 1),
                ((1, 2, 40, 40), "max", 2, 2, 0)]


def _every_config(index, device):
    with pinned(pool, index):
        for j, (shape, mode, kernel, stride, padding) in enumerate(CONFIG_CASES):
            _check(shape, mode, kernel, stride, padding, index, (index + j) % 2 == 1, device)


@pytest.mark.parametrize("index", range(config_count(pool)))
def test_pool_every_config(index):
    _every_config(index, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("index", range(config_count(pool)))
def test_pool_gpu_every_config(index):
    _every_config(index, "cuda")
