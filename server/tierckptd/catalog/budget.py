"""The memory budget (DESIGN.md invariant 7), as running totals under the catalog lock::

    C (committed files held + manifests + quarantined files)
  + R (outstanding reservations + incoming copies + pool segments being preallocated)
  + P (warm pool)                                                             <= limit

The catalog reports every change of a checkpoint's held bytes or reservations with
`track` (and `forget` when it is gone), so no query re-sums the records. `admit` is the
one place a request for memory is refused (MemoryBudgetExceeded, RESOURCE_EXHAUSTED):
each message names what was asked, what is in use and the fix. Pool bytes are
reclaimable: `admit` drops segments (largest first) to make room.

C is counted the way tmpfs charges it (audit 3, M6): each file in whole pages, one
page for each checkpoint's data directory, and every manifest (this node's own and its
peers') in whole pages, so a flood of tiny checkpoints cannot hold more memory than the
budget says. Reservations stay in bytes (what a rank asked for).

Peers' manifests also have their own cap per coordinating node (`admit_manifest`:
`manifest_share` of the limit, [memory] peer_manifest_share), so one peer cannot fill
this node's budget with manifests describing huge files (audit 3, M3).

Not thread-safe: call it under the catalog lock.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from tierckpt.errors import MemoryBudgetExceeded
from tierckpt.units import format_size

from tierckptd.memory.pool import WarmPool
from tierckptd.model import CheckpointRecord, Key
from tierckptd.ops import metrics

__all__ = [
    "MANIFEST_SHARE",
    "MIN_MANIFEST_CAP",
    "PAGE",
    "Budget",
    "IncomingKey",
    "admit_namespace",
    "held_charge",
    "pages",
]

IncomingKey = tuple[str, str, str]  # (namespace, checkpoint_id, file name)
# The share of the budget the manifests of one coordinating peer may take, and a floor
# (a small test budget still takes a few ordinary manifests).
MANIFEST_SHARE = 0.01
MIN_MANIFEST_CAP = 256 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages (what tmpfs charges for a file of that size)."""
    return -(-nbytes // PAGE) * PAGE


def held_charge(rec: CheckpointRecord) -> int:
    """What the files a checkpoint holds here cost in memory: each committed, held file
    in whole pages (an empty one costs its inode only: counted with the directory), plus
    one page for the checkpoint's data directory when it holds any."""
    held = [f.size for f in rec.files.values() if f.committed and f.held]
    return sum(pages(size) for size in held) + (PAGE if held else 0)


def admit_namespace(
    records: Iterable[Key], namespace: str, limit: int, *, node_id: str, what: str
) -> None:
    """Refuse (MemoryBudgetExceeded) a checkpoint of a namespace this node does not hold
    yet when it holds `limit` namespaces already (0: no bound): each costs directories,
    manifests and metric series whatever its size, so a flood of one-byte saves in
    fresh namespaces (or a peer's manifests of them) is bounded."""
    if not limit:
        return
    namespaces = {key[0] for key in records}
    if namespace in namespaces or len(namespaces) < limit:
        return
    metrics.REJECTED_SAVES.labels(reason="namespaces").inc()
    raise MemoryBudgetExceeded(
        f"node {node_id} holds checkpoints of {len(namespaces):,} namespaces, the most "
        f"[memory] max_namespaces = {limit:,} allows; {what} in a new namespace "
        f"{namespace[:64]!r} is refused: remove the checkpoints of namespaces no longer "
        "used (`tierckpt rm`), or raise [memory] max_namespaces"
    )


class Budget:
    """Running totals of C, R and P, and admission against `limit`."""

    def __init__(self, limit: int, pool: WarmPool, *, node_id: str) -> None:
        self.limit = limit
        self.pool = pool
        self.node_id = node_id
        self.quarantined = 0
        self._held: dict[Key, int] = {}
        self._reserved: dict[Key, int] = {}
        self._manifests: dict[Key, int] = {}
        self.manifest_share = MANIFEST_SHARE
        self._manifest_owner: dict[Key, str] = {}  # a peer's manifest -> its coordinator
        self.incoming: dict[IncomingKey, int] = {}
        self._held_total = 0
        self._reserved_total = 0
        self._manifest_total = 0
        self._incoming_total = 0

    # ---- totals -------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """C: bytes held by checkpoints, peers' manifests and quarantined files."""
        return self.quarantined + self._held_total + self._manifest_total

    @property
    def reserved(self) -> int:
        """R: pages promised but not yet held: save reservations, incoming copies, and
        pool segments still being preallocated (they join the pool when complete)."""
        return self._reserved_total + self._incoming_total + self.pool.pending

    @property
    def pooled(self) -> int:
        """P: the warm pool."""
        return self.pool.pool_bytes

    @property
    def checkpoints(self) -> int:
        """How many checkpoints are tracked (in the save budget's message)."""
        return len(self._held)

    def track(self, key: Key, held: int, reserved: int) -> None:
        """A checkpoint now holds `held` bytes and has `reserved` bytes reserved."""
        self._held_total += held - self._held.get(key, 0)
        self._reserved_total += reserved - self._reserved.get(key, 0)
        self._held[key] = held
        self._reserved[key] = reserved

    def charge_manifest(self, key: Key, nbytes: int) -> None:
        """The JSON bytes of a checkpoint's manifest, charged in whole pages (0: none)."""
        nbytes = pages(nbytes)
        self._manifest_total += nbytes - self._manifests.pop(key, 0)
        if nbytes:
            self._manifests[key] = nbytes

    @property
    def manifest_cap(self) -> int:
        """The bytes of manifests one coordinating peer may have charged here."""
        return max(int(self.limit * self.manifest_share), MIN_MANIFEST_CAP)

    def manifests_of(self, coordinator: str) -> int:
        """The bytes charged for the manifests `coordinator` coordinates (entries of
        manifests no longer charged are dropped on the way)."""
        total = 0
        for key, owner in list(self._manifest_owner.items()):
            charged = self._manifests.get(key, 0)
            if not charged:
                del self._manifest_owner[key]
            elif owner == coordinator:
                total += charged
        return total

    def owned_by(self, key: Key, coordinator: str) -> None:
        """The manifest of `key` is (or is about to be) charged for peer `coordinator`."""
        self._manifest_owner[key] = coordinator

    def admit_manifest(self, nbytes: int, key: Key, coordinator: str, *, what: str) -> None:
        """Admit a peer's manifest of `nbytes` (as `admit`), first within the cap of its
        coordinator: MemoryBudgetExceeded naming the peer, its share and the fix."""
        mine = self.manifests_of(coordinator)
        if self._manifest_owner.get(key) == coordinator:
            mine -= self._manifests.get(key, 0)  # charged again: it replaces itself
        cap = self.manifest_cap
        if mine + nbytes > cap:
            self._refuse(
                "manifest",
                f"{what} ({format_size(nbytes)}) does not fit what node {coordinator[:64]} "
                f"may keep in manifests on node {self.node_id}: it has {format_size(mine)} "
                f"of its {format_size(cap)} ([memory] peer_manifest_share = "
                f"{self.manifest_share:g} of memory.budget={format_size(self.limit)}); raise "
                "peer_manifest_share, or keep fewer checkpoints with smaller manifests",
            )
        self.admit(nbytes, what=what, reason="manifest")
        self.owned_by(key, coordinator)

    def forget(self, key: Key) -> None:
        """The checkpoint is gone: nothing of it counts any more."""
        self.track(key, 0, 0)
        self.charge_manifest(key, 0)
        del self._held[key], self._reserved[key]

    def start_incoming(self, ikey: IncomingKey, nbytes: int) -> None:
        self._incoming_total += nbytes - self.incoming.get(ikey, 0)
        self.incoming[ikey] = nbytes

    def finish_incoming(self, ikey: IncomingKey) -> None:
        self._incoming_total -= self.incoming.pop(ikey, 0)

    def release_quarantined(self, nbytes: int) -> None:
        """Quarantined bytes installed or collected (an orphan's files)."""
        self.quarantined -= nbytes

    def limit_manifests(self, share: float) -> None:
        """`[memory] peer_manifest_share`: the share of the limit one coordinator's
        manifests may take."""
        self.manifest_share = share

    def reset(self, quarantined: int) -> None:
        """Start over (restart adoption installs a new set of records)."""
        for d in (self._held, self._reserved, self._manifests, self.incoming):
            d.clear()
        self._manifest_owner.clear()
        self._held_total = self._reserved_total = 0
        self._manifest_total = self._incoming_total = 0
        self.quarantined = quarantined

    # ---- admission ----------------------------------------------------------------------
    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit beside C + R + P without dropping the pool (prewarm:
        a new segment never displaces a warm one)."""
        return self.used + self.reserved + self.pooled + nbytes <= self.limit

    def short(self, nbytes: int, unwritten: Callable[[], int]) -> bool:
        """Whether `nbytes` more would be refused now (budget, or free pages beside the
        `unwritten` reservations) even with the whole pool dropped: a save then waits
        for the pool segments being preallocated, which count as reserved until done."""
        if self.used + self.reserved + nbytes > self.limit:
            return True
        return self.pool.tier.free_bytes() - unwritten() + self.pooled < nbytes

    def trim_pool(self, extra: int = 0) -> None:
        """Drop pool segments, largest first, until C + R + P + extra fits the limit."""
        while self.used + self.reserved + self.pooled + extra > self.limit:
            if not self.pool.drop_largest():
                return

    def admit(
        self,
        nbytes: int,
        *,
        what: str,
        reason: str,
        within: int | None = None,
        holder: str = "",
        unwritten: Callable[[], int] | None = None,
    ) -> None:
        """Admit `nbytes` more or raise MemoryBudgetExceeded (counted per `reason`).

        `what` names the request in the message ("this save", "a copy of ns/id/f", "the
        manifest of ns/id", "file f of ns/id"). With `within`, the bytes must fit that
        room (`holder`'s reservation, already counted in R) instead of the budget. With
        `unwritten` (reserved bytes whose pages are not allocated yet), the filesystem
        must also have the free pages. Admitted bytes get room: the pool is trimmed.
        """
        if within is not None:
            if nbytes > within:
                self._refuse(
                    reason,
                    f"{what} is {format_size(nbytes)} but {holder}'s reservation has only "
                    f"{format_size(within)} left (with the warm segment OpenFile gave it): "
                    "reserve the full size with ReserveSpace before writing",
                )
            return
        in_use = self.used + self.reserved
        if in_use + nbytes > self.limit:
            self._refuse(reason, self._over_budget(nbytes, what, reason, in_use))
        pending = 0
        if unwritten is not None:
            tier = self.pool.tier
            free, pending = tier.free_bytes(), unwritten()
            if free - pending + self.pooled < nbytes:
                self._refuse(
                    "filesystem",
                    f"the filesystem of the memory dir {tier.root} has only "
                    f"{format_size(free)} free (+ {format_size(self.pooled)} reclaimable "
                    f"pool), {format_size(pending)} of it promised to reservations not "
                    f"written yet, but {what} needs {format_size(nbytes)}; enlarge /dev/shm "
                    "(tmpfs size=) or lower [memory] budget below the tmpfs size",
                )
        self.trim_pool(extra=nbytes)
        if unwritten is not None:
            while self.pool.tier.free_bytes() - pending < nbytes and self.pool.drop_largest():
                pass

    def _over_budget(self, nbytes: int, what: str, reason: str, in_use: int) -> str:
        limit = f"memory.budget={format_size(self.limit)}"
        if reason == "budget":
            count = self.checkpoints
            return (
                f"memory budget exceeded: {what} needs {format_size(nbytes)} but "
                f"{format_size(in_use)} of {limit} are in use by {count} "
                f"checkpoint{'s' if count != 1 else ''} on node {self.node_id}; raise "
                "[memory] budget, lower [retention] memory_keep_last, or remove checkpoints "
                "with `tierckpt rm`"
            )
        return (
            f"no room for {what} ({format_size(nbytes)}): {format_size(in_use)} of {limit} "
            f"in use on node {self.node_id}"
        )

    @staticmethod
    def _refuse(reason: str, message: str) -> None:
        metrics.REJECTED_SAVES.labels(reason=reason).inc()
        raise MemoryBudgetExceeded(message)
