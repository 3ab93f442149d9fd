"""Cluster-wide rm, pin, unpin and trust (verified, bad): applied here, journaled,
delivered to every peer.

The node a user asks (the origin) makes the checkpoint known here if only a peer has it
(its manifest, adopted), stamps a `marks.Mark`, keeps it in the journal (persisted
before anything else changes), applies it, then calls ApplyMark on every peer. A peer
that does not answer is retried with backoff on this node's job queue; one that was down
longer learns the mark when it pulls its peers' manifests on return (marks travel in
every ListManifests answer, and are applied before any manifest of that answer, so a
deleted checkpoint is never adopted back).

rm also deletes the checkpoint from the persistent tier it drained to (`.metadata`
first: no reader or discovery sees a half-deleted checkpoint as durable). The origin
does it before answering; one it could not do is owed (kept in the journal) and retried.
Any node whose drain makes a deleted checkpoint durable after the rm (the drain raced
it) deletes it again (`Catalog.on_gone_durable`).

A trust mark (verified, bad) is also written by the origin beside the checkpoint in the
persistent tier once it is durable there (`persistent.trust_marker`; the drain writes one
made before it), and one found there when a checkpoint is adopted from the bucket is taken
into the journal: a cluster that lost every node still knows it.

Every mark is applied idempotently: the newest stamp of each kind wins (`marks`).

Who may mark what. A mark is a statement of the node a user asked, and a checkpoint's
marks are taken only from the nodes of its job: its coordinator and the nodes whose ranks
wrote (own) one of its files, per this node's record of it (`authority`). A node that
only keeps a replica is not one of them: any member may list itself as a copy's holder
(UpdateReplicas, after a fetch), so holding a copy grants nothing. So:
- a user's rm/pin/unpin on a node that is none of them is refused before anything
  changes (FAILED_PRECONDITION naming the nodes to ask: `NotAJobNode`);
- a peer's ApplyMark is applied only when the peer (its origin) is one of them, else
  PERMISSION_DENIED (a checkpoint only the persistent tier holds has no such nodes: any
  member's mark is taken, as every member can reach that bucket anyway); a checkpoint
  this node does not know is NOT_FOUND (nothing to mark; a later adoption of it goes
  through its coordinator, which no longer has it);
- a mark in a ListManifests answer is taken as the answering node's own statement when it
  is its origin; a relayed one (another origin) only after that origin, asked itself,
  states it (the mark it serves is the one applied), as relayed manifests are confirmed
  with their coordinator (`commit.py`). A node's own marks relayed back are ignored.
A stamp ahead of this node's clock tombstones the checkpoint here only up to now, so a
future stamp cannot refuse a later save of that id.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierckpt.errors import (
    TIER_UNAVAILABLE_PREFIX,
    CheckpointNotFound,
    NotAJobNode,
    PermissionDenied,
    TierckptError,
    TierUnavailable,
)
from tierckpt.names import check_checkpoint_id, check_namespace
from tierckpt.trust import Trust as TrustState
from tierckpt.trust import check_reason

from tierckptd.catalog import Catalog
from tierckptd.jobs import JobQueue, backoff
from tierckptd.model import CheckpointRecord, CheckpointView, Key, State, TrustMark
from tierckptd.ops import metrics
from tierckptd.peers.client import PeerCallError, PeerClient
from tierckptd.peers.cluster_marks import Mark, MarkJournal, MarkKind

__all__ = [
    "ClusterOps",
    "Delivery",
    "Flush",
    "SendMarks",
    "StoreTrust",
    "TrustStorer",
    "Unstore",
    "Unstorer",
]

logger = logging.getLogger(__name__)

TrustStorer = Callable[[Key, str, TrustMark], bool]
"""`persistent.trust_marker.store_trust` on this node's tiers: write a trust mark beside a
checkpoint durable at a URL ("": `[persistent] url`); False when it is not durable there.
Raises on an outage (retried). Wired by main.py."""

Unstorer = Callable[[str, str, str], bool]
"""Delete (namespace, checkpoint id) from the persistent tier at a URL ("": `[persistent]
url`), `.metadata` first; True when it was there. Raises TierUnavailable (an outage) or
PermissionDenied (a URL this node does not allow). Wired by main.py."""

ManifestFrom = Callable[[str, str, str], CheckpointRecord]
"""`Committer.manifest_from(node, namespace, checkpoint_id)` (CheckpointNotFound if not)."""

RETRY_FIRST = 1.0
RETRY_CAP = 60.0
SEND_TRIES = 40  # ~30 min of retries; a peer down longer learns the mark on its return
RESEND_WINDOW = 3600.0  # at start, this node's marks this recent are sent again
MAX_RECENT = 4096  # URLs of checkpoints deleted here, for a drain that raced the rm
_FINAL = {"PERMISSION_DENIED", "INVALID_ARGUMENT", "UNIMPLEMENTED", "NOT_A_PEER"}
_NOTHING_THERE = "NOT_FOUND"  # the peer does not know the checkpoint: nothing to mark there


@dataclass(frozen=True)
class SendMarks:
    """Tell one peer the marks of one checkpoint (a retry of an ApplyMark)."""

    node: str
    namespace: str
    checkpoint_id: str


@dataclass(frozen=True)
class Unstore:
    """Delete one checkpoint from the persistent tier (an owed or a repeated delete)."""

    namespace: str
    checkpoint_id: str


@dataclass(frozen=True)
class Flush:
    """Write the mark journal again after a write failed (a full tmpfs)."""


@dataclass(frozen=True)
class StoreTrust:
    """Write a checkpoint's trust mark beside it in the persistent tier."""

    namespace: str
    checkpoint_id: str


Job = SendMarks | Unstore | Flush | StoreTrust


@dataclass(frozen=True)
class Delivery:
    """What the peers did with a mark this node made: `applied` took it (or had nothing
    of the checkpoint), `pending` did not answer (retried in the background, or learnt
    when they next pull this node's manifests), `refused` said no (not retried)."""

    applied: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()

    def summary(self) -> str:
        """Like "N applied, pending: a, b", for messages."""
        text = f"{len(self.applied)} applied"
        if self.pending:
            text += f", pending: {', '.join(self.pending[:16])}"
        if self.refused:
            text += f", refused by: {', '.join(self.refused[:16])}"
        return text


class ClusterOps:
    """rm / pin / unpin of one node, origin and receiver (see the module docstring).

    Args:
        members: the cluster's node ids (a mark from anyone else is refused).
        manifest_from: asks a peer for its manifest of a checkpoint.
        journal: the mark journal (default: under the memory tier's directory).
    """

    def __init__(
        self,
        catalog: Catalog,
        client: PeerClient,
        *,
        members: Callable[[], set[str]],
        manifest_from: ManifestFrom,
        journal: MarkJournal | None = None,
        wall_clock: Callable[[], float] = time.time,
        unstore: Unstorer | None = None,
        check_mark: Callable[[Mark], None] | None = None,
        store_trust: TrustStorer | None = None,
    ) -> None:
        self.catalog = catalog
        self.client = client
        self.node_id = catalog.node_id
        self.members = members
        self.manifest_from = manifest_from
        self.journal = journal if journal is not None else MarkJournal(catalog.tier.root)
        self._wall = wall_clock
        self.unstore = unstore  # main.py, when a persistent tier exists
        self.store_trust = store_trust  # main.py, likewise
        # uid isolation (`LocalAccess.check_mark`, wired by main.py): a peer's mark made
        # for a uid applies only to that uid's checkpoints (PermissionDenied).
        self.check_mark = check_mark
        self.jobs: JobQueue[Job] = JobQueue(self._run, name="tierckptd-marks")
        self._tries: dict[Job, int] = {}
        self._recent: dict[Key, str] = {}  # persistent URL of checkpoints rm deleted here
        self._recent_lock = threading.Lock()  # taken under the catalog lock (`_raced`)
        catalog.events.pin_marks.answer_with(self.journal.pins)
        catalog.events.trust_marks.answer_with(self.journal.trust_states)
        catalog.events.trust_found.add(self._trust_found)
        catalog.events.gone_durable.add(self._raced)
        client.marks_learnt.add(self.learn)

    # ---- life cycle -------------------------------------------------------------------
    def replay(self) -> None:
        """At start: re-apply the journal to the adopted checkpoints (a mark learnt just
        before a crash, a checkpoint deleted while this node was down), queue the
        persistent deletes still owed, and send this node's recent marks again (the
        retries of a daemon that stopped are gone; a peer ignores what it knows)."""
        recent = self._wall() - RESEND_WINDOW
        for mark in self.journal.marks():
            self._apply(mark)
            if mark.origin == self.node_id and mark.stamp >= recent:
                for node in self.client.peer_ids:
                    self.jobs.put(SendMarks(node, *mark.key))
        for namespace, checkpoint_id in self.journal.owed():
            self.jobs.put(Unstore(namespace, checkpoint_id))

    def start(self) -> None:
        self.jobs.start()

    def stop(self) -> None:
        self.jobs.stop()

    # ---- the origin ---------------------------------------------------------------------
    def remove(
        self, namespace: str, checkpoint_id: str, uid: int | None = None
    ) -> tuple[int, Delivery]:
        """`tierckpt rm`: delete the checkpoint here, from the persistent tier and, by
        its mark, from every peer; returns the bytes freed here and what the peers did.
        A save still writing here (never committed) is only collected here.

        Raises:
            CheckpointNotFound: no tier knows it (or an earlier rm removed it all).
            NotAJobNode: this node is not a node of its job (nothing changed).
            TierUnavailable: removed here and the peers notified, but the persistent tier
                did not answer: its delete is retried in the background (rm again to check).
        """
        key = (check_namespace(namespace), check_checkpoint_id(checkpoint_id))
        state, _ = self.catalog.holdings(*key)
        if state is State.WRITING:
            return self.catalog.delete(*key), Delivery()
        known = self._known_here(*key)
        earlier = self.journal.deleted(*key)
        if not known:
            return self._remove_again(key, earlier), Delivery()
        self._check_origin(key, "rm")
        mark = self._stamp(key, MarkKind.DELETED, earlier, uid)  # uid: isolation's tenant
        self.journal.merge(mark)
        removed = self.catalog.remove_marked(namespace, checkpoint_id, mark.stamp)
        freed, url = removed if removed is not None else (0, self.catalog.persistent_url(namespace))
        self._remember(key, url)
        cause = self._unstore_now(key, url)[1] if self.unstore is not None else None
        delivery = self._send(mark)
        if cause is not None:
            raise TierUnavailable(
                f"{TIER_UNAVAILABLE_PREFIX}{namespace}/{checkpoint_id} is removed here; "
                f"peers notified ({delivery.summary()}); but not yet from the persistent "
                f"tier ({cause[:300]}): node {self.node_id} retries that in the background; "
                "run `tierckpt rm` again to check"
            )
        return freed, delivery

    def retired(self, namespace: str, checkpoint_id: str) -> None:
        """Persistent retention deleted the checkpoint (this node committed it and
        applied the policy): a DELETED mark takes it off every node's memory tier and
        listing, as `rm` does, without deleting from the persistent tier again."""
        key = (namespace, checkpoint_id)
        mark = self._stamp(key, MarkKind.DELETED, self.journal.deleted(*key))
        self.journal.merge(mark)
        self.catalog.remove_marked(namespace, checkpoint_id, mark.stamp)
        self._send(mark)

    def _remove_again(self, key: Key, earlier: Mark | None) -> int:
        """rm of a checkpoint no node lists: an earlier rm's persistent delete may still
        be owed (or another copy sits there); else NOT_FOUND."""
        namespace, checkpoint_id = key
        if earlier is not None:
            delivery = self._send(earlier)  # a peer may still lack it
            url = self.journal.owed().get(key, self.catalog.persistent_url(namespace))
            if self.unstore is not None:
                found, cause = self._unstore_now(key, url)
                if cause is not None:
                    raise TierUnavailable(
                        f"{TIER_UNAVAILABLE_PREFIX}{namespace}/{checkpoint_id} was removed "
                        f"here by an earlier rm; peers notified ({delivery.summary()}); but "
                        f"not yet from the persistent tier ({cause[:300]}): node "
                        f"{self.node_id} retries that in the background"
                    )
                if found:
                    return 0
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(earlier.stamp))
            raise CheckpointNotFound(
                f"checkpoint {namespace}/{checkpoint_id} was removed from every tier by "
                f"`tierckpt rm` on node {earlier.origin} at {when}; nothing is left of it"
            )
        raise self._not_found(key)

    def _not_found(self, key: Key) -> CheckpointNotFound:
        peers = ", ".join(self.client.peer_ids[:8]) or "none"
        return CheckpointNotFound(
            f"checkpoint {key[0]}/{key[1]} not found on node {self.node_id}, its peers "
            f"({peers}) or the persistent tier; `tierckpt ls {key[0]}` lists what there is"
        )

    def pin(
        self, namespace: str, checkpoint_id: str, pinned: bool, uid: int | None = None
    ) -> tuple[CheckpointView, Delivery]:
        """`tierckpt pin` / `unpin` on every node: memory retention everywhere and the
        persistent tier's retention obey it; returns the view here and what the peers
        did. CheckpointNotFound if no tier knows it; NotAJobNode on a node that is not a
        node of its job."""
        key = (check_namespace(namespace), check_checkpoint_id(checkpoint_id))
        if not self._known_here(*key):
            raise self._not_found(key)
        self._check_origin(key, "pin" if pinned else "unpin")
        kind = MarkKind.PINNED if pinned else MarkKind.UNPINNED
        mark = self._stamp(key, kind, None, uid)
        self.journal.merge(mark)
        view = self.catalog.apply_pin(namespace, checkpoint_id, pinned)
        if view is None:  # deleted meanwhile
            raise self._not_found(key)
        return view, self._send(mark)

    def trust(
        self,
        namespace: str,
        checkpoint_id: str,
        trust: TrustState,
        reason: str = "",
        uid: int | None = None,
    ) -> tuple[CheckpointView, Delivery]:
        """`tierckpt mark NS ID verified|bad` on every node (the newest trust mark wins):
        a BAD checkpoint is never the newest anywhere, the newest VERIFIED one of the
        namespace is held by every retention. Returns the view here and what the peers
        did; CheckpointNotFound / NotAJobNode as `pin`."""
        key = (check_namespace(namespace), check_checkpoint_id(checkpoint_id))
        reason = check_reason(reason)
        if not self._known_here(*key):
            raise self._not_found(key)
        self._check_origin(key, "mark")
        kind = MarkKind(trust.value)
        mark = dataclasses.replace(self._stamp(key, kind, None, uid), reason=reason)
        self.journal.merge(mark)
        metrics.TRUST_MARKS.labels(trust=trust.value).inc()
        logger.info("cluster mark: %s%s", mark, f" ({reason})" if reason else "")
        self.catalog.trust_changed(namespace)
        if self.store_trust is not None:
            self.jobs.put(StoreTrust(*key))
        try:
            view = self.catalog.get(*key)
        except CheckpointNotFound:  # deleted meanwhile
            raise self._not_found(key) from None
        return view, self._send(mark)

    def _trust_found(self, namespace: str, checkpoint_id: str, found: TrustMark) -> None:
        """`CatalogEvents.trust_found`: a trust mark stored in the persistent tier beside a
        checkpoint adopted from there (after a loss of the cluster that marked it)."""
        kind = MarkKind(found.trust.value)
        mark = Mark(namespace, checkpoint_id, kind, found.stamp, found.origin, reason=found.reason)
        try:
            if self.journal.merge(mark, keep_unsaved=True):
                logger.info("cluster mark from the persistent tier: %s", mark)
                self.catalog.trust_changed(namespace)
            if self.journal.unsaved:
                self.jobs.put(Flush(), RETRY_FIRST)
        except (TierckptError, OSError) as e:
            logger.error("cannot take the stored trust mark %s: %.300s", mark, e)

    def _store_trust(self, job: StoreTrust) -> float | None:
        """Write the checkpoint's newest trust mark beside it in the persistent tier; a
        checkpoint still due to drain is retried (its drain may have read the marks
        before this one)."""
        assert self.store_trust is not None
        key = (job.namespace, job.checkpoint_id)
        mark = self.journal.trust_states(job.namespace).get(job.checkpoint_id)
        if mark is None or not self.catalog.knows(*key):
            return None
        if self.store_trust(key, self.catalog.persistent_url(*key), mark):
            return None
        tries = self._tries.get(job, 0) + 1
        if key in self.catalog.due_not_durable() and tries < SEND_TRIES:
            self._tries[job] = tries
            return RETRY_CAP  # the drain has not finished: look again
        self._tries.pop(job, None)
        return None

    # ---- who may mark a checkpoint --------------------------------------------------------
    def authority(self, namespace: str, checkpoint_id: str) -> set[str] | None:
        """The nodes whose marks on the checkpoint this node takes (the nodes of its
        job): the owners of its files, the coordinator (owner of `.metadata`) among them,
        per this node's record; never a node that only keeps a replica. None when this
        node has no committed record of it; empty for a checkpoint no node is recorded
        for (found only in the persistent tier, written by another cluster)."""
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return None
        nodes = {f.owner_node for f in view.files}
        nodes.discard("")
        return nodes

    def _check_origin(self, key: Key, verb: str) -> None:
        """A user's rm/pin/unpin here: this node must be one its peers take the mark
        from (else NotAJobNode, nothing changed). A checkpoint no node's memory holds
        (persistent only: no owner recorded) may be marked from any node, and its peers
        take that mark from any member: there is no memory copy to protect, and every
        member can reach the bucket it lives in anyway."""
        nodes = self.authority(*key)
        if not nodes or self.node_id in nodes:
            return
        ask = ", ".join(sorted(nodes)[:8])
        raise NotAJobNode(
            f"not a node of the checkpoint: node {self.node_id} neither coordinates "
            f"{key[0]}/{key[1]} nor wrote a file of it (a replica is not enough), so its "
            f"peers would refuse the {verb}; run `tierckpt {verb} {key[0]} {key[1]}` on a "
            f"node of its job: {ask}"
        )

    def _refusal(self, mark: Mark, nodes: set[str] | None) -> TierckptError | None:
        """Why `mark` (stated by its origin) is not taken here, or None."""
        what = f"{mark.namespace}/{mark.checkpoint_id}"
        if nodes is None:
            return CheckpointNotFound(
                f"node {self.node_id} has no committed checkpoint {what}: nothing to mark "
                f"{mark.kind.value} here"
            )
        if nodes and mark.origin not in nodes:
            ask = ", ".join(sorted(nodes)[:8])
            return PermissionDenied(
                f"node {mark.origin} may not mark {what} {mark.kind.value}: only its "
                f"coordinator or a node that wrote one of its files may ({ask})"
            )
        if self.check_mark is not None:  # uid isolation: only the owner's marks
            try:
                self.check_mark(mark)
            except PermissionDenied as e:
                return e
        return None

    def _stamp(
        self, key: Key, kind: MarkKind, earlier: Mark | None, uid: int | None = None
    ) -> Mark:
        """A new mark, stamped after every mark of the checkpoint this node knows."""
        after = [m.stamp for m in self.journal.marks(key[0]) if m.key == key]
        if earlier is not None:
            after.append(earlier.stamp)
        stamp = max([self._wall(), *(s + 1e-3 for s in after)])
        return Mark(key[0], key[1], kind, stamp, self.node_id, uid)

    def _known_here(self, namespace: str, checkpoint_id: str) -> bool:
        """Whether the checkpoint is committed here, after adopting a peer's manifest of
        it when only a peer has it (a node that missed the publish)."""
        if self.catalog.holdings(namespace, checkpoint_id)[0] is State.COMMITTED:
            return True  # LOST ones too: rm and pin act on them like any other
        for node in self.client.peer_ids:
            try:
                rec = self.manifest_from(node, namespace, checkpoint_id)
            except CheckpointNotFound:
                continue
            try:
                if self.catalog.publish(rec):
                    logger.info("%s/%s: adopted %s's manifest", namespace, checkpoint_id, node)
                    return True
            except TierckptError as e:
                logger.warning(
                    "%s/%s: %s's manifest refused: %s", namespace, checkpoint_id, node, e
                )
        return False

    # ---- the persistent tier ------------------------------------------------------------
    def _unstore_now(self, key: Key, url: str) -> tuple[bool, str | None]:
        """Delete from the persistent tier now: (whether it was there, None), or on a
        failure owe it (retried) and return (False, the cause, to report once the peers
        are told)."""
        assert self.unstore is not None
        self.journal.owe(key, url)
        try:
            found = self.unstore(*key, url)
        except (TierckptError, OSError) as e:
            self.jobs.put(Unstore(*key), RETRY_FIRST)
            cause = str(e)
            if cause.startswith(TIER_UNAVAILABLE_PREFIX):
                cause = cause[len(TIER_UNAVAILABLE_PREFIX) :]
            return False, cause
        self.journal.owe(key, None)
        return found, None

    def _raced(self, namespace: str, checkpoint_id: str) -> None:
        """`Catalog.on_gone_durable` (under the catalog lock: only enqueues): a drain made
        a checkpoint durable after an rm deleted it here; delete it again."""
        with self._recent_lock:
            raced = (namespace, checkpoint_id) in self._recent
        if self.unstore is not None and raced:
            self.jobs.put(Unstore(namespace, checkpoint_id))

    # ---- receiving ------------------------------------------------------------------------
    def receive(self, mark: Mark) -> bool:
        """A peer's own mark (ApplyMark; the servicer checked the caller is its origin):
        journal and apply it if it is newer than what this node knows; True when it was.
        Raises PermissionDenied when its origin is not a node of the checkpoint's job
        here, CheckpointNotFound when this node has no record of it."""
        refusal = self._refusal(mark, self.authority(*mark.key))
        if refusal is not None:
            raise refusal
        return self._take(mark)

    def _take(self, mark: Mark) -> bool:
        """Journal (kept in memory if the journal cannot be written now, retried) and
        apply an authorized mark; True when it was new."""
        if not self.journal.merge(mark, keep_unsaved=True):
            return False
        if self.journal.unsaved:
            self.jobs.put(Flush(), RETRY_FIRST)
        logger.info("cluster mark: %s", mark)
        if mark.kind.slot == "trust":
            metrics.TRUST_MARKS.labels(trust=mark.kind.value).inc()
        self._apply(mark)
        return True

    def learn(self, node: str, marks: list[Mark]) -> None:
        """Marks in `node`'s ListManifests answer: its own ones as it states them (it is
        their origin), a relayed one only once its origin confirms it (see the module
        docstring); each only from a node of the checkpoint's job.
        Never raises (a node starts on a full tmpfs: `_take`)."""
        members = self.members()
        stated: dict[tuple[str, str], list[Mark] | None] = {}
        ignored = 0
        for mark in marks:
            if not self.journal.is_new(mark):
                continue
            if mark.origin not in members or mark.origin == self.node_id:
                ignored += 1
                continue
            if self._refusal(mark, self.authority(*mark.key)) is not None:
                ignored += 1
                continue
            if mark.origin != node:
                confirmed = self._confirm(mark, stated)
                if confirmed is None:
                    logger.warning("%s relays %s, which %s does not state", node, mark, mark.origin)
                    ignored += 1
                    continue
                mark = confirmed
            try:
                self._take(mark)
            except (TierckptError, OSError) as e:
                logger.error("cannot take the cluster mark %s: %.300s", mark, e)
        if ignored:
            logger.info("ignored %d mark(s) in %s's manifests (see the log above)", ignored, node)

    def _confirm(self, mark: Mark, stated: dict[tuple[str, str], list[Mark] | None]) -> Mark | None:
        """The mark `mark.origin` itself states for the checkpoint, of the same kind and
        at least as new as the relayed one; None when it states none or cannot be asked
        now (asked again when the mark is relayed again). `stated` caches the origins'
        answers for one listing."""
        asked = (mark.origin, mark.namespace)
        if (mark.origin, "") in stated:
            return None  # the origin did not answer in this listing: not asked again
        if asked not in stated:
            try:
                stated[asked] = self.client.marks_of(mark.origin, mark.namespace)
            except (TierckptError, OSError) as e:
                logger.info("cannot confirm %s with its origin: %.200s", mark, e)
                stated[(mark.origin, "")] = None
                return None
        for own in stated[asked] or []:
            if (
                own.key == mark.key
                and own.origin == mark.origin
                and own.kind.slot == mark.kind.slot
                and own.order() >= mark.order()
            ):
                return own
        return None

    def _apply(self, mark: Mark) -> None:
        try:
            if mark.kind is MarkKind.DELETED:
                durable = self.catalog.durability.is_durable(*mark.key)
                # A stamp ahead of this clock tombstones only up to when this node first
                # learnt it (`Mark.applied`, kept in the journal): a later save of the id
                # is never refused or removed for the origin's skew.
                stamp = min(mark.applied_stamp, self._wall())
                removed = self.catalog.remove_marked(*mark.key, stamp)
                if removed is not None:
                    self._remember(mark.key, removed[1])
                    if durable and mark.origin != self.node_id:
                        self._unstore_again(mark.key, removed[1])
            elif mark.kind.slot == "trust":
                self.catalog.trust_changed(mark.namespace)  # read from the journal
            else:
                self.catalog.apply_pin(*mark.key, mark.kind is MarkKind.PINNED)
        except (TierckptError, OSError) as e:
            # Kept in the journal: re-applied at the next start.
            logger.error("cannot apply the cluster mark %s here: %.300s", mark, e)

    def _unstore_again(self, key: Key, url: str) -> None:
        """A peer's rm reached a checkpoint this node knew durable: it may have drained it
        after the rm (a partition kept the mark from it), so it deletes it from the
        persistent tier too, owed in the journal until done."""
        if self.unstore is None:
            return
        self.journal.owe(key, url, keep_unsaved=True)
        if self.journal.unsaved:
            self.jobs.put(Flush(), RETRY_FIRST)
        self.jobs.put(Unstore(*key))

    def _remember(self, key: Key, url: str) -> None:
        """The persistent URL of a checkpoint an rm deleted here (`_raced`), bounded."""
        with self._recent_lock:
            self._recent[key] = url
            while len(self._recent) > MAX_RECENT:
                del self._recent[next(iter(self._recent))]

    def marks(self, namespace: str = "") -> list[Mark]:
        """What ListManifests carries: every mark this node knows (of `namespace`)."""
        return self.journal.marks(namespace)

    # ---- delivery -------------------------------------------------------------------------
    def _send(self, mark: Mark) -> Delivery:
        """ApplyMark on every peer at once; a failed one is retried in the background.
        Returns which peers applied it, are pending, or refused it."""
        pending: list[str] = []
        refused: list[str] = []

        def failed(node: str, e: PeerCallError) -> None:
            if e.code == _NOTHING_THERE:
                return
            if e.code in _FINAL:
                logger.warning("peer %s refuses the mark %s: %s", node, mark, e)
                refused.append(node)
                return
            logger.info("peer %s missed the mark %s (%s); retrying", node, mark, e.code)
            pending.append(node)
            self.jobs.put(SendMarks(node, *mark.key), RETRY_FIRST)

        self.client.each(
            lambda node: self.client.apply_mark(node, mark), on_error=failed, parallel=True
        )
        applied = [n for n in self.client.peer_ids if n not in pending and n not in refused]
        return Delivery(tuple(applied), tuple(pending), tuple(refused))

    def _run(self, job: Job) -> float | None:
        try:
            if isinstance(job, SendMarks):
                self._resend(job)
            elif isinstance(job, Flush):
                self.journal.flush()
            elif isinstance(job, StoreTrust):
                return self._store_trust(job)
            else:
                self._unstore_owed(job)
        except (TierckptError, OSError) as e:
            tries = self._tries.get(job, 0) + 1
            final = isinstance(e, PeerCallError) and (e.code in _FINAL or e.code == _NOTHING_THERE)
            if final or (isinstance(job, SendMarks) and tries >= SEND_TRIES):
                logger.warning("giving up %s: %.300s", job, e)
                self._tries.pop(job, None)
                return None
            self._tries[job] = tries
            logger.info("%s failed (%d tries): %.300s", job, tries, e)
            return backoff(tries, RETRY_FIRST, RETRY_CAP)
        self._tries.pop(job, None)
        return None

    def _resend(self, job: SendMarks) -> None:
        if job.node not in self.client.peer_ids:
            return  # no longer a peer
        key = (job.namespace, job.checkpoint_id)
        for mark in self.journal.marks(job.namespace):
            if mark.key == key:
                self.client.apply_mark(job.node, mark)

    def _unstore_owed(self, job: Unstore) -> None:
        key = (job.namespace, job.checkpoint_id)
        with self._recent_lock:
            recent = self._recent.get(key)
        url = self.journal.owed().get(key, recent)
        if url is None or self.unstore is None:
            return
        self.unstore(job.namespace, job.checkpoint_id, url)
        self.journal.owe(key, None, keep_unsaved=True)
        logger.info("deleted %s/%s from the persistent tier (cluster rm)", *key)
