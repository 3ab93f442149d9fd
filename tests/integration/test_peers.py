"""Peer tier end to end: real daemons as nodes on 127.0.0.1, real gloo jobs whose ranks
talk to their own node's daemon, and no persistent tier: after a node is lost with its
memory, only a peer can serve its files.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests.support import jobs
from tests.support.backends import Nodes
from tests.support.cli import cli, ls_json
from tests.support.cluster import LocalCluster, local_cluster, save_job
from tests.support.daemon_process import DaemonProcess
from tests.support.dist_job import run_job

pytestmark = pytest.mark.integration

NS = "peer-run"


def cluster(n: int, **kwargs: Any) -> AbstractContextManager[LocalCluster]:
    """`n` nodes, each in its own failure domain, peering with all others."""
    return local_cluster(n, namespace=NS, **kwargs)


def _load(
    c: LocalCluster, world: int, ranks_per_node: int, checkpoint_id: str, expected: Path
) -> None:
    backend = Nodes(NS, c.addresses, ranks_per_node)
    results = run_job(
        jobs.load_and_verify,
        world,
        backend,
        checkpoint_id,
        str(expected / checkpoint_id),
        timeout=120,
    )
    assert [r["world"] for r in results] == [world] * world


def _local_files(daemon: DaemonProcess, checkpoint_id: str) -> set[str]:
    directory = daemon.data_dir(NS, checkpoint_id)
    return {p.name for p in directory.iterdir()} if directory.is_dir() else set()


def _wait_log(daemon: DaemonProcess, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in daemon.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{daemon.name} never logged {text!r}"
        time.sleep(0.2)


def _wait_files(
    daemon: DaemonProcess, checkpoint_id: str, names: set[str], timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while not names <= _local_files(daemon, checkpoint_id):
        assert time.monotonic() < deadline, f"{daemon.name} lacks {names}"
        time.sleep(0.2)


def _counter(metrics: str, name: str) -> float:
    """The value of an unlabelled sample `name` in Prometheus text (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("n", [2, 3])
def test_replacement_node_restores_from_a_peer(tmp_path: Path, n: int) -> None:
    with cluster(n) as c:
        save_job(c, 2 * n, 2, ["step-000100"], tmp_path, 5, timeout=120)
        c.wait_state("step-000100", "REPLICATED")
        owned_by_node0 = {
            f for f in _local_files(c.nodes[0], "step-000100") if f.startswith(("__0_", "__1_"))
        }
        assert owned_by_node0, "node0 should own its ranks' files"
        owned_bytes = sum(
            (c.nodes[0].data_dir(NS, "step-000100") / f).stat().st_size for f in owned_by_node0
        )
        c.lose(0)
        c.replace(0)
        # The replacement came back empty and knows the checkpoint (manifests from
        # peers) before any load,
        assert "adopted 1 checkpoints from peers' manifests" in c.nodes[0].log_path.read_text()
        assert [r["id"] for r in ls_json(c.nodes[0].address, NS)] == ["step-000100"]
        # preallocates pool segments for the files it will restore, and only then tells
        # its peers it started (they push its files back at once).
        _wait_log(c.nodes[0], "pool segments (for the files this node will restore)")
        _load(c, 2 * n, 2, "step-000100", tmp_path)
        # What its ranks needed (fetched, or pushed back) is in its own memory tier, in
        # those segments.
        _wait_files(c.nodes[0], "step-000100", owned_by_node0)
        assert _counter(c.metrics(), "tierckpt_recycled_bytes_total") >= owned_bytes


def test_replacement_node_restores_at_another_world_size(tmp_path: Path) -> None:
    with cluster(2) as c:
        save_job(c, 4, 2, ["step-000200"], tmp_path, 6, timeout=120)
        c.wait_state("step-000200", "REPLICATED")
        c.lose(1)
        c.replace(1)
        _load(c, 2, 1, "step-000200", tmp_path)  # 4 ranks -> 2, one per node


def test_two_copies_survive_losing_two_nodes_at_once(tmp_path: Path) -> None:
    with cluster(4, copies=2) as c:
        save_job(c, 4, 1, ["step-000300"], tmp_path, 7, timeout=120)
        c.wait_state("step-000300", "REPLICATED")
        c.lose(0, 1)
        c.replace(0, 1)
        _load(c, 4, 1, "step-000300", tmp_path)


def test_healing_brings_lost_copies_back(tmp_path: Path) -> None:
    with cluster(2, heal_interval=0.5) as c:
        save_job(c, 2, 1, ["step-000400"], tmp_path, 8, timeout=120)
        c.wait_state("step-000400", "REPLICATED")
        before = _local_files(c.nodes[1], "step-000400")
        c.lose(1)
        c.replace(1)
        # Node 1 came back empty: its own files and its replicas of node 0's are gone,
        # until the survivors re-replicate.
        c.wait_state("step-000400", "REPLICATED", timeout=60)
        deadline = time.monotonic() + 30
        while _local_files(c.nodes[1], "step-000400") != before and time.monotonic() < deadline:
            time.sleep(0.3)
        assert _local_files(c.nodes[1], "step-000400") == before
        assert cli(c.nodes[1].address, "verify", NS, "step-000400").returncode == 0


def test_a_flipped_byte_is_never_served_and_is_repaired(tmp_path: Path) -> None:
    with cluster(2) as c:
        save_job(c, 2, 1, ["step-000500"], tmp_path, 9, timeout=120)
        c.wait_state("step-000500", "REPLICATED")
        victim = c.nodes[0].data_dir(NS, "step-000500") / "__0_0.distcp"
        good = victim.read_bytes()
        os.chmod(victim, 0o600)
        with open(victim, "r+b") as f:
            f.seek(len(good) // 2)
            byte = f.read(1)
            f.seek(len(good) // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert cli(c.nodes[0].address, "verify", NS, "step-000500", check=False).returncode != 0
        _load(c, 2, 1, "step-000500", tmp_path)  # bit-exact: the bad copy was not used
        assert victim.read_bytes() == good  # and it was replaced by a verified copy
        assert cli(c.nodes[0].address, "verify", NS, "step-000500").returncode == 0
        # Counted once, as a bad local copy (the metric's HELP line alone would not match).
        assert 'tierckpt_corrupt_copies_total{where="local"} 1.0' in c.metrics()
