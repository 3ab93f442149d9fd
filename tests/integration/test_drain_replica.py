"""Drain from a replica, and SIGTERM's emergency drain of copies held for buddies (issue
12 point 4): real daemons peering on loopback, a moto S3 server over HTTP, and stock DCP
(`dcp.load(sd, checkpoint_id="s3://...")`, no tierckpt reader) loading the result.

The coordinator's own drain is held back with a fault point
(`TIERCKPT_FAULT=drain.upload:delay=...`), so its files reach S3 only through the replica
holder once the coordinator is killed and its memory wiped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import moto_s3
from tests.support.cluster import LocalCluster, local_cluster, save_job
from tests.support.s3_drain import s3_names, stock_load

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "replica-drain"
HELD_BACK = "drain.upload:delay=600"  # the coordinator never uploads while this test runs


def _overrides(bucket: moto_s3.S3Bucket, **keys: Any) -> dict[str, Any]:
    return {
        "persistent": {
            "url": bucket.url(),
            "storage_options": dict(bucket.storage_options),
            **keys,
        },
        "memory": {"budget": "256MiB"},
    }


@pytest.fixture
def held_back(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Restart one node of a cluster with its drain held back."""

    def restart(c: LocalCluster, i: int) -> None:
        c.nodes[i].kill9()
        monkeypatch.setenv("TIERCKPT_FAULT", HELD_BACK)
        try:
            c.nodes[i].start()
        finally:
            monkeypatch.delenv("TIERCKPT_FAULT")

    yield restart


def _memory_names(c: LocalCluster, i: int, checkpoint_id: str) -> set[str]:
    directory = c.nodes[i].data_dir(NS, checkpoint_id)
    return {p.name for p in directory.iterdir()} if directory.is_dir() else set()


@pytest.mark.parametrize(
    ("owner", "n"), [("down", 2), ("replaced", 2), ("down", 3)], ids=["down", "replaced", "3-nodes"]
)
def test_a_replica_drains_the_files_of_a_lost_owner_and_commits(
    s3: moto_s3.S3Bucket, tmp_path: Path, held_back: Any, owner: str, n: int
) -> None:
    """node0 coordinates and owns two ranks' files; its drain is held back, then it is
    killed with its memory. The nodes holding copies of node0's files upload them, and
    the one holding `.metadata` commits (the coordinator is gone); stock DCP loads it.

    "down": node0 stays down, so the others wait `owner_grace` (1 s) for it first; with
    3 nodes its copies are spread over both others. "replaced": node0 comes back empty
    (grace one hour): it answers without its files, so node1 uploads them at once, and
    node0, the coordinator again, commits."""
    grace = 1.0 if owner == "down" else 3600.0
    with local_cluster(n, namespace=NS, copies=1, overrides=_overrides(s3, owner_grace=grace)) as c:
        held_back(c, 0)
        save_job(c, 2 * n, 2, ["step-000001"], tmp_path, 23)
        c.wait_state("step-000001", "REPLICATED")
        owned_by_0 = _memory_names(c, 0, "step-000001")
        copies = set().union(*(_memory_names(c, i, "step-000001") for i in range(1, n)))
        assert ".metadata" in owned_by_0 and ".metadata" not in s3_names(s3, NS, "step-000001")
        assert owned_by_0 <= copies  # the others hold a copy of each
        assert not owned_by_0 & s3_names(s3, NS, "step-000001")  # none of node0's is up yet
        c.lose(0)
        if owner == "replaced":
            c.replace(0)  # without the fault: a plain replacement
        c.wait_state("step-000001", "DURABLE", timeout=120, nodes=tuple(range(1, n)))
        assert s3_names(s3, NS, "step-000001") == copies
        if owner == "down":
            logs = "".join(c.nodes[i].log_path.read_text(errors="replace") for i in range(1, n))
            assert "other nodes own (their owner is gone)" in logs
        else:  # node0 may have had copies healed back meanwhile: either may upload them
            c.wait_state("step-000001", "DURABLE")
        stock_load(s3, NS, 2 * n, "step-000001", tmp_path)
        stock_load(s3, NS, 2, "step-000001", tmp_path)  # resharded, still stock


def test_sigterm_drains_the_copies_a_node_holds_for_a_buddy(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    """Both ranks write to node0; node1 holds only replicas. every = 1000: nothing is
    due, so only node1's SIGTERM drain can put anything in S3: every file of the newest
    checkpoint it holds (node0's files, .metadata included), committed."""
    overrides = _overrides(s3, every=1000, shutdown_deadline=60.0)
    with local_cluster(2, namespace=NS, copies=1, overrides=overrides) as c:
        save_job(c, 2, 2, ["step-000001", "step-000002"], tmp_path, 23)
        c.wait_state("step-000002", "REPLICATED")
        c.wait_state("step-000001", "REPLICATED")
        assert not _memory_names(c, 1, "step-000002") - _memory_names(c, 0, "step-000002")
        assert not s3_names(s3, NS, "step-000002")
        assert c.nodes[1].terminate(timeout=90) == 0
        assert s3_names(s3, NS, "step-000002") == _memory_names(c, 0, "step-000002")
        assert not s3_names(s3, NS, "step-000001")  # only the newest
        stock_load(s3, NS, 2, "step-000002", tmp_path)
