"""Every metric the PrometheusRule alerts on and the Grafana dashboard plots is exported by
a live daemon: two real tierckptd peers draining to a moto S3, configured like the
DaemonSet (peers, persistent tier, metrics), and the names read from node 0's /metrics.

A labelled series with no child yet has no sample, but the exposition still declares its
family (# TYPE), so a name counts as exported from its family: a histogram `X` exports
X_bucket, X_sum and X_count, a counter `X` exports X_total, a gauge `X` exports X."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import moto_s3
from tests.support.cluster import local_cluster
from tests.support.deploy_files import load_dashboard, referenced_metrics

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

_SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "summary": ("", "_sum", "_count", "_created"),
}


def _exported(exposition: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_metric_of_the_alerts_and_the_dashboard_is_exported(
    s3: moto_s3.S3Bucket,
) -> None:
    overrides: dict[str, Any] = {
        "memory": {"budget": "128MiB"},
        "persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options)},
    }
    with local_cluster(2, namespace="deploy-metrics", overrides=overrides) as cluster:
        exported = _exported(cluster.metrics())
    referenced = referenced_metrics()
    assert len(referenced) >= 20, sorted(referenced)  # the extraction found the queries
    missing = {name: sorted(where) for name, where in referenced.items() if name not in exported}
    assert not missing, (
        "queried by deploy/ but not in a live daemon's /metrics (rename the query or "
        f"export the metric): {missing}"
    )


def test_the_dashboard_plots_every_panel_from_the_datasource_variable() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), ids
    plotted = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(plotted) >= 15
    for panel in plotted:
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], (panel["title"], target)
