"""Byte counts written the way people write them: 1024, "512MiB", "12GiB", "1.5GB"."""
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> int:
    """Return `value` as a whole number of bytes; raise ValueError on anything unclear."""
    if isinstance(value, bool):
        raise ValueError(f"memory must be bytes or a string like '12GiB', got {value!r}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a byte count (try '512MiB' or '12GiB')")
        nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    else:
        raise ValueError(f"memory must be bytes or a string like '12GiB', got {value!r}")
    if nbytes <= 0:
        raise ValueError(f"memory must be positive, got {value!r}")
    return nbytes


def format_bytes(nbytes: int) -> str:
    """Short human form: 1536 -> '1.5 KiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
