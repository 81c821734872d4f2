"""One OpSpec per layer op: everything the scheduler and the runtime need to know about it.

A layer op (graph.OPS) is described in one place: which saved tensors its backward pass
reads, whether the recompute policy may drop and rebuild its output, the workspace its
kernels need, and how its forward and backward kernels are launched, side by side. The
scheduler (sched/) and the runtime consult `SPECS[layer.op]` instead of testing op names, so
adding an op touches graph.py (the builder and shape rule), kernels/<op>.py (the Triton
kernels) and one OpSpec here.

Launchers. `spec.forward(rt, layer, update_running)` and `spec.backward(rt, lp)` (`lp` the
layer's backward `liveness.LayerPass`) are called once, when the Runtime is built; each
returns `launch(algos, workspace)`, the function the runtime calls every time the plan's
Launch operation for that pass comes up. They look their tensors up through `rt.view(tensor
id)` at launch time (so a scheduling bug that reads a freed, dropped or in-flight tensor
raises instead of computing garbage) and read from `rt`: `program` (tensor ids),
`precision`, `images` (the batch being fed), `predicting` and `seed`. `advance_iteration(rt)`
ends every training step (the runtime calls it after the plan's last step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .kernels import act as act_k
from .kernels import bn as bn_k
from .kernels import conv as conv_k
from .kernels import dropout as dropout_k
from .kernels import join as join_k
from .kernels import linear as linear_k
from .kernels import lrn as lrn_k
from .kernels import pool as pool_k
from .kernels import softmax as softmax_k


def _no_workspace(layer, phase) -> int:
    return 0


def _streamed(layer, phase) -> tuple:
    """(flops, bytes) of an elementwise-like layer: it reads its inputs and writes its output
    (forward), or reads dy (and what it saved) and writes dx (backward): memory-bound."""
    ins = sum(4 * x.numel for x in layer.inputs)
    out = 4 * layer.numel
    return (layer.numel, ins + out) if phase == "forward" else (layer.numel, 2 * (ins + out))


@dataclass(frozen=True)
class OpSpec:
    """What one layer op needs from the scheduler and how the runtime launches it.

    backward_reads_input   the backward kernel reads the layer's forward inputs (a bool, or
                           a function of the layer: max pooling does, average pooling not)
    backward_reads_output  the backward kernel reads the layer's own output (ReLU)
    recomputable           cheap enough to drop and rebuild in the backward pass (§3.4)
    rebuildable            not cheap, but its output is a pure function of its inputs and
                           parameters, which no step updates before the backward pass reads
                           it: policy "all" may drop and rebuild it where the step-time
                           model says moving it costs more (conv, add, concat)
    is_loss                the network's loss: its output lives across iterations, it reads
                           the labels, and no gradient flows into it
    saves_statistics       writes a saved-statistics tensor and running buffers (batch norm)
    counts_batches         its torch twin keeps a "num_batches_tracked" counter (batch norm),
                           which tinysn does not use and load_params skips
    is_data                the data layer: its output is the batch, it comes first in a net
    has_algorithms         its kernels come in several algorithms whose workspaces differ
                           (conv): the planner picks one per step (sched/workspace.py)
    draws_mask             draws new random numbers every iteration from (seed, the program's
                           device iteration counter, layer index): its passes read the counter
    in_place_in_caffe      Caffe (the paper's base) runs it in place on its input, so the
                           tensor the paper offloads after a checkpoint conv is its output
    workspace              (layer, "forward" | "backward") -> bytes of scratch its kernels
                           need (conv's depend on the algorithm: sched/workspace.py)
    cost                   (layer, "forward" | "backward") -> (flops, bytes moved to and
                           from device memory): the planner's step-time model (sched/timing.py)
    forward, backward      launcher factories (module docstring); backward None: no backward
    """
    forward: Callable
    backward: Callable | None = None
    backward_reads_input: bool | Callable = False
    backward_reads_output: bool = False
    recomputable: bool = False
    rebuildable: bool = False
    is_loss: bool = False
    saves_statistics: bool = False
    counts_batches: bool = False
    is_data: bool = False
    has_algorithms: bool = False
    draws_mask: bool = False
    in_place_in_caffe: bool = False
    workspace: Callable = _no_workspace
    cost: Callable = _streamed

    def reads_input(self, layer) -> bool:
        """True when the layer's backward kernel needs its forward inputs."""
        return _apply(self.backward_reads_input, layer)


def _apply(rule, layer) -> bool:
    """A per-layer rule: a bool, or a function of the layer."""
    return rule(layer) if callable(rule) else rule


# -- what launchers share ---------------------------------------------------------------
def _act(rt, layer):
    """Function returning the view of `layer`'s output at launch time."""
    tid = rt.program.act[layer]
    return lambda: rt.view(tid)


def _optional(rt, tid):
    """Function returning the view of tensor `tid`, or None when there is no such tensor."""
    return (lambda: None) if tid is None else (lambda: rt.view(tid))


def _param(rt, layer, suffix):
    return _optional(rt, rt.program.param.get(f"{layer.name}.{suffix}"))


def _buffer(rt, layer, suffix):
    return _optional(rt, rt.program.buffer.get(f"{layer.name}.{suffix}"))


def _param_grad(rt, layer, suffix):
    return _optional(rt, rt.program.pgrad.get(f"{layer.name}.{suffix}"))


@dataclass(frozen=True)
class _Grads:
    """The gradients a backward pass reads and writes: dy (None for the loss), one dx per
    input (None where the input needs no gradient) and whether each dx write accumulates."""
    dy: Callable
    dx: list
    accumulate: list


def _grads(rt, lp) -> _Grads:
    p, layer = rt.program, lp.layer
    dx_ids = [p.grad.get(x) for x in layer.inputs]
    return _Grads(_optional(rt, p.grad.get(layer)), [_optional(rt, d) for d in dx_ids],
                  [d is not None and lp.accumulate.get(d, False) for d in dx_ids])


# -- the ops, each forward beside its backward ------------------------------------------
def _data_forward(rt, layer, update_running):
    y = _act(rt, layer)
    return lambda algos, ws: y().copy_(rt.images)


def _conv_forward(rt, layer, update_running):
    x, y = _act(rt, layer.inputs[0]), _act(rt, layer)
    w, b = _param(rt, layer, "weight"), _param(rt, layer, "bias")
    a = layer.attrs
    return lambda algos, ws: conv_k.forward(
        x(), w(), b(), y(), stride=a["stride"], padding=a["padding"], algo=algos["forward"],
        workspace=ws, precision=rt.precision)


def _conv_backward(rt, lp):
    layer, a, g = lp.layer, lp.layer.attrs, _grads(rt, lp)
    x, w = _act(rt, layer.inputs[0]), _param(rt, layer, "weight")
    dw, db = _param_grad(rt, layer, "weight"), _param_grad(rt, layer, "bias")
    return lambda algos, ws: conv_k.backward(
        x(), w(), g.dy(), g.dx[0](), dw(), db(), stride=a["stride"], padding=a["padding"],
        algo_data=algos.get("backward_data", "implicit"), algo_weight=algos["backward_weight"],
        workspace=ws, accumulate=g.accumulate[0], precision=rt.precision)


def _bn_forward(rt, layer, update_running):
    x, y, saved = _act(rt, layer.inputs[0]), _act(rt, layer), _optional(rt, rt.program.saved[layer])
    w, b = _param(rt, layer, "weight"), _param(rt, layer, "bias")
    mean, var = _buffer(rt, layer, "running_mean"), _buffer(rt, layer, "running_var")
    eps, momentum = layer.attrs.get("eps", 1e-5), layer.attrs.get("momentum", 0.1)

    def launch(algos, ws):
        if rt.predicting:           # eval mode: normalise with the running statistics
            bn_k.forward_eval(x(), w(), b(), y(), mean(), var(), eps=eps)
        else:
            bn_k.forward(x(), w(), b(), y(), mean(), var(), saved(), ws, eps=eps,
                         momentum=momentum, update_running=update_running)
    return launch


def _bn_backward(rt, lp):
    layer, g = lp.layer, _grads(rt, lp)
    x, w, saved = _act(rt, layer.inputs[0]), _param(rt, layer, "weight"), _optional(rt, rt.program.saved[layer])
    dw, db = _param_grad(rt, layer, "weight"), _param_grad(rt, layer, "bias")
    return lambda algos, ws: bn_k.backward(x(), w(), g.dy(), saved(), g.dx[0](), dw(), db(), ws,
                                           accumulate=g.accumulate[0])


def _conv_cost(layer, phase) -> tuple:
    n, k, p, q = layer.shape
    c, r, s = layer.inputs[0].shape[1], *layer.attrs["kernel"]
    macs = n * k * p * q * c * r * s
    x, w, y = 4 * layer.inputs[0].numel, 4 * k * c * r * s, 4 * layer.numel
    if phase == "forward":
        return 2 * macs, x + w + y
    gradients = 1 if spec(layer.inputs[0]).is_data else 2   # the data gradient, if any
    return 2 * macs * gradients, 2 * (x + w + y)


def _bn_workspace(layer, phase) -> int:
    return bn_k.workspace_bytes(tuple(layer.shape), phase)


def _relu_forward(rt, layer, update_running):
    x, y = _act(rt, layer.inputs[0]), _act(rt, layer)
    return lambda algos, ws: act_k.forward(x(), y())


def _relu_backward(rt, lp):
    y, g = _act(rt, lp.layer), _grads(rt, lp)
    return lambda algos, ws: act_k.backward(y(), g.dy(), g.dx[0](), accumulate=g.accumulate[0])


def _pool_forward(rt, layer, update_running):
    x, y, a = _act(rt, layer.inputs[0]), _act(rt, layer), layer.attrs
    return lambda algos, ws: pool_k.forward(x(), y(), mode=a["mode"], kernel=a["kernel"],
                                            stride=a["stride"], padding=a["padding"])


def _pool_backward(rt, lp):
    # max pooling recomputes its argmax from x; average pooling reads neither x nor y, so
    # it runs after both were freed
    layer, a, g = lp.layer, lp.layer.attrs, _grads(rt, lp)
    x = _act(rt, layer.inputs[0]) if _pool_reads_input(layer) else (lambda: None)
    return lambda algos, ws: pool_k.backward(
        x(), None, g.dy(), g.dx[0](), mode=a["mode"], kernel=a["kernel"], stride=a["stride"],
        padding=a["padding"], accumulate=g.accumulate[0])


def _pool_reads_input(layer) -> bool:
    return layer.attrs["mode"] == "max"


def _lrn_forward(rt, layer, update_running):
    x, y, a = _act(rt, layer.inputs[0]), _act(rt, layer), layer.attrs
    return lambda algos, ws: lrn_k.forward(x(), y(), size=a["size"], alpha=a["alpha"],
                                           beta=a["beta"], k=a["k"])


def _lrn_backward(rt, lp):
    layer, a, g = lp.layer, lp.layer.attrs, _grads(rt, lp)
    x = _act(rt, layer.inputs[0])
    return lambda algos, ws: lrn_k.backward(
        x(), g.dy(), g.dx[0](), size=a["size"], alpha=a["alpha"], beta=a["beta"], k=a["k"],
        accumulate=g.accumulate[0])


def _fc_forward(rt, layer, update_running):
    x, y, n = _act(rt, layer.inputs[0]), _act(rt, layer), layer.shape[0]
    w, b = _param(rt, layer, "weight"), _param(rt, layer, "bias")
    return lambda algos, ws: linear_k.forward(x().view(n, -1), w(), b(), y(), precision=rt.precision)


def _fc_backward(rt, lp):
    layer, g, n = lp.layer, _grads(rt, lp), lp.layer.shape[0]
    x, w = _act(rt, layer.inputs[0]), _param(rt, layer, "weight")
    dw, db = _param_grad(rt, layer, "weight"), _param_grad(rt, layer, "bias")

    def flat_dx():
        dx = g.dx[0]()
        return None if dx is None else dx.view(n, -1)
    return lambda algos, ws: linear_k.backward(
        x().view(n, -1), w(), g.dy(), flat_dx(), dw(), db(), accumulate=g.accumulate[0],
        precision=rt.precision)


def _fc_cost(layer, phase) -> tuple:
    n, out = layer.shape
    x = layer.inputs[0].numel // n
    flops, data = 2 * n * x * out, 4 * (n * x + x * out + n * out)
    return (flops, data) if phase == "forward" else (2 * flops, 2 * data)


def _fc_workspace(layer, phase) -> int:
    features = 1
    for s in layer.inputs[0].shape[1:]:
        features *= s
    return linear_k.workspace_bytes(layer.shape[0], features, layer.shape[1], phase)


def _dropout_forward(rt, layer, update_running):
    x, y, p = _act(rt, layer.inputs[0]), _act(rt, layer), layer.attrs["p"]
    it = _optional(rt, rt.program.iteration)
    return lambda algos, ws: dropout_k.forward(
        x(), y(), p=0.0 if rt.predicting else p, seed=rt.seed, iteration=it(),
        layer=layer.index)


def _dropout_backward(rt, lp):
    layer, g = lp.layer, _grads(rt, lp)
    it = _optional(rt, rt.program.iteration)
    return lambda algos, ws: dropout_k.backward(
        g.dy(), g.dx[0](), p=layer.attrs["p"], seed=rt.seed, iteration=it(),
        layer=layer.index, accumulate=g.accumulate[0])


def advance_iteration(rt) -> None:
    """The end of a training step: the iteration counter that masks are drawn from moves
    on, on the device (a captured step advances it on every replay)."""
    if rt.program.iteration is not None:
        dropout_k.advance(rt.view(rt.program.iteration))


def _add_forward(rt, layer, update_running):
    xs, y = [_act(rt, x) for x in layer.inputs], _act(rt, layer)
    return lambda algos, ws: join_k.add_forward([x() for x in xs], y())


def _add_backward(rt, lp):
    g = _grads(rt, lp)
    return lambda algos, ws: join_k.add_backward(g.dy(), [dx() for dx in g.dx],
                                                 accumulate=g.accumulate)


def _concat_forward(rt, layer, update_running):
    xs, y = [_act(rt, x) for x in layer.inputs], _act(rt, layer)
    return lambda algos, ws: join_k.concat_forward([x() for x in xs], y())


def _concat_backward(rt, lp):
    g, channels = _grads(rt, lp), [x.shape[1] for x in lp.layer.inputs]
    return lambda algos, ws: join_k.concat_backward(g.dy(), [dx() for dx in g.dx],
                                                    accumulate=g.accumulate, channels=channels)


def _softmax_forward(rt, layer, update_running):
    x, loss = _act(rt, layer.inputs[0]), _act(rt, layer)
    labels = _optional(rt, rt.program.labels)
    return lambda algos, ws: softmax_k.forward(x(), labels(), loss(), ws)


def _softmax_backward(rt, lp):
    x, g = _act(rt, lp.layer.inputs[0]), _grads(rt, lp)
    labels = _optional(rt, rt.program.labels)
    return lambda algos, ws: softmax_k.backward(x(), labels(), g.dx[0](),
                                                accumulate=g.accumulate[0])


def _softmax_workspace(layer, phase) -> int:
    if phase != "forward":
        return 0
    n, k = layer.inputs[0].shape
    return softmax_k.workspace_bytes(n, k)


SPECS = {
    "data": OpSpec(_data_forward, is_data=True),
    "conv": OpSpec(_conv_forward, _conv_backward, backward_reads_input=True, has_algorithms=True,
                   rebuildable=True, cost=_conv_cost),
    "bn": OpSpec(_bn_forward, _bn_backward, backward_reads_input=True, recomputable=True,
                 saves_statistics=True, counts_batches=True, workspace=_bn_workspace),
    "relu": OpSpec(_relu_forward, _relu_backward, backward_reads_output=True, recomputable=True,
                   in_place_in_caffe=True),
    "pool": OpSpec(_pool_forward, _pool_backward, backward_reads_input=_pool_reads_input,
                   recomputable=True),
    "lrn": OpSpec(_lrn_forward, _lrn_backward, backward_reads_input=True, recomputable=True),
    "fc": OpSpec(_fc_forward, _fc_backward, backward_reads_input=True, workspace=_fc_workspace,
                 cost=_fc_cost),
    "dropout": OpSpec(_dropout_forward, _dropout_backward, recomputable=True,
                      draws_mask=True),
    "add": OpSpec(_add_forward, _add_backward, rebuildable=True),
    "concat": OpSpec(_concat_forward, _concat_backward, rebuildable=True),
    "softmax_loss": OpSpec(_softmax_forward, _softmax_backward, backward_reads_input=True,
                           is_loss=True, workspace=_softmax_workspace),
}


def spec(layer) -> OpSpec:
    """The OpSpec of a layer."""
    return SPECS[layer.op]
