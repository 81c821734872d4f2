"""Every GPU config of the fully connected GEMM, timed on the shapes training runs: which
tile the autotuner should find, and how far the best one is from cuBLAS.

    PYTHONPATH=. python bench/linear_configs.py [--batch 32] [--precision tf32] [--out PATH]
        [--passes dw+db+sgd,...] [--grid]

For each case (VGG16's fc6 and fc7, AlexNet's fc6, ResNet-50's fc) and each pass a training
step can run (forward y = x w^T + b; data gradient dx = dy w; weight gradient dw = dy^T x with
db; and the weight gradient going into the weight's SGD step in the GEMM's epilogue, with db,
as training runs it where the update is fused: momentum 0.9, weight decay 5e-4, the rate
read from memory, gated), every
config of `linear._gemm_kernel`'s GPU list is pinned in turn (`_common.pinned`) and timed as
the autotuner times (`common.gpu_ms`: the GPU's time alone), beside torch's own call (addmm,
mm and sum, and for the fused pass those and torch's SGD arithmetic on the weight in place;
TF32 as `--precision` says). One row per (case, pass, config) in --out: milliseconds, torch's
time over tinysn's, and the pass's bytes over its time (GB/s: the fused step reads and
writes the weight and its momentum, 16 bytes an element, which bounds it); each case and
pass names its fastest config (printed). The reason is VGG16's fc6: K is the batch (32), so
its weight gradient is bound by writing its 411 MB output and its fused step by moving
1.6 GB. `--grid` also pins a grid of one-step tiles (`grid_configs`: tile shape, warps,
pipeline stages, tile order) after the list, which is how the list's thin tile for the fused
step was found; `--passes` times only the passes named. Without CUDA the same code runs on
Triton's interpreter on one small case (a smoke test: its times are the interpreter's).
"""
import argparse
import contextlib
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401  (before triton: interpreter switch when there is no GPU)
import torch  # noqa: E402

from bench import common  # noqa: E402
from tinysn.kernels import _common, linear, sgd  # noqa: E402

CASES = (("vgg16 fc6", 25088, 4096), ("vgg16 fc7", 4096, 4096), ("alexnet fc6", 9216, 4096),
         ("resnet50 fc", 2048, 1000))              # (name, in features, out features)
SMALL = (("small", 64, 48),)                       # the interpreter's smoke case
PASSES = ("forward", "dx", "dw+db", "dw+db+sgd")
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4                 # the fused step's settings (train.py's)
LR = 1e-4                                          # small: the timed steps repeat in place


def operands(batch, f, o, device):
    """x, w, b, dy of one case and the outputs each pass writes (allocated once)."""
    g = torch.Generator().manual_seed(0)
    x, w, b, dy, buf = (torch.randn(*s, generator=g).to(device)
                        for s in ((batch, f), (o, f), (o,), (batch, o), (o, f)))
    return x, w, b, dy, buf, {"y": torch.empty(batch, o, device=device),
                              "dx": torch.empty(batch, f, device=device),
                              "dw": torch.empty(o, f, device=device),
                              "db": torch.empty(o, device=device)}


def pass_bytes(batch, f, o) -> dict:
    """pass -> the bytes it must move at least (float32): its operands read, its outputs
    written; the fused step reads and writes the weight and its momentum."""
    x, w, y = batch * f, o * f, batch * o
    return {"forward": 4 * (x + w + o + y), "dx": 4 * (y + w + x),
            "dw+db": 4 * (y + x + w + o), "dw+db+sgd": 4 * (y + x + 4 * w + o)}


def calls(batch, f, o, device, precision):
    """pass -> (tinysn's call, torch's call) on one case's operands."""
    x, w, b, dy, buf, out = operands(batch, f, o, device)
    rate = torch.full((1,), LR, device=device)
    gate = torch.zeros(1, device=device)             # a good batch: the step is taken
    step = sgd.Update(buf, rate, MOMENTUM, WEIGHT_DECAY, gate)

    def torch_step():                   # torch.optim.SGD's arithmetic on one tensor
        torch.mm(dy.t(), x, out=out["dw"])
        torch.sum(dy, 0, out=out["db"])
        out["dw"].add_(w, alpha=WEIGHT_DECAY)
        buf.mul_(MOMENTUM).add_(out["dw"])
        w.add_(buf, alpha=-LR)
    return {
        "forward": (lambda: linear.forward(x, w, b, out["y"], precision=precision),
                    lambda: torch.addmm(b, x, w.t(), out=out["y"])),
        "dx": (lambda: linear.backward(x, w, dy, out["dx"], None, None, precision=precision),
               lambda: torch.mm(dy, w, out=out["dx"])),
        "dw+db": (lambda: linear.backward(x, None, dy, None, out["dw"], out["db"],
                                          precision=precision),
                  lambda: (torch.mm(dy.t(), x, out=out["dw"]),
                           torch.sum(dy, 0, out=out["db"]))),
        "dw+db+sgd": (lambda: linear.backward(x, w, dy, None, None, out["db"],
                                              precision=precision, update=step),
                      torch_step),
    }


def timer(device):
    """ms of one call: the GPU's time alone on CUDA, one wall-clock call on the CPU."""
    if device.type == "cuda":
        return common.gpu_ms

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return once


def grid_configs() -> list:
    """--grid's configs: 32-deep tiles (one reduction step where K is the batch, 32) over
    rows, columns, warps, stages and order (GROUP_M 1: tiles in row-major order), 8 warps
    only on tiles of at least 64x128."""
    return [linear._cfg(bm, bn, 32, warps, stages, group_m)
            for bm, bn, warps, stages, group_m in itertools.product(
                (16, 32, 64), (64, 128, 256), (4, 8), (1, 2), (1, 8))
            if warps == 4 or bm * bn >= 64 * 128]


@contextlib.contextmanager
def swept_configs(extra):
    """Within the block the GEMM autotuner's GPU list (what `_common.pinned` indexes) is
    its own list followed by `extra`."""
    tuner = linear._gemm_kernel
    saved = tuner.all_configs
    tuner.all_configs = list(saved) + list(extra)
    try:
        yield
    finally:
        tuner.all_configs = saved


def config_text(index: int) -> str:
    c = linear._gemm_kernel.all_configs[index]
    return f"{c.kwargs} w{c.num_warps} s{c.num_stages}"


def sweep(cases, batch, device, precision, passes=PASSES) -> list:
    """One row per (case, pass, config), then per (case, pass) the fastest config."""
    ms = timer(device)
    rows = []
    for name, f, o in cases:
        moved = pass_bytes(batch, f, o)
        for pass_name, (ours, theirs) in calls(batch, f, o, device, precision).items():
            if pass_name not in passes:
                continue
            torch_ms = ms(theirs)
            timed = []
            for i in range(_common.config_count(linear)):
                with _common.pinned(linear, i):
                    ours()                      # compiled and run once before the clock
                    timed.append((ms(ours), i))
                rows.append(row(name, batch, f, o, pass_name, timed[-1][0], torch_ms,
                                moved[pass_name], config=config_text(i)))
            best_ms, best = min(timed)
            rows.append(row(name, batch, f, o, pass_name, best_ms, torch_ms, moved[pass_name],
                            best_config=config_text(best)))
    return rows


def row(name, batch, f, o, pass_name, ms, torch_ms, moved, **config) -> dict:
    return {"case": name, "shape": f"{batch}x{f}->{o}", "pass": pass_name, **config,
            "tinysn_ms": ms, "torch_ms": torch_ms, "ratio": torch_ms / ms,
            "gb_per_s": moved / ms / 1e6}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", choices=("tf32", "ieee"), default="tf32")
    ap.add_argument("--passes", default=",".join(PASSES),
                    help=f"comma-separated, among {', '.join(PASSES)}")
    ap.add_argument("--grid", action="store_true",
                    help="also pin grid_configs() after the GEMM's list")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    passes = args.passes.split(",")
    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        ap.error(f"unknown pass {unknown[0]!r} (passes: {', '.join(PASSES)})")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    with swept_configs(grid_configs() if args.grid else ()):
        rows = sweep(CASES if cuda else SMALL, args.batch, device, args.precision, passes)
        count = _common.config_count(linear)
    for r in (r for r in rows if "best_config" in r):       # every config's row: in --out
        print(f"{r['case']:<12}{r['pass']:<10}{r['tinysn_ms']:9.3f} ms  torch "
              f"{r['torch_ms']:8.3f}  {r['ratio']:5.2f}x {r['gb_per_s']:6.0f} GB/s  best of "
              f"{count}: {r['best_config']}")
    result = {"batch": args.batch, "precision": args.precision, "passes": passes,
              "grid": args.grid, "rows": rows}
    common.write(args.out, result)
    return result


if __name__ == "__main__":
    main()
