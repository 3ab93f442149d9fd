"""A TieredStorageWriter that stalls after its data is written, so a test can kill the rank mid-save.

The stall comes after `write_data` completed (the rank's file is in the memory tier) and
before the coordinator's `finish` commits the checkpoint: the window in which a crash
must leave the previous checkpoint intact and get the partial one collected.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tierckpt import TieredStorageWriter

__all__ = ["StallingWriter"]


class StallingWriter(TieredStorageWriter):  # type: ignore[misc]
    def configure_stall(self, job_dir: str, rank: int, hold_seconds: float) -> None:
        self._stall_marker = Path(job_dir, "markers", f"in_write.rank{rank}")
        self._stall_seconds = hold_seconds

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()
        self._stall_marker.parent.mkdir(parents=True, exist_ok=True)
        self._stall_marker.write_text(str(os.getpid()))
        time.sleep(self._stall_seconds)
        return future
