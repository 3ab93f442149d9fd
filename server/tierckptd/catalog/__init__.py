"""The catalog: every checkpoint of this node's memory tier, its lifecycle and its budget.

Budget invariant (DESIGN.md invariant 7), checked under one lock::

    C (committed file bytes) + R (outstanding reservations) + P (warm pool) <= budget

Reservations are taken before a rank writes a byte, so a save that cannot fit is refused
up front with a message naming the budget. Pool bytes are reclaimable: they are dropped
(largest first) whenever a reservation needs room. Long I/O (hashing, preallocation)
never runs under the lock; renames and small manifest writes do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tierckpt.checksum import ALGORITHM, DIGEST_SIZE, BlockChecksums
from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointNotFound,
    InvalidArgument,
    InvalidName,
    MemoryBudgetExceeded,
    TierckptError,
)
from tierckpt.names import METADATA_FILE, check_checkpoint_id, check_file_name, check_namespace

from tierckptd import __version__
from tierckptd.catalog.retention import Candidate, memory_evictions
from tierckptd.config import format_size
from tierckptd.memory.manifest import ManifestError, read_manifest, write_manifest
from tierckptd.memory.manifest import to_json as manifest_to_json
from tierckptd.memory.tier import MemoryTier, Segment, UnsafePath, hash_rate, no_space
from tierckptd.model import (
    MAX_REPLICAS,
    MAX_SEQUENCE,
    CheckpointRecord,
    CheckpointView,
    FileRecord,
    NodeStatusView,
    State,
)
from tierckptd.ops import metrics
from tierckptd.peers.placement import coordinator_of

__all__ = ["Catalog", "Sweeper", "VerifyResult"]

logger = logging.getLogger(__name__)

Key = tuple[str, str]
PREWARM_SEGMENT = 1 << 30
# Longest an incoming copy waits for the pool segment being preallocated for it.
PREWARM_WAIT = 30.0
# Most files one checkpoint may list (a DCP save has a few per rank).
MAX_FILES = 100_000


def listing(names: list[str], shown: int = 5) -> str:
    """Names for a message, bounded: "a, b, c and 199,997 more" (each cut to 64 chars)."""
    head = ", ".join(n[:64] for n in names[:shown]) or "none"
    return head + (f" and {len(names) - shown:,} more" if len(names) > shown else "")


def _key_name(key: Key) -> str:
    return f"{key[0]}/{key[1]}"


def _manifest_estimate(rec: CheckpointRecord) -> int:
    """About the bytes of `rec`'s manifest JSON (each digest is a ~40-byte line),
    without building it: a budget check before the write."""
    blocks = sum(f.checksums.block_count for f in rec.files.values() if f.checksums is not None)
    return 512 + 40 * blocks + sum(256 + 40 * len(f.replica_nodes) for f in rec.files.values())


def _summary(f: FileRecord) -> str:
    return f.checksums.summary() if f.checksums is not None else "none"


class VerifyResult:
    """Outcome of re-hashing a checkpoint's files."""

    def __init__(self, ok: bool, verified_bytes: int, corrupt_files: list[str]) -> None:
        self.ok = ok
        self.verified_bytes = verified_bytes
        self.corrupt_files = corrupt_files


class Catalog:
    """Lifecycle and budget of the checkpoints in one memory tier (thread-safe)."""

    def __init__(
        self,
        tier: MemoryTier,
        *,
        node_id: str,
        failure_domain: str,
        budget: int,
        recycle: bool = True,
        memory_keep_last: int = 2,
        abandon_after: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.tier = tier
        self.node_id = node_id
        self.failure_domain = failure_domain
        self.budget = budget
        self.recycle = recycle
        self.memory_keep_last = memory_keep_last
        self.abandon_after = abandon_after
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.RLock()
        # Names of pool segments being preallocated for a file's restore right now.
        self._prewarming: set[str] = set()
        self._prewarmed = threading.Condition(self._lock)
        self._records: dict[Key, CheckpointRecord] = {}
        self._next_sequence = 1
        self._prewarm_pending = 0
        self._quarantined_bytes = 0
        # Peer tier: extra copies wanted per file (0 = no peers), bytes of files being
        # received from peers (counted like reservations), per-checkpoint health marks
        # set by the healer ("under-replicated", "lost"), and checkpoints deleted here
        # (a peer's healer must not push them back).
        self.replica_target = 0
        self._incoming: dict[tuple[str, str, str], int] = {}
        self._health: dict[Key, str] = {}
        self._gone: set[Key] = set()
        # JSON bytes of the manifests of checkpoints other nodes coordinate: they live in
        # this node's memory, so they count against the budget like files (a peer could
        # otherwise fill the tmpfs with manifests alone).
        self._manifest_bytes: dict[Key, int] = {}
        # Persistent tier: drain every `drain_every`-th committed checkpoint (0: no
        # persistent tier), the checkpoints known to be durable there, and a callback
        # (called under the lock: it must only enqueue) for every new commit here.
        self.drain_every = 0
        self._durable: set[Key] = set()
        self._drain_failed: dict[Key, bool] = {}  # shown as "drain-failed"; True: refused
        self.on_committed: Callable[[str, str], None] | None = None

    # ---- accounting (call under the lock) ---------------------------------------------
    def _used(self) -> int:
        return (
            self._quarantined_bytes
            + sum(r.held_bytes for r in self._records.values())
            + sum(self._manifest_bytes.values())
        )

    def _reserved(self) -> int:
        """Pages promised but not yet held: save reservations, incoming copies, and pool
        segments still being preallocated (they join the pool when they are complete)."""
        return (
            sum(sum(r.reservations.values()) for r in self._records.values())
            + sum(self._incoming.values())
            + self._prewarm_pending
        )

    def _pool(self) -> int:
        return self.tier.pool_bytes

    def _trim_pool(self, extra: int = 0) -> None:
        """Drop pool segments, largest first, until C + R + P + extra fits the budget."""
        while self._used() + self._reserved() + self._pool() + extra > self.budget:
            if not self.tier.drop_largest():
                return

    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved()

    def pool_bytes(self) -> int:
        with self._lock:
            return self._pool()

    def committed_count(self) -> int:
        with self._lock:
            return sum(r.state is State.COMMITTED for r in self._records.values())

    # ---- helpers ----------------------------------------------------------------------
    def _due(self, rec: CheckpointRecord) -> bool:
        """Whether the checkpoint is due for the persistent tier (call under the lock).
        One the drain refused (hostile `.metadata`) never can be: it is no longer due."""
        return (
            self.drain_every > 0
            and rec.sequence % self.drain_every == 0
            and not self._drain_failed.get(rec.key, False)
        )

    def _notify_committed(self, rec: CheckpointRecord) -> None:
        if self.on_committed is not None and self._due(rec):
            self.on_committed(rec.namespace, rec.checkpoint_id)

    @staticmethod
    def _ref(namespace: str, checkpoint_id: str) -> Key:
        return check_namespace(namespace), check_checkpoint_id(checkpoint_id)

    def _newest(self, namespace: str) -> CheckpointRecord | None:
        committed = [
            r
            for r in self._records.values()
            if r.namespace == namespace and r.state is State.COMMITTED
        ]
        return max(committed, key=lambda r: r.order, default=None)

    def _not_found(self, namespace: str, checkpoint_id: str) -> CheckpointNotFound:
        newest = self._newest(namespace)
        tail = (
            f"the newest committed checkpoint of {namespace} is {newest.checkpoint_id}"
            if newest
            else f"{namespace} has no committed checkpoints"
        )
        what = (
            f"checkpoint {namespace}/{checkpoint_id}"
            if checkpoint_id
            else f"no checkpoint of {namespace}"
        )
        verb = "not found" if checkpoint_id else "found"
        return CheckpointNotFound(f"{what} {verb} on node {self.node_id}; {tail}")

    def _writing(self, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        key = self._ref(namespace, checkpoint_id)
        rec = self._records.get(key)
        if rec is None or rec.state is not State.WRITING:
            state = rec.state.value if rec else "unknown"
            raise CheckpointIncomplete(
                f"checkpoint {namespace}/{checkpoint_id} is {state} on node {self.node_id}, not "
                "WRITING: call BeginCheckpoint first (an idle save is aborted after "
                "[memory] abandon_after seconds)"
            )
        rec.last_activity = self._clock()
        return rec

    def _view(self, rec: CheckpointRecord) -> CheckpointView:
        files = tuple(
            dataclasses.replace(f, replica_nodes=list(f.replica_nodes))
            for f in sorted(rec.files.values(), key=lambda f: f.name)
        )
        paths = {
            f.name: str(self.tier.file_path(rec.namespace, rec.checkpoint_id, f.name))
            if f.held
            else ""
            for f in files
        }
        state = rec.state
        health = self._health.get(rec.key, "")
        k = self.replica_target
        if (
            state is State.COMMITTED
            and k > 0
            and not health
            and files
            and all(len(set(f.replica_nodes) - {f.owner_node}) >= k for f in files)
        ):
            state = State.REPLICATED
        durable = rec.state is State.COMMITTED and rec.key in self._durable
        if durable:
            state = State.DURABLE
        tiers: list[str] = []
        if rec.state is State.COMMITTED:
            if all(f.held for f in files):
                tiers.append("memory")
            if any(
                (f.owner_node and f.owner_node != self.node_id and not f.held)
                or set(f.replica_nodes) - {self.node_id}
                for f in files
            ):
                tiers.append("peer")
            if durable:
                tiers.append("persistent")
            if health:
                tiers.append(health)
            if rec.key in self._drain_failed:
                tiers.append("drain-failed")
        return CheckpointView(
            namespace=rec.namespace,
            checkpoint_id=rec.checkpoint_id,
            state=state,
            size_bytes=rec.committed_bytes,
            created_unix=rec.created_unix,
            committed_unix=rec.committed_unix,
            sequence=rec.sequence,
            pinned=rec.pinned,
            files=files,
            local_paths=paths,
            tiers=tuple(tiers),
        )

    def _release_files(self, rec: CheckpointRecord) -> int:
        """Take a checkpoint's files out of the memory tier (into the pool when
        recycling) and remove its directory; returns bytes freed."""
        freed = 0
        for f in rec.files.values():
            path = self.tier.file_path(rec.namespace, rec.checkpoint_id, f.name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                freed += st.st_size
            try:
                if self.recycle:
                    self.tier.to_pool(path, f.name, rec.namespace)
                else:
                    self.tier.remove_file(path)
            except (OSError, UnsafePath) as e:
                logger.warning("cannot release %s/%s/%s: %s", *rec.key, f.name, e)
        self.tier.remove_checkpoint_dir(rec.namespace, rec.checkpoint_id)
        return freed

    def _collect(self, rec: CheckpointRecord) -> int:
        """Remove a checkpoint and its files; returns bytes freed."""
        freed = self._release_files(rec)
        self._records.pop(rec.key, None)
        self._manifest_bytes.pop(rec.key, None)
        self._trim_pool()
        return freed

    def _abort(self, rec: CheckpointRecord, why: str) -> None:
        rec.state = State.ABORTED
        rec.reservations.clear()
        freed = self._collect(rec)
        metrics.ABORTS.inc()
        logger.warning(
            "aborted %s/%s (%s); collected %d files, %s",
            rec.namespace,
            rec.checkpoint_id,
            why,
            len(rec.files),
            format_size(freed),
        )

    # ---- lifecycle --------------------------------------------------------------------
    def begin(self, namespace: str, checkpoint_id: str, rank: int) -> None:
        """Open a save; idempotent for every rank. Committed ids are immutable."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and rec.state is State.COMMITTED:
                raise CheckpointExists(
                    f"checkpoint {namespace}/{checkpoint_id} is already committed on node "
                    f"{self.node_id}; committed checkpoints are immutable: pick a new checkpoint_id"
                )
            self._gone.discard(key)  # saved again after a delete: peers may publish it
            if rec is None:
                rec = CheckpointRecord(
                    namespace=namespace,
                    checkpoint_id=checkpoint_id,
                    state=State.WRITING,
                    created_unix=self._wall(),
                    node_id=self.node_id,
                )
                self._records[key] = rec
                logger.info("begin %s/%s (rank %d)", namespace, checkpoint_id, rank)
            rec.last_activity = self._clock()

    def reserve(self, namespace: str, checkpoint_id: str, rank: int, nbytes: int) -> int:
        """Reserve `nbytes` more for (checkpoint, rank); returns the rank's reservation."""
        with self._lock:
            rec = self._writing(namespace, checkpoint_id)
            used, reserved = self._used(), self._reserved()
            if used + reserved + nbytes > self.budget:
                metrics.REJECTED_SAVES.labels(reason="budget").inc()
                count = len(self._records)
                raise MemoryBudgetExceeded(
                    f"memory budget exceeded: this save needs {format_size(nbytes)} but "
                    f"{format_size(used + reserved)} of memory.budget={format_size(self.budget)} "
                    f"are in use by {count} checkpoint{'s' if count != 1 else ''} on node "
                    f"{self.node_id}; raise [memory] budget, lower [retention] memory_keep_last, "
                    "or remove checkpoints with `tierckpt rm`"
                )
            # Free space must back this reservation and every one not yet written
            # (their pages are not allocated yet); the pool can be unlinked to make room.
            free, unwritten = self.tier.free_bytes(), self._unwritten()
            if free - unwritten + self.tier.pool_bytes < nbytes:
                metrics.REJECTED_SAVES.labels(reason="filesystem").inc()
                raise MemoryBudgetExceeded(
                    f"the filesystem of the memory dir {self.tier.root} has only "
                    f"{format_size(free)} free (+ {format_size(self.tier.pool_bytes)} reclaimable "
                    f"pool), {format_size(unwritten)} of it promised to reservations not "
                    f"written yet, but this save needs {format_size(nbytes)}; enlarge /dev/shm "
                    "(tmpfs size=) or lower [memory] budget below the tmpfs size"
                )
            self._trim_pool(extra=nbytes)
            while self.tier.free_bytes() - unwritten < nbytes and self.tier.drop_largest():
                pass
            rec.reservations[rank] = rec.reservations.get(rank, 0) + nbytes
            return rec.reservations[rank]

    def _unwritten(self) -> int:
        """Reserved bytes whose pages are not allocated yet (call under the lock): per
        rank, its reservation less the pages its open files already hold."""
        total = self._prewarm_pending
        for rec in self._records.values():
            if rec.state is not State.WRITING or not rec.reservations:
                continue
            held: dict[int, int] = {}
            for f in rec.files.values():
                if not f.committed:
                    path = self.tier.file_path(rec.namespace, rec.checkpoint_id, f.name)
                    held[f.rank] = held.get(f.rank, 0) + self.tier.allocated_bytes(path)
            total += sum(max(0, n - held.get(r, 0)) for r, n in rec.reservations.items())
        for (namespace, checkpoint_id, name), nbytes in self._incoming.items():
            path = self.tier.incoming_path(namespace, checkpoint_id, name)
            total += max(0, nbytes - self.tier.allocated_bytes(path))
        return total

    def open_file(
        self, namespace: str, checkpoint_id: str, name: str, rank: int
    ) -> tuple[str, int]:
        """Create (or recycle a warm segment for) one file; returns (path, preallocated)."""
        check_file_name(name)
        with self._lock:
            rec = self._writing(namespace, checkpoint_id)
            if name in rec.files:
                raise CheckpointExists(
                    f"file {name} of {namespace}/{checkpoint_id} is already open or committed; "
                    "each file is opened once per save"
                )
            path = self.tier.file_path(namespace, checkpoint_id, name)
            remaining = rec.reservations.get(rank, 0)
            seg = self.tier.pick_segment(name, remaining, namespace)
            preallocated = 0
            if seg is not None:
                self.tier.take_segment(seg, path)
                # The segment's pages move from the pool into this rank's reservation.
                rec.reservations[rank] = max(remaining, seg.size)
                preallocated = seg.size
                metrics.RECYCLED_BYTES.inc(seg.size)
            else:
                self.tier.create_file(path)
            rec.files[name] = FileRecord(name=name, rank=rank)
            return str(path), preallocated

    def commit_file(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        rank: int,
        size: int,
        *,
        algorithm: str,
        block_size: int,
        digests: bytes,
    ) -> None:
        """Take ownership of a written file. Not re-hashed here: readers verify.

        The file must fit the rank's reservation (which includes the warm segment it was
        given) and nobody may still hold it open for writing: it is sealed read-only
        through its fd, so a committed file cannot change under its checksums.
        """
        check_file_name(name)
        with self._lock:
            rec = self._writing(namespace, checkpoint_id)
            f = rec.files.get(name)
            if f is None:
                raise CheckpointIncomplete(
                    f"file {name} is not open in {namespace}/{checkpoint_id}: call OpenFile first"
                )
            if f.committed:
                raise CheckpointExists(
                    f"file {name} of {namespace}/{checkpoint_id} is already committed"
                )
            if f.rank != rank:
                raise InvalidArgument(
                    f"file {name} of {namespace}/{checkpoint_id} was opened by rank {f.rank}, "
                    f"not rank {rank}: commit it from the rank that opened it"
                )
            if algorithm != ALGORITHM:
                raise InvalidArgument(
                    f"checksum algorithm {algorithm[:32]!r} is not supported; use {ALGORITHM!r}"
                )
            if block_size <= 0 or len(digests) % DIGEST_SIZE:
                raise InvalidArgument(
                    f"malformed checksums for {name}: block_size={block_size}, {len(digests)} digest bytes"
                )
            checksums = BlockChecksums(block_size, digests, algorithm)
            if checksums.block_count != checksums.expected_blocks(size):
                raise InvalidArgument(
                    f"file {name} has {checksums.block_count} block checksums but {size} bytes in "
                    f"blocks of {block_size} need {checksums.expected_blocks(size)}"
                )
            reservation = rec.reservations.get(rank, 0)
            if size > reservation:
                metrics.REJECTED_SAVES.labels(reason="reservation").inc()
                raise MemoryBudgetExceeded(
                    f"file {name} of {namespace}/{checkpoint_id} is {format_size(size)} but rank "
                    f"{rank}'s reservation has only {format_size(reservation)} left (with the "
                    "warm segment OpenFile gave it): reserve the full size with ReserveSpace "
                    "before writing"
                )

            def same_size(st: os.stat_result) -> None:
                if st.st_size != size:
                    raise InvalidArgument(
                        f"file {name} of {namespace}/{checkpoint_id} is {st.st_size} bytes on disk "
                        f"but the commit says {size} bytes: truncate the file to its final size "
                        "before committing"
                    )

            self.tier.seal_file(self.tier.file_path(namespace, checkpoint_id, name), same_size)
            rec.reservations[rank] = reservation - size
            f.size = size
            f.checksums = checksums
            f.owner_node = self.node_id
            metrics.BYTES_COMMITTED.inc(size)

    def commit(
        self,
        namespace: str,
        checkpoint_id: str,
        required_files: list[str],
        remote: dict[str, FileRecord] | None = None,
    ) -> CheckpointView:
        """Publish a checkpoint atomically (its manifest), then collect and apply retention.

        `remote` are required files that peers hold (the cluster commit asked them with
        Holdings); they enter the manifest with their owner and `held` False.
        """
        key = self._ref(namespace, checkpoint_id)
        if len(required_files) > MAX_FILES:
            raise InvalidArgument(
                f"cannot commit {namespace}/{checkpoint_id}: {len(required_files):,} required "
                f"files, at most {MAX_FILES:,}"
            )
        for r in required_files:
            check_file_name(r)
        remote = remote or {}
        with self._lock:
            rec = self._records.get(key)
            if (
                rec is not None
                and rec.state is State.COMMITTED
                and all(r in rec.files for r in required_files)
            ):
                return self._view(rec)  # a retried commit
            rec = self._writing(namespace, checkpoint_id)
            missing = sorted(
                r
                for r in required_files
                if (r not in rec.files or not rec.files[r].committed) and r not in remote
            )
            still_open = sorted(f.name for f in rec.files.values() if not f.committed)
            if missing or still_open:
                raise CheckpointIncomplete(
                    f"cannot commit {namespace}/{checkpoint_id}: "
                    f"missing files: {listing(missing)}; "
                    f"open but not committed: {listing(still_open)}"
                )
            added = {
                name: dataclasses.replace(f, held=False)
                for name, f in remote.items()
                if name not in rec.files
            }
            # Persisted before anything changes here: a failed write (ENOSPC) leaves the
            # save WRITING with its reservations, and the retry starts from the same state.
            staged = dataclasses.replace(
                rec,
                files={**rec.files, **added},
                reservations={},
                sequence=self._next_sequence,
                state=State.COMMITTED,
                committed_unix=self._wall(),
            )
            self._write_manifest(staged)
            rec.files.update(added)
            rec.reservations.clear()
            rec.sequence, rec.state = staged.sequence, staged.state
            rec.committed_unix = staged.committed_unix
            self._next_sequence = min(self._next_sequence + 1, MAX_SEQUENCE)
            metrics.COMMITS.inc()
            logger.info(
                "committed %s/%s: %d files, %s, sequence %d",
                namespace,
                checkpoint_id,
                len(rec.files),
                format_size(rec.committed_bytes),
                rec.sequence,
            )
            view = self._view(rec)
            for other in list(self._records.values()):
                if (
                    other.namespace == namespace
                    and other.state is State.WRITING
                    and other.created_unix <= rec.created_unix
                ):
                    self._abort(other, f"superseded by the commit of {checkpoint_id}")
            self._notify_committed(rec)
            self._apply_retention(namespace)
            return view

    def _persistent_only(self, rec: CheckpointRecord) -> bool:
        """A durable checkpoint no node's memory holds any more (listed, restorable)."""
        return rec.key in self._durable and not any(
            f.held or f.owner_node or f.replica_nodes for f in rec.files.values()
        )

    def _apply_retention(self, namespace: str) -> None:
        committed = sorted(
            (
                r
                for r in self._records.values()
                if r.namespace == namespace
                and r.state is State.COMMITTED
                and not self._persistent_only(r)
            ),
            key=lambda r: r.order,
        )
        # memory_keep_last applies per coordinator (invariant 10): checkpoints a peer
        # publishes never count against, nor push out, those another node (this one
        # included) coordinates. One job has one coordinator, so this is the plain
        # window; a job whose coordinator moved keeps the old one's last checkpoints
        # until they are removed (`tierckpt rm`).
        groups: dict[str, list[CheckpointRecord]] = {}
        for r in committed:
            groups.setdefault(coordinator_of(r.files), []).append(r)
        # Invariant 6: a checkpoint due for the persistent tier and not yet durable
        # there is kept (pinned) until it is, whatever memory_keep_last says.
        candidates = [
            [
                Candidate(
                    r.checkpoint_id,
                    i,
                    r.pinned or (self._due(r) and r.key not in self._durable),
                )
                for i, r in enumerate(group, start=1)
            ]
            for group in groups.values()
        ]
        evicted = [
            c for group in candidates for c in memory_evictions(group, self.memory_keep_last)
        ]
        for checkpoint_id in evicted:
            rec = self._records[(namespace, checkpoint_id)]
            if rec.key in self._durable:
                freed = self._keep_persistent_only(rec)
            else:
                freed = self._delete_committed(rec)
            metrics.EVICTIONS.inc()
            logger.info(
                "evicted %s/%s from memory (retention memory_keep_last=%d), %s",
                namespace,
                checkpoint_id,
                self.memory_keep_last,
                format_size(freed),
            )

    def _keep_persistent_only(self, rec: CheckpointRecord) -> int:
        """Evict a durable checkpoint from memory but keep listing it (its files now
        come from the persistent tier only). The manifest is rewritten first: a crash
        after it leaves stray files adoption collects, never a manifest pointing at
        files that are gone (which would quarantine a durable checkpoint)."""
        gone = {
            name: dataclasses.replace(f, held=False, owner_node="", replica_nodes=[])
            for name, f in rec.files.items()
        }
        self._write_manifest(dataclasses.replace(rec, files=gone))
        freed = self._release_files(rec)
        for f in rec.files.values():
            f.held = False
            f.owner_node = ""
            f.replica_nodes = []
        self._health.pop(rec.key, None)
        self._trim_pool()
        return freed

    def forget_persistent(self, namespace: str, checkpoint_id: str) -> None:
        """The checkpoint was deleted from the persistent tier (its retention)."""
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and self._persistent_only(rec):
                self._delete_committed(rec)
            self._durable.discard(key)

    def _delete_committed(self, rec: CheckpointRecord) -> int:
        # Manifest first: a crash after this point leaves a dir without manifest, which
        # adoption collects, never a manifest pointing at missing files.
        self.tier.remove_file(self.tier.manifest_path(rec.namespace, rec.checkpoint_id))
        if rec.state is State.COMMITTED:
            self._gone.add(rec.key)
        self._health.pop(rec.key, None)
        self._durable.discard(rec.key)
        self._drain_failed.pop(rec.key, None)
        return self._collect(rec)

    def abort(self, namespace: str, checkpoint_id: str) -> None:
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                raise self._not_found(namespace, checkpoint_id)
            if rec.state is State.COMMITTED:
                raise CheckpointIncomplete(
                    f"checkpoint {namespace}/{checkpoint_id} is committed and cannot be aborted; "
                    "use DeleteCheckpoint (`tierckpt rm`)"
                )
            self._abort(rec, "aborted by the client")

    def set_pinned(self, namespace: str, checkpoint_id: str, pinned: bool) -> CheckpointView:
        """Pin (exempt from retention) or unpin a committed checkpoint; persisted in its
        manifest so a restarted daemon keeps it."""
        with self._lock:
            rec = self._committed(check_namespace(namespace), check_checkpoint_id(checkpoint_id))
            if rec.pinned != pinned:
                self._write_manifest(dataclasses.replace(rec, pinned=pinned))  # then in memory
                rec.pinned = pinned
                logger.info(
                    "%s %s/%s", "pinned" if pinned else "unpinned", namespace, checkpoint_id
                )
            return self._view(rec)

    def delete(self, namespace: str, checkpoint_id: str) -> int:
        """Remove a committed or writing checkpoint; returns the bytes freed."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                raise self._not_found(namespace, checkpoint_id)
            freed = self._delete_committed(rec)
            logger.info("deleted %s/%s, %s freed", namespace, checkpoint_id, format_size(freed))
            return freed

    # ---- peer tier ----------------------------------------------------------------------
    def local_committed_files(self, namespace: str, checkpoint_id: str) -> dict[str, FileRecord]:
        """Committed files this node holds of a save (WRITING or COMMITTED); {} if unknown."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.state is State.ABORTED:
                return {}
            return {
                f.name: dataclasses.replace(f, replica_nodes=list(f.replica_nodes))
                for f in rec.files.values()
                if f.committed and f.held
            }

    def holdings(self, namespace: str, checkpoint_id: str) -> tuple[State | None, list[FileRecord]]:
        """(this node's state of the checkpoint or None, the committed files held here)."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.state is State.ABORTED:
                return None, []
            files = [
                dataclasses.replace(f, replica_nodes=list(f.replica_nodes))
                for f in sorted(rec.files.values(), key=lambda f: f.name)
                if f.committed and f.held
            ]
            return rec.state, files

    def committed_keys(self) -> list[Key]:
        with self._lock:
            return [r.key for r in self._records.values() if r.state is State.COMMITTED]

    def publish(self, published: CheckpointRecord) -> bool:
        """Adopt the cluster manifest of a checkpoint the DCP coordinator committed.

        Files of our own WRITING save that the manifest lists become committed (held);
        everything else is listed as held elsewhere. A checkpoint already known only
        merges replica lists. Returns False when this node deleted the checkpoint (it is
        not resurrected by a peer).

        What a peer says never destroys anything here (invariant 10): a committed file of
        ours is never unlinked (a manifest that disagrees with one, or a save whose
        `.metadata` was committed here, which this node commits itself, is refused with
        FAILED_PRECONDITION); the manifest counts against the budget (RESOURCE_EXHAUSTED
        when it does not fit); its timestamps are clamped to this node's clock, so it
        cannot sort as newer than it arrived; and retention groups checkpoints by
        coordinator, so it can only push out checkpoints of its own coordinator.
        """
        key = self._ref(published.namespace, published.checkpoint_id)
        with self._lock:
            if key in self._gone:
                return False
            rec = self._records.get(key)
            if rec is not None and rec.state is State.COMMITTED:
                self._merge_published(rec, published)
                return True
            local = rec.files if rec is not None and rec.state is State.WRITING else {}
            mine_meta = local.get(METADATA_FILE)
            if mine_meta is not None and mine_meta.committed and mine_meta.held:
                raise CheckpointIncomplete(
                    f"{_key_name(key)}: its .metadata was committed on node {self.node_id}, "
                    "which commits the checkpoint itself; a peer's manifest is not taken"
                )
            files: dict[str, FileRecord] = {}
            for f in published.files.values():
                mine = local.get(f.name)
                if mine is not None and mine.committed and mine.held:
                    self._check_same(key, mine, f)
                    files[f.name] = dataclasses.replace(
                        f,
                        owner_node=self.node_id,
                        replica_nodes=[n for n in f.replica_nodes if n != self.node_id],
                        held=True,
                    )
                else:
                    files[f.name] = dataclasses.replace(
                        f, replica_nodes=list(f.replica_nodes), held=False
                    )
            for name, mine in local.items():
                if name not in files and mine.committed and mine.held:
                    files[name] = dataclasses.replace(mine, replica_nodes=list(mine.replica_nodes))
            now = self._wall()
            new = dataclasses.replace(
                published,
                state=State.COMMITTED,
                node_id=self.node_id,
                files=files,
                reservations={},
                last_activity=self._clock(),
                created_unix=min(published.created_unix, now),
                committed_unix=min(published.committed_unix, now),
            )
            charge = _manifest_estimate(new) if coordinator_of(new.files) != self.node_id else 0
            self._trim_pool(extra=charge)
            used, reserved = self._used(), self._reserved()
            if charge and used + reserved + self._pool() + charge > self.budget:
                metrics.REJECTED_SAVES.labels(reason="manifest").inc()
                raise MemoryBudgetExceeded(
                    f"no room for the manifest of {_key_name(key)} ({format_size(charge)}): "
                    f"{format_size(used + reserved)} of memory.budget={format_size(self.budget)} "
                    f"in use on node {self.node_id}"
                )
            self._write_manifest(new)  # before anything changes here
            for name in local:
                if name not in files:  # opened, never committed: a straggler of the save
                    self.tier.remove_file(self.tier.file_path(*key, name))
            self._records[key] = new
            if charge:
                self._manifest_bytes[key] = self._manifest_size(key) or charge
            self._next_sequence = max(self._next_sequence, min(new.sequence + 1, MAX_SEQUENCE))
            logger.info(
                "published %s/%s from the coordinator's daemon: %d files, %d held here",
                *key,
                len(new.files),
                sum(f.held for f in new.files.values()),
            )
            self._notify_committed(new)
            self._apply_retention(key[0])
            return True

    def _manifest_size(self, key: Key) -> int:
        try:
            return os.lstat(self.tier.manifest_path(*key)).st_size
        except OSError:
            return 0

    def _check_same(self, key: Key, mine: FileRecord, theirs: FileRecord) -> None:
        """Refuse a manifest that describes a file committed here with other bytes."""
        if (mine.size, mine.checksums) != (theirs.size, theirs.checksums):
            raise CheckpointIncomplete(
                f"{_key_name(key)}/{mine.name}: the published manifest says {theirs.size} "
                f"bytes with checksums {_summary(theirs)}, but node {self.node_id} committed "
                f"{mine.size} bytes with {_summary(mine)}; the local file is kept and the "
                "manifest refused"
            )

    def _merge_published(self, rec: CheckpointRecord, published: CheckpointRecord) -> None:
        """A known checkpoint published again: merge replica lists (persisted first)."""
        merged: dict[str, FileRecord] = {}
        for f in published.files.values():
            mine = rec.files.get(f.name)
            if mine is None:
                continue
            self._check_same(rec.key, mine, f)
            nodes = list(dict.fromkeys([*mine.replica_nodes, *f.replica_nodes]))
            if nodes != mine.replica_nodes and len(nodes) <= MAX_REPLICAS:
                merged[f.name] = dataclasses.replace(mine, replica_nodes=nodes)
        if merged:
            self._write_manifest(dataclasses.replace(rec, files={**rec.files, **merged}))
            for name, f in merged.items():
                rec.files[name].replica_nodes = f.replica_nodes

    def _write_manifest(self, rec: CheckpointRecord) -> None:
        manifest = self.tier.manifest_path(rec.namespace, rec.checkpoint_id)
        try:
            self.tier.make_dir(manifest.parent)
        except OSError as e:
            raise no_space(e, "creating a manifest directory", self.tier.root) from e
        write_manifest(manifest, rec)

    def _committed(self, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        key = self._ref(namespace, checkpoint_id)
        rec = self._records.get(key)
        if rec is None or rec.state is not State.COMMITTED:
            raise self._not_found(namespace, checkpoint_id)
        return rec

    def file_view(self, namespace: str, checkpoint_id: str, name: str) -> tuple[FileRecord, str]:
        """(a copy of one committed file's record, its local path or "" if not held)."""
        with self._lock:
            rec = self._committed(namespace, checkpoint_id)
            f = rec.files.get(name)
            if f is None:
                raise CheckpointNotFound(
                    f"checkpoint {namespace}/{checkpoint_id} has no file {name[:64]!r}; its "
                    f"files: {listing(sorted(rec.files))}"
                )
            path = str(self.tier.file_path(namespace, checkpoint_id, name)) if f.held else ""
            return dataclasses.replace(f, replica_nodes=list(f.replica_nodes)), path

    def start_incoming(self, namespace: str, checkpoint_id: str, name: str) -> Path | None:
        """Make room for a copy of a file arriving from a peer; None if already held.

        The bytes count as reserved until `finish_incoming`; a copy that does not fit the
        budget is refused (RESOURCE_EXHAUSTED) before any byte is written.
        """
        with self._lock:
            # The segment being preallocated for this very file is moments from ready:
            # wait for it rather than allocate the same pages twice.
            deadline = time.monotonic() + PREWARM_WAIT
            while name in self._prewarming and time.monotonic() < deadline:
                self._prewarmed.wait(max(0.0, deadline - time.monotonic()))
            rec = self._committed(namespace, checkpoint_id)
            f = rec.files.get(name)
            if f is None:
                raise CheckpointNotFound(
                    f"checkpoint {namespace}/{checkpoint_id} has no file {name}"
                )
            if f.held:
                return None
            ikey = (namespace, checkpoint_id, name)
            if ikey in self._incoming:
                raise CheckpointExists(
                    f"file {name} of {namespace}/{checkpoint_id} is already being received"
                )
            self._trim_pool(extra=f.size)
            used, reserved = self._used(), self._reserved()
            if used + reserved + self._pool() + f.size > self.budget:
                metrics.REJECTED_SAVES.labels(reason="replica").inc()
                raise MemoryBudgetExceeded(
                    f"no room for a copy of {namespace}/{checkpoint_id}/{name} "
                    f"({format_size(f.size)}): {format_size(used + reserved)} of "
                    f"memory.budget={format_size(self.budget)} in use on node {self.node_id}"
                )
            path = self.tier.incoming_path(namespace, checkpoint_id, name)
            self.tier.remove_file(path)
            # A replica arriving every checkpoint lands in the warm pages of an evicted one
            # (4x cheaper than fresh tmpfs pages), like a local save.
            seg = self.tier.pick_segment(name, f.size, namespace) if self.recycle else None
            if seg is not None:
                self.tier.take_segment(seg, path)
                metrics.RECYCLED_BYTES.inc(seg.size)
            else:
                self.tier.create_file(path)
            # Reserved until installed: at least the copy's size, or the segment's pages.
            self._incoming[ikey] = max(f.size, seg.size if seg is not None else 0)
            return path

    def finish_incoming(
        self, namespace: str, checkpoint_id: str, name: str, tmp: Path, ok: bool
    ) -> bool:
        """Install (ok) or drop a received copy; True when it is now held here."""
        with self._lock:
            self._incoming.pop((namespace, checkpoint_id, name), None)
            rec = self._records.get((namespace, checkpoint_id))
            f = rec.files.get(name) if rec is not None else None
            if not ok or rec is None or rec.state is not State.COMMITTED or f is None:
                self.tier.remove_file(tmp)
                return False
            final = self.tier.file_path(namespace, checkpoint_id, name)
            replicas = list(f.replica_nodes)
            if f.owner_node != self.node_id and self.node_id not in replicas:
                replicas.append(self.node_id)
            held = dataclasses.replace(f, held=True, replica_nodes=replicas)
            installed = False
            try:
                self.tier.seal_file(tmp)
                self.tier.install(tmp, final)
                installed = True
                self._write_manifest(dataclasses.replace(rec, files={**rec.files, name: held}))
            except BaseException:
                self.tier.remove_file(final if installed else tmp)
                raise
            f.held, f.replica_nodes = True, replicas
            return True

    def drop_local_copy(self, namespace: str, checkpoint_id: str, name: str) -> bool:
        """Forget a corrupt local copy (never served again); True if one was held."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id))
            f = rec.files.get(name) if rec is not None else None
            if rec is None or f is None or not f.held:
                return False
            replicas = [n for n in f.replica_nodes if n != self.node_id]
            if rec.state is State.COMMITTED:
                dropped = dataclasses.replace(f, held=False, replica_nodes=replicas)
                try:
                    self._write_manifest(
                        dataclasses.replace(rec, files={**rec.files, name: dropped})
                    )
                except (OSError, TierckptError) as e:
                    # Dropped anyway: never serve a corrupt copy. A restart re-verifies.
                    logger.error("cannot record the drop of %s/%s/%s: %s", *rec.key, name, e)
            self.tier.remove_file(self.tier.file_path(namespace, checkpoint_id, name))
            f.held = False
            f.replica_nodes = replicas
            return True

    def set_replicas(
        self, namespace: str, checkpoint_id: str, name: str, replica_nodes: list[str]
    ) -> bool:
        """Record the nodes (other than the owner) holding verified copies of a file."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id))
            f = rec.files.get(name) if rec is not None else None
            if rec is None or rec.state is not State.COMMITTED or f is None:
                return False
            nodes = list(dict.fromkeys(replica_nodes))
            if f.held and f.owner_node != self.node_id and self.node_id not in nodes:
                nodes.append(self.node_id)  # we hold a verified copy whatever the peer says
            if nodes != f.replica_nodes:
                changed = dataclasses.replace(f, replica_nodes=nodes)
                self._write_manifest(dataclasses.replace(rec, files={**rec.files, name: changed}))
                f.replica_nodes = nodes
            return True

    def unhealthy_count(self) -> int:
        with self._lock:
            return len(self._health)

    def set_health(self, namespace: str, checkpoint_id: str, mark: str) -> None:
        """The healer's finding ("" healthy, "under-replicated", "lost"), shown in tiers."""
        with self._lock:
            if (namespace, checkpoint_id) not in self._records:
                return
            if mark:
                self._health[(namespace, checkpoint_id)] = mark
            else:
                self._health.pop((namespace, checkpoint_id), None)

    # ---- persistent tier ----------------------------------------------------------------
    def set_drain_failed(
        self, namespace: str, checkpoint_id: str, failed: bool, *, refused: bool = False
    ) -> None:
        """The drain's verdict, shown as "drain-failed" in `tiers` (False clears it).

        `refused`: its `.metadata` was refused, so it can never become durable; it stops
        being due, and memory retention no longer keeps it for the persistent tier
        (invariant 6 keeps what can still drain; this would otherwise pin it forever).
        """
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if not failed or rec is None:
                self._drain_failed.pop(key, None)
                return
            self._drain_failed[key] = refused
            if refused:
                self._apply_retention(namespace)

    def drain_failed(self) -> dict[Key, bool]:
        """Checkpoints the drain gave up on, each True if it was refused."""
        with self._lock:
            return dict(self._drain_failed)

    def due_not_durable(self) -> list[Key]:
        """Committed checkpoints due for the persistent tier and not known durable,
        oldest first (the drain queue a restarted daemon rebuilds)."""
        with self._lock:
            recs = [
                r
                for r in self._records.values()
                if r.state is State.COMMITTED and self._due(r) and r.key not in self._durable
            ]
            return [r.key for r in sorted(recs, key=lambda r: r.order)]

    def is_due(self, namespace: str, checkpoint_id: str) -> bool:
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id))
            return rec is not None and rec.state is State.COMMITTED and self._due(rec)

    def is_durable(self, namespace: str, checkpoint_id: str) -> bool:
        with self._lock:
            return (namespace, checkpoint_id) in self._durable

    def mark_durable(self, namespace: str, checkpoint_id: str) -> bool:
        """Record that the checkpoint's `.metadata` is in the persistent tier; memory
        retention may now evict it. False when it is not (or no longer) committed here."""
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.state is not State.COMMITTED:
                return False
            if key not in self._durable:
                self._durable.add(key)
                logger.info("%s/%s is DURABLE in the persistent tier", *key)
                self._apply_retention(namespace)
            return True

    def manifest_document(self, namespace: str, checkpoint_id: str) -> dict[str, object]:
        """The manifest of a committed checkpoint as JSON data (for the persistent
        tier's bookkeeping: original sizes and block checksums of every file)."""
        with self._lock:
            rec = self._committed(namespace, checkpoint_id)
            return manifest_to_json(rec)

    # ---- queries ----------------------------------------------------------------------
    def get(self, namespace: str, checkpoint_id: str = "") -> CheckpointView:
        """A committed checkpoint; an empty id is the newest of the namespace."""
        check_namespace(namespace)
        with self._lock:
            if not checkpoint_id:
                rec = self._newest(namespace)
            else:
                rec = self._records.get((namespace, check_checkpoint_id(checkpoint_id)))
            if rec is None or rec.state is not State.COMMITTED:
                raise self._not_found(namespace, checkpoint_id)
            return self._view(rec)

    def list_checkpoints(
        self, namespace: str = "", include_uncommitted: bool = False
    ) -> list[CheckpointView]:
        """Committed checkpoints by sequence, then (optionally) saves in progress."""
        if namespace:
            check_namespace(namespace)
        with self._lock:
            recs = [
                r
                for r in self._records.values()
                if (not namespace or r.namespace == namespace)
                and (include_uncommitted or r.state is State.COMMITTED)
            ]
            recs.sort(key=lambda r: (r.state is not State.COMMITTED, r.order, r.created_unix))
            return [self._view(r) for r in recs]

    def verify(self, namespace: str, checkpoint_id: str) -> VerifyResult:
        """Re-hash every file of a committed checkpoint (outside the lock)."""
        view = self.get(namespace, checkpoint_id)
        ok_bytes, corrupt = 0, []
        started = time.monotonic()
        for f in view.files:
            assert f.checksums is not None
            if not f.held:
                continue  # held by peers only; they verify their own copies
            ok, reason = self.tier.verify_file(Path(view.local_paths[f.name]), f.size, f.checksums)
            if ok:
                ok_bytes += f.size
            else:
                corrupt.append(f.name)
                logger.error("verify %s/%s: %s: %s", namespace, checkpoint_id, f.name, reason)
        logger.info(
            "verified %s/%s: %d corrupt files, %s at %s",
            namespace,
            checkpoint_id,
            len(corrupt),
            format_size(ok_bytes),
            hash_rate(ok_bytes, started),
        )
        return VerifyResult(not corrupt, ok_bytes, corrupt)

    def status(self) -> NodeStatusView:
        with self._lock:
            committed = [r for r in self._records.values() if r.state is State.COMMITTED]
            return NodeStatusView(
                node_id=self.node_id,
                failure_domain=self.failure_domain,
                memory_dir=str(self.tier.root),
                budget_bytes=self.budget,
                used_bytes=self._used(),
                reserved_bytes=self._reserved(),
                pool_bytes=self._pool(),
                checkpoints=len(committed),
                namespaces=tuple(sorted({r.namespace for r in self._records.values()})),
                version=__version__,
            )

    # ---- background work ----------------------------------------------------------------
    def saving(self, within: float = 5.0) -> bool:
        """Whether a save is writing on this node right now (RPC activity in the last
        `within` seconds); background copies step aside for it."""
        now = self._clock()
        with self._lock:
            return any(
                r.state is State.WRITING and now - r.last_activity <= within
                for r in self._records.values()
            )

    def sweep(self) -> list[Key]:
        """Abort WRITING saves idle longer than abandon_after (a rank died mid-save)."""
        now = self._clock()
        with self._lock:
            stale = [
                r
                for r in self._records.values()
                if r.state is State.WRITING and now - r.last_activity > self.abandon_after
            ]
            for rec in stale:
                self._abort(rec, f"no activity for {now - rec.last_activity:.0f} s")
            return [r.key for r in stale]

    def prewarm(self, total: int, segment_size: int = PREWARM_SEGMENT) -> int:
        """Preallocate up to `total` bytes of pool segments (`memory.prewarm`); returns
        bytes allocated. Runs in a background thread at start."""
        sizes = [min(segment_size, total - at) for at in range(0, total, segment_size)]
        return self.prewarm_segments([(size, None) for size in sizes], "memory.prewarm")

    def prewarm_segments(self, plan: list[tuple[int, str | None]], why: str) -> int:
        """Preallocate pool segments of the given (size, file name) while the budget and
        tmpfs allow; a segment named for a file is the one that file's copy takes.

        posix_fallocate happens outside the lock, with the bytes counted as reserved so
        concurrent reservations stay in budget. Returns bytes allocated.
        """
        done = 0
        for size, name in plan:
            with self._lock:
                if name is not None and any(key[2] == name for key in self._incoming):
                    continue  # its copy is already arriving, into pages of its own
                if self._used() + self._reserved() + self._pool() + size > self.budget:
                    break
                if self.tier.free_bytes() < size:
                    break
                tmp, final = self.tier.new_prewarm_path()
                self._prewarm_pending += size
                if name is not None:
                    self._prewarming.add(name)
            ok = False
            try:
                self.tier.preallocate(tmp, size)
                ok = True
            except OSError as e:
                logger.warning("prewarm stopped after %s: %s", format_size(done), e)
                tmp.unlink(missing_ok=True)
            finally:
                with self._lock:
                    self._prewarm_pending -= size
                    if ok:
                        tmp.rename(final)
                        self.tier.segments.append(Segment(final, size, name))
                    self._prewarming.discard(name or "")
                    self._prewarmed.notify_all()
            if not ok:
                break
            done += size
        logger.info("prewarmed %s of pool segments (%s)", format_size(done), why)
        return done

    # ---- adoption -----------------------------------------------------------------------
    def adopt(self) -> None:
        """Re-adopt the memory tier left by a previous daemon (restart or kill -9).

        Only checkpoints whose files all verify against their manifest are served; a
        failing one keeps its files but its manifest is renamed `*.json.corrupt`. Data
        dirs without a manifest are unfinished saves and are collected.
        """
        tier = self.tier
        tier.adopt_pool()
        adopted: dict[Key, CheckpointRecord] = {}
        quarantined: set[Key] = set()
        started, hashed = time.monotonic(), 0
        for ns_entry in self._layout_dirs(tier.manifest_root, check_namespace):
            for entry in tier.entries(Path(ns_entry.path)):
                path = Path(entry.path)
                if not entry.is_file(follow_symlinks=False):
                    tier.remove_entry(entry, "not a regular file")
                    continue
                if entry.name.endswith(".json.corrupt"):
                    quarantined.add((ns_entry.name, entry.name[: -len(".json.corrupt")]))
                    continue
                if not entry.name.endswith(".json"):
                    os.unlink(path)  # a manifest tmp file of a crashed write
                    continue
                key = (ns_entry.name, entry.name[: -len(".json")])
                problem = ""
                try:
                    rec = read_manifest(path)
                    if rec.key != key:
                        problem = f"manifest describes {rec.namespace}/{rec.checkpoint_id}"
                except ManifestError as e:
                    problem = str(e)
                if not problem:
                    problem, nbytes = self._adopt_files(rec)
                    hashed += nbytes
                if problem:
                    logger.error(
                        "not serving %s/%s: %s; its manifest is renamed to %s.corrupt and its "
                        "files are kept for inspection (remove them by hand)",
                        *key,
                        problem,
                        path.name,
                    )
                    os.rename(path, path.with_name(path.name + ".corrupt"))
                    quarantined.add(key)
                    continue
                rec.state = State.COMMITTED
                adopted[key] = rec
        logger.info(
            "verified %d checkpoints (%s) at %s",
            len(adopted),
            format_size(hashed),
            hash_rate(hashed, started),
        )
        quarantined_bytes = 0
        for ns_entry in self._layout_dirs(tier.data_root, check_namespace):
            for ckpt_entry in self._layout_dirs(Path(ns_entry.path), check_checkpoint_id):
                key = (ns_entry.name, ckpt_entry.name)
                held = (
                    {f.name for f in adopted[key].files.values() if f.held}
                    if key in adopted
                    else set()
                )
                sizes = []
                for entry in tier.entries(Path(ckpt_entry.path)):
                    if not entry.is_file(follow_symlinks=False):
                        tier.remove_entry(entry, "not a regular file")
                    elif key in adopted and entry.name not in held:
                        os.unlink(entry.path)  # an interrupted peer transfer
                    else:
                        sizes.append(entry.stat(follow_symlinks=False).st_size)
                if key in adopted:
                    continue
                if key in quarantined:
                    quarantined_bytes += sum(sizes)
                    continue
                logger.warning(
                    "collecting unfinished save %s/%s: %d files, %s",
                    *key,
                    len(sizes),
                    format_size(sum(sizes)),
                )
                tier.remove_checkpoint_dir(*key)
        charged = {
            key: self._manifest_size(key)
            for key, rec in adopted.items()
            if coordinator_of(rec.files) != self.node_id
        }
        with self._lock:
            self._records = adopted
            self._manifest_bytes = charged
            self._quarantined_bytes = quarantined_bytes
            self._next_sequence = max((r.sequence for r in adopted.values()), default=0) + 1
            before = tier.pool_bytes
            self._trim_pool()
            if tier.pool_bytes < before:
                logger.info(
                    "dropped %s of pool segments over memory.budget",
                    format_size(before - tier.pool_bytes),
                )
            logger.info(
                "adopted %d checkpoints (%s), pool %s, next sequence %d",
                len(adopted),
                format_size(self._used()),
                format_size(tier.pool_bytes),
                self._next_sequence,
            )
        size = tier.total_bytes()
        if self.budget > size:
            logger.warning(
                "memory.budget=%s is larger than the filesystem of the memory dir %s (%s): "
                "saves can fail with ENOSPC inside their reservation; lower [memory] budget "
                "below the tmpfs size or enlarge the tmpfs (size=)",
                format_size(self.budget),
                tier.root,
                format_size(size),
            )

    def _layout_dirs(
        self, parent: Path, check: Callable[[object], str]
    ) -> Iterator[os.DirEntry[str]]:
        """Real subdirectories of `parent` named by `check`; anything else (a link, a
        file, a bad name) is removed without following it."""
        for entry in self.tier.entries(parent):
            if not entry.is_dir(follow_symlinks=False):
                self.tier.remove_entry(entry, "not a directory")
                continue
            try:
                check(entry.name)
            except InvalidName:
                self.tier.remove_entry(entry, "not a valid name")
                continue
            self.tier.fix_dir_mode(entry)
            yield entry

    def _adopt_files(self, rec: CheckpointRecord) -> tuple[str, int]:
        """Verify and seal (through their fds) the held files of an adopted manifest;
        returns (problem or "", bytes hashed)."""
        hashed = 0
        for f in rec.files.values():
            assert f.checksums is not None
            if not f.held:
                continue
            path = self.tier.file_path(*rec.key, f.name)
            ok, reason = self.tier.verify_file(path, f.size, f.checksums)
            if ok:
                try:
                    self.tier.seal_file(path, exclusive=False)
                except (OSError, UnsafePath) as e:
                    ok, reason = False, str(e)
            if not ok:
                return f"{f.name}: {reason}", hashed
            hashed += f.size
        return "", hashed


class Sweeper(threading.Thread):
    """Calls `catalog.sweep()` every `interval` seconds until stopped."""

    def __init__(self, catalog: Catalog, interval: float = 5.0) -> None:
        super().__init__(name="tierckptd-sweeper", daemon=True)
        self.catalog = catalog
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.catalog.sweep()
            except Exception:
                logger.exception("sweeper failed; retrying in %.0f s", self.interval)

    def stop(self) -> None:
        self._stop_event.set()
