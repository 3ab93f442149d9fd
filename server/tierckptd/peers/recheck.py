"""Re-checking a held copy a peer reported corrupt (`ReportCorrupt`), on this node's own hash.

The bulk sender does not hash what it sends (`bulk_server`): the fetcher verifies every
block as it lands, and when a block from this node fails there it tells this node. A
report is a claim by another node, never proof: acting on it would let any member have
good copies dropped. So this node re-hashes its own copy against its manifest's
checksums and calls `on_corrupt` (dropped, counted, repaired) only when that hash fails.

Bounded: one re-check at a time on this node (a report while one runs is ignored; the
fetcher went on to the next holder anyway, and the scrubber covers what is missed), and
a file re-checked in the last QUIET seconds is not re-checked again. A lying peer thus
costs at most one re-hash per file per QUIET seconds, never a good copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tierckpt.checksum import BlockChecksums
from tierckpt.errors import CheckpointNotFound

from tierckptd.model import FileRecord

__all__ = ["QUIET", "Rechecker"]

logger = logging.getLogger(__name__)

# Seconds after a re-check of a file during which reports of it are ignored.
QUIET = 10.0
# Files remembered as re-checked at most (older ones are forgotten first).
REMEMBERED = 1024

FileView = Callable[[str, str, str], tuple[FileRecord, str]]
Verify = Callable[[Path, int, BlockChecksums], tuple[bool, str]]
OnCorrupt = Callable[[str, str, str, str, str], None]
Key = tuple[str, str, str]


class Rechecker:
    """See the module docstring. `files`: the catalog's `file_view`; `verify`: the memory
    tier's `verify_file`; `on_corrupt`: `Cluster.corrupt`."""

    def __init__(
        self,
        files: FileView,
        verify: Verify,
        on_corrupt: OnCorrupt,
        *,
        node_id: str,
        quiet: float = QUIET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.files = files
        self.verify = verify
        self.on_corrupt = on_corrupt
        self.node_id = node_id
        self.quiet = quiet
        self.clock = clock
        self._lock = threading.Lock()
        self._running: Key | None = None
        self._checked: dict[Key, float] = {}  # file -> when its last re-check started

    @property
    def busy(self) -> bool:
        """A re-check runs now."""
        with self._lock:
            return self._running is not None

    def report(self, namespace: str, checkpoint_id: str, name: str, reporter: str) -> bool:
        """A peer says this node's copy of a file is corrupt: whether a re-check of it
        started (in the background); CheckpointNotFound when no copy is held here."""
        what = f"{namespace}/{checkpoint_id}/{name}"
        _, path = self.files(namespace, checkpoint_id, name)  # CheckpointNotFound: unknown
        if not path:
            raise CheckpointNotFound(f"node {self.node_id} holds no copy of {what}")
        key = (namespace, checkpoint_id, name)
        now = self.clock()
        with self._lock:
            if self._running is not None:
                return False
            last = self._checked.get(key)
            if last is not None and now - last < self.quiet:
                return False
            self._running = key
            self._checked.pop(key, None)
            self._checked[key] = now
            while len(self._checked) > REMEMBERED:
                del self._checked[next(iter(self._checked))]
        logger.info(
            "node %s reports its copy of %s from here corrupt: re-checking it", reporter, what
        )
        threading.Thread(
            target=self._recheck, args=(key, reporter), name="tierckptd-recheck", daemon=True
        ).start()
        return True

    def _recheck(self, key: Key, reporter: str) -> None:
        namespace, checkpoint_id, name = key
        what = f"{namespace}/{checkpoint_id}/{name}"
        try:
            f, path = self.files(namespace, checkpoint_id, name)
            if not path or f.checksums is None:
                return  # evicted or dropped meanwhile
            ok, reason = self.verify(Path(path), f.size, f.checksums)
            if ok:
                logger.warning(
                    "node %s reported %s corrupt, but this node's copy verifies: kept",
                    reporter,
                    what,
                )
                return
            now, later = self.files(namespace, checkpoint_id, name)
            if later != path or now.checksums != f.checksums:
                return  # replaced meanwhile: not the copy that failed
            if self.verify(Path(path), f.size, f.checksums)[0]:
                return  # evicted and landed again meanwhile (as the scrubber confirms)
            self.on_corrupt(
                namespace,
                checkpoint_id,
                name,
                f"re-checked after node {reporter}'s report: {reason}",
                "served",
            )
        except CheckpointNotFound:
            pass  # deleted meanwhile
        except Exception:
            logger.exception("re-checking %s after node %s's report failed", what, reporter)
        finally:
            with self._lock:
                self._running = None
