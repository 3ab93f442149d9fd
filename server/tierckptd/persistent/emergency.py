"""SIGTERM's emergency drain: what this node holds of the newest checkpoints goes up.

A node that stops may hold the only copies of files it does not own (replicas of a
buddy's files whose owner is gone or slow), so on SIGTERM it uploads every file it holds
of the newest checkpoint it holds in each namespace, owner or not, and commits it when
it is the committer or holds `.metadata` (`drain_plan`, `everything`). The committer
waits for the other nodes' uploads until the deadline; any other node is done once its
own copies are up. Every remote call ends by the deadline (`PersistentTier.set_deadline`).

Its own concept beside the background drain (`drain.Drainer`), which works its queue
of committed checkpoints for as long as the daemon runs, each node uploading the files
it owns: this is the one pass at exit, choosing its own work (the newest held, owner or
not) and bounded by one deadline. It drives the
same `Drainer.attempt_locked`, so an upload and a commit are the drain's own.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tierckpt.errors import UnsafeMetadata

from tierckptd.model import Key, State, commit_anchor
from tierckptd.persistent.drain_plan import Outcome

if TYPE_CHECKING:
    from tierckptd.persistent.drain import Drainer

__all__ = ["emergency_drain", "newest_held"]

logger = logging.getLogger(__name__)


def emergency_drain(drainer: Drainer, deadline: float) -> bool:
    """Drain the newest checkpoints held here within `deadline` seconds. True when each
    is durable, or every file held here is up (nothing left for this node to do).

    The background worker is stopped first and the tier's deadline is set for good (the
    daemon is exiting): every remote call, in flight or not, ends by then.
    """
    end = time.monotonic() + deadline
    drainer.stop(timeout=0)
    for tier in drainer.stores.known():
        tier.set_deadline(deadline)
    ok = True
    for key in newest_held(drainer):
        logger.info("shutdown: draining %s/%s (deadline %.0fs)", *key, deadline)
        ok = _drain_one(drainer, key, end) and ok
    return ok


def newest_held(drainer: Drainer) -> list[Key]:
    """Per namespace, the newest committed checkpoint this node holds a file of (or
    coordinates), unless it is durable or its `.metadata` was refused. A LOST one (a
    file with no copy anywhere) can never become durable: the one before it is taken."""
    catalog, me = drainer.catalog, drainer.node_id
    newest: dict[str, Key] = {}
    for view in catalog.list_checkpoints():
        if view.state is State.LOST:
            continue
        anchor = commit_anchor({f.name: f for f in view.files}, view.checkpoint_format)
        meta = next((f for f in view.files if f.name == anchor), None)
        coordinates = meta is not None and meta.owner_node == me
        if coordinates or any(f.held for f in view.files):
            newest[view.namespace] = (view.namespace, view.checkpoint_id)
    refused = catalog.durability.drain_failed()
    return [
        k for k in newest.values() if not catalog.durability.is_durable(*k) and not refused.get(k)
    ]


def _drain_one(drainer: Drainer, key: Key, end: float) -> bool:
    while True:
        outcome: Outcome | None = None
        try:
            outcome = drainer.attempt_locked(key, end - time.monotonic(), everything=True)
        except UnsafeMetadata:
            return False  # refused: logged, counted and marked
        except Exception as e:
            logger.warning("shutdown drain of %s/%s: %.300s", *key, e)
        if outcome is Outcome.DURABLE:
            logger.info("shutdown: %s/%s is durable", *key)
            return True
        if outcome is Outcome.UPLOADED:
            logger.info(
                "shutdown: every file of %s/%s held here is in the persistent tier; "
                "another node commits it",
                *key,
            )
            return True
        if time.monotonic() + drainer.poll > end:
            logger.error("shutdown: %s/%s not durable within the deadline", *key)
            return False
        time.sleep(drainer.poll)
