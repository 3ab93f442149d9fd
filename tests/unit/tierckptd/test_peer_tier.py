"""Catalog side of the peer tier and the verified receiver, without gRPC."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import ChecksumMismatch, InvalidArgument, MemoryBudgetExceeded
from tierckptd.catalog import Catalog
from tierckptd.manifest import read_manifest
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.peers import IncomingFile, restore_plan

from .conftest import MakeCatalog, Save


def _remote(name: str, data: bytes, owner: str) -> FileRecord:
    return FileRecord(
        name=name,
        rank=1,
        size=len(data),
        checksums=checksum_bytes(data, block_size=1024),
        owner_node=owner,
        held=False,
    )


def _receive(catalog: Catalog, ns: str, ckpt: str, name: str, data: bytes) -> None:
    tmp = catalog.start_incoming(ns, ckpt, name)
    assert tmp is not None
    f, _ = catalog.file_view(ns, ckpt, name)
    assert f.checksums is not None
    incoming = IncomingFile(tmp, f.size, f.checksums, name)
    ok = False
    try:
        for off in range(0, len(data), 1024):
            incoming.write(off, data[off : off + 1024])
        incoming.finish()
        ok = True
    finally:
        incoming.close()
        catalog.finish_incoming(ns, ckpt, name, tmp, ok)


def test_commit_with_remote_files_then_replicated(catalog: Catalog, save: Save) -> None:
    catalog.replica_target = 1
    catalog.begin("run", "s1", 0)
    remote = {"__1_0.distcp": _remote("__1_0.distcp", b"b" * 3000, "node-b")}
    catalog.reserve("run", "s1", 0, 10)
    from .conftest import write_file

    write_file(catalog, "run", "s1", "__0_0.distcp", b"a" * 10)
    view = catalog.commit("run", "s1", ["__0_0.distcp", "__1_0.distcp"], remote)
    assert view.state is State.COMMITTED and view.tiers == ("peer",)
    assert view.local_paths["__1_0.distcp"] == ""
    assert catalog.used_bytes() == 10  # only held bytes count against the budget
    catalog.set_replicas("run", "s1", "__0_0.distcp", ["node-b"])
    catalog.set_replicas("run", "s1", "__1_0.distcp", ["node-c"])
    assert catalog.get("run", "s1").state is State.REPLICATED


def test_publish_adopts_our_writing_files_and_a_receiver_verifies(
    make_catalog: MakeCatalog, save: Save, tmp_path: Path
) -> None:
    catalog = make_catalog(node_id="node-b", budget=1 << 20)
    data = os.urandom(5000)
    catalog.begin("run", "s2", 1)
    catalog.reserve("run", "s2", 1, 100)
    from .conftest import write_file

    write_file(catalog, "run", "s2", "__1_0.distcp", b"m" * 100, rank=1)
    record = catalog.holdings("run", "s2")[1][0]
    published = {
        "__1_0.distcp": dataclasses.replace(record, held=False),
        "__0_0.distcp": _remote("__0_0.distcp", data, "node-a"),
    }
    rec = CheckpointRecord("run", "s2", State.COMMITTED, 1.0, "node-a", 2.0, 7, files=published)
    assert catalog.publish(rec)
    view = catalog.get("run", "s2")
    assert view.sequence == 7 and view.local_paths["__1_0.distcp"]
    assert not view.local_paths["__0_0.distcp"]
    # A corrupt block is refused before the copy is installed.
    tmp = catalog.start_incoming("run", "s2", "__0_0.distcp")
    assert tmp is not None
    f, _ = catalog.file_view("run", "s2", "__0_0.distcp")
    assert f.checksums is not None
    bad = IncomingFile(tmp, f.size, f.checksums, "copy")
    with pytest.raises(ChecksumMismatch):
        bad.write(0, b"\0" * 1024)
    bad.close()
    assert not catalog.finish_incoming("run", "s2", "__0_0.distcp", tmp, False)
    assert not tmp.exists() and catalog.reserved_bytes() == 0
    with pytest.raises(InvalidArgument):
        IncomingFile(
            catalog.start_incoming("run", "s2", "__0_0.distcp"), f.size, f.checksums, "c"
        ).write(5, b"x")  # type: ignore[arg-type]
    catalog.finish_incoming("run", "s2", "__0_0.distcp", tmp, False)
    _receive(catalog, "run", "s2", "__0_0.distcp", data)
    view = catalog.get("run", "s2")
    assert Path(view.local_paths["__0_0.distcp"]).read_bytes() == data
    assert catalog.used_bytes() == 5100
    manifest = read_manifest(catalog.tier.manifest_path("run", "s2"))
    assert manifest.files["__0_0.distcp"].held
    assert manifest.files["__0_0.distcp"].replica_nodes == ["node-b"]
    # Dropping a corrupt copy gives the bytes back and stops serving it.
    assert catalog.drop_local_copy("run", "s2", "__0_0.distcp")
    assert catalog.used_bytes() == 100
    assert catalog.file_view("run", "s2", "__0_0.distcp")[1] == ""


def test_incoming_copy_respects_the_budget(make_catalog: MakeCatalog) -> None:
    catalog = make_catalog(budget=4096)
    big = _remote("__0_0.distcp", b"z" * 8192, "node-x")
    rec = CheckpointRecord(
        "run", "s3", State.COMMITTED, 1.0, "node-x", 2.0, 1, files={big.name: big}
    )
    assert catalog.publish(rec)
    with pytest.raises(MemoryBudgetExceeded, match="memory.budget"):
        catalog.start_incoming("run", "s3", "__0_0.distcp")


def test_deleted_checkpoint_is_not_taken_back(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s4", {"__0_0.distcp": b"q" * 10})
    catalog.delete("run", "s4")
    rec = CheckpointRecord("run", "s4", State.COMMITTED, 1.0, "node-x", 2.0, 1)
    assert not catalog.publish(rec)


def _record(ckpt: str, committed: float, files: list[FileRecord]) -> CheckpointRecord:
    return CheckpointRecord(
        "run",
        ckpt,
        State.COMMITTED,
        committed,
        "node-x",
        committed,
        1,
        files={f.name: f for f in files},
    )


def test_restore_plan_covers_the_newest_checkpoint_owned_files_first() -> None:
    owned = dataclasses.replace(_remote("__0_0.distcp", b"a" * 300, "me"), rank=0)
    kept = _remote("__2_0.distcp", b"b" * 200, "node-y")
    kept.replica_nodes = ["me"]
    other = _remote("__4_0.distcp", b"c" * 100, "node-y")
    old = _record("s1", 1.0, [_remote("__0_0.distcp", b"o" * 999, "me")])
    new = _record("s2", 2.0, [kept, other, owned])
    assert restore_plan("me", [new, old]) == [(300, "__0_0.distcp"), (200, "__2_0.distcp")]
    assert restore_plan("me", [old, new]) == restore_plan("me", [new, old])
    assert restore_plan("nobody", [new]) == []


def test_named_prewarm_segment_is_taken_by_that_files_copy(catalog: Catalog) -> None:
    data = os.urandom(5000)
    remote = _remote("__0_0.distcp", data, "node-x")
    assert catalog.publish(_record("s5", 3.0, [remote]))
    # Unnamed segments are left for saves: the copy takes the one named for it, though
    # another fits it more closely.
    plan: list[tuple[int, str | None]] = [(8192, None), (4900, None), (5500, "__0_0.distcp")]
    assert catalog.prewarm_segments(plan, "test") == 18592
    assert catalog.pool_bytes() == 18592
    _receive(catalog, "run", "s5", "__0_0.distcp", data)
    assert catalog.pool_bytes() == 8192 + 4900
    view = catalog.get("run", "s5")
    assert Path(view.local_paths["__0_0.distcp"]).read_bytes() == data


def test_prewarm_stops_at_the_budget(make_catalog: MakeCatalog) -> None:
    catalog = make_catalog(budget=10_000)
    assert catalog.prewarm_segments([(6000, "a"), (6000, "b"), (3000, "c")], "test") == 6000
    assert catalog.pool_bytes() == 6000


def test_prewarm_skips_a_file_whose_copy_is_already_arriving(catalog: Catalog) -> None:
    remote = _remote("__0_0.distcp", b"r" * 5000, "node-x")
    assert catalog.publish(_record("s6", 4.0, [remote]))
    tmp = catalog.start_incoming("run", "s6", "__0_0.distcp")
    assert tmp is not None
    try:
        assert catalog.prewarm_segments([(5000, "__0_0.distcp"), (3000, "x")], "test") == 3000
    finally:
        catalog.finish_incoming("run", "s6", "__0_0.distcp", tmp, False)


def test_incoming_copy_waits_for_the_segment_being_preallocated_for_it(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(5000)
    assert catalog.publish(_record("s7", 5.0, [_remote("__0_0.distcp", data, "node-x")]))
    release = threading.Event()
    allocating = threading.Event()
    preallocate = catalog.tier.preallocate

    def slow_preallocate(tmp: Path, size: int) -> None:
        allocating.set()
        release.wait(10)
        preallocate(tmp, size)

    monkeypatch.setattr(catalog.tier, "preallocate", slow_preallocate)
    prewarm = threading.Thread(
        target=catalog.prewarm_segments, args=([(5000, "__0_0.distcp")], "test")
    )
    prewarm.start()
    assert allocating.wait(10)
    receiver = threading.Thread(target=_receive, args=(catalog, "run", "s7", "__0_0.distcp", data))
    receiver.start()
    receiver.join(0.3)
    assert receiver.is_alive(), "the copy should wait for its segment"
    release.set()
    receiver.join(10)
    prewarm.join(10)
    # It took the preallocated segment: nothing left in the pool, the file is whole.
    assert catalog.pool_bytes() == 0
    assert Path(catalog.get("run", "s7").local_paths["__0_0.distcp"]).read_bytes() == data


def test_a_corrupt_last_short_block_is_caught_at_finish(tmp_path: Path) -> None:
    data = os.urandom(2500)  # blocks of 1024: two whole, one short
    checksums = checksum_bytes(data, block_size=1024)
    path = tmp_path / "incoming"
    path.touch()
    incoming = IncomingFile(path, len(data), checksums, "copy")
    try:
        incoming.write(0, data[:2048])
        incoming.write(2048, data[2048:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(ChecksumMismatch, match="block 2"):
            incoming.finish()
    finally:
        incoming.close()
