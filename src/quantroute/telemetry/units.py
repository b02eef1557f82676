"""Byte sizes as people write them (``24GiB``, ``512 MiB``, ``8GB``) and back."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``"24GiB"`` → 25769803776, ``"8GB"`` → 8000000000, ``1024`` → 1024.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones
    (KB, MB, GB, TB) powers of 1000. Raises ``ValueError`` on anything else.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"negative byte size: {text}")
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a byte size: {text!r}")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}")
    return round(float(number) * factor)


def format_bytes(n: int | None) -> str:
    """``25769803776`` → ``"24.0 GiB"``; ``None`` → ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
