"""bench/step_profile.py's summing of profiler events (the profiling itself needs a GPU) and
its launch-by-launch comparison of a recorded step with the model's."""
import pytest

import tinysn as sn
from bench import step_profile as profile
from tinysn.sched.plan import Launch
from tinysn.sched.timing import simulate
from tinysn.testing import every_layer_net


def test_kernel_times_sum_device_time_per_kernel_and_step_largest_first():
    events = [{"name": "conv", "device_time": 300.0}, {"name": "relu", "device_time": 20.0},
              {"name": "conv", "device_time": 100.0}, {"name": "cudaLaunchKernel",
                                                       "device_time": 0.0},
              {"name": "relu", "device_time": 40.0}, {"name": "conv", "device_time": 200.0}]
    rows = profile.kernel_times(events, steps=2)
    assert [r["kernel"] for r in rows] == ["conv", "relu"]     # host-only events are dropped
    assert rows[0]["ms_per_step"] == 0.3 and rows[0]["calls_per_step"] == 1.5
    assert rows[1]["ms_per_step"] == 0.03 and rows[1]["calls_per_step"] == 1.0


def test_launch_times_match_each_recorded_launch_with_the_models():
    """One eager step of a small net on the CPU, recorded launch by launch, beside the
    model's timeline of the same plan: one row per launch, the conv rows with their
    algorithms, largest overrun first; two walks that differ are refused."""
    net = every_layer_net()
    rt = sn.Runtime(net, "64MiB", "all", device="cpu")
    images, labels = sn.data.synthetic(net)
    recorded = profile.recorded_step(rt, images, labels)
    assert rt.recorder is None
    predicted = simulate(rt.plan).events
    rows = profile.launch_times(recorded, predicted, rt.plan)
    launches = [(s, op) for s in rt.plan.steps for op in s.ops if isinstance(op, Launch)]
    assert sorted(r["launch"] for r in rows) == sorted(f"{s.layer} {s.phase}"
                                                       for s, _ in launches)
    assert [r["over_ms"] for r in rows] == sorted((r["over_ms"] for r in rows), reverse=True)
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
    convs = [r for r in rows if r["launch"].split()[0] in
             {layer.name for layer in net.layers if layer.op == "conv"}]
    assert convs and all(r["algos"] for r in convs)
    last = [e for e in recorded if e.get("ph") == "X" and e["tid"] == 0][-1]
    with pytest.raises(ValueError, match="launches recorded"):
        profile.launch_times([e for e in recorded if e is not last], predicted, rt.plan)
    swapped = [e for e in predicted if e[0] == "compute"]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(ValueError, match="was predicted"):
        profile.launch_times(recorded, swapped, rt.plan)

