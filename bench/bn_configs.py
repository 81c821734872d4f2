"""Batch norm's block-shape constants swept over every batch-norm shape of a net at one batch.

    PYTHONPATH=. python3 bench/bn_configs.py [--model resnet50] [--batch 32] [--out PATH]
        [--tiles 1024,2048,4096] [--warps 4,8] [--programs 1024,2048,4096]
        [--min-chunks 4096,8192] [--last-first 0,1] [--channel-max 0,8192,32768]
        [--channel-programs 128,256]

kernels/bn.py takes every block shape from the tensor's shape alone, through four module
constants (_TILE: elements per tile of the streaming passes; _WARPS; _TARGET_PROGRAMS: the
partial-sum programs over all channels; _MIN_CHUNK: elements a chunk holds at least), so that
the summation order, and with it every bit, never depends on timing. A fifth, _LAST_FIRST,
orders the elementwise passes' programs (last channels first, where the pass before left
them in the L2 cache; 1, the default sweep's only value) and changes no bit. _CHANNEL_MAX
and _CHANNEL_PROGRAMS pick the shapes that run one launch each way, a program per channel
(channels of at most _CHANNEL_MAX values, at least _CHANNEL_PROGRAMS of them; 0: none;
today's values are the default sweep's only ones), instead of three. Which constants are
fastest is the GPU's to say: for each combination this script times, on every distinct
batch-norm input shape of the model (with how many times a step runs it), the forward pass
(statistics, merge, normalisation: three launches) and the backward pass (partial sums,
merge, dx), each the GPU time alone (`common.gpu_ms`, as the runtime's rankings time), and
sums them as a step runs them. The fastest combination by that sum is the pick. Each row
records the bytes a single pass must read and write (forward 2x, backward 3x the input) per
its time and, beside them, `copy_gbps`: torch's device-to-device copy in the same run.
Every combination's outputs are checked against torch's batch norm first (relative error of
y, dx, dgamma, dbeta: a combination whose figures are wrong is never picked).

On a CPU it is a smoke run (Triton's interpreter; wall clock, so it times the interpreter).
"""
import argparse
import collections
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402  (before triton: the interpreter switch where no GPU)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench import common  # noqa: E402
from tinysn.kernels import bn  # noqa: E402

CONSTANTS = ("_TILE", "_WARPS", "_TARGET_PROGRAMS", "_MIN_CHUNK", "_LAST_FIRST", "_CHANNEL_MAX",
             "_CHANNEL_PROGRAMS")
MAX_REL_ERR = 1e-4          # float32 batch norm against torch's: a wrong kernel is far above


def bn_shapes(model: str, batch: int) -> list:
    """[(input shape, times a step runs it)] of the model's batch norms, largest first."""
    net = getattr(sn.models, model)(batch=batch)
    counts = collections.Counter(tuple(layer.shape) for layer in net.layers if layer.op == "bn")
    return sorted(counts.items(), key=lambda item: -item[0][1] * item[0][2] * item[0][3])


def set_constants(combo: dict) -> dict:
    """Set kernels/bn.py's constants to `combo`; return the values they had."""
    before = {name: getattr(bn, name) for name in CONSTANTS}
    for name, value in combo.items():
        setattr(bn, name, value)
    bn._chunks.cache_clear()            # memoized on the shape, from the old constants
    return before


class Case:
    """One shape's tensors and its two passes, with torch's reference."""

    def __init__(self, shape, device):
        g = torch.Generator(device=device).manual_seed(0)
        c = shape[1]
        self.x, self.dy = (torch.randn(shape, device=device, generator=g) for _ in range(2))
        self.gamma = torch.rand(c, device=device, generator=g) + 0.5
        self.beta = torch.randn(c, device=device, generator=g)
        self.rm, self.rv = torch.zeros(c, device=device), torch.ones(c, device=device)
        self.y, self.dx = torch.empty_like(self.x), torch.empty_like(self.x)
        self.saved = torch.empty(2, c, device=device)
        self.dgamma, self.dbeta = torch.empty(c, device=device), torch.empty(c, device=device)
        self.ws = {phase: torch.empty(bn.workspace_bytes(shape, phase), dtype=torch.uint8,
                                      device=device) for phase in ("forward", "backward")}

    def forward(self):
        bn.forward(self.x, self.gamma, self.beta, self.y, self.rm, self.rv, self.saved,
                   self.ws["forward"])

    def backward(self):
        bn.backward(self.x, self.gamma, self.dy, self.saved, self.dx, self.dgamma, self.dbeta,
                    self.ws["backward"])

    def rel_err(self) -> float:
        """The largest relative error of y, dx, dgamma and dbeta against torch's."""
        self.forward()
        self.backward()
        x = self.x.detach().double().requires_grad_()
        g = self.gamma.double().requires_grad_()
        b = self.beta.double().requires_grad_()
        y = F.batch_norm(x, None, None, g, b, training=True, eps=1e-5)
        y.backward(self.dy.double())
        return max(common.rel_err(self.y, y), common.rel_err(self.dx, x.grad),
                   common.rel_err(self.dgamma, g.grad), common.rel_err(self.dbeta, b.grad))


def time_ms(fn, device) -> float:
    """GPU time alone on a GPU; on the CPU the median of three wall-clock calls."""
    if device.type == "cuda":
        return common.gpu_ms(fn)
    walls = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - start) * 1e3)
    return sorted(walls)[1]


def measure(combo: dict, shapes, device) -> dict:
    """One combination: each shape's forward and backward ms and error, and the step's sum."""
    before = set_constants(combo)
    try:
        rows = [_shape_row(shape, count, device) for shape, count in shapes]
    finally:
        set_constants(before)
    total = sum(r["count"] * (r["forward_ms"] + r["backward_ms"]) for r in rows)
    ok = all(r["rel_err"] <= MAX_REL_ERR for r in rows)
    return {"constants": combo, "step_ms": total if ok else float("inf"), "correct": ok,
            "shapes": rows}


def _shape_row(shape, count, device) -> dict:
    case = Case(shape, device)
    nbytes = case.x.numel() * 4
    fwd, bwd = time_ms(case.forward, device), time_ms(case.backward, device)
    return {"shape": list(shape), "count": count, "rel_err": case.rel_err(),
            "forward_ms": fwd, "backward_ms": bwd,
            "forward_gbps": 2 * nbytes / fwd * 1e-6, "backward_gbps": 3 * nbytes / bwd * 1e-6}


def _ints(text: str) -> list:
    return [int(v) for v in text.split(",")]


def _flags(text: str) -> list:
    """'0,1' -> [False, True]."""
    values = _ints(text)
    if any(v not in (0, 1) for v in values):
        raise argparse.ArgumentTypeError(f"expected 0s and 1s, got {text!r}")
    return [bool(v) for v in values]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tiles", type=_ints, default=[1024, 2048, 4096])
    ap.add_argument("--warps", type=_ints, default=[4, 8])
    ap.add_argument("--programs", type=_ints, default=[1024, 2048, 4096])
    ap.add_argument("--min-chunks", type=_ints, default=[4096, 8192])
    ap.add_argument("--last-first", type=_flags, default=[True])
    ap.add_argument("--channel-max", type=_ints, default=[bn._CHANNEL_MAX])
    ap.add_argument("--channel-programs", type=_ints, default=[bn._CHANNEL_PROGRAMS])
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    if not hasattr(sn.models, args.model):
        ap.error(f"--model: no model {args.model!r} in tinysn.models")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = bn_shapes(args.model, args.batch)
    today = {name: getattr(bn, name) for name in CONSTANTS}
    combos = [dict(zip(CONSTANTS, values)) for values in
              itertools.product(args.tiles, args.warps, args.programs, args.min_chunks,
                                args.last_first, args.channel_max, args.channel_programs)]
    result = {"model": args.model, "batch": args.batch, "today": today,
              "copy_gbps": common.copy_gbps(device) if device.type == "cuda" else None,
              "rows": []}
    for combo in combos:
        row = measure(combo, shapes, device)
        result["rows"].append(row)
        print(f"{combo}: {row['step_ms']:.3f} ms a step" + ("" if row["correct"] else
                                                              " (wrong figures)"), flush=True)
        common.write(args.out, result)      # so far: a run cut short keeps what it measured
    best = min(result["rows"], key=lambda r: r["step_ms"])
    mine = next((r for r in result["rows"] if r["constants"] == today), None)
    result["pick"] = best["constants"]
    print(f"pick {best['constants']}: {best['step_ms']:.3f} ms a step"
          + (f"; today's {mine['step_ms']:.3f}" if mine else ""))
    common.write(args.out, result)
    return result


if __name__ == "__main__":
    main()
