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

``.metadata`` is unpickled with full `pickle` (it is DCP's format): only feed it bytes
from our own memory tier, never from an untrusted bucket.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any, Protocol

import zstandard
from tierckpt.checksum import BytesLike

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ZSTD_DESCRIPTOR",
    "BytesSource",
    "DataFile",
    "FileIndex",
    "Item",
    "RangeSource",
    "compress_file",
    "compress_items",
    "data_files",
    "rewrite_metadata",
]

ZSTD_DESCRIPTOR = "stream.zstd/1"  # ZStandard.registry_name() + "/1", as DCP records it
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


def _load(metadata: bytes) -> Any:
    # Unpickling resolves torch.distributed.checkpoint's classes by name (imports torch).
    return pickle.loads(metadata)


def data_files(metadata: bytes) -> dict[str, DataFile]:
    """Every data file `.metadata` refers to, with its distinct items sorted by offset."""
    items: dict[str, set[Item]] = {}
    transformed: set[str] = set()
    for info in _load(metadata).storage_data.values():
        items.setdefault(info.relative_path, set()).add((int(info.offset), int(info.length)))
        if getattr(info, "transform_descriptors", None):
            transformed.add(info.relative_path)
    return {
        path: DataFile(path, tuple(sorted(found)), path in transformed)
        for path, found in items.items()
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


def compress_file(
    source: RangeSource,
    items: Iterable[Item],
    *,
    level: int = 3,
    spool_dir: str | None = None,
) -> tuple[IO[bytes], FileIndex]:
    """`compress_items` into an anonymous temporary file, returned rewound.

    The caller closes the file. Prefer `compress_items` straight into the upload stream
    (what `PersistentTier.upload_file` does): it needs no temporary space.
    """
    spool = tempfile.TemporaryFile(dir=spool_dir)  # noqa: SIM115 - the caller owns it
    try:
        index = compress_items(source, items, spool, level=level)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return spool, index


def rewrite_metadata(metadata: bytes, mappings: Mapping[str, FileIndex]) -> bytes:
    """`.metadata` with the items of the files in `mappings` pointing at their zstd frames.

    Every item of a mapped file gets its new offset and length and
    ``transform_descriptors=['stream.zstd/1']``; other files' items are left as they are.
    With no mappings the bytes come back unchanged (compression "none").

    Raises:
        ValueError: an item of a mapped file is missing from its mapping, or already
            carries transforms.
    """
    if not mappings:
        return metadata
    md = _load(metadata)
    rewritten: dict[Any, Any] = {}
    for key, info in md.storage_data.items():
        mapping = mappings.get(info.relative_path)
        if mapping is not None:
            if getattr(info, "transform_descriptors", None):
                raise ValueError(
                    f"{info.relative_path}: item {key} is already transformed "
                    f"({info.transform_descriptors}); upload such files verbatim"
                )
            try:
                new_offset, new_length = mapping[int(info.offset)]
            except KeyError:
                raise ValueError(
                    f"{info.relative_path}: no compressed frame for the item at offset "
                    f"{info.offset} ({key}); the file's index does not match this .metadata"
                ) from None
            info = dataclasses.replace(
                info,
                offset=new_offset,
                length=new_length,
                transform_descriptors=[ZSTD_DESCRIPTOR],
            )
        rewritten[key] = info
    md.storage_data = rewritten
    buffer = io.BytesIO()
    pickle.dump(md, buffer)  # as FileSystemWriter.finish does
    return buffer.getvalue()
