"""tinysn train | plan | trace | cache  (also `python3 -m tinysn ...`)

  train  trains a model under a memory cap with a progress bar on stderr (loss, images/s
         after the warm-up step, pool peak); lenet trains on scikit-learn's digits and reports
         held-out accuracy and loss (eval mode), the zoo models on a fixed synthetic
         ImageNet-shaped batch, any model on a directory of images (--data
         imagefolder:PATH); --save/--save-every write checkpoints, --resume continues one
         exactly. On a GPU each step after the first few is replayed as a captured CUDA
         graph (--no-cuda-graph: every step launched from Python).
  plan   dry-runs the scheduler for every policy (or one) and prints the peak, the bytes moved
         and the recomputed steps; for a policy that does not fit, the smallest --memory and
         the largest --batch that would; --plot draws the memory timeline (the paper's Fig. 10).
  trace  reads a step's Chrome trace (train --trace, here or on another machine) and prints
         its step time and how busy each stream is; --plot draws it: a lane of bars per
         stream (compute, to host, to device) above the pool's bytes in use and the cap.
  cache  shows or clears the kernel tuning cache (location: $TINYSN_CACHE_DIR, else
         ~/.cache/tinysn).

Under `torchrun --nproc-per-node N -m tinysn train ...` each process is one rank of
data-parallel training (tinysn/distributed.py) under its own cap; rank 0 prints.

Bad arguments give one line on stderr and exit status 2, before any work.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time

from . import models
from .errors import OutOfMemory
from .sched.liveness import BUCKET_BYTES, parse_bucket_bytes
from .sched.plan import POLICIES
from .units import format_bytes, parse_bytes

_STARTED = [time.perf_counter()]   # main() resets it: the first-step notice counts from there

MODELS = {"lenet": models.lenet, "alexnet": models.alexnet, "vgg16": models.vgg16,
          "resnet50": models.resnet50, "resnet101": models.resnet101,
          "resnet152": models.resnet152, "inception_v4": models.inception_v4,
          "densenet121": models.densenet121}
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
SEARCH_LIMIT = 2**44        # the smallest-cap search gives up above 16 TiB
POLICY_HELP = """\
policies (each adds to the one before):
  baseline   every tensor lives the whole iteration (the paper's baseline)
  liveness   frees each tensor after its last use
  offload    + copies each conv's output to pinned host memory as it is produced, and
             back just before the backward pass reads it (always)
  recompute  + drops cheap layers' outputs and recomputes them in the backward pass
  all        + keeps tensors on the GPU while they fit (LRU cache: copies only when short)
             and picks each convolution's algorithm by the workspace it can afford
"""


class UsageError(Exception):
    """A bad argument: printed as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: no usage block, no traceback."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default (a None default is described in the help text)
    and keeps the description's layout."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


# The digits demo's default length: enough steps for LeNet to pass 95% held out, few enough
# for the README's first command to finish within a minute on two CPU cores (README.md quotes
# bench/results/first-run-lenet-digits-cpu.json).
DIGITS_STEPS = 150


def _checked(read, example):
    """An argparse type: `read(text)` or a one-line error that ends with a valid example."""
    def convert(text):
        try:
            return read(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err} (e.g. {example})") from None
    return convert


def _count(low):
    def read(text):
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"must be a whole number, got {text!r}") from None
        if value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value
    return read


def _rate(text):
    """A finite number >= 0 (learning rate, momentum, weight decay)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"must be a finite number >= 0, got {text!r}")
    return value


def _parser():
    parser = _Parser(prog="tinysn", description=__doc__, epilog=POLICY_HELP,
                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub.add_parser("train", help="train a model under a memory cap",
                                 epilog=POLICY_HELP, formatter_class=_Formatter))
    _plan_parser(sub.add_parser("plan", help="dry-run the scheduler (no kernels, no GPU)",
                                epilog=POLICY_HELP, formatter_class=_Formatter))
    _trace_parser(sub.add_parser("trace", help="summarize or draw a step's Chrome trace",
                                 formatter_class=_Formatter))
    cache = sub.add_parser("cache", help="show or clear the kernel tuning cache",
                           formatter_class=_Formatter)
    cache.add_argument("--clear", action="store_true", help="delete every cached entry")
    return parser


def _common_args(p, model, batch, memory):
    p.add_argument("--model", choices=sorted(MODELS), default=model, help="network")
    p.add_argument("--batch", type=_checked(_count(1), "--batch 32"), default=batch,
                   help="images per iteration")
    p.add_argument("--memory", type=_checked(parse_bytes, "--memory 12GiB"), default=memory,
                   help="hard cap on device memory: bytes or 512MiB, 12GiB, 1.5GB")
    p.add_argument("--host-memory", type=_checked(parse_bytes, "--host-memory 60GiB"),
                   default=None, help="cap on the pinned host arena (default: what the plan "
                                      "needs)")


def _train_parser(p):
    _common_args(p, "lenet", 32, "512MiB")
    p.add_argument("--policy", choices=POLICIES, default="all",
                   help="memory policy (below)")
    p.add_argument("--data", type=_data_arg, default=None,
                   help="digits for lenet (default), synthetic for the zoo models, or "
                        "imagefolder:PATH (one sub-directory of images per class; each "
                        "epoch's last partial batch is dropped)")
    p.add_argument("--steps", type=_checked(_count(1), "--steps 20"), default=None,
                   help=f"iterations (default: {DIGITS_STEPS} for digits, 20 otherwise)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when a GPU is present")
    p.add_argument("--lr", type=_checked(_rate, "--lr 0.05"), default=None,
                   help="learning rate (default: 0.05 for digits, 0.01 otherwise)")
    p.add_argument("--schedule", choices=["linear", "constant"], default="linear",
                   help="learning rate: decays linearly to 0 over the steps, or stays")
    p.add_argument("--momentum", type=_checked(_rate, "--momentum 0.9"), default=0.9,
                   help="SGD momentum")
    p.add_argument("--weight-decay", type=_checked(_rate, "--weight-decay 1e-4"), default=0.0,
                   help="SGD weight decay")
    p.add_argument("--seed", type=_checked(_count(0), "--seed 0"), default=0,
                   help="parameters, data order and dropout masks")
    p.add_argument("--trace", default=None,
                   help="write the last step's kernels and copies as a Chrome trace (.json; "
                        "open it in Perfetto or chrome://tracing)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each step after the first few as one captured CUDA graph "
                        "(the default on a GPU unless --trace; any --schedule: the updates "
                        "read the rate from the pool)")
    p.add_argument("--bucket-bytes", type=_checked(parse_bucket_bytes, "--bucket-bytes 25MiB"),
                   default=BUCKET_BYTES, help="under torchrun: gradient bytes per all-reduce "
                                              "bucket (layers in backward order)")
    # checkpoints (tinysn/checkpoint.py): save, periodically and at the end; resume exactly
    p.add_argument("--save", default=None, help="checkpoint path, written at the end")
    p.add_argument("--save-every", type=_checked(_count(1), "--save-every 50"), default=None,
                   help="also write the checkpoint every K steps (needs --save)")
    p.add_argument("--resume", default=None,
                   help="continue from this checkpoint: its step, weights, momentum")


def _plan_parser(p):
    _common_args(p, "alexnet", 200, "12GiB")
    p.add_argument("--policy", choices=POLICIES + ("every",), default="every",
                   help="memory policy (below), or every policy in turn")
    p.add_argument("--plot", default=None,
                   help="memory timeline with the cap drawn (.png, .pdf or .svg)")
    p.add_argument("--json", default=None, help="write the figures as JSON ('-': stdout)")


def _trace_parser(p):
    p.add_argument("path", help="a trace written by tinysn train --trace (.json)")
    p.add_argument("--plot", default=None,
                   help="draw the step: stream lanes above bytes in use (.png, .pdf or .svg)")


def _version() -> str:
    from importlib import metadata

    import torch
    import triton
    try:
        mine = metadata.version("tinysn")
    except metadata.PackageNotFoundError:
        mine = "(not installed)"
    return f"tinysn {mine} (torch {torch.__version__}, triton {triton.__version__})"


def main(argv=None) -> int:
    """Run one command; return its exit status (2: bad arguments or a cap too small)."""
    _STARTED[0] = time.perf_counter()
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:          # --help, --version and argparse's one-line errors
        return stop.code
    try:
        if args.command == "cache":
            return _cache(args)
        _check_args(args)
        return {"train": _train, "plan": _plan, "trace": _trace}[args.command](args)
    except (UsageError, OutOfMemory) as err:
        print(f"tinysn {args.command}: error: {err}", file=sys.stderr)
        return 2


# -- checks before any work ---------------------------------------------------------------
def _check_args(args) -> None:
    """Every check that needs no training, output paths first; UsageError on the first
    problem."""
    if args.command == "trace":
        _check_plot(args.plot)
        if not os.path.isfile(args.path):
            raise UsageError(f"{args.path!r} is not a file: name a trace written by "
                             "tinysn train --trace, e.g. tinysn trace t.json")
        return
    if args.command == "plan":
        _check_output("--json", None if args.json == "-" else args.json, (".json",))
        _check_plot(args.plot)
        return
    _check_output("--trace", args.trace, (".json",))
    dataset = args.data or ("digits" if args.model == "lenet" else "synthetic")
    if dataset == "digits" and args.model != "lenet":
        raise UsageError("--data digits needs --model lenet (8x8 grayscale images), e.g. "
                         "--model lenet --data digits")
    if args.save_every is not None and not args.save:
        raise UsageError("--save-every K needs a checkpoint path, e.g. --save run.safetensors")
    if args.cuda_graph and args.trace:
        raise UsageError("--trace records eager steps, which --cuda-graph replaces: drop one")
    if args.device is None:
        args.device = _default_device()
    if args.device == "cuda" and _default_device() != "cuda":
        raise UsageError("--device cuda asked for, but no CUDA GPU is available: use "
                         "--device cpu")
    if args.cuda_graph and args.device != "cuda":
        raise UsageError("--cuda-graph replays steps captured on a GPU: drop it on the CPU "
                         "(--device cpu)")
    if args.cuda_graph is None:         # replayed wherever it can be: the fast way by default
        args.cuda_graph = args.device == "cuda" and not args.trace
    _check_room("--memory", args.memory, args.device)
    if args.host_memory is not None:
        _check_room("--host-memory", args.host_memory, "cpu")


def _check_output(flag, path, suffixes) -> None:
    """`path` (None: not asked for) must be a file name with one of `suffixes` in an
    existing, writable directory."""
    if path is None:
        return
    if not path.lower().endswith(suffixes):
        raise UsageError(f"{flag} {path!r}: the name must end in {' or '.join(suffixes)}, "
                         f"e.g. {flag} out{suffixes[0]}")
    folder = os.path.dirname(path) or "."
    example = f"e.g. {flag} out{suffixes[0]} (in the current directory)"
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory; name a file, {example}")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path!r}: directory {folder!r} does not exist, {example}")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path!r}: directory {folder!r} is not writable, {example}")


def _check_plot(path) -> None:
    """--plot `path` (None: not asked for): a figure file name, and matplotlib to draw it."""
    _check_output("--plot", path, PLOT_SUFFIXES)
    if path and not _importable("matplotlib"):
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or the "
                         "package's [plot] extra), or leave out --plot")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_room(flag, nbytes, device) -> None:
    """A cap larger than the memory `device` has free cannot be allocated: say so now."""
    from .pool.arena import available_bytes

    room = available_bytes(device)
    where = "GPU memory free" if device == "cuda" else "RAM available"
    if nbytes > room:
        raise UsageError(f"{flag} {format_bytes(nbytes)} is more than this machine has: "
                         f"{format_bytes(room)} of {where}, e.g. {flag} {_flag_bytes(room // 2)}")


def _flag_bytes(nbytes: int) -> str:
    """A byte count as a --memory value, rounded up: to 0.1 GiB from 1 GiB, else to whole
    MiB from 1 MiB, else to whole KiB."""
    if nbytes >= 2**30:
        return f"{math.ceil(nbytes * 10 / 2**30) / 10:.1f}GiB"
    if nbytes >= 2**20:
        return f"{math.ceil(nbytes / 2**20)}MiB"
    return f"{max(1, math.ceil(nbytes / 2**10))}KiB"


# -- what would fit ------------------------------------------------------------------------
def smallest_cap(make_net, batch, policy, **kwargs):
    """The smallest device cap, to 0.1% (or 1 KiB), under which `make_net(batch=batch)`
    plans with `policy` (None when even 16 TiB does not). Assumes plans are monotone in the
    cap: a binary search between the last power of two that fails and the first that fits."""
    from .sched.plan import fits as plans

    net = make_net(batch=batch)

    def fits(cap):
        return plans(net, cap, policy, **kwargs)

    hi = 2**20
    while not fits(hi):
        if hi >= SEARCH_LIMIT:
            return None
        hi *= 2
    lo = hi // 2 if hi > 2**20 else 0
    while hi - lo > max(2**10, hi >> 10):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def fit_advice(make_net, batch, memory, policy, **kwargs) -> str:
    """One sentence: the --memory and the --batch under which the plan would fit. (A dry
    run that plans under a cap below `memory` means the error came from elsewhere, or the
    plans are not monotone in the cap here: that smaller cap is the advice.)"""
    cap = smallest_cap(make_net, batch, policy, **kwargs)
    if cap is not None and cap <= memory:
        return f"It plans under --memory {_flag_bytes(cap)}: try that."
    largest = batch_that_fits(make_net, batch, memory, policy, **kwargs)
    if cap is None and not largest:
        return (f"Nothing fits: no --memory up to {format_bytes(SEARCH_LIMIT)} and no --batch "
                f"under {format_bytes(memory)}; raise --host-memory.")
    if cap is None:
        return (f"To fit, lower --batch to {largest} (no --memory up to "
                f"{format_bytes(SEARCH_LIMIT)} fits this batch; or raise --host-memory).")
    if not largest:
        return (f"To fit, raise --memory to {_flag_bytes(cap)} (no batch fits under "
                f"{format_bytes(memory)}).")
    return f"To fit, raise --memory to {_flag_bytes(cap)} or lower --batch to {largest}."


def batch_that_fits(make_net, batch, memory, policy, **kwargs) -> int:
    """A batch below `batch` (which does not plan) that plans under `memory`, found by
    bisection in a few plans: b plans and b + 1 does not; 0 when batch 1 does not plan.
    Feasibility is not monotone in the batch, so a larger batch may plan as well, and a
    smaller one may not (sn.max_batch, which tries every batch, says which: it takes a
    plan per batch, too long for an error message)."""
    from .sched.plan import fits

    if not fits(make_net(batch=1), memory, policy, **kwargs):
        return 0
    lo, hi = 1, batch                         # lo plans, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(make_net(batch=mid), memory, policy, **kwargs) else (lo, mid)
    return lo


def _explained(err, advice) -> OutOfMemory:
    """`err` (a plan that does not fit) followed by `advice`: what would fit."""
    return OutOfMemory(f"{err}. {advice}")


def _net_maker(args):
    """model(batch=...) for this command: lenet on the digits takes 8x8 grayscale images."""
    model = MODELS[args.model]
    if args.command == "train" and args.model == "lenet" and _dataset(args) == "digits":
        return lambda batch: models.lenet(batch=batch, classes=10, input_shape=(1, 8, 8))
    return model


def _dataset(args) -> str:
    return args.data or ("digits" if args.model == "lenet" else "synthetic")


# -- commands ------------------------------------------------------------------------------
def _cache(args) -> int:
    from . import cache

    root = cache.cache_dir()
    if args.clear:
        print(f"removed {cache.clear()} files from {root}")
        return 0
    files = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    size = sum(p.stat().st_size for p in files)
    print(f"{root}: {len(files)} files, {format_bytes(size)} (clear: tinysn cache --clear)")
    return 0


def _train(args) -> int:
    from . import cache, distributed
    from .runtime import GRAPH_WARMUP, Runtime

    steps = args.steps or (DIGITS_STEPS if _dataset(args) == "digits" else 20)
    lr = args.lr if args.lr is not None else (0.05 if _dataset(args) == "digits" else 0.01)
    group, rank, world = distributed.from_env(args.device)   # torchrun: one rank per process
    if rank:
        sys.stdout = open(os.devnull, "w")                   # rank 0 prints
    make_net = _net_maker(args)
    net = make_net(batch=args.batch)
    if _dataset(args).startswith("imagefolder:"):
        try:
            net, stream = _imagefolder(args, _dataset(args).partition(":")[2])
        except ValueError as err:       # no torchvision, no images, too few for a batch
            raise UsageError(str(err)) from None
        make_net, test = (lambda batch: MODELS[args.model](batch=batch,
                                                           classes=net.classes)), None
    else:
        stream, test = _data(args, net, rank, world)
    if args.device == "cuda":
        print(f"compiling and tuning kernels for the first step (tuning cached in "
              f"{cache.cache_dir()})", file=sys.stderr)
    try:
        rt = Runtime(net, args.memory, args.policy, device=args.device, lr=lr,
                     momentum=args.momentum, weight_decay=args.weight_decay, seed=args.seed,
                     host_memory=args.host_memory, cuda_graph=args.cuda_graph,
                     process_group=group, bucket_bytes=args.bucket_bytes)
    except ValueError as err:           # e.g. --cuda-graph without a GPU
        raise UsageError(str(err)) from None
    except OutOfMemory as err:
        advice = fit_advice(make_net, args.batch, args.memory, args.policy,
                            momentum=args.momentum, host_memory=args.host_memory)
        raise _explained(err, advice) from None
    try:
        first = _resume(args, rt, stream)
    except ValueError as err:           # a damaged checkpoint, another net's
        raise UsageError(str(err)) from None
    ranks = f" x {world} ranks" if world > 1 else ""
    print(f"{args.model} batch {args.batch}{ranks} on {rt.device}, policy {args.policy}, cap "
          f"{format_bytes(rt.plan.capacity)}: planned peak {format_bytes(rt.plan.peak_bytes)}"
          + (f"; steps after the first {GRAPH_WARMUP} replayed as a CUDA graph "
             "(--no-cuda-graph: eager)" if args.cuda_graph else ""))
    if args.trace:
        from .trace import Recorder
        rt.recorder = Recorder()
    warmup = GRAPH_WARMUP + 1 if args.cuda_graph else 1
    loss, rate = _run(rt, stream, range(first, steps), lr, args, warmup)
    if args.save:
        from . import checkpoint
        checkpoint.save(rt, args.save)
    speed = f"{rate:,.1f} images/s after {warmup} warm-up step(s)" if rate else "no timed steps"
    print(f"final loss {loss:.4f}; {speed}; pool peak {rt.stats.peak_bytes:,} bytes "
          f"(planned {rt.plan.peak_bytes:,})")
    if test is not None:
        from torch.utils.data import DataLoader, TensorDataset

        held_out = rt.evaluate(DataLoader(TensorDataset(*test), batch_size=args.batch))
        print(f"held-out accuracy {held_out['accuracy']:.2%}, loss {held_out['loss']:.4f} "
              f"on {len(test[1])} digits")
    if args.trace and rank == 0:
        from .trace import summary, write
        count = write(rt.recorder, args.trace, model=args.model)
        print(f"trace of the last step ({count} events) written to {args.trace}: "
              f"{_busy_line(summary(rt.recorder.events()))}")
    distributed.close(group)
    return 0


def _trace(args) -> int:
    """Print a trace file's step time and busy fractions; with --plot, draw it."""
    from . import trace

    try:
        recorded = trace.read(args.path)
    except ValueError as err:           # not a trace file, or one without spans
        raise UsageError(str(err)) from None
    figures = trace.summary(recorded["traceEvents"])
    print(f"{args.path}: {_busy_line(figures)}")
    if args.plot:
        trace.plot(recorded, args.plot)
        print(f"timeline written to {args.plot}")
    return 0


def _busy_line(figures) -> str:
    """A trace summary in one line: the step time and each stream's busy share."""
    busy = ", ".join(f"{name} {share:.1%}" for name, share in figures["busy"].items())
    return f"step {figures['step_ms']:,.1f} ms; busy: {busy}"


def _data(args, net, rank=0, world=1):
    """(endless batch stream, held-out (x, y) or None) for the command's dataset; under
    data parallelism each rank's shard of a batch `world` times larger."""
    from . import data, distributed

    if _dataset(args) == "digits":
        train_x, train_y, test_x, test_y = data.digits(seed=args.seed)
        batches = data.batches(train_x, train_y, args.batch * world, seed=args.seed)
        return ((distributed.shard(x, y, rank, world) for x, y in batches), (test_x, test_y))
    whole = data.synthetic(MODELS[args.model](batch=args.batch * world), seed=args.seed)
    fixed = distributed.shard(*whole, rank, world)
    return iter(lambda: fixed, None), None


def _run(rt, stream, steps, lr, args, warmup):
    """Train the iterations in range `steps` with a progress bar on stderr (and a checkpoint
    every --save-every); return (last loss, images/s over the steps after the first `warmup`,
    or None when there were none)."""
    from tqdm import tqdm

    from . import checkpoint

    bar = tqdm(steps, unit="step", file=sys.stderr,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    rate, start, loss = None, None, float("nan")
    for done, i in enumerate(bar, 1):              # the bar counts each step as it ends
        if args.schedule == "linear":
            rt.lr = lr * (1 - i / steps.stop)
        loss = rt.step(*next(stream))
        now = time.perf_counter()
        if done == 1:
            bar.write(f"first step done {now - _STARTED[0]:.1f} s after the command started "
                      "(compiling and tuning included)", file=sys.stderr)
        if done == warmup:
            start = now
        elif start is not None:
            rate = (done - warmup) * args.batch / (now - start)
        if args.save_every and (i + 1) % args.save_every == 0:
            checkpoint.save(rt, args.save)
        bar.set_postfix(loss=f"{loss:.4f}", img_s="warm-up" if rate is None else f"{rate:.1f}",
                        peak=format_bytes(rt.stats.peak_bytes))
    bar.close()
    return loss, rate


def _data_arg(value: str) -> str:
    """--data: digits, synthetic or imagefolder:PATH."""
    if value in ("digits", "synthetic") or (value.startswith("imagefolder:") and value[12:]):
        return value
    raise argparse.ArgumentTypeError(f"expected digits, synthetic or imagefolder:PATH, "
                                     f"got {value!r}, e.g. --data imagefolder:./images")


def _imagefolder(args, root):
    """(net, batch stream) for a directory of images: the model with one class per
    sub-directory, at its own input shape."""
    from . import data

    shape = MODELS[args.model](batch=1).input_shape
    dataset = data.imagefolder(root, shape)
    net = MODELS[args.model](batch=args.batch, classes=len(dataset.classes))
    print(f"{len(dataset)} images in {len(dataset.classes)} classes from {root}")
    return net, data.loader_batches(dataset, args.batch, seed=args.seed)


def _resume(args, rt, stream) -> int:
    """With --resume, restore rt and advance the batch stream past the steps already taken
    (the schedule and the data then continue exactly). Returns the step to start from."""
    from . import checkpoint

    if not args.resume:
        return 0
    checkpoint.load(rt, args.resume)
    for _ in range(rt.stats.iterations):
        next(stream)
    return rt.stats.iterations


def _plan(args) -> int:
    """Plan each policy; a policy that does not fit gets a row saying what would."""
    from .sched.plan import plan as make_plan

    out = sys.stderr if args.json == "-" else sys.stdout     # stdout stays pure JSON
    policies = POLICIES if args.policy == "every" else (args.policy,)
    kwargs = {"host_memory": args.host_memory}
    fitted, figures = {}, {}
    for policy in policies:
        try:
            p = make_plan(MODELS[args.model](batch=args.batch), args.memory, policy, **kwargs)
        except OutOfMemory as err:
            advice = fit_advice(MODELS[args.model], args.batch, args.memory, policy, **kwargs)
            if len(policies) == 1:
                raise _explained(err, advice) from None
            print(f"{policy:>9}: does not fit. {advice}", file=out)
            figures[policy] = {"fits": False, "error": str(err), "advice": advice}
            continue
        fitted[policy], figures[policy] = p, _figures(p)
        print(f"{policy:>9}: peak {p.peak_bytes / 2**20:10.1f} MiB  to host "
              f"{p.bytes_to_host / 2**20:9.1f} MiB  to device {p.bytes_to_device / 2**20:9.1f} MiB"
              f"  host arena {p.host_bytes / 2**20:9.1f} MiB  recomputed {p.recomputed_steps:4d}"
              f"  steps {len(p.steps)}  H200 step {figures[policy]['predicted_step_s']:.3f} s",
              file=out)
        waits = figures[policy]["predicted_compute_waits_s"]
        if p.bytes_to_host and sum(waits.values()) >= 0.001:
            print(f"{'':>9}  compute stream idle (waiting for copies or launches): "
                  + ", ".join(f"{s:.3f} s {phase}" for phase, s in waits.items()), file=out)
    _write_plan_outputs(args, fitted, figures, out)
    if not fitted:
        raise OutOfMemory(f"no policy fits {args.model} at batch {args.batch} under "
                          f"{format_bytes(args.memory)} (rows above say what would)")
    return 0


def _figures(p) -> dict:
    from .sched.timing import simulate
    timeline = simulate(p, p.device_model)           # what p.predicted_step_s walks, once
    return {"fits": True, "peak_bytes": p.peak_bytes, "bytes_to_host": p.bytes_to_host,
            "bytes_to_device": p.bytes_to_device, "recomputed_steps": p.recomputed_steps,
            "predicted_step_s": timeline.step_s,
            "predicted_compute_waits_s": timeline.compute_waits(),
            "timeline": [[s.bytes_in_use, s.live_tensors] for s in p.steps]}


def _write_plan_outputs(args, fitted, figures, out) -> None:
    if args.json == "-":
        json.dump(figures, sys.stdout)
        sys.stdout.write("\n")
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f)
        print(f"figures written to {args.json}", file=out)
    if args.plot and fitted:
        plot_timeline(fitted, args.plot, title=f"{args.model} batch {args.batch}")
        print(f"timeline written to {args.plot}", file=out)


def plot_timeline(plans: dict, path: str, title: str = "") -> None:
    """Bytes in use and live tensors per step for each policy (the paper's Fig. 10), with
    the cap as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    styles = ["-", "--", "-.", ":", (0, (6, 2, 1, 2))]   # policies that coincide stay visible
    for i, (policy, p) in enumerate(plans.items()):
        style = dict(linestyle=styles[i % len(styles)], linewidth=2.2 - 0.3 * i)
        top.plot([s.bytes_in_use / 2**20 for s in p.steps],
                 label=f"{policy} (peak {p.peak_bytes / 2**20:,.0f} MiB)", **style)
        bottom.plot([s.live_tensors for s in p.steps], label=policy, **style)
    cap = next(iter(plans.values())).capacity
    top.axhline(cap / 2**20, color="black", linewidth=1, label=f"cap {format_bytes(cap)}")
    top.set_ylabel("device memory in use (MiB)")
    bottom.set_ylabel("live tensors")
    bottom.set_xlabel("step (forward, then backward; recomputations add steps)")
    top.set_title(f"memory timeline, {title}")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
