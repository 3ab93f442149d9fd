"""Persistent tier end to end: real daemons drain to a moto S3 server over HTTP, which
checkpoints are due, and what each tier's retention keeps.

Every drained checkpoint is loaded back by STOCK DCP (`dcp.load(sd, checkpoint_id=
"s3://bucket/ns/id")`, endpoint from AWS_ENDPOINT_URL_S3, no tierckpt reader), bit-exact.
Two nodes and a cluster that lost every memory tier: test_persistent_restore.py; S3
outages, SIGTERM and kills mid-drain: test_persistent_faults.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import moto_s3
from tests.support.cluster import local_cluster, save_job
from tests.support.s3_drain import memory_names, persistent, s3_names, stock_load, tiered_load

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "drain-run"


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_single_node_drains_and_stock_dcp_loads_from_s3(
    s3: moto_s3.S3Bucket, tmp_path: Path, compression: str
) -> None:
    with local_cluster(1, namespace=NS, overrides=persistent(s3, compression=compression)) as c:
        save_job(c, 2, 2, ["step-000001"], tmp_path, 11)
        c.wait_state("step-000001", "DURABLE")
        row = c.rows()["step-000001"]
        assert "persistent" in row["tiers"] and "memory" in row["tiers"]
        # Exactly the DCP files, nothing else, in the checkpoint's directory.
        assert s3_names(s3, NS, "step-000001") == memory_names(c, "step-000001")
        stock_load(s3, NS, 2, "step-000001", tmp_path)
        stock_load(s3, NS, 1, "step-000001", tmp_path)  # resharded, still stock


def test_every_nth_checkpoint_is_drained_and_a_restart_resumes(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    with local_cluster(1, namespace=NS, overrides=persistent(s3, every=2)) as c:
        save_job(c, 2, 2, ["step-000001", "step-000002"], tmp_path, 11)
        c.wait_state("step-000002", "DURABLE")
        assert c.rows()["step-000001"]["state"] == "COMMITTED"  # not due
        assert not s3_names(s3, NS, "step-000001")
        # kill -9 before a drain: the restarted daemon rebuilds its queue from manifests.
        c.nodes[0].kill9()
        fs = s3.fs()
        fs.rm(f"{s3.name}/{NS}/step-000002/.metadata")
        c.nodes[0].start()
        c.wait_state("step-000002", "DURABLE")
        # The check of what S3 still holds runs after READY, in the background (audit 3
        # H7): wait, boundedly, for the re-drained `.metadata`.
        deadline = time.monotonic() + 90
        while not fs.exists(f"{s3.name}/{NS}/step-000002/.metadata"):
            assert time.monotonic() < deadline, "the restarted daemon never re-drained"
            time.sleep(0.5)
            fs.invalidate_cache()
        stock_load(s3, NS, 2, "step-000002", tmp_path)


def test_memory_retention_keeps_checkpoints_not_yet_durable(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    bucket = moto_s3.S3Bucket(s3.endpoint_url, name="no-such-bucket")
    overrides = {
        **persistent(bucket),
        "retention": {"memory_keep_last": 1},
    }
    with local_cluster(1, namespace=NS, overrides=overrides) as c:
        save_job(c, 1, 1, ["step-000001", "step-000002", "step-000003"], tmp_path, 11)
        # The bucket does not exist: nothing becomes durable, so nothing is evicted.
        rows = c.rows()
        assert sorted(rows) == ["step-000001", "step-000002", "step-000003"]
        assert {r["state"] for r in rows.values()} == {"COMMITTED"}


def test_retention_per_tier(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    overrides = {
        **persistent(s3),
        "retention": {
            "memory_keep_last": 2,
            "persistent_keep_last": 3,
            "persistent_keep_every": 5,
        },
    }
    ids = [f"step-{i:06d}" for i in range(1, 11)]
    with local_cluster(1, namespace=NS, overrides=overrides) as c:
        save_job(c, 2, 2, ids, tmp_path, 11)
        c.wait_state("step-000010", "DURABLE")
        want_s3 = {"step-000005", "step-000008", "step-000009", "step-000010"}
        want_memory = {"step-000009", "step-000010"}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = c.rows()
            in_memory = {cid for cid, r in rows.items() if "memory" in r["tiers"]}
            in_s3 = {cid for cid, r in rows.items() if "persistent" in r["tiers"]}
            fs = s3.fs()
            fs.invalidate_cache()
            durable = {p.split("/")[-2] for p in fs.glob(f"{s3.name}/{NS}/*/.metadata")}
            if (in_memory, in_s3, durable, set(rows)) == (want_memory, want_s3, want_s3, want_s3):
                break
            time.sleep(0.5)
        assert in_memory == want_memory
        assert in_s3 == want_s3 == durable
        assert set(rows) == want_s3
        assert set(p.name for p in c.nodes[0].data_dir(NS).iterdir()) == want_memory
        tiered_load(c, 2, 2, "step-000005", tmp_path)  # from S3 only
