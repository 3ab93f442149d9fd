"""A replacement node's newest comes from the cluster, not from whoever answers first
(audit 3 H2, the trust-on-first-use hole), on real daemons.

Three honest daemons a, b, c: a coordinates job/step-1 and job/step-2, b's rank wrote one
file of each (b took part), c only peers. A hostile member m (an in-process peer: no
mutual TLS, its identity is what it claims) coordinates job/step-999, states itself as
job's writer, and relays a made-up job/step-1000 that names a as its coordinator. A fresh
node r (empty memory tier) starts with m listed first among its peers: its newest of job
is a's step-2 through the daemon, the native reader and `tierckpt://job/latest`; step-999
is listed (`foreign`) and loadable by id only; the relayed step-1000 is never taken.
With m and a as its only peers, no writer has a majority (a node never vouches for
itself alone): no newest, a NOT_FOUND naming the candidates; a checkpoint named by
its id is still found.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch.distributed.checkpoint as dcp
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import CheckpointNotFound
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.peers.chunk_wire import PeerStub
from tierckptd.peers.security import node_client_interceptor

from tests.support.daemon_process import DaemonProcess
from tests.support.dcp_files import (
    SavedCheckpoint,
    assert_state_equal,
    load_target,
    save_two_rank_checkpoint,
)
from tests.support.ports import free_ports
from tests.support.raw_rpc import file_entry, write_files

pytestmark = pytest.mark.integration

NS = "job"
HONEST = ("a", "b", "c")
FRESH = ("r", "r2", "r3")  # configured on the honest nodes, started by the tests


def _forged(cid: str, coordinator: str, sequence: int) -> common_pb2.CheckpointInfo:
    """A checkpoint whose `.metadata` `coordinator` owns, with made-up bytes."""
    return common_pb2.CheckpointInfo(
        ref=common_pb2.CheckpointRef(namespace=NS, checkpoint_id=cid),
        state=common_pb2.COMMITTED,
        created_unix=time.time(),
        committed_unix=time.time(),
        sequence=sequence,
        files=[
            file_entry(".metadata", b"m-metadata-" + cid.encode(), coordinator),
            file_entry("__0_0.distcp", b"w=666" * 100, coordinator),
        ],
    )


class Hostile(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    """m: answers at once, with its own checkpoint, a relayed forgery naming a as the
    coordinator, and itself as job's only writer."""

    def ListManifests(self, request: Any, context: Any) -> Any:
        return peer_pb2.ListManifestsResponse(
            checkpoints=[_forged("step-999", "m", 10**9), _forged("step-1000", "a", 10**9 + 1)],
            writers=[peer_pb2.NamespaceWriters(namespace=NS, nodes=["m"])],
        )

    def Holdings(self, request: Any, context: Any) -> Any:
        return peer_pb2.HoldingsResponse()

    def PublishCheckpoint(self, request: Any, context: Any) -> Any:
        return peer_pb2.PublishCheckpointResponse()

    def UpdateReplicas(self, request: Any, context: Any) -> Any:
        return peer_pb2.UpdateReplicasResponse()

    def PushFile(self, request_iterator: Iterator[Any], context: Any) -> Any:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "m keeps no copies")

    def FetchFile(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.NOT_FOUND, "m keeps no copies")

    def ApplyMark(self, request: Any, context: Any) -> Any:
        return peer_pb2.ApplyMarkResponse()


@dataclass
class Cluster:
    stack: ExitStack
    addresses: dict[str, str]  # node -> peer address, m's included
    daemons: dict[str, DaemonProcess]
    saved: dict[str, SavedCheckpoint]

    def client(self, node: str) -> DaemonClient:
        client = DaemonClient(self.daemons[node].address, timeout_s=30)
        self.stack.callback(client.close)
        return client

    def start(self, node: str, peers: list[str]) -> DaemonProcess:
        daemon = DaemonProcess(
            {
                "node": {"id": node, "failure_domain": f"rack-{node}"},
                "listen": {"peer": self.addresses[node]},
                "memory": {"budget": "64MiB"},
                "retention": {"memory_keep_last": 4},
                "replication": {"copies": 1, "heal_interval": 3600.0},
                "peers": [{"id": p, "address": self.addresses[p]} for p in peers],
            },
            name=node,
        )
        self.stack.callback(daemon.cleanup)
        self.daemons[node] = daemon
        return daemon


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with ExitStack() as stack:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        peer_pb2_grpc.add_PeerServiceServicer_to_server(Hostile(), server)
        m_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        stack.callback(server.stop, 0)
        ports = free_ports(len(HONEST) + len(FRESH))
        addresses = {n: f"127.0.0.1:{p}" for n, p in zip(HONEST + FRESH, ports, strict=True)}
        addresses["m"] = m_address
        c = Cluster(stack, addresses, {}, {})
        for node in HONEST:
            daemon = DaemonProcess(
                {
                    "node": {"id": node, "failure_domain": f"rack-{node}"},
                    "listen": {"peer": addresses[node]},
                    "memory": {"budget": "64MiB"},
                    "retention": {"memory_keep_last": 4},
                    "replication": {"copies": 1, "heal_interval": 3600.0},
                    "peers": [{"id": p, "address": addresses[p]} for p in addresses if p != node],
                },
                name=node,
            )
            stack.callback(daemon.cleanup)
            c.daemons[node] = daemon
        a, b = c.client("a"), c.client("b")
        root = tmp_path_factory.mktemp("quorum")
        for step in (1, 2):
            cid = f"step-{step}"
            saved = save_two_rank_checkpoint(root / cid)
            c.saved[cid] = saved
            write_files(a, NS, cid, {n: saved.data(n) for n in (".metadata", "__0_0.distcp")})
            write_files(b, NS, cid, {"__1_0.distcp": saved.data("__1_0.distcp")}, rank=1)
            a.commit_checkpoint(NS, cid, [".metadata", "__0_0.distcp", "__1_0.distcp"])
        # m publishes its own checkpoint to the honest nodes: listed there, never newest.
        for node in HONEST:
            channel = grpc.insecure_channel(addresses[node])
            stack.callback(channel.close)
            stub = PeerStub(grpc.intercept_channel(channel, node_client_interceptor("m")))
            stub.PublishCheckpoint(_forged("step-999", "m", 10**9), timeout=30)
        assert b.get_checkpoint(NS).checkpoint_id == "step-2"
        yield c


def _check_honest(c: Cluster, node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = c.client(node)
    assert client.get_checkpoint(NS).checkpoint_id == "step-2"
    listed = {v.checkpoint_id: v for v in client.list_checkpoints(NS)}
    assert {"step-1", "step-2", "step-999"} <= set(listed)
    assert "step-1000" not in listed  # relayed by m, never confirmed by a
    assert "foreign" in listed["step-999"].tiers
    expected = c.saved["step-2"].state
    # The native reader.
    state = load_target(expected)
    reader = TieredStorageReader(NS, daemon=c.daemons[node].address)
    dcp.load(state, storage_reader=reader)
    assert reader.checkpoint_id == "step-2"
    assert_state_equal(actual=state, expected=expected, what=f"{node}'s newest")
    # tierckpt://job/latest.
    monkeypatch.setenv("TIERCKPT_DAEMON", c.daemons[node].address)
    state = load_target(expected)
    dcp.load(state, checkpoint_id=f"tierckpt://{NS}/latest")
    assert_state_equal(actual=state, expected=expected, what=f"{node}'s latest")


@pytest.mark.timeout(240)
def test_a_replacement_node_takes_the_writers_a_majority_of_its_peers_state(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # m listed first, answering at once: the order answers come in chooses nothing.
    cluster.start("r", ["m", "a", "b", "c"])
    _check_honest(cluster, "r", monkeypatch)
    log = cluster.daemons["r"].log_tail(400)
    assert "its writers per 2 of 3 peers stating one: a" in log
    assert "relayed by m, coordinated by a, which did not confirm it" in log
    # m listed last: the same.
    cluster.start("r2", ["a", "b", "c", "m"])
    _check_honest(cluster, "r2", monkeypatch)
    # After a restart (no binding of its own yet), r asks again and keeps the honest one.
    cluster.daemons["r"].terminate()
    cluster.daemons["r"].start()
    _check_honest(cluster, "r", monkeypatch)


@pytest.mark.timeout(180)
def test_without_a_majority_there_is_no_newest_from_peers(cluster: Cluster) -> None:
    # a and m each state only themselves: neither has a vote but its own.
    cluster.start("r3", ["m", "a"])
    client = cluster.client("r3")
    with pytest.raises(CheckpointNotFound) as caught:
        client.get_checkpoint(NS)
    message = str(caught.value)
    assert "no newest checkpoint of job" in message and "agree on no writer" in message
    assert "a says a" in message and "m says m" in message
    assert "step-2 (by a)" in message and "step-999 (by m" in message
    # A checkpoint named by its id is still there to load (r3 reaches only a and m, so
    # rank 1's file on b is out of its reach: the lookup, not the bytes).
    assert client.get_checkpoint(NS, "step-2").checkpoint_id == "step-2"
    assert client.get_checkpoint(NS, "step-999").checkpoint_id == "step-999"
