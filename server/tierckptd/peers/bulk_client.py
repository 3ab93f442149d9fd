"""The fetching side of the bulk stream: one granted range of a peer's file, received
with `recv_into` into one bounded buffer (RECV_BUFFER) and handed on as views of it.

The buffer is reused: each (offset, view) piece is valid until the next one is asked
for, which is how `memory.incoming` consumes them (pwrite and hash, then the next), so
a byte is copied once out of the socket and once into the landing file, as a raw TCP
receiver's `recv_into` + `pwrite`. A receive that brings no byte for `stall` seconds
(the fetch stall window, `client.FETCH_STALL`) is cancelled ("STALLED"), as a gRPC
fetch is.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from tierckpt.v1 import common_pb2, peer_pb2

from tierckptd.errors import SourceUnavailable
from tierckptd.peers.bulk_wire import STATUS_NAMES, encode_request, read_exact

__all__ = ["CANNOT_CONNECT", "RECV_BUFFER", "BulkError", "BulkFetcher", "BulkTicket"]

RECV_BUFFER = 4 << 20
# The code of a bulk stream that could not be opened at all (a firewall that lets the
# peer port through but not the bulk port): the fetcher uses FetchFile instead.
CANNOT_CONNECT = "CANNOT_CONNECT"


@dataclass(frozen=True)
class BulkTicket:
    """A grant as GrantFetch answered it: where to connect and what to ask for."""

    token: bytes
    host: str
    port: int
    namespace: str
    checkpoint_id: str
    name: str
    offset: int
    length: int


class BulkError(SourceUnavailable):
    """A bulk transfer failed: `code` as `PeerCallError`'s (a gRPC status name, or
    "STALLED"); the peer client turns it into one."""

    def __init__(self, node: str, code: str, details: str) -> None:
        super().__init__(f"peer {node}", f"bulk fetch: {code}: {details}")
        self.node = node
        self.code = code
        self.details = details

    def __reduce__(self) -> tuple[object, ...]:
        return (BulkError, (self.node, self.code, self.details))


class BulkFetcher:
    """Opens bulk connections with this node's TLS context (None: plaintext);
    `verify_names`: the server's certificate must name the node id called (mutual TLS)."""

    def __init__(
        self,
        tls: ssl.SSLContext | None = None,
        *,
        verify_names: bool = False,
        buffer_bytes: int = RECV_BUFFER,
    ) -> None:
        self.tls = tls
        self.verify_names = verify_names
        self.buffer_bytes = buffer_bytes

    def connect(self, node: str, ticket: BulkTicket, stall: float) -> socket.socket:
        sock = socket.create_connection((ticket.host, ticket.port), timeout=stall)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                name = node if self.verify_names else ticket.host
                return self.tls.wrap_socket(sock, server_hostname=name)
            return sock
        except BaseException:
            sock.close()
            raise

    def fetch(
        self, node: str, ticket: BulkTicket, stall: float
    ) -> Iterator[tuple[int, memoryview]]:
        """The granted range as (offset, view) pieces (see the module docstring);
        BulkError when refused, cut short or stalled."""
        received = filled = 0  # filled: bytes in the buffer not yet handed on
        try:
            sock = self.connect(node, ticket, stall)
        except (OSError, ssl.SSLError) as e:
            raise BulkError(
                node, CANNOT_CONNECT, f"cannot connect to {ticket.host}:{ticket.port}: {e}"
            ) from None
        try:
            request = peer_pb2.BulkRequest(
                grant=ticket.token,
                ref=common_pb2.CheckpointRef(
                    namespace=ticket.namespace, checkpoint_id=ticket.checkpoint_id
                ),
                file_name=ticket.name,
                offset=ticket.offset,
                length=ticket.length,
            )
            sock.sendall(encode_request(request))
            status = read_exact(sock, 1)[0]
            if status != 0:
                code = STATUS_NAMES.get(status, "INTERNAL")
                (n,) = struct.unpack(">H", read_exact(sock, 2))
                raise BulkError(
                    node, code, read_exact(sock, min(n, 1024)).decode("utf-8", "replace")
                )
            (length,) = struct.unpack(">Q", read_exact(sock, 8))
            if length != ticket.length:
                raise BulkError(
                    node,
                    "INVALID_ARGUMENT",
                    f"it sends {length} bytes, {ticket.length} were granted",
                )
            buf = bytearray(min(self.buffer_bytes, max(length, 1)))
            view = memoryview(buf)
            while received < length:
                want = min(len(buf), length - received)
                filled = 0
                while filled < want:
                    k = sock.recv_into(view[filled:want])
                    if k == 0:
                        raise BulkError(
                            node,
                            "UNAVAILABLE",
                            f"the stream ended after {received + filled:,} of {length:,} bytes",
                        )
                    filled += k
                yield ticket.offset + received, view[:filled]
                received += filled
                filled = 0
        except BulkError:
            raise
        except TimeoutError:
            # Every byte that came counts, those still in the buffer too: a stall within
            # the first buffer (4 MiB) after bytes flowed is "too slow", never "no answer".
            came = received + filled
            raise BulkError(
                node,
                "STALLED",
                f"too slow ({came:,} bytes; nothing for {stall:g} s): the link is slow or "
                "congested, or the peer froze"
                if came
                else f"no answer for {stall:g} s: it accepted the connection but sent nothing",
            ) from None
        except (OSError, EOFError, ssl.SSLError) as e:
            raise BulkError(node, "UNAVAILABLE", f"the bulk stream broke: {e}") from None
        finally:
            sock.close()
