"""Remote operations on one fsspec root, under a retry policy and a shutdown deadline.

Every remote operation runs under a declared `RetryPolicy`: transient failures
(connection errors, timeouts, 5xx and SlowDown, which s3fs turns into plain `OSError`)
are retried with capped, jittered exponential backoff and a warning per retry;
permanent ones (403, 404 on write, bad arguments, a corrupt source) raise at once. When
the policy is exhausted `PersistentTierUnavailable` is raised: the caller keeps the
checkpoint pending and tries again later. Uploads are idempotent, so that is safe. s3fs
and botocore retry underneath too; tighten their ``config_kwargs`` in
``storage_options`` if a fast failure matters more than riding out blips.

`RemoteStore.set_deadline` bounds all of that at shutdown: every operation (retries,
the one in flight, s3fs's and botocore's own retries underneath) gives up with
`PersistentTierUnavailable` once the deadline passes. Each attempt runs on a helper
thread the caller stops waiting for at the deadline; the attempt is idempotent, so one
that still completes afterwards changes nothing a retry would not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import fsspec

from tierckptd.persistent.retry import PersistentTierUnavailable, RetryPolicy, retry_call

__all__ = ["RemoteStore", "protocols"]

_DEADLINE_POLL = 0.2  # how often a waiting caller looks at the shutdown deadline

T = TypeVar("T")


class RemoteStore:
    """One fsspec root (``url``) and the retried, deadline-bounded calls on it.

    Args:
        url: any fsspec URL (``s3://bucket/prefix``, ``file:///dir``, ...).
        storage_options: passed to ``fsspec.core.url_to_fs`` (``endpoint_url``,
            ``key``/``secret``, ``config_kwargs``, ...).
        retry: the policy for every remote operation.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self._clock = clock
        self._until: float | None = None
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs: Any = fs
        self.root: str = root.rstrip("/")
        self._local = "file" in protocols(fs)

    def set_deadline(self, seconds: float | None) -> None:
        """From now on every operation gives up `seconds` from now (None: no deadline).

        For shutdown: operations in flight on other threads honour it too, so the
        caller can count on the tier returning by then plus `_DEADLINE_POLL`.
        """
        self._until = None if seconds is None else self._clock() + seconds

    def find(self, path: str, *, detail: bool = False) -> Any:
        """Every object under `path`, flat; an unreadable local directory raises (an
        outage), where fsspec's walk would skip it as if empty."""
        if "file" in protocols(self.fs):
            return self.fs.find(path, detail=detail, on_error="raise")
        return self.fs.find(path, detail=detail)

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        return retry_call(
            lambda: self._attempt(fn, what),
            what,
            self.retry,
            sleep=self._sleep,
            clock=self._clock,
            until=lambda: self._until,
        )

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
            until = self._until
            if until is not None and self._clock() >= until:
                raise PersistentTierUnavailable(
                    f"{what}: abandoned at the shutdown deadline; the checkpoint stays pending"
                )
        ok, value = result[0]
        if ok:
            return cast(T, value)
        raise value

    def _mkdirs(self, path: str) -> None:
        if self._local:  # object stores have no directories to create
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)

    def put_object(self, path: str, data: bytes) -> None:
        self._mkdirs(path)
        self.fs.pipe_file(path, data)
        self.fs.invalidate_cache(path)

    def remove_object(self, path: str, *, recursive: bool = False) -> None:
        self.fs.invalidate_cache(path)
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)


def protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
