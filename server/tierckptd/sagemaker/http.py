"""HTTP/1.1 listener of the SageMaker client's API (`[listen] sagemaker`).

Server: the standard library's `http.server.ThreadingHTTPServer`, one thread per
connection. It fits the daemon: every operation behind it is a blocking call into the
catalog, the cluster commit or the restore chain (locks, peer RPCs, S3), exactly what the
gRPC servicer's thread pool does, so no event loop has to hand work to threads (aiohttp)
and no WSGI layer buffers or wraps the body (Werkzeug): the handler reads the body from
the socket's buffered reader straight into the memory-tier file, 1 MiB at a time, and
sends a blob with `os.sendfile` from the page cache. The client opens one connection per
writer or reader (a few per rank and step), so threads stay few; `MAX_CONNECTIONS` caps
them and `TIMEOUT` drops a silent peer.

Status codes, as the client maps them: 400/403/404/409/413/422 -> its
`InMemoryClientError` (404 is "absent" where it allows it), 507 (budget full) and 500 ->
`InMemoryServerError` / `InMemoryRequestError`. Error bodies are one bounded line,
never a traceback; responses are never compressed and always carry Content-Length.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointNotFound,
    ChecksumMismatch,
    InvalidArgument,
    MemoryBudgetExceeded,
    PermissionDenied,
    TierUnavailable,
    UnsafeMetadata,
)

from tierckptd.rpc.servers import AddressInUse
from tierckptd.sagemaker.checkpoints import (
    BodyTooLarge,
    ResetRefused,
    SeedCheckpoints,
)
from tierckptd.sagemaker.protocol import (
    DEFAULT_LIMIT,
    DEFAULT_STEPS_RETAINED,
    MAX_LIMIT,
    MAX_RANK,
    MAX_STEPS_RETAINED,
    NoRoute,
    Route,
    Target,
    parse_shard_meta,
    parse_target,
    query_int,
    shard_meta,
)

__all__ = ["SeedListener", "parse_address"]

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
TIMEOUT = 120.0  # seconds a connection may stay silent (the client's own is 60 s)
MAX_ERROR = 512
MAX_BODY = 1 << 40  # a Content-Length beyond any memory tier is refused unread

# Most specific first: the first class an error is an instance of gives the status.
_STATUS: tuple[tuple[type[BaseException], HTTPStatus], ...] = (
    (NoRoute, HTTPStatus.NOT_FOUND),
    (BodyTooLarge, HTTPStatus.REQUEST_ENTITY_TOO_LARGE),
    (UnsafeMetadata, HTTPStatus.UNPROCESSABLE_ENTITY),
    (ChecksumMismatch, HTTPStatus.BAD_REQUEST),
    (InvalidArgument, HTTPStatus.BAD_REQUEST),
    (ResetRefused, HTTPStatus.FORBIDDEN),
    (PermissionDenied, HTTPStatus.FORBIDDEN),
    (CheckpointNotFound, HTTPStatus.NOT_FOUND),
    (CheckpointExists, HTTPStatus.CONFLICT),
    (CheckpointIncomplete, HTTPStatus.CONFLICT),
    (MemoryBudgetExceeded, HTTPStatus.INSUFFICIENT_STORAGE),
    (TierUnavailable, HTTPStatus.SERVICE_UNAVAILABLE),
)


def status_of(error: BaseException) -> HTTPStatus:
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return HTTPStatus.INTERNAL_SERVER_ERROR


def parse_address(address: str) -> tuple[str, int]:
    """("host", port) of a "HOST:PORT" / "[V6]:PORT" value."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"[listen] sagemaker = {address!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tierckptd-sagemaker"
    sys_version = ""
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(TIMEOUT)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("sagemaker API %s: %s", self.address_string(), format % args)

    # ---- responses ---------------------------------------------------------------------
    def _send(self, status: HTTPStatus, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key.replace("_", "-"), value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value: object, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(value).encode(), "application/json")

    def _error(self, status: HTTPStatus, message: str) -> None:
        text = " ".join(message.split())[:MAX_ERROR]
        self._send(status, json.dumps({"detail": text}).encode(), "application/json")

    def _drain_body(self) -> None:
        """Read off a body the route does not take, so the connection stays usable;
        a large one closes the connection instead."""
        length = self._content_length()
        if length > 1 << 20:
            self.close_connection = True
        elif length:
            self.rfile.read(length)

    def _content_length(self) -> int:
        raw = self.headers.get("Content-Length")
        if raw is None:
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                raise InvalidArgument("chunked request bodies are not taken: send Content-Length")
            return 0
        if not raw.strip().isdigit() or int(raw) > MAX_BODY:
            self.close_connection = True
            raise BodyTooLarge(f"Content-Length {raw[:32]!r} is not a size this API takes")
        return int(raw)

    # ---- dispatch ----------------------------------------------------------------------
    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        body_read = False
        try:
            target = parse_target(self.path)
            if method == "POST" and target.route is Route.BLOB:
                body_read = True  # taken (or the connection closed) by the blob path
                self._post_blob(target)
                return
            self._drain_body()
            body_read = True
            self._route(method, target)
        except Exception as e:  # every error is an answer, never a traceback
            status = status_of(e)
            if status is HTTPStatus.INTERNAL_SERVER_ERROR:
                logger.exception("sagemaker API %s %s failed", method, self.path[:200])
                message = f"{method} failed on node with an internal error; the daemon log has the details"
            else:
                message = str(e)
                if status >= 500:
                    logger.warning("sagemaker API %s %s: %.300s", method, self.path[:200], e)
            if not body_read:
                self.close_connection = True
            self._error(status, message)

    def _route(self, method: str, target: Target) -> None:
        api, route = self.server.api, target.route
        if route is Route.HEALTH and method == "GET":
            self._json({"status": "ok"})
        elif route is Route.NAMESPACE and method == "GET":
            config = api.namespace(target.namespace)
            if config is None:
                self._error(HTTPStatus.NOT_FOUND, f"namespace {target.namespace} not found")
            else:
                self._json(config.to_json())
        elif route is Route.NAMESPACE and method == "POST":
            num_ranks = query_int(target.query, "num_ranks", -1, 2, MAX_RANK)
            if num_ranks < 0:
                raise InvalidArgument("query parameter num_ranks is required")
            kept = query_int(
                target.query, "steps_retained", DEFAULT_STEPS_RETAINED, 1, MAX_STEPS_RETAINED
            )
            self._json(api.create_namespace(target.namespace, num_ranks, kept).to_json())
        elif route is Route.NAMESPACE and method == "DELETE":
            removed = api.delete_namespace(target.namespace)
            self._json({"namespace": target.namespace, "deleted_steps": removed})
        elif route is Route.LATEST and method == "GET":
            limit = query_int(target.query, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
            self._json(api.latest(target.namespace, limit))
        elif route is Route.BLOB and method == "GET":
            self._get_blob(target)
        elif route is Route.BLOB and method == "DELETE":
            api.delete(target.namespace, target.rank, target.step)
            self._json({"deleted": True})
        elif route is Route.RESET and method == "POST":
            self._json({"deleted_steps": api.reset()})
        else:
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not served on this route")

    def _post_blob(self, target: Target) -> None:
        try:
            digest = parse_shard_meta(self.headers.get("Shard-Meta"))
            size = self._content_length()
        except Exception:
            self.close_connection = True  # the body is never read: the stream is lost
            raise
        received = 0

        def read_into(view: memoryview) -> int:
            nonlocal received
            got = self.rfile.readinto(view)
            received += got or 0
            return got or 0

        try:
            self.server.api.put(target.namespace, target.rank, target.step, size, digest, read_into)
        except Exception:
            if received < size:
                self.close_connection = True
            raise
        self._json({"stored": True, "size": size}, HTTPStatus.CREATED)

    def _get_blob(self, target: Target) -> None:
        blob = self.server.api.get(target.namespace, target.rank, target.step)
        if blob is None:
            self._error(
                HTTPStatus.NOT_FOUND,
                f"{target.namespace} has no committed blob of rank {target.rank} at step {target.step}",
            )
            return
        with open(blob.path, "rb") as f:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(blob.size))
            self.send_header("Shard-Meta", shard_meta(blob.digest))
            self.end_headers()
            self.wfile.flush()
            try:  # os.sendfile from the page cache, waiting out a full socket buffer
                sent = self.connection.sendfile(f, 0, blob.size) if blob.size else 0
            except OSError as e:  # the status line is out: only the connection can say it
                sent = -1
                logger.warning("sagemaker API: sending %s stopped: %s", self.path[:200], e)
            if sent != blob.size:
                self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], api: SeedCheckpoints) -> None:
        self.api = api
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                    b"Connection: close\r\n\r\n"
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class SeedListener:
    """The bound listener and its accept thread; `stop()` closes both."""

    def __init__(self, address: str, api: SeedCheckpoints) -> None:
        host, port = parse_address(address)
        try:
            self._server = _Server((host, port), api)
        except OSError as e:
            raise AddressInUse(
                f"[listen] sagemaker = {address!r}: cannot listen there: {e.strerror or e}"
            ) from e
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="tierckptd-sagemaker", daemon=True
        )

    def start(self) -> SeedListener:
        self._thread.start()
        logger.info("SageMaker checkpointing API listening on %s", self.address)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
