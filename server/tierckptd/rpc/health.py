"""grpc.health.v1 wiring: SERVING only once the memory tier is adopted.

Probes (systemd scripts, Kubernetes grpc probes on the peer port) then tell a daemon
that is still re-hashing its memory tier apart from one that can take saves. Each
listener reports the overall status ("") and the service it really serves: the local
socket `tierckpt.v1.DaemonService`, the peer port `tierckpt.v1.PeerService` (a probe asking
the peer port for DaemonService gets NOT_FOUND: that port refuses it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["DAEMON_SERVICE", "PEER_SERVICE", "PROBE_TIMEOUT", "Health", "probe"]

PROBE_TIMEOUT = 3.0

DAEMON_SERVICE = "tierckpt.v1.DaemonService"
PEER_SERVICE = "tierckpt.v1.PeerService"
HEALTH_SERVICE = "grpc.health.v1.Health"


def _on_pool(behaviour: Callable[[Any, Any], Any], pool: Executor) -> Callable[[Any, Any], Any]:
    """`behaviour` as a handler grpc runs on `pool` (grpc's per-handler
    `experimental_thread_pool`) instead of the server's own threads."""

    def handler(request: Any, context: Any) -> Any:
        return behaviour(request, context)

    setattr(handler, "experimental_thread_pool", pool)  # noqa: B010 (a function attribute)
    return handler


class Health:
    """The health services of the local and the peer listener, switched together."""

    def __init__(self) -> None:
        self._local = self._servicer(("", DAEMON_SERVICE))
        self._peer = self._servicer(("", PEER_SERVICE))
        self._services = {self._local: ("", DAEMON_SERVICE), self._peer: ("", PEER_SERVICE)}

    @staticmethod
    def _servicer(names: tuple[str, ...]) -> Any:
        servicer = health.HealthServicer(experimental_non_blocking=True)
        for name in names:
            servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        return servicer

    def add_to(self, server: Any, *, peer: bool = False, pool: Executor | None = None) -> None:
        """Serve health on `server`: the peer listener's (`peer`) or the local one's.

        With `pool` its Check runs on those threads, not the server's: a pool saturated by
        slow calls (a silent S3, audit 3 H7) never fails the liveness probe."""
        servicer = self._peer if peer else self._local
        if pool is None:
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            return
        check = _on_pool(servicer.Check, pool)
        handlers = {
            "Check": grpc.unary_unary_rpc_method_handler(
                check,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                servicer.Watch,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(HEALTH_SERVICE, handlers),)
        )
        server.add_registered_method_handlers(HEALTH_SERVICE, handlers)

    def serving(self) -> None:
        for servicer, names in self._services.items():
            for name in names:
                servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def shutting_down(self) -> None:
        """Every service NOT_SERVING; later `set` calls are ignored by grpc_health."""
        for servicer in self._services:
            servicer.enter_graceful_shutdown()


def probe(address: str, timeout: float = PROBE_TIMEOUT) -> int:
    """`tierckptd --probe`: exit status of a health check against the daemon's local
    `address` (0 when SERVING), for exec probes (Kubernetes' gRPC probes cannot speak
    TLS)."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
    except grpc.RpcError as e:
        print(f"tierckptd --probe: {address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"tierckptd --probe: {address} is {status}", file=sys.stderr)
        return 1
    return 0
