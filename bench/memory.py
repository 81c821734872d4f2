"""Largest trainable batch under a memory cap, planned and then trained for real.

    PYTHONPATH=. python bench/memory.py [--memory 12GiB] [--models resnet50,...] [--plan-only]
                                        [--deep] [--deep-n N] [--reference 120GiB] [--pytorch]

For each model: the largest batch that policy "all" plans under the cap (sn.max_batch, plain
SGD without a momentum buffer, as the PyTorch reference figures were measured), then real
training steps at that batch on the GPU: the pool's measured peak against the plan's, images/s
and the host<->device bandwidth achieved. Also the deepest ResNet [6, 32, n, 6] at batch 16,
and the layer-wise bound (the batch at which the largest single layer's memory plus the
parameter state fills the cap). With --pytorch, PyTorch eager's largest batch (and deepest
ResNet) in the same cap and run, counted the same way: every device byte of the process
(torch.cuda.set_per_process_memory_fraction), batches fed from the host. With --reference, the same batch also trains under a cap so
large that nothing moves: the difference is what offload and eviction cost beyond compute.
The pinned-copy bandwidth of the machine (each way and both at once) is measured for context.
Conv algorithms are chosen per step from rankings timed on the GPU (measure_rankings),
inside the pool. Every device byte counts: batches are fed from pinned host memory, torch's
peak statistics are reset before Runtime() and `process_peak_bytes` (the process's
max_memory_allocated, everything it held included) is recorded beside the pool's peak.
Writes the results to --out after every model.
"""
import argparse
import contextlib
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402
from tinysn.sched import liveness, recompute  # noqa: E402
from tinysn.sched import plan as plan_mod  # noqa: E402
from tinysn.sched.timing import simulate  # noqa: E402

# PyTorch 2.11 eager in the same 12 GiB cap, as measured by the team that filed the issue
# (plain SGD); context only, not reproduced here.
PYTORCH_12GIB = {"resnet50": 140, "resnet101": 96, "resnet152": 66, "vgg16": 148,
                 "inception_v4": 70, "deep_resnet_layers": 662}


def layerwise_bound(model_fn, cap: int) -> int:
    """Largest batch at which the largest single step's memory (l_peak: its inputs, outputs
    and gradients, a gradient written over dy counted once) plus the parameter state fits
    in the cap: the paper's bound."""
    def need(batch):
        prog = liveness.Program(model_fn(batch=batch))
        persistent = sum(t.nbytes for t in prog.tensors if t.persistent)
        return persistent + recompute.layer_peak(prog, lambda s: 0, in_place=True)

    return largest(lambda batch: need(batch) <= cap)


def largest(fits, start: int = 1, limit: int = 1 << 16) -> int:
    """The largest k in [1, limit] with fits(k) (0 if none), for a `fits` that holds up to
    some k and not beyond: doubling from `start`, then bisection."""
    lo, hi = 0, start
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def parse_batches(text: str) -> dict:
    """{model: batch} from "name=N,name=N" (--batches)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, n = item.partition("=")
        if name not in MODELS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--batches: expected name=N with a model name and N >= 1, "
                             f"got {item!r}")
        out[name] = int(n)
    return out


def checked_largest(model_fn, batch: int, cap: int, host_memory=None, **plan_kw) -> int:
    """`batch`, after checking that it is the largest batch policy "all" plans under `cap`
    (it plans, batch + 1 does not): what sn.max_batch would return, at the cost of two of its
    fit tests (`plan_kw`: the planner's options, as sn.max_batch's)."""
    def fits(k):
        return plan_mod.fits(model_fn(batch=k), cap, "all", host_memory=host_memory,
                             **plan_kw)
    if not fits(batch) or fits(batch + 1):
        raise SystemExit(f"--batches: {batch} is not the largest batch that plans under the cap")
    return batch


def deep_resnet(n):
    return lambda batch: sn.models.resnet(blocks=[6, 32, n, 6], batch=batch)


def deepest_resnet(memory, batch=16, policy="all", host_memory=None):
    """Largest n such that resnet([6, 32, n, 6]) at `batch` plans; returns (n, layers)."""
    n = largest(lambda n: plan_mod.fits(deep_resnet(n)(batch), memory, policy,
                                        host_memory=host_memory), start=64)
    return n, conv_fc_layers(deep_resnet(n)(batch))


def conv_fc_layers(net) -> int:
    return sum(1 for layer in net.layers if layer.op in ("conv", "fc"))


@contextlib.contextmanager
def capped(cap: int):
    """Every device byte of the process under `cap` while inside (torch refuses to reserve
    more: torch.cuda.set_per_process_memory_fraction), the peak statistics reset on entry
    and the cache handed back on exit; a no-op without CUDA, where nothing can be capped."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
    try:
        yield
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


def pytorch_peak(net, model_name, cap: int):
    """PyTorch eager, two plain SGD steps of `net`'s twin (common.torch_model) with every
    device byte of the process under `cap` (`capped`), batches fed from pinned host memory as
    tinysn's are: the process's max_memory_allocated, or None when it runs out of memory."""
    model = opt = None
    peak = None
    with capped(cap):
        try:
            model = common.torch_model(model_name, net)[0].cuda().train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            images, labels = (t.pin_memory() for t in sn.data.synthetic(net, seed=0))
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                logits = model(images.cuda(non_blocking=True))
                labels_here = labels.cuda(non_blocking=True)
                torch.nn.functional.cross_entropy(logits, labels_here).backward()
                del logits
                opt.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        except torch.cuda.OutOfMemoryError:
            pass
        model = opt = None
    return peak


def pytorch_largest(make_net, model_name, cap: int, start: int = 1) -> dict:
    """The largest k for which PyTorch trains make_net(k) under `cap` (pytorch_peak), and
    the process peak it reached there."""
    peaks = {}

    def fits(k):
        peaks[k] = pytorch_peak(make_net(k), model_name, cap)
        return peaks[k] is not None
    k = largest(fits, start=start)
    return {"largest": k, "process_peak_bytes": peaks.get(k)}


def copy_bandwidth(nbytes=1 << 30) -> dict:
    """GB/s of pinned host <-> device copies: each way alone, and both at once."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def both():
        with torch.cuda.stream(s1):
            host_a.copy_(dev_a, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_b.copy_(host_b, non_blocking=True)
    to_host = nbytes / timed(lambda: host_a.copy_(dev_a, non_blocking=True)) / 1e9
    to_device = nbytes / timed(lambda: dev_b.copy_(host_b, non_blocking=True)) / 1e9
    both_ways = 2 * nbytes / timed(both) / 1e9
    del host_a, host_b, dev_a, dev_b
    torch.cuda.empty_cache()
    return {"to_host_gb_per_s": to_host, "to_device_gb_per_s": to_device,
            "both_ways_gb_per_s": both_ways}


def train_for_real(net, memory, host_memory=None, steps=2, cuda_graph=False):
    """Plan (conv rankings timed on the GPU first), train warm-up + `steps` timed iterations
    (with cuda_graph, the warm-up includes the eager steps and the capture), report."""
    common.release_memory()
    torch.cuda.reset_peak_memory_stats()
    held_before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    rt = sn.Runtime(net, memory, "all", device="cuda", lr=0.01, momentum=0.0,
                    host_memory=host_memory, cuda_graph=cuda_graph)
    setup_s = time.perf_counter() - t0
    images, labels = (t.pin_memory() for t in sn.data.synthetic(net, seed=0))  # from the host
    warmup = sn.runtime.GRAPH_WARMUP + 1 if cuda_graph else 1
    losses = [rt.step(images, labels) for _ in range(warmup)]
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(rt.step(images, labels))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    s = min(times)
    process_peak = torch.cuda.max_memory_allocated()   # the whole process, since the reset
    moved = rt.plan.bytes_to_host + rt.plan.bytes_to_device
    timeline = simulate(rt.plan, rt.plan.device_model)    # rt.plan.predicted_step_s's walk
    algos = {}
    for phases in rt.plan.conv_algos.values():
        for phase, algo in phases.items():
            key = f"{phase}:{algo}"
            algos[key] = algos.get(key, 0) + 1
    out = {"memory": memory, "cuda_graph": cuda_graph, "peak_bytes": rt.stats.peak_bytes,
           "planned_peak_bytes": rt.plan.peak_bytes,
           "peak_equals_plan": rt.stats.peak_bytes == rt.plan.peak_bytes,
           "process_peak_bytes": process_peak, "process_held_before_bytes": held_before,
           "process_peak_within_cap":
               process_peak <= sn.parse_bytes(memory) + sn.runtime.PROCESS_SLACK_BYTES,
           "setup_seconds_incl_rankings": setup_s,
           "predicted_seconds_per_step": timeline.step_s,
           "predicted_compute_waits_s": timeline.compute_waits(),
           "speed_centric_everywhere": recompute.speed_everywhere(rt.plan.drops),
           "trade_budget": sn.plan.__kwdefaults__["trade_budget"],
           "lookahead": rt.plan.lookahead,
           "in_place_gradients": sn.plan.__kwdefaults__["in_place_gradients"],
           "keep_pools": sn.plan.__kwdefaults__["keep_pools"],
           "evict_by_next_use": sn.plan.__kwdefaults__["evict_by_next_use"],
           "rebuild_joins": sn.plan.__kwdefaults__["rebuild_joins"],
           "fuse_relu": sn.plan.__kwdefaults__["fuse_relu"],
           "fuse_bn_relu": sn.plan.__kwdefaults__["fuse_bn_relu"],
           "fuse_add_relu": sn.plan.__kwdefaults__["fuse_add_relu"],
           "fuse_bn_add": sn.plan.__kwdefaults__["fuse_bn_add"],
           "group_updates": sn.plan.__kwdefaults__["group_updates"],
           "fuse_updates": sn.plan.__kwdefaults__["fuse_updates"],
           "store_argmaxes": sn.plan.__kwdefaults__["store_argmaxes"],
           "batch_staged": rt.batch_staged,
           "rebuilt_joins": rt.plan.rebuilt_joins,
           "device_model": rt.plan.device_model.record(),
           "seconds_per_step": s, "images_per_s": net.batch / s, "losses": losses,
           "bytes_moved_per_step": moved, "transfer_gb_per_s": moved / s / 1e9,
           "recomputed_steps": rt.plan.recomputed_steps, "conv_algos_chosen": algos}
    rt.close()
    common.release_memory()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", default="12GiB")
    parser.add_argument("--models", default="resnet50,resnet101,resnet152,vgg16,inception_v4")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--deep", action="store_true", help="also the deepest ResNet")
    parser.add_argument("--batches", default="",
                        help="name=N,...: take N as a model's largest batch instead of searching "
                             "(N from a --plan-only run); checked: N plans and N+1 does not")
    parser.add_argument("--deep-n", type=int, default=None,
                        help="train ResNet [6, 32, N, 6] (skip the search; N from a plan run)")
    parser.add_argument("--reference", default=None,
                        help="also train each batch under this larger cap (nothing moves)")
    parser.add_argument("--host-memory", default=None,
                        help="cap on the pinned host arena (the GPU machine's RAM bounds it)")
    parser.add_argument("--reference-models", default=None,
                        help="models that get the --reference run (default: all)")
    common.add_out_argument(parser)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="train with Runtime(cuda_graph=True) (the step replayed)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other models' rows already in the --out file, and a "
                             "model's PyTorch largest batch where --pytorch is not given")
    parser.add_argument("--pytorch", action="store_true",
                        help="also PyTorch's largest batch (deep ResNet: depth) in the same cap, "
                             "the whole process counted and fed from the host")
    args = parser.parse_args()
    cap = sn.parse_bytes(args.memory)
    real = torch.cuda.is_available() and not args.plan_only
    rows = {}
    if args.merge:
        rows.update(common.read(args.out).get("models", {}))
    ref_models = args.reference_models.split(",") if args.reference_models else None
    given = parse_batches(args.batches)

    def save():
        return common.write(args.out, {"memory": args.memory, "models": rows})
    if real:
        rows["copy_bandwidth"] = copy_bandwidth()
        print("pinned copies:", {k: round(v, 1) for k, v in rows["copy_bandwidth"].items()},
              flush=True)
    for name in [m for m in args.models.split(",") if m]:
        fn = MODELS[name]
        t0 = time.perf_counter()
        best = (checked_largest(fn, given[name], cap, args.host_memory) if name in given else
                sn.max_batch(fn, cap, "all", host_memory=args.host_memory))
        row = {"max_batch_all": best, "plan_seconds": time.perf_counter() - t0,
               "layerwise_bound": layerwise_bound(fn, cap),
               "pytorch_12gib_reference": PYTORCH_12GIB.get(name)}
        p = sn.plan(fn(batch=best), cap, "all", host_memory=args.host_memory)
        row.update(planned_peak_bytes=p.peak_bytes, uses_recompute=p.uses_recompute,
                   planned_bytes_to_host=p.bytes_to_host, host_memory=args.host_memory,
                   planned_host_bytes=p.host_bytes, recomputed_steps=p.recomputed_steps,
                   predicted_seconds_per_step=p.predicted_step_s)
        print(f"{name}: max batch {best} (layer-wise bound {row['layerwise_bound']}, PyTorch "
              f"reference {row['pytorch_12gib_reference']})", flush=True)
        if not args.pytorch and "pytorch" in rows.get(name, {}):
            row["pytorch"] = rows[name]["pytorch"]    # merged: PyTorch's, measured before
        rows[name] = row
        if real:
            reference = args.reference if ref_models is None or name in ref_models else None
            train_and_record(row, fn(batch=best), cap, reference, args.host_memory,
                             cuda_graph=args.cuda_graph)
            if args.pytorch:
                row["pytorch"] = pytorch_largest(lambda b, fn=fn: fn(batch=b), name, cap,
                                                 start=PYTORCH_12GIB.get(name) or 1)
                print(f"  pytorch: max batch {row['pytorch']['largest']}", flush=True)
            save()
    if args.deep or args.deep_n:
        n, layers = ((args.deep_n, None) if args.deep_n else
                     deepest_resnet(cap, host_memory=args.host_memory))
        if layers is None:
            layers = conv_fc_layers(deep_resnet(n)(16))
        rows["deep_resnet"] = {"blocks": [6, 32, n, 6], "batch": 16, "conv_fc_layers": layers,
                               "pytorch_12gib_reference_layers": PYTORCH_12GIB["deep_resnet_layers"]}
        print(f"deepest ResNet [6, 32, {n}, 6] at batch 16: {layers} conv/fc layers", flush=True)
        if real:
            train_and_record(rows["deep_resnet"], deep_resnet(n)(16), cap, None,
                             args.host_memory, steps=1, cuda_graph=args.cuda_graph)
        if real and args.pytorch:
            torch_deep = pytorch_largest(lambda k: deep_resnet(k)(16), "deep_resnet", cap, start=8)
            torch_deep["conv_fc_layers"] = conv_fc_layers(deep_resnet(torch_deep["largest"])(16))
            rows["deep_resnet"]["pytorch"] = torch_deep
            print(f"  pytorch: {torch_deep['conv_fc_layers']} conv/fc layers", flush=True)
    if save():
        print(f"wrote {args.out}")


def train_and_record(row, net, cap, reference, host_memory, steps=2, cuda_graph=False):
    """Train under the cap (and, with `reference`, under a cap where nothing moves) into row."""
    for key, memory in (("real", cap), ("reference", reference)):
        if memory is None:
            continue
        try:
            row[key] = r = train_for_real(net, memory, host_memory, steps, cuda_graph)
            print(f"  {key} ({memory}): peak {r['peak_bytes']:,} == plan: "
                  f"{r['peak_equals_plan']}, process peak {r['process_peak_bytes']:,}, "
                  f"{r['images_per_s']:.1f} images/s, "
                  f"{r['transfer_gb_per_s']:.1f} GB/s moved, losses "
                  f"{[round(x, 3) for x in r['losses']]}", flush=True)
        except Exception as err:
            row[key + "_error"] = f"{type(err).__name__}: {err}"[:500]
            print(f"  {key} training failed:", row[key + "_error"], flush=True)


if __name__ == "__main__":
    main()
