"""Re-hashing the held files of a checkpoint against its manifest's block checksums.

One loop for `Catalog.verify` (every file, report all corrupt ones) and for restart
adoption (stop at the first bad file, seal the good ones read-only through their fds).
Long: callers run it outside the catalog lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierckptd.memory.tier import MemoryTier, UnsafePath
from tierckptd.model import FileRecord

__all__ = ["VerifyResult", "hash_rate", "verify_files"]


@dataclass
class VerifyResult:
    """Outcome of re-hashing a checkpoint's files: `problems` maps each bad file to why."""

    ok: bool
    verified_bytes: int
    corrupt_files: list[str]
    problems: dict[str, str] = field(default_factory=dict)


def verify_files(
    tier: MemoryTier,
    namespace: str,
    checkpoint_id: str,
    files: Iterable[FileRecord],
    *,
    seal: bool = False,
    stop_at_first: bool = False,
) -> VerifyResult:
    """Re-hash the held files among `files` (others are held by peers, which verify their
    own copies). `seal`: make each good file read-only (not exclusive: nobody else has it
    open after a restart); a file that cannot be sealed counts as bad."""
    ok_bytes, problems = 0, {}
    for f in files:
        assert f.checksums is not None
        if not f.held:
            continue
        path = tier.file_path(namespace, checkpoint_id, f.name)
        ok, reason = tier.verify_file(path, f.size, f.checksums)
        if ok and seal:
            try:
                tier.seal_file(path, exclusive=False)
            except (OSError, UnsafePath) as e:
                ok, reason = False, str(e)
        if ok:
            ok_bytes += f.size
            continue
        problems[f.name] = reason
        if stop_at_first:
            break
    return VerifyResult(not problems, ok_bytes, list(problems), problems)


def hash_rate(nbytes: int, started: float) -> str:
    """Throughput string for log lines about hashing."""
    elapsed = max(time.monotonic() - started, 1e-9)
    return f"{nbytes / elapsed / 1e9:.2f} GB/s"
