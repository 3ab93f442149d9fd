"""Background prewarm threads run at SCHED_IDLE; the caller's thread never changes."""

from __future__ import annotations

import os
import threading

from tierckptd.ops.priority import at_idle_priority


def test_the_worker_thread_runs_idle_and_the_caller_keeps_its_policy() -> None:
    seen: list[int] = []
    handler = at_idle_priority(lambda: seen.append(os.sched_getscheduler(0)))
    before = os.sched_getscheduler(0)
    worker = threading.Thread(target=lambda: (handler(), handler()))
    worker.start()
    worker.join()
    assert seen == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == before
