"""Where the local daemon listens, and the channel options every client uses."""

from __future__ import annotations

import json
import os

import grpc

__all__ = ["DAEMON_ENV", "DEFAULT_DAEMON_ADDRESS", "open_channel", "resolve_daemon_address"]

DAEMON_ENV = "TIERCKPT_DAEMON"
DEFAULT_DAEMON_ADDRESS = "unix:///run/tierckpt/tierckptd.sock"
MAX_MESSAGE_BYTES = 64 << 20

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


def open_channel(address: str) -> grpc.Channel:
    """An insecure channel (local unix socket or loopback TCP) with our limits and retries."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
        ],
    )
