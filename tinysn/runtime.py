"""Runtime: owns the arenas and executes the plan, step by step, every iteration.

`Runtime(net, memory, policy)` first refuses a `memory` or `host_memory` larger than the
machine has, then plans (so a cap that is too small fails before any memory is taken or any
kernel runs), then creates the device arena of exactly `memory` bytes. Under policy "all"
the conv algorithms are ranked by speed inside that arena while it is still empty (or read
from the on-disk cache, sched/workspace.py) and the plan is made again with those rankings.
Then a pinned host arena of the size the plan needs, the persistent tensors (parameters,
batch-norm statistics, optimizer state) placed, and the parameters initialised.

Every device byte is in the cap. `rt.stats.process_peak_bytes` is
`torch.cuda.max_memory_allocated()` since the Runtime's construction began (the constructor
resets torch's peak statistics for its device; reset them again to measure a later span).
Fed from the host, it stays within `memory + PROCESS_SLACK_BYTES`: the arena is one torch
allocation of `memory` bytes, which torch's caching allocator may round up, and nothing else
is allocated outside it: conv ranking runs in the arena, Triton autotuning saves the tensors
it must restore to host memory (kernels/_common.py) and times without a cache-flush buffer,
and a graph replay reads the batch from the pool. Bytes the process held before count too,
and so does a GPU batch passed to `step` (the caller's memory, not the pool's).

`step(images, labels)` runs one iteration: it walks the plan's steps and, for each, performs
its operations in order: allocations and frees through the arena's allocator (which must
hand out exactly the offsets the plan predicted, so the measured peak equals the plan's),
copies between the arenas on two copy streams (one each way, ordered against the kernels by
the events the plan names; the host never waits mid-step), and kernel launches on views of
the arena.
Setting `rt.recorder` to a `tinysn.trace.Recorder` times every kernel and copy of the
steps walked from then on (a Chrome trace); left at None, the walk records nothing.
Every launch reads its tensors through `Tensor.view()`, which raises if a tensor is freed,
dropped or still in flight, so a scheduling bug cannot silently compute wrong numbers.

With `cuda_graph=True` the step is captured once as a CUDA graph and replayed (docs/design.md:
launching a Triton kernel from Python costs ~16 us of host time, a replayed one ~1 us). The
plan makes that possible: every allocation, offset, copy, event and algorithm of a step is
the same every iteration. The first `GRAPH_WARMUP` steps run eagerly (they compile and tune
every kernel; the capture must not), the next one captures the plan's walk (the allocator and
every check run in Python as always, so the captured pass verifies peak == plan) and replays
it; later steps copy the batch into the pool's data and labels tensors at their planned offsets
(the plan is static, so the graph reads fixed addresses inside the pool) and replay. Changing
lr, momentum or weight_decay triggers a new capture (they are launch arguments). Not for nets
with dropout (p > 0): its mask seed changes every iteration.

With `process_group` the Runtime is one rank of data-parallel training (distributed.py):
parameters broadcast from rank 0, each layer's gradients all-reduced while the backward pass
goes on, its update a few steps later (`_then_update`).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

from . import distributed
from .kernels import sgd as sgd_k
from .kernels._common import INTERPRET, compiling_in_parallel
from .ops import spec
from .pool.arena import Arena, check_available
from .sched import plan as plan_mod
from .sched import workspace
from .sched.plan import (Alloc, Drop, Evict, Free, Launch, Mark, Offload, Prefetch, Release,
                         Sync, Wait)
from .tensor import Tensor
from .units import parse_bytes


@dataclass
class Stats:
    """What the runtime measured. `trace` has one record per executed step of the last
    iteration: layer, phase, bytes in use and live tensors while its kernel ran."""
    peak_bytes: int = 0
    trace: list = field(default_factory=list)
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    recomputed_steps: int = 0
    conv_algos: dict = field(default_factory=dict)
    iterations: int = 0
    device: object = field(default=None, repr=False)

    @property
    def process_peak_bytes(self):
        """torch.cuda.max_memory_allocated() of the device: the whole process's peak since
        the Runtime's construction began (or a later reset); None on the CPU."""
        if self.device is None or self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device)


GRAPH_WARMUP = 2   # eager steps before a capture (compiles, autotuning, first-call caches)
# What max_memory_allocated may show beyond `memory` (see the module docstring): torch's
# rounding of the arena's one allocation (under 2 MiB) with room to spare.
PROCESS_SLACK_BYTES = 4 << 20
MOMENTUM_SUFFIX = ".momentum_buffer"   # state_dict() name of a parameter's momentum buffer


def _mask_seed(seed: int, iteration: int, layer_index: int) -> int:
    """Dropout's mask seed from (seed, iteration, layer): a recomputation draws the same mask."""
    return zlib.crc32(f"{seed}:{iteration}:{layer_index}".encode()) & 0x7FFFFFFF


class Runtime:
    """Trains `net` under a hard device-memory cap with the scheduling `policy`."""

    def __init__(self, net, memory, policy: str = "baseline", device=None, lr: float = 0.01,
                 momentum: float = 0.0, weight_decay: float = 0.0, seed: int = 0,
                 conv_algos=None, precision=None, layout="auto", host_memory=None,
                 cuda_graph: bool = False, process_group=None):
        device = _pick_device(device)
        _check_graph_request(cuda_graph, device, net)
        if policy not in plan_mod.POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {plan_mod.POLICIES}")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if precision not in (None, "tf32", "ieee"):
            raise ValueError(f"precision must be None, 'tf32' or 'ieee', got {precision!r}")
        _check_machine(memory, host_memory, device)
        distributed.check_group(process_group, device, net)   # last check: a collective
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.net, self.policy, self.device = net, policy, device
        distributed.plan_everywhere(process_group, device, lambda: self._plan_in_pool(
            memory, momentum=momentum, conv_algos=conv_algos, layout=layout,
            host_memory=host_memory, data_parallel=process_group is not None))
        self.lr, self.momentum, self.weight_decay, self.seed = lr, momentum, weight_decay, seed
        self.precision = precision
        self.program = self.plan.program
        self.stats = Stats(conv_algos=self.plan.conv_algos, device=device)
        moves = self.plan.bytes_to_host + self.plan.bytes_to_device
        self.host = Arena(self.plan.host_bytes if moves else 1024, "cpu",
                          pinned=device.type == "cuda")
        self._cuda = device.type == "cuda"  # copies each way on their own stream (both DMA engines)
        self.to_host_stream = torch.cuda.Stream(device) if self._cuda else None
        self.to_device_stream = torch.cuda.Stream(device) if self._cuda else None
        self._events = [None] * self.plan.event_slots
        self.tensors = [Tensor(t.name, t.shape, t.dtype, t.kind, t.id) for t in self.plan.tensors]
        self._views = [{} for _ in self.tensors]      # tensor id -> {offset: torch view}
        for op in self.plan.setup:
            self._alloc(op)
        self.grad_sync = None if process_group is None else distributed.GradientSync(
            self.program, process_group, self.view)       # data parallel (distributed.py)
        self.images, self.predicting = None, False
        self._launch = self._build_launchers()
        self._execute = {Alloc: self._alloc, Free: self._free, Drop: self._drop,
                         Offload: self._offload, Release: self._release, Evict: self._evict,
                         Prefetch: self._prefetch, Wait: self._wait, Sync: self._sync,
                         Mark: self._mark, Launch: self._run_kernel}
        self.cuda_graph = cuda_graph
        self._graph = self._graph_key = self._pool_batch = None
        self._graph_moved = (0, 0)          # bytes each captured step copies (to host, device)
        self.recorder = None                # a tinysn.trace.Recorder times each walked step
        if self._cuda and self.grad_sync is None and not INTERPRET:
            self._compile_kernels()
        self.load_params(net.init_params(seed))
        for tid in self.program.momentum.values():
            self.view(tid).zero_()
        if self.grad_sync is not None:                     # every rank starts from rank 0's
            self.grad_sync.broadcast([*self.program.param.values(),
                                      *self.program.buffer.values()])

    def _compile_kernels(self):
        """Compile every kernel of a step at once, on a thread pool, before the parameters
        exist: one walk of the plan inside `compiling_in_parallel`, in which no kernel runs,
        so the first real step finds them compiled (cold, that is most of its time). The
        walk's statistics are dropped."""
        images = torch.zeros((self.net.batch, *self.net.input_shape))
        with compiling_in_parallel():
            self._walk(images, torch.zeros(self.net.batch, dtype=torch.long))
        torch.cuda.synchronize(self.device)
        self.stats = Stats(conv_algos=self.plan.conv_algos, device=self.device)

    def _plan_in_pool(self, memory, **options):
        """Set self.plan, self.rankings and self.arena (exactly `memory` bytes, empty).

        Under policy "all" on a GPU the conv rankings come from the disk cache or, when a
        shape is missing there, are timed inside the new arena before anything is placed;
        the first plan (default rankings) has already shown that the cap is large enough.
        """
        dynamic = self.device.type == "cuda" and self.policy == "all" \
            and options["conv_algos"] is None
        self.rankings = workspace.cached_rankings(self.net, self.device) if dynamic else None
        self.plan = plan_mod.plan(self.net, memory, self.policy, rankings=self.rankings, **options)
        self.arena = Arena(self.plan.capacity, self.device, small_bytes=self.plan.small_bytes)
        if dynamic and self.rankings is None:
            self.rankings = workspace.measure_rankings(self.net, self.arena.buffer)
            self.plan = plan_mod.plan(self.net, memory, self.policy, rankings=self.rankings,
                                      **options)
            self.arena = Arena(self.plan.capacity, self.device, buffer=self.arena.buffer,
                               small_bytes=self.plan.small_bytes)

    # -- the public surface -----------------------------------------------------------
    def step(self, images, labels) -> float:
        """One training iteration (forward, backward, SGD update); returns the mean loss.

        CPU tensors (pinned or not, e.g. from a DataLoader) are copied straight into the
        pool's data and labels tensors: feeding from the host keeps every device byte inside
        the cap. A GPU tensor passed in stays the caller's memory, outside the pool.
        """
        self._check_batch(images, labels)
        if self.cuda_graph and self.stats.iterations >= GRAPH_WARMUP:
            self._replay(images, labels)
        else:
            self._walk(images, labels)
        return self._finish_step()

    def _walk(self, images, labels, until=None):
        """Execute the plan's steps once from Python (an eager step, the captured pass, or a
        prediction that stops before step index `until`); a `recorder` (tinysn.trace) times
        each operation when one is set."""
        if labels is not None:
            self.view(self.program.labels).copy_(labels)
        self.images, self._trace = images, []
        rec = self.recorder if self.recorder is not None and self.recorder.begin(self) else None
        try:
            for step in self.plan.steps[:until]:
                self._step = step
                for op in step.ops:
                    if rec is None:
                        self._execute[type(op)](op)
                    else:
                        start = rec.before(op)
                        self._execute[type(op)](op)
                        rec.after(start, op, step, self)
        finally:
            self.images = None
        self._join_copies()
        if until is None:
            self.stats.trace = self._trace

    def _run_kernel(self, op):
        """A Launch: the layer's kernels (ops.py), on views of the arena; one trace record."""
        self._launch[op.key](op.algos, None if op.workspace is None else self.view(op.workspace))
        step = self._step
        self._trace.append({"step": step.index, "layer": step.layer, "phase": step.phase,
                            "bytes_in_use": self.arena.allocator.in_use,
                            "live_tensors": self.arena.allocator.n_used_nodes})

    def _replay(self, images, labels):
        """Graph mode: (re)capture when needed, then copy the batch in and replay the step."""
        key = (self.lr, self.momentum, self.weight_decay)
        if self._graph is None or self._graph_key != key:
            self._capture(key)
        pool_images, pool_labels = self._batch_in_pool()
        pool_images.copy_(images, non_blocking=images.is_pinned())
        pool_labels.copy_(labels, non_blocking=labels.is_pinned())
        self._graph.replay()
        self.stats.bytes_to_host += self._graph_moved[0]
        self.stats.bytes_to_device += self._graph_moved[1]

    def _batch_in_pool(self):
        """Views of the data tensor's planned block and of the labels tensor, where a replay
        reads its batch (found once). The data tensor's view is the one its launches use (a
        copy of a tensor onto itself is no operation, so the captured walk copies nothing)."""
        if self._pool_batch is None:
            data = self.program.act[next(x for x in self.net.layers if x.op == "data")]
            ops = [*self.plan.setup, *(op for step in self.plan.steps for op in step.ops)]
            offset = next(op.offset for op in ops if isinstance(op, Alloc) and op.tensor == data)
            t, views = self.tensors[data], self._views[data]
            if offset not in views:
                raw = self.arena.buffer[offset:offset + t.nbytes]
                views[offset] = raw.view(t.dtype).view(t.shape)
            self._pool_batch = views[offset], self.tensors[self.program.labels].view()
        return self._pool_batch

    def _capture(self, key):
        """Record one walk of the plan as a CUDA graph (nothing runs while it records)."""
        self._graph = None
        torch.cuda.synchronize(self.device)
        moved = (self.stats.bytes_to_host, self.stats.bytes_to_device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stream = torch.cuda.current_stream(self.device)
            self.to_host_stream.wait_stream(stream)      # the copy streams join the capture
            self.to_device_stream.wait_stream(stream)
            self._walk(*self._batch_in_pool())
        self._graph_moved = (self.stats.bytes_to_host - moved[0],
                             self.stats.bytes_to_device - moved[1])
        self.stats.bytes_to_host, self.stats.bytes_to_device = moved
        self._graph, self._graph_key = graph, key

    def _finish_step(self) -> float:
        loss = float(self.view(self.program.act[self.net.loss])[0])
        self.stats.peak_bytes = self.arena.allocator.peak
        self.stats.recomputed_steps = self.plan.recomputed_steps
        self.stats.iterations += 1
        return loss

    def predict(self, images):
        """Logits for a batch of up to net.batch images (a CPU copy), in eval mode.

        As `module.eval()` in torch: batch norm normalises with its running statistics and
        dropout is off, so each image's logits depend on that image alone, and a smaller
        batch is padded with zeros to the planned one. Runs the plan's forward steps up to
        the loss, then frees every activation, leaving the pool as it was before.
        """
        n = self._check_images(images, up_to=True)
        if n < self.net.batch:
            pad = images.new_zeros((self.net.batch - n, *images.shape[1:]))
            images = torch.cat([images, pad])
        loss_layer = self.net.loss.name
        stop = next(s.index for s in self.plan.steps
                    if s.phase == "forward" and s.layer == loss_layer)
        self.predicting = True
        try:
            self._walk(images, None, until=stop)
            logits = self.view(self.program.act[self.net.loss.inputs[0]])
            logits = logits[:n].detach().to("cpu", copy=True)
        finally:
            self.predicting = False
            if self._cuda:                       # copies of a cut-short iteration: done
                torch.cuda.synchronize(self.device)
            persistent = {t.id for t in self.program.tensors if t.persistent}
            if self.policy != "baseline":
                for t in self.tensors:
                    if t.id not in persistent and t.state not in ("unallocated", "freed"):
                        t.free()
        return logits

    def evaluate(self, loader) -> dict:
        """{"loss": mean cross-entropy, "accuracy": fraction correct} in eval mode over
        every sample of `loader`, an iterable of (images, labels) batches of any size (a
        torch DataLoader, say); batches larger than net.batch are predicted in parts."""
        import torch.nn.functional as F

        count, loss_sum, correct = 0, 0.0, 0
        for images, labels in loader:
            if not isinstance(images, torch.Tensor) or images.dim() == 0:
                raise ValueError(f"evaluate: images must be a batch tensor, got "
                                 f"{type(images).__name__}")
            self._check_labels(labels, len(images))
            for i in range(0, len(labels), self.net.batch):
                logits = self.predict(images[i:i + self.net.batch]).double()
                y = labels[i:i + self.net.batch].cpu()
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
            count += len(labels)
        if count == 0:
            raise ValueError("evaluate: the loader gave no samples")
        return {"loss": loss_sum / count, "accuracy": correct / count}

    def params(self) -> dict:
        """Parameters and batch-norm statistics in torch layouts (CPU copies)."""
        named = {**self.program.param, **self.program.buffer}
        return {name: self.tensors[tid].view().detach().to("cpu", copy=True)
                for name, tid in named.items()}

    def load_params(self, state: dict) -> None:
        """Copy parameters (and bn statistics) in; names and shapes must match exactly.
        A torch module's state_dict loads as it is: its batch norms' num_batches_tracked
        counters (which tinysn does not use) are skipped."""
        named = {**self.program.param, **self.program.buffer}
        state = {k: v for k, v in state.items() if not _bn_counter(self.net, k)}
        unknown = sorted(set(state) - set(named))
        missing = sorted(set(self.program.param) - set(state))
        if unknown or missing:
            raise ValueError(f"load_params: unknown names {unknown}, missing parameters {missing}")
        for name, value in state.items():
            want = self.tensors[named[name]].shape
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"load_params: {name} must have shape {want}, got {got}")
        for name, value in state.items():
            self.tensors[named[name]].view().copy_(value)

    # -- checkpoints: the whole training state, for an exact resume ---------------------
    def state_dict(self) -> dict:
        """Everything a run needs to continue bitwise as if never stopped, as CPU tensors:
        parameters and batch-norm statistics under torch's names (as params()), each
        momentum buffer as "<parameter>.momentum_buffer", and "iteration" (the steps taken)
        and "seed" as 0-d int64 tensors (dropout draws its masks from both)."""
        state = {name: self.view(tid).detach().to("cpu", copy=True)
                 for name, tid in self._state_tensors().items()}
        state["iteration"] = torch.tensor(self.stats.iterations, dtype=torch.int64)
        state["seed"] = torch.tensor(self.seed, dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict(): every entry must be present with its shape and dtype and
        no other; nothing changes unless all of them are."""
        want = self._state_layout()
        if not isinstance(state, dict) or set(state) != set(want):
            names = set(state) if isinstance(state, dict) else set()
            raise ValueError(f"load_state_dict: unknown names {sorted(names - set(want))}, "
                             f"missing {sorted(set(want) - names)}")
        for name, (shape, dtype) in want.items():
            value = state[name]
            if (not isinstance(value, torch.Tensor) or tuple(value.shape) != shape
                    or value.dtype != dtype):
                got = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ValueError(f"load_state_dict: {name} must be {shape} {dtype}, got {got}")
        for name in ("iteration", "seed"):
            if int(state[name]) < 0:
                raise ValueError(f"load_state_dict: {name} must be >= 0, got {int(state[name])}")
        for name, tid in self._state_tensors().items():
            self.tensors[tid].view().copy_(state[name])
        self.stats.iterations = int(state["iteration"])
        self.seed = int(state["seed"])

    def _state_tensors(self) -> dict:
        """state_dict()'s float32 entries -> tensor id: params, bn statistics, momentum."""
        p = self.program
        return {**p.param, **p.buffer,
                **{name + MOMENTUM_SUFFIX: tid for name, tid in p.momentum.items()}}

    def _state_layout(self) -> dict:
        """state_dict()'s names -> (shape, dtype)."""
        layout = {name: (tuple(self.tensors[tid].shape), torch.float32)
                  for name, tid in self._state_tensors().items()}
        layout.update({"iteration": ((), torch.int64), "seed": ((), torch.int64)})
        return layout

    # -- input checks -----------------------------------------------------------------
    def _check_batch(self, images, labels):
        self._check_images(images)
        self._check_labels(labels, self.net.batch)

    def _check_labels(self, labels, n):
        """int64 labels of shape (n,), each in [0, classes)."""
        net = self.net
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
            raise ValueError(f"labels must be an int64 torch tensor, got "
                             f"{getattr(labels, 'dtype', type(labels).__name__)}")
        if tuple(labels.shape) != (n,):
            raise ValueError(f"labels must have shape ({n},), got {tuple(labels.shape)}")
        low, high = (int(v) for v in torch.aminmax(labels))   # a GPU tensor: two scalars
        if low < 0 or high >= net.classes:
            raise ValueError(f"labels must lie in [0, {net.classes}), got values in [{low}, {high}]")

    def _check_images(self, images, up_to=False) -> int:
        """float32, finite, shape (batch, *input_shape); with up_to, any batch from 1 to
        net.batch. Returns the batch."""
        net = self.net
        if not isinstance(images, torch.Tensor) or images.dtype != torch.float32:
            raise ValueError(f"images must be a float32 torch tensor, got "
                             f"{getattr(images, 'dtype', type(images).__name__)}")
        n = images.shape[0] if up_to and images.dim() else net.batch
        want = (n, *net.input_shape)
        if tuple(images.shape) != want or not 1 <= n <= net.batch:
            sizes = f"(1..{net.batch}, " if up_to else f"({net.batch}, "
            raise ValueError(f"images must have shape {sizes}"
                             f"{', '.join(map(str, net.input_shape))}), got {tuple(images.shape)}")
        # a float64 sum of float32 values overflows only if one is inf or NaN; on a GPU
        # tensor it allocates one scalar, where isfinite() would allocate the batch's size
        if not math.isfinite(images.sum(dtype=torch.float64)):
            raise ValueError("images contain NaN or infinite values")
        return n

    # -- memory operations ------------------------------------------------------------
    def _alloc(self, op: Alloc):
        t = self.tensors[op.tensor]
        t.allocate(self.arena, views=self._views[op.tensor])
        if t.block.offset != op.offset:
            raise RuntimeError(f"allocator diverged from the plan: {t.name} at {t.block.offset}, "
                               f"planned {op.offset}")

    # Nothing here waits on the host: the plan names the events each block's next writer
    # waits for (sched/plan.py), and the streams are joined once at the end of a step.
    def _free(self, op: Free):
        self.tensors[op.tensor].free(sync=False)

    def _drop(self, op: Drop):
        self.tensors[op.tensor].drop()

    def _offload(self, op: Offload | Evict):
        t = self.tensors[op.tensor]
        t.offload(self.host, self.to_host_stream, waits=[self._events[w] for w in op.waits])
        self._events[op.slot] = t.event
        self.stats.bytes_to_host += t.nbytes
        if t.host_block.offset != op.host_offset:
            raise RuntimeError(f"host allocator diverged from the plan for {t.name}")

    def _release(self, op: Release):
        self.tensors[op.tensor].release(sync=False)

    def _evict(self, op: Evict):
        if op.host_offset is None:
            self.tensors[op.tensor].discard()
            return
        self._offload(op)
        self.tensors[op.tensor].release(sync=False)

    def _prefetch(self, op: Prefetch):
        t = self.tensors[op.tensor]
        t.prefetch(self.arena, self.to_device_stream, views=self._views[op.tensor],
                   waits=[self._events[w] for w in op.waits])
        self._events[op.slot] = t.event
        self.stats.bytes_to_device += t.nbytes
        if t.block.offset != op.offset:
            raise RuntimeError(f"allocator diverged from the plan: {t.name} prefetched to "
                               f"{t.block.offset}, planned {op.offset}")

    def _wait(self, op: Wait):
        stream = torch.cuda.current_stream(self.device) if self._cuda else None
        self.tensors[op.tensor].wait(stream)

    def _sync(self, op: Sync):
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            for slot in op.slots:
                stream.wait_event(self._events[slot])

    def _mark(self, op: Mark):
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[op.slot] = event

    def _join_copies(self):
        """The compute stream waits for both copy streams (end of a step or a prediction)."""
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_stream(self.to_host_stream)
            stream.wait_stream(self.to_device_stream)

    # -- kernel launchers (ops.py builds them; these are what they read) ---------------
    def view(self, tid):
        """The torch view of tensor `tid` (raises unless it is on the device and ready)."""
        return self.tensors[tid].view()

    def dropout_seed(self, layer) -> int:
        return _mask_seed(self.seed, self.stats.iterations, layer.index)

    def _build_launchers(self) -> dict:
        """Launch key -> launch(algos, workspace): one per logical step (a backward step's
        launch also applies the SGD updates the program places there) and one per layer for
        its recomputation (which leaves batch-norm running statistics alone)."""
        launch = {}
        for step in self.program.steps:
            op = spec(step.layer)
            if step.phase == "forward":
                launch[step.index] = op.forward(self, step.layer, True)
            else:
                launch[step.index] = self._then_update(op.backward(self, step), step)
        for layer in self.program.order:
            launch[("recompute", layer.index)] = spec(layer).forward(self, layer, False)
        return launch

    def _then_update(self, kernel, step):
        """`kernel`, then (data parallel) the start of the all-reduce of the layer's
        parameter gradients, then the SGD updates that `program.updates` places at this
        step, each after its layer's all-reduce when data parallel (distributed.py)."""
        p, sync = self.program, self.grad_sync
        reduce = step.layer if sync is not None and step.layer.params else None
        layers = p.updates.get(step.index, [])
        if reduce is None and not layers:
            return kernel
        updates = [[(p.param[n], p.pgrad[n], p.momentum.get(n))
                    for n in (f"{layer.name}.{suffix}" for suffix in layer.params)]
                   for layer in layers]

        def launch(algos, ws):
            kernel(algos, ws)
            if reduce is not None:
                sync.start(reduce)
            for layer, tensors in zip(layers, updates):
                if sync is not None:
                    sync.finish(layer)
                for param, grad, mom in tensors:
                    sgd_k.update(self.view(param), self.view(grad),
                                 None if mom is None else self.view(mom), lr=self.lr,
                                 momentum=self.momentum, weight_decay=self.weight_decay)
        return launch


def _bn_counter(net, name) -> bool:
    """Is `name` torch's "<bn layer>.num_batches_tracked" for a batch norm of `net`?"""
    layer, _, suffix = name.rpartition(".")
    return suffix == "num_batches_tracked" and layer in net and net[layer].op == "bn"


def _check_graph_request(cuda_graph, device, net) -> None:
    """cuda_graph must be a bool; True needs a CUDA device and a net without dropout."""
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be a bool, got {cuda_graph!r}")
    if not cuda_graph:
        return
    drops = [layer.name for layer in net.layers
             if layer.op == "dropout" and layer.attrs["p"] > 0]
    if drops:
        raise ValueError(f"cuda_graph=True cannot replay dropout layers {drops}: their mask "
                         "seed changes every iteration")
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device, got {device}")


def _check_machine(memory, host_memory, device) -> None:
    """OutOfMemory (one line) when `memory` is more than the device can give, or
    `host_memory` more than the host can pin: before anything is planned or allocated."""
    check_available(parse_bytes(memory), device, f"memory={memory!r}")
    if host_memory is not None:
        check_available(parse_bytes(host_memory), "cpu", f"host_memory={host_memory!r}",
                        pinned=device.type == "cuda")


def _pick_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no CUDA GPU is available")
    return device
