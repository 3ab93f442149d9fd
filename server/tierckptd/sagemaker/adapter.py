"""The one door from the SageMaker HTTP API into the daemon: `SeedDaemon`.

The listener needs a handful of the daemon's operations, the same the gRPC
`DaemonService` calls for a native save and load; they are named here once, as a
Protocol, so the HTTP side never reaches into the catalog, the cluster or the restore
chain, and a restructured daemon only has to provide this adapter again.
`DaemonAdapter` implements it on the parts main.py builds.
"""

from __future__ import annotations

from typing import Protocol

from tierckpt.checksum import BlockChecksums
from tierckpt.errors import CheckpointExists, CheckpointNotFound

from tierckptd.catalog import Catalog
from tierckptd.commit import CommitCoordinator
from tierckptd.model import CheckpointView, FileRecord, State
from tierckptd.rpc.daemon_service import ClusterMarks, Discovery, LocalCopy

__all__ = ["DaemonAdapter", "SeedDaemon"]


class SeedDaemon(Protocol):
    """What the SageMaker API asks of the daemon (every call may raise a `TierckptError`)."""

    def begin(self, namespace: str, checkpoint_id: str, rank: int) -> bool:
        """Open (or join) this node's save of a checkpoint; True when this call opened it."""
        ...

    def open_file(self, namespace: str, checkpoint_id: str, name: str, rank: int, size: int) -> str:
        """Reserve `size` bytes for `rank` against the budget and create the memory-tier
        file; its path (MemoryBudgetExceeded when it cannot fit)."""
        ...

    def commit_file(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        rank: int,
        size: int,
        cs: BlockChecksums,
    ) -> None:
        """Seal a written file under its block checksums."""
        ...

    def abort(self, namespace: str, checkpoint_id: str) -> None:
        """Drop this node's unfinished save of the checkpoint and every file it holds."""
        ...

    def commit(self, namespace: str, checkpoint_id: str, required: list[str]) -> CheckpointView:
        """The cluster commit: every required file held here or by a peer, else
        CheckpointIncomplete."""
        ...

    def committed(self, namespace: str, *, relist: bool = True) -> list[CheckpointView]:
        """The namespace's committed checkpoints in every tier, oldest first; `relist`:
        ask the persistent tier for ones this node has not learnt yet (bounded wait)."""
        ...

    def lookup(self, namespace: str, checkpoint_id: str) -> CheckpointView | None:
        """A committed checkpoint known here, to a peer's gossip, or only to the
        persistent tier; None if none is."""
        ...

    def ensure_local(self, namespace: str, checkpoint_id: str, name: str) -> tuple[FileRecord, str]:
        """A local copy of one file through the restore chain: (record, path)."""
        ...

    def remove(self, namespace: str, checkpoint_id: str) -> int:
        """`tierckpt rm` of one checkpoint on every node and the persistent tier."""
        ...

    def namespaces(self) -> set[str]:
        """Namespaces this node holds checkpoints of."""
        ...

    def state(self, namespace: str, checkpoint_id: str) -> State | None:
        """This node's state of a save (WRITING, COMMITTED) or None when unknown here."""
        ...

    def held_file(
        self, namespace: str, checkpoint_id: str, name: str
    ) -> tuple[FileRecord, str] | None:
        """This node's sealed copy of one file of a save, writing or committed: (record,
        path); None when this node holds none."""
        ...

    def set_memory_keep_last(self, namespace: str, keep_last: int) -> None:
        """The namespace's own memory window (`steps_retained`), recorded by its next
        commits here and applied by every node's memory retention (InvalidArgument when
        out of range)."""
        ...


class DaemonAdapter:
    """`SeedDaemon` on the daemon's catalog, commit coordinator, cluster marks and
    restore chain, through the same calls `rpc.daemon_service.DaemonService` makes (no
    uid isolation: the listener is refused in that mode)."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        commits: CommitCoordinator,
        marks: ClusterMarks,
        restorer: LocalCopy,
        discovery: Discovery | None = None,
    ) -> None:
        self.catalog = catalog
        self.commits = commits
        self.marks = marks
        self.restorer = restorer
        self.discovery = discovery

    def begin(self, namespace: str, checkpoint_id: str, rank: int) -> bool:
        opened = not self.catalog.knows(namespace, checkpoint_id)
        self.catalog.begin(namespace, checkpoint_id, rank)
        return opened

    def open_file(self, namespace: str, checkpoint_id: str, name: str, rank: int, size: int) -> str:
        if name in self.catalog.local_committed_files(namespace, checkpoint_id):
            # Before reserving: a blob sent twice is a conflict, never a budget question
            # (`SeedCheckpoints.put` answers an identical one before it gets here).
            raise CheckpointExists(
                f"{namespace}/{checkpoint_id}: {name} is already stored on node "
                f"{self.catalog.node_id}; a step's blob is written once"
            )
        self.catalog.reserve(namespace, checkpoint_id, rank, size)
        path, _ = self.catalog.open_file(namespace, checkpoint_id, name, rank)
        return path

    def commit_file(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        rank: int,
        size: int,
        cs: BlockChecksums,
    ) -> None:
        self.catalog.commit_file(
            namespace,
            checkpoint_id,
            name,
            rank,
            size,
            algorithm=cs.algorithm,
            block_size=cs.block_size,
            digests=cs.digests,
        )

    def abort(self, namespace: str, checkpoint_id: str) -> None:
        try:
            self.catalog.abort(namespace, checkpoint_id)
        except CheckpointNotFound:
            pass  # already collected (the sweeper, or a concurrent failure)

    def commit(self, namespace: str, checkpoint_id: str, required: list[str]) -> CheckpointView:
        return self.commits.commit(namespace, checkpoint_id, required, durable=False, holders=[])

    def committed(self, namespace: str, *, relist: bool = True) -> list[CheckpointView]:
        if relist and self.discovery is not None:
            self.discovery.refresh(namespace)
        return self.catalog.list_checkpoints(namespace)

    def lookup(self, namespace: str, checkpoint_id: str) -> CheckpointView | None:
        try:
            return self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            if self.discovery is None or not self.discovery.probe(namespace, checkpoint_id):
                return None
        try:
            return self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return None

    def ensure_local(self, namespace: str, checkpoint_id: str, name: str) -> tuple[FileRecord, str]:
        return self.restorer.ensure_local(namespace, checkpoint_id, name, False, timed=True)

    def remove(self, namespace: str, checkpoint_id: str) -> int:
        if self.discovery is not None and not self.catalog.knows(namespace, checkpoint_id):
            self.discovery.probe(namespace, checkpoint_id)
        freed, _ = self.marks.remove(namespace, checkpoint_id)
        return freed

    def namespaces(self) -> set[str]:
        return set(self.catalog.status().namespaces)

    def state(self, namespace: str, checkpoint_id: str) -> State | None:
        return self.catalog.holdings(namespace, checkpoint_id)[0]

    def held_file(
        self, namespace: str, checkpoint_id: str, name: str
    ) -> tuple[FileRecord, str] | None:
        f = self.catalog.local_committed_files(namespace, checkpoint_id).get(name)
        if f is None:
            return None
        return f, str(self.catalog.tier.file_path(namespace, checkpoint_id, name))

    def set_memory_keep_last(self, namespace: str, keep_last: int) -> None:
        self.catalog.set_memory_keep_last(namespace, keep_last)
