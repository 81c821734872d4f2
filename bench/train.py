"""Training speed at an ordinary batch: tinysn beside the best PyTorch configuration.

    PYTHONPATH=. python bench/train.py --model resnet50 [--batch 32] [--out PATH]
    PYTHONPATH=. python bench/train.py --table bench/results/train-*.json   # bench/README rows
    PYTHONPATH=. python bench/train.py --summary FILE...  # README's table: a row per model

Every configuration runs in this one process and is timed the same way: `--warmup` steps,
then `--rounds` rounds of `--steps` back-to-back training steps, each round between two
synchronizations and timed by wall clock; images/s = batch * steps / the median round's span
(the rounds' spread says how far two figures must differ to mean something). Each step takes
its batch from host memory (pinned CPU tensors), as a data loader hands it over, and each row
records `process_peak_bytes`: `torch.cuda.max_memory_allocated()` from a reset before its
model or Runtime is built to the end of its steps (the whole process counted, on both sides).

PyTorch trains the tinysn graph's torch twin (`Net.to_torch()`: the same layers and initial
parameters) with torch.optim.SGD (the same lr, momentum and weight decay), TF32 on for cuDNN
and matmuls and cudnn.benchmark on, in three configurations: eager NCHW, eager channels-last
and torch.compile (default mode). The fastest is the reference a user would pick.
tinysn runs `Runtime` with its default (autotuned) kernels for each policy in `--policies`,
eagerly and with the step replayed as a CUDA graph; a refused configuration (graph mode for a
net with dropout) records the reason. Its process peak includes the arena, which is the
whole cap; `peak_bytes` is what the pool used.

The results go to --out after every configuration, so a time limit keeps the rows done; the
ratio of each tinysn row is to the best PyTorch configuration measured so far. Without CUDA
the same code runs on the CPU (Triton's interpreter) as a smoke test; torch.compile is
skipped there, and the JSON says so.
"""
import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import common  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402
from tinysn.sched import recompute  # noqa: E402
from tinysn.sched.timing import host_launch_s, measure_launch_s, simulate  # noqa: E402

PYTORCH_CONFIGS = ("eager NCHW", "eager channels-last", "torch.compile")


class Refused(Exception):
    """tinysn declined a configuration (e.g. graph mode for a net with dropout)."""


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, device, warmup: int, steps: int, rounds: int = 1) -> dict:
    """Run `step` warmup + rounds * steps times; time each round of `steps` as one wall-clock
    span between synchronizations. Returns the median span (`seconds`) and its ms per step,
    each round's ms per step, every loss, the seconds Python's garbage collector ran inside
    the spans (`gc_s`) and the process's device memory peak since the caller reset it
    (before building the model or the Runtime).

    Before the timed steps every object alive is moved out of the collector's reach
    (`gc.freeze`): a configuration that follows torch.compile in the same process would
    otherwise pay for full collections over compile's millions of objects, in whichever
    configuration's steps they happen to fall."""
    t0 = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    sync(device)
    warmup_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()
    spans = []
    with GcClock() as collector:
        for _ in range(rounds):
            t0 = time.perf_counter()
            losses += [step() for _ in range(steps)]
            sync(device)
            spans.append(time.perf_counter() - t0)
    gc.unfreeze()
    span = statistics.median(spans)
    return {"warmup_s": warmup_s, "seconds": span, "ms_per_step": span / steps * 1e3,
            "round_ms_per_step": [t / steps * 1e3 for t in spans],
            "gc_s": collector.seconds, "losses": [float(x) for x in losses],
            "process_peak_bytes": (torch.cuda.max_memory_allocated()
                                   if device.type == "cuda" else None)}


class GcClock:
    """Seconds the garbage collector runs while the block runs (gc.callbacks)."""

    def __enter__(self):
        self.seconds, self._start = 0.0, None
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start


def host_batch(net, device):
    """The synthetic batch in host memory (pinned when there is a GPU to copy it to)."""
    images, labels = sn.data.synthetic(net, seed=0)
    if device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    return images, labels


def reset_peak(device) -> None:
    """Start a row's process peak: cached blocks handed back, torch's peak statistics reset."""
    common.release_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def pytorch_row(net, config, device, args) -> dict:
    """Time one PyTorch configuration of the net's torch twin."""
    reset_peak(device)
    step = config_step(net, config, device, dict(lr=args.lr, momentum=args.momentum,
                                                 weight_decay=args.weight_decay))
    return timed(step, device, args.warmup, args.steps, args.rounds)


def set_up_torch() -> None:
    """PyTorch as a user after speed sets it up: TF32 in cuDNN and cuBLAS (tinysn's kernels
    run TF32 too), cuDNN's own algorithm search. Every script that times or profiles a PyTorch
    step calls this, so their figures compare alike."""
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True


def config_step(net, config, device, sgd: dict):
    """The training step of PyTorch `config` (one of PYTORCH_CONFIGS) on the net's torch
    twin, with SGD settings `sgd`, as a function (torch_step)."""
    fmt = torch.channels_last if config == "eager channels-last" else torch.contiguous_format
    model = net.to_torch().to(device).train().to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), **sgd)
    forward = torch.compile(model) if config == "torch.compile" else model
    return torch_step(forward, opt, host_batch(net, device), device, fmt)


def torch_step(forward, opt, batch, device, fmt):
    """One PyTorch training step as a function: the host batch copied in (in `fmt`), the
    loss, backward, SGD; it returns the loss (a device tensor: no synchronization)."""
    images, labels = batch

    def step():
        x = images.to(device, non_blocking=True).contiguous(memory_format=fmt)
        y = labels.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def host_model(model, probe_s):
    """The runtime's device model on the host as a probe found it (`probe_s`, None: as
    it is): the host's time per eager layer step follows the host, which on the lent
    machines speeds up or slows down by up to 1.6x within seconds (bench/README.md)."""
    if probe_s is None:
        return model
    return dataclasses.replace(model, launch_s=host_launch_s(probe_s), launch_probe_s=probe_s)


def tinysn_row(net, policy, cuda_graph, device, args, host_memory=None) -> dict:
    """Time tinysn's Runtime under `policy` (and `host_memory`, the pinned host arena's cap),
    eagerly or replaying the step as a CUDA graph; beside the measured step, the plan's
    bytes moved each way and the step-time model's prediction for it (sched/timing.py),
    eager on a GPU with the host's speed probed before and after the timed steps
    (`timed_launch_probe_s`, their mean), as the plan's own probe was taken seconds to
    minutes before."""
    reset_peak(device)
    t0 = time.perf_counter()
    try:
        rt = sn.Runtime(net, args.memory, policy, device=device, lr=args.lr,
                        momentum=args.momentum, weight_decay=args.weight_decay,
                        cuda_graph=cuda_graph, host_memory=host_memory,
                        fuse_bn_relu=args.fuse_bn_relu, fuse_add_relu=args.fuse_add_relu,
                        fuse_bn_add=args.fuse_bn_add, group_updates=args.group_updates,
                        fuse_updates=args.fuse_updates, store_argmaxes=args.store_argmaxes)
    except ValueError as err:
        raise Refused(str(err)) from None
    setup_s = time.perf_counter() - t0
    images, labels = host_batch(net, device)
    probed = device.type == "cuda" and not cuda_graph
    before = measure_launch_s(device) if probed else None
    row = timed(lambda: rt.step(images, labels), device, args.warmup, args.steps, args.rounds)
    probe = (before + measure_launch_s(device)) / 2 if probed else None
    timeline = simulate(rt.plan, host_model(rt.plan.device_model, probe))
    row.update(setup_s=setup_s, timed_launch_probe_s=probe, peak_bytes=rt.stats.peak_bytes,
               planned_peak_bytes=rt.plan.peak_bytes,
               peak_equals_plan=rt.stats.peak_bytes == rt.plan.peak_bytes,
               bytes_moved_per_step=rt.plan.bytes_to_host + rt.plan.bytes_to_device,
               bytes_to_host=rt.plan.bytes_to_host, bytes_to_device=rt.plan.bytes_to_device,
               predicted_step_s=timeline.step_s, model_bound_by=timeline.bound_by,
               predicted_compute_waits_s=timeline.compute_waits(),
               recomputed_steps=rt.plan.recomputed_steps,
               speed_centric_everywhere=recompute.speed_everywhere(rt.plan.drops),
               device_model=rt.plan.device_model.record(),
               in_place_gradients=sn.plan.__kwdefaults__["in_place_gradients"],
               keep_pools=sn.plan.__kwdefaults__["keep_pools"],
               evict_by_next_use=sn.plan.__kwdefaults__["evict_by_next_use"],
               rebuild_joins=sn.plan.__kwdefaults__["rebuild_joins"],
               fuse_relu=sn.plan.__kwdefaults__["fuse_relu"],
               fuse_bn_relu=args.fuse_bn_relu, fuse_add_relu=args.fuse_add_relu,
               fuse_bn_add=args.fuse_bn_add, group_updates=args.group_updates,
               fuse_updates=args.fuse_updates, store_argmaxes=args.store_argmaxes,
               batch_staged=rt.batch_staged,
               channels_last=sn.plan.__kwdefaults__["channels_last"],
               channels_last_outputs=sorted(rt.plan.channels_last),
               rebuilt_joins=rt.plan.rebuilt_joins,
               trade_budget=sn.plan.__kwdefaults__["trade_budget"],
               conv_algos=sorted({f"{p}:{a}" for d in rt.plan.conv_algos.values()
                                  for p, a in d.items()}))
    return row


def guarded(run, **labels) -> dict:
    """Run one configuration; a refusal or a failure becomes the row's reason, so one
    configuration cannot hide the others' figures."""
    try:
        row = run()
    except Refused as err:
        return {**labels, "refused": str(err)[:500]}
    except Exception as err:  # noqa: BLE001  (recorded, the others still run)
        return {**labels, "error": f"{type(err).__name__}: {err}"[:500]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {**labels, **row}


def with_rates(result: dict, batch: int) -> dict:
    """Fill in images/s, the best PyTorch configuration and each tinysn row's ratio to it."""
    for row in result["pytorch"] + result["tinysn"]:
        if "seconds" in row:
            row["images_per_s"] = batch / row["ms_per_step"] * 1e3
    done = [r for r in result["pytorch"] if "images_per_s" in r]
    best = max(done, key=lambda r: r["images_per_s"], default=None)
    result["pytorch_best"] = best and best["config"]
    result["pytorch_best_images_per_s"] = best and best["images_per_s"]
    for row in result["tinysn"]:
        if best and "images_per_s" in row:
            row["ratio_to_best"] = row["images_per_s"] / best["images_per_s"]
    return result


def label(row: dict, model: str = "") -> str:
    """A configuration's name: "PyTorch eager NCHW", 'tinysn "all", CUDA graph', ...; with
    `model`, prefixed by it (the first cell of its row in bench/README.md's table)."""
    if "config" in row:
        name = f"PyTorch {row['config']}"
    else:
        name = f'tinysn "{row["policy"]}", ' + ("CUDA graph" if row["cuda_graph"] else "eager")
        name += ", batch norms' ReLUs apart" if row.get("fuse_bn_relu") is False else ""
        name += ", adds' ReLUs apart" if row.get("fuse_add_relu") is False else ""
        name += ", batch norms apart from adds" if row.get("fuse_bn_add") is False else ""
        name += ", each layer's SGD update apart" if row.get("group_updates") is False else ""
        name += ", fc weights stepped apart" if row.get("fuse_updates") is False else ""
        name += ", max pools' argmaxes found again" if row.get("store_argmaxes") is False \
            else ""
        # a measured row without the field ran before sched/staging.py
        name += ", batch copied at the step's start" if "ms_per_step" in row \
            and "batch_staged" not in row else ""
    return f"{model}, {name}" if model else name


def describe(row: dict) -> str:
    """One printed line per configuration."""
    if "images_per_s" not in row:
        return f"{label(row):>32}: {row.get('refused') or row.get('error')}"
    ratio = f" ({row['ratio_to_best']:.2f}x best)" if "ratio_to_best" in row else ""
    mem = row["process_peak_bytes"]
    return (f"{label(row):>32}: {row['images_per_s']:8.1f} images/s{ratio}, "
            f"{row['ms_per_step']:.2f} ms/step, process peak "
            f"{'-' if mem is None else f'{mem / 2**30:.2f} GiB'}")


def table_rows(result: dict) -> list:
    """bench/README.md's training-table rows for one result: configuration, images/s, ratio
    to the best PyTorch configuration, ms per step, memory (the pool's peak for tinysn, torch's
    process peak for PyTorch)."""
    best = result["pytorch_best_images_per_s"]
    rows = []
    for row in result["pytorch"] + result["tinysn"]:
        name = label(row, result["model"])
        if "images_per_s" not in row:
            why = "refused" if "refused" in row else "failed"
            reason = row.get("refused") or row.get("error")
            rows.append(f"| {name} | {why} | | | {reason} |")
            continue
        allocated = row.get("process_peak_bytes")
        memory = (f"pool peak {row['peak_bytes']:,} B" if "peak_bytes" in row else
                  "-" if allocated is None else f"{allocated:,} B allocated")
        rows.append(f"| {name} | {row['images_per_s']:,.0f} | "
                    f"{row['images_per_s'] / best:.2f}x | {row['ms_per_step']:.1f} | {memory} |")
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--memory", default=None,
                    help="tinysn's device cap, its arena (default: 40GiB on a GPU, 1GiB on CPU)")
    ap.add_argument("--policies", default="all", help="tinysn policies, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5,
                    help="timed rounds per configuration (ms per step: their median)")
    ap.add_argument("--warmup", type=int, default=sn.runtime.GRAPH_WARMUP + 1,
                    help="untimed steps first (compiles, tunes, captures)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--fuse-bn-relu", action=argparse.BooleanOptionalAction,
                    default=sn.plan.__kwdefaults__["fuse_bn_relu"],
                    help="tinysn plans with each ReLU after a batch norm fused into it "
                         "(default: the planner's, on); --no-fuse-bn-relu plans them apart")
    ap.add_argument("--fuse-add-relu", action=argparse.BooleanOptionalAction,
                    default=sn.plan.__kwdefaults__["fuse_add_relu"],
                    help="tinysn plans with each ReLU after a residual add fused into it "
                         "where the net fits unmoved (default: the planner's, on); "
                         "--no-fuse-add-relu plans them apart")
    ap.add_argument("--fuse-bn-add", action=argparse.BooleanOptionalAction,
                    default=sn.plan.__kwdefaults__["fuse_bn_add"],
                    help="tinysn plans each batch norm read by a residual add alone fused "
                         "into the add where the adds' ReLUs are (default: the planner's, "
                         "on); --no-fuse-bn-add plans them apart")
    ap.add_argument("--group-updates", action=argparse.BooleanOptionalAction,
                    default=sn.plan.__kwdefaults__["group_updates"],
                    help="tinysn updates each batch norm's parameters in the SGD launch of "
                         "the next layer's where the net fits unmoved (default: the "
                         "planner's, on); --no-group-updates gives each layer its own")
    ap.add_argument("--fuse-updates", action=argparse.BooleanOptionalAction,
                    default=sn.plan.__kwdefaults__["fuse_updates"],
                    help="tinysn steps each fc weight in its weight-gradient GEMM, its "
                         "gradient never stored (default: the planner's, on); "
                         "--no-fuse-updates stores it for the SGD kernel")
    ap.add_argument("--store-argmaxes", action=argparse.BooleanOptionalAction,
                    default=sn.plan.__kwdefaults__["store_argmaxes"],
                    help="tinysn's max pools store their argmaxes in the forward pass where "
                         "the net fits unmoved (default: the planner's, on); "
                         "--no-store-argmaxes finds them again in the backward")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    args.memory = args.memory or ("40GiB" if torch.cuda.is_available() else "1GiB")
    if min(args.steps, args.batch, args.rounds) < 1:
        ap.error(f"--steps, --batch and --rounds must be at least 1, got {args.steps}, "
                 f"{args.batch} and {args.rounds}")
    if torch.cuda.is_available() and args.warmup < sn.runtime.GRAPH_WARMUP + 1:
        ap.error(f"--warmup must be at least {sn.runtime.GRAPH_WARMUP + 1} on a GPU, so "
                 f"the graphed rows time replays only; got {args.warmup}")
    for policy in args.policies.split(","):
        if policy not in sn.sched.plan.POLICIES:
            ap.error(f"--policies: unknown policy {policy!r}; "
                     f"known: {', '.join(sn.sched.plan.POLICIES)}")
    return args


def main(argv=None) -> dict:
    if argv is None and sys.argv[1:2] == ["--table"]:
        return print_tables(sys.argv[2:])
    if argv is None and sys.argv[1:2] == ["--summary"]:
        return print("\n".join(summary_rows([common.read(path) for path in sys.argv[2:]])))
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    set_up_torch()
    net = MODELS[args.model](batch=args.batch)
    skip_compile = args.no_compile or not cuda
    result = {"model": args.model, "batch": args.batch, "steps": args.steps,
              "rounds": args.rounds, "warmup": args.warmup,
              "timer": "wall clock over each round of steps, synchronized; the median round",
              "sgd": {"lr": args.lr, "momentum": args.momentum,
                      "weight_decay": args.weight_decay},
              "torch_compile": "skipped" + (" (--no-compile)" if args.no_compile else
                                            " (no CUDA: too slow on the CPU)")
              if skip_compile else "default mode",
              "autotune": os.environ.get("TINYSN_AUTOTUNE", "1") != "0",
              "pytorch": [], "tinysn": []}
    runs = [("pytorch", lambda c=c: pytorch_row(net, c, device, args), {"config": c})
            for c in PYTORCH_CONFIGS if not (c == "torch.compile" and skip_compile)]
    runs += [("tinysn", lambda p=p, g=g: tinysn_row(net, p, g, device, args),
              {"policy": p, "cuda_graph": g, "fuse_bn_relu": args.fuse_bn_relu,
               "fuse_add_relu": args.fuse_add_relu, "fuse_bn_add": args.fuse_bn_add,
               "group_updates": args.group_updates, "fuse_updates": args.fuse_updates,
               "store_argmaxes": args.store_argmaxes})
             for p in args.policies.split(",") for g in (False, True)]
    for side, run, labels in runs:
        result[side].append(guarded(run, **labels))
        with_rates(result, args.batch)
        print(describe(result[side][-1]), flush=True)
        common.write(args.out, result)
    if args.out:
        print(f"wrote {args.out}")
    return result


MODEL_NAMES = {"resnet50": "ResNet-50", "vgg16": "VGG16", "alexnet": "AlexNet",
               "inception_v4": "Inception-v4"}


PLANNER_OPTIONS = ("fuse_bn_relu", "fuse_add_relu", "fuse_bn_add", "group_updates",
                   "fuse_updates", "store_argmaxes")


def summary_rows(results: list) -> list:
    """README.md's speed-table rows, one per model (in MODEL_NAMES' order, then the rest),
    each from all of that model's result files."""
    models = {}
    for result in results:
        models.setdefault(result["model"], []).append(result)
    order = list(MODEL_NAMES)
    ranked = sorted(models, key=lambda m: (order.index(m) if m in order else len(order), m))
    return [summary_row(models[m]) for m in ranked]


def summary_row(runs: list) -> str:
    """README.md's speed-table row for one model from its result files on one card: the
    fastest PyTorch configuration over all of them (each file is one process; the fastest
    over several only raises the bar), then tinysn's first policy as the planner plans it
    by default (rows with an option turned off are A/B runs, left out), replayed as a CUDA
    graph and eager, each its fastest over the files with its ratio to that PyTorch best
    (a configuration refused, failed or not reached in any file says so)."""
    done = [r for run in runs for r in run["pytorch"] if "images_per_s" in r]
    best = max(done, key=lambda r: r["images_per_s"])
    untimed = [c for c in PYTORCH_CONFIGS if all(r["config"] != c for r in done)]
    cells = [MODEL_NAMES.get(runs[0]["model"], runs[0]["model"]),
             f"{best['images_per_s']:,.0f} ({best['config']}"
             + "".join(f"; {c} not timed" for c in untimed) + ")"]
    rows = [r for run in runs for r in run["tinysn"] if _default_options(r)]
    policy = rows[0]["policy"]
    for graphed in (True, False):
        mine = [r for r in rows if r["policy"] == policy and r["cuda_graph"] == graphed]
        timed = [r for r in mine if "images_per_s" in r]
        if timed:
            fastest = max(timed, key=lambda r: r["images_per_s"])["images_per_s"]
            cells.append(f"{fastest:,.0f} ({fastest / best['images_per_s']:.2f}x)")
        else:
            cells.append("not reached" if not mine else
                         "refused" if any("refused" in r for r in mine) else "failed")
    return "| " + " | ".join(cells) + " |"


def _default_options(row: dict) -> bool:
    """Whether a tinysn row is its build's default, not an A/B run: every planner option
    it records is at today's default (a row from before an option existed records none,
    and ran as its build did by default)."""
    defaults = sn.plan.__kwdefaults__
    return all(row.get(name, defaults[name]) == defaults[name] for name in PLANNER_OPTIONS)


def print_tables(paths) -> None:
    """`train.py --table FILE...`: print bench/README.md's table rows for result files."""
    for path in paths:
        print("\n".join(table_rows(common.read(path))))


if __name__ == "__main__":
    main()
