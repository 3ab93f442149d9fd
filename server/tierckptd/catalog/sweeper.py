"""The sweeper thread: aborts saves whose ranks died mid-save (`Catalog.sweep`, or with
a peer tier `peers.unfinished.UnfinishedSaves.sweep`, which asks the peers first)."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

__all__ = ["Sweeper"]

logger = logging.getLogger("tierckptd.catalog")


class Sweepable(Protocol):
    def sweep(self) -> object: ...


class Sweeper(threading.Thread):
    """Calls `sweep()` of what it was given every `interval` seconds until stopped."""

    def __init__(self, catalog: Sweepable, interval: float = 5.0) -> None:
        super().__init__(name="tierckptd-sweeper", daemon=True)
        self.catalog = catalog
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.catalog.sweep()
            except Exception:
                logger.exception("sweeper failed; retrying in %.0f s", self.interval)

    def stop(self) -> None:
        self._stop_event.set()
