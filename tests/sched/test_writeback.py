"""Victims written back early (policy "all"): every tensor the LRU cache evicts is copied
to the host right after its last use, so its eviction moves nothing and frees its block at
once; the plan's device decisions, peak and bytes moved are those of the late copies."""
import dataclasses

import pytest

import tinysn as sn
import tinysn.testing as snt
from tinysn.sched import offload, plan as plan_mod, timing
from tinysn.sched.plan import Alloc, Evict, Launch, Offload, Prefetch

NETS = {"every_layer": lambda: snt.every_layer_net(batch=2),
        "block": lambda: snt.block_net(batch=2),
        "resnet": lambda: sn.models.resnet(blocks=[1, 2, 2, 1], batch=16, classes=10,
                                           input_shape=(3, 64, 64))}


def both(net, **kwargs):
    """(late, early): the plan at the net's smallest "all" cap without and with early
    write-back."""
    cap = snt.smallest_cap(net, "all", conv_algos={}, **kwargs)
    return tuple(sn.plan(net, cap, "all", conv_algos={}, early_write_back=early, **kwargs)
                 for early in (False, True))


def ops_of(plan, kind):
    """(step index, op) of every op of type `kind`, in plan order."""
    return [(s.index, op) for s in plan.steps for op in s.ops if isinstance(op, kind)]


def copying(plan):
    return [op.tensor for _, op in ops_of(plan, Evict) if op.host_offset is not None]


def uses(plan):
    """Executed step index -> the tensors its kernel reads or writes."""
    out = {}
    for index, launch in ops_of(plan, Launch):
        key = launch.key
        passes = plan.program.passes
        step = (next(p for p in passes if p.phase == "forward" and p.layer.index == key[1])
                if isinstance(key, tuple) else passes[key])
        out[index] = set(step.reads) | set(step.writes)
    return out


@pytest.mark.parametrize("name", sorted(NETS))
def test_every_eviction_finds_its_copy_made_and_moves_nothing(name):
    late, early = both(NETS[name]())
    victims = copying(late)
    assert victims, "the smallest cap should make the cache evict with a copy"
    assert copying(early) == []
    assert [op.tensor for _, op in ops_of(early, Offload)] == victims   # in eviction order
    evicted = {op.tensor for _, op in ops_of(early, Evict)}
    assert set(victims) <= evicted
    same = ("peak_bytes", "required_bytes", "bytes_to_host", "bytes_to_device")
    assert [getattr(early, k) for k in same] == [getattr(late, k) for k in same]
    assert ops_of(early, Alloc) == ops_of(late, Alloc)                    # same blocks
    snt.check_plan(early)


@pytest.mark.parametrize("name", sorted(NETS))
def test_write_back_follows_the_last_use_before_the_eviction(name):
    """Each write-back comes right after the kernel of its tensor's last use before the
    eviction (so after its last write), or right after the write-back before it, whichever
    is later (the copy queue runs in eviction order); no kernel touches the tensor between
    its write-back and its eviction."""
    _, early = both(NETS[name]())
    flat = [(s.index, op) for s in early.steps for op in s.ops]
    used = uses(early)
    assert ops_of(early, Offload)
    previous = -1
    for q, (s, op) in enumerate(flat):
        if not isinstance(op, Offload):
            continue
        tensor = early.tensors[op.tensor].name
        before = [i for i, o in flat[:q] if isinstance(o, Launch)]
        assert before and before[-1] == s, f"{tensor}: not right after a kernel"
        last = max(i for i in before if op.tensor in used[i])
        evicted = next(j for j in range(q, len(flat)) if isinstance(flat[j][1], Evict)
                       and flat[j][1].tensor == op.tensor)
        assert not any(isinstance(o, Launch) and op.tensor in used[i]
                       for i, o in flat[q:evicted]), f"{tensor} used after its write-back"
        assert s == max(last, previous), (tensor, s, last, previous)
        previous = s


def test_a_write_back_before_the_tensor_is_written_races_with_the_kernel():
    """The replay catches a write-back moved before the kernel that writes its tensor."""
    _, early = both(NETS["block"]())
    s, op = ops_of(early, Offload)[0]
    producer = next(i for i, tids in sorted(uses(early).items()) if op.tensor in tids)
    steps = list(early.steps)
    moved = [o for o in steps[s].ops if o is not op]
    at = next(i for i, o in enumerate(steps[producer].ops) if isinstance(o, Launch))
    steps[s] = dataclasses.replace(steps[s], ops=moved)
    ops = steps[producer].ops
    steps[producer] = dataclasses.replace(steps[producer], ops=ops[:at] + [op] + ops[at:])
    with pytest.raises(snt.ScheduleError, match=r"\[stream\]"):
        snt.check_plan(dataclasses.replace(early, steps=steps))


def test_model_predicts_the_early_plan_faster_on_a_slow_link():
    """With slow copies the late plan's evictions stall compute and the early plan's less:
    the early plan is predicted faster, its to-host copies start no later, and an eviction
    after a write-back puts nothing on the to-host stream."""
    late, early = both(NETS["resnet"]())
    model = dataclasses.replace(timing.DeviceModel.h200(), to_host_bytes_per_s=1e9,
                                to_device_bytes_per_s=1e9)
    t_late, t_early = timing.simulate(late, model), timing.simulate(early, model)
    assert t_early.to_host_s == t_late.to_host_s
    assert len([e for e in t_early.events if e[0] == "to_host"]) == len(ops_of(early, Offload))
    assert t_early.step_s < t_late.step_s
    starts = lambda tl: [e[2] for e in tl.events if e[0] == "to_host"]   # noqa: E731
    assert all(a <= b for a, b in zip(starts(t_early), starts(t_late)))


def test_switched_off_or_under_another_policy_nothing_is_written_back():
    net = NETS["block"]()
    late, _ = both(net)
    assert ops_of(late, Offload) == []
    cap = snt.smallest_cap(net, "recompute", conv_algos={})
    off = sn.plan(net, cap, "recompute", conv_algos={}, early_write_back=False)
    on = sn.plan(net, cap, "recompute", conv_algos={})
    assert [s.ops for s in on.steps] == [s.ops for s in off.steps]
    with pytest.raises(ValueError, match="early_write_back must be a bool"):
        sn.plan(net, cap, "all", early_write_back="yes")


def test_host_cap_admits_write_backs_only_where_they_fit():
    """The first pass holds 2 host blocks at step 0, 1 at step 1, then evicts victims 1 and 2
    (one block each), last used at step 0, under a host cap of 3 blocks: both early copies
    at step 0 would hold 4 blocks there, so the second is refused; issued after step 1 it
    fits. With a cap of 4 blocks both fit at step 0."""
    log = offload.EvictionLog()
    log.stepped(0, [1, 2], 2048)        # tick 0
    log.stepped(1, [], 1024)            # tick 1
    log.host_alloc(2048)                # tick 2: 1 copied out
    log.evicted(1)
    log.host_alloc(3072)                # tick 3: 2 copied out
    log.evicted(2)
    assert log.victims == {1: (0, 2), 2: (0, 3)} and log.step_ticks == [0, 1]
    early = offload.EarlyWriteBacks(log, 3 * 1024, 1024)
    assert early.after(0) == [1, 2] and early.after(1) == []
    assert early.admit(1, 1000, 0)
    assert not early.admit(2, 1024, 0)
    assert early.admit(2, 1024, 1)
    roomy = offload.EarlyWriteBacks(log, 4 * 1024, 1024)
    assert roomy.admit(1, 1024, 0) and roomy.admit(2, 1024, 0)


def test_write_backs_the_host_cap_refuses_are_copied_at_the_eviction():
    """The second pass told that the host holds a block less than the first pass's peak:
    the early copies that would overflow it are refused, those victims are copied out at
    their evictions as before, and the plan stays correct; with room for all, none are."""
    net = NETS["resnet"]()
    search = plan_mod._search(net, snt.smallest_cap(net, "all", conv_algos={}), "all",
                              momentum=0.0, conv_algos={}, checkpoints=offload.DEFAULT_CHECKPOINTS,
                              block_bytes=1024, layout="auto", host_memory=None)
    first = plan_mod._choose(search, "all")
    victims = copying(first)
    search.early_write_back = True
    search.host_capacity = first.host_bytes - 1024
    tight = search.write_back_early(first)
    assert 0 < len(copying(tight)) and len(copying(tight)) + len(ops_of(tight, Offload)) \
        == len(victims)
    snt.check_plan(tight)
    search.host_capacity = plan_mod.HOST_CAPACITY
    assert copying(search.write_back_early(first)) == []


def test_trains_bitwise_equal_to_baseline_with_write_backs_in_flight():
    """The runtime executes write-backs (an Offload that leaves the tensor readable) and
    evictions that only release: losses and parameters equal baseline's bit for bit and the
    pool peaks where the plan says (check_equivalent)."""
    net = NETS["block"]()
    rts = snt.check_equivalent(net, ["baseline", "all"], steps=2)
    plan = rts["all"].plan
    assert ops_of(plan, Offload) and not copying(plan)
    assert rts["all"].stats.bytes_to_host == 2 * plan.bytes_to_host > 0


def test_write_backs_are_queued_in_eviction_order():
    """Victim 5 is evicted first but last used after victim 6: 6's copy waits behind 5's
    (issued after step 1, not step 0), so the copy queue serves the first eviction first."""
    log = offload.EvictionLog()
    log.stepped(0, [6], 0)
    log.stepped(1, [5], 0)
    log.host_alloc(1024)
    log.evicted(5)
    log.host_alloc(2048)
    log.evicted(6)
    early = offload.EarlyWriteBacks(log, 1 << 20, 1024)
    assert (early.after(0), early.after(1)) == ([], [5, 6])
