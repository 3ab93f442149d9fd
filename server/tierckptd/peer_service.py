"""PeerService servicer: daemon <-> daemon on the peer listener (never the local socket).

Wire <-> domain translation only; every action lives in `peers.Cluster`. A domain error
becomes its gRPC status through the one table in `tierckpt.errors` (a corrupt copy is
DATA_LOSS, so a fetcher falls through to the next holder).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from tierckpt.checksum import BlockChecksums
from tierckpt.errors import CheckpointIncomplete, InvalidArgument, TierckptError, status_of
from tierckpt.v1 import common_pb2, peer_pb2

from tierckptd.chunk_wire import Chunk, register_peer_service
from tierckptd.peers import Cluster
from tierckptd.wire import to_info

__all__ = ["PeerService", "add_peer_service"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _abort(context: Any, method: str, e: BaseException) -> None:
    if isinstance(e, TierckptError):
        logger.info("peer %s refused: %s", method, e)
        context.abort(status_of(e), str(e))
    logger.error("peer %s failed", method, exc_info=e)
    context.abort(grpc.StatusCode.INTERNAL, f"{method} failed on the peer: {e!r}")


class PeerService:
    """The PeerService methods (registered by `chunk_wire.register_peer_service`)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.catalog = cluster.catalog

    @staticmethod
    def _call(context: Any, method: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as e:
            _abort(context, method, e)
        raise AssertionError("context.abort returned")  # pragma: no cover

    def Holdings(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> peer_pb2.HoldingsResponse:
        return self._call(
            context,
            "Holdings",
            lambda: self.cluster.holdings(request.namespace, request.checkpoint_id),
        )

    def PublishCheckpoint(
        self, request: common_pb2.CheckpointInfo, context: Any
    ) -> peer_pb2.PublishCheckpointResponse:
        def publish() -> None:
            if not self.cluster.published(request):
                raise CheckpointIncomplete(
                    f"{request.ref.namespace}/{request.ref.checkpoint_id} was deleted on node "
                    f"{self.cluster.node_id}; it does not take it back"
                )

        self._call(context, "PublishCheckpoint", publish)
        return peer_pb2.PublishCheckpointResponse()

    def PushFile(
        self, request_iterator: Iterator[Chunk], context: Any
    ) -> peer_pb2.PushFileResponse:
        def push() -> int:
            first = next(request_iterator, None)
            if first is None or first.header is None:
                raise InvalidArgument("PushFile: the first message must carry the header")
            header = first.header
            cs = header.file.checksums
            checksums = BlockChecksums(cs.block_size, cs.block_digests, cs.algorithm)
            if self.catalog.holdings(header.ref.namespace, header.ref.checkpoint_id)[0] is None:
                raise CheckpointIncomplete(
                    f"node {self.cluster.node_id} does not know "
                    f"{header.ref.namespace}/{header.ref.checkpoint_id}: publish it first"
                )
            return self.cluster.receive(
                header.ref.namespace,
                header.ref.checkpoint_id,
                header.file.name,
                request_iterator,
                checksums,
            )

        received = self._call(context, "PushFile", push)
        return peer_pb2.PushFileResponse(received_bytes=received)

    def FetchFile(
        self, request: peer_pb2.FetchFileRequest, context: Any
    ) -> Iterator[bytes | peer_pb2.FileChunk]:
        try:
            yield from self.cluster.serve_chunks(
                request.ref.namespace,
                request.ref.checkpoint_id,
                request.file_name,
                request.offset,
                request.length,
            )
        except Exception as e:
            _abort(context, "FetchFile", e)

    def UpdateReplicas(
        self, request: peer_pb2.UpdateReplicasRequest, context: Any
    ) -> peer_pb2.UpdateReplicasResponse:
        self._call(
            context,
            "UpdateReplicas",
            lambda: self.catalog.set_replicas(
                request.ref.namespace,
                request.ref.checkpoint_id,
                request.file_name,
                list(request.replica_nodes),
            ),
        )
        return peer_pb2.UpdateReplicasResponse()

    def ListManifests(
        self, request: peer_pb2.ListManifestsRequest, context: Any
    ) -> peer_pb2.ListManifestsResponse:
        views = self._call(
            context, "ListManifests", lambda: self.catalog.list_checkpoints(request.namespace)
        )
        return peer_pb2.ListManifestsResponse(checkpoints=[to_info(v) for v in views])


def add_peer_service(cluster: Cluster, server: Any) -> PeerService:
    servicer = PeerService(cluster)
    register_peer_service(servicer, server)
    return servicer
