"""Host time of the runtime's own Python per step, the GPU's work stubbed out (CPU).

    PYTHONPATH=. python bench/host.py [--blocks 3,4,6,3] [--batch 2] [--policy all]
                                      [--repeats 5] [--out PATH]

Walks a ResNet's plan (ResNet-50's blocks by default, on 32x32 images) on the CPU twice, each
time after two untimed iterations, keeping the best of `--repeats` iterations:
- **launchers**: every Triton kernel call is a no-op (the interpreter's `run`), so what is
  timed is the runtime walking its plan plus each layer op's and kernel launcher's Python:
  argument checks, workspace views, block sizes, the autotuned config's lookup. Per layer
  launch, this is the part of an eager step's host cost that is tinysn's own; Triton's launch
  path and the driver come on top of it on a GPU.
- **walk**: every layer launch is a no-op, so what is timed is the runtime alone:
  allocations and frees through the allocator, moves, waits and the per-step trace.
Prints the figures and writes them to --out.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from bench import common  # noqa: E402
from tinysn.kernels import INTERPRET  # noqa: E402
from tinysn.sched.plan import Launch  # noqa: E402


def best_step_s(rt, images, labels, repeats: int) -> float:
    """The fastest of `repeats` iterations, after two untimed ones."""
    for _ in range(2):
        rt.step(images, labels)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rt.step(images, labels)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(blocks, batch: int, policy: str, repeats: int) -> dict:
    """Seconds per iteration with the Triton kernels stubbed, then with the layer launches
    stubbed, and the plan's counts."""
    if not INTERPRET:
        raise SystemExit("bench/host.py stubs the Triton interpreter: run it on a CPU machine")
    net = sn.models.resnet(blocks=blocks, batch=batch, classes=10, input_shape=(3, 32, 32))
    rt = sn.Runtime(net, "12GiB", policy, device="cpu", conv_algos={})
    images = torch.randn(batch, 3, 32, 32)
    labels = torch.randint(0, 10, (batch,))
    real_run = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        launchers = best_step_s(rt, images, labels, repeats)
    finally:
        interpreter.InterpretedFunction.run = real_run
    for key in list(rt._launch):
        rt._launch[key] = lambda rt, algos, ws: None
    walk = best_step_s(rt, images, labels, repeats)
    ops = [op for s in rt.plan.steps for op in s.ops]
    launches = sum(isinstance(op, Launch) for op in ops)
    return {"blocks": blocks, "batch": batch, "policy": policy, "repeats": repeats,
            "plan_steps": len(rt.plan.steps), "operations": len(ops),
            "layer_launches": launches,
            "seconds_per_iteration": walk, "us_per_operation": walk / len(ops) * 1e6,
            "launchers_seconds_per_iteration": launchers,
            "launchers_us_per_layer_launch": launchers / launches * 1e6}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="3,4,6,3")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--policy", default="all")
    ap.add_argument("--repeats", type=int, default=5)
    common.add_out_argument(ap)
    args = ap.parse_args()
    r = measure([int(b) for b in args.blocks.split(",")], args.batch, args.policy,
                args.repeats)
    print(f"ResNet {r['blocks']} batch {r['batch']}, policy {r['policy']}: "
          f"{r['plan_steps']} steps, {r['operations']} operations, "
          f"{r['layer_launches']} layer launches")
    print(f"  walk (layer launches stubbed): {r['seconds_per_iteration'] * 1e3:.1f} ms per "
          f"iteration, {r['us_per_operation']:.2f} us per operation")
    print(f"  with the launchers (Triton kernels stubbed): "
          f"{r['launchers_seconds_per_iteration'] * 1e3:.1f} ms per iteration, "
          f"{r['launchers_us_per_layer_launch']:.1f} us per layer launch")
    common.write(args.out, r)


if __name__ == "__main__":
    main()
