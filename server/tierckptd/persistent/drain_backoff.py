"""The drain's backoff and giving up (audit M7), per checkpoint.

An attempt ends durable, waiting (another node commits, or other nodes still upload) or
failed. Waits and failures back off exponentially from `poll` to `max_backoff`. After
`max_failures` failures in a row, or `max_wait` seconds without becoming durable, the
checkpoint is *drain-failed*: "drain-failed" in its tiers (`tierckpt ls`), and retried
only every `failed_retry` seconds, so an outage still recovers by itself while a
checkpoint that never drains costs one probe every few minutes. It stays pinned in
memory (invariant 6): an outage delays durability but never loses it.
"""

from __future__ import annotations

import logging
import threading
import time

from tierckpt.errors import UnsafeMetadata

from tierckptd.catalog import Catalog
from tierckptd.model import Key
from tierckptd.ops import metrics

__all__ = ["DrainBackoff"]

logger = logging.getLogger(__name__)


class DrainBackoff:
    """Counters of unsuccessful attempts per checkpoint, and the drain-failed marks.

    Args:
        poll: the first delay after a waiting or failed attempt; doubles each time.
        max_backoff: the longest delay between attempts of a checkpoint not drain-failed.
        max_failures: failed attempts in a row after which it is drain-failed.
        max_wait: seconds without becoming durable after which it is drain-failed.
        failed_retry: the delay between attempts of a drain-failed checkpoint.
    """

    def __init__(
        self,
        catalog: Catalog,
        *,
        poll: float,
        max_backoff: float,
        max_failures: int,
        max_wait: float,
        failed_retry: float,
    ) -> None:
        self.catalog = catalog
        self.poll = poll
        self.max_backoff = max_backoff
        self.max_failures = max_failures
        self.max_wait = max_wait
        self.failed_retry = failed_retry
        self._lock = threading.Lock()  # guards the counters below
        # Per checkpoint, since its last success: unsuccessful attempts in a row (the
        # backoff), failed ones in a row, when the first one was; and the ones given up on.
        self._tries: dict[Key, int] = {}
        self._failures: dict[Key, int] = {}
        self._since: dict[Key, float] = {}
        self._failing: set[Key] = set()

    def _forget(self, key: Key) -> bool:
        """Drop a checkpoint's counters; whether it was drain-failed."""
        with self._lock:
            for counter in (self._tries, self._failures, self._since):
                counter.pop(key, None)
            failing = key in self._failing
            self._failing.discard(key)
            return failing

    def unsuccessful(self, key: Key, error: Exception | None) -> float:
        """Count a waiting (`error` None) or failed attempt; the delay before the next."""
        now = time.monotonic()
        with self._lock:
            tries = self._tries[key] = self._tries.get(key, 0) + 1
            since = self._since.setdefault(key, now)
            if error is None:
                self._failures.pop(key, None)  # the tier answered
                failures = 0
            else:
                failures = self._failures[key] = self._failures.get(key, 0) + 1
            failing = key in self._failing
        if not failing:
            if failures >= self.max_failures:
                why = (
                    f"failed {failures} times in a row (last: {type(error).__name__}: "
                    f"{str(error)[:300]})"
                )
                self._give_up(key, why)
                failing = True
            elif now - since >= self.max_wait:
                why = (
                    f"is not durable after {now - since:.0f}s of waiting (for other nodes' "
                    "uploads, or for the node that commits .metadata)"
                )
                self._give_up(key, why)
                failing = True
        if failing:
            return self.failed_retry
        return float(min(self.max_backoff, self.poll * 2.0 ** min(tries - 1, 30)))

    def _give_up(self, key: Key, why: str) -> None:
        with self._lock:
            self._failing.add(key)
        self.catalog.set_drain_failed(*key, True)
        logger.error(
            "persistent tier drain of %s/%s %s; marked drain-failed (see tierckpt ls) and "
            "retried every %.0fs; it stays in memory until it is durable. Fix the cause "
            "(the persistent tier's reachability, credentials, or the other nodes); "
            "Drainer.retry_failed() (SIGHUP) retries at once",
            *key,
            why,
            self.failed_retry,
        )

    def succeeded(self, key: Key) -> None:
        if self._forget(key):
            self.catalog.set_drain_failed(*key, False)
            logger.info("persistent tier drain of %s/%s recovered: it is durable", *key)

    def refuse(self, key: Key, error: UnsafeMetadata) -> None:
        """A `.metadata` that can never drain: drain-failed at once, no longer due."""
        metrics.REFUSED_METADATA.labels(where="drain").inc()
        self._forget(key)
        self.catalog.set_drain_failed(*key, True, refused=True)
        logger.error(
            "persistent tier drain of %s/%s refused: %s. The checkpoint is not drained and "
            "is marked drain-failed (see tierckpt ls); it is not retried and memory "
            "retention may evict it. Delete it (tierckpt rm %s %s) or save it again",
            *key,
            error,
            *key,
        )

    def reset(self, key: Key) -> None:
        """Fresh counters and no drain-failed mark (the operator's override)."""
        self._forget(key)
        self.catalog.set_drain_failed(*key, False)
