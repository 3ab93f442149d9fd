"""Re-saving a committed id through real daemons: an atomic replace.

Two nodes, one gloo rank on each (each rank's file on its own node, a replica on the
other). Until the re-save commits, the old checkpoint is what every node lists and loads,
bit-exact; a re-save whose ranks are killed -9, or whose daemons crash, leaves it as it
was. After the commit every node lists only the new generation (a later sequence), loads
it bit-exact, its replicas are the new bytes (a load served from the buddy after the
owner lost its memory), and no file of the old one is left in any memory tier. With a
persistent tier, the drain of the new generation removes the old `.metadata` before any
byte of it goes up, so stock DCP never reads an old `.metadata` beside new data files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import moto_s3
from tests.support.backends import Nodes
from tests.support.cluster import LocalCluster, local_cluster, save_job
from tests.support.dist_job import start_job
from tests.support.resave_jobs import resave_and_stall
from tests.support.s3_drain import persistent, s3_names, stock_load, tiered_load

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "resave"
ID = "step-000010"
ABANDON = 20.0  # [memory] abandon_after: longer than a stalled re-save is looked at


def _rows(c: LocalCluster) -> list[dict[str, dict[str, object]]]:
    return [c.rows(i) for i in range(len(c.nodes))]


def _names_on_disk(c: LocalCluster) -> list[list[str]]:
    """Every entry of the namespace's data dir on each node (a generation left over
    shows as a second directory)."""
    out = []
    for d in c.nodes:
        root = d.data_dir(NS)
        out.append(sorted(p.name for p in root.iterdir()) if root.is_dir() else [])
    return out


def _stalled_resave(
    c: LocalCluster, old: Path, lost: Path, seed: int, *, crash_daemons: bool
) -> None:
    """A re-save of ID written on both nodes and stalled before its commit: the old
    checkpoint is what both list and load, bit-exact, meanwhile; then the ranks are
    killed -9 (with `crash_daemons`, both daemons too, restarted on their memory), and
    the old one is still what they list and load; the unfinished generation is
    collected (a restart, or abandon_after)."""
    job = start_job(resave_and_stall, 2, Nodes(NS, c.addresses, 1), ID, str(lost), seed)
    try:
        job.wait_for_marker("in_write", [0, 1], timeout=120)
        assert len(_names_on_disk(c)[0]) == 2  # the old generation and the one written
        assert [sorted(r) for r in _rows(c)] == [[ID], [ID]]
        tiered_load(c, 2, 1, ID, old)
        job.kill_rank(1)
        job.kill_all()
        if crash_daemons:
            for d in c.nodes:
                d.kill9()
            for d in c.nodes:
                d.start()
    finally:
        job.cleanup()
    c.wait_state(ID, "REPLICATED")
    tiered_load(c, 2, 1, ID, old)
    c.wait(
        "the unfinished generation collected",
        lambda: _names_on_disk(c) == [[ID], [ID]],
        timeout=60,
    )


@pytest.mark.timeout(600)
def test_a_resave_replaces_the_checkpoint_on_every_node_atomically(tmp_path: Path) -> None:
    old, new, lost = tmp_path / "old", tmp_path / "new", tmp_path / "lost"
    # abandon_after: a re-save whose ranks died is collected without a restart.
    overrides = {"memory": {"abandon_after": ABANDON}}
    with local_cluster(2, namespace=NS, copies=1, heal_interval=1.0, overrides=overrides) as c:
        save_job(c, 2, 1, [ID], old, 11)
        c.wait_state(ID, "REPLICATED")
        first = [r[ID]["sequence"] for r in _rows(c)]

        # Re-saves killed before their commit (ranks; ranks and daemons): the old stays.
        _stalled_resave(c, old, lost, 12, crash_daemons=False)
        _stalled_resave(c, old, lost, 13, crash_daemons=True)
        assert [r[ID]["sequence"] for r in _rows(c)] == first

        # A re-save that commits: every node lists the new generation only.
        save_job(c, 2, 1, [ID], new, 14)
        c.wait_state(ID, "REPLICATED")
        rows = _rows(c)
        assert [sorted(r) for r in rows] == [[ID], [ID]]
        later = [r[ID]["sequence"] for r in rows]
        assert later[0] == later[1] and later[0] > first[0], (first, later)
        tiered_load(c, 2, 1, ID, new, newest=True)
        # One directory of it per node: the old generation's files are gone.
        assert _names_on_disk(c) == [[ID], [ID]]

        # The owner of rank 0's file (and coordinator) loses its memory: the buddy's
        # replica is the new generation's bytes.
        c.lose(0)
        c.replace(0)
        c.wait_state(ID, "REPLICATED", timeout=120)
        tiered_load(c, 2, 1, ID, new)


def test_a_drained_checkpoint_resaved_never_pairs_old_metadata_with_new_data(
    s3: moto_s3.S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    # kill -9 right after the drain of the new generation removed the old `.metadata`,
    # before any byte of the new one went up.
    monkeypatch.setenv("TIERCKPT_FAULT", "drain.retire_metadata:kill")
    with local_cluster(1, namespace=NS, overrides=persistent(s3)) as c:
        monkeypatch.delenv("TIERCKPT_FAULT")  # the running daemon read it at start
        node = c.nodes[0]
        save_job(c, 2, 2, [ID], old, 21)
        c.wait_state(ID, "DURABLE")
        stock_load(s3, NS, 2, ID, old)

        save_job(c, 2, 2, [ID], new, 22)  # the default: overwrite
        c.wait("the daemon killed at drain.retire_metadata", lambda: not node.running)
        names = s3_names(s3, NS, ID)
        assert ".metadata" not in names and names, names  # old data, no `.metadata`

        node.start()  # adopts the committed new generation and drains it, `.metadata` last
        c.wait_state(ID, "DURABLE", timeout=120)
        stock_load(s3, NS, 2, ID, new)
        tiered_load(c, 2, 2, ID, new)
