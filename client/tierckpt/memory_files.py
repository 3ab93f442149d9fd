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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from tierckpt.checksum import (
    DEFAULT_BLOCK_SIZE,
    DIGEST_SIZE,
    BlockChecksums,
    BlockHasher,
    BytesLike,
)
from tierckpt.errors import ChecksumMismatch

__all__ = ["ChecksummingWriter", "VerifiedFile", "wait_all"]

_SMALL_WRITE = 256 << 10
# Bytes per write(2) and per preadv of whole blocks: one 1 MiB block, so the chunk is
# still in the core's own L2 cache between the hash and the kernel's copy. Measured with
# 2 threads on 2 cores, 1 GiB into tmpfs: a steady save took 0.164 s with 1 MiB chunks,
# 0.175 s with 4 MiB; a load 0.156 s against 0.160 s (128 KiB lost again: more syscalls).
_IO_CHUNK = 1 << 20
_MAX_TASK_BLOCKS = 8  # blocks per parallel read task: small, so threads stay balanced


class ChecksummingWriter(io.RawIOBase):
    """A write-only stream over a file descriptor that block-hashes what it writes.

    Small writes (torch.save's zip headers) are coalesced in a buffer; large ones
    (tensor storages) go straight to the file a block (`_IO_CHUNK`) at a time,
    hashed just before the write, so the kernel's copy reads them from cache, not RAM.
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
            step = max(_IO_CHUNK, self._hasher.block_size)
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

    def abandon(self) -> None:
        """Drop unwritten bytes and close without writing: the owner is about to close the
        descriptor, whose number a later open may reuse (a flush from the garbage
        collector would land in that other file)."""
        self._pending = bytearray()
        super().close()

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
        """Close the descriptor; idempotent (a reader may close a file early to repair it)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

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
        tasks = self._plan(segments)
        if pool is None or sum(t.blocks for t in tasks) < 16:
            for task in tasks:
                self._run(task)
            return
        wait_all([pool.submit(self._run, task) for task in tasks])

    def start_segments(
        self, segments: list[tuple[int, memoryview]], pool: ThreadPoolExecutor
    ) -> list[Future[None]]:
        """`read_segments` without waiting: the buffers are filled and verified once every
        future has succeeded. The caller must wait for all of them (`wait_all`) before it
        uses or frees the buffers, also when one fails."""
        return [pool.submit(self._run, task) for task in self._plan(segments)]

    def _plan(self, segments: list[tuple[int, memoryview]]) -> list[_Task]:
        """Split the blocks the segments touch into tasks of consecutive blocks.

        A block that lies wholly inside one segment (the bulk of a tensor) is read
        straight into it and hashed there; an edge block, shared with framing, a gap or
        another segment, is read whole with scratch buffers for the bytes nobody wants.
        Consecutive tasks read consecutive blocks, so each thread streams through the file.
        """
        segs = sorted(
            ((off, view.cast("B")) for off, view in segments if view.nbytes), key=lambda s: s[0]
        )
        step = self._checksums.block_size
        units: list[tuple[int, _Run | _Edge]] = []
        edges: dict[int, _Edge] = {}
        previous_end = 0
        for off, view in segs:
            end = off + view.nbytes
            if off < 0 or end > self.size or off < previous_end:
                raise ValueError(
                    f"{self.what}: range {off}..{end} outside its {self.size} bytes"
                    if off < 0 or end > self.size
                    else f"{self.what}: segments overlap at {off}"
                )
            previous_end = end
            first, last = off // step, (end - 1) // step
            whole_lo = -(-off // step)
            whole_hi = last + 1 if end == self.size else end // step
            if whole_lo < whole_hi:
                stop = min(whole_hi * step, self.size)
                run = _Run(whole_lo, view[whole_lo * step - off : stop - off], whole_hi - whole_lo)
                units.append((whole_lo, run))
            for block in sorted({first, last}):
                if whole_lo <= block < whole_hi:
                    continue
                lo = max(off, block * step)
                hi = min(end, (block + 1) * step)
                if block not in edges:
                    edges[block] = _Edge(block, [])
                    units.append((block, edges[block]))
                edges[block].parts.append((lo, view[lo - off : hi - off]))
        units.sort(key=lambda u: u[0])
        total = sum(u.blocks for _, u in units)
        per_task = max(4, min(_MAX_TASK_BLOCKS, -(-total // 8)))
        tasks: list[_Task] = []
        current = _Task()
        for _, unit in units:
            pieces = unit.split(per_task, step) if isinstance(unit, _Run) else [unit]
            for piece in pieces:
                if current.blocks and current.blocks + piece.blocks > per_task:
                    tasks.append(current)
                    current = _Task()
                current.units.append(piece)
                current.blocks += piece.blocks
        if current.blocks:
            tasks.append(current)
        return tasks

    def _run(self, task: _Task) -> None:
        for unit in task.units:
            if isinstance(unit, _Run):
                self._read_run(unit)
            else:
                self._read_edge(unit)

    def _read_run(self, run: _Run) -> None:
        """Whole blocks straight into the caller's buffer, each hashed right after its read
        (from cache) unless this file already verified it."""
        step = self._checksums.block_size
        digests = self._checksums.digests
        view = run.view
        per_read = max(1, _IO_CHUNK // step)
        for lo in range(0, run.blocks, per_read):
            hi = min(run.blocks, lo + per_read)
            chunk = view[lo * step : hi * step]
            if os.preadv(self._fd, [chunk], (run.first + lo) * step) != chunk.nbytes:
                self._pread_full([chunk], (run.first + lo) * step)  # short read: finish it
            for i in range(lo, hi):
                block = run.first + i
                if block in self._verified:
                    continue
                digest = xxhash.xxh3_128_digest(view[i * step : (i + 1) * step])
                if digest != digests[block * DIGEST_SIZE : (block + 1) * DIGEST_SIZE]:
                    self._checksums.check_block(block, digest, what=self.what)
                with self._lock:
                    self._verified.add(block)

    def _read_edge(self, edge: _Edge) -> None:
        step = self._checksums.block_size
        block = edge.block
        block_lo = block * step
        block_hi = min(block_lo + step, self.size)
        if block in self._verified:
            for off, view in edge.parts:
                self._pread_full([view], off)
            return
        buffers: list[memoryview] = []
        cursor = block_lo
        for off, view in edge.parts:
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


@dataclass
class _Run:
    """Whole blocks from `first` on, read straight into `view`, which they fill exactly
    (the last may be the file's short tail block)."""

    first: int
    view: memoryview
    blocks: int

    def split(self, most: int, step: int) -> list[_Run]:
        return [
            _Run(
                self.first + i, self.view[i * step : (i + most) * step], min(most, self.blocks - i)
            )
            for i in range(0, self.blocks, most)
        ]


@dataclass
class _Edge:
    """One block shared by segments, gaps or framing: its wanted parts, in file order."""

    block: int
    parts: list[tuple[int, memoryview]]
    blocks: int = 1


@dataclass
class _Task:
    """Consecutive units one worker reads in order."""

    units: list[_Run | _Edge] = field(default_factory=list)
    blocks: int = 0


def wait_all(futures: list[Future[None]]) -> None:
    """Wait for every future and raise the first failure, but never while a worker may
    still write into a caller's buffer: after a failure the rest are cancelled, and
    those already running are awaited."""
    error: BaseException | None = None
    for f in futures:
        if error is not None:
            f.cancel()
        if f.cancelled():
            continue
        exc = f.exception()
        if exc is not None and error is None:
            error = exc
            for rest in futures:
                rest.cancel()
    if error is not None:
        raise error
