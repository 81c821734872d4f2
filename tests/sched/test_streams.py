"""The plan's stream ordering: no byte is written while another stream may still touch it.

On a GPU the runtime runs kernels on the compute stream and copies on a device-to-host and a
host-to-device stream, and frees blocks without waiting on the host; the plan's "sync",
"mark" and `waits` entries are all that orders them. This test replays plans on three
simulated streams with vector clocks (one clock per stream, joined at every wait) and checks
every pair of conflicting accesses (same bytes, different streams, at least one a write):
the earlier one must happen before the later. Random nets and caps that force evictions.
"""
import copy
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tinysn as sn
from tinysn.sched.plan import Prefetch, Sync
from tests.nets import block_net, every_layer_net
from tests.sched.test_properties import random_nets

COMPUTE, TO_HOST, TO_DEVICE = 0, 1, 2


class StreamReplay:
    """Replays a plan's ops on three vector-clocked streams and checks every access."""

    def __init__(self, plan):
        self.plan, self.program = plan, plan.program
        self.clock = [[0, 0, 0] for _ in range(3)]
        self.events = {}
        self.dev, self.host = {}, {}         # tid -> offset of its current block
        self.accesses = {"dev": [], "host": []}
        self.kernels_checked = 0

    # -- clocks ------------------------------------------------------------------------
    def _tick(self, stream):
        self.clock[stream][stream] += 1
        return list(self.clock[stream])

    def _join(self, stream, other_clock):
        self.clock[stream] = [max(a, b) for a, b in zip(self.clock[stream], other_clock)]

    def _access(self, space, offset, nbytes, stream, stamp, write):
        for (s0, s1, st_, stamp0, w0) in self.accesses[space]:
            if st_ == stream or not (write or w0) or s1 <= offset or s0 >= offset + nbytes:
                continue
            assert stamp0[st_] <= stamp[st_], (
                f"{space} bytes [{offset}, {offset + nbytes}) touched by stream {stream} while "
                f"stream {st_} may still {'write' if w0 else 'read'} them")
        self.accesses[space].append((offset, offset + nbytes, stream, stamp, write))

    def _nbytes(self, tid):
        return self.plan.tensors[tid].nbytes

    # -- ops ---------------------------------------------------------------------------
    def run_iteration(self):
        for op in self.plan.setup:
            self.dev[op.tensor] = op.offset
        for step in self.plan.steps:
            for op in step.ops:
                fields = [getattr(op, f.name) for f in dataclasses.fields(op)]
                getattr(self, "_" + type(op).__name__.lower())(*fields)
        for s in range(3):                       # the runtime joins the streams at the end
            for o in range(3):
                self._join(s, self.clock[o])

    def _alloc(self, tid, offset):
        self.dev[tid] = offset

    def _free(self, tid):
        self.dev.pop(tid, None)
        self.host.pop(tid, None)

    def _drop(self, tid):
        self.dev.pop(tid)

    def _release(self, tid):
        self.dev.pop(tid)

    def _offload(self, tid, hoff, slot, waits):
        self._join(TO_HOST, self.clock[COMPUTE])  # after the work queued on compute
        for w in waits:
            self._join(TO_HOST, self.events[w])
        stamp = self._tick(TO_HOST)
        self.host[tid] = hoff
        self._access("dev", self.dev[tid], self._nbytes(tid), TO_HOST, stamp, False)
        self._access("host", hoff, self._nbytes(tid), TO_HOST, stamp, True)
        self.events[slot] = stamp

    def _evict(self, tid, hoff, slot, waits):
        if hoff is not None:
            self._offload(tid, hoff, slot, waits)
        self.dev.pop(tid)

    def _prefetch(self, tid, offset, slot, waits):
        for w in waits:
            self._join(TO_DEVICE, self.events[w])
        stamp = self._tick(TO_DEVICE)
        self.dev[tid] = offset
        self._access("host", self.host[tid], self._nbytes(tid), TO_DEVICE, stamp, False)
        self._access("dev", offset, self._nbytes(tid), TO_DEVICE, stamp, True)
        self.events[slot] = stamp
        self.prefetch_event = getattr(self, "prefetch_event", {})
        self.prefetch_event[tid] = slot

    def _wait(self, tid):
        self._join(COMPUTE, self.events[self.prefetch_event[tid]])

    def _sync(self, slots):
        for w in slots:
            self._join(COMPUTE, self.events[w])

    def _mark(self, slot):
        self.events[slot] = list(self.clock[COMPUTE])

    def _launch(self, key, algos, ws):
        if isinstance(key, tuple):               # a recomputation: the layer's forward
            layer = self.program.order[key[1]]
            reads = [self.program.act[x] for x in layer.inputs]
            writes = [self.program.act[layer]]
        else:
            step = self.program.steps[key]
            reads, writes = step.reads, step.writes
        stamp = self._tick(COMPUTE)
        for tid in reads:
            self._access("dev", self.dev[tid], self._nbytes(tid), COMPUTE, stamp, False)
        for tid in list(writes) + ([ws] if ws is not None else []):
            self._access("dev", self.dev[tid], self._nbytes(tid), COMPUTE, stamp, True)
        self.kernels_checked += 1


def replay(plan, iterations=2):
    r = StreamReplay(plan)
    for _ in range(iterations):
        r.run_iteration()
    return r


def moving_cap(net, policy, momentum=0.0) -> int:
    """About the smallest cap (bytes) at which `net` plans under `policy`, so the cache evicts."""
    lo, hi = 1 << 10, 1 << 30
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        try:
            sn.plan(net, mid, policy, conv_algos={}, momentum=momentum)
            hi = mid
        except sn.OutOfMemory:
            lo = mid
    return hi


def moving_plan(net, policy):
    return sn.plan(net, moving_cap(net, policy), policy, conv_algos={})


def test_offload_and_cache_plans_order_every_copy():
    for net in (every_layer_net(batch=2), block_net(batch=2)):
        for policy in ("offload", "recompute", "all"):
            plan = moving_plan(net, policy)
            assert plan.bytes_to_host > 0, (policy, "the cap should force copies")
            r = replay(plan)
            assert r.kernels_checked == 2 * len(plan.steps)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(net=random_nets(), policy=st.sampled_from(["offload", "recompute", "all"]))
def test_random_nets_order_every_copy(net, policy):
    replay(moving_plan(net, policy))


def test_replay_catches_a_missing_wait():
    """The checker itself: without one of the plan's syncs (or a prefetch's waits) it must
    complain for some of them (others are covered by another wait, transitively)."""
    plan = moving_plan(block_net(batch=2), "all")
    sites = [(si, i) for si, step in enumerate(plan.steps) for i, op in enumerate(step.ops)
             if isinstance(op, Sync) or isinstance(op, Prefetch) and op.waits]
    assert sites, "the plan should need syncs"
    caught = 0
    for si, i in sites:
        broken = copy.deepcopy(plan)
        op = broken.steps[si].ops[i]
        if isinstance(op, Sync):
            del broken.steps[si].ops[i]
        else:
            broken.steps[si].ops[i] = dataclasses.replace(op, waits=())
        try:
            replay(broken)
        except AssertionError as err:
            assert "may still" in str(err)
            caught += 1
    assert caught >= len(sites) // 4, (caught, len(sites))


def test_tensor_evicted_after_a_rebuild_read_it_last_is_freed(monkeypatch):
    """Regression (found on the GPU): with the GPU's batch-norm workspaces this ResNet's "all"
    plan rebuilds a ReLU from a residual sum, then evicts the sum before the step ends; the sum
    was never freed, so the next iteration found it still on the host. Every plan now ends
    with nothing held on the device or the host, and the runtime runs two iterations."""
    from tinysn.kernels import bn
    monkeypatch.setattr(bn, "_TILE", 2048)          # the GPU's tile: other workspace sizes
    net = sn.models.resnet(blocks=[1, 2, 2, 1], batch=16, classes=10, input_shape=(3, 64, 64))
    cap = moving_cap(net, "all", momentum=0.9)
    rt = sn.Runtime(net, cap, "all", device="cpu", momentum=0.9, conv_algos={})
    assert rt.plan.uses_recompute
    for key in list(rt._launch):                    # the schedule only: no kernels
        rt._launch[key] = lambda algos, ws: None
    images, labels = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    for _ in range(2):
        rt.step(images, labels)
    replay(rt.plan)


@pytest.mark.gpu
def test_gpu_copies_in_flight_leave_results_bitwise_equal():
    """On a GPU, with real streams: a ResNet under caps that force offloads, evictions and
    prefetches every step trains to the same parameters, bit for bit, as with no moves."""
    def net():
        return sn.models.resnet(blocks=[1, 2, 2, 1], batch=16, classes=10,
                                input_shape=(3, 64, 64))
    gen = torch.Generator().manual_seed(0)
    images = torch.randn((16, 3, 64, 64), generator=gen).cuda()
    labels = torch.randint(0, 10, (16,), generator=gen).cuda()

    def train(policy, memory):
        rt = sn.Runtime(net(), memory, policy, device="cuda", lr=0.05, momentum=0.9,
                        conv_algos={})
        losses = [rt.step(images, labels) for _ in range(3)]
        assert rt.stats.peak_bytes == rt.plan.peak_bytes
        return rt, losses

    ref, ref_losses = train("baseline", "4GiB")
    for policy in ("offload", "all"):
        cap = moving_cap(net(), policy, momentum=0.9)   # (a plan's capacity is rounded)
        rt, losses = train(policy, cap)
        assert rt.plan.bytes_to_host > 0 and rt.stats.bytes_to_device > 0
        assert losses == ref_losses, policy
        for name, value in rt.params().items():
            assert torch.equal(value, ref.params()[name]), (policy, name)
