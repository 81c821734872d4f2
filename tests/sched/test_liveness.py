"""sched/liveness.py: small SGD updates sharing a launch with the next layer's
(`_update_groups`, `Program(group_updates=True)`, plan's `group_updates`)."""

import pytest
import torch

import tinysn as sn
from tinysn.kernels import sgd
from tinysn.sched import liveness, route
from tinysn.sched.fuse import fuse_relus
from tinysn.testing import block_net, check_plan


def _layers(*counts):
    """Stand-in layers as `_update_groups` sees them: `v2` a layer of two vectors (a batch
    norm's), `w1` one with a weight, each updating that many tensors."""
    return [(int(c[1:]), c[0] == "v") for c in counts]


def test_a_vector_layer_waits_for_the_next_other_layer_with_room_oldest_first():
    assert sgd.PER_LAUNCH == 4
    layers = _layers("v2", "v2", "w1", "w1", "v2", "v2", "v2")
    # the first weight takes the oldest batch norm (no room for the second), the next
    # weight the second; the three left at the end share launches among themselves
    assert liveness._update_groups(layers) == [[0, 2], [1, 3], [4, 5], [6]]
    assert liveness._update_groups(_layers("w2", "w2")) == [[0], [1]]   # weights never wait
    assert liveness._update_groups(_layers("w4", "v2")) == [[0], [1]]   # no room: at the end
    assert liveness._update_groups(_layers("v4", "w1")) == [[0], [1]]   # a full launch alone
    assert liveness._update_groups([]) == []


def _backward_layers(net):
    return [layer for layer in reversed(route.forward_order(net)) if layer.params]


@pytest.mark.parametrize("fused", [False, True])
def test_resnet50_updates_each_batch_norm_with_a_conv(fused):
    """107 launches -> 54: the fc layer alone, every conv with one batch norm; as planned
    (its residual adds' batch norms fused in, where a block's last batch norm and its
    shortcut's meet first in backward order) and as built."""
    net = sn.models.resnet50(batch=1)
    net = fuse_relus(net) if fused else net
    layers = _backward_layers(net)
    groups = liveness._update_groups([liveness._launch_items(layer, frozenset())
                                      for layer in layers])
    assert sorted(i for g in groups for i in g) == list(range(len(layers))) and len(layers) == 107
    assert len(groups) == 54 and [layers[i].op for i in groups[0]] == ["fc"]
    for group in groups[1:]:
        assert sorted(layers[i].op for i in group) == ["bn", "conv"]
        assert layers[group[-1]].op == "conv" and group[-1] == max(group)
    assert liveness.groups_updates(net)
    assert not liveness.groups_updates(sn.models.vgg16(batch=1))   # no layer of vectors alone


def test_a_grouped_program_updates_a_batch_norm_at_the_next_convs_pass():
    """Its gradients live until that pass, which reads them with its parameters and
    momentum; ungrouped, each layer is updated at its own pass and its gradients die there."""
    net = block_net(p=0.0)
    plain = liveness.Program(net, momentum=0.9)
    grouped = liveness.Program(net, momentum=0.9, group_updates=True)
    for prog in (plain, grouped):
        backward = {lp.layer: lp for lp in prog.passes if lp.phase == "backward"}
        for at, buckets in prog.updates.items():
            assert len(buckets) == 1
            for layer in buckets[0]:
                assert backward[layer].index <= at
                for table in (prog.pgrad, prog.param, prog.momentum):
                    tid = table[f"{layer.name}.weight"]
                    assert tid in prog.passes[at].reads + prog.passes[at].writes
                assert prog.last_use(prog.pgrad[f"{layer.name}.weight"]) == at
    assert all(len(b[0]) == 1 for b in plain.updates.values())
    sizes = sorted(len(b[0]) for b in grouped.updates.values())
    assert len(grouped.updates) < len(plain.updates) and sizes[-1] == 2
    bns = [lp for lp in grouped.passes if lp.phase == "backward" and lp.layer.op == "bn"]
    assert bns and all(lp.index not in grouped.updates for lp in bns)


def test_plans_group_updates_only_where_the_net_fits_unmoved():
    """As for the adds' ReLUs: grouped at a roomy cap (every policy, "baseline" included),
    each layer at its own pass where the plan must move or drop something, and nowhere
    with group_updates=False."""
    net = block_net(p=0.0)
    roomy = sn.plan(net, "64MiB", "all")
    assert roomy.program.group_updates and not roomy.bytes_to_host
    assert sn.plan(net, "64MiB", "baseline").program.group_updates
    assert not sn.plan(net, "64MiB", "all", group_updates=False).program.group_updates
    tight = _below(net, roomy.peak_bytes)
    check_plan(tight)
    assert tight.bytes_to_host or tight.recomputed_steps
    assert not tight.program.group_updates
    assert all(len(b[0]) == 1 for b in tight.program.updates.values())
    # the max pool's argmaxes (fuse.store_argmaxes): the same condition
    pools = [(plan, plan.net.layers[-4]) for plan in (roomy, tight)]
    assert all(layer.op == "pool" for _, layer in pools)
    assert [layer.attrs.get("saves_argmax", False) for _, layer in pools] == [True, False]
    assert [layer in plan.program.saved for plan, layer in pools] == [True, False]


def _below(net, peak):
    """The plan under "all" at the largest cap below `peak` (1 KB steps) that fits."""
    for cap in range(peak - 1024, 0, -1024):
        try:
            return sn.plan(net, cap, "all")
        except sn.OutOfMemory:
            continue
    raise AssertionError("nothing fits below the roomy plan's peak")


def _runs_with(option, steps):
    """block_net trained `steps` steps with momentum and weight decay, with `option` off
    and on: per run, its losses and its Runtime (peak == plan checked), and the batch."""
    torch.manual_seed(0)
    images, labels = torch.randn(2, 3, 8, 8), torch.tensor([1, 3])
    runs = []
    for value in (False, True):
        rt = sn.Runtime(block_net(p=0.0), memory="64MiB", policy="all", device="cpu",
                        momentum=0.9, weight_decay=1e-3, **{option: value})
        losses = [rt.step(images, labels) for _ in range(steps)]
        assert rt.stats.peak_bytes == rt.plan.peak_bytes
        runs.append((losses, rt))
    return runs, images


def _same_params(a, b) -> bool:
    pa, pb = a.params(), b.params()
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_grouped_updates_train_bitwise_as_ungrouped():
    """Two steps with momentum and weight decay, then a prediction: the same losses,
    parameters and output, bit for bit, and peak == plan either way."""
    ((l0, r0), (l1, r1)), images = _runs_with("group_updates", 2)
    assert (r0.plan.program.group_updates, r1.plan.program.group_updates) == (False, True)
    assert l0 == l1 and torch.equal(r0.predict(images), r1.predict(images))
    assert _same_params(r0, r1)


def test_group_updates_must_be_a_bool():
    net = block_net(p=0.0)
    with pytest.raises(ValueError, match="group_updates must be a bool"):
        sn.plan(net, "64MiB", "all", group_updates=1)
    with pytest.raises(ValueError, match="group_updates must be a bool"):
        sn.Runtime(net, memory="64MiB", device="cpu", group_updates="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_grouped_updates_on_the_gpu_train_bitwise_as_ungrouped(cuda_graph,
                                                               trains_alike_on_the_gpu):
    """A small ResNet under policy "all" on the GPU, eager and replayed: the same bits with
    each batch norm's update in the next layer's launch as with every layer's apart."""
    net = sn.models.resnet(blocks=[1, 1, 1, 1], batch=4, classes=10, input_shape=(3, 32, 32))
    assert sn.plan(net, "1GiB", "all").program.group_updates
    trains_alike_on_the_gpu(net, cuda_graph, "group_updates")


def test_fc_weights_step_in_their_gradient_kernel_and_store_no_gradient():
    """With fuse_updates every fc weight has no stored gradient and no SGD launch (its
    backward pass steps it), its bias keeps both; data parallel (an all-reduce needs the
    gradient) and fuse_updates=False store it as before. VGG16 at batch 32: three gradients
    fewer, a lower peak (2.74 -> 2.39 GB: fc6's 411 MB gradient sat at it) and a shorter
    predicted step."""
    net = block_net(p=0.0)
    for kwargs, fused in (({"fuse_updates": True}, True), ({}, False),
                          ({"fuse_updates": True, "data_parallel": True}, False)):
        prog = liveness.Program(net, momentum=0.9, group_updates=True, **kwargs)
        fc = next(layer for layer in prog.order if layer.op == "fc")
        assert ("fc" in str(sorted(prog.fused_updates))) == fused
        assert (f"{fc.name}.weight" in prog.pgrad) != fused
        assert f"{fc.name}.bias" in prog.pgrad
        assert prog.sgd_params(fc) == (["bias"] if fused else ["weight", "bias"])
        updated = [f"{layer.name}.{s}" for buckets in prog.updates.values()
                   for bucket in buckets for layer in bucket for s in prog.sgd_params(layer)]
        assert sorted(updated) == sorted(prog.pgrad)
    plans = {f: sn.plan(sn.models.vgg16(batch=32), "40GiB", "all", momentum=0.9,
                        fuse_updates=f) for f in (False, True)}
    assert len(plans[False].program.pgrad) - len(plans[True].program.pgrad) == 3
    assert plans[True].peak_bytes < plans[False].peak_bytes - 300_000_000
    assert plans[True].predicted_step_s < plans[False].predicted_step_s


def test_fused_fc_updates_train_bitwise_as_the_sgd_kernel():
    """Three steps with momentum and weight decay: the same losses, parameters and
    momentum buffers, bit for bit (one GEMM config under the interpreter), and peak == plan
    either way."""
    ((l0, r0), (l1, r1)), _ = _runs_with("fuse_updates", 3)
    assert (bool(r0.plan.program.fused_updates), bool(r1.plan.program.fused_updates)) == \
        (False, True)
    assert l0 == l1 and _same_params(r0, r1)
    s0, s1 = r0.state_dict(), r1.state_dict()
    assert all(torch.equal(v, s1[k]) for k, v in s0.items() if isinstance(v, torch.Tensor))
