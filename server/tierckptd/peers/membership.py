"""Who the cluster is: this node, its peers (the static `[[peers]]` and those discovered,
`peers/peer_discovery.py`), the copy count, one channel per peer (reopened when its
address changes).

A member channel carries the cluster token; with mutual TLS it also checks, at every
handshake, that the server's certificate names the member's node id (a DNS
subjectAltName), so a member's address taken over by another node gets no token and no
data. A Hello goes over a channel without the token (`hello_channel`, `open_channel`):
it proves the token by challenge-response (`security.HelloChallenge`). A Hello from a
node that is not a member wakes discovery (`stranger`), rate-limited: one claimed id
at most every STRANGER_BACKOFF seconds (doubling, up to STRANGER_BACKOFF_MAX), and any
stranger at most every STRANGER_GAP seconds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from tierckptd.config import PeerConfig
from tierckptd.ops.events import Listeners
from tierckptd.peers.placement import Member, replica_count
from tierckptd.peers.security import PeerChannels, node_client_interceptor

__all__ = [
    "MAX_STRANGERS",
    "PEER_CHANNEL_OPTIONS",
    "STRANGER_BACKOFF",
    "STRANGER_BACKOFF_MAX",
    "STRANGER_GAP",
    "ChannelFactory",
    "Membership",
]

logger = logging.getLogger(__name__)

ChannelFactory = Callable[[str], grpc.Channel]

PEER_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    # A peer that restarts must be reachable again within a second, not after gRPC's
    # default reconnect backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# A stranger's Hello (a node that is no member yet) makes discovery run a round: any
# stranger at most every STRANGER_GAP seconds, one claimed id again only after
# STRANGER_BACKOFF seconds, doubling up to STRANGER_BACKOFF_MAX (claimed ids remembered:
# at most MAX_STRANGERS). A flood of Hellos costs the members a bounded number of rounds.
STRANGER_GAP = 5.0
STRANGER_BACKOFF = 10.0
STRANGER_BACKOFF_MAX = 300.0
MAX_STRANGERS = 1024


class Membership:
    """The members of this node's cluster and a channel to each peer (thread-safe)."""

    def __init__(
        self,
        node_id: str,
        failure_domain: str = "",
        *,
        peers: Iterable[PeerConfig] = (),
        copies: int = 1,
        channel_factory: ChannelFactory = grpc.insecure_channel,
    ) -> None:
        self.node_id = node_id
        self.failure_domain = failure_domain
        self._factory = channel_factory
        # The cluster token (Hello's challenge-response), and whether a peer's server
        # certificate must name its node id (mutual TLS): from the channel factory.
        channels = channel_factory if isinstance(channel_factory, PeerChannels) else None
        self.hello_key: bytes | None = channels.token if channels is not None else None
        self.verifies_names = channels is not None and channels.verify_names
        self._lock = threading.Lock()
        self._peers: dict[str, PeerConfig] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._hello_channels: dict[str, grpc.Channel] = {}
        # Claimed id -> (when it may wake discovery again, its back-off).
        self._strangers: dict[str, tuple[float, float]] = {}
        self._last_stranger = float("-inf")
        self._members: list[Member] = [Member(node_id, failure_domain)]
        self._copies = copies
        self._k = 0
        # Called with the claimed id when a node that is not a member says Hello (it is
        # joining): discovery runs a round now rather than at the next refresh.
        self.strangers: Listeners[[str]] = Listeners()
        # Told the number of peers after every `configure` (the commit coordinator asks
        # the peer tier only while there are some).
        self.resized: Listeners[[int]] = Listeners()
        self.configure(peers, copies)

    def configure(self, peers: Iterable[PeerConfig], copies: int) -> int:
        """Apply a (re)loaded peer list and copy count (channels to changed peers are
        closed, reopened on next use); returns k, the extra copies per file."""
        peers = [p for p in peers if p.id != self.node_id]
        with self._lock:
            new = {p.id: p for p in peers}
            for node, old in self._peers.items():
                if node not in new or new[node].address != old.address:
                    for channels in (self._channels, self._hello_channels):
                        channel = channels.pop(node, None)
                        if channel is not None:
                            channel.close()
            for node in new:
                self._strangers.pop(node, None)
            self._peers = new
            self._copies = copies
            self._members = [
                Member(self.node_id, self.failure_domain),
                *(Member(p.id, p.failure_domain) for p in peers),
            ]
            k = self._k = replica_count(copies, self._members)
        ids = sorted(new)
        more = f", and {len(ids) - 20} more" if len(ids) > 20 else ""  # bounded: 4,096 members
        logger.info(
            "membership: %d peers (%s%s), %d extra copies per file",
            len(new),
            ", ".join(ids[:20]) or "none",
            more,
            k,
        )
        self.resized(len(new))
        return k

    @property
    def replica_target(self) -> int:
        """k: the extra copies every file should have (copies, capped by membership)."""
        with self._lock:
            return self._k

    @property
    def peer_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    @property
    def members(self) -> set[str]:
        """Node ids of the cluster: this node and its configured peers."""
        with self._lock:
            return {self.node_id, *self._peers}

    def member_list(self) -> list[Member]:
        """The members with their failure domains, this node first (for placement)."""
        with self._lock:
            return list(self._members)

    def _open(self, address: str, *, token: bool, server_name: str = "") -> grpc.Channel:
        factory = self._factory
        if isinstance(factory, PeerChannels):
            channel = factory.open(address, token=token, server_name=server_name)
        else:
            channel = factory(address)  # a plain factory (tests): no token, no TLS names
        return grpc.intercept_channel(channel, node_client_interceptor(self.node_id))

    def _server_name(self, node: str) -> str:
        return node if self.verifies_names else ""

    def channel(self, node: str) -> grpc.Channel | None:
        """The channel to a configured peer (opened on first use), None for anyone else:
        it carries the token, and with mutual TLS accepts only a server whose
        certificate names `node`."""
        with self._lock:
            peer = self._peers.get(node)
            if peer is None:
                return None
            channel = self._channels.get(node)
            if channel is None:
                channel = self._channels[node] = self._open(
                    peer.address, token=True, server_name=self._server_name(node)
                )
            return channel

    def hello_channel(self, node: str) -> grpc.Channel | None:
        """A channel without the token to a member, for its Hello each round (opened on
        first use; with mutual TLS the server's certificate must name `node`)."""
        with self._lock:
            peer = self._peers.get(node)
            if peer is None:
                return None
            channel = self._hello_channels.get(node)
            if channel is None:
                channel = self._hello_channels[node] = self._open(
                    peer.address, token=False, server_name=self._server_name(node)
                )
            return channel

    def address_of(self, node: str) -> str | None:
        """The address this node calls `node` at; None for a non-member."""
        with self._lock:
            peer = self._peers.get(node)
            return None if peer is None else peer.address

    def open_channel(self, address: str, server_name: str = "") -> grpc.Channel:
        """A new channel to `address` without the token (the caller closes it): for a
        Hello to an address that has not proven who answers there; `server_name`: with
        TLS, the name the server's certificate must carry (default: the address's)."""
        return self._open(address, token=False, server_name=server_name)

    def stranger(self, node: str) -> None:
        """A node that is not a member said Hello: tell `strangers`, if any listens,
        within the rate limits (STRANGER_GAP, STRANGER_BACKOFF per claimed id)."""
        hook = self.strangers
        if not hook:
            return
        now = time.monotonic()
        with self._lock:
            if node in self._peers or node == self.node_id:
                return
            allowed, backoff = self._strangers.get(node, (0.0, STRANGER_BACKOFF / 2))
            if now < allowed or now - self._last_stranger < STRANGER_GAP:
                return
            if node not in self._strangers and len(self._strangers) >= MAX_STRANGERS:
                self._strangers = {n: v for n, v in self._strangers.items() if v[0] > now}
                if len(self._strangers) >= MAX_STRANGERS:
                    return  # a flood of claimed ids: the regular rounds find a joiner
            backoff = min(backoff * 2, STRANGER_BACKOFF_MAX)
            self._strangers[node] = (now + backoff, backoff)
            self._last_stranger = now
        hook(node)

    def close(self) -> None:
        with self._lock:
            for channels in (self._channels, self._hello_channels):
                for channel in channels.values():
                    channel.close()
                channels.clear()
