"""The persistent tier the unit tests drain to and restore from: a `file://` store under
the test's tmp dir, whose retries give up in milliseconds (a refused object fails the
test at once instead of after the production backoff)."""

from __future__ import annotations

from pathlib import Path

from tierckptd.config import PersistentConfig
from tierckptd.persistent.store import PersistentTier, RetryPolicy

__all__ = ["FAST", "file_store"]

FAST = RetryPolicy(max_attempts=2, deadline=None, base=0.01, cap=0.02)


def file_store(root: Path, compression: str = "zstd") -> PersistentTier:
    """A persistent tier at `file://{root}` (created on first write)."""
    config = PersistentConfig(url=f"file://{root}", compression=compression)
    return PersistentTier.from_config(config, retry=FAST)
