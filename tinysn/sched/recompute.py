"""Cost-aware recomputation (paper §3.4).

Outputs of cheap layers (pool, ReLU, batch norm, LRN, dropout) are dropped once the forward
pass has finished with them and rebuilt in the backward pass from the nearest checkpoints.
A *segment* is a connected group of such cheap layers between checkpoints. Per segment:

- speed-centric: recompute the segment once, at the first backward step that needs any of
  it, and keep the results until their last backward use (O(N) extra forward work, but the
  segment's tensors are live together);
- memory-centric: recompute what a backward step needs right before that step and drop it
  again afterwards (more extra work, least memory).

The paper picks speed-centric when the segment's memory is at most l_peak, the largest
single layer's memory, since then recomputing it cannot raise the network-wide peak, and
memory-centric otherwise. A recomputed batch norm does not update its running statistics
again and a recomputed dropout draws the same mask (both handled by the kernel launch).

Policy "all" may also drop the outputs of layers that are not cheap (conv, add, concat:
`OpSpec.rebuildable`) when the step-time model predicts that recomputing them is faster
than carrying them over PCIe and back (`plan._trade` picks them). A `Traded` drop choice
names those layers; every function below takes the set (`extra`) and treats its layers as
cheap ones. A rebuilt conv runs the algorithm its forward pass ran, on the same inputs and
parameters (a layer's parameters are updated only at or after its own backward pass, and
every rebuild of its output comes before that), so it computes the same bits.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..ops import spec


@dataclass(frozen=True)
class Traded:
    """A drop choice of policy "all": the cheap layers' variant (None: no cheap layer is
    dropped; "from_checkpoints" or "strict" as in `dropped_tensors`) plus `layers`, the
    indices of rebuildable layers whose outputs are dropped and recomputed as well.
    `speed_everywhere`: every segment is recomputed speed-centric (`strategies`), not only
    those within l_peak. `kept`: indices of cheap layers whose outputs are kept, not
    dropped (checkpoints of their own: a pooling output a quarter of its input's size, kept
    so that the input need not come back before the backward pass reaches it).
    `keep_within`: a rebuilt tensor of a speed-centric segment stays on the device for a
    later use at most this many layer passes ahead; one used farther ahead is dropped after
    the step and rebuilt again for that use (None: kept for any later use, the paper's
    speed-centric rule). A join rebuilt for the block after it (plan._rebuild_joins) then
    does not hold its own block's rebuilt tensors until that block's backward pass."""
    variant: str | None
    layers: frozenset
    speed_everywhere: bool = False
    kept: frozenset = frozenset()
    keep_within: int | None = None


def split(drops):
    """(variant, extra layer indices) of a plan's `drops`: a variant name, None or Traded."""
    if isinstance(drops, Traded):
        return drops.variant, drops.layers
    return drops, frozenset()


def kept(drops) -> frozenset:
    """Indices of the cheap layers `drops` keeps (Traded.kept)."""
    return drops.kept if isinstance(drops, Traded) else frozenset()


def keep_within(drops) -> int | None:
    """How far ahead a rebuilt tensor is kept for its next use (Traded.keep_within)."""
    return drops.keep_within if isinstance(drops, Traded) else None


def speed_everywhere(drops) -> bool:
    """Whether `drops` recomputes every segment speed-centric (Traded.speed_everywhere)."""
    return isinstance(drops, Traded) and drops.speed_everywhere


def _cheap(layer, extra=frozenset()) -> bool:
    return spec(layer).recomputable or layer.index in extra


def dropped_tensors(program, from_checkpoints: bool = True, keep=frozenset(),
                    extra=frozenset(), cheap_layers: bool = True) -> set:
    """Ids of the activations that the recompute policy drops and rebuilds when needed.

    A cheap layer's output is rebuildable when each of its inputs is rebuildable itself, or
    is the output of a non-cheap layer (which then becomes a checkpoint: kept in host memory
    and brought back for the rebuild), or is read by the backward pass anyway. Rebuildable
    outputs that the backward pass never reads are freed after the forward pass as usual and
    rebuilt only as inputs of another rebuild. Whether dropping pays at all is decided per
    plan: `plan()` keeps the recompute-free plan when it has the lower peak, and also tries
    `from_checkpoints=False` (no new checkpoints: rebuild only from tensors the backward pass
    reads anyway), which drops less but can peak lower when rebuilt segments are large.
    Layers in `keep` (the offload policies' checkpoints) are never dropped: they are
    sources for rebuilds, like non-cheap layers. Layers whose index is in `extra` count as
    cheap; `cheap_layers=False` drops the outputs of those alone (by the same rule).
    """
    n_forward = len(program.order)
    dropped = set()
    for layer in program.order:
        eligible = layer.index in extra or (cheap_layers and _cheap(layer))
        if eligible and layer not in keep and all(
                program.act[x] in dropped
                or (from_checkpoints and (not _cheap(x, extra) or x in keep))
                or program.uses[program.act[x]][-1] >= n_forward for x in layer.inputs):
            dropped.add(program.act[layer])
    return dropped


def extra_checkpoints(program, dropped, extra=frozenset()) -> set:
    """Non-cheap layers whose outputs feed a dropped layer: recomputation starts from them."""
    keep = set()
    for layer in program.order:
        if program.act[layer] in dropped:
            keep |= {x for x in layer.inputs if not _cheap(x, extra)}
    return keep


def segments(program, extra=frozenset()) -> list:
    """Connected groups of recomputable layers (edges between two cheap layers join them;
    layers in `extra` count as cheap)."""
    parent = {}

    def find(a):
        while parent[a] is not a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    cheap = [layer for layer in program.order if _cheap(layer, extra)]
    for layer in cheap:
        parent[layer] = layer
    for layer in cheap:
        for x in layer.inputs:
            if x in parent:
                parent[find(x)] = find(layer)
    groups = {}
    for layer in cheap:
        groups.setdefault(find(layer), []).append(layer)
    return list(groups.values())


def layer_peak(program, workspace_of, in_place: bool = False) -> int:
    """l_peak: the most memory any single step touches (its reads, writes and workspace).
    With `in_place`, a gradient written over dy (LayerPass.in_place) shares dy's block and
    counts once: the bound memory.py reports. The segment rule (`strategies`) keeps the
    paper's sum, every tensor in a block of its own."""
    best = 0
    for step in program.passes:
        tids = set(step.reads) | set(step.writes)
        if in_place and step.in_place:
            tids.discard(step.in_place[1])
        size = sum(program.tensors[t].nbytes for t in tids if not program.tensors[t].persistent)
        best = max(best, size + workspace_of(step))
    return best


def strategies(program, l_peak: int, extra=frozenset(), everywhere: bool = False) -> dict:
    """tensor id -> "speed" | "memory" for every dropped tensor, by its segment's cost (the
    paper's rule), or "speed" for all with `everywhere`. A memory-centric segment rebuilds
    its chain from the checkpoint for every backward step that reads it: where a traded
    conv joins a stem or a block into one large segment, that is ten rebuilds of the same
    convolutions, so under policy "all" the planner also tries speed-centric everywhere and
    keeps the faster plan that fits (`plan._choose`)."""
    chosen = {}
    for seg in segments(program, extra):
        cost = sum(program.tensors[program.act[layer]].nbytes for layer in seg)
        kind = "speed" if everywhere or cost <= l_peak else "memory"
        for layer in seg:
            chosen[program.act[layer]] = kind
    return chosen


class RecomputeSchedule:
    """Where every recomputation happens, worked out before the memory simulation.

    `run(step_index, reads)` returns, in execution order, the dropped tensors to rebuild
    before that backward step; `keep_after(tid, step_index)` says whether a rebuilt tensor
    stays on the device after the step. The planner and this pre-pass follow the same rule,
    so the uses added here (a recomputation reads its producer's inputs at that step) are the
    uses the simulation sees. `keep_within` (Traded.keep_within): how many layer passes
    ahead a speed-centric tensor's next use may lie for it to stay (None: any).
    """

    def __init__(self, program, dropped: set, strategy: dict, keep_within: int | None = None):
        self.program = program
        self.dropped = dropped
        self.strategy = strategy
        self.keep_within = keep_within
        self.producer = {program.act[layer]: layer for layer in program.order}
        self.direct_uses = program.uses
        self.uses = {t: list(u) for t, u in program.uses.items()}
        self.rebuild = {}            # step index -> ordered list of tensor ids to recompute
        self._prepass()

    def keep_after(self, tid: int, index: int) -> bool:
        """A rebuilt tensor stays after step `index` only under speed-centric with later uses
        (the next of them within `keep_within` passes, where that is set)."""
        uses = self.direct_uses[tid]
        if self.strategy.get(tid) != "speed" or uses[-1] <= index:
            return False
        return self.keep_within is None or \
            uses[bisect.bisect_right(uses, index)] - index <= self.keep_within

    def _prepass(self):
        program = self.program
        present = set()
        first_backward = len(program.order)
        for step in program.passes[first_backward:]:
            order = []
            now = set(present)

            def ensure(tid):
                if tid not in self.dropped or tid in now:
                    return
                for x in self.producer[tid].inputs:
                    xid = program.act[x]
                    self.uses[xid].append(step.index)
                    ensure(xid)
                now.add(tid)
                order.append(tid)

            for tid in step.reads:
                ensure(tid)
            if order:
                self.rebuild[step.index] = order
            present = {t for t in now if self.keep_after(t, step.index)}
        for tid in self.uses:
            self.uses[tid] = sorted(set(self.uses[tid]))
