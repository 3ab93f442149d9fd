"""tierckpt: tiered checkpoint storage for PyTorch distributed training.

`TieredStorageWriter` / `TieredStorageReader` plug into `torch.distributed.checkpoint`
(`dcp.save`, `dcp.async_save`, `dcp.load`) and keep checkpoints in the node daemon's
shared-memory tier. They are imported lazily so the CLI starts without importing torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointNotFound,
    ChecksumMismatch,
    DaemonTimeout,
    DaemonUnavailable,
    InvalidArgument,
    InvalidName,
    MemoryBudgetExceeded,
    PermissionDenied,
    TierckptError,
    TierUnavailable,
    UnsafeMetadata,
)

if TYPE_CHECKING:
    from tierckpt.storage_reader import TieredStorageReader
    from tierckpt.storage_writer import TieredStorageWriter

__version__ = "0.1.0"

# A library logs but never configures logging: without a handler of the application's,
# nothing is printed (not even via logging.lastResort).
logging.getLogger("tierckpt").addHandler(logging.NullHandler())

__all__ = [
    "CheckpointExists",
    "CheckpointIncomplete",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "DaemonTimeout",
    "DaemonUnavailable",
    "InvalidArgument",
    "InvalidName",
    "MemoryBudgetExceeded",
    "PermissionDenied",
    "TierUnavailable",
    "TierckptError",
    "TieredStorageReader",
    "TieredStorageWriter",
    "UnsafeMetadata",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "TieredStorageWriter":
        from tierckpt.storage_writer import TieredStorageWriter

        return TieredStorageWriter
    if name == "TieredStorageReader":
        from tierckpt.storage_reader import TieredStorageReader

        return TieredStorageReader
    raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
