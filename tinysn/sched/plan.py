"""The plan: every decision of the scheduler, made once, as a list of steps.

For a fixed net, policy and cap every decision (which block each tensor gets, when it is
freed, offloaded, prefetched or recomputed, which conv algorithm runs) is deterministic. So
the planner makes them all up front, through the same BlockAllocator the runtime uses, and
records them as steps of simple operations, the dataclasses below (Alloc, Free, Drop,
Hand, Offload, Release, Evict, Prefetch, Wait, Sync, Mark, Launch), which the runtime executes
one by one (`Runtime._EXECUTE` dispatches on the type).

Nothing waits on the host: a freed block can still be read by a queued kernel or a copy in
flight, so the planner remembers that per freed byte range (offload.FreedRanges) and makes
the block's next writer wait for exactly those events ("sync" before a kernel writes it,
`waits` of a prefetch or offload), which lets copies overlap compute in both directions.

The runtime executes that list; `plan()` (the dry run) is the same list without kernels. So
the pool's measured peak equals the plan's peak by construction, and a cap that is too small
fails here, naming the step, before any kernel runs.

Policies (a ladder, each including the ones before it where it makes sense):
    baseline   every tensor holds its own block for the whole iteration (the paper's baseline)
    liveness   allocate at first use, free after last use (§3.2)
    offload    + copy checkpoint outputs to the host, release, prefetch back (§3.3)
    recompute  + drop cheap layers' outputs and recompute them, cost-aware (§3.4)
    all        liveness + LRU tensor cache (move only when short) + dynamic conv workspaces
               (§3.5); once something must move, the same with cost-aware recomputation
               where that moves fewer bytes (or where the cache alone does not fit), then
               conv, add and concat outputs recomputed too where the step-time model
               predicts a faster step (`_trade`), and prefetches issued up to a few layer
               passes ahead of need where memory allows and the model predicts that pays
               (`_ahead`); all of that again with every recompute segment rebuilt once
               and kept (speed-centric) instead of the paper's per-segment rule, and the
               faster of the two by the model (`_speed_everywhere`); the chosen run is
               planned again with the cache's victims written back to the host right
               after their last use (`_Search.write_back_early`)
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from ..errors import OutOfMemory
from ..ops import SPARE, spec
from ..pool.allocator import BlockAllocator, block_rounded
from ..units import format_bytes, parse_bytes
from . import fuse, liveness, offload, recompute, staging, workspace
from .channels_last import outputs as stored_channels_last
from .liveness import TensorInfo

# -- the operations a plan step is made of ---------------------------------------------
@dataclass(frozen=True)
class Alloc:
    """Give tensor `tensor` a device block at `offset`."""
    tensor: int
    offset: int


@dataclass(frozen=True)
class Hand:
    """Give tensor `tensor` the device block of `source`, in place: the step's kernel reads
    `source` for the last time and writes `tensor` over it element by element (a gradient
    over dy: liveness.LayerPass.in_place). `source` stays readable until that kernel; its
    Free, after it, returns nothing."""
    tensor: int
    source: int


@dataclass(frozen=True)
class Free:
    """Return the tensor's device (and host) blocks."""
    tensor: int


@dataclass(frozen=True)
class Drop:
    """Free the device block of a tensor that will be recomputed."""
    tensor: int


@dataclass(frozen=True)
class Offload:
    """Start copying the tensor to the pinned host arena at `host_offset` (device-to-host
    stream) once the events in slots `waits` are done; its own event goes to `slot`."""
    tensor: int
    host_offset: int
    slot: int
    waits: tuple


@dataclass(frozen=True)
class Release:
    """Free the device block of an offloaded tensor (the copy may still be reading it)."""
    tensor: int


@dataclass(frozen=True)
class Evict:
    """LRU eviction: copy out as Offload does, unless `host_offset` is None (the host copy
    is still valid, or an Offload wrote it back early and may still be copying), then free
    the device block."""
    tensor: int
    host_offset: int | None
    slot: int | None
    waits: tuple


@dataclass(frozen=True)
class Prefetch:
    """Allocate a device block at `offset` and copy the tensor back (host-to-device stream)
    once the events in `waits` are done; its event goes to `slot`. `top`: the block is
    placed by first fit from the top of the pool (an early prefetch), not from the bottom."""
    tensor: int
    offset: int
    slot: int
    waits: tuple
    top: bool = False


@dataclass(frozen=True)
class Wait:
    """The compute stream waits for the tensor's prefetch."""
    tensor: int


@dataclass(frozen=True)
class Sync:
    """The compute stream waits for the copies whose events are in `slots`."""
    slots: tuple


@dataclass(frozen=True)
class Mark:
    """Record an event in `slot` on the compute stream (after a kernel)."""
    slot: int


@dataclass(frozen=True)
class Launch:
    """Launch a layer's kernels. `key` is a layer pass index (forward or backward) or
    ("recompute", layer index); `algos` the conv algorithms; `workspace` a tensor id or None."""
    key: object
    algos: dict | None
    workspace: int | None


POLICIES = ("baseline", "liveness", "offload", "recompute", "all")
# `_Search.fits_unmoved` where the net with its max pools' argmaxes stored fits its cap
# unmoved (True: the fused net without them does; False: neither)
STORED = "stored"
# policy "all": plans the search trading copies for rebuilds may make. More is not
# always better: the greedy search picks the best plan one step ahead, before `_ahead`;
# ResNet-50 under 12 GiB at batch 640 ends at 0.584 s predicted with 24 and 0.630 s
# with 48; at 995 with the H200's measured conv times both give the same plan
TRADE_BUDGET = 24
TRADE_STEPS = 64_000   # ... and plan steps in all, so a deep net's search stays short
LOOKAHEADS = (2, 4, 8, 16, 64)   # policy "all": prefetch distances the planner tries
AHEAD_RETRIES = 3   # ... each planned again that often, early blocks kept off a failed step
# policy "all": plans (each with its prefetch distance search) the search that rebuilds joins
# may make, and how many layer passes ahead its plans keep a rebuilt tensor (_rebuild_joins)
JOIN_BUDGET = 40
KEEP_WITHIN = 12
JOIN_WAITS = 0.05   # ... searched only where compute waits at least this share of the step
HOST_CAPACITY = 1 << 46   # bookkeeping bound for the host arena; the plan sizes the real one


@dataclass
class Step:
    """One executed step: a layer's forward, backward or recomputation, and its operations."""
    index: int
    layer: str
    phase: str                 # "forward" | "backward" | "recompute"
    ops: list = field(default_factory=list)
    bytes_in_use: int = 0      # device bytes in use while the kernel runs
    live_tensors: int = 0      # tensors holding a device block while the kernel runs
    algos: dict | None = None  # conv algorithms chosen for this step


@dataclass
class Plan:
    """The result of planning: the step list and the figures it predicts."""
    net: object
    policy: str
    capacity: int
    momentum: float
    tensors: list
    setup: list               # ops run once, before the first iteration (persistent tensors)
    steps: list
    peak_bytes: int           # the device pool's peak bytes in use
    required_bytes: int       # the highest byte any block reaches: the smallest cap that
                              # runs this exact plan (first fit may fragment: >= peak_bytes)
    setup_bytes: int          # bytes held across iterations (parameters, optimizer state...)
    host_bytes: int           # pinned host arena the plan needs
    bytes_to_host: int        # per iteration
    bytes_to_device: int      # per iteration
    recomputed_steps: int     # extra forward steps per iteration (the paper's Table 1)
    conv_algos: dict          # layer name -> {phase: algo}
    uses_recompute: bool
    program: object = None
    small_bytes: int = 0      # the device allocator's small_bytes this layout was made with
    event_slots: int = 0      # copy and compute events the steps refer to (by slot)
    drops: object = None      # the recomputation variant it was made with (VARIANTS)
    evictions: object = None  # policy "all": what its cache copied out when evicting, and
                              # when (offload.EvictionLog)
    lookahead: int = 1        # policy "all": how many layer passes ahead a prefetch may go
    headroom: object = None   # ... within the room a first pass left (offload.Headroom)
    device_model: object = None   # the timing.DeviceModel `plan` chose with (None: the H200's)
    channels_last: frozenset = frozenset()  # convs whose outputs are stored channels-last
                                            # (sched/channels_last.py)
    batch_staging: int | None = None  # the pool offset the runtime copies the next batch to
                                      # while a step runs; None: no room (sched/staging.py)

    def table(self) -> str:
        """Per-step bytes in use and live tensors, as text."""
        rows = [f"{'step':>5} {'phase':<9} {'layer':<24} {'in use':>12} {'live':>5}"]
        for s in self.steps:
            rows.append(f"{s.index:>5} {s.phase:<9} {s.layer:<24} {s.bytes_in_use:>12,} "
                        f"{s.live_tensors:>5}")
        return "\n".join(rows)

    @property
    def loss_step(self) -> int:
        """Index of the step that runs the loss's forward pass: where a prediction stops
        and where a training step has its loss."""
        loss = self.net.loss.name
        return next(s.index for s in self.steps if s.phase == "forward" and s.layer == loss)

    @property
    def predicted_step_s(self) -> float:
        """Seconds one iteration takes by the step-time model it was planned with
        (sched/timing.py; `device_model`): kernels from their flops and bytes, copies at
        pinned bandwidth, overlapped as the plan's events allow. `timing.simulate(plan,
        model)` gives the whole timeline, for other models."""
        from .timing import simulate
        return simulate(self, self.device_model).step_s

    @property
    def rebuilt_joins(self) -> list:
        """Names of the joins (add, concat) whose outputs the plan drops and rebuilds
        (`_trade`, `_rebuild_joins`), in forward order."""
        _, layers = recompute.split(self.drops)
        return [layer.name for layer in self.net.layers
                if layer.index in layers and _is_join(layer)]

    def placements(self) -> list:
        """One row per device placement of a tensor in one iteration (a tensor that leaves
        the device and comes back has a row per stay): name, offset, bytes, the first and
        last executed step it is there, and how the stay ends ("freed", "dropped",
        "to host", "handed over" to a gradient written in place, or "kept" for tensors
        that live across iterations)."""
        rows, open_rows = [], {}
        for op in self.setup:
            open_rows[op.tensor] = {"tensor": self.tensors[op.tensor].name, "offset": op.offset,
                                    "bytes": self.tensors[op.tensor].nbytes, "first": "setup",
                                    "last": "setup", "ends": "kept"}
        rows += open_rows.values()
        ends = {Free: "freed", Drop: "dropped", Release: "to host", Evict: "to host"}
        for step in self.steps:
            for op in step.ops:
                if isinstance(op, (Alloc, Prefetch)):
                    row = {"tensor": self.tensors[op.tensor].name, "offset": op.offset,
                           "bytes": self.tensors[op.tensor].nbytes, "first": step.index,
                           "last": step.index, "ends": "kept"}
                    open_rows[op.tensor] = row
                    rows.append(row)
                elif isinstance(op, Hand):     # the block goes on, under another name
                    row = open_rows.pop(op.source)
                    row.update(last=step.index, ends="handed over")
                    open_rows[op.tensor] = {**row, "tensor": self.tensors[op.tensor].name,
                                            "first": step.index, "ends": "kept"}
                    rows.append(open_rows[op.tensor])
                elif type(op) in ends and op.tensor in open_rows:
                    open_rows.pop(op.tensor)["ends"] = ends[type(op)]
                elif isinstance(op, Launch):
                    for row in open_rows.values():
                        if row["first"] != "setup":
                            row["last"] = step.index
        return rows

    def placement_table(self) -> str:
        """`placements()` as text, by offset within each stay (like llm.c's activation
        table): where every tensor lives in the pool and for how long."""
        lines = [f"{'tensor':<32} {'offset':>14} {'bytes':>14} {'first':>6} {'last':>6}  ends"]
        for r in self.placements():
            lines.append(f"{r['tensor'][:32]:<32} {r['offset']:>14,} {r['bytes']:>14,} "
                         f"{r['first']!s:>6} {r['last']!s:>6}  {r['ends']}")
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"{self.policy}: peak {format_bytes(self.peak_bytes)} of cap "
                f"{format_bytes(self.capacity)}; to host {format_bytes(self.bytes_to_host)}, "
                f"to device {format_bytes(self.bytes_to_device)}; recomputed steps "
                f"{self.recomputed_steps}; host arena {format_bytes(self.host_bytes)}")


def small_bytes_for(capacity: int) -> int:
    """The second layout the planner tries when plain first fit fragments too much: requests
    up to 1/4096 of the pool are placed from its top (BlockAllocator's `small_bytes`), so
    statistics, biases and scratch stop splitting the long runs that large activations need.
    On ResNet-50 in 12 GiB this raises the largest batch that plans from 767 to 995."""
    return capacity >> 12


GRID_BITS = 7   # a grid cap is a whole number of blocks with at most 7 significant bits


def grid_cap(nbytes: int, block_bytes: int = 1024) -> int:
    """The largest cap on the planner's cap grid that is at most `nbytes`.

    The grid holds every whole number of blocks written with at most GRID_BITS significant
    bits: consecutive caps lie at most 1/64 apart, and round caps (12GiB, 512MiB, 80GiB...)
    are on it. The grid depends on nothing but `block_bytes`, which is what makes the
    planner monotone in the cap (see `_Search`)."""
    n = nbytes // block_bytes
    shift = max(n.bit_length() - GRID_BITS, 0)
    return (n >> shift << shift) * block_bytes


def plan(net, memory, policy: str = "all", *, momentum: float = 0.0, conv_algos=None,
         checkpoints=offload.DEFAULT_CHECKPOINTS, block_bytes: int = 1024,
         layout: str = "auto", host_memory=None, rankings=None,
         data_parallel: bool = False, bucket_bytes=liveness.BUCKET_BYTES,
         early_write_back: bool = True, trade_budget: int = TRADE_BUDGET,
         lookahead: int | None = None, device_model=None,
         in_place_gradients: bool = True, keep_pools: bool = True,
         evict_by_next_use: bool = True, rebuild_joins: bool = True,
         fuse_relu: bool = True, fuse_bn_relu: bool = True, fuse_add_relu: bool = True,
         fuse_bn_add: bool = True, group_updates: bool = True,
         channels_last: bool = True, fuse_updates: bool = True,
         store_argmaxes: bool = True) -> Plan:
    """Dry-run one training iteration of `net` under a `memory` cap and `policy`.

    Raises OutOfMemory naming the first step that does not fit. `conv_algos` pins conv
    algorithms ({"forward": "im2col", ...}, or {} for the zero-workspace defaults).
    `layout` is "auto" (plain first fit, then small requests from the top if that
    fragments too much), "first_fit" or "two_ended" (force one). `host_memory` caps the
    pinned host arena (default: unbounded); when copies would overflow it, policy "all"
    turns to recomputation and the others raise OutOfMemory. `rankings` orders the conv
    algorithms of policy "all" fastest first (workspace.measure_rankings; default: least
    workspace first), so a plan is a function of its arguments alone. `data_parallel` plans
    one rank of data-parallel training: gradients are all-reduced in buckets of at least
    `bucket_bytes` (bytes or a string like '25MiB'; consecutive layers in backward order),
    each layer's update waits for its bucket's all-reduce, a few backward steps after the
    bucket's last layer (liveness.UPDATE_LAG), so the bucket's gradients live that long.
    `early_write_back` (policy "all"): copy each tensor the LRU cache will evict to the
    host right after its last use before the eviction, so the eviction moves nothing and
    frees its block at once (`_Search.write_back_early`); False copies it out at the
    eviction, when the allocation that needs the room waits for it.
    `trade_budget` (policy "all"): how many plans the search that trades copies for
    recomputing conv, add and concat outputs may make (`_trade`); 0 recomputes only the
    cheap layers.
    `lookahead` (policy "all"): how many layer passes (forward or backward steps) before
    its use a prefetch may be issued where memory allows (`_ahead`); None (default) lets
    the step-time model choose among 1 and LOOKAHEADS; 1 issues each prefetch one step
    before its use, as the paper does.
    `device_model` (a timing.DeviceModel; default DeviceModel.h200()): the step-time model
    that chooses among plans that fit (the trade, the lookahead), and the one the returned
    plan's `predicted_step_s` uses.
    `in_place_gradients` (default True): ReLU, batch norm, dropout and add backward passes
    write their gradient over dy where they read dy last (liveness.LayerPass.in_place);
    False gives every gradient a block of its own, as plans made before that did
    (bench/predict.py plans older measured runs so).
    `keep_pools` (policy "all", default True): also try keeping the outputs of pooling
    layers the plan drops, where the model predicts that faster (`_keep`); False plans as
    tinysn did before it.
    `evict_by_next_use` (policy "all", default True): where the plan with the paper's
    least-recently-used cache copies a tensor back twice (or does not fit), plan again with
    a cache that evicts the member whose next use lies furthest ahead (the plan knows every
    use: Belady's rule), and keep the plan the step-time model predicts faster, each judged
    after its joins are rebuilt (`rebuild_joins`: with each batch norm's ReLU fused, ResNet-50
    at 995 rebuilds joins to 1.197 s a step from LRU's plan and none from the other's, 1.255
    s, which was the faster before they were rebuilt, 1.255 against 1.313). LRU order
    can evict a residual block's input in the middle of the block, only to bring it back
    for the add (ResNet-50 under 12 GiB at batch 995, its batch norms' ReLUs apart: 6.4 GB
    more copied back, predicted 1.195 s a step against 1.126). Where LRU brings nothing
    back twice the second search is skipped: it doubles planning time and found at most
    0.4% (ResNet-152, batch 256), and at 512 LRU's plan was the faster. False plans with
    LRU alone, as plans made before this did.
    `rebuild_joins` (policy "all", default True): last, also try dropping the outputs of
    joins (a residual add, a concat) whose copies the plan moves, and rebuilding them from
    the join's inputs, each choice judged as it will run (`_rebuild_joins`); False plans as
    tinysn did before it.
    `fuse_relu` (default True): plan `fuse.fuse_relus(net)`, each conv or add whose output
    only a ReLU reads made one layer with it (the plan's `net` and steps are the fused
    net's; the numbers are the same bits), an add's only where the net so fused fits the
    cap without copying anything out (`_fits_unmoved`; beyond that, the ReLU apart is a
    cheap layer the plan may drop and recompute); False plans `net` as it is, as plans
    made before that did.
    `fuse_add_relu` (default True; with `fuse_relu`): the residual adds' ReLUs fused as
    just said (on the H200 at batch 32 it took ResNet-50's graphed step from 16.89 to 16.26
    ms); False plans them apart everywhere, as plans made before that did.
    `fuse_bn_relu` (default True; with `fuse_relu`): each batch norm whose output only a
    ReLU reads is made one layer with it too (the same bits; on the H200 at batch 32 it took
    ResNet-50's eager step from 67.6 to 50.3 ms and its graphed one from 17.3 to 16.8 ms);
    False plans them apart, as plans made before that did.
    `fuse_bn_add` (default True; with `fuse_relu` and `fuse_add_relu`): where the adds'
    ReLUs are fused, each batch norm whose output only a two-input residual add reads is
    made one layer with the add too (fuse.fuse_residuals: ResNet's last batch norm of each
    block; its output never exists; the same bits); False plans them apart.
    `group_updates` (default True): where the net fits the cap without copying anything
    out (as for the adds' ReLUs), the SGD updates of layers whose parameters are all
    vectors (a batch norm's scale and shift) wait for the next layer's in backward order
    and share its launch (liveness.py `_update_groups`: ResNet-50's 107 update launches ->
    54; those gradients live a pass longer, a few KB; the same bits); False updates each
    layer at its own backward pass everywhere, as plans made before that did.
    `channels_last` (default True): store a conv's output channels-last where one conv
    alone reads it and both convs' algorithms allow it (sched/channels_last.py; the plan's
    `channels_last` names them; the same bits); False stores every activation NCHW.
    `fuse_updates` (default True; one process): every fc layer's weight takes its SGD step
    in its weight-gradient GEMM's epilogue (kernels/linear.py), so that gradient is never
    stored: no block for it, no pass over it (liveness `fused_update_names`; the SGD
    kernel's bits where the batch is one K-block of the GEMM); False stores it and updates
    it with the SGD kernel, as plans made before that did.
    `store_argmaxes` (default True): where the net fits the cap without copying anything
    out (as for the adds' ReLUs; under "offload" and "recompute", which copy out by
    design, where "liveness" would: `_moves_by_design`), each max pool's forward stores
    its windows' argmax bytes for its backward (fuse.store_argmaxes: one byte per window,
    in the plan), which then reads neither x nor a second pass over it (the same bits);
    False finds them again in the backward everywhere, as plans made before that did.

    A plan that fits under a cap fits under every larger cap, for every policy and layout
    (`_Search` says why). The returned plan's `capacity` is the pool it was made for: the
    cap itself, or a cap of the grid below it (`grid_cap`), never more.
    """
    _check_eviction_flag(evict_by_next_use)
    if not isinstance(channels_last, bool):
        raise ValueError(f"channels_last must be a bool, got {channels_last!r}")

    def search(by_next_use, unmoved=None):
        return _search(net, memory, policy, momentum=momentum, conv_algos=conv_algos,
                       checkpoints=checkpoints, block_bytes=block_bytes, layout=layout,
                       host_memory=host_memory, rankings=rankings,
                       data_parallel=data_parallel, bucket_bytes=bucket_bytes,
                       early_write_back=early_write_back, trade_budget=trade_budget,
                       lookahead=lookahead, device_model=device_model,
                       in_place_gradients=in_place_gradients, keep_pools=keep_pools,
                       evict_by_next_use=by_next_use, rebuild_joins=rebuild_joins,
                       fuse_relu=fuse_relu, fuse_bn_relu=fuse_bn_relu,
                       fuse_add_relu=fuse_add_relu, fuse_bn_add=fuse_bn_add,
                       group_updates=group_updates, fuse_updates=fuse_updates,
                       store_argmaxes=store_argmaxes, fits_unmoved=unmoved)
    lru = search(False)             # checks every argument before anything is planned
    try:
        candidates = [(lru, _choose(lru, policy))]     # (search, its plan)
    except OutOfMemory:
        if not (evict_by_next_use and policy == "all"):
            raise
        candidates = []
    if evict_by_next_use and policy == "all" and (
            not candidates or _refetches(lru.write_back_early(candidates[0][1]))):
        candidates += _next_use_candidate(search(True, lru.fits_unmoved),
                                          fallback=candidates)
    if policy == "all":
        candidates += [c for s, p in list(candidates) for c in _untraded_candidate(s, p)]
        candidates = [(s, _rebuild_joins(s, p)) for s, p in candidates]
    owner, chosen = min(candidates, key=lambda c: c[0].step_seconds(c[1]))
    chosen = owner.write_back_early(chosen)
    chosen.device_model = lru.device_model
    if channels_last:
        chosen.channels_last = stored_channels_last(chosen.net, chosen.conv_algos)
    return chosen


def _untraded_candidate(search, traded: Plan) -> list:
    """[(search, plan)]: `search`'s "all" plan chosen without the trade (its budget 0 for
    the call), where it differs from `traded`, the plan chosen with it; else []. Each
    search is greedy from where it starts, so a traded plan may leave the join rebuilding
    (`_rebuild_joins`, which both then go through) less to gain than the untraded one (a
    random net, PCIe starved: 1.74 ms traded against 1.23 without); the faster is kept, so
    trading never makes the chosen step slower where joins are rebuilt. The trade may
    leave `traded` no join to add where the untraded plan has some (a random net: the
    trade rebuilds one concat and stops at 2.58 ms, the join search from the untraded plan
    rebuilds two, 2.19 ms), so only where rebuilding could not gain on `traded` at all
    (`_copies_stall`: nothing moves, or compute waits too little) there is no second
    candidate: its prefetch distances alone took ResNet-152's plan at batch 256 under
    12 GiB past test_plan's 40 s bound."""
    if search.trade_budget == 0 or _copies_stall(search, traded) is None:
        return []
    budget, search.trade_budget = search.trade_budget, 0
    try:
        untraded = _choose(search, "all")
    except OutOfMemory:
        return []
    finally:
        search.trade_budget = budget
    same = (untraded.drops, untraded.lookahead) == (traded.drops, traded.lookahead)
    return [] if same else [(search, untraded)]


def _check_eviction_flag(evict_by_next_use) -> None:
    if not isinstance(evict_by_next_use, bool):
        raise ValueError(f"evict_by_next_use must be a bool, got {evict_by_next_use!r}")


def _refetches(plan) -> bool:
    """Whether the plan copies some tensor back to the device more than once: its cache
    evicted a tensor that was still to be used (what evicting by next use avoids)."""
    fetched = set()
    for op in (op for step in plan.steps for op in step.ops if isinstance(op, Prefetch)):
        if op.tensor in fetched:
            return True
        fetched.add(op.tensor)
    return False


def _next_use_candidate(search, fallback) -> list:
    """[(search, plan)]: the plan of `search` (its cache evicting by next use), or [] where
    it does not fit and `fallback` (the LRU candidates) holds a plan; raises the search's
    OutOfMemory when neither fits."""
    try:
        return [(search, _choose(search, "all"))]
    except OutOfMemory:
        if not fallback:
            raise
        return []


def _search(net, memory, policy, *, momentum, conv_algos, checkpoints, block_bytes, layout,
            host_memory, rankings=None, data_parallel=False,
            bucket_bytes=liveness.BUCKET_BYTES, early_write_back=True,
            trade_budget=TRADE_BUDGET, lookahead=None, device_model=None,
            in_place_gradients=True, keep_pools=True,
            evict_by_next_use=True, rebuild_joins=True, fuse_relu=True,
            fuse_bn_relu=True, fuse_add_relu=True, fuse_bn_add=True,
            group_updates=True, fuse_updates=True, store_argmaxes=True,
            fits_unmoved=None) -> "_Search":
    """Check `plan`'s arguments (before any state changes) and set up its runs: of `net`,
    or with `fuse_relu` of its fused net (fuse.fuse_relus; its residual adds' ReLUs, and the
    batch norms before them, apart where, fused, the net would not fit unmoved:
    `_fits_unmoved`, or `fits_unmoved` where a
    search of the other eviction order found it: the no-drop run that decides evicts
    nothing where it fits unmoved, so the order cannot change the answer), with
    `group_updates` its small SGD updates sharing launches under the same condition
    (liveness.groups_updates), and with `store_argmaxes` its max pools storing their
    argmaxes (fuse.store_argmaxes) where the net so fused fits unmoved too. The search's
    `fits_unmoved` keeps the answer (STORED, True, False; None where nothing asked)."""
    if layout not in ("auto", "first_fit", "two_ended"):
        raise ValueError(f"layout must be 'auto', 'first_fit' or 'two_ended', got {layout!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    capacity = parse_bytes(memory)
    host_capacity = HOST_CAPACITY if host_memory is None else parse_bytes(host_memory)
    if not isinstance(data_parallel, bool):
        raise ValueError(f"data_parallel must be a bool, got {data_parallel!r}")
    if not isinstance(early_write_back, bool):
        raise ValueError(f"early_write_back must be a bool, got {early_write_back!r}")
    if isinstance(trade_budget, bool) or not isinstance(trade_budget, int) or trade_budget < 0:
        raise ValueError(f"trade_budget must be an int >= 0, got {trade_budget!r}")
    if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, int)
                                  or lookahead < 1):
        raise ValueError(f"lookahead must be None or an int >= 1, got {lookahead!r}")
    from .timing import DeviceModel
    if device_model is None:
        device_model = DeviceModel.h200()
    elif not isinstance(device_model, DeviceModel):
        raise ValueError(f"device_model must be a timing.DeviceModel, got {device_model!r}")
    for name, flag in (("in_place_gradients", in_place_gradients), ("keep_pools", keep_pools),
                       ("rebuild_joins", rebuild_joins), ("fuse_relu", fuse_relu),
                       ("fuse_bn_relu", fuse_bn_relu), ("fuse_add_relu", fuse_add_relu),
                       ("fuse_bn_add", fuse_bn_add), ("group_updates", group_updates),
                       ("fuse_updates", fuse_updates), ("store_argmaxes", store_argmaxes)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    bucket_bytes = liveness.parse_bucket_bytes(bucket_bytes)

    def searching(planned, grouped=False, as_policy=policy):
        program = liveness.Program(planned, momentum=momentum, data_parallel=data_parallel,
                                   bucket_bytes=bucket_bytes,
                                   in_place_gradients=in_place_gradients,
                                   group_updates=grouped, fuse_updates=fuse_updates)
        roles = {}          # drops -> the tensors' roles, shared by the search's runs

        def make(cap, drops, small, floor=False, early=None, lookahead=1, headroom=None):
            return _Planner(program, cap, as_policy, conv_algos, checkpoints, block_bytes,
                            drops, small, host_capacity, rankings, floor=floor, early=early,
                            lookahead=lookahead, headroom=headroom,
                            evict_by_next_use=evict_by_next_use, roles=roles)
        return _Search(make, capacity, as_policy, layout, block_bytes, host_capacity,
                       early_write_back, trade_budget, lookahead, device_model, keep_pools,
                       rebuild_joins)

    fused = net if not fuse_relu else fuse.fuse_relus(
        net, batch_norms=fuse_bn_relu, adds=fuse_add_relu, residuals=fuse_bn_add)
    grouping = group_updates and not data_parallel and \
        liveness.groups_updates(fused, fuse_updates)
    storing = fuse.store_argmaxes(fused) if store_argmaxes else fused
    search = searching(storing, grouped=grouping)
    moves_nothing = policy in ("baseline", "liveness")      # they fuse the adds everywhere
    if not (grouping or storing is not fused or (fuse.fuses_adds(fused) and not moves_nothing)):
        return search
    # the nets made only where they fit unmoved, most fused first: the max pools' argmaxes
    # stored (their bytes alone may tip it), then the adds' fusions and grouped updates
    stored_anyway = False
    if fits_unmoved is None:
        fits_unmoved = STORED if _fits_unmoved(search) else False
        if not fits_unmoved and storing is not fused:
            stored_anyway = _moves_by_design(policy) and _fits_unmoved(
                searching(storing, grouped=grouping, as_policy="liveness"))
            if not stored_anyway:
                search = searching(fused, grouped=grouping)
                fits_unmoved = _fits_unmoved(search)
    elif fits_unmoved is True and storing is not fused:   # False: planned apart below
        search = searching(fused, grouped=grouping)
    if not fits_unmoved:
        apart = fused if moves_nothing or not fuse.fuses_adds(fused) else fuse.fuse_relus(
            net, batch_norms=fuse_bn_relu, adds=False)
        search = searching(fuse.store_argmaxes(apart) if stored_anyway else apart)
    search.fits_unmoved = fits_unmoved
    return search


def _moves_by_design(policy) -> bool:
    """True for the policies that copy checkpoints out (and drop outputs) whatever the cap
    ("offload", "recompute"): a plan of theirs never fits unmoved, so whether their max
    pools store argmaxes is what "liveness" decides at the same cap (it moves nothing and
    fits unmoved there, with them stored): the rung below's choice, so their peaks keep
    falling along the ladder (with the argmaxes stored under "liveness" alone, a net whose
    pool backward then needed no workspace peaked 1 KB higher under "offload" than under
    "liveness")."""
    return policy in ("offload", "recompute")


def _fits_unmoved(search) -> bool:
    """True where the search's plan that drops nothing fits its cap and copies nothing out.
    Past that point `_search` plans a residual add's ReLU apart: as a layer of its own it
    is cheap, and a plan may drop its output and recompute it, where fused into the add it
    can only be carried over PCIe or rebuilt by a trade (ResNet-50 under 12 GiB, 60 GiB
    host, batch 897, predicted a step: 1.214 s fused, 0.883 apart). At 256 and 512 fused
    would be predicted faster (0.155 s against 0.165; 0.338 against 0.357); planning both
    and keeping the faster doubled the planning of every net past its cap. Policies that
    move nothing ("baseline", "liveness") always fuse them: it only saves memory there."""
    try:
        return not search.first(None).bytes_to_host
    except OutOfMemory:
        return False


VARIANTS = (None, "from_checkpoints", "strict")   # what `drops` a policy's runs may use


def _choose(search, policy, any_fit: bool = False) -> Plan:
    """The policy's plan among the search's runs; with `any_fit`, the first that fits (all
    `max_batch` needs to know: the same answer to "does it fit", fewer runs)."""
    if policy in ("baseline", "liveness", "offload"):
        return _pick(search, (None,), _peak, any_fit)
    if policy == "all":
        # Move or recompute nothing while everything fits. Once something must move, the
        # plan that moves the fewest bytes: dropping cheap layers' outputs and recomputing
        # them beats carrying them over PCIe and back (a ResNet-50 step at batch 897 took
        # 1.27x its copy time on the H200: moves dominate).
        # Then trade copies for recomputing conv, add and concat outputs where the step-time
        # model predicts a faster step (`_trade`), and prefetch further ahead where it
        # predicts that pays (`_ahead`); fit does not change, so `any_fit` skips both.
        try:
            cached = search.first(None)
            if not cached.bytes_to_host or any_fit:
                return cached
        except OutOfMemory:
            pass
        fewest = _pick(search, VARIANTS, _moved_then_peak, any_fit)
        if any_fit:
            return fewest
        best = _ahead(search, _trade(search, _keep(search, fewest)))
        if _trades_for(fewest) == 0:                    # a net too deep to search
            return best
        return _faster(search, [best, _speed_everywhere(search)])
    # "recompute": cost-aware, recomputation only where it lowers the peak
    return _pick(search, VARIANTS, _peak, any_fit)


def _speed_everywhere(search) -> Plan | None:
    """The "all" pipeline (fewest bytes moved, `_trade`, `_ahead`) again with every
    recompute segment speed-centric (recompute.strategies), or None when none of its
    variants fits. Its plans hold more at once and may move more; the step-time model
    decides (ResNet-50 under 12 GiB: predicted 7% faster at batch 256 and 29% at 512,
    slower at 897, where the paper's rule stays)."""
    variants = [recompute.Traded(v, frozenset(), True) for v in VARIANTS if v is not None]
    try:
        fewest = _pick(search, variants, _moved_then_peak, False)
    except OutOfMemory:
        return None
    return _ahead(search, _trade(search, _keep(search, fewest)))


def _faster(search, plans) -> Plan:
    """The plan of `plans` (None: did not fit) the model predicts fastest as it will run,
    the earlier one on a tie."""
    fitted = [p for p in plans if p is not None]
    return min(fitted, key=search.step_seconds)


def _trade(search, base: Plan) -> Plan:
    """`base`, or a plan predicted faster that also drops the outputs of some rebuildable
    layers (conv, add, concat) and recomputes them: when PCIe bounds the step and compute
    has slack, a conv rebuilt from its input costs less time than its copy out and back.
    At most `search.trade_budget` plans (`_Trade` says how they are chosen), and at most
    TRADE_STEPS plan steps in all, per search (policy "all" runs two: the paper's recompute
    rule and speed-centric everywhere): planning time grows with the step count, so a net
    of thousands of layers (50,000 steps a plan) trades few layers or none, and its
    planning stays within the time of a few plans."""
    if not base.bytes_to_host:
        return base
    trade = _Trade(search, base)
    while trade.left > 0:
        trade.add_layers()
        if not trade.switch_variant():
            break
    return trade.best


def _trades_for(plan) -> int:
    """How many plans of `plan`'s length one trade search may make within TRADE_STEPS
    (each counts twice: the plan and its early write-back)."""
    return TRADE_STEPS // (2 * max(1, len(plan.steps)))


class _Trade:
    """The state of `_trade`'s greedy search: the best plan so far, its predicted step (as
    it will run: written back early), its drop choice and the plans left to make.

    `add_layers`: take the next `k` layers whose outputs the best plan moves, most bytes per
    second of forward compute first (timing.rebuild_order), add them to its drop choice
    (recompute.Traded) and plan again; keep the change when the new plan fits the cap and is
    predicted faster. `k` starts at 1, doubles after a kept change and halves after a
    refused one; a layer refused alone is not tried again. `switch_variant`: the same
    layers with each other way of dropping cheap layers (VARIANTS), for when the rebuilt
    layers have made room for one that did not fit before."""

    def __init__(self, search, base: Plan):
        self.left = min(search.trade_budget, _trades_for(base))
        self.search, self.refused = search, set()
        self.best, self.best_s = base, search.step_seconds(base)
        self.variant, self.chosen = recompute.split(base.drops)
        self.speed_everywhere = recompute.speed_everywhere(base.drops)
        self.kept = recompute.kept(base.drops)

    def attempt(self, variant, layers) -> bool:
        """Plan `variant` with `layers` dropped; keep it if it fits and is faster."""
        self.left -= 1
        try:
            first = self.search.first(recompute.Traded(variant, frozenset(layers),
                                                       self.speed_everywhere, self.kept))
        except OutOfMemory:
            return False
        seconds = self.search.step_seconds(first)
        if seconds >= self.best_s:
            return False
        self.best, self.best_s, self.variant, self.chosen = first, seconds, variant, set(layers)
        return True

    def add_layers(self):
        from .timing import rebuild_order
        k = 1
        while self.left > 0:
            order = rebuild_order(self.best, self.search.device_model)
            group = [i for i in order if i not in self.refused][:k]
            if not group:
                return
            if self.attempt(self.variant, self.chosen | set(group)):
                k *= 2
                continue
            if k == 1:
                self.refused.add(group[0])
            k = max(1, k // 2)

    def switch_variant(self) -> bool:
        """True when another variant with the chosen layers is faster (then it is kept)."""
        switched = False
        for variant in VARIANTS:
            if variant != self.variant and self.left > 0:
                switched |= self.attempt(variant, self.chosen)
        return switched


def _keep(search, base: Plan) -> Plan:
    """`base`, or a plan predicted faster that keeps the outputs of some of the pooling
    layers `base` drops (recompute.Traded.kept), each tried once in forward order and kept
    when the plan fits and the step-time model predicts it faster. A dropped pooling
    output is rebuilt from its input, four times its size after a 2x2 stride, which must
    then be back on the device first: ResNet-50's stem conv output (3 GB at batch 995)
    comes back before the first block's backward pass, where the pool is fullest, only to
    rebuild a 0.8 GB tensor. Kept, that input is needed only by the stem's own backward
    pass, after the block (ResNet-50 under 12 GiB, 60 GiB host: predicted 1.169 s instead
    of 1.524 at batch 995, 0.945 instead of 1.195 at 897). It runs before the trade search,
    which keeps what it kept. `search.keep_pools` False skips it (plans made before it)."""
    if not base.bytes_to_host or not search.keep_pools or not base.uses_recompute:
        return base
    rebuilt = {s.layer for s in base.steps if s.phase == "recompute"}
    candidates = [layer for layer in base.net.layers
                  if layer.op == "pool" and layer.name in rebuilt
                  and layer.numel < sum(x.numel for x in layer.inputs)]
    best, best_s = base, search.step_seconds(base)
    for layer in candidates[:max(0, _trades_for(base))]:
        variant, layers = recompute.split(best.drops)
        drops = recompute.Traded(variant, layers, recompute.speed_everywhere(best.drops),
                                 recompute.kept(best.drops) | {layer.index})
        try:
            plan = search.first(drops)
        except OutOfMemory:
            continue
        seconds = search.step_seconds(plan)
        if seconds < best_s:
            best, best_s = plan, seconds
    return best


def _rebuild_joins(search, base: Plan) -> Plan:
    """`base` (the plan `_ahead` chose), or a plan predicted faster that also drops the
    outputs of some joins (add, concat) whose copies `base` moves, directly or through the
    ReLU after a residual add (timing.rebuild_order's `through_cheap`), and rebuilds them from
    the join's inputs: the rest of the block before it, run again. Where a step is bound by
    copies out during the forward pass and back during the backward pass, each such output
    costs its bytes twice over PCIe, against one block's forward compute.

    Its plans keep a rebuilt tensor at most KEEP_WITHIN layer passes ahead
    (Traded.keep_within): a join rebuilt for the next block's backward pass must not hold
    its own block's rebuilt tensors until that block's backward pass, where the memory they
    take would push other tensors out. Each choice is judged as it will run, its prefetch
    distance chosen by `_ahead`: rebuilds change what must arrive when, and one step ahead
    ranks them differently. The search adds, in rounds, the one join or the two joins next
    to each other in forward order whose plan is predicted fastest, while that beats the
    best so far: rebuilding two alternate block outputs can pay where neither does alone.
    ResNet-50 under 12 GiB at batch 995, 60 GiB host, the H200's measured conv times: layer2
    block 2's add, then blocks 1 and 3's together, then layer3 block 0's; predicted 1.092 s
    -> 0.988, measured on the H200 1.016 -> 0.913 s (bench/README.md). At most JOIN_BUDGET
    plans, and TRADE_STEPS plan steps' worth of them (a net too deep to trade is skipped)."""
    joins, base_s = _join_candidates(search, base)
    if not joins:
        return base
    variant, chosen = recompute.split(base.drops)

    def as_run(layers):
        """The plan dropping `layers` as well, its distance chosen, and its seconds."""
        drops = recompute.Traded(variant, chosen | layers, recompute.speed_everywhere(
            base.drops), recompute.kept(base.drops), KEEP_WITHIN)
        try:
            plan = _ahead(search, search.first(drops))
        except OutOfMemory:
            return None, float("inf")
        return plan, search.step_seconds(plan)

    best, best_s, added = base, base_s, frozenset()
    left = min(JOIN_BUDGET, TRADE_STEPS // max(1, len(base.steps)))
    while left > 0:
        rest = [i for i in joins if i not in added]
        moves = [{i} for i in rest] + [{a, b} for a, b in zip(rest, rest[1:])]
        tried = [(*as_run(added | move), move) for move in moves[:left]]
        left -= len(tried)
        if not tried:
            break
        plan, seconds, move = min(tried, key=lambda t: t[1])
        if seconds >= best_s:
            break
        best, best_s, added = plan, seconds, added | move
    return best


def _join_candidates(search, base: Plan) -> tuple:
    """Indices, in forward order, of the joins `_rebuild_joins` may add to `base`'s drops,
    and `base`'s predicted step (None where it was not needed). The joins are those whose
    copies it moves (directly or through the ReLU after them) and does not rebuild yet;
    none where rebuilding cannot gain (`_copies_stall`)."""
    from .timing import rebuild_order
    base_s = _copies_stall(search, base)
    if base_s is None:
        return [], None
    _, chosen = recompute.split(base.drops)
    return sorted(i for i in rebuild_order(base, search.device_model, through_cheap=True)
                  if _is_join(base.net.layers[i]) and i not in chosen), base_s


def _copies_stall(search, base: Plan):
    """`base`'s predicted step (s) where rebuilding more of it could make it faster; None
    where the join search is off, nothing moves, the net is too deep to trade, or the model
    says the compute stream waits less than JOIN_WAITS of the step: moving fewer bytes
    gains at most that wait, and the copies already hide behind compute (ResNet-152 at
    batch 256 under 12 GiB waits 0.6%: searching found nothing and tripled its planning
    time)."""
    from .timing import simulate
    if not (search.rebuild_joins and base.bytes_to_host and base.uses_recompute) \
            or _trades_for(base) == 0:
        return None
    timeline = simulate(search.write_back_early(base), search.device_model)
    if sum(timeline.compute_waits().values()) < JOIN_WAITS * timeline.step_s:
        return None
    return timeline.step_s


def _is_join(layer) -> bool:
    """A rebuildable layer that is not a conv: a residual add or a concat."""
    return spec(layer).rebuildable and not spec(layer).has_algorithms


def _ahead(search, base: Plan) -> Plan:
    """`base` planned again with prefetches issued up to `lookahead` layer passes before
    their use, within the room `base` leaves free (`_Planner._prefetch_early`). With the
    search's `lookahead` fixed, that plan where it fits; else, among `base` and its plans
    for each distance of LOOKAHEADS, the one the step-time model predicts fastest as it
    will run (written back early), the shorter distance on a tie. An early block can still
    fragment the pool (a plan may then fail, or choose slower conv algorithms, or evict
    more): the cap and the model decide. Where an allocation fails, the distance is planned
    again with no early block held over the step that failed (Headroom.block), up to
    AHEAD_RETRIES times: ResNet-50 under 12 GiB at batch 995 fails at 64 passes once an
    early block splits the free run a 3.2 GB gradient needs; kept clear of those two steps,
    it fits and is predicted 3% faster than the best distance that fit at once (with the
    conv times measured on the H200; 0.5% with the default model). At most TRADE_STEPS // 8
    plan steps in all, retries included, as `_trade` is bounded."""
    if search.lookahead is not None:
        distances = (search.lookahead,) if search.lookahead > 1 else ()
    else:
        distances = LOOKAHEADS
    plans_left = TRADE_STEPS // (8 * max(1, len(base.steps)))
    best, best_s = base, None
    for k in distances:
        if plans_left <= 0:
            break
        ahead, plans_left = _ahead_at(search, base, k, plans_left)
        if ahead is None:
            continue
        if search.lookahead is not None:
            return ahead
        best_s = best_s or search.step_seconds(base)
        seconds = search.step_seconds(ahead)
        if seconds < best_s:
            best, best_s = ahead, seconds
    return best


def _ahead_at(search, base: Plan, k: int, plans_left: int) -> tuple:
    """(`base` planned with prefetch distance `k`, or None where it does not fit, and the
    plans left): each failed allocation blocks early blocks over its step (Headroom.block)
    and plans again, at most AHEAD_RETRIES times and `plans_left` plans."""
    headroom = offload.Headroom.of(base, search.block_bytes)
    for _ in range(1 + AHEAD_RETRIES):
        if plans_left <= 0:
            break
        plans_left -= 1
        try:
            return search.make(base.capacity, base.drops, base.small_bytes, lookahead=k,
                               headroom=headroom).run(), plans_left
        except OutOfMemory as err:
            if err.step is None or not headroom.block(err.step):
                break
    return None, plans_left


def _pick(search, variants, key, any_fit) -> Plan:
    """The variants' best plan (lowest `key`) at the top of the cap; only if none fits
    there, their best below it, down to their floors. Raises the search's first error."""
    for below in (False, True):
        try:
            return _best([lambda d=d: search.first(d, below) for d in variants], key=key,
                         any_fit=any_fit)
        except OutOfMemory:
            continue
    raise search.error


class _Search:
    """The runs of the planner that decide whether, and with which plan, a net fits a cap.

    Why feasibility is monotone in the cap. A plan keeps every block below its pool's
    capacity, so a plan made for a pool of g bytes is valid under any cap C >= g. Each
    run of `_Planner` is one of two kinds:

    - exact runs (no tensor cache, plain first fit): every decision is independent of the
      cap, and first fit places each request in the lowest free run that is long enough.
      Under a larger cap the free runs are the same except the topmost, which is longer,
      so every request lands at the same offset: the run is the same at every cap where it
      succeeds, and succeeds exactly when the cap is at least its `required_bytes`. Exact
      runs are made at the cap C itself.
    - grid runs (the LRU cache evicts when an allocation fails, dynamic workspaces follow
      the largest free run, the two-ended layout places from the top): these depend on
      the cap and are not monotone in it (a four-stage ResNet at batch 16 fit at
      81,477,321 bytes and failed 1% above). They are only made at caps g of the grid
      (`grid_cap`), which depends on nothing but the block size.

    A variant (a choice of drops) fits at C when its exact run fits at C or its grid run
    fits at some grid cap g <= C; both conditions only grow with C, and so does their OR
    over variants. A grid run at g <= C is only skipped when g is below `floor`, a lower
    bound that no run at any cap can beat, so skipping changes no answer. Near the largest
    batch the floor is tight (ResNet-50 at batch 995 under "all" in 12GiB: the plan's peak
    equals it), so few grid caps lie between it and a failing cap: a failure costs a few
    more runs, not a sweep.
    """

    def __init__(self, make, capacity, policy, layout, block_bytes, host_capacity,
                 early_write_back=False, trade_budget=0, lookahead=1, device_model=None,
                 keep_pools=False, rebuild_joins=False):
        self.make, self.capacity, self.block_bytes = make, capacity, block_bytes
        self.keep_pools, self.rebuild_joins = keep_pools, rebuild_joins
        self.host_capacity, self.early_write_back = host_capacity, early_write_back
        self._written_back = {}   # (id(plan), host cap) -> (plan, write_back_early(plan))
        self.trade_budget, self.lookahead = trade_budget, lookahead
        self.device_model = device_model
        self.fits_unmoved = None  # what fits unmoved, where asked (`_search`)
        self.exact = policy != "all" and layout != "two_ended"
        self.layouts = ([0] if policy == "all" and layout != "two_ended" else []) + \
                       ([None] if layout != "first_fit" else [])   # None: small_bytes_for(cap)
        self.floors = {}
        self.done = {}             # (drops, below) -> the plan or the OutOfMemory it gave
        self.error = None          # the first OutOfMemory of the search: the one raised
        self.found = None          # the last plan that fit

    def first(self, drops, below: bool = False) -> Plan:
        """The first plan that fits for `drops` at the top of the cap (the exact run at
        the cap, then the top grid cap) or, `below`, at the grid caps under the top, down
        to the floor. Runs already made are not repeated. While no run has fit, a fallback
        variant (drops) whose floor is above the cap is not run at all."""
        if (drops, below) not in self.done:
            self.done[drops, below] = self._first(drops, below)
        result = self.done[drops, below]
        if isinstance(result, OutOfMemory):
            raise result
        return result

    def _first(self, drops, below):
        if (drops is not None and self.error and not self.found
                and self.capacity < self.floor(drops)):
            return self.error
        for cap, small in self._attempts(drops, below):
            try:
                self.found = self.make(cap, drops, small).run()
                return self.found
            except OutOfMemory as err:
                self.error = self.error or self._noted(err, cap)
        return self.error

    def _noted(self, err, cap):
        """`err`, saying which grid cap was planned when that is not the cap asked for."""
        if cap == self.capacity:
            return err
        return OutOfMemory(f"{err} [planned at {cap:,} bytes, the grid cap at or below the "
                           f"{self.capacity:,} asked for: see tinysn.sched.plan.grid_cap]")

    def _attempts(self, drops, below):
        """(cap, small_bytes) of the runs to try, by falling cap."""
        if self.exact and not below:
            yield self.capacity, 0
        cap = grid_cap(self.capacity, self.block_bytes)
        if not below:
            yield from self._layouts_at(cap)
            return
        cap = grid_cap(cap - self.block_bytes, self.block_bytes)
        while self.layouts and cap > 0 and cap >= self.floor(drops):
            yield from self._layouts_at(cap)
            cap = grid_cap(cap - self.block_bytes, self.block_bytes)

    def _layouts_at(self, cap):
        for small in self.layouts:
            yield cap, small_bytes_for(cap) if small is None else small

    def step_seconds(self, first: Plan) -> float:
        """The step time of `first` as it would run (written back early where the search
        does that), by the search's device model: what the choices among fits compare."""
        from .timing import simulate
        return simulate(self.write_back_early(first), self.device_model).step_s

    def write_back_early(self, first: Plan) -> Plan:
        """`first` planned again with the victims its LRU cache copied out written back to
        the host early (offload.EarlyWriteBacks): same blocks, evictions, peak and bytes
        moved; the evictions move nothing. `first` itself when its cache copied nothing, or
        when the second pass does not fit the host arena (its blocks are placed earlier, so
        first fit may fragment it differently). Remembered per plan: the trade search,
        `_ahead` and `plan` each ask again for the plans they keep."""
        if not self.early_write_back or first.evictions is None or not first.evictions.victims:
            return first
        key = (id(first), self.host_capacity)
        done = self._written_back.get(key)
        if done is None or done[0] is not first:
            done = self._written_back[key] = (first, self._write_back(first))
        return done[1]

    def _write_back(self, first: Plan) -> Plan:
        early = offload.EarlyWriteBacks(first.evictions, self.host_capacity, self.block_bytes)
        try:
            second = self.make(first.capacity, first.drops, first.small_bytes,
                               early=early, lookahead=first.lookahead,
                               headroom=first.headroom).run()
        except OutOfMemory:
            return first
        same = ("peak_bytes", "required_bytes", "bytes_to_host", "bytes_to_device")
        assert all(getattr(second, k) == getattr(first, k) for k in same), \
            "planner bug: writing victims back early changed the plan's device decisions"
        return second

    def floor(self, drops) -> int:
        """Bytes some step of every run for `drops` holds at once, at any cap (`_Planner`'s
        `floor`); a variant that fails even without a device cap (the host cap) never
        fits, and its floor is infinite."""
        if drops not in self.floors:
            planner = self.make(HOST_CAPACITY, drops, 0, floor=True)
            try:
                planner.run()
                self.floors[drops] = planner.floor
            except OutOfMemory:
                self.floors[drops] = float("inf")
        return self.floors[drops]


def _peak(p):
    return p.peak_bytes


def _moved_then_peak(p):
    return (p.bytes_to_host + p.bytes_to_device, p.peak_bytes)


def _best(candidates, key=_peak, any_fit: bool = False) -> Plan:
    """The feasible plan with the lowest `key` (the earlier candidate on a tie); with
    `any_fit`, the first feasible one."""
    best = None
    for make in candidates:
        try:
            p = make()
        except OutOfMemory as err:
            error = err
            continue
        if any_fit:
            return p
        if best is None or key(p) < key(best):
            best = p
    if best is None:
        raise error
    return best


def max_batch(model_fn, memory, policy: str = "all", *, limit: int = 1 << 16, **kwargs) -> int:
    """The largest batch b such that `model_fn(batch=...)` plans under `memory` at b and at
    every smaller batch (0 if batch 1 does not plan; at most `limit`).

    Feasibility is monotone in the cap but not in the batch: a larger batch changes every
    tensor's size, so first fit, the cache's evictions and the recompute choices all
    change: under "all" and 4,131,072 bytes a two-stage ResNet on 16x16 images plans at
    batches 1-4 and 6-8 but not at 5 (tests/sched/test_monotone.py). So no bisection:
    batches are tried in turn from 1, each up to its first plan that fits, and the first
    batch that does not plan ends the search."""
    for batch in range(1, limit + 1):
        if not fits(model_fn(batch=batch), memory, policy, **kwargs):
            return batch - 1
    return limit


def fits(net, memory, policy: str = "all", **kwargs) -> bool:
    """Whether `net` plans under `memory` (plan's keyword arguments): the first plan that
    fits is enough, and the passes that only make a fitting plan faster (the trade search,
    early prefetches, early write-back) never change the answer, so none is made. Under
    `evict_by_next_use` a net fits when it fits with either eviction order, as in `plan`."""
    kwargs = {**plan.__kwdefaults__, **kwargs}
    _check_eviction_flag(kwargs["evict_by_next_use"])
    kwargs.pop("channels_last")         # a layout: it never changes whether a plan fits
    orders = [False]
    if kwargs["evict_by_next_use"] and policy == "all":
        orders.append(True)
    for by_next_use in orders:
        search = _search(net, memory, policy, **{**kwargs, "evict_by_next_use": by_next_use})
        try:
            _choose(search, policy, any_fit=True)
            return True
        except OutOfMemory:
            kwargs["fits_unmoved"] = search.fits_unmoved   # the next order's answer too
    return False


class _Planner:
    """Simulates one iteration through a BlockAllocator and writes down every operation."""

    def __init__(self, program, capacity, policy, conv_algos, checkpoints, block_bytes,
                 drops=None, small_bytes=0, host_capacity=HOST_CAPACITY, rankings=None,
                 floor=False, early=None, lookahead=1, headroom=None,
                 evict_by_next_use=False, roles=None):
        """`floor=True` also records `floor` (see `_track_floor`); else `floor` is None.
        `early` (offload.EarlyWriteBacks): the victims to write back ahead of eviction.
        `lookahead` > 1 (with `headroom`, offload.Headroom, the first pass's free bytes):
        how many layer passes before its use a prefetch may be issued.
        `evict_by_next_use`: the cache's victim is the member used furthest ahead (`plan`).
        `roles` (a dict the runs of one search share): the tensors' roles by `drops`, which
        they depend on alone there (`_choose_roles`), made once per variant."""
        self.program = program
        self.lookahead, self.headroom = lookahead, headroom
        self.room = headroom.fresh() if headroom is not None else None
        self.floor = 0 if floor else None
        self.policy = policy
        self.tensors = list(program.tensors)
        self.small_bytes = small_bytes
        self.dev = BlockAllocator(capacity, block_bytes, small_bytes)
        self.host = BlockAllocator(host_capacity, block_bytes)
        self.n_forward = len(program.order)
        self.loc, self.dblock, self.hblock = {}, {}, {}
        self.dblock_bytes = 0     # the bytes of the blocks in `dblock`, kept as it changes
        self.cache = offload.LRUCache(self.dblock) if policy == "all" else None
        self.evict_by_next_use = evict_by_next_use
        self.now = -1              # the layer pass being planned (a rebuild: the one it serves)
        self.sorted_uses = None    # tid -> its uses in order, made at the first eviction
        self.evictions = offload.EvictionLog() if policy == "all" else None
        self.early = early
        self.always_offload = policy in ("offload", "recompute")
        self.recompute = drops is not None
        self.drops = drops
        self.chooser = workspace.AlgoChooser(dynamic=policy == "all", pinned=conv_algos,
                                             rankings=rankings)
        self.producer = {program.act[layer]: layer for layer in program.order}
        self.locked = set()
        self.rebuilt = set()       # dropped tensors currently rebuilt on the device
        self.steps, self.conv_algos = [], {}
        self.to_host = self.to_device = self.extent = 0
        self.used = []                   # (start, end) of every device block handed out
        self.where = "setup"
        # stream ordering (see the module docstring)
        self.kernels = 0                 # kernel ops so far in the iteration
        self.n_slots = 0                 # event slots handed out
        self.marks = {}                  # kernel position -> slot of the compute event after it
        self.d2h = {}                    # tid -> slot of the copy that made its host copy
        self.h2d = {}                    # tid -> slot of its last prefetch
        self.reading = {}                # tid -> slot of a copy reading its device block
        self.dev_freed = offload.FreedRanges()
        self.host_freed = offload.FreedRanges()
        self._choose_roles(checkpoints, roles)

    # -- which tensors get which treatment --------------------------------------------
    def _choose_roles(self, checkpoints, roles=None):
        """Which tensors this run drops and rebuilds (`dropped`, `schedule`, the `uses` that
        rebuilds add), copies out (`offloaded`) and last reads in the forward pass: from
        `roles` where a run of the same search and drops made them (none changes them)."""
        made = roles.get(self.drops) if roles is not None else None
        if made is None:
            self._make_roles(checkpoints)
            made = (self.dropped, self.schedule, self.uses, self.offloaded,
                    self.last_forward_use)
            if roles is not None:
                roles[self.drops] = made
        (self.dropped, self.schedule, self.uses, self.offloaded,
         self.last_forward_use) = made

    def _make_roles(self, checkpoints):
        p = self.program
        ckpt = offload.checkpoint_layers(p, checkpoints) if self.always_offload else set()
        variant, extra = recompute.split(self.drops)
        kept = {layer for layer in p.order if layer.index in recompute.kept(self.drops)}
        self.dropped = (recompute.dropped_tensors(p, variant == "from_checkpoints", ckpt | kept,
                                                  extra, cheap_layers=variant is not None)
                        if self.recompute else set())
        if self.recompute:
            l_peak = recompute.layer_peak(p, self._default_workspace)
            self.schedule = recompute.RecomputeSchedule(
                p, self.dropped, recompute.strategies(
                    p, l_peak, extra, recompute.speed_everywhere(self.drops)),
                recompute.keep_within(self.drops))
            self.uses = self.schedule.uses
            keep = ckpt | recompute.extra_checkpoints(p, self.dropped, extra)
        else:
            self.schedule = None
            self.uses = p.uses
            keep = ckpt
        self.offloaded = set()
        if self.always_offload:
            self.offloaded = {p.act[layer] for layer in keep
                              if self.uses[p.act[layer]][-1] >= self.n_forward}
        assert not (self.offloaded & self.dropped), "a tensor is either moved or rebuilt"
        self.last_forward_use = {}
        for tid, uses in self.uses.items():
            fwd = [u for u in uses if u < self.n_forward]
            if fwd:
                self.last_forward_use[tid] = fwd[-1]

    def _default_workspace(self, step) -> int:
        layer = step.layer
        if spec(layer).has_algorithms:
            return self.chooser.choose(layer, self._conv_phases(step), 0)[1]
        return workspace.fixed_workspace(layer, step.phase)

    def _conv_phases(self, step):
        if step.phase == "forward":
            return ("forward",)
        has_dx = step.layer.inputs[0] in self.program.grad
        return ("backward_data", "backward_weight") if has_dx else ("backward_weight",)

    # -- the simulation ---------------------------------------------------------------
    def run(self) -> Plan:
        p = self.program
        setup = []
        persistent = [t.id for t in p.tensors if t.persistent]
        if self.policy == "baseline":
            persistent = [t.id for t in p.tensors]
        for tid in persistent:
            owner = self.tensors[tid].layer
            self.where = f"setup of layer {owner.name if owner else '(input)'}"
            self._alloc(tid, setup)
        if self.policy == "baseline":
            self.baseline_ws = {}
            for step in p.passes:
                size = self._default_workspace(step)
                if size:
                    self.baseline_ws[step.index] = self._new_workspace(step.layer, size, setup)
        setup_bytes = self.dev.in_use
        for step in p.passes:
            self.where = f"{step.phase} of layer {step.layer.name}"
            if step.phase == "backward" and self.schedule:
                for tid in self.schedule.rebuild.get(step.index, ()):
                    self._recompute(tid, step)
            self._run_step(step)
        leaked = self.dev.in_use - setup_bytes
        assert leaked == 0, f"planner bug: {leaked} bytes still allocated after the iteration"
        assert self.host.in_use == 0, (f"planner bug: {self.host.in_use} host bytes still "
                                       f"allocated after the iteration")
        self._insert_marks()
        return Plan(
            net=p.net, policy=self.policy, capacity=self.dev.capacity, momentum=p.momentum_value,
            tensors=self.tensors, setup=setup, steps=self.steps, peak_bytes=self.dev.peak,
            required_bytes=self.extent, setup_bytes=setup_bytes,
            host_bytes=max(self.host.peak, 1), bytes_to_host=self.to_host,
            bytes_to_device=self.to_device,
            recomputed_steps=sum(1 for s in self.steps if s.phase == "recompute"),
            conv_algos=self.conv_algos, uses_recompute=self.recompute, program=p,
            small_bytes=self.small_bytes, event_slots=self.n_slots, drops=self.drops,
            evictions=self.evictions, lookahead=self.lookahead, headroom=self.headroom,
            batch_staging=self._batch_staging())

    def _batch_staging(self) -> int | None:
        """Where the runtime stages the next batch (sched/staging.py): the highest span no
        block of this plan ever occupies; None where none is wide enough, or for a
        data-parallel rank (it checks its batch on the host before its step)."""
        if self.program.data_parallel:
            return None
        span = staging.span_bytes(*staging.batch_nbytes(self.program, self.tensors))
        return staging.find_span(self.used, self.dev.capacity, span)

    def _run_step(self, step):
        self.now = step.index
        ops = []
        touched = list(dict.fromkeys(step.reads + step.writes))
        for tid in dict.fromkeys(step.reads):
            self._make_readable(tid, ops)
        self.locked = set(touched)
        for tid in dict.fromkeys(step.writes):
            if self.loc.get(tid) in ("gpu", "offloading"):
                continue
            if step.in_place and step.in_place[0] == tid and self.policy != "baseline":
                self._hand(*step.in_place, ops)
            else:
                self._alloc(tid, ops)
        if self.floor is not None:
            self._track_floor(step)
        algos, ws = self._workspace(step, ops)
        ops.append(Launch(step.index, algos, ws))
        self.kernels += 1
        self._record(Step(len(self.steps), step.layer.name, step.phase, ops, self.dev.in_use,
                          len(self.dblock), algos), touched)
        if ws is not None and self.policy != "baseline":
            self._free(ws, ops)
        for tid in touched:
            if tid in self.cache_members():
                self.cache.touch(tid)
        self.locked = set()
        self._after(step.index, touched, ops)
        self._write_back(ops)
        if step.index + 1 < len(self.program.passes):
            self._lookahead(self.program.passes[step.index + 1], ops)
            self._prefetch_early(step.index, ops)

    def _track_floor(self, step):
        """Raise `floor` to the bytes this step holds at any cap, its kernel about to launch.

        Only LRU cache members are ever evicted, and only when the cap is short; every other
        tensor is allocated, freed, dropped and released at points the program and the drop
        choice fix, whatever the cap. So at this launch every run holds at least the blocks
        of the non-members alive here and of the tensors the step reads and writes (locked),
        plus a workspace no smaller than the smallest the step can choose (baseline's are
        allocated up front, already counted). No cap below the floor can be planned."""
        held = self.dblock_bytes           # kept as blocks come and go: no sum over them
        if self.cache is not None:
            held -= self.cache.nbytes - sum(self.dblock[t].nbytes for t in self.locked
                                            if t in self.cache)
        ws = 0 if self.policy == "baseline" else self._default_workspace(step)
        bb = self.dev.block_bytes
        self.floor = max(self.floor, held + -(-ws // bb) * bb)

    def cache_members(self):
        return self.cache if self.cache is not None else ()

    def _recompute(self, tid, step):
        """Rebuild dropped tensor `tid` before backward `step` (a recompute step)."""
        self.now = step.index
        layer = self.producer[tid]
        ops = []
        inputs = [self.program.act[x] for x in layer.inputs]
        for xid in inputs:
            self._make_readable(xid, ops)
        self.locked = set(inputs) | set(self.program.passes[step.index].reads) | {tid}
        self._alloc(tid, ops)
        algos, size = workspace.rebuild_workspace(layer, self.conv_algos)
        ws = self._new_workspace(layer, size, ops) if size else None
        ops.append(Launch(("recompute", layer.index), algos, ws))
        self.kernels += 1
        self._record(Step(len(self.steps), layer.name, "recompute", ops, self.dev.in_use,
                          len(self.dblock)), inputs + [tid])
        if ws is not None:
            self._free(ws, ops)
        self.locked = set()
        self.rebuilt.add(tid)
        later = self.schedule.rebuild[step.index]
        rest = later[later.index(tid) + 1:]
        for xid in inputs:   # an input needed only for this rebuild goes right away
            if xid in self.rebuilt and step.index not in self.program.uses[xid] \
                    and not self.schedule.keep_after(xid, step.index) and not any(
                    xid in [self.program.act[y] for y in self.producer[r].inputs] for r in rest):
                self._retire_rebuilt(xid, step.index, ops)
        self._write_back(ops)

    def _record(self, record, used):
        """Append an executed step whose kernel uses `used`, noting both in the eviction log."""
        self.steps.append(record)
        if self.evictions is not None:
            self.evictions.stepped(record.index, used, self.host.in_use)

    def _write_back(self, ops):
        """Start copying to the host the victims due after the step just launched (a second
        pass: `early`); each stays on the device, readable, until its eviction frees it."""
        if self.early is None:
            return
        index = len(self.steps) - 1
        for tid in self.early.after(index):
            if self.loc.get(tid) == "gpu" and tid not in self.hblock and self.early.admit(
                    tid, self.tensors[tid].nbytes, index):
                self._offload(tid, ops)

    def _retire_rebuilt(self, tid, index, ops):
        self.rebuilt.discard(tid)
        if self.uses[tid][-1] > index:
            self._drop(tid, ops)
        else:
            self._free(tid, ops)

    def _after(self, index, touched, ops):
        """Frees, drops, offloads and releases once a step's kernel has been launched."""
        p = self.program
        if index >= self.n_forward:
            for tid in list(self.rebuilt):
                if not self.schedule.keep_after(tid, index):
                    self._retire_rebuilt(tid, index, ops)
        candidates = set(touched)
        if self.schedule and index in self.schedule.rebuild:
            for tid in self.schedule.rebuild[index]:
                candidates |= {p.act[x] for x in self.producer[tid].inputs}
        for tid in sorted(candidates):
            info = self.tensors[tid]
            state = self.loc.get(tid)
            if info.persistent or self.policy == "baseline":
                continue
            if self.uses[tid][-1] <= index and state in ("gpu", "offloading", "host", "handed"):
                self._free(tid, ops)        # "host": evicted after a rebuild read it last
                continue
            if state not in ("gpu", "offloading"):
                continue
            if tid in self.offloaded and self.loc[tid] == "gpu" and tid not in self.hblock:
                self._offload(tid, ops)
            if index == self.last_forward_use.get(tid) and index < self.n_forward:
                if tid in self.dropped:
                    self._drop(tid, ops)
                elif tid in self.offloaded:
                    ops.append(Release(tid))
                    self._release_device(tid, "host")

    def _on_host(self, nxt) -> list:
        """What step `nxt` (and the recomputations before it) will read that is on the host
        now, in the order it is read."""
        needed = list(nxt.reads)
        if self.schedule and nxt.index in self.schedule.rebuild:
            for tid in self.schedule.rebuild[nxt.index]:
                needed += [self.program.act[x] for x in self.producer[tid].inputs]
        return [t for t in dict.fromkeys(needed) if self.loc.get(t) == "host"]

    def _lookahead(self, nxt, ops):
        """Prefetch what the next step (and the recomputations before it) will read."""
        needed = self._on_host(nxt)
        if not needed:
            return
        self.locked = set(nxt.reads) | set(nxt.writes) | set(needed)
        for tid in needed:
            self._prefetch(tid, ops)
        self.locked = set()

    def _prefetch_early(self, index, ops):
        """After pass `index`, prefetch what passes index+2 .. index+lookahead will read, in
        the order they read it, placed from the top of the pool (away from the blocks first
        fit is about to hand out), while each block fits as the pool is (nothing is evicted
        for it) and within the room the first pass left until its own prefetch (`room`):
        the copy then overlaps the compute of the steps in between. The first that does
        not go ends it, so the host-to-device stream stays in use order; that one is
        prefetched later, at the latest one step ahead (`_lookahead`)."""
        if self.room is None:
            return
        passes, issue = self.program.passes, len(self.steps) - 1
        for j in range(index + 2, min(index + 1 + self.lookahead, len(passes))):
            for tid in self._on_host(passes[j]):
                nbytes = self.tensors[tid].nbytes
                if self.dev.placement(nbytes, top=True) is None or not self.room.admit(
                        issue, j, block_rounded(nbytes, self.dev.block_bytes)):
                    return
                self._prefetch(tid, ops, top=True)

    # -- primitive operations ---------------------------------------------------------
    def _make_readable(self, tid, ops):
        state = self.loc.get(tid)
        if state == "host":          # not prefetched in time: fetch now and wait
            self._prefetch(tid, ops)
            state = "prefetching"
        if state == "prefetching":
            ops.append(Wait(tid))
            self.loc[tid] = "gpu"
        elif state not in ("gpu", "offloading"):
            raise AssertionError(f"planner bug: {self.tensors[tid].name} read while {state}")
        if tid in self.cache_members():
            self.cache.touch(tid)

    def _alloc(self, tid, ops):
        info = self.tensors[tid]
        block = self._dev_alloc(info.nbytes, info.name, ops)
        self.dblock[tid] = block
        self.dblock_bytes += block.nbytes
        self.loc[tid] = "gpu"
        ops.append(Alloc(tid, block.offset))
        _, slots = self.dev_freed.take(block.offset, block.end)
        if slots:       # copies may still be reading these bytes: the kernel waits for them
            ops.append(Sync(tuple(sorted(slots))))
        if (self.cache is not None and info.role == "act" and not info.persistent
                and tid not in self.dropped):
            self.cache.touch(tid)

    def _hand(self, tid, source, ops):
        """Give `tid` the block of `source`, which this step's kernel reads for the last
        time (a gradient written in place over dy): one block fewer while it runs."""
        assert self.loc.get(source) == "gpu" and source not in self.reading, \
            "planner bug: handing over a block that is moving or not on the device"
        self.dblock[tid] = self.dblock.pop(source)
        self.loc[tid], self.loc[source] = "gpu", "handed"
        ops.append(Hand(tid, source))

    def _dev_alloc(self, nbytes, name, ops, top=False):
        """Allocate on the device (from the top with `top`); under the cache policy, evict
        LRU activations (appending the Evict operations to `ops`) until the request fits."""
        while True:
            try:
                block = self.dev.alloc(nbytes, top)
                self.extent = max(self.extent, block.offset + block.nbytes)
                self.used.append((block.offset, block.end))
                return block
            except OutOfMemory:
                if self.cache is None or not self._evict_one(ops):
                    raise OutOfMemory(
                        f"plan does not fit ({self.policy}): step {len(self.steps)} "
                        f"({self.where}) needs {nbytes:,} bytes for {name}, but the cap of "
                        f"{self.dev.capacity:,} bytes leaves {self.dev.free_bytes:,} free "
                        f"(largest free run {self.dev.largest_free:,})",
                        step=len(self.steps)) from None

    def _evict_one(self, ops) -> bool:
        victims = self.cache.victims(self.locked)
        if self.evict_by_next_use:
            victims = sorted(victims, key=self._next_use, reverse=True)   # stable: LRU ties
        for tid in victims:
            if self.loc.get(tid) not in ("gpu", "offloading"):
                continue
            if tid in self.hblock:           # written back before (a prefetch or `early`)
                ops.append(Evict(tid, None, None, ()))
            else:
                hoff, slot, waits = self._copy_out(tid)
                ops.append(Evict(tid, hoff, slot, waits))
                self.to_host += self.tensors[tid].nbytes
                self.evictions.evicted(tid)
            self._release_device(tid, "host")
            return True
        return False

    def _next_use(self, tid) -> int:
        """The first layer pass after the one being planned that uses `tid` (a rebuild
        counts at the pass it serves); past the last pass when none does."""
        if self.sorted_uses is None:      # a rebuild's uses come after the pass's own
            self.sorted_uses = {t: sorted(u) for t, u in self.uses.items()}
        uses = self.sorted_uses[tid]
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else len(self.program.passes)

    def _copy_out(self, tid):
        """Host block, event slot and waits of a device-to-host copy of `tid`: the copy must
        not overwrite host bytes that a prefetch in flight still reads."""
        try:
            block = self.host.alloc(self.tensors[tid].nbytes)
        except OutOfMemory:
            raise OutOfMemory(f"plan does not fit ({self.policy}): step {len(self.steps)} "
                              f"({self.where}) copies {self.tensors[tid].nbytes:,} bytes of "
                              f"{self.tensors[tid].name} to the host, but the host cap of "
                              f"{self.host.capacity:,} bytes leaves {self.host.free_bytes:,} "
                              f"free") from None
        self.hblock[tid] = block
        if self.evictions is not None:
            self.evictions.host_alloc(self.host.in_use)
        _, waits = self.host_freed.take(block.offset, block.end)
        slot = self._slot()
        self.d2h[tid] = self.reading[tid] = slot
        return block.offset, slot, tuple(sorted(waits))

    def _slot(self) -> int:
        self.n_slots += 1
        return self.n_slots - 1

    def _mark(self, pos: int) -> int:
        """Slot of the compute-stream event recorded right after kernel number `pos`."""
        if pos not in self.marks:
            self.marks[pos] = self._slot()
        return self.marks[pos]

    def _offload(self, tid, ops):
        hoff, slot, waits = self._copy_out(tid)
        ops.append(Offload(tid, hoff, slot, waits))
        self.loc[tid] = "offloading"
        self.to_host += self.tensors[tid].nbytes

    def _free_device_block(self, tid):
        """Free tid's device block, remembering what may still read it."""
        block = self.dblock.pop(tid)
        self.dblock_bytes -= block.nbytes
        assert self.loc.get(tid) != "prefetching", "planner bug: freeing a block still arriving"
        self.dev.free(block)
        copy = self.reading.pop(tid, None)
        self.dev_freed.add(block.offset, block.end, self.kernels, () if copy is None else (copy,))

    def _release_device(self, tid, state):
        self._free_device_block(tid)
        self.loc[tid] = state
        if self.cache is not None:
            self.cache.remove(tid)

    def _prefetch(self, tid, ops, top=False):
        """Allocate `tid`'s block (from the pool's top with `top`) and copy it back."""
        block = self._dev_alloc(self.tensors[tid].nbytes, self.tensors[tid].name, ops, top)
        self.dblock[tid] = block
        self.dblock_bytes += block.nbytes
        self.loc[tid] = "prefetching"
        pos, waits = self.dev_freed.take(block.offset, block.end)
        waits.add(self.d2h[tid])                  # the host copy must be complete
        if pos:
            waits.add(self._mark(pos))            # kernels that read the old contents
        slot = self.h2d[tid] = self._slot()
        ops.append(Prefetch(tid, block.offset, slot, tuple(sorted(waits)), top))
        self.to_device += self.tensors[tid].nbytes
        if self.cache is not None:
            self.cache.touch(tid)

    def _drop(self, tid, ops):
        ops.append(Drop(tid))
        self._release_device(tid, "dropped")

    def _free(self, tid, ops):
        ops.append(Free(tid))
        if tid in self.dblock:
            self._free_device_block(tid)
        if tid in self.hblock:
            block = self.hblock.pop(tid)
            self.host.free(block)
            if tid in self.h2d:           # a prefetch may still be reading it
                self.host_freed.add(block.offset, block.end, 0, (self.h2d.pop(tid),))
            self.d2h.pop(tid, None)
        self.loc[tid] = "freed"
        if self.cache is not None:
            self.cache.remove(tid)

    def _insert_marks(self):
        """Put each Mark right after the kernel whose position a copy waits for."""
        if not self.marks:
            return
        pos = 0
        for step in self.steps:
            ops = []
            for op in step.ops:
                ops.append(op)
                if isinstance(op, Launch):
                    pos += 1
                    if pos in self.marks:
                        ops.append(Mark(self.marks[pos]))
            step.ops[:] = ops

    def _new_workspace(self, layer, size, ops) -> int:
        info = TensorInfo(len(self.tensors), f"{layer.name}.workspace", (size,),
                          torch.uint8, "workspace", layer, "workspace")
        self.tensors.append(info)
        self._alloc(info.id, ops)
        return info.id

    def _workspace(self, step, ops):
        """Choose conv algorithms and allocate the step's workspace (None if it needs none)."""
        layer = step.layer
        if self.policy == "baseline":
            algos = None
            if spec(layer).has_algorithms:
                algos, _ = self.chooser.choose(layer, self._conv_phases(step), 0)
                self.conv_algos.setdefault(layer.name, {}).update(algos)
            return algos, self.baseline_ws.get(step.index)
        if spec(layer).has_algorithms:
            algos, size = self.chooser.choose(layer, self._conv_phases(step), self.dev.largest_free)
            self.conv_algos.setdefault(layer.name, {}).update(algos)
        else:
            algos, size = None, workspace.fixed_workspace(layer, step.phase)
            spare = spec(layer).spare_workspace(layer, step.phase)
            if self.policy == "all" and not size and 0 < spare <= self.dev.largest_free:
                algos, size = {step.phase: SPARE}, spare
        return algos, (self._new_workspace(layer, size, ops) if size else None)
