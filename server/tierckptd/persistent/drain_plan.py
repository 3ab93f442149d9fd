"""Who drains what: the pure part of one drain attempt.

A data file of a due checkpoint is uploaded by one node: its owner, or, once the owner is
*gone*, the first live holder in the file's replica order (the order rule of the healer's
`responsible`: owner, then `replica_nodes`, then other holders by id). A node is gone
when it answered without the file, has been unreachable for `owner_grace` seconds, or is
no longer a member; an unreachable node still within its grace is presumed present, so
the others wait for it rather than race it. Should two nodes still upload the same file
(their views disagree for a moment), they write the same bytes and the same marker.

`.metadata` is committed by the coordinator (its owner: it can restore its copy from a
peer), or, once the coordinator is gone (unreachable past the grace, not a member, or it
no longer knows the checkpoint), by the first live holder of `.metadata` in the same
order. The commit itself waits until every data file is up (`upload_metadata_last`), so
it is idempotent whoever does it.

Without peer information (a single node, or `peers` not given), the rule is the old one:
each node uploads the files it owns and holds, and the coordinator commits.

SIGTERM's emergency drain (`everything`) uploads every data file this node holds,
whoever owns it, and commits if it is the coordinator or holds `.metadata`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from tierckpt.names import METADATA_FILE

from tierckptd.model import FileRecord
from tierckptd.persistent.markers import UploadedFile, fingerprint

__all__ = [
    "DrainPlan",
    "Liveness",
    "Outcome",
    "PeerHolding",
    "PeerLookup",
    "Peers",
    "Presence",
    "committer",
    "is_current",
    "plan_drain",
    "uploader",
]


class Outcome(enum.Enum):
    """How one attempt ended (a failure raises)."""

    DURABLE = "durable"  # `.metadata` is in the tier (or the checkpoint is gone)
    WAITING = "waiting"  # another node uploads or commits; poll again
    UPLOADED = "uploaded"  # SIGTERM: every file held here is up; another node commits


@dataclass(frozen=True)
class PeerHolding:
    """What a reachable peer said of one checkpoint: whether it knows it (has its
    manifest), and the files it holds a verified copy of."""

    known: bool
    names: frozenset[str]


Peers = Mapping[str, PeerHolding | None]
"""The peers asked, with what each holds of a checkpoint; None: it did not answer."""

PeerLookup = Callable[[str, str, Collection[str]], Peers]
"""`(namespace, checkpoint_id, nodes)`: asks those of `nodes` that are configured peers
what they hold of the checkpoint; a node that is not a peer is left out of the answer."""


@dataclass(frozen=True)
class Presence:
    """This node's view of the others for one attempt.

    `peers` None: no peer information (the old rule, see the module doc); else the
    answers of the peers asked (every owner and replica node of the files in question),
    a node missing from it not being a member. `gone`: the unreachable ones past their
    grace.
    """

    me: str
    peers: Peers | None = None
    gone: frozenset[str] = frozenset()

    def holds(self, node: str, f: FileRecord) -> bool:
        if node == self.me:
            return f.held
        h = (self.peers or {}).get(node)
        return h is not None and f.name in h.names

    def absent(self, node: str) -> bool:
        """Gone for good: not a member, or unreachable past the grace."""
        if node == self.me:
            return False
        return self.peers is None or node not in self.peers or node in self.gone

    def unreachable(self, node: str) -> bool:
        return node != self.me and self.peers is not None and self.peers.get(node) is None


class Liveness:
    """Since when each peer has been unreachable, to tell the ones past `grace` seconds
    (the clock starts when this node first sees it down; any answer resets it; a peer
    not asked this round keeps its clock)."""

    def __init__(self, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace = grace
        self._clock = clock
        self._since: dict[str, float] = {}

    def observe(self, peers: Peers) -> frozenset[str]:
        """Record one round of answers; the peers gone (unreachable past the grace)."""
        now = self._clock()
        for node, holding in peers.items():
            if holding is None:
                self._since.setdefault(node, now)
            else:
                self._since.pop(node, None)
        return frozenset(
            n for n in peers if n in self._since and now - self._since[n] >= self.grace
        )


def _order(f: FileRecord, presence: Presence) -> list[str]:
    """The file's candidates: owner, replica list, then any other holder by id."""
    others = sorted(n for n in (presence.peers or {}) if presence.holds(n, f))
    if f.held:
        others = sorted({*others, presence.me})
    return [n for n in dict.fromkeys([f.owner_node, *f.replica_nodes, *others]) if n]


def uploader(f: FileRecord, presence: Presence, *, skip: str = "") -> str:
    """The node that uploads `f` ("": no live node holds it), `skip` passed over."""
    if presence.peers is None:  # the old rule: the owner, if it holds the file
        owner = f.owner_node
        return "" if owner == presence.me and not f.held else owner
    claimed = {f.owner_node, *f.replica_nodes}
    for node in _order(f, presence):
        if node == skip:
            continue
        if presence.holds(node, f):
            return node
        if presence.unreachable(node) and not presence.absent(node) and node in claimed:
            return node  # within its grace: presumed to hold it, wait for it
    return ""


def committer(meta: FileRecord, presence: Presence) -> str:
    """The node that commits `.metadata` ("": none can)."""
    owner = meta.owner_node
    if presence.peers is None:
        return owner or (presence.me if meta.held else "")
    if owner == presence.me:
        return owner  # the coordinator: it restores its .metadata if it lost it
    if owner and not presence.absent(owner):
        h = presence.peers.get(owner)
        if h is None or h.known:  # within its grace, or it knows the checkpoint
            return owner
    return uploader(meta, presence, skip=owner)


def is_current(marker: UploadedFile | None, f: FileRecord) -> bool:
    """Whether the tier already holds `f`'s bytes (its marker describes them)."""
    if marker is None:
        return False
    return marker.fingerprint == fingerprint(f) and marker.source_size == f.size


@dataclass(frozen=True)
class DrainPlan:
    """One attempt's work: `upload` (data files this node uploads now), `waiting` (not
    in the tier yet, another node's to upload), `unheld` (no live node holds a copy),
    and whether this node commits `.metadata` (`commit`; `by_rule`: as the committer
    the rule names, not only as SIGTERM's best effort)."""

    upload: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    unheld: tuple[str, ...] = ()
    commit: bool = False
    by_rule: bool = False


def plan_drain(
    files: Iterable[FileRecord],
    pending: Iterable[str],
    presence: Presence,
    *,
    everything: bool = False,
    anchor: str = METADATA_FILE,
    anchor_is_data: bool = False,
) -> DrainPlan:
    """What this node does for a checkpoint (pure; see the module doc).

    Args:
        files: the checkpoint's files (`.metadata` included).
        pending: names of the data files not (currently) in the tier.
        presence: this node's view of the others.
        everything: SIGTERM's emergency drain: every data file held here.
        anchor: the file whose holder commits (`model.commit_anchor`): DCP's
            `.metadata`, never uploaded as data; `anchor_is_data` ("files" format): it is
            uploaded like the others too.
    """
    by_name = {f.name: f for f in files}
    upload: list[str] = []
    waiting: list[str] = []
    unheld: list[str] = []
    for name in sorted(set(pending)):
        f = by_name.get(name)
        if f is None or (name == anchor and not anchor_is_data):
            continue
        node = presence.me if everything and f.held else uploader(f, presence)
        (upload if node == presence.me else waiting if node else unheld).append(name)
    meta = by_name.get(anchor)
    by_rule = meta is not None and committer(meta, presence) == presence.me
    commit = by_rule or (everything and meta is not None and meta.held)
    return DrainPlan(tuple(upload), tuple(waiting), tuple(unheld), commit, by_rule)
