"""sched/fuse.py: a ReLU fused into the conv whose output only it reads."""
import pytest
import torch
from hypothesis import given, strategies as st

import tinysn as sn
import tinysn.testing as snt
from tinysn.ops import spec
from tinysn.sched import plan as plan_mod
from tinysn.sched import liveness
from tinysn.sched.fuse import fuse_relus, fuses_adds


def _net(batch=2):
    """Convs read by one ReLU (c1, c2, c4, c7), by a batch norm (c3), by an add (c5, c6)."""
    net = sn.Net(input_shape=(3, 8, 8), classes=5, batch=batch)
    x = net.data()
    h = net.relu(net.conv(x, 8, kernel=3, padding=1, name="c1"), name="r1")
    h = net.relu(net.conv(h, 8, kernel=3, padding=1, name="c2"), name="r2")
    h = net.pool(h, "max", kernel=2, name="p")
    a = net.relu(net.bn(net.conv(h, 8, kernel=1, name="c3"), name="bn"), name="r3")
    b = net.relu(net.conv(h, 8, kernel=3, padding=1, name="c4"), name="r4")
    h = net.add(net.conv(a, 8, kernel=1, name="c5"), net.conv(b, 8, kernel=1, name="c6"),
                name="add")
    h = net.relu(net.conv(h, 8, kernel=3, padding=1, name="c7"), name="r7")
    net.softmax_loss(net.fc(h, 5, name="fc"), name="loss")
    return net


def test_only_a_conv_read_by_one_relu_absorbs_it():
    net = _net()
    fused = fuse_relus(net)
    names = [layer.name for layer in fused]
    assert names == ["data1", "c1", "c2", "p", "c3", "bn", "r3", "c4", "c5", "c6", "add",
                     "c7", "fc", "loss"]
    assert {layer.name for layer in fused if layer.attrs.get("relu")} == {"c1", "c2", "c4",
                                                                           "c7"}
    # c1's, c2's and c4's ReLU outputs are read by one conv or pool alone, which masks dx
    assert {layer.name for layer in fused
            if layer.attrs.get("relu_masked")} == {"c1", "c2", "c4"}
    assert {layer.name for layer in fused
            if layer.attrs.get("x_is_relu_output")} == {"c2", "p", "c6"}
    assert [x.name for x in fused["p"].inputs] == ["c2"]          # rewired past the ReLU
    assert [x.name for x in fused["c6"].inputs] == ["c4"]
    assert fused.loss is fused["loss"] and fused["loss"].inputs[0] is fused["fc"]
    assert fused.param_shapes() == net.param_shapes()
    assert fused.buffer_shapes() == net.buffer_shapes()
    assert "relu" not in net["c1"].attrs and net["p"].inputs[0] is net["r2"]   # untouched


def test_a_conv_read_by_a_relu_and_another_layer_is_not_fused():
    net = sn.Net(input_shape=(3, 6, 6), classes=3, batch=2)
    c = net.conv(net.data(), 4, kernel=3, padding=1, name="c")
    net.softmax_loss(net.fc(net.add(net.relu(c), c), 3))
    assert fuse_relus(net) is net


def test_dead_layers_are_named_as_in_the_net():
    net = sn.Net(input_shape=(3, 6, 6), classes=3, batch=2)
    x = net.data()
    net.relu(net.conv(x, 4, kernel=3, name="c"), name="dead")
    net.softmax_loss(net.fc(x, 3))
    with pytest.raises(ValueError, match="dead"):
        fuse_relus(net)


def test_the_fused_plan_has_one_step_fewer_per_pass_of_each_pair():
    net = _net()
    kw = dict(fuse_updates=False)     # the ReLUs' fusion alone moves the peak here
    fused = sn.plan(net, "64MiB", "liveness", fuse_bn_relu=False, **kw)   # the convs' alone
    plain = sn.plan(net, "64MiB", "liveness", fuse_relu=False, **kw)
    assert len(plain.steps) - len(fused.steps) == 2 * 4         # a forward and a backward
    assert not {s.layer for s in fused.steps} & {"r1", "r2", "r4", "r7"}
    assert fused.peak_bytes <= plain.peak_bytes
    assert sn.plan(net, "64MiB", "baseline").peak_bytes < sn.plan(
        net, "64MiB", "baseline", fuse_relu=False).peak_bytes     # four tensors fewer


def _relu_fused(net) -> bool:
    return any(layer.attrs.get("relu") for layer in net)


def _assert_trains_alike(make_net, policy, flag, fused=_relu_fused):
    """Two steps with momentum, then a prediction (eval mode), with the Runtime option
    `flag` False and True: the same losses, parameters and prediction, bit for bit, and
    peak == plan in both (`fused(plan.net)` says whether the option fused anything)."""
    torch.manual_seed(0)
    images, labels = torch.randn(2, 3, 8, 8), torch.tensor([1, 3])
    runs = []
    for fuse in (False, True):
        rt = sn.Runtime(make_net(), memory="64MiB", policy=policy, device="cpu", momentum=0.9,
                        **{flag: fuse})
        assert fuse == fused(rt.plan.net)
        losses = [rt.step(images, labels) for _ in range(2)]
        assert rt.stats.peak_bytes == rt.plan.peak_bytes
        runs.append((losses, rt.params(), rt.predict(images)))
    (l0, p0, y0), (l1, p1, y1) = runs
    assert l0 == l1
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    assert torch.equal(y0, y1)


@pytest.mark.parametrize("policy", ["baseline", "recompute", "all"])
def test_fused_training_is_bitwise_the_unfused(policy):
    _assert_trains_alike(_net, policy, "fuse_relu")


@pytest.mark.parametrize("flag", ["fuse_relu", "fuse_bn_relu", "fuse_add_relu", "fuse_bn_add"])
def test_a_fusion_flag_must_be_a_bool(flag):
    net = _net()
    with pytest.raises(ValueError, match=f"{flag} must be a bool"):
        sn.plan(net, "64MiB", "liveness", **{flag: 1})
    with pytest.raises(ValueError, match=f"{flag} must be a bool"):
        sn.Runtime(net, memory="64MiB", device="cpu", **{flag: "yes"})


def _add_net(batch=2):
    """Residual adds whose ReLU is read by a conv and the next add (a1: the add's own
    backward masks dy as it fans it out), by one conv alone (a2: that conv masks dx), and
    one with no ReLU after it (a3); a dropout draws its masks for its index in this net,
    fused or not."""
    net = sn.Net(input_shape=(3, 8, 8), classes=5, batch=batch)
    x = net.conv(net.data(), 8, kernel=3, padding=1, name="c0")
    h = net.relu(net.add(x, net.conv(x, 8, kernel=3, padding=1, name="c1"), name="a1"),
                 name="r1")
    h = net.relu(net.add(h, net.conv(h, 8, kernel=1, name="c2"), name="a2"), name="r2")
    h = net.conv(h, 8, kernel=3, padding=1, name="c3")
    h = net.add(h, net.conv(h, 8, kernel=1, name="c4"), name="a3")
    net.softmax_loss(net.fc(net.dropout(h, p=0.5, name="drop"), 5, name="fc"), name="loss")
    return net


def test_an_add_absorbs_its_relu_and_masks_dy_as_it_fans_it_out():
    net = _add_net()
    fused = fuse_relus(net)
    assert [layer.name for layer in fused] == ["data1", "c0", "c1", "a1", "c2", "a2", "c3",
                                               "c4", "a3", "drop", "fc", "loss"]
    assert fused["drop"].index < net["drop"].index == fused["drop"].attrs["mask_layer"]
    assert {layer.name for layer in fused if layer.attrs.get("relu")} == {"a1", "a2"}
    assert {layer.name for layer in fused if layer.attrs.get("relu_masked")} == {"a2"}
    assert {layer.name for layer in fused if layer.attrs.get("x_is_relu_output")} == {"c3"}
    # a1's backward reads y beside dy (the step-time model charges it), a2's does not
    for name, masks_dy in (("a1", True), ("a2", False)):
        layer = fused[name]
        assert spec(layer).reads_output(layer) == masks_dy
        cost, plain_cost = (spec(n[name]).cost(n[name], "backward") for n in (fused, net))
        assert cost[1] == plain_cost[1] + masks_dy * 4 * net[name].numel
    plain = sn.plan(net, "64MiB", "liveness", fuse_relu=False)
    assert len(plain.steps) - len(sn.plan(net, "64MiB", "liveness").steps) == 2 * 2


@pytest.mark.parametrize("policy", ["baseline", "all"])
@pytest.mark.parametrize("flag", ["fuse_relu", "fuse_add_relu"])
def test_add_fused_training_is_bitwise_the_unfused(policy, flag):
    _assert_trains_alike(_add_net, policy, flag)


def test_past_its_cap_a_plan_keeps_the_adds_relus_apart():
    """Where the net with its adds' ReLUs fused would copy tensors out, those ReLUs are
    planned apart, cheap layers a plan may drop and recompute; as policies "offload" and
    "recompute" always copy checkpoints out, theirs are apart at any cap. Either way the
    training is bitwise the fused plan's (the dropout's masks too)."""
    net = _add_net()

    def fused_adds(plan):
        return {layer.name for layer in plan.net
                if layer.op == "add" and layer.attrs.get("relu")}
    roomy = sn.plan(net, "64MiB", "all")
    tight = sn.plan(net, int(snt.smallest_cap(net, "all") * 1.05), "all")
    assert fused_adds(roomy) == {"a1", "a2"} and not roomy.bytes_to_host
    assert not fused_adds(tight) and tight.bytes_to_host and "r1" in tight.net
    assert not fused_adds(sn.plan(net, "64MiB", "recompute"))
    assert fused_adds(sn.plan(net, "64MiB", "baseline")) == {"a1", "a2"}
    assert not fused_adds(sn.plan(net, "64MiB", "baseline", fuse_add_relu=False))
    snt.check_equivalent(net, ["baseline", "all"], steps=2)     # each at its smallest cap


def test_whether_the_adds_fit_unmoved_is_asked_once_for_both_eviction_orders(monkeypatch):
    """The no-drop run that decides the adds' ReLUs evicts nothing where it fits unmoved, so
    its answer holds for either eviction order: fits() asks it once where it tries both
    orders (the net does not fit), and plan() at most once."""
    net = _add_net()
    smallest = snt.smallest_cap(net, "all")
    asked, ask = [], plan_mod._fits_unmoved
    monkeypatch.setattr(plan_mod, "_fits_unmoved", lambda s: asked.append(s) or ask(s))
    assert not plan_mod.fits(net, smallest - 4096, "all")
    assert len(asked) == 1
    asked.clear()
    assert sn.plan(net, int(smallest * 1.05), "all").bytes_to_host
    assert len(asked) == 1


def test_where_only_the_argmax_bytes_tip_it_the_adds_stay_fused(monkeypatch):
    """The nets planned only where they fit unmoved are asked most fused first: with the
    max pool's argmaxes stored, then without them (the adds' ReLUs and the grouped updates
    stay), then apart. Here the first answer, then every answer, is forced to no."""
    from tinysn.testing import block_net
    net = block_net(p=0.0)
    ask = plan_mod._fits_unmoved

    def stores(plan):
        return any(layer.attrs.get("saves_argmax") for layer in plan.net.layers)

    def fused_adds(plan):
        return fuses_adds(plan.net)
    roomy = sn.plan(net, "64MiB", "all")
    assert stores(roomy) and fused_adds(roomy) and roomy.program.group_updates
    monkeypatch.setattr(plan_mod, "_fits_unmoved",
                        lambda search: not stores(search.first(None)) and ask(search))
    p = sn.plan(net, "64MiB", "all")
    assert not stores(p) and fused_adds(p) and p.program.group_updates
    monkeypatch.setattr(plan_mod, "_fits_unmoved", lambda search: False)
    p = sn.plan(net, "64MiB", "all")
    assert not stores(p) and not fused_adds(p) and not p.program.group_updates


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_fused_training_on_the_gpu_is_bitwise_the_unfused(cuda_graph, trains_alike_on_the_gpu):
    """Policy "all" on the GPU (its conv algorithms from the measured rankings, the same for
    both: channels-last ones on the 32x32 layers), eager and replayed: the same bits. The
    rankings are this test's own (a private cache): a test beside it in another process
    that times the same shapes would otherwise rewrite them between the two Runtimes."""
    trains_alike_on_the_gpu(_vgg_like(), cuda_graph, "fuse_relu")


def _vgg_like():
    """Conv pairs at 32x32 and 16x16 (channels-last algorithms apply: C % 4 == 0), each
    ReLU read by a conv or a max pool."""
    net = sn.Net(input_shape=(3, 32, 32), classes=10, batch=4)
    h = net.data()
    for i, (c, size) in enumerate([(16, 32), (32, 16)]):
        h = net.relu(net.conv(h, c, kernel=3, padding=1, name=f"c{i}a"))
        h = net.relu(net.conv(h, c, kernel=3, padding=1, name=f"c{i}b"))
        h = net.pool(h, "max", kernel=2, name=f"p{i}")
    net.softmax_loss(net.fc(h, 10, name="fc"))
    return net


def _bn_net(batch=2):
    """Batch norms whose ReLU is read by a conv (b1), by an add (b2: the batch norm's own
    backward masks dy), by a max pool (b3), and one with no ReLU after it (b4)."""
    net = sn.Net(input_shape=(3, 8, 8), classes=5, batch=batch)
    x = net.data()
    h = net.relu(net.bn(net.conv(x, 8, kernel=3, padding=1, name="c1"), name="b1"), name="r1")
    a = net.relu(net.bn(net.conv(h, 8, kernel=3, padding=1, name="c2"), name="b2"), name="r2")
    h = net.add(a, net.bn(net.conv(x, 8, kernel=3, padding=1, name="c3"), name="b4"),
                name="add")
    h = net.relu(net.bn(net.conv(h, 8, kernel=3, padding=1, name="c4"), name="b3"), name="r3")
    h = net.pool(h, "max", kernel=2, name="p")
    net.softmax_loss(net.fc(h, 5, name="fc"), name="loss")
    return net


def test_a_batch_norm_absorbs_its_relu_in_plans_unless_told_not_to():
    net = _bn_net()
    assert fuse_relus(net) is net                       # no conv is read by a ReLU
    fused = fuse_relus(net, batch_norms=True)
    assert [layer.name for layer in fused] == ["data1", "c1", "b1", "c2", "b2", "c3", "b4",
                                               "add", "c4", "b3", "p", "fc", "loss"]
    assert {layer.name for layer in fused if layer.attrs.get("relu")} == {"b1", "b2", "b3"}
    assert {layer.name for layer in fused if layer.attrs.get("relu_masked")} == {"b1", "b3"}
    assert {layer.name for layer in fused
            if layer.attrs.get("x_is_relu_output")} == {"c2", "p"}
    assert fused.param_shapes() == net.param_shapes()
    assert fused.buffer_shapes() == net.buffer_shapes()
    # the step-time model charges b2's backward its in-place ReLU pass (y, dy read, dy
    # written), and b1's nothing: its reader, a conv, masks dx
    for name, masks_dy in (("b2", True), ("b1", False)):
        cost, plain_cost = (spec(n[name]).cost(n[name], "backward") for n in (fused, net))
        assert cost[1] == plain_cost[1] + masks_dy * 3 * 4 * net[name].numel
    plain = sn.plan(net, "64MiB", "liveness", fuse_bn_relu=False)
    both = sn.plan(net, "64MiB", "liveness")            # the default fuses them
    assert len(plain.steps) - len(both.steps) == 2 * 3
    assert sn.plan(net, "64MiB", "baseline").peak_bytes < sn.plan(
        net, "64MiB", "baseline", fuse_bn_relu=False).peak_bytes    # three tensors fewer


@pytest.mark.parametrize("policy", ["baseline", "recompute", "all"])
def test_batch_norm_fused_training_is_bitwise_the_unfused(policy):
    """As above ("recompute" rebuilds fused batch norms' outputs in the backward pass)."""
    _assert_trains_alike(_bn_net, policy, "fuse_bn_relu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_batch_norm_fused_training_on_the_gpu_is_bitwise_the_unfused(cuda_graph,
                                                                     trains_alike_on_the_gpu):
    """A small ResNet under policy "all" on the GPU, eager and replayed: the same bits with
    the batch norms' ReLUs fused as without (private rankings, as the test above)."""
    net = sn.models.resnet(blocks=[1, 1, 1, 1], batch=4, classes=10, input_shape=(3, 32, 32))
    trains_alike_on_the_gpu(net, cuda_graph, "fuse_bn_relu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_add_fused_training_on_the_gpu_is_bitwise_the_unfused(cuda_graph, trains_alike_on_the_gpu):
    """A small ResNet under policy "all" on the GPU, eager and replayed: the same bits with
    every ReLU fused (the residual adds' too) as with every ReLU apart."""
    net = sn.models.resnet(blocks=[1, 1, 1, 1], batch=4, classes=10, input_shape=(3, 32, 32))
    trains_alike_on_the_gpu(net, cuda_graph, "fuse_relu")


def _residual_net(batch=2):
    """Batch norms read by a residual add alone: b2 (its residual x, whose gradient a3's
    pass wrote first, so b2's accumulates; a1's ReLU read by two convs: the fused layer
    masks dy itself), b3 (its residual b4, another batch norm; no ReLU after a2) and b6
    (its residual x again, first written; a3's ReLU read by one conv, which masks dx)."""
    net = sn.Net(input_shape=(3, 8, 8), classes=5, batch=batch)
    x = net.conv(net.data(), 8, kernel=3, padding=1, name="c0")
    h = net.relu(net.bn(net.conv(x, 8, kernel=3, padding=1, name="c1"), name="b1"), name="r1")
    s = net.relu(net.add(net.bn(net.conv(h, 8, kernel=1, name="c2"), name="b2"), x,
                         name="a1"), name="ra1")
    t = net.add(net.bn(net.conv(s, 8, kernel=1, name="c3"), name="b3"),
                net.bn(net.conv(s, 8, kernel=3, padding=1, name="c4"), name="b4"), name="a2")
    u = net.relu(net.add(net.bn(net.conv(t, 8, kernel=1, name="c6"), name="b6"), x,
                         name="a3"), name="ra3")
    u = net.relu(net.conv(u, 8, kernel=3, padding=1, name="c7"), name="r7")
    net.softmax_loss(net.fc(net.pool(u, "max", kernel=2, name="p"), 5, name="fc"),
                     name="loss")
    return net


def _residual_fused(net) -> bool:
    return any(layer.attrs.get("residual") for layer in net)


def test_a_batch_norm_read_by_an_add_alone_is_fused_into_it():
    net = _residual_net()
    fused = fuse_relus(net, batch_norms=True, residuals=True)
    assert [layer.name for layer in fused] == ["data1", "c0", "c1", "b1", "c2", "b2", "c3",
                                               "c4", "b4", "b3", "c6", "b6", "c7", "p", "fc",
                                               "loss"]
    residual = {layer.name: [x.name for x in layer.inputs]
                for layer in fused if layer.attrs.get("residual")}
    assert residual == {"b2": ["c2", "c0"], "b3": ["c3", "b4"], "b6": ["c6", "c0"]}
    assert {layer.name for layer in fused if layer.attrs.get("relu")} == {"b1", "b2", "b6",
                                                                          "c7"}
    assert {layer.name for layer in fused
            if layer.attrs.get("relu_masked")} == {"b1", "b6", "c7"}
    assert fused["b2"].shape == net["a1"].shape and fused["b2"].params == net["b2"].params
    assert fused.param_shapes().keys() == net.param_shapes().keys()
    assert fused.buffer_shapes() == net.buffer_shapes()
    assert fuse_relus(net, batch_norms=True, adds=False, residuals=True)["a1"].op == "add"
    # the backward pass reads the batch norm's input, never the residual: b4's output dies
    # at the forward pass that adds it
    program = liveness.Program(fused)
    b4 = program.act[fused["b4"]]
    assert program.passes[program.last_use(b4)].phase == "forward"
    assert spec(fused["b3"]).inputs_read(fused["b3"]) == [fused["c3"]]
    plain = sn.plan(net, "64MiB", "baseline", fuse_bn_add=False)
    both = sn.plan(net, "64MiB", "baseline")
    assert not _residual_fused(plain.net) and _residual_fused(both.net)
    assert len(plain.steps) - len(both.steps) == 3 * 2
    assert both.peak_bytes < plain.peak_bytes


@pytest.mark.parametrize("policy", ["baseline", "all"])
def test_batch_norm_add_fused_training_is_bitwise_the_unfused(policy):
    """Every way the fused backward pass writes the residual's gradient (accumulating,
    masked, copied), the same bits as the batch norm and the add apart."""
    _assert_trains_alike(_residual_net, policy, "fuse_bn_add", fused=_residual_fused)


def test_past_its_cap_a_plan_keeps_the_batch_norms_apart_from_the_adds():
    net = _residual_net()
    tight = sn.plan(net, int(snt.smallest_cap(net, "all") * 1.05), "all")
    assert tight.bytes_to_host and not _residual_fused(tight.net)
    assert not _residual_fused(sn.plan(net, "64MiB", "recompute").net)
    assert _residual_fused(sn.plan(net, "64MiB", "all").net)



@st.composite
def residual_nets(draw):
    """Random residual nets: a stem conv, then 1-3 blocks (a main branch conv-bn, or
    conv-bn-relu-conv-bn, added to the block's input or to a conv-bn shortcut, in either
    order, the add's ReLU after it or not), sometimes a last add of the final output and
    the first block's (so that block's fused add gives its residual a gradient that
    accumulates), then the head."""
    c, size = draw(st.integers(1, 4)), draw(st.integers(3, 5))
    net = sn.Net(input_shape=(c, size, size), classes=3, batch=draw(st.integers(1, 3)))
    h = net.conv(net.data(), c, kernel=3, padding=1)
    outputs = [h]
    for _ in range(draw(st.integers(1, 3))):
        kernel = draw(st.sampled_from([1, 3]))
        y = net.bn(net.conv(h, c, kernel=kernel, padding=kernel // 2))
        if draw(st.booleans()):
            y = net.bn(net.conv(net.relu(y), c, kernel=1))
        shortcut = h if draw(st.booleans()) else net.bn(net.conv(h, c, kernel=1))
        h = net.add(*((y, shortcut) if draw(st.booleans()) else (shortcut, y)))
        h = net.relu(h) if draw(st.booleans()) else h
        outputs.append(h)
    if len(outputs) > 2 and draw(st.booleans()):
        h = net.add(h, outputs[1])
    net.softmax_loss(net.fc(h, 3))
    return net


@snt.settings(6)
@given(net=residual_nets(), policy=st.sampled_from(["baseline", "all"]))
def test_random_residual_nets_train_bitwise_alike_with_their_batch_norms_fused(net, policy):
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(net.batch, *net.input_shape, generator=gen)
    labels = torch.randint(0, net.classes, (net.batch,), generator=gen)
    runs = []
    for fuse in (False, True):
        rt = sn.Runtime(net, memory="64MiB", policy=policy, device="cpu", momentum=0.9,
                        fuse_bn_add=fuse)
        assert fuse == _residual_fused(rt.plan.net)
        runs.append(([rt.step(images, labels) for _ in range(2)], rt.params(),
                     rt.predict(images)))
    (l0, p0, y0), (l1, p1, y1) = runs
    assert l0 == l1 and torch.equal(y0, y1)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_batch_norm_add_fused_training_on_the_gpu_is_bitwise_the_unfused(cuda_graph,
                                                                         trains_alike_on_the_gpu):
    """A small ResNet under policy "all" on the GPU, eager and replayed: the same bits with
    each block's last batch norm fused into its add as with the two apart."""
    net = sn.models.resnet(blocks=[1, 1, 1, 1], batch=4, classes=10, input_shape=(3, 32, 32))
    trains_alike_on_the_gpu(net, cuda_graph, "fuse_bn_add")
