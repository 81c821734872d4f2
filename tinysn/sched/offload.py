"""The Unified Tensor Pool (paper §3.3): offload to pinned host memory, prefetch, LRU cache.

Two ways to use host memory, chosen by the policy:

- always-offload ("offload", "recompute"): the output of every checkpoint layer (conv by
  default) is copied to the host (device-to-host stream) as soon as it is produced; its device
  block is released after its last forward use, and it is prefetched back one step before
  its first backward use, so the copy overlaps the previous layer's compute.
- LRU tensor cache ("all", the paper's Alg. 2): tensors stay on the device while the pool has
  room. When an allocation would fail, the least recently used unlocked activations are
  evicted (copied out unless the host already holds a valid copy) until it fits; a tensor
  found on the device is a hit and moves nothing. An evicted tensor comes back by prefetch.
  The planner plans twice so that each victim's copy starts right after its last use
  rather than at its eviction (`EvictionLog`, `EarlyWriteBacks`).

No copy is waited for on the host: `FreedRanges` (below) tells the planner which events the
next writer of a freed block must wait for.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict

from ..ops import spec
from ..pool.allocator import block_rounded

DEFAULT_CHECKPOINTS = ("data", "conv")


def checkpoint_layers(program, ops=DEFAULT_CHECKPOINTS) -> set:
    """Layers whose outputs the always-offload policies copy to the host.

    `ops` names the checkpoint layers' ops. A layer that Caffe (the paper's base) runs in
    place (ReLU) right after a checkpoint other than the data layer counts as part of it:
    the tensor the paper offloads is that layer's output; here it writes a new tensor, and
    that is the one the backward pass reads.
    """
    chosen = {layer for layer in program.order if layer.op in ops}
    chosen |= {layer for layer in program.order if spec(layer).in_place_in_caffe
               and layer.inputs[0] in chosen and not spec(layer.inputs[0]).is_data}
    return chosen


class LRUCache:
    """Device-resident activations in least-recently-used order (Alg. 2's tensor cache).

    `touch` marks a use; `victims(exclude)` yields eviction candidates oldest first, never a
    tensor in `exclude` (the ones the running step has locked). `nbytes` is the members'
    device bytes (their blocks in `blocks`, tensor id -> block, when they joined), kept as
    members come and go so the planner never sums over the cache.
    """

    def __init__(self, blocks=None):
        self._order = OrderedDict()    # tensor id -> its bytes
        self._blocks = {} if blocks is None else blocks
        self.nbytes = 0

    def __contains__(self, tid) -> bool:
        return tid in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self):
        return iter(self._order)

    def touch(self, tid: int) -> None:
        if tid in self._order:
            self._order.move_to_end(tid)
            return
        block = self._blocks.get(tid)
        self._order[tid] = 0 if block is None else block.nbytes
        self.nbytes += self._order[tid]

    def remove(self, tid: int) -> None:
        self.nbytes -= self._order.pop(tid, 0)

    def victims(self, exclude):
        for tid in list(self._order):
            if tid not in exclude:
                yield tid


class FreedRanges:
    """What may still touch each freed byte range of a pool, so its next writer waits for that.

    The runtime runs kernels on the compute stream and copies on two copy streams (device to
    host, host to device), and frees blocks without waiting on the host. A freed range can
    still be read by a kernel queued earlier on the compute stream or by a copy in flight;
    the next writer of any of its bytes must wait for exactly those, no more (waiting for
    everything queued would serialise copies and compute again). Each entry records, for a
    disjoint [start, end): `pos`, the number of kernels launched when it was freed (a copy
    stream waits for the compute event marked after that kernel), and `slots`, the event
    slots of copies still reading it. `take` hands back what overlaps a new block and keeps
    the parts outside it.
    """

    def __init__(self):
        self._starts: list = []
        self._rest: dict = {}          # start -> (end, pos, slots)

    def add(self, start: int, end: int, pos: int, slots=()) -> None:
        """Record that [start, end) was freed after `pos` kernels, still read by `slots`."""
        if pos == 0 and not slots:
            return                     # nothing of this iteration touched it yet
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._rest[self._starts[i - 1]][0] > start or \
                i < len(self._starts) and self._starts[i] < end:
            raise AssertionError(f"planner bug: freed range [{start}, {end}) overlaps another")
        self._starts.insert(i, start)
        self._rest[start] = (end, pos, frozenset(slots))

    def take(self, start: int, end: int):
        """(largest pos, union of slots) over the entries overlapping [start, end), which are
        removed there (their parts outside the range stay)."""
        pos, slots = 0, set()
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while i < len(self._starts) and self._starts[i] < end:
            s = self._starts[i]
            e, p, sl = self._rest[s]
            if e <= start:
                i += 1
                continue
            pos, slots = max(pos, p), slots | sl
            del self._starts[i]
            del self._rest[s]
            if s < start:
                self._starts.insert(i, s)
                self._rest[s] = (start, p, sl)
                i += 1
            if e > end:
                self._starts.insert(i, end)
                self._rest[end] = (e, p, sl)
                i += 1
        return pos, slots


class EvictionLog:
    """What the LRU cache evicted in one planning pass, for a second pass that copies those
    victims to the host early.

    The cache copies a victim out only when an allocation fails, so the allocation's writer
    waits for that copy: compute stalls on PCIe exactly when memory is short. A victim's
    bytes do not change after its last use, so the copy can start right then, and the
    eviction later finds a valid host copy and moves nothing. The decisions of a planning
    pass do not depend on when copies start, so a second pass evicts the same tensors at the
    same steps; this log tells it which, and how many host bytes the first pass held when.

    Time is counted in ticks: one at each recorded step and one at each host allocation.
    `ticks[t]` is the host bytes in use at tick t; until the next tick they can only fall
    (frees), so it is also the most held in between."""

    def __init__(self):
        self.last_use = {}     # tid -> index of the last step whose kernel used it so far
        self.victims = {}      # tid -> (index of its last use, tick of its eviction's copy)
        self.ticks = []        # tick -> host bytes in use
        self.step_ticks = []   # step index -> the tick at which that step was recorded

    def stepped(self, index: int, used, host_in_use: int) -> None:
        """Step `index` was recorded; its kernel reads or writes `used`."""
        for tid in used:
            self.last_use[tid] = index
        self.ticks.append(host_in_use)
        self.step_ticks.append(len(self.ticks) - 1)

    def host_alloc(self, host_in_use: int) -> None:
        """A host block was allocated; `host_in_use` bytes are in use now."""
        self.ticks.append(host_in_use)

    def evicted(self, tid: int) -> None:
        """`tid` was evicted with the copy whose host block was allocated last."""
        self.victims[tid] = (self.last_use[tid], len(self.ticks) - 1)


class EarlyWriteBacks:
    """The second pass's write-backs, from the first pass's EvictionLog.

    Victims are copied in the order the first pass evicted them (the copy stream is a
    queue: the copy needed first goes first), each right after its last use or right after
    the previous victim's write-back, whichever is later. An early copy holds its host
    block from its write-back until the first pass would have allocated it, so it is
    admitted only if, at every tick in between, the first pass's host bytes plus the copies
    already admitted plus this one stay within the host cap; a victim not admitted is
    copied out at its eviction, as in the first pass.
    """

    def __init__(self, log: EvictionLog, host_capacity: int, block_bytes: int):
        self.log, self.capacity, self.block_bytes = log, host_capacity, block_bytes
        self.extra = [0] * len(log.ticks)
        self.due = {}              # step index -> victims to write back after its kernel
        issue = -1
        for tid, (last, _) in sorted(log.victims.items(), key=lambda kv: kv[1][1]):
            issue = max(issue, last)
            self.due.setdefault(issue, []).append(tid)

    def after(self, index: int) -> list:
        """The victims to write back once step `index` has been recorded."""
        return self.due.get(index, [])

    def admit(self, tid: int, nbytes: int, index: int) -> bool:
        """Reserve `tid`'s host bytes from the end of step `index` to its eviction, if the
        host cap allows it at every tick in between."""
        need = block_rounded(nbytes, self.block_bytes)
        span = range(self.log.step_ticks[index], self.log.victims[tid][1])
        if any(self.log.ticks[t] + self.extra[t] + need > self.capacity for t in span):
            return False
        for t in span:
            self.extra[t] += need
        return True


class Headroom:
    """Device bytes a first planning pass left free at each step, for a second pass that
    issues prefetches early (`plan._Planner._prefetch_early`).

    An early prefetch holds its block from its issue to the step where the first pass
    allocated it (one step before the use). The first pass's decisions hold in the second
    only while every allocation still finds room, so an early prefetch is admitted only if,
    at every step in between, the bytes the first pass had free there minus the early
    prefetches already admitted over that step still hold its block; else it waits."""

    def __init__(self, free, first_step, blocked=None):
        self.free = tuple(free)              # step index -> bytes free at its launch
        self.first_step = tuple(first_step)  # pass index -> its first step (recomputes first)
        self.reserved = [0] * len(self.free)
        self.blocked = set() if blocked is None else blocked   # steps no early block spans

    @classmethod
    def of(cls, plan, block_bytes: int) -> "Headroom":
        """The headroom of `plan`'s steps, in whole blocks."""
        free, first_step, start = [], [], 0
        for step in plan.steps:
            spare = plan.capacity - step.bytes_in_use
            free.append(spare // block_bytes * block_bytes)
            if step.phase != "recompute":
                first_step.append(start)
                start = step.index + 1
        return cls(free, first_step)

    def fresh(self) -> "Headroom":
        """The same headroom with nothing admitted (one per planning pass); the blocked steps
        are shared."""
        return Headroom(self.free, self.first_step, self.blocked)

    def block(self, step: int) -> bool:
        """Admit no early block over `step` from now on (an allocation failed there with
        early blocks held); False when it was blocked already (blocking changes nothing)."""
        if step in self.blocked:
            return False
        self.blocked.add(step)
        return True

    def admit(self, issue: int, use_pass: int, nbytes: int) -> bool:
        """Reserve `nbytes` (rounded up as `free` is) over the steps after step `issue` and
        before the first step of pass `use_pass`, if every one of them has room."""
        span = range(issue + 1, self.first_step[use_pass])
        if any(self.free[s] - self.reserved[s] < nbytes or s in self.blocked for s in span):
            return False
        for s in span:
            self.reserved[s] += nbytes
        return True
