"""Why a conv pass runs slower inside the training step than in the runtime's rankings.

The runtime ranks each conv shape's algorithms (sched/workspace.py) with plain calls: no
bias, no fused ReLU, no ReLU mask on the data gradient, and the same buffers every call, so
they sit in L2 when they fit. The step runs the conv with those epilogues, on tensors the
layers before it wrote. This script times VGG16's 3x3 shapes at batch 32 both ways, one
difference at a time:

- data gradient ("flipped", "flipped_nhwc"): plain, and with the ReLU mask
  (`relu_output`), as sched/fuse.py runs it where the conv's input is a ReLU's output;
- weight gradient ("splitk", with the bias gradient): warm, and with L2 flushed before each
  call (a 256 MiB write between the timed calls);
- forward ("nhwc", "implicit"): plain, and with bias and the fused ReLU.

    python3 bench/conv_gap.py --out conv-gap-H200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cuda_median_ms, environment  # noqa: E402
from tinysn.kernels import conv  # noqa: E402
from tinysn.kernels._common import bench_ms, compiling_in_parallel  # noqa: E402

SHAPES = [(64, 224), (128, 112), (256, 56), (512, 28), (512, 14)]     # C = K, pixels


def _tensors(c, hw, batch, gen):
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device)
    t = {"x": rand(batch, c, hw, hw), "w": rand(c, c, 3, 3) / 30, "b": rand(c),
         "dy": rand(batch, c, hw, hw)}
    t["relu_out"] = t["x"].clamp(min=0)
    t["y"], t["dx"] = torch.empty_like(t["dy"]), torch.empty_like(t["x"])
    t["dw"], t["db"] = torch.empty_like(t["w"]), torch.empty_like(t["b"])
    return t


def _calls(t):
    """{(phase, algo, variant): call} for one shape, each with its own workspace."""
    shape_x, shape_w = t["x"].shape, t["w"].shape
    calls = {}

    def ws(phase, algo):
        return torch.empty(max(conv.workspace_bytes(shape_x, shape_w, 1, 1, phase, algo), 1),
                           dtype=torch.uint8, device=t["x"].device)
    offered = conv.algos(shape_x, shape_w, 1, 1, "forward")
    for algo in [a for a in ("nhwc", "implicit") if a in offered]:
        space = ws("forward", algo)
        calls[("forward", algo, "plain")] = lambda a=algo, s=space: conv.forward(
            t["x"], t["w"], None, t["y"], stride=1, padding=1, algo=a, workspace=s)
        calls[("forward", algo, "bias+relu")] = lambda a=algo, s=space: conv.forward(
            t["x"], t["w"], t["b"], t["y"], stride=1, padding=1, algo=a, workspace=s,
            relu=True)
    offered = conv.algos(shape_x, shape_w, 1, 1, "backward_data")
    for algo in [a for a in ("flipped_nhwc", "flipped") if a in offered]:
        space = ws("backward_data", algo)
        for variant, mask in (("plain", None), ("relu mask", t["relu_out"])):
            calls[("backward_data", algo, variant)] = lambda a=algo, s=space, m=mask: \
                conv.backward_data(t["dy"], t["w"], t["dx"], stride=1, padding=1, algo=a,
                                   workspace=s, relu_output=m)
    space = ws("backward_weight", "splitk")
    calls[("backward_weight", "splitk", "warm")] = lambda s=space: conv.backward_weight(
        t["x"], t["dy"], t["dw"], t["db"], stride=1, padding=1, algo="splitk", workspace=s)
    return calls


def _cold_ms(fn, flush, reps=20):
    """Median ms of `fn` with L2 flushed (`flush` zeroed) before each call."""
    return cuda_median_ms(fn, iters=reps, warmup=2, before=flush.zero_)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("conv_gap: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for c, hw in SHAPES:
        t = _tensors(c, hw, args.batch, gen)
        calls = _calls(t)
        with compiling_in_parallel():
            for fn in calls.values():
                fn()
        for (phase, algo, variant), fn in calls.items():
            rows.append({"shape": [c, c, hw, 3], "phase": phase, "algo": algo,
                         "variant": variant, "ms": bench_ms(fn)})
            if phase == "backward_weight":
                rows.append({"shape": [c, c, hw, 3], "phase": phase, "algo": algo,
                             "variant": "cold L2", "ms": _cold_ms(fn, flush)})
        for r in rows[-len(calls) - 1:]:
            print(f"{c}@{hw:<4} {r['phase']:16s} {r['algo']:13s} {r['variant']:10s} "
                  f"{r['ms']:7.3f} ms", flush=True)
        del t, calls
    Path(args.out).write_text(json.dumps({"environment": environment(), "batch": args.batch,
                                          "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
