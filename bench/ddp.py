"""Data-parallel scaling: tinysn on N GPUs against 1, beside PyTorch DDP in the same run.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python bench/ddp.py --gpus 2 [--configs ...] [--out PATH]
                                                        [--merge]

Configurations (`--configs`): "b32-graph" (batch 32 per GPU, the step replayed as a CUDA
graph), "b32" (the same, eager) and "largest" (the largest batch per GPU that policy "all"
plans under `--memory` for one data-parallel rank, eager). Each configuration runs twice,
each time in fresh processes: on `--gpus` GPUs (one process per GPU, NCCL; NVLink multicast
stays off), then on one GPU (plain single-process training, no process group). In every
process tinysn trains first, then PyTorch trains the same graph's torch twin
(`Net.to_torch()`, `--pytorch` configuration, wrapped in DistributedDataParallel on N GPUs)
with the same SGD settings; PyTorch runs without a cap, and its max_memory_allocated is
recorded. Both are timed as bench/train.py times them (`timed`: warm-up, then a wall-clock
span between synchronizations, measured on rank 0 after a barrier). Every rank trains on the
same synthetic batch from pinned host memory (speed does not depend on the data).

images/s counts every GPU's images; `scaling` is images/s on N GPUs over images/s on one,
per configuration, for tinysn and for PyTorch. "largest": the batch comes from the planner's
dry run (sn.max_batch with data_parallel=True); the N-GPU run lowers it in 3% steps while
the Runtime refuses it (conv rankings measured on the GPU may change workspaces; the ranks
agree on every refusal), and the one-GPU run trains the batch it settled on. Without CUDA
the same code runs on the CPU with gloo as a smoke test (`--model lenet`).
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench import common  # noqa: E402
from bench.train import PYTORCH_CONFIGS, host_batch, set_up_torch, timed, torch_step  # noqa: E402
from tinysn import distributed  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402

CONFIGS = {"b32-graph": (32, True), "b32": (32, False), "largest": (None, False)}
SHRINK = 0.97       # the "largest" batch steps down by 3% while it does not plan on the GPU


def _join(rank, world, port, device):
    """This process's rank of a `world`-process group (None for one process)."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    if world == 1:
        return None, device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return dist.group.WORLD, device


def _runtime(batch, shrink, cuda_graph, args, device, group):
    """(batch, Runtime): with `shrink`, `batch` lowered in SHRINK steps while the Runtime
    refuses it (OutOfMemory comes on every rank together: distributed.plan_everywhere)."""
    for _ in range(10):
        try:
            return batch, sn.Runtime(MODELS[args.model](batch=batch), args.memory, "all",
                                     device=device, lr=args.lr, momentum=args.momentum,
                                     weight_decay=args.weight_decay, cuda_graph=cuda_graph,
                                     process_group=group)
        except sn.OutOfMemory:
            if not shrink:
                raise
            batch = max(1, int(batch * SHRINK))
    raise sn.OutOfMemory(f"{args.model} does not fit {args.memory} down to batch {batch}")


def _tinysn(batch, shrink, cuda_graph, args, device, group) -> dict:
    """The Runtime at the batch it settles on (`batch` in the row), timed."""
    batch, rt = _runtime(batch, shrink, cuda_graph, args, device, group)
    images, labels = host_batch(rt.net, device)
    _barrier(group)
    row = timed(lambda: rt.step(images, labels), device, args.warmup, args.steps)
    row.update(batch=batch, peak_bytes=rt.stats.peak_bytes,
               planned_peak_bytes=rt.plan.peak_bytes,
               peak_equals_plan=rt.stats.peak_bytes == rt.plan.peak_bytes)
    return row


def _pytorch(net, args, device, group) -> dict:
    """The torch twin under `args.pytorch`, in DistributedDataParallel when `group` is set."""
    fmt = (torch.channels_last if args.pytorch == "eager channels-last"
           else torch.contiguous_format)
    model = net.to_torch().to(device).train().to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    if group is not None:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group, gradient_as_bucket_view=True)
    forward = torch.compile(model) if args.pytorch == "torch.compile" else model
    step = torch_step(forward, opt, host_batch(net, device), device, fmt)
    _barrier(group)
    return timed(step, device, args.warmup, args.steps)


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def _side(run) -> dict:
    """One side's row, or its error (the other side still runs)."""
    try:
        return run()
    except Exception as err:  # noqa: BLE001  (recorded in the row)
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    finally:
        if torch.cuda.is_available():   # the side's Runtime went on return: its blocks too
            torch.cuda.empty_cache()


def _worker(rank, world, port, batch, shrink, cuda_graph, args, out):
    """One process of one run: settles the batch (`shrink`: see _runtime), times tinysn,
    then PyTorch; rank 0 writes the rows to `out`."""
    set_up_torch()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    group, device = _join(rank, world, port, device)
    try:
        tinysn = _side(lambda: _tinysn(batch, shrink, cuda_graph, args, device, group))
        batch = tinysn.get("batch", batch)
        net = MODELS[args.model](batch=batch)
        rows = {"batch": batch, "tinysn": tinysn,
                "pytorch": _side(lambda: _pytorch(net, args, device, group))}
        for row in (rows["tinysn"], rows["pytorch"]):
            if "ms_per_step" in row:
                row["images_per_s"] = world * batch / row["ms_per_step"] * 1e3
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        distributed.close(group)


def run(world, batch, shrink, cuda_graph, args) -> dict:
    """One configuration on `world` GPUs, in fresh processes; rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_worker, args=(world, distributed.free_port(), batch, shrink, cuda_graph,
                                args, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def scaling(runs: dict, world: int) -> dict:
    """images/s on `world` GPUs over images/s on one, per side (None where one is missing)."""
    def rate(n, side):
        return runs.get(str(n), {}).get(side, {}).get("images_per_s")
    return {side: (rate(world, side) / rate(1, side)
                   if rate(world, side) and rate(1, side) else None)
            for side in ("tinysn", "pytorch")}


def configuration(name, args) -> dict:
    """Both runs of one configuration (N GPUs, then 1) and their scaling."""
    batch, cuda_graph = CONFIGS[name]
    shrink = batch is None
    if shrink:
        batch = sn.max_batch(MODELS[args.model], args.memory, "all", momentum=args.momentum,
                             data_parallel=True)
    result = {"batch_per_gpu": batch, "cuda_graph": cuda_graph, "runs": {}}
    for world in (args.gpus, 1):
        try:
            rows = run(world, batch, shrink and world > 1, cuda_graph, args)
        except Exception as err:  # noqa: BLE001  (the configuration records why)
            result["runs"][str(world)] = {"error": f"{type(err).__name__}: {err}"[:500]}
            break
        result["runs"][str(world)] = rows
        batch = result["batch_per_gpu"] = rows["batch"]
    result["scaling"] = scaling(result["runs"], args.gpus)
    return result


def describe(name, result, world) -> str:
    def cell(n, side):
        row = result["runs"].get(str(n), {})
        rate = row.get(side, {}).get("images_per_s")
        return f"{rate:9.1f}" if rate else f"{'failed':>9}"
    s = result["scaling"]
    fmt = (lambda v: "-" if v is None else f"{v:.2f}x")
    return (f"{name:>10} batch {result['batch_per_gpu']:>4}/GPU: tinysn {cell(1, 'tinysn')} -> "
            f"{cell(world, 'tinysn')} images/s ({fmt(s['tinysn'])}), PyTorch "
            f"{cell(1, 'pytorch')} -> {cell(world, 'pytorch')} ({fmt(s['pytorch'])})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2, help="ranks of the data-parallel run")
    ap.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    ap.add_argument("--memory", default="12GiB", help="tinysn's cap per GPU")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--pytorch", default="eager channels-last",
                    choices=PYTORCH_CONFIGS, help="PyTorch's configuration")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=sn.runtime.GRAPH_WARMUP + 1)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    common.add_out_argument(ap)
    ap.add_argument("--merge", action="store_true",
                    help="keep the other configurations already in the --out file")
    args = ap.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    if args.gpus < 2 or (torch.cuda.is_available() and args.gpus > torch.cuda.device_count()):
        ap.error(f"--gpus must be between 2 and the GPUs present, got {args.gpus}")
    if args.steps < 1 or args.warmup < sn.runtime.GRAPH_WARMUP + 1:
        ap.error(f"--steps must be >= 1 and --warmup >= {sn.runtime.GRAPH_WARMUP + 1}, so "
                 "graphed runs time replays only")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"        # NVLink multicast off (the device notes)
    result = {"model": args.model, "gpus": args.gpus, "memory_per_gpu": args.memory,
              "pytorch_config": args.pytorch, "steps": args.steps, "warmup": args.warmup,
              "timer": "wall clock over the timed steps on rank 0, synchronized",
              "sgd": {"lr": args.lr, "momentum": args.momentum,
                      "weight_decay": args.weight_decay},
              "configs": common.read(args.out).get("configs", {}) if args.merge else {}}
    for name in args.configs.split(","):
        result["configs"][name] = configuration(name, args)
        print(describe(name, result["configs"][name], args.gpus), flush=True)
        common.write(args.out, result)
    if args.out:
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
