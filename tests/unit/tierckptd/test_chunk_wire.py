"""The hand-framed FileChunk codec is byte-compatible with protobuf both ways, and the
PeerService registration decodes every request itself (malformed: INVALID_ARGUMENT)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from tierckpt.errors import TierckptError, status_of
from tierckpt.v1 import common_pb2, peer_pb2
from tierckptd.peers.chunk_wire import (
    Chunk,
    PeerStub,
    decode_chunk,
    encode_data_chunk,
    register_peer_service,
    serialize_chunk,
)

CASES = [(0, b""), (0, b"x"), (1, b"\x00" * 127), (2**40 + 3, b"ab" * 70_000), (127, b"\xff")]


@pytest.mark.parametrize(("offset", "data"), CASES)
def test_encode_equals_protobuf(offset: int, data: bytes) -> None:
    assert encode_data_chunk(offset, data) == (
        peer_pb2.FileChunk(offset=offset, data=data).SerializeToString()
    )


def test_decode_matches_protobuf_on_random_chunks() -> None:
    rng = random.Random(5)
    for _ in range(200):
        offset = rng.choice([0, rng.randrange(1 << 7), rng.randrange(1 << 63)])
        data = rng.randbytes(rng.choice([0, 1, 300, 70_000]))
        chunk = decode_chunk(peer_pb2.FileChunk(offset=offset, data=data).SerializeToString())
        assert (chunk.header, chunk.offset, bytes(chunk.data)) == (None, offset, data)


def test_decode_header_chunk_and_skip_unknown_fields() -> None:
    header = peer_pb2.FileHeader(
        ref=common_pb2.CheckpointRef(namespace="run", checkpoint_id="step-000001"),
        file=common_pb2.FileEntry(name="__0_0.distcp", size=5),
    )
    wire = peer_pb2.FileChunk(header=header, offset=9, data=b"hello").SerializeToString()
    # Fields this version does not know, of every wire type, as a newer peer might send.
    unknown = b"\x20\x05" + b"\x29" + b"\x00" * 8 + b"\x32\x02hi" + b"\x3d" + b"\x00" * 4
    chunk = decode_chunk(unknown + wire)
    assert chunk.header == header
    assert (chunk.offset, bytes(chunk.data)) == (9, b"hello")


@pytest.mark.parametrize(
    "wire",
    [
        b"\x1a\x05abc",  # data runs past the end
        b"\x10\x80",  # truncated varint
        b"\x1b",  # wire type 3 (groups) is not used by proto3
        b"\x10" + b"\xff" * 11,  # overlong varint
    ],
)
def test_decode_rejects_malformed(wire: bytes) -> None:
    with pytest.raises(ValueError, match="FileChunk"):
        decode_chunk(wire)


def test_decoded_data_is_a_view_not_a_copy() -> None:
    wire = encode_data_chunk(4096, b"z" * 4096)
    chunk = decode_chunk(wire)
    assert chunk.data.obj is wire


def test_serialize_passes_encoded_bytes_and_serializes_messages() -> None:
    wire = encode_data_chunk(1, b"abc")
    assert serialize_chunk(wire) is wire
    message = peer_pb2.FileChunk(offset=1, data=b"abc")
    assert serialize_chunk(message) == wire


class _Echo:
    """FetchFile streams a header then data chunks; PushFile sums what arrives."""

    def FetchFile(self, request: peer_pb2.FetchFileRequest, context: Any) -> Any:
        yield peer_pb2.FileChunk(header=peer_pb2.FileHeader(file=common_pb2.FileEntry(size=6)))
        yield encode_data_chunk(request.offset, b"abc")
        yield peer_pb2.FileChunk(offset=request.offset + 3, data=b"def")

    def PushFile(self, chunks: Any, context: Any) -> peer_pb2.PushFileResponse:
        got = [c for c in chunks]
        assert all(isinstance(c, Chunk) for c in got)
        return peer_pb2.PushFileResponse(received_bytes=sum(len(c.data) for c in got))

    def Holdings(self, request: common_pb2.CheckpointRef, context: Any) -> Any:
        return peer_pb2.HoldingsResponse()

    PublishCheckpoint = UpdateReplicas = ListManifests = Holdings


def test_stub_and_service_speak_the_codec_over_grpc() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    register_peer_service(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = PeerStub(channel)
            chunks = list(stub.FetchFile(peer_pb2.FetchFileRequest(offset=10), timeout=10))
            assert chunks[0].header is not None and chunks[0].header.file.size == 6
            assert [(c.offset, bytes(c.data)) for c in chunks[1:]] == [(10, b"abc"), (13, b"def")]
            pushed = [peer_pb2.FileChunk(header=peer_pb2.FileHeader()), encode_data_chunk(0, b"xy")]
            assert stub.PushFile(iter(pushed), timeout=10).received_bytes == 2
            held = stub.Holdings(common_pb2.CheckpointRef(), timeout=10)
            assert held == peer_pb2.HoldingsResponse()
    finally:
        server.stop(0)


class _Guarded(_Echo):
    """Refuses every call in its guard, before any request byte is read."""

    def __init__(self) -> None:
        self.guarded: list[str] = []

    @contextmanager
    def guard(self, method: str, context: Any) -> Iterator[Any]:
        self.guarded.append(method)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not you")
        yield  # pragma: no cover


@pytest.fixture
def serve() -> Iterator[Callable[[Any], grpc.Channel]]:
    servers: list[Any] = []
    channels: list[grpc.Channel] = []

    def start(servicer: Any) -> grpc.Channel:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        register_peer_service(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return channels[-1]

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(0)


@pytest.mark.parametrize("method", ["Holdings", "PublishCheckpoint", "ListManifests"])
def test_malformed_requests_are_invalid_argument_never_internal(
    serve: Callable[[Any], grpc.Channel], method: str
) -> None:
    channel = serve(_Echo())
    call = channel.unary_unary(f"/tierckpt.v1.PeerService/{method}")
    for junk in (b"\xff\xff", b"\x0a\x05ab", b"\x1f"):
        with pytest.raises(grpc.RpcError) as e:
            call(junk, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert method in e.value.details()
    assert call(b"", timeout=10) is not None  # an empty message is a valid one


def test_the_guard_runs_before_the_request_is_read(serve: Callable[[Any], grpc.Channel]) -> None:
    servicer = _Guarded()
    stub = PeerStub(serve(servicer))
    never = threading.Event()

    def silent() -> Iterator[Any]:
        never.wait(20)
        return
        yield  # pragma: no cover

    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.PushFile(silent(), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            list(stub.FetchFile(peer_pb2.FetchFileRequest(), timeout=10))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        never.set()
    assert servicer.guarded == ["PushFile", "FetchFile"]


def test_a_malformed_chunk_is_an_invalid_argument(serve: Callable[[Any], grpc.Channel]) -> None:
    class Pusher(_Echo):
        def PushFile(self, chunks: Any, context: Any) -> peer_pb2.PushFileResponse:
            try:
                return super().PushFile(chunks, context)
            except TierckptError as e:
                context.abort(status_of(e), str(e))
                raise

    push = serve(Pusher()).stream_unary("/tierckpt.v1.PeerService/PushFile")
    with pytest.raises(grpc.RpcError) as e:
        push(iter([encode_data_chunk(0, b"ok"), b"\x1a\x05abc"]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "runs past the end" in e.value.details()
