"""The step-time model: its queues follow the plan's dependencies and its figures add up."""
import dataclasses
import json
import math

import pytest

import tinysn as sn
from tinysn.ops import SPARE
from tinysn.sched import timing
from tinysn.sched.plan import Prefetch

NET = dict(batch=16, classes=10, input_shape=(3, 64, 64))


def model(**changes):
    base = dict(flops_per_s=1e12, bytes_per_s=1e11, to_host_bytes_per_s=1e9,
                to_device_bytes_per_s=1e9, launch_s=1e-6)
    return timing.DeviceModel(**{**base, **changes})


def test_nothing_moved_is_the_batch_copy_then_the_sum_of_kernels():
    """Unstaged, the batch crosses first and every kernel waits for it."""
    plan = sn.plan(sn.models.resnet(blocks=[1, 1, 1, 1], **NET), "1GiB", "liveness")
    plan = dataclasses.replace(plan, batch_staging=None)
    tl = timing.simulate(plan, model(launch_s=0.0))
    kernels = [e for e in tl.events if e[0] == "compute"]
    assert len(kernels) == sum(1 for s in plan.steps)
    batch = timing.batch_bytes(plan) / model().to_device_bytes_per_s
    images = plan.net.batch * 4 * math.prod(plan.net.input_shape)
    assert timing.batch_bytes(plan) == images + plan.net.batch * 8    # float32, int64 labels
    assert tl.step_s == pytest.approx(batch + sum(e[3] - e[2] for e in kernels))
    assert min(e[2] for e in kernels) == batch                  # no kernel before the batch
    assert tl.to_host_s == 0 and tl.to_device_s == batch and tl.bound_by == "compute"


def test_a_staged_batch_crosses_while_the_kernels_run():
    """Staged (sched/staging.py), the kernels wait only for the device copy out of the
    staging span, and the next batch crosses once the loss is known (the host has it then),
    beside the backward pass: the step is the longer of the two."""
    plan = sn.plan(sn.models.resnet(blocks=[1, 1, 1, 1], **NET), "1GiB", "liveness")
    assert plan.batch_staging is not None
    unstaged = timing.simulate(dataclasses.replace(plan, batch_staging=None),
                               model(launch_s=0.0))
    for to_device in (1e9, 1e6):                           # the copy shorter, then longer
        tl = timing.simulate(plan, model(launch_s=0.0, to_device_bytes_per_s=to_device))
        kernels = [e for e in tl.events if e[0] == "compute"]
        loss = next(e for e in kernels if e[1] == "forward loss")
        copy = next(e for e in tl.events if e[0] == "to_device")
        batch = timing.batch_bytes(plan) / to_device
        first = 2 * timing.batch_bytes(plan) / model().bytes_per_s
        assert min(e[2] for e in kernels) == pytest.approx(first)
        assert copy[1:] == ("next batch", loss[3], pytest.approx(loss[3] + batch))
        assert tl.compute_s == pytest.approx(unstaged.compute_s)
        assert tl.step_s == pytest.approx(max(first + tl.compute_s, loss[3] + batch))
        assert tl.to_device_s == pytest.approx(batch)
    assert timing.simulate(plan, model(launch_s=0.0)).step_s < unstaged.step_s


def test_launch_cost_bounds_tiny_kernels():
    plan = sn.plan(sn.models.resnet(blocks=[1, 1, 1, 1], **NET), "1GiB", "liveness")
    tl = timing.simulate(plan, model(flops_per_s=1e30, bytes_per_s=1e30, launch_s=1e-3,
                                     to_device_bytes_per_s=1e30))
    assert tl.step_s == pytest.approx(1e-3 * len(plan.steps))


def test_copies_overlap_compute_and_slow_links_bind():
    net = sn.models.resnet(blocks=[1, 1, 1, 1], **NET)
    plan = sn.plan(net, "1GiB", "offload")
    compute = timing.simulate(plan, model(launch_s=0.0)).compute_s
    rate = plan.bytes_to_host / (compute / 2)          # copies each way take half the compute
    both = timing.simulate(plan, model(launch_s=0.0, to_host_bytes_per_s=rate,
                                       to_device_bytes_per_s=rate))
    assert max(both.compute_s, both.to_host_s) <= both.step_s
    assert both.step_s < both.compute_s + both.to_host_s + both.to_device_s   # overlapped
    slow = timing.simulate(plan, model(to_host_bytes_per_s=1e6, to_device_bytes_per_s=1e6))
    assert slow.bound_by == "pcie" and slow.step_s >= plan.bytes_to_host / 1e6
    prefetches = [op for s in plan.steps for op in s.ops if isinstance(op, Prefetch)]
    assert len([e for e in slow.events if e[0] == "to_device"]) == len(prefetches) + 1  # batch


def test_plan_predicts_its_step_time():
    plan = sn.plan(sn.models.resnet50(batch=32), "12GiB", "all")
    assert plan.predicted_step_s == timing.simulate(plan).step_s > 0


def test_compute_waits_for_its_prefetches():
    """With a slow host-to-device link the backward pass stalls on each prefetch: the last
    kernel cannot end before the last prefetch has landed."""
    plan = sn.plan(sn.models.resnet(blocks=[1, 1, 1, 1], **NET), "1GiB", "offload")
    tl = timing.simulate(plan, model(to_device_bytes_per_s=1e6))
    last_kernel = max(e[3] for e in tl.events if e[0] == "compute")
    last_prefetch = max(e[3] for e in tl.events if e[0] == "to_device")
    assert last_kernel > last_prefetch


def test_a_conv_pays_its_arithmetic_and_its_memory_traffic():
    """With conv rates set, a conv costs flops/F + bytes/B (both, not the larger); without,
    it takes the roofline like any other kernel."""
    net = sn.models.resnet(blocks=[1, 1, 1, 1], **NET)
    conv = next(layer for layer in net.layers if layer.op == "conv")
    flops, nbytes = sn.ops.spec(conv).cost(conv, "forward")
    rated = model(conv_flops_per_s=2e12, conv_bytes_per_s=4e11)
    assert timing.layer_seconds(conv, "forward", rated) == \
        pytest.approx(flops / 2e12 + nbytes / 4e11)
    assert timing.layer_seconds(conv, "forward", model()) == \
        pytest.approx(max(flops / 1e12, nbytes / 1e11))


def test_a_plan_is_chosen_and_predicted_with_the_model_it_is_given():
    net = sn.models.resnet(blocks=[1, 1, 1, 1], **NET)
    slow = model(launch_s=1e-3)
    plan = sn.plan(net, "1GiB", "all", device_model=slow)
    assert plan.device_model is slow
    assert plan.predicted_step_s == timing.simulate(plan, slow).step_s
    assert plan.predicted_step_s >= 1e-3 * len(plan.steps)
    assert sn.plan(net, "1GiB", "all").device_model == timing.DeviceModel.h200()
    with pytest.raises(ValueError, match="device_model must be a timing.DeviceModel"):
        sn.plan(net, "1GiB", "all", device_model="h200")


def test_a_record_before_the_bias_phase_serves_convs_with_a_bias_too():
    """Conv times recorded before weight gradients with a bias were ranked apart timed every
    weight gradient with a bias gradient: read back, each also serves a conv with a bias
    (workspace.BIAS_PHASE), so bench/predict.py plans such a run as it ran; a record of
    today's keys is read as written."""
    from tinysn.sched import workspace
    g = ((2, 4, 6, 6), (4, 4, 3, 3), (1, 1), (1, 1))
    times = {(*g, "forward"): {"implicit": 1e-6}, (*g, "backward_weight"): {"onepass": 2e-6}}
    record = timing.DeviceModel.h200(conv_times=times).record()
    assert timing.DeviceModel.from_record(record).conv_times == times      # today's keys
    del record["conv_keys"]                             # as records before the bias phase
    read = timing.DeviceModel.from_record(json.loads(json.dumps(record))).conv_times
    assert read == {**times, (*g, workspace.BIAS_PHASE): {"onepass": 2e-6}}


def test_measured_conv_times_replace_the_formula_where_they_cover_the_plans_choice():
    """A conv pass takes the measured seconds per image of each algorithm the plan chose,
    times the batch (forward; backward data plus weight); a choice not measured falls back
    to the fitted formula, as does every other layer. The record survives JSON."""
    import json
    from tinysn.sched import workspace
    net = sn.models.resnet(blocks=[1, 1, 1, 1], **NET)
    plan = sn.plan(net, "1GiB", "liveness")
    times = {}
    for key in workspace.net_keys(net):
        times[key] = {a: 1e-9 for a in workspace.conv_k.algos(*key[:4], key[4])}
    measured = timing.DeviceModel.h200(conv_times=times)
    launches = [(s, op) for s in plan.steps for op in s.ops if isinstance(op, timing.Launch)]
    convs = [(s, op) for s, op in launches if op.algos]
    assert convs
    for step, op in convs:
        layer = net[step.layer]
        assert timing.measured_conv_seconds(layer, op.algos, measured) == \
            pytest.approx(1e-9 * len(op.algos) * net.batch)
    step, forward = next((s, op) for s, op in convs if s.phase == "forward")
    stale = {k: {} for k in times}
    assert timing.measured_conv_seconds(net[step.layer], forward.algos,
                                        timing.DeviceModel.h200(conv_times=stale)) is None
    assert timing.simulate(plan, measured).compute_s < timing.simulate(plan).compute_s
    again = timing.DeviceModel.from_record(json.loads(json.dumps(measured.record())))
    assert again == measured and again.conv_times == times


def test_compute_waits_add_up_to_the_idle_time_and_land_in_the_phase_that_waited():
    """The idle time per phase sums to the step minus the kernels (launch cost 0); a slow
    host-to-device link puts it in the backward pass, a slow link out in the forward pass."""
    plan = sn.plan(sn.models.resnet(blocks=[1, 1, 1, 1], **NET), "1GiB", "offload")
    for slow, phase in (("to_device_bytes_per_s", "backward"), ("to_host_bytes_per_s", "forward")):
        tl = timing.simulate(plan, model(launch_s=0.0, **{slow: 1e6}))
        waits = tl.compute_waits()
        last_kernel = max(e[3] for e in tl.events if e[0] == "compute")
        assert sum(waits.values()) == pytest.approx(last_kernel - tl.compute_s)
        assert max(waits, key=waits.get) == phase, waits
    assert list(timing.simulate(plan, model()).compute_waits()) == ["forward", "backward"]


def _rebuilding_cap(net, **plan_kw) -> int:
    """The largest cap, in steps of 1% under the peak of policy "liveness", at which
    policy "recompute" fits and rebuilds something."""
    peak = sn.plan(net, "1GiB", "liveness", momentum=0.9, **plan_kw).peak_bytes
    for percent in range(99, 50, -1):
        try:
            if sn.plan(net, peak * percent // 100, "recompute", momentum=0.9,
                       **plan_kw).recomputed_steps:
                return peak * percent // 100
        except sn.OutOfMemory:
            continue
    raise AssertionError("no cap found at which policy 'recompute' rebuilds")


@pytest.mark.parametrize("conv_algos, rebuilds", [
    (None, False),
    ({"backward_data": "transposed", "backward_weight": "splitk", "forward": "im2col"}, False),
    (None, True)])
def test_kernel_launches_counts_the_triton_kernels_each_launch_runs(monkeypatch, conv_algos,
                                                                     rebuilds):
    """One training step of a net with every layer op, run by the CPU interpreter: every
    Launch runs as many Triton kernels as `timing.kernel_launches` says (its layer's own and
    one SGD update per parameter tensor in a backward pass), with the default conv
    algorithms, with the ones that launch two kernels, and under a cap where policy
    "recompute" rebuilds the cheap layers (batch norm's rebuild: one kernel, not three)."""
    import torch
    import tinysn.testing as snt
    from tinysn import runtime as rt_mod
    from tinysn.kernels._common import INTERPRET
    from tinysn.sched.plan import Launch
    if not INTERPRET:
        pytest.skip("counts the interpreter's kernel calls")
    from triton.runtime import interpreter
    ran, current = [], [None]
    real_run = interpreter.InterpretedFunction.run

    def counting(self, *args, **kwargs):
        ran.append(current[0])
        return real_run(self, *args, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counting)
    real_launch = rt_mod.Runtime._EXECUTE[Launch]

    def launch(rt, op):
        current[0] = op
        real_launch(rt, op)
        current[0] = None
    monkeypatch.setitem(rt_mod.Runtime._EXECUTE, Launch, launch)
    net = snt.every_layer_net(batch=2)
    # with its batch norm's ReLU fused, this net fits policy "recompute" without a rebuild
    # at every cap down to where nothing fits, so the rebuilding case plans them apart
    kw = {"fuse_bn_relu": False} if rebuilds else {}
    if conv_algos is not None:      # the max pool's backward finds its argmaxes (SPARE)
        kw["store_argmaxes"] = False
    policy, memory = ("recompute", _rebuilding_cap(net, **kw)) if rebuilds else ("all", "1GiB")
    rt = sn.Runtime(net, memory, policy, momentum=0.9, conv_algos=conv_algos, **kw)
    images, labels = torch.randn(2, *net.input_shape), torch.randint(0, net.classes, (2,))
    rt.step(images, labels)
    launches = [op for step in rt.plan.steps for op in step.ops if isinstance(op, Launch)]
    pinned = {a for op in launches for a in (op.algos or {}).values()}
    assert pinned - {SPARE} == ({"implicit", "onepass"} if conv_algos is None
                                else set(conv_algos.values()))
    # the max pool's argmaxes: stored by its forward where the net fits unmoved, else
    # found by its backward into a spare workspace (policy "all")
    stores = any(layer.attrs.get("saves_argmax") for layer in rt.plan.net.layers)
    assert stores == (policy == "all" and conv_algos is None)
    assert (SPARE in pinned) == (policy == "all" and not stores)
    assert (rt.plan.recomputed_steps > 0) == rebuilds
    for op in launches:
        assert sum(r is op for r in ran) == timing.kernel_launches(rt.plan, op), op


def test_the_host_cost_scales_with_the_hosts_probe(monkeypatch):
    """An eager layer step costs the fitted multiple of the host's bare launch: a host whose
    launch takes twice as long pays twice; without a probe, the fitted hosts' cost.
    Replayed, 1 us per layer step and no probe. The probe survives JSON."""
    import json
    monkeypatch.setattr(timing, "H200_LAUNCH_PER_PROBE", 5.0)
    monkeypatch.setattr(timing, "H200_LAUNCH_PROBE_S", 20e-6)
    assert timing.host_launch_s(40e-6) == pytest.approx(200e-6)
    assert timing.host_launch_s(None) == pytest.approx(100e-6)
    slow = timing.DeviceModel.h200(launch_probe_s=40e-6)
    assert slow.launch_s == pytest.approx(200e-6) and slow.launch_probe_s == 40e-6
    assert slow.kernel_launch_s == 0
    assert timing.DeviceModel.h200().launch_s == pytest.approx(100e-6)
    replayed = timing.DeviceModel.h200(graphed=True, launch_probe_s=40e-6)
    assert replayed.launch_s == 1e-6 and replayed.launch_probe_s is None
    assert timing.DeviceModel.from_record(json.loads(json.dumps(slow.record()))) == slow


def test_a_faster_host_predicts_a_shorter_host_bound_step():
    """A small net's eager step is bound by its host: a host probed at half another's launch
    time predicts a step close to half, one at twice close to twice, and no probe the
    fitted hosts' step."""
    plan = sn.plan(sn.models.resnet(blocks=[1, 1, 1, 1], **NET), "1GiB", "liveness")
    step = {p: timing.simulate(plan, timing.DeviceModel.h200(launch_probe_s=p)).step_s
            for p in (10e-6, 20e-6, 40e-6)}
    assert step[10e-6] == pytest.approx(step[20e-6] / 2, rel=0.1)
    assert step[40e-6] == pytest.approx(step[20e-6] * 2, rel=0.1)
    assert timing.simulate(plan, timing.DeviceModel.h200()).step_s == pytest.approx(
        step[20e-6] * timing.H200_LAUNCH_PROBE_S / 20e-6, rel=0.1)


def test_the_probe_times_bare_launches():
    """measure_launch_s gives a positive time per launch (on the CPU, the interpreter's);
    it launches `rounds * launches + 1` kernels and nothing else."""
    from triton.runtime import interpreter
    from tinysn.kernels._common import INTERPRET
    seconds = timing.measure_launch_s("cpu", rounds=3, launches=4)
    assert 0 < seconds < 1
    if INTERPRET:
        calls = []
        real = interpreter.InterpretedFunction.run
        try:
            interpreter.InterpretedFunction.run = \
                lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1]
            timing.measure_launch_s("cpu", rounds=3, launches=4)
        finally:
            interpreter.InterpretedFunction.run = real
        assert len(calls) == 3 * 4 + 1


@pytest.mark.gpu
@pytest.mark.timing
def test_an_eager_runtime_plans_with_its_hosts_probe_and_allocates_nothing_for_it():
    """On the GPU the probe allocates no device memory, and an eager Runtime's plan carries
    this process's probe (a replayed one none: it pays no per-launch host cost)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    seconds = timing.measure_launch_s("cuda")
    assert 0 < seconds < 1e-3
    assert torch.cuda.max_memory_allocated() == before
    net = sn.models.resnet(blocks=[1, 1, 1, 1], **NET)
    eager = sn.Runtime(net, "1GiB", "all", device="cuda")
    assert 0 < eager.plan.device_model.launch_probe_s < 1e-3
    assert eager.plan.device_model.launch_s == \
        timing.host_launch_s(eager.plan.device_model.launch_probe_s)
    eager.close()
