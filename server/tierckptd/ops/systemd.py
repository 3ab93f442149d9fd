"""sd_notify with the standard library only; a no-op outside systemd.

READY=1 is sent after the sockets are bound and the memory tier is adopted, so
`systemctl start` returns only once saves can succeed (Type=notify).
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["sd_notify"]

logger = logging.getLogger(__name__)


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=...") to $NOTIFY_SOCKET; False if unset."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            sock.sendall(state.encode())
    except OSError as e:
        logger.warning("sd_notify(%r) failed: %s", state, e)
        return False
    return True
