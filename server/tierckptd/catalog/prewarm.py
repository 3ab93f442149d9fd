"""Warm pool segments for a namespace's next save, in the background (`[memory]
prewarm_next`).

A save writes each file into a warm pool segment when `open_file` finds one (named for the
file, or any that fits), else into a new tmpfs file whose every page faults and is zeroed
first: 2.5-4x slower. Retention only fills the pool once checkpoints are evicted, and a
new writer per save has no pages of its own, so without help a job's first saves (the
most exposed ones) are the slow ones. After every commit, the daemon knows the files this
node wrote for the namespace (name, size, rank) and can have the next save's segments
ready before training stops for it.

`assign` plans what to make: only the files `pick` would not already find a big enough
segment for (evicted files' segments, earlier prewarms), so the pool never holds two
segments for one file. `NextSaveWarmer.run_pass` makes them as the handler of a job queue
of namespaces on one worker thread (`jobs.JobQueue`, deduplicated; main.py wires it, as
catalog/ imports no shared worker): never on an RPC thread, never under the catalog lock while it
touches pages, and never while a save writes on this node (it stops between steps and
plans again once the save is over). Its segments are pool bytes (P), which the budget
drops when a reservation needs room, so a prewarm never makes a save fail; and it makes
only segments that `fits` beside the next save's reservation (no pool dropped), so that
reservation does not drop them again: pages touched for nothing. `PoolUse` counts what saves got from the pool
(`tierckpt status`, metrics).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from tierckpt.names import METADATA_FILE

from tierckptd.memory.pool import Segment, pick
from tierckptd.ops import metrics

__all__ = ["RETRY", "NextSavePlan", "NextSaveWarmer", "PoolUse", "assign"]

logger = logging.getLogger(__name__)

# Seconds between checks while a save writes on this node (the job waits for it).
RETRY = 0.2

Plan = list[tuple[int, str | None]]


@dataclass(frozen=True)
class NextSavePlan:
    """The segments to make, (size, name), and the bytes the next save will reserve
    (what this node wrote last time): its reservation must leave them in the pool.
    `activate`: pooled segments the next save will take whose pages were touched once
    (files saved into new pages, since recycled), to touch again first."""

    segments: list[tuple[int, str]]
    save_bytes: int
    activate: list[Segment] = field(default_factory=list)


def assign(
    files: Iterable[tuple[str, int, int]], segments: list[Segment], namespace: str, cap: int = 0
) -> tuple[list[tuple[int, str]], list[Segment]]:
    """(size, name) of the segments to prewarm so that every file of `files` (name, size,
    rank: what this node wrote in the namespace's last save) finds a warm one at least
    its size: the files `pick` would give no such segment of `segments`, assuming the
    next save writes the same files. At most `cap` bytes (0: no cap beyond that). Also
    the segments of `segments` that cover the other files (the ones the save will take).

    The rank's remaining reservation `pick` sees is the rank's bytes (each rank reserves
    its data files before opening any), and for `.metadata` (reserved by itself after
    the data files are committed) its own size.
    """
    wanted = sorted(files, key=lambda f: (f[2], f[0]))
    per_rank: dict[int, int] = {}
    for name, size, rank in wanted:
        if name != METADATA_FILE:
            per_rank[rank] = per_rank.get(rank, 0) + size
    free = list(segments)
    plan: list[tuple[int, str]] = []
    covered: list[Segment] = []
    total = 0
    for name, size, rank in wanted:
        if size <= 0:
            continue
        remaining = size if name == METADATA_FILE else per_rank[rank]
        seg = pick(free, name, remaining, namespace)
        if seg is not None and seg.size >= size:
            free.remove(seg)  # that file is covered; the segment serves no other
            covered.append(seg)
            continue
        if cap and total + size > cap:
            continue  # a smaller file may still fit the cap
        plan.append((size, name))
        total += size
    return plan, covered


@dataclass
class PoolUse:
    """What saves' `open_file` got from the pool since start (guarded by the catalog
    lock): files given a warm segment (hits) or a new file (misses), and the bytes of
    prewarmed segments among the hits."""

    hits: int = 0
    misses: int = 0
    prewarmed_bytes: int = 0

    def record(self, seg: Segment | None) -> None:
        if seg is None:
            self.misses += 1
            metrics.POOL_MISSES.inc()
            return
        self.hits += 1
        metrics.POOL_HITS.inc()
        if seg.prewarmed:
            self.prewarmed_bytes += seg.size
            metrics.PREWARM_USED_BYTES.inc(seg.size)


class Prewarmable(Protocol):
    """What the warmer needs of the catalog."""

    def saving(self, within: float = ...) -> bool: ...

    def next_save_plan(self, namespace: str, cap: int = 0) -> NextSavePlan: ...

    def activate_segments(
        self, segments: list[Segment], stop: Callable[[], bool] | None = None
    ) -> int: ...

    def prewarm_segments(
        self,
        plan: Plan,
        why: str,
        *,
        namespace: str = "",
        stop: Callable[[], bool] | None = None,
        progress: Callable[[int], None] | None = None,
        kind: str = "restore",
        headroom: int = 0,
    ) -> int: ...


class NextSaveWarmer:
    """Prewarms a namespace's next save: `run_pass(namespace)` is the handler of a job
    queue whose `put` the catalog calls after each commit (`prewarm_next`).

    Args:
        catalog: plans (`next_save_plan`), makes segments (`prewarm_segments`) and says
            whether a save is writing (`saving`).
        max_bytes: at most this many bytes per namespace and pass (0: the last save's).
        retry: seconds before the next pass while a save writes.
    """

    def __init__(self, catalog: Prewarmable, *, max_bytes: int = 0, retry: float = RETRY) -> None:
        self._catalog = catalog
        self.max_bytes = max_bytes
        self.retry = retry
        self._stopping = threading.Event()
        # Bytes planned and not made yet (written by the one worker; read by status).
        self.pending_bytes = 0

    def _stop_now(self) -> bool:
        return self._stopping.is_set() or self._catalog.saving()

    def _made(self, nbytes: int) -> None:
        self.pending_bytes = max(0, self.pending_bytes - nbytes)

    def run_pass(self, namespace: str) -> float | None:
        """One pass for `namespace` (run it on one worker thread only): None when done,
        else the delay before another."""
        if self._stopping.is_set():
            return None
        if self._catalog.saving():
            return self.retry  # plan once the save is over: it may change the pool
        plan = self._catalog.next_save_plan(namespace, self.max_bytes)
        if plan.activate:  # the segments it will surely take first
            touched = self._catalog.activate_segments(plan.activate, self._stop_now)
            to_touch = sum(seg.size for seg in plan.activate)
            if touched < to_touch and self._catalog.saving() and not self._stopping.is_set():
                return self.retry  # a save started: the rest (re-planned) after it
        if not plan.segments:
            return None
        wanted = sum(size for size, _ in plan.segments)
        self.pending_bytes = wanted
        try:
            made = self._catalog.prewarm_segments(
                list(plan.segments),
                f"next save of {namespace}",
                namespace=namespace,
                stop=self._stop_now,
                progress=self._made,
                kind="next_save",
                headroom=plan.save_bytes,  # else its reservation would drop them again
            )
        finally:
            self.pending_bytes = 0
        if made < wanted and self._catalog.saving() and not self._stopping.is_set():
            return self.retry  # a save started: the rest (re-planned) after it
        return None  # done, or stopped by the budget / tmpfs: the next commit tries again

    def stop(self) -> None:
        """A pass running ends at its next step, and no other starts (daemon stop)."""
        self._stopping.set()
