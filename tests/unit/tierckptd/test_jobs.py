"""JobQueue (typed jobs, dedup, delay, backoff) and StepAside, on a fake clock."""

from __future__ import annotations

import threading

import pytest
from tierckptd.jobs import Drain, Heal, JobQueue, Repair, StepAside, backoff

from tests.support.clock import FakeClock


def test_jobs_are_typed_values() -> None:
    assert Heal("ns", "a") == Heal("ns", "a")
    assert len({Heal("ns", "a"), Drain("ns", "a")}) == 2  # same fields, different jobs
    assert len({Repair("ns", "a", "f"), Repair("ns", "a", "f")}) == 1
    with pytest.raises(AttributeError):
        Heal("ns", "a").namespace = "x"  # type: ignore[misc]


def test_dedup_keeps_the_earlier_due_time() -> None:
    clock = FakeClock(start=100.0)
    ran: list[object] = []
    q: JobQueue[object] = JobQueue(lambda j: ran.append(j), clock=clock)
    assert q.put(Heal("ns", "a"), delay=5)
    assert not q.put(Heal("ns", "a"), delay=7)  # later: ignored
    assert q.due_in(Heal("ns", "a")) == 5
    assert q.put(Heal("ns", "a"), delay=1)  # earlier: moves up
    assert q.due_in(Heal("ns", "a")) == 1
    assert len(q) == 1
    assert q.run_due() == 0
    clock.now += 1
    assert q.run_due() == 1
    assert ran == [Heal("ns", "a")]
    clock.now += 10
    assert q.run_due() == 0  # the superseded heap entry does not run twice


def test_due_order_and_pending() -> None:
    clock = FakeClock(start=100.0)
    ran: list[object] = []
    q: JobQueue[object] = JobQueue(lambda j: ran.append(j), clock=clock)
    q.put(Drain("ns", "b"), delay=2)
    q.put(Heal("ns", "a"), delay=1)
    q.put(Repair("ns", "a", "f"))
    assert q.pending() == [Repair("ns", "a", "f"), Heal("ns", "a"), Drain("ns", "b")]
    clock.now += 5
    assert q.run_due() == 3
    assert ran == [Repair("ns", "a", "f"), Heal("ns", "a"), Drain("ns", "b")]
    assert q.pending() == []


def test_handler_delay_reschedules_with_backoff() -> None:
    clock = FakeClock(start=100.0)
    tries: list[float] = []

    def handler(job: Drain) -> float | None:
        tries.append(clock.now)
        return None if len(tries) == 4 else backoff(len(tries), 0.5, 1.5)

    q: JobQueue[Drain] = JobQueue(handler, clock=clock)
    q.put(Drain("ns", "a"))
    for _ in range(20):
        q.run_due()
        clock.now += 0.25
    assert [t - 100.0 for t in tries] == [0.0, 0.5, 1.5, 3.0]
    assert q.pending() == []


def test_backoff() -> None:
    assert [backoff(n, 0.5, 10) for n in range(7)] == [0.0, 0.5, 1, 2, 4, 8, 10]
    assert backoff(1000, 1, 60) == 60


def test_a_failing_job_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(start=100.0)

    def handler(job: Heal) -> float | None:
        raise RuntimeError("boom")

    q: JobQueue[Heal] = JobQueue(handler, clock=clock, name="t")
    q.put(Heal("ns", "a"))
    assert q.run_due() == 1
    assert q.pending() == []
    assert "boom" in caplog.text


def test_discard() -> None:
    q: JobQueue[Heal] = JobQueue(lambda j: None, clock=FakeClock(start=100.0))
    q.put(Heal("ns", "a"), delay=3)
    assert q.discard(Heal("ns", "a"))
    assert not q.discard(Heal("ns", "a"))
    assert q.run_due() == 0


def test_worker_thread_runs_jobs_and_stops() -> None:
    done = threading.Event()
    seen: list[Heal] = []

    def handler(job: Heal) -> float | None:
        seen.append(job)
        if len(seen) == 2:
            done.set()
        return None

    q: JobQueue[Heal] = JobQueue(handler, name="test-jobs")
    q.start()
    try:
        q.put(Heal("ns", "a"))
        q.put(Heal("ns", "b"), delay=0.05)
        assert done.wait(5)
        assert q.wait_idle(5)
    finally:
        q.stop()
    assert seen == [Heal("ns", "a"), Heal("ns", "b")]
    q.put(Heal("ns", "c"))
    assert q.pending() == [Heal("ns", "c")]  # stopped: queued, not run


def test_a_job_put_again_while_running_runs_again_after() -> None:
    started = threading.Event()
    release = threading.Event()
    runs: list[Heal] = []

    def handler(job: Heal) -> float | None:
        runs.append(job)
        if len(runs) == 1:
            started.set()
            release.wait(5)
        return None

    q: JobQueue[Heal] = JobQueue(handler, workers=2)
    q.start()
    try:
        q.put(Heal("ns", "a"))
        assert started.wait(5)
        q.put(Heal("ns", "a"))  # while it runs: queued once more, not run concurrently
        release.set()
        assert q.wait_idle(5)
    finally:
        q.stop()
    assert runs == [Heal("ns", "a"), Heal("ns", "a")]


def test_step_aside_waits_while_saving_within_patience() -> None:
    clock = FakeClock(start=100.0)
    saving = {"on": True}
    aside = StepAside(lambda: saving["on"], patience=1.0, clock=clock, sleep=clock.sleep, poll=0.1)
    assert aside.wait() is False
    assert clock.now == pytest.approx(101.0, abs=0.15)  # waited all its patience
    assert aside.wait() is False
    assert clock.now == pytest.approx(101.0, abs=0.15)  # patience is per instance, spent


def test_step_aside_beats_and_clears() -> None:
    clock = FakeClock(start=100.0)
    calls = {"n": 0}

    def saving() -> bool:
        calls["n"] += 1
        return calls["n"] < 30

    aside = StepAside(saving, patience=30, clock=clock, sleep=clock.sleep, poll=0.1)
    assert aside.wait(beat=1.0) is True  # still saving after a beat: heartbeat
    assert aside.wait(beat=1.0) is True
    assert aside.wait(beat=10.0) is False  # the save ended
    assert clock.now < 103.5


def test_step_aside_does_not_wait_without_a_save_or_when_stopping() -> None:
    clock = FakeClock(start=100.0)
    assert StepAside(lambda: False, clock=clock, sleep=clock.sleep).wait() is False
    stop = threading.Event()
    stop.set()
    assert StepAside(lambda: True, stop=stop, clock=clock, sleep=clock.sleep).wait() is False
    assert clock.now == 100.0
