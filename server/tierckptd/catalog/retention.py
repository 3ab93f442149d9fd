"""Retention policy of the memory tier, as a pure function of a catalog snapshot.

Pure so it can be tested exhaustively without files; the catalog applies the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Candidate", "memory_evictions"]


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint of one namespace as retention sees it."""

    checkpoint_id: str
    sequence: int
    pinned: bool = False


def memory_evictions(committed: Iterable[Candidate], keep_last: int) -> list[str]:
    """Ids to evict so that the newest `keep_last` committed checkpoints remain.

    `keep_last` = 0 means unlimited. Pinned checkpoints are never evicted and do not count
    against `keep_last`'s window either way; the newest checkpoint is never evicted
    (invariant 6), which holds because keep_last >= 1 always keeps it.
    """
    if keep_last <= 0:
        return []
    ordered = sorted(committed, key=lambda c: c.sequence, reverse=True)
    return [c.checkpoint_id for c in ordered[keep_last:] if not c.pinned]
