"""Retention policy of the persistent tier, as a pure function.

Inputs are only checkpoints that are already durable (``.metadata`` in the persistent
tier). Because the newest of them is never evicted, every eviction is of a checkpoint
older than one that is durable: an older copy goes only after a newer one is safe. A
checkpoint still draining is not durable, so it neither counts towards `keep_last` nor
displaces anything until it lands.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierckpt.names import step_of

__all__ = ["persistent_evictions"]


def persistent_evictions(
    durable: Iterable[tuple[str, int]],
    keep_last: int,
    keep_every: int,
    pinned: Iterable[str] = (),
) -> list[str]:
    """Ids of durable checkpoints to delete from the persistent tier, oldest first.

    Args:
        durable: ``(checkpoint_id, sequence)`` of every durable checkpoint of one
            namespace; a larger sequence is newer (commit order, or the step).
        keep_last: keep the newest `keep_last`; 0 keeps everything (nothing is evicted).
        keep_every: also keep every checkpoint whose step (the id's trailing integer,
            `tierckpt.names.step_of`) is a multiple of it; 0 turns this off. Ids without
            a step are not kept by this rule.
        pinned: ids never evicted.

    Returns:
        The ids to delete, oldest first; never the newest durable checkpoint.
    """
    if keep_last <= 0:
        return []
    keep = set(pinned)
    ordered = sorted(dict(durable).items(), key=lambda item: item[1], reverse=True)
    evict: list[str] = []
    for rank, (checkpoint_id, _sequence) in enumerate(ordered):
        if rank < keep_last or checkpoint_id in keep:
            continue
        step = step_of(checkpoint_id)
        if keep_every > 0 and step is not None and step % keep_every == 0:
            continue
        evict.append(checkpoint_id)
    evict.reverse()
    return evict
