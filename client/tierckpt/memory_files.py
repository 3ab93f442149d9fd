"""Byte I/O on memory-tier files: checksummed writes and verified ranged reads.

These two classes are the whole data path. Save: every byte is copied once, from the
tensor into the tmpfs page (`os.write`), and hashed from cache right before. Restore:
every byte is copied once, from the tmpfs page into the destination tensor
(`os.preadv`), and hashed from cache right after. No byte crosses a socket.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import xxhash

from tierckpt.checksum import DEFAULT_BLOCK_SIZE, BlockChecksums, BlockHasher, BytesLike
from tierckpt.errors import ChecksumMismatch

__all__ = ["ChecksummingWriter", "VerifiedFile"]

_SMALL_WRITE = 256 << 10


class ChecksummingWriter(io.RawIOBase):
    """A write-only stream over a file descriptor that block-hashes what it writes.

    Small writes (torch.save's zip headers) are coalesced in a buffer; large ones
    (tensor storages) go straight to the file one cache-sized block at a time,
    hashed just before the write so the block is read from cache twice, not from RAM.
    The file may be a recycled segment that is longer than what is written:
    `finish()` truncates it to the bytes written.
    """

    def __init__(self, fd: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__()
        self._fd = fd
        self._hasher = BlockHasher(block_size)
        self._pending = bytearray()
        self._position = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._position

    def fileno(self) -> int:
        return self._fd

    def write(self, data: BytesLike) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        size = view.nbytes
        if size < _SMALL_WRITE:
            self._pending += view
            if len(self._pending) >= _SMALL_WRITE:
                self._flush_pending()
        else:
            self._flush_pending()
            step = self._hasher.block_size
            for start in range(0, size, step):
                self._write_hashed(view[start : start + step])
        self._position += size
        return size

    def _flush_pending(self) -> None:
        if self._pending:
            self._write_hashed(memoryview(self._pending))
            self._pending = bytearray()

    def _write_hashed(self, view: memoryview) -> None:
        self._hasher.update(view)
        while view.nbytes:
            written = os.write(self._fd, view)
            view = view[written:]

    def flush(self) -> None:
        self._flush_pending()

    def finish(self) -> tuple[int, BlockChecksums]:
        """Flush, cut the file to what was written, and return (size, checksums)."""
        self._flush_pending()
        os.ftruncate(self._fd, self._position)
        return self._position, self._hasher.finish()

    def close(self) -> None:  # the owner closes the descriptor
        self._flush_pending()
        super().close()


class VerifiedFile:
    """Ranged, verified reads of one committed memory-tier file.

    Every block a read touches is checked against the file's block checksums before
    the read returns; bytes of edge blocks outside the range go to scratch buffers.
    Verified blocks are remembered, so fan-in reads of small items hash each block once.
    """

    def __init__(self, path: str, size: int, checksums: BlockChecksums, *, what: str) -> None:
        if checksums.expected_blocks(size) != checksums.block_count:
            raise ValueError(f"{what}: {checksums.block_count} block checksums for {size} bytes")
        self.size = size
        self.what = what
        self._checksums = checksums
        self._fd = os.open(path, os.O_RDONLY)
        self._verified: set[int] = set()
        self._lock = threading.Lock()
        actual = os.fstat(self._fd).st_size
        if actual != size:
            os.close(self._fd)
            raise ChecksumMismatch(f"{what}: file has {actual} bytes, its manifest says {size}")

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> VerifiedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        return self._fd

    def read(self, start: int, length: int) -> bytearray:
        """Bytes [start, start+length) as a new buffer, verified."""
        out = bytearray(length)
        self.read_segments([(start, memoryview(out))])
        return out

    def read_blocks_bytes(self, start: int, length: int) -> bytes:
        """Whole blocks [start, start+length) as `bytes`, verified: one copy from the page
        cache into the object a protobuf message takes as is (peer transfers)."""
        step = self._checksums.block_size
        end = start + length
        if start % step or (end % step and end != self.size) or end > self.size or start < 0:
            return bytes(self.read(start, length))
        data = os.pread(self._fd, length, start)
        if len(data) != length:
            raise OSError(f"{self.what}: unexpected end of file at {start + len(data)}")
        view = memoryview(data)
        for i, block in enumerate(range(start // step, -(-end // step))):
            digest = xxhash.xxh3_128_digest(view[i * step : (i + 1) * step])
            self._checksums.check_block(block, digest, what=self.what)
        return data

    def read_segments(
        self, segments: list[tuple[int, memoryview]], pool: ThreadPoolExecutor | None = None
    ) -> None:
        """Fill each ``(file offset, buffer)`` with the file's bytes there, verified.

        Segments are disjoint; every block any of them touches is checked, so a parsed
        header and the data it points at are covered by the same verification. With a
        pool, runs of blocks are read and hashed in parallel.
        """
        segs = sorted(
            ((off, view.cast("B")) for off, view in segments if view.nbytes), key=lambda s: s[0]
        )
        for off, view in segs:
            if off < 0 or off + view.nbytes > self.size:
                raise ValueError(
                    f"{self.what}: range {off}..{off + view.nbytes} outside its {self.size} bytes"
                )
        step = self._checksums.block_size
        blocks = sorted(
            {
                b
                for off, view in segs
                for b in range(off // step, (off + view.nbytes - 1) // step + 1)
            }
        )
        if pool is None or len(blocks) < 16:
            self._read_blocks(blocks, segs)
            return
        per_task = max(4, len(blocks) // 8)
        futures = [
            pool.submit(self._read_blocks, blocks[i : i + per_task], segs)
            for i in range(0, len(blocks), per_task)
        ]
        for f in futures:
            f.result()

    def _read_blocks(self, blocks: list[int], segs: list[tuple[int, memoryview]]) -> None:
        step = self._checksums.block_size
        for block in blocks:
            block_lo = block * step
            block_hi = min(block_lo + step, self.size)
            parts = [
                (
                    max(off, block_lo),
                    view[max(off, block_lo) - off : min(off + view.nbytes, block_hi) - off],
                )
                for off, view in segs
                if off < block_hi and off + view.nbytes > block_lo
            ]
            if block in self._verified:
                for off, view in parts:
                    self._pread_full([view], off)
                continue
            buffers: list[memoryview] = []
            cursor = block_lo
            for off, view in parts:
                if off > cursor:
                    buffers.append(memoryview(bytearray(off - cursor)))
                buffers.append(view)
                cursor = off + view.nbytes
            if block_hi > cursor:
                buffers.append(memoryview(bytearray(block_hi - cursor)))
            self._pread_full(buffers, block_lo)
            hasher = xxhash.xxh3_128()
            for b in buffers:
                hasher.update(b)
            self._checksums.check_block(block, hasher.digest(), what=self.what)
            with self._lock:
                self._verified.add(block)

    def _pread_full(self, buffers: list[memoryview], offset: int) -> None:
        want = sum(b.nbytes for b in buffers)
        got = os.preadv(self._fd, buffers, offset)
        while got < want:  # short reads are legal; finish the rest
            if got == 0:
                raise OSError(f"{self.what}: unexpected end of file at {offset}")
            buffers = _advance(buffers, got)
            offset += got
            want -= got
            got = os.preadv(self._fd, buffers, offset)


def _advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    rest: list[memoryview] = []
    for b in buffers:
        if count >= b.nbytes:
            count -= b.nbytes
            continue
        rest.append(b[count:])
        count = 0
    return rest
