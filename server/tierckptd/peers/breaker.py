"""A circuit breaker per peer: a peer that did not answer its last call is skipped for a
back-off period (audit 3, M1).

A gray peer (SIGSTOPped, a hung kernel, a saturated NIC) accepts TCP connections and
never answers: every call to it costs its whole deadline. Asked once per checkpoint by
one replicator, such a peer held every other replication on its neighbours for minutes.
Here, once a call to it is not answered (UNAVAILABLE, DEADLINE_EXCEEDED), the fan-out
(`PeerClient.each`) skips it for `first` seconds, then, after every missed probe, for
twice the time it has been unreachable so far, up to `cap`. The back-off follows how long
the outage has lasted, not how many calls missed: calls in flight when a link goes down
all miss at once, and counting each as a probe put a peer back from a 2 s cut on the
30 s cap, where the nodes skipping it re-replicated and mis-listed its copies for half a
minute after the cut healed (the network chaos run). When the back-off is over the next fan-out does not call it inline either: it
starts one probe in the background (a cheap Holdings call); an answer closes the
breaker, a miss opens it again for longer. So no commit, heal or broadcast waits for a
peer known not to answer, and the peer is asked again within `cap` seconds.

The back-off period of each skipped peer is `tierckpt_peer_backoff_seconds{peer}` (the
series goes when it answers); every skipped call counts in `tierckpt_peer_calls_skipped`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierckptd.ops import metrics

__all__ = ["BACKOFF_CAP", "BACKOFF_FIRST", "MISSED_CODES", "Breaker"]

logger = logging.getLogger(__name__)

# Status codes that say the peer was not reached (an answer with any other code, even an
# error, proves it is alive).
MISSED_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
BACKOFF_FIRST = 1.0
BACKOFF_CAP = 30.0


@dataclass
class _Peer:
    misses: int = 0
    since: float = 0.0  # its first missed call of this outage (monotonic)
    until: float = 0.0  # skipped until then (monotonic)
    probing: bool = False


class Breaker:
    """Which peers to skip now (see the module docstring); thread-safe. `first` <= 0:
    never skips (tests that take a peer down and back between two calls)."""

    def __init__(
        self,
        *,
        first: float = BACKOFF_FIRST,
        cap: float = BACKOFF_CAP,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._first = first
        self._cap = cap
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}

    def skip(self, node: str) -> tuple[bool, bool]:
        """(skip it, probe it now): a peer that missed its last call is skipped; once its
        back-off is over, exactly one caller is told to probe it (in the background)."""
        with self._lock:
            p = self._peers.get(node)
            if p is None:
                return False, False
            metrics.PEER_CALLS_SKIPPED.inc()
            if p.probing or self._clock() < p.until:
                return True, False
            p.probing = True
            return True, True

    def left(self, node: str) -> float:
        """Seconds `node` is still skipped (0: it is not)."""
        with self._lock:
            p = self._peers.get(node)
            return 0.0 if p is None else max(0.0, p.until - self._clock())

    def backing_off(self) -> dict[str, float]:
        """Every peer being skipped, with its back-off left (0: a probe is due)."""
        now = self._clock()
        with self._lock:
            return {n: max(0.0, p.until - now) for n, p in self._peers.items()}

    def answered(self, node: str) -> None:
        with self._lock:
            p = self._peers.pop(node, None)
        if p is not None:
            metrics.PEER_BACKOFF.remove(node)
            logger.info(
                "peer %s answers again after %d missed calls; no longer skipped", node, p.misses
            )

    def missed(self, node: str, code: str) -> None:
        """A call to `node` ended with `code`; one in MISSED_CODES opens its breaker (or
        keeps it open, for twice as long), any other code is an answer."""
        if code not in MISSED_CODES:
            self.answered(node)
            return
        if self._first <= 0:
            return
        with self._lock:
            now = self._clock()
            p = self._peers.get(node)
            if p is None:
                p = self._peers[node] = _Peer(since=now)
            p.misses += 1
            p.probing = False
            pause = min(self._cap, max(self._first, 2 * (now - p.since)))
            p.until = max(p.until, now + pause)
            misses = p.misses
        metrics.PEER_BACKOFF.labels(peer=node).set(pause)
        log = logger.warning if misses == 1 else logger.info
        log(
            "peer %s did not answer (%s, %d in a row); skipping it for %.0f s (replication "
            "goes to the other peers, marks and replica lists wait for it)",
            node,
            code,
            misses,
            pause,
        )

    def forget(self, keep: set[str]) -> None:
        """Drop peers no longer in the membership."""
        with self._lock:
            gone = [n for n in self._peers if n not in keep]
            for n in gone:
                del self._peers[n]
        for n in gone:
            metrics.PEER_BACKOFF.remove(n)
