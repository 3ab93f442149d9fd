from __future__ import annotations

import urllib.request

from tierckptd.catalog import Catalog
from tierckptd.ops import metrics


def test_metrics_endpoint_reports_catalog(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "s", {"a": b"x" * 100})
    metrics.bind_gauges(
        catalog.budget,
        catalog.used_bytes,
        catalog.reserved_bytes,
        catalog.pool_bytes,
        catalog.committed_count,
    )
    port = metrics.serve("127.0.0.1:0")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "tierckpt_memory_used_bytes 100.0" in body
    assert "tierckpt_committed_checkpoints 1.0" in body
    assert "tierckpt_commits_total" in body
    assert "tierckpt_memory_budget_bytes 1.048576e+06" in body
