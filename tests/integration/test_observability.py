"""What an operator sees of a save, its replication, its drain and its restores (issue 13
point 5): the latency histograms, the per-tier freshness gauges (RPO), the drain backlog,
peer up/down and build info on `/metrics`, JSON log lines with the checkpoint's fields,
and `tierckpt status`'s per-tier freshness. Real daemons peering on loopback, moto S3
over HTTP; every assertion is a count or a value, never a timing."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support import moto_s3
from tests.support.backends import Tiered
from tests.support.cli import cli, cli_json
from tests.support.cluster import LocalCluster, local_cluster
from tests.support.ports import free_ports
from tests.support.state_dicts import plain_tensor_state

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "observed"
CKPT = "step-000001"
NBYTES = 1 << 20
FRESH = "tierckpt_newest_checkpoint_timestamp_seconds"


def _overrides(bucket: moto_s3.S3Bucket) -> dict[str, Any]:
    return {
        "persistent": {"url": bucket.url(), "storage_options": dict(bucket.storage_options)},
        "memory": {"budget": "128MiB"},
        "log": {"format": "json"},
    }


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def _value(body: str, name: str, **labels: str) -> float | None:
    shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = rf"^{name}\{{{re.escape(shown)}\}} (\S+)$" if labels else rf"^{name} (\S+)$"
    match = re.search(pattern, body, re.M)
    return None if match is None else float(match.group(1))


def _count(c: LocalCluster, i: int, histogram: str, **labels: str) -> float:
    return _value(_scrape(c.metrics_ports[i]), f"{histogram}_count", **labels) or 0.0


def _files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}


def _json_records(c: LocalCluster, i: int) -> list[dict[str, Any]]:
    """Every line the daemon wrote to node i's log, each of which must be one JSON
    object (the test harness's own "===== start #N =====" separators aside)."""
    records = []
    for line in c.nodes[i].log_path.read_text().splitlines():
        if not line or line.startswith("===== start #"):
            continue
        record = json.loads(line)
        assert isinstance(record, dict), line
        records.append(record)
    return records


def test_save_replicate_drain_and_restores_are_observed(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    with local_cluster(3, namespace=NS, copies=1, overrides=_overrides(s3), metrics_all=True) as c:
        Tiered(NS, c.nodes[0].address).save(plain_tensor_state(1, NBYTES), CKPT)
        c.wait_state(CKPT, "DURABLE")
        written = _files(c.nodes[0].data_dir(NS, CKPT))
        n = len(written)
        # node0 coordinated and owns every file: it committed, pushed each file to one
        # buddy, and wrote .metadata to S3.
        c.wait("pushes timed", lambda: _count(c, 0, "tierckpt_replicate_duration_seconds") >= n)
        c.wait("drain timed", lambda: _count(c, 0, "tierckpt_drain_duration_seconds") >= 1)
        body = _scrape(c.metrics_ports[0])
        assert _value(body, "tierckpt_save_duration_seconds_count") == 1.0
        assert _value(body, "tierckpt_commit_duration_seconds_count") == 1.0
        assert _value(body, "tierckpt_replicate_duration_seconds_count") == n
        assert _value(body, "tierckpt_drain_duration_seconds_count") == 1.0
        data = sum(size for name, size in written.items() if name != ".metadata")
        assert _value(body, "tierckpt_drained_bytes_total") == data
        assert _value(body, "tierckpt_drain_backlog_checkpoints") == 0.0
        assert _value(body, "tierckpt_drain_backlog_bytes") == 0.0
        for op in ("upload", "read", "list", "delete"):
            assert _value(body, "tierckpt_persistent_errors_total", op=op) == 0.0
        assert _value(body, "tierckpt_peer_up", peer="node1") == 1.0
        assert _value(body, "tierckpt_peer_up", peer="node2") == 1.0
        assert re.search(r'^tierckpt_build_info\{version="[^"]+"\} 1\.0$', body, re.M)
        committed = c.rows(0)[CKPT]["committed"]
        for tier in ("memory", "replicated", "durable"):
            assert _value(body, FRESH, namespace=NS, tier=tier) == pytest.approx(committed)
        # the other nodes were published the checkpoint: they did not time a save
        other = _scrape(c.metrics_ports[1])
        assert _value(other, "tierckpt_save_duration_seconds_count") == 0.0
        assert _value(other, FRESH, namespace=NS, tier="durable") == pytest.approx(committed)

        # `tierckpt status`: the same freshness, per namespace and tier
        status = cli_json(c.nodes[0].address, "status")
        assert status["freshness"][NS] == pytest.approx(
            {"memory": committed, "replicated": committed, "durable": committed}
        )
        text = cli(c.nodes[0].address, "status").stdout
        assert "newest checkpoint per tier (RPO):" in text
        assert re.search(rf"^  {NS}\s+\S+ ago\s+\S+ ago\s+\S+ ago$", text, re.M), text

        # Restores: each file is held by exactly one of node1/node2 (one extra copy), so
        # pulling on both serves every file once from memory and once from a peer.
        cli_json(c.nodes[1].address, "pull", NS, CKPT, str(tmp_path / "pull1"))
        pulled = cli(c.nodes[2].address, "pull", NS, CKPT, str(tmp_path / "pull2"))
        assert pulled.stderr == ""  # no progress bar when stderr is not a terminal
        served = {
            source: sum(
                _count(c, i, "tierckpt_restore_duration_seconds", source=source) for i in (1, 2)
            )
            for source in ("memory", "peer", "persistent")
        }
        assert served == {"memory": n, "peer": n, "persistent": 0.0}

        # JSON logs: one object per line, the fixed fields, the checkpoint's context
        records = _json_records(c, 0)
        assert all({"time", "level", "logger", "node", "msg"} <= r.keys() for r in records)
        assert {r["node"] for r in records} == {"node0"}
        begin = [r for r in records if r["msg"].startswith(f"begin {NS}/{CKPT}")]
        assert [(r["namespace"], r["checkpoint"], r["rank"]) for r in begin] == [(NS, CKPT, 0)]
        commit = [r for r in records if r["msg"].startswith(f"committed {NS}/{CKPT}")]
        assert [(r["namespace"], r["checkpoint"]) for r in commit] == [(NS, CKPT)]
        assert any(
            r["msg"].startswith("replicated ") and r.get("checkpoint") == CKPT for r in records
        )

        # Every memory tier is lost; a replacement node0 finds the checkpoint in S3 only.
        c.lose(0, 1, 2)
        c.replace(0)
        # Adoption from S3 runs after READY, in the background (a silent S3 must not hold
        # READY, audit 3 H7): wait, boundedly, for the durable series to appear.
        deadline = time.monotonic() + 60
        body = _scrape(c.metrics_ports[0])
        while _value(body, FRESH, namespace=NS, tier="durable") is None:
            assert time.monotonic() < deadline, "the replacement never adopted from S3"
            time.sleep(0.2)
            body = _scrape(c.metrics_ports[0])
        assert _value(body, FRESH, namespace=NS, tier="memory") is None  # nothing in memory
        assert _value(body, FRESH, namespace=NS, tier="durable") == pytest.approx(committed)
        assert _value(body, "tierckpt_peer_up", peer="node1") == 0.0  # down since its start
        cli_json(c.nodes[0].address, "pull", NS, CKPT, str(tmp_path / "pull0"))
        assert _count(c, 0, "tierckpt_restore_duration_seconds", source="persistent") == n
        body = _scrape(c.metrics_ports[0])
        assert _value(body, FRESH, namespace=NS, tier="memory") == pytest.approx(committed)


def test_drain_backlog_counts_what_is_not_durable_yet(
    s3: moto_s3.S3Bucket, daemon_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the drain held back (fault point), the committed checkpoint is the backlog:
    one checkpoint, every byte of it (this node owns every file)."""
    (port,) = free_ports(1)
    monkeypatch.setenv("TIERCKPT_FAULT", "drain.upload:delay=600")
    daemon = daemon_factory({**_overrides(s3), "metrics": {"listen": f"127.0.0.1:{port}"}})
    monkeypatch.delenv("TIERCKPT_FAULT")
    Tiered(NS, daemon.address).save(plain_tensor_state(2, NBYTES), CKPT)
    size = sum(_files(daemon.data_dir(NS, CKPT)).values())
    body = _scrape(port)
    assert _value(body, "tierckpt_drain_backlog_checkpoints") == 1.0
    assert _value(body, "tierckpt_drain_backlog_bytes") == size
    assert _value(body, FRESH, namespace=NS, tier="memory") is not None
    assert _value(body, FRESH, namespace=NS, tier="durable") is None  # not there yet


def test_an_s3_outage_is_counted_and_the_drain_timed_once_it_ends(
    s3: moto_s3.S3Bucket, moto_server: moto_s3.MotoServer, daemon_factory: Any
) -> None:
    """S3 down: the drain's calls fail and are counted by operation, the checkpoint stays
    in the backlog; S3 back: it drains, and the drain is observed once."""
    (port,) = free_ports(1)
    daemon = daemon_factory({**_overrides(s3), "metrics": {"listen": f"127.0.0.1:{port}"}})

    def errors() -> float:
        body = _scrape(port)
        ops = ("upload", "read", "list", "delete")
        return sum(_value(body, "tierckpt_persistent_errors_total", op=op) or 0.0 for op in ops)

    def wait(what: str, check: Any, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"{what}\n{daemon.log_tail(40)}"
            time.sleep(0.3)

    moto_server.stop()
    try:
        Tiered(NS, daemon.address).save(plain_tensor_state(3, NBYTES), CKPT)
        wait("an S3 error counted", lambda: errors() > 0)
        assert _value(_scrape(port), "tierckpt_drain_backlog_checkpoints") == 1.0
    finally:
        moto_server.restart()
    wait(
        "the drain timed once S3 is back",
        lambda: _value(_scrape(port), "tierckpt_drain_duration_seconds_count") == 1.0,
    )
    body = _scrape(port)
    assert _value(body, "tierckpt_drain_backlog_checkpoints") == 0.0
    assert _value(body, FRESH, namespace=NS, tier="durable") is not None
