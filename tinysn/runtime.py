"""Runtime: owns the arenas and executes the plan, step by step, every iteration.

`Runtime(net, memory, policy)` checks its arguments and the machine, plans (so a cap that is
too small fails before any memory is taken or any kernel runs), then creates the device
arena of exactly `memory` bytes; under policy "all" the conv algorithms are ranked inside
that still-empty arena (or read from the disk cache, sched/workspace.py) and the plan is
made again with them. Then the pinned host arena, the persistent tensors placed, a step's
kernels compiled in parallel on a GPU (precompile.py), and the parameters initialised.

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
the events the plan names; the host never waits mid-step, the streams join at its end), and
kernel launches on views of the arena, each reading its tensors through `Tensor.view()`,
which raises if a tensor is freed, dropped or still in flight (so a scheduling bug cannot
silently compute wrong numbers).
On one GPU the step returns once its loss is on the host, the rest of it running on in
stream order, and where the plan leaves a span of the pool no block uses
(`Plan.batch_staging`, sched/staging.py) the next batch crosses into it meanwhile, on a
stream of its own. `rt.recorder = tinysn.trace.Recorder()` times every kernel and copy
walked (a Chrome trace).

Nothing a Runtime holds refers back to it (plan operations dispatch through the class table
`_EXECUTE`; the kernel launchers and the graph replay are passed the runtime at each call),
so the Runtime and its pool go as soon as its last reference does; `close()` gives the pool
back while references remain.

Beside it, each found by name: inputs.py (every argument check), graphs.py (`cuda_graph=True`:
after `GRAPH_WARMUP` eager steps the step is captured once as a CUDA graph and replayed),
evaluate.py (`predict`, `evaluate`), checkpoint.py (`params`, `state_dict` and their loads)
and distributed.py (`process_group`: one rank of data-parallel training, the gradients
all-reduced in buckets of `bucket_bytes` during the backward pass, each bucket's updates a
few passes after its last layer).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from . import checkpoint, distributed, evaluate, inputs, precompile
from .graphs import GRAPH_WARMUP, GraphReplay
from .kernels import sgd as sgd_k
from .kernels._common import checked_before
from .ops import advance_iteration, spec
from .pool.arena import Arena
from .sched import liveness
from .sched import plan as plan_mod
from .sched import staging, workspace
from .sched.timing import DeviceModel, measure_launch_s
from .sched.plan import (Alloc, Drop, Evict, Free, Hand, Launch, Mark, Offload, Prefetch,
                         Release, Sync, Wait)
from .tensor import Tensor
from .units import parse_bytes

__all__ = ["GRAPH_WARMUP", "PROCESS_SLACK_BYTES", "Runtime", "Stats"]


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
    step_seconds: float = 0.0   # wall time of the last step, to its loss read (which waits
                                # for the device to reach the loss; on one GPU the rest of
                                # the step may still run then)
    device: object = field(default=None, repr=False)

    @property
    def process_peak_bytes(self):
        """torch.cuda.max_memory_allocated() of the device: the whole process's peak since
        the Runtime's construction began (or a later reset); None on the CPU."""
        if self.device is None or self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device)


PROCESS_SLACK_BYTES = 4 << 20   # max_memory_allocated beyond `memory`: torch rounds the arena
                                # up (under 2 MiB; see the module docstring), with room to spare


class Runtime:
    """Trains `net` under a hard device-memory cap with the scheduling `policy`."""

    def __init__(self, net, memory, policy: str = "baseline", device=None, lr: float = 0.01,
                 momentum: float = 0.0, weight_decay: float = 0.0, seed: int = 0,
                 conv_algos=None, precision=None, layout="auto", host_memory=None,
                 cuda_graph: bool = False, process_group=None,
                 bucket_bytes=liveness.BUCKET_BYTES, fuse_relu: bool = True,
                 fuse_bn_relu: bool = True, fuse_add_relu: bool = True,
                 fuse_bn_add: bool = True, group_updates: bool = True,
                 fuse_updates: bool = True, store_argmaxes: bool = True):
        device = inputs.pick_device(device)
        inputs.check_graph_request(cuda_graph, device)
        inputs.check_options(policy, lr, momentum, weight_decay, seed, precision, fuse_relu,
                             fuse_bn_relu, fuse_add_relu, fuse_bn_add, group_updates,
                             fuse_updates, store_argmaxes)
        inputs.check_trainable(net)
        inputs.check_machine(memory, host_memory, device)
        bucket_bytes = liveness.parse_bucket_bytes(bucket_bytes)
        distributed.check_group(process_group, device, net, bucket_bytes)  # last: a collective
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.net, self.policy, self.device = net, policy, device
        distributed.plan_everywhere(process_group, device, lambda: self._plan_in_pool(
            memory, cuda_graph, momentum=momentum, conv_algos=conv_algos, layout=layout,
            host_memory=host_memory, data_parallel=process_group is not None,
            bucket_bytes=bucket_bytes, fuse_relu=fuse_relu, fuse_bn_relu=fuse_bn_relu,
            fuse_add_relu=fuse_add_relu, fuse_bn_add=fuse_bn_add, group_updates=group_updates,
            fuse_updates=fuse_updates, store_argmaxes=store_argmaxes))
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
            self.program, process_group, self.tensors)    # data parallel (distributed.py)
        self._check_on_device(self._cuda and self.grad_sync is None)
        self.images, self.predicting, self._batch = None, False, None
        self.lr_slot, self._lr_written = self.view(self.program.scalars)[1:2], None
        self._walked = False     # a training walk done: its launches' tensors were checked
        self._staging = self._staging_views()
        self._launch = _build_launchers(self.program, data_parallel=self.grad_sync is not None)
        self.cuda_graph = cuda_graph
        self.replay = GraphReplay() if cuda_graph else None   # graphs.py
        self.recorder = None                # a tinysn.trace.Recorder times each walked step
        if self._cuda and self.grad_sync is None:
            precompile.compile_step(self)                 # cold start: compile in parallel
        self.load_params(net.init_params(seed))
        for tid in [*self.program.momentum.values(), self.program.iteration]:
            if tid is not None:          # momentum buffers and the iteration counter
                self.view(tid).zero_()
        if self.grad_sync is not None:                     # every rank starts from rank 0's
            self.grad_sync.broadcast([*self.program.param.values(),
                                      *self.program.buffer.values()])

    def _plan_in_pool(self, memory, cuda_graph, **options):
        """Set self.plan, self.rankings and self.arena (exactly `memory` bytes, empty).

        Under policy "all" on a GPU the conv rankings come from the disk cache or, when a
        shape is missing there, are timed inside the new arena before anything is placed;
        the first plan (default rankings) has already shown that the cap is large enough,
        and is made without early write-back, the recompute trade or early prefetches,
        which never change whether a plan fits. The plan chooses among fits with the H200's
        step-time model (eager or replayed) and the convs' times measured with the rankings.
        """
        dynamic = self.device.type == "cuda" and self.policy == "all" \
            and options["conv_algos"] is None
        self.rankings = workspace.cached_rankings(self.net, self.device) if dynamic else None
        timing = dynamic and self.rankings is None   # then this plan only checks the fit
        # the host's launch cost, probed once before the pool exists (it allocates nothing);
        # data-parallel ranks plan without it, so each plans with the same figures
        probe = self.device.type == "cuda" and not cuda_graph and not options["data_parallel"]
        self._launch_probe_s = measure_launch_s(self.device) if probe else None
        self.plan = plan_mod.plan(self.net, memory, self.policy, rankings=self.rankings,
                                  early_write_back=not timing, lookahead=1 if timing else None,
                                  trade_budget=0 if timing else plan_mod.TRADE_BUDGET,
                                  device_model=self._device_model(dynamic, cuda_graph),
                                  **options)
        # the timing path plans again into this buffer, and the plan the measured rankings
        # give may take a larger grid cap than this one, never more than `memory`
        size = parse_bytes(memory) if timing else self.plan.capacity
        self.arena = Arena(size, self.device, small_bytes=self.plan.small_bytes)
        if timing:
            self.rankings = workspace.measure_rankings(self.net, self.arena.buffer)
            self.plan = plan_mod.plan(self.net, memory, self.policy, rankings=self.rankings,
                                      device_model=self._device_model(dynamic, cuda_graph),
                                      **options)
            self.arena = Arena(self.plan.capacity, self.device, buffer=self.arena.buffer,
                               small_bytes=self.plan.small_bytes)

    def _device_model(self, dynamic: bool, cuda_graph: bool) -> DeviceModel:
        """The H200's step-time figures, replayed or eager, with the measured times of the
        convs where the rankings were timed on this GPU (policy "all": `dynamic`) and the
        host's launch cost scaled by this process's probe of it, where it was probed."""
        times = workspace.cached_rankings(self.net, self.device, "conv-times") if dynamic \
            else None
        return DeviceModel.h200(graphed=cuda_graph, conv_times=times,
                                launch_probe_s=self._launch_probe_s)

    # -- the public surface -----------------------------------------------------------
    def close(self) -> None:
        """Give the pool and the pinned host arena back now, while something still refers to
        the Runtime: a list of results, a traceback, or a name about to be rebound (`rt =
        Runtime(...)` in a loop builds the next Runtime while `rt` still holds the last one,
        so both pools would exist then). Nothing a Runtime holds refers back to it, so its
        last reference going (`del rt`) frees them as well, without the garbage collector.
        Afterwards every method raises; closing twice does nothing. `with Runtime(...) as
        rt:` closes on leaving."""
        if self.arena is None:
            return
        if self._cuda:
            torch.cuda.synchronize(self.device)   # copies and kernels may still use the pool
        self.replay = self.grad_sync = self.recorder = self.gate = self.lr_slot = None
        self.tensors, self._views, self._events = [], [], []
        self.arena = self.host = self.images = self._batch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step(self, images, labels) -> float:
        """One training iteration (forward, backward, SGD update); returns the mean loss.

        CPU tensors (pinned or not, e.g. from a DataLoader) are copied straight into the
        pool's data and labels tensors (or first into the plan's staging span: _batch_into_pool):
        feeding from the host keeps every device byte inside the cap. A GPU tensor passed in
        stays the caller's memory, outside the pool.

        On one GPU the call returns as soon as the loss (and the batch's check) is on the
        host: the backward pass and the update then still run, in stream order, so anything
        that reads the pool after it (a step, `params`, `predict`) sees the finished step, and
        the next batch's copy overlaps them.
        """
        inputs.check_open(self)
        inputs.check_batch(self.net, images, labels, values=False)
        inputs.check_rates(self.lr, self.momentum, self.weight_decay)
        started = time.perf_counter()
        self._write_lr()
        images = self._batch_into_pool(images, labels)
        if self.replay is not None and self.stats.iterations >= GRAPH_WARMUP:
            self.replay.step(self)
        else:
            self._walk(images, None)
        loss = self._finish_step()
        self.stats.step_seconds = time.perf_counter() - started
        return loss

    def _write_lr(self) -> None:
        """The pool's learning-rate float = `lr`, where it changed since the last step: the
        updates read it there when they run (kernels/sgd.py), so a replayed graph takes a
        schedule's new rate with no new capture. Written on the compute stream, behind the
        last step's updates."""
        if self.lr != self._lr_written:
            self.lr_slot.fill_(self.lr)
            self._lr_written = self.lr

    def _batch_into_pool(self, images, labels):
        """Copy the batch into the pool, the images into the data tensor's block (the view
        its launches read: the data layer's copy of it onto itself is no operation) and the
        labels into theirs; return that view. The data block is free at a step's start and
        refilled by every step.

        The batch is checked there (NaN and infinity in the images, labels out of range:
        inputs.check_values) so that a bad one changes no state. On one GPU two reductions
        count its bad values into the pool's check float (`scalars[0]`) as the step's first
        kernels (`_count_bad_values`, captured with the step in graph mode); every kernel that
        writes training state (SGD, batch-norm running statistics, the dropout counter)
        skips its writes where the count is not zero (`gate`), and the count is read with the
        loss (`_finish_step`), which raises then: the host waits for the GPU once a step, not
        also between the check and the step, and only until the loss is known
        (`_loss_to_host`). Elsewhere (the CPU; a data-parallel rank, whose
        all-reduces must not start on a batch it refuses) the check runs here, before the
        step."""
        pool_images, pool_labels = self._batch_in_pool()
        if self._staging is not None:
            self._stage(images, labels)
            return pool_images
        pool_images.copy_(images, non_blocking=images.is_pinned())
        pool_labels.copy_(labels, non_blocking=labels.is_pinned())
        if self.gate is None:
            flag = self.view(self.program.scalars)[0:1] if self._cuda else None
            inputs.check_values(pool_images, pool_labels, self.net.classes, flag)
        return pool_images

    @property
    def batch_staged(self) -> bool:
        """Whether each batch crosses into the plan's staging span while the last step still
        runs (sched/staging.py): on one GPU, where the plan left room."""
        return self._staging is not None

    def _staging_views(self):
        """(images, labels, stream, copied, copied_out) of batch staging (sched/staging.py):
        views of the plan's staging span, the stream that copies each batch there, the event
        it records after and the one a step records once it has copied the span out (external:
        a replay records it too); None on the CPU, for a data-parallel rank, or where the plan
        left no span wide enough."""
        offset = self.plan.batch_staging
        if self._loss_event is None or offset is None:
            return None
        program = self.program
        images, labels = (self.tensors[t] for t in (program.act[program.net.data_layer],
                                                     program.labels))
        at = offset + staging.labels_offset(images.nbytes)
        buffer = self.arena.buffer
        return (buffer[offset:offset + images.nbytes].view(images.dtype).view(images.shape),
                buffer[at:at + labels.nbytes].view(labels.dtype).view(labels.shape),
                torch.cuda.Stream(self.device), torch.cuda.Event(),
                torch.cuda.Event(external=True))

    def _stage(self, images, labels) -> None:
        """Copy the batch into the staging span: from the host on the staging stream, once
        the last step has copied the span out (its first operations: `_unstage`), so the
        copy overlaps the rest of that step; from the device on the compute stream (the
        caller's tensor may be written there). The compute stream waits for the copy."""
        staged_images, staged_labels, stream, copied, copied_out = self._staging
        compute = torch.cuda.current_stream(self.device)
        if images.is_cuda or labels.is_cuda:
            stream = compute
        else:
            stream.wait_event(copied_out)
        with torch.cuda.stream(stream):
            staged_images.copy_(images, non_blocking=images.is_pinned())
            staged_labels.copy_(labels, non_blocking=labels.is_pinned())
            copied.record(stream)
        compute.wait_event(copied)

    def _unstage(self) -> None:
        """The step's first operations (captured with it in graph mode): the pool's data and
        labels blocks = the staging span's batch (a device copy), then the event the next
        batch's copy into the span waits for."""
        staged_images, staged_labels, _, _, copied_out = self._staging
        pool_images, pool_labels = self._batch_in_pool()
        pool_images.copy_(staged_images, non_blocking=True)
        pool_labels.copy_(staged_labels, non_blocking=True)
        copied_out.record(torch.cuda.current_stream(self.device))

    def _check_on_device(self, on: bool) -> None:
        """Check each batch in the step, with its verdict read beside the loss (`on`: one
        GPU), or before the step (_batch_into_pool). `gate` is then the pool's check
        float, which the state-writing kernels read, `_verdict` the host's copy of the loss
        and that count (pinned on a GPU, so both come back in one wait) and `_loss_event`
        the event recorded after those copies in the step (on a GPU; external: a replay
        records it too), which the host waits for."""
        self.gate = self.view(self.program.scalars)[0:1] if on else None
        self._verdict = torch.empty(2, pin_memory=self._cuda) if on else None
        self._loss_event = torch.cuda.Event(external=True) if on and self._cuda else None
        self._loss_step = self.plan.loss_step if on else None

    def _count_bad_values(self) -> None:
        """The pool's check float (`gate`) = how many of the batch's values are bad."""
        inputs.count_bad_values(*self._batch_in_pool(), self.net.classes, self.gate)

    def _batch_in_pool(self):
        """Views of the data tensor's planned block and of the labels tensor, where a step
        (and a graph replay, which reads fixed addresses) finds its batch; found once. The
        data tensor sits at the same offset every step (the plan allocates it first)."""
        if self._batch is None:
            data = self.program.act[self.program.net.data_layer]
            ops = [*self.plan.setup, *(op for step in self.plan.steps for op in step.ops)]
            offset = next(op.offset for op in ops if isinstance(op, Alloc) and op.tensor == data)
            t, views = self.tensors[data], self._views[data]
            if offset not in views:
                raw = self.arena.buffer[offset:offset + t.nbytes]
                views[offset] = raw.view(t.dtype).view(t.shape)
            self._batch = views[offset], self.tensors[self.program.labels].view()
        return self._batch

    def _walk(self, images, labels, until=None):
        """Execute the plan's steps once from Python (an eager step, the captured pass, or a
        prediction that stops before step index `until`); a `recorder` (tinysn.trace) times
        each operation when one is set."""
        if labels is not None:
            self.view(self.program.labels).copy_(labels)
        self.images, self._trace = images, []
        rec = self.recorder if self.recorder is not None and self.recorder.begin(self) else None
        execute = self._EXECUTE
        training = until is None and self.gate is not None
        repeat = until is None and self._walked      # a training walk made before: checked
        with checked_before() if repeat else contextlib.nullcontext():
            if training:
                if self._staging is not None:
                    self._unstage()
                self._count_bad_values()
            try:
                for step in self.plan.steps[:until]:
                    self._step = step
                    for op in step.ops:
                        if rec is None:
                            execute[type(op)](self, op)
                        else:
                            start = rec.before(op, self)
                            execute[type(op)](self, op)
                            rec.after(start, op, step, self)
                    if training and step.index == self._loss_step:
                        self._loss_to_host()
                if until is None:            # a training step: the masks' counter moves on
                    advance_iteration(self)
            finally:                         # also after an error: no copy is left in flight
                self.images = None
                self._join_copies()
        if until is None:
            self.stats.trace = self._trace
            self._walked = True

    def _run_kernel(self, op):
        """A Launch: the layer's kernels (ops.py), on views of the arena; one trace record."""
        self._launch[op.key](self, op.algos,
                             None if op.workspace is None else self.view(op.workspace))
        step = self._step
        self._trace.append({"step": step.index, "layer": step.layer, "phase": step.phase,
                            "bytes_in_use": self.arena.allocator.in_use,
                            "live_tensors": self.arena.allocator.n_used_nodes})

    def _finish_step(self) -> float:
        loss = self._step_loss()
        self.stats.peak_bytes = self.arena.allocator.peak
        self.stats.recomputed_steps = self.plan.recomputed_steps
        self.stats.iterations += 1
        return loss

    def _step_loss(self) -> float:
        """The step's loss; where the batch was checked in the step, with its count of bad
        values, both in one wait: a bad batch raises here, its step having changed no state."""
        if self.gate is None:
            return float(self.view(self.program.act[self.program.net.loss])[0])
        if self._loss_event is not None:
            self._loss_event.synchronize()
        loss, bad = self._verdict.tolist()
        if bad:                         # the recount names what is wrong, and raises
            inputs.check_values(*self._batch_in_pool(), self.net.classes, self.gate)
            raise RuntimeError(f"tinysn bug: the batch check counted {bad:.0f} bad values "
                               f"that a recount did not find")
        return loss

    def _loss_to_host(self) -> None:
        """In the step, right after the loss's forward kernel: copy the loss and the batch's
        count of bad values to the host and record `_loss_event` after them, so the host
        waits only that far (the backward pass and the update queue behind it)."""
        loss = self.view(self.program.act[self.program.net.loss])
        self._verdict[0:1].copy_(loss, non_blocking=True)
        self._verdict[1:2].copy_(self.gate, non_blocking=True)
        if self._loss_event is not None:
            self._loss_event.record(torch.cuda.current_stream(self.device))

    # -- inference and state: evaluate.py and checkpoint.py --------------------------
    def predict(self, images):
        """Logits for up to net.batch images (a CPU copy), in eval mode (evaluate.predict)."""
        inputs.check_open(self)
        return evaluate.predict(self, images)

    def evaluate(self, loader) -> dict:
        """{"loss", "accuracy"} in eval mode over `loader` (evaluate.evaluate)."""
        inputs.check_open(self)
        return evaluate.evaluate(self, loader)

    def params(self) -> dict:
        """Parameters and batch-norm statistics in torch layouts (checkpoint.params)."""
        inputs.check_open(self)
        return checkpoint.params(self)

    def load_params(self, state: dict) -> None:
        """Copy parameters and bn statistics in, torch names (checkpoint.load_params)."""
        inputs.check_open(self)
        checkpoint.load_params(self, state)

    def state_dict(self) -> dict:
        """The whole training state, for a bitwise resume (checkpoint.state_dict)."""
        inputs.check_open(self)
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict(), all or nothing (checkpoint.load_state_dict)."""
        inputs.check_open(self)
        checkpoint.load_state_dict(self, state)

    # -- memory operations ------------------------------------------------------------
    def _alloc(self, op: Alloc):
        t = self.tensors[op.tensor]
        t.allocate(self.arena, views=self._views[op.tensor])
        if t.block.offset != op.offset:
            raise RuntimeError(f"allocator diverged from the plan: {t.name} at {t.block.offset}, "
                               f"planned {op.offset}")

    def _hand(self, op: Hand):
        self.tensors[op.source].hand_block(self.tensors[op.tensor], views=self._views[op.tensor])

    def _free(self, op: Free):
        self.tensors[op.tensor].free(sync=False)

    def _drop(self, op: Drop):
        self.tensors[op.tensor].drop()

    def _offload(self, op: Offload | Evict):
        t = self.tensors[op.tensor]
        t.offload(self.host, self.to_host_stream, waits=self.events_of(op))
        self._events[op.slot] = t.event
        self.stats.bytes_to_host += t.nbytes
        if t.host_block.offset != op.host_offset:
            raise RuntimeError(f"host allocator diverged from the plan for {t.name}")

    def _release(self, op: Release):
        self.tensors[op.tensor].release(sync=False)

    def _evict(self, op: Evict):
        t = self.tensors[op.tensor]
        if op.host_offset is None and t.state == "gpu":
            t.discard()              # the host copy is valid (the tensor came back by prefetch)
            return
        if op.host_offset is not None:
            self._offload(op)
        t.release(sync=False)        # the copy (this one, or a write-back) may still read it

    def _prefetch(self, op: Prefetch):
        t = self.tensors[op.tensor]
        block = self.arena.alloc(t.nbytes, top=True) if op.top else None   # an early one
        t.prefetch(self.arena, self.to_device_stream, block=block,
                   views=self._views[op.tensor], waits=self.events_of(op))
        self._events[op.slot] = t.event
        self.stats.bytes_to_device += t.nbytes
        if t.block.offset != op.offset:
            raise RuntimeError(f"allocator diverged from the plan: {t.name} prefetched to "
                               f"{t.block.offset}, planned {op.offset}")

    def events_of(self, op: Offload | Evict | Prefetch) -> list:
        """The events of the copies and kernels the copy `op` waits for (its plan `waits`)."""
        return [self._events[w] for w in op.waits]

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

    # plan operation type -> what executes it (unbound: the table refers to no Runtime)
    _EXECUTE = {Alloc: _alloc, Hand: _hand, Free: _free, Drop: _drop, Offload: _offload,
                Release: _release, Evict: _evict, Prefetch: _prefetch, Wait: _wait, Sync: _sync,
                Mark: _mark, Launch: _run_kernel}

    # -- kernel launchers (ops.py builds them; these are what they read) ---------------
    def view(self, tid):
        """The torch view of tensor `tid` (raises unless it is on the device and ready)."""
        return self.tensors[tid].view()


def _build_launchers(program, data_parallel: bool) -> dict:
    """Launch key -> launch(rt, algos, workspace) (ops.py): one per layer pass (a backward
    pass's launch also applies the SGD updates the program places there) and one per layer
    for its recomputation (which leaves batch-norm running statistics alone)."""
    launch = {}
    for lp in program.passes:
        op = spec(lp.layer)
        if lp.phase == "forward":
            launch[lp.index] = op.forward(program, lp.layer, True)
        else:
            launch[lp.index] = _then_update(op.backward(program, lp), lp, program, data_parallel)
    for layer in program.order:
        launch[("recompute", layer.index)] = spec(layer).forward(program, layer, False)
    return launch


def _then_update(kernel, lp, program, data_parallel: bool):
    """`kernel`, then (data parallel) the start of the all-reduce of the gradient bucket
    that ends at this pass, then the SGD updates of the buckets `program.updates` places
    here, each bucket's after its all-reduce, sgd.PER_LAUNCH parameter tensors per launch
    (sgd.update_many; single process, a pass's one bucket may hold the layers before it
    whose updates waited for it: liveness `_update_groups`)."""
    p = program
    reduce = p.reduces.get(lp.index) if data_parallel else None
    buckets = p.updates.get(lp.index, [])
    if reduce is None and not buckets:
        return kernel
    updates = [[(p.param[n], p.pgrad[n], p.momentum.get(n))
                for layer in bucket for n in (f"{layer.name}.{s}" for s in p.sgd_params(layer))]
               for bucket in buckets]

    def launch(rt, algos, ws):
        kernel(rt, algos, ws)
        if reduce is not None:
            rt.grad_sync.start(reduce)
        for bucket, tensors in zip(buckets, updates):
            if data_parallel:
                rt.grad_sync.finish(bucket)
            sgd_k.update_many([(rt.view(param), rt.view(grad),
                                None if mom is None else rt.view(mom))
                               for param, grad, mom in tensors], lr=rt.lr_slot,
                              momentum=rt.momentum, weight_decay=rt.weight_decay,
                              skip=rt.gate)
    return launch
