"""tinysn.sched.route: the execution route of paper Alg. 1."""
import time

import pytest
from hypothesis import given, settings, strategies as st

from tinysn import models
from tinysn.graph import Net
from tinysn.sched.route import forward_order


def alg1_recursive(net):
    """Alg. 1 written as in the paper (recursive), the reference for small nets."""
    counter, route = {}, []

    def construct(layer):
        counter[layer] = counter.get(layer, 0) + 1
        if counter[layer] < max(1, len(layer.inputs)):
            return
        route.append(layer)
        for nxt in layer.consumers:
            construct(nxt)

    construct(net.layers[0])
    return route


def assert_valid_route(net, order):
    assert len(order) == len(net.layers)
    assert {id(layer) for layer in order} == {id(layer) for layer in net.layers}
    assert order[0] is net.layers[0] and order[0].op == "data"
    pos = {id(layer): i for i, layer in enumerate(order)}
    for layer in net.layers:
        for x in layer.inputs:
            assert pos[id(x)] < pos[id(layer)], (x.name, layer.name)


def fig6_net():
    """Paper Fig. 6: layers a..j with two nested fans, (b: c, d) inside (a: b, f), and
    (f: g, h); e joins c and d, i joins e, g and h; j is the classifier."""
    net = Net((2, 4, 4), classes=3, batch=1)
    a = net.data(name="a")
    b = net.conv(a, 2, 1, name="b")
    c = net.conv(b, 2, 3, padding=1, name="c")
    d = net.conv(b, 2, 1, name="d")
    e = net.add(c, d, name="e")
    f = net.conv(a, 2, 1, name="f")
    g = net.conv(f, 2, 1, name="g")
    h = net.relu(f, name="h")
    i = net.concat([e, g, h], name="i")
    net.softmax_loss(net.fc(i, 3, name="j"), name="loss")
    return net


def names(order):
    return [layer.name for layer in order]


def test_fig6_nested_fans():
    net = fig6_net()
    order = forward_order(net)
    assert names(order) == ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "loss"]
    pos = {layer.name: k for k, layer in enumerate(order)}
    assert all(pos[p] < pos["i"] for p in ("e", "g", "h"))
    assert order == alg1_recursive(net)


def test_fig6_depth_first_not_creation_order():
    """Built in a different order than it runs: DFS follows a branch to its end first."""
    net = Net((2, 4, 4), classes=3, batch=1)
    a = net.data(name="a")
    b = net.conv(a, 2, 1, name="b")
    f = net.conv(a, 2, 1, name="f")
    c = net.conv(b, 2, 1, name="c")
    g = net.conv(f, 2, 1, name="g")
    d = net.conv(b, 2, 1, name="d")
    h = net.relu(f, name="h")
    e = net.add(c, d, name="e")
    i = net.concat([e, g, h], name="i")
    net.softmax_loss(net.fc(i, 3, name="j"), name="loss")
    assert names(forward_order(net)) == ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "loss"]


def test_join_waits_for_its_last_input():
    net = Net((2, 4, 4), classes=3, batch=1)
    x = net.data(name="x")
    short = net.conv(x, 2, 1, name="short")              # created first, explored first
    long = net.relu(net.conv(net.relu(net.conv(x, 2, 1, name="l1"), name="r1"), 2, 1, name="l2"),
                    name="r2")
    s = net.add(short, long, name="sum")
    net.softmax_loss(net.fc(s, 3, name="fc"), name="loss")
    assert names(forward_order(net)) == ["x", "short", "l1", "r1", "l2", "r2", "sum", "fc", "loss"]


def test_residual_joins():
    net = models.resnet50(batch=1, classes=10, input_shape=(3, 32, 32))
    order = forward_order(net)
    assert_valid_route(net, order)
    assert order == alg1_recursive(net)
    pos = {layer.name: k for k, layer in enumerate(order)}
    # a projection block: the main branch runs to its end, then the shortcut, then the add
    assert pos["layer2_0_bn3"] < pos["layer2_0_downsample_0"] < pos["layer2_0_add"]
    assert pos["layer2_0_add"] == pos["layer2_0_downsample_1"] + 1
    # an identity block: the add comes right after the main branch's last bn
    assert pos["layer2_1_add"] == pos["layer2_1_bn3"] + 1
    for layer in net.layers:
        if layer.op == "add":
            assert max(pos[x.name] for x in layer.inputs) < pos[layer.name]


def test_densenet_full_joins():
    net = models.densenet121(batch=1, classes=10, input_shape=(3, 32, 32))
    order = forward_order(net)
    assert_valid_route(net, order)
    assert order == alg1_recursive(net)
    concat = net["denseblock2_denselayer12_concat"]
    assert len(concat.inputs) == 12                      # the block input + 11 new maps
    pos = {id(layer): k for k, layer in enumerate(order)}
    # the full join runs right after its last producer (the previous layer's conv2)
    assert pos[id(concat)] == pos[id(net["denseblock2_denselayer11_conv2"])] + 1
    # and the block input fans out to every later join of its block
    block_in = net["transition1_pool"]
    assert len(block_in.consumers) == 12 + 1              # norm1 of layer 1, 11 joins, block concat


def test_inception_fans():
    net = models.inception_v4(batch=1, classes=10, input_shape=(3, 75, 75))
    order = forward_order(net)
    assert_valid_route(net, order)
    assert order == alg1_recursive(net)


@st.composite
def random_dag(draw):
    """A net of random fans and joins: relu / 1x1 conv / add over equal shapes / concat."""
    net = Net((draw(st.integers(1, 3)), 3, 3), classes=2, batch=1)
    layers = [net.data()]
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["relu", "conv", "add", "concat"]))
        x = layers[draw(st.integers(0, len(layers) - 1))]
        if kind == "relu":
            layers.append(net.relu(x))
        elif kind == "conv":
            layers.append(net.conv(x, draw(st.integers(1, 3)), 1))
        else:
            pool = [y for y in layers if y is not x and (kind == "concat" or y.shape == x.shape)]
            if not pool:
                continue
            others = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique_by=id))
            xs = [x] + others
            xs = draw(st.permutations(xs))
            layers.append(net.add(xs) if kind == "add" else net.concat(xs))
    ends = [y for y in layers if not y.consumers]
    last = ends[0] if len(ends) == 1 else net.concat(ends)
    net.softmax_loss(net.fc(last, 2))
    net.check()
    return net


@settings(max_examples=150, deadline=None)
@given(random_dag())
def test_random_dags(net):
    order = forward_order(net)
    assert_valid_route(net, order)
    assert order == alg1_recursive(net)


def test_long_chain_no_recursion_limit():
    net = Net((2, 2, 2), classes=2, batch=1)
    x = net.data()
    for _ in range(5000):
        x = net.relu(x)
    net.softmax_loss(net.fc(x, 2))
    t = time.perf_counter()
    order = forward_order(net)
    assert order == net.layers
    assert time.perf_counter() - t < 2.0


def test_deep_resnet_route():
    net = models.resnet([6, 32, 600, 6], batch=1, classes=10, input_shape=(3, 32, 32))
    assert len(net.layers) > 6000
    t = time.perf_counter()
    order = forward_order(net)
    assert time.perf_counter() - t < 2.0
    assert_valid_route(net, order)


def test_a_route_starts_at_the_data_layer():
    net = Net(input_shape=(3, 4, 4), classes=2, batch=1)
    net.softmax_loss(net.fc(net.data(), 2))
    net.layers.append(net.layers.pop(0))          # a hand-edited graph: data no longer first
    with pytest.raises(ValueError, match="first layer must be its data layer"):
        forward_order(net)
