"""Background work that must never take a core from training.

The next-save prewarm touches a whole checkpoint's worth of pages while the training
process computes or stages its next `async_save` on the same cores; at normal priority it
measurably slowed those copies (the bench's async calls 2-3). SCHED_IDLE runs a thread
only when a core would otherwise idle.

Replication is background work too, but it must finish: the copies of the previous
checkpoint are in flight while the next save copies its state on the same cores (every
node of a job saves at once, and every node receives its buddies' copies). Its threads
run at nice BACKGROUND_NICE, not SCHED_IDLE: under contention the save gets about nine
tenths of a core, and a busy node still replicates at the rest instead of starving, nor
can a replication thread holding a lock stall a save for long. A thread cannot raise its
priority back without CAP_SYS_NICE, so only threads that end with their work are lowered
(a bulk send's connection thread; the thread `at_background_priority` starts).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = [
    "BACKGROUND_NICE",
    "at_background_priority",
    "at_idle_priority",
    "background_priority_for_this_thread",
    "idle_priority_for_this_thread",
]

BACKGROUND_NICE = 10  # CFS weight 110 against a normal thread's 1024

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


def background_priority_for_this_thread() -> bool:
    """Lower the calling thread to nice BACKGROUND_NICE (Linux: nice is per thread).

    Only for a thread that ends with its background work: it cannot be raised again.
    Returns whether it took effect; a thread already nicer keeps its value.
    """
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except (AttributeError, OSError) as e:
        logger.debug("background thread stays at its priority: %s", e)
        return False
    return True


def at_background_priority(work: Callable[[], R], name: str) -> R:
    """`work()` on a new thread at nice BACKGROUND_NICE, waited for by the caller (a
    gRPC handler thread, which must keep its priority); its exception is raised here.
    Threads `work` starts inherit the priority (a parallel receive's range threads)."""
    result: list[R] = []
    error: list[BaseException] = []

    def run() -> None:
        background_priority_for_this_thread()
        try:
            result.append(work())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
