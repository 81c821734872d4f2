"""Join kernels (add, concat) against torch float64 references; interpreter and (gpu) CUDA."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import act, join
from tinysn.kernels._common import config_count, pinned

GPU = torch.cuda.is_available()

NAN = float("nan")


def _rand(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def _check_add(shape, k, seed, acc_flags, none_mask, device="cpu", relu=False):
    """The add (with `relu`: and the ReLU fused into it) against float64, and where it has
    a ReLU, bitwise against the add and kernels/act.py's ReLU run apart."""
    xs = [_rand(shape, seed + i, device) for i in range(k)]
    y = torch.full(shape, NAN, device=device)
    join.add_forward(xs, y, relu=relu)
    ref = xs[0].double()
    for x in xs[1:]:
        ref = ref + x.double()
    tol = 1e-6 * k ** 0.5
    torch.testing.assert_close(y.double(), ref.clamp(min=0) if relu else ref, rtol=tol,
                               atol=tol)
    if relu:
        _check_add_relu_is_the_pair(xs, y, acc_flags, none_mask, seed)

    dy = _rand(shape, seed + 100, device)
    g = dy.double() * (y > 0) if relu else dy.double()
    dxs, refs = [], []
    for i in range(k):
        if none_mask[i]:
            dxs.append(None)
            refs.append(None)
        elif acc_flags[i]:
            before = _rand(shape, seed + 200 + i, device)
            dxs.append(before.clone())
            refs.append(before.double() + g)
        else:
            dxs.append(torch.full(shape, NAN, device=device))
            refs.append(g)
    join.add_backward(dy, dxs, accumulate=list(acc_flags), y=y if relu else None)
    for d, r in zip(dxs, refs):
        if d is not None:
            torch.testing.assert_close(d.double(), r, rtol=1e-6, atol=1e-6)


def _check_add_relu_is_the_pair(xs, y, acc_flags, none_mask, seed):
    """The fused add and ReLU give the bits of the add, then kernels/act.py's ReLU (forward;
    backward: the ReLU's dx, then the add's fan-out of it)."""
    s, r = torch.empty_like(y), torch.empty_like(y)
    join.add_forward(xs, s)
    act.forward(s, r)
    assert torch.equal(y, r)
    dy = _rand(y.shape, seed + 300, y.device)
    dy[y <= 0] = -0.0 if seed % 2 else 0.0          # zeros of either sign, kept or masked
    starts = [_rand(y.shape, seed + 400 + i, y.device) for i in range(len(xs))]
    fused = [None if skip else t.clone() for t, skip in zip(starts, none_mask)]
    apart = [None if skip else t.clone() for t, skip in zip(starts, none_mask)]
    join.add_backward(dy, fused, accumulate=list(acc_flags), y=y)
    g = torch.empty_like(dy)
    act.backward(y, dy, g)
    join.add_backward(g, apart, accumulate=list(acc_flags))
    for a, b in zip(fused, apart):
        assert a is None or torch.equal(a, b)


def _check_concat(n, chans, h, w, seed, acc_flags, none_mask, device="cpu"):
    xs = [_rand((n, c, h, w), seed + i, device) for i, c in enumerate(chans)]
    y = torch.full((n, sum(chans), h, w), NAN, device=device)
    join.concat_forward(xs, y)
    assert torch.equal(y, torch.cat(xs, dim=1))

    dy = _rand(y.shape, seed + 100, device)
    dxs, refs = [], []
    c0 = 0
    for i, c in enumerate(chans):
        part = dy[:, c0:c0 + c].double()
        c0 += c
        if none_mask[i]:
            dxs.append(None)
            refs.append(None)
        elif acc_flags[i]:
            before = _rand((n, c, h, w), seed + 200 + i, device)
            dxs.append(before.clone())
            refs.append(before.double() + part)
        else:
            dxs.append(torch.full((n, c, h, w), NAN, device=device))
            refs.append(part)
    join.concat_backward(dy, dxs, accumulate=list(acc_flags), channels=list(chans))
    for d, r in zip(dxs, refs):
        if d is not None:
            torch.testing.assert_close(d.double(), r, rtol=1e-6, atol=1e-6)


shapes = st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(1, 9), st.integers(1, 9))


@settings(max_examples=50, deadline=None)
@given(shape=shapes, k=st.integers(2, 9), seed=st.integers(0, 2**16), data=st.data())
def test_add_random(shape, k, seed, data):
    acc = data.draw(st.lists(st.booleans(), min_size=k, max_size=k), label="accumulate")
    none = data.draw(st.lists(st.booleans(), min_size=k, max_size=k), label="none")
    _check_add(shape, k, seed, acc, none, relu=data.draw(st.booleans(), label="relu"))


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 4), chans=st.lists(st.integers(1, 7), min_size=1, max_size=5),
       h=st.integers(1, 9), w=st.integers(1, 9), seed=st.integers(0, 2**16), data=st.data())
def test_concat_random(n, chans, h, w, seed, data):
    k = len(chans)
    acc = data.draw(st.lists(st.booleans(), min_size=k, max_size=k), label="accumulate")
    none = data.draw(st.lists(st.booleans(), min_size=k, max_size=k), label="none")
    _check_concat(n, chans, h, w, seed, acc, none)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 1, 1, 1025), (3, 5, 17, 19)])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_add_edge(shape, accumulate, relu):
    _check_add(shape, 2, 3, [accumulate] * 2, [False, False], relu=relu)
    _check_add(shape, 5, 4, [accumulate] * 5, [False, True, False, False, False], relu=relu)


def test_add_relu_keeps_nan_and_masks_through_one_pass_of_several():
    """A NaN sum stays NaN (as torch.relu); with more inputs than one launch sums, the ReLU
    goes on the final sum alone, and more outputs than one launch writes (the first over
    dy, as the planner may hand it dy's block) are all masked alike."""
    xs = [_rand((2, 3, 4, 4), i) for i in range(6)]
    xs[2][0, 0, 0, 0] = NAN
    y = torch.empty(2, 3, 4, 4)
    join.add_forward(xs, y, relu=True)
    assert torch.isnan(y[0, 0, 0, 0])
    ref = xs[0] + xs[1]
    for x in xs[2:]:
        ref = ref + x
    assert torch.equal(y[1:], ref.clamp(min=0)[1:])
    dy = _rand(y.shape, 9)
    masked = torch.where(y <= 0, 0.0, dy)
    outs = [dy] + [torch.full_like(dy, NAN) for _ in range(5)]
    join.add_backward(dy, outs, y=y)
    assert all(torch.equal(d, masked) for d in outs)


@pytest.mark.parametrize("accumulate", [False, True])
def test_concat_edge(accumulate):
    _check_concat(1, [1], 1, 1, 1, [accumulate], [False])
    _check_concat(2, [1, 1, 1], 1, 1, 2, [accumulate] * 3, [False] * 3)
    _check_concat(3, [40, 3], 7, 5, 3, [accumulate, not accumulate], [False, False])


def test_add_order_and_scalar_accumulate():
    # the sum is a left fold x0 + x1 + x2 + ... (bitwise equal to torch's float32 fold)
    xs = [_rand((2, 3, 5, 5), 10 + i) * 10 ** (i % 3) for i in range(7)]
    y = torch.empty(2, 3, 5, 5)
    join.add_forward(xs, y)
    ref = xs[0] + xs[1]
    for x in xs[2:]:
        ref = ref + x
    assert torch.equal(y, ref)
    dy = _rand((2, 3, 5, 5), 1)
    d = [_rand((2, 3, 5, 5), 2), _rand((2, 3, 5, 5), 3)]
    before = [t.clone() for t in d]
    join.add_backward(dy, d, accumulate=True)
    for t, b in zip(d, before):
        assert torch.equal(t, b + dy)
    # the first gradient written over dy (the planner hands it dy's block), the other added
    ref = d[1] + dy
    join.add_backward(dy, [dy, d[1]], accumulate=[False, True])
    assert torch.equal(dy, _rand((2, 3, 5, 5), 1)) and torch.equal(d[1], ref)


def test_concat_backward_none_inferred():
    dy = _rand((2, 6, 3, 3), 5)
    a = torch.full((2, 2, 3, 3), NAN)
    join.concat_backward(dy, [a, None], accumulate=False)          # None's 4 channels inferred
    assert torch.equal(a, dy[:, :2])
    b = torch.full((2, 4, 3, 3), NAN)
    join.concat_backward(dy, [None, b], accumulate=False)
    assert torch.equal(b, dy[:, 2:])
    join.concat_backward(dy, [None, None], accumulate=False, channels=[2, 4])  # nothing to do


def test_join_deterministic_and_workspace():
    xs = [_rand((2, 3, 7, 7), i) for i in range(3)]
    y1, y2 = torch.empty(2, 3, 7, 7), torch.empty(2, 3, 7, 7)
    join.add_forward(xs, y1)
    join.add_forward(xs, y2)
    assert torch.equal(y1, y2)
    assert join.workspace_bytes((2, 3, 7, 7)) == 0


def test_join_bad_input():
    x = _rand((2, 3, 4, 4), 0)
    with pytest.raises(ValueError):
        join.add_forward([x], torch.empty_like(x))                    # one input
    with pytest.raises(ValueError):
        join.add_forward([x, _rand((2, 3, 4, 5), 1)], torch.empty_like(x))
    with pytest.raises(ValueError):
        join.add_forward([x, x.double()], torch.empty_like(x))
    with pytest.raises(ValueError):
        join.add_forward([x, x.transpose(2, 3)], torch.empty_like(x))  # not contiguous
    with pytest.raises(ValueError):
        join.add_backward(x, [torch.empty(2, 3, 4, 5)], accumulate=False)
    with pytest.raises(ValueError):
        join.add_backward(x, [torch.empty_like(x)] * 2, accumulate=[True])
    with pytest.raises(ValueError):
        join.add_backward(x, [x], accumulate=True)                    # dx aliases dy
    with pytest.raises(ValueError, match="relu must be a bool"):
        join.add_forward([x, x], torch.empty_like(x), relu=1)
    with pytest.raises(ValueError, match="y has shape"):
        join.add_backward(x, [torch.empty_like(x)], y=torch.empty(2, 3, 4, 5))
    y = torch.empty_like(x)
    with pytest.raises(ValueError, match="aliases y"):
        join.add_backward(x, [torch.empty_like(x), y], y=y)
    with pytest.raises(ValueError):
        join.concat_forward([x, x], torch.empty(2, 5, 4, 4))          # channels 6 != 5
    with pytest.raises(ValueError):
        join.concat_forward([x, _rand((2, 3, 4, 3), 1)], torch.empty(2, 6, 4, 4))
    with pytest.raises(ValueError):
        join.concat_forward([x.view(2, 3, 16)], torch.empty(2, 3, 16))
    with pytest.raises(ValueError):
        join.concat_backward(torch.empty(2, 6, 4, 4), [None, None, x], accumulate=False)
    with pytest.raises(ValueError):
        join.concat_backward(torch.empty(2, 6, 4, 4), [x, x], accumulate=False, channels=[3, 2])


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(32, 256, 56, 56), (3, 5, 17, 19), (1, 1, 1, 1)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_add_gpu(shape, accumulate):
    _check_add(shape, 2, 1, [accumulate] * 2, [False, False], device="cuda")
    _check_add(shape, 6, 2, [accumulate, False] * 3, [False] * 5 + [True], device="cuda")
    _check_add(shape, 2, 3, [accumulate, False], [False, False], device="cuda", relu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,chans,hw", [(32, [128, 128], 28), (4, [3, 64, 1], 7), (1, [1], 1)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_concat_gpu(n, chans, hw, accumulate):
    k = len(chans)
    _check_concat(n, chans, hw, hw, 1, [accumulate] * k, [False] * k, device="cuda")
    _check_concat(n, chans, hw, hw, 2, [not accumulate] * k, [True] + [False] * (k - 1),
                  device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@settings(max_examples=50, deadline=None)
@given(shape=shapes, k=st.integers(2, 9), chans=st.lists(st.integers(1, 7), min_size=1, max_size=5),
       seed=st.integers(0, 2**16), data=st.data())
def test_join_random_gpu(shape, k, chans, seed, data):
    acc = data.draw(st.lists(st.booleans(), min_size=k, max_size=k), label="accumulate")
    none = data.draw(st.lists(st.booleans(), min_size=k, max_size=k), label="none")
    _check_add(shape, k, seed, acc, none, device="cuda",
               relu=data.draw(st.booleans(), label="relu"))
    kc = len(chans)
    acc_c = (acc + [False] * kc)[:kc]
    none_c = (none + [False] * kc)[:kc]
    _check_concat(shape[0], chans, shape[2], shape[3], seed, acc_c, none_c, device="cuda")


# ----------------------------------------------------------------------------- every config

def _every_config(index, device):
    """Sums and fan-outs longer than the largest block; concat rows longer than it too."""
    with pinned(join, index):
        _check_add((2, 3, 30, 31), 5, index, [index % 2 == 1] * 5, [False] * 4 + [True],
                   device=device, relu=index % 2 == 0)
        _check_concat(2, [3, 1, 5], 30, 31, index, [False, index % 2 == 0, True],
                      [False, True, False], device=device)


@pytest.mark.parametrize("index", range(config_count(join)))
def test_join_every_config(index):
    _every_config(index, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("index", range(config_count(join)))
def test_join_gpu_every_config(index):
    _every_config(index, "cuda")
