"""Where an eager step's host time goes: the runtime's walk profiled with cProfile.

    PYTHONPATH=. python bench/eager_profile.py [--model resnet50] [--batch 32] [--steps 10]
                                               [--top 30] [--out PATH]

At batch 32 an eager step of a deep net is bound by the host (bench/README.md, the training
table): the GPU waits for launches. This script builds the model's Runtime as host_probe.py
does (policy "all", default kernels, three untimed steps), then measures, in this order:
- **step**: synchronized steps, wall clock per step;
- **issue**: the same number of steps with no synchronization until after the clock stops:
  the host's own time per step (equal to the step when the host is the bound);
- **profile**: the same steps under cProfile: the functions that took the most time
  (`top`, per step), the Triton launches per step (calls of triton's `JITFunction.run`, or
  the interpreter's `run` on a CPU), and how the profiled time splits between Triton's
  launch path (everything under its `run`), tinysn's own code and the rest;
- **own**: the same steps issued again with every Triton launch stubbed out (its `run`
  returns at once: no argument binding, no launcher, no kernel): what is left of the host's
  time per step is tinysn's own (the walk, the checks, the pool, torch's copies), and the
  difference from **issue** is Triton's launch path, measured without a profiler. The
  stubbed steps compute nothing, so they come last. `launches_by_kernel` counts each
  stubbed kernel's launches per step.
`--own-only` runs only that last part, on the CPU whatever the machine (the warm-up steps
stubbed too, so nothing runs, nothing is tuned or timed into a cache): tinysn's own host
time per step and the launches of any model in seconds.
cProfile slows every Python call, so its shares, not its absolute times, are the result.
On a CPU the same code runs on Triton's interpreter (a smoke test: the kernels themselves
are then the time).
"""
import argparse
import collections
import contextlib
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.host_probe import FUSE_BN_RELU, eager_runtime, step_seconds  # noqa: E402
from bench.train import sync  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402

TINYSN_DIR = os.path.dirname(os.path.abspath(sn.__file__))
TRITON_RUN = (("runtime", "jit.py", "run"), ("runtime", "interpreter.py", "run"))


def issue_seconds(rt, images, labels, steps, device) -> float:
    """Seconds per eager step over `steps` steps, the clock stopped before the device is
    waited for: the host's own time per step."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        rt.step(images, labels)
    seconds = (time.perf_counter() - start) / steps
    sync(device)
    return seconds


@contextlib.contextmanager
def triton_stubbed():
    """Within the block every Triton launch (triton's `JITFunction.run`, the interpreter's
    `InterpretedFunction.run`) returns at once and is counted; yields the counts (a Counter
    by kernel name). Nothing runs, so whatever the block computes is garbage."""
    from triton.runtime import interpreter, jit

    owners = [jit.JITFunction, interpreter.InterpretedFunction]
    saved = [(owner, vars(owner)["run"]) for owner in owners]
    calls = collections.Counter()

    def run(self, *args, **kwargs):
        calls[getattr(self.fn, "__name__", "?")] += 1
    for owner in owners:
        owner.run = run
    try:
        yield calls
    finally:
        for owner, original in saved:
            owner.run = original


def where(key) -> str:
    """A profile entry's name: the file (tinysn's from the package, others from their
    site-packages folder), line and function."""
    path, line, name = key
    if path.startswith(TINYSN_DIR):
        path = "tinysn" + path[len(TINYSN_DIR):]
    elif "site-packages" + os.sep in path:
        path = path.split("site-packages" + os.sep, 1)[1]
    return f"{path}:{line}({name})"


def is_triton_run(key) -> bool:
    path, _, name = key
    parts = path.split(os.sep)
    return any(name == fn and parts[-2:] == [folder, file] for folder, file, fn in TRITON_RUN)


def profile_summary(stats: dict, steps: int, top: int) -> dict:
    """Per-step figures from cProfile's raw `stats` ({(file, line, name): (primitive calls,
    calls, own seconds, cumulative seconds, callers)})."""
    total = sum(v[2] for v in stats.values())
    runs = [v for k, v in stats.items() if is_triton_run(k)]
    tinysn_own = sum(v[2] for k, v in stats.items() if k[0].startswith(TINYSN_DIR))
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "profiled_s_per_step": total / steps,
        "triton_launches_per_step": sum(v[1] for v in runs) / steps,
        "triton_launch_path_share": sum(v[3] for v in runs) / total if total else 0.0,
        "tinysn_own_share": tinysn_own / total if total else 0.0,
        "top": [{"function": where(k), "calls_per_step": v[1] / steps,
                 "own_us_per_step": v[2] / steps * 1e6,
                 "cumulative_us_per_step": v[3] / steps * 1e6} for k, v in rows],
    }


def own_figures(rt, images, labels, steps, device, warmup=0) -> dict:
    """tinysn's own host time per step (the issue time with every Triton launch stubbed
    out, after `warmup` stubbed steps) and the stubbed launches per step, by kernel."""
    with triton_stubbed() as launches:
        for _ in range(warmup):
            rt.step(images, labels)
        launches.clear()
        own_s = issue_seconds(rt, images, labels, steps, device)
    return {"own_issue_ms": own_s * 1e3,
            "stubbed_launches_per_step": sum(launches.values()) / steps,
            "launches_by_kernel": {k: v / steps for k, v in launches.most_common()},
            "plan_launches_per_step": sum(isinstance(op, sn.sched.plan.Launch)
                                          for s in rt.plan.steps for op in s.ops)}


def measure_own(model: str, batch: int, steps: int, fuse_bn_relu=FUSE_BN_RELU) -> dict:
    """`own_figures` alone, on the CPU (see the module docstring, `--own-only`)."""
    device = torch.device("cpu")
    rt, images, labels = eager_runtime(model, batch, device, warmup=0,
                                       fuse_bn_relu=fuse_bn_relu)
    return {"model": model, "batch": batch, "steps": steps, "device": str(device),
            "fuse_bn_relu": fuse_bn_relu,
            **own_figures(rt, images, labels, steps, device, warmup=3)}


def measure(model: str, batch: int, steps: int, top: int, fuse_bn_relu=FUSE_BN_RELU) -> dict:
    """The step, issue and profile figures of `model`'s eager Runtime (host_probe's: policy
    "all", warmed up, its batch in pinned host memory)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rt, images, labels = eager_runtime(model, batch, device, fuse_bn_relu=fuse_bn_relu)
    step_s = step_seconds(rt, images, labels, steps, device)
    issue_s = issue_seconds(rt, images, labels, steps, device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        rt.step(images, labels)
    sync(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    return {"model": model, "batch": batch, "steps": steps, "device": str(device),
            "fuse_bn_relu": fuse_bn_relu, "step_ms": step_s * 1e3, "issue_ms": issue_s * 1e3,
            **profile_summary(stats, steps, top),
            **own_figures(rt, images, labels, steps, device), **common.runtime_memory(rt)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--own-only", action="store_true",
                    help="only tinysn's own host time and the launches, kernels stubbed, CPU")
    ap.add_argument("--fuse-bn-relu", action=argparse.BooleanOptionalAction,
                    default=FUSE_BN_RELU,
                    help="plan with each ReLU after a batch norm fused into it (the default; "
                         "--no-fuse-bn-relu plans them apart)")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.top < 1:
        ap.error("--steps, --batch and --top must be at least 1")
    if args.own_only:
        r = measure_own(args.model, args.batch, args.steps, args.fuse_bn_relu)
        print_own(r)
    else:
        r = measure(args.model, args.batch, args.steps, args.top, args.fuse_bn_relu)
        print_all(r)
    common.write(args.out, r)
    return r


def print_own(r: dict) -> None:
    print(f"{r['model']} batch {r['batch']}, Triton's launches stubbed out: tinysn's own host "
          f"time {r['own_issue_ms']:.2f} ms per step; {r['stubbed_launches_per_step']:.0f} "
          f"launches per step ({r['plan_launches_per_step']} layer launches)")
    print("  " + ", ".join(f"{k} {v:.0f}" for k, v in r["launches_by_kernel"].items()))


def print_all(r: dict) -> None:
    print(f"{r['model']} batch {r['batch']} on {r['device']}: step {r['step_ms']:.2f} ms, "
          f"host issue {r['issue_ms']:.2f} ms; {r['triton_launches_per_step']:.0f} Triton "
          f"launches per step ({r['plan_launches_per_step']} layer launches)")
    print(f"  Triton's launches stubbed out: host issue {r['own_issue_ms']:.2f} ms per step "
          f"(tinysn's own), so {r['issue_ms'] - r['own_issue_ms']:.2f} ms is Triton's "
          f"launch path")
    print(f"  under cProfile: Triton's launch path {r['triton_launch_path_share']:.0%}, "
          f"tinysn's own code {r['tinysn_own_share']:.0%} of the profiled time")
    for row in r["top"][:12]:
        print(f"  {row['own_us_per_step']:9.0f} us own {row['calls_per_step']:7.0f} calls  "
              f"{row['function']}")


if __name__ == "__main__":
    main()
