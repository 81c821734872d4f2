"""The Unified Tensor Pool (paper §3.3): offload to pinned host memory, prefetch, LRU cache.

Two ways to use host memory, chosen by the policy:

- always-offload ("offload", "recompute"): the output of every checkpoint layer (conv by
  default) is copied to the host on the copy stream as soon as it is produced; its device
  block is released after its last forward use, and it is prefetched back one step before
  its first backward use, so the copy overlaps the previous layer's compute.
- LRU tensor cache ("all", the paper's Alg. 2): tensors stay on the device while the pool has
  room. When an allocation would fail, the least recently used unlocked activations are
  evicted (copied out unless the host already holds a valid copy) until it fits; a tensor
  found on the device is a hit and moves nothing. An evicted tensor comes back by prefetch.
"""
from __future__ import annotations

from collections import OrderedDict

DEFAULT_CHECKPOINTS = ("data", "conv")


def checkpoint_layers(program, ops=DEFAULT_CHECKPOINTS) -> set:
    """Layers whose outputs the always-offload policies copy to the host.

    A ReLU right after a checkpoint conv counts as part of it: Caffe (the paper's base) runs
    that ReLU in place, so the tensor the paper offloads is the ReLU's output; here the ReLU
    writes a new tensor, and that is the one the backward pass reads.
    """
    chosen = {layer for layer in program.order if layer.op in ops}
    chosen |= {layer for layer in program.order
               if layer.op == "relu" and layer.inputs[0] in chosen and layer.inputs[0].op == "conv"}
    return chosen


class LRUCache:
    """Device-resident activations in least-recently-used order (Alg. 2's tensor cache).

    `touch` marks a use; `victims(exclude)` yields eviction candidates oldest first, never a
    tensor in `exclude` (the ones the running step has locked).
    """

    def __init__(self):
        self._order = OrderedDict()

    def __contains__(self, tid) -> bool:
        return tid in self._order

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, tid: int) -> None:
        self._order[tid] = None
        self._order.move_to_end(tid)

    def remove(self, tid: int) -> None:
        self._order.pop(tid, None)

    def victims(self, exclude):
        for tid in list(self._order):
            if tid not in exclude:
                yield tid
