"""The peer tier of one daemon: membership, replication to buddies, healing, and copies
pushed to or served from this node.

`Cluster` composes the parts (each in its own module) and runs the background work on
one `JobQueue` with REPLICATORS workers: `Heal` after a commit or a publish (URGENT,
ahead of everything else) and every `heal_interval` seconds for every committed
checkpoint (BACKGROUND); `Repair` of a copy found corrupt while it was served, pushed or
scrubbed; `Tell` of a replica list a peer did not take. A peer that does not answer is
skipped for a back-off (`peers/breaker.py`), so a gray peer holds no replicator. A restore (EnsureLocal, a repair, the drain's `.metadata`) goes through
`restore.Restorer`, whose per-file lock a pushed copy (`receive`) takes too.

No consensus: the DCP coordinator's daemon decides a commit and publishes the cluster
manifest to the nodes it involves, the others learn it by gossip each heal round
(`peers/commit.py`); each file records its owner and replica nodes, and the
node responsible for a file (its owner, or the first reachable holder when the owner
lost it) keeps k copies (`peers/healer.py`). `tierckpt rm`, `pin` and `unpin` reach
every node (`peers/operations.py`: marks, journaled, re-sent, carried in ListManifests);
retention's deletions are local to a node, which refuses publishes of what it deleted.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import grpc
from tierckpt.checksum import BlockChecksums, BytesLike
from tierckpt.errors import CheckpointNotFound, InvalidArgument, TierckptError, TierUnavailable
from tierckpt.trust import Trust as TrustState

from tierckptd.catalog import Catalog, Resolution
from tierckptd.config import PeerConfig
from tierckptd.errors import SourceUnavailable
from tierckptd.jobs import (
    BACKGROUND,
    NORMAL,
    URGENT,
    Heal,
    JobQueue,
    Repair,
    ReportCorrupt,
    StepAside,
    Tell,
    TellLanded,
    backoff,
)
from tierckptd.memory.incoming import install_copy
from tierckptd.model import CheckpointRecord, CheckpointView, FileRecord, State
from tierckptd.ops import metrics
from tierckptd.ops.faults import fault
from tierckptd.ops.priority import at_background_priority
from tierckptd.peers.client import PeerCallError, PeerClient
from tierckptd.peers.cluster_marks import Mark
from tierckptd.peers.commit import Committer
from tierckptd.peers.healer import REPLACE_AFTER, Healer, HealPlan
from tierckptd.peers.membership import ChannelFactory, Membership
from tierckptd.peers.operations import ClusterOps, Delivery, TrustStorer, Unstorer
from tierckptd.peers.recheck import Rechecker
from tierckptd.peers.serve import Served, Serving
from tierckptd.peers.source import PeerSource
from tierckptd.restore import BUSY_PATIENCE, BUSY_PAUSE, SourceBusy

__all__ = ["Cluster", "LocalRestore"]

logger = logging.getLogger(__name__)

Job = Heal | Repair | TellLanded | Tell | ReportCorrupt

# Replicator threads: a slow push or a peer's deadline holds one of them, not every heal.
REPLICATORS = 4
# A heal of a checkpoint another replicator is healing runs again after this long.
BUSY_RETRY = 0.2
# A heal that left a file short of copies while a peer it asked did not answer (a deadline
# missed under load, a peer not started yet, a gray peer backing off) runs again, this many times at most, after
# HEAL_RETRY_FIRST seconds doubling up to HEAL_RETRY_CAP: not only at the next heal round.
HEAL_RETRIES = 6
HEAL_RETRY_FIRST = 1.0
HEAL_RETRY_CAP = 30.0


class LocalRestore(Protocol):
    """What the peer tier needs of `restore.Restorer`."""

    def ensure_local(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        repair: bool = False,
        *,
        timed: bool = False,
    ) -> tuple[FileRecord, str]: ...

    def file_lock(
        self, namespace: str, checkpoint_id: str, name: str
    ) -> AbstractContextManager[None]: ...


class Cluster:
    """Membership, peer calls and every peer-tier action of one daemon.

    Args:
        restorer: the one restore chain (repairs go through it; `receive` takes its
            per-file lock).
        client: the peer client (its membership); built from `peers`, `copies` and
            `channel_factory` when not given.
    """

    def __init__(
        self,
        catalog: Catalog,
        restorer: LocalRestore,
        *,
        client: PeerClient | None = None,
        peers: Iterable[PeerConfig] = (),
        copies: int = 1,
        channel_factory: ChannelFactory = grpc.insecure_channel,
        heal_interval: float = 5.0,
        replace_after: float = REPLACE_AFTER,
        unstore: Unstorer | None = None,
        store_trust: TrustStorer | None = None,
        check_mark: Callable[[Mark], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.node_id = catalog.node_id
        self.restorer = restorer
        self.heal_interval = heal_interval
        if client is None:
            client = PeerClient(
                Membership(
                    catalog.node_id,
                    catalog.failure_domain,
                    peers=peers,
                    copies=copies,
                    channel_factory=channel_factory,
                )
            )
        self.client = client
        self.membership = client.membership
        self._stop = threading.Event()
        # Several replicators, new commits first (URGENT), the periodic heal round last
        # (BACKGROUND): one gray peer or one big push does not hold every replication.
        self.jobs: JobQueue[Job] = JobQueue(
            self._run, name="tierckptd-replicator", workers=REPLICATORS
        )
        self._healing: set[tuple[str, str]] = set()  # checkpoints a replicator heals now
        self._heal_tries: dict[Heal, int] = {}  # heals retried for an unreached peer
        self._healing_lock = threading.Lock()
        self.committer = Committer(
            catalog,
            client,
            self._queue_heal,
            heal_full=self._queue_full_heal,
            members=self.membership.member_list,
            replica_target=lambda: self.membership.replica_target,
            merged=self._merged,
        )
        # Cluster rm / pin / unpin (peers/operations.py); the journal is re-applied now,
        # after the memory tier was adopted and before any peer is heard.
        self.ops = ClusterOps(
            catalog,
            client,
            members=lambda: self.members,
            manifest_from=self.committer.manifest_from,
            unstore=unstore,
            store_trust=store_trust,
            check_mark=check_mark,
        )
        self.ops.replay()
        self.healer = Healer(
            catalog,
            client,
            replica_target=lambda: self.membership.replica_target,
            members=self.membership.member_list,
            on_corrupt=self.corrupt,
            stop=self._stop,
            retry_tell=self._queue_tell,
            replace_after=replace_after,
        )
        self.serving = Serving(catalog, self.corrupt)
        # A peer's ReportCorrupt: re-hash the copy here, drop it only on this node's hash.
        self.recheck = Rechecker(
            catalog.file_view, catalog.tier.verify_file, self.corrupt, node_id=self.node_id
        )
        self._heal_thread: threading.Thread | None = None
        self._sync_replica_target()

    def set_healing(self, heal_interval: float, replace_after: float) -> None:
        """`[replication] heal_interval` and `replace_after` (SIGHUP): the next heal
        round waits `heal_interval`; the next heal replaces a holder unreachable for
        `replace_after`."""
        self.heal_interval = heal_interval
        self.healer.replace_after = replace_after

    # ---- membership -------------------------------------------------------------------
    def configure(self, peers: Iterable[PeerConfig], copies: int) -> None:
        """Apply a (re)loaded or discovered peer list and copy count (SIGHUP, discovery).
        A node that joined, or rejoined at another address, gets its copies at once: every
        committed checkpoint is healed now, not at the next heal round."""
        peers = list(peers)
        before = {n: self.membership.address_of(n) for n in self.membership.peer_ids}
        self.membership.configure(peers, copies)
        self.client.breaker.forget(set(self.membership.peer_ids))
        self._sync_replica_target()
        joined = sorted(
            p.id for p in peers if p.id != self.node_id and before.get(p.id) != p.address
        )
        if joined:
            logger.info("peers joined: %s; healing every checkpoint now", ", ".join(joined[:20]))
            self.heal_all()

    def heal_all(self) -> None:
        """Queue a heal of every committed checkpoint (deduplicated by the queue), behind
        the heals of new commits."""
        for namespace, checkpoint_id in self.catalog.committed_keys():
            self.jobs.put(Heal(namespace, checkpoint_id), priority=BACKGROUND)

    def _sync_replica_target(self) -> None:
        # The catalog shows "replicated" once every file has k extra copies.
        self.catalog.peer_marks.set_replica_target(self.membership.replica_target)

    @property
    def peer_ids(self) -> list[str]:
        return self.membership.peer_ids

    @property
    def members(self) -> set[str]:
        """Node ids of the cluster: this node and its configured peers."""
        return self.membership.members

    # ---- background work --------------------------------------------------------------
    def start(self) -> None:
        self.jobs.start()
        self.ops.start()
        if self.heal_interval > 0:
            self._heal_thread = threading.Thread(
                target=self._heal_loop, name="tierckptd-healer", daemon=True
            )
            self._heal_thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.jobs.stop()
        self.ops.stop()
        if self._heal_thread is not None:
            self._heal_thread.join(timeout=5.0)
        self.membership.close()

    def _queue_heal(self, namespace: str, checkpoint_id: str) -> None:
        """A checkpoint committed, published or adopted just now: replicated first. A
        record naming a holder its copy may not be on is listed under-replicated until
        the heal confirms it (`Healer.doubt`)."""
        self.healer.doubt(namespace, checkpoint_id)
        self.jobs.put(Heal(namespace, checkpoint_id), priority=URGENT)

    def _merged(self, namespace: str, checkpoint_id: str, before: set[str]) -> None:
        """A gossiped manifest was merged into a known record: holders it added that
        restarted lately are confirmed by a heal first (`Healer.doubt_added`)."""
        if self.healer.doubt_added(namespace, checkpoint_id, before):
            self.jobs.put(Heal(namespace, checkpoint_id), priority=URGENT)

    def _queue_tell(
        self, namespace: str, checkpoint_id: str, name: str, node: str, tries: int, delay: float
    ) -> None:
        self.jobs.put(Tell(namespace, checkpoint_id, name, node, tries), delay, priority=NORMAL)

    def copy_landed(self, namespace: str, checkpoint_id: str, name: str) -> None:
        """A copy from a peer was installed here (`PeerSource.landed`): queue telling the
        file's neighbourhood and the coordinator (`Healer.tell_landed`), off the restore."""
        self.jobs.put(TellLanded(namespace, checkpoint_id, name))

    def copy_rejected(self, node: str, namespace: str, checkpoint_id: str, name: str) -> None:
        """Bytes `node` sent of a file over its bulk stream failed verification here
        (`PeerSource.rejected`): queue telling it (`ReportCorrupt`), off the restore."""
        self.jobs.put(ReportCorrupt(namespace, checkpoint_id, name, node))

    def _queue_full_heal(self, namespace: str, checkpoint_id: str) -> None:
        self.jobs.put(Heal(namespace, checkpoint_id, full=True))

    def _run(self, job: Job) -> float | None:
        try:
            if isinstance(job, Heal):
                key = (job.namespace, job.checkpoint_id)
                with self._healing_lock:
                    if key in self._healing:
                        return BUSY_RETRY  # a full and a plain heal: one at a time
                    self._healing.add(key)
                try:
                    plan = self.healer.heal(job.namespace, job.checkpoint_id, full=job.full)
                finally:
                    with self._healing_lock:
                        self._healing.discard(key)
                return self._heal_again(job, plan)
            elif isinstance(job, TellLanded):
                self.healer.tell_landed(job.namespace, job.checkpoint_id, job.name)
            elif isinstance(job, Tell):
                self.healer.tell(job.namespace, job.checkpoint_id, job.name, job.node, job.tries)
            elif isinstance(job, ReportCorrupt):
                self._report_corrupt(job)
            else:
                self.restorer.ensure_local(job.namespace, job.checkpoint_id, job.name)
                metrics.REPAIRED_COPIES.inc()
        except CheckpointNotFound:
            pass  # deleted or evicted meanwhile
        except TierckptError as e:
            logger.warning("peer job %s failed: %s", job, e)
        return None

    def _report_corrupt(self, job: ReportCorrupt) -> None:
        """Tell a bulk sender its bytes failed here; once (the restore went on to another
        holder already, and the sender's scrubber covers a report that is lost)."""
        what = f"{job.namespace}/{job.checkpoint_id}/{job.name}"
        try:
            started = self.client.report_corrupt(
                job.node, job.namespace, job.checkpoint_id, job.name
            )
        except PeerCallError as e:
            logger.warning("could not report %s's corrupt copy of %s: %s", job.node, what, e)
            return
        logger.info(
            "reported node %s's copy of %s corrupt; %s",
            job.node,
            what,
            "it re-checks it" if started else "it ignored it (busy re-checking, or did just now)",
        )

    def _heal_again(self, job: Heal, plan: HealPlan | None) -> float | None:
        """The delay before `job` runs again: when a peer it asked was not reached and a
        file was left with fewer than k extra copies (a push it could not make, or a
        holder it could not see; bounded: HEAL_RETRIES), else None."""
        with self._healing_lock:
            if plan is None or not (plan.unreached and (plan.under or plan.short)):
                self._heal_tries.pop(job, None)
                return None
            tries = self._heal_tries.get(job, 0) + 1
            if tries > HEAL_RETRIES:
                self._heal_tries.pop(job, None)
                return None  # the heal rounds take it from here
            self._heal_tries[job] = tries
        return backoff(tries, HEAL_RETRY_FIRST, HEAL_RETRY_CAP)

    def _heal_loop(self) -> None:
        while not self._stop.wait(self.heal_interval):
            self.client.probe_backed_off()
            if self.peer_ids:
                self.heal_all()
                try:
                    self.committer.gossip()
                except TierckptError as e:
                    logger.warning("gossip round failed: %s", e)

    def heal(self, namespace: str, checkpoint_id: str) -> None:
        """Heal one checkpoint now, in the calling thread."""
        self.healer.heal(namespace, checkpoint_id)

    # ---- commit and manifests ---------------------------------------------------------
    def published(self, rec: CheckpointRecord) -> bool:
        return self.committer.published(rec)

    def manifest_from(self, node: str, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        return self.committer.manifest_from(node, namespace, checkpoint_id)

    def pull_manifests(self) -> int:
        return self.committer.pull_manifests()

    def resolve_unfinished(self, namespace: str, checkpoint_id: str) -> Resolution:
        return self.committer.resolve_unfinished(namespace, checkpoint_id)

    def republish_own(self) -> int:
        return self.committer.republish_own()

    # ---- cluster rm / pin / unpin -------------------------------------------------------
    def remove(
        self, namespace: str, checkpoint_id: str, uid: int | None = None
    ) -> tuple[int, Delivery]:
        """`tierckpt rm` on every node and the persistent tier (`ClusterOps.remove`):
        the bytes freed here and what the peers did. `uid`: the tenant that asked (uid
        isolation), carried by the mark."""
        return self.ops.remove(namespace, checkpoint_id, uid)

    def pin(
        self, namespace: str, checkpoint_id: str, pinned: bool, uid: int | None = None
    ) -> tuple[CheckpointView, Delivery]:
        """`tierckpt pin` / `unpin` on every node (`ClusterOps.pin`)."""
        return self.ops.pin(namespace, checkpoint_id, pinned, uid)

    def trust(
        self,
        namespace: str,
        checkpoint_id: str,
        trust: TrustState,
        reason: str = "",
        uid: int | None = None,
    ) -> tuple[CheckpointView, Delivery]:
        """`tierckpt mark NS ID verified|bad` on every node (`ClusterOps.trust`)."""
        return self.ops.trust(namespace, checkpoint_id, trust, reason, uid)

    def apply_mark(self, mark: Mark) -> bool:
        """A peer's ApplyMark (the servicer checked it is the mark's origin)."""
        return self.ops.receive(mark)

    def marks(self, namespace: str = "") -> list[Mark]:
        """The marks this node serves in ListManifests."""
        return self.ops.marks(namespace)

    # ---- copies pushed here, copies served --------------------------------------------
    def receive(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        pieces: Iterable[tuple[int, BytesLike]],
        checksums: BlockChecksums | None = None,
    ) -> int:
        """Store a copy a peer pushes, verified block by block, under the restorer's
        lock of that file; returns bytes taken (0 when the file was already held)."""
        with self.restorer.file_lock(namespace, checkpoint_id, name):
            f, path = self.catalog.file_view(namespace, checkpoint_id, name)
            if f.checksums is None or (checksums is not None and checksums != f.checksums):
                raise InvalidArgument(
                    f"{namespace}/{checkpoint_id}/{name}: the pushed checksums differ from "
                    "this node's manifest"
                )
            if path:
                return 0
            what = f"{namespace}/{checkpoint_id}/{name}"
            held = install_copy(self.catalog, namespace, checkpoint_id, f, pieces, what=what)
            return f.size if held is not None else 0

    def take_offer(
        self,
        node: str,
        namespace: str,
        checkpoint_id: str,
        name: str,
        checksums: BlockChecksums | None = None,
    ) -> int:
        """Take the copy `node` offers (OfferFile): fetch it from `node` as a restore
        fetches (its bulk stream when it grants one, else FetchFile) into `receive`,
        verified block by block as it lands; returns bytes taken (0: already held).
        While `node` answers busy (its bulk sends all taken: restores, other offers),
        asked again for up to BUSY_PATIENCE seconds, as a restore does. A copy is
        background work at both ends (`ops/priority.py`): received on a thread of its own
        at background priority (this is a gRPC handler's thread), sent by `node` at
        background priority (the grant says so)."""
        return at_background_priority(
            lambda: self._take_offer(node, namespace, checkpoint_id, name, checksums),
            "tierckptd-offer-take",
        )

    def _take_offer(
        self,
        node: str,
        namespace: str,
        checkpoint_id: str,
        name: str,
        checksums: BlockChecksums | None,
    ) -> int:
        f = self.catalog.file_view(namespace, checkpoint_id, name)[0]
        source = PeerSource(self.client, node, background=True)
        # A save that starts here mid-file goes first (as the holder's send does for its
        # own saves): each pause at most half the stall window, so the sender's send
        # does not time out, SAVE_YIELD_MAX seconds in all.
        aside = StepAside(self.catalog.saving, stop=self._stop)

        def pieces() -> Iterable[tuple[int, BytesLike]]:
            for piece in source.chunks(namespace, checkpoint_id, f):
                fault("peer.receive.offered")
                aside.wait(self.client.fetch_stall / 2)
                yield piece

        give_up = time.monotonic() + BUSY_PATIENCE
        while True:
            try:
                return self.receive(namespace, checkpoint_id, name, pieces(), checksums)
            except SourceUnavailable as e:
                if isinstance(e, SourceBusy) and time.monotonic() < give_up:
                    time.sleep(random.uniform(*BUSY_PAUSE))
                    continue
                # The offerer could not be fetched from (cut, frozen, busy too long): an
                # answer it can act on (UNAVAILABLE), never an internal error.
                raise TierUnavailable(
                    f"node {self.node_id} could not fetch the copy of "
                    f"{namespace}/{checkpoint_id}/{name} it was offered: {e}"
                ) from None

    def holdings(self, namespace: str, checkpoint_id: str) -> tuple[State | None, list[FileRecord]]:
        """A peer's Holdings: the checkpoint's state here (DURABLE once it is: a healer
        that has not learnt it must not call it lost) and the files held here."""
        state, files = self.serving.holdings(namespace, checkpoint_id)
        if state is State.COMMITTED and self.catalog.durability.is_durable(
            namespace, checkpoint_id
        ):
            state = State.DURABLE
        return state, files

    def state_of(self, namespace: str, checkpoint_id: str) -> State | None:
        """This node's state of a checkpoint (None: unknown here)."""
        return self.serving.holdings(namespace, checkpoint_id)[0]

    def file_record(self, namespace: str, checkpoint_id: str, name: str) -> FileRecord:
        """A committed file's record here (NOT_FOUND when unknown)."""
        return self.catalog.file_view(namespace, checkpoint_id, name)[0]

    def set_replicas(self, namespace: str, checkpoint_id: str, name: str, nodes: list[str]) -> None:
        """A peer's UpdateReplicas, once the servicer checked the caller may say so. A
        list naming a holder its copy may not be on is confirmed by a heal first
        (`Healer.doubt`)."""
        self.catalog.set_replicas(namespace, checkpoint_id, name, nodes)
        if self.healer.doubt(namespace, checkpoint_id, fresh=True):
            self.jobs.put(Heal(namespace, checkpoint_id), priority=URGENT)

    def manifests(self, namespace: str, started: str = "") -> list[CheckpointView]:
        """A peer's ListManifests: the committed checkpoints (of `namespace`, or all).
        `started`: the asking node has just started (restarted, or a replacement that
        came back empty): every checkpoint it owned or held copies of is healed at once,
        so a copy lost with its memory is re-made, or the checkpoint listed LOST, within
        seconds (not at the next heal round). Queued, deduplicated. Until that heal finds
        the copies again, such a checkpoint is listed under-replicated here, never
        REPLICATED on the restarted node's name alone (`Healer.suspect`)."""
        views = self.catalog.list_checkpoints(namespace)
        if started:
            self.healer.restarted(started)
        for v in views if started else ():
            if any(f.owner_node == started or started in f.replica_nodes for f in v.files):
                if v.state in (State.COMMITTED, State.REPLICATED):
                    self.healer.suspect(v.namespace, v.checkpoint_id)
                self.jobs.put(Heal(v.namespace, v.checkpoint_id))
        return views

    def namespace_owner(self, namespace: str) -> tuple[int, str] | None:
        """The uid owning `namespace` here and the node of its claim (uid isolation)."""
        return self.catalog.events.owner_of(namespace)

    def stated_writers(self, namespace: str = "") -> dict[str, tuple[set[str], bool]]:
        """What this node states to peers as the writers of each namespace."""
        return self.catalog.writers.stated_writers(namespace)

    def serve(
        self, namespace: str, checkpoint_id: str, name: str, offset: int = 0, length: int = 0
    ) -> Served:
        return self.serving.serve(namespace, checkpoint_id, name, offset, length)

    # ---- corruption -------------------------------------------------------------------
    def corrupt(
        self, namespace: str, checkpoint_id: str, name: str, reason: str, where: str
    ) -> None:
        """A local copy failed verification: never serve it, count it, replace it."""
        metrics.CORRUPT_COPIES.labels(where=where).inc()
        dropped = self.catalog.drop_local_copy(namespace, checkpoint_id, name)
        logger.error(
            "corrupt copy of %s/%s/%s on node %s (%s): %s; fetching a verified copy",
            namespace,
            checkpoint_id,
            name,
            self.node_id,
            where,
            reason,
        )
        if dropped and where != "local":
            self.jobs.put(Repair(namespace, checkpoint_id, name))
