"""Domain <-> protobuf translation shared by DaemonService and PeerService."""

from __future__ import annotations

from tierckpt.checksum import BlockChecksums
from tierckpt.names import check_file_name
from tierckpt.v1 import common_pb2

from tierckptd.model import CheckpointRecord, CheckpointView, FileRecord, State

__all__ = ["file_entry", "file_from_entry", "record_from_info", "ref", "to_info"]

_STATE = {
    "WRITING": common_pb2.WRITING,
    "COMMITTED": common_pb2.COMMITTED,
    "REPLICATED": common_pb2.REPLICATED,
    "ABORTED": common_pb2.ABORTED,
    "DURABLE": common_pb2.DURABLE,
}


def ref(namespace: str, checkpoint_id: str) -> common_pb2.CheckpointRef:
    return common_pb2.CheckpointRef(namespace=namespace, checkpoint_id=checkpoint_id)


def state_of(state: State | None) -> common_pb2.CheckpointState.ValueType:
    return _STATE[state.value] if state is not None else common_pb2.CHECKPOINT_STATE_UNSPECIFIED


def file_entry(f: FileRecord, local_path: str = "") -> common_pb2.FileEntry:
    cs = f.checksums
    return common_pb2.FileEntry(
        name=f.name,
        size=f.size,
        checksums=common_pb2.BlockChecksums(
            algorithm=cs.algorithm, block_size=cs.block_size, block_digests=cs.digests
        )
        if cs is not None
        else None,
        rank=f.rank,
        owner_node=f.owner_node,
        replica_nodes=f.replica_nodes,
        local_path=local_path,
    )


def file_from_entry(e: common_pb2.FileEntry) -> FileRecord:
    """A committed file as a peer describes it (`held` False: the copy is elsewhere)."""
    cs = e.checksums
    return FileRecord(
        name=check_file_name(e.name),
        rank=e.rank,
        size=e.size,
        checksums=BlockChecksums(cs.block_size, cs.block_digests, cs.algorithm),
        owner_node=e.owner_node,
        replica_nodes=list(e.replica_nodes),
        held=False,
    )


def to_info(view: CheckpointView) -> common_pb2.CheckpointInfo:
    """A catalog snapshot as the wire CheckpointInfo (with each file's local path)."""
    return common_pb2.CheckpointInfo(
        ref=ref(view.namespace, view.checkpoint_id),
        state=_STATE[view.state.value],
        size_bytes=view.size_bytes,
        file_count=len(view.files),
        created_unix=view.created_unix,
        committed_unix=view.committed_unix,
        sequence=view.sequence,
        files=[file_entry(f, view.local_paths[f.name]) for f in view.files],
        tiers=list(view.tiers),
        pinned=view.pinned,
    )


def record_from_info(info: common_pb2.CheckpointInfo) -> CheckpointRecord:
    """A published cluster manifest as a committed record (no file held yet)."""
    rec = CheckpointRecord(
        namespace=info.ref.namespace,
        checkpoint_id=info.ref.checkpoint_id,
        state=State.COMMITTED,
        created_unix=info.created_unix,
        node_id="",
        committed_unix=info.committed_unix,
        sequence=info.sequence,
        pinned=info.pinned,
    )
    for e in info.files:
        f = file_from_entry(e)
        rec.files[f.name] = f
    return rec
