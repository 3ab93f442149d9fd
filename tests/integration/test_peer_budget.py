"""A member cannot take another node's memory or make it call everyone (audit 3, M3),
with real daemons.

- Manifests: a peer's manifests are charged to their own cap per coordinating node
  ([memory] peer_manifest_share of the budget). Manifests describing 4 GiB files in
  64 KiB blocks (about 2.6 MiB each) are refused with RESOURCE_EXHAUSTED naming the cap,
  and the node's own 8 MiB save in a 16 MiB budget still succeeds; a small manifest from
  the same peer is still taken.
- Hello flood: a stranger's Hello makes discovery run a round (a joining node), but at
  most one round every few seconds and one claimed id with back-off, so 50 Hellos over
  five seconds cost the members a bounded number of Hellos back.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.checksum import DIGEST_SIZE
from tierckpt.daemon_client import DaemonClient
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.peers.chunk_wire import PeerStub
from tierckptd.peers.security import node_client_interceptor

from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_ports
from tests.support.raw_rpc import file_entry, raw_save

pytestmark = pytest.mark.integration


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _stub(stack: ExitStack, address: str, claim: str) -> PeerStub:
    channel = grpc.insecure_channel(address)
    stack.callback(channel.close)
    return PeerStub(grpc.intercept_channel(channel, node_client_interceptor(claim)))


def _huge_manifest(cid: str, size: int = 4 << 30, block: int = 64 << 10) -> Any:
    """A manifest coordinated by mallory describing one `size`-byte file."""
    blocks = -(-size // block)
    huge = common_pb2.FileEntry(
        name="__0_0.distcp",
        size=size,
        checksums=common_pb2.BlockChecksums(
            algorithm="xxh3-128", block_size=block, block_digests=os.urandom(16) * blocks
        ),
        owner_node="mallory",
    )
    return _manifest(cid, [file_entry(".metadata", b"meta", "mallory"), huge])


def _manifest(cid: str, files: list[Any] | None = None) -> Any:
    now = time.time()
    return common_pb2.CheckpointInfo(
        ref=common_pb2.CheckpointRef(namespace="flood", checkpoint_id=cid),
        state=common_pb2.COMMITTED,
        created_unix=now,
        committed_unix=now,
        sequence=1,
        files=files or [file_entry(".metadata", b"meta-" + cid.encode(), "mallory")],
    )


def test_a_peers_manifests_cannot_take_the_nodes_save_budget(stack: ExitStack) -> None:
    assert DIGEST_SIZE == 16
    port, unused = free_ports(2)
    victim = DaemonProcess(
        {
            "listen": {"peer": f"127.0.0.1:{port}"},
            "memory": {"budget": "16MiB"},
            "peers": [{"id": "mallory", "address": f"127.0.0.1:{unused}"}],
        },
        name="victim",
    )
    stack.callback(victim.cleanup)
    mallory = _stub(stack, f"127.0.0.1:{port}", "mallory")
    refused = []
    for i in range(4):
        try:
            mallory.PublishCheckpoint(_huge_manifest(f"step-{i}"), timeout=60)
        except grpc.RpcError as e:
            refused.append((e.code(), e.details() or ""))
    assert len(refused) == 4, victim.log_tail(20)
    for code, details in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "mallory" in details and "peer_manifest_share" in details
    mallory.PublishCheckpoint(_manifest("step-small"), timeout=60)  # within its share

    client = DaemonClient(victim.address, timeout_s=60)
    stack.callback(client.close)
    raw_save(client, "mine", "step-1", {"__0_0.distcp": os.urandom(8 << 20)})
    assert [c.checkpoint_id for c in client.list_checkpoints("mine")] == ["step-1"]
    assert [c.checkpoint_id for c in client.list_checkpoints("flood")] == ["step-small"]


class Member(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    """A member the victim discovers through its hostfile: counts the Hellos it gets."""

    def __init__(self) -> None:
        self.hellos = 0
        self.lock = threading.Lock()

    def Hello(self, request: peer_pb2.HelloRequest, context: Any) -> peer_pb2.HelloResponse:
        with self.lock:
            self.hellos += 1
        return peer_pb2.HelloResponse(node_id="member1", failure_domain="r1", knows_caller=True)

    def count(self) -> int:
        with self.lock:
            return self.hellos


def test_a_hello_flood_from_a_stranger_costs_a_bounded_number_of_rounds(
    stack: ExitStack, tmp_path: Path
) -> None:
    member = Member()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    peer_pb2_grpc.add_PeerServiceServicer_to_server(member, server)
    member_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    stack.callback(server.stop, 0)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{member_address}\n")
    (port,) = free_ports(1)
    victim = DaemonProcess(
        {
            "listen": {"peer": f"127.0.0.1:{port}"},
            # Only the first round and the strangers' wake-ups ask the member.
            "membership": {"hostfile": str(hostfile), "refresh": 3600.0},
        },
        name="victim",
    )
    stack.callback(victim.cleanup)
    assert member.count() >= 1  # the first round, before READY
    before = member.count()

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stack.callback(channel.close)
    stranger = PeerStub(channel)
    started = time.monotonic()
    for i in range(50):
        claim = "stranger-1" if i % 2 else f"stranger-{uuid.uuid4().hex[:12]}"
        answer = stranger.Hello(peer_pb2.HelloRequest(node_id=claim), timeout=30)
        assert answer.node_id == "victim" and not answer.knows_caller
        time.sleep(0.1)
    flood = time.monotonic() - started
    time.sleep(2.0)  # a round woken by the last Hellos has finished
    rounds = member.count() - before
    # One round at once, one more after STRANGER_GAP (5 s); before the fix, one a second.
    assert rounds <= 3, f"{rounds} membership rounds for 50 Hellos over {flood:.1f} s"
    assert rounds >= 1  # a stranger is still looked for (a joining node)
