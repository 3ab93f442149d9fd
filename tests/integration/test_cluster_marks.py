"""Cluster-wide `tierckpt rm`, `pin` and `unpin` on three real daemons peering on
loopback, draining to a moto S3 server over HTTP: rm reaches every holder and S3 (and a
second rm says it is gone), a checkpoint only S3 still knows is removed too, a pin asked
of one node holds every node's memory retention and the committer's persistent
retention, and a node that was down during an rm and a pin learns both on return."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import moto_s3
from tests.support.cli import cli
from tests.support.cluster import LocalCluster, local_cluster
from tests.support.dcp_files import SavedCheckpoint, save_checkpoint

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "marks-run"
WAIT = 60.0


def _s3_keys(bucket: moto_s3.S3Bucket, checkpoint_id: str) -> list[str]:
    """Every object of the checkpoint: its files, bookkeeping and index entry."""
    fs = bucket.fs()
    fs.invalidate_cache()
    return [p for p in fs.find(f"{bucket.name}/{NS}") if f"/{checkpoint_id}" in p]


def _held_by(c: LocalCluster, checkpoint_id: str) -> list[str]:
    """Nodes whose memory dir still has the checkpoint's data or manifest."""
    return [
        d.name
        for d in c.nodes
        if d.data_dir(NS, checkpoint_id).exists() or d.manifest_path(NS, checkpoint_id).exists()
    ]


def _overrides(bucket: moto_s3.S3Bucket, **retention: int) -> dict[str, Any]:
    return {
        "persistent": {"url": bucket.url(), "storage_options": dict(bucket.storage_options)},
        "retention": {"memory_keep_last": 0, **retention},
        "memory": {"budget": "256MiB"},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> SavedCheckpoint:
    return save_checkpoint(tmp_path_factory.mktemp("marks") / "ckpt")


def test_rm_on_one_node_removes_every_copy_and_the_persistent_one(
    s3: moto_s3.S3Bucket, saved: SavedCheckpoint
) -> None:
    with local_cluster(3, namespace=NS, overrides=_overrides(s3)) as c:
        c.raw_save(0, "step-000001", saved.files())
        c.raw_save(0, "step-000002", saved.files())
        c.wait_state("step-000001", "DURABLE")
        c.wait(
            "step-000001 known everywhere, its files on two nodes",
            lambda: (
                len(_held_by(c, "step-000001")) == 3
                and sum(d.data_dir(NS, "step-000001").exists() for d in c.nodes) >= 2
            ),
            WAIT,
        )
        assert _s3_keys(s3, "step-000001")
        # Asked of its coordinator (node 2, which neither coordinates nor wrote a file of
        # it, is refused: test_mark_authority.py).
        out = cli(c.nodes[0].address, "rm", NS, "step-000001")
        assert "step-000001" in out.stdout
        assert not _s3_keys(s3, "step-000001"), "rm left objects in the persistent tier"
        c.wait("every node forgot step-000001", lambda: not _held_by(c, "step-000001"), WAIT)
        for i in range(3):
            assert list(c.rows(i)) == ["step-000002"], c.rows(i)
        # Idempotent: nothing is left, and a second rm says so (no traceback).
        again = cli(c.nodes[1].address, "rm", NS, "step-000001", check=False)
        assert again.returncode == 1, again
        assert "removed from every tier" in again.stderr, again.stderr
        assert "Traceback" not in again.stderr
        # A checkpoint only the persistent tier still knows (every memory tier lost,
        # marks journals with them) is found there and removed.
        c.wait_state("step-000002", "DURABLE")
        c.lose(0, 1, 2)
        c.replace(0, 1, 2)
        cli(c.nodes[1].address, "rm", NS, "step-000002")
        assert not _s3_keys(s3, "step-000002")
        c.wait("no node lists step-000002", lambda: all(c.rows(i) == {} for i in range(3)), WAIT)
        # The survivors of the first rm never took it back (a publish, an adoption).
        assert not _held_by(c, "step-000001")


def test_a_pin_on_one_node_holds_every_nodes_retention_until_unpinned(
    s3: moto_s3.S3Bucket, saved: SavedCheckpoint
) -> None:
    overrides = _overrides(s3, memory_keep_last=1, persistent_keep_last=1)
    with local_cluster(3, namespace=NS, overrides=overrides) as c:
        c.raw_save(0, "step-000001", saved.files())
        c.wait_state("step-000001", "DURABLE")
        # Asked of the node of its job (another node is refused: test_mark_authority).
        out = cli(c.nodes[0].address, "pin", NS, "step-000001")
        assert "pinned" in out.stdout
        c.wait(
            "every node shows step-000001 pinned",
            lambda: all(c.rows(i)["step-000001"]["pinned"] for i in range(3)),
            WAIT,
        )
        for step in (2, 3):
            c.raw_save(0, f"step-00000{step}", saved.files())
            c.wait_state(f"step-00000{step}", "DURABLE")
        # Node 0 committed all three: its memory retention (keep 1) and its persistent
        # retention (keep 1) would have dropped step-000001 but for node 2's pin.
        assert c.nodes[0].data_dir(NS, "step-000001").exists()
        c.wait(
            "persistent retention dropped step-000002 (so it runs)",
            lambda: not any(k.endswith("/.metadata") for k in _s3_keys(s3, "step-000002")),
            WAIT,
        )
        assert any(k.endswith("step-000001/.metadata") for k in _s3_keys(s3, "step-000001"))
        for i in range(3):
            assert "step-000001" in c.rows(i)
        cli(c.nodes[0].address, "unpin", NS, "step-000001")
        c.raw_save(0, "step-000004", saved.files())
        c.wait_state("step-000004", "DURABLE")
        c.wait(
            "step-000001 evicted once unpinned",
            lambda: (
                not c.nodes[0].data_dir(NS, "step-000001").exists()
                and not any(k.endswith("/.metadata") for k in _s3_keys(s3, "step-000001"))
            ),
            WAIT,
        )


def test_persistent_retention_reaches_every_node_at_once(
    s3: moto_s3.S3Bucket, saved: SavedCheckpoint
) -> None:
    # Chaos finding: the committer's persistent retention deleted a checkpoint from S3,
    # and the other nodes listed it until their next relist of S3; a load through them
    # in that window found nothing. The deletion now travels as a cluster DELETED mark.
    overrides = _overrides(s3, persistent_keep_last=1)
    overrides["persistent"]["relist_interval"] = 3600.0  # no relist can explain the result
    with local_cluster(3, namespace=NS, overrides=overrides) as c:
        c.raw_save(0, "step-000001", saved.files())
        c.wait_state("step-000001", "DURABLE")
        c.raw_save(0, "step-000002", saved.files())
        c.wait_state("step-000002", "DURABLE")
        assert not any(k.endswith("/.metadata") for k in _s3_keys(s3, "step-000001"))
        c.wait(
            "no node lists step-000001 or holds any of it",
            lambda: (
                all("step-000001" not in c.rows(i) for i in range(3))
                and not _held_by(c, "step-000001")
            ),
            WAIT,
        )
        for i in range(3):
            assert "step-000002" in c.rows(i)


def test_a_node_down_during_rm_and_pin_learns_both_on_return(saved: SavedCheckpoint) -> None:
    with local_cluster(3, namespace=NS) as c:
        for step in (1, 2):
            c.raw_save(0, f"step-00000{step}", saved.files())
        c.wait("node 2 knows both", lambda: set(c.rows(2)) == {"step-000001", "step-000002"}, WAIT)
        assert c.nodes[2].manifest_path(NS, "step-000001").exists()
        c.nodes[2].kill9()  # down, its memory dir kept
        cli(c.nodes[0].address, "rm", NS, "step-000001")
        cli(c.nodes[0].address, "pin", NS, "step-000002")
        c.nodes[2].start()
        rows = c.rows(2)
        assert "step-000001" not in rows, rows
        assert rows["step-000002"]["pinned"], rows
        assert not _held_by(c, "step-000001")
        for i in range(3):  # nobody took it back from node 2's adopted manifest
            assert list(c.rows(i)) == ["step-000002"], c.rows(i)
