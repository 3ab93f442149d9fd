"""DaemonService servicer: wire <-> domain translation for the local control plane.

Protobuf stops at `rpc/`, `wire.py` and the peer wire modules (`peers/client.py`,
`peers/chunk_wire.py`); the catalog and the tiers see domain records only. Each RPC
validates, calls the catalog (or the restorer, for EnsureLocal), and a domain error
becomes `context.abort(code, message)` through `rpc.errors` (the one status table in
`tierckpt.errors`), so the message that names the fix reaches the training rank verbatim.

Requests are decoded here, not by grpc: grpcio leaks 15-19 KB for every request its
deserializer rejects, so a flood of malformed messages would grow the daemon without
bound. A request that does not parse is INVALID_ARGUMENT (counted in
`tierckpt_malformed_requests`). Every status message and log line is bounded, and an
unexpected error answers INTERNAL with a fixed message: no repr, traceback or path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from tierckpt.errors import CheckpointNotFound, PermissionDenied, TierUnavailable
from tierckpt.names import (
    check_checkpoint_id,
    check_format,
    check_namespace,
    check_new_checkpoint_id,
)
from tierckpt.trust import Trust as TrustState
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tierckptd.catalog import MAX_FILES, Catalog
from tierckptd.catalog.views import freshness
from tierckptd.commit import CommitCoordinator
from tierckptd.model import CheckpointView, FileRecord
from tierckptd.ops import metrics
from tierckptd.rpc.errors import MAX_DETAILS, StatusTranslator, bounded, rpc_method
from tierckptd.rpc.local_access import LocalAccess
from tierckptd.wire import TRUST_FROM_WIRE, file_entry, node_status, to_info

__all__ = ["MAX_DETAILS", "DaemonService", "add_daemon_service", "bounded", "to_info"]

SERVICE = "tierckpt.v1.DaemonService"


class Discovery(Protocol):
    """Checkpoints another cluster drained into the persistent tier, learnt when asked
    for (`tierckptd.persistent.listing.Discovery`, wired by main.py)."""

    def probe(self, namespace: str, checkpoint_id: str) -> bool: ...

    def refresh(self, namespace: str = "", max_age: float | None = None) -> int: ...


class Delivery(Protocol):
    """What the peers did with a cluster mark (`peers.operations.Delivery`)."""

    @property
    def applied(self) -> tuple[str, ...]: ...

    @property
    def pending(self) -> tuple[str, ...]: ...

    @property
    def refused(self) -> tuple[str, ...]: ...


class ClusterMarks(Protocol):
    """`tierckpt rm` and `pin` on every node (`peers.cluster.Cluster`): cluster marks
    carry them, so they go through the peer tier even on a node without peers."""

    def remove(
        self, namespace: str, checkpoint_id: str, uid: int | None = None
    ) -> tuple[int, Delivery]: ...

    def pin(
        self, namespace: str, checkpoint_id: str, pinned: bool, uid: int | None = None
    ) -> tuple[CheckpointView, Delivery]: ...

    def trust(
        self,
        namespace: str,
        checkpoint_id: str,
        trust: TrustState,
        reason: str = "",
        uid: int | None = None,
    ) -> tuple[CheckpointView, Delivery]: ...


class LocalCopy(Protocol):
    """EnsureLocal's one restore chain (`restore.Restorer`)."""

    def ensure_local(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        repair: bool = False,
        *,
        timed: bool = False,
    ) -> tuple[FileRecord, str]: ...


PersistentUrls = Callable[[str], str]
"""`tierckptd.persistent.roots.Roots.check`: a namespace URL as the daemon records it
("" for `[persistent] url`); PermissionDenied when `[persistent] allowed_urls` excludes it."""


def _internal_message(method: str) -> str:
    return f"{method} failed on the daemon with an internal error; the daemon log has the details"


class DaemonService(daemon_pb2_grpc.DaemonServiceServicer):
    """Serves one node's catalog to its ranks and the CLI."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        commits: CommitCoordinator,
        marks: ClusterMarks,
        restorer: LocalCopy,
        access: LocalAccess | None = None,
        discovery: Discovery | None = None,
        persistent_urls: PersistentUrls | None = None,
    ) -> None:
        self.catalog = catalog
        self.commits = commits  # CommitCheckpoint: holders, catalog, listeners
        self.marks = marks  # DeleteCheckpoint, PinCheckpoint: cluster marks
        self.restorer = restorer  # EnsureLocal: memory, peers, persistent tier
        self.persistent_urls = persistent_urls  # SetNamespace's policy; None: no tier
        self.discovery = discovery  # the persistent tier as a live source (C)
        self.access = access  # [security] local_isolation = "uid"; None: every caller trusted
        self.errors = StatusTranslator(_internal_message)

    def _caller(self, context: Any, method: str) -> int | None:
        """With local_isolation, the uid behind the call's session (else UNAUTHENTICATED)."""
        access = self.access
        if access is None:
            return None
        return access.caller(context.invocation_metadata(), method)

    def _allow(
        self, context: Any, method: str, namespace: str, *, begin: bool = False
    ) -> int | None:
        """With local_isolation, abort unless the caller's uid may act on `namespace`
        (PERMISSION_DENIED for another uid's); the caller's uid when it is a tenant (no
        operator), which cluster marks carry so peers check it too; else None."""
        access, uid = self.access, self._caller(context, method)
        if access is None or uid is None:
            return None
        access.authorize(uid, namespace, method, begin=begin)
        return None if uid in access.operators else uid

    def _visible(self, context: Any, method: str, uid: int | None, names: set[str]) -> set[str]:
        """The namespaces `uid` may see in lists (all of them without local_isolation)."""
        access = self.access
        if access is None or uid is None:
            return names
        return access.visible(uid, names)

    @rpc_method
    def BeginCheckpoint(
        self, request: daemon_pb2.BeginCheckpointRequest, context: Any
    ) -> daemon_pb2.BeginCheckpointResponse:
        ref = request.ref
        self._allow(context, "BeginCheckpoint", ref.namespace, begin=True)
        check_new_checkpoint_id(ref.checkpoint_id)  # a new id: `latest` is taken by URLs
        self.catalog.begin(
            ref.namespace, ref.checkpoint_id, request.rank, overwrite=request.overwrite
        )
        return daemon_pb2.BeginCheckpointResponse(node_id=self.catalog.node_id)

    @rpc_method
    def SetNamespace(
        self, request: daemon_pb2.SetNamespaceRequest, context: Any
    ) -> daemon_pb2.SetNamespaceResponse:
        namespace = check_namespace(request.namespace)
        tenant = self._allow(context, "SetNamespace", namespace, begin=True)
        if self.persistent_urls is not None:
            recorded = self.persistent_urls(request.persistent_url)  # validates, normalizes
            if tenant is not None and self.access is not None:  # a tenant's own prefix only
                self.access.check_url(tenant, namespace, recorded)
        elif request.persistent_url:
            raise PermissionDenied(
                f"cannot set the persistent URL of {namespace}: this daemon has no persistent "
                "tier; an operator sets [persistent] url or allowed_urls in its config"
            )
        else:
            recorded = ""
        self.catalog.durability.set_persistent_url(namespace, recorded)
        return daemon_pb2.SetNamespaceResponse(persistent_url=recorded)

    @rpc_method
    def ReserveSpace(
        self, request: daemon_pb2.ReserveSpaceRequest, context: Any
    ) -> daemon_pb2.ReserveSpaceResponse:
        ref = request.ref
        self._allow(context, "ReserveSpace", ref.namespace)
        total = self.catalog.reserve(ref.namespace, ref.checkpoint_id, request.rank, request.bytes)
        return daemon_pb2.ReserveSpaceResponse(reserved_bytes=total)

    @rpc_method
    def OpenFile(
        self, request: daemon_pb2.OpenFileRequest, context: Any
    ) -> daemon_pb2.OpenFileResponse:
        ref = request.ref
        self._allow(context, "OpenFile", ref.namespace)
        path, prealloc = self.catalog.open_file(
            ref.namespace, ref.checkpoint_id, request.file_name, request.rank
        )
        return daemon_pb2.OpenFileResponse(path=path, preallocated_bytes=prealloc)

    @rpc_method
    def CommitFile(
        self, request: daemon_pb2.CommitFileRequest, context: Any
    ) -> daemon_pb2.CommitFileResponse:
        ref, cs = request.ref, request.checksums
        self._allow(context, "CommitFile", ref.namespace)
        self.catalog.commit_file(
            ref.namespace,
            ref.checkpoint_id,
            request.file_name,
            request.rank,
            request.size,
            algorithm=cs.algorithm,
            block_size=cs.block_size,
            digests=cs.block_digests,
        )
        return daemon_pb2.CommitFileResponse()

    @rpc_method
    def CommitCheckpoint(
        self, request: daemon_pb2.CommitCheckpointRequest, context: Any
    ) -> common_pb2.CheckpointInfo:
        ref = request.ref
        self._allow(context, "CommitCheckpoint", ref.namespace)
        with metrics.COMMIT_DURATION.time():
            view = self.commits.commit(
                ref.namespace,
                ref.checkpoint_id,
                list(request.required_files),
                durable=request.durable,
                checkpoint_format=check_format(request.format),
                # A hint: only names of configured peers count (the commit filters).
                holders=list(request.holder_nodes[:MAX_FILES]),
            )
        return to_info(view)

    @rpc_method
    def AbortCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.AbortCheckpointResponse:
        self._allow(context, "AbortCheckpoint", request.namespace)
        self.catalog.abort(request.namespace, request.checkpoint_id)
        return daemon_pb2.AbortCheckpointResponse()

    @rpc_method
    def GetCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> common_pb2.CheckpointInfo:
        self._allow(context, "GetCheckpoint", request.namespace)
        ns, cid = request.namespace, request.checkpoint_id
        verified = request.newest_verified and not cid
        if self.discovery is not None and not cid:
            self.discovery.refresh(ns)  # "the newest": maybe one another cluster drained
        try:
            view = self.catalog.get(ns, cid, verified=verified)
        except CheckpointNotFound:
            if self.discovery is None or not cid or not self.discovery.probe(ns, cid):
                raise
            view = self.catalog.get(ns, cid)
        return to_info(view)

    @rpc_method
    def ListCheckpoints(
        self, request: daemon_pb2.ListCheckpointsRequest, context: Any
    ) -> daemon_pb2.ListCheckpointsResponse:
        uid = self._caller(context, "ListCheckpoints")
        if request.namespace:
            self._allow(context, "ListCheckpoints", request.namespace)
        if self.discovery is not None:
            self.discovery.refresh(request.namespace)
        views = self.catalog.list_checkpoints(request.namespace, request.include_uncommitted)
        shown = self._visible(context, "ListCheckpoints", uid, {v.namespace for v in views})
        views = [v for v in views if v.namespace in shown]
        return daemon_pb2.ListCheckpointsResponse(checkpoints=[to_info(v) for v in views])

    @rpc_method
    def DeleteCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.DeleteCheckpointResponse:
        tenant = self._allow(context, "DeleteCheckpoint", request.namespace)
        ns, cid = check_namespace(request.namespace), check_checkpoint_id(request.checkpoint_id)
        unreachable = self._probe(ns, cid)
        try:
            freed, peers = self.marks.remove(ns, cid, tenant)
        except CheckpointNotFound:
            if unreachable is not None:
                raise unreachable from None  # it may be there: say why it was not asked
            raise
        return daemon_pb2.DeleteCheckpointResponse(
            freed_bytes=freed,
            peers_applied=len(peers.applied),
            peers_pending=peers.pending,
            peers_refused=peers.refused,
        )

    def _probe(self, namespace: str, checkpoint_id: str) -> TierUnavailable | None:
        """Before a cluster rm or pin of a checkpoint this node does not know: learn it
        if only the persistent tier has it (drained before a restart, or by another
        cluster); the tier's outage, if it could not be asked."""
        if self.discovery is None or self.catalog.knows(namespace, checkpoint_id):
            return None
        try:
            self.discovery.probe(namespace, checkpoint_id)
        except TierUnavailable as e:
            return e
        return None

    @rpc_method
    def PinCheckpoint(
        self, request: daemon_pb2.PinCheckpointRequest, context: Any
    ) -> common_pb2.CheckpointInfo:
        ref = request.ref
        tenant = self._allow(context, "PinCheckpoint", ref.namespace)
        ns, cid = check_namespace(ref.namespace), check_checkpoint_id(ref.checkpoint_id)
        unreachable = self._probe(ns, cid)
        trust = TRUST_FROM_WIRE.get(request.trust)
        try:
            if trust is not None:
                view, peers = self.marks.trust(ns, cid, trust, request.reason, tenant)
            else:
                view, peers = self.marks.pin(ns, cid, request.pinned, tenant)
        except CheckpointNotFound:
            if unreachable is not None:
                raise unreachable from None
            raise
        info = to_info(view)
        info.mark_peers_applied = len(peers.applied)
        info.mark_peers_pending.extend(peers.pending)
        info.mark_peers_refused.extend(peers.refused)
        return info

    @rpc_method
    def VerifyCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.VerifyCheckpointResponse:
        self._allow(context, "VerifyCheckpoint", request.namespace)
        result = self.catalog.verify(request.namespace, request.checkpoint_id)
        return daemon_pb2.VerifyCheckpointResponse(
            ok=result.ok, verified_bytes=result.verified_bytes, corrupt_files=result.corrupt_files
        )

    @rpc_method
    def EnsureLocal(
        self, request: daemon_pb2.EnsureLocalRequest, context: Any
    ) -> common_pb2.FileEntry:
        ref = request.ref
        self._allow(context, "EnsureLocal", ref.namespace)
        f, path = self.restorer.ensure_local(
            ref.namespace, ref.checkpoint_id, request.file_name, request.repair, timed=True
        )
        return file_entry(f, path)

    @rpc_method
    def GetStatus(
        self, request: daemon_pb2.GetStatusRequest, context: Any
    ) -> daemon_pb2.NodeStatus:
        uid = self._caller(context, "GetStatus")
        s = self.catalog.status()
        shown = self._visible(context, "GetStatus", uid, set(s.namespaces))
        fresh = freshness(v for v in self.catalog.list_checkpoints() if v.namespace in shown)
        namespaces = tuple(ns for ns in s.namespaces if ns in shown)
        return node_status(dataclasses.replace(s, namespaces=namespaces, freshness=fresh))


def add_daemon_service(servicer: DaemonService, server: Any) -> DaemonService:
    """Register DaemonService on a grpc server (never the peer server).

    The handlers take raw bytes (no grpc deserializer) and decode them in `_decoding`.
    """
    service = daemon_pb2.DESCRIPTOR.services_by_name["DaemonService"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            _decoding(
                m.name,
                message_factory.GetMessageClass(m.input_type),
                getattr(servicer, m.name),
                servicer.errors,
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
    method: str,
    request_type: type[Message],
    behaviour: Callable[[Any, Any], Message],
    errors: StatusTranslator,
) -> Callable[[bytes, Any], Message]:
    """A raw-bytes handler: parse the request (INVALID_ARGUMENT if it is not one), refuse
    oversized lists, then run the servicer method; an error that escapes it (a method
    without `@rpc_method`) still gets its status and a bounded message, never UNKNOWN."""

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
        return errors.call(context, method, lambda: behaviour(request, context))

    return handle
