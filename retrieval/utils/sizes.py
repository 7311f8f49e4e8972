"""Byte counts for people, in binary units (what ``free`` and ``top`` show and what ``--max-index-memory`` takes)."""

from __future__ import annotations

BYTE_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def size_text(count: float) -> str:
    """A byte count with three significant digits: ``125 KiB``, ``39.0 KiB``, ``1.50 GiB``, ``512 bytes``."""
    value, unit = float(count), 0
    while abs(value) >= 1024 and unit < len(BYTE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value):,} bytes"
    decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{decimals}f} {BYTE_UNITS[unit]}"
