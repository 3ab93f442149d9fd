"""The parts of the gray-peer fix (audit 3, M1) that need no daemon: the per-peer circuit
breaker, the fan-out skipping a backing-off peer, and the job queue's priorities."""

from __future__ import annotations

import threading

from tierckptd.catalog import Catalog
from tierckptd.config import PeerConfig
from tierckptd.jobs import BACKGROUND, URGENT, Heal, JobQueue, Repair
from tierckptd.peers.breaker import Breaker
from tierckptd.peers.client import PeerCallError, PeerClient
from tierckptd.peers.cluster import HEAL_RETRIES, Cluster
from tierckptd.peers.healer import HealPlan
from tierckptd.peers.membership import Membership
from tierckptd.restore import Restorer, no_sources


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_that_missed_its_call_is_skipped_with_a_growing_capped_backoff() -> None:
    clock = FakeClock()
    b = Breaker(first=1.0, cap=4.0, clock=clock)
    assert b.skip("n1") == (False, False)
    b.missed("n1", "DEADLINE_EXCEEDED")
    assert b.skip("n1") == (True, False) and b.left("n1") == 1.0
    clock.now += 1.0
    assert b.skip("n1") == (True, True)  # back-off over: one caller probes
    assert b.skip("n1") == (True, False)  # the others still skip while it does
    b.missed("n1", "UNAVAILABLE")  # the probe missed too: twice the outage so far
    assert b.left("n1") == 2.0
    for _ in range(5):  # calls that were in flight miss at once: no longer than the outage says
        b.missed("n1", "DEADLINE_EXCEEDED")
    assert b.left("n1") == 2.0
    clock.now += 2.0
    b.missed("n1", "DEADLINE_EXCEEDED")  # 3 s into the outage: 6 s, capped
    assert b.left("n1") == 4.0
    assert b.backing_off() == {"n1": 4.0}
    b.missed("n1", "RESOURCE_EXHAUSTED")  # busy is an answer: it is alive
    assert b.skip("n1") == (False, False) and b.backing_off() == {}


class _Calls(PeerClient):
    """A PeerClient whose calls are counted; `gray` nodes never answer."""

    def __init__(self) -> None:
        super().__init__(
            Membership("me", peers=[PeerConfig(n, "127.0.0.1:1") for n in ("n1", "n2")])
        )
        self.gray = {"n1"}
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def call(self, node: str) -> str:
        with self._lock:
            self.calls.append(node)
        if node in self.gray:
            raise PeerCallError(node, "Holdings", "DEADLINE_EXCEEDED")
        return node

    def probe(self, node: str) -> bool:
        with self._lock:
            self.calls.append(f"probe {node}")
        return False


def test_the_fanout_calls_a_gray_peer_once_then_skips_it_without_waiting() -> None:
    client = _Calls()
    errors: list[tuple[str, str]] = []
    try:
        got = client.each(client.call, on_error=lambda n, e: errors.append((n, e.code)))
        assert got == {"n2": "n2"} and errors == [("n1", "DEADLINE_EXCEEDED")]
        errors.clear()
        got = client.each(
            client.call, on_error=lambda n, e: errors.append((n, e.details)), parallel=True
        )
        assert got == {"n2": "n2"}
        assert errors[0][0] == "n1" and "skipped" in errors[0][1]
        assert client.calls == ["n1", "n2", "n2"]  # n1 not called the second time
    finally:
        client.membership.close()


def test_due_jobs_run_by_priority_then_due_time() -> None:
    clock = FakeClock()
    ran: list[object] = []
    q: JobQueue[object] = JobQueue(lambda j: ran.append(j), clock=clock)
    for i in range(5):  # a heal round over every older checkpoint, queued first
        q.put(Heal("ns", f"old-{i}"), priority=BACKGROUND)
    q.put(Repair("ns", "old-1", "f"))
    q.put(Heal("ns", "new"), priority=URGENT)  # a new commit's replication
    assert q.run_due() == 7
    assert ran[:2] == [Heal("ns", "new"), Repair("ns", "old-1", "f")]
    assert ran[2:] == [Heal("ns", f"old-{i}") for i in range(5)]


def test_queueing_a_job_again_keeps_the_higher_priority() -> None:
    clock = FakeClock()
    ran: list[object] = []
    q: JobQueue[object] = JobQueue(lambda j: ran.append(j), clock=clock)
    q.put(Heal("ns", "a"), priority=BACKGROUND)
    q.put(Heal("ns", "b"), priority=BACKGROUND)
    assert q.put(Heal("ns", "b"), priority=URGENT)  # a publish of it: moves up
    assert not q.put(Heal("ns", "b"), priority=BACKGROUND)  # the next round: no change
    assert q.run_due() == 2
    assert ran == [Heal("ns", "b"), Heal("ns", "a")]


def test_a_heal_left_short_by_an_unreached_peer_runs_again_a_bounded_number_of_times(
    catalog: Catalog,
) -> None:
    cluster = Cluster(catalog, Restorer(catalog, no_sources), heal_interval=0)
    job = Heal("ns", "c1")
    short = HealPlan(under=("__0_0.distcp",), unreached=("n1",))
    delays = [cluster._heal_again(job, short) for _ in range(HEAL_RETRIES + 1)]
    assert delays[:3] == [1.0, 2.0, 4.0] and delays[-1] is None  # then the heal rounds
    assert cluster._heal_again(job, short) == 1.0  # counted afresh
    assert cluster._heal_again(job, HealPlan()) is None  # healthy: done, forgotten
    assert cluster._heal_again(job, HealPlan(under=("__0_0.distcp",))) is None  # all answered
    cluster.client.membership.close()
    cluster2 = Cluster(catalog, Restorer(catalog, no_sources), heal_interval=0)
    # the owner's view: no holder missing, but a copy it could not push (peer not reached)
    assert cluster2._heal_again(job, HealPlan(short=("f",), unreached=("n1",))) == 1.0
    assert cluster2._heal_again(job, HealPlan(short=("f",))) is None
    cluster2.client.membership.close()
