"""The memory pool (not pooling layers: those are kernels/pool.py): BlockAllocator (pure
bookkeeping) and Arena (one torch buffer + an allocator)."""
from .allocator import Block, BlockAllocator
from .arena import Arena

__all__ = ["Arena", "Block", "BlockAllocator"]
