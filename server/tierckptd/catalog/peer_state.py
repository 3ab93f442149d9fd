"""The peer tier's changes to the catalog: manifests published by the coordinator's
daemon, copies arriving from other tiers, dropped corrupt copies, replica lists, and the
healer's marks. Each changes records under the catalog lock, manifest first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointNotFound,
    PermissionDenied,
    TierckptError,
)
from tierckpt.names import METADATA_FILE
from tierckpt.units import format_size

from tierckptd.catalog.budget import admit_namespace
from tierckptd.catalog.persistent_marks import PersistentMarks
from tierckptd.catalog.state import MAX_GONE, listing
from tierckptd.catalog.views import Health, found
from tierckptd.model import (
    CLOCK_SKEW,
    MAX_REPLICAS,
    MAX_SEQUENCE,
    CheckpointRecord,
    CheckpointView,
    FileRecord,
    Key,
    State,
    Trust,
    coordinator_of,
)
from tierckptd.ops import metrics

__all__ = ["PeerState"]

logger = logging.getLogger("tierckptd.catalog")

# A checkpoint committed (by its coordinator's clock) up to this many seconds after it was
# deleted (by the deleting node's clock) is taken for the deleted one: node clocks
# disagree a little, and a deleted checkpoint must never come back. Saving it again
# under the same id is taken once it is committed later than that.
DELETE_SKEW = 60.0
# Peers whose clock skew is remembered (`clock_skew`, the metric's label values).
MAX_SKEWED_PEERS = 256


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


class PeerState(PersistentMarks):
    """What peers (and the other tiers' copies) change in the catalog."""

    # The cluster pin marks of a namespace (checkpoint id -> pinned; peers/operations.py),
    # applied to a manifest that arrives after them. Called under the lock: it takes only
    # the mark journal's lock.
    pin_marks: Callable[[str], dict[str, bool]] = staticmethod(_no_pins)

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
        if self.check_owner is not None:  # uid isolation: another uid's namespace here
            self.check_owner(published)
        with self._lock:
            gone_sequence = self._gone_sequence.get(key)
            gone = self._gone.get(key)
            if gone_sequence is not None:
                if published.sequence <= gone_sequence:
                    return False  # the very checkpoint deleted here, whatever its time
            elif gone is not None and published.committed_unix <= gone + DELETE_SKEW:
                return False  # deleted here (or by a cluster rm) after it was committed
            if key in self._evicted and not durable:
                return False  # retention evicted it here; only its durable copy lists it again
            self._evicted.pop(key, None)
            rec = self._records.get(key)
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
                self._measure_skew(published)
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
                pinned=self.pin_marks(key[0]).get(key[1], published.pinned),  # a cluster pin
                trust=Trust.PROVEN if durable or took_part else self._trust_of(published),
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
                self._durable.add(key)  # before retention sees it: kept persistent-only
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
                f"{listing(sorted(self._writers(key[0])))})",
            )
            self._notify_committed(new)
            self._apply_retention(key[0])
            return True

    def _trust_of(self, published: CheckpointRecord) -> Trust:
        """A peer's manifest this node took no part in (call under the lock): VOUCHED when
        its coordinator writes the namespace here, or the namespace has no writer yet and
        the peers were not asked about it (trust on first use: a coordinator publishing
        its own save), else FOREIGN (`model.Trust`). Once the peers stated the writers
        (`set_cluster_writers`), those decide, an empty agreement included."""
        writers = self._writers(published.namespace)
        asked = published.namespace in self._cluster_writers
        if (not writers and not asked) or coordinator_of(published.files) in writers:
            return Trust.VOUCHED
        return Trust.FOREIGN

    def _measure_skew(self, published: CheckpointRecord) -> None:
        """How far ahead of this node's clock the coordinator's times are (call under the
        lock): remembered per coordinator (`clock_skew`, the metric), and a warning once
        it passes CLOCK_SKEW. Shown, never acted on: order is the sequence's."""
        coordinator = coordinator_of(published.files)
        if not coordinator or coordinator == self.node_id:
            return
        ahead = max(0.0, published.committed_unix - self._wall())
        before = self._skew.pop(coordinator, 0.0)
        self._skew[coordinator] = ahead
        while len(self._skew) > MAX_SKEWED_PEERS:
            dropped = next(iter(self._skew))
            del self._skew[dropped]
            metrics.forget_peer_skew(dropped)
        metrics.PEER_CLOCK_SKEW.labels(peer=coordinator).set(ahead)
        if ahead > CLOCK_SKEW >= before:
            logger.warning(
                "node %s's clock is %.0f s ahead of this node's (its manifest of %s/%s): its "
                "times are shown as this node's now; order follows the sequence, so it "
                "still replicates; fix its clock (NTP)",
                coordinator,
                ahead,
                published.namespace,
                published.checkpoint_id,
            )

    def clock_skew(self) -> dict[str, float]:
        """Seconds each peer's clock was ahead of this node's at its latest manifest (0:
        not ahead), for `status` and the metric."""
        with self._lock:
            return dict(self._skew)

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

    def start_incoming(
        self, namespace: str, checkpoint_id: str, name: str, *, restored: bool = False
    ) -> Path | None:
        """Make room for a copy of a file arriving from a peer; None if already held.

        The bytes count as reserved until `finish_incoming`; a copy that does not fit the
        budget is refused (RESOURCE_EXHAUSTED) before any byte is written. `restored`: a
        reader's copy (see `finish_incoming`).
        """
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
            return path

    def finish_incoming(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        tmp: Path,
        ok: bool,
        *,
        restored: bool = False,
    ) -> bool:
        """Install (ok) or drop a received copy; True when it is now held here.
        `restored` (a reader's copy) exempts the checkpoint from memory retention for
        `LANDED_GRACE` s: the reader opens the file next."""
        with self._lock:
            self._budget.finish_incoming((namespace, checkpoint_id, name))
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
                try:
                    self.tier.seal_file(tmp)
                except FileNotFoundError:
                    # Retention evicted the checkpoint while the copy arrived: its directory
                    # went, this copy with it. Not held; the caller says so (never INTERNAL).
                    return False
                self.tier.install(tmp, final)
                installed = True
                self._write_manifest(dataclasses.replace(rec, files={**rec.files, name: held}))
            except BaseException:
                self.tier.remove_file(final if installed else tmp)
                raise
            f.held, f.replica_nodes = True, replicas
            self._track(rec)
            if (health := found(self._health.get(rec.key), name)) is not None:
                self._health[rec.key] = health  # a copy here: that file is not lost
            if restored:
                self._landed[rec.key] = self._clock()
            return True

    def drop_local_copy(
        self, namespace: str, checkpoint_id: str, name: str, *, surplus: bool = False
    ) -> bool:
        """Forget a corrupt local copy (never served again), or with `surplus` one copy
        too many (the healer's trim), which a reader restored moments ago keeps (it opens
        the file next: `_landing`); True if one was dropped."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id))
            f = rec.files.get(name) if rec is not None else None
            if rec is None or f is None or not f.held or (surplus and self._landing(rec)):
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

    def unhealthy_count(self) -> int:
        with self._lock:
            return len(self._health)

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
                self._health.pop(rec.key, None)
                return
            health: Health | None = Health(label, tuple(sorted(lost)))
            # A finding is as old as the holdings its heal asked for: a copy installed
            # here meanwhile (`install_copy` clears its file the same way) is not lost.
            for name, f in rec.files.items():
                if f.held:
                    health = found(health, name)
            assert health is not None
            self._health[rec.key] = health

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
            self._gone[key] = max(self._gone.pop(key, 0.0), stamp)
            while len(self._gone) > MAX_GONE:
                del self._gone[next(iter(self._gone))]
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
        yet applied (persistent retention keeps them all)."""
        marks = self.pin_marks(namespace)
        with self._lock:
            pinned = {
                r.checkpoint_id
                for r in self._records.values()
                if r.namespace == namespace and r.state is State.COMMITTED and r.pinned
            }
        return {c for c in pinned | set(marks) if marks.get(c, True)}
