"""Background work that must never take a core from training.

The next-save prewarm touches a whole checkpoint's worth of pages while the training
process computes or stages its next `async_save` on the same cores; at normal priority it
measurably slowed those copies (the bench's async calls 2-3). SCHED_IDLE runs a thread
only when a core would otherwise idle.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["at_idle_priority", "idle_priority_for_this_thread"]

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger(__name__)


def idle_priority_for_this_thread() -> bool:
    """Move the calling thread to SCHED_IDLE (Linux; pid 0 is the calling thread).

    Returns whether it took effect; elsewhere, or when refused, the thread keeps its
    priority and the work still runs.
    """
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as e:
        logger.debug("background thread stays at normal priority: %s", e)
        return False
    return True


def at_idle_priority(handler: Callable[P, R]) -> Callable[P, R]:
    """`handler`, moving each thread that runs it to SCHED_IDLE on its first call
    (for a worker thread's job handler; never wrap what a caller's thread runs)."""
    done = threading.local()

    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not getattr(done, "set", False):
            done.set = True
            idle_priority_for_this_thread()
        return handler(*args, **kwargs)

    return run
