"""python -m tinysn train | plan

  train  trains a model under a memory cap with a progress bar (loss, images/s, pool peak);
         lenet trains on scikit-learn's digits and reports held-out accuracy, the zoo models
         on a fixed synthetic ImageNet-shaped batch.
  plan   dry-runs the scheduler for every policy (or one) and prints the peak, the bytes moved
         and the recomputed steps; --plot draws the memory timeline (the paper's Fig. 10).

Under `torchrun --nproc-per-node N -m tinysn train ...` each process is one rank of
data-parallel training (tinysn/distributed.py) under its own cap; rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import models
from .errors import OutOfMemory
from .sched.plan import POLICIES
from .units import format_bytes

MODELS = {"lenet": models.lenet, "alexnet": models.alexnet, "vgg16": models.vgg16,
          "resnet50": models.resnet50, "resnet101": models.resnet101,
          "resnet152": models.resnet152, "inception_v4": models.inception_v4,
          "densenet121": models.densenet121}


def _parser():
    parser = argparse.ArgumentParser(prog="python -m tinysn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model under a memory cap")
    train.add_argument("--model", choices=sorted(MODELS), default="lenet")
    train.add_argument("--data", choices=["digits", "synthetic"], default=None,
                       help="digits for lenet (default), synthetic for the zoo models")
    train.add_argument("--batch", type=int, default=32,
                       help="images per step (per rank under torchrun: each rank trains on "
                            "its shard of a batch WORLD_SIZE times larger)")
    train.add_argument("--memory", default="512MiB")
    train.add_argument("--policy", choices=POLICIES, default="all")
    train.add_argument("--steps", type=int, default=None,
                       help="iterations (default: 200 for digits, 20 otherwise)")
    train.add_argument("--device", choices=["cpu", "cuda"], default=None)
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--schedule", choices=["linear", "constant"], default="linear",
                       help="learning rate: decays linearly to 0 over the steps, or stays")
    train.add_argument("--momentum", type=float, default=0.9)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--trace", default=None, help="write the last step's trace as JSON")
    train.add_argument("--cuda-graph", action="store_true",
                       help="replay each step as a CUDA graph (needs --schedule constant and "
                            "a model without dropout)")
    train.add_argument("--host-memory", default=None,
                       help="cap on the pinned host arena (default: what the plan needs)")
    plan = sub.add_parser("plan", help="dry-run the scheduler (no kernels, no GPU)")
    plan.add_argument("--model", choices=sorted(MODELS), default="alexnet")
    plan.add_argument("--batch", type=int, default=200)
    plan.add_argument("--memory", default="12GiB")
    plan.add_argument("--policy", choices=POLICIES + ("every",), default="every")
    plan.add_argument("--plot", default=None, help="PNG path for the memory timeline")
    plan.add_argument("--json", default=None, help="write the figures as JSON")
    plan.add_argument("--host-memory", default=None, help="cap on the pinned host arena")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _train(args) if args.command == "train" else _plan(args)
    except OutOfMemory as err:          # a cap too small: say which step, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


def _train(args) -> int:
    from tqdm import tqdm

    from . import data, distributed
    from .runtime import Runtime

    dataset = args.data or ("digits" if args.model == "lenet" else "synthetic")
    if dataset == "digits" and args.model != "lenet":
        print("--data digits needs --model lenet (8x8 grayscale images)", file=sys.stderr)
        return 2
    if args.cuda_graph and args.schedule != "constant":
        print("--cuda-graph replays a fixed learning rate: add --schedule constant",
              file=sys.stderr)
        return 2
    group, rank, world = distributed.from_env(args.device)   # torchrun: one rank per process
    if rank:
        sys.stdout = open(os.devnull, "w")                   # rank 0 prints
    steps = args.steps or (200 if dataset == "digits" else 20)
    lr = args.lr if args.lr is not None else (0.05 if dataset == "digits" else 0.01)
    if dataset == "digits":
        train_x, train_y, test_x, test_y = data.digits(seed=args.seed)
        net = models.lenet(batch=args.batch, classes=10, input_shape=(1, 8, 8))
        stream = (distributed.shard(x, y, rank, world)
                  for x, y in data.batches(train_x, train_y, args.batch * world, seed=args.seed))
    else:
        net = MODELS[args.model](batch=args.batch)
        fixed = distributed.shard(*data.synthetic(MODELS[args.model](batch=args.batch * world),
                                                  seed=args.seed), rank, world)
        stream = iter(lambda: fixed, None)
    try:
        rt = Runtime(net, args.memory, args.policy, device=args.device, lr=lr,
                     momentum=args.momentum, weight_decay=args.weight_decay, seed=args.seed,
                     host_memory=args.host_memory, cuda_graph=args.cuda_graph,
                     process_group=group)
    except ValueError as err:           # e.g. --cuda-graph on a CPU or with dropout
        print(f"error: {err}", file=sys.stderr)
        return 2
    ranks = f" x {world} ranks" if world > 1 else ""
    print(f"{args.model} batch {args.batch}{ranks} on {rt.device}, policy {args.policy}, cap "
          f"{format_bytes(rt.plan.capacity)}: planned peak {format_bytes(rt.plan.peak_bytes)}")
    bar = tqdm(range(steps), unit="step", file=sys.stdout)
    start, done = time.perf_counter(), 0
    for i in bar:
        if args.schedule == "linear":
            rt.lr = lr * (1 - i / steps)
        images, labels = next(stream)
        loss = rt.step(images, labels)
        done += args.batch * world
        rate = done / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{rate:.1f}",
                        peak=format_bytes(rt.stats.peak_bytes))
    bar.close()
    print(f"final loss {loss:.4f}; pool peak {rt.stats.peak_bytes:,} bytes "
          f"(planned {rt.plan.peak_bytes:,})")
    if dataset == "digits":
        accuracy = evaluate(rt, test_x, test_y)
        print(f"held-out accuracy {accuracy:.2%} on {len(test_y)} digits")
    if args.trace and rank == 0:
        with open(args.trace, "w") as f:
            json.dump(rt.stats.trace, f, indent=1)
        print(f"trace of {len(rt.stats.trace)} steps written to {args.trace}")
    distributed.close(group)
    return 0


def evaluate(rt, x, y) -> float:
    """Accuracy of `rt`'s network on (x, y), predicted batch by batch (the tail is padded)."""
    import torch

    batch, correct = rt.net.batch, 0
    for i in range(0, len(y), batch):
        chunk = x[i:i + batch]
        n = len(chunk)
        if n < batch:
            chunk = torch.cat([chunk, chunk.new_zeros((batch - n, *chunk.shape[1:]))])
        logits = rt.predict(chunk)[:n]
        correct += int((logits.argmax(1) == y[i:i + n]).sum())
    return correct / len(y)


def _plan(args) -> int:
    from .sched.plan import plan as make_plan

    policies = POLICIES if args.policy == "every" else (args.policy,)
    results = {}
    for policy in policies:
        net = MODELS[args.model](batch=args.batch)
        p = make_plan(net, args.memory, policy, host_memory=args.host_memory)
        results[policy] = p
        print(f"{policy:>9}: peak {p.peak_bytes / 2**20:10.1f} MiB  to host "
              f"{p.bytes_to_host / 2**20:9.1f} MiB  to device {p.bytes_to_device / 2**20:9.1f} MiB"
              f"  host arena {p.host_bytes / 2**20:9.1f} MiB  recomputed {p.recomputed_steps:4d}"
              f"  steps {len(p.steps)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {"peak_bytes": v.peak_bytes, "bytes_to_host": v.bytes_to_host,
                           "bytes_to_device": v.bytes_to_device,
                           "recomputed_steps": v.recomputed_steps,
                           "timeline": [[s.bytes_in_use, s.live_tensors] for s in v.steps]}
                       for k, v in results.items()}, f)
    if args.plot:
        plot_timeline(results, args.plot, title=f"{args.model} batch {args.batch}")
        print(f"timeline written to {args.plot}")
    return 0


def plot_timeline(plans: dict, path: str, title: str = "") -> None:
    """Bytes in use and live tensors per step for each policy (the paper's Fig. 10)."""
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
    top.set_ylabel("device memory in use (MiB)")
    bottom.set_ylabel("live tensors")
    bottom.set_xlabel("step (forward, then backward; recomputations add steps)")
    top.set_title(f"memory timeline, {title}")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
