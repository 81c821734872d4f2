"""Byte counts written the way people write them: 1024, "512MiB", "12GiB", "1.5GB"."""
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_POWERS = {"K": 10, "M": 20, "G": 30, "T": 40}   # for the hint on "12G"


def parse_bytes(value) -> int:
    """Return `value` as a whole number of bytes >= 1; raise ValueError on anything unclear.

    A bare number is bytes and must be whole ("1e9" and "0.5" are refused); with a unit a
    fraction is fine ("1.5GiB"). "12G" is refused too: GiB (2**30) and GB (10**9) differ."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"memory must be bytes or a string like '12GiB', got {value!r}")
    nbytes = value if isinstance(value, int) else _read_bytes(value)
    if nbytes < 1:
        raise ValueError(f"memory must be at least 1 byte, got {value!r}")
    return nbytes


def _read_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match and unit in _UNITS:
        number = match.group(1)
        if unit in ("", "B") and not number.isdigit():
            raise ValueError(f"a byte count without a unit must be a whole number, got {text!r}")
        return int(float(number) * _UNITS[unit])
    hint = ""
    if match and unit in ("K", "M", "G", "T"):
        hint = f": write {match.group(1)}{unit}iB (2**{_POWERS[unit]}) or {match.group(1)}{unit}B"
    raise ValueError(f"cannot read {text!r} as a byte count{hint}")


def format_bytes(nbytes: int) -> str:
    """Short human form: 1536 -> '1.5 KiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
