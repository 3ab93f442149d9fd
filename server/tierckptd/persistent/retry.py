"""How the persistent tier rides out a flaky store: a declared `RetryPolicy` (capped,
jittered exponential backoff, a deadline) for one remote operation, and `Calls`, which
runs every operation of one root under it and under the caller's or shutdown's deadline.

Which failures are worth a retry is the backend's table (`persistent.errors`). When the
policy is exhausted `PersistentTierUnavailable` is raised and the caller keeps the
checkpoint pending: nothing is lost, it is simply not there yet. Uploads are idempotent,
so that is safe. A backend's client library may retry underneath too; its entry caps
that (`Backend.library_retries`, `Backend.client_options`).
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from tierckpt.errors import TierckptError

from tierckptd.ops import metrics
from tierckptd.persistent.errors import Backend, Failure, PersistentTierUnavailable

__all__ = [
    "Calls",
    "Op",
    "PersistentTierUnavailable",
    "RetryPolicy",
    "operation",
    "retry_call",
]

logger: logging.Logger = logging.getLogger("tierckptd.persistent.store")

T = TypeVar("T")

_DEADLINE_POLL = 0.2  # how often a waiting caller looks at the deadline


class Op(enum.Enum):
    """What kind of remote operation a call is: the ``op`` label of
    ``tierckpt_persistent_errors`` (values fixed: dashboards select on them)."""

    UPLOAD = "upload"  # a data object, its marker, `.metadata`, an index entry, bookkeeping
    READ = "read"  # a range, a bookkeeping object, a durability probe
    LIST = "list"  # markers, a checkpoint's objects, namespaces, the index, open uploads
    DELETE = "delete"  # a checkpoint, an index entry, an open multipart upload


def operation(op: Op) -> str:
    """The ``tierckpt_persistent_errors{op}`` label of `op`."""
    return op.value


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep retrying a transient failure of one remote operation.

    Attempt n (from 1) failing is followed by a sleep drawn uniformly from
    ``[d/2, d]`` with ``d = min(cap, base * 2**(n-1))``. It gives up after
    `max_attempts` attempts (0: no limit) or when the next attempt would start more
    than `deadline` seconds after the first (None: no limit), whichever comes first.
    """

    max_attempts: int = 8
    deadline: float | None = 300.0
    base: float = 0.5
    cap: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 0 or (self.max_attempts == 0 and self.deadline is None):
            raise ValueError(
                f"retry policy never gives up ({self.max_attempts=}, {self.deadline=}); "
                "set max_attempts >= 1 or a deadline"
            )
        if self.base <= 0 or self.cap < self.base:
            raise ValueError(f"retry backoff needs 0 < base <= cap ({self.base=}, {self.cap=})")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"retry deadline must be positive ({self.deadline=})")

    def backoff(self, attempt: int, draw: Callable[[], float] = random.random) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt - 1, 62))
        return float(ceiling / 2 + draw() * ceiling / 2)


def retry_call(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    *,
    op: Op,
    backend: Backend,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    until: Callable[[], float | None] = lambda: None,
) -> T:
    """Run `fn` under `policy`; return its result or raise.

    `backend` says which failures are transient; every failure of the store (not a
    missing object, not tierckpt's own errors) counts under `op`. `until` gives an
    absolute deadline on `clock` (None: none), read before every attempt and every
    sleep, so one set meanwhile (shutdown) is honoured too; a caller's own deadline
    (`Calls.within`) comes the same way.

    Raises:
        PersistentTierUnavailable: transient failures outlasted the policy (chained to
            the last one).
        Exception: the first permanent failure, unchanged.
    """
    start = clock()
    attempt = 0
    while True:
        attempt += 1
        end = until()
        if end is not None and clock() >= end:
            raise PersistentTierUnavailable(
                f"{what}: not attempted, its deadline (shutdown, or the caller's) has passed; "
                "the checkpoint stays pending"
            )
        try:
            return fn()
        except Exception as exc:
            failure = backend.classify(exc)
            ours = isinstance(exc, TierckptError | PersistentTierUnavailable)
            if failure is not Failure.MISSING and not ours:
                metrics.PERSISTENT_ERRORS.labels(op=operation(op)).inc()
            if failure is not Failure.TRANSIENT:
                raise
            delay = policy.backoff(attempt)
            elapsed = clock() - start
            end = until()
            if (
                (policy.max_attempts and attempt >= policy.max_attempts)
                or (policy.deadline is not None and elapsed + delay > policy.deadline)
                or (end is not None and clock() + delay > end)
            ):
                raise PersistentTierUnavailable(
                    f"{what}: the persistent tier failed {attempt} times over {elapsed:.1f}s "
                    f"({type(exc).__name__}: {exc}); the checkpoint stays pending, retry later"
                ) from exc
            limit = policy.max_attempts or "unlimited"
            logger.warning(
                "%s failed (attempt %d of %s): %s: %s; retrying in %.2fs",
                what,
                attempt,
                limit,
                type(exc).__name__,
                exc,
                delay,
            )
            sleep(delay)


class Calls:
    """Every remote operation on one root: retried under `policy`, and bounded by a
    deadline when one is set.

    `set_deadline` bounds all of it at shutdown: every operation (retries, the one in
    flight, the client library's own retries underneath) gives up with
    `PersistentTierUnavailable` once the deadline passes. Each attempt runs on a helper
    thread the caller stops waiting for at the deadline; the attempt is idempotent, so
    one that still completes afterwards changes nothing a retry would not. `within`
    gives one thread's calls a deadline of their own the same way (a listing, a probe,
    the start-up adoption), so an endpoint that accepts connections and never answers
    costs a caller its budget, not minutes.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        backend: Backend,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.backend = backend
        self._sleep = sleep
        self._clock = clock
        self._until: float | None = None  # the shutdown deadline
        self._bound = threading.local()  # .until: this thread's own deadline (`within`)

    def set_deadline(self, seconds: float | None) -> None:
        """From now on every operation gives up `seconds` from now (None: no deadline).

        For shutdown: operations in flight on other threads honour it too, so the
        caller can count on them returning by then plus `_DEADLINE_POLL`.
        """
        self._until = None if seconds is None else self._clock() + seconds

    @contextmanager
    def within(self, seconds: float) -> Iterator[None]:
        """Every operation this thread starts inside gives up `seconds` from now (nested:
        the earlier deadline wins), as at shutdown: an RPC's probe or a background listing
        never waits longer on a silent endpoint."""
        outer: float | None = getattr(self._bound, "until", None)
        until = self._clock() + seconds
        self._bound.until = until if outer is None else min(outer, until)
        try:
            yield
        finally:
            self._bound.until = outer

    def run(self, fn: Callable[[], T], what: str, op: Op) -> T:
        """`fn` retried under the policy and the deadlines; `what` names it in errors
        and logs, `op` in the metric."""
        return retry_call(
            lambda: self._attempt(fn, what),
            what,
            self.policy,
            op=op,
            backend=self.backend,
            sleep=self._sleep,
            clock=self._clock,
            until=self._deadline,
        )

    def _deadline(self) -> float | None:
        """The earlier of the shutdown deadline and this thread's own (None: neither)."""
        own: float | None = getattr(self._bound, "until", None)
        shutdown = self._until
        if own is None or shutdown is None:
            return own if shutdown is None else shutdown
        return min(own, shutdown)

    def _attempt(self, fn: Callable[[], T], what: str) -> T:
        """One attempt on a helper thread, abandoned at the deadline (if one is set)."""
        result: list[tuple[bool, Any]] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append((True, fn()))
            except BaseException as e:
                result.append((False, e))
            finally:
                done.set()

        threading.Thread(target=run, name="tierckpt-persistent-call", daemon=True).start()
        while not done.wait(_DEADLINE_POLL):
            until = self._deadline()
            if until is not None and self._clock() >= until:
                if self._until is not None and self._clock() >= self._until:
                    raise PersistentTierUnavailable(
                        f"{what}: abandoned at the shutdown deadline; the checkpoint stays pending"
                    )
                raise PersistentTierUnavailable(
                    f"{what}: no answer from the persistent tier within the call's deadline "
                    "(it accepts connections but does not answer, or is too slow)"
                )
        ok, value = result[0]
        if ok:
            return cast(T, value)
        raise value
