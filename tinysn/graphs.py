"""CUDA-graph replay of a Runtime's training step (`Runtime(cuda_graph=True)`).

Launching a Triton kernel from Python costs ~16 us of host time, a replayed one ~1 us
(docs/design.md). The plan makes capture possible: every allocation, offset, copy, event and
algorithm of a step is the same every iteration. The Runtime runs its first `GRAPH_WARMUP`
steps eagerly (they compile and tune every kernel; a capture must not), then hands each step
to its `GraphReplay`: the first one captures the plan's walk (the allocator and every check
run in Python as always, so the captured pass verifies peak == plan) and replays it; later
ones replay on the batch the Runtime copied into the pool's data and labels tensors at
their planned offsets, or, staged, into the plan's staging span, which the captured step
copies from first (the graph reads fixed addresses inside the pool); the events after that
copy and after the loss are external, so each replay records them for the host and the
staging stream. The learning rate is read from the pool by the updates (kernels/sgd.py;
the Runtime writes it there before a step whose rate changed), so a schedule replays the
same graph; changing momentum or weight_decay (or the seed, which load_state_dict may set)
triggers a new capture (they are launch arguments). Dropout replays too: its kernels read
the iteration from a counter in the pool, and the kernel that advances it at the end of
the step is part of the graph, so each replay draws the masks an eager step would.
"""
from __future__ import annotations

import torch


GRAPH_WARMUP = 2   # eager steps before a capture (compiles, autotuning, first-call caches)


class GraphReplay:
    """The captured step of one Runtime: `graph` (None until captured), the optimizer
    settings and seed, `key`, it was captured with (the learning rate is not among them: the
    updates read it from the pool), `captures` (how many so far), and the bytes each replay
    copies each way.
    The Runtime owns it and passes itself to each call (so nothing refers back to it)."""

    def __init__(self):
        self.graph = self.key = None
        self.captures = 0
        self.moved = (0, 0)              # bytes one captured step copies (to host, to device)

    def step(self, rt) -> None:
        """(Re)capture runtime `rt`'s step when needed, then replay it on the batch the
        Runtime copied into the pool (Runtime._batch_in_pool)."""
        key = (rt.momentum, rt.weight_decay, rt.seed)
        if self.graph is None or self.key != key:
            self._capture(rt, key)
        self.graph.replay()
        rt.stats.bytes_to_host += self.moved[0]
        rt.stats.bytes_to_device += self.moved[1]

    def _capture(self, rt, key) -> None:
        """Record one walk of `rt`'s plan as a CUDA graph (nothing runs while it records); the
        copy counters it advanced are put back and added once per replay instead."""
        stats = rt.stats
        self.graph = None
        torch.cuda.synchronize(rt.device)
        before = (stats.bytes_to_host, stats.bytes_to_device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stream = torch.cuda.current_stream(rt.device)
            rt.to_host_stream.wait_stream(stream)        # the copy streams join the capture
            rt.to_device_stream.wait_stream(stream)
            rt._walk(rt._batch_in_pool()[0], None)
        self.moved = (stats.bytes_to_host - before[0], stats.bytes_to_device - before[1])
        stats.bytes_to_host, stats.bytes_to_device = before
        self.graph, self.key = graph, key
        self.captures += 1
