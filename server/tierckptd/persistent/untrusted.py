"""What is read back from the persistent tier is not trusted (a tampered bucket): a
manifest's numbers are range-checked before it is adopted (`check_stored_record`), and a
stored zstd item is decompressed in bounded reads, never past the item's original length
(`original_chunks`, for a restore).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import IO, cast

import zstandard
from tierckpt.errors import ChecksumMismatch

from tierckptd.memory.manifest import ManifestError
from tierckptd.model import CheckpointRecord, State
from tierckptd.persistent.store import PersistentTier

__all__ = [
    "READ_CHUNK",
    "StoredRange",
    "check_stored_record",
    "decompress_item",
    "original_chunks",
]

READ_CHUNK = 8 << 20
# Bookkeeping read back from the store is not trusted (a tampered bucket).
MAX_INT = 2**63 - 1
MAX_CLOCK_SKEW = 86400.0  # a timestamp later than now + this is refused
MAX_FILES = 1 << 20


class StoredRange:
    """Sequential reads of ``[start, start+length)`` of a stored object (for zstd)."""

    def __init__(
        self, tier: PersistentTier, namespace: str, checkpoint_id: str, name: str, start: int,
        length: int,
    ) -> None:  # fmt: skip
        self._tier = tier
        self._file = (namespace, checkpoint_id, name)
        self._position = start
        self._end = start + length
        self._head = b""

    def peek(self, n: int) -> bytes:
        """Up to `n` bytes that the next `read` returns again."""
        self._head = self.read(n)
        return self._head

    def read(self, n: int = -1) -> bytes:
        if self._head:
            head, self._head = self._head, b""
            return head
        left = self._end - self._position
        n = left if n < 0 else min(n, left)
        if n <= 0:
            return b""
        data = self._tier.read_range(*self._file, self._position, min(n, READ_CHUNK))
        self._position += len(data)
        return data


def decompress_item(stored: StoredRange, limit: int, what: str) -> Iterator[bytes]:
    """The item's original bytes, at most `limit` of them and never more in memory than
    one READ_CHUNK: the frame must declare its content size (ours always do) and be
    complete."""
    try:
        declared = zstandard.frame_content_size(stored.peek(READ_CHUNK))  # one request
    except zstandard.ZstdError as e:
        raise ChecksumMismatch(f"{what} is not a zstd frame ({e})") from None
    if declared < 0 or declared > limit:
        raise ChecksumMismatch(
            f"{what} declares {declared} bytes; the item has room for {limit} (a frame without "
            "its size, or a tampered one)"
        )
    reader = zstandard.ZstdDecompressor().stream_reader(
        cast(IO[bytes], stored), read_size=READ_CHUNK, read_across_frames=False
    )
    got = 0
    try:
        while data := reader.read(min(READ_CHUNK, declared - got + 1)):
            got += len(data)
            if got > declared:
                raise ChecksumMismatch(f"{what} decompresses past its declared size")
            yield data
    except zstandard.ZstdError as e:
        raise ChecksumMismatch(f"{what} is corrupt ({e})") from None
    if got != declared:
        raise ChecksumMismatch(f"{what} is truncated ({got} of {declared} bytes)")


def check_stored_record(rec: CheckpointRecord, now: float) -> None:
    """Refuse a manifest read back from the persistent tier whose numbers are out of
    range (a tampered bucket): non-finite or future timestamps, a sequence or sizes
    outside 0..2**63-1, checksums that do not cover the file.

    Raises:
        ManifestError: naming the field.
    """
    if rec.state is not State.COMMITTED:
        raise ManifestError(f"state {rec.state.value} is not COMMITTED")
    for field, t in (("created_unix", rec.created_unix), ("committed_unix", rec.committed_unix)):
        if not math.isfinite(t) or not 0 <= t <= now + MAX_CLOCK_SKEW:
            raise ManifestError(f"{field} {t!r} is not a time between 1970 and now")
    if not 0 <= rec.sequence <= MAX_INT:
        raise ManifestError(f"sequence {str(rec.sequence)[:32]} is outside 0..2**63-1")
    if len(rec.files) > MAX_FILES:
        raise ManifestError(f"{len(rec.files)} files, more than {MAX_FILES}")
    total = 0
    for f in rec.files.values():
        if not 0 <= f.size <= MAX_INT or not 0 <= f.rank < 2**31:
            raise ManifestError(f"{f.name}: size or rank out of range")
        if f.checksums is None or f.checksums.block_count != f.checksums.expected_blocks(f.size):
            raise ManifestError(f"{f.name}: its block checksums do not cover its {f.size} bytes")
        total += f.size
    if total > MAX_INT:
        raise ManifestError(f"the files add up to {total} bytes, more than 2**63-1")


def original_chunks(
    tier: PersistentTier,
    namespace: str,
    checkpoint_id: str,
    name: str,
    index: dict[int, tuple[int, int]] | None,
    size: int,
) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the original file, in order, from the stored object.

    An item decompresses to at most the bytes up to the next item (its original
    length): a tampered frame cannot make a restore allocate more."""
    if index is None:
        for start in range(0, size, READ_CHUNK):
            n = min(READ_CHUNK, size - start)
            yield start, tier.read_range(namespace, checkpoint_id, name, start, n)
        return
    where = f"{namespace}/{checkpoint_id}/{name}"
    olds = sorted(index)
    position = 0
    for i, old in enumerate(olds):
        if old < position or old > size:
            raise ChecksumMismatch(f"{where}: the stored index has an item at {old} outside")
        if old > position:  # bytes outside every item (none in DCP files): zeros
            yield from _zeros(position, old)
            position = old
        new_offset, new_length = index[old]
        limit = (olds[i + 1] if i + 1 < len(olds) else size) - old
        stored = StoredRange(tier, namespace, checkpoint_id, name, new_offset, new_length)
        for data in decompress_item(stored, limit, f"{where}: the stored item at {old}"):
            yield position, data
            position += len(data)
    if position < size:
        yield from _zeros(position, size)


def _zeros(start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, zeros) covering ``[start, end)`` in READ_CHUNK pieces: a gap as large as
    the file never becomes one allocation."""
    zeros = bytes(min(READ_CHUNK, end - start))
    for offset in range(start, end, READ_CHUNK):
        n = min(READ_CHUNK, end - offset)
        yield offset, zeros if n == len(zeros) else zeros[:n]
