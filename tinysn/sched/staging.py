"""Batch staging: where the next step's batch lands while the last step still runs.

A step reads its batch with its first kernels (the batch check, the first conv) and again near
its end (the first conv's weight gradient reads the images), so the next batch cannot be
copied into the data tensor's block before the step is over: copied there, its host-to-device
copy (19 MB for 32 images of 224x224, ~0.4 ms at PCIe 5 rates) would precede every step's
first kernel. Where the plan leaves a span of the pool that none of its blocks ever occupies
(setup or step) wide enough for the images and the labels, the runtime copies each batch
into that span on a stream of its own as soon as the previous step has copied the span out
(with one device-to-device copy into the data and labels blocks, its first operation) and
the host has the batch: the host gets it once that step's loss is known (Runtime.step
returns then), so the copy overlaps that step's backward pass (Runtime._batch_into_pool).
The span is inside the pool: staging costs no byte outside the cap, and a plan that leaves
no such span copies the batch at the step's start.

The planner finds the span as it finishes a plan (`Plan.batch_staging`) and the step-time
model (timing.simulate) counts the copy as overlapping compute where there is one.
"""
from __future__ import annotations

ALIGN = 1024    # the span's offset and its labels' are multiples of this (whole pool blocks)


def batch_nbytes(program, tensors) -> tuple[int, int]:
    """(images bytes, labels bytes) of one batch of `program`'s net (`tensors`: its
    TensorInfo list)."""
    return (tensors[program.act[program.net.data_layer]].nbytes,
            tensors[program.labels].nbytes)


def span_bytes(images: int, labels: int) -> int:
    """Bytes the staging span takes: the images, then the labels at an aligned offset."""
    return labels_offset(images) + labels


def labels_offset(images: int) -> int:
    """Where the labels start inside the span: after the images, aligned."""
    return -(-images // ALIGN) * ALIGN


def find_span(used: list, capacity: int, nbytes: int) -> int | None:
    """The highest aligned offset at which `nbytes` fit in [0, capacity) without touching any
    of the `used` byte ranges ((start, end) pairs); None where no gap is wide enough."""
    top = capacity
    for start, end in sorted(used, key=lambda r: r[1], reverse=True) + [(0, 0)]:
        offset = (top - nbytes) // ALIGN * ALIGN
        if offset >= end and offset >= 0:
            return offset
        top = min(top, start)
        if top <= 0:
            return None
    return None
