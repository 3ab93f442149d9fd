"""The real gRPC server in-process on a unix socket, called through the generated stub."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.checksum import checksum_bytes
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc
from tierckptd.catalog import Catalog
from tierckptd.catalog.budget import PAGE, pages
from tierckptd.ops import metrics
from tierckptd.rpc import daemon_service
from tierckptd.rpc.health import Health
from tierckptd.rpc.servers import AddressInUse, start_servers

from tests.support.daemon_parts import daemon_service as served


@pytest.fixture
def stub(catalog: Catalog, tmp_path: Path) -> Iterator[daemon_pb2_grpc.DaemonServiceStub]:
    health = Health()
    servers = start_servers(served(catalog), health, f"unix://{tmp_path}/d.sock", "127.0.0.1:0")
    health.serving()
    channel = grpc.insecure_channel(f"unix:{tmp_path}/d.sock")
    try:
        yield daemon_pb2_grpc.DaemonServiceStub(channel)
        peer = grpc.insecure_channel(f"127.0.0.1:{servers.peer_port}")
        probe = health_pb2_grpc.HealthStub(peer)
        for service in ("", "tierckpt.v1.PeerService"):
            check = probe.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING, service
        # ... and does not claim the control plane it refuses (below).
        with pytest.raises(grpc.RpcError) as missing:
            probe.Check(
                health_pb2.HealthCheckRequest(service="tierckpt.v1.DaemonService"), timeout=5
            )
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        local = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tierckpt.v1.DaemonService"), timeout=5
        )
        assert local.status == health_pb2.HealthCheckResponse.SERVING
        # The peer port serves health only, never the control plane.
        with pytest.raises(grpc.RpcError) as e:
            daemon_pb2_grpc.DaemonServiceStub(peer).GetStatus(
                daemon_pb2.GetStatusRequest(), timeout=5
            )
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        peer.close()
    finally:
        channel.close()
        servers.stop(0)
    assert not (tmp_path / "d.sock").exists()


def _ref(ckpt: str, ns: str = "run") -> common_pb2.CheckpointRef:
    return common_pb2.CheckpointRef(namespace=ns, checkpoint_id=ckpt)


def _code(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_save_and_status_codes(stub: daemon_pb2_grpc.DaemonServiceStub) -> None:
    code, details = _code(lambda: stub.GetCheckpoint(_ref("")))
    assert code == grpc.StatusCode.NOT_FOUND and "run has no committed checkpoints" in details
    code, details = _code(
        lambda: stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=_ref("../x")))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "[A-Za-z0-9._-]" in details

    ref = _ref("step-000300")
    stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref, rank=0))
    code, details = _code(
        lambda: stub.ReserveSpace(daemon_pb2.ReserveSpaceRequest(ref=ref, rank=0, bytes=1 << 30))
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory.budget=1.0 MiB" in details
    stub.ReserveSpace(daemon_pb2.ReserveSpaceRequest(ref=ref, rank=0, bytes=4096))
    opened = stub.OpenFile(daemon_pb2.OpenFileRequest(ref=ref, file_name=".metadata", rank=0))
    data = b"meta" * 100
    Path(opened.path).write_bytes(data)
    cs = checksum_bytes(data)
    stub.CommitFile(
        daemon_pb2.CommitFileRequest(
            ref=ref,
            file_name=".metadata",
            rank=0,
            size=len(data),
            checksums=common_pb2.BlockChecksums(
                algorithm=cs.algorithm, block_size=cs.block_size, block_digests=cs.digests
            ),
        )
    )
    code, _ = _code(
        lambda: stub.CommitCheckpoint(
            daemon_pb2.CommitCheckpointRequest(
                ref=ref, required_files=[".metadata", "__0_0.distcp"]
            )
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    info = stub.CommitCheckpoint(
        daemon_pb2.CommitCheckpointRequest(ref=ref, required_files=[".metadata"])
    )
    assert info.state == common_pb2.COMMITTED and info.sequence == 1
    assert info.files[0].local_path == opened.path and info.files[0].owner_node == "node-a"

    code, details = _code(lambda: stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref)))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "already committed on node node-a" in details
    code, details = _code(lambda: stub.GetCheckpoint(_ref("step-9")))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "the newest committed checkpoint of run is step-000300" in details

    newest = stub.GetCheckpoint(_ref(""))
    assert newest.ref.checkpoint_id == "step-000300" and newest.files[0].checksums.block_digests
    listed = stub.ListCheckpoints(daemon_pb2.ListCheckpointsRequest(namespace=""))
    assert [c.ref.checkpoint_id for c in listed.checkpoints] == ["step-000300"]
    verified = stub.VerifyCheckpoint(ref)
    assert verified.ok and verified.verified_bytes == len(data)
    status = stub.GetStatus(daemon_pb2.GetStatusRequest())
    # In pages, as tmpfs charges them: the file, its data dir and the manifest (audit 3 M6).
    assert (status.node_id, status.checkpoints) == ("node-a", 1)
    assert status.used_bytes > pages(len(data)) + PAGE and status.used_bytes % PAGE == 0
    assert list(status.namespaces) == ["run"]
    assert stub.DeleteCheckpoint(ref).freed_bytes == len(data)
    code, _ = _code(lambda: stub.AbortCheckpoint(ref))
    assert code == grpc.StatusCode.NOT_FOUND


def test_second_server_on_live_socket_is_refused(catalog: Catalog, tmp_path: Path) -> None:
    health = Health()
    servers = start_servers(served(catalog), health, f"unix:{tmp_path}/d.sock", "")
    try:
        with pytest.raises(AddressInUse, match="another tierckptd is serving"):
            start_servers(served(catalog), Health(), f"unix:{tmp_path}/d.sock", "")
    finally:
        servers.stop(0)
    (tmp_path / "d.sock").touch()  # a stale file nobody answers on is replaced
    servers = start_servers(served(catalog), health, f"unix:{tmp_path}/d.sock", "")
    servers.stop(0)


_METHODS = [m.name for m in daemon_pb2.DESCRIPTOR.services_by_name["DaemonService"].methods]
# Bytes no request parses: a field tag with the invalid wire type 7, a truncated
# varint, a length-delimited field running past the end, an overlong varint tag.
MALFORMED = [b"\x0f", b"\x08", b"\x0a\x05ab", b"\xff" * 11]


def test_malformed_requests_are_invalid_argument(
    stub: daemon_pb2_grpc.DaemonServiceStub, tmp_path: Path
) -> None:
    malformed = metrics.MALFORMED_REQUESTS.labels(service="DaemonService")
    before = malformed._value.get()
    with grpc.insecure_channel(f"unix:{tmp_path}/d.sock") as channel:
        for method in _METHODS:
            call = channel.unary_unary(f"/tierckpt.v1.DaemonService/{method}")
            for raw in MALFORMED:
                with pytest.raises(grpc.RpcError) as e:
                    call(raw, timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw)
                assert "is not a valid tierckpt.v1." in e.value.details()
    assert malformed._value.get() - before == len(_METHODS) * len(MALFORMED)


def test_errors_carry_no_repr_path_or_unbounded_echo(
    stub: daemon_pb2_grpc.DaemonServiceStub, catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise PermissionError(13, "Permission denied", "/secret/dir/file")

    monkeypatch.setattr(catalog, "status", broken)
    code, details = _code(lambda: stub.GetStatus(daemon_pb2.GetStatusRequest()))
    assert code == grpc.StatusCode.INTERNAL
    assert details == (
        "GetStatus failed on the daemon with an internal error; the daemon log has the details"
    )

    # An error raised outside _call (building the reply) gets the same treatment, never
    # UNKNOWN "Exception calling application".
    def out_of_range(view: object) -> None:
        raise ValueError("Value out of range: 18446744073709551616")

    monkeypatch.setattr(daemon_service, "to_info", out_of_range)
    ref = _ref("s")
    stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref))
    code, details = _code(
        lambda: stub.CommitCheckpoint(daemon_pb2.CommitCheckpointRequest(ref=ref))
    )
    assert code == grpc.StatusCode.INTERNAL and "out of range" not in details
    # A 1 MiB name comes back cut, with the message still naming the grammar.
    code, details = _code(
        lambda: stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=_ref("x" * (1 << 20))))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(details) <= daemon_service.MAX_DETAILS and "characters)" in details
    assert "A-Za-z0-9" in details
    code, details = _code(
        lambda: stub.CommitCheckpoint(
            daemon_pb2.CommitCheckpointRequest(
                ref=ref, required_files=[f"f{i}" for i in range(200_000)]
            )
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "CommitCheckpoint: 200,000 required files, at most 100,000 per checkpoint"
