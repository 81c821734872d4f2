"""tinysn's on-disk cache: what a GPU start measures once and reuses in later processes.

Kernel tuning results (which autotune config each kernel runs for each shape) and conv
algorithm rankings are stored here, one small JSON file per entry, so that a second run on
the same machine skips the tuning. Every key includes `device_key()`: the GPU's name and the
triton and torch versions, so a new GPU or a new release measures afresh.

Location: `$TINYSN_CACHE_DIR` if set, else `$XDG_CACHE_HOME/tinysn`, else `~/.cache/tinysn`.
Clear it with `python3 -m tinysn cache --clear` (or `rm -r` the directory): nothing in it is
needed for correctness, only for a fast start.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """The cache directory (not created here; `store` creates what it writes into)."""
    explicit = os.environ.get("TINYSN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tinysn"


def clear() -> int:
    """Delete the cache directory and everything in it; return the number of files removed."""
    root = cache_dir()
    if not root.exists():
        return 0
    count = sum(1 for p in root.rglob("*") if p.is_file())
    shutil.rmtree(root)
    return count


def device_key(device=None) -> tuple:
    """(GPU name, triton version, torch version): a measurement is valid only for these."""
    import torch
    import triton

    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    return (name, triton.__version__, torch.__version__)


def _entry_path(kind: str, key) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache_dir() / kind / f"{digest}.json"


def lookup(kind: str, key):
    """The value stored under (`kind`, `key`), or None (absent, unreadable or a hash clash)."""
    path = _entry_path(kind, key)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if entry.get("key") != json.loads(json.dumps(key, default=str)):
        return None
    return entry.get("value")


def store(kind: str, key, value) -> None:
    """Write `value` (JSON-serialisable) under (`kind`, `key`), atomically (a concurrent
    reader sees the old entry or the new one, never half a file). A cache that cannot be
    written (read-only home, full disk) is skipped: it only costs the next start time."""
    path = _entry_path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f, default=str)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
