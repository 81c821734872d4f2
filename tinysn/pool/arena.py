"""Arena: one torch buffer plus a BlockAllocator that hands out views of it.

This is the ONLY place tinysn asks torch for memory. The device pool, the pinned host pool
(the Unified Tensor Pool's external side) and every tensor, gradient and workspace live in
an Arena's buffer; a tensor is a view of the bytes of its Block.
"""
from __future__ import annotations

import math

import torch

from ..units import parse_bytes
from .allocator import Block, BlockAllocator

__all__ = ["Arena"]


class Arena:
    """`capacity` bytes (or "512MiB") of `device` memory, cut into `block_bytes` blocks.

    The buffer holds `capacity` rounded down to whole blocks. `pinned=True` asks for
    page-locked host memory (device must be the CPU); it is honoured only when CUDA is
    available, and `.pinned` says whether the buffer really is pinned.
    """

    def __init__(self, capacity, device="cpu", pinned: bool = False, block_bytes: int = 1024,
                 small_bytes: int = 0):
        if isinstance(capacity, str):
            capacity = parse_bytes(capacity)
        self.allocator = BlockAllocator(capacity, block_bytes, small_bytes)
        self.device = torch.device(device)
        if pinned and self.device.type != "cpu":
            raise ValueError(f"pinned memory is host memory; got device={str(self.device)!r}")
        pin = bool(pinned and torch.cuda.is_available())
        self.buffer = torch.empty(self.allocator.capacity, dtype=torch.uint8,
                                  device=self.device, pin_memory=pin)
        self.pinned = pin

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def block_bytes(self) -> int:
        return self.allocator.block_bytes

    def alloc(self, nbytes) -> Block:
        return self.allocator.alloc(nbytes)

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
