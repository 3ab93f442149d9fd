"""Background prewarm threads run at SCHED_IDLE, replication's at nice BACKGROUND_NICE;
the caller's thread never changes."""

from __future__ import annotations

import os
import threading

import pytest
from tierckptd.ops.priority import (
    BACKGROUND_NICE,
    at_background_priority,
    at_idle_priority,
    background_priority_for_this_thread,
)


def test_the_worker_thread_runs_idle_and_the_caller_keeps_its_policy() -> None:
    seen: list[int] = []
    handler = at_idle_priority(lambda: seen.append(os.sched_getscheduler(0)))
    before = os.sched_getscheduler(0)
    worker = threading.Thread(target=lambda: (handler(), handler()))
    worker.start()
    worker.join()
    assert seen == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == before


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_background_work_runs_niced_on_its_own_thread_and_the_caller_keeps_its_nice() -> None:
    """Replication's receive runs here from a gRPC handler thread, which serves saves
    next: only the thread started for the work, and threads it starts, are lowered."""
    caller = _nice()
    inner: list[int] = []

    def work() -> tuple[int, str]:
        child = threading.Thread(target=lambda: inner.append(_nice()))
        child.start()
        child.join()
        return _nice(), threading.current_thread().name

    nice, name = at_background_priority(work, "offer-take")
    assert nice == max(caller, BACKGROUND_NICE) and name == "offer-take"
    assert inner == [nice]  # a parallel receive's range threads inherit it
    assert _nice() == caller


def test_background_work_raises_its_error_in_the_caller() -> None:
    def work() -> int:
        raise ValueError("the offerer is unreachable")

    with pytest.raises(ValueError, match="unreachable"):
        at_background_priority(work, "offer-take")


def test_a_thread_already_nicer_is_not_raised() -> None:
    seen: list[int] = []

    def run() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE + 5)
        background_priority_for_this_thread()
        seen.append(_nice())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [BACKGROUND_NICE + 5]
