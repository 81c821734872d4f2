"""Which tile configs the conv autotuners should time: a wide sweep on VGG16 / ResNet-50 shapes.

    PYTHONPATH=. python bench/conv_configs.py --out conv-configs.json     # on a GPU

For 17 conv shapes at batch 32 (every VGG16 3x3 size, ResNet-50's 3x3 and 1x1 sizes), times
the forward kernel (also the "flipped" data gradient of a stride-1 conv) and the split-K
weight-gradient kernel under every candidate config (today's lists plus wider and deeper
tiles), median of triton's do_bench, beside cuDNN's time for the same direction. Then picks
greedily the 8 forward / 4 weight-gradient configs whose best-per-shape total time is
smallest, first the best single config (what TINYSN_AUTOTUNE=0 runs). `_FWD_CONFIGS` and
`_WGT_CONFIGS` in tinysn/kernels/conv.py are that pick. Every candidate is compiled first in
parallel (about 30 s for 680 variants on 16 cores), then timed (about 30 s).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401
import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench import common  # noqa: E402
from tinysn.kernels import _common, conv  # noqa: E402

cfg = conv._cfg
BATCH = 32
# (C, K, H=W, R=S), stride 1, padding R // 2
SHAPES = [
    (64, 64, 224, 3), (128, 128, 112, 3), (256, 256, 56, 3), (512, 512, 28, 3), (512, 512, 14, 3),
    (64, 64, 56, 3), (128, 128, 28, 3), (256, 256, 14, 3), (512, 512, 7, 3), (64, 256, 56, 1),
    (256, 64, 56, 1), (1024, 256, 14, 1), (256, 1024, 14, 1), (2048, 512, 7, 1),
    (512, 2048, 7, 1), (128, 512, 28, 1), (512, 128, 28, 1),
]
EXTRA_FWD = [
    cfg(128, 128, 32, 4, 4), cfg(128, 128, 32, 8, 4), cfg(128, 128, 64, 8, 3),
    cfg(128, 128, 64, 4, 3), cfg(128, 256, 32, 8, 4), cfg(256, 128, 32, 8, 4),
    cfg(256, 128, 32, 8, 3), cfg(256, 64, 32, 8, 4), cfg(64, 256, 32, 8, 4), cfg(128, 64, 64, 4, 4),
    cfg(64, 128, 64, 4, 4), cfg(128, 128, 16, 8, 5), cfg(128, 64, 32, 4, 5),
    cfg(128, 128, 32, 8, 4, False), cfg(256, 128, 32, 8, 4, False), cfg(128, 256, 32, 8, 4, False),
    cfg(128, 64, 32, 4, 3), cfg(64, 64, 64, 4, 4), cfg(128, 128, 32, 8, 3, False),
    cfg(64, 64, 32, 4, 4, False), cfg(128, 128, 32, 8, 3), cfg(128, 64, 32, 4, 4, False),
]
EXTRA_WGT = [
    cfg(128, 128, 64, 8, 3), cfg(64, 128, 64, 4, 3), cfg(128, 64, 64, 4, 3), cfg(64, 64, 128, 4, 3),
    cfg(128, 128, 32, 4, 4), cfg(64, 128, 32, 4, 4), cfg(128, 128, 32, 8, 4), cfg(64, 64, 64, 4, 4),
    cfg(128, 64, 32, 4, 3), cfg(128, 256, 32, 8, 3), cfg(64, 64, 64, 4, 3), cfg(128, 64, 32, 4, 4),
    cfg(128, 128, 32, 8, 3),
]
SMEM_BYTES = 200 * 1024   # what a config's pipeline stages may hold (H200: 227 KiB per SM)


def fits(c) -> bool:
    """The config's operand tiles, times its stages, fit in shared memory."""
    k = c.kwargs
    return (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * 4 * c.num_stages <= SMEM_BYTES


def candidates(today, extra) -> list:
    """Today's configs, then the extra ones that fit and are not among them."""
    seen = {str(c) for c in today}
    out = list(today)
    for c in extra:
        if fits(c) and str(c) not in seen:
            seen.add(str(c))
            out.append(c)
    return out


class ForcedConfig:
    """Stands in for conv's `_launch`: runs an autotuned kernel with `self.config`, or,
    inside `compiling_in_parallel`, compiles it under every candidate of its tuner."""

    def __init__(self, by_tuner):
        self.by_tuner, self.config = by_tuner, None

    def __call__(self, tuner, grid, args, kwargs):
        if _common._COMPILE_ONLY:
            for c in self.by_tuner[id(tuner)]:
                tuner.fn.warmup(*args, grid=grid(c.kwargs), **kwargs, **c.all_kwargs())
            return
        tuner.fn[grid(self.config.kwargs)](*args, **kwargs, **self.config.all_kwargs())


def problem(c, k, hw, r):
    """(tinysn forward, tinysn split-K weight gradient, cuDNN forward, cuDNN weight
    gradient) for one shape, on random inputs."""
    pad = r // 2
    x = torch.randn(BATCH, c, hw, hw, device="cuda")
    w = torch.randn(k, c, r, r, device="cuda") * 0.05
    y = torch.empty(BATCH, k, hw, hw, device="cuda")
    dy = torch.randn_like(y)
    dw = torch.empty_like(w)
    ws = torch.empty(conv.workspace_bytes(x.shape, w.shape, 1, pad, "backward_weight", "splitk")
                     // 4 + 1, device="cuda")
    return (lambda: conv.forward(x, w, None, y, stride=1, padding=pad),
            lambda: conv.backward_weight(x, dy, dw, None, stride=1, padding=pad, algo="splitk",
                                         workspace=ws),
            lambda: torch.nn.functional.conv2d(x, w, None, 1, pad),
            lambda: torch.ops.aten.convolution_backward(
                dy, x, w, None, (1, 1), (pad, pad), (1, 1), False, (0, 0), 1,
                (False, True, False)))


def greedy(rows, count) -> list:
    """Indices of `count` configs, each added where it lowers the total of the per-shape best
    times the most (the first: the best single config)."""
    chosen = []
    for _ in range(count):
        total = lambda i: sum(min(r["ms"][j] for j in chosen + [i]) for r in rows)  # noqa: E731
        chosen.append(min((i for i in range(len(rows[0]["ms"])) if i not in chosen), key=total))
    return chosen


def time_phase(forced, fn, cands) -> list:
    out = []
    for c in cands:
        forced.config = c
        try:
            out.append(do_bench(fn, warmup=5, rep=25, return_mode="median"))
        except Exception as err:   # a config that fails to launch is never picked
            print(f"  {c}: {type(err).__name__}: {str(err)[:80]}")
            out.append(float("inf"))
    return out


def main():
    ap = argparse.ArgumentParser()
    common.add_out_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/conv_configs.py needs a CUDA GPU")
        return 1
    torch.backends.cudnn.allow_tf32 = True
    phases = {"forward": candidates(conv._FWD_CONFIGS, EXTRA_FWD),
              "backward_weight": candidates(conv._WGT_CONFIGS, EXTRA_WGT)}
    forced = ForcedConfig({id(conv._conv_fwd): phases["forward"],
                           id(conv._conv_bwd_weight): phases["backward_weight"]})
    conv._launch = forced
    problems = [problem(*s) for s in SHAPES]
    started = time.perf_counter()
    with _common.compiling_in_parallel():
        for fwd, wgt, _, _ in problems:
            fwd()
            wgt()
    print(f"compiled in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for shape, (fwd, wgt, cudnn_fwd, cudnn_wgt) in zip(SHAPES, problems):
        for phase, fn, ref in (("forward", fwd, cudnn_fwd), ("backward_weight", wgt, cudnn_wgt)):
            ms = time_phase(forced, fn, phases[phase])
            today = len(conv._FWD_CONFIGS if phase == "forward" else conv._WGT_CONFIGS)
            rows.append({"shape": list(shape), "phase": phase, "ms": ms, "today_ms": min(ms[:today]),
                         "cudnn_ms": do_bench(ref, warmup=5, rep=25, return_mode="median")})
            r = rows[-1]
            print(f"{str(shape):<20} {phase:<16} cuDNN {r['cudnn_ms']:.4f} ms, today's best "
                  f"{r['today_ms']:.4f} ({r['cudnn_ms'] / r['today_ms']:.2f}x), best "
                  f"{min(ms):.4f} ({r['cudnn_ms'] / min(ms):.2f}x)", flush=True)
    picks = {}
    for phase, count in (("forward", 8), ("backward_weight", 4)):
        of_phase = [r for r in rows if r["phase"] == phase]
        pick = greedy(of_phase, count)
        picks[phase] = [str(phases[phase][i]) for i in pick]
        print(f"{phase}: pick total {sum(min(r['ms'][i] for i in pick) for r in of_phase):.3f} ms, "
              f"today's {sum(r['today_ms'] for r in of_phase):.3f} ms, cuDNN "
              f"{sum(r['cudnn_ms'] for r in of_phase):.3f} ms")
        for c in picks[phase]:
            print(f"  {c}")
    common.write(args.out, {"batch": BATCH, "candidates": {p: [str(c) for c in cs]
                                                           for p, cs in phases.items()},
                            "rows": rows, "picks": picks})
    return 0


if __name__ == "__main__":
    sys.exit(main())
