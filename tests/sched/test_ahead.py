"""Prefetch distance (plan._ahead): policy "all" issues prefetches further ahead of their use
where the room the one-step plan leaves allows it, with the distance the step-time model
predicts fastest. Never a prefetch later than one step ahead, every early prefetch still
waited for, the same bytes moved, never a slower prediction, bitwise-equal training."""
import dataclasses

import pytest

import tinysn as sn
import tinysn.testing as snt
from tinysn.sched import plan as plan_mod
from tinysn.sched.plan import Prefetch, Wait
from tinysn.sched.timing import DeviceModel

from test_trade import starve   # tests/sched is on the path (no package)


def resnet():
    return sn.models.resnet(blocks=[1, 2, 2, 1], batch=16, classes=10, input_shape=(3, 64, 64))


@pytest.fixture(scope="module")
def roomy():
    """The ResNet at 1.25x its smallest cap: it moves tensors and has room to spare."""
    net = resnet()
    return net, int(snt.smallest_cap(net, "all", conv_algos={}) * 1.25)


def prefetches(plan):
    """{(tensor, step of its Wait): step of the Prefetch} and the Prefetches placed early."""
    issued, pairs, early = {}, {}, []
    for step in plan.steps:
        for op in step.ops:
            if isinstance(op, Prefetch):
                issued[op.tensor] = step.index
                if op.top:
                    early.append(op)
            elif isinstance(op, Wait):
                pairs[op.tensor, step.index] = issued.pop(op.tensor)
    return pairs, early


@pytest.mark.parametrize("lookahead", [2, 4, 8])
def test_no_prefetch_is_issued_later_and_some_go_earlier(roomy, lookahead):
    """Against the one-step plan: the same tensors come back for the same reads, each
    prefetch at the same step or earlier, some earlier; the same bytes move
    and the peak stays within the cap."""
    net, cap = roomy
    base = sn.plan(net, cap, "all", conv_algos={}, lookahead=1)
    ahead = sn.plan(net, cap, "all", conv_algos={}, lookahead=lookahead)
    assert ahead.lookahead == lookahead
    (near, none), (far, early) = prefetches(base), prefetches(ahead)
    assert not none and early
    assert far.keys() == near.keys()
    assert all(far[k] <= near[k] for k in near)
    assert any(far[k] < near[k] for k in near)
    assert (ahead.bytes_to_host, ahead.bytes_to_device) == (base.bytes_to_host,
                                                            base.bytes_to_device)
    assert ahead.peak_bytes <= ahead.capacity == base.capacity


def test_an_early_prefetch_is_waited_for_before_its_use(roomy):
    """The replay accepts the plan; without the Wait of any early prefetch it finds the read
    of a tensor still in flight."""
    net, cap = roomy
    plan = sn.plan(net, cap, "all", conv_algos={}, lookahead=8)
    snt.check_plan(plan)
    early = {op.tensor for op in prefetches(plan)[1]}
    caught = 0
    for step in plan.steps:
        for i, op in enumerate(step.ops):
            if isinstance(op, Wait) and op.tensor in early:
                steps = list(plan.steps)
                steps[step.index] = dataclasses.replace(step, ops=step.ops[:i] + step.ops[i + 1:])
                with pytest.raises(snt.ScheduleError, match="prefetched without a Wait"):
                    snt.check_plan(dataclasses.replace(plan, steps=steps))
                caught += 1
    assert caught == len(early) > 0


@pytest.mark.parametrize("scale", [1.0, 1.1, 1.25, 1.5])
def test_the_chosen_distance_is_never_predicted_slower(scale):
    """The model's choice is never slower than one step ahead (the H200's figures replayed
    from a CUDA graph: eager, this small ResNet is bound by Python's launches and no
    distance matters), and faster where memory allows."""
    net = resnet()
    cap = int(snt.smallest_cap(net, "all", conv_algos={}) * scale)
    graphed = DeviceModel.h200(graphed=True)
    kw = dict(conv_algos={}, trade_budget=0, device_model=graphed)   # it moves tensors
    chosen, base = sn.plan(net, cap, "all", **kw), sn.plan(net, cap, "all", lookahead=1, **kw)
    assert chosen.predicted_step_s <= base.predicted_step_s
    if scale >= 1.25:
        assert chosen.lookahead > 1 and chosen.predicted_step_s < 0.97 * base.predicted_step_s
    snt.check_plan(chosen)


@pytest.mark.parametrize("batch,gain", [(640, 0.98), (897, 0.99)])
def test_resnet50_in_12gib_is_predicted_faster(batch, gain):
    """ResNet-50 under 12 GiB (60 GiB host): prefetching ahead saves at least 2% (batch 640)
    or 1% (897) of the predicted step, within the cap."""
    net = sn.models.resnet50(batch=batch)
    chosen = sn.plan(net, "12GiB", "all", host_memory="60GiB")
    base = sn.plan(net, "12GiB", "all", host_memory="60GiB", lookahead=1)
    assert chosen.lookahead > 1 and prefetches(chosen)[1]
    assert chosen.predicted_step_s < gain * base.predicted_step_s
    assert chosen.peak_bytes <= 12 * 2**30


def test_resnet50_at_897_prefetches_ahead_only_within_the_room_left():
    """At batch 897 memory is short right before most uses: two passes ahead fits, moving
    the same bytes, only because an early block is admitted within the room the one-step
    plan leaves at every step until its use (placed wherever it fits, it fragments the pool
    until a gradient finds no run, and the plan falls back to one step). Planned without
    kept pooling outputs (keep_pools=False), whose plan at this batch falls back to one
    step at two passes ahead, and with every ReLU apart (fuse_relu=False),
    the net this was found on."""
    net = sn.models.resnet50(batch=897)
    kw = dict(host_memory="60GiB", keep_pools=False, fuse_relu=False)
    base = sn.plan(net, "12GiB", "all", lookahead=1, **kw)
    two = sn.plan(net, "12GiB", "all", lookahead=2, **kw)
    assert two.lookahead == 2 and prefetches(two)[1]
    assert (two.bytes_to_host, two.bytes_to_device) == (base.bytes_to_host,
                                                        base.bytes_to_device)


def test_resnet50_at_995_prefetches_far_ahead_once_early_blocks_keep_off_failed_steps(
        resnet50_995_apart, monkeypatch):
    """At its largest batch ResNet-50's plan at 16 and 64 passes ahead fails where an early
    block splits the free run a 3.2 GB gradient needs. Planned again with no early block
    over that step (Headroom.block), 64 passes fits and is chosen; with no retries a
    shorter distance is, predicted slower (by 0.5% with the default model, 3% with the
    conv times the H200 measured)."""
    net, chosen = resnet50_995_apart
    monkeypatch.setattr(plan_mod, "AHEAD_RETRIES", 0)
    once = sn.plan(net, "12GiB", "all", host_memory="60GiB", fuse_relu=False)
    assert chosen.lookahead == 64 and once.lookahead < 64
    assert chosen.predicted_step_s < 0.997 * once.predicted_step_s
    snt.check_plan(chosen)


@pytest.mark.parametrize("sign", [1, -1])
def test_the_model_picks_the_distance(roomy, monkeypatch, sign):
    """With a model that says longer distances are slower, one step ahead is kept; with one
    that says they are faster, the longest distance that fits is chosen."""
    net, cap = roomy
    monkeypatch.setattr(plan_mod._Search, "step_seconds", lambda search, p: sign * p.lookahead)
    chosen = sn.plan(net, cap, "all", conv_algos={}, trade_budget=0)
    fit = [k for k in plan_mod.LOOKAHEADS
           if sn.plan(net, cap, "all", conv_algos={}, trade_budget=0, lookahead=k).lookahead == k]
    assert len(fit) >= 2
    assert chosen.lookahead == (1 if sign > 0 else max(fit))


def test_the_search_is_bounded_by_trade_steps(roomy, monkeypatch):
    """At most TRADE_STEPS // 8 plan steps go into trying distances (and their retries):
    none for a net too deep, and the distances beyond that are not planned."""
    net, cap = roomy
    made = []
    real = plan_mod._Planner.__init__

    def spy(self, *args, **kwargs):
        made.append(kwargs.get("lookahead", 1))
        real(self, *args, **kwargs)
    monkeypatch.setattr(plan_mod._Planner, "__init__", spy)
    steps = len(sn.plan(net, cap, "all", conv_algos={}, trade_budget=0, lookahead=1).steps)
    made.clear()
    monkeypatch.setattr(plan_mod, "TRADE_STEPS", 8 * steps * 2)      # two distances' worth
    sn.plan(net, cap, "all", conv_algos={}, trade_budget=0)
    assert sorted({k for k in made if k > 1}) == list(plan_mod.LOOKAHEADS[:2])
    made.clear()
    monkeypatch.setattr(plan_mod, "TRADE_STEPS", steps)
    assert sn.plan(net, cap, "all", conv_algos={}).lookahead == 1
    assert not [k for k in made if k > 1]


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "4"])
def test_a_bad_lookahead_is_refused(bad):
    with pytest.raises(ValueError, match="lookahead must be None or an int >= 1"):
        sn.plan(snt.block_net(batch=2), "1GiB", "all", lookahead=bad)


def test_trains_bitwise_equal_to_baseline_with_early_prefetches(monkeypatch):
    """With PCIe starved the model sends prefetches ahead on this net at its smallest cap:
    the runtime places them from the pool's top as planned, losses and parameters equal
    baseline's bit for bit and the pool peaks where the plan says (check_equivalent)."""
    starve(monkeypatch)
    rts = snt.check_equivalent(snt.block_net(batch=2), ["baseline", "all"], steps=2)
    assert prefetches(rts["all"].plan)[1]


@pytest.mark.gpu
def test_gpu_trains_bitwise_equal_with_early_prefetches(monkeypatch):
    """On a GPU, with real streams: the ResNet with prefetches issued ahead (its smallest
    cap, PCIe starved) trains to baseline's parameters bit for bit."""
    starve(monkeypatch)
    rts = snt.check_equivalent(resnet(), ["baseline", "all"], steps=2, lr=0.05, device="cuda")
    assert prefetches(rts["all"].plan)[1]

