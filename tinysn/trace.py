"""A timeline of one training step in the Chrome trace event format (Perfetto, chrome://tracing).

Set `rt.recorder = Recorder()` on a Runtime and every eager step it walks is recorded (each
walk replaces the previous one): every kernel on the compute stream, every copy on its copy
stream (to host, to device), each with its start and end, and the pool's bytes in use as a
counter track. Times come from CUDA events on the GPU and from `time.perf_counter` on the CPU
(where the interpreter runs kernels and copies synchronously). A copy's span on the GPU
starts when its stream reaches it, so it includes the wait for the kernels it follows.
Without a recorder the runtime records nothing (`rt.recorder` is None by default); a step
replayed from a CUDA graph is not walked, so it is not recorded either.

`write(recorder, path)` saves the last recorded step as JSON that Perfetto opens.
"""
from __future__ import annotations

import json
import time

import torch

from .sched.plan import Evict, Launch, Offload, Prefetch

COMPUTE, TO_HOST, TO_DEVICE = "compute", "to host", "to device"
_COPY_STREAMS = {Offload: TO_HOST, Evict: TO_HOST, Prefetch: TO_DEVICE}


class Recorder:
    """Start and end marks of the kernels and copies of the last walked step."""

    def __init__(self):
        self.spans = []        # (name, category, stream name, start mark, end mark)
        self.counter = []      # (mark, bytes in use): one sample per kernel
        self._base = None
        self._cuda = False
        self._streams = {}

    def begin(self, rt) -> bool:
        """Start a new step of runtime `rt`; False (record nothing) while a CUDA graph is
        being captured, whose events are not timed."""
        self._cuda = rt.device.type == "cuda"
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return False
        self.spans, self.counter = [], []
        self._streams = {COMPUTE: torch.cuda.current_stream(rt.device) if self._cuda else None,
                         TO_HOST: rt.to_host_stream, TO_DEVICE: rt.to_device_stream}
        self._base = self._mark(COMPUTE)
        return True

    def before(self, op):
        """The start mark of plan operation `op`, or None when it is neither a kernel nor a
        copy (allocations, frees, waits and an evict that only discards take no time)."""
        stream = _stream_of(op)
        return None if stream is None else (stream, self._mark(stream))

    def after(self, start, op, step, rt) -> None:
        """Record the operation begun with mark `start` (None: nothing to record)."""
        if start is None:
            return
        stream, mark = start
        end = self._mark(stream)
        if stream == COMPUTE:
            name, category = f"{step.layer} {step.phase}", step.phase
            self.counter.append((mark, rt.arena.allocator.in_use))
        else:
            name, category = rt.tensors[op.tensor].name, type(op).__name__.lower()
        self.spans.append((name, category, stream, mark, end))

    def _mark(self, stream):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._streams[stream])
        return event

    def _us(self, mark) -> float:
        """Microseconds from the step's start to `mark`."""
        if not self._cuda:
            return (mark - self._base) * 1e6
        return self._base.elapsed_time(mark) * 1e3

    def events(self) -> list:
        """The recorded step as Chrome trace events (waits for the GPU to finish it)."""
        if self._base is None:
            raise ValueError("nothing recorded: set rt.recorder before a step (an eager one; "
                             "steps replayed from a CUDA graph are not walked)")
        if self._cuda:
            torch.cuda.synchronize()
        threads = {COMPUTE: 0, TO_HOST: 1, TO_DEVICE: 2}
        out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
               for name, tid in threads.items()]
        for name, category, stream, start, end in self.spans:
            ts = self._us(start)
            out.append({"name": name, "cat": category, "ph": "X", "pid": 0,
                        "tid": threads[stream], "ts": ts, "dur": max(self._us(end) - ts, 0.0)})
        out += [{"name": "pool bytes in use", "ph": "C", "pid": 0, "ts": self._us(mark),
                 "args": {"bytes": nbytes}} for mark, nbytes in self.counter]
        return out


def _stream_of(op):
    """The stream plan operation `op` runs on, or None when it is no kernel and no copy."""
    if isinstance(op, Launch):
        return COMPUTE
    if isinstance(op, Evict) and op.host_offset is None:   # dropped: the host copy is valid
        return None
    return _COPY_STREAMS.get(type(op))


def write(recorder: Recorder, path) -> int:
    """Write the recorded step to `path` as a Chrome trace; return the number of events."""
    events = recorder.events()
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)
