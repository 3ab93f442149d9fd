"""Cluster commit and the manifests peers exchange.

No consensus: the DCP coordinator's daemon decides a commit (finding the files other
nodes hold through their holdings, asking every peer: the nodes the ranks wrote to, the
writer's hint, are only put first; two nodes claiming one file with different bytes
refuse the commit, audit 3 M2) and publishes the cluster
manifest to the nodes the checkpoint involves (`placement.interested`: the files'
owners and their first placement candidates). Every other node learns it by gossip:
each heal round asks a few random peers for their manifests (`gossip`). A node adopts a
manifest only from the checkpoint's coordinator (a relayed one is confirmed with it).
A replacement node that came back empty adopts the manifests its peers know at start-up.
So a commit's RPCs grow with the nodes the job spans, never with the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    MemoryBudgetExceeded,
    TierckptError,
)

from tierckptd.catalog import Catalog, Resolution
from tierckptd.catalog.views import listing
from tierckptd.memory.incoming import restore_plan
from tierckptd.model import (
    CheckpointRecord,
    CheckpointView,
    FileRecord,
    Key,
    commit_anchor,
    coordinator_of,
)
from tierckptd.ops import metrics
from tierckptd.peers.client import Holdings, Manifests, PeerCallError, PeerClient
from tierckptd.peers.placement import Member, interested

__all__ = ["ANNOUNCE_PATIENCE", "GOSSIP_FANOUT", "Committer", "claims", "quorum"]

logger = logging.getLogger(__name__)

# How long a node that started keeps telling the peers it did not reach (`announce`),
# and its first and longest pause between two tries.
ANNOUNCE_PATIENCE = 600.0
ANNOUNCE_RETRY = 1.0
ANNOUNCE_RETRY_CAP = 30.0

# Peers asked for their manifests per heal round: a new checkpoint reaches every node in
# about log2(N) rounds, at 2 RPCs per node per round whatever N is.
GOSSIP_FANOUT = 2
_DECLINED_MAX = 4096
# A gossiped manifest declined because its coordinator did not know it is asked about
# again after this long: the coordinator may have been restarting empty (it re-adopts
# its checkpoints from its peers moments later), not denying it.
DECLINE_FOR = 120.0
# At start, a manifest a peer relays whose coordinator did not confirm it (the
# coordinator may be starting at the same time: a rack that comes back together) is
# asked about again after these pauses, before gossip's rounds take over.
CONFIRM_RETRIES = (1.0, 2.0, 4.0, 8.0, 16.0)


def claims(
    namespace: str,
    checkpoint_id: str,
    holdings: dict[str, Holdings],
    missing: set[str],
    *,
    replacing: bool = False,
) -> dict[str, FileRecord]:
    """The files of `missing` that peers hold, from their holdings (in node order).

    A node claims the files it answers (their owner is the node that answered, whatever
    it says), except a copy it names another answering node as the owner of that this
    owner answers too: the owner's word on its own file prevails over a replica of it (a
    replica of the generation a re-save replaces is other bytes under the same name). A
    node whose answer did not validate claims nothing; two nodes claiming one file with
    different bytes refuse the commit: nothing is "first wins" (audit H3). `replacing`
    (the commit of a re-save: this node holds the id committed): a copy naming another
    owner is never a claim, even when that owner did not answer: it may be the replaced
    generation's bytes, and a checkpoint mixing generations would load wrong tensors."""
    remote: dict[str, FileRecord] = {}
    # (node, file) for each file a node answers as its own (no owner, or itself).
    owned = {
        (node, f.name)
        for node, held in holdings.items()
        for f in held.files or ()
        if f.owner_node in ("", node)
    }
    for node, held in holdings.items():
        if held.files is None:
            metrics.PEER_REFUSED.labels(reason="invalid").inc()
            logger.warning(
                "commit %s/%s: %s's holdings are refused: %s",
                namespace,
                checkpoint_id,
                node,
                held.refused,
            )
            continue
        for f in held.files:
            if f.name not in missing:
                continue
            if f.owner_node not in ("", node) and (replacing or (f.owner_node, f.name) in owned):
                continue  # a replica of a file its owner answers: the owner's is the claim
            f.owner_node, f.replica_nodes = node, []
            other = remote.get(f.name)
            if other is None:
                remote[f.name] = f
            elif (other.size, other.checksums) != (f.size, f.checksums):
                metrics.PEER_REFUSED.labels(reason="conflict").inc()
                raise CheckpointIncomplete(
                    f"cannot commit {namespace}/{checkpoint_id}: nodes {other.owner_node} and "
                    f"{node} both hold {f.name} with different contents ({other.size} and "
                    f"{f.size} bytes); a rank wrote it twice, or a node is misbehaving: "
                    "save under a new checkpoint_id"
                )
    return remote


def quorum(stated: dict[str, frozenset[str]]) -> set[str]:
    """The writers of a namespace its peers agree on (audit 3 H2), from what each peer
    states as its own binding (node -> the coordinators it has PROVEN; peers stating
    none do not vote): a writer named by more than half of the stating peers, each
    counted once, and by at least one peer other than itself, unless it is the only peer
    stating any writer (a job coordinated by one node: a replacement of its other node
    must still find the newest; a second stating peer that disagrees, a hostile one
    included, leaves no majority, so no newest rather than a chosen one). Empty when no
    writer has such a majority."""
    need = len(stated) // 2 + 1
    votes: dict[str, int] = {}
    others: dict[str, int] = {}
    for node, writers in stated.items():
        for writer in writers:
            votes[writer] = votes.get(writer, 0) + 1
            if writer != node:
                others[writer] = others.get(writer, 0) + 1
    alone = len(stated) == 1
    return {w for w, n in votes.items() if n >= need and (alone or others.get(w, 0) >= 1)}


def _content(rec: CheckpointRecord) -> dict[str, tuple[int, object]]:
    """What a manifest says a checkpoint holds: each file's size and checksums."""
    return {f.name: (f.size, f.checksums) for f in rec.files.values()}


class Committer:
    """The coordinator's commit, publishes received, and manifests pulled from peers.

    Args:
        heal: queues a heal of a checkpoint (replication after a commit or a publish).
        heal_full: queues a heal of every file, asking every peer (a peer lists it LOST).
        members, replica_target: the membership placement uses (who a commit involves).
    """

    def __init__(
        self,
        catalog: Catalog,
        client: PeerClient,
        heal: Callable[[str, str], None],
        *,
        heal_full: Callable[[str, str], None],
        members: Callable[[], list[Member]],
        replica_target: Callable[[], int],
        merged: Callable[[str, str, set[str]], None] = lambda namespace, checkpoint_id, before: (
            None
        ),
    ) -> None:
        self.catalog = catalog
        self.client = client
        self.node_id = catalog.node_id
        self._heal = heal
        self._heal_full = heal_full
        self._merged = merged  # a known record merged with a peer's: (key, names before)
        self._members = members
        self._k = replica_target
        # gossiped manifests this node refused -> until when (monotonic)
        self._declined: dict[Key, float] = {}

    def interested(self, view: CheckpointView) -> list[str]:
        """The peers a commit of `view` publishes to (see the module docstring)."""
        near = interested(
            view.namespace, view.checkpoint_id, view.files, self._members(), self._k()
        )
        return [n for n in self.client.peer_ids if n in near]

    def remote_files(
        self, namespace: str, checkpoint_id: str, missing: set[str], hinted: Sequence[str]
    ) -> dict[str, FileRecord]:
        """The commit coordinator's question (`tierckptd.commit.Holders`): the files of
        `missing` that peers hold. `hinted`: the nodes the ranks wrote to (the writer's
        hint, unverified): only an ordering. Every peer is asked (in parallel) and every
        claim checked against the others: a hinted node that lies about a file another
        node holds refuses the commit rather than steering it (audit 3, M2)."""
        peers = self.client.peer_ids
        if not peers:
            return {}

        silent: dict[str, str] = {}  # the peers that did not answer, and their codes

        def unanswered(node: str, e: PeerCallError) -> None:
            silent[node] = e.code
            logger.warning(
                "commit %s/%s: no holdings from %s: %s", namespace, checkpoint_id, node, e.code
            )

        hinted = [n for n in dict.fromkeys(hinted) if n in peers]
        nodes = [*hinted, *(n for n in peers if n not in hinted)]
        asked = len(nodes)

        def holdings(node: str) -> Holdings:
            return self.client.holdings(node, namespace, checkpoint_id)

        held = self.client.each(holdings, nodes=nodes, on_error=unanswered, parallel=True)
        ordered = {node: held[node] for node in nodes if node in held}
        replacing = (namespace, checkpoint_id) in set(self.catalog.committed_keys())
        remote = claims(namespace, checkpoint_id, ordered, missing, replacing=replacing)
        unasked = [n for n in nodes if n not in held]
        if missing - remote.keys() and unasked:
            # A file is still missing: ask the peers the first round skipped or lost
            # too (one backing off after a restart may hold it), rather than fail
            # the save; this costs a deadline only when the commit would fail anyway.
            held.update(
                self.client.each(
                    holdings,
                    nodes=unasked,
                    on_error=unanswered,
                    parallel=True,
                    backed_off=True,
                )
            )
            ordered = {node: held[node] for node in nodes if node in held}
            remote = dict(claims(namespace, checkpoint_id, ordered, missing, replacing=replacing))
        unreachable = sorted(n for n in silent if n not in held)
        if missing - remote.keys() and unreachable:
            # The save fails either way (`Catalog.commit`); say which nodes it could not
            # reach: a partitioned writer's node is the likely holder of what is missing.
            raise CheckpointIncomplete(
                f"cannot commit {namespace}/{checkpoint_id}: missing files: "
                f"{listing(sorted(missing - remote.keys()))}; peers not reachable: "
                + ", ".join(f"{n} ({silent[n]})" for n in unreachable[:8])
                + ": the files may be there; retry once they answer"
            )
        logger.info(
            "commit %s/%s: asked %d of %d peers for their files (%d hinted by the writer)",
            namespace,
            checkpoint_id,
            asked,
            len(peers),
            len(hinted),
        )
        return remote

    def committed(self, view: CheckpointView) -> None:
        """A commit coordinated here (`tierckptd.commit.CommitListener`): publish the
        manifest to the peers it involves, then replicate."""
        if not self.client.peer_ids:
            return
        namespace, checkpoint_id = view.namespace, view.checkpoint_id

        def unpublished(node: str, e: PeerCallError) -> None:
            logger.warning(
                "commit %s/%s: cannot publish to %s (%s); it adopts the manifest "
                "by gossip, when it restarts or when a healer pushes to it",
                namespace,
                checkpoint_id,
                node,
                e.code,
            )

        self.client.each(
            lambda node: self.client.publish(node, view),
            nodes=self.interested(view),
            on_error=unpublished,
            parallel=True,
        )
        self._heal(namespace, checkpoint_id)

    def published(self, rec: CheckpointRecord) -> bool:
        """PeerService.PublishCheckpoint (the caller authorized): adopt, then replicate
        the files we own."""
        if not self.catalog.publish(rec):
            return False
        self._heal(rec.namespace, rec.checkpoint_id)
        return True

    def manifest_from(self, node: str, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        """The manifest `node` keeps of a checkpoint, validated (a publish by a node that
        does not coordinate the checkpoint is taken as a hint to ask its coordinator)."""
        try:
            rec = self._manifest_or_none(node, namespace, checkpoint_id)
        except PeerCallError as e:
            if e.code == "NOT_A_PEER":
                raise CheckpointNotFound(f"node {node} is not a configured peer") from None
            raise CheckpointNotFound(
                f"node {node} did not answer for {namespace}/{checkpoint_id}: {e.code}"
            ) from None
        if rec is None:
            raise CheckpointNotFound(f"node {node} does not know {namespace}/{checkpoint_id}")
        return rec

    def _manifest_or_none(
        self, node: str, namespace: str, checkpoint_id: str
    ) -> CheckpointRecord | None:
        """`node`'s manifest of a checkpoint, None when it does not know it (PeerCallError
        when it did not answer: the caller tells the two apart)."""
        got = self.client.list_manifests(node, namespace, wait_for_ready=False)
        return next((r for r in got.records if r.key == (namespace, checkpoint_id)), None)

    def pull_manifests(self) -> int:
        """At start: adopt committed checkpoints peers know and this node does not (a
        replacement node that came back empty); returns how many were new.

        This node heals the ones it adopted, and then (in the background, once the
        restore prewarm made the segments the copies pushed back land in) tells its peers
        it started (`announce`): a file lost with this node's memory is copied again, or
        its checkpoint listed LOST on every node, within seconds rather than at the next
        heal round."""
        known = set(self.catalog.committed_keys())
        adopted: list[CheckpointRecord] = []

        def unanswered(node: str, e: PeerCallError) -> None:
            logger.info("no manifests from %s: %s", node, e.code)

        # Every peer at once (the fan-out pool): one slow or dead peer's deadline no longer
        # adds to every other's, so a cluster that starts together is ready in seconds.
        bound = self.catalog.writers.bound_namespaces()  # before any peer is heard
        pulled = self.client.each(self.client.list_manifests, on_error=unanswered, parallel=True)
        stated = self._bind_namespaces(pulled, bound)
        unconfirmed: dict[Key, tuple[str, CheckpointRecord]] = {}
        for node, got in pulled.items():
            refused = list(got.refused)
            for rec in got.records:
                if not self._confirmed(node, rec, pulled, stated.get(rec.namespace, {})):
                    unconfirmed.setdefault(rec.key, (node, rec))
                    refused.append(
                        f"{rec.namespace}/{rec.checkpoint_id}: relayed by {node}, coordinated "
                        f"by {coordinator_of(rec.files) or 'no node'}, which did not confirm it"
                    )
                    continue
                try:
                    if self.catalog.publish(rec) and rec.key not in known:
                        known.add(rec.key)
                        adopted.append(rec)
                except TierckptError as e:
                    refused.append(str(e))
            if refused:
                logger.warning("a manifest from %s is refused: %s", node, refused[0][:1000])
                metrics.PEER_REFUSED.labels(reason="manifest").inc(len(refused))
                logger.warning("refused %d of %s's manifests", len(refused), node)
        if adopted:
            logger.info(
                "adopted %d checkpoints from peers' manifests (no local files)", len(adopted)
            )
            for rec in adopted:
                self._heal(rec.namespace, rec.checkpoint_id)
        later = {
            key: relayed
            for key, relayed in unconfirmed.items()
            if key not in known
            and coordinator_of(relayed[1].files) in self.client.peer_ids
            and coordinator_of(relayed[1].files) != self.node_id
        }
        if later:
            threading.Thread(
                target=self._confirm_later, args=(later,), name="tierckptd-confirm", daemon=True
            ).start()
        plan: list[tuple[int, str | None]] = []
        if self.catalog.recycle:
            plan += restore_plan(self.node_id, adopted)

        def prewarm_then_announce() -> None:
            if plan:
                self.catalog.prewarm_segments(plan, "for the files this node will restore")
            self.announce()

        if self.client.peer_ids:
            threading.Thread(
                target=prewarm_then_announce, name="tierckptd-restore-prewarm", daemon=True
            ).start()
        return len(adopted)

    def _confirm_later(
        self,
        pending: dict[Key, tuple[str, CheckpointRecord]],
        pauses: Sequence[float] = CONFIRM_RETRIES,
    ) -> int:
        """Manifests refused at start because their coordinator did not confirm them
        (`pending`: by checkpoint, the node that relayed it and its manifest): after each
        pause each is adopted as gossip adopts a relayed one (`_adopt_relayed`: as its
        coordinator confirms it), since the coordinator may have been starting empty too,
        re-adopting its checkpoints from its peers. Returns how many were adopted."""
        adopted = 0
        for pause in pauses:
            if not pending:
                break
            time.sleep(pause)
            known = set(self.catalog.committed_keys())
            for key, (node, rec) in list(pending.items()):
                if key in known:
                    del pending[key]
                elif self._adopt_relayed(node, rec):
                    del pending[key]
                    adopted += 1
        if adopted:
            logger.info("adopted %d checkpoints as their coordinators confirmed them", adopted)
        return adopted

    def _bind_namespaces(
        self, pulled: dict[str, Manifests], bound: set[str]
    ) -> dict[str, dict[str, frozenset[str]]]:
        """Every namespace the peers answered about that this node has no binding of (no
        PROVEN or VOUCHED checkpoint of it: a replacement or new node) gets the writers a
        majority of the peers state (`quorum`), before any manifest is taken, so the order
        the answers came in chooses nothing (audit 3 H2). A node that has a binding keeps
        it (`bound`: the namespaces it had writers of before any peer was asked; a
        publish that came in meanwhile does not count). Returns what each peer stated,
        by namespace."""
        stated: dict[str, dict[str, frozenset[str]]] = {}
        weak: dict[str, dict[str, frozenset[str]]] = {}
        for node, got in pulled.items():
            for namespace, writers in got.writers.items():
                if writers:
                    into = weak if namespace in got.vouched else stated
                    into.setdefault(namespace, {})[node] = writers
        for namespace, said in weak.items():  # vouched votes count where none is proven
            stated.setdefault(namespace, said)
        listed = {rec.namespace for got in pulled.values() for rec in got.records}
        for namespace in sorted((listed | set(stated)) - bound):
            said = stated.get(namespace, {})
            agreed = quorum(said)
            if not self.catalog.writers.set_cluster_writers(namespace, agreed, said):
                continue
            if agreed:
                logger.info(
                    "%s: this node took no part in it; its writers per %d of %d peers "
                    "stating one: %s",
                    namespace,
                    sum(1 for w in said.values() if w & agreed),
                    len(said),
                    ", ".join(sorted(agreed)),
                )
            else:
                logger.warning(
                    "%s: this node took no part in it and its peers agree on no writer of it "
                    "(%s): no newest from peers; load a checkpoint by its id",
                    namespace,
                    "; ".join(f"{n} says {', '.join(sorted(w))}" for n, w in sorted(said.items()))
                    or "none stated",
                )
        return stated

    def _confirmed(
        self,
        node: str,
        rec: CheckpointRecord,
        pulled: dict[str, Manifests],
        stated: dict[str, frozenset[str]],
    ) -> bool:
        """Whether a manifest `node` listed at start-up is taken: as it is when `node`
        coordinates it; a relayed one only as its coordinator confirms it (the
        coordinator's own answer is taken instead; one it does not list is refused).
        When the coordinator cannot answer (a lost node, or this node's former self: a
        replacement under the same id with no binding of the namespace yet), the peers
        that state the coordinator as a writer of the namespace (other than itself) vouch
        for it: a majority of them must list the same content, and at least one."""
        coordinator = coordinator_of(rec.files)
        if coordinator == node:
            return True
        if not coordinator or coordinator in pulled:
            return False  # no coordinator to confirm, or its own manifest is the one taken
        if coordinator == self.node_id and self.catalog.writers.proven_writers(rec.namespace):
            return False  # this node keeps its own binding: it knows what it coordinated
        witnesses = [v for v, w in stated.items() if coordinator in w and v != coordinator]
        same = sum(
            1
            for v in witnesses
            if v in pulled
            and any(r.key == rec.key and _content(r) == _content(rec) for r in pulled[v].records)
        )
        return bool(witnesses) and same >= len(witnesses) // 2 + 1

    def announce(self) -> None:
        """Tell every peer this node has started (ListManifests with `starting`): each
        heals at once the checkpoints this node owned or held copies of. Its answer (the
        manifests again) is not needed: `pull_manifests` took them.

        A peer not reached (cut off, frozen or down at that moment) is told again, after
        1 s and then twice as long each time up to 30 s, until it answers or
        ANNOUNCE_PATIENCE has passed: a peer that never hears it goes on listing what
        this node held before it came back empty as REPLICATED on its name (the network
        chaos run: a node cut off while a node of its rack was replaced)."""
        pending = list(self.client.peer_ids)
        deadline = time.monotonic() + ANNOUNCE_PATIENCE
        pause = ANNOUNCE_RETRY
        told_missed: set[str] = set()

        missed: list[str] = []

        def starting(node: str) -> Manifests:
            return self.client.list_manifests(node, starting=True)

        def unanswered(node: str, e: PeerCallError) -> None:
            missed.append(node)
            if node not in told_missed:  # once per peer: retries are not news
                told_missed.add(node)
                logger.info(
                    "could not tell %s that this node started: %s; telling it again until "
                    "it answers",
                    node,
                    e.code,
                )

        while pending:
            missed.clear()
            self.client.each(starting, nodes=pending, on_error=unanswered, parallel=True)
            for node in pending:
                if node in told_missed and node not in missed:
                    logger.info("told %s that this node started, at last", node)
            pending = [n for n in missed if n in self.client.peer_ids]
            if not pending or time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
            pause = min(ANNOUNCE_RETRY_CAP, pause * 2)
        if pending:
            logger.warning(
                "gave up telling %s that this node started after %.0f s",
                ", ".join(pending),
                ANNOUNCE_PATIENCE,
            )

    # ---- saves this node may have missed the commit of ---------------------------------
    def resolve_unfinished(self, namespace: str, checkpoint_id: str) -> Resolution:
        """Whether a save this node still sees unfinished was committed by its
        coordinator: "published" (a peer's manifest of it is adopted now), "absent"
        (every peer answered without it) or "unknown" (some peer did not answer)."""
        answered = True

        def unanswered(node: str, e: PeerCallError) -> None:
            nonlocal answered
            answered = False
            logger.info(
                "%s did not say whether it knows %s/%s: %s", node, namespace, checkpoint_id, e.code
            )

        got = self.client.each(
            lambda node: self.client.list_manifests(node, namespace, wait_for_ready=False),
            on_error=unanswered,
        )
        for node, manifests in got.items():
            for rec in manifests.records:
                if rec.key != (namespace, checkpoint_id) or coordinator_of(rec.files) != node:
                    continue
                if self.catalog.publish(rec):
                    logger.warning(
                        "%s/%s: the publish of its commit never reached this node; adopted "
                        "the manifest from %s (its coordinator) instead",
                        namespace,
                        checkpoint_id,
                        node,
                    )
                    self._heal(namespace, checkpoint_id)
                    return "published"
        return "unknown" if not answered else "absent"

    def republish_own(self) -> int:
        """Publish again every committed checkpoint this node coordinates and holds the
        `.metadata` of (after a restart: a crash between the manifest and its publish
        left the peers holding the files of a save they think unfinished); publishing is
        idempotent. Returns how many were sent."""
        sent = 0
        for namespace, checkpoint_id in self.catalog.committed_keys():
            try:
                view = self.catalog.get(namespace, checkpoint_id)
            except CheckpointNotFound:
                continue
            files = {f.name: f for f in view.files}
            anchor = commit_anchor(files, view.checkpoint_format)  # `.metadata` for DCP
            if coordinator_of(files) != self.node_id or not view.local_paths.get(anchor):
                continue  # another's, or adopted empty: nothing of ours the peers miss

            def publish(node: str, v: CheckpointView = view) -> None:
                self.client.publish(node, v)

            self.client.each(publish, nodes=self.interested(view), parallel=True)
            sent += 1
        return sent

    # ---- gossip -------------------------------------------------------------------------
    def gossip(self, fanout: int = GOSSIP_FANOUT) -> int:
        """Ask `fanout` random peers for their manifests; adopt the committed
        checkpoints this node does not know (confirmed with their coordinator when the
        peer only relays them), and heal in full any checkpoint a peer lists LOST.
        Returns how many were adopted. Cluster marks (rm, pin) ride along."""
        peers = self.client.peer_ids
        if not peers:
            return 0
        chosen = random.sample(peers, min(fanout, len(peers)))
        known = set(self.catalog.committed_keys())
        adopted = 0

        def unanswered(node: str, e: PeerCallError) -> None:
            logger.debug("no manifests from %s for gossip: %s", node, e.code)

        got = self.client.each(
            lambda node: self.client.list_manifests(node, wait_for_ready=False),
            nodes=chosen,
            on_error=unanswered,
        )
        for node, manifests in got.items():
            for rec in manifests.records:
                if self._declined.get(rec.key, 0.0) > time.monotonic():
                    continue
                if rec.key in known:
                    if coordinator_of(rec.files) == node:  # its replica lists, merged
                        with contextlib.suppress(TierckptError):
                            before = self._named(*rec.key)
                            self.catalog.publish(rec)
                            self._merged(rec.namespace, rec.checkpoint_id, before)
                    continue
                known.add(rec.key)
                if self._adopt_relayed(node, rec):
                    adopted += 1
            for key in manifests.lost:
                if key in known:
                    self._heal_full(*key)
        if adopted:
            logger.info("adopted %d checkpoints by gossip", adopted)
        return adopted

    def _named(self, namespace: str, checkpoint_id: str) -> set[str]:
        """Every node this node's record of a checkpoint names as a holder."""
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return set()
        return {n for f in view.files for n in (f.owner_node, *f.replica_nodes)}

    def _adopt_relayed(self, node: str, rec: CheckpointRecord) -> bool:
        """Adopt a manifest `node` gossiped or relayed: as it is when `node` coordinates
        it, else as its coordinator confirms it (a peer cannot make up another's
        checkpoint). Gossip does not ask again about one this node deleted, or whose
        coordinator names another, and asks about one the coordinator does not know
        (yet: it may be restarting empty) after DECLINE_FOR seconds."""
        coordinator = coordinator_of(rec.files)
        try:
            if coordinator != node:
                if coordinator == self.node_id or coordinator not in self.client.peer_ids:
                    return self._decline(rec.key)
                confirmed = self._manifest_or_none(coordinator, *rec.key)
                if confirmed is None:
                    return self._decline(rec.key, DECLINE_FOR)  # or it restarts empty
                if coordinator_of(confirmed.files) != coordinator:
                    return self._decline(rec.key)
                rec = confirmed
            if not self.catalog.publish(rec):
                return self._decline(rec.key)  # deleted or evicted here
        except PeerCallError as e:
            logger.info("gossip: %s did not confirm %s/%s: %s", coordinator, *rec.key, e.code)
            return False  # asked again next round
        except TierckptError as e:
            logger.info("gossiped manifest of %s/%s not adopted: %s", *rec.key, e)
            if isinstance(e, MemoryBudgetExceeded):
                return False  # may fit next round
            return self._decline(rec.key)
        self._heal(rec.namespace, rec.checkpoint_id)
        return True

    def _decline(self, key: Key, seconds: float = float("inf")) -> bool:
        if len(self._declined) >= _DECLINED_MAX:
            self._declined.clear()
        self._declined[key] = time.monotonic() + seconds
        return False
