"""Runtime: owns the arenas and executes the plan, step by step, every iteration.

`Runtime(net, memory, policy)` plans first (so a cap that is too small fails before any
memory is taken or any kernel runs), then creates the device arena of exactly `memory`
bytes and a pinned host arena of the size the plan needs, places the persistent tensors
(parameters, batch-norm statistics, optimizer state) and initialises the parameters.

`step(images, labels)` runs one iteration: it walks the plan's steps and, for each, performs
its operations in order: allocations and frees through the arena's allocator (which must
hand out exactly the offsets the plan predicted, so the measured peak equals the plan's),
copies between the arenas on two copy streams (one each way, ordered against the kernels by
the events the plan names; the host never waits mid-step), and kernel launches on views of
the arena.
Every launch reads its tensors through `Tensor.view()`, which raises if a tensor is freed,
dropped or still in flight, so a scheduling bug cannot silently compute wrong numbers.

With `cuda_graph=True` the step is captured once as a CUDA graph and replayed (DESIGN.md:
launching a Triton kernel from Python costs ~16 us of host time, a replayed one ~1 us). The
plan makes that possible: every allocation, offset, copy, event and algorithm of a step is
the same every iteration. The first `GRAPH_WARMUP` steps run eagerly (they compile and tune
every kernel; the capture must not), the next one captures the plan's walk (the allocator and
every check run in Python as always, so the captured pass verifies peak == plan) and replays
it; later steps copy the batch into static buffers and replay. Changing lr, momentum or
weight_decay triggers a new capture (they are launch arguments). Not for nets with dropout
(p > 0): its mask seed changes every iteration. The static batch buffers (images and labels)
live outside the pool: a graph reads fixed addresses.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

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
from .pool.arena import Arena
from .sched import plan as plan_mod
from .tensor import Tensor


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


GRAPH_WARMUP = 2   # eager steps before a capture (compiles, autotuning, first-call caches)
MOMENTUM_SUFFIX = ".momentum_buffer"   # state_dict() name of a parameter's momentum buffer


def _mask_seed(seed: int, iteration: int, layer_index: int) -> int:
    """Dropout's mask seed from (seed, iteration, layer): a recomputation draws the same mask."""
    return zlib.crc32(f"{seed}:{iteration}:{layer_index}".encode()) & 0x7FFFFFFF


class Runtime:
    """Trains `net` under a hard device-memory cap with the scheduling `policy`."""

    def __init__(self, net, memory, policy: str = "baseline", device=None, lr: float = 0.01,
                 momentum: float = 0.0, weight_decay: float = 0.0, seed: int = 0,
                 conv_algos=None, precision=None, layout="auto", host_memory=None,
                 cuda_graph: bool = False):
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
        if device.type == "cuda" and policy == "all" and conv_algos is None:
            from .sched.workspace import measure_rankings
            measure_rankings(net, device)
        self.plan = plan_mod.plan(net, memory, policy, momentum=momentum, conv_algos=conv_algos,
                                  layout=layout, host_memory=host_memory)
        self.net, self.policy, self.device = net, policy, device
        self.lr, self.momentum, self.weight_decay, self.seed = lr, momentum, weight_decay, seed
        self.precision = precision
        self.program = self.plan.program
        self.stats = Stats(conv_algos=self.plan.conv_algos)
        self.arena = Arena(self.plan.capacity, device, small_bytes=self.plan.small_bytes)
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
            self._alloc(op[1], op[2])
        self._predicting = False
        self._launch = self._build_launchers()
        self._ops = {"alloc": self._alloc, "free": self._free, "drop": self._drop,
                     "offload": self._offload, "release": self._release, "evict": self._evict,
                     "prefetch": self._prefetch, "wait": self._wait, "sync": self._sync,
                     "mark": self._mark}
        self.load_params(net.init_params(seed))
        for tid in self.program.momentum.values():
            self.tensors[tid].view().zero_()
        self.cuda_graph = cuda_graph
        self._graph = self._graph_key = self._static = None
        self._graph_moved = (0, 0)          # bytes each captured step copies (to host, device)

    # -- the public surface -----------------------------------------------------------
    def step(self, images, labels) -> float:
        """One training iteration (forward, backward, SGD update); returns the mean loss."""
        self._check_batch(images, labels)
        if self.cuda_graph and self.stats.iterations >= GRAPH_WARMUP:
            self._replay(images, labels)
        else:
            self._walk(images, labels)
        return self._finish_step()

    def _walk(self, images, labels):
        """Execute the plan's steps once from Python (an eager step, or the captured pass)."""
        self.tensors[self.program.labels].view().copy_(labels)
        self._images = images
        trace = []
        for step in self.plan.steps:
            for op in step.ops:
                if op[0] == "kernel":
                    self._launch[op[1]](op[2], op[3])
                    trace.append({"step": step.index, "layer": step.layer, "phase": step.phase,
                                  "bytes_in_use": self.arena.allocator.in_use,
                                  "live_tensors": self.arena.allocator.n_used_nodes})
                else:
                    self._ops[op[0]](*op[1:])
        self._images = None
        self._join_copies()
        self.stats.trace = trace

    def _replay(self, images, labels):
        """Graph mode: (re)capture when needed, then copy the batch in and replay the step."""
        key = (self.lr, self.momentum, self.weight_decay)
        if self._graph is None or self._graph_key != key:
            self._capture(images, labels, key)
        self._static[0].copy_(images)
        self._static[1].copy_(labels)
        self._graph.replay()
        self.stats.bytes_to_host += self._graph_moved[0]
        self.stats.bytes_to_device += self._graph_moved[1]

    def _capture(self, images, labels, key):
        """Record one walk of the plan as a CUDA graph (nothing runs while it records)."""
        if self._static is None:
            self._static = (torch.empty(images.shape, dtype=images.dtype, device=self.device),
                            torch.empty(labels.shape, dtype=labels.dtype, device=self.device))
        self._graph = None
        torch.cuda.synchronize(self.device)
        moved = (self.stats.bytes_to_host, self.stats.bytes_to_device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stream = torch.cuda.current_stream(self.device)
            self.to_host_stream.wait_stream(stream)      # the copy streams join the capture
            self.to_device_stream.wait_stream(stream)
            self._walk(*self._static)
        self._graph_moved = (self.stats.bytes_to_host - moved[0],
                             self.stats.bytes_to_device - moved[1])
        self.stats.bytes_to_host, self.stats.bytes_to_device = moved
        self._graph, self._graph_key = graph, key

    def _finish_step(self) -> float:
        loss = float(self.tensors[self.program.act[self.net.loss]].view()[0])
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
        self._images, self._predicting = images, True
        loss_layer = self.net.loss.name
        try:
            for step in self.plan.steps:
                if step.phase == "forward" and step.layer == loss_layer:
                    break
                for op in step.ops:
                    if op[0] == "kernel":
                        self._launch[op[1]](op[2], op[3])
                    else:
                        self._ops[op[0]](*op[1:])
            logits = self.tensors[self.program.act[self.net.loss.inputs[0]]].view()
            logits = logits[:n].detach().to("cpu", copy=True)
        finally:
            self._images, self._predicting = None, False
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
        state = {name: self._v(tid).detach().to("cpu", copy=True)
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
        low, high = int(labels.min()), int(labels.max())
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
        if not bool(torch.isfinite(images).all()):
            raise ValueError("images contain NaN or infinite values")
        return n

    # -- memory operations ------------------------------------------------------------
    def _alloc(self, tid, offset):
        t = self.tensors[tid]
        t.allocate(self.arena, views=self._views[tid])
        if t.block.offset != offset:
            raise RuntimeError(f"allocator diverged from the plan: {t.name} at {t.block.offset}, "
                               f"planned {offset}")

    # Nothing here waits on the host: the plan names the events each block's next writer
    # waits for (sched/plan.py), and the streams are joined once at the end of a step.
    def _free(self, tid):
        self.tensors[tid].free(sync=False)

    def _drop(self, tid):
        self.tensors[tid].drop()

    def _offload(self, tid, host_offset, slot, waits):
        t = self.tensors[tid]
        t.offload(self.host, self.to_host_stream, waits=[self._events[w] for w in waits])
        self._events[slot] = t.event
        self.stats.bytes_to_host += t.nbytes
        if t.host_block.offset != host_offset:
            raise RuntimeError(f"host allocator diverged from the plan for {t.name}")

    def _release(self, tid):
        self.tensors[tid].release(sync=False)

    def _evict(self, tid, host_offset, slot, waits):
        t = self.tensors[tid]
        if host_offset is None:
            t.discard()
            return
        self._offload(tid, host_offset, slot, waits)
        t.release(sync=False)

    def _prefetch(self, tid, offset, slot, waits):
        t = self.tensors[tid]
        t.prefetch(self.arena, self.to_device_stream, views=self._views[tid],
                   waits=[self._events[w] for w in waits])
        self._events[slot] = t.event
        self.stats.bytes_to_device += t.nbytes
        if t.block.offset != offset:
            raise RuntimeError(f"allocator diverged from the plan: {t.name} prefetched to "
                               f"{t.block.offset}, planned {offset}")

    def _wait(self, tid):
        stream = torch.cuda.current_stream(self.device) if self._cuda else None
        self.tensors[tid].wait(stream)

    def _sync(self, slots):
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            for slot in slots:
                stream.wait_event(self._events[slot])

    def _mark(self, slot):
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[slot] = event

    def _join_copies(self):
        """The compute stream waits for both copy streams (end of a step or a prediction)."""
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_stream(self.to_host_stream)
            stream.wait_stream(self.to_device_stream)

    # -- kernel launchers -------------------------------------------------------------
    def _build_launchers(self) -> dict:
        """key -> launch(algos, workspace id): one per logical step and per recomputable layer."""
        launch = {}
        for step in self.program.steps:
            if step.phase == "forward":
                launch[step.index] = self._forward_launcher(step.layer, update_running=True)
            else:
                launch[step.index] = self._backward_launcher(step)
        for layer in self.program.order:
            launch[("recompute", layer.index)] = self._forward_launcher(layer, update_running=False)
        return launch

    def _v(self, tid):
        return self.tensors[tid].view()

    def _ws(self, ws):
        return None if ws is None else self.tensors[ws].view()

    def _param(self, layer, suffix, table=None):
        table = self.program.param if table is None else table
        tid = table.get(f"{layer.name}.{suffix}")
        return None if tid is None else (lambda: self.tensors[tid].view())

    def _forward_launcher(self, layer, update_running):
        p, v = self.program, self._v
        op, a = layer.op, layer.attrs
        out = p.act[layer]
        ins = [p.act[x] for x in layer.inputs]
        prec = self.precision
        if op == "data":
            return lambda algos, ws: v(out).copy_(self._images)
        if op == "conv":
            w, b = self._param(layer, "weight"), self._param(layer, "bias")
            return lambda algos, ws: conv_k.forward(
                v(ins[0]), w(), b() if b else None, v(out), stride=a["stride"],
                padding=a["padding"], algo=algos["forward"], workspace=self._ws(ws), precision=prec)
        if op == "bn":
            g, bb = self._param(layer, "weight"), self._param(layer, "bias")
            rm = self._param(layer, "running_mean", p.buffer)
            rv = self._param(layer, "running_var", p.buffer)
            saved = p.saved[layer]

            def launch_bn(algos, ws):
                if self._predicting:           # eval mode: the running statistics
                    bn_k.forward_eval(v(ins[0]), g(), bb(), v(out), rm(), rv(),
                                      eps=a.get("eps", 1e-5))
                else:
                    bn_k.forward(v(ins[0]), g(), bb(), v(out), rm(), rv(), v(saved),
                                 self._ws(ws), eps=a.get("eps", 1e-5),
                                 momentum=a.get("momentum", 0.1), update_running=update_running)
            return launch_bn
        if op == "relu":
            return lambda algos, ws: act_k.forward(v(ins[0]), v(out))
        if op == "pool":
            return lambda algos, ws: pool_k.forward(
                v(ins[0]), v(out), mode=a["mode"], kernel=a["kernel"], stride=a["stride"],
                padding=a["padding"])
        if op == "lrn":
            return lambda algos, ws: lrn_k.forward(
                v(ins[0]), v(out), size=a["size"], alpha=a["alpha"], beta=a["beta"], k=a["k"])
        if op == "fc":
            w, b = self._param(layer, "weight"), self._param(layer, "bias")
            n = layer.shape[0]
            return lambda algos, ws: linear_k.forward(
                v(ins[0]).view(n, -1), w(), b() if b else None, v(out), precision=prec)
        if op == "dropout":
            return lambda algos, ws: dropout_k.forward(
                v(ins[0]), v(out), p=0.0 if self._predicting else a["p"],
                seed=self._dropout_seed(layer), offset=0)
        if op == "add":
            return lambda algos, ws: join_k.add_forward([v(i) for i in ins], v(out))
        if op == "concat":
            return lambda algos, ws: join_k.concat_forward([v(i) for i in ins], v(out))
        if op == "softmax_loss":
            return lambda algos, ws: softmax_k.forward(v(ins[0]), v(p.labels), v(out), self._ws(ws))
        raise ValueError(f"no forward launcher for layer op {op!r}")

    def _dropout_seed(self, layer):
        return _mask_seed(self.seed, self.stats.iterations, layer.index)

    def _backward_launcher(self, step):
        kernel = self._backward_kernel(step)
        updates = self._updates(step.layer)
        if not updates:
            return kernel

        def launch(algos, ws):
            kernel(algos, ws)
            for update in updates:
                update()
        return launch

    def _updates(self, layer):
        p = self.program
        out = []
        for suffix in layer.params:
            name = f"{layer.name}.{suffix}"
            param, grad, mom = p.param[name], p.pgrad[name], p.momentum.get(name)
            out.append(lambda param=param, grad=grad, mom=mom: sgd_k.update(
                self._v(param), self._v(grad), None if mom is None else self._v(mom),
                lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay))
        return out

    def _backward_kernel(self, step):
        p, v = self.program, self._v
        layer = step.layer
        op, a = layer.op, layer.attrs
        dy = p.grad.get(layer)
        ins = [p.act[x] for x in layer.inputs]
        dxs = [p.grad.get(x) for x in layer.inputs]
        acc = [step.accumulate.get(d, False) if d is not None else False for d in dxs]
        opt = lambda tid: None if tid is None else v(tid)  # noqa: E731
        pg = lambda s: (lambda: v(p.pgrad[f"{layer.name}.{s}"])) if s in layer.params else (lambda: None)  # noqa: E731
        prec = self.precision
        if op == "conv":
            w = self._param(layer, "weight")
            dw, db = pg("weight"), pg("bias")
            return lambda algos, ws: conv_k.backward(
                v(ins[0]), w(), v(dy), opt(dxs[0]), dw(), db(), stride=a["stride"],
                padding=a["padding"], algo_data=algos.get("backward_data", "implicit"),
                algo_weight=algos["backward_weight"], workspace=self._ws(ws),
                accumulate=acc[0], precision=prec)
        if op == "bn":
            g = self._param(layer, "weight")
            return lambda algos, ws: bn_k.backward(
                v(ins[0]), g(), v(dy), v(p.saved[layer]), opt(dxs[0]), pg("weight")(),
                pg("bias")(), self._ws(ws), accumulate=acc[0])
        if op == "relu":
            return lambda algos, ws: act_k.backward(v(p.act[layer]), v(dy), v(dxs[0]),
                                                    accumulate=acc[0])
        if op == "pool":
            # max pooling recomputes its argmax from x; average pooling reads neither x nor
            # y, so it runs after both were freed
            needs_x = a["mode"] == "max"
            return lambda algos, ws: pool_k.backward(
                v(ins[0]) if needs_x else None, None, v(dy), v(dxs[0]), mode=a["mode"],
                kernel=a["kernel"], stride=a["stride"], padding=a["padding"], accumulate=acc[0])
        if op == "lrn":
            return lambda algos, ws: lrn_k.backward(
                v(ins[0]), v(dy), v(dxs[0]), size=a["size"], alpha=a["alpha"], beta=a["beta"],
                k=a["k"], accumulate=acc[0])
        if op == "fc":
            w = self._param(layer, "weight")
            n = layer.shape[0]
            return lambda algos, ws: linear_k.backward(
                v(ins[0]).view(n, -1), w(), v(dy),
                None if dxs[0] is None else v(dxs[0]).view(n, -1), pg("weight")(), pg("bias")(),
                accumulate=acc[0], precision=prec)
        if op == "dropout":
            return lambda algos, ws: dropout_k.backward(
                v(dy), v(dxs[0]), p=a["p"], seed=self._dropout_seed(layer), offset=0,
                accumulate=acc[0])
        if op == "add":
            return lambda algos, ws: join_k.add_backward(v(dy), [opt(d) for d in dxs],
                                                         accumulate=acc)
        if op == "concat":
            channels = [x.shape[1] for x in layer.inputs]
            return lambda algos, ws: join_k.concat_backward(v(dy), [opt(d) for d in dxs],
                                                            accumulate=acc, channels=channels)
        if op == "softmax_loss":
            return lambda algos, ws: softmax_k.backward(v(ins[0]), v(p.labels), v(dxs[0]),
                                                        accumulate=acc[0])
        raise ValueError(f"no backward launcher for layer op {op!r}")


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
