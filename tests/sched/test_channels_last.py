"""Channels-last activations between convs (sched/channels_last.py): which outputs a plan
stores so, and a step's bits with and without them."""
import pytest
import torch

import tinysn as sn
from tinysn.graph import Net
from tinysn.kernels import conv as conv_k

CL_ALGOS = {"forward": "nhwc", "backward_data": "flipped_nhwc", "backward_weight": "tma"}


def conv_chain(batch=1):
    """Three 3x3 convs with ReLUs at 28x28 (the smallest output the channels-last algorithms
    are offered on), then a pool and an fc: c1 and c2 are read by a conv, c3 by the pool."""
    net = Net((3, 28, 28), classes=5, batch=batch)
    h = net.data()
    for name in ("c1", "c2", "c3"):
        h = net.relu(net.conv(h, 8, 3, padding=1, name=name))
    net.softmax_loss(net.fc(net.pool(h, "max", kernel=2, stride=2), 5, name="fc"))
    return net


def test_outputs_read_by_one_channels_last_conv_are_stored_channels_last():
    net = conv_chain()
    plan = sn.plan(net, "64MiB", "liveness", conv_algos=CL_ALGOS)
    assert plan.conv_algos["c1"]["forward"] == "implicit"      # 3 channels: no "nhwc"
    assert plan.channels_last == {"c1", "c2"}
    assert sn.plan(net, "64MiB", "liveness", conv_algos=CL_ALGOS,
                   channels_last=False).channels_last == frozenset()
    # readers that run NCHW kernels read NCHW
    assert sn.plan(net, "64MiB", "liveness", conv_algos={}).channels_last == frozenset()
    # a reader whose weight gradient reads x NCHW ("onepass") keeps its input NCHW
    mixed = {**CL_ALGOS, "backward_weight": "onepass"}
    assert sn.plan(net, "64MiB", "liveness", conv_algos=mixed).channels_last == frozenset()


def test_bad_channels_last_flag_is_refused():
    with pytest.raises(ValueError, match="channels_last must be a bool"):
        sn.plan(conv_chain(), "64MiB", "liveness", channels_last=1)


def test_a_step_with_channels_last_outputs_gives_the_nchw_bits(monkeypatch):
    net = conv_chain()
    gen = torch.Generator().manual_seed(1)
    images, labels = torch.randn(1, 3, 28, 28, generator=gen), torch.tensor([3])
    seen = []                   # per conv forward: (x channels-last, y channels-last)
    forward = conv_k.forward

    def recording(x, w, b, y, **kw):
        seen.append((conv_k.is_channels_last(x), conv_k.is_channels_last(y)))
        forward(x, w, b, y, **kw)
    monkeypatch.setattr(conv_k, "forward", recording)
    results = []
    for stored in (True, False):
        rt = sn.Runtime(net, "64MiB", "all", device="cpu", lr=0.05, momentum=0.9, seed=3,
                        precision="ieee", conv_algos=CL_ALGOS)
        assert rt.plan.channels_last == {"c1", "c2"}
        if not stored:
            rt.plan.channels_last = frozenset()
        seen.clear()
        results.append((rt.step(images, labels), rt.params(), list(seen)))
    (loss, params, layouts), (nchw_loss, nchw_params, nchw_layouts) = results
    assert layouts == [(False, True), (True, True), (True, False)]     # c1, c2, c3
    assert nchw_layouts == [(False, False)] * 3
    assert loss == nchw_loss
    assert all(torch.equal(params[k], nchw_params[k]) for k in params)
