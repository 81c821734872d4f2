"""tinysn.models: every builder builds (tiny and ImageNet size); parameter counts."""
import time

import pytest
import torch

from tinysn import models

# builder, smallest input it accepts (square), default input
BUILDERS = [
    (models.lenet, (1, 4, 4), (1, 8, 8)),
    (models.alexnet, (3, 67, 67), (3, 227, 227)),
    (models.vgg16, (3, 32, 32), (3, 224, 224)),
    (models.resnet18, (3, 1, 1), (3, 224, 224)),
    (models.resnet50, (3, 1, 1), (3, 224, 224)),
    (models.resnet101, (3, 1, 1), (3, 224, 224)),
    (models.resnet152, (3, 1, 1), (3, 224, 224)),
    (models.inception_v4, (3, 75, 75), (3, 299, 299)),
    (models.densenet121, (3, 29, 29), (3, 224, 224)),
]


@pytest.mark.parametrize("builder,smallest,default", BUILDERS, ids=lambda v: getattr(v, "__name__", ""))
def test_builds_at_smallest_and_default_input(builder, smallest, default):
    net = builder(batch=2, classes=7, input_shape=smallest)
    net.check()
    assert net.layers[0].shape == (2, *smallest)
    assert net.loss.inputs[0].shape == (2, 7)
    c, h, w = smallest
    if h > 1:
        with pytest.raises(ValueError):
            builder(batch=2, classes=7, input_shape=(c, h - 1, w))
    full = builder(batch=1)
    full.check()
    assert full.input_shape == default


def test_builders_defaults():
    assert models.lenet().batch == 32 and models.lenet().classes == 10
    assert models.resnet50().classes == 1000


# Known counts (classes=1000, ImageNet input): torchvision for resnet/vgg/densenet.
# alexnet: Caffe's bvlc_alexnet widths (96, 256, 384, 384, 256; fc 4096, 4096) without its
# conv groups; torchvision's alexnet (61,100,840) uses other widths (64, 192, 384, 256, 256).
# inception_v4: 42,679,816 as published for timm's inception_v4 (1536 -> 1000 fc); Cadene's
# pretrainedmodels port has 1001 classes (42,681,353).
COUNTS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "vgg16": 138_357_544,
    "densenet121": 7_978_856,
    "alexnet": 62_378_344,
    "inception_v4": 42_679_816,
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_param_counts(name):
    net = getattr(models, name)(batch=1, classes=1000)
    assert net.param_count() == COUNTS[name]


def test_layer_composition():
    def ops(net, op):
        return sum(layer.op == op for layer in net.layers)
    r50 = models.resnet50(batch=1)
    assert (ops(r50, "conv"), ops(r50, "bn"), ops(r50, "add"), ops(r50, "fc")) == (53, 53, 16, 1)
    assert all(not layer.attrs["bias"] for layer in r50.layers if layer.op == "conv")
    # v1.5: the stride sits on the 3x3 conv
    assert r50["layer2_0_conv1"].attrs["stride"] == (1, 1)
    assert r50["layer2_0_conv2"].attrs["stride"] == (2, 2)
    assert r50["layer4_2_relu"].shape == (1, 2048, 7, 7)
    d121 = models.densenet121(batch=1)
    assert ops(d121, "conv") + ops(d121, "fc") == 121
    assert d121["norm5"].shape == (1, 1024, 7, 7)
    inc = models.inception_v4(batch=1)
    assert ops(inc, "conv") == 149 and ops(inc, "conv") == ops(inc, "bn")
    assert {layer.attrs["kernel"] for layer in inc.layers if layer.op == "conv"} >= {(1, 7), (7, 1), (1, 3), (3, 1)}
    for name, shape in [("mixed5a", (1, 384, 35, 35)), ("a4_concat", (1, 384, 35, 35)),
                        ("ra_concat", (1, 1024, 17, 17)), ("b7_concat", (1, 1024, 17, 17)),
                        ("rb_concat", (1, 1536, 8, 8)), ("c3_concat", (1, 1536, 8, 8))]:
        assert inc[name].shape == shape
    alex = models.alexnet(batch=1)
    assert ops(alex, "lrn") == 2 and ops(alex, "dropout") == 2
    assert alex["pool5"].shape == (1, 256, 6, 6)
    vgg = models.vgg16(batch=1)
    assert ops(vgg, "conv") == 13 and vgg["pool5"].shape == (1, 512, 7, 7)
    basic = models.resnet18(batch=1)
    assert ops(basic, "conv") == 20 and ops(basic, "add") == 8


def test_resnet_arguments():
    with pytest.raises(ValueError):
        models.resnet([])
    with pytest.raises(ValueError):
        models.resnet([3, 0, 2])
    two = models.resnet([1, 1], bottleneck=False, batch=1, classes=4, input_shape=(3, 16, 16))
    assert two.loss.inputs[0].inputs[0].shape == (1, 128, 1, 1)


def test_deep_resnet_builds_quickly():
    t = time.perf_counter()
    net = models.resnet([6, 32, 1000, 6], batch=1, classes=10, input_shape=(3, 32, 32))
    net.check()
    assert len(net.layers) > 10_000
    assert time.perf_counter() - t < 10.0


@pytest.mark.parametrize("builder,shape", [
    (models.lenet, (1, 8, 8)), (models.alexnet, (3, 67, 67)), (models.vgg16, (3, 32, 32)),
    (models.resnet18, (3, 16, 16)), (models.resnet50, (3, 32, 32)),
    (models.inception_v4, (3, 75, 75)), (models.densenet121, (3, 32, 32)),
], ids=lambda v: getattr(v, "__name__", ""))
def test_torch_reference_runs_at_tiny_size(builder, shape):
    net = builder(batch=2, classes=5, input_shape=shape)
    model = net.to_torch()
    assert set(model.state_dict()) == set(net.param_shapes()) | set(net.buffer_shapes())
    with torch.no_grad():
        outs = model.outputs(torch.randn(2, *shape), torch.tensor([0, 4]))
    for layer in net.layers:
        if layer.op != "softmax_loss":
            assert tuple(outs[layer.name].shape) == layer.shape, layer.name
    assert torch.isfinite(outs[net.loss.name])
