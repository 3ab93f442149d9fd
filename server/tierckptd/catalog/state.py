"""The catalog's state and what every part of it shares (see `tierckptd.catalog`).

`CatalogState` holds the records, the lock, the budget and the pool, and the steps that
change records under the lock for several callers: lookups, views, manifest writes,
collection, memory retention, and the persistent tier's marks that retention obeys.
`PeerState` (peer_state.py) and `Catalog` (__init__.py) build on it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable

from tierckpt.errors import CheckpointIncomplete, CheckpointNotFound
from tierckpt.names import check_checkpoint_id, check_namespace
from tierckpt.units import format_size

from tierckptd.catalog.budget import Budget, held_charge
from tierckptd.catalog.prewarm import NextSavePlan, PoolUse, assign
from tierckptd.catalog.retention import evictions_by_coordinator
from tierckptd.catalog.views import Health, all_lost, is_lost, view_of
from tierckptd.memory.manifest import to_json as manifest_to_json
from tierckptd.memory.manifest import write_manifest
from tierckptd.memory.pool import PREWARM_SEGMENT, Segment, WarmPool
from tierckptd.memory.tier import MemoryTier, UnsafePath, no_space
from tierckptd.model import CheckpointRecord, CheckpointView, Key, State, Trust, coordinator_of
from tierckptd.ops import metrics
from tierckptd.ops.faults import fault

__all__ = ["CatalogState", "listing"]

logger = logging.getLogger("tierckptd.catalog")

MAX_NAMESPACE_URLS = 65_536  # namespaces with their own persistent URL on one node
# Deleted checkpoints remembered so a peer's late publish cannot bring them back; a peer
# still holding one deleted this many deletions ago is long past its own retention.
MAX_GONE = 65_536
# Seconds a checkpoint a reader's copy just arrived into is exempt from memory retention
# (the reader opens the file next); the sweeper applies retention again once it is over.
LANDED_GRACE = 3.0


def listing(names: list[str], shown: int = 5) -> str:
    """Names for a message, bounded: "a, b, c and 199,997 more" (each cut to 64 chars)."""
    head = ", ".join(n[:64] for n in names[:shown]) or "none"
    return head + (f" and {len(names) - shown:,} more" if len(names) > shown else "")


class CatalogState:
    """Records, lock, budget and pool of one memory tier, and the shared steps."""

    # A drain made a deleted checkpoint durable (peers/operations.py; only enqueues).
    on_gone_durable: Callable[[str, str], None] | None = None

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
        self.recycle = recycle
        self.memory_keep_last = memory_keep_last
        self.abandon_after = abandon_after
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self.pool = WarmPool(tier, self._lock)
        self._budget = Budget(budget, self.pool, node_id=node_id)
        self._records: dict[Key, CheckpointRecord] = {}
        self._next_sequence = 1
        # Peer tier: extra copies wanted per file (0 = no peers), per-checkpoint health
        # marks set by the healer ("under-replicated", "lost"), and checkpoints deleted
        # here (a peer's healer must not push them back).
        self.replica_target = 0
        self._health: dict[Key, Health] = {}  # the healer's marks (`views.Health`)
        # Insertion-ordered and bounded (`MAX_GONE`, oldest dropped): one key per deletion,
        # retention's included, would otherwise grow for the daemon's whole life. Value:
        # the deletion's stamp; a publish of one committed by then is refused (peer_state).
        self._gone: dict[Key, float] = {}
        # The sequence of each deleted checkpoint this node had (bounded like `_gone`): a
        # publish of it at that sequence or below is the deleted one whatever its time
        # says (a peer whose clock is ahead cannot bring it back); above it, a new save.
        self._gone_sequence: dict[Key, int] = {}
        # Seconds each peer's clock was ahead of this one at its latest new manifest
        # (`PeerState.clock_skew`; insertion-ordered, bounded by MAX_SKEWED_PEERS).
        self._skew: dict[str, float] = {}
        # The writers the cluster states for a namespace this node has no PROVEN
        # checkpoint of (`set_cluster_writers`, audit 3 H2): they replace trust on first
        # use. An empty set: the peers agreed on none (no newest from peers). Beside it,
        # what each peer stated, for the messages.
        self._cluster_writers: dict[str, frozenset[str]] = {}
        self._stated: dict[str, dict[str, frozenset[str]]] = {}
        # Retention's evictions of checkpoints not known durable here, kept apart from
        # deletions: a peer's publish of one is refused as well (retention would only
        # evict it again), but the persistent tier's adoption is not (the drain may have
        # made it durable elsewhere; it must stay loadable through this node).
        self._evicted: dict[Key, float] = {}
        self._landed: dict[Key, float] = {}  # when a reader's copy arrived (`_landing`)
        # Persistent tier: drain every `drain_every`-th committed checkpoint (0: no
        # persistent tier), the checkpoints known to be durable there, and a callback
        # (called under the lock: it must only enqueue) for every new commit here.
        self.drain_every = 0
        # Whether `[persistent] url` is set: without it only checkpoints committed in a
        # namespace with its own URL (`set_persistent_url`) drain.
        self.default_persistent = True
        self._persistent_urls: dict[str, str] = {}  # namespace -> URL its commits record
        self._durable: set[Key] = set()
        # No longer due: superseded in the persistent tier (`retire`).
        self._retired: set[Key] = set()
        self._drain_failed: dict[Key, bool] = {}  # shown as "drain-failed"; True: refused
        self.on_committed: Callable[[str, str], None] | None = None
        # Next-save prewarm (`prewarm.NextSaveWarmer.schedule`, called under the lock: it
        # only enqueues) after every commit here, and what saves got from the pool.
        self.prewarm_next: Callable[[str], object] | None = None
        self.prewarm_pending: Callable[[], int] = lambda: 0  # bytes planned, not made yet
        self.pool_use = PoolUse()
        self._prewarm_begun: set[str] = set()  # namespaces prewarmed for at a Begin
        # `[security] local_isolation = "uid"` (`rpc.local_access`, never called under the
        # lock): a namespace's owner (uid, node of the claim), stamped on each new save's
        # record so it travels with the manifest, and the check of a peer's manifest
        # against this node's owner (PermissionDenied) before a publish is taken.
        self.owner_of: Callable[[str], tuple[int, str] | None] = lambda namespace: None
        self.check_owner: Callable[[CheckpointRecord], None] | None = None
        self.max_namespaces = 0  # `[memory] max_namespaces` (0: no bound)

    @property
    def budget(self) -> int:
        """`memory.budget` in bytes."""
        return self._budget.limit

    @budget.setter
    def budget(self, limit: int) -> None:
        self._budget.limit = limit

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
        return is_lost(self._health.get(rec.key), rec.key in self._durable)

    def _writers(self, namespace: str) -> set[str]:
        """The nodes that write `namespace` here (`model.Trust`): the coordinators of its
        PROVEN checkpoints; while it has none, the writers a majority of the peers stated
        (`set_cluster_writers`) once they were asked; else of its VOUCHED ones."""
        return self._writers_by_namespace(namespace).get(namespace, set())

    def _proven_writers(self, namespace: str = "") -> dict[str, set[str]]:
        """The coordinators of the PROVEN checkpoints of `namespace` (or of every one)."""
        proven: dict[str, set[str]] = {}
        for r in self._records.values():
            if (namespace and r.namespace != namespace) or r.state is not State.COMMITTED:
                continue
            if r.trust is Trust.PROVEN and (coordinator := coordinator_of(r.files)):
                proven.setdefault(r.namespace, set()).add(coordinator)
        return proven

    def _writers_by_namespace(self, namespace: str = "") -> dict[str, set[str]]:
        """`_writers` of `namespace`, or of every namespace (""), in one pass."""
        proven = self._proven_writers(namespace)
        vouched: dict[str, set[str]] = {}
        for r in self._records.values():
            if (namespace and r.namespace != namespace) or r.state is not State.COMMITTED:
                continue
            if r.trust is Trust.VOUCHED and (coordinator := coordinator_of(r.files)):
                vouched.setdefault(r.namespace, set()).add(coordinator)
        cluster = {
            ns: set(w)
            for ns, w in self._cluster_writers.items()
            if not namespace or ns == namespace
        }
        return {
            ns: proven.get(ns) or (cluster[ns] if ns in cluster else vouched.get(ns, set()))
            for ns in {*proven, *vouched, *cluster}
        }

    def writers(self, namespace: str) -> set[str]:
        """The nodes that write `namespace` here (`_writers`)."""
        with self._lock:
            return self._writers(namespace)

    def bound_namespaces(self) -> set[str]:
        """The namespaces this node has writers of (`_writers`): its binding, kept."""
        with self._lock:
            return {ns for ns, w in self._writers_by_namespace().items() if w}

    def proven_writers(self, namespace: str = "") -> dict[str, set[str]]:
        """This node's own binding (what it states to peers): per namespace, the
        coordinators of the checkpoints it committed, took part in, or found durable."""
        with self._lock:
            return self._proven_writers(namespace)

    def stated_writers(self, namespace: str = "") -> dict[str, tuple[set[str], bool]]:
        """What this node states to peers as a namespace's writers, and whether the
        statement is only vouched: its PROVEN writers where it has any (False), else the
        ones it uses itself (True: what its peers agreed on, or the coordinators of the
        copies it holds). A node that only holds a job's replicas thus still vouches for
        its coordinator, so the replacement of that job's only writer finds the newest;
        a vouched statement counts only where no peer states proven writers."""
        with self._lock:
            proven = self._proven_writers(namespace)
            return {
                ns: (proven[ns], False) if ns in proven else (nodes, True)
                for ns, nodes in self._writers_by_namespace(namespace).items()
                if nodes
            }

    def set_cluster_writers(
        self, namespace: str, writers: set[str], stated: dict[str, frozenset[str]]
    ) -> bool:
        """The writers of `namespace` a majority of the peers stated (`stated`: what each
        said), for a node that had no binding of it (`bound_namespaces`, asked before the
        peers were): they replace trust on first use, and any VOUCHED one a peer's publish
        made meanwhile. Returns False (nothing set) when this node has PROVEN writers."""
        with self._lock:
            if self._proven_writers(namespace):
                return False
            self._cluster_writers[namespace] = frozenset(writers)
            self._stated[namespace] = dict(stated)
            return True

    def _eligible(self, recs: Iterable[CheckpointRecord], namespace: str) -> list[CheckpointRecord]:
        """The committed checkpoints of `recs` that may be the namespace's newest: not
        LOST, and coordinated by a writer of the namespace (one no memory tier holds any
        more, with no coordinator left, unless it arrived FOREIGN)."""
        writers = self._writers(namespace)
        return [
            r
            for r in recs
            if r.namespace == namespace
            and r.state is State.COMMITTED
            and not self._is_lost(r)
            and not self._foreign(r, writers)
        ]

    def _newest(self, namespace: str) -> CheckpointRecord | None:
        """The namespace's newest committed checkpoint (by sequence, never by wall time)
        that is not LOST and is coordinated by a node that writes the namespace: a peer
        publishing into a namespace it does not write never becomes its newest here."""
        eligible = self._eligible(self._records.values(), namespace)
        return max(eligible, key=lambda r: r.order, default=None)

    def _say_skipped(self, namespace: str, newest: CheckpointRecord | None) -> None:
        """Warn when a checkpoint later by sequence than the newest was passed over
        because its coordinator does not write the namespace here (never silently)."""
        after = newest.order if newest is not None else (-1, 0.0)
        eligible = {r.key for r in self._eligible(self._records.values(), namespace)}
        skipped = [
            r
            for r in self._records.values()
            if r.namespace == namespace
            and r.state is State.COMMITTED
            and r.order > after
            and not self._is_lost(r)
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
                listing(sorted(self._writers(namespace))),
            )

    def _not_found(self, namespace: str, checkpoint_id: str) -> CheckpointNotFound:
        newest = self._newest(namespace)
        if not checkpoint_id and newest is None and (unbound := self._unbound(namespace)):
            return unbound
        lost = [r for r in self._records.values() if r.namespace == namespace]
        if not checkpoint_id and newest is None and any(map(self._is_lost, lost)):
            return all_lost(namespace, self.node_id, [r for r in lost if self._is_lost(r)])
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

    def _unbound(self, namespace: str) -> CheckpointNotFound | None:
        """Why a namespace has no newest when its peers agreed on no writer of it (a node
        with no binding of its own: `set_cluster_writers`), naming the candidates."""
        agreed = self._cluster_writers.get(namespace)
        if self._proven_writers(namespace) or agreed is None or agreed:
            return None  # a binding of its own, never asked, or the peers agreed on writers
        candidates = sorted(
            (r for r in self._records.values() if r.namespace == namespace),
            key=lambda r: r.order,
            reverse=True,
        )
        committed = [r for r in candidates if r.state is State.COMMITTED]
        if not committed:
            return None
        stated = self._stated.get(namespace, {})
        said = "; ".join(
            f"{node} says {listing(sorted(w)) if w else 'none'}"
            for node, w in sorted(stated.items())
        )
        return CheckpointNotFound(
            f"no newest checkpoint of {namespace} on node {self.node_id}: this node took no "
            f"part in {namespace} and its peers agree on no writer of it (a writer needs a "
            f"majority of the {len(stated)} peers that state one, and a node never vouches "
            f"for itself alone: {said or 'none stated'}); candidates: "
            + listing(
                [
                    f"{r.checkpoint_id} (by {coordinator_of(r.files) or 'none'}"
                    + (", LOST)" if self._is_lost(r) else ")")
                    for r in committed
                ]
            )
            + "; load one by its id"
        )

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

    def _committed(self, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        key = self._ref(namespace, checkpoint_id)
        rec = self._records.get(key)
        if rec is None or rec.state is not State.COMMITTED:
            raise self._not_found(namespace, checkpoint_id)
        return rec

    def _foreign(self, rec: CheckpointRecord, writers: set[str] | None = None) -> bool:
        """Whether `rec` is never its namespace's newest here for its coordinator (not a
        writer of the namespace: `model.Trust`); `writers` of its namespace if known."""
        if rec.state is not State.COMMITTED:
            return False
        coordinator = coordinator_of(rec.files)
        if not coordinator:
            return rec.trust is Trust.FOREIGN
        return coordinator not in (writers if writers is not None else self._writers(rec.namespace))

    def _view(self, rec: CheckpointRecord, writers: set[str] | None = None) -> CheckpointView:
        health = self._health.get(rec.key, Health(""))
        return view_of(
            rec,
            node_id=self.node_id,
            replica_target=self.replica_target,
            label=health.label,
            lost=health.lost,
            durable=rec.key in self._durable,
            drain_failed=rec.key in self._drain_failed,
            foreign=self._foreign(rec, writers),
            paths={
                f.name: str(self.tier.file_path(rec.namespace, rec.checkpoint_id, f.name))
                for f in rec.files.values()
                if f.held
            },
        )

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
        tombstone that the persistent tier's adoption overrides, see `_evicted`)."""
        # Manifest first: a crash after this point leaves a dir without manifest, which
        # adoption collects, never a manifest pointing at missing files.
        self.tier.remove_file(self.tier.manifest_path(rec.namespace, rec.checkpoint_id))
        if rec.state is State.COMMITTED:
            stones = self._evicted if evicted else self._gone
            stones[rec.key] = max(stones.pop(rec.key, 0.0), self._wall())
            while len(stones) > MAX_GONE:
                del stones[next(iter(stones))]
            if not evicted:
                self._forget_sequence(rec.key, rec.sequence)
        self._health.pop(rec.key, None)
        self._durable.discard(rec.key)
        self._retired.discard(rec.key)
        self._drain_failed.pop(rec.key, None)
        return self._collect(rec)

    def _forget_sequence(self, key: Key, sequence: int) -> None:
        """Remember the sequence of a deleted checkpoint (see `_gone_sequence`)."""
        self._gone_sequence[key] = max(self._gone_sequence.pop(key, 0), sequence)
        while len(self._gone_sequence) > MAX_GONE:
            del self._gone_sequence[next(iter(self._gone_sequence))]

    # ---- memory retention ---------------------------------------------------------------
    def _due(self, rec: CheckpointRecord) -> bool:
        """Whether the checkpoint is due for the persistent tier (call under the lock):
        every `drain_every`-th one, and any committed with the durable hint. One the drain
        refused (hostile `.metadata`) never can be: it is no longer due."""
        return (
            self.drain_every > 0
            and (self.default_persistent or rec.persistent_url != "")
            and (rec.durable_requested or rec.sequence % self.drain_every == 0)
            and not self._drain_failed.get(rec.key, False)
            and rec.key not in self._retired
        )

    def _holds(self, rec: CheckpointRecord) -> bool:
        """Whether retention must keep `rec` in memory: pinned, or (invariant 6) due for
        the persistent tier and not durable there yet, whatever memory_keep_last says."""
        if rec.pinned:
            return True
        if self._is_lost(rec):
            return False  # due or not, it can never be made durable: kept only by its age
        if self._due(rec) and rec.key not in self._durable:
            return True
        return self._landing(rec)

    def expire_landed(self) -> None:
        """Apply memory retention again where a reader's grace ran out (the sweeper)."""
        now = self._clock()
        with self._lock:
            over = [k for k, t in self._landed.items() if now - t > LANDED_GRACE]
            for key in over:
                del self._landed[key]
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
        return rec.key in self._durable and not any(
            f.held or f.owner_node or f.replica_nodes for f in rec.files.values()
        )

    def _notify_committed(self, rec: CheckpointRecord) -> None:
        if self.on_committed is not None and self._due(rec):
            self.on_committed(rec.namespace, rec.checkpoint_id)
        if self.prewarm_next is not None:
            self.prewarm_next(rec.namespace)  # plans after retention: evicted files count

    def _apply_retention(self, namespace: str) -> None:
        committed = [
            r
            for r in self._records.values()
            if r.namespace == namespace
            and r.state is State.COMMITTED
            and not self._persistent_only(r)
        ]
        for checkpoint_id in evictions_by_coordinator(
            committed, self.memory_keep_last, self._holds, self._is_lost
        ):
            rec = self._records[(namespace, checkpoint_id)]
            fault("retention.evict")
            if rec.key in self._durable:
                freed = self._keep_persistent_only(rec)
            else:
                freed = self._delete_committed(rec, evicted=True)
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
        self._track(rec)
        self._health.pop(rec.key, None)
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
        if self.prewarm_next is None or namespace in self._prewarm_begun:
            return
        self._prewarm_begun.add(namespace)
        if self._newest(namespace) is not None:
            self.prewarm_next(namespace)
