"""BlockAllocator: the bookkeeping half of the paper's GPU memory pool (§3.2).

The pool is one preallocated span cut into fixed-size blocks (1 KiB by default). A request
is rounded up to whole blocks and placed by FIRST FIT: the free run with the lowest offset
that is long enough. Allocated nodes are found by id through a dict (the paper's
ID-to-node hash table); a freed node is merged with free neighbours, so two free runs are
never adjacent.

No memory is touched here: offsets are plain integers. The same class keeps the books for
the device arena, the pinned host arena and the dry-run planner, which replays every
allocation of a plan, so the hot paths (`alloc`, `free`) are a handful of C-level list
operations:

- the free list is two parallel Python lists, `_starts` (sorted) and `_lens`, in blocks;
- first fit is one C-speed scan of `_lens` (itertools.compress over a map), O(#free runs);
- free finds its neighbours with one bisect on `_starts` and merges in place.

Nothing here waits for the GPU: a freed block may still be read by queued kernels or copies;
the plan orders its next writer after them with events (sched/plan.py, sched/offload.py).
"""
from __future__ import annotations

import operator
from bisect import bisect_right
from itertools import compress, count
from typing import NamedTuple

from ..errors import OutOfMemory
from ..units import format_bytes, parse_bytes

__all__ = ["Block", "BlockAllocator"]

_new_block = tuple.__new__      # Block(...) without namedtuple's Python-level __new__
_serials = count()              # each BlockAllocator's serial number, a Block's `owner`


class Block(NamedTuple):
    """One allocation: `nbytes` (rounded to whole blocks) at byte `offset` of its pool.

    `owner` is the serial number of the allocator that made it, so a block handed to another
    pool is caught (a number, not the allocator: the allocator's table of live blocks then
    forms no reference cycle, and it is freed with its last reference). Blocks are immutable
    and compare equal only to themselves (ids never repeat per pool, serials never repeat).
    """

    id: int
    offset: int
    nbytes: int
    owner: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def __repr__(self) -> str:
        return f"Block(id={self.id}, offset={self.offset}, nbytes={self.nbytes})"


def block_rounded(nbytes: int, block_bytes: int) -> int:
    """Bytes of the whole blocks a request of `nbytes` occupies."""
    return -(-nbytes // block_bytes) * block_bytes


def _request(nbytes) -> int:
    if type(nbytes) is not int:
        if isinstance(nbytes, bool):
            raise ValueError(f"allocation size must be a positive whole number of bytes, got {nbytes!r}")
        try:
            nbytes = operator.index(nbytes)
        except TypeError:
            raise ValueError(
                f"allocation size must be a positive whole number of bytes, got {nbytes!r}") from None
    if nbytes <= 0:
        raise ValueError(f"allocation size must be a positive whole number of bytes, got {nbytes!r}")
    return nbytes


class BlockAllocator:
    """First-fit allocator over `capacity_bytes` (rounded down) in units of `block_bytes`."""

    __slots__ = ("_small", "_bb", "_nblocks", "_starts", "_lens", "_used", "_used_blocks", "_peak_blocks",
                 "_next_id", "_serial", "__weakref__")

    def __init__(self, capacity_bytes, block_bytes: int = 1024, small_bytes: int = 0):
        """`small_bytes` > 0 places requests of at most that many bytes by first fit from
        the top of the pool (the end of the highest run that fits): small long-lived tensors
        (statistics, biases, scratch) then gather at one end instead of splitting the large
        runs that big activations need. 0 (the default) is plain first fit."""
        if isinstance(small_bytes, bool) or not isinstance(small_bytes, int) or small_bytes < 0:
            raise ValueError(f"small_bytes must be a non-negative int, got {small_bytes!r}")
        self._small = small_bytes
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if isinstance(capacity_bytes, str):
            capacity_bytes = parse_bytes(capacity_bytes)
        elif isinstance(capacity_bytes, bool):
            raise ValueError(f"capacity must be bytes or a string like '512MiB', got {capacity_bytes!r}")
        else:
            try:
                capacity_bytes = operator.index(capacity_bytes)
            except TypeError:
                raise ValueError(
                    f"capacity must be bytes or a string like '512MiB', got {capacity_bytes!r}") from None
        if capacity_bytes < 0:
            raise ValueError(f"capacity must not be negative, got {capacity_bytes!r}")
        self._bb = block_bytes
        self._nblocks = capacity_bytes // block_bytes
        # Free list, address ordered, in blocks: run k is [_starts[k], _starts[k] + _lens[k]).
        self._starts: list[int] = [0] if self._nblocks else []
        self._lens: list[int] = [self._nblocks] if self._nblocks else []
        self._used: dict[int, Block] = {}          # id -> Block (the ID-to-node table)
        self._used_blocks = 0
        self._peak_blocks = 0
        self._next_id = 0
        self._serial = next(_serials)

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, nbytes, top: bool = False) -> Block:
        """Return a Block of at least `nbytes` at the lowest offset that fits (`top`: at the
        highest, as requests up to `small_bytes` always are).

        Raises ValueError for nbytes <= 0 and OutOfMemory when no free run is long enough;
        a failed request changes nothing.
        """
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = _request(nbytes)
        bb = self._bb
        need = -(-nbytes // bb)
        lens = self._lens
        if top or nbytes <= self._small:
            return self._alloc_top(nbytes, need)
        i = self._first_run(need)
        if i < 0:
            raise self._oom(nbytes, need)
        starts = self._starts
        start = starts[i]
        rest = lens[i] - need
        if rest:
            starts[i] = start + need
            lens[i] = rest
        else:
            del starts[i]
            del lens[i]
        return self._record(start, need)

    def placement(self, nbytes: int, top: bool = False) -> int | None:
        """The offset `alloc(nbytes, top)` would return now, or None where it would fail;
        changes nothing (the planner asks before issuing a prefetch early: sched/plan.py)."""
        need = -(-nbytes // self._bb)
        if top or nbytes <= self._small:
            i = self._top_run(need)
            return None if i < 0 else (self._starts[i] + self._lens[i] - need) * self._bb
        i = self._first_run(need)
        return None if i < 0 else self._starts[i] * self._bb

    def _first_run(self, need: int) -> int:
        """Index of the lowest free run of at least `need` blocks, -1 if none. Usually the
        first run fits; else the scan over the lengths runs in C (compress/map)."""
        lens = self._lens
        if lens and lens[0] >= need:
            return 0
        return next(compress(count(), map(need.__le__, lens)), -1)

    def _top_run(self, need: int) -> int:
        """Index of the highest free run of at least `need` blocks, -1 if none."""
        lens = self._lens
        return next((j for j in range(len(lens) - 1, -1, -1) if lens[j] >= need), -1)

    def _alloc_top(self, nbytes: int, need: int) -> Block:
        """First fit from the top: the end of the highest free run that is long enough."""
        lens = self._lens
        i = self._top_run(need)
        if i < 0:
            raise self._oom(nbytes, need)
        start = self._starts[i] + lens[i] - need
        if lens[i] == need:
            del self._starts[i]
            del lens[i]
        else:
            lens[i] -= need
        return self._record(start, need)

    def _record(self, start: int, need: int) -> Block:
        used = self._used_blocks + need
        self._used_blocks = used
        if used > self._peak_blocks:
            self._peak_blocks = used
        bid = self._next_id
        self._next_id = bid + 1
        block = _new_block(Block, (bid, start * self._bb, need * self._bb, self._serial))
        self._used[bid] = block
        return block

    def free(self, block: Block) -> None:
        """Give `block` back now; it merges with free neighbours.

        ValueError if the block is not live in this allocator (double free, or a block of
        another allocator).
        """
        try:
            live = self._used.get(block.id)
        except AttributeError:
            live = None
        if live is not block:
            # slow path: an equal copy of a live block is fine; anything else is an error
            self._check_live(block)
        self._release(block.id)

    def _check_live(self, block) -> int:
        if not isinstance(block, Block) or block.owner != self._serial:
            raise ValueError(f"{block!r} does not belong to this allocator")
        bid = block.id
        if self._used.get(bid) != block:
            raise ValueError(f"{block!r} is not allocated (double free?)")
        return bid

    def _release(self, bid: int) -> int:
        block = self._used.pop(bid)
        bb = self._bb
        start = block.offset // bb
        n = block.nbytes // bb
        self._used_blocks -= n
        starts, lens = self._starts, self._lens
        k = bisect_right(starts, start)          # runs [0, k) start before `start`
        end = start + n
        if k and starts[k - 1] + lens[k - 1] == start:              # merge left
            if k < len(starts) and starts[k] == end:                 # ... and right
                lens[k - 1] += n + lens[k]
                del starts[k]
                del lens[k]
            else:
                lens[k - 1] += n
        elif k < len(starts) and starts[k] == end:                   # merge right
            starts[k] = start
            lens[k] += n
        else:
            starts.insert(k, start)
            lens.insert(k, n)
        return n

    # ------------------------------------------------------------------ figures
    @property
    def capacity(self) -> int:
        return self._nblocks * self._bb

    @property
    def block_bytes(self) -> int:
        return self._bb

    @property
    def in_use(self) -> int:
        return self._used_blocks * self._bb

    @property
    def peak(self) -> int:
        return self._peak_blocks * self._bb

    def reset_peak(self) -> None:
        self._peak_blocks = self._used_blocks

    @property
    def free_bytes(self) -> int:
        return (self._nblocks - self._used_blocks) * self._bb

    @property
    def largest_free(self) -> int:
        return max(self._lens, default=0) * self._bb

    @property
    def n_free_nodes(self) -> int:
        return len(self._starts)

    @property
    def n_used_nodes(self) -> int:
        return len(self._used)

    def free_runs(self) -> list[tuple[int, int]]:
        """[(offset, nbytes), ...] of the free runs, by offset."""
        bb = self._bb
        return [(s * bb, n * bb) for s, n in zip(self._starts, self._lens)]

    def used_blocks(self) -> list[Block]:
        """The live blocks, by offset."""
        return sorted(self._used.values(), key=operator.attrgetter("offset"))

    def owns(self, block) -> bool:
        """True if `block` is live in this allocator."""
        return (isinstance(block, Block) and block.owner == self._serial
                and self._used.get(block.id) == block)

    def _oom(self, nbytes: int, need: int) -> OutOfMemory:
        bb = self._bb
        free = self.free_bytes
        largest = self.largest_free
        return OutOfMemory(
            f"cannot allocate {nbytes} bytes ({format_bytes(nbytes)}; {need * bb} in "
            f"{bb}-byte blocks): {free} bytes free ({format_bytes(free)}), largest free run "
            f"{largest} bytes ({format_bytes(largest)}), capacity {self.capacity} bytes "
            f"({format_bytes(self.capacity)}), {self.in_use} bytes in use")

    def __repr__(self) -> str:
        return (f"BlockAllocator(capacity={self.capacity}, block_bytes={self._bb}, "
                f"in_use={self.in_use}, peak={self.peak}, free_runs={len(self._starts)}, "
                f"used_nodes={len(self._used)})")
