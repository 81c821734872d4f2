"""Conv kernels (every algorithm of every phase) against cuDNN through torch, ResNet-50 shapes.

    PYTHONPATH=. python bench/kernels_conv.py [--phases forward,backward_data] [--shapes 0,2]
                                               [--batch 32] [--out PATH] [--warm]

bench(device="cuda") -> list of rows {"kernel": "conv.<phase>", "algo", "shape", "tinysn_ms",
"torch_ms", "ratio" (torch_ms / tinysn_ms), "tflops" (2*N*K*P*Q*C*R*S / tinysn time),
"torch_tflops", "rel_err" (against torch's own TF32 result), "config" (the autotuner's pick)}.
torch: F.conv2d (with bias) for forward, torch.nn.grad.conv2d_input / conv2d_weight (cuDNN
backward data / filter) for the backward pieces; tinysn's backward_weight runs without db so
both sides do the same work. TF32 on both sides. Times: GPU-time medians (common.gpu_ms,
as the runtime's rankings time; warm-up 25 ms, 100 ms of calls), everything allocated
outside the timed function.
--warm only compiles and autotunes (used to fill Triton's cache from parallel processes).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401  (before triton: interpreter switch when there is no GPU)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench import common  # noqa: E402
from tinysn.kernels import conv  # noqa: E402

# (name, C, H, W, K, R, S, stride, padding) -- ResNet-50 layers
SHAPES = [
    ("7x7/2 3->64 @224", 3, 224, 224, 64, 7, 7, 2, 3),
    ("1x1 64->64 @56", 64, 56, 56, 64, 1, 1, 1, 0),
    ("3x3 64->64 @56", 64, 56, 56, 64, 3, 3, 1, 1),
    ("1x1 64->256 @56", 64, 56, 56, 256, 1, 1, 1, 0),
    ("3x3 128->128 @28", 128, 28, 28, 128, 3, 3, 1, 1),
    ("3x3 256->256 @14", 256, 14, 14, 256, 3, 3, 1, 1),
    ("3x3 512->512 @7", 512, 7, 7, 512, 3, 3, 1, 1),
    ("1x1 1024->256 @14", 1024, 14, 14, 256, 1, 1, 1, 0),
]
PHASES = ("forward", "backward_data", "backward_weight")
_TUNED = {"forward": "_conv_fwd", "backward_data": "_conv_bwd_data",
          "backward_weight": "_conv_bwd_weight"}
# (phase, algorithm) pairs whose GEMM runs under an autotuner other than the phase's
_TUNED_ALGO = {("backward_data", "transposed"): "_conv_bwd_data_t",
               ("backward_data", "flipped"): "_conv_fwd", ("forward", "nhwc"): "_conv_nhwc",
               ("backward_data", "flipped_splitk"): "_conv_fwd",
               ("backward_data", "flipped_nhwc"): "_conv_nhwc",
               ("backward_weight", "nhwc"): "_conv_bwd_weight_nhwc",
               ("backward_weight", "tma"): "_conv_bwd_weight_tma"}


_do_bench, _rel = common.gpu_ms, common.rel_err


def _tuning(phase, algo):
    """The autotuner's pick and the timings of every config it tried (if it benchmarked)."""
    kern = getattr(conv, _TUNED_ALGO.get((phase, algo), _TUNED[phase]))
    best = getattr(kern, "best_config", None)
    timings = getattr(kern, "configs_timings", None) or {}
    tried = {str(c.kwargs) + f" w{c.num_warps} s{c.num_stages}":
             (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
    return (str(best.kwargs) + f" w{best.num_warps} s{best.num_stages}") if best else None, tried


def bench(device="cuda", batch=32, shapes=None, phases=PHASES, precision="tf32", warm=False,
          log=print):
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for idx, (name, c, h, w, k, r, s, st, pd) in enumerate(SHAPES):
        if shapes is not None and idx not in shapes:
            continue
        n = batch
        gen = torch.Generator(device=device).manual_seed(idx)
        x = torch.randn(n, c, h, w, device=device, generator=gen)
        wt = torch.randn(k, c, r, s, device=device, generator=gen) * (1.0 / (c * r * s) ** 0.5)
        b = torch.randn(k, device=device, generator=gen)
        _, _, p, q = conv.out_shape(x.shape, wt.shape, st, pd)
        dy = torch.randn(n, k, p, q, device=device, generator=gen)
        y = torch.empty(n, k, p, q, device=device)
        dx = torch.empty_like(x)
        dw = torch.empty_like(wt)
        flops = 2 * n * k * p * q * c * r * s
        for phase in phases:
            def torch_fn():
                if phase == "forward":
                    return F.conv2d(x, wt, b, st, pd)
                if phase == "backward_data":
                    return torch.nn.grad.conv2d_input(x.shape, wt, dy, st, pd)
                return torch.nn.grad.conv2d_weight(x, wt.shape, dy, st, pd)

            out = {"forward": y, "backward_data": dx, "backward_weight": dw}[phase]
            ref = torch_fn()
            torch_ms = None if warm else _do_bench(torch_fn)
            for algo in conv._ALGOS[phase]:
                if algo not in conv.algos(x.shape, wt.shape, st, pd, phase) and \
                        algo != "zero_insert":
                    continue        # not offered for this shape (zero_insert runs: a padded dY)
                need = conv.workspace_bytes(x.shape, wt.shape, st, pd, phase, algo)
                ws = torch.empty(max(need, 4), dtype=torch.uint8, device=device)

                kw = dict(stride=st, padding=pd, algo=algo, workspace=ws, precision=precision)

                def fn():   # tinysn's backward_weight without db: the same work as torch's
                    if phase == "forward":
                        conv.forward(x, wt, b, y, **kw)
                    elif phase == "backward_data":
                        conv.backward_data(dy, wt, dx, **kw)
                    else:
                        conv.backward_weight(x, dy, dw, None, **kw)

                row = {"kernel": f"conv.{phase}", "algo": algo, "shape": f"{name} b{n}",
                       "workspace_bytes": need, "flops": flops}
                try:
                    t0 = time.time()
                    out.fill_(float("nan"))
                    fn()
                    if x.is_cuda:
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.time() - t0, 2)
                    row["config"], row["tune_ms"] = _tuning(phase, algo)
                    row["rel_err"] = _rel(out, ref)
                    if not warm:
                        ms = _do_bench(fn)
                        row.update(tinysn_ms=ms, torch_ms=torch_ms, ratio=torch_ms / ms,
                                   tflops=flops / ms * 1e-9, torch_tflops=flops / torch_ms * 1e-9)
                except Exception as e:  # keep going: one failure should not hide the rest
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                rows.append(row)
                log(_fmt(row))
            del ref
    return rows


def _fmt(row):
    if "error" in row:
        return f"{row['kernel']:<21}{row['algo']:<12}{row['shape']:<24} ERROR {row['error'][:200]}"
    if "tinysn_ms" not in row:
        return f"{row['kernel']:<21}{row['algo']:<12}{row['shape']:<24} warm " \
               f"{row['first_call_s']}s err {row['rel_err']:.1e} {row['config']}"
    return (f"{row['kernel']:<21}{row['algo']:<12}{row['shape']:<24}"
            f"{row['tinysn_ms']:9.3f}{row['torch_ms']:9.3f}{row['ratio']:7.2f}"
            f"{row['tflops']:8.1f}{row['torch_tflops']:8.1f}  {row['rel_err']:.1e}  "
            f"{row['config']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="tf32")
    common.add_out_argument(ap)
    ap.add_argument("--warm", action="store_true")
    a = ap.parse_args()
    shapes = None if a.shapes is None else [int(i) for i in a.shapes.split(",")]
    phases = tuple(a.phases.split(","))
    print(f"{'kernel':<21}{'algo':<12}{'shape':<24}{'tinysn':>9}{'torch':>9}{'ratio':>7}"
          f"{'TFLOP/s':>8}{'torch':>8}  rel_err  config", flush=True)
    rows = bench("cuda", a.batch, shapes, phases, a.precision, a.warm,
                 log=lambda s: print(s, flush=True))
    if a.warm:
        return
    path = common.write(a.out, {"batch": a.batch, "precision": a.precision, "rows": rows})
    print(f"\nwrote {path}\n" if path else "")
    print(f"{'kernel':<21}{'algo':<12}{'shape':<24}{'tinysn':>9}{'torch':>9}{'ratio':>7}"
          f"{'TFLOP/s':>8}")
    for row in rows:
        if "tinysn_ms" in row:
            print(f"{row['kernel']:<21}{row['algo']:<12}{row['shape']:<24}"
                  f"{row['tinysn_ms']:9.3f}{row['torch_ms']:9.3f}{row['ratio']:7.2f}"
                  f"{row['tflops']:8.1f}")
        else:
            print(_fmt(row))


if __name__ == "__main__":
    main()
