"""Honest state after a loss (issue 12 point 3), with real daemons and real DCP jobs.

Three nodes, copies = 1, no persistent tier. Node 1's pushes are held back by a fault
point (`peer.offer:delay=...`), so its file of the second checkpoint has no other
copy when node 1 is killed -9 and comes back empty. Then every node lists that
checkpoint LOST (naming the file), loading it raises `CheckpointLost`, and
`checkpoint_id=None` restores the older, complete one bit-exact, saying which newer one
it skipped. When the lost copy comes back (node 1's memory put back), the state heals.

There `heal_interval` is an hour: what makes the nodes notice at once is the returning
node's start (it pulls manifests with `starting`, its peers heal what it held; it heals
what it adopted), not the periodic heal. A second, torch-free test shows that a holder
that does not answer is no loss (it may come back), and that the periodic heal finds a
real one.
"""

from __future__ import annotations

import logging
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt import TieredStorageReader
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import CHECKPOINT_LOST_PREFIX, CheckpointLost
from tierckpt.fsspec_fs import TierckptFileSystem

from tests.support import jobs
from tests.support.backends import Nodes
from tests.support.cli import cli
from tests.support.cluster import LocalCluster, local_cluster, save_job
from tests.support.dist_job import run_job
from tests.support.errors import capture, originals
from tests.support.peer_nodes import NS as PEER_NS
from tests.support.peer_nodes import Nodes as PeerNodes
from tests.support.peer_nodes import payload

pytestmark = pytest.mark.integration

NS = "lost-run"
RANK1 = "__1_"  # rank 1 runs on node 1 and writes __1_0.distcp, __1_1.distcp, ...
# Node 1's replica pushes stall (well past the test) from its restart on.
HELD_BACK = "peer.offer:delay=3600"


def _load_plain(c: LocalCluster, checkpoint_id: str | None, expected: Path) -> None:
    """One process on node 0, no process group: a 3-rank checkpoint into a plain model."""
    (result,) = run_job(
        jobs.load_plain_no_pg,
        1,
        Nodes(NS, (c.addresses[0],), 1),
        checkpoint_id,
        str(expected),
        use_pg=False,
        timeout=180,
    )
    assert result["leaves"] >= 20


def _wait_loadable(c: LocalCluster, checkpoint_id: str, timeout: float = 60.0) -> None:
    """Until every node lists the checkpoint COMMITTED or REPLICATED, with no lost file."""
    deadline = time.monotonic() + timeout
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = [c.rows(i).get(checkpoint_id, {}) for i in range(len(c.nodes))]
        if all(r.get("state") in ("COMMITTED", "REPLICATED") for r in rows):
            assert all(r["lost_files"] == [] for r in rows), rows
            return
        time.sleep(0.3)
    logs = "\n".join(d.log_tail(40) for d in c.nodes)
    raise AssertionError(f"{checkpoint_id} not loadable on every node: {rows}\n{logs}")


def _lost_error(address: str, checkpoint_id: str) -> CheckpointLost:
    reader = TieredStorageReader(NS, daemon=address)
    raised = capture(
        lambda: dcp.load({"x": torch.zeros(1)}, checkpoint_id=checkpoint_id, storage_reader=reader)
    )
    found = [e for e in originals(raised) if isinstance(e, CheckpointLost)]
    assert found, f"expected CheckpointLost, got {raised!r}"
    return found[0]


def test_a_lost_file_is_listed_lost_everywhere_and_the_newest_complete_one_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    expected = tmp_path / "expected"
    overrides = {"memory": {"budget": "256MiB"}}
    with local_cluster(3, namespace=NS, copies=1, overrides=overrides) as c:
        save_job(c, 3, 1, ["step-1"], expected, 41)
        c.wait_state("step-1", "REPLICATED")

        node1 = c.nodes[1]
        node1.terminate()
        monkeypatch.setenv("TIERCKPT_FAULT", HELD_BACK)
        try:
            node1.start()
        finally:
            monkeypatch.delenv("TIERCKPT_FAULT")
        save_job(c, 3, 1, ["step-2"], expected, 42)
        lost_files = sorted(p.name for p in node1.data_dir(NS, "step-2").glob(f"{RANK1}*"))
        assert lost_files
        for i in (0, 2):  # nobody else got a copy of node 1's files
            assert not list(c.nodes[i].data_dir(NS, "step-2").glob(f"{RANK1}*"))

        # Node 1 dies with its memory (kept aside, to put back later), and returns empty.
        node1.kill9()
        kept = tmp_path / "node1-memory"
        shutil.move(node1.memory_dir, kept)
        node1.start()
        c.wait_state("step-2", "LOST", timeout=60)
        for i in range(3):
            row = c.rows(i)["step-2"]
            assert row["lost_files"] == lost_files, row
            assert c.rows(i)["step-1"]["state"] in ("COMMITTED", "REPLICATED")
        listing = cli(c.nodes[0].address, "ls", NS).stdout
        assert f"step-2 is LOST: no copy of {', '.join(lost_files)} is left" in listing, listing
        # tierckpt://: listed with its state (retention can rm it), but a framework's
        # "highest step with a .metadata" discovery passes over it; `latest` too.
        fs = TierckptFileSystem(daemon=c.nodes[2].address)
        rows = {e["checkpoint_id"]: e["state"] for e in fs.ls(f"tierckpt://{NS}")}
        assert rows["step-2"] == "LOST" and rows["step-1"] in ("COMMITTED", "REPLICATED")
        assert not fs.isfile(f"tierckpt://{NS}/step-2/.metadata")
        assert fs.isfile(f"tierckpt://{NS}/step-1/.metadata")
        assert fs.info(f"tierckpt://{NS}/latest")["checkpoint_id"] == "step-1"

        # Loading it names the file and the node that held it; not a checksum error.
        for i in (0, 1):
            lost = _lost_error(c.nodes[i].address, "step-2")
            assert str(lost).startswith(CHECKPOINT_LOST_PREFIX)
            assert all(f in str(lost) for f in lost_files) and "node1" in str(lost), lost
        # The restore chain itself: every source answered without the file.
        client = DaemonClient(c.nodes[2].address)
        try:
            with pytest.raises(CheckpointLost) as raised:
                client.ensure_local(NS, "step-2", lost_files[0])
        finally:
            client.close()
        assert str(raised.value).startswith(CHECKPOINT_LOST_PREFIX)
        assert "peer node1: missing" in str(raised.value), raised.value

        # checkpoint_id=None: the newest complete one, saying which newer one is LOST.
        reader = TieredStorageReader(NS, daemon=c.nodes[2].address)
        reader.reset(None)
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            reader.read_metadata()
        assert reader.checkpoint_id == "step-1" and reader.lost_newer == ("step-2",)
        assert "the newer step-2 is LOST" in caplog.text and lost_files[0] in caplog.text
        _load_plain(c, None, expected / "step-1")

        # The lost copy comes back (node 1's memory put back): healed on every node.
        node1.kill9()
        shutil.rmtree(node1.memory_dir)
        shutil.move(kept, node1.memory_dir)
        node1.start()
        _wait_loadable(c, "step-2")
        _load_plain(c, "step-2", expected / "step-2")


def test_an_unreachable_holder_is_no_loss_and_the_heal_loop_finds_a_real_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node that does not answer may come back with its copy: the checkpoint stays
    COMMITTED (under-replicated) and the newest. Once it answers without the file, the
    periodic heal lists it LOST; with nothing complete left, "newest" says so."""
    with ExitStack() as stack:
        nodes = PeerNodes(stack, 3, heal_interval=0.5, overrides={"memory": {"budget": "64MiB"}})
        n1 = nodes.nodes[1]
        n1.terminate()
        monkeypatch.setenv("TIERCKPT_FAULT", HELD_BACK)
        try:
            n1.start()
        finally:
            monkeypatch.delenv("TIERCKPT_FAULT")
        nodes.save(
            "s1", {0: {"__0_0.distcp": payload(1, 3000)}, 1: {"__1_0.distcp": payload(2, 5000)}}
        )
        nodes.lose(1)  # killed -9 with its memory; not back yet
        survivors = (nodes.clients[0], nodes.clients[2])

        def marked() -> bool:
            rows = [{r.checkpoint_id: r for r in c.list_checkpoints(PEER_NS)} for c in survivors]
            return all("under-replicated" in r["s1"].tiers for r in rows)

        nodes.wait("s1 under-replicated on the survivors", marked)
        for c in survivors:
            (row,) = c.list_checkpoints(PEER_NS)
            assert row.state == "COMMITTED" and row.lost_files == ()
            assert c.get_checkpoint(PEER_NS).checkpoint_id == "s1"
        nodes.replace(1)  # back, empty: it answers without __1_0.distcp
        nodes.wait("s1 LOST everywhere", lambda: set(nodes.states("s1")) == {"LOST"})
        for c in nodes.clients:
            assert c.list_checkpoints(PEER_NS)[0].lost_files == ("__1_0.distcp",)
            with pytest.raises(CheckpointLost, match="every committed one is LOST"):
                c.get_checkpoint(PEER_NS)
