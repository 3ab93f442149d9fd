"""Every Prometheus metric of the daemon, in one place.

Gauges read the catalog lazily (set_function, or the `_Live` collector for labelled
series) so they are exact at scrape time without the catalog having to publish on every
change. Labels stay bounded: by namespace (a series goes with the namespace's last
checkpoint), by peer (the current membership), never by checkpoint id.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierckptd import __version__

__all__ = [
    "PEER_REQUESTS",
    "ABORTS",
    "BUILD_INFO",
    "BYTES_COMMITTED",
    "COMMITS",
    "COMMIT_DURATION",
    "CORRUPT_COPIES",
    "DRAINED_BYTES",
    "DRAIN_BACKLOG_BYTES",
    "DRAIN_BACKLOG_CHECKPOINTS",
    "DRAIN_DURATION",
    "PERSISTENT_ERRORS",
    "PERSISTENT_OPS",
    "REPLICATE_DURATION",
    "RESTORE_DURATION",
    "RESTORE_SOURCES",
    "SAVE_DURATION",
    "FETCHED_BYTES",
    "EVICTIONS",
    "TRUST_MARKS",
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
    "PEER_BACKOFF",
    "PEER_CALLS_SKIPPED",
    "MEMBERSHIP_REFUSED",
    "MEMBERSHIP_ROUNDS",
    "PEER_REFUSED",
    "PEER_SENT_BYTES",
    "POOL_HITS",
    "POOL_MISSES",
    "PREWARM_BYTES",
    "PREWARM_USED_BYTES",
    "MetricsEndpoint",
    "UNDER_REPLICATED",
    "bind_freshness",
    "bind_gauges",
    "bind_peers",
    "bind_prewarm_gauges",
    "peer_answered",
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
TRUST_MARKS = Counter(
    "tierckpt_trust_marks",
    "Trust marks (tierckpt mark) taken on this node, its own and its peers', by state",
    ["trust"],
)
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
    "[memory] prewarm, next_save: [memory] prewarm_next, restore: files to fetch, "
    "activate: recycled segments touched again before the next save takes them)",
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
FETCHED_BYTES = Counter(
    "tierckpt_fetched_bytes",
    "Bytes this node fetched into its memory tier for a restore, from a peer or the persistent tier",
)
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
PEER_REQUESTS = Counter(
    "tierckpt_peer_requests",
    "Peer RPCs this node served (authenticated, known methods), by method: what a commit, "
    "a heal round or a restore costs each node (bench/scale.py)",
    ["method"],
)
PEER_REFUSED = Counter(
    "tierckpt_peer_refused",
    "Peer calls and peer-sent manifests refused (unknown peer, not authorized, invalid, "
    "conflicting, over budget, busy), by reason",
    ["reason"],
)
PEER_SENT_BYTES = Counter(
    "tierckpt_peer_sent_bytes",
    "File bytes this node served to peers that fetch them, by path (bulk: the bulk "
    "stream; grpc: FetchFile): how a restore wave spreads over the holders",
    ["path"],
)
MEMBERSHIP_REFUSED = Counter(
    "tierckpt_membership_refused",
    "Discovered addresses not taken as members, by reason (unproven: answered Hello "
    "without proving its node id; conflict: another address claims the same id)",
    ["reason"],
)
MEMBERSHIP_ROUNDS = Counter(
    "tierckpt_membership_rounds",
    "Background membership rounds, by trigger (timer: [membership] refresh; wake: a "
    "stranger's Hello, rate-limited)",
    ["trigger"],
)
PEER_CLOCK_SKEW = Gauge(
    "tierckpt_peer_clock_skew_seconds",
    "How far a peer's clock was ahead of this node's at the latest new manifest it "
    "coordinated (0: not ahead); its times are clamped to this node's clock, and order "
    "follows the sequence, so it still replicates",
    ["peer"],
)


def forget_peer_skew(peer: str) -> None:
    """Drop a peer's skew sample (the catalog keeps a bounded number of peers)."""
    with contextlib.suppress(KeyError):
        PEER_CLOCK_SKEW.remove(peer)


# Latency histograms. The buckets span a small file on loopback (ms) to a large
# checkpoint drained to S3 over an hour; the same ones everywhere, so panels compare.
_SECONDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600,
)  # fmt: skip
SAVE_DURATION = Histogram(
    "tierckpt_save_duration_seconds",
    "A checkpoint's first BeginCheckpoint to its commit, on the committing (coordinator's) node",
    buckets=_SECONDS,
)
COMMIT_DURATION = Histogram(
    "tierckpt_commit_duration_seconds",
    "CommitCheckpoint RPC handling (finding remote files, manifest, publish to peers)",
    buckets=_SECONDS,
)
REPLICATE_DURATION = Histogram(
    "tierckpt_replicate_duration_seconds",
    "One file pushed to one buddy (successful pushes)",
    buckets=_SECONDS,
)
DRAIN_DURATION = Histogram(
    "tierckpt_drain_duration_seconds",
    "A checkpoint's commit to its .metadata in the persistent tier, on the node that wrote it",
    buckets=_SECONDS,
)
RESTORE_SOURCES = ("memory", "peer", "persistent")
RESTORE_DURATION = Histogram(
    "tierckpt_restore_duration_seconds",
    "One file served by EnsureLocal (a restore), by the tier it came from (memory: "
    "already held here)",
    ["source"],
    buckets=_SECONDS,
)
DRAIN_BACKLOG_CHECKPOINTS = Gauge(
    "tierckpt_drain_backlog_checkpoints",
    "Committed checkpoints due for the persistent tier and not durable yet",
)
DRAIN_BACKLOG_BYTES = Gauge(
    "tierckpt_drain_backlog_bytes",
    "Bytes of those checkpoints' files this node owns and holds (its share to upload)",
)
DRAINED_BYTES = Counter(
    "tierckpt_drained_bytes", "Bytes of data files uploaded to the persistent tier"
)
PERSISTENT_OPS = ("upload", "read", "list", "delete")
PERSISTENT_ERRORS = Counter(
    "tierckpt_persistent_errors",
    "Failed persistent-tier (S3/fsspec) calls, retried ones included, by operation",
    ["op"],
)
BUILD_INFO = Gauge("tierckpt_build_info", "Always 1; the daemon's version", ["version"])
BUILD_INFO.labels(version=__version__).set(1)
for _source in RESTORE_SOURCES:  # every series exists from the start, at 0
    RESTORE_DURATION.labels(source=_source)
for _op in PERSISTENT_OPS:
    PERSISTENT_ERRORS.labels(op=_op)

# A peer answered (1) or could not be reached (0) in its last call; entries of nodes no
# longer in the membership are dropped at the next scrape.
PEER_DOWN_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "STALLED"})
_peer_lock = threading.Lock()
_peer_up: dict[str, bool] = {}


def peer_answered(node: str, code: str = "") -> None:
    """Record the outcome of a call to `node`: "" (it answered) or the gRPC status name
    of the failure (an answer too, unless it says the peer was not reached)."""
    with _peer_lock:
        _peer_up[node] = code not in PEER_DOWN_CODES


# The circuit breaker of the peer fan-out (peers/breaker.py): a peer that did not answer
# its last call is skipped for a back-off period; the series goes when it answers again.
PEER_BACKOFF = Gauge(
    "tierckpt_peer_backoff_seconds",
    "The back-off period (seconds) this node skips the peer for in its fan-out calls "
    "(heals, publishes, replica lists, marks): it did not answer its last call",
    ["peer"],
)
PEER_CALLS_SKIPPED = Counter(
    "tierckpt_peer_calls_skipped",
    "Calls to a peer not made because it is backing off (it did not answer its last call)",
)


DEFAULT_NAMESPACE_SERIES = 100


def namespace_label(namespace: str, hashed: bool) -> str:
    """The namespace as a label: its name, or (`[metrics] hash_namespaces`) "ns-" and 12
    hex digits of its SHA-256, stable across nodes and restarts (an operator maps it back
    with `tierckpt status`, which shows names to those allowed to see them)."""
    if not hashed:
        return namespace
    return "ns-" + hashlib.sha256(namespace.encode()).hexdigest()[:12]


def newest_namespaces(
    fresh: Mapping[str, Mapping[str, float]], limit: int
) -> list[tuple[str, Mapping[str, float]]]:
    """The `limit` namespaces committed most recently (any tier), newest first, ties by
    name: the per-namespace series a scrape carries (audit 3 M6: one series per
    namespace and tier grows the scrape with the cluster's job count, gossip included)."""
    if limit <= 0:
        return []
    return heapq.nsmallest(  # O(n log limit): a scrape of 100k namespaces stays cheap
        limit, fresh.items(), key=lambda item: (-max(item[1].values(), default=0.0), item[0])
    )


class _Live(Collector):
    """The labelled series read at scrape time: per-tier freshness (the newest
    `max_namespaces` namespaces, their names hashed with `hash_labels`), the number of
    namespaces, and peer up/down."""

    def __init__(self) -> None:
        self.freshness: Callable[[], Mapping[str, Mapping[str, float]]] | None = None
        self.peers: Callable[[], Iterable[str]] | None = None
        self.max_namespaces = DEFAULT_NAMESPACE_SERIES
        self.hash_labels = False

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "tierckpt_newest_checkpoint_timestamp_seconds",
                "Commit time of the namespace's newest checkpoint that reached the tier "
                "(memory: held in a memory tier; replicated: survives a node loss; durable: "
                "in the persistent tier); RPO = time() - this",
                labels=["namespace", "tier"],
            ),
            GaugeMetricFamily(
                "tierckpt_peer_up",
                "1 if the peer answered this node's last call to it, 0 if it was not reached",
                labels=["peer"],
            ),
            GaugeMetricFamily(
                "tierckpt_namespaces",
                "Namespaces with a committed checkpoint on this node; the freshness series "
                "cover the most recently committed [metrics] namespace_series of them",
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        fresh, up, count = self._families()
        try:
            if self.freshness is not None:
                every = self.freshness()
                count.add_metric([], float(len(every)))
                for namespace, tiers in newest_namespaces(every, self.max_namespaces):
                    label = namespace_label(namespace, self.hash_labels)
                    for tier, ts in sorted(tiers.items()):
                        fresh.add_metric([label, tier], ts)
            if self.peers is not None:
                members = set(self.peers())
                with _peer_lock:
                    for node in set(_peer_up) - members:
                        del _peer_up[node]
                    known = sorted(_peer_up.items())
                for node, answered in known:
                    up.add_metric([node], 1.0 if answered else 0.0)
        except Exception:  # a scrape never fails for it: the other series still go out
            logger.exception("cannot read the freshness or peer series")
        yield fresh
        yield up
        yield count


_LIVE = _Live()
REGISTRY.register(_LIVE)


def bind_freshness(
    freshness: Callable[[], Mapping[str, Mapping[str, float]]],
    *,
    max_namespaces: int = DEFAULT_NAMESPACE_SERIES,
    hash_labels: bool = False,
) -> None:
    """Read {namespace: {tier: newest commit time}} (`catalog.views.freshness`) at each
    scrape; a namespace with no checkpoint is simply absent. Series for the newest
    `max_namespaces` namespaces only (`[metrics] namespace_series`), labelled with a
    hash of the name with `hash_labels` (`[metrics] hash_namespaces`)."""
    _LIVE.freshness = freshness
    _LIVE.max_namespaces = max_namespaces
    _LIVE.hash_labels = hash_labels


def bind_peers(peers: Callable[[], Iterable[str]]) -> None:
    """Report `tierckpt_peer_up` for the current membership's peers only."""
    _LIVE.peers = peers


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
