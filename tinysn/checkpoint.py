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
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch

FORMAT = "tinysn-checkpoint/1"
_KEY = "tinysn"          # the safetensors metadata entry holding the JSON header


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
