"""The fitted figures of the step-time model (`sched/timing.DeviceModel.h200`), derived from
the tracked GPU results, so the model's numbers come from measurements and not from hand.

    PYTHONPATH=. python3 bench/calibrate.py [--results bench/results] [--out PATH]

- **Conv rates.** A conv kernel's time is modelled as flops / F + bytes / B
  (`timing.conv_seconds`). F and B are fitted, by least squares on the relative error, over
  `kernels-<gpu>.json`'s conv rows: for each direction and shape the fastest algorithm (the
  one the planner's rankings pick), leaving out the first conv's data gradient, which
  training never computes.
- **Host cost.** At batch 32 AlexNet's and ResNet-50's eager steps are bound by the host
  (their CUDA-graph replays run 1.5x and 3.8x as fast). For each, the host seconds per layer step
  at which the model predicts its measured eager step (`train-alexnet-b32-<gpu>.json`,
  `train-resnet50-b32-bn-apart-<gpu>.json`,
  planned as it ran, with its measured conv times) are divided by the run's own probe of
  the host (`timing.measure_launch_s`, a bare Triton launch, taken before and after the
  timed steps): the model charges that multiple of a process's probe per layer step. The
  fit is the geometric mean of the two runs' multiples, and the probe without one the
  mean of their probes. Per layer step rather than per Triton kernel, and scaled by the
  probe, because that is what varies least between the two models' runs: in one call
  they cost 7.41 and 7.38 probes per layer step (per kernel, 1.55x apart; commit
  ac36b27's results); in the tracked runs, from two calls, 9.61 and 10.58 (this script
  prints them), in earlier calls 9.61 and 9.09, 8.1 and 11.6, 9.6 and 13.1, 5.8 and 10.2,
  7.7 and 10.0, and 13.0 and 10.3.

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
from bench import predict  # noqa: E402
from bench.common import add_out_argument, write  # noqa: E402
from tinysn.sched.plan import Launch  # noqa: E402
from tinysn.sched.timing import DeviceModel, simulate  # noqa: E402

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


# the batch-32 runs the host cost is fitted on: AlexNet's before batch staging, and
# ResNet-50's with every ReLU but the convs' planned apart (its A/B file; the host bounds
# that eager step most)
HOST_BOUND = ("alexnet-b32-unstaged", "resnet50-b32-bn-apart")    # train-<these>-<gpu>.json


def eager_row(train: dict) -> dict:
    """A train.py result's eager tinysn row."""
    return next(r for r in train["tinysn"] if not r["cuda_graph"] and "ms_per_step" in r)


def launch_probe_seconds(train: dict) -> float:
    """The bare launch time an eager run's process measured beside its timed steps (or, in
    runs from before that, when its Runtime planned)."""
    row = eager_row(train)
    probe = row.get("timed_launch_probe_s") or row.get("device_model", {}).get("launch_probe_s")
    if not probe:
        raise ValueError(f"calibrate: the {train['model']} batch-{train['batch']} eager run "
                         "recorded no probe of its host (timing.measure_launch_s)")
    return probe


def host_step_seconds(train: dict, conv_flops: float, conv_bytes: float) -> float:
    """Host seconds per layer step at which the model (with the fitted conv rates, and the
    run's measured conv times where it has them) predicts the run's measured eager step:
    by bisection, since the kernels still running when the host has issued the last one
    add to the step."""
    row = eager_row(train)
    plan_kw = predict.train_plan_kw(train, row)
    net = getattr(sn.models, train["model"])(batch=train["batch"])
    plan = predict.plan_as_run(net, train.get("memory") or "40GiB", row["policy"], **plan_kw)
    plan = predict.staged_as_run(plan, row.get("batch_staged", False))
    base = dataclasses.replace(DeviceModel.h200(conv_times=plan_kw["device_model"].conv_times),
                               conv_flops_per_s=conv_flops, conv_bytes_per_s=conv_bytes)
    measured = row["ms_per_step"] / 1e3
    launches = sum(isinstance(op, Launch) for step in plan.steps for op in step.ops)
    lo, hi = 0.0, measured / launches
    for _ in range(40):
        mid = (lo + hi) / 2
        predicted = simulate(plan, dataclasses.replace(base, launch_s=mid)).step_s
        lo, hi = (mid, hi) if predicted < measured else (lo, mid)
    return (lo + hi) / 2


def fit_host(runs: list, conv_flops: float, conv_bytes: float) -> dict:
    """The host cost per layer step as a multiple of the probe (geometric mean over `runs`)
    and the runs' mean probe, with each run's own multiple."""
    probes = {r["model"]: launch_probe_seconds(r) for r in runs}
    multiples = {r["model"]: host_step_seconds(r, conv_flops, conv_bytes) / probes[r["model"]]
                 for r in runs}
    return {"launch_per_probe": float(np.exp(np.mean(np.log(list(multiples.values()))))),
            "launch_probe_s": float(np.exp(np.mean(np.log(list(probes.values()))))),
            "launch_per_probe_by_model": multiples}


def calibrate(folder: Path, gpu: str = "NVIDIA-H200") -> dict:
    """The fitted figures from `folder`'s results of `gpu`."""
    kernels = json.loads((folder / f"kernels-{gpu}.json").read_text())
    runs = [json.loads((folder / f"train-{stem}-{gpu}.json").read_text())
            for stem in HOST_BOUND]
    samples = conv_samples(kernels)
    flops, nbytes = fit_conv(samples)
    errors = [(f / flops + b / nbytes) / t - 1 for _, _, f, b, t in samples]
    return {"gpu": gpu, "conv_flops_per_s": flops, "conv_bytes_per_s": nbytes,
            "conv_rows": len(samples), "conv_worst_error": max(errors, key=abs),
            **fit_host(runs, flops, nbytes)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--gpu", default="NVIDIA-H200", help="the results' GPU name")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    fit = calibrate(Path(args.results), args.gpu)
    print(f"conv: {fit['conv_flops_per_s'] / 1e12:.1f} TFLOP/s + "
          f"{fit['conv_bytes_per_s'] / 1e12:.2f} TB/s over {fit['conv_rows']} rows "
          f"(worst {fit['conv_worst_error']:+.0%}); an eager layer step's host time "
          f"{fit['launch_per_probe']:.2f} bare launches ("
          + ", ".join(f"{m} {v:.2f}" for m, v in fit["launch_per_probe_by_model"].items())
          + f"), {fit['launch_probe_s'] * 1e6:.1f} us each on those hosts")
    write(args.out, fit)
    return fit


if __name__ == "__main__":
    main()
