"""Per-item zstd framing of drained DCP files, and the `.metadata` that describes it.

A drained checkpoint stays readable by stock DCP: each item of a data file (one
``torch.save`` blob, located by ``.metadata``'s ``_StorageInfo(relative_path, offset,
length)``) becomes its own plain zstd frame, exactly what ``FileSystemWriter(...,
_extensions=[ZStandard()])`` writes, and ``.metadata`` is rewritten with the new offsets
and lengths plus ``transform_descriptors=['stream.zstd/1']``. A stock reader with
``zstandard`` or ``pyzstd`` installed undoes it per item.

Frames carry their content size and a content checksum, so a corrupt object fails to
decompress instead of loading wrong bytes. Sources are read through `RangeSource`,
which `tierckpt.memory_files.VerifiedFile` satisfies: every block is verified against
the file's block checksums while it is read.

``.metadata`` is a pickle written by ranks or peers, so it is never unpickled here, nor
decoded in the daemon at all: `tierckptd.persistent.decode` runs the allow-list decoder
(`tierckpt.dcp_metadata.load_metadata`: DCP's metadata classes only, then the shape:
file names, offsets, lengths) in a child process with memory and CPU limits, and reads
back plain rows (and, for the rewrite, the bytes the child pickled), raising
`UnsafeMetadata` for anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Protocol

import zstandard
from tierckpt.checksum import BytesLike

from tierckptd.persistent.decode import decode
from tierckptd.persistent.decode_child import ZSTD_DESCRIPTOR

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ZSTD_DESCRIPTOR",
    "BytesSource",
    "DataFile",
    "FileIndex",
    "Item",
    "RangeSource",
    "compress_items",
    "data_files",
    "rewrite_metadata",
]

DEFAULT_CHUNK_SIZE = 8 << 20

Item = tuple[int, int]
"""One DCP item of a data file: ``(offset, length)`` in the uncompressed file."""

FileIndex = dict[int, tuple[int, int]]
"""Where each item of a file went: ``{old_offset: (new_offset, new_length)}``."""


class RangeSource(Protocol):
    """Random-access bytes of one source file (a `VerifiedFile` is one)."""

    @property
    def size(self) -> int: ...

    def read(self, start: int, length: int) -> BytesLike: ...


class BytesSource:
    """A `RangeSource` over an in-memory buffer."""

    def __init__(self, data: BytesLike) -> None:
        self._view = memoryview(data).cast("B")

    @property
    def size(self) -> int:
        return self._view.nbytes

    def read(self, start: int, length: int) -> BytesLike:
        if start < 0 or length < 0 or start + length > self.size:
            raise ValueError(f"range {start}..{start + length} outside {self.size} bytes")
        return self._view[start : start + length]


@dataclass(frozen=True)
class DataFile:
    """The items `.metadata` places in one data file.

    `transformed` is True when some item already carries transform descriptors (the
    client compressed it): such a file is uploaded verbatim, never compressed twice.
    """

    relative_path: str
    items: tuple[Item, ...]
    transformed: bool = False


def data_files(metadata: bytes, *, what: str = ".metadata") -> dict[str, DataFile]:
    """Every data file `.metadata` refers to, with its distinct items sorted by offset.

    Raises:
        UnsafeMetadata: `metadata` is not plain DCP metadata, or its decoding child hit
            a limit (`what` names it).
        DecoderUnavailable: the decoding child could not run (retry later).
    """
    found = decode(metadata, what=what).files
    return {
        path: DataFile(path, items, transformed) for path, (items, transformed) in found.items()
    }


def _checked_items(items: Iterable[Item], size: int) -> list[Item]:
    ordered = sorted(set(items))
    end = 0
    for offset, length in ordered:
        if offset < 0 or length <= 0 or offset + length > size:
            raise ValueError(f"item ({offset}, {length}) is outside the file's {size} bytes")
        if offset < end:
            raise ValueError(f"item ({offset}, {length}) overlaps the item before it")
        end = offset + length
    return ordered


def compress_items(
    source: RangeSource,
    items: Iterable[Item],
    out: IO[bytes],
    *,
    level: int = 3,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> FileIndex:
    """Write each item of `source` to `out` as its own zstd frame, in offset order.

    Bytes of the source outside every item (there are none in a FileSystemWriter file)
    are dropped: nothing refers to them. The output is deterministic for a given
    zstandard version and level, so a retried upload writes the same bytes.

    Returns:
        ``{old_offset: (new_offset, new_length)}``, offsets relative to the start of `out`.
    """
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    index: FileIndex = {}
    position = 0
    for offset, length in _checked_items(items, source.size):
        frame = compressor.compressobj(size=length)
        start = position
        for chunk_start in range(offset, offset + length, chunk_size):
            data = source.read(chunk_start, min(chunk_size, offset + length - chunk_start))
            compressed = frame.compress(data)
            out.write(compressed)
            position += len(compressed)
        compressed = frame.flush()
        out.write(compressed)
        position += len(compressed)
        index[offset] = (start, position - start)
    return index


def rewrite_metadata(
    metadata: bytes, mappings: Mapping[str, FileIndex], *, what: str = ".metadata"
) -> bytes:
    """`.metadata` with the items of the files in `mappings` pointing at their zstd frames.

    Every item of a mapped file gets its new offset and length and
    ``transform_descriptors=['stream.zstd/1']``; other files' items are left as they are.
    With no mappings the bytes come back unchanged (compression "none").

    Raises:
        UnsafeMetadata: `metadata` is not plain DCP metadata (or its decoder hit a limit).
        DecoderUnavailable: the decoding child could not run (retry later).
        ValueError: an item of a mapped file is missing from its mapping, or already
            carries transforms.
    """
    if not mappings:
        return metadata
    rewritten = decode(metadata, what=what, mappings=mappings).rewritten
    assert rewritten is not None
    return rewritten  # pickled by the decoding child as FileSystemWriter.finish does
