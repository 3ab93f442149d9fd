"""The persistent tier's marks in the catalog: which checkpoints are durable, retired,
drain-failed, and where each one drains. Memory retention obeys them (invariant 6: a
checkpoint due for the persistent tier stays in memory until it is durable there); the
drainer, discovery and persistent retention set them. A layer of the catalog between
`state.CatalogState` and `peer_state.PeerState` (see `tierckptd.catalog`).
"""

from __future__ import annotations

import logging

from tierckpt.errors import MemoryBudgetExceeded

from tierckptd.catalog.state import MAX_NAMESPACE_URLS, CatalogState
from tierckptd.model import Key, State

__all__ = ["PersistentMarks"]

logger = logging.getLogger("tierckptd.catalog")


class PersistentMarks(CatalogState):
    """Durable / retired / drain-failed marks and per-namespace persistent URLs."""

    def set_drain_failed(
        self, namespace: str, checkpoint_id: str, failed: bool, *, refused: bool = False
    ) -> None:
        """The drain's verdict, shown as "drain-failed" in `tiers` (False clears it).

        `refused`: its `.metadata` was refused, so it can never become durable; it stops
        being due, and memory retention no longer keeps it for the persistent tier
        (invariant 6 keeps what can still drain; this would otherwise pin it forever).
        """
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if not failed or rec is None:
                self._drain_failed.pop(key, None)
                return
            self._drain_failed[key] = refused
            if refused:
                self._apply_retention(namespace)

    def drain_failed(self) -> dict[Key, bool]:
        """Checkpoints the drain gave up on, each True if it was refused."""
        with self._lock:
            return dict(self._drain_failed)

    def due_not_durable(self) -> list[Key]:
        """Committed checkpoints due for the persistent tier and not known durable,
        oldest first (the drain queue a restarted daemon rebuilds)."""
        with self._lock:
            recs = [
                r
                for r in self._records.values()
                if r.state is State.COMMITTED and self._due(r) and r.key not in self._durable
            ]
            return [r.key for r in sorted(recs, key=lambda r: r.order)]

    def set_persistent_url(self, namespace: str, url: str) -> None:
        """Where the namespace's next commits here drain ("": `[persistent] url`). The
        caller checked `url` against the policy (`persistent.roots.Roots.check`); held
        in memory only: a job sets it with every writer, and each committed checkpoint
        keeps its own URL in its manifest."""
        with self._lock:
            if url:
                if namespace not in self._persistent_urls and len(self._persistent_urls) >= (
                    MAX_NAMESPACE_URLS
                ):
                    raise MemoryBudgetExceeded(
                        f"cannot set the persistent URL of {namespace}: {MAX_NAMESPACE_URLS} "
                        "namespaces have one on this node"
                    )
                self._persistent_urls[namespace] = url
            else:
                self._persistent_urls.pop(namespace, None)

    def persistent_url(self, namespace: str, checkpoint_id: str = "") -> str:
        """The URL a checkpoint drains to (its record's), or without `checkpoint_id` (or
        one this node does not know) the URL the namespace's next commit would record."""
        with self._lock:
            rec = self._records.get((namespace, checkpoint_id)) if checkpoint_id else None
            return (
                rec.persistent_url if rec is not None else self._persistent_urls.get(namespace, "")
            )

    def is_durable(self, namespace: str, checkpoint_id: str) -> bool:
        with self._lock:
            return (namespace, checkpoint_id) in self._durable

    def mark_durable(self, namespace: str, checkpoint_id: str) -> bool:
        """Record that the checkpoint's `.metadata` is in the persistent tier; memory
        retention may now evict it. False when it is not (or no longer) committed here."""
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.state is not State.COMMITTED:
                if key in self._gone and self.on_gone_durable is not None:
                    self.on_gone_durable(namespace, checkpoint_id)  # a drain beat an rm
                return False
            # Durable and drain-failed exclude each other: clear the mark in the same
            # step, so no view shows both (the drainer's own bookkeeping follows).
            self._drain_failed.pop(key, None)
            if key not in self._durable:
                self._durable.add(key)
                logger.info("%s/%s is DURABLE in the persistent tier", *key)
                self._apply_retention(namespace)
            return True

    def retire(self, namespace: str, checkpoint_id: str) -> None:
        """The checkpoint is no longer due: enough newer ones are durable that persistent
        retention deletes it (or already did, before this node learnt it was durable).
        Memory retention may evict it like any checkpoint that is not due."""
        key = (namespace, checkpoint_id)
        with self._lock:
            if key in self._records and key not in self._retired:
                self._retired.add(key)
                self._apply_retention(namespace)

    def persistent_only(self, namespace: str, url: str) -> list[str]:
        """Ids of the namespace's durable checkpoints no node's memory holds, recorded
        as drained to `url` (what a re-listing of that tier must still show)."""
        with self._lock:
            return sorted(
                r.checkpoint_id
                for r in self._records.values()
                if r.namespace == namespace
                and r.persistent_url == url
                and r.key in self._durable
                and self._persistent_only(r)
            )

    def forget_persistent(self, namespace: str, checkpoint_id: str) -> None:
        """The checkpoint was deleted from the persistent tier (its retention). Held
        nowhere else: it is gone. Still in memory somewhere: it stays listed there, and is
        retired, not due again (draining it back would only feed the same retention, and
        a due checkpoint that is never durable is held in memory forever)."""
        key = (namespace, checkpoint_id)
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and self._persistent_only(rec):
                self._delete_committed(rec)
            elif rec is not None:
                self._retired.add(key)
            self._durable.discard(key)
