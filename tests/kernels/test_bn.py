"""Training-mode BatchNorm2d kernels against torch float64 (F.batch_norm + autograd)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from tinysn.kernels import bn

# the one-launch form's thresholds as shipped, before the `form` fixture changes them
SHIPPED_CHANNEL_FORM = {"_CHANNEL_MAX": bn._CHANNEL_MAX, "_CHANNEL_PROGRAMS": bn._CHANNEL_PROGRAMS}
GPU = torch.cuda.is_available()
NAN = float("nan")


@pytest.fixture(autouse=True, params=["three launches", "a program per channel"])
def form(request, monkeypatch):
    """Every test under both forms of the passes: the chunked statistics, merge and
    elementwise launches, and one program per channel (bn._one_program, here forced for
    every shape)."""
    if request.param == "a program per channel":
        monkeypatch.setattr(bn, "_CHANNEL_MAX", 1 << 40)
        monkeypatch.setattr(bn, "_CHANNEL_PROGRAMS", 1)
    else:
        monkeypatch.setattr(bn, "_CHANNEL_MAX", 0)
    return request.param


def _rand(shape, seed, device="cpu", scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(device)


def _workspace(shape, phase, device, dtype=torch.uint8):
    nbytes = bn.workspace_bytes(shape, phase)
    if dtype == torch.uint8:       # garbage: the kernels must not rely on its contents
        return torch.full((nbytes + 3,), 0xFF, dtype=torch.uint8, device=device)
    return torch.full((nbytes // 4 + 1,), NAN, device=device)


def _check(shape, seed=0, device="cpu", accumulate=False, update_running=True, grads="all",
           offset=0.0, scale=1.0, ws_dtype=torch.uint8, momentum=0.1):
    n, c, h, w = shape
    red = n * h * w
    x = _rand(shape, seed, device, scale, offset)
    gamma = _rand((c,), seed + 1, device)
    beta = _rand((c,), seed + 2, device)
    rmean = _rand((c,), seed + 3, device)
    rvar = _rand((c,), seed + 4, device).abs() + 0.5
    rmean0, rvar0 = rmean.clone(), rvar.clone()
    y = torch.full_like(x, NAN)
    saved = torch.full((2, c), NAN, device=device)
    ws = _workspace(shape, "forward", device, ws_dtype)
    bn.forward(x, gamma, beta, y, rmean, rvar, saved, ws, eps=1e-5, momentum=momentum, update_running=update_running)

    xd = x.double().requires_grad_()
    gd = gamma.double().requires_grad_()
    bd = beta.double().requires_grad_()
    rmd, rvd = rmean0.double(), rvar0.double()
    ref = F.batch_norm(xd, rmd, rvd, gd, bd, training=True, momentum=momentum, eps=1e-5)
    mean = xd.detach().mean((0, 2, 3))
    var = xd.detach().var((0, 2, 3), unbiased=False)
    # tolerances scale with the reduction length; an offset data set is limited by the
    # float32 resolution of x itself (ulp(offset)) times the normalisation's 1/std
    tol = 1e-5 * red ** 0.5
    xtol = tol + 2 * abs(offset) * 2.0 ** -23 / scale
    torch.testing.assert_close(y.double(), ref.detach(), rtol=tol, atol=xtol * 4)
    torch.testing.assert_close(saved[0].double(), mean, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(saved[1].double(), 1 / torch.sqrt(var + 1e-5), rtol=tol, atol=0)
    if update_running:
        torch.testing.assert_close(rmean.double(), rmd, rtol=tol, atol=tol * scale)
        torch.testing.assert_close(rvar.double(), rvd, rtol=tol, atol=tol)
    else:
        assert torch.equal(rmean, rmean0) and torch.equal(rvar, rvar0)

    dy = _rand(shape, seed + 5, device)
    ref.backward(dy.double())
    want_dx = grads in ("all", "dx")
    want_p = grads in ("all", "params")
    ref_dx = xd.grad
    if want_dx and accumulate:
        before = _rand(shape, seed + 6, device)
        dx = before.clone()
        ref_dx = before.double() + ref_dx
    else:
        dx = torch.full_like(x, NAN) if want_dx else None
    dgamma = torch.full((c,), NAN, device=device) if want_p else None
    dbeta = torch.full((c,), NAN, device=device) if want_p else None
    bn.backward(x, gamma, dy, saved, dx, dgamma, dbeta,
                _workspace(shape, "backward", device, ws_dtype), accumulate=accumulate)
    if want_dx:
        err = (dx.double() - ref_dx).abs()
        allowed = tol * ref_dx.abs() + xtol * 4 + tol * _dx_terms(xd, gd, dy.double(), mean, var)
        assert bool((err <= allowed).all()), \
            f"dx off by {float((err - allowed).max()):.3g} beyond the float32 bound"
    if want_p:
        torch.testing.assert_close(dbeta.double(), bd.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(dgamma.double(), gd.grad, rtol=tol, atol=xtol * red ** 0.5)
    return y, saved, rmean, rvar, dx, dgamma, dbeta


def _dx_terms(xd, gd, dyd, mean, var):
    """|gamma inv_std / n| (n |dy| + |dbeta| + |xhat dgamma|) per element, in float64: the
    size of the terms of dx = gamma inv_std / n (n dy - dbeta - xhat dgamma). float32 gets dx
    to a few ulps of these, not of dx: where they cancel (two values a channel, far from
    each other next to eps, leave 1 - xhat^2 = eps / (var + eps)) dx is much smaller."""
    n = xd.numel() // xd.shape[1]
    per = lambda v: v.view(1, -1, 1, 1)  # noqa: E731
    xhat = (xd.detach() - per(mean)) / per(torch.sqrt(var + 1e-5))
    dbeta = dyd.sum((0, 2, 3))
    dgamma = (dyd * xhat).sum((0, 2, 3))
    scale = per((gd.detach() / torch.sqrt(var + 1e-5) / n).abs())
    return scale * (n * dyd.abs() + per(dbeta.abs()) + (xhat * per(dgamma)).abs())


shapes = st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(1, 9), st.integers(1, 9))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])   # `form`: per test
@example(shape=(2, 5, 1, 1), seed=5, accumulate=False, update_running=False, grads="all",
         ws_dtype=torch.uint8)      # dx's terms cancel: a bound on dx alone failed it
@given(shape=shapes, seed=st.integers(0, 2**16), accumulate=st.booleans(),
       update_running=st.booleans(), grads=st.sampled_from(["all", "dx", "params"]),
       ws_dtype=st.sampled_from([torch.uint8, torch.float32]))
def test_bn_random(shape, seed, accumulate, update_running, grads, ws_dtype):
    assume(shape[0] * shape[2] * shape[3] >= 2)
    _check(shape, seed, accumulate=accumulate, update_running=update_running, grads=grads,
           ws_dtype=ws_dtype)


@pytest.mark.parametrize("shape", [
    (1, 1, 1, 2),          # N*H*W = 2, single channel
    (2, 3, 1, 1),          # 1x1 images, N*H*W = 2
    (1, 5, 2, 1),
    (4, 7, 9, 9),
    (16, 1, 32, 32),       # several row chunks per channel
    (1, 2, 128, 128),      # several column chunks per channel
    (2, 1, 128, 128),      # row and column chunks
    (3, 2, 45, 50),        # ragged tiles
])
@pytest.mark.parametrize("accumulate", [False, True])
def test_bn_edge(shape, accumulate):
    _check(shape, 11, accumulate=accumulate)


@pytest.mark.parametrize("offset,scale", [(100.0, 1.0), (1e4, 1.0), (-3e3, 0.01)])
def test_bn_large_mean_is_stable(offset, scale):
    # E[x^2] - E[x]^2 in float32 would lose every digit of the variance here
    _check((4, 3, 12, 12), 5, offset=offset, scale=scale)
    _check((2, 1, 100, 100), 6, offset=offset, scale=scale)


@triton.jit
def _tile_owner_kernel(out, N, C, HW, R: tl.constexpr, COLS: tl.constexpr,
                       LAST_FIRST: tl.constexpr):
    """out[n, c, hw] = the program whose bn._elementwise_tile holds that element."""
    rows, rm, c, cols = bn._elementwise_tile(N, C, HW, R, COLS, LAST_FIRST)
    m = rm[:, None] & (cols < HW)[None, :]
    owner = tl.zeros([R, COLS], tl.int32) + tl.program_id(0)
    tl.store(out + (rows * HW)[:, None] + cols[None, :], owner, mask=m)


@pytest.mark.parametrize("shape", [(3, 5, 2, 3), (2, 3, 40, 40), (4, 20, 7, 7)])
@pytest.mark.parametrize("last_first", [False, True])
def test_bn_elementwise_tiles_cover_each_element_once_channel_block_by_block(shape,
                                                                             last_first):
    n, c, h, w = shape
    grid, r, cols = bn._elementwise_grid(n, c, h * w)
    out = torch.full(shape, -1, dtype=torch.int32)
    _tile_owner_kernel[grid](out, n, c, h * w, R=r, COLS=cols, LAST_FIRST=last_first)
    owners = out.permute(1, 0, 2, 3).reshape(c, -1)           # [channel, n * hw]
    assert (owners >= 0).all()                                 # every element written
    assert len(torch.unique(out)) == grid[0]                   # by every program, once
    lowest, highest = owners.min(dim=1).values, owners.max(dim=1).values
    visited = range(c - 1, -1, -1) if last_first else range(c)
    assert lowest[visited[0]] == 0                             # the pass starts there
    for a, b in zip(visited, visited[1:]):                     # block by block: a block's
        same = lowest[a] == lowest[b] and highest[a] == highest[b]  # programs all before
        assert same or highest[a] < lowest[b]                  # the next block's


@pytest.mark.parametrize("shape", [(3, 5, 7, 7), (2, 3, 33, 40)])
def test_bn_channel_order_of_the_elementwise_passes_changes_no_bit(shape, monkeypatch):
    c = shape[1]
    x, gamma, beta, dy = _rand(shape, 1), _rand((c,), 2), _rand((c,), 3), _rand(shape, 4)
    got = []
    for last_first in (False, True):
        monkeypatch.setattr(bn, "_LAST_FIRST", last_first)
        y, dx, saved = torch.empty_like(x), torch.empty_like(x), torch.empty(2, c)
        bn.forward(x, gamma, beta, y, torch.zeros(c), torch.ones(c), saved,
                   _workspace(shape, "forward", "cpu"), relu=True, residual=dy)
        bn.backward(x, gamma, dy, saved, dx, None, None, _workspace(shape, "backward", "cpu"))
        got.append((y, dx))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_bn_recompute_gives_same_bits():
    shape = (3, 4, 7, 7)
    x = _rand(shape, 1)
    gamma, beta = _rand((4,), 2), _rand((4,), 3)
    rm, rv = torch.zeros(4), torch.ones(4)
    y1, y2 = torch.empty_like(x), torch.full_like(x, NAN)
    s1, s2 = torch.empty(2, 4), torch.full((2, 4), NAN)
    ws = _workspace(shape, "forward", "cpu")
    bn.forward(x, gamma, beta, y1, rm, rv, s1, ws)
    rm1, rv1 = rm.clone(), rv.clone()
    bn.forward(x, gamma, beta, y2, rm, rv, s2, ws, update_running=False)
    assert torch.equal(y1, y2) and torch.equal(s1, s2)
    assert torch.equal(rm, rm1) and torch.equal(rv, rv1)
    bn.forward(x, gamma, beta, y2, None, None, s2, ws, update_running=False)   # stats not needed
    assert torch.equal(y1, y2)
    dy = _rand(shape, 4)
    outs = []
    for _ in range(2):
        dx, dg, db = torch.empty_like(x), torch.empty(4), torch.empty(4)
        bn.backward(x, gamma, dy, s1, dx, dg, db, _workspace(shape, "backward", "cpu"))
        outs.append((dx, dg, db))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    bn.backward(x, gamma, dy, s1, None, None, None, _workspace(shape, "backward", "cpu"))


@pytest.mark.parametrize("shape", [(3, 4, 7, 7), (2, 5, 33, 40)])
def test_bn_rebuild_from_saved_statistics_gives_the_forward_bits(shape):
    _check_rebuild(shape, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(32, 64, 112, 112), (32, 256, 56, 56), (32, 2048, 7, 7),
                                   (3, 5, 17, 19)])
def test_bn_rebuild_on_the_gpu_gives_the_forward_bits(shape):
    """The forward normalises with the statistics its programs merge in registers, a
    rebuild with those it stored: the same floats, so the same bits, if the compiler keeps
    inv_std as computed (no reassociation of 1 / sqrt into the scale)."""
    _check_rebuild(shape, "cuda")


def _check_rebuild(shape, device):
    c = shape[1]
    x, gamma, beta = _rand(shape, 5, device), _rand((c,), 6, device), _rand((c,), 7, device)
    rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
    saved, y = torch.empty(2, c, device=device), torch.empty_like(x)
    bn.forward(x, gamma, beta, y, rm, rv, saved, _workspace(shape, "forward", device))
    kept = (saved.clone(), rm.clone(), rv.clone())
    again = torch.full_like(x, NAN)
    bn.rebuild(x, gamma, beta, again, saved)
    assert torch.equal(again, y)
    assert all(torch.equal(a, b) for a, b in zip(kept, (saved, rm, rv)))   # nothing else written


def test_bn_rebuild_bad_input():
    shape = (2, 3, 4, 4)
    x, g, b = _rand(shape, 0), torch.ones(3), torch.zeros(3)
    y, s = torch.empty_like(x), torch.ones(2, 3)
    bn.rebuild(x, g, b, y, s)                             # the valid call
    for args in ((x, g, b, y, torch.ones(3, 2)),          # saved's shape
                 (x, torch.ones(4), b, y, s),             # gamma's length
                 (x, g, b, torch.empty(2, 3, 4, 5), s),   # y's shape
                 (torch.ones(1, 3, 1, 1), g, b, torch.empty(1, 3, 1, 1), s)):   # 1 value
        with pytest.raises(ValueError):
            bn.rebuild(*args)


@pytest.mark.parametrize("shape", [(3, 4, 7, 7), (2, 5, 33, 40)])
def test_bn_backward_in_place_gives_same_bits(shape):
    """dx written over dy (the planner hands dy's block to dx) equals dx written apart."""
    c = shape[1]
    x, gamma, beta = _rand(shape, 1), _rand((c,), 2), _rand((c,), 3)
    saved = torch.empty(2, c)
    bn.forward(x, gamma, beta, torch.empty_like(x), torch.zeros(c), torch.ones(c), saved,
               _workspace(shape, "forward", "cpu"))
    dy = _rand(shape, 4)
    apart, dg, db = torch.full_like(x, NAN), torch.empty(c), torch.empty(c)
    bn.backward(x, gamma, dy, saved, apart, dg, db, _workspace(shape, "backward", "cpu"))
    over, dg2, db2 = dy.clone(), torch.empty(c), torch.empty(c)
    bn.backward(x, gamma, over, saved, over, dg2, db2, _workspace(shape, "backward", "cpu"))
    assert torch.equal(over, apart) and torch.equal(dg2, dg) and torch.equal(db2, db)
    with pytest.raises(ValueError, match="cannot accumulate"):
        bn.backward(x, gamma, over, saved, over, None, None,
                    _workspace(shape, "backward", "cpu"), accumulate=True)
    flat = torch.zeros(2 * x.numel())     # dx half over dy: neither apart nor in place
    with pytest.raises(ValueError, match="overlaps dy"):
        bn.backward(x, gamma, flat[:x.numel()].view(shape), saved,
                    flat[x.numel() // 2:][:x.numel()].view(shape), None, None,
                    _workspace(shape, "backward", "cpu"))


def test_the_shipped_thresholds_give_resnet50s_14x14_and_7x7_stages_one_launch(monkeypatch):
    """At batch 32 the 14x14 and 7x7 stages' batch norms take the one-program form (the
    H100 sweep's pick); the 28x28 stage, the 56x56 one and the stem take three launches."""
    for name, value in SHIPPED_CHANNEL_FORM.items():
        monkeypatch.setattr(bn, name, value)
    one = {(c, hw): bn._one_program(32, c, hw * hw) for c, hw in
           [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14),
            (512, 7), (2048, 7)]}
    assert [k for k, v in one.items() if v] == [(256, 14), (1024, 14), (512, 7), (2048, 7)]


def test_bn_workspace_bytes():
    for shape in [(1, 1, 1, 2), (32, 64, 112, 112), (32, 256, 56, 56), (32, 2048, 7, 7)]:
        f = bn.workspace_bytes(shape, "forward")
        b = bn.workspace_bytes(shape, "backward")
        assert f > 0 and b > 0 and f % 4 == 0 and b % 4 == 0
        assert f <= 3 * 4 * shape[1] * 2048 and b <= 2 * 4 * shape[1] * 2049
    with pytest.raises(ValueError):
        bn.workspace_bytes((2, 3, 4, 4), "sideways")
    with pytest.raises(ValueError):
        bn.workspace_bytes((2, 3, 4), "forward")


def test_bn_bad_input():
    shape = (2, 3, 4, 4)
    x = _rand(shape, 0)
    g, b = torch.ones(3), torch.zeros(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    y, s = torch.empty_like(x), torch.empty(2, 3)
    ws = _workspace(shape, "forward", "cpu")
    bn.forward(x, g, b, y, rm, rv, s, ws)            # the valid call
    with pytest.raises(ValueError):                   # one value per channel
        bn.forward(torch.ones(1, 3, 1, 1), g, b, torch.empty(1, 3, 1, 1), rm, rv, s,
                   _workspace((1, 3, 1, 1), "forward", "cpu"))
    with pytest.raises(ValueError):
        bn.forward(x, torch.ones(4), b, y, rm, rv, s, ws)
    with pytest.raises(ValueError):
        bn.forward(x, g, b, torch.empty(2, 3, 4, 5), rm, rv, s, ws)
    with pytest.raises(ValueError):
        bn.forward(x, g, b, y, rm, rv, torch.empty(3, 2), ws)
    with pytest.raises(ValueError):
        bn.forward(x, g, b, y, None, rv, s, ws)       # running stats needed
    with pytest.raises(ValueError):
        bn.forward(x, g, b, y, rm, rv, s, ws[:4])     # workspace too small
    with pytest.raises(ValueError):
        bn.forward(x, g, b, y, rm, rv, s, ws.to(torch.int32))
    with pytest.raises(ValueError):
        bn.forward(x.double(), g, b, y, rm, rv, s, ws)
    with pytest.raises(ValueError):
        bn.forward(x, g, b, y, rm, rv, s, ws, eps=0.0)
    with pytest.raises(ValueError):
        bn.forward(x, g, b, y, rm, rv, s, ws, momentum=2.0)
    with pytest.raises(ValueError):
        bn.forward(x.view(2, 3, 16), g, b, y.view(2, 3, 16), rm, rv, s, ws)
    wsb = _workspace(shape, "backward", "cpu")
    with pytest.raises(ValueError):
        bn.backward(x, g, torch.empty(2, 3, 4, 5), s, torch.empty_like(x), None, None, wsb)
    with pytest.raises(ValueError):
        bn.backward(x, g, x, s, torch.empty_like(x), torch.empty(2), None, wsb)
    with pytest.raises(ValueError):
        bn.backward(x, g, x, s, torch.empty_like(x), None, None, wsb[:8])
    with pytest.raises(ValueError):
        bn.backward(x, g, x, s, torch.empty_like(x), None, None, wsb, accumulate=None)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(32, 64, 112, 112), (32, 256, 56, 56), (32, 2048, 7, 7),
                                   (1, 64, 224, 224), (2, 3, 1, 1), (1, 1, 1, 2), (3, 5, 17, 19)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_bn_gpu(shape, accumulate):
    _check(shape, 3, device="cuda", accumulate=accumulate)
    _check(shape, 4, device="cuda", accumulate=accumulate, update_running=False, grads="dx",
           offset=50.0)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_bn_gpu_deterministic():
    shape = (32, 64, 56, 56)
    x = _rand(shape, 1, "cuda")
    g, b = _rand((64,), 2, "cuda"), _rand((64,), 3, "cuda")
    dy = _rand(shape, 4, "cuda")
    res = []
    for _ in range(3):
        y, s = torch.empty_like(x), torch.empty(2, 64, device="cuda")
        bn.forward(x, g, b, y, None, None, s, _workspace(shape, "forward", "cuda"),
                   update_running=False)
        dx = torch.empty_like(x)
        dg, db = torch.empty(64, device="cuda"), torch.empty(64, device="cuda")
        bn.backward(x, g, dy, s, dx, dg, db, _workspace(shape, "backward", "cuda"))
        res.append((y, s, dx, dg, db))
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(res[0], r))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(1, 40), st.integers(1, 70), st.integers(1, 40),
                      st.integers(1, 40)),
       seed=st.integers(0, 2**16), accumulate=st.booleans(), update_running=st.booleans(),
       grads=st.sampled_from(["all", "dx", "params"]))
def test_bn_random_gpu(shape, seed, accumulate, update_running, grads):
    assume(shape[0] * shape[2] * shape[3] >= 2)
    _check(shape, seed, device="cuda", accumulate=accumulate, update_running=update_running,
           grads=grads)


# ----------------------------------------------------------------------------- eval mode
def _check_eval(shape, seed=0, device="cpu"):
    """forward_eval against F.batch_norm(training=False) in float64; stats untouched."""
    n, c, h, w = shape
    x = _rand(shape, seed, device, scale=2.0, offset=0.5)
    gamma, beta = _rand((c,), seed + 1, device), _rand((c,), seed + 2, device)
    rmean = _rand((c,), seed + 3, device)
    rvar = _rand((c,), seed + 4, device).abs() + 0.1
    rmean0, rvar0 = rmean.clone(), rvar.clone()
    y = torch.full_like(x, NAN)
    bn.forward_eval(x, gamma, beta, y, rmean, rvar, eps=1e-5)
    ref = F.batch_norm(x.double(), rmean.double(), rvar.double(), gamma.double(),
                       beta.double(), training=False, eps=1e-5)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(rmean, rmean0) and torch.equal(rvar, rvar0)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 3, 1, 1), (2, 5, 3, 7), (3, 4, 33, 40),
                                   (2, 70, 2, 2)])
def test_bn_eval_matches_torch(shape):
    _check_eval(shape, seed=sum(shape))


def test_bn_eval_bad_input():
    x = torch.zeros(2, 3, 4, 4)
    y, v = torch.zeros_like(x), torch.ones(3)
    bad = [((x[0], v, v, y[0], v, v), {}, "4-D"),
           ((x, v[:2], v, y, v, v), {}, "gamma"),
           ((x, v, v, y, v, v.double()), {}, "running_var"),
           ((x, v, v, y[:1], v, v), {}, "y"),
           ((x, v, v, y, v, v), {"eps": 0}, "eps")]
    for args, kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            bn.forward_eval(*args, **kwargs)
    assert not y.any()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1, 64, 56, 56), (32, 2048, 7, 7)])
def test_bn_eval_gpu(shape):
    _check_eval(shape, device="cuda")


@pytest.mark.parametrize("shape", [(3, 4, 7, 7), (2, 5, 33, 40)])
def test_relu_stored_by_each_forward_is_the_relu_of_its_output_bitwise(shape):
    """forward, rebuild and forward_eval with relu=True store exactly what kernels/act.py's
    ReLU makes of their relu=False output (NaN stays NaN), and nothing else changes."""
    from tinysn.kernels import act
    c = shape[1]
    x, gamma, beta = _rand(shape, 8), _rand((c,), 9), _rand((c,), 10)
    x[0, 0, 0, 0] = NAN
    outs = []
    for relu in (False, True):
        rm, rv, saved = torch.zeros(c), torch.ones(c), torch.empty(2, c)
        y, again, ev = (torch.full_like(x, NAN) for _ in range(3))
        bn.forward(x, gamma, beta, y, rm, rv, saved, _workspace(shape, "forward", "cpu"),
                   relu=relu)
        bn.rebuild(x, gamma, beta, again, saved, relu=relu)
        bn.forward_eval(x, gamma, beta, ev, rm, rv, relu=relu)
        outs.append((y, again, ev, saved, rm, rv))
    for plain, fused in zip(outs[0][:3], outs[1][:3]):
        relued = torch.empty_like(plain)
        act.forward(plain, relued)
        assert torch.equal(fused.nan_to_num(7.0), relued.nan_to_num(7.0))
        kept = ~plain.isnan()          # the NaN's channel is NaN (its statistics are)
        assert torch.equal(fused.isnan(), plain.isnan()) and bool(kept.any())
        assert bool((fused[kept] >= 0).all()) and bool((fused[kept] == 0).any())
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))       # the statistics
               for a, b in zip(outs[0][3:], outs[1][3:]))


def test_relu_must_be_a_bool():
    shape = (2, 3, 4, 4)
    x, v = _rand(shape, 0), torch.ones(3)
    y, saved = torch.zeros_like(x), torch.ones(2, 3)
    for call in (lambda: bn.forward(x, v, v, y, v.clone(), v.clone(), saved.clone(),
                                    _workspace(shape, "forward", "cpu"), relu=1),
                 lambda: bn.rebuild(x, v, v, y, saved, relu="yes"),
                 lambda: bn.forward_eval(x, v, v, y, v, v, relu=None)):
        with pytest.raises(ValueError, match="relu must be a bool"):
            call()
    assert not y.any()


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 7, 7), (2, 5, 33, 40)])
def test_a_residual_stored_by_each_forward_is_the_add_of_its_output_bitwise(shape, relu):
    """forward, rebuild and forward_eval with a residual store exactly what kernels/join.py's
    add (with its fused ReLU where `relu`) makes of their output and the residual, in either
    order, and the statistics are those of the batch norm alone."""
    from tinysn.kernels import join
    c = shape[1]
    x, gamma, beta, res = _rand(shape, 11), _rand((c,), 12), _rand((c,), 13), _rand(shape, 14)
    res0 = res.clone()
    outs = []
    for residual in (None, res):
        rm, rv, saved = torch.zeros(c), torch.ones(c), torch.empty(2, c)
        y, again, ev = (torch.full_like(x, NAN) for _ in range(3))
        flags = dict(relu=relu and residual is not None, residual=residual)
        bn.forward(x, gamma, beta, y, rm, rv, saved, _workspace(shape, "forward", "cpu"),
                   **flags)
        bn.rebuild(x, gamma, beta, again, saved, **flags)
        bn.forward_eval(x, gamma, beta, ev, rm, rv, **flags)
        outs.append((y, again, ev, saved, rm, rv))
    assert torch.equal(res, res0)
    for plain, fused in zip(outs[0][:3], outs[1][:3]):
        for pair in ([plain, res], [res, plain]):
            added = torch.empty_like(plain)
            join.add_forward(pair, added, relu=relu)
            assert torch.equal(fused, added)
        assert not torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(outs[0][3:], outs[1][3:]))


def test_a_residual_add_matches_torch():
    """y = bn(x) + residual against torch float64."""
    shape = (2, 5, 9, 11)
    x, gamma, beta, res = _rand(shape, 1), _rand((5,), 2), _rand((5,), 3), _rand(shape, 4)
    y, saved = torch.full_like(x, NAN), torch.empty(2, 5)
    bn.forward(x, gamma, beta, y, torch.zeros(5), torch.ones(5), saved,
               _workspace(shape, "forward", "cpu"), residual=res)
    ref = F.batch_norm(x.double(), None, None, gamma.double(), beta.double(), training=True,
                       eps=1e-5) + res.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_bad_residual_is_refused_before_anything_is_written():
    shape = (2, 3, 4, 4)
    x, v = _rand(shape, 0), torch.ones(3)
    y, saved = torch.zeros_like(x), torch.ones(2, 3)
    rm, rv = torch.zeros(3), torch.ones(3)
    for residual, match in ((x[:1], "residual"), (x.double(), "residual")):
        for call in (lambda: bn.forward(x, v, v, y, rm, rv, saved,
                                        _workspace(shape, "forward", "cpu"), residual=residual),
                     lambda: bn.rebuild(x, v, v, y, saved, residual=residual),
                     lambda: bn.forward_eval(x, v, v, y, rm, rv, residual=residual)):
            with pytest.raises(ValueError, match=match):
                call()
    room = torch.zeros(2 * x.numel())
    shifted = room[8:8 + x.numel()].view(shape)
    with pytest.raises(ValueError, match="y overlaps residual"):
        bn.rebuild(x, v, v, room[:x.numel()].view(shape), saved, residual=shifted)
    assert not y.any() and not room.any() and torch.equal(saved, torch.ones(2, 3))
    assert torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 7, 7), (2, 5, 33, 40)])
def test_backward_storing_its_dy_gives_the_fan_out_then_backward_bits(shape, masked):
    """backward with dy_out (and relu_output) stores exactly what kernels/join.py's fan-out
    makes of dy (masked by the ReLU's output) and gives the gradients of backward run on
    that: a fused residual add's backward in the batch norm's own passes. dy_out may be
    dy itself, and dx may then still be apart."""
    from tinysn.kernels import join
    c = shape[1]
    x, gamma, dy, y = _rand(shape, 21), _rand((c,), 22), _rand(shape, 23), _rand(shape, 24)
    y.view(-1)[::7] = 0.0               # a ReLU's output holds zeros: those mask dy too
    saved = torch.stack([x.mean((0, 2, 3)), 1 / (x.var((0, 2, 3)) + 1e-5).sqrt()])
    mask = y if masked else None
    g_ref = torch.empty_like(dy)
    join.add_backward(dy, [g_ref], y=mask)
    ref = [torch.empty_like(x), torch.empty(c), torch.empty(c)]
    bn.backward(x, gamma, g_ref, saved, *ref, _workspace(shape, "backward", "cpu"))
    for in_place in (False, True):
        grad = dy.clone()
        out = grad if in_place else torch.full_like(dy, NAN)
        got = [torch.full_like(x, NAN), torch.empty(c), torch.empty(c)]
        bn.backward(x, gamma, grad, saved, *got, _workspace(shape, "backward", "cpu"),
                    relu_output=mask, dy_out=out)
        assert torch.equal(out, g_ref)
        assert in_place or torch.equal(grad, dy)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    if masked:
        assert not torch.equal(g_ref, dy)


def test_backward_refuses_a_bad_dy_out_before_writing():
    shape = (2, 3, 4, 4)
    x, v, dy = _rand(shape, 0), torch.ones(3), _rand(shape, 1)
    saved, dx, out = torch.ones(2, 3), torch.zeros_like(x), torch.zeros_like(x)
    ws = _workspace(shape, "backward", "cpu")
    cases = [(dict(relu_output=dy.clone()), "relu_output needs dy_out"),
             (dict(dy_out=out[:1]), "dy_out"),
             (dict(dy_out=x), "dy_out overlaps x"),
             (dict(dy_out=out, relu_output=out), "dy_out overlaps relu_output")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            bn.backward(x, v, dy, saved, dx, None, None, ws, **kwargs)
    with pytest.raises(ValueError, match="overlaps"):
        bn.backward(x, v, dy, saved, out, None, None, ws, dy_out=out)
    assert not dx.any() and not out.any()


@pytest.mark.parametrize("count", [0.0, 3.0])
def test_bn_a_bad_batch_leaves_the_running_statistics(count):
    """`skip` holding a bad batch's count (non-zero) keeps running_mean / running_var as they
    were; y and saved are written either way."""
    shape = (2, 3, 5, 5)
    x, gamma, beta = _rand(shape, 1), _rand((3,), 2), _rand((3,), 3)
    rm, rv = torch.zeros(3), torch.ones(3)
    y, saved = torch.full_like(x, NAN), torch.full((2, 3), NAN)
    bn.forward(x, gamma, beta, y, rm, rv, saved, _workspace(shape, "forward", "cpu"),
               skip=torch.tensor([count]))
    assert not y.isnan().any() and not saved.isnan().any()
    kept = torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))
    assert kept == (count != 0.0)
