"""Healing: every file of a committed checkpoint keeps k verified extra copies.

`plan_heal` is pure: from a checkpoint's view, what every reachable node holds, the
members and k, it says which files this node must push where, which replica lists to
record, and the checkpoint's health label ("lost", "under-replicated" or ""). `Healer`
executes a plan: it asks the peers' holdings, pushes (stepping aside while a save
writes), plans again with the pushes that succeeded, records the replica lists and
broadcasts them, and keeps the health labels.

A node heals only the files it is involved in (it holds one, or is in the file's
neighbourhood: owner, replica holders, first placement candidates), asking only those
nodes: a heal costs the same RPCs in a cluster of 8 or of 800 nodes. A checkpoint a peer
lists LOST is healed in full here (every file, every peer), so the loss is this node's
own finding, never taken on a peer's word.

The node responsible for a file pushes it: its owner, or, when the owner lost it, the
first reachable holder in the file's replica order. Nobody else pushes that file.

A recorded holder that stopped answering is waited for `replace_after` seconds before its
copy is replaced (HDFS's dead-node interval, Ceph's down-out interval): a cut, a flap or
a frozen process of a few seconds costs no push, and no trim when the holder is back.
Meanwhile the file is listed under-replicated (never REPLICATED on an unreachable
holder's name), and a holder that answers without the file (a node that came back
empty) is replaced at once.

A record can name a holder its copy is not on: a replica list made before a peer came
back empty can arrive after that peer's start announce, and a manifest adopted from a
peer can name this node for a file it does not hold. Such a record is doubted
(`Healer.doubt`): listed under-replicated until a heal finds the copies. And a peer
answering that a checkpoint is durable (its copies may be let go) makes the drain ask
the persistent tier now (`CatalogEvents.durable_elsewhere`), never taken as proof.

A file no reachable node holds is "lost" only when every node that held it (its owner
and its replica nodes) answered without it and the persistent tier does not hold the
checkpoint: the checkpoint is then listed LOST on every node (each node's healer finds
it) until a copy reappears. A holder that did not answer may come back: the file is
only under-replicated then.

Pushing one copy is `peers/push.py`; dropping this node's surplus copies (more than k
extra) is planned by `peers/trim.py`. A DURABLE checkpoint whose owner answered holding
none of it (retention let it go to the persistent tier there) is not pushed for: the
persistent tier serves those files.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tierckpt.errors import CheckpointNotFound
from tierckpt.units import format_size

from tierckptd.catalog import Catalog
from tierckptd.catalog.views import LOST, UNDER
from tierckptd.jobs import backoff
from tierckptd.model import CheckpointView, FileRecord, Key, State
from tierckptd.ops import metrics
from tierckptd.peers.client import Holdings, PeerCallError, PeerClient
from tierckptd.peers.placement import (
    Member,
    coordinator_of,
    file_key,
    neighbourhood,
    preference,
)
from tierckptd.peers.push import HEARTBEAT, OnCorrupt, Pusher
from tierckptd.peers.trim import plan_trim, settled_replicas

__all__ = [
    "HEARTBEAT",
    "FilePush",
    "HealPlan",
    "Healer",
    "OnCorrupt",
    "involved",
    "let_go",
    "plan_heal",
    "responsible",
]

logger = logging.getLogger(__name__)

# UpdateReplicas a peer did not take (busy, or not answering): sent again by a queued job
# (`Tell`), never inline, up to this many times in all, the first pause (seconds) doubling
# up to the cap, jittered so that many owners do not come back at once.
BROADCAST_ATTEMPTS = 8
BROADCAST_BACKOFF = 1.0
BROADCAST_BACKOFF_CAP = 30.0
# Seconds a recorded holder that does not answer is waited for before its copies are
# pushed elsewhere (`[replication] replace_after`).
REPLACE_AFTER = 15.0
# Seconds after a peer announced its (re)start during which a replica list or manifest
# naming it is doubted (`Healer.doubt`): a list sent before it came back empty can arrive
# late (UpdateReplicas retries for minutes, the announce for up to 10).
RESTART_DOUBT = 600.0
# Seconds between two hints to the drain that a peer says a checkpoint is durable.
DURABLE_ELSEWHERE_EVERY = 10.0
MAX_HINTS = 10_000

RetryTell = Callable[[str, str, str, str, int, float], None]
"""(namespace, checkpoint id, file name, node, tries so far, delay): queue a `Tell`."""


@dataclass(frozen=True)
class FilePush:
    """Push `name` to the first `need` of `targets` that take it (best first)."""

    name: str
    targets: tuple[str, ...]
    need: int


@dataclass(frozen=True)
class HealPlan:
    pushes: tuple[FilePush, ...] = ()
    # file name -> the replica list to record (only where it differs from the view's)
    replicas: Mapping[str, list[str]] = field(default_factory=dict)
    lost: tuple[str, ...] = ()
    under: tuple[str, ...] = ()
    # Nodes the heal asked that did not answer (or were skipped while they back off), and
    # the files left with fewer than k extra copies on the nodes that answered.
    unreached: tuple[str, ...] = ()
    short: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return LOST if self.lost else UNDER if self.under else ""


def responsible(f: FileRecord, holders: Sequence[str], me: str) -> bool:
    """Whether `me` pushes `f`: its owner when the owner holds it, else the first holder
    in replica order (then by id)."""
    if f.owner_node in holders:
        return f.owner_node == me
    order = [*f.replica_nodes, *sorted(holders)]
    return next(n for n in order if n in holders) == me


def plan_heal(
    view: CheckpointView,
    holdings: Mapping[str, Holdings],
    members: Sequence[Member],
    k: int,
    me: str,
    waiting: frozenset[str] = frozenset(),
) -> HealPlan:
    """What healing `view` takes (pure; see the module docstring).

    `holdings`: every reachable node (this one included) and what it holds, in the
    order holders are listed; a node missing from it is unreachable and gets nothing.
    A node that answered without knowing the checkpoint holds none of it (it was
    wiped, or retention let the checkpoint go there). `waiting`: unreachable nodes not
    yet replaced (unreachable for less than `replace_after`): a copy they are recorded
    to hold counts for the push plan and stays in the replica list, not in the label.
    """
    reachable = list(holdings)
    # The persistent tier holds every file (here, or a peer knows it: this node may not
    # have learnt it yet, and a peer that let its copies go there answers without them).
    durable = view.state is State.DURABLE or any(h.durable for h in holdings.values())
    domain_of = {m.id: m.domain for m in members}
    spread = min(k + 1, len(set(domain_of.values())))  # failure domains the copies span
    pushes: list[FilePush] = []
    replicas: dict[str, list[str]] = {}
    lost: list[str] = []
    under: list[str] = []
    for f in view.files:
        holders = [n for n in reachable if f.name in holdings[n].names]
        if not holders:
            claimed = {f.owner_node, *f.replica_nodes} - {""}
            if not claimed:
                continue  # let go to the persistent tier where this manifest came from
            if durable or not claimed <= set(reachable):
                under.append(f.name)  # restorable from the persistent tier, or may come back
            else:
                lost.append(f.name)  # every node that held it answered without it
            continue
        recorded = list(f.replica_nodes)
        if me in holders and responsible(f, holders, me):
            key = file_key(view.namespace, view.checkpoint_id, f.name)
            candidates = list(
                dict.fromkeys([f.owner_node, *preference(key, f.owner_node, members)])
            )
            targets = tuple(n for n in candidates if n not in holders and n in holdings)
            pending = [n for n in dict.fromkeys([f.owner_node, *f.replica_nodes]) if n in waiting]
            need = k + 1 - len(holders) - len(pending)
            if need > 0 and targets:
                pushes.append(FilePush(f.name, targets, need))
            elif missing := _domains_missing(domain_of, [*holders, *pending], spread):
                # Enough copies, too few failure domains: placed while the other domains
                # were out of reach. One more copy in each missing domain (the trim then
                # drops the copy that ranks last: the one in a domain already covered).
                pushes.extend(
                    _spread_push(f.name, targets, domain_of, [*holders, *pending], missing)
                )
            rank = {n: i for i, n in enumerate(candidates)}
            recorded = sorted(
                (n for n in [*holders, *pending] if n != f.owner_node),
                key=lambda n: rank.get(n, 1 << 30),
            )
            if recorded != f.replica_nodes:
                replicas[f.name] = recorded
        claimed = {f.owner_node, *recorded}
        if len(holders) < k + 1 and not claimed <= set(holders):
            under.append(f.name)
        elif len(holders) >= k + 1 and _domains_missing(domain_of, holders, spread):
            under.append(f.name)  # k + 1 copies, yet one failure domain's loss takes all
    return HealPlan(tuple(pushes), replicas, tuple(lost), tuple(under))


def _domains_missing(domain_of: Mapping[str, str], holders: Sequence[str], spread: int) -> int:
    """How many more failure domains the copies on `holders` must span (`spread`: k + 1,
    or every domain of the cluster when it has fewer)."""
    return max(0, spread - len({domain_of.get(n, n) for n in holders}))


def _spread_push(
    name: str,
    targets: Sequence[str],
    domain_of: Mapping[str, str],
    holders: Sequence[str],
    missing: int,
) -> list[FilePush]:
    """A push of `name` to a node in each of `missing` failure domains its holders lack
    (the best target of each domain, best domain first), or none when no such target is
    reachable."""
    have = {domain_of.get(n, n) for n in holders}
    best: dict[str, str] = {}  # domain -> its best target (targets come best first)
    for n in targets:
        best.setdefault(domain_of.get(n, n), n)
    new = tuple(n for d, n in best.items() if d not in have)
    return [FilePush(name, new, min(missing, len(new)))] if new else []


def involved(
    view: CheckpointView, members: Sequence[Member], k: int, me: str
) -> tuple[tuple[FileRecord, ...], set[str]]:
    """The files of `view` that involve `me` (it holds one, or is in its neighbourhood)
    and the union of their neighbourhoods: the nodes a heal of them asks."""
    files: list[FileRecord] = []
    asked: set[str] = set()
    for f in view.files:
        key = file_key(view.namespace, view.checkpoint_id, f.name)
        near = neighbourhood(key, f.owner_node, f.replica_nodes, members, k)
        if f.held or me in near:
            files.append(f)
            asked |= near
    asked.discard(me)
    return tuple(files), asked


def asked_all(view: CheckpointView, members: Sequence[Member], k: int) -> set[str]:
    """The union of every file's neighbourhood: whom a heal of all of `view` asks."""
    asked: set[str] = set()
    for f in view.files:
        key = file_key(view.namespace, view.checkpoint_id, f.name)
        asked |= neighbourhood(key, f.owner_node, f.replica_nodes, members, k)
    return asked


def told_nodes(
    view: CheckpointView,
    f: FileRecord,
    replicas: Sequence[str],
    members: Sequence[Member],
    k: int,
    me: str,
    coordinator: str,
) -> list[str]:
    """Whom a new replica list of `f` goes to: the file's neighbourhood (as recorded and
    as about to be) and the checkpoint's `coordinator` (`placement.coordinator_of` of all
    its files, computed once per checkpoint), whose manifest others adopt."""
    key = file_key(view.namespace, view.checkpoint_id, f.name)
    near = neighbourhood(key, f.owner_node, [*f.replica_nodes, *replicas], members, k)
    return sorted((near | {coordinator}) - {me, ""})


def let_go(view: CheckpointView, holdings: Mapping[str, Holdings], me: str) -> CheckpointView:
    """`view` without the files of a DURABLE checkpoint whose owner answered that it
    knows the checkpoint but holds none of it: retention let it go to the persistent
    tier there (or the copy was lost, and the persistent tier has it). Nobody pushes
    them back nor counts them under-replicated."""
    if view.state is not State.DURABLE:
        return view
    gone = {n for n, h in holdings.items() if n != me and h.known and not h.names}
    files = tuple(f for f in view.files if f.owner_node not in gone)
    return view if len(files) == len(view.files) else dataclasses.replace(view, files=files)


class Healer:
    """Executes `plan_heal` for one node and keeps its health labels."""

    def __init__(
        self,
        catalog: Catalog,
        client: PeerClient,
        *,
        replica_target: Callable[[], int],
        members: Callable[[], list[Member]],
        on_corrupt: OnCorrupt,
        stop: threading.Event | None = None,
        retry_tell: RetryTell | None = None,
        replace_after: float = REPLACE_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.catalog = catalog
        self.client = client
        self.node_id = catalog.node_id
        self._k = replica_target
        self._members = members
        self._on_corrupt = on_corrupt
        self._retry_tell = retry_tell
        self._stop = stop if stop is not None else threading.Event()
        self._pusher = Pusher(catalog, client, on_corrupt, stop=stop)
        self._lock = threading.Lock()
        self._labels: dict[Key, str] = {}
        self._lost: dict[Key, tuple[str, ...]] = {}  # the files of a "lost" label
        # Checkpoints naming a peer that restarted (it may have come back empty): listed
        # under-replicated, every file healed, until a heal finds every copy again.
        self._suspect: set[Key] = set()
        self.replace_after = replace_after
        self._clock = clock
        # Peers a heal did not reach: when a heal first missed them (monotonic).
        self._unreached: dict[str, float] = {}
        # Peers that announced a (re)start, and when (monotonic): `doubt`.
        self._restarted: dict[str, float] = {}
        # When a heal last confirmed every copy of a checkpoint (monotonic): a restart
        # before it is no reason to doubt the checkpoint again.
        self._confirmed: dict[Key, float] = {}
        self._hinted: dict[Key, float] = {}  # durable hints given to the drain, and when

    def label(self, namespace: str, checkpoint_id: str) -> str:
        """The health label the last heal of a checkpoint left ("" when healthy)."""
        with self._lock:
            return self._labels.get((namespace, checkpoint_id), "")

    def suspect(self, namespace: str, checkpoint_id: str) -> None:
        """A peer this checkpoint names (owner or replica) has just restarted and may
        have come back empty (kill -9, memory wiped): its copies no longer count. The
        checkpoint is listed under-replicated at once, not REPLICATED on names alone,
        and its heals take every file (asking their neighbourhoods, even where none
        involves this node) until one finds every copy again; then the label goes as
        any heal's does."""
        key = (namespace, checkpoint_id)
        with self._lock:
            self._suspect.add(key)
            if self._labels.get(key):
                return  # already under-replicated or lost: that label stays
            self._labels[key] = UNDER
        self.catalog.set_health(namespace, checkpoint_id, UNDER)

    def restarted(self, node: str) -> None:
        """`node` announced it (re)started: it may have come back empty."""
        with self._lock:
            self._restarted[node] = self._clock()

    def doubt(self, namespace: str, checkpoint_id: str, *, fresh: bool = False) -> bool:
        """Suspect (`suspect`) a checkpoint whose record names a holder its copy may not
        be on: this node for a file it does not hold (a manifest adopted from a peer, or
        a replica list sent before this node came back empty), or a peer that announced a
        restart within RESTART_DOUBT seconds (a list made before it came back empty may
        arrive after its announce) and since the last heal that confirmed every copy
        (`fresh`: a replica list that arrived just now, doubted whenever it names such a
        peer). Whether it did; the next heal confirms or heals."""
        view = self._doubtable(namespace, checkpoint_id)
        if view is None:
            return False
        key = (namespace, checkpoint_id)
        with self._lock:
            if key in self._suspect:
                return True
            recent = self._restarted_since(0.0 if fresh else self._confirmed.get(key, 0.0))
        me = self.node_id
        for f in view.files:
            named = {f.owner_node, *f.replica_nodes}
            if (me in named and not f.held) or named & recent:
                self.suspect(namespace, checkpoint_id)
                return True
        return False

    def doubt_added(self, namespace: str, checkpoint_id: str, before: set[str]) -> bool:
        """`doubt` for the holders a merge just added to a checkpoint's record (a gossiped
        manifest's replica lists are merged as a union, so a list made before a peer came
        back empty can name it again after a heal here dropped it): suspected when an
        added name is a peer that announced a restart within RESTART_DOUBT seconds."""
        view = self._doubtable(namespace, checkpoint_id)
        if view is None:
            return False
        added = {n for f in view.files for n in (f.owner_node, *f.replica_nodes)} - before
        with self._lock:
            recent = self._restarted_since(0.0)
        if added & recent:
            self.suspect(namespace, checkpoint_id)
            return True
        return False

    def _doubtable(self, namespace: str, checkpoint_id: str) -> CheckpointView | None:
        """The checkpoint's view while it is committed here and not durable or lost."""
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return None
        return view if view.state in (State.COMMITTED, State.REPLICATED) else None

    def _restarted_since(self, since: float) -> set[str]:
        """Peers that announced a restart within RESTART_DOUBT seconds and after `since`
        (monotonic; call under the lock)."""
        now = self._clock()
        return {n for n, t in self._restarted.items() if now - t < RESTART_DOUBT and t > since}

    def heal(self, namespace: str, checkpoint_id: str, *, full: bool = False) -> HealPlan | None:
        """Heal one checkpoint (None: not a committed one here, or none of its files
        involve this node); the final plan.

        Only the files this node is involved in are healed (it owns or holds one, or is
        among its first placement candidates: `placement.neighbourhood`), asking only
        their neighbourhoods: the work per checkpoint does not grow with the cluster.
        `full` (a peer lists it LOST, or this node does) heals every file, asking every
        peer, so that a loss found anywhere is confirmed, or undone, here by this node's
        own finding."""
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            with self._lock:  # deleted (retention, rm): its label must not outlive it
                self._labels.pop((namespace, checkpoint_id), None)
                self._lost.pop((namespace, checkpoint_id), None)
                self._suspect.discard((namespace, checkpoint_id))
            return None
        if view.state not in (State.COMMITTED, State.REPLICATED, State.DURABLE, State.LOST):
            return None
        if not any(f.held or f.owner_node or f.replica_nodes for f in view.files):
            # Retention let it go to the persistent tier only (here, or on the peer whose
            # manifest this is, before this node learnt it is durable): no memory copy is
            # wanted, so it is neither "lost" nor pushed back into a node that evicted it.
            self._record(namespace, checkpoint_id, HealPlan(), self._k())
            return None
        me = self.node_id
        self.doubt(namespace, checkpoint_id)
        members, k = self._members(), self._k()
        coordinator = coordinator_of({f.name: f for f in view.files})
        manifest = view  # every file: what a push publishes to a node that lacks it
        asked: list[str] = self.client.peer_ids
        with self._lock:
            suspect = (namespace, checkpoint_id) in self._suspect
        if not (full or self.label(namespace, checkpoint_id) == LOST):
            files, near = involved(view, members, k, me)
            if suspect:  # every file, even one not involving this node: its label is here
                files, near = view.files, asked_all(view, members, k)
            if not files:  # none of it involves this node (membership may have moved)
                if self.label(namespace, checkpoint_id):
                    self._record(namespace, checkpoint_id, HealPlan(), k)
                return None
            view = dataclasses.replace(view, files=files)
            asked = [n for n in asked if n in near]
        asked_at = self._clock()  # a restart announced after this, the answers predate
        holdings: dict[str, Holdings] = {
            me: Holdings(True, frozenset(f.name for f in view.files if f.held))
        }
        # All at once (the fan-out pool); a peer that did not answer its last call is
        # skipped while it backs off (`PeerClient.breaker`): it is unreachable here.
        holdings.update(
            self.client.each(
                lambda node: self.client.holdings(node, namespace, checkpoint_id),
                nodes=asked,
                parallel=True,
            )
        )
        self._durable_elsewhere(view, holdings)
        view = let_go(view, holdings, me)
        files_by_name = {f.name: f for f in view.files}  # as recorded when this heal began
        waiting = self._waiting(asked, holdings)
        plan = plan_heal(view, holdings, members, k, me, waiting)
        if plan.pushes:
            for p in plan.pushes:
                got = 0
                for node in p.targets:
                    if got >= p.need:
                        break
                    if self._pusher.refusing((namespace, checkpoint_id), node):
                        continue
                    f = files_by_name[p.name]
                    if self._pusher.push(node, manifest, f, holdings[node].known):
                        had = holdings[node]
                        holdings[node] = Holdings(True, had.names | {p.name}, had.files)
                        got += 1
            plan = plan_heal(view, holdings, members, k, me, waiting)
        trims = plan_trim(view, holdings, members, k, me)

        def told(name: str, replicas: list[str]) -> list[str] | None:
            """Who hears of the new list: the file's neighbourhood and the coordinator;
            every peer when it drops a name (a trim, a holder found without its copy).
            Gossip merges replica lists as unions, so it spreads a name added but never
            a name removed: a node outside the neighbourhood would list it for good."""
            f = files_by_name[name]
            if set(f.replica_nodes) - set(replicas):
                return None
            return told_nodes(manifest, f, replicas, members, k, me, coordinator)

        for name, replicas in plan.replicas.items():
            if name not in trims:
                self.catalog.set_replicas(namespace, checkpoint_id, name, replicas)
                self.broadcast_replicas(
                    namespace, checkpoint_id, name, replicas, told(name, replicas)
                )
        for name, kept in trims.items():
            self._trim(view, name, kept, k, told(name, kept))
        for name, confirmed in settled_replicas(view, holdings, members).items():
            if name not in plan.replicas and name not in trims:  # recorded and told above
                # Only over the list this finding started from: the responsible node's
                # UpdateReplicas may have brought a newer one while the holdings were asked.
                self.catalog.set_replicas(
                    namespace,
                    checkpoint_id,
                    name,
                    confirmed,
                    expected=files_by_name[name].replica_nodes,
                )
        plan = self._unless_restarted_meanwhile(view, plan, asked_at)
        self._record(namespace, checkpoint_id, plan, k)
        unreached = tuple(n for n in asked if n not in holdings)
        short = tuple(
            f.name for f in view.files if sum(f.name in h.names for h in holdings.values()) < k + 1
        )
        return dataclasses.replace(plan, unreached=unreached, short=short)

    def _unless_restarted_meanwhile(
        self, view: CheckpointView, plan: HealPlan, asked_at: float
    ) -> HealPlan:
        """A heal that found every copy is no confirmation when a holder it names announced
        a restart after the holdings were asked: that node may have come back empty since
        it answered (the stop-34 network chaos run: a heal begun before the restart cleared
        the doubt the announce had raised, and the checkpoint was listed REPLICATED on the
        empty node's name). Its files stay under-replicated; the heal the announce queued
        decides."""
        if plan.label:
            return plan
        with self._lock:
            meanwhile = self._restarted_since(asked_at)
        named = [f.name for f in view.files if meanwhile & {f.owner_node, *f.replica_nodes}]
        return dataclasses.replace(plan, under=tuple(named)) if named else plan

    def _durable_elsewhere(self, view: CheckpointView, holdings: Mapping[str, Holdings]) -> None:
        """A peer answered that a checkpoint not durable here is durable: the drain
        checks the persistent tier now (`CatalogEvents.durable_elsewhere`; at most every
        DURABLE_ELSEWHERE_EVERY seconds per checkpoint). Its peers may be letting their copies
        go to the persistent tier: until this node learns it is durable, it would go on
        listing those copies."""
        if view.state is State.DURABLE or not any(h.durable for h in holdings.values()):
            return
        key, now = (view.namespace, view.checkpoint_id), self._clock()
        with self._lock:
            if now - self._hinted.get(key, -DURABLE_ELSEWHERE_EVERY) < DURABLE_ELSEWHERE_EVERY:
                return
            self._hinted[key] = now
            if len(self._hinted) > MAX_HINTS:
                self._hinted = {k: t for k, t in self._hinted.items() if now - t < 60.0}
        self.catalog.events.durable_elsewhere(*key)

    def _waiting(self, asked: Sequence[str], holdings: Mapping[str, Holdings]) -> frozenset[str]:
        """The asked peers that did not answer, unanswered in every heal for less than
        `replace_after` seconds: waited for, not replaced. An answer in any heal ends the
        outage."""
        now = self._clock()
        with self._lock:
            for node in asked:
                if node in holdings:
                    self._unreached.pop(node, None)
                else:
                    self._unreached.setdefault(node, now)
            return frozenset(
                n
                for n in asked
                if n not in holdings and now - self._unreached[n] < self.replace_after
            )

    def _trim(
        self, view: CheckpointView, name: str, kept: list[str], k: int, told: list[str] | None
    ) -> None:
        """Drop this node's surplus copy of `name` (peers/trim.py) and tell the peers
        which nodes keep one."""
        namespace, checkpoint_id = view.namespace, view.checkpoint_id
        if not self.catalog.drop_local_copy(namespace, checkpoint_id, name, surplus=True):
            return  # not held, or a reader restored it moments ago: kept for now
        size = next(f.size for f in view.files if f.name == name)
        metrics.TRIMMED_COPIES.inc()
        metrics.TRIMMED_BYTES.inc(size)
        logger.info(
            "%s/%s/%s: dropped the surplus copy on node %s (%s); %d extra copies kept, on %s",
            namespace,
            checkpoint_id,
            name,
            self.node_id,
            format_size(size),
            k,
            ", ".join(kept) or "the owner only",
        )
        self.catalog.set_replicas(namespace, checkpoint_id, name, kept)
        self.broadcast_replicas(namespace, checkpoint_id, name, kept, told)

    def tell_landed(self, namespace: str, checkpoint_id: str, name: str) -> None:
        """A copy of `name` from a peer was installed here: tell the file's neighbourhood
        and the coordinator the replica list this node now records (it names this node),
        so that the next heal or trim anywhere counts this copy."""
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return  # deleted or evicted meanwhile
        f = next((g for g in view.files if g.name == name), None)
        if f is None or f.owner_node == self.node_id:
            return
        replicas = list(f.replica_nodes)
        coordinator = coordinator_of({g.name: g for g in view.files})
        members, k = self._members(), self._k()
        nodes = told_nodes(view, f, replicas, members, k, self.node_id, coordinator)
        self.broadcast_replicas(namespace, checkpoint_id, name, replicas, nodes)

    def broadcast_replicas(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        replicas: list[str],
        nodes: list[str] | None = None,
    ) -> None:
        """Tell `nodes` (default: every peer) the file's new replica list, all at once:
        its neighbourhood and the checkpoint's coordinator, whose manifest others adopt.

        A peer serving its limit of calls (RESOURCE_EXHAUSTED: every owner of a large
        job tells the coordinator at once), not answering, or backing off (it did not
        answer its last call) is told again by a queued job (`retry_tell`), up to
        `BROADCAST_ATTEMPTS` times with a jittered backoff, never inline: a gray peer
        holds no heal. Nobody else re-sends it."""
        peers = set(self.client.peer_ids)
        targets = [n for n in (self.client.peer_ids if nodes is None else nodes) if n in peers]
        missed = self._send_replicas(namespace, checkpoint_id, name, replicas, targets)
        for node in missed:
            self._queue_tell(namespace, checkpoint_id, name, node, 1)

    def _send_replicas(
        self, namespace: str, checkpoint_id: str, name: str, replicas: list[str], nodes: list[str]
    ) -> list[str]:
        """UpdateReplicas to `nodes` at once; the nodes to tell again later."""
        missed: list[str] = []

        def unanswered(node: str, e: PeerCallError) -> None:
            if e.code in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"):
                missed.append(node)
            else:
                logger.debug("%s", e)

        self.client.each(
            lambda node: self.client.update_replicas(
                node, namespace, checkpoint_id, name, replicas
            ),
            nodes=nodes,
            on_error=unanswered,
            parallel=True,
        )
        return missed

    def _queue_tell(
        self, namespace: str, checkpoint_id: str, name: str, node: str, tries: int
    ) -> None:
        if tries >= BROADCAST_ATTEMPTS or self._retry_tell is None:
            logger.warning(
                "%s/%s/%s: %s did not take its replica list (busy or not answering); it "
                "learns it from the next heal or gossip",
                namespace,
                checkpoint_id,
                name,
                node,
            )
            return
        delay = backoff(tries, BROADCAST_BACKOFF, BROADCAST_BACKOFF_CAP) * (1 + random.random())
        self._retry_tell(namespace, checkpoint_id, name, node, tries, delay)

    def tell(self, namespace: str, checkpoint_id: str, name: str, node: str, tries: int) -> None:
        """A queued `Tell`: send `node` the replica list this node records for `name` now
        (the one a heal or trim recorded, or newer); queue it again if it is missed."""
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return  # deleted or evicted meanwhile
        f = next((g for g in view.files if g.name == name), None)
        if f is None or node not in self.client.peer_ids:
            return
        if self._send_replicas(namespace, checkpoint_id, name, list(f.replica_nodes), [node]):
            self._queue_tell(namespace, checkpoint_id, name, node, tries + 1)

    def _record(self, namespace: str, checkpoint_id: str, plan: HealPlan, k: int) -> None:
        label = plan.label
        key = (namespace, checkpoint_id)
        with self._lock:
            previous = self._labels.get(key, ""), self._lost.get(key, ())
            if label:
                self._labels[key] = label
            else:
                self._labels.pop(key, None)
            if plan.lost:
                self._lost[key] = plan.lost
            else:
                self._lost.pop(key, None)
            if not label:
                if key in self._suspect:
                    self._confirmed[key] = self._clock()
                    if len(self._confirmed) > MAX_HINTS:
                        self._confirmed.pop(next(iter(self._confirmed)))
                self._suspect.discard(key)  # a heal found every copy again
        self.catalog.set_health(namespace, checkpoint_id, label, plan.lost)
        if (label, plan.lost) != previous:
            if plan.lost:
                logger.error(
                    "%s/%s is LOST: every node that held %s answered without it and the "
                    "persistent tier does not hold the checkpoint; it is never loaded nor "
                    "picked as the newest until a copy comes back",
                    namespace,
                    checkpoint_id,
                    ", ".join(plan.lost),
                )
            elif plan.under:
                logger.warning(
                    "%s/%s is under-replicated: %s have fewer than %d extra copies on "
                    "reachable nodes",
                    namespace,
                    checkpoint_id,
                    ", ".join(plan.under),
                    k,
                )
            else:
                logger.info(
                    "%s/%s: every file has %d extra copies again", namespace, checkpoint_id, k
                )
        metrics.UNDER_REPLICATED.set(self.catalog.peer_marks.unhealthy_count())
