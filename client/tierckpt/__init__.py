"""tierckpt: tiered checkpoint storage for PyTorch distributed training.

`TieredStorageWriter` / `TieredStorageReader` plug into `torch.distributed.checkpoint`
(`dcp.save`, `dcp.async_save`, `dcp.load`) and keep checkpoints in the node daemon's
shared-memory tier. They are imported lazily so the CLI starts without importing torch.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from tierckpt.completion import CheckpointRef, Tier, TierState, tier_state, wait_for
from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointLost,
    CheckpointNotFound,
    ChecksumMismatch,
    DaemonTimeout,
    DaemonUnavailable,
    InvalidArgument,
    InvalidName,
    MemoryBudgetExceeded,
    NoPersistentTier,
    NotAJobNode,
    PermissionDenied,
    TierckptError,
    TierTimeout,
    TierUnavailable,
    UnsafeMetadata,
)
from tierckpt.trust import Trust, mark

if TYPE_CHECKING:
    from tierckpt.staging import StagingStats
    from tierckpt.storage_reader import TieredStorageReader
    from tierckpt.storage_writer import TieredStorageWriter

__version__ = "0.1.0"

# A library logs but never configures logging: without a handler of the application's,
# nothing is printed (not even via logging.lastResort).
logging.getLogger("tierckpt").addHandler(logging.NullHandler())

__all__ = [
    "CheckpointExists",
    "CheckpointIncomplete",
    "CheckpointLost",
    "CheckpointNotFound",
    "CheckpointRef",
    "ChecksumMismatch",
    "DaemonTimeout",
    "DaemonUnavailable",
    "InvalidArgument",
    "InvalidName",
    "MemoryBudgetExceeded",
    "NoPersistentTier",
    "NotAJobNode",
    "PermissionDenied",
    "Tier",
    "TierState",
    "TierTimeout",
    "TierUnavailable",
    "Trust",
    "TierckptError",
    "TieredStorageReader",
    "TieredStorageWriter",
    "UnsafeMetadata",
    "__version__",
    "mark",
    "release_staging",
    "staging_stats",
    "tier_state",
    "wait_for",
]


def release_staging(namespace: str | None = None) -> int:
    """Free this process's async_save staging buffers of `namespace` (None: all); their bytes.

    `dcp.async_save` with a TieredStorageWriter keeps one shared-memory copy of the state per
    namespace and layout for the whole process, so later saves only copy. Call this when a
    namespace will not be saved again; a save still in flight keeps its buffers until it ends.
    """
    staging = sys.modules.get("tierckpt.staging")  # nothing staged yet: don't import torch
    return 0 if staging is None else int(staging.release_staging(namespace))


def staging_stats() -> StagingStats:
    """Staging buffers this process holds (namespaces, sets, bytes) and allocations/reuses."""
    from tierckpt.staging import staging_stats as stats

    return stats()


def __getattr__(name: str) -> Any:
    if name == "TieredStorageWriter":
        from tierckpt.storage_writer import TieredStorageWriter

        return TieredStorageWriter
    if name == "TieredStorageReader":
        from tierckpt.storage_reader import TieredStorageReader

        return TieredStorageReader
    raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
