"""Every Prometheus metric of the daemon, in one place.

Gauges read the catalog lazily (set_function) so they are exact at scrape time without
the catalog having to publish on every change.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

__all__ = [
    "ABORTS",
    "BYTES_COMMITTED",
    "COMMITS",
    "CORRUPT_COPIES",
    "FETCHED_BYTES",
    "EVICTIONS",
    "MALFORMED_REQUESTS",
    "RECYCLED_BYTES",
    "REJECTED_SAVES",
    "REPAIRED_COPIES",
    "REPLICATED_BYTES",
    "SCRUBBED_BYTES",
    "SCRUB_LAST_PASS",
    "TRIMMED_BYTES",
    "TRIMMED_COPIES",
    "REFUSED_METADATA",
    "DRAIN_FAILED",
    "PEER_REFUSED",
    "POOL_HITS",
    "POOL_MISSES",
    "PREWARM_BYTES",
    "PREWARM_USED_BYTES",
    "MetricsEndpoint",
    "UNDER_REPLICATED",
    "bind_gauges",
    "bind_prewarm_gauges",
    "serve",
]

logger = logging.getLogger(__name__)

BUDGET = Gauge("tierckpt_memory_budget_bytes", "Configured [memory] budget")
USED = Gauge("tierckpt_memory_used_bytes", "Bytes of committed files (C)")
RESERVED = Gauge("tierckpt_memory_reserved_bytes", "Bytes reserved by saves in progress (R)")
POOL = Gauge("tierckpt_memory_pool_bytes", "Bytes of warm recycled pool segments (P)")
CHECKPOINTS = Gauge("tierckpt_committed_checkpoints", "Committed checkpoints in the memory tier")
COMMITS = Counter("tierckpt_commits", "Checkpoints committed")
ABORTS = Counter("tierckpt_aborts", "Saves aborted (explicitly, superseded or abandoned)")
EVICTIONS = Counter("tierckpt_evictions", "Checkpoints evicted from the memory tier by retention")
BYTES_COMMITTED = Counter("tierckpt_committed_bytes", "Bytes of files committed")
REJECTED_SAVES = Counter(
    "tierckpt_rejected_saves", "Reservations refused with RESOURCE_EXHAUSTED", ["reason"]
)
RECYCLED_BYTES = Counter("tierckpt_recycled_bytes", "Bytes of warm pool segments reused by saves")
POOL_HITS = Counter("tierckpt_pool_hits", "Files a save opened in a warm pool segment")
POOL_MISSES = Counter(
    "tierckpt_pool_misses", "Files a save opened as a new (cold) file: no pool segment fit"
)
PREWARM_BYTES = Counter(
    "tierckpt_prewarm_bytes",
    "Bytes of pool segments allocated and touched ahead of use, by kind (start: "
    "[memory] prewarm, next_save: [memory] prewarm_next, restore: files to fetch)",
    ["kind"],
)
PREWARM_USED_BYTES = Counter(
    "tierckpt_prewarm_used_bytes", "Bytes of prewarmed pool segments handed to saves"
)
PREWARM_PENDING = Gauge(
    "tierckpt_prewarm_pending_bytes", "Bytes the next-save prewarm has planned and not made yet"
)
PREWARM_READY = Gauge(
    "tierckpt_prewarm_ready_bytes", "Bytes of prewarmed pool segments waiting for a save"
)
CORRUPT_COPIES = Counter(
    "tierckpt_corrupt_copies", "Local copies that failed verification and were replaced", ["where"]
)
REPLICATED_BYTES = Counter("tierckpt_replicated_bytes", "Bytes pushed to buddies")
REPAIRED_COPIES = Counter(
    "tierckpt_repaired_copies",
    "Local copies found corrupt (served, pushed, scrubbed) replaced by a verified copy",
)
SCRUBBED_BYTES = Counter(
    "tierckpt_scrubbed_bytes",
    "Bytes of memory copies the background scrubber re-hashed against their checksums "
    '(corrupt ones found: tierckpt_corrupt_copies_total{where="scrubbed"})',
)
SCRUB_LAST_PASS = Gauge(
    "tierckpt_scrub_last_pass_unix",
    "When the scrubber last finished a full pass over the memory copies (0: never)",
)
TRIMMED_COPIES = Counter(
    "tierckpt_trimmed_copies",
    "Surplus replicas (more than k extra copies of a file) this node dropped",
)
TRIMMED_BYTES = Counter("tierckpt_trimmed_bytes", "Bytes of surplus replicas this node dropped")
FETCHED_BYTES = Counter("tierckpt_fetched_bytes", "Bytes fetched from peers into this node")
UNDER_REPLICATED = Gauge(
    "tierckpt_under_replicated_checkpoints",
    "Checkpoints whose files have fewer than k extra copies (or none at all)",
)
MALFORMED_REQUESTS = Counter(
    "tierckpt_malformed_requests",
    "Requests that are not valid protobuf, refused with INVALID_ARGUMENT",
    ["service"],
)
REFUSED_METADATA = Counter(
    "tierckpt_refused_metadata",
    ".metadata files refused by the allow-list decoder (never unpickled), by where",
    ["where"],
)
DRAIN_FAILED = Gauge(
    "tierckpt_drain_failed_checkpoints",
    "Checkpoints the drain gave up on (refused, or failing for a long time); see tierckpt ls",
)
PEER_REFUSED = Counter(
    "tierckpt_peer_refused",
    "Peer calls and peer-sent manifests refused (unknown peer, not authorized, invalid, "
    "conflicting, over budget, busy), by reason",
    ["reason"],
)


def bind_gauges(
    budget: int,
    used: Callable[[], float],
    reserved: Callable[[], float],
    pool: Callable[[], float],
    checkpoints: Callable[[], float],
) -> None:
    """Point the gauges at the live catalog."""
    BUDGET.set(budget)
    USED.set_function(used)
    RESERVED.set_function(reserved)
    POOL.set_function(pool)
    CHECKPOINTS.set_function(checkpoints)


def bind_prewarm_gauges(pending: Callable[[], float], ready: Callable[[], float]) -> None:
    """Point the prewarm gauges at the live catalog."""
    PREWARM_PENDING.set_function(pending)
    PREWARM_READY.set_function(ready)


@dataclass(frozen=True)
class MetricsEndpoint:
    """A running /metrics endpoint: its bound port, and `stop()`."""

    port: int
    server: Any  # wsgiref's WSGIServer
    thread: threading.Thread

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


def serve(listen: str) -> MetricsEndpoint:
    """Start the /metrics HTTP endpoint on "host:port" (port 0: any free one)."""
    host, _, port = listen.rpartition(":")
    server, thread = start_http_server(int(port), addr=host or "127.0.0.1")
    bound = int(server.server_address[1])
    logger.info("metrics on http://%s:%s/metrics", host or "127.0.0.1", bound)
    return MetricsEndpoint(bound, server, thread)
