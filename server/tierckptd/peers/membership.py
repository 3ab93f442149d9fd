"""Who the cluster is: this node, its peers (the static `[[peers]]` and those discovered,
`peers/member_sources.py`), the copy count, one channel per peer (reopened when its
address changes)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from tierckptd.config import PeerConfig
from tierckptd.peers.placement import Member, replica_count
from tierckptd.peers.security import node_client_interceptor

__all__ = ["PEER_CHANNEL_OPTIONS", "ChannelFactory", "Membership"]

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
        self._lock = threading.Lock()
        self._peers: dict[str, PeerConfig] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._members: list[Member] = [Member(node_id, failure_domain)]
        self._copies = copies
        self._k = 0
        # Called with the claimed id when a node that is not a member says Hello (it is
        # joining): discovery runs a round now rather than at the next refresh.
        self.on_stranger: Callable[[str], None] | None = None
        self.configure(peers, copies)

    def configure(self, peers: Iterable[PeerConfig], copies: int) -> int:
        """Apply a (re)loaded peer list and copy count (channels to changed peers are
        closed, reopened on next use); returns k, the extra copies per file."""
        peers = [p for p in peers if p.id != self.node_id]
        with self._lock:
            new = {p.id: p for p in peers}
            for node, old in self._peers.items():
                if node not in new or new[node].address != old.address:
                    channel = self._channels.pop(node, None)
                    if channel is not None:
                        channel.close()
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

    def channel(self, node: str) -> grpc.Channel | None:
        """The channel to a configured peer (opened on first use), None for anyone else."""
        with self._lock:
            peer = self._peers.get(node)
            if peer is None:
                return None
            channel = self._channels.get(node)
            if channel is None:
                channel = self._channels[node] = grpc.intercept_channel(
                    self._factory(peer.address), node_client_interceptor(self.node_id)
                )
            return channel

    def address_of(self, node: str) -> str | None:
        """The address this node calls `node` at; None for a non-member."""
        with self._lock:
            peer = self._peers.get(node)
            return None if peer is None else peer.address

    def open_channel(self, address: str) -> grpc.Channel:
        """A new channel to `address` with this node's credentials (the caller closes it):
        for a Hello to an address no member is known at yet."""
        return grpc.intercept_channel(self._factory(address), node_client_interceptor(self.node_id))

    def stranger(self, node: str) -> None:
        """A node that is not a member said Hello (`on_stranger`, if set)."""
        hook = self.on_stranger
        if hook is not None and node not in self.members:
            hook(node)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
