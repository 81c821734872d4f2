"""Batch staging: the span a plan leaves for the next batch is one no block of it ever uses."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinysn as sn
from tinysn.sched import staging
from tinysn.sched.plan import Alloc, Prefetch

NET = dict(batch=4, classes=10, input_shape=(3, 32, 32))
A = staging.ALIGN


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=8),
       st.integers(1, 48), st.integers(1, 6 * A))
def test_find_span_is_the_highest_aligned_gap(ranges, capacity_blocks, nbytes):
    """Against brute force over every aligned offset: the span touches no used range, fits
    in the pool, and no higher aligned offset would."""
    used = [(a * A // 2, (a + n) * A // 2) for a, n in ranges]
    capacity = capacity_blocks * A // 2

    def free(offset):
        return offset + nbytes <= capacity and all(offset >= e or offset + nbytes <= s
                                                   for s, e in used)
    expected = next((o for o in range(capacity // A * A, -1, -A) if free(o)), None)
    assert staging.find_span(used, capacity, nbytes) == expected


def blocks_of(plan):
    """(start, end) of every device tensor a plan ever places, setup and steps."""
    ops = [*plan.setup, *(op for step in plan.steps for op in step.ops)]
    return [(op.offset, op.offset + plan.tensors[op.tensor].nbytes)
            for op in ops if isinstance(op, (Alloc, Prefetch))]


@pytest.mark.parametrize("policy", ["baseline", "liveness", "offload", "recompute", "all"])
def test_a_plan_stages_the_batch_where_none_of_its_blocks_ever_lies(policy):
    net = sn.models.resnet(blocks=[1, 1, 1, 1], **NET)
    plan = sn.plan(net, "256MiB", policy)
    offset = plan.batch_staging
    assert offset is not None and offset % A == 0
    end = offset + staging.span_bytes(*staging.batch_nbytes(plan.program, plan.tensors))
    assert end <= plan.capacity
    assert all(e <= offset or s >= end for s, e in blocks_of(plan))


def test_a_tight_plan_or_a_data_parallel_rank_does_not_stage():
    """At the smallest cap that runs it, a plan leaves no span for a batch; a data-parallel
    rank checks its batch on the host before its step, so its plan stages nothing."""
    net = sn.models.resnet(blocks=[1, 1, 1, 1], **NET)
    roomy = sn.plan(net, "256MiB", "liveness")
    tight = sn.plan(net, roomy.required_bytes, "liveness")
    assert tight.batch_staging is None
    assert sn.plan(net, "256MiB", "liveness", data_parallel=True).batch_staging is None
