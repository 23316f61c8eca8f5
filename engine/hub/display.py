"""Sizes and durations written the way people read them."""

from __future__ import annotations


def format_size(n: int | float) -> str:
    """Decimal units, the way disks and the Hub count: 61.07 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_duration(seconds: float | None) -> str:
    """An ETA the way people read one: 45s, 12m05s, 2h07m; "?" when unknown."""
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
