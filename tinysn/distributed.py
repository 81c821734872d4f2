"""Data-parallel training over torch.distributed, each rank under its own memory cap.

`Runtime(net, ..., process_group=pg)` makes each process of `pg` one rank: it has its own
pool, plan and cap and trains on its own shard of the batch (`net.batch` is the local
batch; the caller passes the local images and labels). The ranks stay equal because:

- at construction rank 0's parameters and batch-norm statistics are broadcast, from pool
  buffer to pool buffer (`GradientSync.broadcast`);
- in the backward pass the parameter gradients are all-reduced in buckets: consecutive
  layers in backward order, each bucket closed once it holds at least `bucket_bytes` of
  gradients (a `Runtime` option, default `liveness.BUCKET_BYTES`, 25 MiB as DDP's;
  `liveness.group_buckets`). Right after the backward kernel of a bucket's last layer
  has written its gradients, the bucket's all-reduce starts: asynchronously, in place on
  the pool buffers, as ONE coalesced call over all the bucket's gradient tensors
  (`ProcessGroup.allreduce_coalesced`, what torch.distributed's `_coalescing_manager`
  and the deprecated `all_reduce_coalesced` call too; NCCL (torch 2.11) groups one
  all-reduce per tensor into one NCCL group launch, reading and writing the buffers in
  place; gloo (torch 2.13, CPU) flattens the tensors into a host buffer of its own,
  reduces that and copies the sums back). On another backend (not in
  `COALESCING_BACKENDS`) a bucket is one asynchronous call per tensor, waited for
  together. It runs while the next backward kernels do. The
  SGD updates of the bucket's layers are part of the backward pass `UPDATE_LAG` passes
  after the bucket's last layer (sched/liveness.py: `Program.updates`): after that pass's
  kernel, the updates wait for the bucket's all-reduce, average (sum / world size) and
  apply SGD. The planner sees the start pass read every gradient of the bucket and the
  update pass read them again, so their liveness spans the all-reduce, every policy's
  plan accounts for those bytes and peak == plan still holds. The last buckets (the
  first layers) update at the last pass, after waiting: nothing is left to overlap them
  with. No bucket buffer exists: the collectives read and write the gradients where the
  plan put them, and no device byte is copied.

Semantics: after a step, every rank's parameters equal those of single-process training on
the concatenation of the ranks' batches (rank order), up to the order of the reduction (the
loss is each rank's mean, the gradients are averaged over ranks). Batch norm normalises
with each rank's own batch statistics and keeps its own running statistics, as PyTorch's
DistributedDataParallel does without SyncBatchNorm and with `broadcast_buffers=False`.
Run to run the result is bitwise the same (same world size, same backend, same conv
algorithms: pin them with `conv_algos` where rankings are measured): the collectives are
deterministic for a fixed group and every kernel is. Every rank must build the same network
at the same local batch and bucket size; `check_group` compares them before anything is
planned. Under a CUDA graph (`cuda_graph=True`) the NCCL all-reduces and their waits are
captured with the step; the eager warm-up steps create the communicators before the
capture.

NCCL needs CUDA devices (one per rank: `from_env` selects LOCAL_RANK's); gloo runs on CPUs.
"""
from __future__ import annotations

import os
import socket
import zlib

import torch
import torch.distributed as dist

from .errors import OutOfMemory


COALESCING_BACKENDS = ("gloo", "nccl")   # those whose allreduce_coalesced a bucket uses


def check_group(group, device, net, bucket_bytes: int) -> None:
    """Raise ValueError unless `group` is None or a usable process group for `device` whose
    ranks all train the same `net` with the same buckets (a collective: every rank calls
    it; ranks with other buckets would pair unequal collectives)."""
    if group is None:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group given, but torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"process_group must be a torch.distributed ProcessGroup or None, "
                         f"got {type(group).__name__}")
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.device(device).type != "cuda":
        raise ValueError(f"process_group uses NCCL, which needs device 'cuda', got {device}")
    mine = zlib.crc32(repr((net.batch, net.input_shape, net.classes, bucket_bytes,
                            sorted(net.param_shapes().items()))).encode())
    fingerprints = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(fingerprints, op=dist.ReduceOp.MIN, group=group)
    if fingerprints.tolist() != [mine, -mine]:
        raise ValueError("the ranks of process_group build different networks, local "
                         "batches or buckets; every rank must train the same net at the "
                         "same batch with the same bucket_bytes")


def plan_everywhere(group, device, make_plan):
    """`make_plan()`, and with a group the ranks' agreement that every rank's plan fits: a
    rank whose plan fits raises OutOfMemory too when another's does not (a collective), so
    no rank goes on alone into the broadcast and waits there forever."""
    if group is None:
        return make_plan()
    try:
        result, error = make_plan(), None
    except OutOfMemory as err:
        result, error = None, err
    fits = torch.tensor([int(error is None)], dtype=torch.int64, device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=group)
    if error is not None:
        raise error
    if not fits.item():
        raise OutOfMemory("another rank's plan does not fit its cap, so no rank trains")
    return result


class GradientSync:
    """All-reduces the parameter gradients of each bucket of `program.buckets` across the
    ranks of `group`, straight from the pool buffers of the runtime's `tensors` (indexed by
    tensor id; a list, not the Runtime, so that nothing refers back to the Runtime)."""

    def __init__(self, program, group, tensors):
        self.group, self.tensors = group, tensors
        self.world = dist.get_world_size(group)
        self.source = dist.get_global_rank(group, 0)
        self.coalesce = dist.get_backend(group) in COALESCING_BACKENDS
        self.grads = {bucket: [program.pgrad[f"{layer.name}.{s}"]
                               for layer in bucket for s in layer.params]
                      for bucket in program.buckets}
        self._pending = {}          # bucket -> (gradient views, collective handles)

    def broadcast(self, tensor_ids) -> None:
        """Copy rank 0's values of the tensors `tensor_ids` to every rank (in place)."""
        for tid in tensor_ids:
            dist.broadcast(self.tensors[tid].view(), src=self.source, group=self.group)

    def start(self, bucket) -> None:
        """Start summing `bucket`'s gradients over the ranks (returns at once): one coalesced
        collective, or one per tensor where the backend has none."""
        if bucket in self._pending:
            raise RuntimeError(f"all-reduce of {_name(bucket)} started twice")
        views = [self.tensors[tid].view() for tid in self.grads[bucket]]
        if self.coalesce:
            options = dist.AllreduceCoalescedOptions()
            options.reduceOp, options.asyncOp = dist.ReduceOp.SUM, True
            works = [self.group.allreduce_coalesced(views, options)]
        else:
            works = [dist.all_reduce(v, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                     for v in views]
        self._pending[bucket] = (views, works)

    def finish(self, bucket) -> None:
        """Wait for `bucket`'s all-reduce (on CUDA: the compute stream waits, not the host)
        and turn the sums into averages."""
        if bucket not in self._pending:
            raise RuntimeError(f"update of {_name(bucket)} before its gradients' all-reduce")
        views, works = self._pending.pop(bucket)
        for work in works:
            work.wait()
        for v in views:
            v.div_(self.world)


def _name(bucket) -> str:
    """A bucket as its layers, for messages: 'the bucket of fc' or '... of c3..c1'."""
    names = bucket[0].name if len(bucket) == 1 else f"{bucket[0].name}..{bucket[-1].name}"
    return f"the bucket of {names}"


def from_env(device=None):
    """(group, rank, world size) from torchrun's environment: initialises the default
    process group (NCCL for CUDA, gloo for the CPU) when WORLD_SIZE > 1, else (None, 0, 1).
    On CUDA each process takes the GPU LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None, 0, 1
    cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def close(group) -> None:
    """Tear down what `from_env` set up (nothing when `group` is None)."""
    if group is not None:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous of local processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard(images, labels, rank: int, world: int):
    """Rank `rank`'s contiguous share of a global batch (its size must divide by `world`)."""
    n = len(labels)
    if n % world:
        raise ValueError(f"a batch of {n} does not split evenly over {world} ranks")
    size = n // world
    part = slice(rank * size, (rank + 1) * size)
    return images[part].contiguous(), labels[part].contiguous()
