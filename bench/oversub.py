"""Throughput beyond the cap: images/s against batch, from batch 32 to the largest batch that
plans under the cap, beside the same batch with nothing moved and PyTorch's ways past its cap.

    PYTHONPATH=. python bench/oversub.py [--models resnet50,vgg16,inception_v4] [--memory 12GiB]
        [--reference 120GiB] [--host-memory 60GiB] [--batches resnet50=897,...] [--first 32]
        [--parts tinysn,pytorch] [--merge] [--out PATH] [--plot PNG]
    PYTHONPATH=. python bench/oversub.py --table bench/results/oversub-*.json   # README rows
    PYTHONPATH=. python bench/oversub.py --from bench/results/oversub-GPU.json --plot PNG

For each model the batches are `--first`, then doubling while below the largest batch, then
the largest: the batch from `--batches name=N` (checked with two plans, as memory.py does) or
sn.max_batch under the cap. At each batch tinysn (policy "all", plain SGD, fed from pinned host
memory) trains under the cap and again under `--reference`, a cap so large that nothing moves;
each is timed by bench/train.py's `timed` (warm-up, then back-to-back steps between two
synchronizations). A row holds:

    images_per_s, no_move_images_per_s   under the cap, under the reference
    fraction                             images_per_s / no_move_images_per_s
    pcie_floor_s                         bytes_to_host / to_host_bandwidth
                                         + bytes_to_device / to_device_bandwidth
    bound_by                             "pcie" when seconds_per_step <= PCIE_BOUND_FACTOR *
                                         pcie_floor_s, else "compute" (the measured step
                                         against the floor; the step-time model's own verdict
                                         is beside it, `model_bound_by`, with its
                                         `predicted_step_s`)

The floor adds the two directions: it is the time the copies take if they do not overlap each
other (they overlap little: copies out happen in the forward pass, copies back in the
backward pass). Bandwidths are the pinned copy rates measured at the start of the run
(memory.copy_bandwidth; on the CPU a plain host copy stands in).

PyTorch, per model, in three configurations: "eager" (the model memory.py measures,
common.torch_model: torchvision's where it has one, else the tinysn graph's torch twin);
"checkpoint" (torch.utils.checkpoint over segments of the twin, `Net.to_torch`, between
single-tensor cut points, about sqrt(cut points) segments); "save_on_cpu" (the eager model
with every tensor saved for backward in pinned host memory, torch.autograd.graph.save_on_cpu).
Each at its largest batch under the same cap, counted as memory.py counts it (every device
byte of the process, memory.capped, batches fed from pinned host memory), searched up to the
model's largest tinysn batch; a batch whose pinned host bytes (measured, or projected from the
last batch that ran) exceed `--host-memory` does not fit either. Then its images/s there.
On the CPU nothing caps the device, so the search reaches its limit (`cap_enforced` false).

Every configuration runs in its own try: an out-of-memory or a refusal is recorded in its row,
and the rest still run; each releases its memory before the next (common.release_memory).
The JSON goes to --out after every configuration, so a time limit keeps what was done.
"""
import argparse
import math
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

from bench import common, memory, train  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402

PYTORCH_CONFIGS = ("eager", "checkpoint", "save_on_cpu")
PARTS = ("tinysn", "pytorch")
PCIE_BOUND_FACTOR = 1.5     # a step within 1.5x of its copy floor is bound by PCIe
TIMED_STEP_DOWNS = 5        # batches tried below PyTorch's probed largest when timing fails
SGD = {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0}   # plain SGD, as memory.py


class HostCapExceeded(Exception):
    """A PyTorch configuration needs more pinned host memory than --host-memory."""


def ladder(first: int, largest: int) -> list:
    """`first`, doubling while below `largest`, then `largest` (just `largest` when it is
    not above `first`)."""
    batches, b = [], first
    while b < largest:
        batches.append(b)
        b *= 2
    return batches + [largest]


# ---------------------------------------------------------------------- PyTorch's twins
def cut_points(twin) -> list:
    """Indices i in the twin's layer order (up to the logits) after which exactly one value,
    layer i's output, is still needed: where a sequential segment can end."""
    end = next(i for i, (name, _, _) in enumerate(twin.plan) if name == twin.logits_name)
    cuts, live = [], set()
    for i, (name, _, ins) in enumerate(twin.plan[:end + 1]):
        live = {n for n in live | {name} if twin._last_use.get(n, -1) > i}
        if live <= {name} or i == end:
            cuts.append(i)
    return cuts


def segments(twin, count=None) -> list:
    """The twin's layers up to the logits in `count` (default about the square root of the
    stretches between cut points) consecutive segments of similar layer counts, each a range
    of layer indices whose only input is the previous segment's output: each segment ends at
    the cut point nearest its share of the layers."""
    cuts = cut_points(twin)
    count = count or max(1, round(math.sqrt(len(cuts) - 1)))
    last = cuts[-1]
    ends = sorted({min(cuts[1:], key=lambda c: abs(c - last * (k + 1) / count))
                   for k in range(count)})
    starts = [1] + [e + 1 for e in ends[:-1]]
    return [range(s, e + 1) for s, e in zip(starts, ends)]


class Checkpointed(nn.Module):
    """The twin with torch.utils.checkpoint around each segment (`segments`): only segment
    inputs are kept through the forward pass; each segment runs again in the backward."""

    def __init__(self, twin, count=None):
        super().__init__()
        self.twin = twin
        self.parts = segments(twin, count)

    def run(self, layers, x):
        plan = self.twin.plan
        values = {plan[layers[0] - 1][0]: x}
        for i in layers:
            name, _, ins = plan[i]
            values[name] = self.twin._layer_modules[name](*(values[n] for n in ins))
        return values[plan[layers[-1]][0]]

    def forward(self, images):
        x = self.twin._layer_modules[self.twin.plan[0][0]](images)
        for layers in self.parts:
            x = torch.utils.checkpoint.checkpoint(self.run, layers, x, use_reentrant=False)
        return x


class SavedOnHost(nn.Module):
    """A model with every tensor its forward saves for backward held in host memory
    (torch.autograd.graph.save_on_cpu, pinned when there is a GPU to copy back to)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return self.model(images)


def torch_module(config: str, net, model_name: str):
    """(module, source) of one configuration, on the CPU: "eager" and "save_on_cpu" wrap
    the model memory.py measures (common.torch_model: torchvision's where it has one),
    "checkpoint" the tinysn graph's torch twin, whose layer order gives the segments."""
    if config == "checkpoint":
        return Checkpointed(net.to_torch()), "tinysn graph's torch twin"
    model, source = common.torch_model(model_name, net)
    return (SavedOnHost(model) if config == "save_on_cpu" else model), source


def host_peak_bytes():
    """Pinned host bytes torch's host allocator held at most since the last reset (None
    without CUDA)."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.host_memory_stats()
    return stats.get("allocated_bytes.peak", stats.get("allocated_bytes.all.peak"))


def pytorch_run(net, model_name, config, cap, device, warmup, steps, host_cap=None):
    """Train `config`'s module of `net` under `cap` (memory.capped): train.timed's figures,
    the process peak and the pinned host peak; None when it runs out of device memory."""
    train.reset_peak(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_host_memory_stats()
    with memory.capped(cap):
        try:
            model, source = torch_module(config, net, model_name)
            model = model.to(device).train()
            opt = torch.optim.SGD(model.parameters(), **SGD)
            step = train.torch_step(model, opt, train.host_batch(net, device), device,
                                    torch.contiguous_format)
            row = {**train.timed(step, device, warmup, steps), "source": source}
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            model = opt = step = None
    row["host_peak_bytes"] = host_peak_bytes()
    if host_cap is not None and (row["host_peak_bytes"] or 0) > host_cap:
        raise HostCapExceeded(f"{row['host_peak_bytes']:,} B pinned > {host_cap:,} B")
    return row


def pytorch_largest(model_name, config, cap, device, limit, host_cap, timing) -> dict:
    """The largest batch (at most `limit`) at which `config` of the model trains under `cap`
    (pytorch_run), then its images/s there (`timing`: warmup, steps). Each probe runs two
    steps; a batch whose pinned host bytes, projected linearly from the largest batch that
    ran, exceed `host_cap` is not tried. Where the timed run at that batch runs out of
    memory (the probe's two steps fit, the timed steps did not: torch.utils.checkpoint's
    ResNet-50 at 207 under 12 GiB), the batch steps down by 2% at a time, up to
    TIMED_STEP_DOWNS times; `largest` is then the batch that was timed and `probed` the
    search's."""
    model_fn, per_image = MODELS[model_name], [0.0]

    def fits(k):
        if host_cap is not None and per_image[0] * k > host_cap:
            return False
        t0, verdict = time.perf_counter(), "out of device memory"
        try:
            row = pytorch_run(model_fn(batch=k), model_name, config, cap, device, 1, 1,
                              host_cap)
        except HostCapExceeded:
            row, verdict = None, "over the host cap"
        if row is not None:
            per_image[0] = max(per_image[0], (row["host_peak_bytes"] or 0) / k)
            verdict = "fits"
        print(f"  {model_name} {config} at batch {k}: {verdict} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        return row is not None
    t0 = time.perf_counter()
    k = memory.largest(fits, start=max(1, limit // 8), limit=limit)
    out = {"largest": k, "limit": limit, "at_limit": k == limit,
           "cap_enforced": device.type == "cuda", "search_s": time.perf_counter() - t0}
    row, tries = None, 0
    while k and not row and tries <= TIMED_STEP_DOWNS:
        row = pytorch_run(model_fn(batch=k), model_name, config, cap, device, *timing)
        if not row:
            failed, k, tries = k, k - max(1, k // 50), tries + 1
    if row:
        if k != out["largest"]:
            out.update(probed=out["largest"], largest=k, at_limit=False)
        out.update(row, images_per_s=k / row["ms_per_step"] * 1e3)
    elif out["largest"]:     # the probe found a batch, but no timed run fit at or below it
        out["error"] = f"out of device memory when timed at batch {failed} and below"
    return out


# ---------------------------------------------------------------------- tinysn's curve
def pcie_floor_s(bytes_to_host: int, bytes_to_device: int, bandwidth: dict) -> float:
    """Seconds the step's copies take at the measured pinned bandwidth, the two directions
    one after the other (module docstring)."""
    return (bytes_to_host / (bandwidth["to_host_gb_per_s"] * 1e9)
            + bytes_to_device / (bandwidth["to_device_gb_per_s"] * 1e9))


def bound_by(seconds_per_step: float, floor_s: float) -> str:
    """What bounds a measured step: "pcie" when it is within PCIE_BOUND_FACTOR of its copy
    floor, else "compute" (the kernels and the host that launches them)."""
    return "pcie" if floor_s > 0 and seconds_per_step <= PCIE_BOUND_FACTOR * floor_s \
        else "compute"


def tinysn_point(net, cap, device, args):
    """train.tinysn_row for policy "all", eager, plain SGD under `cap` (or its failure)."""
    run_args = SimpleNamespace(memory=cap, warmup=args.warmup, steps=args.steps, rounds=1,
                               fuse_bn_relu=sn.plan.__kwdefaults__["fuse_bn_relu"],
                               fuse_add_relu=sn.plan.__kwdefaults__["fuse_add_relu"],
                               fuse_bn_add=sn.plan.__kwdefaults__["fuse_bn_add"],
                               group_updates=sn.plan.__kwdefaults__["group_updates"],
                               fuse_updates=sn.plan.__kwdefaults__["fuse_updates"],
                               store_argmaxes=args.store_argmaxes, **SGD)
    return train.guarded(lambda: train.tinysn_row(net, "all", False, device, run_args,
                                                  host_memory=args.host_memory))


def curve_row(model, batch, capped, reference, bandwidth) -> dict:
    """One point of the curve from the capped and the reference run (module docstring)."""
    row = {"model": model, "batch": batch}
    if "ms_per_step" not in capped:
        return {**row, "error": capped.get("error") or capped.get("refused")}
    step_s = capped["ms_per_step"] / 1e3
    floor = pcie_floor_s(capped["bytes_to_host"], capped["bytes_to_device"], bandwidth)
    row.update(images_per_s=batch / step_s, seconds_per_step=step_s,
               pcie_floor_s=floor, bound_by=bound_by(step_s, floor),
               predicted_step_s=capped["predicted_step_s"],
               model_bound_by=capped["model_bound_by"],
               predicted_compute_waits_s=capped["predicted_compute_waits_s"],
               recomputed_steps=capped["recomputed_steps"],
               speed_centric_everywhere=capped["speed_centric_everywhere"],
               bytes_moved_per_step=capped["bytes_moved_per_step"],
               bytes_to_host=capped["bytes_to_host"], bytes_to_device=capped["bytes_to_device"],
               process_peak_bytes=capped["process_peak_bytes"],
               peak_bytes=capped["peak_bytes"], peak_equals_plan=capped["peak_equals_plan"],
               setup_s=capped["setup_s"], losses=capped["losses"],
               in_place_gradients=capped["in_place_gradients"],
               keep_pools=capped["keep_pools"],
               evict_by_next_use=capped["evict_by_next_use"],
               rebuild_joins=capped["rebuild_joins"], rebuilt_joins=capped["rebuilt_joins"],
               fuse_relu=capped["fuse_relu"], fuse_bn_relu=capped["fuse_bn_relu"],
               fuse_add_relu=capped["fuse_add_relu"], fuse_bn_add=capped["fuse_bn_add"],
               group_updates=capped["group_updates"],
               fuse_updates=capped["fuse_updates"],
               store_argmaxes=capped["store_argmaxes"],
               batch_staged=capped["batch_staged"],
               trade_budget=capped["trade_budget"],
               launch_probe_s=capped["device_model"]["launch_probe_s"],
               timed_launch_probe_s=capped["timed_launch_probe_s"],
               no_move_images_per_s=None, fraction=None)
    if "ms_per_step" in reference:
        no_move = batch / reference["ms_per_step"] * 1e3
        row.update(no_move_images_per_s=no_move, fraction=row["images_per_s"] / no_move,
                   no_move_bytes_moved=reference["bytes_moved_per_step"])
    else:
        row["no_move_error"] = reference.get("error") or reference.get("refused")
    return row


def model_largest(name, args, cap) -> int:
    """The model's largest batch under the cap: --batches (checked) or sn.max_batch."""
    fn = MODELS[name]
    kw = dict(store_argmaxes=args.store_argmaxes)
    if name in args.given:
        return memory.checked_largest(fn, args.given[name], cap, args.host_memory, **kw)
    return sn.max_batch(fn, cap, "all", host_memory=args.host_memory, **kw)


def run_model(name, largest, args, device, bandwidth, result, save) -> None:
    """The curve up to `largest` and the PyTorch configurations of one model into `result`,
    saved after each configuration."""
    cap, reference = sn.parse_bytes(args.memory), sn.parse_bytes(args.reference)
    host_cap = args.host_memory and sn.parse_bytes(args.host_memory)
    print(f"{name}: largest batch {largest} under {args.memory}", flush=True)
    fn = MODELS[name]
    if "tinysn" in args.parts:
        for batch in args.only or ladder(args.first, largest):
            capped = tinysn_point(fn(batch=batch), cap, device, args)
            row = curve_row(name, batch, capped, tinysn_point(fn(batch=batch), reference,
                                                              device, args), bandwidth)
            result["rows"].append(row)
            result["rows"].sort(key=lambda r: (r["model"], r["batch"]))
            print(describe(row), flush=True)
            save()
    if "pytorch" in args.parts:
        for config in args.pytorch_configs:
            row = train.guarded(lambda c=config: pytorch_largest(
                name, c, cap, device, largest, host_cap, (args.warmup, args.steps)),
                model=name, config=config)
            result["pytorch"].append(row)
            print(describe(row), flush=True)
            save()


def describe(row) -> str:
    """One printed line per configuration."""
    if "config" in row:
        head = f"  PyTorch {row['config']}: largest {row.get('largest')}"
    else:
        head = f"  batch {row['batch']}"
    if "images_per_s" not in row:
        return f"{head}: {row.get('error') or row.get('refused') or 'nothing fits'}"
    if "config" in row:
        return f"{head}, {row['images_per_s']:.1f} images/s"
    frac = "-" if row["fraction"] is None else f"{row['fraction']:.0%}"
    return (f"{head}: {row['images_per_s']:.1f} images/s, no move "
            f"{row['no_move_images_per_s'] or 0:.1f} ({frac}), moved "
            f"{row['bytes_moved_per_step'] / 1e9:.2f} GB, floor {row['pcie_floor_s']:.3f} s, "
            f"{row['bound_by']}, peak == plan {row['peak_equals_plan']}")


# ---------------------------------------------------------------------- outputs
def table_rows(result: dict) -> list:
    """bench/README.md's rows for one result: a row per tinysn batch, then per PyTorch
    configuration (configuration, batch, images/s, no-move images/s, fraction, GB moved per
    step, PCIe floor, bound by)."""
    lines = []
    for r in result.get("rows", []):
        if "images_per_s" not in r:
            lines.append(f"| {r['model']}, tinysn \"all\" | {r['batch']} | failed: "
                         f"{r['error']} | | | | | |")
            continue
        no_move = "-" if r["no_move_images_per_s"] is None else \
            f"{r['no_move_images_per_s']:,.1f}"
        frac = "-" if r["fraction"] is None else f"{r['fraction']:.0%}"
        lines.append(f"| {r['model']}, tinysn \"all\" | {r['batch']} | {r['images_per_s']:,.1f} "
                     f"| {no_move} | {frac} | {r['bytes_moved_per_step'] / 1e9:.1f} GB | "
                     f"{r['pcie_floor_s']:.2f} s | {r['bound_by']} |")
    for r in result.get("pytorch", []):
        name = f"{r['model']}, PyTorch {r['config']}"
        if "images_per_s" not in r:
            why = r.get("error") or r.get("refused") or "nothing fits"
            lines.append(f"| {name} | {r.get('largest', '-')} | failed: {why} | | | | | |")
            continue
        lines.append(f"| {name} | {r['largest']} | {r['images_per_s']:,.1f} | | | | | |")
    return lines


def print_tables(paths) -> None:
    """`oversub.py --table FILE...`: print the README rows of result files."""
    for path in paths:
        if not os.path.exists(path):
            raise SystemExit(f"--table: no such file {path!r}")
        print("\n".join(table_rows(common.read(path))))


def plot(result: dict, path: str) -> None:
    """images/s against batch per model: tinysn under the cap and with nothing moved as
    lines, each PyTorch configuration as a point at its largest batch (the shape of the
    paper's Fig. 14)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"] + result["pytorch"]))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model and "images_per_s" in r]
        for key, label, style in (("images_per_s", f'tinysn "all", {result["memory"]}', "o-"),
                                  ("no_move_images_per_s", "tinysn, nothing moved", "s--")):
            points = [(r["batch"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), style, label=label)
        for r in result["pytorch"]:
            if r["model"] == model and "images_per_s" in r:
                ax.plot([r["largest"]], [r["images_per_s"]], "^", markersize=9,
                        label=f"PyTorch {r['config']}")
        ax.set(title=model, xlabel="batch", ylabel="images/s", xscale="log")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- command line
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,vgg16,inception_v4")
    ap.add_argument("--memory", default="12GiB", help="the device cap")
    ap.add_argument("--reference", default="120GiB", help="a cap under which nothing moves")
    ap.add_argument("--host-memory", default=None, help="cap on pinned host memory")
    ap.add_argument("--batches", default="", help="name=N,...: a model's largest batch "
                    "(checked: N plans and N+1 does not), else sn.max_batch")
    ap.add_argument("--first", type=int, default=32, help="the curve's first batch")
    ap.add_argument("--only", default="", metavar="B,...",
                    help="run just these batches of the curve (e.g. twice PyTorch's largest); "
                         "with --merge the model's rows at other batches stay")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--store-argmaxes", action=argparse.BooleanOptionalAction,
                    default=sn.plan.__kwdefaults__["store_argmaxes"],
                    help="max pools store their argmaxes where the net fits unmoved (default: "
                         "the planner's, on); --no-store-argmaxes finds them again")
    ap.add_argument("--parts", default=",".join(PARTS), help="tinysn, pytorch or both")
    ap.add_argument("--pytorch-configs", default=",".join(PYTORCH_CONFIGS))
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows already in --out of other models or parts")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the curve to PNG")
    ap.add_argument("--from", dest="source", default=None, metavar="JSON",
                    help="with --plot: draw a results file's curve and run nothing")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    check_args(ap, args)
    return args


def check_args(ap, args) -> None:
    """Every argument checked before anything runs; one line naming the bad one."""
    args.models = [m for m in args.models.split(",") if m]
    args.parts = [p for p in args.parts.split(",") if p]
    args.pytorch_configs = [c for c in args.pytorch_configs.split(",") if c]
    for what, given, known in (("--models", args.models, MODELS), ("--parts", args.parts, PARTS),
                               ("--pytorch-configs", args.pytorch_configs, PYTORCH_CONFIGS)):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            ap.error(f"{what}: unknown or empty {unknown or given}; known: {', '.join(known)}")
    caps = {}
    for opt in ("memory", "reference", "host_memory"):
        value = getattr(args, opt)
        try:
            caps[opt] = value and sn.parse_bytes(value)
        except ValueError as err:
            ap.error(f"--{opt.replace('_', '-')}: {err}")
    if caps["reference"] <= caps["memory"]:
        ap.error(f"--reference ({args.reference}) must be above --memory ({args.memory})")
    try:
        args.only = sorted({int(b) for b in args.only.split(",") if b})
    except ValueError:
        ap.error(f"--only: comma-separated batches, got {args.only!r}")
    if args.only and args.only[0] < 1:
        ap.error(f"--only: batches must be at least 1, got {args.only[0]}")
    if min(args.first, args.steps, args.warmup) < 1:
        ap.error(f"--first, --steps and --warmup must be at least 1, got "
                 f"{args.first}, {args.steps}, {args.warmup}")
    if args.plot is not None and not args.plot.endswith(".png"):
        ap.error(f"--plot must name a .png file, got {args.plot!r}")
    if args.source is not None and (args.plot is None or not os.path.exists(args.source)):
        ap.error(f"--from needs --plot and an existing results file, got {args.source!r}")
    if args.merge and not args.out:
        ap.error("--merge needs --out (the file whose rows it keeps)")
    try:
        args.given = memory.parse_batches(args.batches)
    except SystemExit as err:
        ap.error(str(err))


def copy_rates(device) -> dict:
    """Pinned host <-> device GB/s (memory.copy_bandwidth); on the CPU, a host copy's rate
    for both directions, so the floor stays defined."""
    if device.type == "cuda":
        return {**memory.copy_bandwidth(), "measured": "pinned copies"}
    src, dst = torch.ones(1 << 24, dtype=torch.uint8), torch.empty(1 << 24, dtype=torch.uint8)
    t0 = time.perf_counter()
    dst.copy_(src)
    rate = src.numel() / (time.perf_counter() - t0) / 1e9
    return {"to_host_gb_per_s": rate, "to_device_gb_per_s": rate,
            "measured": "host copy (no GPU)"}


def kept(args) -> dict:
    """With --merge, the rows of the --out file that this run does not redo: other models'
    and parts' rows, and with --only the model's curve rows at other batches. ("rows" are
    the tinysn part's, "pytorch" the pytorch part's, of which only the configurations in
    --pytorch-configs are redone.)"""
    old = common.read(args.out) if args.merge else {}
    def redone(key, row):
        part = "tinysn" if key == "rows" else "pytorch"
        if row["model"] not in args.models or part not in args.parts:
            return False
        if part == "pytorch":
            return row["config"] in args.pytorch_configs
        return not args.only or row["batch"] in args.only
    return {key: [r for r in old.get(key, []) if not redone(key, r)]
            for key in ("rows", "pytorch")}


def main(argv=None) -> dict:
    if argv is None and sys.argv[1:2] == ["--table"]:
        return print_tables(sys.argv[2:])
    args = parse_args(argv)
    if args.source:
        plot(common.read(args.source), args.plot)
        return print(f"drew {args.plot}")
    cap = sn.parse_bytes(args.memory)
    largest = {name: model_largest(name, args, cap) for name in args.models}  # checks --batches
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    bandwidth = copy_rates(device)
    print("copies:", {k: v if isinstance(v, str) else round(v, 1)
                      for k, v in bandwidth.items()}, flush=True)
    result = {"memory": args.memory, "reference": args.reference,
              "host_memory": args.host_memory, "first": args.first, "steps": args.steps,
              "warmup": args.warmup, "sgd": SGD, "pcie_bound_factor": PCIE_BOUND_FACTOR,
              "copy_bandwidth": bandwidth, **kept(args)}

    def save():
        common.write(args.out, result)
    for name in args.models:
        run_model(name, largest[name], args, device, bandwidth, result, save)
    if args.plot:
        plot(result, args.plot)
        print(f"drew {args.plot}")
    if args.out:
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
