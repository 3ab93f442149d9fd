"""Typed client of the local daemon's DaemonService.

The only client module that touches generated wire types: callers get the records of
`tierckpt.records` (re-exported here) and tierckpt exceptions (mapped from the gRPC
status by errors.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc

from tierckpt.checksum import BlockChecksums
from tierckpt.endpoint import open_channel, resolve_daemon_address
from tierckpt.errors import (
    DaemonTimeout,
    DaemonUnavailable,
    PermissionDenied,
    TierckptError,
    TierUnavailable,
    error_from_status,
    reason_in,
)
from tierckpt.freshness import from_wire
from tierckpt.names import FORMAT_DCP, check_format
from tierckpt.records import CheckpointInfo, FileEntry, NodeStatus, OpenedFile, PeerMarks
from tierckpt.trust import Trust, check_reason, parse_trust
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

__all__ = [
    "CheckpointInfo",
    "DaemonClient",
    "FileEntry",
    "NodeStatus",
    "OpenedFile",
    "PeerMarks",
    "status_from_wire",
]

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 60.0


def _ref(namespace: str, checkpoint_id: str) -> common_pb2.CheckpointRef:
    return common_pb2.CheckpointRef(namespace=namespace, checkpoint_id=checkpoint_id)


def _checksums_to_wire(c: BlockChecksums) -> common_pb2.BlockChecksums:
    return common_pb2.BlockChecksums(
        algorithm=c.algorithm, block_size=c.block_size, block_digests=c.digests
    )


def _file_from_wire(f: common_pb2.FileEntry) -> FileEntry:
    c = f.checksums
    return FileEntry(
        name=f.name,
        size=f.size,
        # A file still being written has no checksums yet.
        checksums=BlockChecksums(c.block_size, c.block_digests, c.algorithm)
        if c.algorithm
        else None,
        rank=f.rank,
        owner_node=f.owner_node,
        replica_nodes=tuple(f.replica_nodes),
        local_path=f.local_path,
    )


def _info_from_wire(info: common_pb2.CheckpointInfo) -> CheckpointInfo:
    return CheckpointInfo(
        namespace=info.ref.namespace,
        checkpoint_id=info.ref.checkpoint_id,
        state=common_pb2.CheckpointState.Name(info.state),
        size_bytes=info.size_bytes,
        file_count=info.file_count,
        created_unix=info.created_unix,
        committed_unix=info.committed_unix,
        sequence=info.sequence,
        tiers=tuple(info.tiers),
        pinned=info.pinned,
        files=tuple(_file_from_wire(f) for f in info.files),
        durable_requested=info.durable_requested,
        persistent_url=info.persistent_url,
        lost_files=tuple(info.lost_files),
        trust=_TRUST_FROM_WIRE.get(info.trust),
        trust_reason=info.trust_reason,
        checkpoint_format=info.format or FORMAT_DCP,
    )


_TRUST_TO_WIRE = {Trust.VERIFIED: common_pb2.TRUST_VERIFIED, Trust.BAD: common_pb2.TRUST_BAD}
_TRUST_FROM_WIRE = {w: t for t, w in _TRUST_TO_WIRE.items()}


def status_from_wire(s: daemon_pb2.NodeStatus) -> NodeStatus:
    """A GetStatus answer as the record the daemon built (`tierckptd.wire.node_status`
    puts it on the wire field by field name, as this reads it back)."""
    return NodeStatus(
        **{name: getattr(s, name) for name in NodeStatus.scalar_fields()},
        namespaces=tuple(s.namespaces),
        freshness=from_wire(s.freshness),
        peer_clocks={c.peer: c.ahead_seconds for c in s.peer_clocks},
    )


class DaemonClient:
    """Calls to one daemon. Picklable: the channel is opened lazily in each process."""

    def __init__(self, daemon: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = resolve_daemon_address(daemon)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: daemon_pb2_grpc.DaemonServiceStub | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["address"], timeout_s=state["timeout_s"])  # type: ignore[misc]

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None

    def _service(self) -> daemon_pb2_grpc.DaemonServiceStub:
        with self._lock:
            if self._stub is None:
                self._channel = open_channel(self.address)
                self._stub = daemon_pb2_grpc.DaemonServiceStub(self._channel)
            return self._stub

    def _call(self, method: Callable[..., T], request: Any) -> T:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            # The gRPC error stays as the cause (for tracebacks; pickling drops it).
            raise self._translate(e) from e

    def _translate(self, e: grpc.RpcError) -> TierckptError:
        code: grpc.StatusCode = e.code()
        details: str = e.details() or ""
        trailing = getattr(e, "trailing_metadata", None)
        error = error_from_status(code, details, reason_in(trailing() if trailing else None))
        if isinstance(error, TierUnavailable):
            # The daemon answered: a tier behind it (a peer, S3) is down, not the daemon.
            return error
        if code == grpc.StatusCode.UNAVAILABLE:
            return DaemonUnavailable(
                f"tierckptd is not reachable at {self.address} ({details}): start it "
                "(`tierckptd --config PATH` or `systemctl start tierckptd`) or point "
                "TIERCKPT_DAEMON / daemon= at the running one"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DaemonTimeout(
                f"tierckptd at {self.address} did not answer within {self.timeout_s:.0f} s"
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:  # local_isolation: no valid session
            return PermissionDenied(details)
        return error

    # --- save path -------------------------------------------------------------------
    def begin_checkpoint(
        self, namespace: str, checkpoint_id: str, rank: int, *, overwrite: bool = False
    ) -> str:
        """Start (or join) a save on this rank's daemon; returns the daemon's node id.
        `overwrite`: a committed id is replaced when this save commits (else
        CheckpointExists)."""
        req = daemon_pb2.BeginCheckpointRequest(
            ref=_ref(namespace, checkpoint_id), rank=rank, overwrite=overwrite
        )
        return str(self._call(self._service().BeginCheckpoint, req).node_id)

    def reserve_space(self, namespace: str, checkpoint_id: str, rank: int, nbytes: int) -> int:
        req = daemon_pb2.ReserveSpaceRequest(
            ref=_ref(namespace, checkpoint_id), rank=rank, bytes=nbytes
        )
        return int(self._call(self._service().ReserveSpace, req).reserved_bytes)

    def open_file(
        self, namespace: str, checkpoint_id: str, file_name: str, rank: int
    ) -> OpenedFile:
        req = daemon_pb2.OpenFileRequest(
            ref=_ref(namespace, checkpoint_id), file_name=file_name, rank=rank
        )
        resp = self._call(self._service().OpenFile, req)
        return OpenedFile(resp.path, resp.preallocated_bytes)

    def commit_file(
        self,
        namespace: str,
        checkpoint_id: str,
        file_name: str,
        rank: int,
        size: int,
        checksums: BlockChecksums,
    ) -> None:
        req = daemon_pb2.CommitFileRequest(
            ref=_ref(namespace, checkpoint_id),
            file_name=file_name,
            rank=rank,
            size=size,
            checksums=_checksums_to_wire(checksums),
        )
        self._call(self._service().CommitFile, req)

    def commit_checkpoint(
        self,
        namespace: str,
        checkpoint_id: str,
        required_files: Iterable[str],
        *,
        durable: bool = False,
        holder_nodes: Iterable[str] = (),
        checkpoint_format: str = FORMAT_DCP,
    ) -> CheckpointInfo:
        """Commit a save (the DCP coordinator). `durable`: drain this checkpoint to the
        persistent tier whatever `[persistent] every` says, and keep it in memory until it
        is durable (NoPersistentTier when the daemon has none). `holder_nodes`: the
        nodes the ranks wrote to (the daemon asks those first; empty: every peer).
        `checkpoint_format`: "dcp", or "files" for any other format (its files are held,
        drained and restored byte for byte, never decoded; `tierckpt.names.FORMATS`)."""
        req = daemon_pb2.CommitCheckpointRequest(
            ref=_ref(namespace, checkpoint_id),
            required_files=sorted(required_files),
            durable=durable,
            holder_nodes=sorted(set(holder_nodes)),
            format=check_format(checkpoint_format),
        )
        return _info_from_wire(self._call(self._service().CommitCheckpoint, req))

    def abort_checkpoint(self, namespace: str, checkpoint_id: str) -> None:
        self._call(self._service().AbortCheckpoint, _ref(namespace, checkpoint_id))

    # --- restore path and administration --------------------------------------------
    def get_checkpoint(
        self, namespace: str, checkpoint_id: str | None = None, *, verified: bool = False
    ) -> CheckpointInfo:
        """A committed checkpoint with its files; `None` asks for the newest (never one
        marked bad; `verified`: the newest marked verified, CheckpointNotFound if none)."""
        ref = common_pb2.CheckpointRef(
            namespace=namespace,
            checkpoint_id=checkpoint_id or "",
            newest_verified=verified and not checkpoint_id,
        )
        return _info_from_wire(self._call(self._service().GetCheckpoint, ref))

    def ensure_local(
        self, namespace: str, checkpoint_id: str, file_name: str, *, repair: bool = False
    ) -> FileEntry:
        """Have the daemon make a valid local copy of one file: restored from a peer or the
        persistent tier when this node lacks it, or replaced when `repair` says the local
        copy is corrupt. TierUnavailable when no copy could be had because a tier was
        down (retry later); CheckpointNotFound when no tier holds it; ChecksumMismatch
        only when every copy found was corrupt."""
        req = daemon_pb2.EnsureLocalRequest(
            ref=_ref(namespace, checkpoint_id), file_name=file_name, repair=repair
        )
        return _file_from_wire(self._call(self._service().EnsureLocal, req))

    def list_checkpoints(
        self, namespace: str, *, include_uncommitted: bool = False
    ) -> list[CheckpointInfo]:
        req = daemon_pb2.ListCheckpointsRequest(
            namespace=namespace, include_uncommitted=include_uncommitted
        )
        return [
            _info_from_wire(c) for c in self._call(self._service().ListCheckpoints, req).checkpoints
        ]

    def delete_checkpoint(self, namespace: str, checkpoint_id: str) -> int:
        """Delete a checkpoint from every node and the persistent tier (`tierckpt rm`);
        the bytes freed on this node."""
        return self.remove_checkpoint(namespace, checkpoint_id)[0]

    def remove_checkpoint(self, namespace: str, checkpoint_id: str) -> tuple[int, PeerMarks]:
        """`delete_checkpoint`, also returning what the peers did with the rm."""
        resp = self._call(self._service().DeleteCheckpoint, _ref(namespace, checkpoint_id))
        peers = PeerMarks(resp.peers_applied, tuple(resp.peers_pending), tuple(resp.peers_refused))
        return int(resp.freed_bytes), peers

    def pin_checkpoint(
        self, namespace: str, checkpoint_id: str, pinned: bool = True
    ) -> CheckpointInfo:
        """Exempt a checkpoint from retention on every node and in the persistent tier (or
        lift that with pinned=False)."""
        return self.pin_checkpoint_report(namespace, checkpoint_id, pinned)[0]

    def pin_checkpoint_report(
        self, namespace: str, checkpoint_id: str, pinned: bool = True
    ) -> tuple[CheckpointInfo, PeerMarks]:
        """`pin_checkpoint`, also returning what the peers did with the pin or unpin."""
        req = daemon_pb2.PinCheckpointRequest(ref=_ref(namespace, checkpoint_id), pinned=pinned)
        info = self._call(self._service().PinCheckpoint, req)
        peers = PeerMarks(
            info.mark_peers_applied, tuple(info.mark_peers_pending), tuple(info.mark_peers_refused)
        )
        return _info_from_wire(info), peers

    def mark_checkpoint(
        self, namespace: str, checkpoint_id: str, trust: Trust | str, *, reason: str = ""
    ) -> tuple[CheckpointInfo, PeerMarks]:
        """Mark a checkpoint verified or bad on every node (`tierckpt mark`); returns it
        as marked here and what the peers did with the mark."""
        req = daemon_pb2.PinCheckpointRequest(
            ref=_ref(namespace, checkpoint_id),
            trust=_TRUST_TO_WIRE[parse_trust(trust)],
            reason=check_reason(reason),
        )
        info = self._call(self._service().PinCheckpoint, req)
        peers = PeerMarks(
            info.mark_peers_applied, tuple(info.mark_peers_pending), tuple(info.mark_peers_refused)
        )
        return _info_from_wire(info), peers

    def set_namespace(self, namespace: str, *, persistent_url: str = "") -> str:
        """Make the namespace's next commits on this node drain to `persistent_url` ("":
        the daemon's `[persistent] url`); returns the URL as the daemon recorded it.

        Raises:
            PermissionDenied: the URL is not under the daemon's `[persistent] allowed_urls`
                (or, with local isolation, the namespace is another user's).
            InvalidName: the URL is malformed.
        """
        req = daemon_pb2.SetNamespaceRequest(namespace=namespace, persistent_url=persistent_url)
        return str(self._call(self._service().SetNamespace, req).persistent_url)

    def verify_checkpoint(self, namespace: str, checkpoint_id: str) -> tuple[bool, int, list[str]]:
        resp = self._call(self._service().VerifyCheckpoint, _ref(namespace, checkpoint_id))
        return resp.ok, int(resp.verified_bytes), list(resp.corrupt_files)

    def status(self) -> NodeStatus:
        return status_from_wire(
            self._call(self._service().GetStatus, daemon_pb2.GetStatusRequest())
        )
