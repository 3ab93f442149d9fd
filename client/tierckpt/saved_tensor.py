"""Where a tensor's bytes lie inside one DCP item (a complete ``torch.save`` archive).

Reading the zip directory and the pickle (a few KiB) tells us the dtype, shape,
strides and the offset of the raw storage record, so the reader can copy exactly the
bytes it needs from shared memory into the destination tensor, with no intermediate
``torch.load`` buffer.
"""

from __future__ import annotations

import io
import math
import os
import threading
from dataclasses import dataclass
from typing import IO, cast

import torch

__all__ = ["SavedTensorLayout", "parse_saved_tensor"]

_WINDOW = 64 << 10  # bytes read at each end of an item for its zip framing

# What torch.load's meta result depends on (the storage record holds only data).
_PARSED_RECORDS = ("data.pkl", "byteorder", ".format_version", ".storage_alignment")
_META_CACHE: dict[tuple[bytes | None, ...], torch.Tensor] = {}
_META_CACHE_SIZE = 1024
_META_LOCK = threading.Lock()


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of bytes [base, base+length) of a file descriptor.

    The zip reader makes ~20 small reads at both ends of the item (local headers and the
    pickle at the front, the central directory at the back): the two ends are read once
    each and those reads are served from memory.
    """

    def __init__(self, fd: int, base: int, length: int) -> None:
        super().__init__()
        self._fd, self._base, self._length, self._pos = fd, base, length, 0
        self._windows: list[tuple[int, bytes]] = []
        head = min(length, _WINDOW)
        tail_at = max(head, length - _WINDOW)
        for at, n in ((0, head), (tail_at, length - tail_at)):
            if n:
                data = os.pread(fd, n, base + at)
                if len(data) != n:
                    raise ValueError(f"unexpected end of file at {base + at + len(data)}")
                self._windows.append((at, data))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        origin = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, origin + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._length - self._pos)
        if want <= 0:
            return 0
        for at, data in self._windows:
            if at <= self._pos and self._pos + want <= at + len(data):
                start = self._pos - at
                memoryview(buffer)[:want] = data[start : start + want]
                self._pos += want
                return want
        got = os.preadv(self._fd, [memoryview(buffer)[:want]], self._base + self._pos)
        self._pos += got
        return got


@dataclass(frozen=True)
class SavedTensorLayout:
    """A saved tensor: its meta twin (dtype/shape/strides) and its storage record offset."""

    meta: torch.Tensor
    storage_offset_bytes: int  # of the storage record, from the start of the item

    @property
    def storage_nbytes(self) -> int:
        return int(self.meta.untyped_storage().nbytes())

    def contiguous_range(
        self, offsets: tuple[int, ...], lengths: tuple[int, ...]
    ) -> tuple[int, int] | None:
        """(start, nbytes) within the item of the sub-block at `offsets` of size `lengths`,
        when those elements are one contiguous run in row-major order; else None."""
        t = self.meta
        sizes = tuple(t.shape)
        if not t.is_contiguous() or len(offsets) != t.dim() or len(lengths) != t.dim():
            return None
        if any(
            o < 0 or n < 0 or o + n > size
            for o, n, size in zip(offsets, lengths, sizes, strict=True)
        ):
            return None
        # Row-major runs: leading dims of length 1, then one dim of any length, then
        # only whole dims.
        outer = next((i for i, n in enumerate(lengths) if n != 1), t.dim())
        if any(lengths[i] != sizes[i] for i in range(outer + 1, t.dim())):
            return None
        first = t.storage_offset() + sum(o * s for o, s in zip(offsets, t.stride(), strict=True))
        item = t.element_size()
        return self.storage_offset_bytes + int(first) * item, math.prod(lengths) * item


def parse_saved_tensor(fd: int, base: int, length: int) -> SavedTensorLayout:
    """Parse the torch.save archive at [base, base+length) of `fd` without reading its data.

    The dtype/shape/strides come from ``torch.load`` onto the meta device, which is most
    of the cost (~1 ms); a file's items mostly share a few pickles (same shape and dtype),
    so the result is remembered per exact pickle bytes: the same bytes unpickle the same.
    """
    source = _RangeFile(fd, base, length)
    reader = torch._C.PyTorchFileReader(cast(IO[bytes], source))
    names = reader.get_all_records()
    storage_records = [r for r in names if r.rsplit("/", 2)[-2:-1] == ["data"]]
    if len(storage_records) != 1:
        raise ValueError(
            f"expected one storage record in a DCP tensor item, found {storage_records}"
        )
    key = tuple(reader.get_record(r) if r in names else None for r in _PARSED_RECORDS)
    meta = _META_CACHE.get(key)
    if meta is None:
        source.seek(0)
        loaded = torch.load(cast(IO[bytes], source), map_location="meta", weights_only=True)
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"expected a saved tensor, found {type(loaded).__name__}")
        meta = loaded
        with _META_LOCK:
            if len(_META_CACHE) >= _META_CACHE_SIZE:
                _META_CACHE.pop(next(iter(_META_CACHE)))
            _META_CACHE[key] = meta
    offset = reader.get_record_offset(storage_records[0])  # type: ignore[attr-defined]
    return SavedTensorLayout(meta, int(offset))
