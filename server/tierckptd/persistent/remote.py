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
that still completes afterwards changes nothing a retry would not. `RemoteStore.within`
gives one thread's calls a deadline of their own the same way (a listing, a probe, the
start-up adoption), so an endpoint that accepts connections and never answers (audit 3
H7) costs a caller its budget, not minutes.

Underneath, an S3 client gets bounded timeouts and retries unless ``storage_options``
names its own (`S3_CLIENT_DEFAULTS`): botocore's legacy default of 5 attempts, times
s3fs's 5 retries of a read timeout, held one call for over 6 minutes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import fsspec

from tierckptd.persistent.retry import PersistentTierUnavailable, RetryPolicy, retry_call

__all__ = ["S3_CLIENT_DEFAULTS", "S3_RETRIES", "RemoteStore", "protocols", "with_s3_defaults"]

_DEADLINE_POLL = 0.2  # how often a waiting caller looks at the shutdown deadline
# botocore `Config` for an S3 root whose storage_options do not set these keys: one
# request waits at most connect_timeout + read_timeout per attempt, 2 attempts; the
# RetryPolicy above retries the operation as a whole.
S3_CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 15,
    "retries": {"total_max_attempts": 2, "mode": "standard"},
}
S3_RETRIES = 2  # s3fs's own retries of a timeout or 5xx (its default is 5)
_S3_PROTOCOLS = ("s3", "s3a")

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
        self._bound = threading.local()  # .until: this thread's own deadline (`within`)
        fs, root = fsspec.core.url_to_fs(url, **with_s3_defaults(url, storage_options))
        if set(protocols(fs)) & set(_S3_PROTOCOLS) and isinstance(getattr(fs, "retries", 0), int):
            fs.retries = min(fs.retries, S3_RETRIES)
        self.fs: Any = fs
        self.root: str = root.rstrip("/")
        self._local = "file" in protocols(fs)

    def set_deadline(self, seconds: float | None) -> None:
        """From now on every operation gives up `seconds` from now (None: no deadline).

        For shutdown: operations in flight on other threads honour it too, so the
        caller can count on the tier returning by then plus `_DEADLINE_POLL`.
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

    def _deadline(self) -> float | None:
        """The earlier of the shutdown deadline and this thread's own (None: neither)."""
        own: float | None = getattr(self._bound, "until", None)
        shutdown = self._until
        if own is None or shutdown is None:
            return own if shutdown is None else shutdown
        return min(own, shutdown)

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
            until=self._deadline,
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


def with_s3_defaults(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """`storage_options` with `S3_CLIENT_DEFAULTS` under ``config_kwargs`` for an S3 URL
    (what the operator set wins, key by key); other URLs unchanged."""
    options = dict(storage_options or {})
    if url.split("://", 1)[0] not in _S3_PROTOCOLS:
        return options
    config = dict(options.get("config_kwargs") or {})
    for key, value in S3_CLIENT_DEFAULTS.items():
        config.setdefault(key, value)
    options["config_kwargs"] = config
    return options


def protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
