"""grpc.health.v1 wiring: SERVING only once the memory tier is adopted.

Probes (systemd scripts, Kubernetes grpc probes on the peer port) then tell a daemon
that is still re-hashing its memory tier apart from one that can take saves. Each
listener reports the overall status ("") and the service it really serves: the local
socket `tierckpt.v1.DaemonService`, the peer port `tierckpt.v1.PeerService` (a probe asking
the peer port for DaemonService gets NOT_FOUND: that port refuses it).
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["DAEMON_SERVICE", "PEER_SERVICE", "Health"]

DAEMON_SERVICE = "tierckpt.v1.DaemonService"
PEER_SERVICE = "tierckpt.v1.PeerService"


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

    def add_to(self, server: Any, *, peer: bool = False) -> None:
        """Serve health on `server`: the peer listener's (`peer`) or the local one's."""
        health_pb2_grpc.add_HealthServicer_to_server(self._peer if peer else self._local, server)

    def serving(self) -> None:
        for servicer, names in self._services.items():
            for name in names:
                servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def shutting_down(self) -> None:
        """Every service NOT_SERVING; later `set` calls are ignored by grpc_health."""
        for servicer in self._services:
            servicer.enter_graceful_shutdown()
