"""tinysn.Tensor: where its bytes are, which moves are legal, and that a move keeps the data."""
import pytest
import torch

import tinysn as sn
from tinysn.pool import Arena

GPU = torch.cuda.is_available()


def arenas(device="cpu"):
    return Arena("64KiB", device), Arena("64KiB", "cpu", pinned=device != "cpu")


def filled(arena, shape=(3, 5), name="t"):
    t = sn.Tensor(name, shape)
    t.allocate(arena)
    t.view().copy_(torch.randn(shape))
    return t


def test_round_trip_through_the_host_keeps_the_data():
    dev, host = arenas()
    t = filled(dev)
    want = t.view().clone()
    t.offload(host)
    assert t.state == "offloading" and torch.equal(t.view(), want)    # still readable
    t.release()
    assert t.state == "host" and dev.allocator.in_use == 0
    t.prefetch(dev)
    with pytest.raises(RuntimeError, match="prefetching"):
        t.view()
    t.wait()
    assert t.state == "gpu" and torch.equal(t.view(), want)
    t.discard()                       # the host copy is still valid: no copy needed
    assert t.state == "host"
    t.prefetch(dev)
    t.wait()
    assert torch.equal(t.view(), want)
    t.free()
    assert t.state == "freed" and dev.allocator.in_use == 0 and host.allocator.in_use == 0


@pytest.mark.parametrize("state", ["host", "dropped", "freed", "unallocated"])
def test_reading_a_tensor_that_is_not_on_the_device_raises(state):
    dev, host = arenas()
    t = sn.Tensor("t", (4,))
    if state != "unallocated":
        t.allocate(dev)
        if state == "host":
            t.offload(host)
            t.release()
        elif state == "dropped":
            t.drop()
        else:
            t.free()
    with pytest.raises(RuntimeError, match=state):
        t.view()


def test_illegal_moves_raise_and_change_nothing():
    dev, host = arenas()
    t = filled(dev)
    for move in (t.release, t.wait, lambda: t.prefetch(dev), lambda: t.allocate(dev)):
        with pytest.raises(RuntimeError):
            move()
    assert t.state == "gpu" and dev.allocator.in_use > 0
    with pytest.raises(RuntimeError, match="without a host copy"):
        t.discard()
    t.free()
    with pytest.raises(RuntimeError, match="freed"):
        t.free()
    with pytest.raises(ValueError, match="kind"):
        sn.Tensor("x", (1,), kind="weights")


def test_dropped_tensor_can_be_rebuilt_in_place():
    dev, _ = arenas()
    t = filled(dev)
    t.drop()
    assert t.state == "dropped" and dev.allocator.in_use == 0
    t.allocate(dev)
    assert t.state == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_moves_ordered_by_events_alone():
    """On the GPU: copies on two streams, ordered only by the events passed (as the runtime
    does), with blocks freed without host waits; the data survives."""
    dev, host = arenas("cuda")
    to_host, to_device = torch.cuda.Stream(), torch.cuda.Stream()
    t = sn.Tensor("t", (64, 64))
    t.allocate(dev)
    t.view().copy_(torch.randn(64, 64, device="cuda"))
    want = t.view().clone()
    t.offload(host, to_host)
    out_event = t.event
    t.release(sync=False)
    other = sn.Tensor("o", (64, 64))
    other.allocate(dev)                                   # reuses the block being read
    torch.cuda.current_stream().wait_event(out_event)     # what the plan's "sync" does
    other.view().fill_(7.0)
    t.prefetch(dev, to_device, waits=[out_event])
    t.wait(torch.cuda.current_stream())
    assert torch.equal(t.view(), want)
    assert torch.equal(other.view(), torch.full((64, 64), 7.0, device="cuda"))
