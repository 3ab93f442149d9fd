from __future__ import annotations

import re
import urllib.request

import pytest
from tierckptd.catalog import Catalog
from tierckptd.ops import metrics


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def _value(body: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", body, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_metrics_endpoint_reports_catalog(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    metrics.bind_gauges(
        catalog.budget,
        catalog.used_bytes,
        catalog.reserved_bytes,
        catalog.pool_bytes,
        catalog.committed_count,
    )
    endpoint = metrics.serve("127.0.0.1:0")
    try:
        before = _scrape(endpoint.port)
        save(catalog, "run", "s", {"a": b"x" * 100})
        body = _scrape(endpoint.port)
    finally:
        endpoint.stop()
    assert _value(body, "tierckpt_memory_used_bytes") == catalog.used_bytes() >= 3 * 4096
    assert _value(body, "tierckpt_committed_checkpoints") == 1.0
    # counters are process-wide (other tests commit too): this save added exactly one
    commits = _value(body, "tierckpt_commits_total") - _value(before, "tierckpt_commits_total")
    assert commits == 1.0
    committed = _value(body, "tierckpt_committed_bytes_total") - _value(
        before, "tierckpt_committed_bytes_total"
    )
    assert committed == 100.0
    assert _value(body, "tierckpt_memory_budget_bytes") == catalog.budget
    # stopped: nothing listens on the port any more
    with pytest.raises(OSError):
        _scrape(endpoint.port)


def test_namespace_series_are_capped_to_the_newest_and_can_be_hashed() -> None:
    """Audit 3 M6/L4: one freshness series per namespace and tier grew the scrape with
    every job of the cluster (gossip brings them all) and named every job; now only the
    newest `namespace_series` namespaces get series, optionally under a hashed label, and
    tierckpt_namespaces still counts them all."""
    fresh = {f"job-{i:05d}": {"memory": 1000.0 + i, "durable": 500.0 + i} for i in range(5000)}
    endpoint = metrics.serve("127.0.0.1:0")
    try:
        metrics.bind_freshness(lambda: fresh, max_namespaces=3)
        body = _scrape(endpoint.port)
        metrics.bind_freshness(lambda: fresh, max_namespaces=3, hash_labels=True)
        hashed = _scrape(endpoint.port)
    finally:
        metrics.bind_freshness(lambda: {})
        endpoint.stop()
    series = re.findall(
        r'^tierckpt_newest_checkpoint_timestamp_seconds\{namespace="([^"]+)"', body, re.M
    )
    assert sorted(set(series)) == ["job-04997", "job-04998", "job-04999"]  # the newest 3
    assert len(series) == 6  # two tiers each
    assert _value(body, "tierckpt_namespaces") == 5000.0
    assert "job-0" not in hashed
    labels = set(
        re.findall(
            r'^tierckpt_newest_checkpoint_timestamp_seconds\{namespace="([^"]+)"', hashed, re.M
        )
    )
    want = {metrics.namespace_label(f"job-{i:05d}", True) for i in (4997, 4998, 4999)}
    assert labels == want and all(re.fullmatch(r"ns-[0-9a-f]{12}", label) for label in labels)
