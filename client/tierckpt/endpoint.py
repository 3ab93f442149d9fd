"""Where the local daemon listens, the channel options every client uses, and the
session login of a daemon that isolates jobs by uid.

With `[security] local_isolation = "uid"` the daemon serves a login socket beside its
control socket (`<socket>.login`): connecting there returns a session token bound to the
caller's uid (the daemon reads it with SO_PEERCRED), which every DaemonService call then
carries as `x-tierckpt-session` metadata. A daemon without isolation has no login socket
and no token is sent. One login per process and socket; a token the daemon no longer
knows (it restarted) is replaced by a new login, once per call, transparently.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc

__all__ = [
    "DAEMON_ENV",
    "DEFAULT_DAEMON_ADDRESS",
    "LOGIN_GREETING",
    "LOGIN_SUFFIX",
    "SESSION_METADATA",
    "login",
    "login_path",
    "open_channel",
    "resolve_daemon_address",
]

logger = logging.getLogger(__name__)

DAEMON_ENV = "TIERCKPT_DAEMON"
DEFAULT_DAEMON_ADDRESS = "unix:///run/tierckpt/tierckptd.sock"
MAX_MESSAGE_BYTES = 64 << 20
SESSION_METADATA = "x-tierckpt-session"
LOGIN_SUFFIX = ".login"
LOGIN_GREETING = "tierckpt-session 1"
LOGIN_TIMEOUT_S = 5.0

# Retry only UNAVAILABLE, briefly: a daemon that is restarting comes back within seconds,
# a daemon that is gone should fail the save promptly rather than hang the job.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "tierckpt.v1.DaemonService"}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def resolve_daemon_address(daemon: str | None = None) -> str:
    """The explicit address, else ``$TIERCKPT_DAEMON``, else the default unix socket."""
    address = daemon or os.environ.get(DAEMON_ENV) or DEFAULT_DAEMON_ADDRESS
    if address.startswith("/"):
        address = f"unix://{address}"
    return address


def login_path(address: str) -> str | None:
    """The login socket beside a unix-socket daemon address (None for TCP)."""
    for prefix in ("unix://", "unix:"):
        if address.startswith(prefix):
            path = address[len(prefix) :]
            return os.path.abspath(path) + LOGIN_SUFFIX if path else None
    return None


def login(path: str, timeout: float = LOGIN_TIMEOUT_S) -> str | None:
    """A new session token from the login socket at `path`; None when there is none to
    log in to (no socket, nobody listening, or not allowed to connect: the daemon then
    answers UNAUTHENTICATED with the fix)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            data = b""
            while len(data) < 256 and (chunk := sock.recv(256)):
                data += chunk
        except OSError as e:
            logger.debug("no tierckptd session from %s: %s", path, e)
            return None
    head, _, token = data.decode("ascii", "replace").strip().rpartition(" ")
    return token if head == LOGIN_GREETING and token else None


_SESSIONS: dict[tuple[int, int, str], str] = {}
_SESSIONS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A fork while another thread logs in must not leave the child a held lock."""
    global _SESSIONS_LOCK
    _SESSIONS_LOCK = threading.Lock()
    _SESSIONS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _session(path: str, stale: str | None = None) -> str | None:
    """This process's token for `path`: cached per (pid, euid), so a forked child or a
    process that changed its uid logs in as itself; `stale` is a token the daemon refused."""
    key = (os.getpid(), os.geteuid(), path)
    with _SESSIONS_LOCK:
        token = _SESSIONS.get(key)
        if token is not None and token != stale:
            return token
        _SESSIONS.pop(key, None)
        if not os.path.exists(path):
            return None
        token = login(path)
        if token is not None:
            _SESSIONS[key] = token
        return token


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,  # type: ignore[misc]
):
    """The details of a call with our metadata (grpc's own class cannot be built)."""


class _SessionInterceptor(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds the session token to each call; on UNAUTHENTICATED logs in again and retries
    once (a restarted daemon forgot our token)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @staticmethod
    def _with(details: Any, token: str | None) -> Any:
        metadata = [(k, v) for k, v in details.metadata or () if k != SESSION_METADATA]
        if token is not None:
            metadata.append((SESSION_METADATA, token))
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], details: Any, request: Any
    ) -> Any:
        token = _session(self.path)
        outcome = continuation(self._with(details, token), request)
        if outcome.code() == grpc.StatusCode.UNAUTHENTICATED:
            fresh = _session(self.path, stale=token)
            if fresh is not None and fresh != token:
                outcome = continuation(self._with(details, fresh), request)
        return outcome


def open_channel(address: str) -> grpc.Channel:
    """An insecure channel (local unix socket or loopback TCP) with our limits and retries;
    on a unix socket, calls carry a session when the daemon has a login socket."""
    channel = grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            # A restarted daemon (systemd, a kill -9) is back within a second or two: retry
            # the connection at most every second, not gRPC's default of up to 120 s, and
            # keep this channel's reconnect backoff its own (channels to one address share
            # it by default, so a new client would inherit an old one's long wait).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )
    path = login_path(address)
    if path is None:
        return channel
    return grpc.intercept_channel(channel, _SessionInterceptor(path))
