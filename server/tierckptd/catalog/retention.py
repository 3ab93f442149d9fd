"""Retention policy of the memory tier, as a pure function of a catalog snapshot.

Pure so it can be tested exhaustively without files; the catalog applies the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tierckptd.model import CheckpointRecord, coordinator_of

__all__ = ["Candidate", "effective_window", "evictions_by_coordinator", "memory_evictions"]


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint of one namespace as retention sees it."""

    checkpoint_id: str
    sequence: int
    pinned: bool = False
    lost: bool = False  # listed LOST: some file has no copy left


def memory_evictions(committed: Iterable[Candidate], keep_last: int) -> list[str]:
    """Ids to evict so that the newest `keep_last` committed checkpoints remain.

    `keep_last` = 0 means unlimited. Pinned checkpoints are never evicted and do not count
    against `keep_last`'s window either way; the newest checkpoint is never evicted
    (invariant 6), which holds because keep_last >= 1 always keeps it.
    """
    if keep_last <= 0:
        return []
    ordered = sorted(committed, key=lambda c: c.sequence, reverse=True)
    kept = [c for c in ordered if not c.lost][:keep_last]
    # A LOST checkpoint never takes a complete one's place in the window; it goes once
    # `keep_last` complete ones newer than it are kept.
    floor = kept[-1].sequence if len(kept) == keep_last else -1
    return [
        c.checkpoint_id
        for c in ordered
        if c not in kept and not c.pinned and (not c.lost or c.sequence < floor)
    ]


def effective_window(keep_last: int, namespace_keep_last: int) -> int:
    """The memory window of a namespace: `[retention] memory_keep_last` (0: unlimited)
    narrowed by the namespace's own (`CheckpointRecord.memory_keep_last`, 0: none); the
    stricter wins, and a namespace's window never widens `[retention]`'s."""
    if namespace_keep_last <= 0:
        return keep_last
    if keep_last <= 0:
        return namespace_keep_last
    return min(keep_last, namespace_keep_last)


def evictions_by_coordinator(
    committed: Iterable[CheckpointRecord],
    keep_last: int,
    held: Callable[[CheckpointRecord], bool],
    lost: Callable[[CheckpointRecord], bool] = lambda r: False,
) -> list[str]:
    """Ids of one namespace's committed checkpoints to evict from memory.

    `memory_keep_last` applies per coordinator (invariant 10): checkpoints a peer
    publishes never count against, nor push out, those another node (this one included)
    coordinates. One job has one coordinator, so this is the plain window; a job whose
    coordinator moved keeps the old one's last checkpoints until they are removed
    (`tierckpt rm`). Each group's window is `effective_window` of `keep_last` and the
    namespace window its newest checkpoint recorded at commit (the namespace's current
    setting, which the manifest carried to every node). A checkpoint `held` (pinned, or
    due for the persistent tier and not durable there yet: invariant 6) is never evicted;
    a `lost` one (listed LOST) does not count against the window.
    """
    groups: dict[str, list[CheckpointRecord]] = {}
    for r in sorted(committed, key=lambda r: r.order):
        groups.setdefault(coordinator_of(r.files), []).append(r)
    return [
        checkpoint_id
        for group in groups.values()
        for checkpoint_id in memory_evictions(
            [Candidate(r.checkpoint_id, i, held(r), lost(r)) for i, r in enumerate(group, start=1)],
            effective_window(keep_last, group[-1].memory_keep_last),
        )
    ]
