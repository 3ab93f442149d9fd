"""The series read at scrape time: per-tier freshness by namespace (gone with the
namespace's last checkpoint), peer up/down for the current membership only, build info,
and persistent-tier errors counted by operation."""

from __future__ import annotations

import re

import pytest
from prometheus_client import REGISTRY, generate_latest
from tierckptd import __version__
from tierckptd.catalog import Catalog
from tierckptd.catalog.views import freshness
from tierckptd.ops import metrics
from tierckptd.persistent.errors import S3
from tierckptd.persistent.retry import Op, RetryPolicy, operation, retry_call

FRESH = "tierckpt_newest_checkpoint_timestamp_seconds"


def _body() -> str:
    return generate_latest(REGISTRY).decode()


def _sample(body: str, name: str, **labels: str) -> float | None:
    shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{name}\{{{re.escape(shown)}\}} (\S+)$", body, re.M)
    return None if match is None else float(match.group(1))


def test_freshness_follows_the_catalog(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    metrics.bind_freshness(lambda: freshness(catalog.list_checkpoints()))
    try:
        save(catalog, "fresh", "s1", {"a": b"x" * 10})
        save(catalog, "fresh", "s2", {"a": b"y" * 10})
        newest = catalog.get("fresh").committed_unix
        body = _body()
        assert _sample(body, FRESH, namespace="fresh", tier="memory") == newest
        # no peers, no persistent tier: the other levels are not reached
        assert _sample(body, FRESH, namespace="fresh", tier="replicated") is None
        assert _sample(body, FRESH, namespace="fresh", tier="durable") is None
        catalog.delete("fresh", "s1")
        catalog.delete("fresh", "s2")
        assert 'namespace="fresh"' not in _body()  # no checkpoint: no series
    finally:
        metrics.bind_freshness(dict)


def test_peer_up_reports_the_membership_only() -> None:
    members = ["node-b", "node-c"]
    metrics.bind_peers(lambda: members)
    try:
        metrics.peer_answered("node-b")
        metrics.peer_answered("node-c", "UNAVAILABLE")
        metrics.peer_answered("10.0.0.9:7070", "DEADLINE_EXCEEDED")  # not a member
        body = _body()
        assert _sample(body, "tierckpt_peer_up", peer="node-b") == 1.0
        assert _sample(body, "tierckpt_peer_up", peer="node-c") == 0.0
        assert "10.0.0.9" not in body
        metrics.peer_answered("node-c", "NOT_FOUND")  # it answered: up
        assert _sample(_body(), "tierckpt_peer_up", peer="node-c") == 1.0
        members.remove("node-c")  # left the cluster: its series goes
        assert 'peer="node-c"' not in _body()
    finally:
        metrics.bind_peers(lambda: ())


def test_build_info() -> None:
    assert _sample(_body(), "tierckpt_build_info", version=__version__) == 1.0


def test_operations_keep_their_label_values() -> None:
    """Dashboards select on these: an `Op` names one of them, whatever its message says."""
    assert {operation(op) for op in Op} == set(metrics.PERSISTENT_OPS)
    assert [operation(op) for op in Op] == ["upload", "read", "list", "delete"]


def test_persistent_errors_are_counted_by_operation() -> None:
    def errors() -> float:
        return _sample(_body(), "tierckpt_persistent_errors_total", op="upload") or 0.0

    before = errors()
    failures = [OSError("SlowDown"), ConnectionError("reset")]

    def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    policy = RetryPolicy(max_attempts=5, deadline=None, base=0.001, cap=0.001)
    assert retry_call(flaky, "f", policy, op=Op.UPLOAD, backend=S3, sleep=lambda s: None) == "ok"
    assert errors() - before == 2.0

    def absent() -> None:
        raise FileNotFoundError("no marker")  # an answer, not an error of the store

    with pytest.raises(FileNotFoundError):
        retry_call(absent, "f", policy, op=Op.UPLOAD, backend=S3, sleep=lambda s: None)
    assert errors() - before == 2.0
