"""The memory directory on tmpfs: layout, exclusive lock, raw file operations, verification.

Layout under `memory.dir`::

    .lock                                    flock held by the one daemon using the dir
    data/<namespace>/<flat id>/<file>        DCP files (``__0_0.distcp``, ``.metadata``)
    manifests/<namespace>/<flat id>.json
    pool/seg-<n>@<namespace>                 warm segments recycled from evicted files

The warm pool under ``pool/`` is `memory.pool.WarmPool`.

A checkpoint id that is a folder path (``run1/step-10``) is one directory here, spelled
by `tierckpt.names.flat_checkpoint_id` (``run1+step-10``): no checkpoint's directory is
inside another's, removing one never touches another, and adoption reads each name
back with `checkpoint_id_of_flat`, which validates it.

Nothing here follows a symlink: paths are built from validated names and checked to
stay under the root, files are opened with O_NOFOLLOW and changed through their fds, and
directories are not group-writable (ranks only write files the daemon created), so a
member of the daemon's group cannot plant links or swap files.

This class is not thread-safe: the catalog calls it under its lock, except for hashing
(`verify_file`), which is long and runs outside.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from tierckpt.checksum import ALGORITHM, BlockChecksums, BlockHasher
from tierckpt.errors import CheckpointIncomplete, InvalidName, MemoryBudgetExceeded, TierckptError
from tierckpt.names import NEXT_GENERATION, check_file_name, check_namespace, flat_checkpoint_id

from tierckptd.ops.events import Listeners

__all__ = [
    "COMMITTED_MODE",
    "WRITING_MODE",
    "DIR_MODE",
    "MemoryTier",
    "MemoryTierLocked",
    "UnsafePath",
    "no_space",
]

logger = logging.getLogger(__name__)

# setgid so files keep the daemon's group; not group-writable: only the daemon creates,
# renames or unlinks entries.
DIR_MODE = 0o2750
WRITING_MODE = 0o660
COMMITTED_MODE = 0o440
_READ_CHUNK = 8 << 20
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class MemoryTierLocked(RuntimeError):
    """Another daemon holds the memory directory."""


class UnsafePath(InvalidName):
    """A memory-tier path that is a symlink, not a regular file, or resolves outside
    `memory.dir`: refused rather than followed."""


def no_space(error: OSError, what: str, where: Path) -> TierckptError | OSError:
    """ENOSPC/EDQUOT as MemoryBudgetExceeded (RESOURCE_EXHAUSTED) naming the memory tier
    and its filesystem; any other OSError unchanged."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return error
    return MemoryBudgetExceeded(
        f"memory tier: the filesystem of the memory dir {where} is full ({what}); remove "
        "checkpoints (`tierckpt rm`), enlarge the tmpfs (size=) or lower [memory] budget "
        "below the tmpfs size"
    )


def _fchmod_dir(path: Path | str, mode: int | None = None) -> None:
    """chmod a real directory through its fd; `mode` None clears only the group and
    other write bits (a stricter mode set by local isolation is kept)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    try:
        current = stat.S_IMODE(os.fstat(fd).st_mode)
        wanted = current & ~0o022 if mode is None else mode
        if wanted != current:
            os.fchmod(fd, wanted)
    finally:
        os.close(fd)


class MemoryTier:
    """Owns `memory.dir`: paths, the directory lock and raw file operations."""

    _lease_warned = False

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self._lock_fd: int | None = None
        # Called with the namespace right after data/<namespace> is created (local
        # isolation restricts it to its owner before any file exists in it).
        self.namespace_dirs: Listeners[[str]] = Listeners()

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

    def _under_root(self, path: Path) -> Path:
        """`path` if it stays under the root lexically (names are validated, so it does;
        this guards the next caller that forgets)."""
        normal = os.path.normpath(path)
        if os.path.commonpath([normal, self.root]) != str(self.root) or normal == str(self.root):
            raise UnsafePath(f"memory tier path {str(path)[:200]!r} leaves memory.dir")
        return path

    @staticmethod
    def _flat(checkpoint_id: str) -> str:
        """The id as one path component; a replacing save's internal id
        (`names.next_generation_id`) keeps its suffix, which adoption never takes."""
        base = checkpoint_id.removesuffix(NEXT_GENERATION)
        return flat_checkpoint_id(base) + checkpoint_id[len(base) :]

    def data_dir(self, namespace: str, checkpoint_id: str) -> Path:
        ns, cid = check_namespace(namespace), self._flat(checkpoint_id)
        return self._under_root(self.data_root / ns / cid)

    def file_path(self, namespace: str, checkpoint_id: str, name: str) -> Path:
        return self._under_root(self.data_dir(namespace, checkpoint_id) / check_file_name(name))

    def incoming_path(self, namespace: str, checkpoint_id: str, name: str) -> Path:
        """Where a copy of `name` arriving from another tier is written until installed."""
        directory = self.data_dir(namespace, checkpoint_id)
        return self._under_root(directory / f".{check_file_name(name)}.incoming")

    def manifest_path(self, namespace: str, checkpoint_id: str) -> Path:
        ns, cid = check_namespace(namespace), self._flat(checkpoint_id)
        return self._under_root(self.manifest_root / ns / f"{cid}.json")

    def check_no_links(self, path: Path) -> None:
        """Refuse `path` when a directory between the root and it is a symlink (the
        root itself may be one: that is the operator's choice)."""
        parent = path.parent
        try:
            rel = parent.relative_to(self.root)
        except ValueError:
            raise UnsafePath(f"memory tier path {str(path)[:200]!r} leaves memory.dir") from None
        expected = os.path.normpath(os.path.join(os.path.realpath(self.root), rel))
        if os.path.realpath(parent) != expected:
            raise UnsafePath(
                f"memory tier path {str(path)[:200]!r} goes through a symbolic link; "
                "refusing to follow it"
            )

    def make_dir(self, path: Path) -> None:
        """Create `path` and its parents under the root with DIR_MODE (umask-proof);
        an existing component that is not a real directory is refused."""
        if path == self.root or self.root not in path.parents:
            self._make_root()
            if path == self.root:
                return
            raise UnsafePath(f"memory tier directory {str(path)[:200]!r} leaves memory.dir")
        self._make_root()
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            try:
                os.mkdir(current, DIR_MODE)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(current).st_mode):
                    raise UnsafePath(
                        f"memory tier path {str(current)[:200]!r} is not a directory "
                        "(a symbolic link?); refusing to follow it"
                    ) from None
                continue
            _fchmod_dir(current, DIR_MODE)
            if current.parent == self.data_root:
                self.namespace_dirs(part)

    def _make_root(self) -> None:
        missing = []
        p = self.root
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            os.chmod(d, DIR_MODE)

    def _ensure_layout_dir(self, path: Path) -> None:
        """data/, manifests/, pool/: real directories, not group-writable (fixes the 2770
        of older versions; a planted link is removed, not followed)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self.make_dir(path)
            return
        if not stat.S_ISDIR(st.st_mode):
            logger.warning("removing %s: not a directory (a symbolic link?)", path)
            path.unlink()
            self.make_dir(path)
            return
        if st.st_mode & 0o022:
            _fchmod_dir(path)

    def open_layout(self) -> None:
        """Create the layout and take the exclusive lock; raises MemoryTierLocked."""
        self.make_dir(self.root)
        st = os.stat(self.root)
        if st.st_mode & 0o022:
            if st.st_uid == os.geteuid():
                os.chmod(self.root, stat.S_IMODE(st.st_mode) & ~0o022)
            else:
                logger.warning(
                    "memory dir %s is group- or world-writable and not ours to chmod: "
                    "anyone in its group can plant files there; make it mode 2750",
                    self.root,
                )
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise MemoryTierLocked(
                f"memory dir {self.root} is in use by another tierckptd ({holder[:64]}); stop "
                "that daemon or give this one its own [memory] dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        self._lock_fd = fd
        for d in (self.data_root, self.manifest_root, self.pool_dir):
            self._ensure_layout_dir(d)
        # A lease break (someone opening a file for writing while we check it at commit)
        # signals SIGIO, whose default action kills the process.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGIO, signal.SIG_IGN)

    def close(self) -> None:
        """Release the directory lock (the kernel also drops it when the process dies)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def free_bytes(self) -> int:
        """Free bytes of the filesystem holding the memory dir (tmpfs: free shared memory)."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def total_bytes(self) -> int:
        """Size of the filesystem holding the memory dir (tmpfs: its size=)."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize

    # ---- files ------------------------------------------------------------------------
    def open_regular(self, path: Path, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
        """An fd on `path` and its fstat; UnsafePath for a symlink or a non-regular file
        (O_NONBLOCK: opening a planted FIFO must not hang)."""
        self.check_no_links(path)
        try:
            fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(
                    f"memory tier file {path.name!r} is a symbolic link; refusing to follow it"
                ) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePath(f"memory tier file {path.name!r} is not a regular file")
        return fd, st

    def create_file(self, path: Path) -> None:
        """Create an empty, exclusive data file writable by the group (the ranks)."""
        try:
            self.make_dir(path.parent)
            self.check_no_links(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, WRITING_MODE)
        except OSError as e:
            raise no_space(e, f"creating {path.name}", self.root) from e
        try:
            os.fchmod(fd, WRITING_MODE)
        finally:
            os.close(fd)

    def seal_file(
        self,
        path: Path,
        check: Callable[[os.stat_result], None] | None = None,
        *,
        exclusive: bool = True,
    ) -> os.stat_result:
        """Make a committed file read-only through its fd; returns its stat.

        `exclusive`: also prove that nobody holds it open for writing (or mapped
        writable): a read lease is refused while a writer exists. The mode changes first,
        so once the lease is granted no non-owner can open it for writing any more, and
        `check` (the size) runs on a file nobody can change. A failed check or lease
        gives the file back to its writer (mode restored) and raises.
        """
        fd, st = self.open_regular(path)
        try:
            if st.st_uid != os.geteuid() or st.st_nlink != 1:
                raise UnsafePath(
                    f"memory tier file {path.name!r} was replaced (owner uid {st.st_uid}, "
                    f"{st.st_nlink} links): only files the daemon created are committed"
                )
            mode = stat.S_IMODE(st.st_mode)
            os.fchmod(fd, COMMITTED_MODE)
            try:
                leased = exclusive and self._take_read_lease(fd, path)
                try:
                    st = os.fstat(fd)
                    if check is not None:
                        check(st)
                finally:
                    if leased:
                        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except BaseException:
                os.fchmod(fd, mode)
                raise
            return st
        finally:
            os.close(fd)

    def _take_read_lease(self, fd: int, path: Path) -> bool:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EBUSY):
                raise CheckpointIncomplete(
                    f"file {path.name} is still open for writing (or mapped writable) by a "
                    "process: close the file before CommitFile; a committed file is immutable"
                ) from None
            if not MemoryTier._lease_warned:
                MemoryTier._lease_warned = True
                logger.warning(
                    "the filesystem of %s does not grant file leases (%s): a rank that keeps "
                    "a file open after CommitFile cannot be detected",
                    self.root,
                    os.strerror(e.errno or 0),
                )
            return False
        try:
            fcntl.fcntl(fd, fcntl.F_SETOWN, 0)  # a lease break signals nobody
        except OSError:
            pass
        return True

    def allocated_bytes(self, path: Path) -> int:
        """Bytes of pages a file holds (0 if it does not exist); never follows a link."""
        try:
            return os.lstat(path).st_blocks * 512
        except FileNotFoundError:
            return 0

    def remove_file(self, path: Path) -> None:
        """Unlink a file or a planted link (never its target); missing is fine."""
        self.check_no_links(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def install(self, src: Path, dest: Path) -> None:
        """Rename a regular file over `dest` (an incoming copy becoming the held file)."""
        self.check_no_links(src)
        self.check_no_links(dest)
        if not stat.S_ISREG(os.lstat(src).st_mode):
            raise UnsafePath(f"memory tier file {src.name!r} is not a regular file")
        os.replace(src, dest)

    def move_checkpoint_dir(self, namespace: str, from_id: str, to_id: str) -> None:
        """Rename a save's data dir into another id's place (a replacing save taking the
        place of the generation it retired; that one's dir is gone). Missing is fine: a
        save with no file here yet has no dir."""
        src, dest = self.data_dir(namespace, from_id), self.data_dir(namespace, to_id)
        self.check_no_links(src)
        self.check_no_links(dest)
        try:
            os.rename(src, dest)
        except FileNotFoundError:
            pass

    def remove_checkpoint_dir(self, namespace: str, checkpoint_id: str) -> None:
        """Remove what is left of a checkpoint's data dir and the namespace dir if empty.
        A link in its place is unlinked, never followed (rmtree does not follow links
        below the top either)."""
        d = self.data_dir(namespace, checkpoint_id)
        try:
            self.check_no_links(d)
            st = os.lstat(d)
        except (FileNotFoundError, UnsafePath):
            st = None
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)
        for parent in (d.parent, self.manifest_root / namespace):
            try:
                parent.rmdir()
            except OSError:
                pass

    # ---- adoption scans ---------------------------------------------------------------
    def entries(self, directory: Path) -> Iterator[os.DirEntry[str]]:
        """Entries of a real directory, sorted, never following links; missing is empty."""
        try:
            with os.scandir(directory) as it:
                found = list(it)
        except FileNotFoundError:
            return iter(())
        return iter(sorted(found, key=lambda e: e.name))

    def remove_entry(self, entry: os.DirEntry[str], why: str) -> None:
        """Remove an entry the layout does not allow, without following it."""
        logger.warning("removing %s from the memory dir: %s", entry.path[:300], why)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass

    def fix_dir_mode(self, entry: os.DirEntry[str]) -> None:
        """A real directory of an older version (2770) loses its group write bit."""
        if entry.stat(follow_symlinks=False).st_mode & 0o022:
            _fchmod_dir(entry.path)

    # ---- verification -----------------------------------------------------------------
    def verify_file(self, path: Path, size: int, checksums: BlockChecksums) -> tuple[bool, str]:
        """Re-hash `path` and compare with `checksums`; returns (ok, reason)."""
        if checksums.algorithm != ALGORITHM:
            return False, f"unsupported algorithm {checksums.algorithm[:32]!r}"
        try:
            fd, st = self.open_regular(path)
        except FileNotFoundError:
            return False, "file is missing"
        except UnsafePath as e:
            return False, str(e)
        with open(fd, "rb", buffering=0, closefd=True) as f:
            if st.st_size != size:
                return False, f"size is {st.st_size} bytes, manifest says {size}"
            hasher = BlockHasher(checksums.block_size)
            buf = bytearray(_READ_CHUNK)
            view = memoryview(buf)
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
