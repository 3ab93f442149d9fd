"""Placement of replicas: which buddies hold the extra copies of a file.

Rendezvous (highest random weight) hashing on "namespace/checkpoint_id/file": every node
gets a score per file and the best-scoring nodes win, so every daemon computes the same
buddies without talking, and adding or removing one node only moves the files whose
choice involved that node. Nodes in a failure domain other than the owner's come first;
the owner is never its own buddy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from tierckptd.model import FileRecord, coordinator_of

__all__ = [
    "Member",
    "buddies",
    "coordinator_of",
    "file_key",
    "interested",
    "neighbourhood",
    "preference",
    "replica_count",
]


@dataclass(frozen=True)
class Member:
    """A node of the cluster as placement sees it."""

    id: str
    failure_domain: str = ""

    @property
    def domain(self) -> str:
        return self.failure_domain or self.id


def file_key(namespace: str, checkpoint_id: str, name: str) -> str:
    return f"{namespace}/{checkpoint_id}/{name}"


def _score(node_id: str, key: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{node_id}\0{key}".encode())


def preference(key: str, owner: str, members: Sequence[Member]) -> list[str]:
    """Every member but the owner, best buddy first: other failure domains first, then
    by rendezvous score (ties, impossible in practice, by id)."""
    domains = {m.id: m.domain for m in members}
    owner_domain = domains.get(owner, owner)
    others = {m.id: m for m in members if m.id != owner}
    return sorted(
        others,
        key=lambda n: (others[n].domain == owner_domain, -_score(n, key), n),
    )


def replica_count(copies: int, members: Sequence[Member]) -> int:
    """k: the extra copies that can exist, min(copies, number of other nodes)."""
    return max(0, min(copies, len({m.id for m in members}) - 1))


def buddies(key: str, owner: str, members: Sequence[Member], copies: int) -> list[str]:
    """The `k` buddies of a file (k capped by membership), best first."""
    return preference(key, owner, members)[: replica_count(copies, members)]


def spare_width(k: int) -> int:
    """How many placement candidates know a file's manifest: its k buddies and one spare
    (at least two), so the next candidate already knows it when a buddy is down."""
    return max(k + 1, 2)


def neighbourhood(
    key: str, owner: str, replicas: Sequence[str], members: Sequence[Member], k: int
) -> set[str]:
    """The nodes a file's commit, healing and replica lists involve: its owner, the nodes
    recorded holding a copy, and its first `spare_width(k)` placement candidates. Its
    size does not grow with the cluster: at most 1 + len(replicas) + max(k + 1, 2)."""
    near = {owner, *replicas, *preference(key, owner, members)[: spare_width(k)]}
    near.discard("")
    return near


def interested(
    namespace: str,
    checkpoint_id: str,
    files: Iterable[FileRecord],
    members: Sequence[Member],
    k: int,
) -> set[str]:
    """The nodes a commit publishes to: every file's neighbourhood. Other nodes learn
    the manifest by gossip."""
    nodes: set[str] = set()
    for f in files:
        key = file_key(namespace, checkpoint_id, f.name)
        nodes |= neighbourhood(key, f.owner_node, f.replica_nodes, members, k)
    return nodes
