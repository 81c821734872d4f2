"""Arena: one torch buffer plus a BlockAllocator that hands out views of it.

This is the ONLY place tinysn asks torch for memory. The device pool, the pinned host pool
(the Unified Tensor Pool's external side) and every tensor, gradient and workspace live in
an Arena's buffer; a tensor is a view of the bytes of its Block. An Arena can also sit on
bytes another arena owns (`buffer=`): scratch carved from a pool allocates nothing.

A buffer larger than the machine can give (`available_bytes`) is refused with one line
before torch is asked for anything.
"""
from __future__ import annotations

import math
import os

import torch

from ..errors import OutOfMemory
from ..units import format_bytes, parse_bytes
from .allocator import Block, BlockAllocator

__all__ = ["Arena", "available_bytes", "check_available", "pinned_bytes"]


def available_bytes(device) -> int:
    """Bytes a new buffer on `device` can take now: for a GPU its free memory plus what
    torch's caching allocator holds unused; for the host the available RAM (MemAvailable,
    which also bounds what can be pinned)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pinned_bytes(nbytes: int) -> int:
    """What a pinned buffer of `nbytes` really takes: torch's pinned-memory allocator rounds
    a request up to a power of two (60 GiB takes a 64 GiB block)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def check_available(nbytes: int, device, what: str, pinned: bool = False) -> None:
    """Raise OutOfMemory (one line) when `nbytes` of `device` memory (pinned: as torch
    rounds it) cannot be had at all."""
    have = available_bytes(device)
    if pinned:
        nbytes = pinned_bytes(nbytes)
    if nbytes > have:
        where = "GPU memory free" if torch.device(device).type == "cuda" else "RAM available"
        raise OutOfMemory(f"{what} of {nbytes:,} bytes ({format_bytes(nbytes)}) is more than "
                          f"this machine has: {have:,} bytes ({format_bytes(have)}) of {where}")


class Arena:
    """`capacity` bytes (or "512MiB") of `device` memory, cut into `block_bytes` blocks.

    The buffer holds `capacity` rounded down to whole blocks. `pinned=True` asks for
    page-locked host memory (device must be the CPU); it is honoured only when CUDA is
    available, and `.pinned` says whether the buffer really is pinned. `buffer` (a uint8
    tensor of at least `capacity` bytes on `device`) makes the arena use those bytes instead
    of allocating its own.
    """

    def __init__(self, capacity, device="cpu", pinned: bool = False, block_bytes: int = 1024,
                 small_bytes: int = 0, buffer=None):
        if isinstance(capacity, str):
            capacity = parse_bytes(capacity)
        self.allocator = BlockAllocator(capacity, block_bytes, small_bytes)
        self.device = torch.device(device)
        if pinned and self.device.type != "cpu":
            raise ValueError(f"pinned memory is host memory; got device={str(self.device)!r}")
        pin = bool(pinned and torch.cuda.is_available())
        if buffer is None:
            check_available(self.allocator.capacity, self.device,
                            "a pinned host arena" if pin else f"an arena on {self.device}", pin)
            buffer = torch.empty(self.allocator.capacity, dtype=torch.uint8,
                                 device=self.device, pin_memory=pin)
        else:
            _check_buffer(buffer, self.allocator.capacity, self.device)
            pin = bool(pin and buffer.is_pinned())
        self.buffer = buffer
        self.pinned = pin

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def block_bytes(self) -> int:
        return self.allocator.block_bytes

    def alloc(self, nbytes, top: bool = False) -> Block:
        return self.allocator.alloc(nbytes, top)

    def free(self, block: Block) -> None:
        self.allocator.free(block)

    def view(self, block: Block, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor of `shape`/`dtype` aliasing bytes [offset, offset + numel*itemsize).

        ValueError if the block is not live in this arena or the tensor does not fit in it.
        """
        if not self.allocator.owns(block):
            raise ValueError(f"{block!r} is not a live block of this arena")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"shape must be non-negative ints, got {shape}")
        itemsize = dtype.itemsize
        n = math.prod(shape) * itemsize
        if n > block.nbytes:
            raise ValueError(f"a {tuple(shape)} {dtype} tensor needs {n} bytes; "
                             f"{block!r} holds {block.nbytes}")
        if block.offset % itemsize:
            raise ValueError(f"{block!r} offset is not aligned to {dtype} ({itemsize} bytes); "
                             f"use a block_bytes that is a multiple of {itemsize}")
        offset = block.offset
        return self.buffer[offset:offset + n].view(dtype).view(shape)

    def __repr__(self) -> str:
        pinned = ", pinned" if self.pinned else ""
        return f"Arena({self.device}{pinned}, {self.allocator!r})"


def _check_buffer(buffer, capacity: int, device: torch.device) -> None:
    """ValueError unless `buffer` is a contiguous uint8 tensor of >= `capacity` bytes on `device`."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1 \
            or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a contiguous 1-d uint8 tensor, got "
                         f"{getattr(buffer, 'dtype', type(buffer).__name__)}")
    if buffer.device != device and not (device.type == buffer.device.type == "cuda"
                                        and device.index is None):
        raise ValueError(f"buffer is on {buffer.device}, the arena on {device}")
    if buffer.numel() < capacity:
        raise ValueError(f"buffer holds {buffer.numel():,} bytes, the arena needs {capacity:,}")
