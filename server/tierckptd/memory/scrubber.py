"""The background scrubber: every memory copy re-hashed at a bounded rate.

A reader verifies what it reads, so a flipped bit in a copy nobody reads (a buddy's
replica, an older checkpoint) would be found only when it is needed, maybe when it is
the last copy. The scrubber re-hashes each held file of every committed checkpoint
against its manifest's block checksums, block by block, at most `rate` bytes per second
(hashing costs CPU and memory bandwidth that training needs), stepping aside while a
save writes on this node. A mismatch is confirmed by a second, whole-file verification
of the file the catalog still holds (a copy evicted or repaired meanwhile is not
corrupt), then handed to `on_corrupt` with `where="scrubbed"`: the peer tier drops the
copy (never served again) and repairs it from another copy, like one found corrupt
while served.

A pass covers the checkpoints committed when it starts; passes start `interval`
seconds apart at the earliest, the first one `interval` after the daemon starts (its
adoption verified every copy). The end of each pass is logged and sets
`tierckpt_scrub_last_pass_unix`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tierckpt.checksum import ALGORITHM, BlockHasher
from tierckpt.errors import CheckpointNotFound
from tierckpt.units import format_size

from tierckptd.memory.tier import MemoryTier, UnsafePath
from tierckptd.model import CheckpointView, FileRecord
from tierckptd.ops import metrics

__all__ = ["OnCorrupt", "PassResult", "Scrubbed", "Scrubber", "Throttle"]

logger = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
OnCorrupt = Callable[[str, str, str, str, str], None]
Clock = Callable[[], float]


class Scrubbed(Protocol):
    """What the scrubber needs of the catalog (memory/ never imports catalog/)."""

    def list_checkpoints(
        self, namespace: str = "", include_uncommitted: bool = False
    ) -> list[CheckpointView]: ...

    def file_view(
        self, namespace: str, checkpoint_id: str, name: str
    ) -> tuple[FileRecord, str]: ...


class Throttle:
    """Paces reads to at most `rate` bytes per second: the time spent reading and
    hashing counts, and a pause (a save, a slow disk) is not caught up with a burst.
    `wait(seconds)` returns True when stopping."""

    def __init__(self, rate: int, *, clock: Clock, wait: Callable[[float], bool]) -> None:
        self.rate = rate
        self._clock = clock
        self._wait = wait
        self._next = clock()  # when the next read may start

    def take(self, nbytes: int) -> bool:
        """Account for `nbytes` just read; wait until the rate allows more. True: stop."""
        now = self._clock()
        self._next += nbytes / self.rate
        if self._next <= now:
            self._next = now  # behind (paused or slow): no credit carried over
            return False
        return self._wait(self._next - now)


@dataclass
class PassResult:
    """One pass: files and bytes re-hashed, the copies found corrupt, whether it ended
    early (the daemon stopping)."""

    files: int = 0
    nbytes: int = 0
    corrupt: int = 0
    stopped: bool = False


class Scrubber:
    """Re-verifies this node's memory copies in the background (module docstring).

    Args:
        rate: bytes per second, at most (> 0).
        interval: seconds from the start of a pass to the start of the next, at least.
        on_corrupt: (namespace, checkpoint_id, name, reason, where) of a corrupt copy.
        step_aside: given the scrubber's stop event, a fresh wait-while-a-save-writes
            for one file (`jobs.StepAside(...).wait`); it returns when reading may go on.
    """

    def __init__(
        self,
        catalog: Scrubbed,
        tier: MemoryTier,
        *,
        rate: int,
        interval: float,
        on_corrupt: OnCorrupt,
        step_aside: Callable[[threading.Event], Callable[[], object]] = lambda _: lambda: None,
        clock: Clock = time.monotonic,
    ) -> None:
        if rate <= 0:
            raise ValueError("the scrub rate must be positive (0 means no scrubber at all)")
        self.catalog = catalog
        self.tier = tier
        self.interval = interval
        self._on_corrupt = on_corrupt
        self._step_aside = step_aside
        self._clock = clock
        self._stop = threading.Event()
        self._throttle = Throttle(rate, clock=clock, wait=self._stop.wait)
        self._thread: threading.Thread | None = None
        self.passes = 0

    # ---- background thread ------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tierckptd-scrubber", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        # Adoption verified every copy at start: the first pass waits an interval too.
        due = self._clock() + self.interval
        while not self._stop.wait(max(0.0, due - self._clock())):
            due = self._clock() + self.interval  # from the start of this pass
            try:
                result = self.run_pass()
            except Exception:  # a bug must not end scrubbing for good
                logger.exception("scrub pass failed")
                result = PassResult()
            if result.stopped:
                return

    # ---- one pass ---------------------------------------------------------------------
    def run_pass(self) -> PassResult:
        """Re-hash every held file of the checkpoints committed now (calling thread)."""
        started = self._clock()
        result = PassResult()
        for view in self.catalog.list_checkpoints():
            for f in view.files:
                path = view.local_paths.get(f.name, "")
                if not path or f.checksums is None:
                    continue
                if self._stop.is_set():
                    result.stopped = True
                    return result
                reason = self.scrub_file(f, Path(path))
                result.files += 1
                result.nbytes += f.size
                if reason and self._confirm(view, f, path):
                    result.corrupt += 1
                    self._on_corrupt(view.namespace, view.checkpoint_id, f.name, reason, "scrubbed")
        if self._stop.is_set():
            result.stopped = True
            return result
        self.passes += 1
        metrics.SCRUB_LAST_PASS.set(time.time())
        logger.log(
            logging.WARNING if result.corrupt else logging.INFO,
            "scrub pass %d: %d memory copies (%s) re-hashed in %.0f s, %d corrupt%s",
            self.passes,
            result.files,
            format_size(result.nbytes),
            self._clock() - started,
            result.corrupt,
            " (dropped; each is repaired from another copy)" if result.corrupt else "",
        )
        return result

    def scrub_file(self, f: FileRecord, path: Path) -> str:
        """Re-hash one copy at the scrub rate; "" when it matches (or went away: evicted),
        else why not. Stops early at the first bad block."""
        cs = f.checksums
        assert cs is not None
        if cs.algorithm != ALGORITHM:
            return f"unsupported algorithm {cs.algorithm[:32]!r}"
        try:
            fd, st = self.tier.open_regular(path)
        except FileNotFoundError:
            return ""  # evicted, trimmed or being repaired: nothing to scrub
        except UnsafePath as e:
            return str(e)
        try:
            if st.st_size != f.size:
                return f"size is {st.st_size} bytes, manifest says {f.size}"
            hasher = BlockHasher(cs.block_size)
            checked, pos = 0, 0
            pause = self._step_aside(self._stop)
            while pos < f.size:
                pause()
                data = os.pread(fd, min(READ_CHUNK, f.size - pos), pos)
                if not data:
                    return f"file ends at {pos} of {f.size} bytes"
                hasher.update(data)
                pos += len(data)
                metrics.SCRUBBED_BYTES.inc(len(data))
                for block in range(checked, hasher.closed_blocks):
                    if hasher.block_digest(block) != cs.digest(block):
                        return f"checksum mismatch in block {block}"
                checked = hasher.closed_blocks
                if self._throttle.take(len(data)):
                    return ""  # stopping
            final = hasher.finish()
            for block in range(checked, final.block_count):
                if final.digest(block) != cs.digest(block):
                    return f"checksum mismatch in block {block}"
            if final.block_count != cs.block_count:
                return f"{final.block_count} blocks, manifest says {cs.block_count}"
            return ""
        except OSError as e:
            return f"cannot read it: {os.strerror(e.errno or 0)}"
        finally:
            os.close(fd)

    def _confirm(self, view: CheckpointView, f: FileRecord, path: str) -> bool:
        """Whether the copy the catalog holds now is still bad (not one evicted,
        trimmed or repaired since the scrub read it)."""
        try:
            held, now = self.catalog.file_view(view.namespace, view.checkpoint_id, f.name)
        except CheckpointNotFound:
            return False
        if now != path or held.checksums != f.checksums:
            return False
        assert f.checksums is not None
        ok, _ = self.tier.verify_file(Path(path), f.size, f.checksums)
        return not ok
