"""Peer tier at the daemon level: real tierckptd processes on 127.0.0.1 driven with
DaemonClient exactly as the writer does (begin, reserve, open, write, commit)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from tierckpt.errors import ChecksumMismatch

from tests.support.peer_nodes import NS, Nodes, payload

pytestmark = pytest.mark.integration


@pytest.fixture
def nodes_factory() -> Iterator[Callable[..., Nodes]]:
    with ExitStack() as stack:
        yield lambda n, **kw: Nodes(stack, n, **kw)


FILES = {
    0: {"__0_0.distcp": payload(1, (3 << 20) + 17), ".metadata": b"meta" * 100},
    1: {"__1_0.distcp": payload(2, 5000)},
    2: {"__2_0.distcp": payload(3, (1 << 20) * 2)},
}


def test_commit_publishes_and_replicates(nodes_factory: Callable[..., Nodes]) -> None:
    nodes = nodes_factory(3, heal_interval=3600.0)
    info = nodes.save("step-1", FILES)
    assert info.state in ("COMMITTED", "REPLICATED")
    owners = {f.name: f.owner_node for f in info.files}
    assert owners == {
        "__0_0.distcp": "n0",
        ".metadata": "n0",
        "__1_0.distcp": "n1",
        "__2_0.distcp": "n2",
    }
    nodes.wait_replicated("step-1")
    for c in nodes.clients:
        got = c.get_checkpoint(NS, "step-1")
        # every node sees the other nodes' copies; "memory" only where it holds them all
        held_all = all(f.local_path for f in got.files)
        assert got.tiers == (("memory", "peer") if held_all else ("peer",)), got.tiers
        for f in got.files:
            assert len(f.replica_nodes) == 1 and f.owner_node not in f.replica_nodes
    # Every copy on disk is bit-exact.
    for f in nodes.clients[0].get_checkpoint(NS, "step-1").files:
        data = next(d[f.name] for d in FILES.values() if f.name in d)
        for holder in (f.owner_node, *f.replica_nodes):
            path = nodes.nodes[int(holder[1:])].data_dir(NS, "step-1") / f.name
            assert path.read_bytes() == data


def test_missing_file_refuses_commit(nodes_factory: Callable[..., Nodes]) -> None:
    nodes = nodes_factory(2, heal_interval=3600.0)
    with pytest.raises(Exception, match="missing files: __9_0.distcp"):
        nodes.clients[0].begin_checkpoint(NS, "step-x", 0)
        nodes.clients[0].commit_checkpoint(NS, "step-x", ["__9_0.distcp"])


def test_replacement_fetches_then_heals(nodes_factory: Callable[..., Nodes]) -> None:
    nodes = nodes_factory(2, heal_interval=0.5)
    files = {0: FILES[0], 1: FILES[1]}
    nodes.save("step-2", files)
    nodes.wait_replicated("step-2")
    nodes.lose_and_replace(1)
    # The replacement knows the checkpoint from its peer's manifests.
    info = nodes.clients[1].get_checkpoint(NS, "step-2")
    assert {f.name for f in info.files} == {"__0_0.distcp", ".metadata", "__1_0.distcp"}
    entry = nodes.clients[1].ensure_local(NS, "step-2", "__1_0.distcp")
    assert entry.local_path and Path(entry.local_path).read_bytes() == files[1]["__1_0.distcp"]
    # Healing: node 1 gets every copy back and the checkpoint is REPLICATED again.
    nodes.wait_replicated("step-2")
    nodes.wait(
        "node 1 holds all files",
        lambda: all(f.local_path for f in nodes.clients[1].get_checkpoint(NS, "step-2").files),
    )
    ok, _, corrupt = nodes.clients[1].verify_checkpoint(NS, "step-2")
    assert ok and not corrupt


def test_a_copy_restored_from_a_peer_is_told_by_a_queued_job(
    nodes_factory: Callable[..., Nodes],
) -> None:
    """A node that restores a copy from a peer (here a reader's pull onto a node that held
    none) does not tell the peers in the restore's thread: it queues a job that tells the
    file's neighbourhood and the coordinator its replica list, which names it. No heal
    round runs (heal_interval is an hour), so only that queued job can tell n0."""
    nodes = nodes_factory(3, heal_interval=3600.0)
    nodes.save("step-4", FILES)
    nodes.wait_replicated("step-4")
    f = next(
        f for f in nodes.clients[0].get_checkpoint(NS, "step-4").files if f.name == ".metadata"
    )
    assert f.owner_node == "n0" and len(f.replica_nodes) == 1
    reader = next(i for i in (1, 2) if f"n{i}" not in f.replica_nodes)
    entry = nodes.clients[reader].ensure_local(NS, "step-4", ".metadata")
    assert entry.local_path and Path(entry.local_path).read_bytes() == FILES[0][".metadata"]
    nodes.wait(
        f"n0 lists n{reader} as a holder of .metadata",
        lambda: (
            f"n{reader}"
            in next(
                g.replica_nodes
                for g in nodes.clients[0].get_checkpoint(NS, "step-4").files
                if g.name == ".metadata"
            )
        ),
    )


def test_lost_buddy_shows_under_replicated(nodes_factory: Callable[..., Nodes]) -> None:
    nodes = nodes_factory(2, heal_interval=0.3)
    nodes.save("step-3", {0: FILES[0], 1: FILES[1]})
    nodes.wait_replicated("step-3")
    nodes.nodes[1].kill9()
    nodes.wait(
        "under-replicated on node 0",
        lambda: "under-replicated" in nodes.clients[0].get_checkpoint(NS, "step-3").tiers,
    )
    assert nodes.clients[0].get_checkpoint(NS, "step-3").state == "COMMITTED"
    nodes.nodes[1].start()  # same memory: its copies are still there
    nodes.wait_replicated("step-3")


def test_flipped_byte_is_repaired_and_counted(nodes_factory: Callable[..., Nodes]) -> None:
    nodes = nodes_factory(2, heal_interval=3600.0)
    nodes.save("step-4", {0: FILES[0], 1: FILES[1]})
    nodes.wait_replicated("step-4")
    victim = nodes.nodes[0].data_dir(NS, "step-4") / "__0_0.distcp"
    good = victim.read_bytes()
    os.chmod(victim, 0o600)
    with open(victim, "r+b") as f:
        f.seek(len(good) - 10)
        f.write(bytes([good[-10] ^ 0x01]))
    entry = nodes.clients[0].ensure_local(NS, "step-4", "__0_0.distcp", repair=True)
    assert Path(entry.local_path).read_bytes() == good
    assert nodes.clients[0].verify_checkpoint(NS, "step-4")[0]
    assert 'tierckpt_corrupt_copies_total{where="local"} 1.0' in nodes.metrics()
    assert "corrupt copy of peerd/step-4/__0_0.distcp" in nodes.nodes[0].log_path.read_text()


def test_corrupt_copy_is_not_served_and_fetch_falls_through(
    nodes_factory: Callable[..., Nodes],
) -> None:
    nodes = nodes_factory(3, heal_interval=3600.0, copies=2)
    nodes.save("step-5", {0: FILES[0], 1: FILES[1], 2: FILES[2]})
    nodes.wait_replicated("step-5")
    # Corrupt the owner's copy of node 0's file, and node 1's (a replica holder): node 1
    # repairs its copy, asking the owner first. (No restart: a restarted node's peers
    # would push it their copies at once, the corrupt one found while pushed.)
    victim = nodes.nodes[0].data_dir(NS, "step-5") / "__0_0.distcp"
    good = victim.read_bytes()
    for path in (victim, nodes.nodes[1].data_dir(NS, "step-5") / "__0_0.distcp"):
        os.chmod(path, 0o600)
        with open(path, "r+b") as f:
            f.write(bytes([good[0] ^ 0xFF]))
    entry = nodes.clients[1].ensure_local(NS, "step-5", "__0_0.distcp", repair=True)
    assert Path(entry.local_path).read_bytes() == good  # from n2, not the corrupt n0
    # n0 noticed while serving, counted it and repairs its copy in the background.
    nodes.wait("n0 repaired", lambda: victim.exists() and victim.read_bytes() == good)
    assert 'tierckpt_corrupt_copies_total{where="served"} 1.0' in nodes.metrics()


def test_no_copy_anywhere_is_data_loss(nodes_factory: Callable[..., Nodes]) -> None:
    nodes = nodes_factory(2, heal_interval=3600.0)
    nodes.save("step-6", {0: {"__0_0.distcp": b"x" * 3000}, 1: FILES[1]})
    nodes.wait_replicated("step-6")
    for d in nodes.nodes:
        path = d.data_dir(NS, "step-6") / "__0_0.distcp"
        os.chmod(path, 0o600)
        path.write_bytes(b"y" * 3000)
    with pytest.raises(ChecksumMismatch, match="__0_0.distcp"):
        nodes.clients[0].ensure_local(NS, "step-6", "__0_0.distcp", repair=True)
