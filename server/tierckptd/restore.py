"""One restore chain: a verified local copy of a committed file, from the nearest tier.

Every way a file comes back into the memory tier goes through `Restorer.ensure_local`:
the EnsureLocal RPC (the reader, `tierckpt pull`), the drain's `.metadata`, healing's
repairs and a replacement node's prefetch. The restorer tries its sources in order
(memory, each peer holder, the persistent tier), lands a copy through
`memory.incoming.install_copy` (budget-checked, every block verified against the
manifest's checksums as it arrives) and, when no source had a valid copy, raises one
error naming every source tried and why:

- DATA_LOSS (`ChecksumMismatch`) only when every copy found was corrupt;
- UNAVAILABLE (`TierUnavailable`) when some tier could not be asked (it may hold one);
- DATA_LOSS (`CheckpointLost`, "checkpoint lost: ...") when every source answered
  without it: no copy is left anywhere, which is not a checksum error.

`FileSource` is the one small interface every tier implements. Its contract (enforced by
`tests/conformance/`): `chunks` yields the file's original bytes as (offset, data)
pieces at increasing offsets, or raises `CheckpointNotFound` (this source does not hold
it), `SourceUnavailable` (the tier could not be asked) or `ChecksumMismatch` (what it
holds is damaged and it knows so). A source never installs anything itself; verification
happens where the bytes land, so a source that hands out a flipped byte is caught there.

Lock order: restorer file lock -> catalog lock (install_copy takes the catalog lock
briefly; a source never holds a lock of its own across a yield).
"""

from __future__ import annotations

import enum
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tierckpt.checksum import BytesLike
from tierckpt.errors import (
    CHECKPOINT_LOST_PREFIX,
    TIER_UNAVAILABLE_PREFIX,
    CheckpointLost,
    CheckpointNotFound,
    ChecksumMismatch,
    InvalidArgument,
    TierUnavailable,
)
from tierckpt.names import check_checkpoint_id, check_file_name, check_namespace

from tierckptd.catalog import Catalog
from tierckptd.errors import SourceUnavailable
from tierckptd.memory.incoming import install_copy, install_ranges, split_ranges
from tierckptd.model import FileRecord
from tierckptd.ops import logs, metrics

__all__ = [
    "Attempt",
    "FileSource",
    "Landed",
    "Rejected",
    "Outcome",
    "PeerCopies",
    "PersistentCopies",
    "RangeSource",
    "RestoreSources",
    "Restorer",
    "SourceBusy",
    "SourcesFor",
    "final_error",
    "no_sources",
]

logger = logging.getLogger(__name__)


BUSY_PREFIX = "busy: "
# Seconds a restore keeps asking when every holder it asked was busy, and the pause
# between rounds (random, so that a wave of fetchers does not come back in step).
BUSY_PATIENCE = 30.0
BUSY_PAUSE = (0.05, 0.25)
# A file at least this large comes from several holders at once, in ranges.
PARALLEL_MIN = 64 << 20
RANGE_SOURCES = 4


class SourceBusy(SourceUnavailable):
    """The source holds the file but serves its limit of transfers now: ask another,
    or again soon (a restore retries for BUSY_PATIENCE s while holders are busy)."""


class FileSource(Protocol):
    """A tier that may hold a committed file's bytes (see the module docstring)."""

    @property
    def name(self) -> str:
        """What the source is, for errors and logs: "memory", "peer node-b",
        "persistent s3://bucket/prefix"."""
        ...

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        """The original bytes of `f` as (offset, data) pieces at increasing offsets."""
        ...


@runtime_checkable
class RangeSource(Protocol):
    """Optional for a `FileSource`: it serves byte ranges, so a large file can come
    from several holders at once (`Restorer._from_ranges`)."""

    @property
    def name(self) -> str: ...

    def holds(self, namespace: str, checkpoint_id: str, f: FileRecord) -> bool:
        """Whether it holds a copy now (a cheap question)."""
        ...

    def range_chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord, offset: int, length: int
    ) -> Iterator[tuple[int, BytesLike]]:
        """Bytes `offset`..`offset+length` of `f`, as `FileSource.chunks`."""
        ...


@runtime_checkable
class Landed(Protocol):
    """Optional for a `FileSource`: told when a copy it gave was installed (a peer
    source tells the other peers this node now holds a copy)."""

    def landed(self, namespace: str, checkpoint_id: str, f: FileRecord) -> None: ...


@runtime_checkable
class Rejected(Protocol):
    """Optional for a `FileSource`: told when bytes it gave failed verification where
    they landed (a peer source reports them to a bulk sender, which re-checks its copy)."""

    def rejected(self, namespace: str, checkpoint_id: str, f: FileRecord) -> None: ...


SourcesFor = Callable[[str, str, FileRecord], Sequence[FileSource]]
"""The remote sources to try for one file, nearest first (`RestoreSources`)."""


def no_sources(namespace: str, checkpoint_id: str, f: FileRecord) -> Sequence[FileSource]:
    """A `SourcesFor` with no remote tier (a node with no peers and no persistent tier)."""
    return ()


class PeerCopies(Protocol):
    """The peer tier's sources of one file, in its order: the file's owner, its replica
    holders, then the other peers (`peers.source.PeerSources`)."""

    def __call__(self, f: FileRecord) -> Sequence[FileSource]: ...


class PersistentCopies(Protocol):
    """The persistent tier a checkpoint recorded with `url` drains to, as a source;
    None when this node has none there (`persistent.roots.Roots.source`)."""

    def __call__(self, url: str) -> FileSource | None: ...


class RestoreSources:
    """The chain's order after memory: the file's peers (holders first), then the
    persistent tier the checkpoint drained to (its own URL, from its record). Built from
    the two tiers' source factories; either may be absent (no peers, no persistent tier).
    """

    def __init__(
        self,
        catalog: Catalog,
        *,
        peers: PeerCopies | None = None,
        persistent: PersistentCopies | None = None,
    ) -> None:
        self.catalog = catalog
        self._peers = peers
        self._persistent = persistent

    def __call__(self, namespace: str, checkpoint_id: str, f: FileRecord) -> list[FileSource]:
        found = list(self._peers(f)) if self._peers is not None else []
        if self._persistent is not None:
            tier = self._persistent(self.catalog.persistent_url(namespace, checkpoint_id))
            if tier is not None:
                found.append(tier)
        return found


class Outcome(enum.Enum):
    MISSING = "missing"
    UNAVAILABLE = "unavailable"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class Attempt:
    source: str
    outcome: Outcome
    cause: str

    def __str__(self) -> str:
        return f"{self.source}: {self.outcome.value} ({self.cause})"


def final_error(what: str, attempts: Sequence[Attempt]) -> Exception:
    """The one error for a file no source could give: UNAVAILABLE if a tier could not be
    asked, else DATA_LOSS if a copy was found and every one was corrupt, else DATA_LOSS
    as `CheckpointLost`: every source answered without it."""
    tried = "; ".join(str(a) for a in attempts) or "no source to ask"
    outcomes = {a.outcome for a in attempts}
    if Outcome.UNAVAILABLE in outcomes:
        unavailable = [a for a in attempts if a.outcome is Outcome.UNAVAILABLE]
        down = ", ".join(a.source for a in unavailable)
        # A peer whose data came too slowly (peers/client.py) is reachable: its link is slow.
        slow = all("too slow (" in a.cause for a in unavailable)
        advice = f"the link to {down} is too slow" if slow else f"retry once {down} is reachable"
        return TierUnavailable(
            f"{TIER_UNAVAILABLE_PREFIX}{down}: no valid copy of {what} could be restored "
            f"(tried {tried}); {advice}"
        )
    if Outcome.CORRUPT in outcomes:
        return ChecksumMismatch(f"every copy of {what} found is corrupt (tried {tried})")
    return CheckpointLost(
        f"{CHECKPOINT_LOST_PREFIX}no copy of {what} is left on any tier (tried {tried}); "
        "load an older checkpoint (checkpoint_id=None picks the newest complete one)"
    )


def _kind(source: str) -> str:
    """The `source` label of a source's name ("peer node-b" -> "peer"), bounded."""
    kind = source.split(" ", 1)[0]
    return kind if kind in metrics.RESTORE_SOURCES else "peer"


class Restorer:
    """Brings a verified copy of a committed file into the local memory tier."""

    def __init__(
        self,
        catalog: Catalog,
        sources_for: SourcesFor,
        *,
        on_corrupt_local: Callable[[str, str, str, str], None] | None = None,
        parallel_min: int = PARALLEL_MIN,
        range_sources: int = RANGE_SOURCES,
        busy_patience: float = BUSY_PATIENCE,
    ) -> None:
        """`parallel_min`: files this large come from up to `range_sources` holders at
        once; `busy_patience`: how long a restore asks again while every holder is busy."""
        self.catalog = catalog
        self.parallel_min = parallel_min
        self.range_sources = range_sources
        self.busy_patience = busy_patience
        self.sources_for = sources_for
        self.on_corrupt_local = on_corrupt_local
        self._lock = threading.Lock()
        self._file_locks: dict[tuple[str, str, str], tuple[threading.Lock, int]] = {}

    @contextmanager
    def file_lock(self, namespace: str, checkpoint_id: str, name: str) -> Iterator[None]:
        """Hold the lock of one file (validated names only); the entry goes with its last
        user, so names asked about once do not stay in memory (audit M6)."""
        key = (
            check_namespace(namespace),
            check_checkpoint_id(checkpoint_id),
            check_file_name(name),
        )
        with self._lock:
            lock, users = self._file_locks.get(key, (threading.Lock(), 0))
            self._file_locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._file_locks[key]
                if users > 1:
                    self._file_locks[key] = (lock, users - 1)
                else:
                    del self._file_locks[key]

    def file_locks_in_use(self) -> int:
        with self._lock:
            return len(self._file_locks)

    def ensure_local(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        repair: bool = False,
        *,
        timed: bool = False,
    ) -> tuple[FileRecord, str]:
        """A verified local copy of one file: (its record, its local path). With `repair`
        the local copy is verified first and replaced when corrupt. `timed`: a restore
        (EnsureLocal), observed in `tierckpt_restore_duration_seconds{source}`; the
        drain's and healing's own fetches are not restores."""
        started = time.monotonic()
        f, path, source = self._ensure_local(namespace, checkpoint_id, name, repair)
        if timed:
            metrics.RESTORE_DURATION.labels(source=source).observe(time.monotonic() - started)
        return f, path

    def _ensure_local(
        self, namespace: str, checkpoint_id: str, name: str, repair: bool
    ) -> tuple[FileRecord, str, str]:
        """`ensure_local`, and the kind of source the copy came from (RESTORE_SOURCES)."""
        what = f"{namespace}/{checkpoint_id}/{name}"
        with self.file_lock(namespace, checkpoint_id, name):
            f, path = self.catalog.file_view(namespace, checkpoint_id, name)
            if f.checksums is None:
                raise CheckpointNotFound(f"{what}: the manifest has no checksums for it")
            attempts: list[Attempt] = []
            if path and not repair:
                return f, path, "memory"
            if path:
                ok, reason = self.catalog.tier.verify_file(Path(path), f.size, f.checksums)
                if ok:
                    logger.info("repair of %s asked, but the local copy verifies", what)
                    return f, path, "memory"
                attempts.append(Attempt("memory", Outcome.CORRUPT, reason))
                metrics.CORRUPT_COPIES.labels(where="local").inc()
                self.catalog.drop_local_copy(namespace, checkpoint_id, name)
                logger.error(
                    "corrupt copy of %s on node %s (local): %s; restoring a verified copy",
                    what,
                    self.catalog.node_id,
                    reason,
                )
                if self.on_corrupt_local is not None:
                    self.on_corrupt_local(namespace, checkpoint_id, name, reason)
            else:
                attempts.append(Attempt("memory", Outcome.MISSING, "not held on this node"))
            tried = attempts[:]
            patience = time.monotonic() + self.busy_patience
            while True:
                sources = list(self.sources_for(namespace, checkpoint_id, f))
                got = self._from_ranges(namespace, checkpoint_id, f, sources)
                if got is not None:
                    return got
                attempts = tried[:]
                busy = False
                for source in sources:
                    got = self._from(source, namespace, checkpoint_id, f, attempts)
                    if got is not None:
                        return got
                    busy = busy or attempts[-1].cause.startswith(BUSY_PREFIX)
                if not busy or time.monotonic() >= patience:
                    break
                # Every holder asked was at its limit of sends: the wave of restores it
                # serves lands copies elsewhere meanwhile; ask again (sources anew).
                time.sleep(random.uniform(*BUSY_PAUSE))
            raise final_error(what, attempts)

    def _from(
        self,
        source: FileSource,
        namespace: str,
        checkpoint_id: str,
        f: FileRecord,
        attempts: list[Attempt],
    ) -> tuple[FileRecord, str, str] | None:
        """Land `f` from one source: (record, path, source kind), or None with the
        reason appended to `attempts`."""
        what = f"{namespace}/{checkpoint_id}/{f.name}"
        try:
            held = install_copy(
                self.catalog,
                namespace,
                checkpoint_id,
                f,
                source.chunks(namespace, checkpoint_id, f),
                what=f"{what} from {source.name}",
                restored=True,
            )
        except CheckpointNotFound as e:
            attempts.append(Attempt(source.name, Outcome.MISSING, str(e)))
            return None
        except SourceBusy as e:
            logger.info("restore of %s: %s", what, e)
            attempts.append(Attempt(source.name, Outcome.UNAVAILABLE, BUSY_PREFIX + e.cause))
            return None
        except SourceUnavailable as e:
            logger.warning("restore of %s: %s", what, e)
            attempts.append(Attempt(source.name, Outcome.UNAVAILABLE, e.cause))
            return None
        except (ChecksumMismatch, InvalidArgument) as e:
            # Damaged bytes, or a stream cut short or out of order: not this copy.
            logger.error("restore of %s from %s: %s", what, source.name, e)
            attempts.append(Attempt(source.name, Outcome.CORRUPT, str(e)))
            if isinstance(e, ChecksumMismatch) and isinstance(source, Rejected):
                source.rejected(namespace, checkpoint_id, f)
            return None
        return self._landed(held, namespace, checkpoint_id, f, [source], attempts)

    def _landed(
        self,
        held: FileRecord | None,
        namespace: str,
        checkpoint_id: str,
        f: FileRecord,
        sources: Sequence[FileSource | RangeSource],
        attempts: list[Attempt],
    ) -> tuple[FileRecord, str, str] | None:
        what = f"{namespace}/{checkpoint_id}/{f.name}"
        name = ", ".join(s.name for s in sources)
        if held is None:  # another route installed it meanwhile
            f, path = self.catalog.file_view(namespace, checkpoint_id, f.name)
            if path:
                return f, path, "memory"
            attempts.append(Attempt(name, Outcome.MISSING, "evicted as it landed"))
            return None
        f = held
        metrics.FETCHED_BYTES.inc(f.size)
        logger.info(
            "restored %s from %s (%d bytes)",
            what,
            name,
            f.size,
            extra=logs.context(namespace, checkpoint_id, f.rank),
        )
        source = sources[0]
        if isinstance(source, Landed):
            try:
                source.landed(namespace, checkpoint_id, f)
            except Exception as e:
                logger.warning("after restoring %s from %s: %s", what, source.name, e)
        path = str(self.catalog.tier.file_path(namespace, checkpoint_id, f.name))
        return f, path, _kind(source.name)

    def _from_ranges(
        self, namespace: str, checkpoint_id: str, f: FileRecord, sources: Sequence[FileSource]
    ) -> tuple[FileRecord, str, str] | None:
        """A large file from several holders at once: split into one range of whole
        blocks per holder (up to `range_sources` of them), each fetched in its own
        thread, every block verified as it lands (`install_ranges`). None when fewer
        than two sources hold it or any range failed (logged): the chain then asks one
        source after another, which names every failure."""
        if f.size < self.parallel_min or self.range_sources < 2:
            return None
        holders: list[RangeSource] = []
        # The known holders come first (`peers.source.peer_sources`): ask only a few, not
        # every peer of a large cluster, whether it holds the file.
        for source in sources[: 2 * self.range_sources]:
            if isinstance(source, RangeSource) and source.holds(namespace, checkpoint_id, f):
                holders.append(source)
                if len(holders) == self.range_sources:
                    break
        if len(holders) < 2:
            return None
        what = f"{namespace}/{checkpoint_id}/{f.name}"
        parts = split_ranges(f, len(holders))
        ranges = [
            (start, n, functools.partial(src.range_chunks, namespace, checkpoint_id, f))
            for (start, n), src in zip(parts, holders, strict=False)
        ]
        names = ", ".join(s.name for s in holders[: len(ranges)])

        def rejected(index: int) -> None:
            source = holders[index]
            if isinstance(source, Rejected):
                source.rejected(namespace, checkpoint_id, f)

        try:
            held = install_ranges(
                self.catalog,
                namespace,
                checkpoint_id,
                f,
                ranges,
                what=f"{what} from {names}",
                restored=True,
                rejected=rejected,
            )
        except (CheckpointNotFound, SourceUnavailable, ChecksumMismatch, InvalidArgument) as e:
            logger.warning(
                "restore of %s from %s at once: %s; one source at a time", what, names, e
            )
            return None
        return self._landed(held, namespace, checkpoint_id, f, holders, [])
