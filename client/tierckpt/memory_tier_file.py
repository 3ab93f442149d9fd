"""A file of a save, written into the daemon's memory tier: the one save path of both
routes (`TieredStorageWriter` and ``tierckpt://``).

Open -> write -> commit. The daemon gives the file a path in its memory tier (OpenFile);
`MemoryTierFile` writes it in place through `ChecksummingWriter` (xxh3 block checksums of
every byte, large writes straight from the caller's buffer into the tmpfs page) and
commits it with its size and checksums when it closes (CommitFile). An error inside its
``with`` block, or `discard()`, aborts the checkpoint instead: DCP fails the whole save
when one file fails, and the abort releases every rank's reservation now.

Copies per byte: one (the caller's buffer -> the tmpfs page, `os.write`); writes under
256 KiB (torch.save's zip framing) are coalesced in a buffer first, so those bytes are
copied twice.

Budget: no byte lands outside a reservation of the rank (ReserveSpace, `reserve`).
`TieredStorageWriter` knows its plan and reserves it before the first file opens
(``grow=False``). DCP's fsspec writer never says how big a file will be, so a
``tierckpt://`` file reserves as it grows (``grow=True``): a chunk at a time
(`MIN_CHUNK`, doubling up to `MAX_CHUNK`; a file of the same name saved before by this
process reserves that size up front), and when a chunk does not fit, exactly what the
next write needs; a save that cannot fit fails with MemoryBudgetExceeded naming the file
and the bytes written so far.
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
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import MemoryBudgetExceeded, TierckptError
from tierckpt.memory_files import ChecksummingWriter
from tierckpt.units import format_size

__all__ = [
    "CRC32_ENV",
    "MAX_CHUNK",
    "MIN_CHUNK",
    "MemoryTierFile",
    "SaveTarget",
    "abort_quietly",
    "crc32_disabled",
    "reserve",
]

logger = logging.getLogger(__name__)

MIN_CHUNK = 8 << 20
MAX_CHUNK = 256 << 20
CRC32_ENV = "TIERCKPT_FSSPEC_CRC32"

# Bytes the last save of (daemon, namespace, file name) wrote in this process: the next
# save of a periodic job reserves that up front (one RPC, and a warm segment can be used).
_SIZE_HINTS: dict[tuple[str, str, str], int] = {}
_HINTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class SaveTarget:
    """One rank's part of a save: the checkpoint its files go into and the rank whose
    reservation they draw on."""

    namespace: str
    checkpoint_id: str
    rank: int

    def what(self, file_name: str) -> str:
        """How errors and logs name a file of this save."""
        return f"tierckpt://{self.namespace}/{self.checkpoint_id}/{file_name}"


def reserve(client: DaemonClient, target: SaveTarget, nbytes: int) -> None:
    """Reserve `nbytes` more of the rank's memory budget for this save, before any of
    those bytes is written; MemoryBudgetExceeded (memory untouched) when they do not fit."""
    client.reserve_space(target.namespace, target.checkpoint_id, target.rank, nbytes)


def abort_quietly(client: DaemonClient, target: SaveTarget) -> None:
    """Abort the save (its files and every rank's reservations go now, not at the daemon's
    clean-up); quiet when another rank aborted first or the daemon is gone."""
    try:
        client.abort_checkpoint(target.namespace, target.checkpoint_id)
    except TierckptError as e:
        logger.debug("abort of %s/%s: %s", target.namespace, target.checkpoint_id, e)


# --- torch.save's CRC32 ---------------------------------------------------------------
class _CrcState(threading.local):
    depth = 0  # data files open in this thread
    previous = True  # torch.save's CRC32 setting before the first of them


_CRC = _CrcState()


@contextlib.contextmanager
def crc32_disabled() -> Iterator[None]:
    """torch.save's CRC32 off in this thread while a data file is written.

    The CRC32 halves torch.save's throughput; our xxh3 blocks already cover every byte
    and torch.load does not check the CRC, so stock DCP readers still read the files.
    torch's switch is thread-local (a ContextVar), and DCP opens, writes (torch.save) and
    closes each file in one writer thread, so a file sets it on open and restores it on
    close, in that thread. ``TIERCKPT_FSSPEC_CRC32=1`` keeps the CRC (on both routes:
    this is their one switch).
    """
    if os.environ.get(CRC32_ENV, "") not in ("", "0"):
        yield
        return
    owner = threading.get_ident()
    if _CRC.depth == 0:  # the outermost open file of this thread keeps the user's setting
        _CRC.previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
    _CRC.depth += 1
    try:
        yield
    finally:
        if threading.get_ident() == owner:  # another thread's switch is not ours to set
            _CRC.depth -= 1
            if _CRC.depth == 0:  # files may close in any order: the last one restores
                torch.serialization.set_crc32_options(_CRC.previous)


# --- the file ---------------------------------------------------------------------------
class MemoryTierFile(io.RawIOBase):
    """A file of a save in progress, written in place in the memory tier.

    ``close()`` (or leaving a ``with`` block without an error) commits the file; an
    error inside the ``with`` block, or ``discard()``, aborts the checkpoint instead.
    With ``autocommit=False`` (fsspec transactions) the file is finished on close and
    committed by ``commit()``. `on_committed` runs after the daemon took the file (the
    ``tierckpt://`` `.metadata` hook); if it fails, the save is aborted.
    """

    def __init__(
        self,
        client: DaemonClient,
        target: SaveTarget,
        file_name: str,
        *,
        grow: bool,
        autocommit: bool = True,
        on_committed: Callable[[MemoryTierFile], None] | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.target = target
        self.file_name = file_name
        self.what = target.what(file_name)
        self.autocommit = autocommit
        self._on_committed = on_committed
        self.size = 0
        self.checksums: BlockChecksums | None = None
        self.path = ""
        self._grow_budget = grow
        self._hint_key = (client.address, target.namespace, file_name)
        self._allowance = 0  # bytes reserved for this file (grow=True)
        self._state = "open"  # open -> finished -> committed | discarded
        self._fd = -1
        self._crc: contextlib.AbstractContextManager[None] | None = None
        t = target
        try:
            if grow:
                with _HINTS_LOCK:
                    hint = _SIZE_HINTS.get(self._hint_key, 0)
                self._grow(max(hint, MIN_CHUNK), needed=0)
            opened = client.open_file(t.namespace, t.checkpoint_id, file_name, t.rank)
            self.path = opened.path
            # No O_TRUNC: a recycled warm segment is overwritten in place, finish() cuts it.
            self._fd = os.open(opened.path, os.O_WRONLY | os.O_CLOEXEC)
        except BaseException:
            self._state = "discarded"
            abort_quietly(client, t)  # the save cannot go on: release what it holds now
            raise
        self._writer = ChecksummingWriter(self._fd)
        if file_name.endswith(".distcp"):  # torch.save writes these
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
            raise ValueError(f"{self.what} is closed")
        if self._grow_budget:
            end = self._writer.tell() + memoryview(data).nbytes
            if end > self._allowance:
                short = end - self._allowance
                chunk = min(max(self._allowance, MIN_CHUNK), MAX_CHUNK)  # doubles, capped
                self._grow(max(short, chunk), short)
        return self._writer.write(data)

    def _grow(self, wanted: int, needed: int) -> None:
        """Reserve `wanted` more bytes, else exactly `needed` (0: an estimate that may fail)."""
        refused: MemoryBudgetExceeded | None = None
        for amount in dict.fromkeys((wanted, needed)):
            if amount <= 0:
                continue
            try:
                reserve(self.client, self.target, amount)
            except MemoryBudgetExceeded as e:
                refused = e
                continue
            self._allowance += amount
            return
        if needed > 0 and refused is not None:
            written = self._writer.tell()
            raise MemoryBudgetExceeded(
                f"{self.what}: the memory budget cannot take {format_size(needed)} more of "
                f"this file after {format_size(written)} written (tierckpt:// reserves as "
                f"the stream grows); the save is aborted. {refused}"
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
            self._writer.abandon()  # never flush into a descriptor number reused later
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
            t.namespace, t.checkpoint_id, self.file_name, t.rank, self.size, self.checksums
        )
        self._state = "committed"
        if self._grow_budget:
            with _HINTS_LOCK:
                _SIZE_HINTS[self._hint_key] = self.size
        if self._on_committed is not None:
            try:
                self._on_committed(self)
            except BaseException:
                abort_quietly(self.client, t)
                raise

    def discard(self) -> None:
        """Drop the file and abort its checkpoint (the save failed)."""
        if self._state in ("committed", "discarded"):
            return
        self._state = "discarded"
        self._release_fd()
        abort_quietly(self.client, self.target)

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
