"""The memory directory on tmpfs: layout, exclusive lock, file creation and the warm pool.

Layout under `memory.dir`::

    .lock                                    flock held by the one daemon using the dir
    data/<namespace>/<checkpoint_id>/<file>  DCP files (``__0_0.distcp``, ``.metadata``)
    manifests/<namespace>/<checkpoint_id>.json
    pool/seg-<n>                             warm segments recycled from evicted files

Writing into a fresh tmpfs file costs a page fault and a zeroed page per 4 KiB, about 4x
slower than overwriting pages that are already allocated, so evicted and deleted files
are renamed into the pool and handed to the next save instead of being unlinked.

This class is not thread-safe: the catalog calls it under its lock, except for hashing
(`verify_file`) and preallocation (`preallocate`), which are long and run outside.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tierckpt.checksum import ALGORITHM, BlockChecksums, BlockHasher

__all__ = ["DIR_MODE", "MemoryTier", "MemoryTierLocked", "Segment"]

logger = logging.getLogger(__name__)

_TOUCH_CHUNK = 1 << 20

DIR_MODE = 0o2770
WRITING_MODE = 0o660
COMMITTED_MODE = 0o440
_READ_CHUNK = 8 << 20


class MemoryTierLocked(RuntimeError):
    """Another daemon holds the memory directory."""


@dataclass
class Segment:
    """A warm pooled file; `previous_name` is the DCP file it last held (None if unknown)."""

    path: Path
    size: int
    previous_name: str | None = None


class MemoryTier:
    """Owns `memory.dir`: paths, the directory lock, raw file operations and the pool."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.segments: list[Segment] = []
        self._lock_fd: int | None = None
        self._next_segment = 0

    # ---- layout ---------------------------------------------------------------------
    @property
    def data_root(self) -> Path:
        return self.root / "data"

    @property
    def manifest_root(self) -> Path:
        return self.root / "manifests"

    @property
    def pool_dir(self) -> Path:
        return self.root / "pool"

    def data_dir(self, namespace: str, checkpoint_id: str) -> Path:
        return self.data_root / namespace / checkpoint_id

    def file_path(self, namespace: str, checkpoint_id: str, name: str) -> Path:
        return self.data_dir(namespace, checkpoint_id) / name

    def manifest_path(self, namespace: str, checkpoint_id: str) -> Path:
        return self.manifest_root / namespace / f"{checkpoint_id}.json"

    def make_dir(self, path: Path) -> None:
        """Create `path` and its parents with the setgid group-shared mode (umask-proof)."""
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            os.chmod(d, DIR_MODE)

    def open_layout(self) -> None:
        """Create the layout and take the exclusive lock; raises MemoryTierLocked."""
        self.make_dir(self.root)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise MemoryTierLocked(
                f"memory dir {self.root} is in use by another tierckptd ({holder}); stop that "
                "daemon or give this one its own [memory] dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        self._lock_fd = fd
        for d in (self.data_root, self.manifest_root, self.pool_dir):
            self.make_dir(d)

    def close(self) -> None:
        """Release the directory lock (the kernel also drops it when the process dies)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def free_bytes(self) -> int:
        """Free bytes of the filesystem holding the memory dir (tmpfs: free shared memory)."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    # ---- files ------------------------------------------------------------------------
    def create_file(self, path: Path) -> None:
        """Create an empty, exclusive data file writable by the group (the ranks)."""
        self.make_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, WRITING_MODE)
        os.fchmod(fd, WRITING_MODE)
        os.close(fd)

    def seal_file(self, path: Path) -> None:
        """Make a committed file read-only: committed checkpoints are immutable."""
        os.chmod(path, COMMITTED_MODE)

    def remove_checkpoint_dir(self, namespace: str, checkpoint_id: str) -> None:
        """Remove what is left of a checkpoint's data dir and the namespace dir if empty."""
        d = self.data_dir(namespace, checkpoint_id)
        shutil.rmtree(d, ignore_errors=True)
        for parent in (d.parent, self.manifest_root / namespace):
            try:
                parent.rmdir()
            except OSError:
                pass

    # ---- pool -------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def _segment_path(self) -> Path:
        path = self.pool_dir / f"seg-{self._next_segment}"
        self._next_segment += 1
        return path

    def to_pool(self, path: Path, previous_name: str | None) -> Segment | None:
        """Move a data file into the pool; returns the new segment (None if it vanished)."""
        try:
            size = path.stat().st_size
            dest = self._segment_path()
            os.chmod(path, WRITING_MODE)
            os.rename(path, dest)
        except FileNotFoundError:
            return None
        seg = Segment(dest, size, previous_name)
        if size == 0:
            dest.unlink(missing_ok=True)
            return None
        self.segments.append(seg)
        return seg

    def pick_segment(self, file_name: str, remaining: int) -> Segment | None:
        """Best segment for a new file given the rank's remaining reservation.

        Prefer the segment that last held a file of the same name (a periodic save writes
        the same files with the same sizes), allowing 25% slack; else the largest segment
        that fits in the reservation; else none.
        """
        same = [
            s for s in self.segments if s.previous_name == file_name and s.size <= remaining * 1.25
        ]
        if same:
            return max(same, key=lambda s: s.size)
        fitting = [s for s in self.segments if s.size <= remaining]
        return max(fitting, key=lambda s: s.size) if fitting else None

    def take_segment(self, seg: Segment, dest: Path) -> None:
        """Rename a pooled segment to a data path; its pages stay allocated."""
        self.make_dir(dest.parent)
        self.segments.remove(seg)
        os.rename(seg.path, dest)
        os.chmod(dest, WRITING_MODE)

    def drop_largest(self) -> int:
        """Unlink the largest segment (fewest unlinks to free space); returns bytes freed."""
        if not self.segments:
            return 0
        seg = max(self.segments, key=lambda s: s.size)
        self.segments.remove(seg)
        seg.path.unlink(missing_ok=True)
        return seg.size

    def adopt_pool(self) -> None:
        """Re-adopt warm segments left by a previous daemon; drop half-made prewarm files."""
        self.segments.clear()
        for p in sorted(self.pool_dir.iterdir()):
            if p.name.startswith("seg-") and p.name[4:].isdigit() and p.is_file():
                self._next_segment = max(self._next_segment, int(p.name[4:]) + 1)
                size = p.stat().st_size
                if size:
                    self.segments.append(Segment(p, size))
                else:
                    p.unlink()
            else:
                logger.info("removing stray pool entry %s", p)
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    def new_prewarm_path(self) -> tuple[Path, Path]:
        """(temporary path, final segment path) for a segment being preallocated."""
        final = self._segment_path()
        return self.pool_dir / f".prewarm-{final.name}", final

    @staticmethod
    def preallocate(tmp: Path, size: int) -> None:
        """Allocate `size` bytes of resident pages in `tmp` (long: run outside the catalog
        lock). posix_fallocate reserves the pages (ENOSPC up front); writing them makes
        them resident, since fallocated tmpfs pages are only touched at first write and a
        VM host may back guest memory only on first touch (3 s/GiB measured here)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, WRITING_MODE)
        try:
            os.posix_fallocate(fd, 0, size)
            zeros = memoryview(bytes(min(size, _TOUCH_CHUNK)))
            for offset in range(0, size, _TOUCH_CHUNK):
                os.pwrite(fd, zeros[: min(_TOUCH_CHUNK, size - offset)], offset)
        finally:
            os.close(fd)

    # ---- verification -----------------------------------------------------------------
    @staticmethod
    def verify_file(path: Path, size: int, checksums: BlockChecksums) -> tuple[bool, str]:
        """Re-hash `path` and compare with `checksums`; returns (ok, reason)."""
        if checksums.algorithm != ALGORITHM:
            return False, f"unsupported algorithm {checksums.algorithm}"
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            return False, "file is missing"
        if actual != size:
            return False, f"size is {actual} bytes, manifest says {size}"
        hasher = BlockHasher(checksums.block_size)
        buf = bytearray(_READ_CHUNK)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                hasher.update(view[:n])
        got = hasher.finish()
        if got.digests != checksums.digests:
            bad = next(
                (i for i in range(checksums.block_count) if got.digest(i) != checksums.digest(i)),
                checksums.block_count,
            )
            return False, f"checksum mismatch in block {bad}"
        return True, ""


def hash_rate(nbytes: int, started: float) -> str:
    """Throughput string for log lines about hashing."""
    elapsed = max(time.monotonic() - started, 1e-9)
    return f"{nbytes / elapsed / 1e9:.2f} GB/s"
