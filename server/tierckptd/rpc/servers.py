"""gRPC servers of the daemon: the local control socket and the peer listener.

DaemonService is served only on `listen.local` (a unix socket by default, whose file mode
is the access control); the peer listener serves PeerService and health (which names
PeerService there, never DaemonService), so the control plane is never reachable from the
network by accident.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tierckptd.peers.security import PeerServerSecurity
from tierckptd.rpc.daemon_service import DaemonService, add_daemon_service
from tierckptd.rpc.health import Health
from tierckptd.rpc.local_login import LoginServer, login_path_for
from tierckptd.rpc.peer_counter import PeerRpcCounter
from tierckptd.rpc.peer_guard import HealthGuard
from tierckptd.rpc.peer_service import WORKERS as PEER_SERVICE_WORKERS

__all__ = ["AddressInUse", "Servers", "parse_local", "start_servers"]

logger = logging.getLogger(__name__)

MAX_MESSAGE = 64 << 20
HEALTH_WORKERS = 2  # the local socket's health checks have these threads to themselves
SOCKET_MODE = 0o660  # the daemon's group may connect (the file mode is the access control)
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    # Without this a second daemon could bind the same TCP port and silently share it.
    ("grpc.so_reuseport", 0),
]


# The peer listener: the largest message it takes is a published manifest (16 digest
# bytes per block: a 4 TiB checkpoint in 1 MiB blocks is 64 MiB); a pushed chunk is one
# block (at most wire.MAX_BLOCK_SIZE). Dead connections are found by keepalive pings,
# idle ones closed; calls queued beyond PEER_MAX_RPCS are refused at once.
PEER_WORKERS = PEER_SERVICE_WORKERS
PEER_MAX_RPCS = 256
PEER_OPTIONS = [
    *OPTIONS,
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_concurrent_streams", 64),
]


class AddressInUse(RuntimeError):
    """Another process (most likely another tierckptd) answers on our address."""


def parse_local(address: str) -> tuple[str, Path | None]:
    """(grpc bind address, unix socket path or None) of a `listen.local` value.

    Accepts "unix:///abs/path", "unix:/abs/path", "unix:relative" and "host:port".
    """
    if address.startswith("unix://"):
        path = Path(address[len("unix://") :])
    elif address.startswith("unix:"):
        path = Path(address[len("unix:") :])
    else:
        return address, None
    path = path.absolute()
    return f"unix:{path}", path


def _claim_socket_path(path: Path, address: str) -> None:
    """Create the socket's dir; remove a stale socket file only if nothing answers on it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.exists() or path.is_symlink()):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
                raise
        else:
            raise AddressInUse(
                f"another tierckptd is serving {address}; stop it first or set [listen] local "
                "to another socket"
            )
    logger.info("removing stale socket %s", path)
    path.unlink(missing_ok=True)


@dataclass
class Servers:
    local: Any
    peer: Any | None
    local_address: str
    socket_path: Path | None
    peer_port: int | None
    login: LoginServer | None = None  # [security] local_isolation's login socket

    def stop(self, grace: float) -> None:
        """Stop both servers, letting in-flight RPCs finish for up to `grace` seconds."""
        if self.login is not None:
            self.login.stop()
        events = [s.stop(grace) for s in (self.local, self.peer) if s is not None]
        for event in events:
            event.wait(grace + 5)
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)


def _bind(server: Any, address: str, what: str) -> int:
    try:
        port = int(server.add_insecure_port(address))
    except RuntimeError as e:
        raise AddressInUse(f"cannot bind {what} {address}: {e}") from e
    if port == 0:
        raise AddressInUse(f"cannot bind {what} {address} (in use, or an invalid address)")
    return port


def _bind_unix(server: Any, address: str, path: Path) -> None:
    """Bind the control socket under umask 0177, then open it to the group: grpc creates
    the socket file when it binds, and under a lax umask it would be world-connectable
    until a later chmod (audit L4)."""
    old_umask = os.umask(0o177)
    try:
        _bind(server, address, "[listen] local")
    finally:
        os.umask(old_umask)
    os.chmod(path, SOCKET_MODE)


def _bind_peer(server: Any, address: str, security: PeerServerSecurity) -> int:
    if security.credentials is None:
        return _bind(server, address, "[listen] peer")
    try:
        port = int(server.add_secure_port(address, security.credentials))
    except RuntimeError as e:
        raise AddressInUse(f"cannot bind [listen] peer {address}: {e}") from e
    if port == 0:
        raise AddressInUse(f"cannot bind [listen] peer {address} (in use, or an invalid address)")
    return port


def start_servers(
    daemon: DaemonService,
    health: Health,
    local: str,
    peer: str,
    *,
    workers: int = 32,
    register_peer: Callable[[Any], object] | None = None,
    peer_security: PeerServerSecurity | None = None,
) -> Servers:
    """Bind and start the servers; `daemon` (DaemonService) on `local`, health on both,
    and what `register_peer` adds (PeerService) on `peer`, behind `peer_security` (TLS,
    token). With the servicer's `access` (local_isolation), a login socket beside `local`
    issues the sessions DaemonService checks."""
    access = daemon.access
    grpc_local, socket_path = parse_local(local)
    if access is not None and socket_path is None:
        raise ValueError("local_isolation needs [listen] local to be a unix socket")
    if socket_path is not None:
        _claim_socket_path(socket_path, local)
        # Ours now; a stale login socket would only make clients try to log in.
        login_path_for(socket_path).unlink(missing_ok=True)
    local_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierckptd-rpc"),
        options=OPTIONS,
    )
    add_daemon_service(daemon, local_server)
    # Health's Check on threads of its own: however long DaemonService calls take (a
    # silent S3 under restores, audit 3 H7), the liveness probe is answered.
    health_pool = futures.ThreadPoolExecutor(
        max_workers=HEALTH_WORKERS, thread_name_prefix="tierckptd-health"
    )
    health.add_to(local_server, pool=health_pool)
    if socket_path is not None:
        _bind_unix(local_server, grpc_local, socket_path)
    else:
        _bind(local_server, grpc_local, "[listen] local")
    peer_server, peer_port = None, None
    if peer:
        security = peer_security or PeerServerSecurity()
        # PeerService admits at most peer_service.MAX_IN_FLIGHT calls, so the rest of the
        # threads stay free for health (the liveness probe's) whatever peers do.
        peer_server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=PEER_WORKERS, thread_name_prefix="tierckptd-peer"
            ),
            options=PEER_OPTIONS,
            interceptors=[*security.interceptors, HealthGuard(), PeerRpcCounter()],
            maximum_concurrent_rpcs=PEER_MAX_RPCS,
        )
        health.add_to(peer_server, peer=True)
        if register_peer is not None:
            register_peer(peer_server)
        peer_port = _bind_peer(peer_server, peer, security)
    login = None
    if access is not None and socket_path is not None:
        login = LoginServer(login_path_for(socket_path), access.sessions, mode=SOCKET_MODE)
        login.start()
    local_server.start()
    if peer_server is not None:
        peer_server.start()
    logger.info("serving DaemonService on %s", grpc_local)
    if peer_port is not None:
        logger.info("peer listener on %s (bound port %d)", peer, peer_port)
    return Servers(local_server, peer_server, grpc_local, socket_path, peer_port, login)
