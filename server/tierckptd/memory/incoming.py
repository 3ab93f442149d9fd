"""Copies of committed files arriving from another tier (a peer's stream, the persistent
tier) and the plan of what a node that came back empty preallocates for them.

`install_copy` is the one way a copy enters the memory tier, and one call for its callers
(the restorer, a peer's push), which never touch catalog state: budget-checked, written
into a warm segment when one fits, every block verified as it arrives, installed only when
complete, through one call to the catalog (`Landing.land`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from tierckpt.checksum import BlockChecksums, BlockHasher, BytesLike
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, InvalidArgument

from tierckptd.model import CheckpointRecord, FileRecord

__all__ = [
    "IncomingFile",
    "Landing",
    "RangeFetch",
    "install_copy",
    "install_ranges",
    "restore_plan",
    "split_ranges",
]


class Landing(Protocol):
    """Where a copy lands: the catalog's side of `install_copy` (memory/ never imports
    catalog/, so it names only what it calls), one call: room made for the copy before its
    first byte, `write(tmp)` run to fill it, then the copy installed (or dropped when
    `write` raised). None when the file was already held; CheckpointNotFound when it went
    while the copy arrived."""

    def land(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        write: Callable[[Path], None],
        *,
        what: str,
        restored: bool = False,
    ) -> FileRecord | None: ...


class IncomingFile:
    """Writes a file arriving in chunks at increasing offsets, verifying every block
    against the manifest's checksums as soon as it is complete.

    `start`/`end`: only that range of the file arrives here (`start` on a block
    boundary, `end` on one or at the end of the file), so several ranges of one file can
    land at once, each through its own IncomingFile (`install_ranges`); the file is cut
    to `size` by the writer of its last range."""

    def __init__(
        self,
        path: Path,
        size: int,
        checksums: BlockChecksums,
        what: str,
        *,
        start: int = 0,
        end: int | None = None,
    ) -> None:
        end = size if end is None else end
        step = checksums.block_size
        if start % step or not (0 <= start <= end <= size) or (end % step and end != size):
            raise InvalidArgument(
                f"{what}: range {start}..{end} does not fall on blocks of {step} bytes"
            )
        self.size = size
        self.what = what
        self.end = end
        self._checksums = checksums
        self._fd = os.open(path, os.O_WRONLY)
        self._position = start
        self._first_block = start // step
        self._hasher = BlockHasher(step)
        self._checked = 0

    def write(self, offset: int, data: BytesLike) -> None:
        if offset != self._position:
            raise InvalidArgument(
                f"{self.what}: chunk at offset {offset}, expected {self._position}"
            )
        if offset + len(data) > self.end:
            raise InvalidArgument(
                f"{self.what}: chunk past the end of its {self.end} bytes"
                if self.end == self.size
                else f"{self.what}: chunk past the end of its range ({self.end})"
            )
        view = memoryview(data)
        while view.nbytes:
            view = view[os.pwrite(self._fd, view, self._position) :]
            self._position = offset + len(data) - view.nbytes
        self._hasher.update(data)
        for block in range(self._checked, self._hasher.closed_blocks):
            self._check(block, self._hasher.block_digest(block))

    def _check(self, block: int, digest: bytes) -> None:
        self._checksums.check_block(self._first_block + block, digest, what=self.what)
        self._checked = block + 1

    def finish(self) -> None:
        if self._position != self.end:
            raise InvalidArgument(
                f"{self.what}: stream ended at {self._position} of {self.end} bytes"
            )
        final = self._hasher.finish()
        for block in range(self._checked, final.block_count):
            self._check(block, final.digest(block))
        if self.end == self.size:
            os.ftruncate(self._fd, self.size)

    def close(self) -> None:
        os.close(self._fd)


def install_copy(
    catalog: Landing,
    namespace: str,
    checkpoint_id: str,
    f: FileRecord,
    pieces: Iterable[tuple[int, BytesLike]],
    *,
    what: str,
    restored: bool = False,
) -> FileRecord | None:
    """Store a copy of the committed file `f` (its record, as the caller read it)
    arriving as (offset, bytes) pieces from another tier (a peer's stream, the persistent
    tier): budget-checked, written into a warm segment when one fits, every block
    verified against `f`'s checksums, installed only when complete. `restored`: a reader
    asked for it (kept a while even outside memory retention). Returns the record as held
    now, or None when the file was already held (nothing taken)."""
    checksums = f.checksums
    if checksums is None:
        raise CheckpointNotFound(f"{what}: the manifest has no checksums for it")

    def write(tmp: Path) -> None:
        incoming = IncomingFile(tmp, f.size, checksums, f"copy of {what}")
        try:
            for offset, data in pieces:
                incoming.write(offset, data)
            incoming.finish()
        finally:
            incoming.close()

    return catalog.land(namespace, checkpoint_id, f.name, write, what=what, restored=restored)


RangeFetch = Callable[[int, int], Iterable[tuple[int, BytesLike]]]
"""(offset, length) -> that range's (offset, bytes) pieces, at increasing offsets."""


def split_ranges(f: FileRecord, parts: int) -> list[tuple[int, int]]:
    """`f` cut into at most `parts` (offset, length) ranges of whole checksum blocks."""
    assert f.checksums is not None
    step = f.checksums.block_size
    blocks = -(-f.size // step)
    per = -(-blocks // max(1, parts))
    out = []
    for first in range(0, blocks, per):
        start = first * step
        out.append((start, min((first + per) * step, f.size) - start))
    return out or [(0, 0)]


def install_ranges(
    catalog: Landing,
    namespace: str,
    checkpoint_id: str,
    f: FileRecord,
    ranges: Sequence[tuple[int, int, RangeFetch]],
    *,
    what: str,
    restored: bool = False,
    rejected: Callable[[int], None] | None = None,
) -> FileRecord | None:
    """`install_copy` with the file arriving as several ranges at once, each from its
    own fetch (`ranges`: (offset, length, fetch), covering `f` in whole blocks, e.g.
    `split_ranges`), each in its own thread into the same staging file and verified
    block by block as it lands. Any range failing fails the copy (its error raised, the
    others stopped at their next piece); nothing is installed unless all verify.
    `rejected`: told the index of each range whose bytes failed their checksum."""
    checksums = f.checksums
    if checksums is None:
        raise CheckpointNotFound(f"{what}: the manifest has no checksums for it")
    stop = threading.Event()

    def one(tmp: Path, index: int, start: int, length: int, fetch: RangeFetch) -> None:
        incoming = IncomingFile(
            tmp, f.size, checksums, f"copy of {what}", start=start, end=start + length
        )
        try:
            for offset, data in fetch(start, length):
                if stop.is_set():
                    raise InvalidArgument(f"{what}: another range failed")
                incoming.write(offset, data)
            incoming.finish()
        except ChecksumMismatch:
            stop.set()
            if rejected is not None:
                rejected(index)
            raise
        except BaseException:
            stop.set()
            raise
        finally:
            incoming.close()

    def write(tmp: Path) -> None:
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="tierckptd-range") as pool:
            futures = [
                pool.submit(one, tmp, i, start, n, fetch)
                for i, (start, n, fetch) in enumerate(ranges)
            ]
            errors = [e for e in (fut.exception() for fut in futures) if e is not None]
        if errors:
            first = next((e for e in errors if "another range failed" not in str(e)), errors[0])
            raise first

    return catalog.land(namespace, checkpoint_id, f.name, write, what=what, restored=restored)


def restore_plan(node_id: str, adopted: Iterable[CheckpointRecord]) -> list[tuple[int, str]]:
    """(size, name) of the pool segments a node that came back empty preallocates: the
    files it owned, then those it kept copies of, in the newest checkpoint of each
    namespace. A restore or healing brings exactly those back, and a fresh tmpfs page
    costs several times a warm one (the main cost of a peer restore), so allocating them
    while the job is being rescheduled takes that cost off the restore."""
    newest: dict[str, CheckpointRecord] = {}
    for rec in adopted:
        have = newest.get(rec.namespace)
        if have is None or rec.order > have.order:  # commit order, not a peer's clock
            newest[rec.namespace] = rec
    owned: list[tuple[int, str]] = []
    kept: list[tuple[int, str]] = []
    for rec in newest.values():
        for f in rec.files.values():
            if f.size and f.owner_node == node_id:
                owned.append((f.size, f.name))
            elif f.size and node_id in f.replica_nodes:
                kept.append((f.size, f.name))
    return owned + kept
