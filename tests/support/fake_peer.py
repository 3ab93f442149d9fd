"""A configured peer that is not a daemon: a PeerService servicer a test serves on its own
port to play a hostile or a scripted member, and `code_of` for the status of a call."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc


@dataclass
class FakePeer(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    """Accepts everything and keeps no copies. `holdings` are its Holdings answers by id;
    `served` the bytes its FetchFile answers by file name (whatever they are);
    `published` records what it was published; `marks` is what its ListManifests answers
    carry (`stated`: only in an answer for one namespace, the call a node confirms a
    relayed mark with); `asked` counts its ListManifests calls by namespace."""

    holdings: dict[str, list[common_pb2.FileEntry]] = field(default_factory=dict)
    published: list[common_pb2.CheckpointInfo] = field(default_factory=list)
    marks: list[peer_pb2.CheckpointMark] = field(default_factory=list)
    stated: list[peer_pb2.CheckpointMark] = field(default_factory=list)
    asked: dict[str, int] = field(default_factory=dict)
    served: dict[str, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Holdings(self, request: common_pb2.CheckpointRef, context: Any) -> Any:
        files = self.holdings.get(request.checkpoint_id, [])
        state = common_pb2.WRITING if files else common_pb2.CHECKPOINT_STATE_UNSPECIFIED
        return peer_pb2.HoldingsResponse(state=state, files=files)

    def PublishCheckpoint(self, request: common_pb2.CheckpointInfo, context: Any) -> Any:
        with self.lock:
            self.published.append(request)
        return peer_pb2.PublishCheckpointResponse()

    def ListManifests(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.asked[request.namespace] = self.asked.get(request.namespace, 0) + 1
            marks = list(self.marks) + (list(self.stated) if request.namespace else [])
        return peer_pb2.ListManifestsResponse(marks=marks)

    def UpdateReplicas(self, request: Any, context: Any) -> Any:
        return peer_pb2.UpdateReplicasResponse()

    def ApplyMark(self, request: Any, context: Any) -> Any:
        return peer_pb2.ApplyMarkResponse()

    def PushFile(self, request_iterator: Iterator[Any], context: Any) -> Any:
        # Takes no copies: the victim never lists a fake peer as a holder.
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this fake keeps no copies")

    def FetchFile(self, request: Any, context: Any) -> Any:
        data = self.served.get(request.file_name)
        entry = next(
            (e for held in self.holdings.values() for e in held if e.name == request.file_name),
            None,
        )
        if data is None or entry is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "this fake keeps no copies")
        yield peer_pb2.FileChunk(header=peer_pb2.FileHeader(ref=request.ref, file=entry))
        yield peer_pb2.FileChunk(offset=0, data=data)

    def times_asked(self, namespace: str = "") -> int:
        with self.lock:
            return self.asked.get(namespace, 0)


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status `call` ended with (a streaming answer is read to its end)."""
    try:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK
