"""Healing: every file of a committed checkpoint keeps k verified extra copies.

`plan_heal` is pure: from a checkpoint's view, what every reachable node holds, the
members and k, it says which files this node must push where, which replica lists to
record, and the checkpoint's health mark ("lost", "under-replicated" or ""). `Healer`
executes a plan: it asks the peers' holdings, pushes (stepping aside while a save
writes), plans again with the pushes that succeeded, records the replica lists and
broadcasts them, and keeps the health marks.

The node responsible for a file pushes it: its owner, or, when the owner lost it, the
first reachable holder in the file's replica order. Nobody else pushes that file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt.errors import CheckpointNotFound
from tierckpt.units import format_size

from tierckptd.catalog import Catalog
from tierckptd.jobs import StepAside
from tierckptd.model import CheckpointView, FileRecord, Key, State
from tierckptd.ops import metrics
from tierckptd.peers.client import Holdings, PeerCallError, PeerClient
from tierckptd.peers.placement import Member, file_key, preference

__all__ = ["HEARTBEAT", "FilePush", "HealPlan", "Healer", "plan_heal", "responsible"]

logger = logging.getLogger(__name__)

# A push stepping aside sends an empty chunk this often, so the receiver's watchdog
# (peer_service.STALL_TIMEOUT) sees a live stream.
HEARTBEAT = 2.0

LOST = "lost"
UNDER = "under-replicated"


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

    @property
    def mark(self) -> str:
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
) -> HealPlan:
    """What healing `view` takes (pure; see the module docstring).

    `holdings`: every reachable node (this one included) and what it holds, in the
    order holders are listed; a node missing from it is unreachable and gets nothing.
    """
    reachable = list(holdings)
    pushes: list[FilePush] = []
    replicas: dict[str, list[str]] = {}
    lost: list[str] = []
    under: list[str] = []
    for f in view.files:
        holders = [n for n in reachable if f.name in holdings[n].names]
        if not holders:
            lost.append(f.name)
            continue
        recorded = list(f.replica_nodes)
        if me in holders and responsible(f, holders, me):
            key = file_key(view.namespace, view.checkpoint_id, f.name)
            candidates = list(
                dict.fromkeys([f.owner_node, *preference(key, f.owner_node, members)])
            )
            targets = tuple(n for n in candidates if n not in holders and n in holdings)
            need = k + 1 - len(holders)
            if need > 0 and targets:
                pushes.append(FilePush(f.name, targets, need))
            rank = {n: i for i, n in enumerate(candidates)}
            recorded = sorted(
                (n for n in holders if n != f.owner_node), key=lambda n: rank.get(n, 1 << 30)
            )
            if recorded != f.replica_nodes:
                replicas[f.name] = recorded
        claimed = {f.owner_node, *recorded}
        if len(holders) < k + 1 and not claimed <= set(holders):
            under.append(f.name)
    return HealPlan(tuple(pushes), replicas, tuple(lost), tuple(under))


OnCorrupt = Callable[[str, str, str, str, str], None]


class Healer:
    """Executes `plan_heal` for one node and keeps its health marks."""

    def __init__(
        self,
        catalog: Catalog,
        client: PeerClient,
        *,
        replica_target: Callable[[], int],
        members: Callable[[], list[Member]],
        on_corrupt: OnCorrupt,
        stop: threading.Event | None = None,
    ) -> None:
        self.catalog = catalog
        self.client = client
        self.node_id = catalog.node_id
        self._k = replica_target
        self._members = members
        self._on_corrupt = on_corrupt
        self._stop = stop
        self._lock = threading.Lock()
        self._marks: dict[Key, str] = {}

    def mark(self, namespace: str, checkpoint_id: str) -> str:
        """The health mark the last heal of a checkpoint left ("" when healthy)."""
        with self._lock:
            return self._marks.get((namespace, checkpoint_id), "")

    def heal(self, namespace: str, checkpoint_id: str) -> HealPlan | None:
        """Heal one checkpoint (None: not a committed one here); the final plan."""
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            with self._lock:  # deleted (retention, rm): its mark must not outlive it
                self._marks.pop((namespace, checkpoint_id), None)
            return None
        if view.state not in (State.COMMITTED, State.REPLICATED, State.DURABLE):
            return None
        if view.state is State.DURABLE and not any(
            f.held or f.owner_node or f.replica_nodes for f in view.files
        ):
            # Retention let it go to the persistent tier only: no memory copy is wanted,
            # so it is neither "lost" nor pushed back into a node that evicted it.
            self._record(namespace, checkpoint_id, HealPlan(), self._k())
            return None
        me = self.node_id
        holdings: dict[str, Holdings] = {
            me: Holdings(True, frozenset(f.name for f in view.files if f.held))
        }
        holdings.update(
            self.client.each(lambda node: self.client.holdings(node, namespace, checkpoint_id))
        )
        members, k = self._members(), self._k()
        plan = plan_heal(view, holdings, members, k, me)
        if plan.pushes:
            files = {f.name: f for f in view.files}
            for p in plan.pushes:
                got = 0
                for node in p.targets:
                    if got >= p.need:
                        break
                    if self._push(node, view, files[p.name], holdings[node].known):
                        had = holdings[node]
                        holdings[node] = Holdings(True, had.names | {p.name}, had.files)
                        got += 1
            plan = plan_heal(view, holdings, members, k, me)
        for name, replicas in plan.replicas.items():
            self.catalog.set_replicas(namespace, checkpoint_id, name, replicas)
            self.broadcast_replicas(namespace, checkpoint_id, name, replicas)
        self._record(namespace, checkpoint_id, plan, k)
        return plan

    def broadcast_replicas(
        self, namespace: str, checkpoint_id: str, name: str, replicas: list[str]
    ) -> None:
        self.client.each(
            lambda node: self.client.update_replicas(node, namespace, checkpoint_id, name, replicas)
        )

    def _record(self, namespace: str, checkpoint_id: str, plan: HealPlan, k: int) -> None:
        mark = plan.mark
        with self._lock:
            previous = self._marks.get((namespace, checkpoint_id), "")
            if mark:
                self._marks[(namespace, checkpoint_id)] = mark
            else:
                self._marks.pop((namespace, checkpoint_id), None)
        self.catalog.set_health(namespace, checkpoint_id, mark)
        if mark != previous:
            if plan.lost:
                logger.error(
                    "%s/%s: no reachable node holds a valid copy of %s; these files cannot "
                    "be restored until a holder comes back",
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
        metrics.UNDER_REPLICATED.set(self.catalog.unhealthy_count())

    def _push(self, node: str, view: CheckpointView, f: FileRecord, knows: bool) -> bool:
        what = f"{view.namespace}/{view.checkpoint_id}/{f.name}"
        if not knows:
            try:
                self.client.publish(node, view)
            except PeerCallError as e:
                logger.warning(
                    "cannot publish %s/%s to %s: %s",
                    view.namespace,
                    view.checkpoint_id,
                    node,
                    e.cause,
                )
                return False
        path = view.local_paths.get(f.name, "")
        if not path or f.checksums is None:
            return False
        try:
            self.client.push(node, view.namespace, view.checkpoint_id, f, self._read(path, f))
        except PeerCallError as e:
            if e.code == "DATA_LOSS":
                ok, reason = self.catalog.tier.verify_file(Path(path), f.size, f.checksums)
                if not ok:
                    self._on_corrupt(view.namespace, view.checkpoint_id, f.name, reason, "pushed")
            logger.warning("push of %s to %s failed: %s", what, node, e.cause)
            return False
        except FileNotFoundError:
            return False
        metrics.REPLICATED_BYTES.inc(f.size)
        logger.info("replicated %s to %s (%s)", what, node, format_size(f.size))
        return True

    def _read(self, path: str, f: FileRecord) -> Iterator[tuple[int, bytes]]:
        """The file's bytes in checksum blocks, unverified (the receiver verifies);
        stepping aside between blocks while a save writes, with heartbeats."""
        assert f.checksums is not None
        step = f.checksums.block_size
        aside = StepAside(self.catalog.saving, stop=self._stop)
        with open(path, "rb", buffering=0) as fh:
            pos = 0
            while pos < f.size:
                # Between blocks: a save may start mid-file.
                while aside.wait(HEARTBEAT):
                    yield pos, b""  # still here
                data = fh.read(min(step, f.size - pos))
                if not data:
                    return
                yield pos, data
                pos += len(data)
