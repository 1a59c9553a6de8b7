"""Byte sizes as users write them (``--max-shard-size 2GB``, ``5MiB``), as huggingface_hub
reads them: KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024."""

from __future__ import annotations

import os
import re

from .errors import UsageError

SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}


def parse_size(text: str | int) -> int:
    """``2GB`` -> 2_000_000_000, ``1.5GiB`` -> 1610612736, ``1000`` -> 1000 (as huggingface_hub)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m or m.group(2) and m.group(2).upper() not in SIZE_UNITS:
        raise UsageError(
            f"bad size {text!r}", hint="use bytes or a number with KB/MB/GB or KiB/MiB/GiB"
        )
    size = int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "").upper()])
    if size <= 0:
        raise UsageError(f"size must be positive, got {text!r}")
    return size


def env_size(name: str, default: int | None = None) -> int | None:
    """The size the environment variable ``name`` gives (bytes, or a number with a unit,
    as :func:`parse_size` reads it), ``default`` where it is unset or empty: one parser
    for every size, options and environment alike.

    Raises:
        UsageError: A value that is no size, naming the variable.
    """
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(
            f"bad {name}={text!r}", hint="bytes, or a number with KB/MB/GB or KiB/MiB/GiB"
        ) from None


def human_bytes(n: float) -> str:
    """Binary units everywhere (inspect, diff, progress bars, 'wrote' lines): 12.6 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
