"""Refused `.metadata` files, remembered across restarts (audit 3, H1).

A `.metadata` the allow-list decoder refuses can never drain. The refusal used to live in
memory only: a restart queued the checkpoint again and decoded the same file again (with
a decoder bomb, a crash loop under the liveness probe). `RefusedMetadata` keeps one small
JSON file in the memory dir, ``refused-metadata.json``: per checkpoint, the fingerprint of
its `.metadata` (the block checksums the catalog verified it against) and why it was
refused. The drain asks it before decoding: a checkpoint whose `.metadata` is still the
refused one is refused again without being decoded; a new save under the same id (other
bytes) is decoded as usual. Entries of checkpoints this node no longer has go at the next
write. The operator's override (`Drainer.retry_failed`, SIGHUP) forgets the entries it
retries, so those are decoded again.

The file is the daemon's own (written atomically, never followed through a link); one it
cannot read is logged and set aside, which only means refused files are decoded again
(bounded by the decoder, `tierckpt.pickle_scan`).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from tierckpt.errors import InvalidName
from tierckpt.names import check_checkpoint_id, check_namespace

from tierckptd.memory.manifest import atomic_write
from tierckptd.model import Key

__all__ = ["FILE_NAME", "RefusedMetadata"]

logger = logging.getLogger(__name__)

FILE_NAME = "refused-metadata.json"
_FORMAT = 1
_MAX_BYTES = 16 << 20
_MAX_ENTRIES = 10_000  # more than any memory tier holds checkpoints; the oldest go first
_WHY_CHARS = 400


class RefusedMetadata:
    """The refusals this node's drain made, by checkpoint.

    Args:
        path: the JSON file (in the memory dir).
        alive: whether this node still has a checkpoint (entries of others are dropped).
    """

    def __init__(self, path: Path, alive: Callable[[Key], bool]) -> None:
        self.path = path
        self._alive = alive
        self._lock = threading.Lock()
        self._entries: dict[Key, tuple[str, str]] = self._read()

    def _read(self) -> dict[Key, tuple[str, str]]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return {}
        except OSError as e:
            logger.warning(
                "cannot read %s (%s): refused .metadata files are decoded again",
                self.path,
                os.strerror(e.errno or 0),
            )
            return {}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
                raise ValueError(f"not a regular file of at most {_MAX_BYTES} bytes")
            with open(fd, "rb", closefd=False) as f:
                doc = json.loads(f.read(_MAX_BYTES + 1))
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError("not a refusal record of format 1")
            entries: dict[Key, tuple[str, str]] = {}
            for row in doc["refused"][:_MAX_ENTRIES]:
                key = (check_namespace(row["namespace"]), check_checkpoint_id(row["checkpoint_id"]))
                metadata, why = row["metadata"], row["why"]
                if not isinstance(metadata, str) or not isinstance(why, str):
                    raise ValueError("a fingerprint or reason that is not a string")
                entries[key] = (metadata[:200], why[:_WHY_CHARS])
            return entries
        except (ValueError, KeyError, TypeError, InvalidName, UnicodeDecodeError) as e:
            logger.warning(
                "%s is unreadable (%.200s); it is set aside and refused .metadata files are "
                "decoded again",
                self.path,
                e,
            )
            try:
                os.replace(self.path, self.path.with_name(self.path.name + ".corrupt"))
            except OSError:
                pass
            return {}
        finally:
            os.close(fd)

    def why(self, key: Key, metadata: str) -> str | None:
        """Why the checkpoint's `.metadata` with fingerprint `metadata` was refused, or
        None when it was not (or other bytes were)."""
        with self._lock:
            entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0] == metadata else None

    def remember(self, key: Key, metadata: str, why: str) -> None:
        """Record a refusal (and write the file; an error is logged, not raised: the
        refusal still holds until the restart)."""
        with self._lock:
            self._entries[key] = (metadata, why[:_WHY_CHARS])
            self._write()

    def forget(self, keys: Iterable[Key]) -> None:
        with self._lock:
            gone = [k for k in keys if self._entries.pop(k, None) is not None]
            if gone:
                self._write()

    def keys(self) -> list[Key]:
        with self._lock:
            return sorted(self._entries)

    def _write(self) -> None:
        for key in [k for k in self._entries if not self._alive(k)]:
            del self._entries[key]
        while len(self._entries) > _MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]
        rows = [
            {"namespace": ns, "checkpoint_id": cid, "metadata": metadata, "why": why}
            for (ns, cid), (metadata, why) in self._entries.items()
        ]
        try:
            atomic_write(self.path, json.dumps({"format": _FORMAT, "refused": rows}).encode())
        except Exception as e:  # a full tmpfs, a permission: the refusal holds until restart
            logger.warning(
                "cannot record the refused .metadata files in %s (%s: %.200s); after a "
                "restart they are decoded again",
                self.path,
                type(e).__name__,
                e,
            )
