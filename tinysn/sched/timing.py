"""The planner's step-time model: how long one iteration of a plan takes on a GPU.

A plan fixes every kernel, copy and event of an iteration, so its time can be worked out
before anything runs. Three queues run concurrently, as in the runtime: the compute stream
(kernels, in plan order), the device-to-host copy stream (Offload, Evict) and the
host-to-device copy stream (Prefetch). Each kernel costs the larger of its arithmetic time
and its memory time (a roofline: OpSpec.cost gives flops and bytes; a conv pays both, see
conv_seconds, or takes its measured time where the GPU timed it, `conv_times`), and cannot
start before the host has issued it (Python's launch cost, or a graph replay's); each copy
costs its bytes over the measured pinned bandwidth of its direction. Dependencies are
exactly the plan's:

    Offload / Evict   after the compute queued so far and the events in `waits`
    Prefetch          after the events in `waits` (not after compute: it overlaps it)
    Wait              compute waits for that tensor's prefetch
    Sync              compute waits for those copy events
    Mark              records the compute stream's time in an event slot

Before them the step's batch crosses to the device (the runtime copies it into the pool and
checks it there before the first launch); where the plan leaves room to stage it
(sched/staging.py), compute starts after a device copy of the batch, and the next step's
batch crosses on the host-to-device queue once this step's loss is known. The iteration
ends when all three queues are drained (the runtime joins them). The result is a
`Timeline`: the predicted step time, what bound it, and every kernel and copy with its
start and end (what a stream timeline of the plan draws).

The device figures are a model, not a measurement: `DeviceModel.h200()` states the numbers it
assumes and where they come from; bench/predict.py sets the prediction beside every measured
step in bench/results, so its error is visible (bench/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..kernels import sgd as sgd_k
from ..kernels._common import cdiv
from ..ops import spec
from . import staging
from .plan import Evict, Launch, Mark, Offload, Prefetch, Sync, Wait
from .workspace import RANKINGS_VERSION, conv_geometry, key_from_text, key_text, ranked_phase
from .workspace import with_bias_twins


@dataclass(frozen=True)
class DeviceModel:
    """What one GPU does per second, as the step-time model sees it."""
    flops_per_s: float        # dense arithmetic the fc kernels reach
    bytes_per_s: float        # device-memory bandwidth the memory-bound kernels reach
    to_host_bytes_per_s: float
    to_device_bytes_per_s: float
    launch_s: float           # host time to issue one layer step, whatever it launches
    # A conv's implicit GEMM: its arithmetic and its memory traffic add up at these rates
    # (conv_seconds); None: the conv takes the roofline like every other kernel.
    conv_flops_per_s: float | None = None
    conv_bytes_per_s: float | None = None
    # Measured conv times, {(x_shape, w_shape, stride, padding, phase): {algorithm: seconds
    # per image}} (workspace.measure_rankings keeps them): a conv they cover takes them.
    conv_times: dict | None = field(default=None, hash=False, repr=False)
    # host time per Triton kernel a layer step launches (kernel_launches), on top of
    # launch_s: what models of earlier runs charged (bench/predict.py plans them as they
    # ran); DeviceModel.h200 charges per layer step instead, where AlexNet's and
    # ResNet-50's host costs lie closer together (bench/calibrate.py)
    kernel_launch_s: float = 0.0
    # this process's host seconds per bare Triton launch (measure_launch_s), which scaled
    # launch_s; None: not measured (planned off the GPU, replayed, or recorded before)
    launch_probe_s: float | None = None

    @classmethod
    def h200(cls, graphed: bool = False, conv_times: dict | None = None,
             launch_probe_s: float | None = None) -> "DeviceModel":
        """An NVIDIA H200 with tinysn's kernels, from measurements on it (bench/calibrate.py
        derives the fitted figures from the tracked results and a test keeps them equal):
        convs at 91.9 TFLOP/s plus 2.28 TB/s, fitted over bench/kernels.py's conv rows
        (the fastest algorithm of each direction and shape); other memory-bound kernels at
        3 TB/s (69-102% of the copy bandwidth, bench/kernels.py) and fc arithmetic at
        100 TFLOP/s; pinned copies at 55 GB/s each way (bench/memory.py); eager, the host's
        time per layer step (`host_launch_s`), and 1 us per layer step replayed from a
        graph. `conv_times`: the convs' own measured times, where the runtime has them (it
        timed the rankings). `launch_probe_s`: this host's seconds per bare Triton launch
        (`measure_launch_s`), which scales the host's time per layer step."""
        return cls(flops_per_s=100e12, bytes_per_s=3.0e12, to_host_bytes_per_s=55e9,
                   to_device_bytes_per_s=55e9,
                   launch_s=1e-6 if graphed else host_launch_s(launch_probe_s),
                   conv_flops_per_s=H200_CONV_FLOPS_PER_S, conv_bytes_per_s=H200_CONV_BYTES_PER_S,
                   conv_times=conv_times, launch_probe_s=None if graphed else launch_probe_s)

    def record(self) -> dict:
        """The model as JSON-ready data (conv time keys as text); `from_record` reads it."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.conv_times is not None:
            data["conv_times"] = {key_text(k): v for k, v in self.conv_times.items()}
            data["conv_keys"] = RANKINGS_VERSION      # what its keys mean
        return data

    @classmethod
    def from_record(cls, data: dict) -> "DeviceModel":
        data = dict(data)
        keys = data.pop("conv_keys", 1)
        if data.get("conv_times") is not None:
            data["conv_times"] = {key_from_text(k): v for k, v in data["conv_times"].items()}
            if keys < 2:
                data["conv_times"] = with_bias_twins(data["conv_times"])
        return cls(**data)


# The fitted figures of DeviceModel.h200 (bench/calibrate.py prints them from bench/results).
H200_CONV_FLOPS_PER_S = 91.9e12
H200_CONV_BYTES_PER_S = 2.28e12
H200_LAUNCH_PER_PROBE = 10.09    # an eager layer step's host time over a bare launch's
H200_LAUNCH_PROBE_S = 19.2e-6    # the bare launch on the hosts of the runs it was fitted on


def host_launch_s(probe_s: float | None = None) -> float:
    """Host seconds to issue one eager layer step (its Python, its kernels' launches, its
    pool operations) on a host whose bare Triton launch takes `probe_s` (measure_launch_s):
    a fitted multiple of the probe. The lent machines' hosts run up to 1.6x faster or
    slower from one call to the next, and within one process from one second to the next,
    so the step's host time follows the host's probe, not a fixed figure (the multiple
    itself moves between calls, from 5.8 to 13.1: bench/README.md). Without a probe: the
    mean probe of the runs the multiple was fitted on."""
    return H200_LAUNCH_PER_PROBE * (probe_s or H200_LAUNCH_PROBE_S)


def measure_launch_s(device, rounds: int = 5, launches: int = 50) -> float:
    """This host's seconds per bare Triton kernel launch: the median over `rounds` of the mean
    host time of `launches` launches of the ReLU kernel over no elements. The GPU finishes
    each long before the host issues the next, so what is timed is Python, Triton's launcher
    and the driver: the parts of every eager launch that vary with the host. Its arguments
    are empty tensors, so it allocates no device memory (the cap is the process); its first
    launch compiles it (or loads it from Triton's disk cache) outside the timing."""
    import statistics
    import time

    import torch

    from ..kernels import act
    from ..kernels._common import run

    empty = torch.empty(0, device=device)

    def launch():
        run(act._relu_fwd_kernel, (1,), empty, empty, 0, BLOCK=act.BLOCK,
            num_warps=act.NUM_WARPS)

    launch()
    if empty.is_cuda:
        torch.cuda.synchronize(device)
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(launches):
            launch()
        means.append((time.perf_counter() - start) / launches)
    if empty.is_cuda:
        torch.cuda.synchronize(device)
    return statistics.median(means)


_PHASE_ORDER = ["forward", "recompute", "backward"]


@dataclass
class Timeline:
    """One iteration as the model predicts it."""
    step_s: float
    compute_s: float          # busy time of the compute stream (kernels alone)
    to_host_s: float          # busy time of each copy stream
    to_device_s: float
    events: list = field(default_factory=list)   # (stream, name, start_s, end_s)

    def compute_waits(self) -> dict:
        """Seconds the compute stream stands idle before the launches of each phase
        ("forward", "recompute", "backward"): waiting for a copy out to free its block or
        for a prefetch to arrive, for the batch at the start, or, eager, for the host's
        launches)."""
        waits, free_at = {}, 0.0
        for stream, name, start, end in sorted(self.events, key=lambda e: e[2]):
            if stream != "compute":
                continue
            phase = name.split(" ", 1)[0]
            waits[phase] = waits.get(phase, 0.0) + max(0.0, start - free_at)
            free_at = max(free_at, end)
        return {phase: waits[phase] for phase in sorted(waits, key=_PHASE_ORDER.index)}

    @property
    def bound_by(self) -> str:
        """The queue that would take longest on its own: "compute", "pcie" or "host"."""
        pcie = max(self.to_host_s, self.to_device_s)
        return "compute" if self.compute_s >= pcie else "pcie"


def kernel_seconds(plan, launch: Launch, model: DeviceModel) -> float:
    """Time of one Launch: its layer's kernels plus the SGD updates its backward pass
    applies (`Program.updates`: a memory-bound pass over those parameters)."""
    program = plan.program
    layer, phase = _layer_phase(plan, launch)
    seconds = measured_conv_seconds(layer, launch.algos, model)
    if seconds is None:
        seconds = layer_seconds(layer, phase, model)
    momentum = 2 if program.momentum else 0
    params = sum(program.tensors[t].nbytes for t in _updated_params(plan, launch))
    weight = f"{layer.name}.weight"
    fused = program.tensors[program.param[weight]].nbytes \
        if phase == "backward" and weight in program.fused_updates else 0
    # an SGD launch reads w, dw (m) and writes w (m); a step fused into the weight-gradient
    # GEMM reads and writes w (m) where the GEMM, as costed, wrote dw
    return seconds + (params * (3 + momentum) + fused * (1 + momentum)) / model.bytes_per_s


def kernel_launches(plan, launch: Launch) -> int:
    """Triton kernels one Launch runs: its layer's own (OpSpec.launches, by phase and conv
    algorithm) and, in a backward step, those of the SGD updates its pass applies,
    sgd.PER_LAUNCH tensors per launch of each bucket (sgd.update_many)."""
    layer, phase = _layer_phase(plan, launch)
    own = spec(layer).launches(layer, phase, launch.algos)
    if phase != "backward":
        return own
    p = plan.program
    return own + sum(cdiv(sum(len(p.sgd_params(l)) for l in bucket), sgd_k.PER_LAUNCH)
                     for bucket in p.updates.get(launch.key, []))


def _updated_params(plan, launch: Launch) -> list:
    """Ids of the parameter tensors whose SGD updates this Launch applies (none but in a
    backward pass; there, those of the buckets `Program.updates` places at its pass)."""
    if isinstance(launch.key, tuple) or plan.program.passes[launch.key].phase != "backward":
        return []
    p = plan.program
    return [p.param[f"{layer.name}.{s}"] for bucket in p.updates.get(launch.key, [])
            for layer in bucket for s in p.sgd_params(layer)]


def _layer_phase(plan, launch: Launch) -> tuple:
    """The layer a Launch runs and its phase ("recompute" for a rebuild)."""
    if isinstance(launch.key, tuple):                 # ("recompute", layer index)
        return plan.program.net.layers[launch.key[1]], "recompute"
    step = plan.program.passes[launch.key]
    return step.layer, step.phase


def measured_conv_seconds(layer, algos, model: DeviceModel) -> float | None:
    """A conv pass's time from `model.conv_times`: the measured seconds per image of each
    algorithm the plan chose for it (`algos`, phase -> algorithm), times the batch; None
    when it is no conv or any of them was not measured."""
    if not model.conv_times or not algos or not spec(layer).has_algorithms:
        return None
    geometry = conv_geometry(layer)
    seconds = 0.0
    for phase, algo in algos.items():
        per_image = model.conv_times.get((*geometry, ranked_phase(layer, phase)), {}).get(algo)
        if per_image is None:
            return None
        seconds += per_image * layer.shape[0]
    return seconds


def layer_seconds(layer, phase: str, model: DeviceModel) -> float:
    """Time of a layer's own kernels in one phase, from OpSpec.cost's flops and bytes (a
    rebuild, phase "recompute", costs a forward pass)."""
    flops, nbytes = spec(layer).cost(layer, "forward" if phase == "recompute" else phase)
    if spec(layer).has_algorithms and model.conv_flops_per_s:
        return conv_seconds(flops, nbytes, model)
    return roofline(flops, nbytes, model)


def roofline(flops: float, nbytes: float, model: DeviceModel) -> float:
    """Seconds of a kernel: the larger of its arithmetic time and its memory time."""
    return max(flops / model.flops_per_s, nbytes / model.bytes_per_s)


def conv_seconds(flops: float, nbytes: float, model: DeviceModel) -> float:
    """A conv's time: arithmetic plus memory traffic. Its tiles re-read their input from
    memory and cache while they compute, so unlike a plain roofline the two do not hide each
    other; bench/kernels.py's small-channel 1x1 convs run at a fifth of the rate of the
    3x3 ones, which a roofline at any one rate cannot show."""
    return flops / model.conv_flops_per_s + nbytes / model.conv_bytes_per_s


def batch_bytes(plan) -> int:
    """Bytes of the images and labels each step copies from the host into the pool
    (Runtime._batch_into_pool), before its first launch or, staged, during the step before."""
    return sum(staging.batch_nbytes(plan.program, plan.tensors))


def simulate(plan, model: DeviceModel | None = None) -> Timeline:
    """Walk the plan's operations on three simulated queues (module docstring)."""
    model = model or DeviceModel.h200()
    # unstaged, the batch crosses to the pool before the first launch; staged
    # (sched/staging.py), the step starts with a device copy out of the staging span, and
    # the next batch crosses once this step's loss is known (the host has it then)
    nbytes = batch_bytes(plan)
    batch = nbytes / model.to_device_bytes_per_s
    staged = plan.batch_staging is not None
    host = compute = 2 * nbytes / model.bytes_per_s if staged else batch
    to_device, to_host = (0.0 if staged else batch), 0.0
    busy = {"compute": 0.0, "to_host": 0.0, "to_device": batch}
    slots, arrived = {}, {}
    events = [] if staged else [("to_device", "batch", 0.0, batch)]
    loss_step = plan.loss_step if staged else None
    for step in plan.steps:
        for op in step.ops:
            if isinstance(op, Launch):
                host += model.launch_s
                if model.kernel_launch_s:
                    host += model.kernel_launch_s * kernel_launches(plan, op)
                # busy time sums durations, not end - start: equal work, equal sums
                start, seconds = max(compute, host), kernel_seconds(plan, op, model)
                compute = start + seconds
                busy["compute"] += seconds
                events.append(("compute", f"{step.phase} {step.layer}", start, compute))
            elif isinstance(op, (Offload, Evict)) and op.host_offset is not None:
                start = max([to_host, compute] + [slots[w] for w in op.waits])
                seconds = plan.tensors[op.tensor].nbytes / model.to_host_bytes_per_s
                to_host = start + seconds
                busy["to_host"] += seconds
                slots[op.slot] = to_host
                events.append(("to_host", plan.tensors[op.tensor].name, start, to_host))
            elif isinstance(op, Prefetch):
                start = max([to_device] + [slots[w] for w in op.waits])
                seconds = plan.tensors[op.tensor].nbytes / model.to_device_bytes_per_s
                to_device = start + seconds
                busy["to_device"] += seconds
                slots[op.slot] = arrived[op.tensor] = to_device
                events.append(("to_device", plan.tensors[op.tensor].name, start, to_device))
            elif isinstance(op, Wait):
                compute = max(compute, arrived[op.tensor])
            elif isinstance(op, Sync):
                compute = max([compute] + [slots[w] for w in op.slots])
            elif isinstance(op, Mark):
                slots[op.slot] = compute
        if step.index == loss_step:                  # the loss's forward is over
            start = max(to_device, compute)
            to_device = start + batch
            events.append(("to_device", "next batch", start, to_device))
    return Timeline(step_s=max(compute, to_host, to_device, host), compute_s=busy["compute"],
                    to_host_s=busy["to_host"], to_device_s=busy["to_device"], events=events)


def rebuild_order(plan, model: DeviceModel | None = None, through_cheap: bool = False) -> list:
    """Indices of the rebuildable layers (OpSpec.rebuildable: conv, add, concat) whose
    outputs `plan` copies to the host, most bytes per second of forward compute first: the
    order in which recomputing them instead saves the most PCIe time per compute time.
    With `through_cheap`, a copied output of a cheap layer with one input (the ReLU after a
    residual add) counts for the rebuildable layer that feeds it: rebuilding that layer lets
    the cheap output be dropped and rebuilt too."""
    model = model or DeviceModel.h200()
    program, score = plan.program, {}
    for step in plan.steps:
        for op in step.ops:
            if isinstance(op, (Offload, Evict)) and op.host_offset is not None:
                layer = _rebuilt_for(plan.tensors[op.tensor].layer, op.tensor, program,
                                     through_cheap)
                if layer is not None:
                    seconds = layer_seconds(layer, "forward", model)
                    score[layer.index] = plan.tensors[op.tensor].nbytes / seconds
    return sorted(score, key=lambda i: (-score[i], i))


def _rebuilt_for(layer, tid, program, through_cheap):
    """The rebuildable layer whose recomputation would rebuild activation `tid` of `layer`
    (itself, or with `through_cheap` the producer of a cheap one-input layer's input)."""
    if layer is None or program.act.get(layer) != tid:
        return None
    if spec(layer).rebuildable:
        return layer
    if through_cheap and spec(layer).recomputable and len(layer.inputs) == 1 \
            and spec(layer.inputs[0]).rebuildable:
        return layer.inputs[0]
    return None
