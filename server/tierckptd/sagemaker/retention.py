"""A namespace's `steps_retained` (what the client sends when it creates the namespace):
the memory tier keeps at most that many of its newest committed steps, by commit order.

Applied by the node that commits a step (the one the metadata blob reached) right after
the commit, as a cluster `tierckpt rm` of each step that falls out of the window, so
every node drops it (the rm's mark travels to them) and none keeps it listed. The window
is `tierckptd.catalog.retention.memory_evictions`, the daemon's own: the newest step is
never dropped, a LOST step never takes a complete one's place, and `[retention]
memory_keep_last` keeps applying on every node beside it (the stricter wins).

Never dropped, whatever the window: a pinned step; one due for the persistent tier and
not durable there yet (invariant 6); and one already durable there, because an rm would
delete it from the persistent tier too and `steps_retained` (3 unless the client is
built with another value: the writer offers no knob) is a memory-tier setting. A durable
step leaves memory by `[retention] memory_keep_last` and stays listed and restorable from
the persistent tier. Steps still being written are not committed, so never candidates.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from tierckpt.errors import TierckptError, TierUnavailable

from tierckptd.catalog.retention import Candidate, memory_evictions
from tierckptd.model import CheckpointView, State
from tierckptd.sagemaker.adapter import SeedDaemon

__all__ = ["apply_window", "window_evictions"]

logger = logging.getLogger(__name__)


def window_evictions(
    committed: Sequence[CheckpointView], keep: int, held: Collection[str] = ()
) -> list[str]:
    """Ids of the namespace's committed steps (oldest first, by commit order) that fall
    out of a window of `keep`; `held`: ids that must stay whatever the window."""
    return memory_evictions(
        [
            Candidate(
                v.checkpoint_id,
                i,
                pinned=v.pinned or v.state is State.DURABLE or v.checkpoint_id in held,
                lost=v.state is State.LOST,
            )
            for i, v in enumerate(committed, start=1)
        ],
        keep,
    )


def apply_window(
    daemon: SeedDaemon, namespace: str, committed: Sequence[CheckpointView], keep: int
) -> list[str]:
    """Remove, cluster-wide, the steps out of the window; the ids removed. A step that
    cannot be removed (another job's node, the persistent tier down) is logged and left
    to the daemon's own retention: the save that triggered this has committed already."""
    removed: list[str] = []
    for checkpoint_id in window_evictions(committed, keep, daemon.memory_held(namespace)):
        try:
            daemon.remove(namespace, checkpoint_id)
        except TierUnavailable as e:  # removed from memory; the persistent delete is retried
            logger.warning("sagemaker API: %s/%s: %.300s", namespace, checkpoint_id, e)
        except TierckptError as e:
            logger.warning(
                "sagemaker API: %s/%s is out of the namespace's steps_retained=%d window but "
                "stays: %.300s",
                namespace,
                checkpoint_id,
                keep,
                e,
            )
            continue
        removed.append(checkpoint_id)
        logger.info(
            "sagemaker API: removed %s/%s (namespace steps_retained=%d)",
            namespace,
            checkpoint_id,
            keep,
        )
    return removed
