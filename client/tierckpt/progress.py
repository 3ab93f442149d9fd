"""A one-line progress bar for long CLI copies (`tierckpt pull`), drawn only on a
terminal: piped or redirected output, and `--json`, stay free of control characters."""

from __future__ import annotations

import time
from typing import TextIO

from tierckpt.units import format_size

__all__ = ["Progress", "format_age"]

_WIDTH = 24
_REDRAW = 0.1  # seconds between redraws; the last one always shows


def format_age(seconds: float) -> str:
    """A short age ("42s", "5m03s", "2h04m", "3d05h"); a future time (clock skew) is "0s"."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class Progress:
    """Bytes and files done of a known total, redrawn in place on `stream` when it is a
    terminal (`enabled`); `close()` ends the line."""

    def __init__(self, label: str, total_bytes: int, total_files: int, stream: TextIO) -> None:
        self.label = label
        self.total_bytes = max(0, total_bytes)
        self.total_files = total_files
        self.stream = stream
        self.enabled = stream.isatty()
        self.done_bytes = 0
        self.done_files = 0
        self._drawn = 0.0
        self._started = time.monotonic()

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        self.done_bytes += nbytes
        self.done_files += files
        now = time.monotonic()
        if self.enabled and (files or now - self._drawn >= _REDRAW):
            self._drawn = now
            self.stream.write("\r" + self.line(now - self._started))
            self.stream.flush()

    def line(self, elapsed: float) -> str:
        """The bar as drawn after `elapsed` seconds."""
        share = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        share = min(1.0, share)
        filled = int(share * _WIDTH)
        rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
        return (
            f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {share:4.0%} "
            f"{format_size(self.done_bytes)} of {format_size(self.total_bytes)}, "
            f"{self.done_files}/{self.total_files} files, {format_size(int(rate))}/s"
        )

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
