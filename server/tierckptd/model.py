"""Domain model shared by every tier: checkpoints, their files, and node status (the
client's `tierckpt.records.NodeStatus`, the one type both sides use).

Plain dataclasses so that the catalog, the tiers, manifests and retention never see
protobuf types; `tierckptd.wire` translates them to and from the wire (for `rpc/` and the
peer client), and the import-direction test keeps protobuf there.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from tierckpt.checksum import BlockChecksums
from tierckpt.names import FORMAT_DCP, METADATA_FILE
from tierckpt.records import NodeStatus  # one record for client and daemon
from tierckpt.trust import Trust as TrustState  # model.Trust is the newest-binding one

# Bounds of what a peer may send. The client writes 1 MiB blocks (DEFAULT_BLOCK_SIZE);
# the floor keeps a manifest's digests at most 1/4096 of the bytes it describes, the
# ceiling keeps a pushed chunk (one block) and a fetched one (4 blocks) within the
# peer port's message limit.
MAX_SEQUENCE = 2**63 - 1
MAX_FILE_SIZE = 2**62 - 1
MAX_FILES = 100_000
MAX_REPLICAS = 64
MIN_BLOCK_SIZE = 64 << 10
MAX_BLOCK_SIZE = 16 << 20
# A namespace's own memory window (`CheckpointRecord.memory_keep_last`): 0 (none) up to
# this; a manifest naming more is refused where it enters (disk, peer, persistent tier).
MAX_NAMESPACE_KEEP_LAST = 1 << 20
# Clocks of a cluster disagree: a peer's timestamp more than this ahead of this node's
# clock is reported as skew (metric, status, a warning), then clamped to "now"; time never
# orders checkpoints (the sequence does), so a skewed node still replicates.
CLOCK_SKEW = 300.0


__all__ = [
    "CheckpointRecord",
    "CheckpointView",
    "TrustMark",
    "FileRecord",
    "Key",
    "NodeStatus",
    "State",
    "Trust",
    "coordinator_of",
]

# A checkpoint's identity: (namespace, checkpoint_id).
Key = tuple[str, str]


class State(enum.Enum):
    """Lifecycle states the memory tier uses (names match common.proto CheckpointState)."""

    WRITING = "WRITING"
    COMMITTED = "COMMITTED"
    REPLICATED = "REPLICATED"  # a view of a COMMITTED record: every file has k extra copies
    ABORTED = "ABORTED"
    DURABLE = "DURABLE"  # a view of a COMMITTED record whose .metadata is in the persistent tier
    # A view of a COMMITTED record some file of which has no copy left on any tier (the
    # healer's finding); never loaded, never the newest. Heals back if a copy reappears.
    LOST = "LOST"


class Trust(enum.Enum):
    """Whether a checkpoint may be its namespace's newest here (audit 3, H2).

    A namespace is bound to the nodes that write it: its writers on this node are the
    coordinators of its PROVEN checkpoints, or, while it has none, of its VOUCHED ones.
    Only a checkpoint whose coordinator is a writer (or with no coordinator left: one
    the persistent tier holds) is ever "newest" / `latest`; the others are listed and
    held, but a job never restores one unless it names it.
    """

    # Committed here, saved with files this node's ranks wrote (this node took part in
    # the save), or found in this node's persistent tier.
    PROVEN = "proven"
    # A peer's, coordinated by a writer of the namespace: on a node that had no binding
    # of it at start-up, a writer a majority of its peers state (`commit.quorum`); for a
    # namespace new to a running node, the first coordinator publishing its own save.
    VOUCHED = "vouched"
    # A peer's, whose coordinator does not write the namespace here.
    FOREIGN = "foreign"


@dataclass
class FileRecord:
    """One DCP file of a checkpoint; `checksums` is None while the file is open.

    `held` says whether this node's memory tier has a verified copy (the owner after
    commit, a replica holder after a push or fetch); a manifest published by a peer lists
    files held elsewhere with `held` False. `replica_nodes` are the nodes other than the
    owner holding a verified copy.
    """

    name: str
    rank: int
    size: int = 0
    checksums: BlockChecksums | None = None
    owner_node: str = ""
    replica_nodes: list[str] = field(default_factory=list)
    held: bool = True
    # Written into pages this save allocated (no warm segment): touched once, so when
    # the file is recycled the next-save warmer touches them again (`WarmPool.activate`).
    fresh_pages: bool = False

    @property
    def committed(self) -> bool:
        return self.checksums is not None


@dataclass
class CheckpointRecord:
    """Mutable catalog entry; guarded by the catalog lock."""

    namespace: str
    checkpoint_id: str
    state: State
    created_unix: float
    node_id: str
    committed_unix: float = 0.0
    sequence: int = 0
    pinned: bool = False
    # Committed with the "make this one durable" hint: due for the persistent tier
    # whatever `[persistent] every` says (kept in its manifest and published manifest).
    durable_requested: bool = False
    # Where it drains: "" for `[persistent] url`, else the namespace's URL when it was
    # committed (`tierckpt.names.check_persistent_url` grammar; policy checked at use).
    persistent_url: str = ""
    # The namespace's memory window when it was committed (`Catalog.set_memory_keep_last`,
    # 0: none): the memory tier keeps at most that many of the coordinator's newest,
    # within `[retention] memory_keep_last`. Travels with the manifest, so every node
    # holding the namespace's checkpoints (a replacement one too) applies the same window.
    memory_keep_last: int = 0
    # Its format (`tierckpt.names.FORMATS`): "dcp" (`.metadata` commits it), or "files"
    # (any other format's files, moved byte for byte and never decoded). Travels with
    # the manifest, so every node drains and restores it the same way.
    checkpoint_format: str = FORMAT_DCP
    # With `[security] local_isolation = "uid"`: the uid owning the namespace when it was
    # saved, and the node where that claim was made (None / "": saved without isolation).
    # Travels with the manifest; every isolating node refuses it to other uids.
    owner_uid: int | None = None
    owner_claim_node: str = ""
    files: dict[str, FileRecord] = field(default_factory=dict)
    # (rank -> bytes reserved and not yet charged by a committed file); WRITING only.
    reservations: dict[int, int] = field(default_factory=dict)
    last_activity: float = 0.0  # catalog clock, WRITING only
    begun: float = 0.0  # catalog (monotonic) clock at BeginCheckpoint, WRITING only
    trust: Trust = Trust.PROVEN  # see `Trust` (kept in the manifest)

    @property
    def key(self) -> Key:
        return (self.namespace, self.checkpoint_id)

    @property
    def committed_bytes(self) -> int:
        return sum(f.size for f in self.files.values() if f.committed)

    @property
    def held_bytes(self) -> int:
        """Bytes of this checkpoint's files in this node's memory tier (the budget's C)."""
        return sum(f.size for f in self.files.values() if f.committed and f.held)

    @property
    def order(self) -> tuple[int, float]:
        """Commit order that agrees across nodes: the coordinator's sequence, a
        Lamport-style counter (every node commits above any sequence it has taken from a
        writer of the namespace), never wall time; time only breaks a tie (two
        coordinators that never heard of each other's commits)."""
        return (self.sequence, self.committed_unix)


@dataclass(frozen=True)
class CheckpointView:
    """Immutable snapshot of a checkpoint handed out of the catalog lock."""

    namespace: str
    checkpoint_id: str
    state: State
    size_bytes: int
    created_unix: float
    committed_unix: float
    sequence: int
    pinned: bool
    files: tuple[FileRecord, ...]
    local_paths: dict[str, str]  # "" for a file this node does not hold
    tiers: tuple[str, ...] = ()
    durable_requested: bool = False
    persistent_url: str = ""
    memory_keep_last: int = 0  # CheckpointRecord.memory_keep_last
    checkpoint_format: str = FORMAT_DCP  # CheckpointRecord.checkpoint_format
    lost_files: tuple[str, ...] = ()  # with state LOST: the files no tier holds
    owner_uid: int | None = None  # CheckpointRecord.owner_uid
    owner_claim_node: str = ""
    trust: TrustState | None = None  # the newest trust mark (`tierckpt mark`), None: unmarked
    trust_reason: str = ""


@dataclass(frozen=True)
class TrustMark:
    """A checkpoint's newest trust mark as the catalog and the persistent tier see it (the
    cluster mark journal owns it: `peers.cluster_marks`)."""

    trust: TrustState
    reason: str = ""
    stamp: float = 0.0  # the origin's wall clock when it marked
    origin: str = ""  # the node a user asked


def commit_anchor(files: Mapping[str, FileRecord], checkpoint_format: str = FORMAT_DCP) -> str:
    """The name of the file whose holder commits the checkpoint in the persistent tier:
    DCP's `.metadata`; for a "files" checkpoint the coordinator's (`coordinator_of`):
    `.metadata` when one is there (only a name: never decoded), else the first by name.
    "" for none."""
    if checkpoint_format == FORMAT_DCP:
        return METADATA_FILE
    if METADATA_FILE in files:
        return METADATA_FILE
    return min(files, default="")


def coordinator_of(files: Mapping[str, FileRecord]) -> str:
    """The node that coordinates a checkpoint's commit: the owner of its `.metadata`
    (the DCP coordinator rank writes it and commits on its own node); without one, the
    owner of the first file by name. "" when no owner is recorded (persistent only).

    Only this node may publish the checkpoint's manifest to peers, and retention groups
    checkpoints by it, so a peer's checkpoints never push another node's out of memory.
    """
    meta = files.get(METADATA_FILE)
    if meta is not None:
        return meta.owner_node
    first = min(files, default=None)
    return files[first].owner_node if first is not None else ""
