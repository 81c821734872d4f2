"""ReLU fused into the conv (or add, or batch norm) before it: one layer, and passes over
memory fewer.

A ReLU reads its input and writes its output, a pass over memory that moves twice the
activation's bytes, and its backward pass reads y and dy and writes dx, three times. After a
conv that is the only reader of the conv's output, the conv can store max(y, 0) itself
(kernels/conv.py, `relu=True`) and the pre-activation never exists. The pair's backward pass
masks dy by the output (the ReLU's backward, in place) and runs the conv's backward on it
(ops.py, `_conv_backward`). Where the ReLU's output is read by one conv or pool alone, that
reader's backward applies the mask as it stores dx (`x_is_relu_output`: a conv's data
gradient, a pool's gather), so the pair does not pass over dy again (`relu_masked`). The
numbers are the same bits as the separate layers'. A batch norm stores max(y, 0) the same
way (kernels/bn.py, `relu=True`) and masks dy the same way in its backward; that fusion is
planned by default too (`batch_norms`; `plan(..., fuse_bn_relu=False)` turns it off): it is
ResNet's and Inception's every ReLU after a batch norm. A residual add stores max(sum, 0)
too (kernels/join.py, `relu=True`), and its backward masks dy as it copies it to the
inputs' gradients, reading y beside dy in that one pass: ResNet's ReLU after each block
(planned so where the fused net fits its cap unmoved: plan._fits_unmoved).

`fuse_relus(net)` returns a new Net in which each such pair is one layer: the conv's
(add's, batch norm's) name, parameters and attributes, plus `relu=True` (and
`relu_masked=True` where its reader masks); the conv or pool that reads such an output gets
`x_is_relu_output=True`; every other layer is copied as it is (a dropout keeps its index in
`net` as `mask_layer`: its masks are drawn for it, so plans that fuse differently draw the
same ones). The planner plans that net (`plan(..., fuse_relu=True)`,
the default), so its schedule has one tensor and one step per pair where the unfused one
had two: Caffe, the paper's base, ran such ReLUs in place on the conv's output, which is
the same memory. Policies see a fused conv as a conv: its output is a checkpoint, never
dropped as a cheap layer's; a fused add as an add (policy "all" may rebuild it, ReLU and
all).

A batch norm whose output one residual add of two tensors alone reads is made one layer
with that add too (`fuse_residuals`, `fuse_relus(..., residuals=True)`; planned by default
wherever the adds' ReLUs are, `plan(..., fuse_bn_add=False)` turns it off): ResNet's last
batch norm of each block. Its normalisation pass stores bn(x) + residual (and the add's
ReLU, kernels/bn.py `residual`), so the batch norm's output, a tensor of the block's
output size, never exists: its write and the add's read of it go, and one launch each
way. Its backward pass gives the residual the add's gradient (masked by the add's ReLU
where the add masked it), which is also the batch norm's dy: where the residual's gradient
is a first write (ResNet's every one) the batch norm's first backward kernel masks dy and
stores it there as it sums it, so no pass of its own (ops.py, `_bn_residual_backward`).
The fused layer is a batch norm (the batch norm's name,
parameters, statistics and attributes, plus `residual=True` and the add's `relu` and
`relu_masked`) whose second input is the residual, which its backward never reads
(OpSpec.inputs_read): it dies where the add was. The same bits as apart.

A max pool's backward can read the argmax its forward found instead of finding it in x
again (`store_argmaxes`: one byte per window, kept from the forward pass to the backward
pass, kernels/pool.py); that fuses the argmax pass into the forward. Planned where the net
fits its cap unmoved, as the adds' fusions (plan.py; under "offload" and "recompute" where
"liveness" fits it unmoved, so that the policies' peaks keep their order): there the byte
a window costs no move, and x need not live to the backward pass (its dx through a ReLU
before the pool takes the mask from the byte too). Beyond, the backward finds the argmaxes
in x again, into a spare workspace where policy "all" has room (ops.SPARE).
"""
from __future__ import annotations

from ..kernels import pool as pool_k
from ..ops import spec


def fusible(layer, batch_norms: bool = False, adds: bool = True) -> bool:
    """True for a layer that can store a ReLU of its output (OpSpec.stores_relu: a conv,
    an add where `adds`, a batch norm where `batch_norms`) whose output is read by one
    layer alone, a ReLU."""
    return (spec(layer).stores_relu and (batch_norms or layer.op != "bn")
            and (adds or layer.op != "add")
            and len(layer.consumers) == 1 and spec(layer.consumers[0]).is_relu)


def masked_by_reader(layer, batch_norms: bool = False, adds: bool = True) -> bool:
    """True for a fusible layer whose ReLU's output one layer alone reads, and that one
    can store its dx through the ReLU (OpSpec.masks_through_relu: a conv or a pool): the
    reader's backward then stores the ReLU's input gradient directly."""
    readers = layer.consumers[0].consumers if fusible(layer, batch_norms, adds) else []
    return len(readers) == 1 and spec(readers[0]).masks_through_relu


def _copied_attrs(layer) -> dict:
    """`layer`'s attributes for a fused copy of its net: a layer that draws masks keeps
    drawing them for its index in the net as built (ops.py)."""
    attrs = dict(layer.attrs)
    if spec(layer).draws_mask:
        attrs.setdefault("mask_layer", layer.index)
    return attrs


def _fused_attrs(layer, batch_norms: bool, adds: bool) -> dict:
    attrs = _copied_attrs(layer)
    if fusible(layer, batch_norms, adds):
        attrs["relu"] = True
        if masked_by_reader(layer, batch_norms, adds):
            attrs["relu_masked"] = True
    if spec(layer).masks_through_relu and spec(layer.inputs[0]).is_relu \
            and masked_by_reader(layer.inputs[0].inputs[0], batch_norms, adds):
        attrs["x_is_relu_output"] = True
    return attrs


def fuse_relus(net, batch_norms: bool = False, adds: bool = True, residuals: bool = False):
    """`net`, checked, with every fusible conv (and, where `batch_norms`, batch norm; where
    `adds`, add) and its ReLU made one layer (a new Net), and where `residuals` (with
    `adds`) each add that can absorb a batch norm made one layer with it (`fuse_residuals`);
    `net` itself when there is nothing to fuse."""
    net.check()
    if any(fusible(layer, batch_norms, adds) for layer in net.layers):
        net = _fuse_relu_pairs(net, batch_norms, adds)
    return fuse_residuals(net) if residuals and adds else net


def _fuse_relu_pairs(net, batch_norms: bool, adds: bool):
    from ..graph import Net

    fused = Net(net.input_shape, net.classes, net.batch)
    copy = {}                       # layer of `net` -> the layer that stands for it
    for layer in net.layers:
        if spec(layer).is_relu and fusible(layer.inputs[0], batch_norms, adds):
            copy[layer] = copy[layer.inputs[0]]
            continue
        copy[layer] = fused._add_layer(layer.op, layer.name, [copy[x] for x in layer.inputs],
                                       layer.shape, _fused_attrs(layer, batch_norms, adds),
                                       layer.params, layer.buffers)
    fused.loss = copy[net.loss]
    return fused


def absorbed_bn(layer):
    """The batch norm a residual add can absorb (None if none): an input of a two-input add
    of two different tensors that is a batch norm storing no ReLU, read by the add alone,
    whose own input the batch norm alone reads (so its gradient is written once, and in the
    same order as before)."""
    if layer.op != "add" or len(layer.inputs) != 2 or layer.inputs[0] is layer.inputs[1]:
        return None
    for x in layer.inputs:
        if (x.op == "bn" and len(x.consumers) == 1 and not x.attrs.get("relu")
                and not x.attrs.get("residual") and len(x.inputs[0].consumers) == 1):
            return x
    return None


def fuse_residuals(net):
    """`net` with each residual add that can absorb a batch norm (`absorbed_bn`) made one
    layer with it (a new Net; `net` itself where there is none): the batch norm's name,
    parameters and attributes plus `residual=True`, and the add's `relu` and `relu_masked`;
    its inputs the batch norm's input and the add's other input (the residual). It stands
    where the add stood, so the residual is computed before it. Its forward pass stores
    bn(x) + residual (kernels/bn.py `residual`), the batch norm's output never exists;
    its backward pass gives the residual the add's gradient, as the add's did, and runs
    the batch norm's backward on it (ops.py). The same bits as the two layers apart."""
    from ..graph import Net

    bn_of = {layer: absorbed_bn(layer) for layer in net.layers}
    bn_of = {add: bn for add, bn in bn_of.items() if bn is not None}
    if not bn_of:
        return net
    absorbed = set(bn_of.values())
    fused = Net(net.input_shape, net.classes, net.batch)
    copy = {}
    for layer in net.layers:
        if layer in absorbed:
            continue                # made where its add stands
        bn = bn_of.get(layer)
        if bn is None:
            copy[layer] = fused._add_layer(layer.op, layer.name, [copy[x] for x in layer.inputs],
                                           layer.shape, _copied_attrs(layer), layer.params,
                                           layer.buffers)
            continue
        residual = layer.inputs[1] if layer.inputs[0] is bn else layer.inputs[0]
        attrs = dict(bn.attrs, residual=True)
        attrs.update({k: v for k, v in layer.attrs.items() if k in ("relu", "relu_masked")})
        copy[layer] = fused._add_layer("bn", bn.name, [copy[bn.inputs[0]], copy[residual]],
                                       layer.shape, attrs, bn.params, bn.buffers)
    fused.loss = copy[net.loss]
    return fused


def fuses_adds(net) -> bool:
    """True where `net` (as fused) has an add storing its ReLU or a batch norm with its add
    fused into it: the fusions a plan makes only where the net fits unmoved (plan.py)."""
    return any(layer.attrs.get("residual") or (layer.op == "add" and layer.attrs.get("relu"))
               for layer in net.layers)


def saves_argmax(layer) -> bool:
    """True for a max pool that keeps argmax bytes (pool.argmax_bytes: windows of at most
    128 taps whose backward can gather them)."""
    a = layer.attrs
    return layer.op == "pool" and pool_k.argmax_bytes(
        tuple(layer.inputs[0].shape), mode=a["mode"], kernel=a["kernel"], stride=a["stride"],
        padding=a["padding"]) > 0


def store_argmaxes(net):
    """`net` with every max pool that `saves_argmax` marked `saves_argmax=True` (a new
    Net; `net` itself where there is none): its forward pass stores each window's argmax
    for its backward pass (ops.py)."""
    from ..graph import Net

    if not any(saves_argmax(layer) for layer in net.layers):
        return net
    marked = Net(net.input_shape, net.classes, net.batch)
    copy = {}
    for layer in net.layers:
        attrs = _copied_attrs(layer)
        if saves_argmax(layer):
            attrs["saves_argmax"] = True
        copy[layer] = marked._add_layer(layer.op, layer.name, [copy[x] for x in layer.inputs],
                                        layer.shape, attrs, layer.params, layer.buffers)
    marked.loss = copy[net.loss]
    return marked
