"""Dropout kernels: mask regenerated from (seed, iteration counter, layer, offset), inverted
scaling, statistics, the counter's advance."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import dropout

GPU = torch.cuda.is_available()


def _nonzero(shape, seed, device="cpu"):
    """Random values with no zeros (|v| >= 0.1), so y != 0 exactly marks the kept elements."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g)
    return torch.where(v >= 0, v + 0.1, v - 0.1).to(device)


def _it(i, device="cpu"):
    """The iteration counter: a one-element int64 tensor holding i."""
    return torch.tensor([i], dtype=torch.int64, device=device)


def _fwd(x, p, seed, offset, iteration=3, layer=5):
    y = torch.full_like(x, float("nan"))
    dropout.forward(x, y, p=p, seed=seed, iteration=_it(iteration, x.device), layer=layer,
                    offset=offset)
    return y


def _check(shape, p, seed, offset, accumulate, device="cpu", iteration=3, layer=5):
    x = _nonzero(shape, seed % 1000, device)
    y = _fwd(x, p, seed, offset, iteration, layer)
    keep = y != 0
    scale = 1.0 / (1.0 - p)
    torch.testing.assert_close(y.double(), x.double() * scale * keep, rtol=1e-6, atol=0)

    dy = _nonzero(shape, seed % 1000 + 1, device)
    ref = dy.double() * scale * keep
    if accumulate:
        before = _nonzero(shape, seed % 1000 + 2, device)
        dx = before.clone()
        ref = before.double() + ref
    else:
        dx = torch.full_like(x, float("nan"))
    dropout.backward(dy, dx, p=p, seed=seed, iteration=_it(iteration, device), layer=layer,
                     offset=offset, accumulate=accumulate)
    # the backward mask equals the forward mask: dx = dy * (y != 0) / (1 - p)
    torch.testing.assert_close(dx.double(), ref, rtol=1e-6, atol=1e-6)
    return keep


def _capped(shape, limit=20000):
    """Keep hypothesis shapes small for the interpreter: drop trailing dims past `limit`."""
    while len(shape) > 1 and math.prod(shape) > limit:
        shape = shape[:-1]
    return tuple(shape)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=4).map(_capped),
       p=st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.999]), seed=st.integers(0, 2**31 - 1),
       offset=st.integers(0, 2**40), accumulate=st.booleans(),
       iteration=st.integers(0, 2**40), layer=st.integers(0, 2**31 - 1))
def test_dropout_random(shape, p, seed, offset, accumulate, iteration, layer):
    _check(tuple(shape), p, seed, offset, accumulate, iteration=iteration, layer=layer)


@pytest.mark.parametrize("n", [1, 3, dropout.BLOCK // 4 + 1, dropout.BLOCK, dropout.BLOCK + 5,
                               3 * dropout.BLOCK - 1])
def test_dropout_edge_sizes(n):
    _check((n,), 0.5, 1, 0, False)
    _check((n,), 0.3, 1, 2**33 - 5, True)        # counter crosses the 32-bit boundary


def test_keep_fraction():
    n = 1 << 18
    x = _nonzero((n,), 0)
    for p in (0.1, 0.5, 0.8):
        kept = (_fwd(x, p, 123, 4567) != 0).double().mean().item()
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(kept - (1 - p)) < 5 * sigma, (p, kept)


def test_reproducible_and_independent_across_seed_iteration_layer_offset():
    x = _nonzero((7, 1000), 1)
    a = _fwd(x, 0.5, 42, 1000)
    b = _fwd(x, 0.5, 42, 1000)
    assert torch.equal(a, b)                        # same (seed, iteration, layer, offset)
    others = [_fwd(x, 0.5, 42, 1001), _fwd(x, 0.5, 43, 1000),
              _fwd(x, 0.5, 42, 1000 + x.numel()),              # the next disjoint range
              _fwd(x, 0.5, 42, 1000, iteration=4), _fwd(x, 0.5, 42, 1000, layer=6),
              _fwd(x, 0.5, 42, 1000, iteration=3 + 2**32)]     # the iteration's high word
    for other in others:
        agree = ((a != 0) == (other != 0)).double().mean().item()
        assert 0.4 < agree < 0.6, agree                         # independent masks agree ~half


def test_mask_depends_only_on_element_index():
    """Element e's draw is a function of (seed, offset, e): a prefix keeps its mask."""
    x = _nonzero((3 * dropout.BLOCK + 17,), 2)
    full = _fwd(x, 0.5, 9, 77)
    for n in (5, dropout.BLOCK + 3):
        part = _fwd(x[:n].clone(), 0.5, 9, 77)
        assert torch.equal(part, full[:n])


def test_p_zero_is_exact_copy_and_in_place():
    x = _nonzero((5, 33), 3)
    x[0, 0] = float("inf")
    assert torch.equal(_fwd(x, 0.0, 5, 6), x)
    dy = _nonzero((5, 33), 4)
    dx = _nonzero((5, 33), 5)
    ref = dx + dy
    dropout.backward(dy, dx, p=0.0, seed=5, iteration=_it(3), layer=5, offset=6,
                     accumulate=True)
    assert torch.equal(dx, ref)
    y = _fwd(x, 0.5, 5, 6)
    dropout.forward(x, x, p=0.5, seed=5, iteration=_it(3), layer=5, offset=6)   # in place
    assert torch.equal(x, y)
    apart = torch.empty_like(dy)
    dropout.backward(dy, apart, p=0.5, seed=5, iteration=_it(3), layer=5, offset=6)
    dropout.backward(dy, dy, p=0.5, seed=5, iteration=_it(3), layer=5, offset=6)  # dx over dy
    assert torch.equal(dy, apart)
    assert dropout.workspace_bytes(x.shape) == 0


def test_dropout_bad_input():
    x = _nonzero((4, 5), 0)
    y = torch.empty_like(x)
    it = dict(iteration=_it(0), layer=0)
    for p in (1.0, -0.1, 1.5, float("nan"), "0.5"):
        with pytest.raises(ValueError, match="p must"):
            dropout.forward(x, y, p=p, seed=0, offset=0, **it)
    for seed in (-1, 2**31, 1.5):
        with pytest.raises(ValueError, match="seed"):
            dropout.forward(x, y, p=0.5, seed=seed, offset=0, **it)
    for layer in (-1, 2**31, True, 1.0):
        with pytest.raises(ValueError, match="layer"):
            dropout.forward(x, y, p=0.5, seed=0, iteration=_it(0), layer=layer)
    for bad in (3, _it(0).int(), torch.zeros(2, dtype=torch.int64), _it(0).float()):
        with pytest.raises(ValueError, match="iteration"):
            dropout.forward(x, y, p=0.5, seed=0, iteration=bad, layer=0)
        with pytest.raises(ValueError, match="iteration"):
            dropout.advance(bad)
    with pytest.raises(ValueError, match="offset"):
        dropout.forward(x, y, p=0.5, seed=0, offset=-1, **it)
    with pytest.raises(ValueError):
        dropout.forward(x, torch.empty(4, 6), p=0.5, seed=0, offset=0, **it)
    with pytest.raises(ValueError):
        dropout.forward(x.double(), y.double(), p=0.5, seed=0, offset=0, **it)
    with pytest.raises(ValueError):
        dropout.backward(x.t(), torch.empty(5, 4), p=0.5, seed=0, offset=0, **it)
    big = _nonzero((10,), 0)
    with pytest.raises(ValueError, match="overlaps"):
        dropout.forward(big[:8], big[2:], p=0.5, seed=0, offset=0, **it)


def test_advance_adds_one_in_place():
    it = _it(2**32 - 1)
    before = it.data_ptr()
    dropout.advance(it)
    assert it.item() == 2**32 and it.data_ptr() == before


@pytest.mark.parametrize("shape", [(32, 4096), (32, 256, 56, 56), (3, 7, 11)])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_dropout_gpu(shape, accumulate):
    keep = _check(shape, 0.5, 1234, 2**35 + 3, accumulate, device="cuda")
    kept = keep.double().mean().item()
    assert abs(kept - 0.5) < 5 * math.sqrt(0.25 / keep.numel()) + 1e-9


def _philox_keep(seed, iteration, layer, offset, n, p):
    """The documented mask, computed with numpy: Philox-4x32-10, key (seed, iteration >> 32),
    counter (offset + e // 4, layer, iteration's low word), output e % 4, uniform = int31 *
    4.6566127342e-10, keep when uniform >= p."""
    e = np.arange(n, dtype=np.uint64)
    ctr = np.uint64(offset) + e // np.uint64(4)
    m32 = np.uint64(0xFFFFFFFF)
    c = [ctr & m32, ctr >> np.uint64(32), ctr * 0 + np.uint64(layer),
         ctr * 0 + np.uint64(iteration & 0xFFFFFFFF)]
    k0, k1 = np.uint64(seed), np.uint64(iteration >> 32)
    for _ in range(10):
        pa, pb = c[0] * np.uint64(0xD2511F53), c[2] * np.uint64(0xCD9E8D57)
        c = [(pb >> np.uint64(32)) ^ c[1] ^ k0, pb & m32,
             (pa >> np.uint64(32)) ^ c[3] ^ k1, pa & m32]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    r = np.choose((e % np.uint64(4)).astype(np.int64), c).astype(np.uint32).view(np.int32)
    r = np.where(r < 0, ~r, r)
    u = r.astype(np.float32) * np.float32(4.6566127342e-10)
    return torch.from_numpy(u >= np.float32(p))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CUDA")])])
def test_mask_matches_numpy_philox(device):
    """The keep mask is exactly the documented Philox stream, on every triton version/device."""
    n = 2 * dropout.BLOCK + 17
    x = _nonzero((n,), 2, device)
    for seed, offset, iteration, layer in ((9, 77, 3, 5), (2**31 - 1, 2**32 - 1000, 2**33 + 7,
                                                         2**31 - 1), (0, 0, 0, 0)):
        keep = (_fwd(x, 0.3, seed, offset, iteration, layer) != 0).cpu()
        assert torch.equal(keep, _philox_keep(seed, iteration, layer, offset, n, 0.3))
