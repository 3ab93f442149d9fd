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
    assert _value(body, "tierckpt_memory_used_bytes") == 100.0
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
