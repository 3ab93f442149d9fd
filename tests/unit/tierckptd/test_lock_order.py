"""The lock order written in `catalog/__init__.py`, checked at run time.

    Restorer's per-file lock -> catalog lock -> job queue's lock

Each of those locks is swapped for a ranked wrapper that records, per thread, what it
holds; taking a lock while holding one of the same or a later rank is a violation. A
workload of concurrent restores (a source that asks the catalog while it streams),
commits that enqueue drain jobs from under the catalog lock, and job handlers that read
the catalog then has to finish without one.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tierckpt.checksum import BytesLike
from tierckptd import restore as restore_module
from tierckptd.catalog import Catalog
from tierckptd.catalog.prewarm import NextSaveWarmer
from tierckptd.jobs import Drain, JobQueue
from tierckptd.model import FileRecord
from tierckptd.restore import Restorer

from .conftest import MakeCatalog, Save

DATA = bytes(range(256)) * 12  # three 1 KiB checksum blocks

FILE, CATALOG, JOBS = 1, 2, 3  # the documented order, outermost first


@dataclass
class Witness:
    violations: list[str] = field(default_factory=list)
    taken: dict[str, int] = field(default_factory=dict)
    nested: set[tuple[str, str]] = field(default_factory=set)
    _local: threading.local = field(default_factory=threading.local)

    def held(self) -> list[RankedLock]:
        if not hasattr(self._local, "held"):
            self._local.held = []
        held: list[RankedLock] = self._local.held
        return held


class RankedLock:
    """A non-reentrant lock that reports acquisitions against the order."""

    def __init__(self, witness: Witness, rank: int, name: str) -> None:
        self._witness = witness
        self._inner = threading.Lock()
        self.rank = rank
        self.name = name

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        held = self._witness.held()
        later = [h.name for h in held if h is not self and h.rank >= self.rank]
        if later:
            self._witness.violations.append(f"{self.name} taken while holding {later}")
        ok = self._inner.acquire(blocking, timeout)
        if ok:
            for h in held:
                self._witness.nested.add((h.name, self.name))
            held.append(self)
            self._witness.taken[self.name] = self._witness.taken.get(self.name, 0) + 1
        return ok

    def release(self) -> None:
        self._witness.held().remove(self)
        self._inner.release()

    def locked(self) -> bool:
        return self._inner.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_the_witness_catches_an_inverted_order() -> None:
    w = Witness()
    file_lock, catalog_lock = RankedLock(w, FILE, "file"), RankedLock(w, CATALOG, "catalog")
    with file_lock, catalog_lock:
        pass
    assert w.violations == []
    with catalog_lock, file_lock:
        pass
    assert w.violations == ["file taken while holding ['catalog']"]


class AskingSource:
    """A source that reads the catalog between pieces, as a real one may (file lock held)."""

    name = "peer b"

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        for off in range(0, len(DATA), 1000):
            self.catalog.get(namespace, checkpoint_id)
            yield off, DATA[off : off + 1000]


def _rank_catalog(catalog: Catalog, w: Witness) -> None:
    lock = RankedLock(w, CATALOG, "catalog")
    attrs: Any = catalog
    attrs._lock = lock
    attrs.pool._lock = lock
    attrs.durability._lock = lock
    attrs.peer_marks._lock = lock
    attrs.pool._prewarmed = threading.Condition(lock)


def test_restores_commits_and_jobs_keep_the_documented_order(
    make_catalog: MakeCatalog, save: Save, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = make_catalog(drain_every=1)
    w = Witness()
    _rank_catalog(catalog, w)
    handled: list[Drain] = []

    def handle(job: Drain) -> None:
        catalog.get(job.namespace, job.checkpoint_id)  # a drain reads the catalog
        handled.append(job)

    jobs: JobQueue[Drain] = JobQueue(handle, workers=2)
    attrs: Any = jobs
    attrs._cv = threading.Condition(RankedLock(w, JOBS, "jobs"))
    catalog.events.committed.add(lambda ns, cid: jobs.put(Drain(ns, cid)))  # under the catalog lock

    restorer = Restorer(catalog, lambda ns, cid, f: [AskingSource(catalog)])
    ranked = types.SimpleNamespace(Lock=lambda: RankedLock(w, FILE, "file"))
    monkeypatch.setattr(restore_module, "threading", ranked)

    names = [f"__{i}_0.distcp" for i in range(4)]
    save(catalog, "run", "s1", dict.fromkeys(names, DATA))
    for name in names:
        catalog.drop_local_copy("run", "s1", name)
    jobs.start()
    try:
        errors: list[BaseException] = []

        def restore(name: str) -> None:
            try:
                for _ in range(3):
                    _, path = restorer.ensure_local("run", "s1", name)
                    assert Path(path).read_bytes() == DATA
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=restore, args=(n,)) for n in names * 2]
        for t in threads:
            t.start()
        for i in range(2, 6):
            save(catalog, "run", f"s{i}", {"__0_0.distcp": DATA})
        for t in threads:
            t.join(30)
        assert jobs.wait_idle(10)
    finally:
        jobs.stop()
    assert errors == []
    assert w.violations == []
    # Not vacuous: every lock was used, and the nestings the order allows happened.
    assert {"file", "catalog", "jobs"} <= set(w.taken)
    assert {("file", "catalog"), ("catalog", "jobs")} <= w.nested
    assert {j.checkpoint_id for j in handled} >= {f"s{i}" for i in range(2, 6)}


def test_the_next_save_prewarm_keeps_the_documented_order(catalog: Catalog, save: Save) -> None:
    """Commits schedule it under the catalog lock; its worker plans and makes segments
    (the pool takes the catalog lock) with no queue lock held, while saves run."""
    w = Witness()
    _rank_catalog(catalog, w)
    warmer = NextSaveWarmer(catalog, retry=0.01)
    jobs: JobQueue[str] = JobQueue(warmer.run_pass)
    attrs: Any = jobs
    attrs._cv = threading.Condition(RankedLock(w, JOBS, "jobs"))
    catalog.events.prewarm_next.add(jobs.put)
    jobs.start()
    try:
        for i in range(1, 6):
            save(catalog, "run", f"s{i}", {"__0_0.distcp": DATA, ".metadata": DATA[:100]})
            assert jobs.wait_idle(10)
    finally:
        warmer.stop()
        jobs.stop()
    assert w.violations == []
    assert ("catalog", "jobs") in w.nested
    assert catalog.status().prewarm_used_bytes > 0  # not vacuous: saves took its segments
