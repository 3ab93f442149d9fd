"""What the peer tier marks on the catalog's checkpoints, kept beside the records.

- the healer's health labels ("under-replicated", "lost" and the files no node holds);
- tombstones: checkpoints deleted here (a peer's late publish or its healer must not
  bring them back), with the sequence each had, and retention's evictions (a weaker
  tombstone that the persistent tier's copy overrides);
- each coordinator's clock skew at its latest manifest (shown, never acted on);
- the replica target (extra copies wanted per file, 0 without peers) views show.

It shares the catalog's lock (as `memory.pool.WarmPool` does): the methods marked
"under the lock" are called by the catalog with it held; the others take it.
"""

from __future__ import annotations

import logging
import threading

from tierckptd.catalog.views import Health, found, is_lost
from tierckptd.model import CLOCK_SKEW, CheckpointRecord, Key, coordinator_of
from tierckptd.ops import metrics

__all__ = ["DELETE_SKEW", "MAX_GONE", "MAX_SKEWED_PEERS", "PeerMarks"]

logger = logging.getLogger("tierckptd.catalog")

# Deleted checkpoints remembered so a peer's late publish cannot bring them back; a peer
# still holding one deleted this many deletions ago is long past its own retention.
MAX_GONE = 65_536
# A checkpoint committed (by its coordinator's clock) up to this many seconds after it was
# deleted (by the deleting node's clock) is taken for the deleted one: node clocks
# disagree a little, and a deleted checkpoint must never come back. Saving it again
# under the same id is taken once it is committed later than that.
DELETE_SKEW = 60.0
# Peers whose clock skew is remembered (`clock_skew`, the metric's label values).
MAX_SKEWED_PEERS = 256


def _bounded(stones: dict[Key, float] | dict[Key, int]) -> None:
    while len(stones) > MAX_GONE:
        del stones[next(iter(stones))]


class PeerMarks:
    """Health labels, tombstones, clock skew and the replica target of one catalog."""

    def __init__(self, lock: threading.Lock, node_id: str) -> None:
        self._lock = lock
        self.node_id = node_id
        self.replica_target = 0
        self._health: dict[Key, Health] = {}
        # Insertion-ordered and bounded (`MAX_GONE`, oldest dropped): one key per deletion,
        # retention's included, would otherwise grow for the daemon's whole life. Value:
        # the deletion's stamp; a publish of one committed by then is refused.
        self._gone: dict[Key, float] = {}
        # The sequence of each deleted checkpoint this node had (bounded like `_gone`): a
        # publish of it at that sequence or below is the deleted one whatever its time
        # says (a peer whose clock is ahead cannot bring it back); above it, a new save.
        self._gone_sequence: dict[Key, int] = {}
        # Retention's evictions of checkpoints not known durable here, kept apart from
        # deletions: a peer's publish of one is refused as well (retention would only
        # evict it again), but the persistent tier's adoption is not (the drain may have
        # made it durable elsewhere; it must stay loadable through this node).
        self._evicted: dict[Key, float] = {}
        self._skew: dict[str, float] = {}  # insertion-ordered, MAX_SKEWED_PEERS at most

    def set_replica_target(self, copies: int) -> None:
        """Extra copies wanted per file (the membership's; 0 without peers)."""
        self.replica_target = copies

    # ---- health (under the lock) -------------------------------------------------------
    def health(self, key: Key) -> Health:
        return self._health.get(key, Health(""))

    def is_lost(self, key: Key, durable: bool) -> bool:
        """Shown LOST (`views.is_lost`): never the newest, never loaded."""
        return is_lost(self._health.get(key), durable)

    def label(self, key: Key, health: Health | None) -> None:
        """The healer's finding; None: healthy."""
        if health is None:
            self._health.pop(key, None)
        else:
            self._health[key] = health

    def held_here(self, key: Key, name: str) -> None:
        """A copy of `name` is held here now: that file is not lost."""
        if (health := found(self._health.get(key), name)) is not None:
            self._health[key] = health

    # ---- tombstones (under the lock) ---------------------------------------------------
    def tombstone(self, key: Key, stamp: float, *, evicted: bool = False) -> None:
        """Remember a deletion (or with `evicted`, retention's eviction) stamped `stamp`."""
        stones = self._evicted if evicted else self._gone
        stones[key] = max(stones.pop(key, 0.0), stamp)
        _bounded(stones)

    def forget_sequence(self, key: Key, sequence: int) -> None:
        """Remember the sequence of a deleted checkpoint (see `_gone_sequence`)."""
        self._gone_sequence[key] = max(self._gone_sequence.pop(key, 0), sequence)
        _bounded(self._gone_sequence)

    def saved_again(self, key: Key) -> None:
        """A save of `key` began here after a delete: peers may publish it again."""
        self._gone.pop(key, None)
        self._gone_sequence.pop(key, None)
        self._evicted.pop(key, None)

    def gone(self, key: Key) -> bool:
        return key in self._gone

    def refuses(self, published: CheckpointRecord, *, durable: bool) -> bool:
        """Whether a publish of `published` brings back one deleted or evicted here;
        one taken clears its eviction."""
        key = published.key
        gone_sequence = self._gone_sequence.get(key)
        gone = self._gone.get(key)
        if gone_sequence is not None:
            if published.sequence <= gone_sequence:
                return True  # the very checkpoint deleted here, whatever its time
        elif gone is not None and published.committed_unix <= gone + DELETE_SKEW:
            return True  # deleted here (or by a cluster rm) after it was committed
        if key in self._evicted and not durable:
            return True  # retention evicted it here; only its durable copy lists it again
        self._evicted.pop(key, None)
        return False

    def tombstones(self) -> list[Key]:
        """The deletions remembered, oldest first."""
        with self._lock:
            return list(self._gone)

    # ---- clock skew --------------------------------------------------------------------
    def measure_skew(self, published: CheckpointRecord, now: float) -> None:
        """How far ahead of this node's clock (`now`) the coordinator's times are (under
        the lock): remembered per coordinator (`clock_skew`, the metric), and a warning
        once it passes CLOCK_SKEW. Shown, never acted on: order is the sequence's."""
        coordinator = coordinator_of(published.files)
        if not coordinator or coordinator == self.node_id:
            return
        ahead = max(0.0, published.committed_unix - now)
        before = self._skew.pop(coordinator, 0.0)
        self._skew[coordinator] = ahead
        while len(self._skew) > MAX_SKEWED_PEERS:
            dropped = next(iter(self._skew))
            del self._skew[dropped]
            metrics.forget_peer_skew(dropped)
        metrics.PEER_CLOCK_SKEW.labels(peer=coordinator).set(ahead)
        if ahead > CLOCK_SKEW >= before:
            logger.warning(
                "node %s's clock is %.0f s ahead of this node's (its manifest of %s/%s): its "
                "times are shown as this node's now; order follows the sequence, so it "
                "still replicates; fix its clock (NTP)",
                coordinator,
                ahead,
                published.namespace,
                published.checkpoint_id,
            )

    def skew_now(self) -> tuple[tuple[str, float], ...]:
        """`clock_skew` under the lock, sorted (for `status`)."""
        return tuple(sorted(self._skew.items()))

    def clock_skew(self) -> dict[str, float]:
        """Seconds each peer's clock was ahead of this node's at its latest manifest (0:
        not ahead), for `status` and the metric."""
        with self._lock:
            return dict(self._skew)

    def unhealthy_count(self) -> int:
        with self._lock:
            return len(self._health)
