"""The catalog: every checkpoint of this node's memory tier, its lifecycle and its budget.

Budget invariant (DESIGN.md invariant 7), checked under one lock::

    C (committed file bytes) + R (outstanding reservations) + P (warm pool) <= budget

Reservations are taken before a rank writes a byte, so a save that cannot fit is refused
up front with a message naming the budget. Pool bytes are reclaimable: they are dropped
(largest first) whenever a reservation needs room. Long I/O (hashing, preallocation)
never runs under the lock; renames and small manifest writes do.

One class, `Catalog`, holds the records and the lock and changes records (the save
lifecycle, queries, manifests, collection, memory retention, what peers publish, copies
arriving from other tiers, unfinished saves, adoption). Its named collaborators own their
state and share its lock: `budget.Budget` (C, R, P and the one admission check),
`memory.pool.WarmPool` (the warm pool), `durability.DurabilityLedger` (durable, retired,
drain-failed, per-namespace URLs and the due rule), `peer_marks.PeerMarks` (health
labels, tombstones, clock skew, replica target), `writers.NamespaceWriters` (which nodes
write each namespace here, and what the peers stated). Pure helpers: `views.view_of`,
`retention` (policy), and in memory/: `adoption.adopt`, `verify.verify_files`.

Lock order (outermost first; never take an earlier one while holding a later one):

    Restorer's per-file lock -> catalog lock -> drain queue's lock

The catalog lock is a plain (non-reentrant) `threading.Lock`: no public method is called
with it held. Manifest writes (small, atomic renames) happen under it, so a manifest on
disk always agrees with the record; `events.committed`, `events.prewarm_next` (the next-save prewarm,
`prewarm.py`) and `tier.on_namespace_dir` are called under it and must only enqueue or
take locks later in the order. The warm pool shares the lock (it waits on a Condition of
it for segments being preallocated).

Unfinished saves whose coordinator may have committed them are never thrown away early:
a multi-node save commits on the coordinator's daemon, which then publishes the cluster
manifest to every node holding files of it; if that publish never arrives this node sees
a WRITING record, or after a restart a data dir without a manifest (an *orphan*). Its
files may be the only copies of a committed checkpoint, so neither is collected before
the peers have been asked: the catalog keeps them (`idle_saves`, `abort_idle`,
`salvage_orphans`), peers/unfinished.py asks the cluster and decides.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from tierckpt.checksum import ALGORITHM, DIGEST_SIZE, BlockChecksums
from tierckpt.errors import (
    NO_PERSISTENT_TIER_PREFIX,
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointNotFound,
    InvalidArgument,
    NoPersistentTier,
    PermissionDenied,
    TierckptError,
)
from tierckpt.names import (
    FORMAT_DCP,
    METADATA_FILE,
    NEXT_GENERATION,
    check_checkpoint_id,
    check_file_name,
    check_format,
    check_namespace,
    next_generation_id,
)
from tierckpt.trust import Trust as TrustState
from tierckpt.units import format_size

from tierckptd import __version__
from tierckptd.catalog.budget import Budget, admit_namespace, held_charge
from tierckptd.catalog.durability import DurabilityLedger
from tierckptd.catalog.peer_marks import DELETE_SKEW, PeerMarks
from tierckptd.catalog.prewarm import NextSavePlan, PoolUse, assign
from tierckptd.catalog.retention import effective_window, evictions_by_coordinator
from tierckptd.catalog.sweeper import Sweeper
from tierckptd.catalog.views import Health, all_lost, found, listing, view_of
from tierckptd.catalog.windows import NamespaceWindows
from tierckptd.catalog.writers import NamespaceWriters
from tierckptd.memory.adoption import Adopted, adopt
from tierckptd.memory.manifest import to_json as manifest_to_json
from tierckptd.memory.manifest import write_manifest
from tierckptd.memory.pool import PREWARM_SEGMENT, Segment, WarmPool
from tierckptd.memory.tier import MemoryTier, UnsafePath, no_space
from tierckptd.memory.verify import VerifyResult, hash_rate, verify_files
from tierckptd.model import (
    MAX_FILES,
    MAX_REPLICAS,
    MAX_SEQUENCE,
    CheckpointRecord,
    CheckpointView,
    FileRecord,
    Key,
    NodeStatus,
    State,
    Trust,
    TrustMark,
    coordinator_of,
)
from tierckptd.ops import logs, metrics
from tierckptd.ops.events import Answer, Listeners
from tierckptd.ops.faults import fault

__all__ = [
    "MAX_FILES",
    "SURPLUS_GRACE",
    "UNFINISHED_PATIENCE",
    "Catalog",
    "CatalogEvents",
    "Resolution",
    "Sweeper",
    "VerifyResult",
    "listing",
]

logger = logging.getLogger(__name__)

# Seconds a checkpoint a reader's copy just arrived into is exempt from memory retention
# (the reader opens the file next); the sweeper applies retention again once it is over.
LANDED_GRACE = 3.0

# Seconds a copy that just landed here (a push, a reader's restore) is never dropped as
# surplus. The node that pushed it counted too few copies because it could not reach one
# that this node can (a cut, or its breaker still skipping a peer back from one, for up
# to `peers.breaker.BACKOFF_CAP`, 30 s): dropping the copy at once made it push again
# every heal round, a trim/push loop that kept the listings naming a dropped copy. Kept
# this long, the pusher has asked that peer again before the copy can go.
SURPLUS_GRACE = 30.0

Resolution = Literal["published", "absent", "unknown"]
# An unfinished save with committed files whose fate some peer could not tell is kept
# this many abandon_after periods (its coordinator may be restarting) before collection.
UNFINISHED_PATIENCE = 4


def _key_name(key: Key) -> str:
    return f"{key[0]}/{key[1]}"


def _manifest_estimate(rec: CheckpointRecord) -> int:
    """About the bytes of `rec`'s manifest JSON (each digest is a ~40-byte line),
    without building it: a budget check before the write."""
    blocks = sum(f.checksums.block_count for f in rec.files.values() if f.checksums is not None)
    return 512 + 40 * blocks + sum(256 + 40 * len(f.replica_nodes) for f in rec.files.values())


def _summary(f: FileRecord) -> str:
    return f.checksums.summary() if f.checksums is not None else "none"


def _no_pins(namespace: str) -> dict[str, bool]:
    return {}


def _no_trust(namespace: str) -> dict[str, TrustMark]:
    return {}


def _marked(mark: TrustMark | None, trust: TrustState) -> bool:
    return mark is not None and mark.trust is trust


def _no_owner(namespace: str) -> tuple[int, str] | None:
    return None


def _nothing_pending() -> int:
    return 0


@dataclasses.dataclass(frozen=True)
class CatalogEvents:
    """What the catalog tells and asks the parts built after it (`ops.events`): each
    part subscribes once, while main.py wires the daemon. Those called under the catalog
    lock (marked) must only enqueue or take locks later in the lock order."""

    # A checkpoint due for the persistent tier committed here, by a commit or a peer's
    # publish (under the lock): the drain enqueues it.
    committed: Listeners[[str, str]] = dataclasses.field(default_factory=Listeners)
    # Any checkpoint committed here, or a namespace's first Begin (under the lock): the
    # next-save prewarm queues it; with no listener, nothing is planned.
    prewarm_next: Listeners[[str]] = dataclasses.field(default_factory=Listeners)
    # Bytes of next-save prewarm planned and not made yet (`status`).
    prewarm_pending: Answer[[], int] = dataclasses.field(
        default_factory=lambda: Answer(_nothing_pending)
    )
    # A peer answered that a checkpoint not durable here is durable in the persistent
    # tier (never under the lock): a hint, never proof; the drain asks the persistent
    # tier now rather than after its back-off, so this node learns it, and stops listing
    # the copies the peers let go, within a heal round (`Healer.heal`).
    durable_elsewhere: Listeners[[str, str]] = dataclasses.field(default_factory=Listeners)
    # A drain made a deleted checkpoint durable (under the lock): the cluster rm deletes
    # it again (peers/operations.py).
    gone_durable: Listeners[[str, str]] = dataclasses.field(default_factory=Listeners)
    # The cluster pin marks of a namespace (checkpoint id -> pinned), applied to a
    # manifest that arrives after them (under the lock: takes only the journal's lock).
    pin_marks: Answer[[str], dict[str, bool]] = dataclasses.field(
        default_factory=lambda: Answer(_no_pins)
    )
    # The cluster trust marks of a namespace (checkpoint id -> its newest mark), from the
    # mark journal (under the lock: takes only the journal's lock). A BAD one is never the
    # newest; the newest VERIFIED one is held by every retention.
    trust_marks: Answer[[str], dict[str, TrustMark]] = dataclasses.field(
        default_factory=lambda: Answer(_no_trust)
    )
    # A trust mark stored beside a checkpoint in the persistent tier, found when the
    # checkpoint is adopted from there (never under the lock): the mark journal takes it.
    trust_found: Listeners[[str, str, TrustMark]] = dataclasses.field(default_factory=Listeners)
    # `[security] local_isolation = "uid"` (never under the lock): a namespace's owner
    # (uid, node of the claim), stamped on each new save's record; and the check of a
    # peer's manifest against this node's owner (PermissionDenied) before a publish.
    owner_of: Answer[[str], tuple[int, str] | None] = dataclasses.field(
        default_factory=lambda: Answer(_no_owner)
    )
    check_owner: Listeners[[CheckpointRecord]] = dataclasses.field(default_factory=Listeners)


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
        max_namespaces: int = 0,
        drain_every: int = 0,
        default_persistent: bool = True,
        events: CatalogEvents | None = None,
    ) -> None:
        """`max_namespaces`: `[memory] max_namespaces` (0: no bound); `drain_every`,
        `default_persistent`: the persistent tier's (`durability.DurabilityLedger`)."""
        self.tier = tier
        self.node_id = node_id
        self.failure_domain = failure_domain
        self.recycle = recycle
        self.memory_keep_last = memory_keep_last
        self.abandon_after = abandon_after
        self.max_namespaces = max_namespaces
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self.pool = WarmPool(tier, self._lock)
        self._budget = Budget(budget, self.pool, node_id=node_id)
        self.durability = DurabilityLedger(
            self._lock, drain_every=drain_every, default_persistent=default_persistent
        )
        self.peer_marks = PeerMarks(self._lock, node_id)
        self.windows = NamespaceWindows(self._lock)  # namespaces' own memory windows
        self._records: dict[Key, CheckpointRecord] = {}
        self._next_sequence = 1
        self.writers = NamespaceWriters(self._lock, MappingProxyType(self._records), node_id)
        self._landed: dict[Key, float] = {}  # when a reader's copy arrived (`_landing`)
        self._arrived: dict[tuple[Key, str], float] = {}  # when a copy landed (SURPLUS_GRACE)
        # Adoption's unfinished data dirs (`keep_orphans`) and since when.
        self._orphans: dict[Key, dict[str, int]] = {}
        self._orphans_since = 0.0
        # What the catalog tells and asks the parts built after it (they subscribe).
        self.events = events if events is not None else CatalogEvents()
        self.pool_use = PoolUse()
        self._prewarm_begun: set[str] = set()  # namespaces prewarmed for at a Begin

    @property
    def budget(self) -> int:
        """`memory.budget` in bytes."""
        return self._budget.limit

    # ---- accounting (call under the lock) ---------------------------------------------
    def _track(self, rec: CheckpointRecord) -> None:
        """Tell the budget what `rec` holds and reserves now (after every change)."""
        if self._records.get(rec.key) is rec:
            # Whole pages, as tmpfs charges them (`budget.held_charge`).
            self._budget.track(rec.key, held_charge(rec), sum(rec.reservations.values()))

    def _unwritten(self) -> int:
        """Reserved bytes whose pages are not allocated yet (call under the lock): per
        rank, its reservation less the pages its open files already hold."""
        total = self.pool.pending
        for rec in self._records.values():
            if rec.state is not State.WRITING or not rec.reservations:
                continue
            held: dict[int, int] = {}
            for f in rec.files.values():
                if not f.committed:
                    path = self.tier.file_path(rec.namespace, rec.checkpoint_id, f.name)
                    held[f.rank] = held.get(f.rank, 0) + self.tier.allocated_bytes(path)
            total += sum(max(0, n - held.get(r, 0)) for r, n in rec.reservations.items())
        for (namespace, checkpoint_id, name), nbytes in self._budget.incoming.items():
            path = self.tier.incoming_path(namespace, checkpoint_id, name)
            total += max(0, nbytes - self.tier.allocated_bytes(path))
        return total

    # ---- lookups ------------------------------------------------------------------------
    @staticmethod
    def _ref(namespace: str, checkpoint_id: str) -> Key:
        return check_namespace(namespace), check_checkpoint_id(checkpoint_id)

    def _is_lost(self, rec: CheckpointRecord) -> bool:
        """Shown LOST (`views.is_lost`): never the newest, never loaded."""
        return self.peer_marks.is_lost(rec.key, self.durability.durable(rec.key))

    def _eligible(
        self, recs: Iterable[CheckpointRecord], namespace: str, *, verified: bool = False
    ) -> list[CheckpointRecord]:
        """The committed checkpoints of `recs` that may be the namespace's newest: not
        LOST, not marked BAD (`verified`: marked VERIFIED), and coordinated by a writer of
        the namespace (one no memory tier holds any more, with no coordinator left, unless
        it arrived FOREIGN)."""
        writers = self.writers.of(namespace)
        trust = {cid: m.trust for cid, m in self.events.trust_marks(namespace).items()}
        return [
            r
            for r in recs
            if r.namespace == namespace
            and r.state is State.COMMITTED
            and trust.get(r.checkpoint_id) is not TrustState.BAD
            and (not verified or trust.get(r.checkpoint_id) is TrustState.VERIFIED)
            and not self._is_lost(r)
            and not self.writers.foreign(r, writers)
        ]

    def _newest(self, namespace: str, *, verified: bool = False) -> CheckpointRecord | None:
        """The namespace's newest committed checkpoint (by sequence, never by wall time)
        that is not LOST, not marked BAD (`verified`: the newest marked VERIFIED) and is
        coordinated by a node that writes the namespace: a peer publishing into a
        namespace it does not write never becomes its newest here."""
        eligible = self._eligible(self._records.values(), namespace, verified=verified)
        return max(eligible, key=lambda r: r.order, default=None)

    def _newest_verified_id(self, namespace: str) -> str:
        """The id of the newest checkpoint of `namespace` marked VERIFIED ("": none),
        whoever coordinated it: every retention holds it."""
        trust = self.events.trust_marks(namespace)
        verified = [
            r
            for r in self._records.values()
            if r.namespace == namespace
            and r.state is State.COMMITTED
            and _marked(trust.get(r.checkpoint_id), TrustState.VERIFIED)
        ]
        newest = max(verified, key=lambda r: r.order, default=None)
        return newest.checkpoint_id if newest is not None else ""

    def _say_skipped(self, namespace: str, newest: CheckpointRecord | None) -> None:
        """Warn when a checkpoint later by sequence than the newest was passed over
        because its coordinator does not write the namespace here (never silently)."""
        after = newest.order if newest is not None else (-1, 0.0)
        eligible = {r.key for r in self._eligible(self._records.values(), namespace)}
        trust = self.events.trust_marks(namespace)
        skipped = [
            r
            for r in self._records.values()
            if r.namespace == namespace
            and r.state is State.COMMITTED
            and r.order > after
            and not self._is_lost(r)
            and not _marked(trust.get(r.checkpoint_id), TrustState.BAD)
            and r.key not in eligible
        ]
        if skipped:
            logger.warning(
                "the newest checkpoint of %s here is %s; passed over: %s, coordinated by "
                "%s, which does not write %s on this node (it writes: %s): a peer's "
                "checkpoint is never restored as the newest unless its coordinator saved "
                "this namespace with this node; name it to load it",
                namespace,
                newest.checkpoint_id if newest is not None else "none",
                listing([r.checkpoint_id for r in skipped]),
                listing(sorted({coordinator_of(r.files) or "none" for r in skipped})),
                namespace,
                listing(sorted(self.writers.of(namespace))),
            )

    def _not_found(self, namespace: str, checkpoint_id: str) -> CheckpointNotFound:
        newest = self._newest(namespace)
        if (
            not checkpoint_id
            and newest is None
            and (unbound := self.writers.unbound(namespace, self._is_lost))
        ):
            return unbound
        lost = [r for r in self._records.values() if r.namespace == namespace]
        if not checkpoint_id and newest is None and any(map(self._is_lost, lost)):
            return all_lost(namespace, self.node_id, [r for r in lost if self._is_lost(r)])
        trust = self.events.trust_marks(namespace)
        bad = sorted(
            c
            for c, m in trust.items()
            if m.trust is TrustState.BAD and (namespace, c) in self._records
        )
        tail = (
            f"the newest committed checkpoint of {namespace} is {newest.checkpoint_id}"
            if newest
            else f"{namespace} has no committed checkpoint that is not marked bad "
            f"(bad: {listing(bad)})"
            if bad and not checkpoint_id
            else f"{namespace} has no committed checkpoints"
        )
        what = (
            f"checkpoint {namespace}/{checkpoint_id}"
            if checkpoint_id
            else f"no checkpoint of {namespace}"
        )
        verb = "not found" if checkpoint_id else "found"
        return CheckpointNotFound(f"{what} {verb} on node {self.node_id}; {tail}")

    def _replacing(self, key: Key) -> CheckpointRecord | None:
        """The save replacing the committed `key` (WRITING under its internal id,
        `names.next_generation_id`), if one is under way (call under the lock)."""
        rec = self._records.get(key)
        if rec is None or rec.state is not State.COMMITTED:
            return None
        return self._records.get((key[0], next_generation_id(key[1])))

    def _save_of(self, key: Key) -> CheckpointRecord | None:
        """The record a save's RPCs on `key` change: its replacing save while one is
        under way, else its own."""
        return self._replacing(key) or self._records.get(key)

    def _writing(self, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        key = self._ref(namespace, checkpoint_id)
        rec = self._save_of(key)
        if rec is None or rec.state is not State.WRITING:
            state = rec.state.value if rec else "unknown"
            raise CheckpointIncomplete(
                f"checkpoint {namespace}/{checkpoint_id} is {state} on node {self.node_id}, not "
                "WRITING: call BeginCheckpoint first (an idle save is aborted after "
                "[memory] abandon_after seconds)"
            )
        rec.last_activity = self._clock()
        return rec

    def _committed(self, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        key = self._ref(namespace, checkpoint_id)
        rec = self._records.get(key)
        if rec is None or rec.state is not State.COMMITTED:
            raise self._not_found(namespace, checkpoint_id)
        return rec

    def _view(
        self,
        rec: CheckpointRecord,
        writers: set[str] | None = None,
        trust_marks: dict[str, TrustMark] | None = None,
    ) -> CheckpointView:
        """`trust_marks`: the namespace's, when the caller has them (a listing asks once)."""
        health = self.peer_marks.health(rec.key)
        if trust_marks is None:
            trust_marks = self.events.trust_marks(rec.namespace)
        trust = trust_marks.get(rec.checkpoint_id)
        view = view_of(
            rec,
            node_id=self.node_id,
            replica_target=self.peer_marks.replica_target,
            label=health.label,
            lost=health.lost,
            durable=self.durability.durable(rec.key),
            drain_failed=self.durability.failed(rec.key),
            foreign=self.writers.foreign(rec, writers),
            paths={
                f.name: str(self.tier.file_path(rec.namespace, rec.checkpoint_id, f.name))
                for f in rec.files.values()
                if f.held
            },
        )
        if trust is None:
            return view
        return dataclasses.replace(view, trust=trust.trust, trust_reason=trust.reason)

    # ---- manifests ----------------------------------------------------------------------
    def _write_manifest(self, rec: CheckpointRecord) -> None:
        manifest = self.tier.manifest_path(rec.namespace, rec.checkpoint_id)
        try:
            self.tier.make_dir(manifest.parent)
        except OSError as e:
            raise no_space(e, "creating a manifest directory", self.tier.root) from e
        write_manifest(manifest, rec)

    def _manifest_size(self, key: Key) -> int:
        try:
            return os.lstat(self.tier.manifest_path(*key)).st_size
        except OSError:
            return 0

    def manifest_document(self, namespace: str, checkpoint_id: str) -> dict[str, object]:
        """The manifest of a committed checkpoint as JSON data (for the persistent
        tier's bookkeeping: original sizes and block checksums of every file)."""
        with self._lock:
            rec = self._committed(namespace, checkpoint_id)
            return manifest_to_json(rec)

    # ---- collection ---------------------------------------------------------------------
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
                    self.pool.to_pool(path, f.name, rec.namespace, touched_once=f.fresh_pages)
                else:
                    self.tier.remove_file(path)
            except (OSError, UnsafePath) as e:
                logger.warning("cannot release %s/%s/%s: %s", *rec.key, f.name, e)
        self.tier.remove_checkpoint_dir(rec.namespace, rec.checkpoint_id)
        return freed

    def _collect(self, rec: CheckpointRecord) -> int:
        """Remove a checkpoint and its files; returns bytes freed."""
        freed = self._release_files(rec)
        if self._records.pop(rec.key, None) is not None:
            self._budget.forget(rec.key)
        self._landed.pop(rec.key, None)
        self._budget.trim_pool()
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

    def _delete_committed(self, rec: CheckpointRecord, *, evicted: bool = False) -> int:
        """Delete a checkpoint from this node; `evicted`: by memory retention (a weaker
        tombstone that the persistent tier's adoption overrides: `PeerMarks`)."""
        # Manifest first: a crash after this point leaves a dir without manifest, which
        # adoption collects, never a manifest pointing at missing files.
        self.tier.remove_file(self.tier.manifest_path(rec.namespace, rec.checkpoint_id))
        if rec.state is State.COMMITTED:
            self.peer_marks.tombstone(rec.key, self._wall(), evicted=evicted)
            if not evicted:
                self.peer_marks.forget_sequence(rec.key, rec.sequence)
        self.peer_marks.label(rec.key, None)
        self.durability.forget(rec.key)
        return self._collect(rec)

    def _replace_generation(self, old: CheckpointRecord) -> CheckpointRecord | None:
        """Retire the committed `old` for the generation that replaces it (call under
        the lock, right before that one's manifest is written): its manifest first, as a
        delete, then its files; a publish of it again (its sequence or below) is refused,
        as after a delete. The replacing save written here (if any) takes its place, still
        WRITING; returned. A crash between here and the new manifest leaves that save's
        files without a manifest: an unfinished save, salvaged from the peers' manifests."""
        key = old.key
        self.tier.remove_file(self.tier.manifest_path(*key))
        self.peer_marks.forget_sequence(key, old.sequence)
        self.peer_marks.label(key, None)
        self.durability.forget(key)
        pending = self._records.get((key[0], next_generation_id(key[1])))
        freed = self._collect(old)
        logger.info(
            "retired %s/%s (sequence %d, %s) for its replacing save",
            *key,
            old.sequence,
            format_size(freed),
        )
        if pending is None or pending.state is not State.WRITING:
            return None
        self._budget.forget(pending.key)
        del self._records[pending.key]
        self.tier.move_checkpoint_dir(key[0], pending.checkpoint_id, key[1])
        pending.checkpoint_id = key[1]
        self._records[key] = pending
        self._track(pending)
        return pending

    # ---- memory retention ---------------------------------------------------------------
    def _holds(self, rec: CheckpointRecord) -> bool:
        """Whether retention must keep `rec` in memory: pinned, or (invariant 6) due for
        the persistent tier and not durable there yet, whatever memory_keep_last says."""
        if rec.pinned:
            return True
        if self._is_lost(rec):
            return False  # due or not, it can never be made durable: kept only by its age
        if self.durability.due(rec) and not self.durability.durable(rec.key):
            return True
        return self._landing(rec)

    def expire_landed(self) -> None:
        """Apply memory retention again where a reader's grace ran out (the sweeper)."""
        now = self._clock()
        with self._lock:
            over = [k for k, t in self._landed.items() if now - t > LANDED_GRACE]
            for key in over:
                del self._landed[key]
            for copy in [c for c, t in self._arrived.items() if now - t > SURPLUS_GRACE]:
                del self._arrived[copy]
            for namespace in sorted({k[0] for k in over}):
                self._apply_retention(namespace)

    def _landing(self, rec: CheckpointRecord) -> bool:
        """Whether a reader's copy of one of `rec`'s files started or arrived moments
        ago: a restore of an older checkpoint makes it memory-held again, and evicting it
        then would pull the files from under the reader (`expire_landed` evicts it
        once the grace is over)."""
        landed = self._landed.get(rec.key)
        return landed is not None and self._clock() - landed <= LANDED_GRACE

    def _persistent_only(self, rec: CheckpointRecord) -> bool:
        """A durable checkpoint no node's memory holds any more (listed, restorable)."""
        return self.durability.durable(rec.key) and not any(
            f.held or f.owner_node or f.replica_nodes for f in rec.files.values()
        )

    def _notify_committed(self, rec: CheckpointRecord) -> None:
        if self.durability.due(rec):
            self.events.committed(rec.namespace, rec.checkpoint_id)
        self.events.prewarm_next(rec.namespace)  # plans after retention: evicted files count

    def _apply_retention(self, namespace: str) -> None:
        committed = [
            r
            for r in self._records.values()
            if r.namespace == namespace
            and r.state is State.COMMITTED
            and not self._persistent_only(r)
        ]
        newest = max(committed, key=lambda r: r.order, default=None)
        own = newest.memory_keep_last if newest is not None else 0
        window = effective_window(self.memory_keep_last, own)
        verified = self._newest_verified_id(namespace)

        def holds(rec: CheckpointRecord) -> bool:
            return rec.checkpoint_id == verified or self._holds(rec)

        for checkpoint_id in evictions_by_coordinator(
            committed, self.memory_keep_last, holds, self._is_lost
        ):
            rec = self._records[(namespace, checkpoint_id)]
            fault("retention.evict")
            if self.durability.durable(rec.key):
                freed = self._keep_persistent_only(rec)
            else:
                freed = self._delete_committed(rec, evicted=True)
            metrics.EVICTIONS.inc()
            logger.info(
                "evicted %s/%s from memory (memory window %d: [retention] "
                "memory_keep_last=%d, the namespace's own %s), %s",
                namespace,
                checkpoint_id,
                window,
                self.memory_keep_last,
                own or "none",
                format_size(freed),
            )

    def set_memory_keep_last(self, namespace: str, keep_last: int) -> None:
        """The namespace's own memory window (0: none, `[retention] memory_keep_last`
        alone): the memory tier keeps at most `keep_last` of its newest checkpoints, with
        every rule of memory retention (never the newest, pins and invariant 6 honoured).
        Recorded by the namespace's next commit here and carried by its manifest to every
        node (`windows`); it never narrows persistent retention: an evicted durable
        checkpoint stays listed from the persistent tier."""
        self.windows.set(check_namespace(namespace), keep_last)

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
        self._track(rec)
        self.peer_marks.label(rec.key, None)
        self._budget.trim_pool()
        return freed

    # ---- prewarm -------------------------------------------------------------------------
    def prewarm(self, total: int, segment_size: int = PREWARM_SEGMENT) -> int:
        """Preallocate up to `total` bytes of fresh pool segments (`memory.prewarm`);
        returns bytes allocated. Runs in a background thread at start."""
        sizes = [min(segment_size, total - at) for at in range(0, total, segment_size)]
        plan: list[tuple[int, str | None]] = [(size, None) for size in sizes]
        return self.prewarm_segments(plan, "memory.prewarm", kind="start")

    def prewarm_segments(
        self,
        plan: list[tuple[int, str | None]],
        why: str,
        *,
        namespace: str = "",
        stop: Callable[[], bool] | None = None,
        progress: Callable[[int], None] | None = None,
        kind: str = "restore",
        headroom: int = 0,
    ) -> int:
        """Preallocate pool segments of the given (size, file name) while the budget
        (`fits` beside `headroom` more: no pool dropped for them) and tmpfs allow; a
        segment named for a file is the one that file's copy or save takes (a copy
        already arriving is skipped), one of a `namespace` is for that job only. `stop`
        ends it between steps (a save started). Returns bytes allocated (counted by
        `kind` in the metrics)."""

        def arriving(name: str) -> bool:
            return any(key[2] == name for key in self._budget.incoming)

        done = self.pool.prewarm(
            plan,
            lambda size: self._budget.fits(size + headroom),
            skip=arriving,
            why=why,
            namespace=namespace,
            stop=stop,
            progress=progress,
        )
        metrics.PREWARM_BYTES.labels(kind=kind).inc(done)
        return done

    def next_save_plan(self, namespace: str, cap: int = 0) -> NextSavePlan:
        """The segments `namespace`'s next save lacks: one per file this node wrote in its
        newest checkpoint that no pool segment covers (`assign`), and those files' bytes."""
        with self._lock:
            rec = self._newest(namespace)
            if rec is None:
                return NextSavePlan([], 0)
            files = [
                (f.name, f.size, f.rank)
                for f in rec.files.values()
                if f.committed and f.held and f.owner_node == self.node_id
            ]
            plan, covered = assign(files, self.pool.segments, namespace, cap)
            activate = [seg for seg in covered if seg.touched_once]
            return NextSavePlan(plan, sum(size for _, size, _ in files), activate)

    def activate_segments(
        self, segments: list[Segment], stop: Callable[[], bool] | None = None
    ) -> int:
        """Touch pooled segments again before a save takes them (`WarmPool.activate`;
        takes the lock itself, around short steps)."""
        done = self.pool.activate(segments, stop)
        metrics.PREWARM_BYTES.labels(kind="activate").inc(done)
        return done

    def _prewarm_once(self, namespace: str) -> None:
        """At the first Begin of a namespace since start (e.g. after a restart adopted
        its checkpoints), schedule the prewarm a commit would have (call under the lock;
        it runs once the save is over, or right away if the save is abandoned)."""
        if not self.events.prewarm_next or namespace in self._prewarm_begun:
            return
        self._prewarm_begun.add(namespace)
        if self._newest(namespace) is not None:
            self.events.prewarm_next(namespace)

    # ---- durability (the ledger's marks that need the records) ------------------------
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
            if not failed or key not in self._records:
                self.durability.clear_failed(key)
                return
            self.durability.set_failed(key, refused)
            if refused:
                self._apply_retention(namespace)

    def due_not_durable(self) -> list[Key]:
        """Committed checkpoints due for the persistent tier and not known durable,
        oldest first (the drain queue a restarted daemon rebuilds)."""
        with self._lock:
            recs = [
                r
                for r in self._records.values()
                if r.state is State.COMMITTED
                and self.durability.due(r)
                and not self.durability.durable(r.key)
            ]
            return [r.key for r in sorted(recs, key=lambda r: r.order)]

    def persistent_url(self, namespace: str, checkpoint_id: str = "") -> str:
        """The URL a checkpoint drains to (its record's), or without `checkpoint_id` (or
        one this node does not know) the URL the namespace's next commit would record."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id)) if checkpoint_id else None
            return rec.persistent_url if rec is not None else self.durability.url(namespace)

    def mark_durable(self, namespace: str, checkpoint_id: str) -> bool:
        """Record that the checkpoint's `.metadata` is in the persistent tier; memory
        retention may now evict it. False when it is not (or no longer) committed here."""
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.state is not State.COMMITTED:
                if self.peer_marks.gone(key):
                    self.events.gone_durable(namespace, checkpoint_id)  # a drain beat an rm
                return False
            # Durable and drain-failed exclude each other: the ledger clears the mark in
            # the same step, so no view shows both (the drainer's own bookkeeping follows).
            if self.durability.add_durable(key):
                logger.info("%s/%s is DURABLE in the persistent tier", *key)
                self._apply_retention(namespace)
            return True

    def retire(self, namespace: str, checkpoint_id: str) -> None:
        """The checkpoint is no longer due: enough newer ones are durable that persistent
        retention deletes it (or already did, before this node learnt it was durable).
        Memory retention may evict it like any checkpoint that is not due."""
        key = (namespace, checkpoint_id)
        with self._lock:
            if key in self._records and self.durability.retire_key(key):
                self._apply_retention(namespace)

    def persistent_only(self, namespace: str, url: str) -> list[str]:
        """Ids of the namespace's durable checkpoints no node's memory holds, recorded
        as drained to `url` (what a re-listing of that tier must still show)."""
        with self._lock:
            return sorted(
                r.checkpoint_id
                for r in self._records.values()
                if r.namespace == namespace and r.persistent_url == url and self._persistent_only(r)
            )

    def forget_persistent(self, namespace: str, checkpoint_id: str) -> None:
        """The checkpoint was deleted from the persistent tier (its retention). Held
        nowhere else: it is gone. Still in memory somewhere: it stays listed there, and is
        retired, not due again (draining it back would only feed the same retention, and
        a due checkpoint that is never durable is held in memory forever)."""
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and self._persistent_only(rec):
                self._delete_committed(rec)
            elif rec is not None:
                self.durability.retire_key(key)
            self.durability.drop_durable(key)

    # ---- peer tier ----------------------------------------------------------------------
    def local_committed_files(self, namespace: str, checkpoint_id: str) -> dict[str, FileRecord]:
        """Committed files this node holds of a save (WRITING or COMMITTED); {} if unknown."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._save_of(key)  # a replacing save's: what its commit asks
            if rec is None or rec.state is State.ABORTED:
                return {}
            return {
                f.name: dataclasses.replace(f, replica_nodes=list(f.replica_nodes))
                for f in rec.files.values()
                if f.committed and f.held
            }

    def holdings(self, namespace: str, checkpoint_id: str) -> tuple[State | None, list[FileRecord]]:
        """(this node's state of the checkpoint or None, the committed files held here).
        While a save replaces it, its files are answered in place of the old ones of the
        same name (the replacing commit asks them), the old one's others as well (a heal
        of the old one meanwhile still finds its copies here)."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.state is State.ABORTED:
                return None, []
            held = {f.name: f for f in rec.files.values() if f.committed and f.held}
            pending = self._replacing(key)
            if pending is not None:
                held.update((f.name, f) for f in pending.files.values() if f.committed and f.held)
            files = [
                dataclasses.replace(f, replica_nodes=list(f.replica_nodes))
                for f in sorted(held.values(), key=lambda f: f.name)
            ]
            return rec.state, files

    def committed_keys(self) -> list[Key]:
        with self._lock:
            return [r.key for r in self._records.values() if r.state is State.COMMITTED]

    def publish(self, published: CheckpointRecord, *, durable: bool = False) -> bool:
        """Adopt the cluster manifest of a checkpoint the DCP coordinator committed.

        Files of our own WRITING save that the manifest lists become committed (held);
        everything else is listed as held elsewhere. A checkpoint already known only
        merges replica lists. Returns False when this node deleted the checkpoint (it is
        not resurrected by a peer) or its retention evicted it, unless `durable` (the
        persistent tier's copy: a durable checkpoint stays listed, persistent-only).

        What a peer says never destroys anything here (invariant 10): a committed file of
        ours is never unlinked (a manifest that disagrees with one, or a save whose
        `.metadata` was committed here, which this node commits itself, is refused with
        FAILED_PRECONDITION); the manifest counts against the budget (RESOURCE_EXHAUSTED
        when it does not fit); retention groups checkpoints by coordinator, so it can
        only push out checkpoints of its own coordinator; and it is the namespace's newest
        here only when its coordinator writes the namespace (`model.Trust`, audit 3 H2).

        Time orders nothing (audit 3, H6): a manifest is taken whatever its timestamps
        say; they are clamped to this node's clock for display, and how far ahead they
        were is reported as the coordinator's clock skew (`clock_skew`, a metric).
        """
        key = self._ref(published.namespace, published.checkpoint_id)
        self.events.check_owner(published)  # uid isolation: another uid's namespace here
        with self._lock:
            if self.peer_marks.refuses(published, durable=durable):
                return False  # deleted or evicted here: a peer does not bring it back
            rec = self._records.get(key)
            if rec is not None and self._newer_generation(rec, published):
                rec = self._replace_generation(rec)  # an overwrite committed: old goes
            if rec is not None and rec.state is State.COMMITTED:
                self._merge_published(rec, published)
                return True
            if rec is None:
                admit_namespace(
                    self._records,
                    key[0],
                    self.max_namespaces,
                    node_id=self.node_id,
                    what=f"the manifest of {_key_name(key)}",
                )
            if not durable:
                self.peer_marks.measure_skew(published, self._wall())
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
            # This node took part in the save: the manifest lists, with the same bytes
            # (`_check_same`), files this node's ranks wrote here.
            took_part = any(f.held for name, f in files.items() if name in published.files)
            new = dataclasses.replace(
                published,
                state=State.COMMITTED,
                node_id=self.node_id,
                files=files,
                reservations={},
                last_activity=self._clock(),
                created_unix=min(published.created_unix, now),
                committed_unix=min(published.committed_unix, now),
                pinned=self.events.pin_marks(key[0]).get(key[1], published.pinned),  # a cluster pin
                trust=Trust.PROVEN if durable or took_part else self.writers.trust_of(published),
            )
            by = coordinator_of(new.files)
            charge = _manifest_estimate(new) if by != self.node_id else 0
            if charge:  # within the coordinator's own cap (budget.admit_manifest, M3)
                self._budget.admit_manifest(
                    charge, key, by, what=f"the manifest of {_key_name(key)}"
                )
            self._write_manifest(new)  # before anything changes here
            for name in local:
                if name not in files:  # opened, never committed: a straggler of the save
                    self.tier.remove_file(self.tier.file_path(*key, name))
            self._records[key] = new
            self._track(new)
            if durable:
                self.durability.add_durable(key)  # before retention: kept persistent-only
            if charge:
                self._budget.charge_manifest(key, self._manifest_size(key) or charge)
            if new.trust is not Trust.FOREIGN:  # Lamport: commit above what writers did
                self._next_sequence = max(self._next_sequence, min(new.sequence + 1, MAX_SEQUENCE))
            logger.info(
                "published %s/%s from the coordinator's daemon: %d files, %d held here%s",
                *key,
                len(new.files),
                sum(f.held for f in new.files.values()),
                ""
                if new.trust is not Trust.FOREIGN
                else f"; listed, never the newest of {key[0]}: its coordinator "
                f"{coordinator_of(new.files)} does not write {key[0]} here (writers: "
                f"{listing(sorted(self.writers.of(key[0])))})",
            )
            self._notify_committed(new)
            self._apply_retention(key[0])
            return True

    def _newer_generation(self, rec: CheckpointRecord, published: CheckpointRecord) -> bool:
        """Whether `published` is a save that replaced the committed `rec` (an
        overwrite): a later sequence, from the coordinator this node recorded or one that
        writes the namespace here (no other peer retires a checkpoint by publishing)."""
        if rec.state is not State.COMMITTED or published.sequence <= rec.sequence:
            return False
        claimed = coordinator_of(published.files)
        return bool(claimed) and (
            claimed == coordinator_of(rec.files) or claimed in self.writers.of(rec.namespace)
        )

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
        """A known checkpoint published again: merge replica lists (persisted first).
        Only from the coordinator this node recorded (audit 3, M2): a manifest naming
        another node as the owner of its `.metadata` is refused (PermissionDenied), so no
        peer lists itself as a holder of another's files by publishing them again.
        Not into one retention let go to the persistent tier only (as `set_replicas`):
        a peer's lists would make it a memory one again here, for good."""
        if self._persistent_only(rec):
            return
        recorded, claimed = coordinator_of(rec.files), coordinator_of(published.files)
        if not recorded:
            return  # known here from the persistent tier only: no coordinator to match
        if claimed != recorded:
            metrics.PEER_REFUSED.labels(reason="coordinator").inc()
            raise PermissionDenied(
                f"{_key_name(rec.key)} is coordinated by node {recorded or 'none'} here; a "
                f"manifest of it naming {claimed[:64] or 'no node'} as its coordinator is "
                "refused (only its coordinator publishes its replica lists)"
            )
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

    def land(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        write: Callable[[Path], None],
        *,
        what: str,
        restored: bool = False,
    ) -> FileRecord | None:
        """Land a copy of a committed file arriving from another tier, in one call (the
        memory tier's `incoming.install_copy` is the caller): room made, `write(tmp)` run
        outside the lock to fill and verify the copy, then the copy installed, or dropped
        if `write` raised. The bytes count as reserved from before the first one is written
        until the copy is installed or dropped; a copy that does not fit the budget is
        refused (RESOURCE_EXHAUSTED) before `write` runs. `restored` (a reader's copy)
        exempts the checkpoint from memory retention for `LANDED_GRACE` s: the reader opens
        the file next. Returns the record as held here now, or None when the file was
        already held (nothing taken, `write` not called); CheckpointNotFound when the
        checkpoint was deleted or evicted while the copy arrived."""
        staged = self._stage_copy(namespace, checkpoint_id, name, restored)
        if staged is None:
            return None
        tmp, sequence = staged
        ok = False
        try:
            write(tmp)
            ok = True
        finally:
            held = self._install_copy(namespace, checkpoint_id, name, tmp, ok, restored, sequence)
        if held is None:
            raise CheckpointNotFound(f"{what}: deleted or evicted while it arrived")
        return held

    def _stage_copy(
        self, namespace: str, checkpoint_id: str, name: str, restored: bool
    ) -> tuple[Path, int] | None:
        """`land`'s first step: the staging file, its bytes reserved, and the sequence of
        the generation it is a copy of; None if already held."""
        with self._lock:
            self.pool.wait_for(name)  # a segment being preallocated for this very file
            rec = self._committed(namespace, checkpoint_id)
            if restored:
                self._landed[rec.key] = self._clock()
            f = rec.files.get(name)
            if f is None:
                raise CheckpointNotFound(
                    f"checkpoint {namespace}/{checkpoint_id} has no file {name}"
                )
            if f.held:
                return None
            ikey = (namespace, checkpoint_id, name)
            if ikey in self._budget.incoming:
                raise CheckpointExists(
                    f"file {name} of {namespace}/{checkpoint_id} is already being received"
                )
            self._budget.admit(
                f.size, what=f"a copy of {namespace}/{checkpoint_id}/{name}", reason="replica"
            )
            path = self.tier.incoming_path(namespace, checkpoint_id, name)
            self.tier.remove_file(path)
            # A replica arriving every checkpoint lands in the warm pages of an evicted one
            # (4x cheaper than fresh tmpfs pages), like a local save.
            seg = self.pool.pick_segment(name, f.size, namespace) if self.recycle else None
            if seg is not None:
                self.pool.take_segment(seg, path)
                metrics.RECYCLED_BYTES.inc(seg.size)
            else:
                self.tier.create_file(path)
            # Reserved until installed: at least the copy's size, or the segment's pages.
            self._budget.start_incoming(ikey, max(f.size, seg.size if seg is not None else 0))
            return path, rec.sequence

    def _install_copy(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        tmp: Path,
        ok: bool,
        restored: bool,
        sequence: int,
    ) -> FileRecord | None:
        """`land`'s last step: install (ok) or drop the staged copy, its reservation
        released; its record as held here now, or None (also when a save replaced the
        checkpoint meanwhile: `sequence`, the copied generation's, is not its)."""
        with self._lock:
            self._budget.finish_incoming((namespace, checkpoint_id, name))
            rec = self._records.get((namespace, checkpoint_id))
            f = rec.files.get(name) if rec is not None else None
            if (
                not ok
                or rec is None
                or rec.state is not State.COMMITTED
                or f is None
                or rec.sequence != sequence
            ):
                self.tier.remove_file(tmp)
                return None
            final = self.tier.file_path(namespace, checkpoint_id, name)
            replicas = list(f.replica_nodes)
            if f.owner_node != self.node_id and self.node_id not in replicas:
                replicas.append(self.node_id)
            held = dataclasses.replace(f, held=True, replica_nodes=replicas)
            installed = False
            try:
                try:
                    self.tier.seal_file(tmp)
                except FileNotFoundError:
                    # Retention evicted the checkpoint while the copy arrived: its directory
                    # went, this copy with it. Not held; the caller says so (never INTERNAL).
                    return None
                self.tier.install(tmp, final)
                installed = True
                self._write_manifest(dataclasses.replace(rec, files={**rec.files, name: held}))
            except BaseException:
                self.tier.remove_file(final if installed else tmp)
                raise
            f.held, f.replica_nodes = True, replicas
            self._track(rec)
            self.peer_marks.held_here(rec.key, name)  # a copy here: that file is not lost
            self._arrived[(rec.key, name)] = self._clock()
            if restored:
                self._landed[rec.key] = self._clock()
            return dataclasses.replace(f, replica_nodes=list(f.replica_nodes))

    def drop_local_copy(
        self, namespace: str, checkpoint_id: str, name: str, *, surplus: bool = False
    ) -> bool:
        """Forget a corrupt local copy (never served again), or with `surplus` one copy
        too many (the healer's trim), which a reader restored moments ago keeps (it opens
        the file next: `_landing`), and so does a copy that landed within SURPLUS_GRACE;
        True if one was dropped."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id))
            f = rec.files.get(name) if rec is not None else None
            if rec is None or f is None or not f.held:
                return False
            if surplus:
                arrived = self._arrived.get((rec.key, name))
                fresh = arrived is not None and self._clock() - arrived <= SURPLUS_GRACE
                if fresh or self._landing(rec):
                    return False
            self._arrived.pop((rec.key, name), None)
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
            self._track(rec)
            return True

    def set_replicas(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        replica_nodes: list[str],
        *,
        expected: list[str] | None = None,
    ) -> bool:
        """Record the nodes (other than the owner) holding verified copies of a file.

        `expected`: record only if the list is still this one (what the caller's finding
        started from); a newer list a peer sent meanwhile is kept (False).

        Not for a checkpoint retention left in the persistent tier only: a peer that has
        not evicted it yet would list itself, which makes the record a memory one again
        (its pushes accepted, retention and `forget_persistent` skipping it) for good."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id))
            f = rec.files.get(name) if rec is not None else None
            if rec is None or rec.state is not State.COMMITTED or f is None:
                return False
            if self._persistent_only(rec):
                return False
            if expected is not None and f.replica_nodes != expected:
                return False
            nodes = list(dict.fromkeys(replica_nodes))
            if f.held and f.owner_node != self.node_id and self.node_id not in nodes:
                nodes.append(self.node_id)  # we hold a verified copy whatever the peer says
            if nodes != f.replica_nodes:
                changed = dataclasses.replace(f, replica_nodes=nodes)
                self._write_manifest(dataclasses.replace(rec, files={**rec.files, name: changed}))
                f.replica_nodes = nodes
            return True

    def set_health(
        self, namespace: str, checkpoint_id: str, label: str, lost: Sequence[str] = ()
    ) -> None:
        """The healer's finding ("" healthy, "under-replicated", "lost"), shown in tiers;
        with "lost", the files no node holds: the checkpoint is then shown LOST (unless
        durable), never picked as the newest (`views.is_lost`)."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id))
            if rec is None:
                return
            if not label:
                self.peer_marks.label(rec.key, None)
                return
            health: Health | None = Health(label, tuple(sorted(lost)))
            # A finding is as old as the holdings its heal asked for: a copy installed
            # here meanwhile (`install_copy` clears its file the same way) is not lost.
            for name, f in rec.files.items():
                if f.held:
                    health = found(health, name)
            self.peer_marks.label(rec.key, health)

    # ---- cluster marks (peers/operations.py) ------------------------------------------
    def remove_marked(
        self, namespace: str, checkpoint_id: str, stamp: float
    ) -> tuple[int, str] | None:
        """A cluster rm stamped `stamp` (its origin's clock): delete the checkpoint if it
        was committed by then, and refuse a later publish or adoption of it. A save of it
        writing here now is a re-save after the rm: left alone. Returns (bytes freed, its
        persistent URL) when a committed checkpoint was deleted here, else None."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and rec.state is State.WRITING:
                return None
            self.peer_marks.tombstone(key, stamp)
            if rec is None or rec.state is not State.COMMITTED:
                return None
            if rec.committed_unix > stamp + DELETE_SKEW:
                return None  # committed again after the rm
            url = rec.persistent_url
            freed = self._delete_committed(rec)
            logger.info(
                "deleted %s/%s (a cluster rm), %s freed",
                namespace,
                checkpoint_id,
                format_size(freed),
            )
            return freed, url

    def apply_pin(self, namespace: str, checkpoint_id: str, pinned: bool) -> CheckpointView | None:
        """A cluster pin or unpin: persisted in the manifest, then in memory; None when
        this node does not have the checkpoint committed (the mark waits in the journal
        for its manifest: `pin_marks`)."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.state is not State.COMMITTED:
                return None
            if rec.pinned != pinned:
                self._write_manifest(dataclasses.replace(rec, pinned=pinned))
                rec.pinned = pinned
                logger.info("%s %s/%s", "pinned" if pinned else "unpinned", *key)
            return self._view(rec)

    def knows(self, namespace: str, checkpoint_id: str) -> bool:
        """Whether this node has the checkpoint (committed or being written)."""
        key = self._ref(namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            return rec is not None and rec.state is not State.ABORTED

    def pinned_ids(self, namespace: str) -> set[str]:
        """Ids of the namespace's checkpoints pinned here or by a cluster pin mark not
        yet applied, and its newest one marked VERIFIED (persistent retention keeps them
        all)."""
        marks = self.events.pin_marks(namespace)
        with self._lock:
            pinned = {
                r.checkpoint_id
                for r in self._records.values()
                if r.namespace == namespace and r.state is State.COMMITTED and r.pinned
            }
            verified = self._newest_verified_id(namespace)
        held = {c for c in pinned | set(marks) if marks.get(c, True)}
        return held | {verified} if verified else held

    def trust_changed(self, namespace: str) -> None:
        """A trust mark was taken: memory retention again (the newest VERIFIED one it
        holds may have moved; a window it held open closes)."""
        with self._lock:
            self._apply_retention(check_namespace(namespace))

    # ---- unfinished saves (the asking is peers/unfinished.py's) -----------------------
    def idle_saves(self) -> list[tuple[Key, float, bool]]:
        """WRITING saves idle longer than abandon_after (a rank died mid-save, or the
        coordinator's publish never came): (key, seconds idle, whether it holds committed
        files: only those may have been committed by a peer coordinator)."""
        now = self._clock()
        with self._lock:
            return [
                (
                    r.key,
                    now - r.last_activity,
                    # A replacing save is never asked of the peers (its internal id is
                    # no RPC's); its commit's publish or gossip takes it into place.
                    not r.checkpoint_id.endswith(NEXT_GENERATION)
                    and any(f.committed and f.held for f in r.files.values()),
                )
                for r in self._records.values()
                if r.state is State.WRITING and now - r.last_activity > self.abandon_after
            ]

    def abort_idle(self, keys: Iterable[Key]) -> list[Key]:
        """Abort the saves of `keys` still WRITING and still idle past abandon_after;
        returns those aborted."""
        now = self._clock()
        aborted = []
        with self._lock:
            for key in keys:
                rec = self._records.get(key)
                idle = now - rec.last_activity if rec is not None else 0.0
                if rec is not None and rec.state is State.WRITING and idle > self.abandon_after:
                    self._abort(rec, f"no activity for {idle:.0f} s")
                    aborted.append(key)
        return aborted

    def sweep(self) -> list[Key]:
        """A node without a peer tier: abort every idle save, settle orphans, and apply
        memory retention where a reader's grace ran out; returns the keys aborted (with
        peers, `peers.unfinished.UnfinishedSaves.sweep` asks them first)."""
        aborted = self.abort_idle(key for key, _, _ in self.idle_saves())
        self.salvage_orphans()
        self.expire_landed()
        return aborted

    # ---- orphans (restart) -------------------------------------------------------------
    def keep_orphans(self, orphans: dict[Key, dict[str, int]]) -> None:
        """Adoption's unfinished data dirs (call under the lock; their bytes are already
        counted as quarantined)."""
        self._orphans = dict(orphans)
        self._orphans_since = self._clock()

    def unknown_orphans(self) -> list[Key]:
        """Orphans of checkpoints this node knows nothing of (the peers may)."""
        with self._lock:
            return [k for k in self._orphans if k not in self._records]

    def salvage_orphans(self, absent: Collection[Key] = (), *, final: bool = False) -> int:
        """Install the orphan files a committed manifest says this node owns (verified
        first, outside the lock) and collect the orphans that are settled: known to the
        catalog, `absent` (every peer answered without it), or unknown past the patience
        (`final`: now). Returns bytes installed."""
        with self._lock:
            if not self._orphans:
                return 0
            late = final or (
                self._clock() - self._orphans_since > UNFINISHED_PATIENCE * self.abandon_after
            )
            candidates: list[tuple[Key, FileRecord]] = []
            for key, files in self._orphans.items():
                rec = self._records.get(key)
                if rec is None or rec.state is not State.COMMITTED:
                    continue
                for name, size in files.items():
                    f = rec.files.get(name)
                    if f is not None and self._salvageable(f, size):
                        candidates.append((key, dataclasses.replace(f)))
        good = [(key, f) for key, f in candidates if self._verified(key, f)]
        installed = 0
        with self._lock:
            for key, f in good:
                installed += self._install_orphan(key, f)
            settled = [k for k in self._orphans if k in absent or self._settled(k, late)]
            for key in settled:
                self._collect_orphan(key, self._orphans.pop(key))
        return installed

    def _settled(self, key: Key, late: bool) -> bool:
        """Whether an orphan's fate is known: its checkpoint committed here, or nothing
        known of it past the patience (a save of that id writing again keeps it)."""
        rec = self._records.get(key)
        return rec.state is State.COMMITTED if rec is not None else late

    def _salvageable(self, f: FileRecord, size: int) -> bool:
        return (
            not f.held
            and f.owner_node == self.node_id
            and f.size == size
            and f.checksums is not None
        )

    def _verified(self, key: Key, f: FileRecord) -> bool:
        assert f.checksums is not None
        path = self.tier.file_path(*key, f.name)
        ok, reason = self.tier.verify_file(path, f.size, f.checksums)
        if ok:
            try:
                self.tier.seal_file(path, exclusive=False)
            except (OSError, UnsafePath) as e:
                ok, reason = False, str(e)
        if not ok:
            logger.warning(
                "%s/%s/%s left by an unfinished save does not match the committed "
                "manifest (%s): not installed",
                *key,
                f.name,
                reason,
            )
        return ok

    def _install_orphan(self, key: Key, f: FileRecord) -> int:
        """Hold a verified orphan file (call under the lock); bytes installed."""
        rec = self._records.get(key)
        mine = rec.files.get(f.name) if rec is not None else None
        if rec is None or rec.state is not State.COMMITTED or mine is None or mine.held:
            return 0
        if (mine.size, mine.checksums, mine.owner_node) != (f.size, f.checksums, f.owner_node):
            return 0
        held = dataclasses.replace(mine, held=True)
        self._write_manifest(dataclasses.replace(rec, files={**rec.files, f.name: held}))
        mine.held = True
        self._orphans[key].pop(f.name, None)
        self._budget.release_quarantined(f.size)
        self._track(rec)
        logger.info(
            "%s/%s/%s: kept the file an unfinished save left here, %s: its coordinator "
            "committed the checkpoint while this daemon was down",
            *key,
            f.name,
            format_size(f.size),
        )
        return f.size

    def _collect_orphan(self, key: Key, files: dict[str, int]) -> None:
        """Remove what is left of an orphan (call under the lock)."""
        rec = self._records.get(key)
        for name in files:
            f = rec.files.get(name) if rec is not None else None
            if f is not None and f.held:
                continue
            try:
                self.tier.remove_file(self.tier.file_path(*key, name))
            except (OSError, UnsafePath) as e:
                logger.warning("cannot collect %s/%s/%s: %s", *key, name, e)
        self._budget.release_quarantined(sum(files.values()))
        if rec is None:
            self.tier.remove_checkpoint_dir(*key)
        if files:
            logger.warning(
                "collected %d files (%s) of the unfinished save %s/%s: %s",
                len(files),
                format_size(sum(files.values())),
                *key,
                "its coordinator did not commit it"
                if rec is None
                else "not part of the committed checkpoint",
            )

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
    def begin(
        self, namespace: str, checkpoint_id: str, rank: int, *, overwrite: bool = False
    ) -> None:
        """Open a save; idempotent for every rank. A committed id is refused
        (CheckpointExists) unless `overwrite`: then the save is a new generation, written
        under an internal id beside the committed one, which stays listed and loadable
        until the new one commits and retires it (`_replace_generation`)."""
        fault("save.begin")
        key = self._ref(namespace, checkpoint_id)
        owner = self.events.owner_of(namespace)  # uid isolation: the manifest names the owner
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and rec.state is State.COMMITTED:
                if not overwrite:
                    raise CheckpointExists(
                        f"checkpoint {namespace}/{checkpoint_id} is already committed on node "
                        f"{self.node_id} and this save does not overwrite (immutable): pick a "
                        "new checkpoint_id, or save with overwrite"
                    )
                key = (namespace, next_generation_id(checkpoint_id))
                rec = self._records.get(key)
            else:
                self.peer_marks.saved_again(key)  # after a delete: peers may publish it
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
                    checkpoint_id=key[1],
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
            path = self.tier.file_path(namespace, rec.checkpoint_id, name)
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

            self.tier.seal_file(self.tier.file_path(namespace, rec.checkpoint_id, name), same_size)
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
        checkpoint_format: str = FORMAT_DCP,
    ) -> CheckpointView:
        """Publish a checkpoint atomically (its manifest), then collect and apply retention.

        `remote` are required files that peers hold (the cluster commit asked them with
        Holdings); they enter the manifest with their owner and `held` False. `durable`:
        the "make this one durable" hint, kept in the manifest (restarts, peers): due
        whatever `drain_every` says (`DurabilityLedger.due`). Refused without a persistent tier, never
        ignored: the caller asked for a copy that would never exist. `checkpoint_format`
        (`tierckpt.names.FORMATS`) is kept in the manifest: a "files" one is drained and
        restored byte for byte, never decoded.
        """
        key = self._ref(namespace, checkpoint_id)
        url = self.persistent_url(namespace)
        if durable and self.durability.refuses_durable(url):
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
                and self._replacing(key) is None
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
            old = self._records.get(key)
            if rec is not old and old is not None:  # an overwrite: the old generation goes
                rec = self._replace_generation(old) or rec
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
                memory_keep_last=self.windows.get(namespace),
                checkpoint_format=check_format(checkpoint_format),
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
            rec.memory_keep_last = staged.memory_keep_last
            rec.checkpoint_format = staged.checkpoint_format
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
            rec = self._save_of(key)
            if rec is None:
                raise self._not_found(namespace, checkpoint_id)
            if rec.state is State.COMMITTED:
                raise CheckpointIncomplete(
                    f"checkpoint {namespace}/{checkpoint_id} is committed and cannot be aborted; "
                    "use DeleteCheckpoint (`tierckpt rm`)"
                )
            self._abort(rec, "aborted by the client")

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
    def get(
        self, namespace: str, checkpoint_id: str = "", *, verified: bool = False
    ) -> CheckpointView:
        """A committed checkpoint; an empty id is the newest of the namespace (never one
        marked BAD; `verified`: the newest marked VERIFIED)."""
        check_namespace(namespace)
        with self._lock:
            if not checkpoint_id:
                rec = self._newest(namespace, verified=verified)
                if rec is None and verified:
                    raise CheckpointNotFound(
                        f"no checkpoint of {namespace} is marked verified on node "
                        f"{self.node_id} (`tierckpt mark {namespace} ID verified`); "
                        f"`tierckpt ls {namespace}` shows each one's trust"
                    )
                self._say_skipped(namespace, rec)
            else:
                rec = self._records.get((namespace, check_checkpoint_id(checkpoint_id)))
            if rec is None or rec.state is not State.COMMITTED:
                raise self._not_found(namespace, checkpoint_id)
            return self._view(rec)

    def list_checkpoints(
        self, namespace: str = "", include_uncommitted: bool = False
    ) -> list[CheckpointView]:
        """Committed checkpoints by sequence, then (optionally) saves in progress; a save
        replacing a committed id is shown under that id (WRITING, beside the committed one),
        never under its internal id."""
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
            writers = self.writers.by_namespace(namespace)
            trust = {ns: self.events.trust_marks(ns) for ns in {r.namespace for r in recs}}
            views = [
                self._view(r, writers.get(r.namespace, set()), trust[r.namespace]) for r in recs
            ]
            return [
                dataclasses.replace(v, checkpoint_id=v.checkpoint_id.removesuffix(NEXT_GENERATION))
                if v.checkpoint_id.endswith(NEXT_GENERATION)
                else v
                for v in views
            ]

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
                prewarm_pending_bytes=self.events.prewarm_pending() + self.pool.pending,
                prewarm_ready_bytes=self.pool.prewarmed_bytes,
                prewarm_used_bytes=self.pool_use.prewarmed_bytes,
                pool_hits=self.pool_use.hits,
                pool_misses=self.pool_use.misses,
                peer_clocks=dict(self.peer_marks.skew_now()),
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
            self._budget.limit_manifests(share)

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
            # The same dict, filled: the namespace binding reads it (`writers`).
            self._records.clear()
            self._records.update(records)
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
