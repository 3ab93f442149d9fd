"""The bulk stream's framing and TLS, shared by its server (`bulk_server`) and its
fetcher (`bulk_client`).

A connection carries one transfer. The fetcher sends MAGIC, a big-endian uint16 length
(at most MAX_REQUEST) and a `BulkRequest` (the grant and what it was granted for); the
server answers one status byte: OK, then the range's length as a big-endian uint64 and
exactly that many bytes, or an error code, a big-endian uint16 length and a UTF-8
message (at most MAX_MESSAGE bytes). Nothing else is ever read from the fetcher, so a
server never buffers more than MAX_REQUEST bytes of anyone's.

TLS: when the peer port speaks TLS (`[security] tls_cert`/`tls_key`), so does the bulk
listener, with the same certificate, and with `tls_ca` it requires a client certificate
from that CA (mutual TLS) and the fetcher checks the server's names the node id it
called, as peer channels do (`security`).
"""

from __future__ import annotations

import socket
import ssl
import struct

from tierckpt.errors import InvalidArgument
from tierckpt.v1 import peer_pb2

from tierckptd.config import SecurityConfig

__all__ = [
    "MAGIC",
    "MAX_MESSAGE",
    "MAX_REQUEST",
    "STATUS_NAMES",
    "client_context",
    "encode_request",
    "read_exact",
    "read_request",
    "server_context",
]

MAGIC = b"TCB1"
MAX_REQUEST = 4096
MAX_MESSAGE = 1024
OK = 0
# Error status bytes and the gRPC status names the fetcher reports them as.
STATUS_NAMES = {
    1: "PERMISSION_DENIED",
    2: "NOT_FOUND",
    3: "INVALID_ARGUMENT",
    4: "RESOURCE_EXHAUSTED",
    5: "INTERNAL",
    6: "DATA_LOSS",
}
STATUS_OF = {name: code for code, name in STATUS_NAMES.items()}


def encode_request(request: peer_pb2.BulkRequest) -> bytes:
    body = request.SerializeToString()
    if len(body) > MAX_REQUEST:
        raise InvalidArgument(f"bulk request of {len(body)} bytes (at most {MAX_REQUEST})")
    return MAGIC + struct.pack(">H", len(body)) + body


def read_exact(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock` (n is small: headers only); EOFError when it closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def read_request(sock: socket.socket) -> peer_pb2.BulkRequest:
    """The fetcher's one request, bounded (InvalidArgument when it is not one)."""
    head = read_exact(sock, len(MAGIC) + 2)
    if head[: len(MAGIC)] != MAGIC:
        raise InvalidArgument("not a tierckpt bulk request (bad magic)")
    (length,) = struct.unpack(">H", head[len(MAGIC) :])
    if length > MAX_REQUEST:
        raise InvalidArgument(f"bulk request of {length} bytes (at most {MAX_REQUEST})")
    try:
        return peer_pb2.BulkRequest.FromString(read_exact(sock, length))
    except EOFError:
        raise
    except Exception:
        raise InvalidArgument("the bulk request is not a BulkRequest") from None


def error_frame(status: str, message: str) -> bytes:
    data = message.encode("utf-8", "replace")[:MAX_MESSAGE]
    return (
        bytes((STATUS_OF.get(status, STATUS_OF["INTERNAL"]),)) + struct.pack(">H", len(data)) + data
    )


def ok_frame(length: int) -> bytes:
    return bytes((OK,)) + struct.pack(">Q", length)


def server_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """The bulk listener's TLS context: None when the peer port is plaintext."""
    if not (security.tls_cert and security.tls_key):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_ca:
        ctx.load_verify_locations(security.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """The fetcher's TLS context (its certificate, the cluster's CA or the system roots):
    None when the peer port is plaintext."""
    if not (security.tls_cert and security.tls_key):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_ca:
        ctx.load_verify_locations(security.tls_ca)
    else:
        ctx.load_default_certs()
    return ctx


def cert_names(sock: socket.socket) -> list[str]:
    """The DNS and URI subjectAltNames of the verified certificate the other side of a
    TLS connection presented (none on a plaintext one): the node ids it goes by."""
    if not isinstance(sock, ssl.SSLSocket):
        return []
    cert = sock.getpeercert() or {}
    return [
        str(entry[1])
        for entry in cert.get("subjectAltName", ())
        if isinstance(entry, tuple) and len(entry) == 2 and entry[0] in ("DNS", "URI")
    ]
