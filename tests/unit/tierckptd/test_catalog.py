from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointNotFound,
    InvalidArgument,
    InvalidName,
    MemoryBudgetExceeded,
)
from tierckptd.catalog import Catalog
from tierckptd.catalog.budget import PAGE, pages
from tierckptd.memory.incoming import install_copy
from tierckptd.model import CheckpointRecord, FileRecord, State

from tests.support.catalog_files import write_file

KiB = 1024


def test_full_save_is_listed_only_after_commit(catalog: Catalog) -> None:
    catalog.begin("run", "step-1", 0)
    catalog.begin("run", "step-1", 1)  # idempotent for every rank
    catalog.reserve("run", "step-1", 0, 10 * KiB)
    path = write_file(catalog, "run", "step-1", "__0_0.distcp", b"a" * 3000)
    assert catalog.list_checkpoints("run") == []
    assert [v.state for v in catalog.list_checkpoints("run", include_uncommitted=True)] == [
        State.WRITING
    ]
    with pytest.raises(CheckpointNotFound):
        catalog.get("run", "step-1")
    write_file(catalog, "run", "step-1", ".metadata", b"m" * 10)
    view = catalog.commit("run", "step-1", ["__0_0.distcp", ".metadata"])
    assert view.state is State.COMMITTED and view.sequence == 1
    assert view.size_bytes == 3010
    assert view.local_paths["__0_0.distcp"] == path
    assert os.stat(path).st_mode & 0o777 == 0o440
    manifest = catalog.tier.manifest_path("run", "step-1")
    assert manifest.exists()
    status = catalog.status()
    # As tmpfs charges it: each file and the data dir in whole pages, and the manifest.
    charged = 2 * PAGE + PAGE + pages(manifest.stat().st_size)
    assert (status.used_bytes, status.reserved_bytes, status.checkpoints) == (charged, 0, 1)
    assert catalog.get("run").checkpoint_id == "step-1"


def test_committed_ids_are_immutable(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "step-1", {".metadata": b"x"})
    with pytest.raises(CheckpointExists, match="already committed on node node-a.*pick a new"):
        catalog.begin("run", "step-1", 0)


def test_invalid_names(catalog: Catalog) -> None:
    with pytest.raises(InvalidName, match=r"\[A-Za-z0-9._-\]"):
        catalog.begin("../x", "step-1", 0)
    catalog.begin("run", "s", 0)
    with pytest.raises(InvalidName):
        catalog.open_file("run", "s", "a/b", 0)


def test_reserve_refused_names_the_budget(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "step-1", {".metadata": b"x" * (600 * KiB)})
    catalog.begin("run", "step-2", 0)
    with pytest.raises(MemoryBudgetExceeded) as e:
        catalog.reserve("run", "step-2", 0, 500 * KiB)
    message = str(e.value)
    assert "memory.budget=1.0 MiB" in message
    assert "500.0 KiB" in message and "by 2 checkpoints" in message
    assert "[memory] budget" in message and "tierckpt rm" in message
    assert catalog.status().reserved_bytes == 0
    assert catalog.reserve("run", "step-2", 0, 256 * KiB) == 256 * KiB


def test_reserve_needs_a_writing_checkpoint(catalog: Catalog) -> None:
    with pytest.raises(CheckpointIncomplete, match="BeginCheckpoint"):
        catalog.reserve("run", "nope", 0, 1)


def test_commit_file_checks_size_and_blocks(catalog: Catalog) -> None:
    catalog.begin("run", "s", 0)
    catalog.reserve("run", "s", 0, 10 * KiB)
    path, _ = catalog.open_file("run", "s", "f", 0)
    Path(path).write_bytes(b"z" * 2048)
    cs = checksum_bytes(b"z" * 2048, block_size=1024)
    with pytest.raises(InvalidArgument, match="2048 bytes on disk.*2000 bytes"):
        catalog.commit_file(
            "run", "s", "f", 0, 2000, algorithm=cs.algorithm, block_size=1024, digests=cs.digests
        )
    with pytest.raises(InvalidArgument, match="block checksums"):
        catalog.commit_file(
            "run", "s", "f", 0, 2048, algorithm=cs.algorithm, block_size=512, digests=cs.digests
        )
    with pytest.raises(InvalidArgument, match="crc32"):
        catalog.commit_file(
            "run", "s", "f", 0, 2048, algorithm="crc32c", block_size=1024, digests=cs.digests
        )
    with pytest.raises(CheckpointIncomplete, match="OpenFile"):
        catalog.commit_file(
            "run", "s", "g", 0, 0, algorithm=cs.algorithm, block_size=1024, digests=b""
        )
    with pytest.raises(CheckpointExists):
        catalog.open_file("run", "s", "f", 0)


def test_commit_refuses_missing_and_open_files(catalog: Catalog) -> None:
    catalog.begin("run", "s", 0)
    catalog.reserve("run", "s", 0, 10 * KiB)
    write_file(catalog, "run", "s", "__0_0.distcp", b"d")
    catalog.open_file("run", "s", "__1_0.distcp", 1)
    with pytest.raises(CheckpointIncomplete, match=r"missing files: \.metadata.*open.*__1_0"):
        catalog.commit("run", "s", ["__0_0.distcp", ".metadata"])


def test_writing_beyond_the_reservation_is_refused(catalog: Catalog) -> None:
    # Audit M2: a rank used to take free budget silently when it wrote more than it
    # reserved; now the commit is refused whatever the budget says.
    catalog.begin("run", "s", 0)
    catalog.reserve("run", "s", 0, 100)
    with pytest.raises(MemoryBudgetExceeded, match=r"rank 0's reservation has only 100 B left"):
        write_file(catalog, "run", "s", "small", b"x" * 300)
    assert catalog.status().used_bytes == 0
    catalog.reserve("run", "s", 1, 1000 * KiB)
    with pytest.raises(MemoryBudgetExceeded, match="reservation"):
        write_file(catalog, "run", "s", "big", b"x" * (100 * KiB), rank=2)
    write_file(catalog, "run", "s", "fits", b"x" * 100)  # exactly the reservation
    assert catalog.status().reserved_bytes == 1000 * KiB  # rank 1's, untouched


def test_abort_collects_and_releases(catalog: Catalog) -> None:
    catalog.begin("run", "s", 0)
    catalog.reserve("run", "s", 0, 10 * KiB)
    path = write_file(catalog, "run", "s", "f", b"x" * 4096)
    catalog.abort("run", "s")
    assert not Path(path).exists()
    status = catalog.status()
    assert (status.used_bytes, status.reserved_bytes, status.pool_bytes) == (0, 0, 4096)
    with pytest.raises(CheckpointNotFound):
        catalog.abort("run", "s")


def test_pool_recycling_prefers_same_name_then_best_fit(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "s1", {"__0_0.distcp": b"a" * (100 * KiB), ".metadata": b"m" * KiB})
    save(catalog, "run", "s2", {"__0_0.distcp": b"b" * (50 * KiB), ".metadata": b"m" * KiB})
    catalog.delete("run", "s1")
    catalog.delete("run", "s2")
    sizes = sorted(s.size for s in catalog.pool.segments)
    assert sizes == [KiB, KiB, 50 * KiB, 100 * KiB]
    catalog.begin("run", "s3", 0)
    catalog.reserve("run", "s3", 0, 60 * KiB)
    # Same name, within 1.25x of the remaining reservation: the 50 KiB segment.
    path, prealloc = catalog.open_file("run", "s3", "__0_0.distcp", 0)
    assert prealloc == 50 * KiB and os.path.getsize(path) == 50 * KiB
    # Reservation left: 10 KiB -> best fit among {1 KiB, 1 KiB} (100 KiB is too large).
    _, prealloc = catalog.open_file("run", "s3", "other", 0)
    assert prealloc == KiB
    status = catalog.status()
    assert status.pool_bytes == 101 * KiB
    assert status.used_bytes + status.reserved_bytes + status.pool_bytes <= catalog.budget


def test_reservation_drops_pool_largest_first(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "s1", {"a": b"a" * (300 * KiB), "b": b"b" * (100 * KiB)})
    catalog.delete("run", "s1")
    assert catalog.status().pool_bytes == 400 * KiB
    catalog.begin("run", "s2", 0)
    catalog.reserve("run", "s2", 0, 800 * KiB)
    status = catalog.status()
    assert status.pool_bytes == 100 * KiB  # the 300 KiB segment went first
    assert status.reserved_bytes + status.pool_bytes <= catalog.budget


def test_recycle_off_unlinks(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    catalog = make_catalog(recycle=False)
    save(catalog, "run", "s1", {"a": b"a" * KiB})
    assert catalog.delete("run", "s1") == KiB
    assert catalog.status().pool_bytes == 0


def test_retention_keeps_newest_and_pinned(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    catalog = make_catalog(memory_keep_last=2)
    save(catalog, "run", "step-1", {"a": b"1"})
    catalog._records[("run", "step-1")].pinned = True
    for i in range(2, 6):
        save(catalog, "run", f"step-{i}", {"a": b"x"})
    save(catalog, "other", "step-1", {"a": b"x"})
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == [
        "step-1",
        "step-4",
        "step-5",
    ]
    assert not catalog.tier.data_dir("run", "step-2").exists()
    assert not catalog.tier.manifest_path("run", "step-3").exists()
    assert catalog.get("other").checkpoint_id == "step-1"
    assert catalog.get("run").checkpoint_id == "step-5"


def test_commit_collects_older_unfinished_saves(catalog: Catalog, save, clock) -> None:  # type: ignore[no-untyped-def]
    catalog.begin("run", "step-1", 0)  # a save whose rank was killed
    catalog.reserve("run", "step-1", 0, KiB)
    write_file(catalog, "run", "step-1", "f", b"x")
    clock.now += 1
    save(catalog, "run", "step-2", {"a": b"y"})
    ids = [v.checkpoint_id for v in catalog.list_checkpoints("run", include_uncommitted=True)]
    assert ids == ["step-2"]
    assert catalog.status().reserved_bytes == 0


def test_not_found_names_the_newest(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckpointNotFound, match="run has no committed checkpoints"):
        catalog.get("run")
    save(catalog, "run", "step-000300", {"a": b"x"})
    with pytest.raises(
        CheckpointNotFound,
        match="run/step-9 not found on node node-a; the newest committed checkpoint of run is step-000300",
    ):
        catalog.get("run", "step-9")


def test_sweeper_aborts_idle_saves(catalog: Catalog, clock) -> None:  # type: ignore[no-untyped-def]
    catalog.begin("run", "idle", 0)
    catalog.begin("run", "busy", 0)
    clock.now += 800
    catalog.reserve("run", "busy", 0, 1)  # activity refreshes the timer
    assert catalog.sweep() == []
    clock.now += 200
    assert catalog.sweep() == [("run", "idle")]
    assert [v.checkpoint_id for v in catalog.list_checkpoints(include_uncommitted=True)] == ["busy"]


def test_verify_detects_corruption(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "s", {"a": b"a" * 5000, "b": b"b" * 10})
    result = catalog.verify("run", "s")
    assert result.ok and result.verified_bytes == 5010
    path = catalog.tier.file_path("run", "s", "a")
    os.chmod(path, 0o640)
    with open(path, "r+b") as f:
        f.seek(4000)
        f.write(b"!")
    result = catalog.verify("run", "s")
    assert not result.ok and result.corrupt_files == ["a"]


def test_delete_frees_and_list_all_namespaces(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "a", "s", {"f": b"x" * 10})
    save(catalog, "b", "s", {"f": b"x" * 20})
    assert {v.namespace for v in catalog.list_checkpoints("")} == {"a", "b"}
    assert catalog.status().namespaces == ("a", "b")
    assert catalog.delete("b", "s") == 20
    with pytest.raises(CheckpointNotFound):
        catalog.delete("b", "s")


def test_prewarm_fills_pool_within_budget(catalog: Catalog) -> None:
    assert catalog.prewarm(3 * 256 * KiB, segment_size=256 * KiB) == 768 * KiB
    assert catalog.status().pool_bytes == 768 * KiB
    assert catalog.prewarm(512 * KiB, segment_size=256 * KiB) == 256 * KiB  # budget caps it
    # "@" with no namespace: fresh pages any namespace may take.
    assert sorted(p.name for p in catalog.tier.pool_dir.iterdir()) == [
        "seg-0@",
        "seg-1@",
        "seg-2@",
        "seg-3@",
    ]


def test_reserve_refused_when_filesystem_is_full(catalog: Catalog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(catalog.tier, "free_bytes", lambda: 10 * KiB)
    catalog.begin("run", "s", 0)
    with pytest.raises(
        MemoryBudgetExceeded, match=r"filesystem of the memory dir .* 10\.0 KiB free"
    ):
        catalog.reserve("run", "s", 0, 20 * KiB)


def test_sweeper_thread_runs(catalog: Catalog, clock) -> None:  # type: ignore[no-untyped-def]
    import time

    from tierckptd.catalog import Sweeper

    catalog.begin("run", "idle", 0)
    clock.now += 10_000
    sweeper = Sweeper(catalog, interval=0.01)
    sweeper.start()
    deadline = time.monotonic() + 5
    while catalog.list_checkpoints(include_uncommitted=True) and time.monotonic() < deadline:
        time.sleep(0.01)
    sweeper.stop()
    sweeper.join(5)
    assert catalog.list_checkpoints(include_uncommitted=True) == []


def test_pin_survives_restart_and_unpin_lets_retention_evict(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    catalog = make_catalog(memory_keep_last=1)
    save(catalog, "run", "step-1", {"a": b"1"})
    pinned = catalog.apply_pin("run", "step-1", True)
    assert pinned is not None and pinned.pinned
    save(catalog, "run", "step-2", {"a": b"2"})
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["step-1", "step-2"]
    # The pin is in the manifest: a restarted daemon keeps honouring it.
    assert '"pinned": true' in catalog.tier.manifest_path("run", "step-1").read_text()
    unpinned = catalog.apply_pin("run", "step-1", False)
    assert unpinned is not None and not unpinned.pinned
    save(catalog, "run", "step-3", {"a": b"3"})
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["step-3"]
    assert catalog.apply_pin("run", "step-1", True) is None  # evicted: waits for a manifest


def test_pool_segments_never_cross_namespaces(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    # Audit H1: a recycled segment handed to another job let it read the old bytes.
    save(catalog, "job-a", "s1", {"__0_0.distcp": b"SECRET-WEIGHTS" * 1000})
    catalog.delete("job-a", "s1")
    assert [s.namespace for s in catalog.pool.segments] == ["job-a"]
    catalog.begin("job-b", "s1", 0)
    catalog.reserve("job-b", "s1", 0, 100 * KiB)
    path, prealloc = catalog.open_file("job-b", "s1", "__0_0.distcp", 0)
    assert prealloc == 0 and Path(path).read_bytes() == b""
    catalog.begin("job-a", "s2", 0)
    catalog.reserve("job-a", "s2", 0, 100 * KiB)
    _, prealloc = catalog.open_file("job-a", "s2", "__0_0.distcp", 0)
    assert prealloc == 14000  # the job's own warm pages


def test_commit_file_refuses_a_file_still_open_for_writing(catalog: Catalog) -> None:
    catalog.begin("run", "s", 0)
    catalog.reserve("run", "s", 0, 10 * KiB)
    path, _ = catalog.open_file("run", "s", "f", 0)
    cs = checksum_bytes(b"z" * 100, block_size=1024)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"z" * 100)
        with pytest.raises(CheckpointIncomplete, match="close the file before CommitFile"):
            catalog.commit_file(
                "run", "s", "f", 0, 100, algorithm=cs.algorithm, block_size=1024, digests=cs.digests
            )
    finally:
        os.close(fd)
    catalog.commit_file(
        "run", "s", "f", 0, 100, algorithm=cs.algorithm, block_size=1024, digests=cs.digests
    )
    assert os.stat(path).st_mode & 0o777 == 0o440
    with pytest.raises(InvalidArgument, match="opened by rank 0, not rank 1"):
        catalog.open_file("run", "s", "g", 0)
        catalog.commit_file(
            "run", "s", "g", 1, 0, algorithm=cs.algorithm, block_size=1024, digests=b""
        )


def test_free_space_check_counts_unwritten_reservations(make_catalog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Audit M2: two 2.5 MiB reservations both passed on a tmpfs with 3.5 MiB free.
    catalog = make_catalog(budget=64 << 20)
    monkeypatch.setattr(catalog.tier, "free_bytes", lambda: 3584 * KiB)
    catalog.begin("a", "s", 0)
    catalog.begin("b", "s", 0)
    catalog.reserve("a", "s", 0, 2560 * KiB)
    with pytest.raises(MemoryBudgetExceeded, match=r"2\.5 MiB of it promised to reservations"):
        catalog.reserve("b", "s", 0, 2560 * KiB)
    catalog.abort("a", "s")
    assert catalog.reserve("b", "s", 0, 2560 * KiB) == 2560 * KiB


def test_budget_larger_than_the_filesystem_warns(make_catalog, caplog) -> None:  # type: ignore[no-untyped-def]
    make_catalog(budget=1 << 60)
    assert "is larger than the filesystem of the memory dir" in caplog.text


def test_commit_messages_are_bounded(catalog: Catalog) -> None:
    # Audit M5: 200k required names made a 22 MB log line and error.
    catalog.begin("run", "s", 0)
    names = [f"__{i}_0.distcp" for i in range(99_999)]
    with pytest.raises(CheckpointIncomplete) as e:
        catalog.commit("run", "s", names)
    assert len(str(e.value)) < 400 and "and 99,994 more" in str(e.value)
    with pytest.raises(InvalidArgument, match="200,000 required files, at most 100,000"):
        catalog.commit("run", "s", names * 2 + ["x", "y"])
    with pytest.raises(InvalidName):
        catalog.commit("run", "s", ["../../etc/passwd"])


def test_only_the_saves_own_calls_keep_it_alive(catalog: Catalog, save, clock) -> None:  # type: ignore[no-untyped-def]
    # Audit M2 "keep-alive": reads of the catalog must not refresh an abandoned save.
    save(catalog, "run", "step-1", {"a": b"x"})
    catalog.begin("run", "idle", 0)
    for _ in range(3):
        clock.now += 400
        catalog.status()
        catalog.list_checkpoints("run", include_uncommitted=True)
        catalog.get("run", "step-1")
        catalog.verify("run", "step-1")
        catalog.apply_pin("run", "step-1", True)
    assert catalog.sweep() == [("run", "idle")]


def test_a_received_copy_is_held_only_once_its_manifest_is_written(
    catalog: Catalog, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # Audit M3 (a copy's install): a manifest write that fails leaves the copy not held,
    # in memory and on disk, and no stray file.
    from tierckptd.memory import manifest as manifest_module

    data = os.urandom(3000)
    remote = FileRecord("__0_0.distcp", 1, len(data), checksum_bytes(data), "node-x", held=False)
    rec = CheckpointRecord(
        "run", "s1", State.COMMITTED, 1.0, "node-x", 1.0, 1, files={remote.name: remote}
    )
    assert catalog.publish(rec)

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(manifest_module.os, "write", full)
        with pytest.raises(MemoryBudgetExceeded, match="is full"):
            install_copy(catalog, "run", "s1", remote, [(0, data)], what=remote.name)
    f, path = catalog.file_view("run", "s1", remote.name)
    assert not f.held and path == ""
    assert list(catalog.tier.data_dir("run", "s1").iterdir()) == []
    assert catalog.reserved_bytes() == 0
    assert install_copy(catalog, "run", "s1", remote, [(0, data)], what=remote.name)
    f, path = catalog.file_view("run", "s1", remote.name)
    assert f.held and Path(path).read_bytes() == data
    assert os.stat(path).st_mode & 0o777 == 0o440
