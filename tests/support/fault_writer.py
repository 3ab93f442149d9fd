"""Hooks that stall a save so a test can kill a rank mid-save.

`StallingWriter` stalls after `write_data` completed; `StallingPlanner` stalls in the
middle of the byte copy. The writer's stall comes after `write_data` completed (the rank's file is in the memory tier) and
before the coordinator's `finish` commits the checkpoint: the window in which a crash
must leave the previous checkpoint intact and get the partial one collected.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from tierckpt import TieredStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

__all__ = ["StallingPlanner", "StallingWriter"]


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


class StallingPlanner(DefaultSavePlanner):
    """Stalls in the middle of writing a rank's data: on its `stall_at`-th tensor item.

    By then the rank's file is open in the memory tier and partly written, and nothing of
    it is committed: a kill here is a crash in the middle of the byte copy.
    """

    def __init__(self, job_dir: str, rank: int, *, stall_at: int = 2, hold_seconds: float = 300.0):
        super().__init__()
        self._stall_marker = Path(job_dir, "markers", f"in_write.rank{rank}")
        self._stall_at = stall_at
        self._stall_seconds = hold_seconds
        self._tensor_items = 0
        self._lock = threading.Lock()

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            with self._lock:
                self._tensor_items += 1
                stall = self._tensor_items == self._stall_at
            if stall:
                self._stall_marker.parent.mkdir(parents=True, exist_ok=True)
                self._stall_marker.write_text(str(os.getpid()))
                time.sleep(self._stall_seconds)
        return super().resolve_data(write_item)
