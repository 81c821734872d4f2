"""One OpSpec per layer op: everything the scheduler and the runtime need to know about it.

A layer op (graph.OPS) is described in one place: which saved tensors its backward pass
reads, whether the recompute policy may drop and rebuild its output, the workspace its
kernels need, and how its forward and backward kernels are launched, side by side. The
scheduler (sched/) and the runtime consult `SPECS[layer.op]` instead of testing op names, so
adding an op touches graph.py (the builder and shape rule), kernels/<op>.py (the Triton
kernels) and one OpSpec here.

Launchers. `spec.forward(program, layer, update_running)` and `spec.backward(program, lp)`
(`program` the `liveness.Program`, `lp` the layer's backward `liveness.LayerPass`) are called
once, when the Runtime is built; each returns `launch(rt, algos, workspace)`, the function the
runtime calls, passing itself, every time the plan's Launch operation for that pass comes up.
A launcher keeps tensor ids, never the runtime (so nothing refers back to the Runtime and
it is freed with its last reference). It looks its tensors up through `rt.view(tensor id)`
at launch time (so a scheduling bug that reads a freed, dropped or in-flight tensor raises
instead of computing garbage) and reads from `rt`: `precision`, `images` (the batch being
fed), `predicting` and `seed`. `advance_iteration(rt)` ends every training step (the
runtime calls it after the plan's last step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .kernels import act as act_k
from .kernels import bn as bn_k
from .kernels import conv as conv_k
from .kernels import dropout as dropout_k
from .kernels import join as join_k
from .kernels import linear as linear_k
from .kernels import lrn as lrn_k
from .kernels import pool as pool_k
from .kernels import sgd as sgd_k
from .kernels import softmax as softmax_k


SPARE = "spare_workspace"      # Launch.algos value of a pass given its spare workspace


def _no_workspace(layer, phase) -> int:
    return 0


def _saves_nothing(layer):
    return None


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
    backward_reads_output  the backward kernel reads the layer's own output (ReLU, and a
                           conv, batch norm or add with a ReLU fused into it: a bool, or a
                           function of the layer)
    recomputable           cheap enough to drop and rebuild in the backward pass (§3.4)
    rebuildable            not cheap, but its output is a pure function of its inputs and
                           parameters, which no step updates before the backward pass reads
                           it: policy "all" may drop and rebuild it where the step-time
                           model says moving it costs more (conv, add, concat)
    is_loss                the network's loss: its output lives across iterations, it reads
                           the labels, and no gradient flows into it
    saves                  layer -> (shape, dtype) of the tensor its forward pass writes for
                           its backward pass alone, or None: batch norm's statistics, max
                           pooling's argmax bytes (liveness.Program.saved; the tensor lives
                           from the forward pass to the backward pass, counted in the plan)
    saves_statistics       writes running buffers (batch norm); a rebuild (update_running
                           False) reads its saved statistics instead
    counts_batches         its torch twin keeps a "num_batches_tracked" counter (batch norm),
                           which tinysn does not use and load_params skips
    is_data                the data layer: its output is the batch, it comes first in a net
    has_algorithms         its kernels come in several algorithms whose workspaces differ
                           (conv): the planner picks one per step (sched/workspace.py)
    draws_mask             draws new random numbers every iteration from (seed, the program's
                           device iteration counter, layer index): its passes read the counter
    in_place_in_caffe      Caffe (the paper's base) runs it in place on its input, so the
                           tensor the paper offloads after a checkpoint conv is its output
    is_relu                a ReLU: sched/fuse.py fuses it into the conv before it
    stores_relu            its forward kernel can store max(y, 0) itself, a ReLU after it
                           fused into it (conv, batch norm, add: `relu=True`)
    masks_through_relu     its backward can store dx through the backward of the ReLU whose
                           output its input is (`x_is_relu_output`: conv, pool)
    backward_in_place      its backward kernel writes each element of dx from the same
                           element of dy (and of what it saved), so dx may take over dy's block
                           when the pass reads dy for the last time (liveness.LayerPass's
                           `in_place`): ReLU, batch norm, dropout and add
    workspace              (layer, "forward" | "backward" | "recompute") -> bytes of scratch
                           its kernels need (conv's depend on the algorithm:
                           sched/workspace.py); "recompute": a rebuild of the output, which
                           the forward launcher runs with update_running False
    cost                   (layer, "forward" | "backward") -> (flops, bytes moved to and
                           from device memory): the planner's step-time model (sched/timing.py;
                           a rebuild costs a forward pass)
    launches               (layer, "forward" | "backward" | "recompute", algos) -> Triton
                           kernels its launcher runs (SGD updates not counted): the host's
                           share of an eager step in the step-time model
    spare_workspace        (layer, "forward" | "backward") -> bytes of scratch that make the
                           pass faster where the plan has room for them (0: none): policy
                           "all" allocates them when the largest free run holds them and
                           marks the step's algos {phase: SPARE} (the backward of a max
                           pool that saves no argmax: every window's argmax found once, not
                           once per cell)
    forward, backward      launcher factories (module docstring); backward None: no backward
    """
    forward: Callable
    backward: Callable | None = None
    backward_reads_input: bool | Callable = False
    backward_reads_output: bool | Callable = False
    recomputable: bool = False
    rebuildable: bool = False
    is_loss: bool = False
    saves: Callable = _saves_nothing
    saves_statistics: bool = False
    counts_batches: bool = False
    is_data: bool = False
    has_algorithms: bool = False
    draws_mask: bool = False
    in_place_in_caffe: bool = False
    is_relu: bool = False
    stores_relu: bool = False
    masks_through_relu: bool = False
    backward_in_place: bool = False
    workspace: Callable = _no_workspace
    cost: Callable = _streamed
    launches: Callable = lambda layer, phase, algos: 1
    spare_workspace: Callable = _no_workspace

    def reads_input(self, layer) -> bool:
        """True when the layer's backward kernel needs its forward inputs."""
        return _apply(self.backward_reads_input, layer)

    def inputs_read(self, layer) -> list:
        """The forward inputs the layer's backward kernels read: none, or (`reads_input`)
        all but a residual fused into it (sched/fuse.py: the add's backward read neither
        of its inputs)."""
        if not self.reads_input(layer):
            return []
        return list(layer.inputs[:1] if _residual(layer) else layer.inputs)

    def reads_output(self, layer) -> bool:
        """True when the layer's backward kernel needs its own output."""
        return _apply(self.backward_reads_output, layer)


def _apply(rule, layer) -> bool:
    """A per-layer rule: a bool, or a function of the layer."""
    return rule(layer) if callable(rule) else rule


# -- what launchers share ---------------------------------------------------------------
def _act(program, layer):
    """Function of the runtime returning the view of `layer`'s output at launch time."""
    return _optional(program.act[layer])


def _optional(tid):
    """Function of the runtime returning the view of tensor `tid`, or None when there is no
    such tensor."""
    return (lambda rt: None) if tid is None else (lambda rt: rt.view(tid))


def _param(program, layer, suffix):
    return _optional(program.param.get(f"{layer.name}.{suffix}"))


def _buffer(program, layer, suffix):
    return _optional(program.buffer.get(f"{layer.name}.{suffix}"))


def _param_grad(program, layer, suffix):
    return _optional(program.pgrad.get(f"{layer.name}.{suffix}"))


@dataclass(frozen=True)
class _Grads:
    """The gradients a backward pass reads and writes: dy (None for the loss), one dx per
    input (None where the input needs no gradient) and whether each dx write accumulates."""
    dy: Callable
    dx: list
    accumulate: list


def _grads(program, lp) -> _Grads:
    dx_ids = [program.grad.get(x) for x in lp.layer.inputs]
    return _Grads(_optional(program.grad.get(lp.layer)), [_optional(d) for d in dx_ids],
                  [d is not None and lp.accumulate.get(d, False) for d in dx_ids])


# -- the ops, each forward beside its backward ------------------------------------------
def _data_forward(program, layer, update_running):
    y = _act(program, layer)
    return lambda rt, algos, ws: y(rt).copy_(rt.images)


def _fused_relu(layer) -> bool:
    """True for a conv, batch norm or add that a ReLU was fused into (sched/fuse.py): its
    output is the ReLU's."""
    return layer.attrs.get("relu", False)


def _conv_act(program, layer):
    """`_act` for a conv's input or output: the view channels-last where the runtime's plan
    stores `layer`'s output so (Plan.channels_last, sched/channels_last.py)."""
    view = _act(program, layer)

    def act(rt):
        t = view(rt)
        return conv_k.channels_last_view(t) if layer.name in rt.plan.channels_last else t
    return act


def _conv_forward(program, layer, update_running):
    x, y = _conv_act(program, layer.inputs[0]), _conv_act(program, layer)
    w, b = _param(program, layer, "weight"), _param(program, layer, "bias")
    a, relu = layer.attrs, _fused_relu(layer)
    return lambda rt, algos, ws: conv_k.forward(
        x(rt), w(rt), b(rt), y(rt), stride=a["stride"], padding=a["padding"],
        algo=algos["forward"], workspace=ws, precision=rt.precision, relu=relu)


def _masks_dy(layer) -> bool:
    """True for a fused conv, batch norm or add whose backward masks dy itself
    (sched/fuse.py: where one conv or pool alone reads its output, that reader's backward
    did)."""
    return _fused_relu(layer) and not layer.attrs.get("relu_masked", False)


def _fused_relu_dy(program, layer, g):
    """rt -> the pass's dy (`g.dy`), first masked in place by the backward of a ReLU fused
    into the layer where the layer's own backward masks it (`_masks_dy`; dy is read by
    this pass alone, so it may hold the layer's own output gradient)."""
    y = _act(program, layer) if _masks_dy(layer) else None

    def dy(rt):
        grad = g.dy(rt)
        if y is not None:
            act_k.backward(y(rt), grad, grad)
        return grad
    return dy


def _conv_backward(program, lp):
    """A fused ReLU's backward first masks dy in place (`_fused_relu_dy`), then the conv's
    backward runs on it; dx goes through the ReLU before the conv where x is that ReLU's
    output (sched/fuse.py)."""
    layer, a, g = lp.layer, lp.layer.attrs, _grads(program, lp)
    x, w = _conv_act(program, layer.inputs[0]), _param(program, layer, "weight")
    dw, db = _param_grad(program, layer, "weight"), _param_grad(program, layer, "bias")
    dy = _fused_relu_dy(program, layer, g)
    through_relu = a.get("x_is_relu_output", False)

    def launch(rt, algos, ws):
        conv_k.backward(
            x(rt), w(rt), dy(rt), g.dx[0](rt), dw(rt), db(rt), stride=a["stride"],
            padding=a["padding"], algo_data=algos.get("backward_data", "implicit"),
            algo_weight=algos["backward_weight"], workspace=ws, accumulate=g.accumulate[0],
            precision=rt.precision, x_is_relu_output=through_relu)
    return launch


def _residual(layer) -> bool:
    """True for a batch norm a residual add was fused into (sched/fuse.py): its second
    input is the residual, its output the add's."""
    return layer.attrs.get("residual", False)


def _bn_forward(program, layer, update_running):
    x, y, saved = _act(program, layer.inputs[0]), _act(program, layer), \
        _optional(program.saved.get(layer))
    res = _act(program, layer.inputs[1]) if _residual(layer) else _optional(None)
    w, b = _param(program, layer, "weight"), _param(program, layer, "bias")
    mean, var = _buffer(program, layer, "running_mean"), _buffer(program, layer, "running_var")
    eps, momentum = layer.attrs.get("eps", 1e-5), layer.attrs.get("momentum", 0.1)
    relu = _fused_relu(layer)

    def launch(rt, algos, ws):
        if rt.predicting:           # eval mode: normalise with the running statistics
            bn_k.forward_eval(x(rt), w(rt), b(rt), y(rt), mean(rt), var(rt), eps=eps,
                              relu=relu, residual=res(rt))
        elif not update_running:    # a rebuild: the statistics its forward pass saved
            bn_k.rebuild(x(rt), w(rt), b(rt), y(rt), saved(rt), relu=relu, residual=res(rt))
        else:
            bn_k.forward(x(rt), w(rt), b(rt), y(rt), mean(rt), var(rt), saved(rt), ws, eps=eps,
                         momentum=momentum, relu=relu, residual=res(rt), skip=rt.gate)
    return launch


def _bn_backward(program, lp):
    """As a conv's (`_conv_backward`): a fused ReLU's backward first masks dy in place; with
    a residual add fused in, see `_bn_residual_backward`."""
    layer, g = lp.layer, _grads(program, lp)
    x, w = _act(program, layer.inputs[0]), _param(program, layer, "weight")
    saved = _optional(program.saved.get(layer))
    dw, db = _param_grad(program, layer, "weight"), _param_grad(program, layer, "bias")
    if _residual(layer):
        return _bn_residual_backward(program, layer, g, x, w, saved, dw, db)
    dy = _fused_relu_dy(program, layer, g)
    return lambda rt, algos, ws: bn_k.backward(
        x(rt), w(rt), dy(rt), saved(rt), g.dx[0](rt), dw(rt), db(rt), ws,
        accumulate=g.accumulate[0])


def _bn_residual_backward(program, layer, g, x, w, saved, dw, db):
    """A batch norm with a residual add fused into it: the add's gradient (dy, through the
    add's fused ReLU where this pass masks it) is the residual's gradient and the batch
    norm's dy. Where the residual's gradient is a first write, the batch norm's first
    kernel masks dy and stores it there as it sums it (bn.backward's `dy_out`), and its
    last reads it there: no pass of its own. Else (the residual's gradient accumulates, or
    there is none) kernels/join.py's fan-out masks dy in place and adds it to the
    residual's gradient first, and the batch norm reads dy."""
    y = _act(program, layer) if _masks_dy(layer) else _optional(None)

    def launch(rt, algos, ws):
        grad, d_res, mask = g.dy(rt), g.dx[1](rt), y(rt)
        if d_res is not None and not g.accumulate[1]:
            if mask is None and d_res.data_ptr() == grad.data_ptr():
                d_res = None                    # dy's block already is the residual's
        else:
            outs = ([grad] if mask is not None else []) + ([d_res] if d_res is not None else [])
            if outs:
                join_k.add_backward(grad, outs, y=mask, accumulate=[d is d_res for d in outs])
            d_res = mask = None
        bn_k.backward(x(rt), w(rt), grad, saved(rt), g.dx[0](rt), dw(rt), db(rt), ws,
                      accumulate=g.accumulate[0], relu_output=mask, dy_out=d_res)
    return launch


def _conv_launches(layer, phase, algos) -> int:
    """One or two kernels per algorithm the pass runs (conv_k.LAUNCHES), and the bias
    gradient's in a backward pass (conv_k.bias_launches: none or only its partial sums' sum
    where a pass sums it on the way, else one or two of its own)."""
    algos = algos or {}
    own = sum(conv_k.LAUNCHES[(p, a)] for p, a in algos.items())
    if phase != "backward":
        return own
    own += _masks_dy(layer)                     # the fused ReLU's backward
    if "bias" not in layer.params:
        return own
    x_shape, w_shape = tuple(layer.inputs[0].shape), tuple(layer.params["weight"])
    return own + conv_k.bias_launches(
        algos.get("backward_data"), algos.get("backward_weight"), x_shape, w_shape,
        tuple(layer.attrs["stride"]), tuple(layer.attrs["padding"]),
        has_dx="backward_data" in algos, has_dw="backward_weight" in algos)


def _conv_cost(layer, phase) -> tuple:
    n, k, p, q = layer.shape
    c, r, s = layer.inputs[0].shape[1], *layer.attrs["kernel"]
    macs = n * k * p * q * c * r * s
    x, w, y = 4 * layer.inputs[0].numel, 4 * k * c * r * s, 4 * layer.numel
    if phase == "forward":
        return 2 * macs, x + w + y
    gradients = 1 if spec(layer.inputs[0]).is_data else 2   # the data gradient, if any
    relu = 3 * y if _masks_dy(layer) else 0        # a fused ReLU's backward reads y, dy: dy
    relu += x if layer.attrs.get("x_is_relu_output") else 0     # dx's store reads x's mask
    return 2 * macs * gradients, 2 * (x + w + y) + relu


def _bn_saves(layer):
    """Batch norm's saved statistics: [0] the batch mean, [1] 1 / sqrt(var + eps)."""
    return (2, layer.shape[1]), torch.float32


def _bn_workspace(layer, phase) -> int:
    if phase == "recompute":        # bn_k.rebuild: the normalisation alone
        return 0
    return bn_k.workspace_bytes(tuple(layer.shape), phase)


def _masking_cost(mask_floats: int):
    """The cost of a layer that may store a fused ReLU: an elementwise layer's
    (`_streamed`), and in a backward pass that masks dy, one flop and `mask_floats` more
    floats moved per element."""
    def cost(layer, phase) -> tuple:
        flops, nbytes = _streamed(layer, phase)
        if phase == "backward" and _masks_dy(layer):
            return flops + layer.numel, nbytes + mask_floats * 4 * layer.numel
        return flops, nbytes
    return cost


# a batch norm masks dy in a pass of its own (it reads y and dy and writes dy); an add reads
# y beside the dy it fans out
_bn_alone_cost, _add_cost = _masking_cost(3), _masking_cost(1)


def _bn_cost(layer, phase) -> tuple:
    """A batch norm's (`_masking_cost`); with a residual add fused in, its backward moves a
    batch norm's backward's bytes plus the residual's gradient, written by its first
    kernel, and y, read there where it masks (`_bn_residual_backward`)."""
    if phase == "backward" and _residual(layer):
        return layer.numel, 4 * layer.numel * (2 * 2 + 1 + _masks_dy(layer))
    return _bn_alone_cost(layer, phase)


def _bn_launches(layer, phase, algos) -> int:
    """Three kernels each way (a rebuild: the normalisation alone), and in a backward pass
    a fused ReLU's backward where this pass masks dy (a fused residual add's mask goes in
    the first kernel where its residual's gradient is a first write: ResNet's every one)."""
    if phase == "recompute":
        return 1
    return 3 + (phase == "backward" and _masks_dy(layer) and not _residual(layer))


def _relu_forward(program, layer, update_running):
    x, y = _act(program, layer.inputs[0]), _act(program, layer)
    return lambda rt, algos, ws: act_k.forward(x(rt), y(rt))


def _relu_backward(program, lp):
    y, g = _act(program, lp.layer), _grads(program, lp)
    return lambda rt, algos, ws: act_k.backward(y(rt), g.dy(rt), g.dx[0](rt),
                                                accumulate=g.accumulate[0])


def _pool_forward(program, layer, update_running):
    # a max pool that saves its argmax stores it in its training forward (a rebuild keeps
    # the bytes its forward pass stored; eval mode has no backward)
    x, y, a = _act(program, layer.inputs[0]), _act(program, layer), layer.attrs
    argmax = _optional(program.saved.get(layer))

    def launch(rt, algos, ws):
        store = update_running and not rt.predicting
        pool_k.forward(x(rt), y(rt), mode=a["mode"], kernel=a["kernel"], stride=a["stride"],
                       padding=a["padding"], argmax=argmax(rt) if store else None)
    return launch


def _pool_backward(program, lp):
    # max pooling reads the argmax bytes its forward saved, or finds the argmax in x again
    # (into the spare workspace, when the plan gives it one); average pooling reads neither
    # x nor y (but for the mask of a ReLU before it), so it may run after both were freed
    layer, a, g = lp.layer, lp.layer.attrs, _grads(program, lp)
    x = _act(program, layer.inputs[0]) if _pool_reads_input(layer) else _optional(None)
    argmax = _optional(program.saved.get(layer))
    return lambda rt, algos, ws: pool_k.backward(
        x(rt), None, g.dy(rt), g.dx[0](rt), mode=a["mode"], kernel=a["kernel"],
        stride=a["stride"], padding=a["padding"], accumulate=g.accumulate[0], workspace=ws,
        argmax=argmax(rt), x_is_relu_output=a.get("x_is_relu_output", False))


def _pool_saves(layer):
    """The argmax bytes of a max pool the planner lets save them (`saves_argmax`,
    sched/fuse.py), one per window of its output (kernels/pool.py)."""
    return (tuple(layer.shape), torch.uint8) if layer.attrs.get("saves_argmax") else None


def _pool_spare_workspace(layer, phase) -> int:
    if phase != "backward" or layer.attrs.get("saves_argmax"):
        return 0
    a = layer.attrs
    return pool_k.argmax_workspace_bytes(tuple(layer.inputs[0].shape), mode=a["mode"],
                                         kernel=a["kernel"], stride=a["stride"],
                                         padding=a["padding"])


def _pool_launches(layer, phase, algos) -> int:
    return 2 if (algos or {}).get(phase) == SPARE else 1


def _pool_reads_input(layer) -> bool:
    """Max pooling without saved argmax bytes finds the argmax in x; a pool whose dx goes
    through the ReLU before it (sched/fuse.py: the pool is that ReLU's one reader, so its
    dx does not accumulate) reads x's mask, unless argmax bytes give it."""
    a = layer.attrs
    return pool_k.reads_input(a["mode"], bool(a.get("saves_argmax")),
                              a.get("x_is_relu_output", False))


def _lrn_forward(program, layer, update_running):
    x, y, a = _act(program, layer.inputs[0]), _act(program, layer), layer.attrs
    return lambda rt, algos, ws: lrn_k.forward(x(rt), y(rt), size=a["size"], alpha=a["alpha"],
                                               beta=a["beta"], k=a["k"])


def _lrn_backward(program, lp):
    layer, a, g = lp.layer, lp.layer.attrs, _grads(program, lp)
    x = _act(program, layer.inputs[0])
    return lambda rt, algos, ws: lrn_k.backward(
        x(rt), g.dy(rt), g.dx[0](rt), size=a["size"], alpha=a["alpha"], beta=a["beta"], k=a["k"],
        accumulate=g.accumulate[0])


def _fc_forward(program, layer, update_running):
    x, y, n = _act(program, layer.inputs[0]), _act(program, layer), layer.shape[0]
    w, b = _param(program, layer, "weight"), _param(program, layer, "bias")
    return lambda rt, algos, ws: linear_k.forward(x(rt).view(n, -1), w(rt), b(rt), y(rt),
                                                  precision=rt.precision)


def _fc_backward(program, lp):
    """Where the weight's update is fused (Program.fused_updates), its gradient goes into
    the weight's SGD step in the weight-gradient GEMM (kernels/linear.py) with the
    settings the SGD launches take (the pool's rate, the batch check's gate)."""
    layer, g, n = lp.layer, _grads(program, lp), lp.layer.shape[0]
    x, w = _act(program, layer.inputs[0]), _param(program, layer, "weight")
    dw, db = _param_grad(program, layer, "weight"), _param_grad(program, layer, "bias")
    fused = f"{layer.name}.weight" in program.fused_updates
    buf = _optional(program.momentum.get(f"{layer.name}.weight"))

    def flat_dx(rt):
        dx = g.dx[0](rt)
        return None if dx is None else dx.view(n, -1)

    def step(rt):
        return sgd_k.Update(buf(rt), rt.lr_slot, rt.momentum, rt.weight_decay,
                            rt.gate) if fused else None
    return lambda rt, algos, ws: linear_k.backward(
        x(rt).view(n, -1), w(rt), g.dy(rt), flat_dx(rt), dw(rt), db(rt),
        accumulate=g.accumulate[0], precision=rt.precision, update=step(rt))


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


def _mask_layer(layer) -> int:
    """The layer index a mask is drawn for: the layer's in the net as built, which
    sched/fuse.py keeps (`mask_layer`) where the fused net numbers its layers anew, so that
    every plan of a net draws the same masks, its ReLUs fused or apart."""
    return layer.attrs.get("mask_layer", layer.index)


def _dropout_forward(program, layer, update_running):
    x, y, p = _act(program, layer.inputs[0]), _act(program, layer), layer.attrs["p"]
    it = _optional(program.iteration)
    return lambda rt, algos, ws: dropout_k.forward(
        x(rt), y(rt), p=0.0 if rt.predicting else p, seed=rt.seed, iteration=it(rt),
        layer=_mask_layer(layer))


def _dropout_backward(program, lp):
    layer, g = lp.layer, _grads(program, lp)
    it = _optional(program.iteration)
    return lambda rt, algos, ws: dropout_k.backward(
        g.dy(rt), g.dx[0](rt), p=layer.attrs["p"], seed=rt.seed, iteration=it(rt),
        layer=_mask_layer(layer), accumulate=g.accumulate[0])


def advance_iteration(rt) -> None:
    """The end of a training step: the iteration counter that masks are drawn from moves
    on, on the device (a captured step advances it on every replay; not after a bad batch:
    `rt.gate`)."""
    if rt.program.iteration is not None:
        dropout_k.advance(rt.view(rt.program.iteration), skip=rt.gate)


def _add_forward(program, layer, update_running):
    xs, y, relu = [_act(program, x) for x in layer.inputs], _act(program, layer), \
        _fused_relu(layer)
    return lambda rt, algos, ws: join_k.add_forward([x(rt) for x in xs], y(rt), relu=relu)


def _add_backward(program, lp):
    """The fan-out of dy to the inputs' gradients; a fused ReLU's backward (where this pass
    masks dy, `_masks_dy`) goes in the same pass: the kernel reads y beside dy, and dy is
    not written first, as a conv's or batch norm's fused ReLU writes it."""
    layer, g = lp.layer, _grads(program, lp)
    y = _act(program, layer) if _masks_dy(layer) else _optional(None)
    return lambda rt, algos, ws: join_k.add_backward(g.dy(rt), [dx(rt) for dx in g.dx],
                                                     accumulate=g.accumulate, y=y(rt))


def _concat_forward(program, layer, update_running):
    xs, y = [_act(program, x) for x in layer.inputs], _act(program, layer)
    return lambda rt, algos, ws: join_k.concat_forward([x(rt) for x in xs], y(rt))


def _concat_backward(program, lp):
    g, channels = _grads(program, lp), [x.shape[1] for x in lp.layer.inputs]
    return lambda rt, algos, ws: join_k.concat_backward(g.dy(rt), [dx(rt) for dx in g.dx],
                                                        accumulate=g.accumulate, channels=channels)


def _softmax_forward(program, layer, update_running):
    x, loss = _act(program, layer.inputs[0]), _act(program, layer)
    labels = _optional(program.labels)
    return lambda rt, algos, ws: softmax_k.forward(x(rt), labels(rt), loss(rt), ws)


def _softmax_backward(program, lp):
    x, g = _act(program, lp.layer.inputs[0]), _grads(program, lp)
    labels = _optional(program.labels)
    return lambda rt, algos, ws: softmax_k.backward(x(rt), labels(rt), g.dx[0](rt),
                                                    accumulate=g.accumulate[0])


def _softmax_workspace(layer, phase) -> int:
    if phase != "forward":
        return 0
    n, k = layer.inputs[0].shape
    return softmax_k.workspace_bytes(n, k)


SPECS = {
    "data": OpSpec(_data_forward, is_data=True, launches=lambda layer, phase, algos: 0),
    "conv": OpSpec(_conv_forward, _conv_backward, backward_reads_input=True, has_algorithms=True,
                   backward_reads_output=_masks_dy, rebuildable=True, cost=_conv_cost,
                   launches=_conv_launches, stores_relu=True, masks_through_relu=True),
    # statistics, their finalisation, the normalisation (a rebuild: the normalisation
    # alone, from the saved statistics); backward: partial sums, their finalisation, dx
    "bn": OpSpec(_bn_forward, _bn_backward, backward_reads_input=True, recomputable=True,
                 backward_reads_output=_masks_dy, saves=_bn_saves, saves_statistics=True,
                 counts_batches=True,
                 workspace=_bn_workspace, backward_in_place=True, launches=_bn_launches,
                 cost=_bn_cost, stores_relu=True),
    "relu": OpSpec(_relu_forward, _relu_backward, backward_reads_output=True, recomputable=True,
                   in_place_in_caffe=True, backward_in_place=True, is_relu=True),
    "pool": OpSpec(_pool_forward, _pool_backward, backward_reads_input=_pool_reads_input,
                   recomputable=True, saves=_pool_saves, spare_workspace=_pool_spare_workspace,
                   launches=_pool_launches, masks_through_relu=True),
    "lrn": OpSpec(_lrn_forward, _lrn_backward, backward_reads_input=True, recomputable=True),
    "fc": OpSpec(_fc_forward, _fc_backward, backward_reads_input=True, workspace=_fc_workspace,
                 cost=_fc_cost,                                  # backward: dx and dw GEMMs
                 launches=lambda layer, phase, algos: 2 if phase == "backward" else 1),
    "dropout": OpSpec(_dropout_forward, _dropout_backward, recomputable=True,
                      draws_mask=True, backward_in_place=True),
    "add": OpSpec(_add_forward, _add_backward, rebuildable=True, backward_in_place=True,
                  backward_reads_output=_masks_dy, cost=_add_cost, stores_relu=True),
    "concat": OpSpec(_concat_forward, _concat_backward, rebuildable=True),
    "softmax_loss": OpSpec(_softmax_forward, _softmax_backward, backward_reads_input=True,
                           is_loss=True, workspace=_softmax_workspace,   # rows, their mean
                           launches=lambda layer, phase, algos: 2 if phase == "forward" else 1),
}


def spec(layer) -> OpSpec:
    """The OpSpec of a layer."""
    return SPECS[layer.op]
