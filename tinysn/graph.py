"""The layer graph: a Net is a list of Layers, each knowing its producers and consumers.

A Net is built front to back with one method per layer type. Every method checks its
arguments, infers the output shape (batch included) and returns the new Layer, which is
the handle later layers take as input. A layer whose output feeds several layers makes a
*fan*; a layer with several inputs (`add`, `concat`) is a *join* (paper, Fig. 1).

    net = Net(input_shape=(3, 32, 32), classes=10, batch=8)
    x = net.data()
    h = net.relu(net.bn(net.conv(x, 16, kernel=3, padding=1)))
    net.softmax_loss(net.fc(h, 10))

Semantics are torch's (nn.Conv2d, nn.BatchNorm2d in training mode, nn.MaxPool2d /
nn.AvgPool2d with floor mode and count_include_pad=True, nn.LocalResponseNorm, nn.Linear on
the flattened input, nn.Dropout, F.cross_entropy with mean reduction), and parameters use
torch's layouts and names "<layer>.weight", "<layer>.bias", "<layer>.running_mean", ...
`Net.to_torch()` builds the equivalent torch model, the reference the tests compare against.
"""
from __future__ import annotations

import math
import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn

OPS = ("data", "conv", "bn", "relu", "pool", "lrn", "fc", "dropout", "add", "concat",
       "softmax_loss")
BN_EPS = 1e-5
BN_MOMENTUM = 0.1
# a name may be a dotted module path ("layer1.0.conv1", or "0" in an nn.Sequential), so
# that a layer imported from a torch module keeps torch's parameter names
_NAME = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*\Z")


class Layer:
    """One node of the graph, and the handle the Net's builder methods return.

    net      the Net it belongs to          name    unique within the net
    op       one of OPS                     inputs  producer Layers, in argument order
    shape    output shape, batch included: (N, C, H, W) for images, (N, F) after fc,
             (1,) for the loss
    attrs    the op's hyper-parameters (conv: out_channels, kernel, stride, padding as
             pairs, bias; pool: mode, kernel, stride, padding; lrn: size, alpha, beta, k;
             fc: out_features, bias; dropout: p; bn: eps, momentum; in the net a plan
             makes, sched/fuse.py adds relu, relu_masked, x_is_relu_output and mask_layer)
    params   trainable tensors, suffix -> shape (torch layouts)
    buffers  non-trainable state, suffix -> shape (bn running statistics)
    index    position in creation order (net.layers[index] is self)
    consumers  Layers that take this one as input, in creation order (each listed once)
    """

    __slots__ = ("net", "name", "op", "inputs", "shape", "attrs", "params", "buffers",
                 "index", "consumers")

    def __init__(self, net, name, op, inputs, shape, attrs=None, params=None, buffers=None):
        self.net = net
        self.name = name
        self.op = op
        self.inputs = tuple(inputs)
        self.shape = tuple(int(d) for d in shape)
        self.attrs = dict(attrs or {})
        self.params = dict(params or {})
        self.buffers = dict(buffers or {})
        self.index = -1
        self.consumers = []

    @property
    def numel(self) -> int:
        """Elements of the output tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the float32 output tensor."""
        return 4 * self.numel

    def __repr__(self):
        ins = ", ".join(i.name for i in self.inputs)
        return f"Layer({self.name}: {self.op}({ins}) -> {self.shape})"


def _pair(value, what, minimum):
    """An int or a pair of ints, each >= minimum, as a pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{what} must be an int or a pair of ints, got {value!r}")
        pair = tuple(value)
    else:
        pair = (value, value)
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{what} must be an int or a pair of ints, got {value!r}")
        if v < minimum:
            word = "positive" if minimum == 1 else "non-negative"
            raise ValueError(f"{what} must be {word}, got {value!r}")
    return pair


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _window_out(size, kernel, stride, padding, what):
    """floor((size + 2*padding - kernel) / stride) + 1, checking the window fits."""
    if kernel > size + 2 * padding:
        raise ValueError(f"{what}: kernel {kernel} is larger than the padded input "
                         f"{size} + 2*{padding} = {size + 2 * padding}")
    return (size + 2 * padding - kernel) // stride + 1


class Net:
    """A CNN as a graph of Layers; see the module docstring."""

    def __init__(self, input_shape=(3, 224, 224), classes=1000, batch=1):
        if isinstance(input_shape, int):
            input_shape = (input_shape,)
        input_shape = tuple(input_shape)
        if len(input_shape) not in (1, 3):
            raise ValueError(f"input_shape must be (C, H, W) (or (F,)), got {input_shape!r}")
        for d in input_shape:
            _positive_int(d, f"input_shape entry (in {input_shape!r})")
        self.input_shape = input_shape
        self.classes = _positive_int(classes, "classes")
        self.batch = _positive_int(batch, "batch")
        self.layers: list[Layer] = []
        self.loss: Layer | None = None
        self._by_name: dict[str, Layer] = {}
        self._counters: dict[str, int] = {}

    # ------------------------------------------------------------------ plumbing
    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, name: str) -> Layer:
        return self._by_name[name]

    def __contains__(self, name) -> bool:
        return name in self._by_name

    def __repr__(self):
        return (f"Net({len(self.layers)} layers, input {self.input_shape}, "
                f"classes {self.classes}, batch {self.batch})")

    @property
    def data_layer(self) -> Layer | None:
        return self.layers[0] if self.layers else None

    def _name(self, op, name):
        if name is None:
            n = self._counters.get(op, 0)
            while True:
                n += 1
                name = f"{op}{n}"
                if name not in self._by_name:
                    break
            self._counters[op] = n
            return name
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"layer name must be a string of letters, digits, '_' or '-', "
                             f"optionally in '.'-separated parts (a module path), got {name!r}")
        if name in self._by_name:
            raise ValueError(f"duplicate layer name {name!r}")
        return name

    def _input(self, x, what) -> Layer:
        if not isinstance(x, Layer):
            raise ValueError(f"{what}: input must be a Layer of this net, got {type(x).__name__}")
        if x.net is not self:
            raise ValueError(f"{what}: input {x.name!r} belongs to another Net")
        if x.op == "softmax_loss":
            raise ValueError(f"{what}: the loss {x.name!r} cannot feed another layer")
        return x

    def _inputs(self, xs, what, minimum=2) -> list[Layer]:
        if isinstance(xs, Layer):
            xs = [xs]
        try:
            xs = list(xs)
        except TypeError:
            raise ValueError(f"{what}: expected a list of Layers, got {type(xs).__name__}") from None
        if len(xs) < minimum:
            raise ValueError(f"{what}: needs at least {minimum} inputs, got {len(xs)}")
        xs = [self._input(x, what) for x in xs]
        if len({id(x) for x in xs}) != len(xs):
            raise ValueError(f"{what}: the same layer appears twice among the inputs "
                             f"({[x.name for x in xs]})")
        return xs

    def _image(self, x, what) -> tuple[int, int, int, int]:
        if len(x.shape) != 4:
            raise ValueError(f"{what}: needs a 4-D (N, C, H, W) input, "
                             f"{x.name!r} has shape {x.shape}")
        return x.shape

    def _add_layer(self, op, name, inputs, shape, attrs=None, params=None, buffers=None):
        for d in shape:
            if d < 1:
                raise ValueError(f"{op} {name!r}: output shape {tuple(shape)} is empty")
        layer = Layer(self, name, op, inputs, shape, attrs, params, buffers)
        layer.index = len(self.layers)
        self.layers.append(layer)
        self._by_name[name] = layer
        for x in layer.inputs:
            x.consumers.append(layer)
        return layer

    # ------------------------------------------------------------------ builders
    def data(self, name=None) -> Layer:
        """The input images, shape (batch, *input_shape). Only one per net."""
        if self.layers:
            raise ValueError("data() may be called only once, and first")
        name = self._name("data", name)
        return self._add_layer("data", name, (), (self.batch, *self.input_shape))

    def conv(self, x, out_channels, kernel=3, stride=1, padding=0, bias=True, name=None) -> Layer:
        """nn.Conv2d(C, out_channels, kernel, stride, padding, bias=bias)."""
        what = "conv" if name is None else f"conv {name!r}"
        x = self._input(x, what)
        n, c, h, w = self._image(x, what)
        k = _positive_int(out_channels, f"{what}: out_channels")
        kh, kw = _pair(kernel, f"{what}: kernel", 1)
        sh, sw = _pair(stride, f"{what}: stride", 1)
        ph, pw = _pair(padding, f"{what}: padding", 0)
        if not isinstance(bias, bool):
            raise ValueError(f"{what}: bias must be True or False, got {bias!r}")
        oh = _window_out(h, kh, sh, ph, f"{what} (height)")
        ow = _window_out(w, kw, sw, pw, f"{what} (width)")
        name = self._name("conv", name)
        params = {"weight": (k, c, kh, kw)}
        if bias:
            params["bias"] = (k,)
        attrs = {"out_channels": k, "kernel": (kh, kw), "stride": (sh, sw),
                 "padding": (ph, pw), "bias": bias}
        return self._add_layer("conv", name, (x,), (n, k, oh, ow), attrs, params)

    def bn(self, x, name=None) -> Layer:
        """nn.BatchNorm2d(C) in training mode (eps 1e-5, momentum 0.1, affine)."""
        what = "bn" if name is None else f"bn {name!r}"
        x = self._input(x, what)
        c = self._image(x, what)[1]
        name = self._name("bn", name)
        return self._add_layer("bn", name, (x,), x.shape,
                               {"eps": BN_EPS, "momentum": BN_MOMENTUM},
                               {"weight": (c,), "bias": (c,)},
                               {"running_mean": (c,), "running_var": (c,)})

    def relu(self, x, name=None) -> Layer:
        what = "relu" if name is None else f"relu {name!r}"
        x = self._input(x, what)
        return self._add_layer("relu", self._name("relu", name), (x,), x.shape)

    def pool(self, x, mode="max", kernel=2, stride=None, padding=0, name=None) -> Layer:
        """nn.MaxPool2d / nn.AvgPool2d(kernel, stride (default kernel), padding), floor mode;
        avg counts the zero padding (count_include_pad=True, torch's default)."""
        what = "pool" if name is None else f"pool {name!r}"
        x = self._input(x, what)
        n, c, h, w = self._image(x, what)
        if mode not in ("max", "avg"):
            raise ValueError(f"{what}: unknown pooling mode {mode!r} (use 'max' or 'avg')")
        kh, kw = _pair(kernel, f"{what}: kernel", 1)
        sh, sw = _pair(kernel if stride is None else stride, f"{what}: stride", 1)
        ph, pw = _pair(padding, f"{what}: padding", 0)
        if ph > kh // 2 or pw > kw // 2:
            raise ValueError(f"{what}: padding {(ph, pw)} must be at most half the kernel "
                             f"{(kh, kw)} (torch's rule)")
        oh = _window_out(h, kh, sh, ph, f"{what} (height)")
        ow = _window_out(w, kw, sw, pw, f"{what} (width)")
        name = self._name("pool", name)
        attrs = {"mode": mode, "kernel": (kh, kw), "stride": (sh, sw), "padding": (ph, pw)}
        return self._add_layer("pool", name, (x,), (n, c, oh, ow), attrs)

    def lrn(self, x, size=5, alpha=1e-4, beta=0.75, k=2.0, name=None) -> Layer:
        """nn.LocalResponseNorm(size, alpha, beta, k) across channels."""
        what = "lrn" if name is None else f"lrn {name!r}"
        x = self._input(x, what)
        self._image(x, what)
        attrs = {"size": _positive_int(size, f"{what}: size"),
                 "alpha": _number(alpha, f"{what}: alpha"),
                 "beta": _number(beta, f"{what}: beta"),
                 "k": _number(k, f"{what}: k")}
        return self._add_layer("lrn", self._name("lrn", name), (x,), x.shape, attrs)

    def fc(self, x, out_features, bias=True, name=None) -> Layer:
        """nn.Linear(prod(x.shape[1:]), out_features) on the flattened input."""
        what = "fc" if name is None else f"fc {name!r}"
        x = self._input(x, what)
        o = _positive_int(out_features, f"{what}: out_features")
        if not isinstance(bias, bool):
            raise ValueError(f"{what}: bias must be True or False, got {bias!r}")
        if len(x.shape) < 2:
            raise ValueError(f"{what}: input {x.name!r} has no feature dimension ({x.shape})")
        f = math.prod(x.shape[1:])
        params = {"weight": (o, f)}
        if bias:
            params["bias"] = (o,)
        return self._add_layer("fc", self._name("fc", name), (x,), (x.shape[0], o),
                               {"out_features": o, "bias": bias}, params)

    def dropout(self, x, p=0.5, name=None) -> Layer:
        """nn.Dropout(p): zero with probability p, scale the rest by 1/(1-p)."""
        what = "dropout" if name is None else f"dropout {name!r}"
        x = self._input(x, what)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"{what}: p must be in [0, 1), got {p!r}")
        return self._add_layer("dropout", self._name("dropout", name), (x,), x.shape,
                               {"p": float(p)})

    def add(self, *xs, name=None) -> Layer:
        """Elementwise sum (a join): net.add(a, b) or net.add([a, b, c]); equal shapes."""
        what = "add" if name is None else f"add {name!r}"
        if len(xs) == 1 and not isinstance(xs[0], Layer):
            xs = xs[0]
        xs = self._inputs(xs, what)
        for x in xs[1:]:
            if x.shape != xs[0].shape:
                raise ValueError(f"{what}: shapes differ: " +
                                 ", ".join(f"{x.name} {x.shape}" for x in xs))
        return self._add_layer("add", self._name("add", name), xs, xs[0].shape)

    def concat(self, xs, name=None) -> Layer:
        """Concatenation along channels (dim 1, a join); every other dimension must agree."""
        what = "concat" if name is None else f"concat {name!r}"
        xs = self._inputs(xs, what)
        first = xs[0].shape
        for x in xs:
            if len(x.shape) < 2 or len(x.shape) != len(first) or x.shape[0] != first[0] \
                    or x.shape[2:] != first[2:]:
                raise ValueError(f"{what}: only the channel dimension may differ: " +
                                 ", ".join(f"{x.name} {x.shape}" for x in xs))
        channels = sum(x.shape[1] for x in xs)
        return self._add_layer("concat", self._name("concat", name), xs,
                               (first[0], channels, *first[2:]))

    def softmax_loss(self, x, name=None) -> Layer:
        """Mean cross-entropy of the logits x (N, classes) against integer labels."""
        what = "softmax_loss" if name is None else f"softmax_loss {name!r}"
        x = self._input(x, what)
        if self.loss is not None:
            raise ValueError(f"{what}: the net already has a loss ({self.loss.name!r})")
        if len(x.shape) != 2:
            raise ValueError(f"{what}: needs 2-D logits (N, classes), {x.name!r} has "
                             f"shape {x.shape} (add an fc layer)")
        if x.shape[1] != self.classes:
            raise ValueError(f"{what}: logits have {x.shape[1]} features but the net has "
                             f"{self.classes} classes")
        layer = self._add_layer("softmax_loss", self._name("softmax_loss", name), (x,), (1,))
        self.loss = layer
        return layer

    # ------------------------------------------------------------------ queries
    def check(self) -> "Net":
        """Raise ValueError unless the net is trainable: a data layer, a loss, and every
        layer's output used on the way to the loss. Returns the net."""
        if not self.layers:
            raise ValueError("the net is empty (call data() first)")
        if self.loss is None:
            raise ValueError("the net has no loss (call softmax_loss(logits))")
        dead = [layer.name for layer in self.layers
                if not layer.consumers and layer is not self.loss]
        if dead:
            shown = ", ".join(dead[:5]) + (" ..." if len(dead) > 5 else "")
            raise ValueError(f"{len(dead)} layer(s) do not lead to the loss: {shown}")
        return self

    def param_shapes(self) -> dict[str, tuple]:
        """Trainable parameters "<layer>.<suffix>" -> shape, in layer order."""
        return {f"{layer.name}.{k}": s for layer in self.layers for k, s in layer.params.items()}

    def buffer_shapes(self) -> dict[str, tuple]:
        """Non-trainable state ("<bn>.running_mean", "<bn>.running_var") -> shape."""
        return {f"{layer.name}.{k}": s for layer in self.layers for k, s in layer.buffers.items()}

    def param_count(self) -> int:
        """Number of trainable scalars."""
        return sum(math.prod(s) for s in self.param_shapes().values())

    def init_params(self, seed=0) -> dict[str, torch.Tensor]:
        """Parameters and buffers as float32 CPU tensors, torch's default initialisation.

        conv / fc weight: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in));
        their bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); bn weight 1, bias 0, running_mean 0,
        running_var 1. Each tensor draws from its own generator seeded by (seed, name), so
        adding a layer does not change the others. Order: per layer, params then buffers
        (the order of the torch model's state_dict).
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        out = {}
        for layer in self.layers:
            if layer.op in ("conv", "fc"):
                w_shape = layer.params["weight"]
                fan_in = math.prod(w_shape[1:])
                bound = 1.0 / math.sqrt(fan_in)
                key = f"{layer.name}.weight"
                w = torch.empty(w_shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=_generator(seed, key))
                out[key] = w
                if "bias" in layer.params:
                    key = f"{layer.name}.bias"
                    b = torch.empty(layer.params["bias"], dtype=torch.float32)
                    b.uniform_(-bound, bound, generator=_generator(seed, key))
                    out[key] = b
            elif layer.op == "bn":
                c = layer.params["weight"]
                out[f"{layer.name}.weight"] = torch.ones(c, dtype=torch.float32)
                out[f"{layer.name}.bias"] = torch.zeros(c, dtype=torch.float32)
                out[f"{layer.name}.running_mean"] = torch.zeros(c, dtype=torch.float32)
                out[f"{layer.name}.running_var"] = torch.ones(c, dtype=torch.float32)
        return out

    def summary(self) -> str:
        """A table: name, op, inputs, output shape, parameter count; totals at the end."""
        rows = [("name", "op", "inputs", "output", "params")]
        for layer in self.layers:
            ins = ",".join(x.name for x in layer.inputs)
            if len(ins) > 30:
                ins = ins[:27] + "..."
            count = sum(math.prod(s) for s in layer.params.values())
            rows.append((layer.name, layer.op, ins, "x".join(map(str, layer.shape)),
                         f"{count:,}" if count else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if j < 4 else c.rjust(w)
                                   for j, (c, w) in enumerate(zip(r, widths))).rstrip())
            if i == 0:
                lines.append("-" * len(lines[0]))
        act = sum(layer.nbytes for layer in self.layers)
        lines.append(f"{len(self.layers)} layers, {self.param_count():,} parameters, "
                     f"{act / 2**20:.1f} MiB of float32 layer outputs at batch {self.batch}")
        return "\n".join(lines)

    def to_torch(self, params=None, seed=0) -> "TorchNet":
        """The same graph as a torch nn.Module (the reference model).

        Its state_dict keys are exactly param_shapes() | buffer_shapes(). It is loaded with
        `params` if given, else with init_params(seed). forward(images) returns the logits
        (the input of the loss); see TorchNet for more.
        """
        self.check()
        model = TorchNet(self)
        state = self.init_params(seed) if params is None else params
        model.load_state_dict(state)
        return model


def _generator(seed, key) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(key.encode())) % (2**63))
    return g


# ---------------------------------------------------------------------- torch reference
class _BatchNorm(nn.Module):
    """nn.BatchNorm2d without num_batches_tracked, so the state_dict holds exactly
    weight, bias, running_mean, running_var (F.batch_norm: unbiased running variance)."""

    def __init__(self, c, eps=BN_EPS, momentum=BN_MOMENTUM):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training, self.momentum, self.eps)


class _Linear(nn.Linear):
    """nn.Linear on the flattened input."""

    def forward(self, x):
        return super().forward(x.flatten(1))


class _Join(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *xs):
        if self.op == "concat":
            return torch.cat(xs, dim=1)
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out

    def extra_repr(self):
        return self.op


def _module(layer: Layer) -> nn.Module:
    a = layer.attrs
    if layer.op == "conv":
        return nn.Conv2d(layer.inputs[0].shape[1], a["out_channels"], a["kernel"],
                         a["stride"], a["padding"], bias=a["bias"])
    if layer.op == "bn":
        return _BatchNorm(layer.shape[1], a["eps"], a["momentum"])
    if layer.op == "relu":
        return nn.ReLU()
    if layer.op == "pool":
        cls = nn.MaxPool2d if a["mode"] == "max" else nn.AvgPool2d
        return cls(a["kernel"], a["stride"], a["padding"])
    if layer.op == "lrn":
        return nn.LocalResponseNorm(a["size"], a["alpha"], a["beta"], a["k"])
    if layer.op == "fc":
        return _Linear(math.prod(layer.inputs[0].shape[1:]), a["out_features"], bias=a["bias"])
    if layer.op == "dropout":
        return nn.Dropout(a["p"])
    if layer.op in ("add", "concat"):
        return _Join(layer.op)
    if layer.op in ("data", "softmax_loss"):
        return nn.Identity()
    raise AssertionError(layer.op)


def _place(root: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """Register `module` under a dotted layer name ("layer1.0.conv1"), creating empty
    container modules for the missing parents, so that its state_dict keys are
    "<name>.weight", ... as in the torch module the name came from. Returns `module`.

    _modules is set directly: add_module refuses names like "forward" or "training", and
    state_dict only reads _modules."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        node = node._modules.setdefault(part, nn.Module())
    earlier = node._modules.get(leaf)     # a container made for a deeper name, placed first
    if earlier is not None:
        module._modules.update(earlier._modules)
    node._modules[leaf] = module
    return module


class TorchNet(nn.Module):
    """A Net as torch modules, one per layer, registered under the layer's (possibly
    dotted) name, so the state_dict keys are "<layer>.weight", .... Runs layers in creation order (a valid
    topological order). Any batch size works; .double() gives a float64 reference.

    forward(images) -> logits; loss(images, labels) -> mean cross-entropy;
    outputs(images, labels=None) -> {layer name: output} for every layer (the loss entry
    only when labels are given).
    """

    def __init__(self, net: Net):
        super().__init__()
        self.plan = [(layer.name, layer.op, tuple(x.name for x in layer.inputs))
                     for layer in net.layers]
        self.loss_name = net.loss.name
        self.logits_name = net.loss.inputs[0].name
        last_use = {}
        for i, (_, _, ins) in enumerate(self.plan):
            for n in ins:
                last_use[n] = i
        self._last_use = last_use
        self._layer_modules = {}
        with torch.device("meta"):      # no wasted random init; Net.to_torch loads values
            for layer in net.layers:
                self._layer_modules[layer.name] = _place(self, layer.name, _module(layer))
        self.to_empty(device="cpu")

    def __setattr__(self, name, value):
        # plain attributes (e.g. `training`, set by .train()) bypass Module.__setattr__,
        # which would refuse a name that is also a layer's name.
        if isinstance(value, (torch.Tensor, nn.Module)):
            super().__setattr__(name, value)
        else:
            object.__setattr__(self, name, value)

    def outputs(self, images, labels=None, keep=True):
        values = {}
        for i, (name, op, ins) in enumerate(self.plan):
            module = self._layer_modules[name]
            if op == "data":
                values[name] = module(images)
            elif op == "softmax_loss":
                if labels is None:
                    continue
                values[name] = F.cross_entropy(values[ins[0]], labels)
            else:
                values[name] = module(*(values[n] for n in ins))
            if not keep:
                for n in ins:
                    if self._last_use[n] == i and n != self.logits_name:
                        del values[n]
        return values

    def forward(self, images):
        return self.outputs(images, keep=False)[self.logits_name]

    def loss(self, images, labels):
        return F.cross_entropy(self.forward(images), labels)
