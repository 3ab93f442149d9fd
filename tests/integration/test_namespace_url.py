"""Per-namespace persistent URLs end to end: two real daemons peering, a moto S3 server
over HTTP, `[persistent] url` on one prefix and `allowed_urls` admitting another.

The job sets its namespace's URL on node 0 only; node 1 learns it from the published
manifest, so each owner drains its own files to the job's prefix (nothing lands under
the daemon's URL), and stock DCP loads the checkpoint from there bit-exact. URLs outside
the policy are refused with the status a client can act on (PERMISSION_DENIED for a
sibling prefix or another bucket, INVALID_ARGUMENT for a path trick), and a replacement
node with an empty memory tier finds the job's durable checkpoints under its URL.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import InvalidArgument, PermissionDenied

from tests.support import jobs, moto_s3
from tests.support.backends import Nodes, StockUrl
from tests.support.cluster import local_cluster
from tests.support.daemon_process import DaemonProcess
from tests.support.dist_job import run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "url-run"


def _names(bucket: moto_s3.S3Bucket, prefix: str) -> set[str]:
    fs = bucket.fs()
    fs.invalidate_cache()
    try:
        return {p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket.name}/{prefix}")}
    except FileNotFoundError:
        return set()


def test_the_namespace_url_travels_to_every_owner_and_stays_inside_the_policy(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    persistent = {
        "url": s3.url("cluster-default"),
        "allowed_urls": [s3.url("jobs")],
        "storage_options": dict(s3.storage_options),
        "every": 100,
    }
    job_url = s3.url("jobs", "team-a")
    with local_cluster(2, namespace=NS, overrides={"persistent": persistent}) as c:
        first = DaemonClient(c.addresses[0])
        refusals = [
            (s3.url("jobs-evil"), PermissionDenied),
            ("s3://another-bucket/jobs", PermissionDenied),
            (s3.url("cluster-default-2"), PermissionDenied),
            (s3.url("jobs") + "/../cluster-default", InvalidArgument),
            (s3.url("jobs") + "//team-a", InvalidArgument),
        ]
        for url, error in refusals:
            with pytest.raises(error):
                first.set_namespace(NS, persistent_url=url)
        assert first.set_namespace(NS, persistent_url=job_url + "/") == job_url

        nodes = dataclasses.replace(Nodes(NS, c.addresses, 1), durable=True)
        run_job(jobs.save_only, 2, nodes, ["step-000001"], str(tmp_path), 21, timeout=180)
        c.wait_state("step-000001", "DURABLE")
        # Node 1 never saw SetNamespace: its files went where the manifest said.
        landed = _names(s3, f"jobs/team-a/{NS}/step-000001")
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= landed
        assert not _names(s3, f"cluster-default/{NS}")
        info = DaemonClient(c.addresses[1]).get_checkpoint(NS, "step-000001")
        assert info.persistent_url == job_url
        results = run_job(
            jobs.load_and_verify,
            2,
            StockUrl(f"{job_url}/{NS}"),
            "step-000001",
            str(tmp_path / "step-000001"),
            timeout=180,
        )
        assert [r["world"] for r in results] == [2] * 2

    # A replacement node (empty memory, no peers): the job names its URL, and the
    # newest durable checkpoint is found there and restored, verified, from S3.
    fresh = DaemonProcess({"persistent": persistent}, name="url-fresh")
    try:
        client = DaemonClient(fresh.address)
        client.set_namespace(NS, persistent_url=job_url)
        assert client.get_checkpoint(NS, "").checkpoint_id == "step-000001"
        tiered = Nodes(NS, (fresh.address,), 2)
        results = run_job(
            jobs.load_and_verify, 2, tiered, None, str(tmp_path / "step-000001"), timeout=180
        )
        assert [r["world"] for r in results] == [2] * 2
    finally:
        fresh.cleanup()
