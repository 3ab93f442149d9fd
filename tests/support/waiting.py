"""Waiting on a condition with a deadline, the one way the tests wait for a daemon: poll
often (a met condition ends the wait at once, unlike a fixed sleep) and fail with what was
awaited and the caller's details (log tails) instead of hanging into the test timeout."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(
    what: str,
    check: Callable[[], object],
    timeout: float = 30.0,
    *,
    interval: float = 0.2,
    details: Callable[[], str] = lambda: "",
) -> None:
    """Return once `check()` is true; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{details()}")
        time.sleep(interval)
