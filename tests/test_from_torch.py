"""sn.from_torch: torch modules imported through torch.fx train one step as torch does."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tinysn as sn


class Branchy(nn.Module):
    """Fan-out, a channel concat, residual adds (operator and torch.add), every mapped
    layer type, functional and in-place forms, and a .view flatten before the classifier."""

    def __init__(self, classes=5, p=0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6),
                                  nn.ReLU(inplace=True))
        self.left = nn.Conv2d(6, 4, 1)
        self.right = nn.Conv2d(6, 3, 3, padding=1, bias=False)
        self.proj = nn.Conv2d(3, 7, 1)
        self.bn = nn.BatchNorm2d(7)
        self.lrn = nn.LocalResponseNorm(3)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.avg = nn.AvgPool2d(2, stride=1)
        self.gap = nn.AdaptiveAvgPool2d(2)
        self.drop = nn.Dropout(p)
        self.fc1 = nn.Linear(28, 8)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, classes))

    def forward(self, x):
        h = self.stem(x)
        h = torch.cat([self.left(h), self.right(h)], dim=1)      # fan-out and concat
        h = h + self.proj(x)                                     # residual add
        h = F.relu(self.bn(h), inplace=True)
        h = torch.add(self.lrn(self.pool(h)), F.max_pool2d(h, 3, stride=2, padding=1))
        h = self.gap(F.avg_pool2d(self.avg(h), 1))
        h = self.drop(h.view(h.size(0), -1))
        return self.head(torch.relu(self.fc1(h)))


def _batch(net, batch, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((batch, *net.input_shape), generator=gen),
            torch.randint(0, net.classes, (batch,), generator=gen))


def _torch_step(module, images, labels, dtype, device="cpu", lr=0.05, momentum=0.9,
                channels_last=False):
    """One SGD step of a copy of `module` in `dtype` on `device` (TF32 off; NHWC activations
    with `channels_last`): its loss and its state afterwards, as float64 CPU tensors."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    try:
        ref = copy.deepcopy(module).to(device=device, dtype=dtype, memory_format=fmt).train()
        opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
        x = images.to(device, dtype).contiguous(memory_format=fmt)
        loss = F.cross_entropy(ref(x), labels.to(device))
        loss.backward()
        opt.step()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    return loss.item(), {k: v.double().cpu() for k, v in ref.state_dict().items()
                         if not k.endswith("num_batches_tracked")}


def _step_both(module, net, batch, device, memory, lr=0.05, momentum=0.9):
    """One SGD step of tinysn and of the module in float64; returns both losses and states."""
    rt = sn.Runtime(net, memory, "all", device=device, lr=lr, momentum=momentum,
                    precision="ieee", conv_algos={})
    rt.load_params(module.state_dict())
    images, labels = _batch(net, batch)
    loss = rt.step(images.to(device), labels.to(device))
    ref_loss, theirs = _torch_step(module, images, labels, torch.float64)
    return loss, ref_loss, rt.params(), theirs


def _assert_step_equal(module, net, batch, device="cpu", memory="256MiB", rtol=2e-4,
                       atol=2e-5):
    loss, ref_loss, ours, theirs = _step_both(module, net, batch, device, memory)
    assert loss == pytest.approx(ref_loss, rel=rtol, abs=atol)
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value.double(), theirs[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


def _assert_as_close_as_torch_float32(module, net, batch, device, memory, slack=4.0,
                                      floor=1e-4):
    """Deep nets with batch norm over few values amplify float32 rounding (a batch-2
    ResNet-50 at 64x64 moves some of PyTorch's own float32 gradients by 10-30% from float64),
    and by how much depends on the summation order, so a fixed tolerance says nothing there.
    The oracle: each parameter's change in one step (and the loss) is as close to the float64
    truth as float32 PyTorch gets, within `slack` times the largest error of three float32
    PyTorch runs whose summation orders differ (on `device` NCHW and channels-last, on the
    CPU), relative to the change's largest element, + `floor`."""
    loss, ref_loss, ours, theirs = _step_both(module, net, batch, device, memory)
    images, labels = _batch(net, batch)
    runs = [_torch_step(module, images, labels, torch.float32, device),
            _torch_step(module, images, labels, torch.float32, device, channels_last=True),
            _torch_step(module, images, labels, torch.float32, "cpu")]
    loss_err32 = max(abs(run_loss - ref_loss) for run_loss, _ in runs)
    assert abs(loss - ref_loss) <= slack * loss_err32 + floor * abs(ref_loss)
    before = {k: v.double() for k, v in module.state_dict().items() if k in theirs}
    for name, truth in theirs.items():
        change = truth - before[name]
        scale = change.abs().max().item() or 1.0

        def error(state):
            return ((state[name].double() - before[name]) - change).abs().max().item() / scale
        err, err32 = error(ours), max(error(state) for _, state in runs)
        assert err <= slack * err32 + floor, f"{name}: error {err:.2e}, torch float32 {err32:.2e}"


def test_branchy_module_imports_with_torch_names_and_steps_like_torch():
    torch.manual_seed(0)
    module = Branchy()
    net = sn.from_torch(module, input_shape=(3, 10, 10), batch=3)
    ops = [layer.op for layer in net]
    assert ops.count("concat") == 1 and ops.count("add") == 2 and ops.count("fc") == 2
    assert "dropout" not in ops                           # p = 0 makes no layer
    assert net.classes == 5 and net.loss is not None
    # parameter names are torch's: the module's state_dict keys, less bn counters
    torch_names = {k for k in module.state_dict() if not k.endswith("num_batches_tracked")}
    assert set(net.param_shapes()) | set(net.buffer_shapes()) == torch_names
    _assert_step_equal(module, net, batch=3)


def test_dropout_and_flatten_forms_map_to_layers():
    net = sn.from_torch(Branchy(p=0.25), input_shape=(3, 10, 10), batch=2)
    (drop,) = [layer for layer in net if layer.op == "dropout"]
    assert drop.name == "drop" and drop.attrs["p"] == 0.25
    assert drop.inputs[0].shape == (2, 7, 2, 2)          # the flatten made no layer
    assert net["fc1"].params["weight"] == (8, 28)


def test_classes_must_match_the_output():
    with pytest.raises(ValueError, match="returns 5 logits, classes=7"):
        sn.from_torch(Branchy(), input_shape=(3, 10, 10), batch=2, classes=7)


class Functional(nn.Module):
    """The functional and method forms: F.local_response_norm, F.dropout, the adaptive pool,
    x.relu(), .flatten(1), torch.flatten, .reshape(-1, F), .contiguous(), nn.Identity and a
    concat of flattened values (torch.cat over dim -1)."""

    def __init__(self, p=0.0):
        super().__init__()
        self.p = p
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.skip = nn.Identity()
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        h = F.local_response_norm(self.conv(x), 3, alpha=1e-3, beta=0.7, k=1.5)
        h = F.dropout(self.skip(h), self.p, self.training)
        a = F.adaptive_avg_pool2d(h, (2, 2)).flatten(1)
        b = torch.flatten(F.max_pool2d(h.relu(), 4), 1).contiguous()
        return self.fc(torch.cat([a, b.reshape(-1, 16)], -1))


def test_functional_forms_map_exactly():
    torch.manual_seed(2)
    module = Functional()
    net = sn.from_torch(module, input_shape=(3, 8, 8), batch=2)
    assert [layer.op for layer in net] == ["data", "conv", "lrn", "pool", "relu", "pool",
                                            "concat", "fc", "softmax_loss"]
    assert net["local_response_norm"].attrs == {"size": 3, "alpha": 1e-3, "beta": 0.7, "k": 1.5}
    ref = net.to_torch(params=module.state_dict()).double()
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(ref(images), module.double()(images))
    with_drop = sn.from_torch(Functional(p=0.3), input_shape=(3, 8, 8), batch=2)
    assert [layer.attrs["p"] for layer in with_drop if layer.op == "dropout"] == [0.3]


class _Sigmoid(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.sigmoid(self.conv(x)).flatten(1))


class _Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(self.conv(self.conv(x)).flatten(1))


class _ReadAfterInplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 8 * 8, 3)

    def forward(self, x):
        h = self.conv(x)
        y = F.relu(h, inplace=True)
        return self.fc((y + h).flatten(1))


@pytest.mark.parametrize("module,match", [
    (_Sigmoid(), r"node 'sigmoid' \(call_function .*sigmoid\) at .*test_from_torch.py:\d+: "
                 r"return self.fc\(torch.sigmoid.*no tinysn layer computes this\. Supported: "),
    (_Reused(), r"node 'conv_1' \(call_module conv\).*called more than once"),
    (_ReadAfterInplace(), r"node 'relu' .*in-place op on 'conv'"),
    (nn.Sequential(nn.Conv2d(3, 4, 3, groups=1, dilation=2), nn.Flatten(), nn.Linear(64, 2)),
     r"node '_0' \(call_module 0\).*dilation=1"),
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3)),
     r"node '_1' \(call_module 1\).*eps=0.001"),
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(4)),
     r"adaptive pooling of 6x6 to 4x4"),
    (nn.Sequential(nn.Conv2d(3, 4, 3)), r"node 'output'.*2-D tensor of logits"),
])
def test_unsupported_nodes_raise_one_error_naming_node_target_and_line(module, match):
    with pytest.raises(ValueError, match=match):
        sn.from_torch(module, input_shape=(3, 8, 8), batch=2)


def test_layer_names_may_be_module_paths():
    net = sn.Net(input_shape=(3, 4, 4), classes=2, batch=1)
    net.conv(net.data(), 2, name="layer1.0.conv1")
    net.conv(net.data_layer, 2, name="0")
    for bad in ("layer1..conv", ".conv", "conv.", "a b", "a/b"):
        with pytest.raises(ValueError, match="layer name"):
            net.conv(net.data_layer, 2, name=bad)


def test_to_torch_nests_dotted_names_like_torch():
    """The reference model registers "block.conv" inside "block", even when the child
    layer comes first, so its state_dict keys are the layer parameter names."""
    net = sn.Net(input_shape=(3, 6, 6), classes=2, batch=2)
    a = net.conv(net.data(), 3, name="block.conv")
    b = net.conv(a, 3, padding=1, name="block")
    net.softmax_loss(net.fc(b, 2, name="head.fc"))
    model = net.to_torch(seed=1)
    assert set(model.state_dict()) == set(net.param_shapes())
    assert isinstance(model.block.conv, nn.Conv2d) and isinstance(model.head.fc, nn.Linear)
    images = torch.randn(2, 3, 6, 6)
    w = net.init_params(1)
    h = F.conv2d(F.conv2d(images, w["block.conv.weight"], w["block.conv.bias"]),
                 w["block.weight"], w["block.bias"], padding=1)
    torch.testing.assert_close(model(images), F.linear(h.flatten(1), w["head.fc.weight"],
                                                       w["head.fc.bias"]))


# ------------------------------------------------------------------ torchvision
def _torchvision_case(name):
    """(module with dropout off, input shape, batch) for a small but faithful import."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    module = getattr(tv.models, name)(num_classes=10)
    for m in module.modules():          # dropout masks are drawn differently: compare p = 0
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    # AlexNet and VGG pool adaptively to 6x6 and 7x7, which their 224 input reaches exactly
    size = 224 if name in ("alexnet", "vgg16") else 64
    return module, (3, size, size), 2


TORCHVISION = ["resnet50", "densenet121", "alexnet", "vgg16"]


@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_model_imports_with_its_parameter_names(name):
    module, shape, batch = _torchvision_case(name)
    net = sn.from_torch(module, input_shape=shape, batch=batch)
    torch_names = {k for k in module.state_dict() if not k.endswith("num_batches_tracked")}
    assert set(net.param_shapes()) | set(net.buffer_shapes()) == torch_names
    ref = net.to_torch(params={k: module.state_dict()[k] for k in torch_names}).double()
    images = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ref(images.double()),
                                   copy.deepcopy(module).double()(images.double()))


@pytest.mark.gpu
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_model_steps_like_torch_on_gpu(name):
    """One training step on the GPU (a ResNet-50 step in the CPU interpreter takes over
    20 minutes, so the CPU checks stop at the import and the float64 forward above)."""
    module, shape, batch = _torchvision_case(name)
    _assert_as_close_as_torch_float32(module, sn.from_torch(module, input_shape=shape,
                                                            batch=batch), batch, "cuda", "4GiB")


@pytest.mark.gpu
def test_branchy_module_steps_like_torch_on_gpu():
    torch.manual_seed(0)
    module = Branchy()
    _assert_step_equal(module, sn.from_torch(module, input_shape=(3, 10, 10), batch=3), 3,
                       device="cuda")
