"""The fitted figures of the step-time model (`sched/timing.DeviceModel.h200`), derived from
the tracked GPU results, so the model's numbers come from measurements and not from hand.

    PYTHONPATH=. python3 bench/calibrate.py [--results bench/results] [--out PATH]

- **Conv rates.** A conv kernel's time is modelled as flops / F + bytes / B
  (`timing.conv_seconds`). F and B are fitted, by least squares on the relative error, over
  `kernels-<gpu>.json`'s conv rows: for each direction and shape the fastest algorithm (the
  one the planner's rankings pick), leaving out the first conv's data gradient, which
  training never computes.
- **Launch cost.** AlexNet at batch 32 eager is bound by the host (its CUDA-graph replay
  runs 1.7x as fast, and its kernels keep the GPU busy for under two thirds of the eager
  step): the Python cost of one Triton kernel launch is the one at which the model
  predicts its measured step (`train-alexnet-b32-<gpu>.json`), counting the kernels its
  plan's layer steps launch (`timing.kernel_launches`). Per kernel rather than per layer
  step: ResNet-50's and Inception-v4's steps launch more kernels each than AlexNet's
  (batch norm three, a backward pass one SGD update per parameter tensor), and their
  host-bound eager steps take longer per layer step. The run's own probe of the host
  (`timing.measure_launch_s`, a bare Triton launch) is kept beside it: the model scales the
  cost by another process's probe over this one, as hosts differ between calls.

The model's error against every measured run is bench/predict.py's table.
"""
import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
from bench.common import add_out_argument, write  # noqa: E402
from tinysn.sched.plan import Launch  # noqa: E402
from tinysn.sched.timing import DeviceModel, kernel_launches, simulate  # noqa: E402

# bench/kernels.py's conv shape: "7x7/2 3->64 @224 b32" (kernel/stride, channels, size, batch)
SHAPE = re.compile(r"(\d+)x(\d+)(?:/(\d+))? (\d+)->(\d+) @(\d+) b(\d+)$")
F32 = 4


def conv_bytes(shape: str) -> int:
    """Bytes of a conv's input, weight and output, from bench/kernels.py's shape text."""
    m = SHAPE.match(shape)
    if not m:
        raise ValueError(f"calibrate: cannot read the conv shape {shape!r}")
    r, s, stride, c, k, size, n = (int(g) if g else 1 for g in m.groups())
    out = size // stride
    return F32 * (n * c * size * size + k * c * r * s + n * k * out * out)


def conv_samples(kernels: dict) -> list:
    """(direction, shape, flops, bytes, seconds) of the fastest algorithm per direction and
    shape, without data gradients of 3-channel inputs (the first conv's, never computed)."""
    best = {}
    for row in kernels["rows"]:
        direction = row["kernel"]
        if not direction.startswith("conv.") or "tinysn_ms" not in row:
            continue
        if direction == "conv.backward_data" and " 3->" in row["shape"]:
            continue
        key, seconds = (direction, row["shape"]), row["tinysn_ms"] / 1e3
        if key not in best or seconds < best[key][4]:
            best[key] = (direction, row["shape"], row["flops"], conv_bytes(row["shape"]),
                         seconds)
    return list(best.values())


def fit_conv(samples: list) -> tuple:
    """(flops/s, bytes/s) minimising the squared relative error of flops/F + bytes/B."""
    if len(samples) < 2:
        raise ValueError(f"calibrate: need at least 2 conv rows to fit, got {len(samples)}")
    a = np.array([[f / t, b / t] for _, _, f, b, t in samples])
    inverse, *_ = np.linalg.lstsq(a, np.ones(len(samples)), rcond=None)
    if min(inverse) <= 0:
        raise ValueError(f"calibrate: the conv rows give no positive rates ({inverse})")
    return 1 / inverse[0], 1 / inverse[1]


def kernel_launch_seconds(train: dict, conv_flops: float, conv_bytes: float) -> float:
    """Host seconds per Triton kernel launch at which the model (with the fitted conv rates)
    predicts a host-bound run's measured eager step: found by bisection, since the kernels
    still running when the host has issued the last one add to the step."""
    eager = next(r for r in train["tinysn"] if not r["cuda_graph"] and "ms_per_step" in r)
    net = getattr(sn.models, train["model"])(batch=train["batch"])
    plan = sn.plan(net, train.get("memory") or "40GiB", eager["policy"],
                   momentum=train["sgd"]["momentum"])
    measured = eager["ms_per_step"] / 1e3
    base = dataclasses.replace(DeviceModel.h200(), conv_flops_per_s=conv_flops,
                               conv_bytes_per_s=conv_bytes)
    lo, hi = 0.0, measured / sum(kernel_launches(plan, op) for step in plan.steps
                                 for op in step.ops if isinstance(op, Launch))
    for _ in range(40):
        mid = (lo + hi) / 2
        predicted = simulate(plan, dataclasses.replace(base, kernel_launch_s=mid)).step_s
        lo, hi = (mid, hi) if predicted < measured else (lo, mid)
    return (lo + hi) / 2


def launch_probe_seconds(train: dict):
    """The bare launch time the host-bound run's process measured (timing.measure_launch_s;
    None in runs from before the probe): the host the launch cost is fitted on."""
    eager = next(r for r in train["tinysn"] if not r["cuda_graph"] and "ms_per_step" in r)
    return eager.get("device_model", {}).get("launch_probe_s")


def calibrate(folder: Path, gpu: str = "NVIDIA-H200") -> dict:
    """The fitted figures from `folder`'s results of `gpu`."""
    kernels = json.loads((folder / f"kernels-{gpu}.json").read_text())
    train = json.loads((folder / f"train-alexnet-b32-{gpu}.json").read_text())
    samples = conv_samples(kernels)
    flops, nbytes = fit_conv(samples)
    errors = [(f / flops + b / nbytes) / t - 1 for _, _, f, b, t in samples]
    return {"gpu": gpu, "conv_flops_per_s": flops, "conv_bytes_per_s": nbytes,
            "conv_rows": len(samples), "conv_worst_error": max(errors, key=abs),
            "kernel_launch_s": kernel_launch_seconds(train, flops, nbytes),
            "launch_probe_s": launch_probe_seconds(train)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--gpu", default="NVIDIA-H200", help="the results' GPU name")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    fit = calibrate(Path(args.results), args.gpu)
    print(f"conv: {fit['conv_flops_per_s'] / 1e12:.1f} TFLOP/s + "
          f"{fit['conv_bytes_per_s'] / 1e12:.2f} TB/s over {fit['conv_rows']} rows "
          f"(worst {fit['conv_worst_error']:+.0%}); "
          f"{fit['kernel_launch_s'] * 1e6:.0f} us per kernel launch"
          + (f" on a host whose bare launch takes {fit['launch_probe_s'] * 1e6:.1f} us"
             if fit["launch_probe_s"] else ""))
    write(args.out, fit)
    return fit


if __name__ == "__main__":
    main()
