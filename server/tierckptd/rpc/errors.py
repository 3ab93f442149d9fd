"""Domain error -> gRPC status, in one place for both servicers (DaemonService, PeerService).

An RPC method decorated with `@rpc_method` runs with every exception translated by its
servicer's `errors` (a `StatusTranslator`):

- a `TierckptError` aborts with its status from the one table in `tierckpt.errors` and
  its message, bounded (grpc carries details in trailing metadata, whose hard limit a
  long echo would exceed: the client would see "Stream removed" instead); a subtype that
  shares its code (`TierUnavailable`, `CheckpointLost`, ...) also sends its `reason` in
  the trailing metadata `REASON_METADATA`, so the client need not read the message;
- an UNAVAILABLE answer (a tier behind this daemon is down: `TierUnavailable`) carries
  `grpc-retry-pushback-ms: -1`, so the client channel's retry policy, meant for a daemon
  that is restarting, does not repeat a restore that already waited out its tier;
- anything else is a bug: INTERNAL with a fixed message (no repr, traceback or path out);
  the cause goes to this node's log, with a traceback the first time per method and kind;
- a `grpc.RpcError`, or an error after the context already aborted (a cancelled stream),
  is re-raised untouched.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol, TypeVar, cast

import grpc
from tierckpt.errors import REASON_METADATA, TierckptError, status_of

__all__ = [
    "MAX_DETAILS",
    "NO_RETRY",
    "StatusTranslator",
    "bounded",
    "rpc_method",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# Longest status message or echoed error in a log line.
MAX_DETAILS = 1000
# Trailing metadata asking the client not to retry (gRFC A6: a negative server pushback).
NO_RETRY = (("grpc-retry-pushback-ms", "-1"),)
# Distinct (method, exception type) pairs logged with a traceback, per translator.
MAX_TRACEBACKS = 256

# (level, format, args, exc_info): how a translator logs; PeerService rate-limits.
LogFn = Callable[[int, str, tuple[object, ...], "BaseException | None"], None]
# (method, code, bounded message): called before a refusal is answered (metrics, logs).
RefusedFn = Callable[[str, grpc.StatusCode, str], None]


def bounded(text: str, limit: int = MAX_DETAILS) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}... ({len(text) - limit + 40:,} more characters)"


def _log(level: int, fmt: str, args: tuple[object, ...], exc: BaseException | None) -> None:
    logger.log(level, fmt, *args, exc_info=exc)


class StatusTranslator:
    """How one servicer turns an exception into its gRPC answer (see the module doc).

    Args:
        internal_message: the fixed INTERNAL message for a method, e.g. naming the node.
        log: where lines go (default: this module's logger).
        refused: called for every TierckptError answered (default: an INFO line).
    """

    def __init__(
        self,
        internal_message: Callable[[str], str],
        *,
        log: LogFn = _log,
        refused: RefusedFn | None = None,
    ) -> None:
        self.internal_message = internal_message
        self.log = log
        self.refused = refused or self._log_refusal
        self._traced: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def _log_refusal(self, method: str, code: grpc.StatusCode, message: str) -> None:
        self.log(logging.INFO, "%s refused: %s", (method, message), None)

    def abort(self, context: Any, method: str, error: BaseException) -> NoReturn:
        """Answer `error` on `context` (never returns: grpc's abort raises)."""
        if isinstance(error, grpc.RpcError) or context.code() is not None:
            raise error  # cancelled, or already aborted with its own status
        if isinstance(error, TierckptError):
            code, message = status_of(error), bounded(str(error))
            self.refused(method, code, message)
            trailing: tuple[tuple[str, str], ...] = ()
            if error.reason:
                trailing += ((REASON_METADATA, error.reason),)
            if code == grpc.StatusCode.UNAVAILABLE:
                trailing += NO_RETRY
            if trailing:
                context.set_trailing_metadata(trailing)
            context.abort(code, message)
        else:
            kind = (method, type(error).__name__)
            with self._lock:
                first = kind not in self._traced and len(self._traced) < MAX_TRACEBACKS
                self._traced.add(kind)
            self.log(
                logging.ERROR,
                "%s failed: %s: %s",
                (method, type(error).__name__, bounded(str(error))),
                error if first else None,
            )
            context.abort(grpc.StatusCode.INTERNAL, self.internal_message(method))
        raise AssertionError("context.abort returned")  # pragma: no cover

    def call(self, context: Any, method: str, fn: Callable[[], T]) -> T:
        """`fn()`, with any exception answered as its status."""
        try:
            return fn()
        except Exception as e:
            self.abort(context, method, e)


class _Servicer(Protocol):
    errors: StatusTranslator


def rpc_method(method: F) -> F:
    """Decorate a servicer method `(self, request, context)`: any exception it raises
    (or its response stream raises) is answered by `self.errors` under the method's name."""
    name = method.__name__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: _Servicer, request: Any, context: Any) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except Exception as e:
                self.errors.abort(context, name, e)

        return cast(F, stream)

    @functools.wraps(method)
    def unary(self: _Servicer, request: Any, context: Any) -> Any:
        try:
            return method(self, request, context)
        except Exception as e:
            self.errors.abort(context, name, e)

    return cast(F, unary)
