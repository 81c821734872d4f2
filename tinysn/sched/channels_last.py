"""Channels-last activations between convs: a conv's output that one conv alone reads is
stored [N, H, W, C] where both convs' algorithms allow it.

A channels-last conv kernel ("nhwc", "flipped_nhwc", kernels/conv.py) wants its input with
the channels contiguous, so it first copies an NCHW input into its workspace; in VGG16 at
batch 32 those copies were 1.4 of the 18.2 ms a step spent on the H200. Where the writer can
store channels-last (its forward algorithm is among conv.WRITES_CHANNELS_LAST) and every pass
of the reader that reads the tensor can read it so (conv.reads_channels_last: its forward, its
weight gradient, and its data gradient where that applies the writer's ReLU mask), the plan
stores the tensor channels-last and the reader's forward and weight gradient skip the copy.

The layout is decided after the algorithms: nothing the plan chose changes (a pass that
reads in place uses less of its workspace than planned), and the numbers are the same bits.
Gradients stay NCHW: a weight gradient reads dY along the pixels, a data gradient along
the channels, so one of the two copies dY whichever layout it had. A writer whose own
backward masks dy by its output (a fused ReLU its reader does not mask: ops._masks_dy)
keeps NCHW, as that pass reads y beside dy element by element.
"""
from __future__ import annotations

from ..kernels import conv as conv_k
from ..ops import spec
from .workspace import conv_geometry


def outputs(net, conv_algos) -> frozenset:
    """Names of the convs of `net` (as planned: fused) whose outputs a plan with `conv_algos`
    (layer name -> {phase: algo}) stores channels-last."""
    return frozenset(layer.name for layer in net.layers if _stored(layer, conv_algos))


def _stored(layer, conv_algos) -> bool:
    if not spec(layer).has_algorithms or len(layer.consumers) != 1:
        return False
    reader = layer.consumers[0]
    if not spec(reader).has_algorithms:
        return False
    if layer.attrs.get("relu") and not layer.attrs.get("relu_masked"):
        return False
    if conv_algos.get(layer.name, {}).get("forward") not in conv_k.WRITES_CHANNELS_LAST:
        return False
    algos = conv_algos.get(reader.name, {})
    x_shape, w_shape, _, _ = conv_geometry(reader)
    phases = ["forward", "backward_weight"]
    if reader.attrs.get("x_is_relu_output"):
        phases.append("backward_data")
    return all(p in algos and conv_k.reads_channels_last(p, algos[p], x_shape, w_shape)
               for p in phases)

