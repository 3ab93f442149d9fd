"""The login socket of `[security] local_isolation = "uid"`: who is calling, proven.

grpc-python cannot tell a handler who calls on a unix socket (`context.peer()` is just
"unix:" and the auth context has no uid). So a small socket beside the control socket,
`<socket>.login`, answers every connection with a random session token bound to the
connecting uid, which the kernel reports with SO_PEERCRED; clients send the token as
`x-tierckpt-session` metadata on every DaemonService call (tierckpt.endpoint). Tokens
live only in this process: a restarted daemon issues new ones and clients log in again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from tierckpt.endpoint import LOGIN_GREETING, LOGIN_SUFFIX

__all__ = ["LoginServer", "Sessions", "login_path_for"]

logger = logging.getLogger(__name__)

SESSION_TTL = 24 * 3600.0
MAX_SESSIONS = 65536
# A uid that logs in in a loop evicts only its own oldest sessions, never another uid's.
MAX_SESSIONS_PER_UID = 1024
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def login_path_for(socket_path: Path) -> Path:
    """The login socket that belongs to a control socket."""
    return socket_path.with_name(socket_path.name + LOGIN_SUFFIX)


class Sessions:
    """Session token -> uid, in memory only: bounded (LRU, per uid and in all) and each
    token valid for `ttl` seconds from its issue."""

    def __init__(
        self,
        *,
        ttl: float = SESSION_TTL,
        max_sessions: int = MAX_SESSIONS,
        max_per_uid: int = MAX_SESSIONS_PER_UID,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl, self.max_sessions, self.max_per_uid = ttl, max_sessions, max_per_uid
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._by_uid: dict[int, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)

    def _drop(self, token: str) -> None:
        uid, _ = self._tokens.pop(token)
        mine = self._by_uid[uid]
        del mine[token]
        if not mine:
            del self._by_uid[uid]

    def issue(self, uid: int) -> str:
        """A new token for `uid`, evicting that uid's least recently used one at its bound
        and then the least recently used of all at the global bound."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            mine = self._by_uid.setdefault(uid, OrderedDict())
            while len(mine) >= self.max_per_uid:
                self._drop(next(iter(mine)))
            while len(self._tokens) >= self.max_sessions:
                self._drop(next(iter(self._tokens)))
            self._tokens[token] = (uid, self._clock() + self.ttl)
            self._by_uid.setdefault(uid, mine)[token] = None
        return token

    def uid_of(self, token: str) -> int | None:
        """The uid `token` was issued to, or None (unknown, evicted or expired)."""
        with self._lock:
            entry = self._tokens.get(token)
            if entry is None:
                return None
            uid, expires = entry
            if self._clock() >= expires:
                self._drop(token)
                return None
            self._tokens.move_to_end(token)
            self._by_uid[uid].move_to_end(token)
            return uid


class LoginServer:
    """The login socket: one thread accepts, reads the peer's uid with SO_PEERCRED, and
    writes back `tierckpt-session 1 <token>`. It never reads from the caller, so a caller
    cannot stall it; the reply fits in the socket buffer."""

    def __init__(self, path: Path, sessions: Sessions, *, mode: int = 0o660) -> None:
        self.path = path
        self.sessions = sessions
        self.mode = mode
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve. The caller owns the path (it claimed the control socket)."""
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # bind() creates the file with this mode minus the umask: never wider than
            # owner-only, so there is no window in which anyone else may connect.
            os.fchmod(sock.fileno(), 0o600)
            sock.bind(str(self.path))
            os.chmod(self.path, self.mode)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="tierckptd-login", daemon=True)
        self._thread.start()
        logger.info("login socket %s (local_isolation)", self.path)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            ready, _, _ = select.select([self._sock, self._wake_r], [], [])
            if self._stopping.is_set():
                return
            if self._sock not in ready:
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                logger.warning("login socket %s: accept failed: %s", self.path, e)
                time.sleep(0.05)
                continue
            with conn:
                try:
                    conn.settimeout(1.0)
                    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                    _, uid, _ = _UCRED.unpack(raw)
                    token = self.sessions.issue(uid)
                    conn.sendall(f"{LOGIN_GREETING} {token}\n".encode())
                except OSError as e:
                    logger.debug("login socket %s: %s", self.path, e)

    def stop(self) -> None:
        """Stop serving and remove the socket file (outstanding tokens die with us)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread is not None:
            self._thread.join(5.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.path.unlink(missing_ok=True)
        self._wake_r.close()
        self._wake_w.close()
