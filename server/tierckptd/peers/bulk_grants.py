"""One-use grants for bulk transfers: what a GrantFetch control call hands out and a
bulk connection redeems (`bulk_server`).

A grant is 32 bytes from `secrets` (unguessable), valid for GRANT_TTL seconds, taken
out of the table by its first use, whether that use succeeds or not (a replayed or
guessed grant finds nothing). It is bound to the caller the control call authorized
(its node id and, without mutual TLS, the IP address it called from), the file and the
byte range: the data connection must name the same, and is refused otherwise. Only
the SHA-256 of a grant is kept, so the table's lookups leak nothing about the grants.

The table is bounded (MAX_GRANTS outstanding), and so are the transfers: at most
`send_slots` sends are granted or running at once on this node; another GrantFetch is
answered busy (RESOURCE_EXHAUSTED), and the fetcher asks another holder (`restore`
spreads a wave of restores over every node that holds the file).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from tierckpt.errors import PermissionDenied, TierckptError

__all__ = [
    "GRANT_BYTES",
    "GRANT_TTL",
    "MAX_GRANTS",
    "SEND_SLOTS",
    "Grant",
    "Grants",
    "SendersBusy",
]

GRANT_BYTES = 32
# Seconds between the grant and the connection that uses it (the fetcher connects at once).
GRANT_TTL = 10.0
MAX_GRANTS = 1024
# Bulk sends granted or running on this node at once. Few: a holder serving more
# streams only splits its bandwidth further, while a busy answer sends the fetcher to
# another holder (fan-out; docs/peer-bulk.md).
SEND_SLOTS = 4


@dataclass(frozen=True)
class Grant:
    """What one grant allows: `peer` (the node id the control call authorized) fetching
    `length` bytes of `namespace/checkpoint_id/name` from `offset`; `address` is the IP
    the control call came from ("" when it is not bound to one: mutual TLS binds the
    node id instead); `background`: a replication copy, sent at background priority."""

    peer: str
    address: str
    namespace: str
    checkpoint_id: str
    name: str
    offset: int
    length: int
    expires: float
    background: bool = False


class SendersBusy(TierckptError):
    """This node runs its limit of bulk sends: ask another holder, or again soon."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def _key(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class Grants:
    """The grants this node handed out and the sends it runs (see the module docstring)."""

    def __init__(
        self,
        *,
        ttl: float = GRANT_TTL,
        send_slots: int = SEND_SLOTS,
        max_grants: int = MAX_GRANTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.send_slots = send_slots
        self.max_grants = max_grants
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[bytes, Grant] = {}
        self._sending = 0

    def _prune(self, now: float) -> None:
        for key in [k for k, g in self._grants.items() if g.expires <= now]:
            del self._grants[key]

    def issue(
        self,
        peer: str,
        address: str,
        namespace: str,
        checkpoint_id: str,
        name: str,
        offset: int,
        length: int,
        background: bool = False,
    ) -> bytes:
        """A new grant (SendersBusy when this node is at its send slots: busy)."""
        now = self._clock()
        with self._lock:
            self._prune(now)
            if len(self._grants) + self._sending >= min(self.send_slots, self.max_grants):
                raise SendersBusy(
                    f"busy: {self._sending} bulk sends running and {len(self._grants)} granted "
                    f"(at most {self.send_slots}); ask another holder, or retry"
                )
            token = secrets.token_bytes(GRANT_BYTES)
            self._grants[_key(token)] = Grant(
                peer,
                address,
                namespace,
                checkpoint_id,
                name,
                offset,
                length,
                now + self.ttl,
                background,
            )
            return token

    def redeem(self, token: bytes) -> Grant:
        """The grant `token` names, taken out of the table (one use), and a send slot
        taken for it (give it back with `done`). PermissionDenied when it is unknown,
        used or expired, all alike."""
        now = self._clock()
        with self._lock:
            grant = self._grants.pop(_key(token), None) if len(token) == GRANT_BYTES else None
            if grant is None or grant.expires <= now:
                raise PermissionDenied(
                    "bulk transfer refused: the grant is unknown, used or expired"
                )
            self._sending += 1
            return grant

    def done(self) -> None:
        """A send that `redeem` started is over."""
        with self._lock:
            self._sending -= 1

    @property
    def outstanding(self) -> int:
        with self._lock:
            self._prune(self._clock())
            return len(self._grants)

    @property
    def sending(self) -> int:
        with self._lock:
            return self._sending
