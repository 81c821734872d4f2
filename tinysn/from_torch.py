"""Import a torch `nn.Module` as a tinysn Net, through a torch.fx symbolic trace.

    net = sn.from_torch(module, input_shape=(3, 224, 224), batch=32)
    rt = sn.Runtime(net, memory="8GiB", policy="all")
    rt.load_params(module.state_dict())

Every traced node becomes a Net layer (or, for flatten and shape queries, no layer at all).
A layer holding parameters is named by its module path, so its parameters carry torch's
names ("layer1.0.conv1.weight") and the module's state_dict loads as it is. The module's
output must be the logits (N, classes); the Net adds the mean cross-entropy loss on them.

Flattening makes no layer: tinysn's fc flattens its input, and elementwise layers (ReLU,
dropout, add) compute the same numbers on the flat or the 4-D view, so a flattened value is
its 4-D layer marked `flat`. Anything the importer cannot map exactly raises one ValueError
naming the node, its target and the source line that created it.
"""
from __future__ import annotations

import inspect
import math
import operator
import os
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .graph import BN_EPS, BN_MOMENTUM, Layer, Net

SUPPORTED = ("nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, "
             "nn.AdaptiveAvgPool2d (to a size dividing the input), nn.LocalResponseNorm, "
             "nn.Linear, nn.Dropout, nn.Flatten, nn.Identity; F.relu, F.max_pool2d, "
             "F.avg_pool2d, F.adaptive_avg_pool2d, F.local_response_norm, F.dropout; "
             "torch.relu, torch.flatten, .view/.reshape/.flatten to (N, -1), torch.cat over "
             "dim 1, + / torch.add of two tensors, .size() and .shape")
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


class _Unsupported(Exception):
    """A node the importer cannot map; `listing` adds the list of what is supported."""

    def __init__(self, reason, listing=False):
        super().__init__(reason)
        self.listing = listing


class _Value(NamedTuple):
    """A traced tensor: the layer computing it, and whether torch sees it flattened."""
    layer: Layer
    flat: bool = False

    @property
    def shape(self):
        s = self.layer.shape
        return (s[0], math.prod(s[1:])) if self.flat else s


class _Tracer(fx.Tracer):
    """An fx tracer that records each node's stack trace (for the source line in errors)."""

    def __init__(self):
        super().__init__()
        self.record_stack_traces = True


def from_torch(module, input_shape, batch, classes=None) -> Net:
    """The Net computing `module`'s forward pass (training mode) on (batch, *input_shape)
    images, with a softmax loss on its output. `classes` defaults to the output's width."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"from_torch needs a torch nn.Module, got {type(module).__name__}")
    if classes is not None and (isinstance(classes, bool) or not isinstance(classes, int)
                                or classes < 1):
        raise ValueError(f"classes must be a positive int or None, got {classes!r}")
    net = Net(input_shape=input_shape, classes=classes or 1, batch=batch)
    try:
        graph = _Tracer().trace(module)
    except Exception as err:   # fx refuses data-dependent control flow and the like
        raise ValueError(f"from_torch: torch.fx cannot trace {type(module).__name__}: "
                         f"{err}") from None
    _Importer(module, net, classes).run(graph)
    return net


class _Importer:
    """Walks an fx graph in order, building the Net one node at a time."""

    def __init__(self, module, net, classes):
        self.net, self.classes = net, classes
        self.modules = dict(module.named_modules())
        # module paths owning parameters are reserved: only their module's layer may take
        # the name, so the parameter names stay torch's
        self.reserved = {path for path, m in self.modules.items()
                         if any(True for _ in m.parameters(recurse=False))}
        self.values = {}
        self.order = {}

    def run(self, graph):
        for i, node in enumerate(graph.nodes):
            self.order[node] = i
        for node in graph.nodes:
            try:
                self.values[node] = self.visit(node)
            except (_Unsupported, ValueError) as err:
                raise ValueError(_describe(node, err)) from None

    def visit(self, node):
        if node.op == "placeholder":
            if self.net.layers:
                raise _Unsupported("the module takes more than one input")
            return _Value(self.net.data(name=self.name(node)))
        if node.op == "get_attr":
            if node.users:
                raise _Unsupported("a parameter or buffer used directly by an operation "
                                   "(functional conv/linear/batch_norm)", listing=True)
            return None
        if node.op == "output":
            return self.output(node)
        args = [self.arg(a) for a in node.args]
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        if node.op == "call_module":
            return self.call_module(node, self.modules[node.target], args, kwargs)
        table = _FUNCTIONS if node.op == "call_function" else _METHODS
        handler = table.get(node.target)
        if handler is None:
            raise _Unsupported("no tinysn layer computes this", listing=True)
        method, signature = handler
        try:
            bound = inspect.signature(signature).bind(*args, **kwargs)
        except TypeError as err:
            raise _Unsupported(f"unexpected arguments ({err})") from None
        bound.apply_defaults()
        return getattr(self, method)(node, **bound.arguments)

    def arg(self, a):
        """An argument's imported value: a _Value, a number, or a list/tuple of them."""
        if isinstance(a, fx.Node):
            return self.values[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        return a

    def name(self, node, path=None) -> str:
        """A fresh layer name: the module path when given and free (a module owning
        parameters always gets it: nothing else may take a reserved path), else the fx
        node's name, suffixed until it is free."""
        if path is not None and path not in self.net:
            return path
        if path in self.reserved:
            raise _Unsupported(f"module {path!r} is called more than once; tinysn layers "
                               "do not share parameters")
        name, k = node.name, 0
        while name in self.net or name in self.reserved:
            k += 1
            name = f"{node.name}_{k}"
        return name

    def output(self, node):
        out = self.values[node.args[0]] if isinstance(node.args[0], fx.Node) else None
        if not isinstance(out, _Value) or len(out.shape) != 2:
            raise _Unsupported("the module must return one 2-D tensor of logits (N, classes)")
        if out.flat:
            raise _Unsupported("the logits must come from a Linear layer, not a flattened map")
        width = out.layer.shape[1]
        if self.classes is not None and self.classes != width:
            raise _Unsupported(f"the module returns {width} logits, classes={self.classes}")
        self.net.classes = width
        self.net.softmax_loss(out.layer, name=self.name(node, "loss"))
        return None

    # ------------------------------------------------------------------ modules
    def call_module(self, node, m, args, kwargs):
        kind = type(m)
        if kind not in _MODULES:
            raise _Unsupported(f"module type {kind.__name__} has no tinysn layer", listing=True)
        if len(args) != 1 or kwargs:
            raise _Unsupported(f"{kind.__name__} called with {len(args)} arguments and "
                               f"keywords {sorted(kwargs)}")
        return getattr(self, _MODULES[kind])(node, m, _tensor(args[0], "input"))

    def m_conv(self, node, m, x):
        if m.groups != 1 or tuple(m.dilation) != (1, 1) or m.padding_mode != "zeros":
            raise _Unsupported("only Conv2d with groups=1, dilation=1 and zero padding maps")
        padding = 0 if m.padding == "valid" else m.padding
        if isinstance(padding, str):
            raise _Unsupported(f"Conv2d padding={padding!r}: give explicit padding")
        _channels(x, m.in_channels, "Conv2d")
        return _Value(self.net.conv(x.layer, m.out_channels, tuple(m.kernel_size),
                                    tuple(m.stride), tuple(padding), bias=m.bias is not None,
                                    name=self.name(node, node.target)))

    def m_bn(self, node, m, x):
        if not (m.affine and m.track_running_stats):
            raise _Unsupported("BatchNorm2d needs affine=True and track_running_stats=True")
        if m.eps != BN_EPS or m.momentum != BN_MOMENTUM:
            raise _Unsupported(f"BatchNorm2d eps={m.eps}, momentum={m.momentum}: tinysn's "
                               f"batch norm has eps={BN_EPS}, momentum={BN_MOMENTUM}")
        _channels(x, m.num_features, "BatchNorm2d")
        return _Value(self.net.bn(x.layer, name=self.name(node, node.target)))

    def m_relu(self, node, m, x):
        return self.f_relu(node, x, m.inplace)

    def m_max_pool(self, node, m, x):
        return self.pool(node, x, "max", m.kernel_size, m.stride, m.padding, m.dilation,
                         m.ceil_mode, m.return_indices)

    def m_avg_pool(self, node, m, x):
        return self.pool(node, x, "avg", m.kernel_size, m.stride, m.padding, 1, m.ceil_mode,
                         False, m.count_include_pad, m.divisor_override)

    def m_adaptive(self, node, m, x):
        return self.f_adaptive(node, x, m.output_size)

    def m_lrn(self, node, m, x):
        return self.f_lrn(node, x, m.size, m.alpha, m.beta, m.k)

    def m_linear(self, node, m, x):
        if m.in_features != math.prod(x.shape[1:]):
            raise _Unsupported(f"Linear expects {m.in_features} features, its input "
                               f"{x.layer.name!r} has shape {x.shape}")
        return _Value(self.net.fc(x.layer, m.out_features, bias=m.bias is not None,
                                  name=self.name(node, node.target)))

    def m_dropout(self, node, m, x):
        return self.f_dropout(node, x, m.p, True, m.inplace)

    def m_flatten(self, node, m, x):
        return self.f_flatten(node, x, m.start_dim, m.end_dim)

    def m_identity(self, node, m, x):
        return x

    # ------------------------------------------------------------------ functions
    def f_relu(self, node, input, inplace=False):
        x = _tensor(input, "input")
        if inplace:
            self.check_inplace(node)
        return _Value(self.net.relu(x.layer, name=self.name(node)), x.flat)

    def f_relu_(self, node, input):
        return self.f_relu(node, input, True)

    def check_inplace(self, node):
        """An in-place op is exact only if nothing reads its input after it."""
        source = node.args[0]
        later = [u.name for u in source.users if self.order[u] > self.order[node]]
        if later:
            raise _Unsupported(f"in-place op on {source.name!r}, which {later} read "
                               "afterwards (tinysn layers do not mutate their input)")

    def pool(self, node, x, mode, kernel, stride, padding, dilation=1, ceil_mode=False,
             return_indices=False, count_include_pad=True, divisor_override=None):
        x = _image(x)
        if dilation not in (1, (1, 1)) or ceil_mode or return_indices:
            raise _Unsupported("pooling with dilation, ceil_mode or return_indices")
        if divisor_override is not None or (not count_include_pad and padding not in (0, (0, 0))):
            raise _Unsupported("average pooling must count the padding "
                               "(count_include_pad=True, no divisor_override)")
        stride = kernel if stride in (None, ()) else stride
        return _Value(self.net.pool(x.layer, mode, _ints(kernel), _ints(stride),
                                    _ints(padding), name=self.name(node, _path(node))))

    def f_max_pool(self, node, input, kernel_size, stride=None, padding=0, dilation=1,
                   ceil_mode=False, return_indices=False):
        return self.pool(node, input, "max", kernel_size, stride, padding, dilation,
                         ceil_mode, return_indices)

    def f_avg_pool(self, node, input, kernel_size, stride=None, padding=0, ceil_mode=False,
                   count_include_pad=True, divisor_override=None):
        return self.pool(node, input, "avg", kernel_size, stride, padding, 1, ceil_mode,
                         False, count_include_pad, divisor_override)

    def f_adaptive(self, node, input, output_size):
        """Adaptive average pooling to a size dividing the input: a plain average pool."""
        x = _image(input)
        h, w = x.layer.shape[2:]
        oh, ow = (output_size, output_size) if isinstance(output_size, int) else output_size
        oh, ow = oh or h, ow or w
        if h % oh or w % ow:
            raise _Unsupported(f"adaptive pooling of {h}x{w} to {oh}x{ow}: only output sizes "
                               "dividing the input map (choose another input_shape)")
        if (oh, ow) == (h, w):
            return x
        kernel = (h // oh, w // ow)
        return _Value(self.net.pool(x.layer, "avg", kernel, kernel, 0,
                                    name=self.name(node, _path(node))))

    def f_lrn(self, node, input, size, alpha=1e-4, beta=0.75, k=1.0):
        x = _image(input)
        return _Value(self.net.lrn(x.layer, size, float(alpha), float(beta), float(k),
                                   name=self.name(node, _path(node))))

    def f_dropout(self, node, input, p=0.5, training=True, inplace=False):
        x = _tensor(input, "input")
        if inplace:
            self.check_inplace(node)
        if not training or p == 0:
            return x
        return _Value(self.net.dropout(x.layer, float(p), name=self.name(node, _path(node))),
                      x.flat)

    def f_flatten(self, node, input, start_dim=0, end_dim=-1):
        x = _tensor(input, "input")
        if start_dim != 1 or end_dim not in (-1, len(x.shape) - 1):
            raise _Unsupported(f"flatten(start_dim={start_dim}, end_dim={end_dim}): only "
                               "flattening to (N, -1) maps")
        return _flat(x)

    def f_view(self, node, input, shape):
        x = _tensor(input, "input")
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        n, features = x.shape[0], math.prod(x.shape[1:])
        if tuple(shape) not in ((n, -1), (n, features), (-1, features)):
            raise _Unsupported(f"reshape of {x.shape} to {tuple(shape)}: only (N, -1) maps")
        return _flat(x)

    def f_cat(self, node, tensors, dim=0):
        xs = [_tensor(t, "tensors") for t in tensors]
        if len(xs) == 1:
            return xs[0]
        flats = {x.flat for x in xs}
        rank = len(xs[0].shape)
        if len(flats) > 1 or dim not in (1, 1 - rank):
            raise _Unsupported(f"torch.cat over dim {dim} of tensors shaped "
                               f"{[x.shape for x in xs]}: only the channel dimension maps")
        return _Value(self.net.concat([x.layer for x in xs], name=self.name(node)),
                      flats.pop())

    def f_add(self, node, input, other, alpha=1):
        a, b = _tensor(input, "input"), _tensor(other, "other")
        if alpha != 1:
            raise _Unsupported(f"torch.add with alpha={alpha}")
        if a.flat != b.flat:
            raise _Unsupported(f"adding {a.shape} and {b.shape}: one flattened, one not")
        return _Value(self.net.add(a.layer, b.layer, name=self.name(node)), a.flat)

    def f_add_(self, node, input, other, alpha=1):
        self.check_inplace(node)
        return self.f_add(node, input, other, alpha)

    def f_size(self, node, input, dim=None):
        shape = _tensor(input, "input").shape
        return torch.Size(shape) if dim is None else shape[dim]

    def f_getattr(self, node, obj, name):
        if isinstance(obj, _Value) and name == "shape":
            return torch.Size(obj.shape)
        raise _Unsupported(f"attribute {name!r} of a traced value")

    def f_getitem(self, node, obj, index):
        if isinstance(obj, (tuple, list)):
            return obj[index]
        raise _Unsupported("indexing a tensor")

    def f_contiguous(self, node, input, memory_format=None):
        return _tensor(input, "input")


# ---------------------------------------------------------------------- helpers
def _tensor(value, what) -> _Value:
    if not isinstance(value, _Value):
        raise _Unsupported(f"{what} is {type(value).__name__}, not a traced tensor "
                           "(operations with constants do not map)")
    return value


def _image(value) -> _Value:
    x = _tensor(value, "input")
    if x.flat or len(x.shape) != 4:
        raise _Unsupported(f"needs a 4-D (N, C, H, W) input, got shape {x.shape}")
    return x


def _flat(x: _Value) -> _Value:
    return x if len(x.layer.shape) == 2 else _Value(x.layer, True)


def _channels(x: _Value, want, what):
    x = _image(x)
    if x.layer.shape[1] != want:
        raise _Unsupported(f"{what} expects {want} channels, its input {x.layer.name!r} has "
                           f"shape {x.shape}")


def _ints(value):
    return tuple(value) if isinstance(value, (tuple, list)) else value


def _path(node):
    """The module path of a call_module node (its layer's name), else None."""
    return node.target if node.op == "call_module" else None


def _source(node) -> str:
    """'file:line: code' of the innermost frame outside torch and tinysn that created the
    node (the user's forward), if the trace recorded one."""
    lines = (node.stack_trace or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if line.startswith('File "'):
            file, _, rest = line[6:].partition('", line ')
            if file.startswith(_LIBRARY_DIRS):
                continue
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{file}:{rest.split(',')[0]}: {code}"
    return "a forward inside torch (no user source line)"


def _describe(node, err) -> str:
    target = node.target
    if callable(target):
        target = f"{getattr(target, '__module__', None) or ''}.{getattr(target, '__name__', target)}"
    message = (f"from_torch: cannot map node {node.name!r} ({node.op} {target}) "
               f"at {_source(node)}: {err}")
    if getattr(err, "listing", False):
        message += f". Supported: {SUPPORTED}"
    return message


def _sig_unary(input, inplace=False): ...
def _sig_relu_(input): ...
def _sig_max_pool(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                  return_indices=False): ...
def _sig_avg_pool(input, kernel_size, stride=None, padding=0, ceil_mode=False,
                  count_include_pad=True, divisor_override=None): ...
def _sig_adaptive(input, output_size): ...
def _sig_lrn(input, size, alpha=1e-4, beta=0.75, k=1.0): ...
def _sig_dropout(input, p=0.5, training=True, inplace=False): ...
def _sig_flatten(input, start_dim=0, end_dim=-1): ...
def _sig_view(input, *shape): ...
def _sig_cat(tensors, dim=0): ...
def _sig_add(input, other, alpha=1): ...
def _sig_size(input, dim=None): ...
def _sig_getattr(obj, name): ...
def _sig_getitem(obj, index): ...
def _sig_contiguous(input, memory_format=None): ...


_MODULES = {nn.Conv2d: "m_conv", nn.BatchNorm2d: "m_bn", nn.ReLU: "m_relu",
            nn.MaxPool2d: "m_max_pool", nn.AvgPool2d: "m_avg_pool",
            nn.AdaptiveAvgPool2d: "m_adaptive", nn.LocalResponseNorm: "m_lrn",
            nn.Linear: "m_linear", nn.Dropout: "m_dropout", nn.Flatten: "m_flatten",
            nn.Identity: "m_identity"}
_FUNCTIONS = {
    F.relu: ("f_relu", _sig_unary), torch.relu: ("f_relu", _sig_unary),
    torch.relu_: ("f_relu_", _sig_relu_), F.relu_: ("f_relu_", _sig_relu_),
    F.max_pool2d: ("f_max_pool", _sig_max_pool), torch.max_pool2d: ("f_max_pool", _sig_max_pool),
    F.avg_pool2d: ("f_avg_pool", _sig_avg_pool),
    F.adaptive_avg_pool2d: ("f_adaptive", _sig_adaptive),
    F.local_response_norm: ("f_lrn", _sig_lrn),
    F.dropout: ("f_dropout", _sig_dropout),
    torch.flatten: ("f_flatten", _sig_flatten), torch.cat: ("f_cat", _sig_cat),
    torch.concat: ("f_cat", _sig_cat),
    operator.add: ("f_add", _sig_add), torch.add: ("f_add", _sig_add),
    operator.iadd: ("f_add_", _sig_add),
    getattr: ("f_getattr", _sig_getattr), operator.getitem: ("f_getitem", _sig_getitem),
}
_METHODS = {
    "relu": ("f_relu", _sig_unary), "relu_": ("f_relu_", _sig_relu_),
    "flatten": ("f_flatten", _sig_flatten), "view": ("f_view", _sig_view),
    "reshape": ("f_view", _sig_view), "add": ("f_add", _sig_add), "add_": ("f_add_", _sig_add),
    "size": ("f_size", _sig_size), "contiguous": ("f_contiguous", _sig_contiguous),
}
