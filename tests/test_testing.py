"""tinysn.testing bites: planted planner bugs, each caught by the oracles on drawn nets.

Every mutation below rewrites a correct plan the way a buggy planner would have written
it (one mutant per site where the bug can be planted). The property test draws nets,
policies and caps, checks that the real plan passes and that every mutant of it fails
with the rule the bug breaks; `find` shows that each bug is planted on some drawn net.
"""
import dataclasses

import pytest
import torch
from hypothesis import Phase, find, given, strategies as st

import tinysn as sn
import tinysn.testing as snt
from tinysn.sched.plan import (Alloc, Drop, Evict, Free, Hand, Launch, Offload, Prefetch, Release,
                               Step, Sync, Wait)


@st.composite
def plans(draw, policies=sn.POLICIES):
    """A plan of a drawn net under a drawn policy and cap."""
    net, policy = draw(snt.nets()), draw(snt.policies(policies))
    return sn.plan(net, draw(snt.caps(net, policy)), policy)


def with_ops(plan, index, ops):
    """A copy of `plan` whose step `index` has `ops` instead (index None: the setup)."""
    if index is None:
        return dataclasses.replace(plan, setup=ops)
    steps = list(plan.steps)
    steps[index] = dataclasses.replace(steps[index], ops=ops)
    return dataclasses.replace(plan, steps=steps)


def sites(plan, kind):
    """(step index, position, op) of every op of type `kind` in the steps."""
    return [(s.index, i, op) for s in plan.steps for i, op in enumerate(s.ops)
            if isinstance(op, kind)]


def forward_of(plan, layer_index):
    """The forward layer pass of the layer with net index `layer_index`."""
    return next(s for s in plan.program.passes
                if s.phase == "forward" and s.layer.index == layer_index)


def touched(plan, launch):
    """Tensor ids a Launch reads or writes."""
    key = launch.key
    step = forward_of(plan, key[1]) if isinstance(key, tuple) else plan.program.passes[key]
    return set(step.reads) | set(step.writes) | {launch.workspace} - {None}


# -- the planted bugs: plan -> mutants -------------------------------------------------
def free_early(plan):
    """Free a tensor before the kernel of its last use instead of after it."""
    for si, j, op in sites(plan, Free):
        ops = plan.steps[si].ops
        launch = next((i for i in range(j) if isinstance(ops[i], Launch)), None)
        if launch is not None and op.tensor in touched(plan, ops[launch]):
            yield with_ops(plan, si, ops[:launch] + [op] + ops[launch:j] + ops[j + 1:])


def skip_wait(plan):
    """Forget to wait for a prefetch before the kernel reads it."""
    for si, j, _ in sites(plan, Wait):
        ops = plan.steps[si].ops
        yield with_ops(plan, si, ops[:j] + ops[j + 1:])


def drop_checkpoint(plan):
    """Drop a checkpoint (no copy to the host) that the backward pass brings back."""
    for si, j, op in sites(plan, Offload) + sites(plan, Evict):
        if isinstance(op, Evict) and op.host_offset is None:
            continue
        mutant = plan
        if isinstance(op, Offload):
            ops = plan.steps[si].ops
            mutant = with_ops(plan, si, ops[:j] + ops[j + 1:])
            release = [(s, i) for s, i, r in sites(mutant, Release) if r.tensor == op.tensor]
            if not release:
                continue
            si, j = release[0]
        ops = mutant.steps[si].ops
        yield with_ops(mutant, si, ops[:j] + [Drop(op.tensor)] + ops[j + 1:])


def recompute_with_forward(plan, ops=None):
    """Rebuild a dropped output (of a layer whose op is in `ops`, default any) by running
    the layer's training forward again (a batch norm updates its running statistics a
    second time)."""
    for si, j, op in sites(plan, Launch):
        if isinstance(op.key, tuple):
            forward = forward_of(plan, op.key[1])
            if ops is None or forward.layer.op in ops:
                step_ops = plan.steps[si].ops
                launch = Launch(forward.index, op.algos, op.workspace)
                yield with_ops(plan, si, step_ops[:j] + [launch] + step_ops[j + 1:])


def rebuild_before_forward(plan):
    """Recompute a dropout before its forward ran this iteration (another mask)."""
    for si, j, op in sites(plan, Launch):
        if isinstance(op.key, tuple) and forward_of(plan, op.key[1]).layer.op == "dropout":
            early = Step(0, plan.steps[si].layer, "recompute", [op])
            yield dataclasses.replace(plan, steps=[early] + list(plan.steps))


def overlap(plan):
    """Place a tensor on top of the first persistent one."""
    first = plan.setup[0].offset
    for si, j, op in [(None, i, op) for i, op in enumerate(plan.setup)][1:] + sites(plan, Alloc):
        ops = plan.setup if si is None else plan.steps[si].ops
        yield with_ops(plan, si, ops[:j] + [Alloc(op.tensor, first)] + ops[j + 1:])


def hand_elsewhere(plan):
    """Give a gradient the block of a tensor its kernel reads but does not write it over
    (the input, not dy), as if that read were the last."""
    for si, j, op in sites(plan, Hand):
        lp = plan.program.passes[next(o.key for o in plan.steps[si].ops if isinstance(o, Launch))]
        others = [t for t in lp.reads if t != op.source and not plan.tensors[t].persistent]
        if others:
            ops = plan.steps[si].ops
            yield with_ops(plan, si, ops[:j] + [Hand(op.tensor, others[0])] + ops[j + 1:])


def keep_handed(plan):
    """Hand dy's block over and never free dy (the planner forgot it holds no block)."""
    for si, j, op in sites(plan, Free):
        if any(isinstance(o, Hand) and o.source == op.tensor for o in plan.steps[si].ops):
            ops = plan.steps[si].ops
            yield with_ops(plan, si, ops[:j] + ops[j + 1:])


def leak(plan):
    """Never free the tensor freed last in the iteration."""
    frees = sites(plan, Free)
    if frees:
        si, j, _ = frees[-1]
        ops = plan.steps[si].ops
        yield with_ops(plan, si, ops[:j] + ops[j + 1:])


def shrink_cap(plan):
    """Claim a cap one block below the highest byte the plan uses."""
    yield dataclasses.replace(plan, capacity=plan.required_bytes - snt.BLOCK_BYTES)


def misstate_peak(plan):
    """Report a peak one block lower than the plan reaches."""
    yield dataclasses.replace(plan, peak_bytes=plan.peak_bytes - snt.BLOCK_BYTES)


MUTATIONS = {                # name: (planted bug, the rules that may catch it)
    "free_early": (free_early, {"access"}),
    "skip_wait": (skip_wait, {"access"}),
    # the prefetch finds no host copy, or a wait names the copy's event, now never recorded
    "drop_checkpoint": (drop_checkpoint, {"state", "stream"}),
    "recompute_with_forward": (recompute_with_forward, {"recompute"}),
    "rebuild_before_forward": (rebuild_before_forward, {"recompute"}),
    # a larger tensor put on the first one may also run past the arena's end (the cap)
    "overlap": (overlap, {"overlap", "cap"}),
    # the other tensor may still be moving, or not on the device at all
    "hand_elsewhere": (hand_elsewhere, {"in place", "state"}),
    "keep_handed": (keep_handed, {"leak"}),
    # a leaked block is either handed to another tensor later (overlap) or still held
    "leak": (leak, {"leak", "overlap"}),
    "shrink_cap": (shrink_cap, {"cap"}),
    "misstate_peak": (misstate_peak, {"figures"}),
}


def assert_caught(plan, name):
    mutate, rules = MUTATIONS[name]
    mutants = list(mutate(plan))
    for mutant in mutants:
        with pytest.raises(snt.ScheduleError) as err:
            snt.check_plan(mutant)
        assert err.value.rule in rules, (name, str(err.value))
        assert err.value.where in str(err.value)
    return len(mutants)


@snt.settings(30)
@given(net=snt.nets(), policy=snt.policies(), data=st.data())
def test_real_plans_pass_and_every_planted_bug_is_caught(net, policy, data):
    plan = sn.plan(net, data.draw(snt.caps(net, policy), label="cap"), policy)
    snt.check_plan(plan)
    for name in MUTATIONS:
        assert_caught(plan, name)


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_bug_is_planted_and_caught_on_some_drawn_net(name):
    """`find` draws plans of the moving policies until the bug can be planted."""
    plan = find(plans(("offload", "recompute", "all")),
                lambda p: any(True for _ in MUTATIONS[name][0](p)),
                settings=snt.settings(300, database=None, phases=[Phase.generate]))
    assert assert_caught(plan, name) > 0


def test_errors_name_step_layer_and_tensor():
    plan = sn.plan(snt.every_layer_net(), "64MiB", "offload")
    mutant = next(skip_wait(plan))
    with pytest.raises(snt.ScheduleError, match=r"iteration 1, step \d+ \(backward of layer "
                                                r"\w+\), tensor \w+: read .* prefetching "
                                                r"\(prefetched without a Wait\)") as err:
        snt.check_plan(mutant)
    assert err.value.tensor in {t.name for t in plan.tensors}


def test_missing_syncs_race_on_the_streams():
    """Without one of the plan's syncs (or a prefetch's waits) copies race with kernels for
    some of them (others are covered by another wait, transitively)."""
    plan = sn.plan(snt.block_net(), snt.smallest_cap(snt.block_net(), "all"), "all")
    syncs = sites(plan, Sync) + [s for s in sites(plan, Prefetch) if s[2].waits]
    assert syncs, "the plan should need syncs"
    caught = 0
    for si, j, op in syncs:
        ops = plan.steps[si].ops
        rest = [] if isinstance(op, Sync) else [dataclasses.replace(op, waits=())]
        try:
            snt.check_plan(with_ops(plan, si, ops[:j] + rest + ops[j + 1:]))
        except snt.ScheduleError as err:
            assert err.rule == "stream" and "may still" in str(err)
            caught += 1
    assert caught >= len(syncs) // 4, (caught, len(syncs))


def test_host_cap_below_the_host_arena_is_caught():
    plan = sn.plan(snt.every_layer_net(), "64MiB", "offload")
    snt.check_plan(plan, host_memory=plan.host_bytes)
    with pytest.raises(snt.ScheduleError, match=r"\[cap\].*host arena"):
        snt.check_plan(plan, host_memory=plan.host_bytes - snt.BLOCK_BYTES)


def test_the_recompute_rule_guards_a_real_bug(monkeypatch):
    """Run for real, a recomputation launched as the training forward updates batch-norm
    running statistics twice: the parameters the oracle protects really change. (A batch
    norm's rebuild takes no workspace, bn.rebuild, so the training forward put in its place
    is handed a scratch tensor of its own here.)"""
    from tinysn.kernels import bn
    forward = bn.forward

    def with_scratch(x, *args, **kwargs):
        if args[6] is None:
            args = (*args[:6], torch.empty(bn.workspace_bytes(x.shape, "forward"),
                                           dtype=torch.uint8))
        forward(x, *args, **kwargs)
    monkeypatch.setattr(bn, "forward", with_scratch)
    net = snt.block_net(p=0.0)
    cap = snt.smallest_cap(net, "recompute", conv_algos={})

    def running_stats(mutate):
        rt = sn.Runtime(net, cap, "recompute", device="cpu", conv_algos={})
        rt.plan.steps[:] = mutate(rt.plan).steps
        gen = torch.Generator().manual_seed(0)
        rt.step(torch.randn((net.batch, *net.input_shape), generator=gen),
                torch.randint(0, net.classes, (net.batch,), generator=gen))
        return {k: v for k, v in rt.params().items() if "running" in k}

    good = running_stats(lambda p: p)
    bad = running_stats(lambda p: next(recompute_with_forward(p, ops=("bn",))))
    assert any(not torch.equal(good[k], bad[k]) for k in good)


def test_check_equivalent_catches_a_policy_that_computes_differently(monkeypatch):
    """A dropout whose recomputation draws another mask: the trained parameters differ."""
    from tinysn.kernels import dropout

    net = snt.block_net(p=0.5)
    calls, forward = [], dropout.forward

    def layer_per_call(*args, layer, **kwargs):
        calls.append(layer)
        forward(*args, layer=len(calls), **kwargs)
    monkeypatch.setattr(dropout, "forward", layer_per_call)
    with pytest.raises(snt.ScheduleError, match=r"\[equivalence\] policy 'recompute'"):
        snt.check_equivalent(net, ["liveness", "recompute"])


def test_bad_arguments_fail_with_one_clear_line():
    net = snt.every_layer_net()
    for call, match in ((lambda: snt.check_plan(net), "needs a Plan"),
                        (lambda: snt.check_plan(sn.plan(net, "64MiB"), iterations=0),
                         "iterations"),
                        (lambda: snt.check_equivalent(net, ["fast"]), "policies"),
                        (lambda: snt.check_equivalent(net, steps=0), "steps"),
                        (lambda: snt.policies(["fast"]), "policies"),
                        (lambda: snt.nets(max_layers=-1).example(), "bounds"),
                        (lambda: snt.nets(kinds=("gelu",)).example(), "kinds")):
        with pytest.raises(ValueError, match=match):
            call()


def test_examples_read_tinysn_examples(monkeypatch):
    monkeypatch.setenv("TINYSN_EXAMPLES", "500")
    assert snt.examples(10) == 500 and snt.settings(10).max_examples == 500
    monkeypatch.delenv("TINYSN_EXAMPLES")
    assert snt.examples(10) == 10
    monkeypatch.setenv("TINYSN_EXAMPLES", "lots")
    with pytest.raises(ValueError, match="TINYSN_EXAMPLES"):
        snt.examples(10)


def test_drawn_nets_print_as_the_code_that_builds_them():
    net = find(snt.nets(), lambda n: any(layer.op == "concat" for layer in n),
               settings=snt.settings(200, database=None))
    code = repr(net)
    assert "net.concat([" in code
    namespace = {"sn": sn}
    exec(code, namespace)                   # the recipe rebuilds the same net
    rebuilt = namespace["net"]
    assert [(x.op, x.shape) for x in rebuilt] == [(x.op, x.shape) for x in net]


def test_caps_start_at_the_smallest_feasible_cap_and_all_plan():
    net = snt.block_net()
    for policy in ("liveness", "all"):
        low = snt.smallest_cap(net, policy)
        with pytest.raises(sn.OutOfMemory):
            sn.plan(net, low - snt.BLOCK_BYTES, policy)

        @snt.settings(10, database=None)
        @given(cap=snt.caps(net, policy))
        def drawn(cap):
            assert cap >= low
            sn.plan(net, cap, policy)
        drawn()
    host = snt.smallest_host_cap(net, "offload", "64MiB")
    sn.plan(net, "64MiB", "offload", host_memory=host)
    with pytest.raises(sn.OutOfMemory):
        sn.plan(net, "64MiB", "offload", host_memory=host - snt.BLOCK_BYTES)


def test_the_worked_example_in_docs_runs():
    """docs/testing.md's code: the false property's counterexample still moves 72 against
    144 bytes, and the property that holds passes."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "testing.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) == 3
    namespace = {}
    for block in blocks:
        exec(block, namespace)
    namespace["test_all_moves_nothing_where_liveness_fits"]()
