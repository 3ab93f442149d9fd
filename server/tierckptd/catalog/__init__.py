"""The catalog: every checkpoint of this node's memory tier, its lifecycle and its budget.

Budget invariant (DESIGN.md invariant 7), checked under one lock::

    C (committed file bytes) + R (outstanding reservations) + P (warm pool) <= budget

Reservations are taken before a rank writes a byte, so a save that cannot fit is refused
up front with a message naming the budget. Pool bytes are reclaimable: they are dropped
(largest first) whenever a reservation needs room. Long I/O (hashing, preallocation)
never runs under the lock; renames and small manifest writes do.

The class is built in layers, one module each: `state.CatalogState` (records, lock,
budget, pool, views, collection, memory retention), `persistent_marks.PersistentMarks`
(the persistent tier's marks that retention obeys: durable, retired, drain-failed, where
each checkpoint drains), `peer_state.PeerState` (what peers change: publish, incoming
copies, replica lists, dropped copies, cluster marks), `unfinished.UnfinishedSaves`
(saves whose coordinator may have committed them: the sweep and restart orphans) and
`Catalog` here (the save lifecycle, queries, restart adoption). Helpers: `budget.Budget`
(C, R, P and the one admission check), `views.view_of`, `retention` (pure policy), and
in memory/: `pool.WarmPool`, `adoption.adopt`, `verify.verify_files`.

Lock order (outermost first; never take an earlier one while holding a later one):

    Restorer's per-file lock -> catalog lock -> drain queue's lock

The catalog lock is a plain (non-reentrant) `threading.Lock`: no public method is called
with it held. Manifest writes (small, atomic renames) happen under it, so a manifest on
disk always agrees with the record; `on_committed`, `prewarm_next` (the next-save prewarm,
`prewarm.py`) and `tier.on_namespace_dir` are called under it and must only enqueue or
take locks later in the order. The warm pool shares
the lock (it waits on a Condition of it for segments being preallocated).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from tierckpt.checksum import ALGORITHM, DIGEST_SIZE, BlockChecksums
from tierckpt.errors import (
    NO_PERSISTENT_TIER_PREFIX,
    CheckpointExists,
    CheckpointIncomplete,
    InvalidArgument,
    NoPersistentTier,
)
from tierckpt.names import check_checkpoint_id, check_file_name, check_namespace
from tierckpt.units import format_size

from tierckptd import __version__
from tierckptd.catalog.budget import admit_namespace
from tierckptd.catalog.state import listing
from tierckptd.catalog.sweeper import Sweeper
from tierckptd.catalog.unfinished import UnfinishedSaves
from tierckptd.memory.adoption import Adopted, adopt
from tierckptd.memory.verify import VerifyResult, hash_rate, verify_files
from tierckptd.model import (
    MAX_FILES,
    MAX_SEQUENCE,
    CheckpointRecord,
    CheckpointView,
    FileRecord,
    NodeStatus,
    State,
    Trust,
    coordinator_of,
)
from tierckptd.ops import logs, metrics
from tierckptd.ops.faults import fault

__all__ = ["MAX_FILES", "Catalog", "Sweeper", "VerifyResult", "listing"]

logger = logging.getLogger(__name__)


class Catalog(UnfinishedSaves):
    """Lifecycle and budget of the checkpoints in one memory tier (thread-safe)."""

    # ---- accounting -------------------------------------------------------------------
    def used_bytes(self) -> int:
        with self._lock:
            return self._budget.used

    def reserved_bytes(self) -> int:
        with self._lock:
            return self._budget.reserved

    def pool_bytes(self) -> int:
        with self._lock:
            return self._budget.pooled

    def committed_count(self) -> int:
        with self._lock:
            return sum(r.state is State.COMMITTED for r in self._records.values())

    # ---- lifecycle --------------------------------------------------------------------
    def begin(self, namespace: str, checkpoint_id: str, rank: int) -> None:
        """Open a save; idempotent for every rank. Committed ids are immutable."""
        fault("save.begin")
        key = self._ref(namespace, checkpoint_id)
        owner = self.owner_of(namespace)  # uid isolation: the manifest names the owner
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and rec.state is State.COMMITTED:
                raise CheckpointExists(
                    f"checkpoint {namespace}/{checkpoint_id} is already committed on node "
                    f"{self.node_id}; committed checkpoints are immutable: pick a new checkpoint_id"
                )
            self._gone.pop(key, None)  # saved again after a delete: peers may publish it
            self._gone_sequence.pop(key, None)
            self._evicted.pop(key, None)
            if rec is None:
                admit_namespace(
                    self._records,
                    namespace,
                    self.max_namespaces,
                    node_id=self.node_id,
                    what="a save",
                )
                rec = CheckpointRecord(
                    namespace=namespace,
                    checkpoint_id=checkpoint_id,
                    state=State.WRITING,
                    created_unix=self._wall(),
                    node_id=self.node_id,
                    owner_uid=owner[0] if owner is not None else None,
                    owner_claim_node=owner[1] if owner is not None else "",
                )
                rec.begun = self._clock()
                self._records[key] = rec
                self._track(rec)
                ctx = logs.context(namespace, checkpoint_id, rank)
                logger.info("begin %s/%s (rank %d)", namespace, checkpoint_id, rank, extra=ctx)
                self._prewarm_once(namespace)
            rec.last_activity = self._clock()

    def reserve(self, namespace: str, checkpoint_id: str, rank: int, nbytes: int) -> int:
        """Reserve `nbytes` more for (checkpoint, rank); returns the rank's reservation."""
        fault("save.reserve")
        with self._lock:
            self._writing(namespace, checkpoint_id)  # a save is writing: prewarms stop
            if self.pool.pending and self._budget.short(nbytes, self._unwritten):
                self.pool.wait_pending()  # they join the pool, which the budget may drop
            rec = self._writing(namespace, checkpoint_id)
            # Free space must back this reservation and every one not yet written
            # (their pages are not allocated yet); the pool can be unlinked to make room.
            self._budget.admit(nbytes, what="this save", reason="budget", unwritten=self._unwritten)
            rec.reservations[rank] = rec.reservations.get(rank, 0) + nbytes
            self._track(rec)
            return rec.reservations[rank]

    def open_file(
        self, namespace: str, checkpoint_id: str, name: str, rank: int
    ) -> tuple[str, int]:
        """Create (or recycle a warm segment for) one file; returns (path, preallocated)."""
        fault("save.open_file")
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
            seg = self.pool.pick_segment(name, remaining, namespace)
            self.pool_use.record(seg)
            preallocated = 0
            if seg is not None:
                self.pool.take_segment(seg, path)
                # The segment's pages move from the pool into this rank's reservation.
                rec.reservations[rank] = max(remaining, seg.size)
                preallocated = seg.size
                metrics.RECYCLED_BYTES.inc(seg.size)
            else:
                self.tier.create_file(path)
            rec.files[name] = FileRecord(name=name, rank=rank, fresh_pages=seg is None)
            self._track(rec)
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
        fault("save.commit_file")
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
            self._budget.admit(
                size,
                what=f"file {name} of {namespace}/{checkpoint_id}",
                reason="reservation",
                within=reservation,
                holder=f"rank {rank}",
            )

            def same_size(st: os.stat_result) -> None:
                if st.st_size != size:
                    raise InvalidArgument(
                        f"file {name} of {namespace}/{checkpoint_id} is {st.st_size} bytes on disk "
                        f"but the commit says {size} bytes: truncate the file to its final size "
                        "before committing"
                    )

            self.tier.seal_file(self.tier.file_path(namespace, checkpoint_id, name), same_size)
            fault("save.commit_file.sealed")
            rec.reservations[rank] = reservation - size
            f.size = size
            f.checksums = checksums
            f.owner_node = self.node_id
            self._track(rec)
            metrics.BYTES_COMMITTED.inc(size)

    def commit(
        self,
        namespace: str,
        checkpoint_id: str,
        required_files: list[str],
        remote: dict[str, FileRecord] | None = None,
        *,
        durable: bool = False,
    ) -> CheckpointView:
        """Publish a checkpoint atomically (its manifest), then collect and apply retention.

        `remote` are required files that peers hold (the cluster commit asked them with
        Holdings); they enter the manifest with their owner and `held` False. `durable`:
        the "make this one durable" hint, kept in the manifest (restarts, peers): due
        whatever `drain_every` says (`_due`). Refused without a persistent tier, never
        ignored: the caller asked for a copy that would never exist.
        """
        key = self._ref(namespace, checkpoint_id)
        url = self.persistent_url(namespace)
        if durable and (self.drain_every <= 0 or not (url or self.default_persistent)):
            raise NoPersistentTier(
                f"{NO_PERSISTENT_TIER_PREFIX}cannot commit {namespace}/{checkpoint_id} with "
                "durable=true: this daemon has no persistent tier for the namespace; set "
                "`[persistent] url` in its config (or a namespace URL under `[persistent] "
                "allowed_urls`), or commit without durable"
            )
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
                durable_requested=durable,
                persistent_url=url,
            )
            fault("commit.before_manifest")
            self._write_manifest(staged)
            self._budget.charge_manifest(key, self._manifest_size(key))  # own ones too (M6)
            fault("commit.after_manifest")
            rec.files.update(added)
            rec.reservations.clear()
            rec.sequence, rec.state = staged.sequence, staged.state
            rec.committed_unix = staged.committed_unix
            rec.durable_requested = durable
            rec.persistent_url = url
            self._track(rec)
            self._next_sequence = min(self._next_sequence + 1, MAX_SEQUENCE)
            metrics.COMMITS.inc()
            metrics.SAVE_DURATION.observe(max(0.0, rec.committed_unix - rec.created_unix))
            logger.info(
                "committed %s/%s: %d files, %s, sequence %d",
                namespace,
                checkpoint_id,
                len(rec.files),
                format_size(rec.committed_bytes),
                rec.sequence,
                extra=logs.context(namespace, checkpoint_id),
            )
            view = self._view(rec)
            for other in list(self._records.values()):
                if (
                    other.namespace == namespace
                    and other.state is State.WRITING
                    and other.begun <= rec.begun  # begun before it (monotonic, not wall)
                ):
                    self._abort(other, f"superseded by the commit of {checkpoint_id}")
            self._notify_committed(rec)
            self._apply_retention(namespace)
            return view

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

    # ---- queries ----------------------------------------------------------------------
    def get(self, namespace: str, checkpoint_id: str = "") -> CheckpointView:
        """A committed checkpoint; an empty id is the newest of the namespace."""
        check_namespace(namespace)
        with self._lock:
            if not checkpoint_id:
                rec = self._newest(namespace)
                self._say_skipped(namespace, rec)
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
            writers = self._writers_by_namespace(namespace)
            return [self._view(r, writers.get(r.namespace, set())) for r in recs]

    def verify(self, namespace: str, checkpoint_id: str) -> VerifyResult:
        """Re-hash every file of a committed checkpoint (outside the lock)."""
        view = self.get(namespace, checkpoint_id)
        started = time.monotonic()
        result = verify_files(self.tier, namespace, checkpoint_id, view.files)
        for name, reason in result.problems.items():
            logger.error("verify %s/%s: %s: %s", namespace, checkpoint_id, name, reason)
        ok_bytes, corrupt = result.verified_bytes, result.corrupt_files
        logger.info(
            "verified %s/%s: %d corrupt files, %s at %s",
            namespace,
            checkpoint_id,
            len(corrupt),
            format_size(ok_bytes),
            hash_rate(ok_bytes, started),
        )
        return result

    def status(self) -> NodeStatus:
        with self._lock:
            committed = [r for r in self._records.values() if r.state is State.COMMITTED]
            return NodeStatus(
                node_id=self.node_id,
                failure_domain=self.failure_domain,
                memory_dir=str(self.tier.root),
                budget_bytes=self.budget,
                used_bytes=self._budget.used,
                reserved_bytes=self._budget.reserved,
                pool_bytes=self._budget.pooled,
                checkpoints=len(committed),
                namespaces=tuple(sorted({r.namespace for r in self._records.values()})),
                version=__version__,
                prewarm_pending_bytes=self.prewarm_pending() + self.pool.pending,
                prewarm_ready_bytes=self.pool.prewarmed_bytes,
                prewarm_used_bytes=self.pool_use.prewarmed_bytes,
                pool_hits=self.pool_use.hits,
                pool_misses=self.pool_use.misses,
                peer_clocks=dict(sorted(self._skew.items())),
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

    # ---- adoption -----------------------------------------------------------------------
    def limit_peer_manifests(self, share: float) -> None:
        """The share of the budget the manifests of one coordinating peer may take
        ([memory] peer_manifest_share)."""
        with self._lock:
            self._budget.manifest_share = share

    def adopt(self) -> None:
        """Re-adopt the memory tier left by a previous daemon (restart or kill -9).

        Only checkpoints whose files all verify against their manifest are served; a
        failing one keeps its files but its manifest is renamed `*.json.corrupt`. Data
        dirs without a manifest are unfinished saves and are collected.
        """
        self.pool.adopt_pool()
        self._install(adopt(self.tier))

    def _install(self, adopted: Adopted) -> None:
        tier, records = self.tier, adopted.records
        charged = {key: self._manifest_size(key) for key in records}  # every manifest (M6)
        with self._lock:
            self._records = records
            self._budget.reset(adopted.quarantined_bytes + adopted.orphan_bytes)
            self.keep_orphans(adopted.orphans)
            for rec in records.values():
                self._track(rec)
            for key, nbytes in charged.items():
                self._budget.charge_manifest(key, nbytes)
                if (by := coordinator_of(records[key].files)) != self.node_id:
                    self._budget.owned_by(key, by)  # a peer's: within its cap (M3)
            # Lamport: above every sequence taken from a writer (a FOREIGN manifest's,
            # whatever it says, never pushes this node's counter: `model.Trust`).
            taken = (r.sequence for r in records.values() if r.trust is not Trust.FOREIGN)
            self._next_sequence = min(max(taken, default=0) + 1, MAX_SEQUENCE)
            before = self.pool.pool_bytes
            self._budget.trim_pool()
            if self.pool.pool_bytes < before:
                logger.info(
                    "dropped %s of pool segments over memory.budget",
                    format_size(before - self.pool.pool_bytes),
                )
            logger.info(
                "adopted %d checkpoints (%s), pool %s, next sequence %d",
                len(records),
                format_size(self._budget.used),
                format_size(self.pool.pool_bytes),
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
