"""Every GPU config of the fully connected GEMM, timed on the shapes training runs: which
tile the autotuner should find, and how far the best one is from cuBLAS.

    PYTHONPATH=. python bench/linear_configs.py [--batch 32] [--precision tf32] [--out PATH]

For each case (VGG16's fc6 and fc7, ResNet-50's fc) and each pass a training step runs
(forward y = x w^T + b; data gradient dx = dy w; weight gradient dw = dy^T x with db), every
config of `linear._gemm_kernel`'s GPU list is pinned in turn (`_common.pinned`) and timed as
the autotuner times (`common.gpu_ms`: the GPU's time alone), beside torch's own call (addmm,
mm and sum; TF32 as `--precision` says). One row per (case, pass, config) in --out:
milliseconds and torch's time over tinysn's; each case and pass names its fastest config
(printed). The reason is
VGG16's fc6 weight gradient: K is the batch (32), so it is bound by writing its 411 MB
output, which cuBLAS does in 0.14 ms, while the autotuner's pick took 0.43 ms in the
tracked kernel table. Without CUDA the same code runs on Triton's interpreter on one small
case (a smoke test: its times are the interpreter's).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401  (before triton: interpreter switch when there is no GPU)
import torch  # noqa: E402

from bench import common  # noqa: E402
from tinysn.kernels import _common, linear  # noqa: E402

CASES = (("vgg16 fc6", 25088, 4096), ("vgg16 fc7", 4096, 4096),
         ("resnet50 fc", 2048, 1000))              # (name, in features, out features)
SMALL = (("small", 64, 48),)                       # the interpreter's smoke case
PASSES = ("forward", "dx", "dw+db")


def operands(batch, f, o, device):
    """x, w, b, dy of one case and the outputs each pass writes (allocated once)."""
    g = torch.Generator().manual_seed(0)
    x, w, b, dy = (torch.randn(*s, generator=g).to(device)
                   for s in ((batch, f), (o, f), (o,), (batch, o)))
    return x, w, b, dy, {"y": torch.empty(batch, o, device=device),
                         "dx": torch.empty(batch, f, device=device),
                         "dw": torch.empty(o, f, device=device),
                         "db": torch.empty(o, device=device)}


def calls(batch, f, o, device, precision):
    """pass -> (tinysn's call, torch's call) on one case's operands."""
    x, w, b, dy, out = operands(batch, f, o, device)
    return {
        "forward": (lambda: linear.forward(x, w, b, out["y"], precision=precision),
                    lambda: torch.addmm(b, x, w.t(), out=out["y"])),
        "dx": (lambda: linear.backward(x, w, dy, out["dx"], None, None, precision=precision),
               lambda: torch.mm(dy, w, out=out["dx"])),
        "dw+db": (lambda: linear.backward(x, None, dy, None, out["dw"], out["db"],
                                          precision=precision),
                  lambda: (torch.mm(dy.t(), x, out=out["dw"]),
                           torch.sum(dy, 0, out=out["db"]))),
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


def config_text(index: int) -> str:
    c = linear._gemm_kernel.all_configs[index]
    return f"{c.kwargs} w{c.num_warps} s{c.num_stages}"


def sweep(cases, batch, device, precision) -> list:
    """One row per (case, pass, config), then per (case, pass) the fastest config."""
    ms = timer(device)
    rows = []
    for name, f, o in cases:
        for pass_name, (ours, theirs) in calls(batch, f, o, device, precision).items():
            torch_ms = ms(theirs)
            timed = []
            for i in range(_common.config_count(linear)):
                with _common.pinned(linear, i):
                    ours()                      # compiled and run once before the clock
                    timed.append((ms(ours), i))
                rows.append({"case": name, "shape": f"{batch}x{f}->{o}", "pass": pass_name,
                             "config": config_text(i), "tinysn_ms": timed[-1][0],
                             "torch_ms": torch_ms, "ratio": torch_ms / timed[-1][0]})
            best_ms, best = min(timed)
            rows.append({"case": name, "shape": f"{batch}x{f}->{o}", "pass": pass_name,
                         "best_config": config_text(best), "tinysn_ms": best_ms,
                         "torch_ms": torch_ms, "ratio": torch_ms / best_ms})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", choices=("tf32", "ieee"), default="tf32")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    rows = sweep(CASES if cuda else SMALL, args.batch, device, args.precision)
    for r in (r for r in rows if "best_config" in r):       # every config's row: in --out
        print(f"{r['case']:<12}{r['pass']:<8}{r['tinysn_ms']:9.3f} ms  torch {r['torch_ms']:8.3f}"
              f"  {r['ratio']:5.2f}x  best of {_common.config_count(linear)}: "
              f"{r['best_config']}")
    result = {"batch": args.batch, "precision": args.precision, "rows": rows}
    common.write(args.out, result)
    return result


if __name__ == "__main__":
    main()
