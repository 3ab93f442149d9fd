"""The read stream behind `tierckpt://` (see fsspec_fs.py); writes go through
`tierckpt.memory_tier_file.MemoryTierFile`, the save path `TieredStorageWriter` uses too.

`ReadStream` is a `VerifiedFile` over the local copy (made local by the daemon from a
peer or the persistent tier first, as `TieredStorageReader` does), so every byte served
was checked against the file's block checksums; a corrupt local copy is replaced once
(EnsureLocal with repair) and the read retried.
"""

from __future__ import annotations

import io
import logging
from typing import Any

from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import ChecksumMismatch, TierckptError
from tierckpt.memory_files import VerifiedFile
from tierckpt.records import FileEntry

__all__ = ["ReadStream"]

logger = logging.getLogger(__name__)


class ReadStream(io.RawIOBase):
    """A committed file, read with verification; repaired once from another copy if the
    local one fails its checksums."""

    def __init__(
        self,
        client: DaemonClient,
        namespace: str,
        checkpoint_id: str,
        entry: FileEntry,
        opened: VerifiedFile | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.namespace = namespace
        self.checkpoint_id = checkpoint_id
        self.name = entry.name
        self.what = f"tierckpt://{namespace}/{checkpoint_id}/{entry.name}"
        self.size = entry.size
        self._pos = 0
        self._repaired = False
        # `opened`: the caller's open copy of `entry` (shared by concurrent ranged reads,
        # see `_release`), so no second GetCheckpoint/open is needed.
        self._file: VerifiedFile | None = opened if opened is not None else self._open(entry)

    def _open(self, entry: FileEntry | None, *, repair: bool = False) -> VerifiedFile:
        """The local copy of `entry`; fetched by the daemon when this node has none (or,
        with `repair`, when the local one is corrupt)."""
        if entry is not None and not repair and entry.local_path and entry.checksums:
            try:
                return entry.open_verified(self.what)
            except FileNotFoundError:
                pass  # evicted since GetCheckpoint: fetch it like a missing file
        entry = self.client.ensure_local(
            self.namespace, self.checkpoint_id, self.name, repair=repair
        )
        return entry.open_verified(self.what)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.what}: negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        try:
            return self._readinto(buffer)
        except BaseException as failure:
            # The failure's frames hold views of `buffer`; a caller that frees it on the
            # error (torch_checkpointing closes its mmap) would get a BufferError that
            # hides this one. Keep the message and the chain, not our frames.
            _drop_frames(failure)
            raise failure.with_traceback(None) from failure.__cause__

    def _readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(view.nbytes, self.size - self._pos))
        if count == 0:
            return 0
        if self._file is None:
            raise ValueError(f"{self.what} is closed")
        segment = [(self._pos, view[:count])]
        try:
            self._file.read_segments(segment)
        except ChecksumMismatch as mismatch:
            if self._repaired:
                raise
            self._repaired = True
            self._file = self._repair(mismatch)
            self._file.read_segments(segment)
        self._pos += count
        return count

    def _repair(self, mismatch: ChecksumMismatch) -> VerifiedFile:
        """Have the daemon replace the corrupt local copy from a peer or the persistent
        tier (counted and logged there); ChecksumMismatch when no valid copy exists."""
        logger.warning("%s; asking tierckptd to repair it from another copy", mismatch)
        corrupt, self._file = self._file, None
        if corrupt is not None:
            self._release(corrupt, corrupt=True)
        try:
            return self._open(None, repair=True)
        except TierckptError as e:
            raise ChecksumMismatch(f"{mismatch}; no valid copy could be fetched: {e}") from e

    def readall(self) -> bytes:
        out = bytearray(max(0, self.size - self._pos))
        self.readinto(out)
        return bytes(out)

    def detach(self) -> VerifiedFile:
        """Close this stream and hand its open file to the caller, who closes it."""
        file, self._file = self._file, None
        if file is None:
            raise ValueError(f"{self.what} is closed")
        self.close()
        return file

    def _release(self, file: VerifiedFile, *, corrupt: bool = False) -> None:
        """Done with `file` (`corrupt`: it failed its checksums): closed here; a subclass
        over a shared `opened` file hands it back instead."""
        file.close()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            self._release(file)
        super().close()


def _drop_frames(failure: BaseException) -> None:
    """Forget the tracebacks (and so the locals) of `failure` and the errors it chains."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [failure]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.with_traceback(None)
        pending += [e.__cause__, e.__context__]
