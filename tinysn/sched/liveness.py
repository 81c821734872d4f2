"""Liveness analysis (paper §3.2): which tensors each layer pass reads and writes, and when
each dies.

The training iteration is first written down as a *logical program*, independent of any
policy: a list of `LayerPass`es, one forward pass per layer in route order, then one
backward pass per layer in reverse order (the SGD update of a layer's parameters is part of
its backward pass, since no parameter is used again in the iteration once its layer's
backward has run, or of a later one's where small updates share a launch: `_update_groups`).
Each pass lists the tensors it reads and writes. From that, every tensor's uses give its
live range, and the in/out live sets of every pass follow: a tensor is live from the pass
that writes it first to the last pass that reads it. The planner
(plan.py) turns each pass into one or more executed `Step`s.

Data parallel (`data_parallel=True`, tinysn/distributed.py): parameter gradients are
all-reduced across ranks while the backward pass goes on, in buckets: consecutive layers in
backward order, closed once they hold `bucket_bytes` of gradients (`group_buckets`). A
bucket's collective starts after the backward pass of its last layer, which therefore also
reads the bucket's other gradients; the updates of all its layers move to the backward pass
`UPDATE_LAG` passes after that one (or the last pass), which reads the gradients again:
their live ranges, and with them every plan's peak, cover the all-reduce in flight.

In-place gradients: a backward pass whose op writes dx element by element from dy
(OpSpec.backward_in_place: ReLU, batch norm, dropout, add) and reads dy for the last time
writes its first freshly written dx into dy's block (`LayerPass.in_place`). Batch norm's
backward then holds two of x, dy and dx instead of three; on ResNet-50 at batch 897 that is
2.9 GB of a 12 GiB cap at every layer-1 batch norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels import sgd as sgd_k
from ..ops import spec
from ..units import parse_bytes
from . import route

UPDATE_LAG = 2   # data parallel: backward passes between a bucket's start and its updates
                 # (its all-reduce overlaps that many kernels; its gradients live that long)
BUCKET_BYTES = 25 << 20   # data parallel: gradient bytes that close a bucket (DDP's default)


def _update_groups(layers) -> list:
    """Positions in `layers` (per layer with SGD launches to make, in backward order: how
    many tensors they update, and whether all of the layer's parameters are vectors)
    grouped into SGD updates that share launches (sgd.update_many: PER_LAUNCH tensors
    each), each group updated at its last layer's backward pass. A layer whose parameters
    are all vectors (a batch norm's scale and shift: a few KB) waits for the next other
    layer with room left in its launch, oldest first; no other layer waits, so no
    weight's gradient lives longer (an fc layer whose weight steps in its own kernel,
    `fused_update_names`, still has a weight: its bias does not wait). Vector layers left
    at the end share launches among themselves. ResNet-50: each batch norm goes with the
    conv before it in forward order (where a block's last batch norm and its shortcut's
    meet first, the shortcut's conv takes one, the block's conv the other): 107 launches
    -> 54."""
    groups, waiting = [], []
    for i, (count, vectors) in enumerate(layers):
        if vectors and count < sgd_k.PER_LAUNCH:
            waiting.append(i)
            continue
        room, taken = sgd_k.PER_LAUNCH - count, []
        for j in list(waiting):
            if layers[j][0] <= room:
                room -= layers[j][0]
                taken.append(j)
                waiting.remove(j)
        groups.append(taken + [i])
    run, held = [], 0
    for j in waiting:
        if run and held + layers[j][0] > sgd_k.PER_LAUNCH:
            groups.append(run)
            run, held = [], 0
        run.append(j)
        held += layers[j][0]
    return groups + ([run] if run else [])


def fused_update_names(order, fuse_updates: bool) -> frozenset:
    """The parameters whose SGD step runs in their layer's weight-gradient kernel, so that
    their gradient is never stored (`fuse_updates`): every fc layer's weight
    (kernels/linear.py, backward's `update`)."""
    if not fuse_updates:
        return frozenset()
    return frozenset(f"{layer.name}.weight" for layer in order
                     if layer.op == "fc" and "weight" in layer.params)


def _launch_items(layer, fused) -> tuple:
    """(how many of `layer`'s parameters an SGD launch updates: those not in `fused`,
    whether all its parameters are vectors): `_update_groups`' view of a layer."""
    count = sum(f"{layer.name}.{suffix}" not in fused for suffix in layer.params)
    return count, all(len(shape) == 1 for shape in layer.params.values())


def groups_updates(net, fuse_updates: bool = False) -> bool:
    """True where a Program of `net` with `group_updates` puts two layers' SGD updates in
    one launch (`_update_groups`): where grouping changes the plan at all."""
    order = route.forward_order(net)
    fused = fused_update_names(order, fuse_updates)
    items = [i for i in (_launch_items(layer, fused) for layer in reversed(order)) if i[0]]
    return any(len(group) > 1 for group in _update_groups(items))


def parse_bucket_bytes(value) -> int:
    """`value` (bytes, or a string like '25MiB') as a positive byte count; one clear
    ValueError naming bucket_bytes otherwise."""
    try:
        return parse_bytes(value)
    except ValueError:
        raise ValueError(f"bucket_bytes must be a positive number of bytes or a string like "
                         f"'25MiB', got {value!r}") from None


def group_buckets(sizes, bucket_bytes: int) -> list:
    """Split `sizes`, (item, gradient bytes) pairs in backward order, into buckets: lists of
    consecutive items, each closed as soon as it holds at least `bucket_bytes` (the last
    one may hold less). Fewer, larger collectives; a bucket's all-reduce can start only
    when its last item's gradients exist, so a bucket never skips an item."""
    buckets, current, held = [], [], 0
    for item, nbytes in sizes:
        current.append(item)
        held += nbytes
        if held >= bucket_bytes:
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class TensorInfo:
    """One logical tensor of the iteration."""
    id: int
    name: str
    shape: tuple
    dtype: torch.dtype
    kind: str            # data | grad | param | state | workspace
    layer: object = None  # the Layer that owns it (None: labels, the counter, the check)
    # act | grad | saved | param | pgrad | momentum | buffer | labels | loss | counter | check
    role: str = ""
    persistent: bool = False  # lives across iterations (parameters, optimizer state, ...)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class LayerPass:
    """One layer's forward or backward pass in the logical program: what it reads, what it
    writes, which gradient writes accumulate. `index` is its place in `Program.passes`."""
    index: int
    layer: object
    phase: str                      # "forward" | "backward"
    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    accumulate: dict = field(default_factory=dict)   # tensor id -> bool, for gradient writes
    in_place: tuple | None = None   # (dx, dy): dx takes over dy's block (module docstring)


class Program:
    """The logical program of one training iteration of `net` and its tensors."""

    def __init__(self, net, momentum: float = 0.0, data_parallel: bool = False,
                 bucket_bytes: int = BUCKET_BYTES, in_place_gradients: bool = True,
                 group_updates: bool = False, fuse_updates: bool = False):
        net.check()
        self.group_updates = group_updates
        self.net = net
        self.momentum_value = momentum
        self.data_parallel = data_parallel
        self.bucket_bytes = bucket_bytes
        self.order = route.forward_order(net)
        # parameters stepped by their weight-gradient kernel, no gradient stored (single
        # process: an all-reduce needs the gradient)
        self.fused_updates = fused_update_names(self.order, fuse_updates and not data_parallel)
        self.requires_grad = set()   # layers whose output's gradient reaches a parameter
        for layer in self.order:
            if layer.params or any(x in self.requires_grad for x in layer.inputs):
                self.requires_grad.add(layer)
        self.tensors: list[TensorInfo] = []
        self.act, self.grad, self.saved = {}, {}, {}
        self.param, self.pgrad, self.momentum, self.buffer = {}, {}, {}, {}
        self._make_tensors(momentum)
        self.passes: list[LayerPass] = []
        self._make_passes()
        self.buckets, self.reduces, self.updates = self._place_updates()
        self.uses = self._uses()
        if in_place_gradients:
            self._mark_in_place()

    # -- tensors -------------------------------------------------------------------------
    def _new(self, name, shape, kind, layer, role, dtype=torch.float32, persistent=False):
        info = TensorInfo(len(self.tensors), name, tuple(shape), dtype, kind, layer, role, persistent)
        self.tensors.append(info)
        return info.id

    def _make_tensors(self, momentum):
        net = self.net
        for layer in self.order:
            for suffix, shape in layer.params.items():
                name = f"{layer.name}.{suffix}"
                self.param[name] = self._new(name, shape, "param", layer, "param", persistent=True)
            for suffix, shape in layer.buffers.items():
                name = f"{layer.name}.{suffix}"
                self.buffer[name] = self._new(name, shape, "state", layer, "buffer", persistent=True)
        if momentum:
            for name, tid in self.param.items():
                info = self.tensors[tid]
                self.momentum[name] = self._new(name + ".momentum", info.shape, "state",
                                                info.layer, "momentum", persistent=True)
        self.labels = self._new("labels", (net.batch,), "data", None, "labels",
                                dtype=torch.int64, persistent=True)
        # two floats of the step, sharing one block: [0] the count of the batch's bad values
        # (kernels/check.py), taken before the forward pass: every write of training state
        # waits on it (kernels/_common.gate) and the Runtime reads it with the loss; [1] the
        # learning rate the updates read (the Runtime writes it before a step whose rate
        # changed: a replayed graph reads each step's rate there, graphs.py)
        self.scalars = self._new("scalars", (2,), "state", None, "scalars", persistent=True)
        # the iteration counter random masks are drawn from (advanced on the device)
        self.iteration = self._new("iteration", (1,), "state", None, "counter",
                                   dtype=torch.int64, persistent=True) \
            if any(spec(layer).draws_mask for layer in self.order) else None
        for layer in self.order:
            persistent = spec(layer).is_loss
            self.act[layer] = self._new(layer.name, layer.shape, "data", layer, "act",
                                        persistent=persistent)
            saves = spec(layer).saves(layer)
            if saves is not None:
                self.saved[layer] = self._new(layer.name + ".saved", saves[0], "state", layer,
                                              "saved", dtype=saves[1])
        for layer in self.order:
            if not spec(layer).is_loss and self._needs_grad(layer):
                self.grad[layer] = self._new(layer.name + ".grad", layer.shape, "grad",
                                             layer, "grad")
        for name, tid in self.param.items():
            if name in self.fused_updates:
                continue
            info = self.tensors[tid]
            self.pgrad[name] = self._new(name + ".grad", info.shape, "grad", info.layer, "pgrad")

    def sgd_params(self, layer) -> list:
        """The suffixes of `layer`'s parameters that an SGD launch updates (each has a
        stored gradient): all but those in `fused_updates`."""
        return [s for s in layer.params if f"{layer.name}.{s}" in self.pgrad]

    def _needs_grad(self, layer) -> bool:
        """A layer's output needs a gradient only if a parameter lies upstream of it."""
        return layer in self.requires_grad

    # -- passes --------------------------------------------------------------------------
    def _layer_params(self, layer, table):
        return [table[f"{layer.name}.{s}"] for s in layer.params if f"{layer.name}.{s}" in table]

    def _make_passes(self):
        for layer in self.order:
            lp = LayerPass(len(self.passes), layer, "forward")
            op = spec(layer)
            lp.reads += [self.act[x] for x in layer.inputs]
            lp.reads += self._layer_params(layer, self.param)
            if op.is_loss:
                lp.reads.append(self.labels)
            lp.writes.append(self.act[layer])
            if op.draws_mask:
                lp.reads.append(self.iteration)
            if layer in self.saved:
                lp.writes.append(self.saved[layer])
            if op.saves_statistics:
                lp.writes += [self.buffer[f"{layer.name}.{b}"] for b in layer.buffers]
            self.passes.append(lp)
        written = set()
        for layer in reversed(self.order):
            if layer not in self.requires_grad:
                continue                # nothing upstream learns: no backward pass at all
            lp = LayerPass(len(self.passes), layer, "backward")
            if layer in self.grad:
                lp.reads.append(self.grad[layer])
            op = spec(layer)
            lp.reads += [self.act[x] for x in op.inputs_read(layer)]
            if op.reads_output(layer):
                lp.reads.append(self.act[layer])
            if op.is_loss:
                lp.reads.append(self.labels)
            if op.draws_mask:
                lp.reads.append(self.iteration)
            if layer in self.saved:
                lp.reads.append(self.saved[layer])
            lp.reads += self._layer_params(layer, self.param)
            lp.reads += self._layer_params(layer, self.momentum)
            for x in layer.inputs:
                if x in self.grad:
                    gid = self.grad[x]
                    lp.writes.append(gid)
                    lp.accumulate[gid] = gid in written
                    written.add(gid)
            lp.writes += self._layer_params(layer, self.pgrad)
            self.passes.append(lp)

    def _place_updates(self):
        """(buckets, reduces, updates): the gradient buckets (tuples of layers in backward
        order; data parallel only), backward pass index -> the bucket whose all-reduce
        starts after that pass, and backward pass index -> the buckets whose layers' SGD
        updates run at the end of that pass.

        Single process: no all-reduce; each layer is updated at its own backward pass, or
        (`group_updates`) with the layers after it in one launch (`_update_groups`). Data
        parallel: a bucket starts after its last layer's pass, which
        reads all the bucket's gradients, and is updated `UPDATE_LAG` backward passes later
        (at most the last pass), which reads the layers' parameter gradients, parameters
        and momentum: the gradients stay live over the all-reduce in flight."""
        backward = [lp for lp in self.passes
                    if lp.phase == "backward" and self.sgd_params(lp.layer)]
        if not self.data_parallel:
            groups = (_update_groups([_launch_items(lp.layer, self.fused_updates)
                                      for lp in backward]) if self.group_updates
                      else [[i] for i in range(len(backward))])
            updates = {}
            for group in ([backward[i] for i in g] for g in groups):
                at = group[-1]
                updates[at.index] = [tuple(lp.layer for lp in group)]
                self._add_reads(at, [lp.layer for lp in group[:-1]],
                                (self.pgrad, self.param, self.momentum))
            return [], {}, updates
        sizes = [(lp, sum(self.tensors[t].nbytes
                          for t in self._layer_params(lp.layer, self.pgrad)))
                 for lp in backward]
        buckets, reduces, updates = [], {}, {}
        last = len(self.passes) - 1
        for group in group_buckets(sizes, self.bucket_bytes):
            bucket, start = tuple(lp.layer for lp in group), group[-1]
            at = self.passes[min(start.index + UPDATE_LAG, last)]
            buckets.append(bucket)
            reduces[start.index] = bucket
            updates.setdefault(at.index, []).append(bucket)
            self._add_reads(start, bucket, (self.pgrad,))
            self._add_reads(at, bucket, (self.pgrad, self.param, self.momentum))
        return buckets, reduces, updates

    def _add_reads(self, lp, layers, tables):
        """Make pass `lp` also read the `tables` entries of `layers` it does not touch yet."""
        touched = set(lp.reads) | set(lp.writes)
        for layer in layers:
            for table in tables:
                lp.reads += [t for t in self._layer_params(layer, table) if t not in touched]

    def _uses(self) -> dict:
        """tensor id -> sorted layer pass indices that read or write it."""
        uses = {info.id: [] for info in self.tensors}
        for lp in self.passes:
            for tid in set(lp.reads) | set(lp.writes):
                uses[tid].append(lp.index)
        return uses

    def _mark_in_place(self):
        """Set `in_place` of every backward pass that may write a gradient over dy: its op
        says so (OpSpec.backward_in_place), it reads dy for the last time, and dx is a first
        write (not accumulated) that the pass makes once (an add of x to itself writes it
        twice). The first such input's gradient is the one."""
        for lp in self.passes:
            dy = self.grad.get(lp.layer)
            if (lp.phase != "backward" or dy is None or not spec(lp.layer).backward_in_place
                    or self.last_use(dy) != lp.index):
                continue
            fresh = [t for t in lp.writes if lp.accumulate.get(t) is False
                     and lp.writes.count(t) == 1]
            if fresh:
                assert self.tensors[fresh[0]].nbytes == self.tensors[dy].nbytes
                lp.in_place = (fresh[0], dy)

    def first_use(self, tid) -> int:
        return self.uses[tid][0]

    def last_use(self, tid) -> int:
        return self.uses[tid][-1]

    def live_sets(self):
        """Per layer pass, the (in, out) live sets of non-persistent tensors, as the paper's Fig. 5."""
        born = {t: self.first_use(t) for t in self.uses if self.uses[t]}
        dies = {t: self.last_use(t) for t in self.uses if self.uses[t]}
        sets = []
        for lp in self.passes:
            live_in = {t for t in born if born[t] < lp.index <= dies[t]
                       and not self.tensors[t].persistent}
            live_out = {t for t in born if born[t] <= lp.index < dies[t]
                        and not self.tensors[t].persistent}
            sets.append((live_in, live_out))
        return sets
