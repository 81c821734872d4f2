"""tinysn.graph: shape inference (against torch), errors, names, init, the torch reference."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tinysn.graph import Layer, Net, TorchNet


def image_net(c=3, h=8, w=8, batch=2, classes=10):
    net = Net(input_shape=(c, h, w), classes=classes, batch=batch)
    return net, net.data()


# --------------------------------------------------------------------------- shapes
@settings(max_examples=60, deadline=None)
@given(c=st.integers(1, 4), h=st.integers(1, 9), w=st.integers(1, 9), k=st.integers(1, 5),
       kh=st.integers(1, 5), kw=st.integers(1, 5), sh=st.integers(1, 3), sw=st.integers(1, 3),
       ph=st.integers(0, 3), pw=st.integers(0, 3), bias=st.booleans())
def test_conv_shape_matches_torch(c, h, w, k, kh, kw, sh, sw, ph, pw, bias):
    net, x = image_net(c, h, w)
    fits = kh <= h + 2 * ph and kw <= w + 2 * pw
    if not fits:
        with pytest.raises(ValueError, match="larger than the padded input"):
            net.conv(x, k, (kh, kw), (sh, sw), (ph, pw), bias)
        return
    y = net.conv(x, k, (kh, kw), (sh, sw), (ph, pw), bias)
    ref = F.conv2d(torch.zeros(x.shape), torch.zeros(k, c, kh, kw), None, (sh, sw), (ph, pw))
    assert y.shape == tuple(ref.shape)
    assert y.attrs == {"out_channels": k, "kernel": (kh, kw), "stride": (sh, sw),
                       "padding": (ph, pw), "bias": bias}
    assert y.params == ({"weight": (k, c, kh, kw), "bias": (k,)} if bias
                        else {"weight": (k, c, kh, kw)})
    assert y.buffers == {}


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(["max", "avg"]), h=st.integers(1, 9), w=st.integers(1, 9),
       kh=st.integers(1, 5), kw=st.integers(1, 5), stride=st.none() | st.integers(1, 3),
       ph=st.integers(0, 2), pw=st.integers(0, 2))
def test_pool_shape_matches_torch(mode, h, w, kh, kw, stride, ph, pw):
    net, x = image_net(2, h, w)
    if ph > kh // 2 or pw > kw // 2:
        with pytest.raises(ValueError, match="at most half"):
            net.pool(x, mode, (kh, kw), stride, (ph, pw))
        return
    if kh > h + 2 * ph or kw > w + 2 * pw:
        with pytest.raises(ValueError, match="larger than the padded input"):
            net.pool(x, mode, (kh, kw), stride, (ph, pw))
        return
    y = net.pool(x, mode, (kh, kw), stride, (ph, pw))
    fn = F.max_pool2d if mode == "max" else F.avg_pool2d
    ref = fn(torch.zeros(x.shape), (kh, kw), stride if stride is not None else (kh, kw), (ph, pw))
    assert y.shape == tuple(ref.shape)
    assert y.attrs["stride"] == ((kh, kw) if stride is None else (stride, stride))
    assert y.params == {} and y.buffers == {}


def test_elementwise_and_fc_shapes():
    net, x = image_net(3, 5, 7, batch=4)
    assert x.shape == (4, 3, 5, 7) and x.op == "data" and x.inputs == ()
    b = net.bn(x)
    assert b.shape == x.shape
    assert b.params == {"weight": (3,), "bias": (3,)}
    assert b.buffers == {"running_mean": (3,), "running_var": (3,)}
    assert b.attrs == {"eps": 1e-5, "momentum": 0.1}
    r = net.relu(b)
    ln = net.lrn(r, size=3, alpha=2e-4, beta=0.5, k=1.0)
    assert ln.shape == x.shape and ln.attrs == {"size": 3, "alpha": 2e-4, "beta": 0.5, "k": 1.0}
    d = net.dropout(ln, p=0.25)
    assert d.shape == x.shape and d.attrs == {"p": 0.25}
    f = net.fc(d, 6)
    assert f.shape == (4, 6) and f.params == {"weight": (6, 3 * 5 * 7), "bias": (6,)}
    f2 = net.fc(f, 10, bias=False)
    assert f2.params == {"weight": (10, 6)}
    loss = net.softmax_loss(f2)
    assert loss.shape == (1,) and net.loss is loss


def test_join_shapes_and_graph_links():
    net, x = image_net(3, 6, 6)
    a = net.conv(x, 4, 1)
    b = net.conv(x, 5, 3, padding=1)
    c = net.concat([a, b])
    assert c.shape == (2, 9, 6, 6) and c.inputs == (a, b)
    s1 = net.add(a, net.conv(x, 4, 1))
    s2 = net.add([a, net.relu(a), net.conv(x, 4, 3, padding=1)])
    assert s1.shape == s2.shape == a.shape and len(s2.inputs) == 3
    assert [layer.index for layer in net.layers] == list(range(len(net.layers)))
    assert x.consumers == [a, b, net["conv3"], net["conv4"]]
    assert a.consumers == [c, s1, net["relu1"], s2]
    assert net["concat1"] is c and "add2" in net and len(net) == len(net.layers)
    # 2-D concat along features works too
    net2 = Net((4,), classes=3, batch=2)
    z = net2.data()
    assert net2.concat([net2.fc(z, 2), net2.fc(z, 3)]).shape == (2, 5)


def test_automatic_and_explicit_names():
    net, x = image_net()
    assert x.name == "data1"
    c1 = net.conv(x, 2, 1)
    explicit = net.conv(c1, 2, 1, name="conv2")
    c3 = net.conv(explicit, 2, 1)
    assert (c1.name, c3.name) == ("conv1", "conv3")
    assert net.bn(c3).name == "bn1" and net.relu(c3).name == "relu1"
    with pytest.raises(ValueError, match="duplicate layer name"):
        net.relu(c3, name="conv1")
    for bad in ("a..b", "", ".a", "a.", 3, "has space"):
        with pytest.raises(ValueError, match="layer name"):
            net.relu(c3, name=bad)


# --------------------------------------------------------------------------- errors
def test_errors():
    net, x = image_net(3, 8, 8)
    other, ox = image_net(3, 8, 8)
    a, b = net.conv(x, 4, 1), net.conv(x, 5, 1)
    cases = [
        (lambda: net.data(), "only once"),
        (lambda: net.add(a, b), "shapes differ"),
        (lambda: net.add([a]), "at least 2"),
        (lambda: net.add(a, a), "appears twice"),
        (lambda: net.concat([a, net.pool(b, "max", 2)]), "only the channel"),
        (lambda: net.concat([a, net.fc(b, 3)]), "only the channel"),
        (lambda: net.concat(a), "at least 2"),
        (lambda: net.conv(x, 4, 9), "larger than the padded input"),
        (lambda: net.conv(x, 4, (1, 11), padding=(0, 1)), "larger than the padded input"),
        (lambda: net.pool(x, "max", 9), "larger than the padded input"),
        (lambda: net.pool(x, "sum", 2), "unknown pooling mode"),
        (lambda: net.pool(x, "max", 3, padding=2), "at most half"),
        (lambda: net.pool(x, "avg", (2, 4), padding=(0, 3)), "at most half"),
        (lambda: net.conv(x, 0, 1), "positive"),
        (lambda: net.conv(x, 4, 0), "positive"),
        (lambda: net.conv(x, 4, 3, stride=0), "positive"),
        (lambda: net.conv(x, 4, 3, stride=(1, -1)), "positive"),
        (lambda: net.conv(x, 4, 3, padding=-1), "non-negative"),
        (lambda: net.conv(x, 4, (1, 2, 3)), "pair"),
        (lambda: net.conv(x, 4, 2.0), "int"),
        (lambda: net.conv(x, True, 1), "positive int"),
        (lambda: net.conv(x, 4, 1, bias=1), "bias"),
        (lambda: net.pool(x, "max", 2, stride=0), "positive"),
        (lambda: net.pool(x, "max", 0), "positive"),
        (lambda: net.lrn(x, size=0), "positive"),
        (lambda: net.lrn(x, alpha=float("nan")), "finite"),
        (lambda: net.fc(x, 0), "positive"),
        (lambda: net.dropout(x, 1.0), r"\[0, 1\)"),
        (lambda: net.dropout(x, -0.1), r"\[0, 1\)"),
        (lambda: net.conv(ox, 4, 1), "another Net"),
        (lambda: net.add(a, other.conv(ox, 4, 1)), "another Net"),
        (lambda: net.relu("conv1"), "Layer"),
        (lambda: net.concat([a, torch.zeros(1)]), "Layer"),
        (lambda: net.concat(5), "list of Layers"),
        (lambda: net.softmax_loss(a), "2-D"),
        (lambda: net.softmax_loss(net.fc(a, 7)), "classes"),
        (lambda: net.bn(net.fc(a, 7)), "4-D"),
        (lambda: net.conv(net.fc(a, 7), 3), "4-D"),
        (lambda: Net((3, 8), classes=10), "input_shape"),
        (lambda: Net((3, 0, 8), classes=10), "positive"),
        (lambda: Net(classes=0), "positive"),
        (lambda: Net(batch=0), "positive"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()
    n_before = len(net.layers)
    loss = net.softmax_loss(net.fc(net.concat([a, b]), 10))
    with pytest.raises(ValueError, match="already has a loss"):
        net.softmax_loss(net.fc(a, 10))
    with pytest.raises(ValueError, match="cannot feed"):
        net.relu(loss)
    assert n_before > 0


def test_failed_builder_leaves_net_unchanged():
    net, x = image_net()
    before = (len(net.layers), list(x.consumers))
    with pytest.raises(ValueError):
        net.conv(x, 4, 99)
    with pytest.raises(ValueError):
        net.pool(x, "bad")
    assert (len(net.layers), list(x.consumers)) == before
    assert net.conv(x, 4, 1).name == "conv1"


def test_check():
    net = Net((3, 4, 4), classes=2)
    with pytest.raises(ValueError, match="empty"):
        net.check()
    x = net.data()
    h = net.relu(x)
    with pytest.raises(ValueError, match="no loss"):
        net.check()
    net.softmax_loss(net.fc(h, 2))
    assert net.check() is net
    net.conv(x, 2, 1)  # a dead end: its output never reaches the loss
    with pytest.raises(ValueError, match="do not lead to the loss: conv1"):
        net.check()


# ----------------------------------------------------------------------- parameters
def small_net():
    net, x = image_net(3, 8, 8, batch=2, classes=5)
    h = net.relu(net.bn(net.conv(x, 4, 3, padding=1, bias=False, name="c1")))
    a = net.conv(h, 4, 1, name="a")
    b = net.conv(h, 2, 3, padding=1, name="b")
    h = net.concat([a, b])
    h = net.add(h, net.conv(x, 6, 1, name="short"))
    h = net.pool(h, "max", kernel=3, stride=2, padding=1)
    h = net.lrn(h)
    h = net.dropout(h, p=0.5)
    net.softmax_loss(net.fc(h, 5, name="fc"))
    return net


def test_param_and_buffer_names():
    net = small_net()
    assert net.param_shapes() == {
        "c1.weight": (4, 3, 3, 3), "bn1.weight": (4,), "bn1.bias": (4,),
        "a.weight": (4, 4, 1, 1), "a.bias": (4,), "b.weight": (2, 4, 3, 3), "b.bias": (2,),
        "short.weight": (6, 3, 1, 1), "short.bias": (6,),
        "fc.weight": (5, 6 * 4 * 4), "fc.bias": (5,)}
    assert net.buffer_shapes() == {"bn1.running_mean": (4,), "bn1.running_var": (4,)}
    assert net.param_count() == sum(math.prod(s) for s in net.param_shapes().values())


def test_init_params_deterministic_and_torch_like():
    net = small_net()
    p0, p0b, p1 = net.init_params(0), net.init_params(0), net.init_params(1)
    assert list(p0) == list(net.param_shapes()) [:3] + ["bn1.running_mean", "bn1.running_var"] \
        + list(net.param_shapes())[3:]
    assert set(p0) == set(net.param_shapes()) | set(net.buffer_shapes())
    for k, v in p0.items():
        assert v.dtype == torch.float32 and v.device.type == "cpu"
        assert tuple(v.shape) == {**net.param_shapes(), **net.buffer_shapes()}[k]
        assert torch.equal(v, p0b[k])
    for k in ("c1.weight", "a.weight", "a.bias", "fc.weight", "fc.bias"):
        assert not torch.equal(p0[k], p1[k])
    assert torch.equal(p0["bn1.weight"], torch.ones(4)) and torch.equal(p0["bn1.bias"], torch.zeros(4))
    assert torch.equal(p0["bn1.running_mean"], torch.zeros(4))
    assert torch.equal(p0["bn1.running_var"], torch.ones(4))
    # torch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for conv/linear weight and bias
    for layer, fan_in in (("c1", 27), ("a", 4), ("b", 36), ("fc", 96)):
        bound = 1 / math.sqrt(fan_in)
        w = p0[f"{layer}.weight"]
        assert w.abs().max() <= bound and w.abs().max() > 0.5 * bound
        if f"{layer}.bias" in p0:
            assert p0[f"{layer}.bias"].abs().max() <= bound
    # the same numbers as nn.init.kaiming_uniform_ with a torch.Generator
    w = torch.empty(4, 3, 3, 3)
    from tinysn.graph import _generator
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=_generator(0, "c1.weight"))
    assert torch.equal(w, p0["c1.weight"])
    # large fan-in: the spread of the draws is that of U(-b, b)
    big = Net((1, 1, 1), classes=10, batch=1)
    big.softmax_loss(big.fc(big.fc(big.data(), 4000), 10))
    wt = big.init_params(3)["fc1.weight"]
    assert abs(wt.std().item() - 1 / math.sqrt(3)) < 0.01


def test_init_params_stable_when_net_grows():
    def build(extra):
        net, x = image_net()
        h = net.conv(x, 4, 3, name="first")
        if extra:
            h = net.conv(h, 4, 1, name="inserted")
        net.softmax_loss(net.fc(h, 10, name="head"))
        return net.init_params(7)
    p, q = build(False), build(True)
    assert torch.equal(p["first.weight"], q["first.weight"])
    assert torch.equal(p["head.weight"], q["head.weight"])
    assert torch.equal(p["head.bias"], q["head.bias"])


def test_summary():
    net = small_net()
    text = net.summary()
    for layer in net.layers:
        assert layer.name in text
    assert "2x6x4x4" in text and f"{net.param_count():,} parameters" in text
    assert "Layer(fc: fc(dropout1) -> (2, 5))" == repr(net["fc"])


# ------------------------------------------------------------------ torch reference
def reference_forward(p, x, training=True):
    """small_net by hand with torch.nn.functional."""
    h = F.conv2d(x, p["c1.weight"], None, 1, 1)
    h = F.relu(F.batch_norm(h, p["bn1.running_mean"].clone(), p["bn1.running_var"].clone(),
                            p["bn1.weight"], p["bn1.bias"], training, 0.1, 1e-5))
    a = F.conv2d(h, p["a.weight"], p["a.bias"])
    b = F.conv2d(h, p["b.weight"], p["b.bias"], 1, 1)
    h = torch.cat([a, b], 1) + F.conv2d(x, p["short.weight"], p["short.bias"])
    h = F.max_pool2d(h, 3, 2, 1)
    h = F.local_response_norm(h, 5, 1e-4, 0.75, 2.0)
    return F.linear(h.flatten(1), p["fc.weight"], p["fc.bias"])


def test_to_torch_matches_functional_reference_float64():
    net = small_net()
    params = net.init_params(3)
    model = net.to_torch(params).double().eval()    # eval: dropout off, bn uses running stats
    assert isinstance(model, TorchNet) and isinstance(model, torch.nn.Module)
    assert list(model.state_dict()) == list(params)
    for k, v in model.state_dict().items():
        assert torch.equal(v.float(), params[k])
    p64 = {k: v.double() for k, v in params.items()}
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = model(x)                                  # any batch size works
    assert out.dtype == torch.float64 and out.shape == (3, 5)
    torch.testing.assert_close(out, reference_forward(p64, x, training=False), rtol=1e-12, atol=1e-12)
    model.train()
    torch.manual_seed(0)
    logits = model(x)                               # dropout active: compare loss pieces only
    assert logits.shape == (3, 5)
    labels = torch.tensor([0, 4, 2])
    assert model.loss(x, labels).ndim == 0


def test_to_torch_training_bn_and_gradients():
    net, x = image_net(2, 5, 5, batch=4, classes=3)
    h = net.relu(net.bn(net.conv(x, 3, 3, padding=1, name="c")))
    net.softmax_loss(net.fc(net.pool(h, "avg", 2), 3, name="f"))
    params = net.init_params(0)
    model = net.to_torch(params).double()
    images = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 1])
    loss = model.loss(images, labels)
    loss.backward()
    p = {k: v.double().requires_grad_(k.endswith(("weight", "bias"))) for k, v in params.items()}
    rm, rv = p["bn1.running_mean"].clone(), p["bn1.running_var"].clone()
    h = F.conv2d(images, p["c.weight"], p["c.bias"], 1, 1)
    h = F.relu(F.batch_norm(h, rm, rv, p["bn1.weight"], p["bn1.bias"], True, 0.1, 1e-5))
    ref = F.cross_entropy(F.linear(F.avg_pool2d(h, 2).flatten(1), p["f.weight"], p["f.bias"]), labels)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    named = dict(model.named_parameters())
    assert set(named) == set(net.param_shapes())
    for k, v in named.items():
        torch.testing.assert_close(v.grad, p[k].grad)
    torch.testing.assert_close(model.state_dict()["bn1.running_mean"], rm)
    torch.testing.assert_close(model.state_dict()["bn1.running_var"], rv)   # unbiased update
    assert "bn1.num_batches_tracked" not in model.state_dict()


def test_to_torch_outputs_every_layer_shape():
    net = small_net()
    model = net.to_torch()
    outs = model.outputs(torch.randn(2, 3, 8, 8), torch.tensor([1, 3]))
    assert set(outs) == {layer.name for layer in net.layers}
    for layer in net.layers:
        if layer.op != "softmax_loss":
            assert tuple(outs[layer.name].shape) == layer.shape, layer.name
    assert outs["softmax_loss1"].ndim == 0


def test_to_torch_awkward_layer_names_and_default_seed():
    net = Net((1, 4, 4), classes=2, batch=1)
    x = net.data(name="training")
    h = net.conv(x, 2, 1, name="forward")
    h = net.relu(h, name="eval")
    net.softmax_loss(net.fc(h, 2, name="state_dict"), name="loss")
    model = net.to_torch()
    assert list(model.state_dict()) == ["forward.weight", "forward.bias",
                                        "state_dict.weight", "state_dict.bias"]
    model.eval()
    assert model.training is False
    model.train()
    assert model(torch.randn(3, 1, 4, 4)).shape == (3, 2)
    torch.testing.assert_close(model.state_dict()["forward.weight"], net.init_params(0)["forward.weight"])
    lossless = Net((1, 2, 2))
    lossless.relu(lossless.data())
    with pytest.raises(ValueError, match="no loss"):
        lossless.to_torch()


def test_layer_is_hashable_by_identity():
    net, x = image_net()
    a, b = net.relu(x), net.relu(x)
    assert len({a: 1, b: 2}) == 2 and isinstance(a, Layer)

