"""No listing says REPLICATED for a file whose copy a restarted peer lost (issue 28).

Four real daemons on loopback, copies = 1, each its own failure domain. Node 0 saves
checkpoints (it owns every file) and each file gets one replica on a buddy. The buddy
holding the most replicas is killed -9, its memory tier wiped, and restarted empty with
the same node id, while node 0 is frozen (SIGSTOP): nobody can push the copies back, so
what every other node lists is what it believes, not a heal that happened to be quick.
With four nodes a file's neighbourhood (owner, replicas, first placement candidates)
leaves one node out; that node's healer never looked at the file, and its listing kept
saying REPLICATED on the buddy's name alone: the network chaos run's 251 dishonest
listings after a member was replaced empty.

Bounded window: a peer learns of the restart from the restarted node's start-up
announce (ListManifests with `starting`), sent after its adoption of the peers'
manifests and its restore prewarm, a few seconds after it is READY. From then on every
listing says under-replicated until a heal finds the copies again.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from typing import Any

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.records import CheckpointInfo

from tests.support.cluster import LocalCluster, local_cluster

pytestmark = pytest.mark.integration

NS = "restart-honesty"
IDS = [f"step-{i:03d}" for i in range(6)]
# The restarted node's announce follows its READY by its pull of manifests (node 0,
# frozen, answers nothing: the pull waits out its deadline) and its prewarm.
ANNOUNCE_WINDOW = 20.0


def _listings(c: LocalCluster, nodes: list[int]) -> dict[int, list[CheckpointInfo]]:
    out: dict[int, list[CheckpointInfo]] = {}
    for i in nodes:
        client = DaemonClient(c.nodes[i].address, timeout_s=30)
        try:
            out[i] = client.list_checkpoints(NS)
        finally:
            client.close()
    return out


def _dishonest(c: LocalCluster, nodes: list[int]) -> list[str]:
    """Every (node, checkpoint, file) listed REPLICATED while a listed holder lacks the
    file on disk (the network chaos runner's check, bench/net_chaos.py)."""
    by_id = {d.name: d for d in c.nodes}
    out: list[str] = []
    for i, rows in _listings(c, nodes).items():
        for info in rows:
            if info.state != "REPLICATED":
                continue
            for f in info.files:
                holders = [h for h in (f.owner_node, *f.replica_nodes) if h]
                present = [
                    h
                    for h in holders
                    if (by_id[h].data_dir(NS, info.checkpoint_id) / f.name).is_file()
                ]
                if len(present) < 2:
                    out.append(f"node{i} {info.checkpoint_id}/{f.name}: on {holders}, {present}")
    return out


def _buddy(c: LocalCluster) -> int:
    """The node holding the most of node 0's replicas."""
    held: Counter[str] = Counter()
    for info in _listings(c, [0])[0]:
        for f in info.files:
            held.update(f.replica_nodes)
    name, _ = held.most_common(1)[0]
    return next(i for i, d in enumerate(c.nodes) if d.name == name)


def test_no_replicated_listing_names_a_peer_that_came_back_empty() -> None:
    files: dict[str, bytes] = {f"__0_{j}.distcp": os.urandom(4096 + j) for j in range(2)}
    files[".metadata"] = os.urandom(512)
    cfg: dict[str, Any] = {"namespace": NS, "copies": 1, "heal_interval": 2.0}
    with local_cluster(4, **cfg) as c:
        for checkpoint_id in IDS:
            c.raw_save(0, checkpoint_id, files)
        for checkpoint_id in IDS:
            c.wait_state(checkpoint_id, "REPLICATED")
        assert not _dishonest(c, [0, 1, 2, 3])
        buddy = _buddy(c)
        others = [i for i in (1, 2, 3) if i != buddy]
        os.kill(c.nodes[0].pid, signal.SIGSTOP)  # nobody pushes the lost copies back
        try:
            c.lose(buddy)
            c.replace(buddy)
            back = time.monotonic()
            watched = [*others, buddy]
            lying = _dishonest(c, watched)
            while lying and time.monotonic() - back < ANNOUNCE_WINDOW:
                time.sleep(0.3)
                lying = _dishonest(c, watched)
            settled = time.monotonic() - back
            assert not lying, f"still listed REPLICATED {settled:.1f} s after the restart: {lying}"
            # From then on, while the copies cannot come back, no listing lies.
            end = time.monotonic() + 8.0
            while time.monotonic() < end:
                assert not _dishonest(c, watched), f"{settled:.1f} s after the restart"
                time.sleep(0.3)
            under = [
                (i, x)
                for i in others
                for x, row in c.rows(i).items()
                if row["state"] == "COMMITTED" and "under-replicated" in row["tiers"]
            ]
            assert under, "the buddy held replicas: some checkpoint is under-replicated"
        finally:
            os.kill(c.nodes[0].pid, signal.SIGCONT)
        # Node 0 back: the copies are re-made and every node lists REPLICATED again,
        # honestly.
        for checkpoint_id in IDS:
            c.wait_state(checkpoint_id, "REPLICATED", timeout=90.0)
        assert not _dishonest(c, [0, 1, 2, 3])
