"""Bounds on the peer port's threads: admission per peer and in total, and a watchdog
that cancels calls that stop making progress.

The peer server has a fixed pool of threads and the health service shares it (the
DaemonSet's liveness probe calls it there). A PeerService call holds a thread for as long
as its peer keeps it open, so a peer that opens streams and never sends a message, or
never reads what it asked for, could hold every thread and make the node look dead.
`Admission` refuses calls beyond `per_peer` for one caller and `total`
overall (RESOURCE_EXHAUSTED, at once), so some threads are always free for health;
`Watchdog` cancels a call with no message in or out for `stall` seconds, or older than
`limit`, so admitted slots come back.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from tierckptd.peers.security import HEALTH_PREFIX, MethodInterceptor

__all__ = ["Admission", "HealthGuard", "Ticket", "Watchdog"]

logger = logging.getLogger(__name__)


class Admission:
    """Counts calls in flight per caller and in total; `enter` refuses beyond the caps."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self._lock = threading.Lock()
        self._by_peer: dict[str, int] = {}
        self._count = 0

    def enter(self, peer: str) -> bool:
        with self._lock:
            mine = self._by_peer.get(peer, 0)
            if self._count >= self.total or mine >= self.per_peer:
                return False
            self._by_peer[peer] = mine + 1
            self._count += 1
            return True

    def leave(self, peer: str) -> None:
        with self._lock:
            left = self._by_peer.get(peer, 0) - 1
            if left > 0:
                self._by_peer[peer] = left
            else:
                self._by_peer.pop(peer, None)
            self._count -= 1

    def in_flight(self) -> int:
        with self._lock:
            return self._count


@dataclass
class Ticket:
    """One watched call: `touch` after every message in or out."""

    cancel: Callable[[], None]
    what: str
    stall: float
    end: float
    deadline: float

    def touch(self) -> None:
        self.deadline = time.monotonic() + self.stall

    def settle(self) -> None:
        """The request is in: from now on only the call's overall limit applies."""
        self.deadline = self.end


class Watchdog:
    """One thread cancelling watched calls past their deadline (checked every `tick`)."""

    def __init__(self, tick: float = 0.5, level: int = logging.WARNING) -> None:
        self.tick = tick
        self.level = level
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], None], what: str, stall: float, limit: float) -> int:
        """Watch a call (`cancel` ends it); returns the id for `ticket` and `done`."""
        now = time.monotonic()
        ticket = Ticket(cancel, what, stall, now + limit, min(now + stall, now + limit))
        with self._lock:
            key = next(self._ids)
            self._tickets[key] = ticket
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tierckptd-peer-watchdog", daemon=True
                )
                self._thread.start()
        return key

    def ticket(self, key: int) -> Ticket:
        with self._lock:
            return self._tickets[key]

    def done(self, key: int) -> None:
        with self._lock:
            self._tickets.pop(key, None)

    def watched(self) -> int:
        with self._lock:
            return len(self._tickets)

    def _run(self) -> None:
        while True:
            time.sleep(self.tick)
            now = time.monotonic()
            with self._lock:
                late = [(k, t) for k, t in self._tickets.items() if now >= t.deadline]
                for key, _ in late:
                    del self._tickets[key]
            for _, t in late:
                why = "over its time limit" if now >= t.end else f"no message for {t.stall:g} s"
                logger.log(self.level, "cancelled %s: %s", t.what, why)
                try:
                    t.cancel()
                except Exception as e:  # a call that ended meanwhile
                    logger.debug("cancel of %s: %s", t.what, e)


class HealthGuard(MethodInterceptor):
    """grpc.health.v1 on the peer port, hardened: anyone may call it (probes carry no
    token), so its requests are decoded here, not by gRPC (a request gRPC fails to
    deserialize leaks ~15-19 KB in grpcio 1.85), and a Check whose request does not
    arrive within `stall` seconds is cancelled rather than holding a thread."""

    def __init__(self, stall: float = 5.0) -> None:
        self.stall = stall
        self.watchdog = Watchdog(level=logging.DEBUG)  # anyone may call: no log flood

    def intercept(
        self, handler: grpc.RpcMethodHandler, method: str, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if not method.startswith(HEALTH_PREFIX) or handler.request_streaming:
            return handler
        parse = handler.request_deserializer or (lambda raw: raw)
        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._check(handler.unary_unary, parse, method),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _decoded(handler.unary_stream, parse, method),
                response_serializer=handler.response_serializer,
            )
        return handler

    def _check(
        self, behaviour: Callable[[Any, Any], Any], parse: Callable[[bytes], Any], method: str
    ) -> Callable[[Iterator[bytes], Any], Any]:
        def check(requests: Iterator[bytes], context: Any) -> Any:
            key = self.watchdog.watch(context.cancel, method, self.stall, self.stall)
            try:
                raw = next(requests, None)
            finally:
                self.watchdog.done(key)
            return behaviour(_parse(parse, raw, method, context), context)

        return check


def _parse(parse: Callable[[bytes], Any], raw: bytes | None, method: str, context: Any) -> Any:
    try:
        if raw is None:
            raise ValueError("no request")
        return parse(raw)
    except Exception:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request")
        raise AssertionError("context.abort returned") from None  # pragma: no cover


def _decoded(
    behaviour: Callable[..., Any], parse: Callable[[bytes], Any], method: str
) -> Callable[..., Any]:
    """A raw-bytes unary-stream behaviour that decodes, keeping gRPC's non-blocking
    calling convention (health Watch holds no thread while it waits)."""

    def watch(raw: bytes, context: Any, send_response_callback: Any = None) -> Any:
        request = _parse(parse, raw, method, context)
        if send_response_callback is None:
            return behaviour(request, context)
        return behaviour(request, context, send_response_callback=send_response_callback)

    non_blocking = getattr(behaviour, "experimental_non_blocking", False)
    watch.experimental_non_blocking = non_blocking  # type: ignore[attr-defined]
    if hasattr(behaviour, "experimental_thread_pool"):
        watch.experimental_thread_pool = behaviour.experimental_thread_pool  # type: ignore[attr-defined]
    return watch
