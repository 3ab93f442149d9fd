"""What a client sees of a checkpoint: a pure function of its record and annotations.

The derived states live here: a COMMITTED record is shown REPLICATED when every file has
`replica_target` extra copies and the healer has no label on it, DURABLE when its
`.metadata` is in the persistent tier, and LOST when the healer found a file with no copy
left anywhere and the persistent tier does not hold it (DURABLE wins: it is restorable);
`tiers` says where its bytes can be had.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from tierckpt.errors import CHECKPOINT_LOST_PREFIX, CheckpointLost
from tierckpt.freshness import Freshness, newest_by_tier

from tierckptd.model import CheckpointRecord, CheckpointView, FileRecord, State

__all__ = [
    "LOST",
    "UNDER",
    "Health",
    "all_lost",
    "found",
    "freshness",
    "is_lost",
    "listing",
    "view_of",
]

LOST = "lost"
UNDER = "under-replicated"


def listing(names: list[str], shown: int = 5) -> str:
    """Names for a message, bounded: "a, b, c and 199,997 more" (each cut to 64 chars)."""
    head = ", ".join(n[:64] for n in names[:shown]) or "none"
    return head + (f" and {len(names) - shown:,} more" if len(names) > shown else "")


class Health(NamedTuple):
    """The healer's last finding on a checkpoint: its label ("lost", "under-replicated")
    and, when lost, the files no node holds."""

    label: str
    lost: tuple[str, ...] = ()


def is_lost(health: Health | None, durable: bool) -> bool:
    """Whether a committed checkpoint is shown LOST: the healer found a file with no
    copy on any node, and the persistent tier does not hold the checkpoint."""
    return health is not None and health.label == LOST and bool(health.lost) and not durable


def found(health: Health | None, name: str) -> Health | None:
    """`health` once this node holds a verified copy of `name` again: not lost any more
    (under-replicated until the next heal says more)."""
    if health is None or name not in health.lost:
        return health
    lost = tuple(n for n in health.lost if n != name)
    return Health(health.label, lost) if lost else Health(UNDER)


def all_lost(namespace: str, node_id: str, lost: Sequence[CheckpointRecord]) -> CheckpointLost:
    """The answer to "the newest checkpoint of `namespace`" when every committed one is
    LOST (`lost`): none can be loaded, which is not "there is none"."""
    ids = [r.checkpoint_id for r in sorted(lost, key=lambda r: r.order, reverse=True)]
    shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
    return CheckpointLost(
        f"{CHECKPOINT_LOST_PREFIX}no complete checkpoint of {namespace} on node {node_id}: "
        f"every committed one is LOST (a file of each has no copy on any tier): {shown}"
    )


# The tier tag of a checkpoint whose coordinator does not write its namespace on this
# node: listed and loadable by id, never the newest (`tierckpt ls`, the SageMaker reader).
FOREIGN_TAG = "foreign"


def view_of(
    rec: CheckpointRecord,
    *,
    node_id: str,
    replica_target: int = 0,
    label: str = "",
    lost: Sequence[str] = (),
    durable: bool = False,
    drain_failed: bool = False,
    paths: Mapping[str, str] | None = None,
    foreign: bool = False,
) -> CheckpointView:
    """An immutable view of `rec` (copied: it may leave the catalog lock).

    `label` is the healer's finding ("under-replicated", "lost") and `lost` the files no
    node holds (with "lost"), `durable` whether the persistent tier holds it,
    `drain_failed` whether the drain gave up on it, and `paths` the local path of each
    file this node holds (a held file missing from it, and every file not held, gets "").
    `foreign`: its coordinator does not write the namespace here (`model.Trust`): shown
    as the tier tag FOREIGN_TAG, never restored as the newest.
    """
    paths = paths or {}
    files = tuple(
        dataclasses.replace(f, replica_nodes=list(f.replica_nodes))
        for f in sorted(rec.files.values(), key=lambda f: f.name)
    )
    committed = rec.state is State.COMMITTED
    durable = committed and durable
    state = rec.state

    def copies(f: FileRecord) -> int:
        """The copies its record names, this node only when it holds one: what this
        node knows of its own disk beats any replica list (one adopted from a peer, or
        merged from gossip, may name it for a copy it lost when it came back empty)."""
        named = {f.owner_node, *f.replica_nodes} - {""}
        if not f.held:
            named.discard(node_id)
        return len(named)

    if (
        committed
        and replica_target > 0
        and not label
        and files
        and all(copies(f) >= replica_target + 1 for f in files)
    ):
        state = State.REPLICATED
    lost_files: tuple[str, ...] = ()
    if committed and is_lost(Health(label, tuple(lost)), durable):
        state, lost_files = State.LOST, tuple(sorted(lost))
    if durable:
        state = State.DURABLE
    tiers: list[str] = []
    if committed:
        if all(f.held for f in files):
            tiers.append("memory")
        if any(
            (f.owner_node and f.owner_node != node_id and not f.held)
            or set(f.replica_nodes) - {node_id}
            for f in files
        ):
            tiers.append("peer")
        if durable:
            tiers.append("persistent")
        if label and not (durable and label == LOST):  # durable: the persistent tier has it
            tiers.append(label)
        if drain_failed:
            tiers.append("drain-failed")
        if foreign:
            tiers.append(FOREIGN_TAG)
    return CheckpointView(
        namespace=rec.namespace,
        checkpoint_id=rec.checkpoint_id,
        state=state,
        size_bytes=rec.committed_bytes,
        created_unix=rec.created_unix,
        committed_unix=rec.committed_unix,
        sequence=rec.sequence,
        pinned=rec.pinned,
        files=files,
        local_paths={f.name: paths.get(f.name, "") if f.held else "" for f in files},
        tiers=tuple(tiers),
        durable_requested=rec.durable_requested,
        persistent_url=rec.persistent_url,
        memory_keep_last=rec.memory_keep_last,
        checkpoint_format=rec.checkpoint_format,
        lost_files=lost_files,
        owner_uid=rec.owner_uid,
        owner_claim_node=rec.owner_claim_node,
    )


def freshness(views: Iterable[CheckpointView]) -> dict[str, dict[str, float]]:
    """{namespace: {tier: newest commit time}} of committed views (`tierckpt.freshness`):
    the RPO view of `/metrics` and `tierckpt status`."""
    return newest_by_tier(
        Freshness(v.namespace, v.state.value, v.tiers, v.committed_unix)
        for v in views
        if FOREIGN_TAG not in v.tiers  # a peer's checkpoint says nothing of this job's RPO
    )
