"""Sizes for people: the one formatter the CLI, the daemon's logs and its error messages use."""

from __future__ import annotations

__all__ = ["format_size"]

_UNITS = ("B", "KiB", "MiB", "GiB")


def format_size(n: float) -> str:
    """A binary size with one decimal ("512 B", "1.5 GiB", "2048.0 TiB"), as error
    messages quote budgets and `tierckpt ls` shows checkpoints."""
    for unit in _UNITS:
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
