"""The eager tensor: one named array whose storage lives in a pool and may move.

A Tensor knows its shape, dtype, name and kind, and where its bytes are right now:

    unallocated -> gpu -> (offloading -> host -> prefetching -> gpu)* -> freed
                    \\-> dropped (to be recomputed) -> gpu ...

Reading is allowed in "gpu" and "offloading" (a device-to-host copy only reads the
device block, so the data there stays valid until the block is released). Reading a tensor
that is dropped, on the host only, still arriving (prefetching), freed or never allocated
raises, so a schedule bug shows up as an error instead of silently wrong numbers.

Moves run on copy streams with one CUDA event per move; on the CPU they are plain
synchronous copies. By default a move waits for the work queued on the compute stream and
freeing a block waits on the host for a copy still touching it (safe on its own); the
Runtime passes exact event lists and `sync=False` instead, because its plan knows which
events each block's next writer needs (sched/plan.py). (The LRU cache's rule that the running
layer's tensors are never evicted is the planner's: sched/plan.py keeps them out of reach.)
"""
from __future__ import annotations

import math

import torch

KINDS = ("data", "grad", "param", "state", "workspace")
READABLE = ("gpu", "offloading")


class _DoneEvent:
    """Stand-in for a CUDA event on the CPU, where every copy is synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Tensor:
    """A named tensor whose storage is a block of a device Arena or a pinned host Arena."""

    __slots__ = ("id", "name", "shape", "dtype", "kind", "nbytes", "state", "block",
                 "host_block", "event", "_device_arena", "_host_arena", "_view")

    def __init__(self, name: str, shape, dtype=torch.float32, kind: str = "data", id: int = -1):
        if kind not in KINDS:
            raise ValueError(f"tensor kind must be one of {KINDS}, got {kind!r}")
        self.id = id
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.kind = kind
        self.nbytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        self.state = "unallocated"
        self.block = None          # device block while it has one
        self.host_block = None     # host block while it has one
        self.event = None          # the event of the last move
        self._device_arena = None
        self._host_arena = None
        self._view = None

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.shape}, {self.kind}, {self.state})"

    # -- placement -----------------------------------------------------------------------
    def allocate(self, arena, block=None, views=None) -> None:
        """Give the tensor a device block (allocated here unless one is passed).

        `views`, a dict, caches the torch view per offset: a plan puts a tensor at the same
        few offsets every iteration, and making a view costs more host time than the alloc.
        """
        if self.state not in ("unallocated", "dropped", "freed"):
            raise RuntimeError(f"cannot allocate {self.name}: it is {self.state}")
        self._device_arena = arena
        self.block = arena.alloc(self.nbytes) if block is None else block
        self._view = _cached_view(arena, self.block, self.shape, self.dtype, views)
        self.state = "gpu"

    def hand_block(self, other: "Tensor", views=None) -> None:
        """Give this tensor's device block to `other` (allocate's `views`), for a kernel
        that reads this tensor for the last time and writes `other` over it in place. This
        one stays readable until it is freed, which then returns no block."""
        if self.state != "gpu" or self.host_block is not None:
            raise RuntimeError(f"cannot hand the block of {self.name} over: it is {self.state}"
                               f"{' with a host copy' if self.host_block is not None else ''}")
        other.allocate(self._device_arena, block=self.block, views=views)
        self.block = None

    def view(self) -> torch.Tensor:
        """The torch view a kernel reads and writes; raises unless the data is on the device."""
        if self.state not in READABLE:
            raise RuntimeError(f"kernel read of {self.name} while it is {self.state}")
        return self._view

    def free(self, sync: bool = True) -> None:
        """Return the device block (and any host block) to their pools; with `sync` first
        wait for a copy still touching them (without it, the caller orders the next use)."""
        if self.state in ("unallocated", "freed"):
            raise RuntimeError(f"cannot free {self.name}: it is {self.state}")
        if sync and self.state in ("offloading", "prefetching"):
            self.event.synchronize()    # never hand out a block a copy still touches
        if self.block is not None:
            self._device_arena.free(self.block)
        if self.host_block is not None:
            self._host_arena.free(self.host_block)
        self.block = self.host_block = self._view = None
        self.state = "freed"

    def drop(self) -> None:
        """Free the device block of a tensor that the backward pass will recompute."""
        if self.state != "gpu":
            raise RuntimeError(f"cannot drop {self.name}: it is {self.state}")
        self.free()
        self.state = "dropped"

    # -- moves ---------------------------------------------------------------------------
    def offload(self, host_arena, copy_stream=None, host_block=None, waits=()) -> None:
        """Start copying the device data to a pinned host block (asynchronous on a GPU),
        after the compute queued so far and the events in `waits`."""
        if self.state != "gpu":
            raise RuntimeError(f"cannot offload {self.name}: it is {self.state}")
        self._host_arena = host_arena
        if self.host_block is None:
            self.host_block = host_arena.alloc(self.nbytes) if host_block is None else host_block
        host = host_arena.view(self.host_block, self.shape, self.dtype)
        self.event = _copy(host, self._view, copy_stream, waits, after_compute=True)
        self.state = "offloading"

    def release(self, sync: bool = True) -> None:
        """Free the device block of an offloaded tensor; with `sync` once the copy has
        finished (without it, the caller makes the block's next writer wait)."""
        if self.state != "offloading":
            raise RuntimeError(f"cannot release {self.name}: it is {self.state}")
        if sync:
            self.event.synchronize()
        self._device_arena.free(self.block)
        self.block = self._view = None
        self.state = "host"

    def discard(self) -> None:
        """Free the device block of a tensor whose host copy is still valid (no copy needed)."""
        if self.state != "gpu" or self.host_block is None:
            raise RuntimeError(f"cannot discard {self.name}: it is {self.state} without a host copy")
        self._device_arena.free(self.block)
        self.block = self._view = None
        self.state = "host"

    def prefetch(self, arena, copy_stream=None, block=None, views=None, waits=None) -> None:
        """Start copying the host data back into a new device block: after the events in
        `waits`, or (None) after everything queued on the compute stream."""
        if self.state != "host":
            raise RuntimeError(f"cannot prefetch {self.name}: it is {self.state}")
        self._device_arena = arena
        self.block = arena.alloc(self.nbytes) if block is None else block
        device = _cached_view(arena, self.block, self.shape, self.dtype, views)
        host = self._host_arena.view(self.host_block, self.shape, self.dtype)
        self.event = _copy(device, host, copy_stream, waits or (), after_compute=waits is None)
        self._view = device
        self.state = "prefetching"

    def wait(self, stream=None) -> None:
        """Make `stream` (or the host, on the CPU) wait for the prefetch; then it is readable."""
        if self.state != "prefetching":
            raise RuntimeError(f"cannot wait for {self.name}: it is {self.state}")
        if stream is not None:
            stream.wait_event(self.event)
        self.state = "gpu"


def _cached_view(arena, block, shape, dtype, views):
    if views is None:
        return arena.view(block, shape, dtype)
    view = views.get(block.offset)
    if view is None:
        view = views[block.offset] = arena.view(block, shape, dtype)
    return view


def await_copy_inputs(copy_stream, waits=(), compute=None) -> None:
    """Make `copy_stream` wait for the work queued so far on stream `compute` (None: none)
    and for the events `waits`: what a copy must follow (also used by tinysn.trace to time
    a copy from when it can begin)."""
    if compute is not None:
        copy_stream.wait_stream(compute)
    for event in waits:
        copy_stream.wait_event(event)


def _copy(dst: torch.Tensor, src: torch.Tensor, copy_stream, waits=(), after_compute=True):
    """Copy src into dst on `copy_stream` after the events `waits` (and, with
    `after_compute`, the work queued on the compute stream so far); return its event."""
    if copy_stream is None:
        dst.copy_(src)
        return _DoneEvent()
    await_copy_inputs(copy_stream, waits, torch.cuda.current_stream() if after_compute else None)
    with torch.cuda.stream(copy_stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(copy_stream)
    return event
