"""Per-tier freshness of a namespace: the commit time of its newest checkpoint at each
level of protection, from which an operator reads the RPO (`now - newest`).

One definition for the daemon's `tierckpt_newest_checkpoint_timestamp_seconds` gauge and
its GetStatus answer (`tierckpt status`, read back with `from_wire`), so the two never
disagree. A checkpoint counts at every level it has reached, a stronger level implying
the weaker ones:

- ``memory``: committed and held by some node's memory tier (this node or a peer), not
  LOST: survives a process restart;
- ``replicated``: REPLICATED (every file has its extra copies) or DURABLE: survives the
  loss of a node;
- ``durable``: DURABLE (its `.metadata` is in the persistent tier): survives the loss of
  every memory tier.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import NamedTuple, Protocol

from tierckpt.errors import InvalidName
from tierckpt.names import check_namespace

__all__ = ["TIERS", "Freshness", "from_wire", "levels", "newest_by_tier"]

TIERS = ("memory", "replicated", "durable")
MAX_NAMESPACES = 100_000  # what a status answer may list; more is not a daemon's answer


class Freshness(NamedTuple):
    """What freshness needs of one checkpoint (a daemon view or a `CheckpointInfo`)."""

    namespace: str
    state: str  # COMMITTED, REPLICATED, DURABLE, LOST, ...
    tiers: Collection[str]  # where its bytes can be had: memory, peer, persistent, ...
    committed_unix: float


def levels(state: str, tiers: Collection[str]) -> tuple[str, ...]:
    """The protection levels (of `TIERS`) a checkpoint in `state` with `tiers` reached."""
    if state not in ("COMMITTED", "REPLICATED", "DURABLE"):
        return ()  # LOST, WRITING, ABORTED: nothing to restore from
    reached = []
    if "memory" in tiers or "peer" in tiers:
        reached.append("memory")
    if state in ("REPLICATED", "DURABLE"):
        reached.append("replicated")
    if state == "DURABLE":
        reached.append("durable")
    return tuple(reached)


def newest_by_tier(checkpoints: Iterable[Freshness]) -> dict[str, dict[str, float]]:
    """{namespace: {level: newest commit time}}; a level no checkpoint reached is absent,
    and so is a namespace with none (a timestamp no calendar holds is ignored: it may
    come from a peer's manifest)."""
    newest: dict[str, dict[str, float]] = {}
    for c in checkpoints:
        ts = c.committed_unix
        if not math.isfinite(ts) or ts <= 0:
            continue
        for level in levels(c.state, c.tiers):
            by_tier = newest.setdefault(c.namespace, {})
            by_tier[level] = max(by_tier.get(level, 0.0), ts)
    return newest


class WireFreshness(Protocol):
    """daemon.proto's NamespaceFreshness (0: the level was not reached)."""

    namespace: str
    memory_unix: float
    replicated_unix: float
    durable_unix: float


def from_wire(entries: Iterable[WireFreshness]) -> dict[str, dict[str, float]]:
    """A GetStatus answer's freshness as `newest_by_tier` gives it; an invalid namespace
    or a timestamp no calendar holds is dropped, never shown."""
    fresh: dict[str, dict[str, float]] = {}
    for i, e in enumerate(entries):
        if i >= MAX_NAMESPACES:
            break
        try:
            namespace = check_namespace(e.namespace)
        except InvalidName:
            continue
        stamps = zip(TIERS, (e.memory_unix, e.replicated_unix, e.durable_unix), strict=True)
        tiers = {t: ts for t, ts in stamps if math.isfinite(ts) and ts > 0}
        if tiers:
            fresh[namespace] = tiers
    return fresh
