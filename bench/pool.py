"""The memory pool against torch's allocators, on a ResNet-50 training step's allocations.

    PYTHONPATH=. python bench/pool.py [--batch 32] [--step-ms 22] [--repeats 15] [--out PATH]

1. Records the allocation pattern of one ResNet-50 training step (batch 32, float32) in a
   temporary file (the cudaMalloc child replays it from there). The pattern is synthesised from
   ResNet-50's real layer output shapes (torchvision v1.5: stride on the 3x3 conv), with a
   simple liveness rule:
     forward, per layer: conv workspace alloc+free (im2col bytes, capped at 64 MiB), output
       alloc; batch norm also allocs its saved mean and inverse std (C floats each);
     backward, layers in reverse: alloc the gradient of each input on first touch (a second
       consumer accumulates into it), param gradients alloc (freed after the SGD update, as
       with zero_grad(set_to_none=True)), conv dgrad + wgrad workspaces alloc+free, bn
       reduction scratch alloc+free; then free the layer's output gradient, its output
       and its saved statistics.
   Every allocation is freed by the end of the step.
2. Replays it through
   (a) tinysn.pool.BlockAllocator (pure Python bookkeeping; this is what the device pool,
       the host pool and the planner pay per allocation);
   (b) torch's CUDA caching allocator (torch.empty(n, uint8, cuda) / drop the reference),
       warmed up, torch.cuda.synchronize() around the whole replay; this includes making
       and destroying the torch.Tensor, which a pool user pays too (Arena.view);
   (c) raw cudaMalloc/cudaFree: the same replay in a child process run with
       PYTORCH_NO_CUDA_MEMORY_CACHING=1.
   Each figure is the median over --repeats replays of (replay time / number of allocations),
   i.e. µs per alloc+free pair, and the whole replay as a % of a ResNet-50 step (22 ms, a
   PyTorch eager step at batch 32, unless --step-ms gives one measured on the machine).
   Without CUDA only (a) runs, and the output says so.
Writes the rows and the pattern's statistics to --out.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import tinysn  # noqa: E402,F401  (before triton: interpreter switch when there is no GPU)
from bench import common  # noqa: E402
WS_CAP = 64 << 20          # conv workspace cap (bytes)


# ---------------------------------------------------------------------------- the pattern
def resnet50_layers(batch=32, classes=1000):
    """[(name, kind, (C, H, W), [input layer indices], extra)] in forward order."""
    layers = []

    def add(name, kind, shape, inputs, **extra):
        layers.append((name, kind, shape, inputs, extra))
        return len(layers) - 1

    def conv(name, x, cout, k, stride):
        cin, h, w = layers[x][2]
        ho, wo = (h + stride - 1) // stride, (w + stride - 1) // stride
        return add(name, "conv", (cout, ho, wo), [x], cin=cin, k=k)

    def bn(name, x):
        return add(name, "bn", layers[x][2], [x])

    def relu(name, x):
        return add(name, "relu", layers[x][2], [x])

    x = add("data", "data", (3, 224, 224), [])
    x = relu("relu1", bn("bn1", conv("conv1", x, 64, 7, 2)))             # 64x112x112
    x = add("maxpool", "pool", (64, 56, 56), [x])
    for stage, (blocks, width, stride) in enumerate(((3, 64, 1), (4, 128, 2),
                                                     (6, 256, 2), (3, 512, 2)), start=1):
        for b in range(blocks):
            s = stride if b == 0 else 1
            p = f"layer{stage}.{b}"
            h = relu(p + ".relu1", bn(p + ".bn1", conv(p + ".conv1", x, width, 1, 1)))
            h = relu(p + ".relu2", bn(p + ".bn2", conv(p + ".conv2", h, width, 3, s)))
            h = bn(p + ".bn3", conv(p + ".conv3", h, 4 * width, 1, 1))
            skip = x
            if b == 0:
                skip = bn(p + ".down.bn", conv(p + ".down.conv", x, 4 * width, 1, s))
            x = relu(p + ".relu3", add(p + ".add", "add", layers[h][2], [h, skip]))
    x = add("avgpool", "pool", (2048, 1, 1), [x])
    x = add("fc", "fc", (classes, 1, 1), [x], cin=2048)
    add("loss", "loss", (classes, 1, 1), [x])                           # saved probabilities
    return layers


def resnet50_pattern(batch=32, classes=1000):
    """The allocation events of one training step: ("a", id, nbytes) and ("f", id)."""
    layers = resnet50_layers(batch, classes)
    events, next_id = [], [0]

    def alloc(nbytes):
        i = next_id[0]
        next_id[0] += 1
        events.append(("a", i, int(nbytes)))
        return i

    def free(i):
        events.append(("f", i))

    def nbytes(shape):
        c, h, w = shape
        return batch * c * h * w * 4

    def conv_ws(layer):
        _, _, shape, _, extra = layer
        c, h, w = shape
        return min(batch * extra["cin"] * extra["k"] ** 2 * h * w * 4, WS_CAP)

    out, saved = {}, {}
    for li, layer in enumerate(layers):                                  # forward
        name, kind, shape, inputs, extra = layer
        if kind == "conv":
            free(alloc(conv_ws(layer)))
        out[li] = alloc(nbytes(shape))
        if kind == "bn":
            saved[li] = [alloc(shape[0] * 4), alloc(shape[0] * 4)]
    grad, param_grads = {}, []
    for li in range(len(layers) - 1, 0, -1):                             # backward
        name, kind, shape, inputs, extra = layers[li]
        for x in inputs:
            if x not in grad and layers[x][1] != "data":
                grad[x] = alloc(nbytes(layers[x][2]))
        if kind == "conv":
            param_grads.append(alloc(shape[0] * extra["cin"] * extra["k"] ** 2 * 4))
            free(alloc(conv_ws(layers[li])))                             # dgrad workspace
            free(alloc(conv_ws(layers[li])))                             # wgrad workspace
        elif kind == "bn":
            param_grads += [alloc(shape[0] * 4), alloc(shape[0] * 4)]
            free(alloc(2 * shape[0] * 4))                                # reduction scratch
        elif kind == "fc":
            param_grads += [alloc(shape[0] * extra["cin"] * 4), alloc(shape[0] * 4)]
        if li in grad:
            free(grad.pop(li))
        free(out.pop(li))
        for i in saved.pop(li, ()):
            free(i)
    free(out.pop(0))                                                     # the input batch
    for i in param_grads:                                                # after the update
        free(i)
    assert not out and not grad and not saved
    return layers, events


def pattern_stats(events):
    live = peak = total = 0
    sizes = {}
    for ev in events:
        if ev[0] == "a":
            sizes[ev[1]] = ev[2]
            live += ev[2]
            total += ev[2]
            peak = max(peak, live)
        else:
            live -= sizes[ev[1]]
    assert live == 0
    return {"n_alloc": len(sizes), "n_events": len(events), "peak_live_bytes": peak,
            "total_alloc_bytes": total, "min_bytes": min(sizes.values()),
            "max_bytes": max(sizes.values())}


def compact(events):
    """[(is_alloc, slot, nbytes)] for the replay loops."""
    return [(True, e[1], e[2]) if e[0] == "a" else (False, e[1], 0) for e in events]


# ---------------------------------------------------------------------------- replays
def replay_pool(ops, n, capacity, block_bytes=1024):
    from tinysn.pool import BlockAllocator
    pool = BlockAllocator(capacity, block_bytes)
    slots = [None] * n
    alloc, free = pool.alloc, pool.free
    t0 = time.perf_counter()
    for is_alloc, i, nb in ops:
        if is_alloc:
            slots[i] = alloc(nb)
        else:
            free(slots[i])
    elapsed = time.perf_counter() - t0
    assert pool.in_use == 0 and pool.n_free_nodes == 1
    return elapsed, pool


def replay_loop_only(ops, n):
    """The replay loop with no allocator (its cost is included in every other figure)."""
    slots = [None] * n
    t0 = time.perf_counter()
    for is_alloc, i, nb in ops:
        if is_alloc:
            slots[i] = nb
        else:
            slots[i] = None
    return time.perf_counter() - t0


def pool_layout(ops, n, capacity):
    """Span the first-fit pool touches (highest block end) and its free-run count."""
    from tinysn.pool import BlockAllocator
    pool = BlockAllocator(capacity)
    slots, high, runs, peak = [None] * n, 0, 0, 0
    for is_alloc, i, nb in ops:
        if is_alloc:
            slots[i] = b = pool.alloc(nb)
            high = max(high, b.offset + b.nbytes)
        else:
            pool.free(slots[i])
        runs = max(runs, pool.n_free_nodes)
    return {"pool_peak_bytes": pool.peak, "first_fit_high_water_bytes": high,
            "max_free_runs": runs}


def replay_torch(ops, n, repeats, warmup=2):
    """Replay through torch.empty on cuda; returns per-replay seconds."""
    import torch
    empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda")
    times = []
    for r in range(warmup + repeats):
        slots = [None] * n
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for is_alloc, i, nb in ops:
            if is_alloc:
                slots[i] = empty(nb, dtype=u8, device=dev)
            else:
                slots[i] = None
        torch.cuda.synchronize()
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def child_main(path, repeats):
    """Runs under PYTORCH_NO_CUDA_MEMORY_CACHING=1: every torch.empty is a cudaMalloc."""
    import torch
    with open(path) as f:
        pattern = json.load(f)
    ops = compact(pattern["events"])
    times = replay_torch(ops, pattern["stats"]["n_alloc"], repeats, warmup=1)
    print(json.dumps({"times": times, "caching_disabled":
                      os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                      "device": torch.cuda.get_device_name(0)}))


# ---------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=None,
                    help="measured ResNet-50 step time; default 22 ms (PyTorch eager, batch 32)")
    common.add_out_argument(ap)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--child", metavar="PATTERN_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args.child, args.repeats)

    import torch

    t_start = time.perf_counter()
    step_ms = args.step_ms if args.step_ms is not None else 22.0
    step_src = "measured (--step-ms)" if args.step_ms is not None else "default"
    layers, events = resnet50_pattern(args.batch)
    stats = pattern_stats(events)
    pattern_path = os.path.join(tempfile.mkdtemp(prefix="tinysn-pool-"),
                                f"resnet50_b{args.batch}_alloc_pattern.json")
    with open(pattern_path, "w") as f:
        json.dump({"model": "resnet50", "batch": args.batch, "dtype": "float32",
                   "conv_workspace_cap_bytes": WS_CAP, "stats": stats,
                   "layers": [{"name": l[0], "kind": l[1], "shape": list(l[2])} for l in layers],
                   "events": [list(e) for e in events]}, f, separators=(",", ":"))
    n = stats["n_alloc"]
    ops = compact(events)
    capacity = sum(-(-e[2] // 1024) * 1024 for e in events if e[0] == "a")  # never OOMs

    print(f"ResNet-50 step, batch {args.batch}: {len(layers)} layers, {n} allocations "
          f"({stats['min_bytes']} B .. {stats['max_bytes'] / 2**20:.1f} MiB), "
          f"live peak {stats['peak_live_bytes'] / 2**30:.2f} GiB -> {pattern_path}")

    rows = {}
    # (a) BlockAllocator
    pool_times = [replay_pool(ops, n, capacity)[0] for _ in range(args.repeats)]
    loop_times = [replay_loop_only(ops, n) for _ in range(args.repeats)]
    rows["tinysn BlockAllocator"] = pool_times
    layout = pool_layout(ops, n, capacity)

    cuda = torch.cuda.is_available()
    notes = []
    if cuda:
        # (b) torch caching allocator, in this process
        torch.cuda.reset_peak_memory_stats()
        rows["torch caching allocator"] = replay_torch(ops, n, args.repeats)
        torch_reserved = torch.cuda.max_memory_reserved()
        # (c) cudaMalloc/cudaFree in a child without the cache
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        reps = max(3, args.repeats // 3)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", pattern_path,
                               "--repeats", str(reps)], env=env, capture_output=True,
                              text=True, timeout=120)
        if proc.returncode == 0:
            child = json.loads(proc.stdout.strip().splitlines()[-1])
            assert child["caching_disabled"]
            rows["cudaMalloc/cudaFree (no cache)"] = child["times"]
        else:
            notes.append("cudaMalloc child failed: " + proc.stderr.strip()[-500:])
    else:
        torch_reserved = None
        notes.append("no CUDA device: only (a), the pure-Python BlockAllocator, was measured")

    result_rows = []
    print(f"\n{'allocator':34s} {'us/alloc+free':>14s} {'replay ms':>10s} {'% of step':>10s}")
    for name, times in rows.items():
        med = statistics.median(times)
        row = {"allocator": name, "us_per_pair": med / n * 1e6, "replay_ms": med * 1e3,
               "replay_ms_min": min(times) * 1e3, "pct_of_step": med * 1e3 / step_ms * 100,
               "repeats": len(times)}
        result_rows.append(row)
        print(f"{name:34s} {row['us_per_pair']:14.2f} {row['replay_ms']:10.3f} "
              f"{row['pct_of_step']:9.2f}%")
    loop_us = statistics.median(loop_times) / n * 1e6
    print(f"{'(replay loop alone, in all rows)':34s} {loop_us:14.2f}")
    print(f"\nstep reference: {step_ms} ms ({step_src}); {n} allocations per step")
    print(f"first-fit pool: peak in use {layout['pool_peak_bytes'] / 2**30:.3f} GiB, "
          f"highest byte touched {layout['first_fit_high_water_bytes'] / 2**30:.3f} GiB, "
          f"at most {layout['max_free_runs']} free runs")
    if torch_reserved is not None:
        print(f"torch caching allocator: max reserved {torch_reserved / 2**30:.3f} GiB")
    for note in notes:
        print("note:", note)

    shutil.rmtree(os.path.dirname(pattern_path))
    out = {"benchmark": "pool", "cuda": cuda,
           "batch": args.batch, "step_ms": step_ms, "step_ms_source": step_src,
           "pattern_stats": stats,
           "n_alloc": n, "rows": result_rows, "replay_loop_us_per_pair": loop_us,
           "pool_layout": layout, "torch_max_reserved_bytes": torch_reserved, "notes": notes,
           "wall_s": time.perf_counter() - t_start}
    if common.write(args.out, out):
        print(f"wrote {args.out} ({out['wall_s']:.2f} s)")


if __name__ == "__main__":
    main()
