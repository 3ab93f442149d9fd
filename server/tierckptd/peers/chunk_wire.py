"""`FileChunk` messages on the peer data path, encoded and decoded without protobuf
copying the payload.

protobuf's Python runtime copies a `bytes` field into its arena when it builds or parses
a message and again into a new `bytes` object when it is read, and gRPC copies the
serialized message once more. For 1 MiB chunks this made a peer transfer 3-4x slower than
gRPC streaming the same bytes (bench/bench_peer_tier.py). Here a data chunk is framed by
hand (the few tag/length bytes of `FileChunk{offset, data}`, then the payload) and parsed
into a `memoryview` of the received message, so a byte is copied once per side besides
gRPC's own copies. The wire format is exactly `FileChunk`'s: a peer using generated
code in any language interoperates. Control messages (the header chunk) still go through
protobuf.

On the serving side every PeerService request arrives as raw bytes and is decoded in
the handler, never by gRPC: grpcio 1.85 leaks ~15-19 KB for each request it fails to
deserialize, so a flood of malformed messages would grow the daemon without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from tierckpt.errors import InvalidArgument
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc

from tierckptd.ops import metrics
from tierckptd.ops.faults import fault

__all__ = [
    "Chunk",
    "decode_chunk",
    "encode_data_chunk",
    "PeerStub",
    "register_peer_service",
    "serialize_chunk",
]

T = TypeVar("T")

_SERVICE = "tierckpt.v1.PeerService"
# FileChunk field numbers (proto/tierckpt/v1/peer.proto).
_HEADER, _OFFSET, _DATA = 1, 2, 3
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True, slots=True)
class Chunk:
    """A decoded `FileChunk`; `data` is a view into the received message (no copy)."""

    header: peer_pb2.FileHeader | None
    offset: int
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_data_chunk(offset: int, data: bytes) -> bytes:
    """The serialized `FileChunk(offset=offset, data=data)`: one copy of `data`, and the
    same bytes protobuf would produce (proto3 leaves out zero and empty fields)."""
    parts = []
    if offset:
        parts.append(bytes((_OFFSET << 3 | _VARINT,)) + _varint(offset))
    if data:
        parts.append(bytes((_DATA << 3 | _LEN,)) + _varint(len(data)))
        parts.append(data)
    return b"".join(parts)


def serialize_chunk(chunk: bytes | peer_pb2.FileChunk) -> bytes:
    """gRPC serializer for FileChunk streams: bytes from `encode_data_chunk` pass as they
    are; a message (the header chunk) is serialized by protobuf."""
    if isinstance(chunk, bytes):
        return chunk
    return chunk.SerializeToString()


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= buf.nbytes or shift > 63:
            raise ValueError("FileChunk: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def decode_chunk(message: bytes) -> Chunk:
    """Decode a FileChunk (the fetcher's deserializer; PushFile's handler calls it on
    each raw message). Unknown fields are skipped, as protobuf does; a malformed message
    raises ValueError."""
    buf = memoryview(message)
    header: peer_pb2.FileHeader | None = None
    offset = 0
    data = buf[:0]
    pos = 0
    while pos < buf.nbytes:
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            if field == _OFFSET:
                offset = value
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > buf.nbytes:
                raise ValueError("FileChunk: a field runs past the end of the message")
            if field == _DATA:
                data = buf[pos : pos + length]
            elif field == _HEADER:
                try:
                    header = peer_pb2.FileHeader.FromString(buf[pos : pos + length].tobytes())
                except Exception:
                    raise ValueError("FileChunk: the header is not a FileHeader") from None
            pos += length
        elif wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
        else:
            raise ValueError(f"FileChunk: unsupported wire type {wire_type}")
    if pos != buf.nbytes:
        raise ValueError("FileChunk: truncated message")
    return Chunk(header, offset, data)


class PeerStub:
    """The generated PeerService stub, with FetchFile and PushFile on this codec."""

    def __init__(self, channel: grpc.Channel) -> None:
        generated = peer_pb2_grpc.PeerServiceStub(channel)
        self.Holdings = generated.Holdings
        self.PublishCheckpoint = generated.PublishCheckpoint
        self.UpdateReplicas = generated.UpdateReplicas
        self.ListManifests = generated.ListManifests
        self.ApplyMark = generated.ApplyMark
        self.Hello = generated.Hello
        self.GrantFetch = generated.GrantFetch
        self.ReportCorrupt = generated.ReportCorrupt
        self.OfferFile = generated.OfferFile
        self.FetchFile: grpc.UnaryStreamMultiCallable[peer_pb2.FetchFileRequest, Chunk] = (
            channel.unary_stream(
                f"/{_SERVICE}/FetchFile",
                request_serializer=peer_pb2.FetchFileRequest.SerializeToString,
                response_deserializer=decode_chunk,
                _registered_method=True,
            )
        )
        self.PushFile: grpc.StreamUnaryMultiCallable[
            bytes | peer_pb2.FileChunk, peer_pb2.PushFileResponse
        ] = channel.stream_unary(
            f"/{_SERVICE}/PushFile",
            request_serializer=serialize_chunk,
            response_deserializer=peer_pb2.PushFileResponse.FromString,
            _registered_method=True,
        )


class Ticket(Protocol):
    """What the servicer's guard hands out per call (`rpc.peer_guard.Ticket`)."""

    def touch(self) -> None: ...

    def settle(self) -> None: ...


class _NoTicket:
    def touch(self) -> None:
        pass

    def settle(self) -> None:
        pass


_NO_TICKET = _NoTicket()


def _guard(servicer: Any, method: str, context: Any) -> AbstractContextManager[Ticket]:
    """The servicer's `guard(method, context)` (admission and a watchdog ticket, entered
    before any request byte is read), or nothing for a servicer without one."""
    guard = getattr(servicer, "guard", None)
    if guard is None:
        return nullcontext(_NO_TICKET)
    ticket: AbstractContextManager[Ticket] = guard(method, context)
    return ticket


def _malformed(method: str, what: str, context: Any) -> NoReturn:
    metrics.MALFORMED_REQUESTS.labels(service="PeerService").inc()
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {what}")
    raise AssertionError("context.abort returned")  # pragma: no cover


def _request(
    method: str, parse: Callable[[bytes], T], requests: Iterator[bytes], context: Any
) -> T:
    """The one request message of a unary-request call, parsed here, not by gRPC: a
    message gRPC fails to deserialize costs ~15-19 KB that grpcio 1.85 never frees."""
    raw = next(requests, None)
    if raw is None:
        _malformed(method, "the call carries no request message", context)
    try:
        return parse(raw)
    except Exception:
        _malformed(method, "the request is not a valid protobuf message of its type", context)


def _unary(
    servicer: Any, method: str, parse: Callable[[bytes], Any]
) -> Callable[[Iterator[bytes], Any], Any]:
    behaviour = getattr(servicer, method)

    def handle(requests: Iterator[bytes], context: Any) -> Any:
        with _guard(servicer, method, context) as ticket:
            request = _request(method, parse, requests, context)
            ticket.settle()
            return behaviour(request, context)

    return handle


def _fetch(servicer: Any) -> Callable[[Iterator[bytes], Any], Iterator[Any]]:
    def handle(requests: Iterator[bytes], context: Any) -> Iterator[Any]:
        with _guard(servicer, "FetchFile", context) as ticket:
            request = _request("FetchFile", peer_pb2.FetchFileRequest.FromString, requests, context)
            ticket.touch()
            for chunk in servicer.FetchFile(request, context):
                yield chunk
                ticket.touch()  # sent: the fetcher reads

    return handle


def _push(servicer: Any) -> Callable[[Iterator[bytes], Any], Any]:
    def handle(requests: Iterator[bytes], context: Any) -> Any:
        with _guard(servicer, "PushFile", context) as ticket:

            def chunks() -> Iterator[Chunk]:
                for raw in requests:
                    ticket.touch()
                    fault("peer.receive.chunk")
                    try:
                        chunk = decode_chunk(raw)
                    except ValueError as e:
                        metrics.MALFORMED_REQUESTS.labels(service="PeerService").inc()
                        raise InvalidArgument(f"PushFile: {e}") from None
                    yield chunk

            return servicer.PushFile(chunks(), context)

    return handle


def register_peer_service(servicer: Any, server: Any) -> None:
    """Register a PeerService servicer: every method takes its request as raw bytes and
    decodes it here (INVALID_ARGUMENT when malformed), after the servicer's `guard`
    admitted the call; FetchFile and PushFile speak this codec (the servicer takes
    `Chunk`s and may yield encoded bytes)."""
    unary: dict[str, tuple[type[Message], type[Message]]] = {
        "Holdings": (common_pb2.CheckpointRef, peer_pb2.HoldingsResponse),
        "PublishCheckpoint": (common_pb2.CheckpointInfo, peer_pb2.PublishCheckpointResponse),
        "UpdateReplicas": (peer_pb2.UpdateReplicasRequest, peer_pb2.UpdateReplicasResponse),
        "ListManifests": (peer_pb2.ListManifestsRequest, peer_pb2.ListManifestsResponse),
        "ApplyMark": (peer_pb2.CheckpointMark, peer_pb2.ApplyMarkResponse),
        "Hello": (peer_pb2.HelloRequest, peer_pb2.HelloResponse),
        "GrantFetch": (peer_pb2.FetchFileRequest, peer_pb2.BulkGrant),
        "ReportCorrupt": (peer_pb2.ReportCorruptRequest, peer_pb2.ReportCorruptResponse),
        "OfferFile": (peer_pb2.FileHeader, peer_pb2.PushFileResponse),
    }
    # Request-streaming handlers (the wire is the same for a unary request): gRPC then
    # reads nothing before the servicer's guard runs, and deserializes nothing at all.
    handlers = {
        name: grpc.stream_unary_rpc_method_handler(
            _unary(servicer, name, request.FromString),
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in unary.items()
        if hasattr(servicer, name)  # a partial servicer (tests): the rest is UNIMPLEMENTED
    }
    handlers["PushFile"] = grpc.stream_unary_rpc_method_handler(
        _push(servicer), response_serializer=peer_pb2.PushFileResponse.SerializeToString
    )
    handlers["FetchFile"] = grpc.stream_stream_rpc_method_handler(
        _fetch(servicer), response_serializer=serialize_chunk
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)
