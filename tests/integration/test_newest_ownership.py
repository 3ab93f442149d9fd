"""A namespace is bound to the nodes that write it (audit 3, H2 and M2), on a real daemon.

One victim daemon peers with two configured in-process nodes, "mallory" and "buddy"
(no mutual TLS: a peer's identity is what it claims, the audit's position). The victim
saves its own checkpoints; mallory publishes checkpoints it coordinates into the same
namespaces with a later time, a higher sequence and a higher step.

- H2 (`e02_peer_forgery.py` a): mallory's checkpoint is listed (tagged `foreign`) but
  never the newest: not for the daemon's GetCheckpoint, not for TieredStorageReader,
  `tierckpt://NS/latest` or the SageMaker reader (`step=None`), and not after a restart.
- M2 c: a re-publish of the victim's checkpoint naming mallory as its coordinator is
  refused, so mallory cannot list itself as a holder and then rewrite replica lists.
- M2 d: the commit's holder hint is only an ordering: a hinted node's claim is checked
  against every other peer's, and conflicting contents refuse the commit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt.compat.sagemaker import SageMakerCheckpointConfig, SageMakerTieredStorageReader
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import CheckpointIncomplete
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.peers.chunk_wire import PeerStub
from tierckptd.peers.security import node_client_interceptor

from tests.support.daemon_process import DaemonProcess
from tests.support.fake_peer import FakePeer, code_of
from tests.support.ports import free_ports
from tests.support.raw_rpc import file_entry, raw_save, write_files

pytestmark = pytest.mark.integration

CODE = grpc.StatusCode


@dataclass
class Victim:
    daemon: DaemonProcess
    client: DaemonClient
    peer_address: str
    fakes: dict[str, FakePeer]
    stack: ExitStack

    def stub(self, node: str = "mallory") -> PeerStub:
        channel = grpc.insecure_channel(self.peer_address)
        self.stack.callback(channel.close)
        return PeerStub(grpc.intercept_channel(channel, node_client_interceptor(node)))


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
                "retention": {"memory_keep_last": 3},
                "replication": {"copies": 1, "heal_interval": 3600.0},
                "peers": [{"id": n, "address": a} for n, a in addresses.items()],
            },
            name="victim",
        )
        stack.callback(daemon.cleanup)
        client = DaemonClient(daemon.address, timeout_s=30)
        stack.callback(client.close)
        yield Victim(daemon, client, f"127.0.0.1:{port}", fakes, stack)


def forged(ns: str, cid: str, *, committed: float, sequence: int) -> common_pb2.CheckpointInfo:
    """A checkpoint mallory coordinates (it owns the .metadata), with its files."""
    return common_pb2.CheckpointInfo(
        ref=common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid),
        state=common_pb2.COMMITTED,
        created_unix=min(committed, time.time()),
        committed_unix=committed,
        sequence=sequence,
        files=[
            file_entry(".metadata", b"mallory-metadata", "mallory"),
            file_entry("__0_0.distcp", b"w=666" * 100, "mallory"),
        ],
    )


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), value)}


def _tiers(v: Victim, ns: str, cid: str) -> tuple[str, ...]:
    return next(c.tiers for c in v.client.list_checkpoints(ns) if c.checkpoint_id == cid)


@pytest.mark.timeout(180)
def test_a_peer_never_becomes_the_newest_of_a_namespace_it_does_not_write(
    victim: Victim, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, sm_ns = "job", "smjob"
    monkeypatch.setenv("TIERCKPT_DAEMON", victim.daemon.address)
    dcp.save(_state(0.0), checkpoint_id=f"tierckpt://{ns}/step-100")
    dcp.save(_state(5.0), checkpoint_id=f"tierckpt://{sm_ns}/step_5")
    stub = victim.stub("mallory")
    # The audit's e02 a: later time, higher sequence; for SageMaker a higher step with a
    # time 300 days in the past. Each is taken (listed), none refused for its time.
    now = time.time()
    for info in (
        forged(ns, "step-0", committed=now + 250, sequence=10**9),
        forged(sm_ns, "step_99999999", committed=now - 300 * 86400, sequence=10**9),
    ):
        assert code_of(lambda i=info: stub.PublishCheckpoint(i, timeout=30)) == CODE.OK

    def check(forgeries: set[str]) -> None:
        assert forgeries <= {c.checkpoint_id for c in victim.client.list_checkpoints(ns)}
        assert victim.client.get_checkpoint(ns).checkpoint_id == "step-100"
        assert victim.client.get_checkpoint(sm_ns).checkpoint_id == "step_5"
        assert all("foreign" in _tiers(victim, ns, cid) for cid in forgeries)
        assert "foreign" in _tiers(victim, sm_ns, "step_99999999")
        # The native reader.
        state = _state(-1.0)
        reader = TieredStorageReader(ns, daemon=victim.daemon.address)
        dcp.load(state, storage_reader=reader)
        assert reader.checkpoint_id == "step-100" and torch.equal(state["w"], _state(0.0)["w"])
        # tierckpt://NS/latest.
        state = _state(-1.0)
        dcp.load(state, checkpoint_id=f"tierckpt://{ns}/latest")
        assert torch.equal(state["w"], _state(0.0)["w"])
        # The SageMaker reader, step=None.
        config = SageMakerCheckpointConfig(namespace=sm_ns, world_size=1)
        sm = SageMakerTieredStorageReader(config, daemon=victim.daemon.address)
        state = _state(-1.0)
        dcp.load(state, storage_reader=sm)
        assert sm.step == 5 and torch.equal(state["w"], _state(5.0)["w"])

    check({"step-0"})
    assert "listed, never the newest of job" in victim.daemon.log_tail(400)
    # A time far ahead (a clock years off) is taken too, shown at this node's clock.
    late = forged(ns, "step-999", committed=4e9, sequence=10**12)
    assert code_of(lambda: stub.PublishCheckpoint(late, timeout=30)) == CODE.OK
    assert victim.client.get_checkpoint(ns, "step-999").committed_unix <= time.time() + 1
    check({"step-0", "step-999"})
    # Still so after a restart (the binding is kept in the manifests).
    victim.daemon.terminate()
    victim.daemon.start()
    check({"step-0", "step-999"})
    # The victim's next save is the newest: its sequence is not pushed up by mallory's.
    raw_save(victim.client, ns, "step-101", {".metadata": b"m", "__0_0.distcp": b"d" * 100})
    assert victim.client.get_checkpoint(ns).checkpoint_id == "step-101"
    assert victim.client.get_checkpoint(ns, "step-101").sequence < 10**9


def test_a_peer_cannot_republish_anothers_checkpoint_to_claim_its_files(
    victim: Victim,
) -> None:
    ns, cid = "jobC", "step-1"
    raw_save(victim.client, ns, cid, {".metadata": b"meta", "__0_0.distcp": os.urandom(3000)})
    stub = victim.stub("mallory")
    ref = common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid)

    def update(nodes: list[str]) -> grpc.StatusCode:
        req = peer_pb2.UpdateReplicasRequest(ref=ref, file_name="__0_0.distcp", replica_nodes=nodes)
        return code_of(lambda: stub.UpdateReplicas(req, timeout=10))

    assert update(["buddy"]) == CODE.PERMISSION_DENIED
    # The audit's e02 c: the victim's checkpoint again, mallory claiming its .metadata and
    # listing itself as the holder of every file.
    info = victim.client.get_checkpoint(ns, cid)
    data = info.file("__0_0.distcp")
    assert data.checksums is not None
    republished = common_pb2.CheckpointInfo(
        ref=ref,
        state=common_pb2.COMMITTED,
        created_unix=info.created_unix,
        committed_unix=info.committed_unix,
        sequence=info.sequence,
        files=[
            file_entry(".metadata", b"meta", "mallory", ("mallory",)),
            common_pb2.FileEntry(
                name=data.name,
                size=data.size,
                checksums=common_pb2.BlockChecksums(
                    algorithm=data.checksums.algorithm,
                    block_size=data.checksums.block_size,
                    block_digests=data.checksums.digests,
                ),
                owner_node="victim",
                replica_nodes=["mallory"],
            ),
        ],
    )
    assert (
        code_of(lambda: stub.PublishCheckpoint(republished, timeout=30)) == CODE.PERMISSION_DENIED
    )
    after = victim.client.get_checkpoint(ns, cid)
    assert all(f.replica_nodes == () for f in after.files), after.files
    assert update(["buddy"]) == CODE.PERMISSION_DENIED  # still no holder


def test_the_holder_hint_only_orders_a_commit(victim: Victim) -> None:
    ns, cid = "jobD", "step-1"
    # Rank 0 (the coordinator) wrote .metadata here; buddy and mallory both claim rank
    # 1's file, with different bytes. The writer's hint names mallory only.
    victim.fakes["buddy"].holdings[cid] = [file_entry("__1_0.distcp", b"real" * 500, "buddy")]
    victim.fakes["mallory"].holdings[cid] = [file_entry("__1_0.distcp", b"evil" * 500, "mallory")]
    write_files(victim.client, ns, cid, {".metadata": b"meta"})
    with pytest.raises(CheckpointIncomplete, match="different contents"):
        victim.client.commit_checkpoint(
            ns, cid, [".metadata", "__1_0.distcp"], holder_nodes=["mallory"]
        )
    assert not any(c.checkpoint_id == cid for c in victim.client.list_checkpoints(ns))
    # With honest holders the hint still commits (and only orders who is asked first).
    victim.fakes["mallory"].holdings.pop(cid)
    view = victim.client.commit_checkpoint(
        ns, cid, [".metadata", "__1_0.distcp"], holder_nodes=["buddy"]
    )
    assert view.file("__1_0.distcp").owner_node == "buddy"
