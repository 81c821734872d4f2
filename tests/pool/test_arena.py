"""Arena: views alias exactly their block's bytes of the one buffer."""
import pytest
import torch

from tinysn.errors import OutOfMemory
from tinysn.pool import Arena, BlockAllocator


def test_capacity_and_buffer():
    arena = Arena("10KiB", block_bytes=1024)
    assert arena.capacity == 10 * 1024
    assert arena.buffer.dtype == torch.uint8 and arena.buffer.numel() == 10 * 1024
    assert arena.device == torch.device("cpu") and not arena.pinned
    assert isinstance(arena.allocator, BlockAllocator)
    assert Arena(5000, block_bytes=1024).buffer.numel() == 4096   # rounded down
    with pytest.raises(ValueError):
        Arena("lots")
    with pytest.raises(OutOfMemory):
        arena.alloc(11 * 1024)


def test_view_aliases_exactly_its_bytes():
    arena = Arena(8 * 1024, block_bytes=1024)
    arena.buffer.fill_(0xAB)
    a, b, c = arena.alloc(1024), arena.alloc(3000), arena.alloc(1024)
    assert b.offset == 1024 and b.nbytes == 3072
    v = arena.view(b, (5, 7), torch.float32)               # 140 bytes
    assert v.shape == (5, 7) and v.dtype == torch.float32
    assert v.data_ptr() == arena.buffer.data_ptr() + b.offset
    v.copy_(torch.arange(35, dtype=torch.float32).view(5, 7))
    raw = arena.buffer[b.offset:b.offset + 140].clone()
    assert torch.equal(raw.view(torch.float32), torch.arange(35, dtype=torch.float32))
    untouched = torch.cat([arena.buffer[:b.offset], arena.buffer[b.offset + 140:]])
    assert bool((untouched == 0xAB).all()), "a view wrote outside its bytes"
    # the buffer and the view share storage both ways
    arena.buffer[b.offset:b.offset + 4].copy_(torch.tensor([1.5]).view(torch.uint8))
    assert v[0, 0].item() == 1.5
    for blk in (a, c):
        arena.free(blk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.int64, torch.int32, torch.uint8, torch.bool])
def test_views_of_other_dtypes(dtype):
    arena = Arena(4 * 1024, block_bytes=256)
    arena.alloc(256)
    blk = arena.alloc(600)
    arena.buffer.zero_()
    n = 600 // dtype.itemsize
    v = arena.view(blk, (n,), dtype)
    assert v.numel() == n and v.dtype == dtype
    v.fill_(1)
    nbytes = n * dtype.itemsize
    assert bool((arena.buffer[:blk.offset] == 0).all())
    assert bool((arena.buffer[blk.offset + nbytes:] == 0).all())
    assert arena.buffer[blk.offset:blk.offset + nbytes].any()
    expect = torch.ones(n, dtype=dtype).view(torch.uint8)
    assert torch.equal(arena.buffer[blk.offset:blk.offset + nbytes], expect)


def test_view_errors():
    arena = Arena(4096, block_bytes=1024)
    blk = arena.alloc(1024)
    assert arena.view(blk, (256,)).numel() == 256                 # exactly the block
    assert arena.view(blk, 16, torch.float64).shape == (16,)
    assert arena.view(blk, (0, 3)).numel() == 0
    with pytest.raises(ValueError, match="needs 1028 bytes"):
        arena.view(blk, (257,))
    with pytest.raises(ValueError):
        arena.view(blk, (129,), torch.float64)
    other = Arena(4096).alloc(16)
    with pytest.raises(ValueError):
        arena.view(other, (4,))                                    # foreign block
    arena.free(blk)
    with pytest.raises(ValueError):
        arena.view(blk, (4,))                                      # freed block
    with pytest.raises(ValueError):
        arena.free(blk)


@pytest.mark.gpu
def test_cuda_arena_and_pinned_host():
    arena = Arena("1MiB", device="cuda")
    blk = arena.alloc(4096)
    v = arena.view(blk, (32, 32))
    v.fill_(2.0)
    assert arena.buffer.is_cuda and float(v.sum()) == 2048.0
    host = Arena("1MiB", pinned=True)
    assert host.pinned and host.buffer.is_pinned()
    event = torch.cuda.Event()
    hblk = host.alloc(4096)
    hv = host.view(hblk, (32, 32))
    hv.copy_(v, non_blocking=True)
    event.record()
    event.synchronize()
    assert float(hv.sum()) == 2048.0
    host.free(hblk)
    with pytest.raises(ValueError):
        Arena("1MiB", device="cuda", pinned=True)
