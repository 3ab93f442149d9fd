"""The per-checkpoint durable hint end to end: two real daemons peering, draining to a
moto S3 server over HTTP with `[persistent] every = 100` (no checkpoint is due by
`every`). A save committed with `TieredStorageWriter(durable=True)` still drains, every
node its own files (the hint travels in the published manifest), and stock DCP loads it
from S3 bit-exact; the saves without the hint stay in memory only."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.support import jobs, moto_s3
from tests.support.backends import Nodes, StockUrl
from tests.support.cluster import local_cluster
from tests.support.dist_job import run_job
from tests.support.s3_drain import s3_names

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "hint-run"


def test_a_durable_save_drains_despite_every_on_every_owner(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    overrides = {
        "persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options), "every": 100}
    }
    with local_cluster(2, namespace=NS, overrides=overrides) as c:
        plain = Nodes(NS, c.addresses, 2)
        run_job(jobs.save_only, 4, plain, ["step-000001"], str(tmp_path), 11, timeout=180)
        hinted = dataclasses.replace(plain, durable=True)
        run_job(jobs.save_only, 4, hinted, ["step-000002"], str(tmp_path), 12, timeout=180)
        c.wait_state("step-000002", "DURABLE")
        # Both nodes' files are there (each owner drained its own), .metadata included.
        names = s3_names(s3, NS, "step-000002")
        assert {".metadata", "__0_0.distcp", "__3_0.distcp"} <= names
        for i in range(2):
            assert "persistent" in c.rows(i)["step-000002"]["tiers"]
        row = c.rows()["step-000001"]  # no hint, not due by `every`: memory only
        assert row["state"] != "DURABLE" and "persistent" not in row["tiers"]
        assert not s3_names(s3, NS, "step-000001")
        results = run_job(
            jobs.load_and_verify,
            4,
            StockUrl(s3.url(NS)),
            "step-000002",
            str(tmp_path / "step-000002"),
            timeout=180,
        )
        assert [r["world"] for r in results] == [4] * 4
