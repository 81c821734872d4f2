"""Policy "all" last tries rebuilding the joins (add, concat) whose copies a plan moves,
directly or through the ReLU after a residual add (plan._rebuild_joins), with rebuilt
tensors kept at most KEEP_WITHIN layer passes ahead (recompute.Traded.keep_within): never a
slower plan, the same fit, correct schedules, bitwise the same training."""
import pytest
import torch
from hypothesis import given, strategies as st

import tinysn as sn
import tinysn.testing as snt
from tinysn.ops import spec
from tinysn.sched import offload, plan as plan_mod, recompute, timing

from test_trade import starve   # tests/sched is on the path (no package)


@pytest.fixture
def starved(monkeypatch):
    """The planner uses PCIe a thousand times slower than compute can hide."""
    starve(monkeypatch)


def search_for(net, cap="64MiB", **options):
    return plan_mod._search(net, cap, "all", momentum=0.0, conv_algos={},
                            checkpoints=offload.DEFAULT_CHECKPOINTS, block_bytes=1024,
                            layout="auto", host_memory=None, **options)


def rebuildable(net) -> frozenset:
    return frozenset(layer.index for layer in net.layers if spec(layer).rebuildable)


def test_keep_within_drops_rebuilt_tensors_used_far_ahead_and_rebuilds_them_again():
    """Every conv and add of a residual net dropped, each segment speed-centric: kept for
    any later use, the segments are rebuilt once; kept only for uses a few passes ahead,
    the farther uses rebuild them again, and fewer bytes are held at once. (The ReLUs after
    the adds planned apart: fused into the adds, a block has too few passes for a one- and
    a four-pass window to differ.)"""
    net = snt.block_net(batch=2)
    search = search_for(net, fuse_relu=False)
    plans = [search.first(recompute.Traded("strict", rebuildable(net), True, frozenset(), k))
             for k in (None, 4, 1)]
    steps = [p.recomputed_steps for p in plans]
    assert steps[0] < steps[1] < steps[2]
    assert plans[0].peak_bytes > plans[1].peak_bytes > plans[2].peak_bytes
    for p in plans:
        snt.check_plan(p)


def test_keep_within_defaults_to_the_papers_rule():
    """A Traded without keep_within, and a plain variant, keep rebuilt tensors for any later
    use: the plans made before it are unchanged."""
    net = snt.block_net(batch=2)
    search = search_for(net)
    layers = rebuildable(net)
    assert recompute.keep_within("strict") is None
    assert recompute.Traded("strict", layers).keep_within is None
    with_none = search.first(recompute.Traded("strict", layers, True, frozenset(), None))
    far = search.first(recompute.Traded("strict", layers, True, frozenset(), 10_000))
    assert [s.layer for s in with_none.steps] == [s.layer for s in far.steps]


def test_rebuild_order_through_cheap_names_the_add_under_a_relu(starved):
    """In a plan that copies a residual block's output (the ReLU after its add), the add is
    a candidate only when the search looks through cheap layers. Every ReLU planned apart
    (fused into the add, it is the add's output; each batch norm's fused, the plan at this
    cap copies no block output)."""
    net = snt.block_net(batch=4)
    cap = int(snt.smallest_cap(net, "all", conv_algos={}, fuse_relu=False) * 1.05)
    plan = sn.plan(net, cap, "all", conv_algos={}, rebuild_joins=False, fuse_relu=False)
    adds = {layer.index for layer in net.layers if layer.op == "add"}
    assert not adds & set(timing.rebuild_order(plan))
    assert adds & set(timing.rebuild_order(plan, through_cheap=True))


def test_joins_are_rebuilt_where_that_is_faster_and_train_bitwise_equal(starved):
    """A residual net, PCIe starved, at a cap where its block output is copied: the join
    search drops the add's output (and the ReLU after it) and rebuilds them, predicted far
    faster, moving fewer bytes; trained, every parameter and loss equals the baseline's."""
    net = snt.block_net(batch=2)
    cap = int(snt.smallest_cap(net, "all", conv_algos={}, momentum=0.0) * 1.16)
    joined = sn.plan(net, cap, "all", conv_algos={})
    plain = sn.plan(net, cap, "all", conv_algos={}, rebuild_joins=False)
    assert joined.rebuilt_joins == ["add1"] and not plain.rebuilt_joins
    assert recompute.keep_within(joined.drops) == plan_mod.KEEP_WITHIN
    assert joined.predicted_step_s < 0.5 * plain.predicted_step_s
    assert joined.bytes_to_host < plain.bytes_to_host
    assert joined.peak_bytes <= cap
    snt.check_plan(joined)
    runs = [sn.Runtime(net, memory, policy, device="cpu", conv_algos={}, seed=0, lr=0.1)
            for memory, policy in (("64MiB", "baseline"), (cap, "all"))]
    assert runs[1].plan.rebuilt_joins == ["add1"]
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        images = torch.randn(net.batch, *net.input_shape, generator=gen)
        labels = torch.randint(0, net.classes, (net.batch,), generator=gen)
        assert runs[0].step(images, labels) == runs[1].step(images, labels)
    assert runs[1].stats.peak_bytes == runs[1].plan.peak_bytes
    reference, joined_params = (rt.params() for rt in runs)
    assert reference.keys() == joined_params.keys()
    assert all(torch.equal(reference[k], joined_params[k]) for k in reference)


@snt.settings(20)
@given(net=snt.nets(), data=st.data())
def test_random_nets_join_plans_are_correct_and_never_slower(net, data):
    """On random nets (fans, joins, every layer op) at any feasible cap, PCIe starved: the
    plan with the join search is a correct schedule, fits where the plan without it does,
    and is never predicted slower."""
    with pytest.MonkeyPatch.context() as mp:
        starve(mp)
        cap = data.draw(snt.caps(net, "all"), label="cap")
        joined = sn.plan(net, cap, "all")
        snt.check_plan(joined)
        assert joined.predicted_step_s <= \
            sn.plan(net, cap, "all", rebuild_joins=False).predicted_step_s


def test_the_search_makes_at_most_join_budget_plans(starved, monkeypatch):
    """Each choice a join search judges is planned and given its prefetch distance
    (`_ahead`): at most JOIN_BUDGET of them per search, fewer where the budget says so,
    also within a round (here both adds are candidates: three choices a round, each add
    and the pair; every ReLU planned apart, the net this was written for). A
    plan runs one search per candidate plan (the traded one and the untraded one, where
    they differ)."""
    net = snt.block_net(batch=4)
    cap = int(snt.smallest_cap(net, "all", conv_algos={}, fuse_relu=False) * 1.2)
    adds = [layer.index for layer in net.layers if layer.op == "add"]
    real_order = timing.rebuild_order
    monkeypatch.setattr(timing, "rebuild_order", lambda plan, model=None, through_cheap=False: (
        adds if through_cheap else real_order(plan, model)))
    judged, per_search = [], []
    real, real_search = plan_mod._ahead, plan_mod._rebuild_joins
    monkeypatch.setattr(plan_mod, "_ahead", lambda search, base: (
        judged.append(recompute.keep_within(base.drops)) or real(search, base)))

    def counted(search, base):
        judged.clear()
        plan = real_search(search, base)
        per_search.append(judged.count(plan_mod.KEEP_WITHIN))
        return plan
    monkeypatch.setattr(plan_mod, "_rebuild_joins", counted)
    sn.plan(net, cap, "all", conv_algos={}, fuse_relu=False)
    assert per_search and 3 <= max(per_search) <= plan_mod.JOIN_BUDGET
    for budget in (2, 1, 0):
        per_search.clear()
        monkeypatch.setattr(plan_mod, "JOIN_BUDGET", budget)
        joins = sn.plan(net, cap, "all", conv_algos={}, fuse_relu=False).rebuilt_joins
        assert per_search and max(per_search) == budget
        assert joins == (["add1"] if budget else [])


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_a_bad_rebuild_joins_flag_is_refused(flag):
    with pytest.raises(ValueError, match="rebuild_joins"):
        sn.plan(snt.block_net(batch=2), "64MiB", "all", rebuild_joins=flag)


@pytest.mark.parametrize("scale", [1.0, 1.1, 1.2, 1.3, 1.5])
def test_every_add_a_candidate_the_plan_is_never_slower(starved, monkeypatch, scale):
    """With both adds of a residual net candidates at every round (whether or not the plan
    copies them), at caps from the smallest up: the search keeps a choice only when the
    model predicts it faster, so the plan is never slower than without the search."""
    net = snt.block_net(batch=4)
    cap = int(snt.smallest_cap(net, "all", conv_algos={}) * scale)
    adds = [layer.index for layer in net.layers if layer.op == "add"]
    real_order = timing.rebuild_order
    monkeypatch.setattr(timing, "rebuild_order", lambda plan, model=None, through_cheap=False: (
        adds if through_cheap else real_order(plan, model)))
    joined = sn.plan(net, cap, "all", conv_algos={})
    snt.check_plan(joined)
    assert joined.predicted_step_s <= \
        sn.plan(net, cap, "all", conv_algos={}, rebuild_joins=False).predicted_step_s
