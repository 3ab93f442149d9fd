"""The persistent tier as a live source, end to end: real daemons, moto S3 over HTTP.

Two independent clusters (their own memory tiers, no peering) drain into the same bucket
and namespace. The other cluster's checkpoints are restored by the tierckpt reader bit-exact
by explicit id (probed and adopted on demand) and as "the newest" once the re-list
interval has passed; a restore while S3 is down is UNAVAILABLE naming the persistent tier
(never DATA_LOSS) and succeeds once S3 is back.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import TierUnavailable

from tests.support import jobs, moto_s3
from tests.support.backends import Nodes
from tests.support.cluster import LocalCluster, local_cluster, save_job
from tests.support.dist_job import RankFailed, run_job

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "live-run"
RELIST = 2.0


def _persistent(bucket: moto_s3.S3Bucket, **keys: Any) -> dict[str, Any]:
    return {
        "persistent": {
            "url": bucket.url(),
            "storage_options": dict(bucket.storage_options),
            **keys,
        }
    }


def _load(c: LocalCluster, cid: str | None, expected: Path, shown_as: str) -> None:
    target = str(expected / shown_as)
    backend = Nodes(NS, c.addresses, 1)
    results = run_job(jobs.load_and_verify, 1, backend, cid, target, timeout=180)
    assert [r["world"] for r in results] == [1]


def test_a_checkpoint_another_cluster_drained_is_restored_by_id_and_as_newest(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    config = _persistent(s3, relist_interval=RELIST)
    with (
        local_cluster(1, namespace=NS, id_prefix="a", overrides=config) as a,
        local_cluster(1, namespace=NS, id_prefix="b", overrides=config) as b,
    ):
        assert b.rows() == {}
        save_job(a, 1, 1, ["step-000005", "step-000006"], tmp_path, 23)
        a.wait_state("step-000005", "DURABLE")
        a.wait_state("step-000006", "DURABLE")
        # b never saw them: an explicit id is probed in S3, adopted, restored bit-exact.
        _load(b, "step-000005", tmp_path, "step-000005")
        time.sleep(RELIST + 0.5)
        _load(b, None, tmp_path, "step-000006")  # the newest, after the re-list interval
        rows = b.rows()
        assert sorted(rows) == ["step-000005", "step-000006"]
        assert all(r["state"] == "DURABLE" for r in rows.values())


def test_a_restore_while_s3_is_down_is_unavailable_then_succeeds(
    s3: moto_s3.S3Bucket, moto_server: moto_s3.MotoServer, tmp_path: Path
) -> None:
    config = _persistent(s3, relist_interval=3600.0)
    with (
        local_cluster(1, namespace=NS, id_prefix="a", overrides=config) as a,
        local_cluster(1, namespace=NS, id_prefix="b", overrides=config) as b,
    ):
        save_job(a, 1, 1, ["step-000003"], tmp_path, 23)
        a.wait_state("step-000003", "DURABLE")
        client = DaemonClient(b.nodes[0].address)
        try:
            info = client.get_checkpoint(NS, "step-000003")  # adopted: no file held on b
            names = sorted(f.name for f in info.files)
            moto_server.stop()
            try:
                for name in (".metadata", names[0]):
                    with pytest.raises(TierUnavailable) as caught:
                        client.ensure_local(NS, "step-000003", name)
                    message = str(caught.value)
                    assert f"persistent {s3.url()}" in message, message
                    assert "refused" in message or "connect" in message.lower(), message
                # An id b does not know cannot be looked up either: UNAVAILABLE, not NOT_FOUND.
                with pytest.raises(TierUnavailable, match="persistent s3://"):
                    client.get_checkpoint(NS, "step-000009")
                with pytest.raises(RankFailed, match="tier unavailable: persistent s3://"):
                    _load(b, "step-000003", tmp_path, "step-000003")
            finally:
                moto_server.restart()
            _load(b, "step-000003", tmp_path, "step-000003")
        finally:
            client.close()
