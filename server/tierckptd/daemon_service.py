"""DaemonService servicer: wire <-> domain translation for the local control plane.

The only module (with health wiring) that sees protobuf types. Each RPC validates,
calls the catalog, and turns a domain error into `context.abort(code, message)` through
the one status table in `tierckpt.errors`, so the message that names the fix reaches the
training rank verbatim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from tierckpt.errors import TierckptError, status_of
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tierckptd.catalog import Catalog
from tierckptd.peers import Cluster
from tierckptd.wire import file_entry, to_info

__all__ = ["DaemonService", "add_daemon_service", "to_info"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DaemonService(daemon_pb2_grpc.DaemonServiceServicer):
    """Serves one node's catalog to its ranks and the CLI."""

    def __init__(self, catalog: Catalog, cluster: Cluster | None = None) -> None:
        self.catalog = catalog
        # Without peers the cluster only serves local copies (EnsureLocal of a held file).
        self.cluster = cluster or Cluster(catalog, channel_factory=grpc.insecure_channel)

    @staticmethod
    def _call(context: Any, method: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except TierckptError as e:
            logger.info("%s refused: %s", method, e)
            context.abort(status_of(e), str(e))
        except Exception as e:
            logger.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{method} failed on the daemon: {e!r}")
        raise AssertionError("context.abort returned")  # pragma: no cover

    def BeginCheckpoint(
        self, request: daemon_pb2.BeginCheckpointRequest, context: Any
    ) -> daemon_pb2.BeginCheckpointResponse:
        ref = request.ref
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
        self._call(
            context,
            "AbortCheckpoint",
            lambda: self.catalog.abort(request.namespace, request.checkpoint_id),
        )
        return daemon_pb2.AbortCheckpointResponse()

    def GetCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> common_pb2.CheckpointInfo:
        view = self._call(
            context,
            "GetCheckpoint",
            lambda: self.catalog.get(request.namespace, request.checkpoint_id),
        )
        return to_info(view)

    def ListCheckpoints(
        self, request: daemon_pb2.ListCheckpointsRequest, context: Any
    ) -> daemon_pb2.ListCheckpointsResponse:
        views = self._call(
            context,
            "ListCheckpoints",
            lambda: self.catalog.list_checkpoints(request.namespace, request.include_uncommitted),
        )
        return daemon_pb2.ListCheckpointsResponse(checkpoints=[to_info(v) for v in views])

    def DeleteCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.DeleteCheckpointResponse:
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
        view = self._call(
            context,
            "PinCheckpoint",
            lambda: self.catalog.set_pinned(ref.namespace, ref.checkpoint_id, request.pinned),
        )
        return to_info(view)

    def VerifyCheckpoint(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> daemon_pb2.VerifyCheckpointResponse:
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
        s = self._call(context, "GetStatus", self.catalog.status)
        return daemon_pb2.NodeStatus(
            node_id=s.node_id,
            failure_domain=s.failure_domain,
            memory_dir=s.memory_dir,
            budget_bytes=s.budget_bytes,
            used_bytes=s.used_bytes,
            reserved_bytes=s.reserved_bytes,
            pool_bytes=s.pool_bytes,
            checkpoints=s.checkpoints,
            namespaces=list(s.namespaces),
            version=s.version,
        )


def add_daemon_service(
    catalog: Catalog, server: Any, cluster: Cluster | None = None
) -> DaemonService:
    """Register DaemonService for `catalog` on a grpc server (never the peer server)."""
    servicer = DaemonService(catalog, cluster)
    daemon_pb2_grpc.add_DaemonServiceServicer_to_server(servicer, server)
    return servicer
