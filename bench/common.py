"""Shared by the benchmarks: environment description and JSON output under bench/results/."""
import json
import os
import platform

import torch
import triton

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def environment() -> dict:
    """Which GPU, torch and triton a figure was measured on."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}


def gpu_tag() -> str:
    name = environment()["gpu"]
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def write(name: str, payload: dict) -> str:
    """Write payload (plus the environment) to bench/results/<name>.json; return the path."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name + ".json")
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=1)
    return path


def cuda_median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `iters` runs, timed with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def do_bench(fn) -> float:
    """Median milliseconds of fn() by triton's event timer (warm-up 25 ms, 100 ms of repeats)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def shape_str(s) -> str:
    return "x".join(str(d) for d in s)
