"""How the persistent tier rides out a flaky object store: which failures are transient,
and a declared `RetryPolicy` (capped, jittered exponential backoff, a deadline) for one
remote operation. When the policy is exhausted `PersistentTierUnavailable` is raised and
the caller keeps the checkpoint pending: nothing is lost, it is simply not there yet.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tierckpt.errors import TierckptError

from tierckptd.ops import metrics

__all__ = [
    "PersistentTierUnavailable",
    "RetryPolicy",
    "discard_partial_write",
    "is_transient",
    "retry_call",
]

logger: logging.Logger = logging.getLogger("tierckptd.persistent.store")

T = TypeVar("T")


class PersistentTierUnavailable(ConnectionError):
    """The persistent tier kept failing for longer than the retry policy allows.

    Nothing was lost: what was not confirmed is simply not there yet (no `.metadata`
    without its data). Keep the checkpoint pending and retry the same call later.
    A daemon-side error, not a `TierckptError`: it is never sent to clients as such
    (those see the checkpoint as not yet durable). Picklable with its message.
    """


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


# OSErrors that describe the request, not the service: retrying cannot help.
_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)
# Transport failures that do not derive from a builtin (botocore, aiohttp), by class name
# so that neither needs importing here.
_TRANSIENT_NAMES = frozenset(
    {
        "HTTPClientError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying `exc` may succeed: the one table of what the tier retries."""
    if isinstance(exc, TierckptError | PersistentTierUnavailable):
        return False  # ChecksumMismatch is an OSError, this one a ConnectionError: final
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if isinstance(exc, OSError):  # s3fs: 5xx, SlowDown (EBUSY), InternalError, ...
        return True
    return any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__)


# The verb `what` starts with (every caller's first word) -> the `op` label.
_OPS = {"upload": "upload", "commit": "upload", "write": "upload", "index": "upload"}
_OPS |= {"read": "read", "probe": "read", "list": "list", "delete": "delete"}
_OPS |= {"unindex": "delete"}


def operation(what: str) -> str:
    """The `tierckpt_persistent_errors{op}` label of an operation described by `what`."""
    return _OPS.get(what.split(" ", 1)[0], "read")


def retry_call(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    until: Callable[[], float | None] = lambda: None,
) -> T:
    """Run `fn` under `policy`; return its result or raise.

    `until` gives an absolute deadline on `clock` (None: none), read before every
    attempt and every sleep, so one set meanwhile (shutdown) is honoured too; a caller's
    own deadline (`RemoteStore.within`) comes the same way.

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
            if not isinstance(exc, FileNotFoundError | TierckptError | PersistentTierUnavailable):
                metrics.PERSISTENT_ERRORS.labels(op=operation(what)).inc()  # an S3 error
            if not is_transient(exc):
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


def discard_partial_write(f: Any, path: str) -> None:
    """Abandon a failed write without committing it (aborts an S3 multipart upload)."""
    buffered = callable(getattr(f, "discard", None)) and hasattr(f, "buffer")
    try:
        if buffered:
            f.discard()
        else:
            f.close()  # local files: a partial object is harmless without its marker
    except Exception:
        logger.warning("could not abandon the partial upload of %s", path, exc_info=True)
    finally:
        if buffered:
            # Never let close() or __del__ complete this upload later: a stale partial
            # object could overwrite the one a successful retry wrote meanwhile.
            f.closed = True
