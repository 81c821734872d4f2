"""A timeline of one training step in the Chrome trace event format (Perfetto, chrome://tracing).

Set `rt.recorder = Recorder()` on a Runtime and every eager step it walks is recorded (each
walk replaces the previous one): every kernel on the compute stream, every copy on its copy
stream (to host, to device), each with its start and end, and the pool's bytes in use as a
counter track. Times come from CUDA events on the GPU and from `time.perf_counter` on the CPU
(where the interpreter runs kernels and copies synchronously). On the GPU a copy's start
is marked once its stream has waited for what the copy waits for (the compute queued before
a copy out, the plan's events), so its span is the transfer and any queueing behind the
copy before it on the same stream, not the wait for the kernel that produced its tensor.
Without a recorder the runtime records nothing (`rt.recorder` is None by default); a step
replayed from a CUDA graph is not walked, so it is not recorded either.

`write(recorder, path)` saves the last recorded step as JSON that Perfetto opens, with what
the step was (batch, policy, cap, device) and its figures (`summary`: the step time and the
fraction of it each stream is busy) in the file's `otherData`. `read(path)` loads such a file
and `plot(trace, path)` draws it (matplotlib, the `plot` extra): one lane of bars per stream
on a common time axis in ms, and below it the pool's bytes in use with the cap.
"""
from __future__ import annotations

import json
import time

import torch

from .sched.plan import Evict, Launch, Offload, Prefetch
from .tensor import await_copy_inputs
from .units import format_bytes

COMPUTE, TO_HOST, TO_DEVICE = "compute", "to host", "to device"
_COPY_STREAMS = {Offload: TO_HOST, Evict: TO_HOST, Prefetch: TO_DEVICE}
THREADS = {COMPUTE: 0, TO_HOST: 1, TO_DEVICE: 2}      # stream name -> the trace's thread id
COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "tab:red",
           "offload": "tab:green", "evict": "tab:olive", "prefetch": "tab:purple"}


class Recorder:
    """Start and end marks of the kernels and copies of the last walked step."""

    def __init__(self):
        self.spans = []        # (name, category, stream name, start mark, end mark)
        self.counter = []      # (mark, bytes in use): one sample per kernel
        self._base = None
        self._cuda = False
        self._streams = {}
        self.meta = {}         # what the step was: batch, policy, cap, device

    def begin(self, rt) -> bool:
        """Start a new step of runtime `rt`; False (record nothing) while a CUDA graph is
        being captured, whose events are not timed."""
        self._cuda = rt.device.type == "cuda"
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return False
        self.spans, self.counter = [], []
        self.meta = {"batch": rt.net.batch, "policy": rt.policy,
                     "cap_bytes": rt.plan.capacity, "device": str(rt.device)}
        self._streams = {COMPUTE: torch.cuda.current_stream(rt.device) if self._cuda else None,
                         TO_HOST: rt.to_host_stream, TO_DEVICE: rt.to_device_stream}
        self._base = self._mark(COMPUTE)
        return True

    def before(self, op, rt):
        """The start mark of plan operation `op` of runtime `rt`, or None when it is neither
        a kernel nor a copy (allocations, frees, waits and an evict that only discards take
        no time)."""
        stream = _stream_of(op)
        if stream is None:
            return None
        if self._cuda and stream != COMPUTE:
            self._await_inputs(op, stream, rt)
        return stream, self._mark(stream)

    def _await_inputs(self, op, stream, rt) -> None:
        """Make copy `stream` wait now for what copy `op` will wait for (tensor._copy: the
        compute queued so far before a copy out; the plan's events), so the start mark that
        follows is reached when the copy can begin. The copy's own waits then find them met:
        the schedule is unchanged."""
        await_copy_inputs(self._streams[stream], rt.events_of(op),
                          self._streams[COMPUTE] if stream == TO_HOST else None)

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
        out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
               for name, tid in THREADS.items()]
        for name, category, stream, start, end in self.spans:
            ts = self._us(start)
            out.append({"name": name, "cat": category, "ph": "X", "pid": 0,
                        "tid": THREADS[stream], "ts": ts, "dur": max(self._us(end) - ts, 0.0)})
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


def write(recorder: Recorder, path, **meta) -> int:
    """Write the recorded step to `path` as a Chrome trace; return the number of events.
    `meta` (e.g. model="resnet50") joins the recorder's own (batch, policy, cap, device) and
    the step's `summary` in the file's otherData, where `plot` finds its title."""
    events = recorder.events()
    other = {**recorder.meta, **meta, **summary(events)}
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, f)
    return len(events)


def read(path) -> dict:
    """The trace file at `path` as {"traceEvents": [...], "otherData": {...}} (a bare event
    list, Chrome's other format, too); ValueError naming the problem when it is no trace or
    holds no span to draw."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror})") from None
    except ValueError:                                  # not JSON, or not text at all
        raise ValueError(f"{path} is not a trace file: it is not JSON (write one with "
                         f"tinysn train --trace)") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path} is not a trace file: no traceEvents list (write one with "
                         f"tinysn train --trace)")
    if not all(isinstance(e, dict) for e in data["traceEvents"]):
        raise ValueError(f"{path} is not a trace file: its traceEvents are not all objects")
    try:
        summary(data["traceEvents"])
    except ValueError as err:                           # no spans, or a malformed one
        raise ValueError(f"{path}: {err}") from None
    data.setdefault("otherData", {})
    return data


def summary(events) -> dict:
    """The step's figures from its spans: `step_ms`, first start to last end, and `busy`,
    the fraction of that time each stream runs at least one span (overlapping spans count
    once). ValueError when `events` holds no span."""
    lanes = _lanes(events)
    every = [span for spans in lanes.values() for span in spans]
    if not every:
        raise ValueError("the trace holds no kernel or copy spans: nothing to draw (record "
                         "an eager step with tinysn train --trace)")
    first, last = min(s for s, _, _ in every), max(s + d for s, d, _ in every)
    step = last - first
    busy = {name: _covered(spans) / step if step > 0 else 0.0 for name, spans in lanes.items()}
    return {"step_ms": step / 1e3, "busy": busy}


def _lanes(events) -> dict:
    """Stream name -> its spans as (start us, duration us, category), for every stream the
    trace names (thread_name events; the recorder's three when it names none)."""
    names = {e.get("tid"): str(e["args"].get("name")) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"
             and isinstance(e.get("args"), dict)}
    names = names or {tid: name for name, tid in THREADS.items()}
    lanes = {name: [] for name in names.values()}
    for i, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        if not all(isinstance(e.get(k), (int, float)) for k in ("ts", "dur")):
            raise ValueError(f"trace event {i} ({e.get('name')!r}) is a span without a "
                             "numeric ts and dur")
        lanes.setdefault(names.get(e.get("tid"), f"thread {e.get('tid')}"), []).append(
            (e["ts"], e["dur"], e.get("cat", "")))
    return lanes


def _covered(spans) -> float:
    """Microseconds covered by the union of `spans` ((start, duration, _) tuples)."""
    total, reach = 0.0, float("-inf")
    for start, duration, _ in sorted(spans):
        end = start + duration
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def plot(trace: dict, path) -> dict:
    """Draw `trace` (as `read` returns it) to `path` (.png, .pdf, .svg): a lane of bars per
    stream over the step in ms, coloured by category, and below it the pool's bytes in use
    as a step line with the cap dashed. Returns the step's `summary`. Each (lane, category)
    is one collection of bars, so a step of 50,000 spans draws as fast as one of 50."""
    from matplotlib.figure import Figure

    events, meta = trace["traceEvents"], trace.get("otherData", {})
    figures, spans = summary(events), _lanes(events)
    end_ms = max(s + d for lane in spans.values() for s, d, _ in lane) / 1e3
    fig = Figure(figsize=(12, 6))
    lanes, memory = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.2, 1]})
    _draw_lanes(lanes, spans, figures["busy"])
    _draw_memory(memory, events, meta.get("cap_bytes"), end_ms)
    lanes.set_title(_title(meta, figures), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return figures


def _draw_lanes(ax, lanes, busy) -> None:
    """One row per stream, top to bottom in the trace's order, with a legend of categories."""
    labelled = set()
    for row, spans in enumerate(lanes.values()):
        y = len(lanes) - 1 - row
        for category in dict.fromkeys(c for _, _, c in spans):
            bars = [(s / 1e3, d / 1e3) for s, d, c in spans if c == category]
            colour = COLOURS.get(category, "tab:gray")
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colour, edgecolors=colour,
                           linewidth=0.3, label=None if category in labelled else category)
            labelled.add(category)
    ax.set_yticks(range(len(lanes)),
                  [f"{name}\n{busy[name]:.1%} busy" for name in reversed(list(lanes))])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _draw_memory(ax, events, cap, end_ms) -> None:
    """The counter track as a step line held to the step's end (`end_ms`), with the cap."""
    samples = [(e["ts"] / 1e3, e["args"]["bytes"]) for e in events
               if e.get("ph") == "C" and isinstance(e.get("ts"), (int, float))
               and isinstance((e.get("args") or {}).get("bytes"), (int, float))]
    top = max([cap or 0] + [b for _, b in samples])
    unit, scale = next((u, 2**p) for u, p in (("GiB", 30), ("MiB", 20), ("KiB", 10), ("B", 0))
                       if top >= 2**p or p == 0)
    if samples:
        samples.append((max(end_ms, samples[-1][0]), samples[-1][1]))
        ax.step([t for t, _ in samples], [b / scale for _, b in samples], where="post",
                color="black", linewidth=1, label="pool bytes in use")
    if cap:
        ax.axhline(cap / scale, color="tab:red", linestyle="--", linewidth=1,
                   label=f"cap {format_bytes(cap)}")
    ax.set_ylim(0, top / scale * 1.05 or 1)
    ax.set_ylabel(f"device memory in use ({unit})")
    ax.set_xlabel("time in the step (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _title(meta, figures) -> str:
    """Model, batch, policy, cap and device where the trace names them; the step time and
    the copy streams' busy fractions."""
    what = [str(meta["model"])] if meta.get("model") else []
    what += [f"{key} {meta[key]}" for key in ("batch", "policy") if meta.get(key) is not None]
    if meta.get("cap_bytes"):
        what.append(f"cap {format_bytes(meta['cap_bytes'])}")
    if meta.get("device"):
        what.append(f"on {meta['device']}")
    copies = ", ".join(f"{name} {share:.1%}" for name, share in figures["busy"].items()
                       if name != COMPUTE)
    return f"{' '.join(what)}: step {figures['step_ms']:,.1f} ms; copy streams busy: {copies}"
