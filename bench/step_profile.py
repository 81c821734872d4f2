"""Where a tinysn training step's GPU time goes: device time per Triton kernel, from the
CUDA profiler, beside the step-time model's prediction.

    PYTHONPATH=. python3 bench/step_profile.py --model alexnet --batch 32 [--out PATH]   # on a GPU

Builds the Runtime as bench/train.py does (policy "all", default autotuned kernels), runs
warm-up steps, then profiles `--steps` eager steps with torch.profiler (CUDA activity only)
and sums each kernel's device time per step. The sum is the GPU's busy time: a step
replayed from a CUDA graph runs the same kernels, so where the graphed step takes longer
than the model predicts, this table says which kernels the model underrates. Each kernel
is listed with its calls per step, ms per step and share of the busy time; the JSON keeps
every kernel.

With `--pytorch` a PyTorch configuration of bench/train.py (`--pytorch-config`: by default
torch.compile, default mode, the best on VGG16 and AlexNet; eager channels-last was the best
on ResNet-50; the same SGD settings and host batch) is profiled the same way after its
warm-up steps, in the same process: its kernels and busy time sit beside tinysn's in the
JSON (`pytorch`), so the two steps can be compared kernel by kernel.

Then one more eager step is timed launch by launch (tinysn.trace's Recorder: CUDA events
around each layer step) beside the model's time for the same launch (the conv passes' from
the runtime's own rankings, `conv_times`): `launches` in the JSON, largest overrun first,
with the conv algorithms each ran. Where the step takes longer than its kernels' ranked
times add up to, these rows say which layer steps. The JSON records the pool's peak beside
the process's device peak (max_memory_allocated) for tinysn, and the process's for PyTorch.
"""
import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.train import PYTORCH_CONFIGS, config_step, set_up_torch  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402
from tinysn.sched.plan import Launch  # noqa: E402
from tinysn.sched.timing import simulate  # noqa: E402
from tinysn.trace import COMPUTE, THREADS, Recorder  # noqa: E402


SGD = {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}   # tinysn's and PyTorch's alike


def kernel_times(events, steps: int) -> list:
    """[{"kernel", "calls_per_step", "ms_per_step"}] from profiler events (each with `name`
    and `device_time` in us, or None for host-only events), largest first."""
    total, calls = defaultdict(float), defaultdict(int)
    for e in events:
        if e["device_time"]:
            total[e["name"]] += e["device_time"]
            calls[e["name"]] += 1
    rows = [{"kernel": name, "calls_per_step": calls[name] / steps,
             "ms_per_step": total[name] / 1e3 / steps} for name in total]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def device_events(prof) -> list:
    """The profiler's kernel and memcpy/memset events as plain dicts."""
    out = []
    for e in prof.events():
        kind = getattr(e, "device_type", None)
        if kind == torch.autograd.DeviceType.CUDA:
            out.append({"name": e.name, "device_time": e.device_time})
    return out


def launch_times(recorded, predicted, plan) -> list:
    """[{"launch", "algos", "measured_ms", "predicted_ms", "over_ms"}], one row per kernel
    launch of a step, largest overrun (measured - predicted) first: `recorded` is the step's
    trace events (Recorder.events(): compute spans named "layer phase"), `predicted` the
    model's timeline events of the same plan (simulate(...).events: ("compute", "phase
    layer", start s, end s)), matched in order; `algos` are the conv algorithms of the
    plan's launch ({} for other layers). ValueError where the two walks differ."""
    measured = [e for e in recorded if e.get("ph") == "X" and e["tid"] == THREADS[COMPUTE]]
    model = [e for e in predicted if e[0] == COMPUTE]
    launches = [op for step in plan.steps for op in step.ops if isinstance(op, Launch)]
    if not len(measured) == len(model) == len(launches):
        raise ValueError(f"{len(measured)} launches recorded, {len(model)} predicted, "
                         f"{len(launches)} in the plan")
    rows = []
    for m, (_, name, start, end), op in zip(measured, model, launches):
        layer, phase = m["name"].rsplit(" ", 1)
        if f"{phase} {layer}" != name:
            raise ValueError(f"launch '{m['name']}' recorded where '{name}' was predicted")
        took, ranked = m["dur"] / 1e3, (end - start) * 1e3
        rows.append({"launch": m["name"], "algos": dict(op.algos or {}), "measured_ms": took,
                     "predicted_ms": ranked, "over_ms": took - ranked})
    return sorted(rows, key=lambda r: -r["over_ms"])


def profiled_kernels(step, steps: int) -> list:
    """kernel_times of `steps` calls of `step` under torch.profiler (CUDA activity only)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return kernel_times(device_events(prof), steps)


def pytorch_profile(net, steps: int, config: str = "torch.compile", warmup: int = 5) -> dict:
    """The step of bench/train.py's PyTorch `config` on `net`'s torch twin: {"config",
    "busy_ms_per_step", "kernels", "process_peak_bytes"}, profiled after `warmup` steps
    (compiling, if any); the peak is max_memory_allocated from before the model is built."""
    torch.cuda.reset_peak_memory_stats()
    step = config_step(net, config, torch.device("cuda"), SGD)
    for _ in range(warmup):
        step()
    rows = profiled_kernels(step, steps)
    return {"config": config, "kernels": rows,
            "busy_ms_per_step": sum(r["ms_per_step"] for r in rows),
            "process_peak_bytes": torch.cuda.max_memory_allocated()}


def recorded_step(rt, images, labels) -> list:
    """The trace events of one eager step of `rt` (tinysn.trace.Recorder)."""
    rt.recorder = Recorder()
    try:
        rt.step(images, labels)
        return rt.recorder.events()
    finally:
        rt.recorder = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="alexnet", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--memory", default="40GiB")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--top", type=int, default=25, help="kernels printed")
    ap.add_argument("--pytorch", action="store_true",
                    help="also profile a PyTorch step, in the same process")
    ap.add_argument("--pytorch-config", default="torch.compile", choices=PYTORCH_CONFIGS,
                    help="the PyTorch configuration --pytorch profiles")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/step_profile.py needs a CUDA GPU")
        return 1
    set_up_torch()     # the PyTorch step's GEMMs in TF32, as bench/train.py times them
    net = MODELS[args.model](batch=args.batch)
    rt = sn.Runtime(net, args.memory, "all", device="cuda", **SGD)
    images, labels = (t.pin_memory() for t in sn.data.synthetic(net, seed=0))
    for _ in range(3):
        rt.step(images, labels)
    t0 = time.perf_counter()
    rows = profiled_kernels(lambda: rt.step(images, labels), args.steps)
    eager_ms = (time.perf_counter() - t0) / args.steps * 1e3
    busy = sum(r["ms_per_step"] for r in rows)
    predicted = simulate(rt.plan, rt.plan.device_model.__class__.h200(
        graphed=True, conv_times=rt.plan.device_model.conv_times))
    print(f"{args.model} b{args.batch}: GPU busy {busy:.3f} ms/step (profiled eager step "
          f"{eager_ms:.3f} ms); the model predicts {predicted.compute_s * 1e3:.3f} ms of kernels")
    print(f"{'kernel':<48}{'calls':>7}{'ms/step':>10}{'share':>8}")
    for r in rows[:args.top]:
        print(f"{r['kernel'][:47]:<48}{r['calls_per_step']:>7.1f}{r['ms_per_step']:>10.3f}"
              f"{r['ms_per_step'] / busy:>8.1%}")
    launches = launch_times(recorded_step(rt, images, labels), predicted.events, rt.plan)
    print(f"{'layer step':<32}{'measured ms':>12}{'model ms':>10}  conv algorithms")
    for r in launches[:args.top]:
        print(f"{r['launch'][:31]:<32}{r['measured_ms']:>12.3f}{r['predicted_ms']:>10.3f}  "
              f"{', '.join(r['algos'].values())}")
    memory = common.runtime_memory(rt)
    print(f"pool peak {memory['pool_peak_bytes']:,} B (plan {memory['planned_peak_bytes']:,}), "
          f"process peak {memory['process_peak_bytes']:,} B")
    result = {"model": args.model, "batch": args.batch, "steps": args.steps,
              "busy_ms_per_step": busy, "profiled_eager_ms_per_step": eager_ms,
              "predicted_kernel_ms_per_step": predicted.compute_s * 1e3,
              "kernels": rows, "launches": launches, **memory}
    if args.pytorch:
        rt.close()
        result["pytorch"] = reference = pytorch_profile(net, args.steps, args.pytorch_config)
        print(f"{reference['config']}: GPU busy {reference['busy_ms_per_step']:.3f} ms/step "
              f"against tinysn's {busy:.3f}; process peak "
              f"{reference['process_peak_bytes']:,} B")
        for r in reference["kernels"][:args.top]:
            print(f"{r['kernel'][:47]:<48}{r['calls_per_step']:>7.1f}{r['ms_per_step']:>10.3f}")
    common.write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
