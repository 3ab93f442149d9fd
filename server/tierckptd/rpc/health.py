"""grpc.health.v1 wiring: SERVING only once the memory tier is adopted.

Probes (systemd scripts, Kubernetes grpc probes on the peer port) then tell a daemon
that is still re-hashing its memory tier apart from one that can take saves.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["DAEMON_SERVICE", "Health"]

DAEMON_SERVICE = "tierckpt.v1.DaemonService"
_SERVICES = ("", DAEMON_SERVICE)


class Health:
    """One HealthServicer shared by the local and the peer server."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer(experimental_non_blocking=True)
        for name in _SERVICES:
            self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def add_to(self, server: Any) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def serving(self) -> None:
        for name in _SERVICES:
            self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def shutting_down(self) -> None:
        """Every service NOT_SERVING; later `set` calls are ignored by grpc_health."""
        self.servicer.enter_graceful_shutdown()
