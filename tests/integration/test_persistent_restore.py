"""Two daemons drain to a moto S3 server over HTTP, each node its own files and
`.metadata` last, and a cluster that then loses every memory tier restores from S3.

One cluster and one save serve both halves: what S3 holds after the drain (exactly the
DCP files, stock DCP loads it bit-exact at two world sizes), then, with every node killed
and its memory wiped, what the restarted nodes list and load through the tiered reader.

Uncompressed ([persistent] compression = "none"), the codec no other multi-node test
drains with. zstd, the default, runs each half elsewhere: two nodes' drain, S3 holding
exactly the memory tiers' files and stock DCP loading it (test_persistent_faults.py's S3
outage, test_drain_replica.py), a node or cluster with nothing in memory listing and
loading from S3 (test_persistent_live.py, test_pull_tiers.py). Single-node drains with
both codecs: test_persistent.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support import moto_s3
from tests.support.cluster import local_cluster, save_job
from tests.support.s3_drain import memory_names, persistent, s3_names, stock_load, tiered_load
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "drain-run"


@pytest.mark.timeout(240)  # two scenarios of the 120 s default's size, one cluster
def test_two_nodes_drain_their_own_files_then_every_memory_tier_lost_restores_from_s3(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    with local_cluster(2, namespace=NS, overrides=persistent(s3, compression="none")) as c:
        save_job(c, 4, 2, ["step-000001", "step-000002"], tmp_path, 11)
        c.wait_state("step-000002", "DURABLE")
        c.wait_state("step-000001", "DURABLE")
        # The drain: both nodes' files, nothing else, and both nodes know it is durable.
        assert s3_names(s3, NS, "step-000002") == memory_names(c, "step-000002")
        for i in range(2):
            assert "persistent" in c.rows(i)["step-000002"]["tiers"]
        stock_load(s3, NS, 4, "step-000002", tmp_path)
        stock_load(s3, NS, 2, "step-000002", tmp_path)  # resharded, still stock
        # Every memory tier lost: the restarted nodes learn both from S3 alone.
        for d in c.nodes:
            d.kill9()
            shutil.rmtree(d.memory_dir, ignore_errors=True)
        for d in c.nodes:
            d.start()
        # A listing answers from what the node knows while its start-up adoption runs
        # in the background (persistent/startup.py); it completes within the wait.
        for i in range(2):
            wait_until(
                f"node {i} to adopt both checkpoints from S3",
                lambda i=i: len(c.rows(i)) == 2,
                timeout=60.0,
                details=lambda i=i: repr(sorted(c.rows(i))),
            )
            rows = c.rows(i)
            assert sorted(rows) == ["step-000001", "step-000002"]
            assert rows["step-000002"]["state"] == "DURABLE"
            assert rows["step-000002"]["tiers"] == ["persistent"]
        tiered_load(c, 4, 2, "step-000002", tmp_path, newest=True)  # only in S3
        tiered_load(c, 2, 1, "step-000001", tmp_path)  # another world size
