"""Largest trainable batch under a memory cap, planned and then trained for real.

    PYTHONPATH=. python bench/memory.py [--memory 12GiB] [--models resnet50,...] [--plan-only]

For each model: the largest batch that policy "all" plans under the cap (sn.max_batch, plain
SGD without a momentum buffer, as the PyTorch reference figures were measured), then real
training steps at that batch on the GPU: the pool's measured peak against the plan's, images/s
and the host<->device bandwidth achieved. Also the deepest ResNet [6, 32, n, 6] at batch 16,
and the layer-wise bound (the batch at which the largest single layer's memory plus the
parameter state fills the cap). Writes bench/results/memory-<gpu or cpu>.json.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402
from tinysn.sched import liveness, recompute, workspace  # noqa: E402

# PyTorch 2.11 eager in the same 12 GiB cap, as measured by the team that filed the issue
# (plain SGD); context only, not reproduced here.
PYTORCH_12GIB = {"resnet50": 140, "resnet101": 96, "resnet152": 66, "vgg16": 148,
                 "inception_v4": 70, "deep_resnet_layers": 662}


def layerwise_bound(model_fn, cap: int) -> int:
    """Largest batch at which the largest single step's memory (l_peak: its inputs, outputs
    and gradients) plus the parameter state fits in the cap: the paper's bound."""
    def need(batch):
        prog = liveness.Program(model_fn(batch=batch))
        persistent = sum(t.nbytes for t in prog.tensors if t.persistent)
        return persistent + recompute.layer_peak(prog, lambda s: 0)

    lo, hi = 0, 1
    while need(hi) <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= cap else (lo, mid)
    return lo


def deep_resnet(n):
    return lambda batch: sn.models.resnet(blocks=[6, 32, n, 6], batch=batch)


def deepest_resnet(memory, batch=16, policy="all"):
    """Largest n such that resnet([6, 32, n, 6]) at `batch` plans; returns (n, layers)."""
    def fits(n):
        try:
            sn.plan(deep_resnet(n)(batch), memory, policy)
            return True
        except sn.OutOfMemory:
            return False
    lo, hi = 1, 64
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    net = deep_resnet(lo)(batch)
    convs_fcs = sum(1 for layer in net.layers if layer.op in ("conv", "fc"))
    return lo, convs_fcs


def train_for_real(net, memory, steps=2):
    rt = sn.Runtime(net, memory, "all", device="cuda", lr=0.01, momentum=0.0, conv_algos={})
    images, labels = sn.data.synthetic(net, seed=0, device="cuda")
    rt.step(images, labels)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = rt.step(images, labels)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    s = min(times)
    moved = rt.plan.bytes_to_host + rt.plan.bytes_to_device
    out = {"peak_bytes": rt.stats.peak_bytes, "planned_peak_bytes": rt.plan.peak_bytes,
           "peak_equals_plan": rt.stats.peak_bytes == rt.plan.peak_bytes,
           "seconds_per_step": s, "images_per_s": net.batch / s, "loss": loss,
           "bytes_moved_per_step": moved, "transfer_gb_per_s": moved / s / 1e9,
           "recomputed_steps": rt.plan.recomputed_steps}
    del rt
    torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", default="12GiB")
    parser.add_argument("--models", default="resnet50,resnet101,resnet152,vgg16,inception_v4")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--deep", action="store_true", help="also the deepest ResNet")
    args = parser.parse_args()
    cap = sn.parse_bytes(args.memory)
    real = torch.cuda.is_available() and not args.plan_only
    rows = {}
    for name in [m for m in args.models.split(",") if m]:
        fn = MODELS[name]
        t0 = time.perf_counter()
        best = sn.max_batch(fn, cap, "all")
        row = {"max_batch_all": best, "plan_seconds": time.perf_counter() - t0,
               "layerwise_bound": layerwise_bound(fn, cap),
               "pytorch_12gib_reference": PYTORCH_12GIB.get(name)}
        p = sn.plan(fn(batch=best), cap, "all")
        row.update(planned_peak_bytes=p.peak_bytes, uses_recompute=p.uses_recompute,
                   planned_bytes_to_host=p.bytes_to_host)
        print(f"{name}: max batch {best} (layer-wise bound {row['layerwise_bound']}, PyTorch "
              f"reference {row['pytorch_12gib_reference']})", flush=True)
        if real:
            try:
                row["real"] = train_for_real(fn(batch=best), cap)
                r = row["real"]
                print(f"  trained: peak {r['peak_bytes']:,} == plan: {r['peak_equals_plan']}, "
                      f"{r['images_per_s']:.1f} images/s, {r['transfer_gb_per_s']:.1f} GB/s moved",
                      flush=True)
            except Exception as err:
                row["real_error"] = f"{type(err).__name__}: {err}"[:500]
                print("  training failed:", row["real_error"], flush=True)
        rows[name] = row
    if args.deep:
        n, layers = deepest_resnet(cap)
        rows["deep_resnet"] = {"blocks": [6, 32, n, 6], "batch": 16, "conv_fc_layers": layers,
                               "pytorch_12gib_reference_layers": PYTORCH_12GIB["deep_resnet_layers"]}
        print(f"deepest ResNet [6, 32, {n}, 6] at batch 16: {layers} conv/fc layers", flush=True)
        if real:
            try:
                rows["deep_resnet"]["real"] = train_for_real(deep_resnet(n)(16), cap, steps=1)
            except Exception as err:
                rows["deep_resnet"]["real_error"] = f"{type(err).__name__}: {err}"[:500]
    path = common.write(f"memory-{common.gpu_tag()}", {"memory": args.memory, "models": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
