"""bench/step_profile.py's summing of profiler events (the profiling itself needs a GPU)."""
from bench import step_profile as profile


def test_kernel_times_sum_device_time_per_kernel_and_step_largest_first():
    events = [{"name": "conv", "device_time": 300.0}, {"name": "relu", "device_time": 20.0},
              {"name": "conv", "device_time": 100.0}, {"name": "cudaLaunchKernel",
                                                       "device_time": 0.0},
              {"name": "relu", "device_time": 40.0}, {"name": "conv", "device_time": 200.0}]
    rows = profile.kernel_times(events, steps=2)
    assert [r["kernel"] for r in rows] == ["conv", "relu"]     # host-only events are dropped
    assert rows[0]["ms_per_step"] == 0.3 and rows[0]["calls_per_step"] == 1.5
    assert rows[1]["ms_per_step"] == 0.03 and rows[1]["calls_per_step"] == 1.0
