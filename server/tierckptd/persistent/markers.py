"""Upload requests (`FileUpload`) and upload markers: what the persistent tier records about each uploaded data file (sizes,
compression, the per-item zstd index, a fingerprint of the source). Markers are read
back from the store, so parsing them trusts nothing (a tampered bucket).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash
from tierckpt.checksum import BytesLike
from tierckpt.errors import InvalidName
from tierckpt.names import METADATA_FILE, check_file_name

from tierckptd.model import FileRecord
from tierckptd.persistent.format import BytesSource, FileIndex, Item, RangeSource

__all__ = [
    "COMPRESSIONS",
    "FileUpload",
    "Source",
    "UploadedFile",
    "as_range_source",
    "check_relative_path",
    "fingerprint",
]

COMPRESSIONS = ("zstd", "none")


@dataclass(frozen=True)
class UploadedFile:
    """The marker of one data file in the persistent tier.

    `index` is the per-item zstd index (None: the object holds the source verbatim).
    `fingerprint` is whatever the caller passed to identify the source (e.g. its
    checksum summary), so a resumed drain can tell whether the object is still current.
    """

    name: str
    source_size: int
    size: int
    compression: str
    index: FileIndex | None = None
    fingerprint: str = ""

    def to_json(self) -> bytes:
        index = None if self.index is None else [[o, n, s] for o, (n, s) in self.index.items()]
        return json.dumps(
            {
                "name": self.name,
                "source_size": self.source_size,
                "size": self.size,
                "compression": self.compression,
                "index": index,
                "fingerprint": self.fingerprint,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> UploadedFile:
        """Parse a marker read back from the store (not trusted: a tampered bucket).

        Raises:
            ValueError: not a marker, or a field out of range.
        """
        try:
            raw = json.loads(data)
            index = raw.get("index")
            if index is not None and (not isinstance(index, list) or len(index) > _MAX_INDEX):
                raise ValueError("the index is not a list of at most 2**24 items")
            marker = cls(
                name=check_file_name(raw["name"]),
                source_size=_bounded_int(raw["source_size"]),
                size=_bounded_int(raw["size"]),
                compression=str(raw["compression"]),
                index=None
                if index is None
                else {_bounded_int(o): (_bounded_int(n), _bounded_int(s)) for o, n, s in index},
                fingerprint=str(raw.get("fingerprint", ""))[:256],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # InvalidName too
            raise ValueError(
                f"not a valid upload marker: {type(e).__name__}: {str(e)[:160]}"
            ) from None
        if marker.compression not in COMPRESSIONS:
            raise ValueError(f"not a valid upload marker: compression {marker.compression[:32]!r}")
        return marker


_MAX_INDEX = 1 << 24  # items of one file a marker may describe
_MAX_SIZE = (1 << 63) - 1


def _bounded_int(value: object) -> int:
    """An int in 0..2**63-1 from JSON (bool, float and str are refused)."""
    if type(value) is not int or not 0 <= value <= _MAX_SIZE:
        raise ValueError(f"{str(value)[:32]!r} is not an int in 0..2**63-1")
    return value


Source = RangeSource | BytesLike
"""What `upload_file` reads: a `RangeSource` (e.g. a `VerifiedFile`) or a buffer."""


@dataclass(frozen=True)
class FileUpload:
    """One data file for `PersistentTier.upload_files`; fields as in `upload_file`."""

    name: str
    source: Source
    size: int | None = None
    items: Sequence[Item] | None = None
    fingerprint: str = ""
    # A file of a "files" checkpoint: any valid name is data (a `.metadata` too, never
    # taken for DCP's commit marker).
    any_name: bool = False


def as_range_source(source: Source) -> RangeSource:
    if isinstance(source, bytes | bytearray | memoryview):
        return BytesSource(source)
    return source


def check_relative_path(name: str, *, data_only: bool = True) -> str:
    for part in name.split("/"):
        check_file_name(part)
    if data_only and name == METADATA_FILE:
        raise InvalidName(f"{name!r} is the commit marker: upload it with upload_metadata_last")
    return name


def fingerprint(f: FileRecord) -> str:
    """Identifies a file's bytes (its block checksums) in its upload marker."""
    assert f.checksums is not None
    cs = f.checksums
    return f"{cs.algorithm}:{cs.block_size}:{xxhash.xxh3_128_hexdigest(cs.digests)}"
