"""The next-save prewarm (`[memory] prewarm_next`): what it plans (only the shortfall,
within a cap), what it makes (tagged, named segments within the budget), that the next
save takes them, and that it steps aside for saves. Real catalog, real tmpfs-style files,
a fake clock driving the job queue (no worker thread, no timing)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tierckptd.catalog import Catalog
from tierckptd.catalog.prewarm import NextSaveWarmer, assign
from tierckptd.jobs import JobQueue
from tierckptd.memory import pool as pool_module
from tierckptd.memory.pool import Segment

from .conftest import FakeClock, MakeCatalog, Save

KiB = 1024
DATA0 = b"a" * (100 * KiB)
DATA1 = b"b" * (60 * KiB)
META = b"m" * KiB
FILES = {"__0_0.distcp": DATA0, "__0_1.distcp": DATA1, ".metadata": META}


def _seg(size: int, name: str | None, namespace: str = "run") -> Segment:
    return Segment(Path(f"seg-{name}-{size}"), size, name, namespace)


def _warmer(catalog: Catalog, clock: FakeClock, max_bytes: int = 0) -> JobQueue[str]:
    """The warmer on a job queue driven by the test (`run_due`, fake clock), as main.py
    wires it on a worker thread."""
    warmer = NextSaveWarmer(catalog, max_bytes=max_bytes)
    queue: JobQueue[str] = JobQueue(warmer.run_pass, clock=clock)
    catalog.events.prewarm_next.add(queue.put)
    catalog.events.prewarm_pending.answer_with(lambda: warmer.pending_bytes)
    return queue


# ---- planning -----------------------------------------------------------------------------
LAST = [("__0_0.distcp", 100, 0), ("__0_1.distcp", 60, 0), (".metadata", 10, 0)]
LAST_PLAN = [(10, ".metadata"), (100, "__0_0.distcp"), (60, "__0_1.distcp")]


def test_an_empty_pool_plans_every_file() -> None:
    assert assign(LAST, [], "run")[0] == LAST_PLAN


def test_segments_the_next_save_would_get_are_not_made_twice() -> None:
    # Evicted files of the same names (retention recycled them) cover their files; a
    # fresh segment large enough covers another by best fit; one too small does not.
    pool = [_seg(100, "__0_0.distcp"), _seg(70, None, ""), _seg(5, ".metadata")]
    assert assign(LAST, pool, "run")[0] == [(10, ".metadata")]
    # Each segment serves one file only; one larger than the rank's reservation none.
    assert assign(LAST, [_seg(200, None)], "run")[0] == LAST_PLAN
    assert assign(LAST, [_seg(150, None)], "run")[0] == [(10, ".metadata"), (60, "__0_1.distcp")]


def test_another_namespaces_segments_do_not_count() -> None:
    pool = [_seg(100, "__0_0.distcp", "other"), _seg(60, "__0_1.distcp", "other")]
    assert [name for _, name in assign(LAST, pool, "run")[0]] == [
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
    ]


def test_the_cap_bounds_the_plan() -> None:
    assert assign(LAST, [], "run", cap=75)[0] == [(10, ".metadata"), (60, "__0_1.distcp")]
    assert assign([("f", 0, 0)], [], "run")[0] == []


# ---- the worker on a real catalog -----------------------------------------------------------
def test_the_next_save_writes_into_segments_prewarmed_for_it(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    catalog = make_catalog()
    warmer = _warmer(catalog, clock)
    save(catalog, "run", "s1", FILES)
    assert catalog.status().pool_misses == 3
    assert warmer.pending() == ["run"]
    assert warmer.run_due() == 1
    status = catalog.status()
    size = sum(map(len, FILES.values()))
    assert (status.prewarm_ready_bytes, status.prewarm_pending_bytes) == (size, 0)
    # Tagged with the namespace: no other tenant is handed them.
    names = sorted(p.name.split("@")[1] for p in catalog.tier.pool_dir.iterdir())
    assert names == ["run"] * 3
    save(catalog, "run", "s2", FILES)
    status = catalog.status()
    assert (status.pool_hits, status.pool_misses) == (3, 3)
    assert status.prewarm_used_bytes == size and status.prewarm_ready_bytes == 0
    assert catalog.get("run", "s2").size_bytes == size


def test_another_tenant_never_gets_them(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    catalog = make_catalog()
    warmer = _warmer(catalog, clock)
    save(catalog, "victim", "s1", {"__0_0.distcp": DATA0})
    warmer.run_due()
    assert catalog.status().prewarm_ready_bytes == len(DATA0)
    catalog.begin("thief", "s1", 0)
    catalog.reserve("thief", "s1", 0, len(DATA0))
    _, preallocated = catalog.open_file("thief", "s1", "__0_0.distcp", 0)
    assert preallocated == 0


def test_retention_recycled_files_are_not_prewarmed_again_but_touched_again(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    # s1 was saved into new pages (touched once: a page written once is off the kernel's
    # active list, and the save that overwrites it first pays for the move). Once s2
    # evicts it, its segments are not prewarmed again, only touched again before s3
    # takes them; s2's (saved into warm segments) need no second pass.
    catalog = make_catalog(memory_keep_last=1)
    warmer = _warmer(catalog, clock)
    save(catalog, "run", "s1", FILES)
    warmer.run_due()  # prewarms s2's segments (touched twice already)
    save(catalog, "run", "s2", FILES)  # writes into the prewarmed segments; evicts s1
    size = sum(map(len, FILES.values()))
    assert catalog.status().pool_bytes == size  # s1's files, recycled
    plan = catalog.next_save_plan("run")
    assert plan.segments == []
    assert sorted(str(seg.previous_name) for seg in plan.activate) == sorted(FILES)
    for seg in plan.activate:  # s1's bytes are still in them
        assert seg.path.read_bytes()[:1] in (b"a", b"b", b"m")
    assert warmer.run_due() == 1
    assert not any(seg.touched_once for seg in catalog.pool.segments)
    for seg in catalog.pool.segments:
        assert seg.path.read_bytes() == bytes(seg.size)
    status = catalog.status()
    assert (status.pool_bytes, status.prewarm_ready_bytes) == (size, 0)  # not doubled
    assert status.prewarm_pending_bytes == 0
    assert catalog.next_save_plan("run").activate == []
    save(catalog, "run", "s3", FILES)  # takes them; evicts s2
    assert catalog.status().pool_hits == 6
    assert catalog.next_save_plan("run").activate == []


def test_the_budget_bounds_it_and_a_reservation_still_fits(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    # Used 200 KiB, the next save reserves 200 KiB: room for one 100 KiB segment beside.
    catalog = make_catalog(budget=550 * KiB)
    warmer = _warmer(catalog, clock)
    save(catalog, "run", "s1", {"__0_0.distcp": DATA0, "__0_1.distcp": DATA0})
    warmer.run_due()
    status = catalog.status()
    assert status.prewarm_ready_bytes == 100 * KiB
    # The next save's reservation leaves it in the pool, and the save takes it.
    catalog.begin("run", "s2", 0)
    catalog.reserve("run", "s2", 0, 200 * KiB)
    status = catalog.status()
    assert status.pool_bytes == 100 * KiB
    assert status.used_bytes + status.reserved_bytes + status.pool_bytes <= catalog.budget
    _, preallocated = catalog.open_file("run", "s2", "__0_0.distcp", 0)
    assert preallocated == 100 * KiB


def test_a_reservation_drops_prewarmed_segments_it_needs_room_from(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    catalog = make_catalog(budget=550 * KiB)
    warmer = _warmer(catalog, clock)
    save(catalog, "run", "s1", {"__0_0.distcp": DATA0, "__0_1.distcp": DATA0})
    warmer.run_due()
    catalog.begin("run", "s2", 0)
    catalog.reserve("run", "s2", 0, 300 * KiB)  # larger than the last save: never refused
    status = catalog.status()
    assert (status.reserved_bytes, status.pool_bytes) == (300 * KiB, 0)


def test_the_cap_from_the_config_bounds_each_pass(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    catalog = make_catalog()
    warmer = _warmer(catalog, clock, max_bytes=80 * KiB)
    save(catalog, "run", "s1", FILES)
    warmer.run_due()
    assert catalog.status().prewarm_ready_bytes == len(META) + len(DATA1)


def test_it_waits_while_a_save_writes_and_plans_again_after(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    catalog = make_catalog()
    warmer = _warmer(catalog, clock)
    save(catalog, "run", "s1", FILES)
    catalog.begin("other", "s1", 0)  # another job's save is writing
    assert warmer.run_due() == 1
    assert catalog.status().prewarm_ready_bytes == 0
    assert warmer.pending() == ["run"]  # again in `retry` seconds
    clock.now += 1
    assert warmer.run_due() == 1 and warmer.pending() == ["run"]
    clock.now += 6  # the other save went quiet (abandoned): no longer counts as writing
    warmer.run_due()
    assert warmer.pending() == []
    assert catalog.status().prewarm_ready_bytes == sum(map(len, FILES.values()))


def test_a_save_starting_stops_it_between_steps_and_keeps_the_warm_part(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_module, "PREWARM_STEP", 16 * KiB)
    catalog = make_catalog()
    warmer = _warmer(catalog, clock)
    save(catalog, "run", "s1", {"__0_0.distcp": DATA0})
    steps = 0
    saving = catalog.saving

    def begins_after_two_steps(within: float = 5.0) -> bool:
        nonlocal steps
        steps += 1
        if steps == 4:  # the job's check, the segment's, then one per step after the first
            catalog.begin("run", "s2", 0)
        return saving(within)

    monkeypatch.setattr(catalog, "saving", begins_after_two_steps)
    warmer.run_due()
    [seg] = catalog.pool.segments
    assert (seg.size, seg.previous_name, seg.prewarmed) == (32 * KiB, "__0_0.distcp", True)
    assert warmer.pending() == ["run"]  # the rest after the save
    catalog.reserve("run", "s2", 0, len(DATA0))
    _, preallocated = catalog.open_file("run", "s2", "__0_0.distcp", 0)
    assert preallocated == 32 * KiB  # the save gets the warm part


def test_a_reservation_waits_for_a_segment_being_made_when_it_needs_the_room(
    make_catalog: MakeCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = make_catalog(budget=200 * KiB)
    release, allocating = threading.Event(), threading.Event()
    preallocate = catalog.pool.preallocate

    def slow(tmp: Path, size: int, stop: object = None) -> int:
        allocating.set()
        release.wait(10)
        return preallocate(tmp, size)

    monkeypatch.setattr(catalog.pool, "preallocate", slow)
    prewarm = threading.Thread(
        target=catalog.prewarm_segments,
        args=([(150 * KiB, "f")], "test"),
        kwargs={"namespace": "run"},
    )
    prewarm.start()
    assert allocating.wait(10)
    catalog.begin("run", "s1", 0)
    errors: list[BaseException] = []

    def reserve() -> None:
        try:
            catalog.reserve("run", "s1", 0, 100 * KiB)  # 150 pending + 100 > 200
        except BaseException as e:
            errors.append(e)

    reserving = threading.Thread(target=reserve)
    reserving.start()
    reserving.join(0.3)
    assert reserving.is_alive(), "the reservation should wait for the segment being made"
    release.set()
    reserving.join(10)
    prewarm.join(10)
    assert errors == []
    status = catalog.status()
    assert status.reserved_bytes == 100 * KiB and status.pool_bytes == 0  # dropped for room


def test_a_restarted_daemon_prewarms_at_the_first_begin(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    before = make_catalog()
    save(before, "run", "s1", FILES)
    before.tier.close()
    catalog = make_catalog()  # adopts s1, as after a restart
    warmer = _warmer(catalog, clock)
    catalog.begin("fresh", "s1", 0)  # nothing known of it: nothing to plan
    catalog.begin("run", "s2", 0)
    assert warmer.pending() == ["run"]
    catalog.abort("run", "s2")
    catalog.abort("fresh", "s1")
    warmer.run_due()
    assert catalog.status().prewarm_ready_bytes == sum(map(len, FILES.values()))
    catalog.begin("run", "s3", 0)
    assert warmer.pending() == []  # once per namespace; commits schedule the rest


# ---- touching recycled pages again (`activate`) ---------------------------------------------
def test_touching_again_steps_aside_for_a_save_and_never_writes_a_taken_segment(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_module, "PREWARM_STEP", 16 * KiB)
    catalog = make_catalog(memory_keep_last=1, recycle=True)
    save(catalog, "run", "s1", {"__0_0.distcp": DATA0})
    save(catalog, "run", "s2", {"__0_1.distcp": DATA1})  # evicts s1 into the pool
    [seg] = catalog.pool.segments
    assert seg.touched_once
    calls = 0

    def stop_after_two_steps() -> bool:
        nonlocal calls
        calls += 1
        return calls > 2

    assert catalog.activate_segments([seg], stop_after_two_steps) == 0
    assert catalog.pool.segments == [seg] and seg.touched_once  # pooled, not done
    assert catalog.pool.pending == 0
    # Taken by a save meanwhile: not in the pool any more, so never written.
    catalog.begin("run", "s3", 0)
    catalog.reserve("run", "s3", 0, len(DATA0))
    path, preallocated = catalog.open_file("run", "s3", "__0_0.distcp", 0)
    assert preallocated == len(DATA0)
    Path(path).write_bytes(b"x" * len(DATA0))
    assert catalog.activate_segments([seg]) == 0
    assert Path(path).read_bytes() == b"x" * len(DATA0)
