"""Domain <-> protobuf translation shared by DaemonService and PeerService.

Everything a peer sends enters the daemon through `record_from_info`, `file_from_entry`
or `check_node_id`, which validate every name and bound every number before anything is
built from it (DESIGN.md invariant 9): names follow `tierckpt.names` (so none can leave
its directory), sequences fit a signed 64-bit integer, timestamps are finite and not
negative (a time ahead of this node's clock is taken, then clamped and reported as skew
by the catalog: time orders nothing), sizes, file counts, replica lists and digest bytes
are bounded, and the block size has a floor so a manifest cannot grow without data
behind it. A violation is `InvalidArgument` (INVALID_ARGUMENT on the wire), its message
bounded whatever the input.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from tierckpt.checksum import ALGORITHM, DIGEST_SIZE, BlockChecksums
from tierckpt.errors import InvalidArgument, InvalidName
from tierckpt.freshness import TIERS
from tierckpt.names import (
    check_checkpoint_id,
    check_file_name,
    check_format,
    check_namespace,
    check_persistent_url,
)
from tierckpt.records import NodeStatus
from tierckpt.trust import Trust as TrustState
from tierckpt.v1 import common_pb2, daemon_pb2

from tierckptd.model import (
    CLOCK_SKEW,
    MAX_BLOCK_SIZE,
    MAX_FILE_SIZE,
    MAX_FILES,
    MAX_NAMESPACE_KEEP_LAST,
    MAX_REPLICAS,
    MAX_SEQUENCE,
    MIN_BLOCK_SIZE,
    CheckpointRecord,
    CheckpointView,
    FileRecord,
    State,
)

__all__ = [
    "CLOCK_SKEW",
    "MAX_BLOCK_SIZE",
    "MAX_FILES",
    "MAX_FILE_SIZE",
    "MAX_REPLICAS",
    "MAX_SEQUENCE",
    "MIN_BLOCK_SIZE",
    "TRUST_FROM_WIRE",
    "bounded",
    "check_node_id",
    "check_ref",
    "file_entry",
    "file_from_entry",
    "node_status",
    "record_from_info",
    "ref",
    "to_info",
]


_STATE = {
    "WRITING": common_pb2.WRITING,
    "COMMITTED": common_pb2.COMMITTED,
    "REPLICATED": common_pb2.REPLICATED,
    "ABORTED": common_pb2.ABORTED,
    "DURABLE": common_pb2.DURABLE,
    "LOST": common_pb2.LOST,
}
TRUST_FROM_WIRE = {
    common_pb2.TRUST_VERIFIED: TrustState.VERIFIED,
    common_pb2.TRUST_BAD: TrustState.BAD,
}
"""A PinCheckpointRequest's trust (TRUST_UNSPECIFIED: none, a pin or unpin)."""
_TRUST_TO_WIRE = {t: w for w, t in TRUST_FROM_WIRE.items()}


def bounded(text: str, limit: int = 512) -> str:
    """`text` cut to `limit` characters (error details and log lines never echo more)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _short(value: object) -> str:
    return repr(value)[:64]


def ref(namespace: str, checkpoint_id: str) -> common_pb2.CheckpointRef:
    return common_pb2.CheckpointRef(namespace=namespace, checkpoint_id=checkpoint_id)


def check_ref(r: common_pb2.CheckpointRef) -> tuple[str, str]:
    """(namespace, checkpoint id) of a peer's CheckpointRef, both validated."""
    return check_namespace(r.namespace), check_checkpoint_id(r.checkpoint_id)


def _format(value: str, what: str) -> str:
    """A manifest's checkpoint format, validated (InvalidArgument)."""
    try:
        return check_format(value)
    except InvalidName as e:
        raise InvalidArgument(f"{what}: {e}") from None


def check_node_id(value: object, what: str = "node id") -> str:
    """A node id from a peer: the charset of names (ids are compared, logged, hashed)."""
    try:
        return check_namespace(value)
    except InvalidName:
        raise InvalidName(
            f"invalid {what} {_short(value)}: use 1-128 characters from [A-Za-z0-9._-]"
        ) from None


def _check_nodes(nodes: Iterable[str], what: str) -> list[str]:
    out = list(dict.fromkeys(nodes))
    if len(out) > MAX_REPLICAS:
        raise InvalidArgument(f"{what}: {len(out):,} replica nodes, at most {MAX_REPLICAS}")
    return [check_node_id(n, f"replica node of {what}") for n in out]


def check_time(value: float, what: str, now: Callable[[], float] = time.time) -> float:
    """A peer's unix timestamp: finite and not negative. One ahead of `now` is taken (a
    node whose clock is ahead must still replicate, audit 3 H6): the catalog clamps it to
    its own clock and reports the skew; order follows the sequence, never time."""
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{what} {value!r} is not a time (finite, not negative)")
    return value


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


def node_status(s: NodeStatus) -> daemon_pb2.NodeStatus:
    """GetStatus's answer: `s` as given (the caller narrowed its namespaces and freshness
    to what the asker may see). Fields go by name, as the client reads them back."""
    scalars: dict[str, Any] = {name: getattr(s, name) for name in NodeStatus.scalar_fields()}
    return daemon_pb2.NodeStatus(
        **scalars,
        namespaces=s.namespaces,
        peer_clocks=[
            daemon_pb2.PeerClock(peer=peer, ahead_seconds=ahead)
            for peer, ahead in sorted(s.peer_clocks.items())
        ],
        freshness=[
            daemon_pb2.NamespaceFreshness(
                namespace=ns, **{f"{tier}_unix": tiers.get(tier, 0.0) for tier in TIERS}
            )
            for ns, tiers in sorted(s.freshness.items())
        ],
    )


def check_checksums(cs: common_pb2.BlockChecksums, size: int, what: str) -> BlockChecksums:
    """A peer's block checksums of a `size`-byte file, every field checked."""
    if cs.algorithm != ALGORITHM:
        raise InvalidArgument(
            f"{what}: checksum algorithm {_short(cs.algorithm)} is not supported; use {ALGORITHM!r}"
        )
    if not MIN_BLOCK_SIZE <= cs.block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgument(
            f"{what}: block_size {cs.block_size} outside {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}"
        )
    checksums = BlockChecksums(cs.block_size, b"", ALGORITHM)
    want = checksums.expected_blocks(size) * DIGEST_SIZE
    if len(cs.block_digests) != want:
        raise InvalidArgument(
            f"{what}: {len(cs.block_digests):,} digest bytes, but {size:,} bytes in blocks of "
            f"{cs.block_size} need {want:,}"
        )
    return BlockChecksums(cs.block_size, cs.block_digests, ALGORITHM)


def file_from_entry(e: common_pb2.FileEntry) -> FileRecord:
    """A committed file as a peer describes it (`held` False: the copy is elsewhere),
    every field validated (InvalidArgument)."""
    name = check_file_name(e.name)
    if e.size > MAX_FILE_SIZE:
        raise InvalidArgument(f"file {name}: size {e.size} is larger than {MAX_FILE_SIZE}")
    if e.rank < 0:
        raise InvalidArgument(f"file {name}: rank {e.rank} is negative")
    if not e.HasField("checksums"):
        raise InvalidArgument(f"file {name}: no block checksums")
    return FileRecord(
        name=name,
        rank=e.rank,
        size=e.size,
        checksums=check_checksums(e.checksums, e.size, f"file {name}"),
        owner_node=check_node_id(e.owner_node, f"owner of {name}") if e.owner_node else "",
        replica_nodes=_check_nodes(e.replica_nodes, f"file {name}"),
        held=False,
    )


def to_info(view: CheckpointView, *, local_paths: bool = True) -> common_pb2.CheckpointInfo:
    """A catalog snapshot as the wire CheckpointInfo; with each file's local path for a
    local client, without (`local_paths=False`) for a peer: paths of this node are none
    of its business."""
    return common_pb2.CheckpointInfo(
        ref=ref(view.namespace, view.checkpoint_id),
        state=_STATE[view.state.value],
        size_bytes=view.size_bytes,
        file_count=len(view.files),
        created_unix=view.created_unix,
        committed_unix=view.committed_unix,
        sequence=view.sequence,
        files=[file_entry(f, view.local_paths[f.name] if local_paths else "") for f in view.files],
        tiers=list(view.tiers),
        pinned=view.pinned,
        durable_requested=view.durable_requested,
        persistent_url=view.persistent_url,
        memory_keep_last=view.memory_keep_last,
        format=view.checkpoint_format,
        lost_files=list(view.lost_files),
        owner_uid=view.owner_uid,
        owner_claim_node=view.owner_claim_node,
        trust=_TRUST_TO_WIRE.get(view.trust, common_pb2.TRUST_UNSPECIFIED)
        if view.trust is not None
        else common_pb2.TRUST_UNSPECIFIED,
        trust_reason=view.trust_reason,
    )


def record_from_info(
    info: common_pb2.CheckpointInfo, now: Callable[[], float] = time.time
) -> CheckpointRecord:
    """A published cluster manifest as a committed record (no file held yet), validated
    field by field (InvalidArgument). A peer's pin is not taken over: pinned records are
    exempt from retention, so only this node's operator pins here; nor is its state or
    `lost_files` (LOST is each node's own finding, `peers.healer`)."""
    namespace, checkpoint_id = check_ref(info.ref)
    what = f"manifest of {namespace}/{checkpoint_id}"
    if info.sequence > MAX_SEQUENCE:
        raise InvalidArgument(f"{what}: sequence {info.sequence} is larger than {MAX_SEQUENCE}")
    if len(info.files) > MAX_FILES:
        raise InvalidArgument(f"{what}: {len(info.files):,} files, at most {MAX_FILES:,}")
    if info.memory_keep_last > MAX_NAMESPACE_KEEP_LAST:
        raise InvalidArgument(
            f"{what}: memory_keep_last {info.memory_keep_last} is larger than "
            f"{MAX_NAMESPACE_KEEP_LAST}"
        )
    rec = CheckpointRecord(
        namespace=namespace,
        checkpoint_id=checkpoint_id,
        state=State.COMMITTED,
        created_unix=check_time(info.created_unix, f"{what}: created_unix", now),
        node_id="",
        committed_unix=check_time(info.committed_unix, f"{what}: committed_unix", now),
        sequence=info.sequence,
        pinned=False,  # a pin is this node's operator's decision, never a peer's
        # The coordinator's durable hint: this node drains its own files of it too.
        durable_requested=info.durable_requested,
        # Syntax here; whether this node may drain there is the drain's check
        # (`tierckptd.persistent.roots`), against its own `[persistent] allowed_urls`.
        persistent_url=check_persistent_url(info.persistent_url),
        memory_keep_last=info.memory_keep_last,
        checkpoint_format=_format(info.format, what),
    )
    if info.HasField("owner_uid"):  # the namespace's owner where it was saved (isolation)
        if info.owner_uid >= 0xFFFFFFFF:
            raise InvalidArgument(f"{what}: owner_uid {info.owner_uid} is not a uid")
        rec.owner_uid = info.owner_uid
        rec.owner_claim_node = (
            check_node_id(info.owner_claim_node, f"{what}: owner_claim_node")
            if info.owner_claim_node
            else ""
        )
    total = 0
    for e in info.files:
        f = file_from_entry(e)
        if f.name in rec.files:
            raise InvalidArgument(f"{what}: file {f.name} is listed twice")
        total += f.size
        rec.files[f.name] = f
    if total > MAX_FILE_SIZE:
        raise InvalidArgument(f"{what}: {total:,} bytes in all, more than {MAX_FILE_SIZE:,}")
    return rec
