"""Cluster-wide rm, pin and unpin: applied here, journaled, delivered to every peer.

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

Every mark is applied idempotently: the newest stamp of each kind wins (`marks`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierckpt.errors import (
    TIER_UNAVAILABLE_PREFIX,
    CheckpointNotFound,
    TierckptError,
    TierUnavailable,
)
from tierckpt.names import check_checkpoint_id, check_namespace

from tierckptd.catalog import Catalog
from tierckptd.jobs import JobQueue, backoff
from tierckptd.model import CheckpointRecord, CheckpointView, Key, State
from tierckptd.peers.client import PeerCallError, PeerClient
from tierckptd.peers.marks import Mark, MarkJournal, MarkKind

__all__ = ["ClusterOps", "SendMarks", "Unstore", "Unstorer"]

logger = logging.getLogger(__name__)

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


Job = SendMarks | Unstore


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
    ) -> None:
        self.catalog = catalog
        self.client = client
        self.node_id = catalog.node_id
        self.members = members
        self.manifest_from = manifest_from
        self.journal = journal if journal is not None else MarkJournal(catalog.tier.root)
        self._wall = wall_clock
        self.unstore: Unstorer | None = None  # main.py, when a persistent tier exists
        self.jobs: JobQueue[Job] = JobQueue(self._run, name="tierckptd-marks")
        self._tries: dict[Job, int] = {}
        self._recent: dict[Key, str] = {}  # persistent URL of checkpoints rm deleted here
        self._recent_lock = threading.Lock()  # taken under the catalog lock (`_raced`)
        catalog.pin_marks = self.journal.pins
        catalog.on_gone_durable = self._raced
        client.on_marks = self.learn

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
    def remove(self, namespace: str, checkpoint_id: str) -> int:
        """`tierckpt rm`: delete the checkpoint from every node and the persistent tier;
        returns the bytes freed here. A save still writing here (never committed) is
        only collected here.

        Raises:
            CheckpointNotFound: no tier knows it (or an earlier rm removed it all).
            TierUnavailable: removed from memory everywhere, but the persistent tier did
                not answer: its delete is retried in the background (rm again to check).
        """
        key = (check_namespace(namespace), check_checkpoint_id(checkpoint_id))
        state, _ = self.catalog.holdings(*key)
        if state is State.WRITING:
            return self.catalog.delete(*key)
        known = self._known_here(*key)
        earlier = self.journal.deleted(*key)
        if not known:
            return self._remove_again(key, earlier)
        mark = self._stamp(key, MarkKind.DELETED, earlier)
        self.journal.merge(mark)
        removed = self.catalog.remove_marked(namespace, checkpoint_id, mark.stamp)
        freed, url = removed if removed is not None else (0, self.catalog.persistent_url(namespace))
        self._remember(key, url)
        failure = self._unstore_now(key, url)[1] if self.unstore is not None else None
        self._send(mark)
        if failure is not None:
            raise failure
        return freed

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
            self._send(earlier)  # a peer may still lack it
            url = self.journal.owed().get(key, self.catalog.persistent_url(namespace))
            if self.unstore is not None:
                found, failure = self._unstore_now(key, url)
                if failure is not None:
                    raise failure
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

    def pin(self, namespace: str, checkpoint_id: str, pinned: bool) -> CheckpointView:
        """`tierckpt pin` / `unpin` on every node: memory retention everywhere and the
        persistent tier's retention obey it. CheckpointNotFound if no tier knows it."""
        key = (check_namespace(namespace), check_checkpoint_id(checkpoint_id))
        if not self._known_here(*key):
            raise self._not_found(key)
        kind = MarkKind.PINNED if pinned else MarkKind.UNPINNED
        mark = self._stamp(key, kind, None)
        self.journal.merge(mark)
        view = self.catalog.apply_pin(namespace, checkpoint_id, pinned)
        if view is None:  # deleted meanwhile
            raise self._not_found(key)
        self._send(mark)
        return view

    def _stamp(self, key: Key, kind: MarkKind, earlier: Mark | None) -> Mark:
        """A new mark, stamped after every mark of the checkpoint this node knows."""
        after = [m.stamp for m in self.journal.marks(key[0]) if m.key == key]
        if earlier is not None:
            after.append(earlier.stamp)
        stamp = max([self._wall(), *(s + 1e-3 for s in after)])
        return Mark(key[0], key[1], kind, stamp, self.node_id)

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
    def _unstore_now(self, key: Key, url: str) -> tuple[bool, TierUnavailable | None]:
        """Delete from the persistent tier now: (whether it was there, None), or on a
        failure owe it (retried) and return (False, the error to raise once the peers
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
            return False, TierUnavailable(
                f"{TIER_UNAVAILABLE_PREFIX}{key[0]}/{key[1]} is removed from the memory tier "
                f"of every node, but not yet from the persistent tier ({cause[:300]}); this "
                "node retries in the background: run `tierckpt rm` again to check"
            )
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
        """A peer's mark (ApplyMark, the caller authorized): journal and apply it if it
        is newer than what this node knows; True when it was."""
        if not self.journal.merge(mark):
            return False
        logger.info("cluster mark: %s", mark)
        self._apply(mark)
        return True

    def learn(self, node: str, marks: list[Mark]) -> None:
        """Marks in `node`'s ListManifests answer: taken from configured members only."""
        members = self.members()
        strangers = 0
        for mark in marks:
            if mark.origin not in members:
                strangers += 1
                continue
            self.receive(mark)
        if strangers:
            logger.warning("ignored %d mark(s) from %s made by non-members", strangers, node)

    def _apply(self, mark: Mark) -> None:
        try:
            if mark.kind is MarkKind.DELETED:
                removed = self.catalog.remove_marked(*mark.key, mark.stamp)
                if removed is not None:
                    self._remember(mark.key, removed[1])
            else:
                self.catalog.apply_pin(*mark.key, mark.kind is MarkKind.PINNED)
        except (TierckptError, OSError) as e:
            # Kept in the journal: re-applied at the next start.
            logger.error("cannot apply the cluster mark %s here: %.300s", mark, e)

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
    def _send(self, mark: Mark) -> None:
        """ApplyMark on every peer; a failed one is retried in the background."""

        def failed(node: str, e: PeerCallError) -> None:
            if e.code in _FINAL:
                logger.warning("peer %s refuses the mark %s: %s", node, mark, e)
                return
            logger.info("peer %s missed the mark %s (%s); retrying", node, mark, e.code)
            self.jobs.put(SendMarks(node, *mark.key), RETRY_FIRST)

        self.client.each(lambda node: self.client.apply_mark(node, mark), on_error=failed)

    def _run(self, job: Job) -> float | None:
        try:
            if isinstance(job, SendMarks):
                self._resend(job)
            else:
                self._unstore_owed(job)
        except (TierckptError, OSError) as e:
            tries = self._tries.get(job, 0) + 1
            final = isinstance(e, PeerCallError) and e.code in _FINAL
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
        self.journal.owe(key, None)
        logger.info("deleted %s/%s from the persistent tier (cluster rm)", *key)
