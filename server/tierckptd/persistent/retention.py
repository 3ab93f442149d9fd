"""Retention policy of the persistent tier: a pure function, and how a daemon applies it.

Inputs are only checkpoints that are already durable (``.metadata`` in the persistent
tier). Because the newest of them is never evicted, every eviction is of a checkpoint
older than one that is durable: an older copy goes only after a newer one is safe. A
checkpoint still draining is not durable, so it neither counts towards `keep_last` nor
displaces anything until it lands.

`PersistentRetention` applies it. Only the node that commits a checkpoint's `.metadata`
deletes (right after it did, `apply`); pinned checkpoints, by this node or by a cluster
pin mark, never. Every other node may learn a checkpoint is durable
after that node already retired it; `superseded` tells such a node, from the same pure
policy over the tier's listing, that the checkpoint is no longer due, so it does not pin
it in memory forever waiting for a durability it will never see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from tierckpt.errors import TIER_UNAVAILABLE_PREFIX, CheckpointNotFound, TierUnavailable
from tierckpt.names import step_of

from tierckptd.catalog import Catalog
from tierckptd.config_secrets import redact
from tierckptd.persistent.errors import tier_label
from tierckptd.persistent.listing import remove_index_entry
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.store import PersistentTier, step_order

__all__ = ["PersistentRetention", "persistent_evictions", "remove_checkpoint"]

logger = logging.getLogger(__name__)


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


class PersistentRetention:
    """``persistent_keep_last``/``persistent_keep_every`` for one daemon (module doc)."""

    def __init__(
        self,
        catalog: Catalog,
        keep_last: int,
        keep_every: int,
        on_evicted: Callable[[str, str], None] | None = None,
    ) -> None:
        """`on_evicted` tells every other node (main.py wires the cluster's DELETED
        mark): they drop their copies and their listing of it at once, not at their next
        relist of S3."""
        self.catalog = catalog
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.on_evicted = on_evicted

    def apply(self, tier: PersistentTier, namespace: str) -> None:
        """On the committer, after a commit: delete what the policy evicts (`.metadata`
        first); the newest committed checkpoint and pinned ones are kept."""
        if self.keep_last <= 0:
            return
        durable = tier.list_durable(namespace)
        pinned = sorted(self.catalog.pinned_ids(namespace))  # cluster pins included
        try:
            pinned.append(self.catalog.get(namespace).checkpoint_id)  # the newest, always
        except CheckpointNotFound:
            pass
        ordered = [(cid, i) for i, cid in enumerate(durable)]
        for cid in persistent_evictions(ordered, self.keep_last, self.keep_every, pinned):
            remove_index_entry(tier, namespace, cid)  # first: never lists a partial one
            tier.delete(namespace, cid)
            self.catalog.forget_persistent(namespace, cid)
            if self.on_evicted is not None:
                self.on_evicted(namespace, cid)
            logger.info(
                "evicted %s/%s from the persistent tier (persistent_keep_last=%d, "
                "persistent_keep_every=%d)",
                namespace,
                cid,
                self.keep_last,
                self.keep_every,
            )

    def superseded(self, tier: PersistentTier, namespace: str, checkpoint_id: str) -> bool:
        """Whether the policy deletes the checkpoint as soon as it is durable (`keep_last`
        newer ones already are, and `keep_every` does not keep it); if so it is retired
        (no longer due). For nodes that do not commit it: the committer may have drained
        and deleted it before they probed it durable."""
        if self.keep_last <= 0:
            return False
        durable = tier.list_durable(namespace)
        ids = sorted({*durable, checkpoint_id}, key=step_order)
        ordered = [(cid, i) for i, cid in enumerate(ids)]
        pinned = self.catalog.pinned_ids(namespace)  # kept: it must drain like any other
        if checkpoint_id not in persistent_evictions(
            ordered, self.keep_last, self.keep_every, pinned
        ):
            return False
        self.catalog.retire(namespace, checkpoint_id)
        logger.info(
            "%s/%s: not drained here: %d newer checkpoints are durable, so persistent "
            "retention (persistent_keep_last=%d) deletes it; memory retention may evict it",
            namespace,
            checkpoint_id,
            len(ids) - 1 - ids.index(checkpoint_id),
            self.keep_last,
        )
        return True


def remove_checkpoint(stores: Roots, namespace: str, checkpoint_id: str, url: str) -> bool:
    """A cluster rm in the persistent tier the checkpoint drained to (`url`, "" for
    `[persistent] url`): `.metadata` first, so no reader or discovery ever sees a
    half-deleted checkpoint as durable, then its data, bookkeeping and index entry.
    Idempotent; True when it was durable there. A URL this node has no tier for (none,
    or not allowed) has nothing it could delete: logged, False.

    Raises:
        TierUnavailable: the tier did not answer (the caller retries).
    """
    tier = stores.tier(url)
    if tier is None:
        logger.warning(
            "rm %s/%s: no persistent tier %s on this node: nothing deleted there",
            namespace,
            checkpoint_id,
            redact(url) or "([persistent] url is not set)",
        )
        return False
    try:
        found = tier.is_durable(namespace, checkpoint_id)
        tier.delete(namespace, checkpoint_id)  # .metadata first
        remove_index_entry(tier, namespace, checkpoint_id)
    except OSError as e:  # PersistentTierUnavailable, a 403, ...
        raise TierUnavailable(
            f"{TIER_UNAVAILABLE_PREFIX}{tier_label(tier.url)}: cannot delete "
            f"{namespace}/{checkpoint_id}: {tier.backend.describe(e)}"
        ) from None
    logger.info(
        "rm %s/%s: %s the persistent tier %s",
        namespace,
        checkpoint_id,
        "deleted from" if found else "not durable in",
        tier_label(tier.url),
    )
    return found
