"""The durability ledger: what the catalog knows of the persistent tier.

Which checkpoints are durable there, retired (no longer due), drain-failed, where each
namespace's next commits drain, and the rule for which checkpoints are due at all
(every `drain_every`-th one, and any committed with the durable hint). Memory retention
obeys it (invariant 6: a checkpoint due for the persistent tier stays in memory until it
is durable there); the drainer, the listing and persistent retention change it through
the catalog, which applies retention after each change.

It shares the catalog's lock (as `memory.pool.WarmPool` does): the methods marked
"under the lock" are called by the catalog with it held; the others take it.
"""

from __future__ import annotations

import threading

from tierckpt.errors import MemoryBudgetExceeded

from tierckptd.model import CheckpointRecord, Key

__all__ = ["MAX_NAMESPACE_URLS", "DurabilityLedger"]

MAX_NAMESPACE_URLS = 65_536  # namespaces with their own persistent URL on one node


class DurabilityLedger:
    """Durable / retired / drain-failed marks, per-namespace URLs and the due rule.

    Args:
        drain_every: drain every `drain_every`-th committed checkpoint (0: no
            persistent tier).
        default_persistent: whether `[persistent] url` is set; without it only
            checkpoints committed in a namespace with its own URL drain.
    """

    def __init__(
        self, lock: threading.Lock, *, drain_every: int = 0, default_persistent: bool = True
    ) -> None:
        self._lock = lock
        self.drain_every = drain_every
        self.default_persistent = default_persistent
        self._urls: dict[str, str] = {}  # namespace -> URL its commits record
        self._durable: set[Key] = set()
        self._retired: set[Key] = set()  # superseded in the persistent tier (`retire`)
        self._failed: dict[Key, bool] = {}  # shown as "drain-failed"; True: refused

    # ---- the rules (under the lock) ----------------------------------------------------
    def due(self, rec: CheckpointRecord) -> bool:
        """Whether the checkpoint is due for the persistent tier: every `drain_every`-th
        one, and any committed with the durable hint. One the drain refused (hostile
        `.metadata`) never can be: it is no longer due."""
        return (
            self.drain_every > 0
            and (self.default_persistent or rec.persistent_url != "")
            and (rec.durable_requested or rec.sequence % self.drain_every == 0)
            and not self._failed.get(rec.key, False)
            and rec.key not in self._retired
        )

    def refuses_durable(self, url: str) -> bool:
        """Whether a commit with the durable hint must be refused: no persistent tier for
        a namespace whose commits record `url`."""
        return self.drain_every <= 0 or not (url or self.default_persistent)

    def durable(self, key: Key) -> bool:
        return key in self._durable

    def failed(self, key: Key) -> bool:
        return key in self._failed

    def add_durable(self, key: Key) -> bool:
        """Mark `key` durable (clearing its drain failure); True when it was not yet."""
        self._failed.pop(key, None)  # durable and drain-failed exclude each other
        if key in self._durable:
            return False
        self._durable.add(key)
        return True

    def drop_durable(self, key: Key) -> None:
        self._durable.discard(key)

    def retire_key(self, key: Key) -> bool:
        """No longer due; True when it was not retired yet."""
        if key in self._retired:
            return False
        self._retired.add(key)
        return True

    def set_failed(self, key: Key, refused: bool) -> None:
        self._failed[key] = refused

    def clear_failed(self, key: Key) -> None:
        self._failed.pop(key, None)

    def forget(self, key: Key) -> None:
        """A checkpoint deleted from this node: none of its marks stay."""
        self._durable.discard(key)
        self._retired.discard(key)
        self._failed.pop(key, None)

    def url(self, namespace: str) -> str:
        """The URL the namespace's next commit records ("": `[persistent] url`)."""
        return self._urls.get(namespace, "")

    # ---- queries and changes (take the lock) -------------------------------------------
    def is_durable(self, namespace: str, checkpoint_id: str) -> bool:
        with self._lock:
            return (namespace, checkpoint_id) in self._durable

    def drain_failed(self) -> dict[Key, bool]:
        """Checkpoints the drain gave up on, each True if it was refused."""
        with self._lock:
            return dict(self._failed)

    def set_persistent_url(self, namespace: str, url: str) -> None:
        """Where the namespace's next commits here drain ("": `[persistent] url`). The
        caller checked `url` against the policy (`persistent.roots.Roots.check`); held
        in memory only: a job sets it with every writer, and each committed checkpoint
        keeps its own URL in its manifest."""
        with self._lock:
            if not url:
                self._urls.pop(namespace, None)
                return
            if namespace not in self._urls and len(self._urls) >= MAX_NAMESPACE_URLS:
                raise MemoryBudgetExceeded(
                    f"cannot set the persistent URL of {namespace}: {MAX_NAMESPACE_URLS} "
                    "namespaces have one on this node"
                )
            self._urls[namespace] = url
