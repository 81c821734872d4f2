"""SGD update against torch.optim.SGD (float32 copies: tight; float64 copies: scaled tolerance)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import sgd

GPU = torch.cuda.is_available()


def _rand(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def _torch_sgd(param, grads, dtype, lr, momentum, weight_decay):
    p = param.clone().to(dtype).requires_grad_(True)
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, weight_decay=weight_decay)
    for g in grads:
        p.grad = g.clone().to(dtype)
        opt.step()
    buf = opt.state[p].get("momentum_buffer") if momentum else None
    return p.detach(), buf


def _check(shape, lr, momentum, weight_decay, seed=0, steps=3, device="cpu"):
    param0 = _rand(shape, seed, device)
    grads = [_rand(shape, seed + 1 + i, device) for i in range(steps)]
    param = param0.clone()
    buf = torch.zeros_like(param) if momentum else None
    for g in grads:
        sgd.update(param, g, buf, lr=lr, momentum=momentum, weight_decay=weight_decay)

    ref32, buf32 = _torch_sgd(param0, grads, torch.float32, lr, momentum, weight_decay)
    torch.testing.assert_close(param, ref32, rtol=0, atol=1e-6)
    ref64, buf64 = _torch_sgd(param0, grads, torch.float64, lr, momentum, weight_decay)
    torch.testing.assert_close(param.double(), ref64, rtol=1e-5, atol=1e-5)
    if momentum:
        torch.testing.assert_close(buf, buf32, rtol=0, atol=1e-6)
        torch.testing.assert_close(buf.double(), buf64, rtol=1e-5, atol=1e-5)
    return param, ref32


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-4, 0.05])
def test_sgd_matches_torch(momentum, weight_decay):
    param, ref32 = _check((3, 1000, 7), 0.1, momentum, weight_decay)
    if not GPU:   # on the interpreter the rounding is torch's, bit for bit
        assert torch.equal(param, ref32)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 3 * sgd.BLOCK + 5), lr=st.sampled_from([0.0, 1e-3, 0.1, 1.0]),
       momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
       weight_decay=st.sampled_from([0.0, 1e-4, 5e-4, 0.1]), seed=st.integers(0, 2**16))
def test_sgd_random(n, lr, momentum, weight_decay, seed):
    _check((n,), lr, momentum, weight_decay, seed=seed, steps=2)


def test_sgd_without_momentum_leaves_buffer_alone():
    p = _rand((50,), 0)
    g = _rand((50,), 1)
    buf = _rand((50,), 2)
    before = buf.clone()
    ref = p - 0.5 * g
    sgd.update(p, g, buf, lr=0.5, momentum=0.0, weight_decay=0.0)
    assert torch.equal(buf, before)
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-6)
    sgd.update(p, g, None, lr=0.5, momentum=0, weight_decay=0)     # None allowed here
    assert sgd.workspace_bytes(50) == 0


def test_sgd_deterministic():
    outs = []
    for _ in range(2):
        p, g, b = _rand((5000,), 0), _rand((5000,), 1), torch.zeros(5000)
        sgd.update(p, g, b, lr=0.1, momentum=0.9, weight_decay=1e-4)
        outs.append((p, b))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-4)])
def test_sgd_update_many_matches_one_update_each(momentum, weight_decay, device="cpu"):
    """Four tensors share a launch (each after the blocks of those before it, mid-grid), the
    two left over one more (its last slots empty), an empty one none; each ends bitwise as
    update() leaves it."""
    assert sgd.PER_LAUNCH == 4
    sizes = [5000, 37, 9000, 0, 4096, 1, 8193]
    hp = dict(lr=0.1, momentum=momentum, weight_decay=weight_decay)

    def fresh():
        return [(_rand((n,), 3 * i, device), _rand((n,), 3 * i + 1, device),
                 _rand((n,), 3 * i + 2, device) * 0.1) for i, n in enumerate(sizes)]
    alone, together = fresh(), fresh()
    for p, g, b in alone:
        sgd.update(p, g, b, **hp)
    sgd.update_many(together, **hp)
    for (p, _, b), (q, _, c) in zip(alone, together):
        assert torch.equal(p, q) and torch.equal(b, c)


@pytest.mark.parametrize("lr", [0.1, 1e-3 / 3, 0.0])
def test_sgd_reads_a_rate_held_in_memory_as_the_number(lr, device="cpu"):
    """`lr` as a one-element float32 tensor (the Runtime's pool keeps it there, so a replayed
    graph reads each step's rate) updates bit for bit as the number: the kernel reads the
    float32 the number rounds to. Changing the tensor changes the next update's rate."""
    sizes, hp = [4100, 7, 33, 9000, 5], dict(momentum=0.9, weight_decay=1e-3)

    def fresh():
        return [(_rand((n,), 3 * i, device), _rand((n,), 3 * i + 1, device),
                 _rand((n,), 3 * i + 2, device)) for i, n in enumerate(sizes)]
    by_number, in_memory = fresh(), fresh()
    rate = torch.tensor([lr], dtype=torch.float32, device=device)
    for step in range(2):
        sgd.update_many(by_number, lr=lr * (step + 1), **hp)
        rate.fill_(lr * (step + 1))
        sgd.update_many(in_memory, lr=rate, **hp)
    for (p, _, b), (q, _, c) in zip(by_number, in_memory):
        assert torch.equal(p, q) and torch.equal(b, c)


def test_sgd_rate_tensor_checked_before_any_launch():
    """A rate tensor of the wrong dtype, shape or device, or lying inside a tensor the update
    writes, is named before anything changes."""
    p, g, b = _rand((10,), 0), _rand((10,), 1), torch.zeros(10)
    before = p.clone()
    hp = dict(momentum=0.9, weight_decay=0.0)
    for bad, match in ((torch.tensor([0.1], dtype=torch.float64), "lr must be"),
                       (torch.tensor([0.1, 0.2]), "lr must have shape"),
                       (p[3:4], "lr lies inside a param"), (b[9:], "lr lies inside a momentum")):
        with pytest.raises(ValueError, match=match):
            sgd.update_many([(p, g, b)], lr=bad, **hp)
        assert torch.equal(p, before) and not b.any()


def test_sgd_update_many_checks_every_item_before_any_launch():
    """A bad third item (a launch of its own) is named before the first pair is touched."""
    p, g, b = _rand((10,), 0), _rand((10,), 1), torch.zeros(10)
    before = p.clone()
    with pytest.raises(ValueError, match="grad"):
        sgd.update_many([(p, g, b), (p.clone(), g.clone(), b.clone()),
                         (p.clone(), _rand((11,), 2), b.clone())], lr=0.1, momentum=0.9,
                        weight_decay=0.0)
    assert torch.equal(p, before)


@pytest.mark.parametrize("count", [0.0, 3.0])
def test_sgd_skip_writes_nothing_where_the_batch_was_bad(count):
    """`skip` holds a batch check's count (kernels/check.py): 0 updates as without it, bit
    for bit; otherwise neither the parameters nor the momentum buffers change."""
    items = [(_rand((n,), seed), _rand((n,), seed + 1), _rand((n,), seed + 2))
             for seed, n in ((0, 4100), (3, 7), (6, 33))]
    plain = [tuple(t.clone() for t in item) for item in items]
    sgd.update_many(items, lr=0.1, momentum=0.9, weight_decay=1e-3,
                    skip=torch.tensor([count]))
    if count:
        expected = [tuple(t.clone() for t in item) for item in plain]
    else:
        sgd.update_many(plain, lr=0.1, momentum=0.9, weight_decay=1e-3)
        expected = plain
    for got, want in zip(items, expected):
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    with pytest.raises(ValueError, match="skip"):
        sgd.update_many(items, lr=0.1, momentum=0.9, weight_decay=0.0,
                        skip=torch.zeros(1, dtype=torch.float64))


def test_sgd_bad_input():
    p, g, b = _rand((10,), 0), _rand((10,), 1), torch.zeros(10)
    hp = dict(lr=0.1, momentum=0.9, weight_decay=0.0)
    with pytest.raises(ValueError):
        sgd.update(p, g, None, **hp)                                  # buffer needed
    with pytest.raises(ValueError):
        sgd.update(p, g, b, lr=-0.1, momentum=0.9, weight_decay=0.0)
    with pytest.raises(ValueError):
        sgd.update(p, g, b, lr=0.1, momentum=-0.9, weight_decay=0.0)
    with pytest.raises(ValueError):
        sgd.update(p, g, b, lr=0.1, momentum=0.9, weight_decay=float("nan"))
    with pytest.raises(ValueError):
        sgd.update(p, _rand((11,), 1), b, **hp)                       # shape
    with pytest.raises(ValueError):
        sgd.update(p, g.double(), b, **hp)                            # dtype
    with pytest.raises(ValueError):
        sgd.update(p, g, p, **hp)                                     # buffer aliases param
    m = _rand((4, 5), 0)
    with pytest.raises(ValueError):
        sgd.update(m.t(), _rand((5, 4), 1), torch.zeros(5, 4), **hp)  # non-contiguous


@pytest.mark.parametrize("shape", [(25_557_032,), (1000, 2048), (3, 7)])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-4)])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_sgd_gpu(shape, momentum, weight_decay):
    _check(shape, 0.1, momentum, weight_decay, device="cuda")


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-4)])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_sgd_gpu_update_many_matches_one_update_each(momentum, weight_decay):
    test_sgd_update_many_matches_one_update_each(momentum, weight_decay, device="cuda")


@pytest.mark.parametrize("lr", [0.1, 1e-3 / 3])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_sgd_gpu_reads_a_rate_held_in_memory_as_the_number(lr):
    test_sgd_reads_a_rate_held_in_memory_as_the_number(lr, device="cuda")
