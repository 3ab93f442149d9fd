"""Threads and processes of the test process placed in a testbed node's network namespace.

A network namespace is a property of a thread on Linux (`setns(2)`), and a socket stays in
the namespace of the thread that made it; threads inherit their creator's namespace. So a
server started from a thread that entered node k's namespace (moto, in bench/net_chaos.py)
listens on node k's address, and a client whose connections are made by such a thread
(fsspec's event-loop thread, when that thread starts it) reaches it, while the rest of the
process stays in the host's namespace, where the testbed's `ip`/`tc` commands must run.
Python 3.11 has no `os.setns`, hence libc's, through ctypes.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["NetnsThread", "enter_netns"]

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"  # where `ip netns add` binds its namespaces


def enter_netns(netns: str) -> None:
    """Move the calling thread into the named network namespace (`ip netns` name)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class NetnsThread:
    """One worker thread living in `netns`: `call(fn, *args)` runs `fn` there and returns
    its value (threads `fn` starts are in `netns` too)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"netns-{netns}", initializer=enter_netns, initargs=(netns,)
        )

    def call(self, fn: Callable[..., T], *args: object) -> T:
        return self._pool.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
