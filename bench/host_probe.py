"""Does the host probe follow the eager step? Paired samples in one process, over time.

    PYTHONPATH=. python3 bench/host_probe.py [--models resnet50,alexnet] [--rounds 25]
        [--steps 5] [--out PATH]

The step-time model charges an eager layer step a fitted multiple of a bare Triton launch
(`timing.host_launch_s`, `timing.measure_launch_s`), because the lent machines' hosts change
speed between calls and within a process. This script measures how well that probe tracks
the eager step: each model's Runtime (batch 32, policy "all", SGD momentum 0.9 and weight
decay 5e-4, as bench/train.py) is built once; then, `--rounds` times in turn, the bare
launch probe, a pure-Python loop (200,000 additions: the host's interpreter speed alone)
and `--steps` eager steps of each model, synchronized and timed by wall clock. It prints
each figure's range, each model's step time per layer step in probes (the multiple the
model fits), and the correlation of each probe with each model's step; `--out` writes
every round. On the CPU the kernels run in Triton's interpreter (a smoke run).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.train import host_batch, sync  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402
from tinysn.sched.plan import Launch  # noqa: E402
from tinysn.sched.timing import measure_launch_s  # noqa: E402

FUSE_BN_RELU = sn.plan.__kwdefaults__["fuse_bn_relu"]   # the planner's default, as a user gets

PROBES = ("bare_launch_s", "python_loop_s")


def python_loop_seconds(n: int = 200_000) -> float:
    """Seconds of a plain Python loop: the interpreter's speed, without Triton or CUDA."""
    start, total = time.perf_counter(), 0
    for i in range(n):
        total += i
    return time.perf_counter() - start


def eager_runtime(name, batch, device, warmup=3, fuse_bn_relu=FUSE_BN_RELU):
    """A model's eager Runtime as bench/train.py builds it, after `warmup` steps, with its
    batch."""
    net = MODELS[name](batch=batch)
    rt = sn.Runtime(net, "20GiB" if device.type == "cuda" else "2GiB", "all", device=device,
                    lr=0.01, momentum=0.9, weight_decay=5e-4, fuse_bn_relu=fuse_bn_relu)
    images, labels = host_batch(net, device)
    for _ in range(warmup):
        rt.step(images, labels)
    return rt, images, labels


def step_seconds(rt, images, labels, steps, device) -> float:
    """Wall-clock seconds per eager step over `steps` steps between synchronizations."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        rt.step(images, labels)
    sync(device)
    return (time.perf_counter() - start) / steps


def summary(rounds: list, layer_steps: dict) -> dict:
    """Each figure's range, each model's seconds per layer step over the bare probe, and
    the correlation of each probe with each model's step (None with under 3 rounds)."""
    out = {}
    for key in [*PROBES, *(f"{m}_step_s" for m in layer_steps)]:
        values = [r[key] for r in rounds]
        out[key] = {"min": min(values), "max": max(values)}
    for model, n in layer_steps.items():
        multiples = [r[f"{model}_step_s"] / n / r["bare_launch_s"] for r in rounds]
        out[f"{model}_per_layer_step_in_probes"] = {"min": min(multiples), "max": max(multiples)}
        for probe in PROBES:
            pairs = np.array([[r[probe], r[f"{model}_step_s"]] for r in rounds])
            corr = float(np.corrcoef(pairs.T)[0, 1]) if len(rounds) >= 3 else None
            out[f"{model}_correlation_with_{probe}"] = corr
    return out


def run_memory(runs: dict) -> dict:
    """Each model's pool peak (common.runtime_memory), and the process's device peak over
    the run: every Runtime lives to the end, and the last one's construction reset the peak
    with the others' arenas held (None on the CPU)."""
    per_model = {m: common.runtime_memory(rt) for m, (rt, _, _) in runs.items()}
    for record in per_model.values():
        del record["process_peak_bytes"]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"models": per_model, "process_peak_bytes": peak}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,alexnet")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--steps", type=int, default=5)
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models or args.rounds < 1 or args.steps < 1:
        ap.error(f"--models takes names of {sorted(MODELS)} and --rounds and --steps at "
                 f"least 1 (got {args.models!r}, {args.rounds}, {args.steps})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = {m: eager_runtime(m, args.batch, device) for m in models}
    layer_steps = {m: sum(isinstance(op, Launch) for s in rt.plan.steps for op in s.ops)
                   for m, (rt, _, _) in runs.items()}
    rounds = []
    for i in range(args.rounds):
        row = {"round": i, "bare_launch_s": measure_launch_s(device),
               "python_loop_s": python_loop_seconds()}
        for m, (rt, images, labels) in runs.items():
            row[f"{m}_step_s"] = step_seconds(rt, images, labels, args.steps, device)
        rounds.append(row)
        print(" ".join(f"{k} {v * 1e3:.3f} ms" if k != "round" else f"round {v}"
                       for k, v in row.items()), flush=True)
    result = {"models": models, "batch": args.batch, "steps": args.steps,
              "layer_steps": layer_steps, "rounds": rounds,
              "summary": summary(rounds, layer_steps), "memory": run_memory(runs)}
    for key, value in result["summary"].items():
        print(f"{key}: {value}")
    common.write(args.out, result)
    return result


if __name__ == "__main__":
    main()
