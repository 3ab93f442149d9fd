"""The warm pool: tmpfs files whose pages stay allocated, handed to the next save.

Writing into a fresh tmpfs file costs a page fault and a zeroed page per 4 KiB, about 4x
slower than overwriting pages that are already allocated, so evicted and deleted files
are renamed into ``pool/seg-<n>@<namespace>`` and handed to the next save (or incoming
copy) instead of being unlinked. A segment is handed only to the namespace it last served
(``seg-<n>@`` is a fresh one from prewarm; one prewarmed for a namespace's next save is
tagged with it so no other tenant takes it): another job must never read a previous
tenant's bytes, nor share an inode with a tenant that kept a descriptor open.

Not thread-safe on its own: the owner (the catalog) calls it under its lock, which it
hands to the pool so that `prewarm` can take it around its short steps (posix_fallocate
runs outside it) and `wait_for` can wait for a segment being preallocated.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tierckpt.units import format_size

from tierckptd.memory.tier import WRITING_MODE, MemoryTier, UnsafePath, no_space
from tierckptd.ops.faults import fault

__all__ = [
    "POOL_MODE",
    "PREWARM_SEGMENT",
    "PREWARM_STEP",
    "PREWARM_WAIT",
    "Segment",
    "WarmPool",
    "pick",
]

logger = logging.getLogger(__name__)

POOL_MODE = 0o600
PREWARM_SEGMENT = 1 << 30
# Longest an incoming copy waits for the pool segment being preallocated for it.
PREWARM_WAIT = 30.0
# A prewarm that may be stopped (for a save) checks between steps of this many bytes.
PREWARM_STEP = 64 << 20
_TOUCH_CHUNK = 1 << 20
_TOUCH_PASSES = 2  # see `preallocate`
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_SEGMENT = re.compile(r"seg-(\d+)@([A-Za-z0-9._-]{0,128})")


@dataclass
class Segment:
    """A warm pooled file; `previous_name` is the DCP file it last held or was prewarmed
    for (None if unknown), `namespace` the job it last served or was prewarmed for (""
    for a fresh segment any job may take), `prewarmed` whether it never held data
    (allocated by a prewarm; counted as such when a save takes it) and `touched_once`
    whether its pages were written only once (a file saved into new pages), which
    `activate` fixes."""

    path: Path
    size: int
    previous_name: str | None = None
    namespace: str = ""
    prewarmed: bool = False
    touched_once: bool = False


def pick(segments: list[Segment], file_name: str, remaining: int, namespace: str) -> Segment | None:
    """Best of `segments` for a new file of `namespace` given the rank's remaining
    reservation (`WarmPool.pick_segment`; the next-save prewarm plans with it too).

    Only segments of `namespace` or fresh ones qualify. Prefer the segment that last
    held (or was prewarmed for) a file of the same name (a periodic save writes the same
    files with the same sizes), allowing 25% slack; else the largest segment that fits
    in the reservation; else none.
    """
    mine = [s for s in segments if s.namespace in (namespace, "")]
    same = [s for s in mine if s.previous_name == file_name and s.size <= remaining * 1.25]
    if same:
        return max(same, key=lambda s: s.size)
    fitting = [s for s in mine if s.size <= remaining]
    return max(fitting, key=lambda s: s.size) if fitting else None


class WarmPool:
    """The segments under `tier.pool_dir`, and the ones being preallocated."""

    def __init__(
        self, tier: MemoryTier, lock: threading.Lock | threading.RLock | None = None
    ) -> None:
        self.tier = tier
        self.segments: list[Segment] = []
        self._next_segment = 0
        self._lock = lock if lock is not None else threading.Lock()
        # Bytes being preallocated (the budget counts them as reserved) and the names of
        # the files they are preallocated for.
        self.pending = 0
        self._prewarming: set[str] = set()
        self._prewarmed = threading.Condition(self._lock)

    @property
    def pool_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def prewarmed_bytes(self) -> int:
        """Pool bytes allocated by a prewarm and not handed out yet."""
        return sum(s.size for s in self.segments if s.prewarmed)

    def _segment_path(self, namespace: str) -> Path:
        path = self.tier.pool_dir / f"seg-{self._next_segment}@{namespace}"
        self._next_segment += 1
        return path

    def to_pool(
        self, path: Path, previous_name: str | None, namespace: str, *, touched_once: bool = False
    ) -> Segment | None:
        """Move a data file into the pool for reuse by `namespace` only; returns the new
        segment (None if it vanished, was empty, or was not a regular file: unlinked).
        `touched_once`: the file was written into pages its save allocated."""
        try:
            fd, st = self.tier.open_regular(path)
        except FileNotFoundError:
            return None
        except UnsafePath as e:
            logger.warning("%s; unlinking it", e)
            self.tier.remove_file(path)
            return None
        try:
            if st.st_size == 0 or st.st_uid != os.geteuid() or st.st_nlink != 1:
                self.tier.remove_file(path)
                return None
            os.fchmod(fd, POOL_MODE)  # nobody opens a pooled segment but the daemon
            dest = self._segment_path(namespace)
            fault("pool.recycle")
            os.rename(path, dest)
        finally:
            os.close(fd)
        seg = Segment(dest, st.st_size, previous_name, namespace, touched_once=touched_once)
        self.segments.append(seg)
        return seg

    def pick_segment(self, file_name: str, remaining: int, namespace: str) -> Segment | None:
        """Best segment of `namespace` (or a fresh one) for a new file (see `pick`)."""
        return pick(self.segments, file_name, remaining, namespace)

    def take_segment(self, seg: Segment, dest: Path) -> None:
        """Rename a pooled segment to a data path; its pages stay allocated."""
        tier = self.tier
        try:
            tier.make_dir(dest.parent)
        except OSError as e:
            raise no_space(e, f"creating the directory of {dest.name}", tier.root) from e
        tier.check_no_links(dest)
        self.segments.remove(seg)
        if not stat.S_ISREG(os.lstat(seg.path).st_mode):
            seg.path.unlink()
            raise UnsafePath(f"pool segment {seg.path.name!r} is not a regular file")
        fault("pool.reuse")
        os.rename(seg.path, dest)
        fd, _ = tier.open_regular(dest)
        try:
            os.fchmod(fd, WRITING_MODE)
        finally:
            os.close(fd)

    def drop_largest(self) -> int:
        """Unlink the largest segment (fewest unlinks to free space); returns bytes freed."""
        if not self.segments:
            return 0
        seg = max(self.segments, key=lambda s: s.size)
        self.segments.remove(seg)
        seg.path.unlink(missing_ok=True)
        return seg.size

    def adopt_pool(self) -> None:
        """Re-adopt warm segments left by a previous daemon; drop half-made prewarm files,
        segments of an unknown namespace (older versions) and anything not a regular file."""
        self.segments.clear()
        for entry in self.tier.entries(self.tier.pool_dir):
            match = _SEGMENT.fullmatch(entry.name)
            if not match or not entry.is_file(follow_symlinks=False):
                self.tier.remove_entry(entry, "not a pool segment")
                continue
            number, namespace = int(match.group(1)), match.group(2)
            self._next_segment = max(self._next_segment, number + 1)
            size = entry.stat(follow_symlinks=False).st_size
            if size and namespace not in (".", ".."):
                self.segments.append(Segment(Path(entry.path), size, None, namespace))
            else:
                os.unlink(entry.path)

    def new_prewarm_path(self, namespace: str = "") -> tuple[Path, Path]:
        """(temporary path, final segment path) for a segment being preallocated; tagged
        with `namespace` when it is for that job only ("" = fresh, for any job)."""
        final = self._segment_path(namespace)
        return self.tier.pool_dir / f".prewarm-{final.name}", final

    @staticmethod
    def _write_zeros(
        fd: int, size: int, stop: Callable[[], bool] | None, *, allocate: bool, passes: int
    ) -> int:
        """Write zeros `passes` times over the first `size` bytes of `fd`, a step of
        PREWARM_STEP at a time (posix_fallocate'd first with `allocate`); `stop()` is
        asked between steps. Returns the bytes done (`size` unless stopped)."""
        zeros = memoryview(bytes(min(size, _TOUCH_CHUNK)))
        for step in range(0, size, PREWARM_STEP):
            if step and stop is not None and stop():
                return step
            end = min(size, step + PREWARM_STEP)
            if allocate:
                os.posix_fallocate(fd, step, end - step)
            for _ in range(passes):
                for offset in range(step, end, _TOUCH_CHUNK):
                    os.pwrite(fd, zeros[: min(_TOUCH_CHUNK, end - offset)], offset)
        return size

    @staticmethod
    def preallocate(tmp: Path, size: int, stop: Callable[[], bool] | None = None) -> int:
        """Allocate `size` bytes of resident pages in `tmp` (long: run outside the catalog
        lock); returns the bytes allocated, fewer when `stop()` said so between steps of
        PREWARM_STEP (the pages made so far stay: a shorter warm segment still helps).

        posix_fallocate reserves the pages (ENOSPC up front); writing them makes them
        resident, since fallocated tmpfs pages are only touched at first write and a VM
        host may back guest memory only on first touch (3 s/GiB measured here). Each step
        is written `_TOUCH_PASSES` times: the kernel moves a page to its active LRU list
        only at its second access, and the save's write into a page touched once pays
        for that move (its first overwrite measured 20-25% slower than the next one)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, POOL_MODE)
        try:
            return WarmPool._write_zeros(fd, size, stop, allocate=True, passes=_TOUCH_PASSES)
        finally:
            os.close(fd)

    # ---- prewarm (takes the owner's lock itself) ---------------------------------------
    def prewarm(
        self,
        plan: Iterable[tuple[int, str | None]],
        admit: Callable[[int], bool],
        *,
        skip: Callable[[str], bool] = lambda name: False,
        why: str = "memory.prewarm",
        namespace: str = "",
        stop: Callable[[], bool] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Preallocate pool segments of the given (size, file name) while `admit(size)`
        (the budget, called under the lock) and the tmpfs allow; a segment named for a
        file is the one that file's copy (or save) takes, and one whose file `skip`s (its
        copy is already arriving) is left out. Segments are tagged with `namespace`
        ("" = fresh, for any job).

        posix_fallocate happens outside the lock, with the bytes counted in `pending` so
        concurrent reservations stay in budget. `stop()` (called outside the lock) ends
        the prewarm between steps: a save started. `progress(n)` is told the bytes of
        each segment made. Returns bytes allocated.
        """
        done = 0
        for size, name in plan:
            if stop is not None and stop():
                break
            # Copies (`skip`, `wait_for`) only concern fresh segments: a namespace's own
            # are for its next save, whose file names other jobs' copies share.
            copies = name if name is not None and not namespace else None
            with self._lock:
                if copies is not None and skip(copies):
                    continue  # its copy is already arriving, into pages of its own
                if not admit(size) or self.tier.free_bytes() < size:
                    break
                tmp, final = self.new_prewarm_path(namespace)
                self.pending += size
                if copies is not None:
                    self._prewarming.add(copies)
            made = 0
            try:
                made = self.preallocate(tmp, size, stop)
            except OSError as e:
                logger.warning("prewarm stopped after %s: %s", format_size(done), e)
                made = -1
            finally:
                with self._lock:
                    self.pending -= size
                    if made > 0:
                        tmp.rename(final)
                        self.segments.append(Segment(final, made, name, namespace, True))
                    else:
                        tmp.unlink(missing_ok=True)
                    self._prewarming.discard(copies or "")
                    self._prewarmed.notify_all()
            if made > 0:
                done += made
                if progress is not None:
                    progress(made)
            if made < size:
                break
        logger.info("prewarmed %s of pool segments (%s)", format_size(done), why)
        return done

    def activate(self, segments: Iterable[Segment], stop: Callable[[], bool] | None = None) -> int:
        """Write once more over each `touched_once` segment of `segments` still pooled,
        so that a save overwrites pages on the kernel's active list (see `preallocate`).

        A segment is out of `segments` while it is written (so no save takes it
        meanwhile: a save never shares pages with this pass), its bytes counted in
        `pending` as a prewarm's are; `stop()` ends the pass between steps, leaving the
        segment pooled and still `touched_once`. Returns bytes touched."""
        done = 0
        for seg in segments:
            if stop is not None and stop():
                break
            with self._lock:
                if not seg.touched_once or seg not in self.segments:
                    continue
                self.segments.remove(seg)
                self.pending += seg.size
            finished = False
            try:
                fd, _ = self.tier.open_regular(seg.path, os.O_WRONLY)
                try:
                    made = self._write_zeros(fd, seg.size, stop, allocate=False, passes=1)
                    finished = made == seg.size
                finally:
                    os.close(fd)
            except (OSError, UnsafePath) as e:
                logger.warning("cannot touch pool segment %s: %s", seg.path.name, e)
            finally:
                with self._lock:
                    self.pending -= seg.size
                    seg.touched_once = not finished
                    self.segments.append(seg)
                    self._prewarmed.notify_all()
            if finished:
                done += seg.size
            else:
                break
        return done

    def wait_pending(self, timeout: float = PREWARM_WAIT) -> None:
        """Wait (under the owner's lock) until no segment is being preallocated: a save
        whose reservation would not fit beside them waits for them to join the pool,
        which the budget may then drop (a prewarm never makes a reservation fail)."""
        self._wait_while(lambda: self.pending > 0, timeout)

    def wait_for(self, name: str, timeout: float = PREWARM_WAIT) -> None:
        """Wait (under the owner's lock) while a segment for `name` is preallocated: it is
        moments from ready, better than allocating the same pages twice."""
        self._wait_while(lambda: name in self._prewarming, timeout)

    def _wait_while(self, busy: Callable[[], bool], timeout: float) -> None:
        """Wait on the prewarm condition (its lock held) while `busy()`, at most `timeout`."""
        deadline = time.monotonic() + timeout
        while busy() and time.monotonic() < deadline:
            self._prewarmed.wait(max(0.0, deadline - time.monotonic()))
