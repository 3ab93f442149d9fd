"""C1 re-run against real daemons: a `.metadata` written by a rank or a peer is never
unpickled, neither by the daemon's drain nor by a training process's reader (M7, M9 too).

The payload is the audit's: ``pickle.dumps(P())`` with ``P.__reduce__`` returning
``(os.system, ("touch MARKER",))``. Every test asserts MARKER never appears.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch.distributed.checkpoint as dcp
from tierckpt.daemon_client import DaemonClient
from tierckpt.dcp_metadata import load_metadata
from tierckpt.errors import UnsafeMetadata
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.peers.chunk_wire import PeerStub, encode_data_chunk
from tierckptd.peers.security import node_client_interceptor
from torch.distributed.checkpoint.api import CheckpointException

from tests.support import moto_s3
from tests.support.cli import ls_json
from tests.support.daemon_process import DaemonProcess
from tests.support.dcp_files import assert_state_equal, load_target, make_state, save_checkpoint
from tests.support.legacy_dcp import LegacyTensorProperties, legacy_properties
from tests.support.ports import free_ports
from tests.support.raw_rpc import file_entry, raw_save

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3


class P:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def payload(marker: Path) -> bytes:
    return pickle.dumps(P(f"touch {shlex.quote(str(marker))}"))


def metric(url: str, sample: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    m = re.search(rf"^{re.escape(sample)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def tiers(client: DaemonClient, ns: str, cid: str) -> tuple[str, ...]:
    return client.get_checkpoint(ns, cid).tiers


@pytest.fixture
def drainer_node(s3: moto_s3.S3Bucket) -> Iterator[tuple[DaemonProcess, DaemonClient, str]]:
    (metrics_port,) = free_ports(1)
    daemon = DaemonProcess(
        {
            "persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options)},
            "retention": {"memory_keep_last": 3},
            "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
        },
        name="drainer",
    )
    client = DaemonClient(daemon.address, timeout_s=30)
    try:
        yield daemon, client, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        client.close()
        daemon.cleanup()


def test_the_drain_refuses_a_hostile_metadata_and_keeps_running(
    drainer_node: tuple[DaemonProcess, DaemonClient, str],
    s3: moto_s3.S3Bucket,
    tmp_path: Path,
) -> None:
    daemon, client, metrics_url = drainer_node
    marker = tmp_path / "MARKER"
    refused = 'tierckpt_refused_metadata_total{where="drain"}'
    before = metric(metrics_url, refused)
    raw_save(client, "rce", "step-1", {".metadata": payload(marker)})
    wait_for(lambda: "drain-failed" in tiers(client, "rce", "step-1"), what="drain-failed")
    rows = {row["id"]: row for row in ls_json(daemon.address, "rce")}
    assert "drain-failed" in rows["step-1"]["tiers"]  # what `tierckpt ls` shows
    assert metric(metrics_url, refused) == before + 1
    assert metric(metrics_url, "tierckpt_drain_failed_checkpoints") == 1
    time.sleep(2.0)  # a few drain periods: the audit saw the payload re-run every <=10 s
    assert not marker.exists()
    assert daemon.running
    assert metric(metrics_url, refused) == before + 1  # refused once, not retried
    assert (
        "refused" in daemon.log_path.read_text() and "posix.system" in daemon.log_path.read_text()
    )
    fs = s3.fs()
    assert not fs.exists(f"{s3.name}/rce/step-1/.metadata")
    # A data file with the payload as .metadata beside it: refused the same way, nothing
    # of it uploaded.
    raw_save(client, "rce", "step-2", {"__0_0.distcp": b"d" * 100, ".metadata": payload(marker)})
    wait_for(lambda: "drain-failed" in tiers(client, "rce", "step-2"), what="step-2")
    fs.invalidate_cache()
    assert not fs.exists(f"{s3.name}/rce/step-2")
    # A real checkpoint saved afterwards drains as usual.
    good = save_checkpoint(tmp_path / "good")
    names = [*good.data_names, ".metadata"]
    raw_save(client, "rce", "step-3", {n: (good.directory / n).read_bytes() for n in names})
    wait_for(lambda: "persistent" in tiers(client, "rce", "step-3"), what="durable")
    assert "drain-failed" not in tiers(client, "rce", "step-3")
    assert not marker.exists() and daemon.running


def test_the_reader_refuses_a_hostile_metadata(
    drainer_node: tuple[DaemonProcess, DaemonClient, str], tmp_path: Path
) -> None:
    daemon, client, _ = drainer_node
    marker = tmp_path / "MARKER"
    raw_save(client, "victim-job", "step-9", {".metadata": payload(marker)})
    reader = TieredStorageReader("victim-job", daemon=daemon.address)
    reader.reset("step-9")
    with pytest.raises(UnsafeMetadata, match=r"victim-job/step-9/\.metadata.*posix\.system"):
        reader.read_metadata()
    # Through stock dcp.load too (the newest checkpoint of the namespace).
    with pytest.raises(CheckpointException, match=r"refused.*posix\.system"):
        dcp.load({"x": 1}, storage_reader=TieredStorageReader("victim-job", daemon=daemon.address))
    assert not marker.exists()


def _load_every_way(address: str, state: dict[str, Any]) -> None:
    """Through the tierckpt reader and through a stock ``tierckpt://`` load (fsspec)."""
    target = load_target(state)
    dcp.load(target, storage_reader=TieredStorageReader("legacy", daemon=address))
    assert_state_equal(actual=target, expected=state, what="through TieredStorageReader")
    target = load_target(state)
    dcp.load(target, checkpoint_id="tierckpt://legacy/step-1")
    assert_state_equal(actual=target, expected=state, what="through tierckpt://")


def test_a_legacy_sharded_tensor_checkpoint_saves_drains_restores_and_loads(
    drainer_node: tuple[DaemonProcess, DaemonClient, str],
    s3: moto_s3.S3Bucket,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DCP's compatibility contract (torch's test_sharded_tensor_dependency) through real
    daemons: a stock save whose `.metadata` names the legacy sharded-tensor
    TensorProperties (as torch < 2.2 wrote it) commits, drains (decoded and
    zstd-rewritten by the daemon's allow-list decoder), loads through the client, and
    loads again once every memory copy is gone and only S3 holds it."""
    daemon, client, _ = drainer_node
    monkeypatch.setenv("TIERCKPT_DAEMON", daemon.address)
    state = make_state(seed=3)
    with legacy_properties():
        dcp.save(state, checkpoint_id="tierckpt://legacy/step-1")
    wait_for(lambda: "persistent" in tiers(client, "legacy", "step-1"), what="durable")
    assert "drain-failed" not in tiers(client, "legacy", "step-1")
    drained = load_metadata(s3.fs().cat_file(f"{s3.name}/legacy/step-1/.metadata"))
    tensors = [e for e in drained.state_dict_metadata.values() if hasattr(e, "properties")]
    assert tensors and all(type(e.properties) is LegacyTensorProperties for e in tensors)
    _load_every_way(daemon.address, state)

    daemon.kill9()
    shutil.rmtree(daemon.memory_dir, ignore_errors=True)
    daemon.start()
    restarted = DaemonClient(daemon.address, timeout_s=30)
    try:
        assert tiers(restarted, "legacy", "step-1") == ("persistent",)
        _load_every_way(daemon.address, state)
    finally:
        restarted.close()


class Mallory(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    """A configured peer of the victim that answers everything and holds nothing."""

    def Holdings(self, request: Any, context: Any) -> Any:
        return peer_pb2.HoldingsResponse()

    def PublishCheckpoint(self, request: Any, context: Any) -> Any:
        return peer_pb2.PublishCheckpointResponse()

    def UpdateReplicas(self, request: Any, context: Any) -> Any:
        return peer_pb2.UpdateReplicasResponse()

    def ListManifests(self, request: Any, context: Any) -> Any:
        return peer_pb2.ListManifestsResponse()


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_a_peer_pushed_pickle_runs_nowhere(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    """The audit's e5/e13 over the peer port: a manifest naming the victim as the owner
    of `.metadata` (its drain would commit it) or a forged newest checkpoint whose
    `.metadata` the peer pushes as a replica (a training process would load it)."""
    marker = tmp_path / "MARKER"
    evil = payload(marker)
    with ExitStack() as stack:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        peer_pb2_grpc.add_PeerServiceServicer_to_server(Mallory(), server)
        mallory_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        stack.callback(server.stop, 0)
        (port,) = free_ports(1)
        daemon = DaemonProcess(
            {
                "node": {"id": "victim"},
                "listen": {"peer": f"127.0.0.1:{port}"},
                "persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options)},
                "replication": {"copies": 1, "heal_interval": 3600.0},
                "peers": [{"id": "mallory", "address": mallory_address}],
            },
            name="victim",
        )
        stack.callback(daemon.cleanup)
        channel = grpc.intercept_channel(
            grpc.insecure_channel(f"127.0.0.1:{port}"), node_client_interceptor("mallory")
        )
        stack.callback(channel.close)
        stub = PeerStub(channel)
        published: list[grpc.StatusCode] = []
        for cid, owner in (("e5", "victim"), ("e13", "mallory")):
            info = common_pb2.CheckpointInfo(
                ref=common_pb2.CheckpointRef(namespace="jobC", checkpoint_id=cid),
                state=common_pb2.COMMITTED,
                created_unix=time.time(),
                committed_unix=time.time(),
                sequence=1,
                files=[file_entry(".metadata", evil, owner)],
            )
            published.append(_code(lambda i=info: stub.PublishCheckpoint(i, timeout=10)))
            header = peer_pb2.FileHeader(ref=info.ref, file=info.files[0])
            chunks = [peer_pb2.FileChunk(header=header), encode_data_chunk(0, evil)]
            _code(lambda c=chunks: stub.PushFile(iter(c), timeout=10))
        # Mallory does not coordinate a commit whose .metadata the victim owns (helper
        # B's per-call authorization); its own forged checkpoint it may publish and push.
        assert published[0] != grpc.StatusCode.OK
        assert published[1] == grpc.StatusCode.OK
        time.sleep(3.0)  # drain periods
        assert not marker.exists() and daemon.running
        client = DaemonClient(daemon.address, timeout_s=30)
        stack.callback(client.close)
        held = [
            c.checkpoint_id
            for c in client.list_checkpoints("jobC")
            if any(f.name == ".metadata" and f.local_path for f in c.files)
        ]
        assert held == ["e13"]
        for cid in held:  # what the victim accepted, a training process refuses
            reader = TieredStorageReader("jobC", daemon=daemon.address)
            reader.reset(cid)
            with pytest.raises(UnsafeMetadata):
                reader.read_metadata()
        assert not marker.exists() and daemon.running
        assert not s3.fs().exists(f"{s3.name}/jobC/e5/.metadata")


def test_sigterm_with_s3_down_returns_within_the_deadline(
    s3: moto_s3.S3Bucket, moto_server: moto_s3.MotoServer, tmp_path: Path
) -> None:
    """M9: botocore's default retries and timeouts, S3 gone, a 3 s shutdown deadline."""
    options = {k: v for k, v in s3.storage_options.items() if k != "config_kwargs"}
    daemon = DaemonProcess(
        {
            "persistent": {
                "url": s3.url(),
                "storage_options": options,
                "every": 1000,  # only the shutdown drain
                "shutdown_deadline": 3.0,
            },
        },
        name="sigterm",
    )
    try:
        client = DaemonClient(daemon.address, timeout_s=30)
        good = save_checkpoint(tmp_path / "good")
        names = [*good.data_names, ".metadata"]
        raw_save(client, "job", "step-1", {n: (good.directory / n).read_bytes() for n in names})
        client.close()
        moto_server.stop()
        started = time.monotonic()
        assert daemon.terminate(timeout=60) == 0
        took = time.monotonic() - started
        assert took < 3.0 + 5.0, f"{took:.1f}s\n{daemon.log_tail()}"
        assert "not durable within the deadline" in daemon.log_path.read_text()
    finally:
        daemon.cleanup()
