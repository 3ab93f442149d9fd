"""The bulk listener: file bytes to peers off the per-chunk RPC path.

gRPC stays the control plane: a fetcher asks `GrantFetch` (authenticated and authorized
as every peer call, `rpc/peer_service.py`), gets a one-use grant (`bulk_grants`), and
opens one TCP connection here that presents it (`bulk_wire`). Nothing on that
connection is trusted more than a peer RPC: the request is bounded (MAX_REQUEST bytes,
read within `header_timeout`), the grant is taken out of the table by its first use,
the request must name exactly what was granted, the caller must be the one it was
granted to (mutual TLS: its certificate names that node; otherwise it connects from the
address the control call came from), and the range is checked against the catalog's
record and the file as it is now.

The bytes go out with `socket.sendfile` (zero copy from the memory-tier tmpfs file)
on a plaintext stream, and through a 1 MiB buffer (`os.preadv` + `sendall`) under TLS,
where every byte is encrypted in user space: TLS costs one read copy and the cipher.
That is all a send spends: the sender does not hash what it sends. Only the file's size
is checked against its manifest before the answer (a copy of the wrong size is never
served: DATA_LOSS, dropped and repaired here through `on_corrupt`).

Why this is safe: trust no byte. The fetcher trusts nothing it did not hash itself; it
verifies every block against the manifest as it lands (`memory.incoming.IncomingFile`),
so a corrupt byte can never land as a good copy, whoever sent it: it asks the next
holder. Hashing here too would only have told this node sooner that its copy is bad;
instead the fetcher tells it (`ReportCorrupt`) and this node re-hashes its own copy,
bounded, acting only on its own hash (`peers/recheck.py`), and the background scrubber
(`[memory] scrub_rate`) re-hashes every held copy anyway. (Hashing every block here as
well cost the sender 3.46x the CPU per GiB of a raw `sendfile` sender.)

A replication copy's grant says it is one (`background`): its send runs at background CPU
priority (`ops/priority.py`), in slices, stepping aside while a save writes on this node
(as the per-chunk push did between messages); a restore's goes at once, at normal priority.

A send that makes no progress for `stall` seconds is dropped (the socket's timeout), so
a fetcher that stops reading frees its slot.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from contextlib import suppress
from io import FileIO

from tierckpt.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    InvalidArgument,
    PermissionDenied,
    TierckptError,
)
from tierckpt.names import check_file_name
from tierckpt.v1 import peer_pb2

from tierckptd.jobs import StepAside
from tierckptd.model import FileRecord
from tierckptd.ops import metrics
from tierckptd.ops.faults import fault
from tierckptd.ops.priority import background_priority_for_this_thread
from tierckptd.peers.bulk_grants import Grant, Grants
from tierckptd.peers.bulk_wire import cert_names, error_frame, ok_frame, read_request
from tierckptd.peers.serve import OnCorrupt
from tierckptd.wire import bounded, check_ref

__all__ = ["HEADER_TIMEOUT", "MAX_CONNECTIONS", "TLS_BUFFER", "BulkServer", "FileView"]

logger = logging.getLogger(__name__)

# A connection must complete its TLS handshake and send its request within this.
HEADER_TIMEOUT = 5.0
# Connections served at once (handshakes, requests and sends); more are closed at once.
MAX_CONNECTIONS = 32
# The buffer of a send under TLS (no sendfile there).
TLS_BUFFER = 1 << 20
# A replication copy is sent in slices of this many bytes, a save on this node checked
# between them: a save that starts mid-file waits for at most one slice (about 7 ms at
# 1.2 GB/s).
BACKGROUND_SLICE = 8 << 20

FileView = Callable[[str, str, str], tuple[FileRecord, str]]
"""(namespace, checkpoint id, name) -> (its record, its local path or "" when not held)."""

_ERROR_NAMES: dict[type[Exception], str] = {
    ChecksumMismatch: "DATA_LOSS",
    PermissionDenied: "PERMISSION_DENIED",
    CheckpointNotFound: "NOT_FOUND",
    InvalidArgument: "INVALID_ARGUMENT",
}


def _status(e: BaseException) -> str:
    for kind, name in _ERROR_NAMES.items():
        if isinstance(e, kind):
            return name
    return "INTERNAL"


class BulkServer:
    """One node's bulk listener (see the module docstring).

    Args:
        files: the catalog's `file_view`.
        grants: the grants GrantFetch hands out.
        address: "host:port" to bind (port 0: any free port; `port` says which).
        tls: the server's TLS context (`bulk_wire.server_context`), None for plaintext.
        mutual_tls: a caller is the node its client certificate names.
        stall: seconds a send may make no progress before it is dropped.
        on_corrupt: told of a copy that failed verification as it was sent
            (`Cluster.corrupt`: dropped, counted, repaired).
        saving: whether a save writes on this node now (`Catalog.saving`): a
            replication copy's send steps aside for it between slices.
    """

    def __init__(
        self,
        files: FileView,
        grants: Grants,
        address: str,
        *,
        node_id: str,
        tls: ssl.SSLContext | None = None,
        mutual_tls: bool = False,
        stall: float = 10.0,
        header_timeout: float = HEADER_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        on_corrupt: OnCorrupt | None = None,
        saving: Callable[[], bool] | None = None,
    ) -> None:
        self.files = files
        self.saving = saving
        self.on_corrupt = on_corrupt
        self.grants = grants
        self.node_id = node_id
        self.tls = tls
        self.mutual_tls = mutual_tls
        self.stall = stall
        self.header_timeout = header_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, int(port or 0)))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tierckptd-bulk", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info(
            "bulk listener on port %d (%s)",
            self.port,
            "TLS" if self.tls is not None else "plaintext",
        )

    def stop(self) -> None:
        self._stopped.set()
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                continue
            if not self._slots.acquire(blocking=False):
                metrics.PEER_REFUSED.labels(reason="busy").inc()
                conn.close()
                continue
            threading.Thread(
                target=self._connection,
                args=(conn, peer[0]),
                name="tierckptd-bulk-send",
                daemon=True,
            ).start()

    def _connection(self, conn: socket.socket, address: str) -> None:
        try:
            conn.settimeout(self.header_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            self._serve(conn, address)
        except (OSError, EOFError, ssl.SSLError) as e:
            logger.debug("bulk connection from %s dropped: %s", address, e)
        finally:
            with suppress(OSError):
                conn.close()
            self._slots.release()

    def _serve(self, conn: socket.socket, address: str) -> None:
        try:
            request = read_request(conn)
            grant = self.grants.redeem(request.grant)
        except TierckptError as e:
            self._refuse(conn, address, e)
            return
        try:
            try:
                f, path = self._check(conn, address, grant, request)
            except TierckptError as e:
                self._refuse(conn, address, e)
                return
            if grant.background:
                # This thread ends with this send (one grant per connection), so it can
                # be lowered for good: a replication copy yields to this node's saves.
                background_priority_for_this_thread()
            self._send(conn, grant, path, f)
        finally:
            self.grants.done()

    def _check(
        self, conn: socket.socket, address: str, grant: Grant, request: peer_pb2.BulkRequest
    ) -> tuple[FileRecord, str]:
        """The granted file's record and path, once the connection proved it may have it."""
        namespace, checkpoint_id = check_ref(request.ref)
        name = check_file_name(request.file_name)
        asked = (namespace, checkpoint_id, name, request.offset, request.length)
        granted = (grant.namespace, grant.checkpoint_id, grant.name, grant.offset, grant.length)
        if asked != granted:
            raise PermissionDenied(
                f"bulk transfer refused: the grant was for {grant.namespace}/"
                f"{grant.checkpoint_id}/{grant.name} bytes {grant.offset}+{grant.length}, "
                f"not {namespace}/{checkpoint_id}/{name} bytes {request.offset}+{request.length}"
            )
        if self.mutual_tls:
            if grant.peer not in cert_names(conn):
                raise PermissionDenied(
                    f"bulk transfer refused: the grant is node {grant.peer}'s, and this "
                    "connection's certificate does not name it"
                )
        elif grant.address and address != grant.address:
            raise PermissionDenied(
                f"bulk transfer refused: the grant was given to {grant.address}, not {address}"
            )
        f, path = self.files(namespace, checkpoint_id, name)
        what = f"{namespace}/{checkpoint_id}/{name}"
        if not path:
            raise CheckpointNotFound(f"node {self.node_id} holds no copy of {what}")
        if grant.offset + grant.length > f.size:
            raise InvalidArgument(
                f"range {grant.offset}+{grant.length} outside {what}'s {f.size} bytes"
            )
        return f, path

    def _send(self, conn: socket.socket, grant: Grant, path: str, f: FileRecord) -> None:
        try:
            file = open(path, "rb", buffering=0)  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            self._refuse(
                conn,
                grant.address,
                CheckpointNotFound(f"node {self.node_id}: the copy of {f.name} vanished (evicted)"),
            )
            return
        with file:
            if os.fstat(file.fileno()).st_size != f.size:
                self._corrupt(
                    conn,
                    grant,
                    ChecksumMismatch(
                        f"{grant.namespace}/{grant.checkpoint_id}/{f.name} on node {self.node_id}: "
                        f"the file has {os.fstat(file.fileno()).st_size} bytes, its manifest says {f.size}"
                    ),
                )
                return
            conn.settimeout(self.stall)
            conn.sendall(ok_frame(grant.length))
            fault("peer.bulk.send")
            sent = self._send_range(conn, file, grant)
            metrics.PEER_SENT_BYTES.labels(path="bulk").inc(sent)
            if sent < grant.length:  # the file shrank (released and recycled) meanwhile
                raise EOFError(f"the copy ended after {sent:,} of {grant.length:,} bytes")

    def _corrupt(self, conn: socket.socket, grant: Grant, e: ChecksumMismatch) -> None:
        """This node's copy is not the size its manifest says: never serve it, and have
        it dropped and repaired (`Cluster.corrupt`, as a gRPC fetch does)."""
        if self.on_corrupt is not None:
            self.on_corrupt(grant.namespace, grant.checkpoint_id, grant.name, str(e), "served")
        with suppress(OSError):
            conn.sendall(error_frame("DATA_LOSS", bounded(str(e), 900)))

    def _send_range(self, conn: socket.socket, file: FileIO, grant: Grant) -> int:
        """The granted range, sent; the bytes sent (fewer when the file ends early).

        A restore's range goes in one `sendfile`. A replication copy's goes in slices,
        and before each it steps aside while a save writes on this node (the gRPC push
        did so between messages): each wait at most half the stall window, so the
        fetcher still sees progress, and SAVE_YIELD_MAX seconds in all."""
        aside = (
            StepAside(self.saving, stop=self._stopped)
            if grant.background and self.saving is not None
            else None
        )
        sent = 0
        while sent < grant.length:
            count = grant.length - sent
            if aside is not None:
                aside.wait(self.stall / 2)
                count = min(count, BACKGROUND_SLICE)
            offset = grant.offset + sent
            if isinstance(conn, ssl.SSLSocket):
                n = self._send_copied(conn, file.fileno(), offset, count)
            else:
                n = conn.sendfile(file, offset, count)
            if n <= 0:
                break
            sent += n
        return sent

    def _send_copied(self, conn: socket.socket, fd: int, offset: int, length: int) -> int:
        """Under TLS (no sendfile): `length` bytes from `offset` through one buffer;
        the bytes sent (fewer when the file ends early)."""
        buf = bytearray(min(TLS_BUFFER, max(length, 1)))
        view = memoryview(buf)
        start, end = offset, offset + length
        while offset < end:
            n = os.preadv(fd, [view[: min(len(buf), end - offset)]], offset)
            if n <= 0:
                break
            conn.sendall(view[:n])
            offset += n
        return offset - start

    def _refuse(self, conn: socket.socket, address: str, e: TierckptError) -> None:
        status = _status(e)
        metrics.PEER_REFUSED.labels(
            reason="permission" if status == "PERMISSION_DENIED" else "invalid"
        ).inc()
        logger.info("bulk transfer from %s refused: %s", address, bounded(str(e)))
        with suppress(OSError):
            conn.sendall(error_frame(status, bounded(str(e), 900)))
