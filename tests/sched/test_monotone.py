"""Plans are monotone in the cap: a net that plans under a cap plans under every larger one.

(a) the counterexample that started this (ResNet-18-like, batch 16, momentum 0.9, "all");
(b) a hypothesis property over random nets, policies, layouts, block sizes and cap pairs;
(c) `_Planner.floor` is a true lower bound: a run one block below it fails, at any layout;
(d) feasibility in the batch, and what `sn.max_batch` promises about smaller batches.

Example counts are small by default (seconds on the interpreter-free planner); set
TINYSN_EXAMPLES (e.g. 500) for a nightly-sized run.
"""
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tinysn as sn
from tinysn.sched import liveness, offload
from tinysn.sched.plan import HOST_CAPACITY, POLICIES, _Planner, grid_cap, small_bytes_for
from tests.sched.test_properties import random_nets

EXAMPLES = int(os.environ.get("TINYSN_EXAMPLES", "25"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=list(HealthCheck))


def fits(net, cap, policy, **kwargs):
    """The plan under `cap`, or None when it does not fit."""
    try:
        return sn.plan(net, cap, policy, **kwargs)
    except sn.OutOfMemory:
        return None


def test_grid_cap_rounds_down_to_seven_significant_bits():
    assert grid_cap(12 * 2**30) == 12 * 2**30 and grid_cap(512 * 2**20) == 512 * 2**20
    assert grid_cap(81_477_321) == 77 * 2**20      # 79,567 blocks -> 77 << 10
    assert grid_cap(100 * 1024 + 1000) == 100 * 1024       # under 128 blocks: every block
    assert grid_cap(255 * 1024) == 254 * 1024
    for n in (1, 127, 128, 129, 1000, 10**9):
        g = grid_cap(n * 1024)
        assert g <= n * 1024 and g >= n * 1024 * 63 / 64 and grid_cap(g) == g


def test_the_counterexample_is_monotone_now():
    """It planned at 81,477,321 bytes and failed at 1.01x and 1.02x; now every cap from the
    first that fits upwards fits, each plan within its cap."""
    net = sn.models.resnet(blocks=[1, 1, 1, 1], batch=16, classes=10, input_shape=(3, 64, 64))
    caps = [int(81_477_321 * f) for f in (0.98, 0.99, 1.0, 1.005, 1.01, 1.015, 1.02, 1.03,
                                           1.04, 1.05, 1.1, 1.2, 1.4, 1.6)]
    plans = [fits(net, cap, "all", momentum=0.9) for cap in caps]
    first = next(i for i, p in enumerate(plans) if p is not None)
    assert first < 6                     # it fits within 1.5% of the old cap...
    for cap, p in zip(caps[first:], plans[first:]):
        assert p is not None, f"fits at {caps[first]:,} but not at {cap:,}"   # ...and above
        assert p.required_bytes <= p.capacity <= cap


def test_out_of_memory_on_a_grid_cap_says_so():
    net = sn.models.resnet(blocks=[1, 1, 1, 1], batch=16, classes=10, input_shape=(3, 64, 64))
    with pytest.raises(sn.OutOfMemory, match=r"planned at 80,740,352 bytes, the grid cap at "
                                             r"or below the 81,477,321 asked for"):
        sn.plan(net, 81_477_321, "all", momentum=0.9)


@st.composite
def zoo_nets(draw, batch=None):
    """Small ResNets and DenseNets (fans, joins, every zoo layer), big enough that the pool
    fragments; `batch` fixed, or drawn."""
    batch = batch or draw(st.integers(1, 12))
    size = draw(st.sampled_from([16, 24, 32]))
    if draw(st.booleans()):
        stages = draw(st.lists(st.integers(1, 2), min_size=1, max_size=4))
        return sn.models.resnet(blocks=stages, bottleneck=draw(st.booleans()), batch=batch,
                                classes=10, input_shape=(3, size, size))
    return sn.models.densenet(blocks=draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)),
                              growth=draw(st.sampled_from([4, 8, 16])), init_features=16,
                              batch=batch, classes=10, input_shape=(3, size, size))


def floor_of(net, policy, momentum, block):
    """The floor of policy's first variant: caps near it are where plans break."""
    planner = _Planner(liveness.Program(net, momentum=momentum), HOST_CAPACITY, policy, None,
                       offload.DEFAULT_CHECKPOINTS, block, None, floor=True)
    planner.run()
    return planner.floor


def check_monotone(net, policy, low, steps, **kwargs):
    """Caps from `low` up by the factors `steps`: once one fits, every larger one fits,
    each plan inside its cap."""
    cap, fitted = low, None
    for step in (1.0, *steps):
        cap = int(cap * step) + 1
        p = fits(net, cap, policy, **kwargs)
        if fitted is not None:
            assert p is not None, f"{policy}: fits at {fitted:,} bytes, not at {cap:,}"
        if p is not None:
            assert p.required_bytes <= p.capacity <= cap
            fitted = fitted or cap


@SETTINGS
@given(net=zoo_nets(), policy=st.sampled_from(POLICIES),
       layout=st.sampled_from(["auto", "auto", "first_fit", "two_ended"]),
       momentum=st.sampled_from([0.0, 0.9]), low=st.floats(0.97, 1.3),
       steps=st.lists(st.floats(1.0, 1.03), min_size=3, max_size=6))
def test_zoo_nets_plan_monotone_in_the_cap(net, policy, layout, momentum, low, steps):
    start = int(floor_of(net, policy, momentum, 1024) * low)
    check_monotone(net, policy, start, steps, momentum=momentum, layout=layout)


@SETTINGS
@given(net=random_nets(), policy=st.sampled_from(POLICIES),
       layout=st.sampled_from(["auto", "first_fit", "two_ended"]),
       block=st.sampled_from([16, 64, 1024]), momentum=st.sampled_from([0.0, 0.9]),
       low=st.floats(0.9, 1.5), steps=st.lists(st.floats(1.0, 1.1), min_size=2, max_size=5))
def test_random_nets_plan_monotone_in_the_cap(net, policy, layout, block, momentum, low,
                                              steps):
    start = int(floor_of(net, policy, momentum, block) * low)
    check_monotone(net, policy, start, steps, momentum=momentum, layout=layout,
                   block_bytes=block)


@SETTINGS
@given(net=random_nets(), policy=st.sampled_from(POLICIES),
       drops=st.sampled_from([None, "from_checkpoints", "strict"]),
       two_ended=st.booleans(), block=st.sampled_from([16, 64]))
def test_no_run_fits_one_block_below_its_floor(net, policy, drops, two_ended, block):
    if policy not in ("recompute", "all"):
        drops = None
    program = liveness.Program(net, momentum=0.9)

    def planner(cap, small=0, floor=False):
        return _Planner(program, cap, policy, None, offload.DEFAULT_CHECKPOINTS, block, drops,
                        small, floor=floor)

    free = planner(HOST_CAPACITY, floor=True)
    unbounded = free.run()
    assert 0 < free.floor <= unbounded.peak_bytes
    cap = free.floor - block
    with pytest.raises(sn.OutOfMemory):
        planner(cap, small_bytes_for(cap) if two_ended else 0).run()
