"""Read and write the human units of the ZeRO paper: "7.5B" parameters, "32GB" GPUs, "50GB/s" links.

The paper counts memory in decimal gigabytes (ZeRO §5, Table 1: 7.5B parameters × 16 bytes = 120 GB, so
GB = 1e9 bytes), while `nvidia-smi` and DeepSpeed's estimators print binary GiB (2**30 bytes). Both appear
in this course, so every parser here says which one it means, and `format_bytes` labels GiB as GiB.
Pure Python: planners and lessons use it without importing torch.
"""

from __future__ import annotations

import re
from decimal import Decimal

GB = 10**9
GiB = 2**30

_COUNT_SCALES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_BYTE_SCALES = {
    "B": 1,
    "KB": 10**3, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_BIT_SCALES = {
    "bit": 1, "b": 1,
    "Kbit": 10**3, "Kb": 10**3, "kbit": 10**3, "kb": 10**3,
    "Mbit": 10**6, "Mb": 10**6, "Gbit": 10**9, "Gb": 10**9, "Tbit": 10**12, "Tb": 10**12,
}
_NUMBER_AND_UNIT = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z/]*)\s*$")


def _split(text: str | float, what: str, example: str) -> tuple[Decimal, str]:
    """Split "7.5B" into (Decimal("7.5"), "B"); a malformed or negative value names itself in the error."""
    match = _NUMBER_AND_UNIT.match(str(text))
    if match is None:
        raise ValueError(f"could not read {text!r} as {what}; write it like {example}")
    number = Decimal(match.group(1))
    if number < 0:
        raise ValueError(f"{what} cannot be negative, got {text!r}; write it like {example}")
    return number, match.group(2)


def parse_count(text: str | int) -> int:
    """A parameter count: "7.5B" -> 7_500_000_000 (K, M, B, T = 1e3, 1e6, 1e9, 1e12), "1.3e9", 1300."""
    what, example = "a parameter count", "7.5B or 1.3e9"
    number, suffix = _split(text, what, example)
    scale = _COUNT_SCALES.get(suffix.upper())
    if scale is None:
        raise ValueError(f"could not read {text!r} as {what}; write it like {example}")
    count = number * scale
    if count == 0:
        raise ValueError(f"a model needs at least one parameter, got {text!r}; write it like {example}")
    if count != count.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of parameters; write it like {example}")
    return int(count)


def _no_unit(text: str | float, what: str, example: str) -> ValueError:
    """The error for a size written without its unit: "40" could be bytes, GB or GiB, so it is none of them."""
    return ValueError(
        f"{text!r} has no unit: write {what} with one, like {example} (a bare number is not read as bytes)"
    )


def parse_bytes(text: str | int) -> int:
    """A memory size in bytes: "32GB" -> 32e9 (KB..TB decimal, as the paper), "16GiB" -> 16·2**30, "512B".

    A string needs its unit ("0" aside): "40" could mean 40 bytes, 40 GB or 40 GiB, and reading it as bytes
    would answer a different question without a word. A Python int is bytes.
    """
    what, example = "a memory size", "32GB or 16GiB"
    if isinstance(text, int):
        return _check_bytes(Decimal(text), text, what, example)
    number, unit = _split(text, what, example)
    if not unit and number != 0:
        raise _no_unit(text, what, example)
    scale = _BYTE_SCALES.get(unit or "B")
    if scale is None:
        raise ValueError(f"could not read {text!r} as {what}; write it like {example}")
    return _check_bytes(number * scale, text, what, example)


def _check_bytes(size: Decimal, text: str | int, what: str, example: str) -> int:
    if size < 0:
        raise ValueError(f"{what} cannot be negative, got {text!r}; write it like {example}")
    if size != size.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes; write it like {example}")
    return int(size)


def parse_bandwidth(text: str | float) -> float:
    """A link bandwidth in bytes per second: "50GB/s" -> 5e10, "100Gbit/s" or "100Gb/s" -> 1.25e10.

    Network links are sold in bits per second and GPU links in bytes per second; the case of the "b"
    tells them apart, as in vendor data sheets. A bare number is an error: bits or bytes, and per what?
    """
    what, example = "a bandwidth", "50GB/s or 100Gbit/s"
    number, unit = _split(text, what, example)
    if not unit:
        raise _no_unit(text, what, example)
    if unit and not unit.endswith("/s"):
        raise ValueError(f"could not read {text!r} as {what} (no '/s'); write it like {example}")
    unit = unit.removesuffix("/s")
    if unit in _BIT_SCALES:
        bytes_per_s = number * _BIT_SCALES[unit] / 8
    elif unit in _BYTE_SCALES:
        bytes_per_s = number * _BYTE_SCALES[unit]
    else:
        raise ValueError(f"could not read {text!r} as {what}; write it like {example}")
    if bytes_per_s == 0:
        raise ValueError(f"a link needs a positive bandwidth, got {text!r}; write it like {example}")
    return float(bytes_per_s)


def format_bytes(n_bytes: float, unit: str = "GB", digits: int = 2) -> str:
    """120e9 -> "120.00 GB"; decimal GB by default to match the paper, "GiB" when asked (and so labelled)."""
    scale = _BYTE_SCALES.get(unit)
    if scale is None:
        raise ValueError(f"unknown byte unit {unit!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return f"{n_bytes / scale:.{digits}f} {unit}"


def format_count(count: float) -> str:
    """7_500_000_000 -> "7.5B", 1e12 -> "1T": the way the paper names its models (ZeRO §5, Table 1)."""
    for suffix in ("T", "B", "M", "K"):
        scale = _COUNT_SCALES[suffix]
        if abs(count) >= scale:
            value = count / scale
            text = f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
            return text + suffix
    return f"{count:.4g}"


def format_seconds(seconds: float) -> str:
    """0.6 -> "600.0 ms", 2.5e-5 -> "25.0 µs", 90 -> "1.50 min": the largest unit that keeps a leading digit."""
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {seconds!r} s")
    if seconds == 0:
        return "0 s"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.2f} min"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e9:.1f} ns"
