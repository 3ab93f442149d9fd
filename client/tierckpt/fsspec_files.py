"""The file objects behind `tierckpt://` (see fsspec_fs.py): a write stream into the
memory tier and a verified read stream out of it.

Write: the daemon gives the file a path in its memory tier (OpenFile), the stream writes
it in place through `ChecksummingWriter` (one copy per byte, xxh3 block checksums of
every byte) and commits it with its size and checksums when it closes. DCP's fsspec
writer never says how big a file will be, so the budget is reserved as the stream grows:
a chunk at a time (`_MIN_CHUNK`, doubling up to `_MAX_CHUNK`; a file of the same name
saved before by this process reserves that size up front), and when a chunk does not fit,
exactly what the next write needs. No byte lands outside a reservation; a save that
cannot fit fails with MemoryBudgetExceeded (RESOURCE_EXHAUSTED) naming the file and the
bytes written so far, and the checkpoint is aborted so other ranks' reservations go too.

Read: `VerifiedFile` over the local copy (made local by the daemon from a peer or the
persistent tier first, as `TieredStorageReader` does), so every byte served was checked
against the file's block checksums; a corrupt local copy is replaced once (EnsureLocal
with repair) and the read retried.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.serialization

from tierckpt.checksum import BlockChecksums, BytesLike
from tierckpt.daemon_client import DaemonClient, FileEntry
from tierckpt.errors import ChecksumMismatch, MemoryBudgetExceeded, TierckptError
from tierckpt.memory_files import ChecksummingWriter, VerifiedFile
from tierckpt.units import format_size

__all__ = ["ReadStream", "SaveTarget", "WriteStream", "crc32_disabled"]

logger = logging.getLogger(__name__)

_MIN_CHUNK = 8 << 20
_MAX_CHUNK = 256 << 20
CRC32_ENV = "TIERCKPT_FSSPEC_CRC32"

# Bytes the last save of (daemon, namespace, file name) wrote in this process: the next
# save of a periodic job reserves that up front (one RPC, and a warm segment can be used).
_SIZE_HINTS: dict[tuple[str, str, str], int] = {}
_HINTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class SaveTarget:
    """One file of a save: where it goes and which rank's reservation it draws on."""

    namespace: str
    checkpoint_id: str
    file_name: str
    rank: int

    @property
    def what(self) -> str:
        return f"tierckpt://{self.namespace}/{self.checkpoint_id}/{self.file_name}"


# --- torch.save's CRC32 ---------------------------------------------------------------
class _CrcState(threading.local):
    depth = 0  # tierckpt:// data files open in this thread
    previous = True  # torch.save's CRC32 setting before the first of them


_CRC = _CrcState()


@contextlib.contextmanager
def crc32_disabled() -> Iterator[None]:
    """torch.save's CRC32 off in this thread while a tierckpt:// data file is written.

    Our xxh3 blocks cover every byte and torch.load does not check the CRC, so the files
    stay readable by stock DCP (as with TieredStorageWriter). torch's switch is
    thread-local (a ContextVar), and DCP opens, writes (torch.save) and closes each file
    in one writer thread, so the stream sets it on open and restores it on close, in that
    thread. ``TIERCKPT_FSSPEC_CRC32=1`` keeps the CRC.
    """
    if os.environ.get(CRC32_ENV, "") not in ("", "0"):
        yield
        return
    owner = threading.get_ident()
    if _CRC.depth == 0:  # the outermost open stream of this thread keeps the user's setting
        _CRC.previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
    _CRC.depth += 1
    try:
        yield
    finally:
        if threading.get_ident() == owner:  # another thread's switch is not ours to set
            _CRC.depth -= 1
            if _CRC.depth == 0:  # streams may close in any order: the last one restores
                torch.serialization.set_crc32_options(_CRC.previous)


# --- write ------------------------------------------------------------------------------
class WriteStream(io.RawIOBase):
    """A file of a save in progress, written in place in the memory tier.

    ``close()`` (or leaving a ``with`` block without an error) commits the file; an
    error inside the ``with`` block, or ``discard()``, aborts the checkpoint instead:
    DCP fails the whole save when one file fails. With ``autocommit=False`` (fsspec
    transactions) the file is finished on close and committed by ``commit()``.
    `on_committed` runs after the daemon took the file (the `.metadata` commit hook).
    """

    def __init__(
        self,
        client: DaemonClient,
        target: SaveTarget,
        *,
        autocommit: bool = True,
        on_committed: Callable[[WriteStream], None] | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.target = target
        self.autocommit = autocommit
        self._on_committed = on_committed
        self.size = 0
        self.checksums: BlockChecksums | None = None
        self.path = ""
        self._hint_key = (client.address, target.namespace, target.file_name)
        self._allowance = 0  # bytes reserved for this file
        self._state = "open"  # open -> finished -> committed | discarded
        self._fd = -1
        self._crc: contextlib.AbstractContextManager[None] | None = None
        t = target
        client.begin_checkpoint(t.namespace, t.checkpoint_id, t.rank)
        with _HINTS_LOCK:
            hint = _SIZE_HINTS.get(self._hint_key, 0)
        try:
            self._grow(max(hint, _MIN_CHUNK), needed=0)
            opened = client.open_file(t.namespace, t.checkpoint_id, t.file_name, t.rank)
            self.path = opened.path
            # No O_TRUNC: a recycled warm segment is overwritten in place, finish() cuts it.
            self._fd = os.open(opened.path, os.O_WRONLY | os.O_CLOEXEC)
        except BaseException:
            self._state = "discarded"
            self._abort()  # the save cannot go on: release what it holds now
            raise
        self._writer = ChecksummingWriter(self._fd)
        if t.file_name.endswith(".distcp"):  # torch.save writes these
            crc = crc32_disabled()
            crc.__enter__()
            self._crc = crc

    # -- io protocol ----------------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._writer.tell()

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        if self._state == "open":
            self._writer.flush()

    def write(self, data: BytesLike) -> int:  # type: ignore[override]
        if self._state != "open":
            raise ValueError(f"{self.target.what} is closed")
        end = self._writer.tell() + memoryview(data).nbytes
        if end > self._allowance:
            short = end - self._allowance
            chunk = min(max(self._allowance, _MIN_CHUNK), _MAX_CHUNK)  # doubles, capped
            self._grow(max(short, chunk), short)
        return self._writer.write(data)

    def _grow(self, wanted: int, needed: int) -> None:
        """Reserve `wanted` more bytes, else exactly `needed` (0: an estimate that may fail)."""
        t = self.target
        refused: MemoryBudgetExceeded | None = None
        for amount in dict.fromkeys((wanted, needed)):
            if amount <= 0:
                continue
            try:
                self.client.reserve_space(t.namespace, t.checkpoint_id, t.rank, amount)
            except MemoryBudgetExceeded as e:
                refused = e
                continue
            self._allowance += amount
            return
        if needed > 0 and refused is not None:
            written = self._writer.tell()
            raise MemoryBudgetExceeded(
                f"{t.what}: the memory budget cannot take {format_size(needed)} more of this "
                f"file after {format_size(written)} written (tierckpt:// reserves as the "
                f"stream grows); the save is aborted. {refused}"
            ) from refused

    # -- lifecycle ------------------------------------------------------------------------
    def _finish(self) -> None:
        try:
            self.size, self.checksums = self._writer.finish()
        finally:
            self._release_fd()
        self._state = "finished"

    def _release_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._crc is not None:
            crc, self._crc = self._crc, None
            crc.__exit__(None, None, None)

    def commit(self) -> None:
        """Hand the finished file to the daemon (its size and block checksums)."""
        if self._state == "open":
            self._finish()
        if self._state != "finished":
            return
        assert self.checksums is not None
        t = self.target
        self.client.commit_file(
            t.namespace, t.checkpoint_id, t.file_name, t.rank, self.size, self.checksums
        )
        self._state = "committed"
        with _HINTS_LOCK:
            _SIZE_HINTS[self._hint_key] = self.size
        if self._on_committed is not None:
            try:
                self._on_committed(self)
            except BaseException:
                self._abort()
                raise

    def discard(self) -> None:
        """Drop the file and abort its checkpoint (the save failed)."""
        if self._state in ("committed", "discarded"):
            return
        self._state = "discarded"
        self._release_fd()
        self._abort()

    def _abort(self) -> None:
        t = self.target
        try:
            self.client.abort_checkpoint(t.namespace, t.checkpoint_id)
        except TierckptError as e:  # another rank aborted first, or the daemon is gone
            logger.debug("abort of %s/%s: %s", t.namespace, t.checkpoint_id, e)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._state == "open":
                if self.autocommit:
                    self.commit()
                else:
                    self._finish()
        except BaseException:
            self.discard()
            raise
        finally:
            super().close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.discard()
        self.close()

    def __del__(self) -> None:  # never commit from the garbage collector
        if getattr(self, "_state", "") == "open":
            self._release_fd()


# --- read -------------------------------------------------------------------------------
class ReadStream(io.RawIOBase):
    """A committed file, read with verification; repaired once from another copy if the
    local one fails its checksums."""

    def __init__(
        self,
        client: DaemonClient,
        namespace: str,
        checkpoint_id: str,
        entry: FileEntry,
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
        self._file: VerifiedFile | None = self._open(entry)

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
            corrupt.close()
        try:
            return self._open(None, repair=True)
        except TierckptError as e:
            raise ChecksumMismatch(f"{mismatch}; no valid copy could be fetched: {e}") from e

    def readall(self) -> bytes:
        out = bytearray(max(0, self.size - self._pos))
        self.readinto(out)
        return bytes(out)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()
