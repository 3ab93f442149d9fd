"""The records client and daemon share: what a checkpoint, one of its files and a node's
status are, defined once.

The daemon answers with these types (its GetStatus builds a `NodeStatus`), the client
returns them; the wire translation on each side copies fields by name
(`scalar_fields`), so a field added here and to daemon.proto reaches `tierckpt status`
without another list to update. Pure data: no gRPC, no protobuf, no daemon imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tierckpt.checksum import BlockChecksums
from tierckpt.errors import CheckpointIncomplete
from tierckpt.memory_files import VerifiedFile
from tierckpt.trust import Trust

__all__ = ["CheckpointInfo", "FileEntry", "NodeStatus", "OpenedFile", "PeerMarks"]


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as a daemon knows it: where the bytes are on this node
    (`local_path`, "" when it holds no copy), who wrote it and who holds copies, and the
    block checksums every read is verified against."""

    name: str
    size: int
    checksums: BlockChecksums | None  # None while the file is still being written
    rank: int
    owner_node: str
    replica_nodes: tuple[str, ...]
    local_path: str

    def open_verified(self, what: str) -> VerifiedFile:
        """The local copy for verified reads; refuses a file that was never committed."""
        if self.checksums is None or not self.local_path:
            raise CheckpointIncomplete(f"{what} is not committed on this node; it cannot be read")
        return VerifiedFile(self.local_path, self.size, self.checksums, what=what)


@dataclass(frozen=True)
class PeerMarks:
    """What the peers did with a cluster rm/pin/unpin this daemon made: how many applied
    it (or had nothing of the checkpoint), which have not answered yet (the daemon keeps
    retrying them, and they learn it when they next pull its manifests), which refused."""

    applied: int = 0
    pending: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()

    def summary(self) -> str:
        """Like "2 applied, pending: n3", for a human."""
        text = f"{self.applied} applied"
        if self.pending:
            text += f", pending: {', '.join(self.pending)}"
        if self.refused:
            text += f", refused by: {', '.join(self.refused)}"
        return text


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as a daemon answers for it: its state (WRITING, COMMITTED,
    REPLICATED, DURABLE, LOST, ...), the tiers that can serve it, and (from GetCheckpoint
    and EnsureLocal) its files."""

    namespace: str
    checkpoint_id: str
    state: str
    size_bytes: int
    file_count: int
    created_unix: float
    committed_unix: float
    sequence: int
    tiers: tuple[str, ...]
    pinned: bool
    files: tuple[FileEntry, ...] = field(default=())
    durable_requested: bool = False  # committed with the "make this one durable" hint
    persistent_url: str = ""  # where it drains; "" is the daemon's `[persistent] url`
    lost_files: tuple[str, ...] = ()  # state LOST: the files no tier holds any more
    trust: Trust | None = None  # `tierckpt mark`: VERIFIED or BAD, None unmarked
    trust_reason: str = ""
    checkpoint_format: str = "dcp"  # `tierckpt.names.FORMATS`: "dcp" or "files"

    def file(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise KeyError(f"{self.namespace}/{self.checkpoint_id} has no file {name!r}")

    def to_json(self) -> dict[str, Any]:
        """The `tierckpt ls --json` row: stable keys for scripts."""
        return {
            "namespace": self.namespace,
            "id": self.checkpoint_id,
            "state": self.state,
            "bytes": self.size_bytes,
            "files": self.file_count,
            "created": self.created_unix,
            "committed": self.committed_unix or None,
            "sequence": self.sequence,
            "tiers": list(self.tiers),
            "pinned": self.pinned,
            "lost_files": list(self.lost_files),
            "trust": self.trust.value if self.trust is not None else None,
            "trust_reason": self.trust_reason,
            "format": self.checkpoint_format,
        }


@dataclass(frozen=True)
class OpenedFile:
    """A file of a save in progress, opened by the daemon in its memory tier: the path the
    client writes in place, and how many bytes of it a recycled warm segment already
    backs (0: a new file)."""

    path: str
    preallocated_bytes: int


@dataclass(frozen=True)
class NodeStatus:
    """One daemon's memory tier and what it serves: the daemon's `status()` builds it,
    GetStatus carries it (namespaces and freshness limited to what the caller may see),
    `tierckpt status` shows it."""

    node_id: str
    failure_domain: str
    memory_dir: str
    budget_bytes: int
    used_bytes: int
    reserved_bytes: int  # promised to saves in progress, not written yet
    pool_bytes: int  # warm segments kept for the next save
    checkpoints: int  # committed ones in this node's catalog
    namespaces: tuple[str, ...]
    version: str
    # Warm pool: bytes the next-save prewarm has planned and not made yet, prewarmed
    # segments waiting for a save, prewarmed bytes saves used; files saves opened warm
    # (hits) or cold (misses) since the daemon started.
    prewarm_pending_bytes: int = 0
    prewarm_ready_bytes: int = 0
    prewarm_used_bytes: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    # {peer: seconds its clock was ahead of this node's at its latest new manifest}
    # (shown, never trusted for order)
    peer_clocks: dict[str, float] = field(default_factory=dict)
    # {namespace: {tier: newest commit time}} (`tierckpt.freshness`): the RPO view
    freshness: dict[str, dict[str, float]] = field(default_factory=dict)

    @staticmethod
    def scalar_fields() -> tuple[str, ...]:
        """The fields daemon.proto's NodeStatus carries under the same name and type; the
        rest (namespaces, peer_clocks, freshness) have a wire shape of their own."""
        structured = {"namespaces", "peer_clocks", "freshness"}
        return tuple(f.name for f in dataclasses.fields(NodeStatus) if f.name not in structured)
