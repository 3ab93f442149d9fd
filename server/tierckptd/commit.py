"""The commit coordinator: where a save's CommitCheckpoint goes.

One place decides a commit, in three steps:

1. ask the holders for the required files this node does not hold (only when the daemon
   has a peer tier: `Holders`, `peers.commit.Committer`);
2. commit the catalog (`Catalog.commit`: the manifest, retention, and the catalog's own
   committed event, which enqueues the drain and the next-save prewarm under its lock,
   as a manifest a peer publishes does);
3. tell the listeners (`CommitListener`: the peer tier publishes the manifest to the
   nodes it involves and queues the heal).

A one-node commit is rpc -> coordinator -> catalog: this module imports nothing of
`tierckptd.peers` (a test checks it), the peer tier is handed in by main.py, and while the
node has no peers (`peers_changed`, told by the membership) it is not called at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tierckpt.names import FORMAT_DCP

from tierckptd.catalog import Catalog
from tierckptd.model import CheckpointView, FileRecord
from tierckptd.ops.faults import fault

__all__ = ["CommitCoordinator", "CommitListener", "Holders"]


class Holders(Protocol):
    """Who else may hold a save's files (the peer tier)."""

    def remote_files(
        self, namespace: str, checkpoint_id: str, missing: set[str], hinted: Sequence[str]
    ) -> dict[str, FileRecord]:
        """The files of `missing` that other nodes hold, each with its owner;
        `hinted`: the nodes the ranks wrote to (the writer's hint, only an ordering)."""
        ...


class CommitListener(Protocol):
    """Told of each checkpoint this node's coordinator role committed."""

    def committed(self, view: CheckpointView) -> None: ...


class CommitCoordinator:
    """Asks the holders, commits the catalog, tells the listeners.

    Args:
        holders: the peer tier's view of files held elsewhere; None on a daemon without
            a peer tier (every required file must be here).
        listeners: told after each commit, in order (the peer tier's publish and heal).
        peers: how many peers the node has now; holders and listeners are asked only
            while it has some (`peers_changed` keeps it current).
    """

    def __init__(
        self,
        catalog: Catalog,
        holders: Holders | None = None,
        listeners: Sequence[CommitListener] = (),
        *,
        peers: int = 1,
    ) -> None:
        self.catalog = catalog
        self._holders = holders
        self._listeners = tuple(listeners)
        self._peered = peers > 0

    def peers_changed(self, count: int) -> None:
        """The node's peers now (the membership's `resized`): none, and a commit asks
        and tells nobody but the catalog."""
        self._peered = count > 0

    def commit(
        self,
        namespace: str,
        checkpoint_id: str,
        required: list[str],
        *,
        durable: bool = False,
        holders: Sequence[str] = (),
        checkpoint_format: str = FORMAT_DCP,
    ) -> CheckpointView:
        """The DCP coordinator's commit. `durable` (the hint) travels in the manifest:
        every owner drains its files of the checkpoint. `holders`: the nodes the ranks
        wrote to (unverified; only an ordering of whom to ask first). `checkpoint_format`:
        `tierckpt.names.FORMATS` (validated by the caller), kept in the manifest."""
        remote: dict[str, FileRecord] = {}
        peered = self._peered
        if self._holders is not None and peered:
            local = self.catalog.local_committed_files(namespace, checkpoint_id)
            missing = {r for r in required if r not in local}
            if missing:
                remote = self._holders.remote_files(namespace, checkpoint_id, missing, holders)
        view = self.catalog.commit(
            namespace,
            checkpoint_id,
            required,
            remote,
            durable=durable,
            checkpoint_format=checkpoint_format,
        )
        fault("commit.before_publish")
        for listener in self._listeners if peered else ():
            listener.committed(view)
        return view
