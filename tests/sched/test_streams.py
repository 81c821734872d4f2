"""The plan's stream ordering: no byte is written while another stream may still touch it.

On a GPU the runtime runs kernels on the compute stream and copies on a device-to-host and a
host-to-device stream, and frees blocks without waiting on the host; the plan's Sync, Mark
and `waits` entries are all that orders them. `tinysn.testing.check_plan` replays plans on
three simulated streams with vector clocks and checks every pair of conflicting accesses
(tests/test_testing.py shows it catches missing waits; tests/sched/test_properties.py runs
it on random nets and caps). Here: the fixed nets at caps that force copies, a regression,
and the same on a real GPU.
"""
import dataclasses

import pytest
import torch

import tinysn as sn
import tinysn.testing as snt
from tinysn.sched.plan import Offload, Prefetch, Sync


def test_offload_and_cache_plans_order_every_copy():
    for net in (snt.every_layer_net(batch=2), snt.block_net(batch=2)):
        for policy in ("offload", "recompute", "all"):
            plan = sn.plan(net, snt.smallest_cap(net, policy, conv_algos={}), policy,
                           conv_algos={})
            assert plan.bytes_to_host > 0, (policy, "the cap should force copies")
            if policy == "all":
                assert any(isinstance(op, Offload) for s in plan.steps for op in s.ops), \
                    "the cache's victims should be written back early"
            snt.check_plan(plan)


def test_each_net_needs_some_wait_for_a_write_back():
    """Policy "all" writes victims back early and frees their blocks at eviction without
    waiting: the blocks' next writers (and the prefetches that read the host copies) wait
    for the write-back's event. Dropping that event from the waits naming it makes the
    replay find a race (for some of them: others are covered by another wait)."""
    for net in (snt.every_layer_net(batch=2), snt.block_net(batch=2)):
        plan = sn.plan(net, snt.smallest_cap(net, "all", conv_algos={}), "all", conv_algos={})
        copies = {op.slot for s in plan.steps for op in s.ops if isinstance(op, Offload)}
        caught = 0
        for s in plan.steps:
            for i, op in enumerate(s.ops):
                field = {Sync: "slots", Prefetch: "waits"}.get(type(op))
                if field is None or not copies & set(getattr(op, field)):
                    continue
                kept = tuple(x for x in getattr(op, field) if x not in copies)
                ops = s.ops[:i] + [dataclasses.replace(op, **{field: kept})] + s.ops[i + 1:]
                steps = list(plan.steps)
                steps[s.index] = dataclasses.replace(s, ops=ops)
                try:
                    snt.check_plan(dataclasses.replace(plan, steps=steps))
                except snt.ScheduleError as err:
                    assert err.rule == "stream" and "to-host copy stream" in str(err)
                    caught += 1
        assert caught > 0


def test_tensor_evicted_after_a_rebuild_read_it_last_is_freed(monkeypatch):
    """Regression (found on the GPU): with the GPU's batch-norm workspaces this ResNet's "all"
    plan rebuilds a ReLU from a residual sum, then evicts the sum before the step ends; the sum
    was never freed, so the next iteration found it still on the host. Every plan now ends
    with nothing held on the device or the host, and the runtime runs two iterations."""
    from tinysn.kernels import bn
    monkeypatch.setattr(bn, "_TILE", 2048)          # the GPU's tile: other workspace sizes
    net = sn.models.resnet(blocks=[1, 2, 2, 1], batch=16, classes=10, input_shape=(3, 64, 64))
    smallest = snt.smallest_cap(net, "all", momentum=0.9, conv_algos={})
    cap = next(c for c in (int(smallest * (1 + k / 100)) for k in range(20))
               if sn.plan(net, c, "all", momentum=0.9, conv_algos={}).uses_recompute)
    rt = sn.Runtime(net, cap, "all", device="cpu", momentum=0.9, conv_algos={})
    assert rt.plan.uses_recompute
    for key in list(rt._launch):                    # the schedule only: no kernels
        rt._launch[key] = lambda rt, algos, ws: None
    images, labels = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    for _ in range(2):
        rt.step(images, labels)
    snt.check_plan(rt.plan)


@pytest.mark.gpu
def test_gpu_copies_in_flight_leave_results_bitwise_equal():
    """On a GPU, with real streams: a ResNet under caps that force offloads, evictions (after
    early write-backs) and prefetches every step trains to the same parameters, bit for bit, as with no moves."""
    net = sn.models.resnet(blocks=[1, 2, 2, 1], batch=16, classes=10, input_shape=(3, 64, 64))
    rts = snt.check_equivalent(net, ["baseline", "offload", "all"], steps=3, lr=0.05,
                               weight_decay=0.0, device="cuda")
    for policy in ("offload", "all"):
        assert rts[policy].plan.bytes_to_host > 0 and rts[policy].stats.bytes_to_device > 0
    assert any(isinstance(op, Offload) for s in rts["all"].plan.steps for op in s.ops), \
        "the cache's victims should be written back early, their copies in flight"
