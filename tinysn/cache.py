"""tinysn's on-disk cache: measurements worth keeping between runs (conv rankings, ...).

The folder is $TINYSN_CACHE_DIR when set, else ~/.cache/tinysn. Writers create it when they
first store something; `clear()` deletes it with everything in it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (not created here): $TINYSN_CACHE_DIR, else ~/.cache/tinysn."""
    configured = os.environ.get("TINYSN_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "tinysn"


def clear() -> None:
    """Delete the cache folder and everything in it (nothing happens if there is none)."""
    shutil.rmtree(cache_dir(), ignore_errors=True)
