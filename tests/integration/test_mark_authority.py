"""Audit 3 H3: a checkpoint's rm/pin/unpin marks are statements of the nodes of its job.

A victim daemon peers with two in-process fakes, "mallory" and "buddy" (no mutual TLS: a
caller is whoever it claims, the strongest position the audit assumes), and gossips with
them every second. mallory's own ApplyMark on a checkpoint it neither coordinates nor
holds is refused and deletes nothing, also for an id not saved yet; a delete mark in
mallory's ListManifests answer made "by buddy", buddy's checkpoint's coordinator, is not
taken until buddy itself states it. Then three real daemons: an rm on a node that
neither holds nor coordinates the checkpoint is refused naming the nodes to ask, and an
rm on its coordinator still removes it everywhere, saying what the peers did (L5).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.peers.chunk_wire import PeerStub
from tierckptd.peers.security import node_client_interceptor

from tests.support.cli import cli, cli_json
from tests.support.cluster import local_cluster
from tests.support.daemon_process import DaemonProcess
from tests.support.fake_peer import FakePeer, code_of
from tests.support.ports import free_ports
from tests.support.raw_rpc import file_entry, raw_save

pytestmark = pytest.mark.integration

CODE = grpc.StatusCode
WAIT = 60.0


@dataclass
class Victim:
    daemon: DaemonProcess
    client: DaemonClient
    peer_address: str
    fakes: dict[str, FakePeer]
    stack: ExitStack

    def stub(self, node: str) -> PeerStub:
        channel = grpc.insecure_channel(self.peer_address)
        self.stack.callback(channel.close)
        return PeerStub(grpc.intercept_channel(channel, node_client_interceptor(node)))

    def ids(self, ns: str) -> list[str]:
        return sorted(c.checkpoint_id for c in self.client.list_checkpoints(ns))


@pytest.fixture(scope="module")
def victim() -> Iterator[Victim]:
    with ExitStack() as stack:
        fakes = {"mallory": FakePeer(), "buddy": FakePeer()}
        addresses = {}
        for node, fake in fakes.items():
            server = grpc.server(futures.ThreadPoolExecutor(4))
            peer_pb2_grpc.add_PeerServiceServicer_to_server(fake, server)
            addresses[node] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            server.start()
            stack.callback(server.stop, 0)
        (port,) = free_ports(1)
        daemon = DaemonProcess(
            {
                "node": {"id": "victim"},
                "listen": {"peer": f"127.0.0.1:{port}"},
                "memory": {"budget": "64MiB"},
                # Heal and gossip with both fakes every second.
                "replication": {"copies": 1, "heal_interval": 1.0},
                "peers": [{"id": n, "address": a} for n, a in addresses.items()],
            },
            name="victim",
        )
        stack.callback(daemon.cleanup)
        client = DaemonClient(daemon.address, timeout_s=30)
        stack.callback(client.close)
        yield Victim(daemon, client, f"127.0.0.1:{port}", fakes, stack)


def _mark(ns: str, cid: str, kind: int, origin: str) -> peer_pb2.CheckpointMark:
    return peer_pb2.CheckpointMark(
        ref=common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid),
        kind=kind,
        stamp_unix=time.time(),
        origin_node=origin,
    )


def _save(v: Victim, ns: str, cid: str) -> None:
    raw_save(v.client, ns, cid, {".metadata": b"meta-" + cid.encode(), "__0_0.distcp": b"x" * 999})


def _wait(what: str, check: Callable[[], bool], daemon: DaemonProcess) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{daemon.log_tail(40)}")
        time.sleep(0.2)


def test_a_peer_cannot_delete_or_pin_what_it_neither_holds_nor_coordinates(
    victim: Victim,
) -> None:
    ns = "jobB"
    _save(victim, ns, "step-1")
    _save(victim, ns, "step-2")
    mallory = victim.stub("mallory")
    # Any member may list itself as a copy's holder (it fetched one): that grants nothing.
    for cid in ("step-1", "step-2"):
        mallory.UpdateReplicas(
            peer_pb2.UpdateReplicasRequest(
                ref=common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid),
                file_name="__0_0.distcp",
                replica_nodes=["mallory"],
            ),
            timeout=30,
        )
        assert "mallory" in victim.client.get_checkpoint(ns, cid).file("__0_0.distcp").replica_nodes
    for cid in ("step-1", "step-2"):
        for kind in (peer_pb2.MARK_DELETED, peer_pb2.MARK_PINNED, peer_pb2.MARK_UNPINNED):
            mark = _mark(ns, cid, kind, "mallory")
            code = code_of(lambda m=mark: mallory.ApplyMark(m, timeout=30))
            assert code == CODE.PERMISSION_DENIED, (cid, kind, code)
    # A delete of an id not saved yet: nothing to mark, and it blocks no later save.
    code = code_of(
        lambda: mallory.ApplyMark(_mark(ns, "step-3", peer_pb2.MARK_DELETED, "mallory"), timeout=30)
    )
    assert code == CODE.NOT_FOUND, code
    _save(victim, ns, "step-3")
    assert victim.ids(ns) == ["step-1", "step-2", "step-3"]
    assert not any(victim.client.get_checkpoint(ns, c).pinned for c in victim.ids(ns))
    assert victim.daemon.data_dir(ns, "step-1").exists()


def test_a_mark_relayed_in_gossip_is_taken_only_when_its_origin_states_it(
    victim: Victim,
) -> None:
    ns = "jobR"
    # buddy coordinates jobR/step-1 (it publishes the manifest; it owns .metadata).
    info = common_pb2.CheckpointInfo(
        ref=common_pb2.CheckpointRef(namespace=ns, checkpoint_id="step-1"),
        state=common_pb2.COMMITTED,
        created_unix=time.time(),
        committed_unix=time.time(),
        sequence=1,
        files=[file_entry(".metadata", b"buddy-meta", "buddy")],
    )
    victim.stub("buddy").PublishCheckpoint(info, timeout=30)
    _save(victim, ns, "mine")  # the victim's own checkpoint, coordinated by it
    assert victim.ids(ns) == ["mine", "step-1"]
    mallory, buddy = victim.fakes["mallory"], victim.fakes["buddy"]
    forged = _mark(ns, "step-1", peer_pb2.MARK_DELETED, "buddy")
    mallory.marks = [
        forged,
        _mark(ns, "mine", peer_pb2.MARK_DELETED, "victim"),  # in the victim's own name
        _mark(ns, "mine", peer_pb2.MARK_PINNED, "buddy"),  # buddy does not hold it
    ]
    seen = mallory.times_asked()
    _wait("3 gossip rounds with mallory", lambda: mallory.times_asked() >= seen + 3, victim.daemon)
    _wait("buddy asked to confirm", lambda: buddy.times_asked(ns) >= 1, victim.daemon)
    assert victim.ids(ns) == ["mine", "step-1"]
    assert not victim.client.get_checkpoint(ns, "mine").pinned
    assert victim.daemon.data_dir(ns, "mine").exists()
    # Once buddy states the delete itself (only in its answer to the confirming call),
    # the relayed mark is taken.
    buddy.stated = [forged]
    _wait("buddy's confirmed delete", lambda: victim.ids(ns) == ["mine"], victim.daemon)
    assert victim.client.list_checkpoints(ns)[0].checkpoint_id == "mine"


def test_rm_is_issued_by_a_node_of_the_job_and_still_removes_every_copy() -> None:
    ns = "authority"
    files = {".metadata": b"m" * 100, "__0_0.distcp": os.urandom(4096)}
    with local_cluster(3, namespace=ns) as c:
        client = DaemonClient(c.nodes[0].address, timeout_s=60)
        try:
            raw_save(client, ns, "step-1", files)
            c.wait(
                "a replica of step-1",
                lambda: bool(
                    client.get_checkpoint(ns, "step-1").file("__0_0.distcp").replica_nodes
                ),
                WAIT,
            )
            replicas = client.get_checkpoint(ns, "step-1").file("__0_0.distcp").replica_nodes
        finally:
            client.close()
        outsider = min(replicas)  # holds a copy, but its ranks wrote nothing of step-1
        c.wait(
            "step-1 known everywhere", lambda: all("step-1" in c.rows(i) for i in range(3)), WAIT
        )
        refused = cli(c.nodes[int(outsider[-1])].address, "rm", ns, "step-1", check=False)
        assert refused.returncode != 0
        assert "node of its job: node0" in refused.stderr, refused.stderr
        assert all("step-1" in c.rows(i) for i in range(3))
        removed = cli_json(c.nodes[0].address, "rm", ns, "step-1")
        assert removed["peers_applied"] == 2 and removed["peers_pending"] == [], removed
        for i in range(3):
            assert "step-1" not in c.rows(i)
            assert not c.nodes[i].data_dir(ns, "step-1").exists()
