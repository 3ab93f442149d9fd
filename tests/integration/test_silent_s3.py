"""Audit 3 H7: an S3 endpoint that accepts connections and never answers.

The endpoint is a socket in the test that accepts every connection and never sends a
byte. Before the fix the daemon reached READY only after 423 s (the durable adoption
ran first, one listing held for botocore's timeouts times its retries times s3fs's),
and 40 ranks asking for the newest checkpoint of 40 namespaces held every thread of
the control socket under one lock: another job's Health and BeginCheckpoint timed out.
Now nothing of S3 comes before READY, a listing is answered from the catalog after a
short wait while the re-listing goes on in the background, health has threads of its
own, and an explicit probe gives up at its deadline with UNAVAILABLE naming the tier.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.daemon_client import DaemonClient
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tests.support import moto_s3
from tests.support.daemon_process import DaemonProcess
from tests.support.raw_rpc import raw_save

RANKS = 40


class BlackHole:
    """A TCP endpoint that accepts every connection and never answers (nor closes)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self._held:
            conn.close()
        self._listener.close()


@pytest.fixture
def black_hole(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlackHole]:
    hole = BlackHole()
    for name in moto_s3.AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in moto_s3.aws_environment(hole.url).items():
        monkeypatch.setenv(name, value)  # the daemon inherits fake credentials
    yield hole
    hole.close()


def _newest_and_list(address: str, namespace: str) -> tuple[str, int]:
    """One rank's restore questions: the newest checkpoint, then the listing."""
    with grpc.insecure_channel(address) as channel:
        stub = daemon_pb2_grpc.DaemonServiceStub(channel)
        try:
            stub.GetCheckpoint(common_pb2.CheckpointRef(namespace=namespace), timeout=60)
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        listed = stub.ListCheckpoints(
            daemon_pb2.ListCheckpointsRequest(namespace=namespace), timeout=60
        )
        return code, len(listed.checkpoints)


def test_a_silent_s3_delays_neither_ready_nor_the_control_socket(black_hole: BlackHole) -> None:
    daemon = DaemonProcess(
        {
            "persistent": {
                # The daemon's own client settings: no test shortcuts for botocore.
                "url": "s3://silent-bucket/jobs",
                "storage_options": {"endpoint_url": black_hole.url},
                "shutdown_deadline": 2.0,
            },
        },
        name="silent",
        start=False,
    )
    try:
        daemon.start(timeout=60)  # READY does not wait on S3 (423 s before)
        with futures.ThreadPoolExecutor(RANKS) as pool:
            asked = [pool.submit(_newest_and_list, daemon.address, f"job{i}") for i in range(RANKS)]
            # Meanwhile another job on the node: health, and a memory-tier save.
            with grpc.insecure_channel(daemon.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for _ in range(3):
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
            client = DaemonClient(daemon.address, timeout_s=30)
            try:
                raw_save(client, "other", "step-1", {".metadata": b"m", "__0_0.distcp": b"d"})
                # Listed from the catalog within the RPC's deadline, S3 still silent.
                listed = client.list_checkpoints("other")
                assert [c.checkpoint_id for c in listed] == ["step-1"]
            finally:
                client.close()
            answers = [f.result(timeout=120) for f in asked]
        # Every rank got an answer from what the node knows (nothing saved there).
        assert answers == [("NOT_FOUND", 0)] * RANKS, daemon.log_tail()
        # An explicit id the node does not know: the probe gives up at its deadline
        # with an error naming the tier, not after minutes.
        with grpc.insecure_channel(daemon.address) as channel:
            stub = daemon_pb2_grpc.DaemonServiceStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                stub.GetCheckpoint(
                    common_pb2.CheckpointRef(namespace="job0", checkpoint_id="step-7"),
                    timeout=60,
                )
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
        assert "persistent" in (raised.value.details() or ""), raised.value.details()
        assert daemon.running
    finally:
        daemon.cleanup()
