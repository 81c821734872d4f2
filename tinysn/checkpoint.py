"""Checkpoints: a Runtime's whole training state in one safetensors file, written atomically.

    checkpoint.save(rt, "run.safetensors")      # rt.state_dict(), plus a small JSON header
    checkpoint.load(rt, "run.safetensors")      # rt.load_state_dict(...) after every check

The tensors are rt.state_dict()'s (parameters under torch's names, batch-norm statistics,
momentum buffers, iteration and seed). The safetensors metadata holds one JSON header: the
format, the net's fingerprint (its layers, shapes and hyper-parameters; not the batch, cap
or policy, so a run may resume under another policy or cap) and a SHA-256 of the tensor data.
A file is written to a temporary file in the same directory, flushed to disk, then renamed
over the target, so a reader sees the old checkpoint or the new one, never a torn one; a file
damaged anyway (truncated, bytes flipped, another net's) fails with one CheckpointError.

The Runtime's `params`, `load_params`, `state_dict` and `load_state_dict` are the functions
of the same names here (each takes the runtime), so the state a file holds and the state a
runtime gives and takes are defined in one place.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch

from .ops import spec

FORMAT = "tinysn-checkpoint/1"
_KEY = "tinysn"          # the safetensors metadata entry holding the JSON header
MOMENTUM_SUFFIX = ".momentum_buffer"   # state_dict() name of a parameter's momentum buffer


class CheckpointError(ValueError):
    """A checkpoint file that cannot be restored: unreadable, damaged, or another net's."""


def fingerprint(net) -> str:
    """SHA-256 of the net's structure: layer names, ops, inputs, per-sample shapes,
    hyper-parameters, parameter shapes; the input shape and classes. Not the batch."""
    layers = [[layer.name, layer.op, [x.name for x in layer.inputs], list(layer.shape[1:]),
               sorted(layer.attrs.items()), sorted(layer.params.items()),
               sorted(layer.buffers.items())] for layer in net.layers]
    text = json.dumps([list(net.input_shape), net.classes, layers], default=list)
    return hashlib.sha256(text.encode()).hexdigest()


def save(rt, path) -> None:
    """Write rt.state_dict() to `path` atomically (temp file, fsync, rename)."""
    from safetensors.torch import save as to_bytes

    tensors = rt.state_dict()
    header = {"format": FORMAT, "net": fingerprint(rt.net), "sha256": _digest(tensors)}
    _write_atomically(os.fspath(path), to_bytes(tensors, metadata={_KEY: json.dumps(header)}))


def load(rt, path) -> dict:
    """Restore `rt` from the checkpoint at `path`; returns its header. Raises
    CheckpointError, before changing anything, if the file is damaged or another net's."""
    tensors, header = read(path)
    if header["net"] != fingerprint(rt.net):
        raise CheckpointError(f"checkpoint {path}: saved from a different net "
                              "(its layers, shapes or hyper-parameters differ)")
    try:
        rt.load_state_dict(tensors)
    except ValueError as err:     # e.g. saved with momentum, restored without
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    return header


def read(path) -> tuple[dict, dict]:
    """(tensors, header) of a checkpoint file, each checked: format, digest."""
    from safetensors.torch import load as from_bytes

    try:
        with open(path, "rb") as f:
            blob = f.read()
        tensors = from_bytes(blob)
        # safetensors layout: 8-byte little-endian length, then its JSON header
        size = int.from_bytes(blob[:8], "little")
        header = json.loads(json.loads(blob[8:8 + size])["__metadata__"][_KEY])
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file") from None
    except Exception as err:          # safetensors, JSON and missing-key errors alike
        raise CheckpointError(f"checkpoint {path}: not a readable tinysn checkpoint "
                              f"({type(err).__name__}: {err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: unknown format {header!r}")
    if header.get("sha256") != _digest(tensors):
        raise CheckpointError(f"checkpoint {path}: tensor data does not match its checksum "
                              "(the file is damaged)")
    return tensors, header


def _digest(tensors: dict) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _write_atomically(path: str, blob: bytes) -> None:
    """Write `blob` to a temporary file beside `path`, fsync it, rename it over `path`,
    and fsync the directory so the rename itself survives a crash."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- a runtime's state, as rt.params() / rt.state_dict() give it and take it back ------------
def params(rt) -> dict:
    """Parameters and batch-norm statistics in torch layouts (CPU copies)."""
    named = {**rt.program.param, **rt.program.buffer}
    return {name: rt.view(tid).detach().to("cpu", copy=True) for name, tid in named.items()}


def load_params(rt, state: dict) -> None:
    """Copy parameters (and bn statistics) in; names and shapes must match exactly. A torch
    module's state_dict loads as it is: its batch norms' num_batches_tracked counters (which
    tinysn does not use) are skipped."""
    named = {**rt.program.param, **rt.program.buffer}
    state = {k: v for k, v in state.items() if not _batch_counter(rt.net, k)}
    unknown = sorted(set(state) - set(named))
    missing = sorted(set(rt.program.param) - set(state))
    if unknown or missing:
        raise ValueError(f"load_params: unknown names {unknown}, missing parameters {missing}")
    for name, value in state.items():
        want = rt.tensors[named[name]].shape
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"load_params: {name} must have shape {want}, got {got}")
    for name, value in state.items():
        rt.view(named[name]).copy_(value)


def state_dict(rt) -> dict:
    """Everything a run needs to continue bitwise as if never stopped, as CPU tensors:
    parameters and batch-norm statistics under torch's names (as params()), each momentum
    buffer as "<parameter>.momentum_buffer", and "iteration" (the steps taken) and "seed" as
    0-d int64 tensors (dropout draws its masks from both; the iteration equals the device
    counter its kernels read)."""
    state = {name: rt.view(tid).detach().to("cpu", copy=True)
             for name, tid in _state_tensors(rt).items()}
    state["iteration"] = torch.tensor(rt.stats.iterations, dtype=torch.int64)
    state["seed"] = torch.tensor(rt.seed, dtype=torch.int64)
    return state


def load_state_dict(rt, state: dict) -> None:
    """Restore a state_dict(): every entry must be present with its shape and dtype and no
    other; nothing changes unless all of them are."""
    want = _state_layout(rt)
    if not isinstance(state, dict) or set(state) != set(want):
        names = set(state) if isinstance(state, dict) else set()
        raise ValueError(f"load_state_dict: unknown names {sorted(names - set(want))}, "
                         f"missing {sorted(set(want) - names)}")
    for name, (shape, dtype) in want.items():
        value = state[name]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape \
                or value.dtype != dtype:
            got = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise ValueError(f"load_state_dict: {name} must be {shape} {dtype}, got {got}")
    for name in ("iteration", "seed"):
        if int(state[name]) < 0:
            raise ValueError(f"load_state_dict: {name} must be >= 0, got {int(state[name])}")
    for name, tid in _state_tensors(rt).items():
        rt.view(tid).copy_(state[name])
    rt.stats.iterations = int(state["iteration"])
    rt.seed = int(state["seed"])
    if rt.program.iteration is not None:          # the device counter masks are drawn from
        rt.view(rt.program.iteration).fill_(rt.stats.iterations)


def _state_tensors(rt) -> dict:
    """state_dict()'s float32 entries -> tensor id: params, bn statistics, momentum."""
    p = rt.program
    return {**p.param, **p.buffer,
            **{name + MOMENTUM_SUFFIX: tid for name, tid in p.momentum.items()}}


def _state_layout(rt) -> dict:
    """state_dict()'s names -> (shape, dtype)."""
    layout = {name: (tuple(rt.tensors[tid].shape), torch.float32)
              for name, tid in _state_tensors(rt).items()}
    layout.update({"iteration": ((), torch.int64), "seed": ((), torch.int64)})
    return layout


def _batch_counter(net, name) -> bool:
    """Is `name` torch's "<layer>.num_batches_tracked" for a layer of `net` whose torch twin
    keeps one (batch norm)?"""
    layer, _, suffix = name.rpartition(".")
    return suffix == "num_batches_tracked" and layer in net and spec(net[layer]).counts_batches
