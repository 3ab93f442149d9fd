"""DaemonService servicer: wire <-> domain translation for the local control plane.

The only module (with health wiring) that sees protobuf types. Each RPC validates,
calls the catalog, and turns a domain error into `context.abort(code, message)` through
the one status table in `tierckpt.errors`, so the message that names the fix reaches the
training rank verbatim.

Requests are decoded here, not by grpc: grpcio leaks 15-19 KB for every request its
deserializer rejects, so a flood of malformed messages would grow the daemon without
bound. A request that does not parse is INVALID_ARGUMENT (counted in
`tierckpt_malformed_requests`). Every status message and log line is bounded, and an
unexpected error answers INTERNAL with a fixed message: no repr, traceback or path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from tierckpt.errors import TierckptError, status_of
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tierckptd.catalog import MAX_FILES, Catalog
from tierckptd.ops import metrics
from tierckptd.peers.cluster import Cluster
from tierckptd.rpc.local_access import LocalAccess
from tierckptd.wire import file_entry, to_info

__all__ = ["DaemonService", "add_daemon_service", "bounded", "to_info"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE = "tierckpt.v1.DaemonService"
# Longest status message or echoed error in a log line: grpc carries the details in
# trailing metadata, whose hard limit a long echo would exceed (the client then sees
# "Stream removed" instead of the real error).
MAX_DETAILS = 1000
# Distinct (method, exception type) pairs logged with a traceback; later ones log a line.
_TRACEBACKS_LOGGED: set[tuple[str, str]] = set()
_TRACEBACKS_LOCK = threading.Lock()


def bounded(text: str, limit: int = MAX_DETAILS) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}... ({len(text) - limit + 40:,} more characters)"


def _internal(context: Any, method: str, error: BaseException) -> None:
    """Answer INTERNAL with a fixed message; log the cause, a traceback once per kind."""
    kind = (method, type(error).__name__)
    with _TRACEBACKS_LOCK:
        first = kind not in _TRACEBACKS_LOGGED and len(_TRACEBACKS_LOGGED) < 256
        _TRACEBACKS_LOGGED.add(kind)
    logger.error(
        "%s failed: %s: %s",
        method,
        type(error).__name__,
        bounded(str(error)),
        exc_info=error if first else None,
    )
    context.abort(
        grpc.StatusCode.INTERNAL,
        f"{method} failed on the daemon with an internal error; the daemon log has the details",
    )


class DaemonService(daemon_pb2_grpc.DaemonServiceServicer):
    """Serves one node's catalog to its ranks and the CLI."""

    def __init__(
        self, catalog: Catalog, cluster: Cluster | None = None, access: LocalAccess | None = None
    ) -> None:
        self.catalog = catalog
        # Without peers the cluster only serves local copies (EnsureLocal of a held file).
        self.cluster = cluster or Cluster(catalog, channel_factory=grpc.insecure_channel)
        self.access = access  # [security] local_isolation = "uid"; None: every caller trusted

    def _caller(self, context: Any, method: str) -> int | None:
        """With local_isolation, the uid behind the call's session (else UNAUTHENTICATED)."""
        access = self.access
        if access is None:
            return None
        return self._call(
            context, method, lambda: access.caller(context.invocation_metadata(), method)
        )

    def _allow(self, context: Any, method: str, namespace: str, *, begin: bool = False) -> None:
        """With local_isolation, abort unless the caller's uid may act on `namespace`
        (PERMISSION_DENIED for another uid's)."""
        access, uid = self.access, self._caller(context, method)
        if access is not None and uid is not None:
            self._call(
                context, method, lambda: access.authorize(uid, namespace, method, begin=begin)
            )

    def _visible(self, context: Any, method: str, uid: int | None, names: set[str]) -> set[str]:
        """The namespaces `uid` may see in lists (all of them without local_isolation)."""
        access = self.access
        if access is None or uid is None:
            return names
        return self._call(context, method, lambda: access.visible(uid, names))

    @staticmethod
    def _call(context: Any, method: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except TierckptError as e:
            message = bounded(str(e))
            logger.info("%s refused: %s", method, message)
            context.abort(status_of(e), message)
        except Exception as e:
            _internal(context, method, e)
        raise AssertionError("context.abort returned")  # pragma: no cover

    def BeginCheckpoint(
        self, request: daemon_pb2.BeginCheckpointRequest, context: Any
    ) -> daemon_pb2.BeginCheckpointResponse:
        ref = request.ref
        self._allow(context, "BeginCheckpoint", ref.namespace, begin=True)
        self._call(
            context,
            "BeginCheckpoint",
            lambda: self.catalog.begin(ref.namespace, ref.checkpoint_id, request.rank),
        )
        return daemon_pb2.BeginCheckpointResponse()

    def ReserveSpace(
        self, request: daemon_pb2.ReserveSpaceRequest, context: Any
    ) -> daemon_pb2.ReserveSpaceResponse:
        ref = request.ref
        self._allow(context, "ReserveSpace", ref.namespace)
        total = self._call(
            context,
            "ReserveSpace",
            lambda: self.catalog.reserve(
                ref.namespace, ref.checkpoint_id, request.rank, request.bytes
            ),
        )
        return daemon_pb2.ReserveSpaceResponse(reserved_bytes=total)

    def OpenFile(
        self, request: daemon_pb2.OpenFileRequest, context: Any
    ) -> daemon_pb2.OpenFileResponse:
        ref = request.ref
        self._allow(context, "OpenFile", ref.namespace)
        path, prealloc = self._call(
            context,
            "OpenFile",
            lambda: self.catalog.open_file(
                ref.namespace, ref.checkpoint_id, request.file_name, request.rank
            ),
        )
        return daemon_pb2.OpenFileResponse(path=path, preallocated_bytes=prealloc)

    def CommitFile(
        self, request: daemon_pb2.CommitFileRequest, context: Any
    ) -> daemon_pb2.CommitFileResponse:
        ref, cs = request.ref, request.checksums
        self._allow(context, "CommitFile", ref.namespace)
        self._call(
            context,
            "CommitFile",
            lambda: self.catalog.commit_file(
                ref.namespace,
                ref.checkpoint_id,
                request.file_name,
                request.rank,
                request.size,
                algorithm=cs.algorithm,
                block_size=cs.block_size,
                digests=cs.block_digests,
            ),
        )
        return daemon_pb2.CommitFileResponse()

    def CommitCheckpoint(
        self, request: daemon_pb2.CommitCheckpointRequest, context: Any
    ) -> common_pb2.CheckpointInfo:
        ref = request.ref
        self._allow(context, "CommitCheckpoint", ref.namespace)
        view = self._call(
            context,
            "CommitCheckpoint",
            lambda: self.cluster.commit(
                ref.namespace, ref.checkpoint_id, list(request.required_files)
            ),
        )
        return to_info(view)

    def AbortCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.AbortCheckpointResponse:
        self._allow(context, "AbortCheckpoint", request.namespace)
        self._call(
            context,
            "AbortCheckpoint",
            lambda: self.catalog.abort(request.namespace, request.checkpoint_id),
        )
        return daemon_pb2.AbortCheckpointResponse()

    def GetCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> common_pb2.CheckpointInfo:
        self._allow(context, "GetCheckpoint", request.namespace)
        view = self._call(
            context,
            "GetCheckpoint",
            lambda: self.catalog.get(request.namespace, request.checkpoint_id),
        )
        return to_info(view)

    def ListCheckpoints(
        self, request: daemon_pb2.ListCheckpointsRequest, context: Any
    ) -> daemon_pb2.ListCheckpointsResponse:
        uid = self._caller(context, "ListCheckpoints")
        if request.namespace:
            self._allow(context, "ListCheckpoints", request.namespace)
        views = self._call(
            context,
            "ListCheckpoints",
            lambda: self.catalog.list_checkpoints(request.namespace, request.include_uncommitted),
        )
        shown = self._visible(context, "ListCheckpoints", uid, {v.namespace for v in views})
        views = [v for v in views if v.namespace in shown]
        return daemon_pb2.ListCheckpointsResponse(checkpoints=[to_info(v) for v in views])

    def DeleteCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.DeleteCheckpointResponse:
        self._allow(context, "DeleteCheckpoint", request.namespace)
        freed = self._call(
            context,
            "DeleteCheckpoint",
            lambda: self.catalog.delete(request.namespace, request.checkpoint_id),
        )
        return daemon_pb2.DeleteCheckpointResponse(freed_bytes=freed)

    def PinCheckpoint(
        self, request: daemon_pb2.PinCheckpointRequest, context: Any
    ) -> common_pb2.CheckpointInfo:
        ref = request.ref
        self._allow(context, "PinCheckpoint", ref.namespace)
        view = self._call(
            context,
            "PinCheckpoint",
            lambda: self.catalog.set_pinned(ref.namespace, ref.checkpoint_id, request.pinned),
        )
        return to_info(view)

    def VerifyCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.VerifyCheckpointResponse:
        self._allow(context, "VerifyCheckpoint", request.namespace)
        result = self._call(
            context,
            "VerifyCheckpoint",
            lambda: self.catalog.verify(request.namespace, request.checkpoint_id),
        )
        return daemon_pb2.VerifyCheckpointResponse(
            ok=result.ok, verified_bytes=result.verified_bytes, corrupt_files=result.corrupt_files
        )

    def EnsureLocal(
        self, request: daemon_pb2.EnsureLocalRequest, context: Any
    ) -> common_pb2.FileEntry:
        ref = request.ref
        self._allow(context, "EnsureLocal", ref.namespace)
        f, path = self._call(
            context,
            "EnsureLocal",
            lambda: self.cluster.ensure_local(
                ref.namespace, ref.checkpoint_id, request.file_name, request.repair
            ),
        )
        return file_entry(f, path)

    def GetStatus(
        self, request: daemon_pb2.GetStatusRequest, context: Any
    ) -> daemon_pb2.NodeStatus:
        uid = self._caller(context, "GetStatus")
        s = self._call(context, "GetStatus", self.catalog.status)
        shown = self._visible(context, "GetStatus", uid, set(s.namespaces))
        return daemon_pb2.NodeStatus(
            node_id=s.node_id,
            failure_domain=s.failure_domain,
            memory_dir=s.memory_dir,
            budget_bytes=s.budget_bytes,
            used_bytes=s.used_bytes,
            reserved_bytes=s.reserved_bytes,
            pool_bytes=s.pool_bytes,
            checkpoints=s.checkpoints,
            namespaces=[ns for ns in s.namespaces if ns in shown],
            version=s.version,
        )


def add_daemon_service(
    catalog: Catalog,
    server: Any,
    cluster: Cluster | None = None,
    access: LocalAccess | None = None,
) -> DaemonService:
    """Register DaemonService for `catalog` on a grpc server (never the peer server).

    The handlers take raw bytes (no grpc deserializer) and decode them in `_decoding`.
    """
    servicer = DaemonService(catalog, cluster, access)
    service = daemon_pb2.DESCRIPTOR.services_by_name["DaemonService"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            _decoding(
                m.name,
                message_factory.GetMessageClass(m.input_type),
                getattr(servicer, m.name),
            ),
            response_serializer=_serialize,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
    return servicer


def _serialize(response: Message) -> bytes:
    return response.SerializeToString()


def _decoding(
    method: str, request_type: type[Message], behaviour: Callable[[Any, Any], Message]
) -> Callable[[bytes, Any], Message]:
    """A raw-bytes handler: parse the request (INVALID_ARGUMENT if it is not one), refuse
    oversized lists, then run the servicer method; an error that escapes it (outside
    `_call`) still gets its status and a bounded message, never UNKNOWN."""

    def handle(raw: bytes, context: Any) -> Message:
        try:
            request = request_type.FromString(raw)
        except Exception:
            metrics.MALFORMED_REQUESTS.labels(service="DaemonService").inc()
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: the request is not a valid {request_type.DESCRIPTOR.full_name} message",
            )
        files = getattr(request, "required_files", ())
        if len(files) > MAX_FILES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: {len(files):,} required files, at most {MAX_FILES:,} per checkpoint",
            )
        try:
            return behaviour(request, context)
        except TierckptError as e:
            if context.code() is not None:
                raise  # already aborted with its own status
            message = bounded(str(e))
            logger.info("%s refused: %s", method, message)
            context.abort(status_of(e), message)
        except Exception as e:
            if context.code() is not None:
                raise
            _internal(context, method, e)
        raise AssertionError("context.abort returned")  # pragma: no cover

    return handle
