"""Property-based testing of memory schedules: hypothesis strategies and schedule oracles.

A researcher who changes the planner (a new eviction rule, a new recomputation policy) wants
hypothesis to find the net on which it breaks. This module gives the pieces:

    import hypothesis.strategies as st
    from hypothesis import given
    import tinysn as sn
    import tinysn.testing as snt

    @snt.settings(20)                     # 20 examples, or $TINYSN_EXAMPLES for a long run
    @given(net=snt.nets(), policy=snt.policies(), data=st.data())
    def test_every_plan_is_a_correct_schedule(net, policy, data):
        cap = data.draw(snt.caps(net, policy))
        snt.check_plan(sn.plan(net, cap, policy))

Strategies: `nets()` (random fan/join graphs over every layer type), `policies()`,
`caps(net, policy)` (device caps from the smallest feasible one upward), `host_caps(net,
policy, memory)` (pinned host caps likewise, or None for unbounded). Oracles:
`check_plan(plan)` replays a plan symbolically and raises `ScheduleError` naming the step,
layer and tensor when a schedule rule breaks; `check_equivalent(net, policies)` trains under
each policy and demands bitwise-equal parameters and a measured peak equal to the plan's.
Fixed nets for quick checks: `every_layer_net()` and `block_net()`.

The rules `check_plan` enforces (each ScheduleError carries one of these as `.rule`):
    access      a kernel reads a tensor that is freed, dropped, on the host, or still in
                flight (prefetched without a Wait); or writes one without a device block
    state       an operation the tensor's state forbids (offload of a dropped tensor, ...)
    stream      bytes reused or overwritten while another stream may still touch them: the
                plan is replayed on three vector-clocked streams (compute, to host, to
                device) joined only where the plan waits (Wait, Sync, `waits`)
    overlap     two live tensors overlap in the device or host arena
    in place    a block handed over (Hand) other than to the gradient the next kernel writes
                over dy (liveness.LayerPass.in_place); its old owner read after that kernel
                breaks "access", and never freed "leak"
    cap         a block beyond the device cap, or beyond the host arena (the plan's
                host_bytes, or `host_memory`)
    leak        a tensor still holds device or host bytes when the iteration ends
    recompute   a recomputation that would update batch-norm running statistics (a logical
                step launched twice) or redraw a dropout mask (rebuilt before its forward
                ran this iteration), recomputes a layer that is neither recomputable
                nor one of the plan's traded layers (`recompute.Traded`), or rebuilds a
                conv with other algorithms than its forward pass ran (other bits)
    program     a layer pass missing, repeated or out of its place (layer, phase)
    figures     the plan's own figures (peak, bytes in use per step, bytes moved,
                recomputed steps) disagree with what its operations do
`check_equivalent` raises rule "equivalence" when policies' results or peaks disagree.

hypothesis is imported here only: `import tinysn` does not import this module.
"""
from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings as _settings, strategies as st

from . import graph
from .ops import spec
from .pool.allocator import block_rounded
from .runtime import Runtime
from .sched import recompute as recompute_mod
from .sched.plan import (POLICIES, Alloc, Drop, Evict, Free, Hand, Launch, Mark, Offload,
                         Prefetch, Release, Sync, Wait, fits, plan)
from .units import parse_bytes

__all__ = ["nets", "policies", "caps", "host_caps", "smallest_cap", "smallest_host_cap",
           "check_plan", "check_equivalent", "ScheduleError", "settings", "examples",
           "every_layer_net", "block_net"]

BLOCK_BYTES = 1024      # the pool's block size (sn.plan's and the Runtime's default)


# -- example counts ---------------------------------------------------------------------
def examples(default: int) -> int:
    """`default`, or the number in $TINYSN_EXAMPLES (a nightly-sized run) when it is set."""
    value = os.environ.get("TINYSN_EXAMPLES")
    if value is None:
        return default
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"TINYSN_EXAMPLES must be a positive whole number, got {value!r}")
    return int(value)


def settings(default_examples: int = 10, **kwargs):
    """hypothesis settings for schedule properties: `examples(default_examples)` examples,
    no deadline (plans and CPU kernels vary in time), no too-slow health checks."""
    kwargs.setdefault("deadline", None)
    kwargs.setdefault("suppress_health_check", [HealthCheck.too_slow,
                                                HealthCheck.data_too_large])
    return _settings(max_examples=examples(default_examples), **kwargs)


# -- nets ---------------------------------------------------------------------------------
class DrawnNet(graph.Net):
    """A Net whose repr is the code that builds it, so a failing example reads as a recipe."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.source = [f"net = sn.Net({_args(args, kwargs, {})})"]
        self._vars = {}

    def record(self, method, *args, **kwargs):
        """Call the builder `method` and write the call down; returns the new Layer."""
        layer = getattr(self, method)(*args, **kwargs)
        self._vars[layer] = f"h{len(self._vars)}"
        self.source.append(f"{self._vars[layer]} = net.{method}({_args(args, kwargs, self._vars)})")
        return layer

    def __repr__(self):
        return "\n".join(["", *self.source, ""])


def _args(args, kwargs, names) -> str:
    def text(a):
        if isinstance(a, graph.Layer):
            return names[a]
        if isinstance(a, list):
            return "[" + ", ".join(text(x) for x in a) + "]"
        return repr(a)
    return ", ".join([text(a) for a in args] + [f"{k}={text(v)}" for k, v in kwargs.items()])


# Body kinds, simplest first: hypothesis shrinks a sampled choice toward the front.
BODY = ("relu", "conv", "bn", "pool", "lrn", "dropout", "add", "concat", "skip")
HEADS = ("fc", "fc_relu_fc", "fc_dropout_fc")


def nets(min_layers: int = 1, max_layers: int = 6, max_batch: int = 3,
         max_channels: int = 4, min_size: int = 3, max_size: int = 7, kinds=BODY):
    """Random valid nets: `min_layers`..`max_layers` body blocks drawn from `kinds` (conv,
    bn, relu, max/avg pool, lrn, dropout, and joins: a residual `add` of a fan of branches,
    a `concat` of branches, a `skip` add to an earlier output of the same shape) on
    (channels, size, size) images, then an fc head (sometimes fc-relu/dropout-fc) and the
    softmax loss. Shrinks toward one ReLU block on a small image at batch 1. The net's repr
    is the code that builds it."""
    if not 0 <= min_layers <= max_layers or min(max_batch, max_channels) < 1 \
            or not 1 <= min_size <= max_size:
        raise ValueError(f"nets: bounds must satisfy 0 <= min_layers <= max_layers, "
                         f"max_batch, max_channels >= 1, 1 <= min_size <= max_size; got "
                         f"{min_layers}, {max_layers}, {max_batch}, {max_channels}, "
                         f"{min_size}, {max_size}")
    unknown = set(kinds) - set(BODY)
    if unknown or not kinds:
        raise ValueError(f"nets: kinds must be a non-empty subset of {BODY}, got {kinds!r}")
    return _nets(min_layers, max_layers, max_batch, max_channels, min_size, max_size,
                 tuple(kinds))


@st.composite
def _nets(draw, min_layers, max_layers, max_batch, max_channels, min_size, max_size, kinds):
    size = draw(st.integers(min_size, max_size))
    net = DrawnNet(input_shape=(draw(st.integers(1, max_channels)), size, size),
                   classes=draw(st.integers(2, 4)), batch=draw(st.integers(1, max_batch)))
    h = net.record("data")
    outputs = [h]
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=min_layers, max_size=max_layers)):
        h = _BLOCKS[kind](draw, net, h, outputs, max_channels)
        outputs.append(h)
    _head(draw, net, h)
    return net


def _conv(draw, net, h, channels, allow_stride=True):
    kernel = draw(st.sampled_from([1, 3]))
    stride = draw(st.sampled_from([1, 2])) if allow_stride and h.shape[2] >= 4 else 1
    return net.record("conv", h, channels, kernel=kernel, stride=stride, padding=kernel // 2)


def _pool(draw, net, h, keep_shape=False):
    """Max or average pooling; `keep_shape`: a 3x3 window, stride 1, padding 1."""
    mode = draw(st.sampled_from(["max", "avg"]))
    kernel = 3 if keep_shape or h.shape[2] < 2 else draw(st.sampled_from([3, 2]))
    stride = 1 if keep_shape or h.shape[2] < 4 else draw(st.sampled_from([1, 2]))
    return net.record("pool", h, mode, kernel=kernel, stride=stride,
                      padding=kernel // 2 if kernel == 3 else 0)


def _branches(draw, net, h, max_channels, same_shape):
    """2-3 branches out of `h` (a fan): identity (at most once), conv, conv-relu, pool.
    With `same_shape` each keeps h's shape (for add); else channels vary (for concat)."""
    branches, identity = [], False
    for kind in draw(st.lists(st.sampled_from(["conv", "identity", "conv_relu", "pool"]),
                              min_size=2, max_size=3)):
        if kind == "identity" and not identity:
            identity = True
            branches.append(h)
        elif kind == "pool":
            branches.append(_pool(draw, net, h, keep_shape=True))
        else:
            channels = h.shape[1] if same_shape else draw(st.integers(1, max_channels))
            y = _conv(draw, net, h, channels, allow_stride=False)
            branches.append(net.record("relu", y) if kind == "conv_relu" else y)
    return branches


def _bn(net, h):
    """Batch norm where it has more than one value per channel to normalise, else ReLU."""
    n, _, height, width = h.shape
    return net.record("bn", h) if n * height * width > 1 else net.record("relu", h)


def _skip(draw, net, h, outputs, max_channels):
    same = [e for e in outputs if e.shape == h.shape and e is not h]
    return net.record("add", h, draw(st.sampled_from(same))) if same else h


_BLOCKS = {
    "relu": lambda draw, net, h, outs, c: net.record("relu", h),
    "conv": lambda draw, net, h, outs, c: _conv(draw, net, h, draw(st.integers(1, c))),
    "bn": lambda draw, net, h, outs, c: _bn(net, h),
    "pool": lambda draw, net, h, outs, c: _pool(draw, net, h),
    "lrn": lambda draw, net, h, outs, c: net.record("lrn", h, size=draw(st.sampled_from([3, 2, 5]))),
    "dropout": lambda draw, net, h, outs, c: net.record("dropout", h,
                                                         p=draw(st.sampled_from([0.5, 0.0]))),
    "add": lambda draw, net, h, outs, c: net.record("add", _branches(draw, net, h, c, True)),
    "concat": lambda draw, net, h, outs, c: net.record("concat", _branches(draw, net, h, c, False)),
    "skip": _skip,
}


def _head(draw, net, h):
    head = draw(st.sampled_from(HEADS))
    if head != "fc":
        h = net.record("fc", h, draw(st.integers(2, 6)))
        h = net.record("relu", h) if head == "fc_relu_fc" else net.record("dropout", h, p=0.5)
    net.record("softmax_loss", net.record("fc", h, net.classes))


def every_layer_net(batch=2, p=0.0, classes=5):
    """Every layer type once, a fan, a concat join and a residual add, on 9x9 images."""
    net = graph.Net(input_shape=(3, 9, 9), classes=classes, batch=batch)
    x = net.data()
    h = net.relu(net.bn(net.conv(x, 6, kernel=3, padding=1, name="c1")))
    a = net.conv(h, 4, kernel=1, name="fa")                         # fan ...
    b = net.conv(h, 3, kernel=3, padding=1, bias=False, name="fb")
    h = net.concat([a, b], name="cat")                              # ... and join: 7 channels
    h = net.add(h, net.conv(x, 7, kernel=1, name="proj"), name="res")  # residual join
    h = net.pool(h, "max", kernel=3, stride=2, padding=1, name="mp")    # 5x5
    h = net.lrn(h, size=3, name="norm")
    h = net.pool(h, "avg", kernel=2, stride=1, name="ap")               # 4x4
    h = net.dropout(h, p=p, name="drop")
    h = net.relu(net.fc(h, 8, name="fc1"))
    net.softmax_loss(net.fc(h, classes, name="fc2"), name="loss")
    return net


def block_net(batch=2, p=0.3):
    """Residual conv-bn-relu blocks, max pool and dropout: the recompute policy rebuilds
    batch norms, ReLUs, the pool and the dropout here (its plan beats the one without)."""
    net = graph.Net(input_shape=(3, 8, 8), classes=4, batch=batch)
    h = net.relu(net.bn(net.conv(net.data(), 8, kernel=3, padding=1, bias=False)))
    for _ in range(2):
        y = net.relu(net.bn(net.conv(h, 8, kernel=3, padding=1, bias=False)))
        y = net.bn(net.conv(y, 8, kernel=3, padding=1, bias=False))
        h = net.relu(net.add(h, y))
    h = net.dropout(net.pool(h, "max", kernel=2, stride=2), p=p)
    net.softmax_loss(net.fc(h, 4))
    return net


# -- policies and caps --------------------------------------------------------------------
def policies(choices=POLICIES):
    """One of `choices` (default every policy); shrinks toward "baseline"."""
    unknown = [p for p in choices if p not in POLICIES]
    if unknown or not choices:
        raise ValueError(f"policies: choose a non-empty subset of {POLICIES}, got {choices!r}")
    return st.sampled_from(tuple(choices))


def _smallest(fits, hi: int) -> int:
    """The smallest multiple of BLOCK_BYTES for which `fits` is true, by bisection below
    `hi` (doubled first until it fits; fits is assumed monotone, as sn.plan promises)."""
    lo, hi = 0, max(1, -(-hi // BLOCK_BYTES))    # in blocks: lo fails, hi fits
    while not fits(hi * BLOCK_BYTES):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * BLOCK_BYTES) else (mid, hi)
    return hi * BLOCK_BYTES


def _roomy(net, policy, **plan_kwargs):
    """A plan with room for everything: eight times the layer outputs, plus 64 MiB."""
    everything = sum(layer.nbytes for layer in net) * 8 + (64 << 20)
    return plan(net, everything, policy, **plan_kwargs)


def smallest_cap(net, policy: str, **plan_kwargs) -> int:
    """The smallest device cap (a whole number of pool blocks) at which `net` plans under
    `policy` with `plan_kwargs` (sn.plan's momentum=, conv_algos=, host_memory=, ...)."""
    hi = _roomy(net, policy, **plan_kwargs).required_bytes
    return _smallest(lambda cap: fits(net, cap, policy, **plan_kwargs), hi)


def caps(net, policy: str, **plan_kwargs):
    """Device caps for `net` under `policy`, from the smallest feasible one (found by
    bisection with the planner's fit test, plan.fits) up to one where nothing has to move;
    shrinks toward the smallest, where the scheduler works hardest. Pass the plan_kwargs
    you plan with."""
    lo = smallest_cap(net, policy, **plan_kwargs)
    hi = max(lo, _roomy(net, policy, **plan_kwargs).required_bytes)
    return st.integers(lo, hi)


def smallest_host_cap(net, policy: str, memory, **plan_kwargs) -> int:
    """The smallest pinned host cap (whole blocks) at which `net` plans under `policy` and
    device cap `memory`; raises OutOfMemory when it does not plan even with unbounded host."""
    hi = plan(net, memory, policy, **plan_kwargs).host_bytes
    return _smallest(lambda host: fits(net, memory, policy, host_memory=host, **plan_kwargs),
                     max(hi, BLOCK_BYTES))


def host_caps(net, policy: str, memory, **plan_kwargs):
    """Host caps for `net` under `policy` and device cap `memory`: None (unbounded) or a
    byte count from the smallest feasible one up to what the unbounded plan uses."""
    lo = smallest_host_cap(net, policy, memory, **plan_kwargs)
    hi = max(lo, plan(net, memory, policy, **plan_kwargs).host_bytes)
    return st.none() | st.integers(lo, hi)


# -- the plan oracle ----------------------------------------------------------------------
class ScheduleError(AssertionError):
    """A schedule rule broken: `rule` (see the module docstring), `where` (iteration and
    step, with its phase and layer) and `tensor` (its name, or None)."""

    def __init__(self, rule: str, where: str, tensor, message: str):
        self.rule, self.where, self.tensor = rule, where, tensor
        named = f", tensor {tensor}" if tensor else ""
        super().__init__(f"[{rule}] {where}{named}: {message}")


COMPUTE, TO_HOST, TO_DEVICE = 0, 1, 2
STREAMS = ("compute", "to-host copy", "to-device copy")
READABLE = ("gpu", "offloading")


def _blocks(nbytes: int) -> int:
    """Bytes of the pool blocks a request of `nbytes` occupies."""
    return block_rounded(nbytes, BLOCK_BYTES)


class _Clocks:
    """Three streams with vector clocks, joined only where the plan makes one wait; every
    access to a byte range is checked against the earlier conflicting ones."""

    def __init__(self, fail):
        self.fail = fail
        self.clock = [[0, 0, 0] for _ in STREAMS]
        self.events = {}
        self.accesses = {"device": [], "host": []}

    def join(self, stream, stamp):
        self.clock[stream] = [max(a, b) for a, b in zip(self.clock[stream], stamp)]

    def join_events(self, stream, slots, tensor):
        for slot in slots:
            if slot not in self.events:
                self.fail("stream", tensor, f"waits for event slot {slot}, which nothing "
                                            f"recorded before")
            self.join(stream, self.events[slot])

    def tick(self, stream):
        self.clock[stream][stream] += 1
        return list(self.clock[stream])

    def access(self, space, block, stream, stamp, write, tensor):
        start, end = block
        for s0, e0, other, stamp0, w0 in self.accesses[space]:
            if other != stream and (write or w0) and s0 < end and start < e0 \
                    and stamp0[other] > stamp[other]:
                self.fail("stream", tensor, f"{STREAMS[stream]} stream "
                          f"{'writes' if write else 'reads'} {space} bytes [{start}, {end}) "
                          f"while the {STREAMS[other]} stream may still "
                          f"{'write' if w0 else 'read'} [{s0}, {e0})")
        self.accesses[space].append((start, end, stream, stamp, write))

    def prune(self):
        """Forget accesses every stream has already seen: they cannot conflict any more."""
        for space, items in self.accesses.items():
            self.accesses[space] = [a for a in items if any(
                self.clock[s][a[2]] < a[3][a[2]] for s in range(len(STREAMS)))]

    def join_all(self):
        """The runtime joins the streams at the end of every step."""
        top = [max(c[s] for c in self.clock) for s in range(len(STREAMS))]
        self.clock = [list(top) for _ in STREAMS]
        self.prune()


class _Replay:
    """Replays a plan's operations symbolically: tensor states as the runtime's Tensor
    keeps them, blocks in both arenas, three clocked streams, and the plan's figures."""

    def __init__(self, p, host_memory):
        self.plan, self.program = p, p.program
        self.host_limit = p.host_bytes if host_memory is None else min(p.host_bytes,
                                                                        host_memory)
        self.clocks = _Clocks(self.fail)
        self.state = {t.id: "unallocated" for t in p.tensors}
        self.dev, self.host = {}, {}          # tid -> (start, end) of its block
        self.lent = {}                        # Hand source -> the tensor its block went to
        self.prefetch_slot = {}
        self.peak = self.extent = 0
        self.where = "setup"
        self.forward = {s.layer: s for s in self.program.passes if s.phase == "forward"}
        self.by_index = {layer.index: layer for layer in self.program.order}
        self.traded = recompute_mod.split(p.drops)[1]
        self.forward_algos = {}               # layer pass index -> algos its Launch ran
        self.handlers = {Alloc: self.alloc, Hand: self.hand, Free: self.free, Drop: self.drop,
                         Offload: self.offload, Release: self.release, Evict: self.evict,
                         Prefetch: self.prefetch, Wait: self.wait, Sync: self.sync,
                         Mark: self.mark, Launch: self.launch}

    def fail(self, rule, tensor, message):
        name = tensor if tensor is None or isinstance(tensor, str) else self.name(tensor)
        raise ScheduleError(rule, self.where, name, message)

    def name(self, tid):
        return self.plan.tensors[tid].name

    # -- driving ---------------------------------------------------------------------
    def run(self, iterations):
        for op in self.plan.setup:
            self.do(op)
        self.resident = dict(self.dev)
        for it in range(1, iterations + 1):
            self.launched, self.moved = [], [0, 0]
            for step in self.plan.steps:
                self.step = step
                self.where = (f"iteration {it}, step {step.index} ({step.phase} of layer "
                              f"{step.layer})")
                for op in step.ops:
                    self.do(op)
            self.where = f"end of iteration {it}"
            self.end_of_iteration()
            self.clocks.join_all()

    def do(self, op):
        handler = self.handlers.get(type(op))
        if handler is None:
            self.fail("program", None, f"unknown operation {op!r}")
        handler(op)

    def expect(self, tid, states, what):
        if self.state[tid] not in states:
            self.fail("state", tid, f"{what} while it is {self.state[tid]}")

    # -- blocks ----------------------------------------------------------------------
    def place(self, table, space, tid, offset, limit):
        block = (offset, offset + _blocks(self.plan.tensors[tid].nbytes))
        if offset < 0 or block[1] > limit:
            self.fail("cap", tid, f"{space} block [{block[0]}, {block[1]}) lies outside the "
                                  f"{space} arena of {limit:,} bytes")
        for other, (s0, e0) in table.items():
            if s0 < block[1] and block[0] < e0:
                self.fail("overlap", tid, f"{space} block [{block[0]}, {block[1]}) overlaps "
                                          f"live tensor {self.name(other)} at [{s0}, {e0})")
        table[tid] = block
        if table is self.dev:
            in_use = sum(e - s for s, e in self.dev.values())
            self.peak, self.extent = max(self.peak, in_use), max(self.extent, block[1])

    def unplace(self, tid):
        self.dev.pop(tid, None)

    # -- operations (the runtime's Tensor transitions) --------------------------------
    def alloc(self, op):
        self.expect(op.tensor, ("unallocated", "dropped", "freed"), "allocated")
        self.place(self.dev, "device", op.tensor, op.offset, self.plan.capacity)
        self.state[op.tensor] = "gpu"

    def hand(self, op):
        """The source lends its block to the tensor; the next kernel, the layer pass that
        writes it in place, is the source's last reader."""
        self.expect(op.source, ("gpu",), "handed over")
        self.expect(op.tensor, ("unallocated", "dropped", "freed"), "given a block")
        passes, done = self.program.passes, len(self.launched)
        if (self.step.phase != "backward" or done >= len(passes)
                or passes[done].in_place != (op.tensor, op.source)):
            self.fail("in place", op.tensor, f"given the block of {self.name(op.source)}, "
                                             f"which the next kernel does not write it over")
        self.dev[op.tensor] = self.dev.pop(op.source)
        self.lent[op.source] = op.tensor
        self.state[op.tensor] = "gpu"

    def free(self, op):
        self.expect(op.tensor, ("gpu", "offloading", "host", "prefetching", "dropped",
                                "handed"), "freed")
        self.unplace(op.tensor)
        self.host.pop(op.tensor, None)
        self.state[op.tensor] = "freed"

    def drop(self, op):
        self.expect(op.tensor, ("gpu",), "dropped")
        self.unplace(op.tensor)
        self.state[op.tensor] = "dropped"

    def offload(self, op):
        tid = op.tensor
        self.expect(tid, ("gpu",), "offloaded")
        if tid in self.host:
            self.fail("state", tid, "offloaded to a new host block while it has a host copy")
        self.place(self.host, "host", tid, op.host_offset, self.host_limit)
        c = self.clocks
        c.join(TO_HOST, c.clock[COMPUTE])          # a copy starts after the queued kernels
        c.join_events(TO_HOST, op.waits, tid)
        stamp = c.tick(TO_HOST)
        c.access("device", self.dev[tid], TO_HOST, stamp, False, tid)
        c.access("host", self.host[tid], TO_HOST, stamp, True, tid)
        c.events[op.slot] = stamp
        self.moved[0] += self.plan.tensors[tid].nbytes
        self.state[tid] = "offloading"

    def release(self, op):
        self.expect(op.tensor, ("offloading",), "released")
        self.unplace(op.tensor)
        self.state[op.tensor] = "host"

    def evict(self, op):
        if op.host_offset is not None:
            self.offload(op)
            self.release(op)
            return
        self.expect(op.tensor, ("gpu", "offloading"), "evicted without a copy")
        if op.tensor not in self.host:
            self.fail("state", op.tensor, "evicted without a copy but has no host copy")
        self.unplace(op.tensor)
        self.state[op.tensor] = "host"

    def prefetch(self, op):
        tid = op.tensor
        self.expect(tid, ("host",), "prefetched")
        self.place(self.dev, "device", tid, op.offset, self.plan.capacity)
        c = self.clocks
        c.join_events(TO_DEVICE, op.waits, tid)
        stamp = c.tick(TO_DEVICE)
        c.access("host", self.host[tid], TO_DEVICE, stamp, False, tid)
        c.access("device", self.dev[tid], TO_DEVICE, stamp, True, tid)
        c.events[op.slot] = stamp
        self.prefetch_slot[tid] = op.slot
        self.moved[1] += self.plan.tensors[tid].nbytes
        self.state[tid] = "prefetching"

    def wait(self, op):
        self.expect(op.tensor, ("prefetching",), "waited for")
        self.clocks.join_events(COMPUTE, [self.prefetch_slot[op.tensor]], op.tensor)
        self.state[op.tensor] = "gpu"

    def sync(self, op):
        self.clocks.join_events(COMPUTE, op.slots, None)

    def mark(self, op):
        self.clocks.events[op.slot] = list(self.clocks.clock[COMPUTE])

    # -- kernels ---------------------------------------------------------------------
    def launch(self, op):
        reads, writes = (self.recomputation(op.key, op.algos) if isinstance(op.key, tuple)
                         else self.logical(op.key))
        self.forward_algos.setdefault(op.key, op.algos)
        if op.workspace is not None:
            writes = list(writes) + [op.workspace]
        c = self.clocks
        stamp = c.tick(COMPUTE)
        for tids, verb, write in ((reads, "read", False), (writes, "written", True)):
            for tid in dict.fromkeys(tids):
                if self.state[tid] not in READABLE:
                    hint = " (prefetched without a Wait)" if self.state[tid] == "prefetching" else ""
                    self.fail("access", tid, f"{verb} by the kernel while it is "
                                             f"{self.state[tid]}{hint}")
                block = self.dev[tid] if tid in self.dev else self.dev[self.lent[tid]]
                c.access("device", block, COMPUTE, stamp, write, tid)
        for source in self.lent:             # read for the last time: no block, no reads
            self.state[source] = "handed"
        self.lent.clear()
        c.prune()
        self.check_step_figures()

    def logical(self, key):
        """Reads and writes of layer pass `key`, which must come next, exactly once."""
        passes = self.program.passes
        if not isinstance(key, int) or not 0 <= key < len(passes):
            self.fail("program", None, f"launch of unknown layer pass {key!r}")
        if key in self.launched:
            self.fail("recompute", None, f"layer pass {key} ({passes[key].phase} of "
                      f"{passes[key].layer.name}) launched again: a second training forward "
                      f"updates batch-norm running statistics twice")
        if self.step.phase == "recompute":
            self.fail("recompute", None, f"a recomputation launches layer pass {key}, the "
                      f"training forward (it updates running statistics)")
        want = passes[key]
        if key != len(self.launched) or (want.layer.name, want.phase) != (self.step.layer,
                                                                          self.step.phase):
            self.fail("program", None, f"launches layer pass {key} ({want.phase} of "
                      f"{want.layer.name}); pass {len(self.launched)} comes next")
        self.launched.append(key)
        return want.reads, want.writes

    def recomputation(self, key, algos):
        """Reads and writes of rebuilding layer key[1]'s output with `algos`: its forward's,
        with the batch-norm running statistics read, not updated."""
        layer = self.by_index.get(key[1]) if len(key) == 2 and key[0] == "recompute" else None
        if layer is None:
            self.fail("program", None, f"launch of unknown key {key!r}")
        allowed = spec(layer).recomputable or layer.index in self.traded
        if not allowed or self.step.phase != "recompute" \
                or self.step.layer != layer.name:
            self.fail("recompute", self.program.act[layer], f"recomputation of layer "
                      f"{layer.name} ({layer.op}) in a {self.step.phase} step of "
                      f"{self.step.layer}")
        forward = self.forward[layer]
        if forward.index not in self.launched:
            self.fail("recompute", self.program.act[layer], f"rebuilt before layer "
                      f"{layer.name}'s forward ran this iteration: a dropout would draw "
                      f"another mask, a batch norm see other inputs")
        ran = self.forward_algos[forward.index]
        if spec(layer).has_algorithms and algos != {"forward": ran["forward"]}:
            self.fail("recompute", self.program.act[layer], f"rebuilt with algorithms "
                      f"{algos}, its forward pass ran {ran['forward']!r}")
        buffers = {self.program.buffer[f"{layer.name}.{b}"] for b in layer.buffers}
        return (list(forward.reads) + sorted(buffers),
                [t for t in forward.writes if t not in buffers])

    def check_step_figures(self):
        in_use = sum(e - s for s, e in self.dev.values())
        if (self.step.bytes_in_use, self.step.live_tensors) != (in_use, len(self.dev)):
            self.fail("figures", None, f"the plan records {self.step.bytes_in_use:,} bytes "
                      f"in {self.step.live_tensors} tensors while the kernel runs; its "
                      f"operations hold {in_use:,} bytes in {len(self.dev)}")

    # -- the end of an iteration --------------------------------------------------------
    def end_of_iteration(self):
        if len(self.launched) != len(self.program.passes):
            missing = len(self.launched)
            s = self.program.passes[missing]
            self.fail("program", None, f"layer pass {missing} ({s.phase} of "
                                       f"{s.layer.name}) never launched")
        for tid, block in self.resident.items():
            if self.dev.get(tid) != block:
                self.fail("state", tid, f"placed at {block} before the first iteration, "
                                        f"it ends the iteration {self.state[tid]} at "
                                        f"{self.dev.get(tid)}")
        for tid, state in self.state.items():
            if state == "handed":
                self.fail("leak", tid, "handed its block over but was never freed")
        for table, space in ((self.dev, "device"), (self.host, "host")):
            for tid in table:
                if tid not in self.resident or table is self.host:
                    self.fail("leak", tid, f"still holds {space} bytes {table[tid]} "
                                           f"({self.state[tid]})")
        p = self.plan
        figures = {"peak_bytes": (p.peak_bytes, self.peak),
                   "required_bytes": (p.required_bytes, self.extent),
                   "bytes_to_host": (p.bytes_to_host, self.moved[0]),
                   "bytes_to_device": (p.bytes_to_device, self.moved[1]),
                   "recomputed_steps": (p.recomputed_steps,
                                        sum(s.phase == "recompute" for s in p.steps))}
        for name, (claimed, found) in figures.items():
            if claimed != found:
                self.fail("figures", None, f"plan.{name} is {claimed:,}; its operations "
                                           f"give {found:,}")


def check_plan(plan, *, host_memory=None, iterations: int = 2) -> None:
    """Replay `plan` (from sn.plan or a Runtime) `iterations` times without kernels and
    raise ScheduleError at the first broken rule (the module docstring lists them).
    `host_memory` is the pinned host cap the plan was made for (default: its host_bytes)."""
    if not hasattr(plan, "steps") or not hasattr(plan, "program"):
        raise ValueError(f"check_plan needs a Plan (sn.plan(...) or rt.plan), got "
                         f"{type(plan).__name__}")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"iterations must be a positive int, got {iterations!r}")
    limit = None if host_memory is None else parse_bytes(host_memory)
    _Replay(plan, limit).run(iterations)


# -- the training oracle ------------------------------------------------------------------
def _batches(net, steps, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn((net.batch, *net.input_shape), generator=gen),
             torch.randint(0, net.classes, (net.batch,), generator=gen)) for _ in range(steps)]


def check_equivalent(net, policies=POLICIES, steps: int = 1, *, memory=None,
                     host_memory=None, seed: int = 0, lr: float = 0.1, momentum: float = 0.9,
                     weight_decay: float = 1e-3, conv_algos=None, device="cpu") -> dict:
    """Train `net` for `steps` steps under each policy (same seed, same batches, conv
    algorithms pinned: `conv_algos` default {}) and raise ScheduleError (rule
    "equivalence") unless every policy gives bitwise the same losses, parameters and
    batch-norm statistics as the first, and its pool's measured peak equals its plan's.
    `memory` is the cap for all (default: each policy's smallest feasible cap, where it
    moves and recomputes most); each plan also passes check_plan. Returns the Runtimes."""
    policies = list(policies)
    if not policies or any(p not in POLICIES for p in policies):
        raise ValueError(f"policies must be a non-empty list drawn from {POLICIES}, "
                         f"got {policies!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    conv_algos = {} if conv_algos is None else conv_algos
    batches = _batches(net, steps, seed)
    runtimes, reference = {}, None
    for policy in policies:
        cap = memory if memory is not None else smallest_cap(
            net, policy, momentum=momentum, conv_algos=conv_algos, host_memory=host_memory)
        rt = Runtime(net, cap, policy, device=device, lr=lr, momentum=momentum,
                     weight_decay=weight_decay, seed=seed, conv_algos=conv_algos,
                     host_memory=host_memory)
        check_plan(rt.plan, host_memory=host_memory)
        losses = [rt.step(images.to(rt.device), labels.to(rt.device))
                  for images, labels in batches]
        where = f"policy {policy!r} at a cap of {rt.plan.capacity:,} bytes"
        if rt.stats.peak_bytes != rt.plan.peak_bytes:
            raise ScheduleError("equivalence", where, None, f"the pool peaked at "
                                f"{rt.stats.peak_bytes:,} bytes, the plan says "
                                f"{rt.plan.peak_bytes:,}")
        result = (policy, losses, rt.params())
        if reference is None:
            reference = result
        _compare(reference, result, where)
        runtimes[policy] = rt
    return runtimes


def _compare(reference, result, where):
    """Raise unless `result` (policy, losses, params) equals `reference` bit for bit."""
    first, ref_losses, ref_params = reference
    _, losses, params = result
    if losses != ref_losses:
        raise ScheduleError("equivalence", where, None, f"losses {losses} differ from "
                            f"policy {first!r}'s {ref_losses}")
    for name, value in params.items():
        if not torch.equal(value, ref_params[name]):
            diff = (value - ref_params[name]).abs().max().item()
            raise ScheduleError("equivalence", where, name, f"differs from policy "
                                f"{first!r}'s (largest difference {diff:g})")
