"""One job queue for the daemon's background work, and one "step aside for saves" rule.

`JobQueue` runs typed jobs (frozen dataclasses: `Heal`, `Repair`, `Drain`, ...) on its
own worker thread(s): replication and healing on the peer tier, drains on the persistent
tier. A job is queued at most once (dedup by value); queueing it again keeps the earlier
due time and the higher priority. Among the jobs due, the one of the highest priority
runs first (`URGENT` before `NORMAL` before `BACKGROUND`; then by due time), so a new
commit's replication is not queued behind a heal round over every older checkpoint.
The handler returns None (done) or a delay in seconds after which the job runs
again (retry with backoff, see `backoff`). `put` never blocks, so it is safe under the
catalog lock (lock order: catalog lock -> queue condition; the handler runs with no
queue lock held).

The clock and the wait are injectable: tests drive a queue without threads through
`run_due()` and a fake clock.

`StepAside` is the one rule for background I/O while a save is writing on this node:
wait while `saving()` is true, at most `patience` seconds in total per file, so a push or
an upload does not compete with training for CPU and memory bandwidth, and back-to-back
saves cannot starve it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "BACKGROUND",
    "NORMAL",
    "SAVE_YIELD_MAX",
    "URGENT",
    "Drain",
    "Heal",
    "JobHandler",
    "JobQueue",
    "Repair",
    "ReportCorrupt",
    "StepAside",
    "TellLanded",
    "backoff",
]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], None]

# Longest one file's push or upload, in total, steps aside for saves on this node.
SAVE_YIELD_MAX = 30.0

# Job priorities (lower runs first among the jobs due): a new commit's replication, other
# work, and the periodic heal round over every committed checkpoint.
URGENT, NORMAL, BACKGROUND = 0, 1, 2


# ---- typed jobs -----------------------------------------------------------------------
@dataclass(frozen=True)
class Heal:
    """Give every file of a committed checkpoint its extra copies (peer tier)."""

    namespace: str
    checkpoint_id: str
    full: bool = False  # every file, asking every peer (a peer lists it LOST)


@dataclass(frozen=True)
class Repair:
    """Replace this node's copy of one file found corrupt (through the Restorer)."""

    namespace: str
    checkpoint_id: str
    name: str


@dataclass(frozen=True)
class TellLanded:
    """Tell the peers this node's replica list of a file a copy of which landed here."""

    namespace: str
    checkpoint_id: str
    name: str


@dataclass(frozen=True)
class ReportCorrupt:
    """Tell `node` that bytes of a file it sent over its bulk stream failed verification
    here (it re-checks its own copy, `peers.recheck`)."""

    namespace: str
    checkpoint_id: str
    name: str
    node: str


@dataclass(frozen=True)
class Tell:
    """Send `node` this node's replica list of one file again (it did not take it)."""

    namespace: str
    checkpoint_id: str
    name: str
    node: str
    tries: int = 1


@dataclass(frozen=True)
class Drain:
    """Make a committed checkpoint durable on the persistent tier."""

    namespace: str
    checkpoint_id: str


J = TypeVar("J", bound=Hashable)

JobHandler = Callable[[J], "float | None"]
"""Runs one job; returns None when it is finished, else the delay before it runs again."""


def backoff(tries: int, first: float, cap: float) -> float:
    """The delay before attempt `tries` + 1: `first`, doubling each time, at most `cap`."""
    if tries <= 0:
        return 0.0
    return float(min(cap, first * (1 << min(tries - 1, 30))))


class JobQueue(Generic[J]):
    """Delayed, deduplicated jobs run by `workers` threads (see the module docstring).

    Args:
        handler: runs one job; its return value reschedules it (None: finished). An
            exception is logged and the job dropped.
        name: the worker threads' name (and the log's).
        workers: worker threads started by `start`.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        handler: JobHandler[J],
        *,
        name: str = "tierckptd-jobs",
        workers: int = 1,
        clock: Clock = time.monotonic,
    ) -> None:
        self._handler = handler
        self.name = name
        self._workers = workers
        self._clock = clock
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, J]] = []  # (due, seq, job), superseded ones too
        self._ready: list[tuple[int, float, int, J]] = []  # due: (priority, due, seq, job)
        self._when: dict[J, float] = {}
        self._priority: dict[J, int] = {}
        self._running: set[J] = set()
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- queueing ---------------------------------------------------------------------
    def put(self, job: J, delay: float = 0.0, *, priority: int = NORMAL) -> bool:
        """Queue `job` to run after `delay` seconds (never blocks); False when it was
        already queued to run no later and at no lower a priority (dedup)."""
        when = self._clock() + delay
        with self._cv:
            queued = self._when.get(job)
            if queued is not None:
                had = self._priority.get(job, NORMAL)
                if queued <= when and had <= priority:
                    return False
                when, priority = min(when, queued), min(priority, had)
            self._when[job] = when
            self._priority[job] = priority
            heapq.heappush(self._heap, (when, next(self._seq), job))
            self._cv.notify()
            return True

    def pending(self) -> list[J]:
        """Jobs queued (not the ones running), soonest first."""
        with self._cv:
            return sorted(self._when, key=lambda j: self._when[j])

    def due_in(self, job: J) -> float | None:
        """Seconds until a queued `job` runs (None: not queued)."""
        with self._cv:
            when = self._when.get(job)
        return None if when is None else max(0.0, when - self._clock())

    def discard(self, job: J) -> bool:
        """Drop a queued `job` (not one running); True if it was queued."""
        with self._cv:
            self._priority.pop(job, None)
            return self._when.pop(job, None) is not None

    def __len__(self) -> int:
        with self._cv:
            return len(self._when)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ---- running ----------------------------------------------------------------------
    def _pop_due(self, now: float) -> tuple[J | None, float | None]:
        """(the due job of the highest priority, None) or (None, seconds until the next
        one / None when empty). Call with the condition held."""
        while self._heap and self._heap[0][0] <= now:
            when, seq, job = heapq.heappop(self._heap)
            if self._when.get(job) == when:  # else a superseded entry
                heapq.heappush(self._ready, (self._priority.get(job, NORMAL), when, seq, job))
        busy: list[tuple[int, float, int, J]] = []
        found: J | None = None
        while self._ready:
            entry = heapq.heappop(self._ready)
            job = entry[3]
            if self._when.get(job) != entry[1]:
                continue  # ran, discarded, or queued again (its entry is in the heap)
            if job in self._running:
                busy.append(entry)  # running on another worker: it finishes first
                continue
            found = job
            break
        for entry in busy:
            heapq.heappush(self._ready, entry)
        if found is not None:
            del self._when[found]
            self._priority.pop(found, None)
            self._running.add(found)
            return found, None
        if busy:
            return None, 0.05
        if self._heap:
            return None, max(0.0, self._heap[0][0] - now)
        return None, None

    def _run_one(self, job: J) -> None:
        try:
            again = self._handler(job)
        except Exception:
            logger.exception("%s: job %s failed", self.name, job)
            again = None
        finally:
            with self._cv:
                self._running.discard(job)
                self._cv.notify_all()
        if again is not None and not self._stop.is_set():
            self.put(job, again)

    def run_due(self) -> int:
        """Run every job due now in the calling thread (tests, with a fake clock); the
        number run. Jobs rescheduled with a delay of 0 run again in the same call."""
        ran = 0
        while True:
            with self._cv:
                job, _ = self._pop_due(self._clock())
            if job is None:
                return ran
            self._run_one(job)
            ran += 1

    def _work(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop.is_set():
                        return
                    job, wait = self._pop_due(self._clock())
                    if job is not None:
                        break
                    self._cv.wait(wait)
            self._run_one(job)

    def start(self) -> None:
        for i in range(self._workers):
            suffix = f"-{i}" if self._workers > 1 else ""
            t = threading.Thread(target=self._work, name=self.name + suffix, daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the workers (a job running finishes first, within `timeout`); queued jobs
        stay queued and are not run."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is queued due now or running (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._running or any(w <= self._clock() for w in self._when.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
            return True


class StepAside:
    """Waits while a save is writing on this node, `patience` seconds at most in total
    (one instance per file pushed or uploaded).

    Args:
        saving: whether a save is writing now (`Catalog.saving`).
        patience: the total wait this instance allows.
        stop: set when the daemon stops (waiting ends at once).
    """

    def __init__(
        self,
        saving: Callable[[], bool],
        *,
        patience: float = SAVE_YIELD_MAX,
        stop: threading.Event | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
        poll: float = 0.05,
    ) -> None:
        self._saving = saving
        self._until = clock() + patience
        self._stop = stop
        self._clock = clock
        self._sleep = sleep
        self._poll = poll

    def wait(self, beat: float | None = None) -> bool:
        """Wait while a save writes and patience is left. With `beat`, return True after
        `beat` seconds when the save still runs (the caller sends a heartbeat and calls
        again); False when it is clear to go."""
        beat_at = None if beat is None else self._clock() + beat
        while (
            self._saving()
            and self._clock() < self._until
            and not (self._stop is not None and self._stop.is_set())
        ):
            if beat_at is not None and self._clock() >= beat_at:
                return True
            self._sleep(self._poll)
        return False
