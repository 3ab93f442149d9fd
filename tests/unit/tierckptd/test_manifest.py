from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import MemoryBudgetExceeded
from tierckptd.catalog import Catalog
from tierckptd.memory import manifest as manifest_module
from tierckptd.memory.adoption import adopt
from tierckptd.memory.manifest import ManifestError, atomic_write, read_manifest, write_manifest
from tierckptd.model import CheckpointRecord, FileRecord, State


def _record() -> CheckpointRecord:
    rec = CheckpointRecord("run", "step-7", State.COMMITTED, 1.5, "node-a", 2.5, 7, True)
    cs = checksum_bytes(b"x" * 3000, block_size=1024)
    rec.files["__0_0.distcp"] = FileRecord("__0_0.distcp", 0, 3000, cs, "node-a", ["node-b"])
    return rec


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    write_manifest(path, _record())
    doc = json.loads(path.read_text())
    assert doc["format"] == 1 and doc["sequence"] == 7 and doc["pinned"] is True
    assert len(doc["files"][0]["block_digests"]) == 3
    assert doc["files"][0]["algorithm"] == "xxh3-128"
    back = read_manifest(path)
    assert back == _record()
    assert os.stat(path).st_mode & 0o777 == 0o440
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no tmp file left


def test_atomic_replace_keeps_old_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.json"
    atomic_write(path, b"old")

    def boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"


def test_malformed_manifest(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"format": 1, "namespace": "run"}')
    with pytest.raises(ManifestError, match="malformed"):
        read_manifest(path)
    path.write_text("not json")
    with pytest.raises(ManifestError):
        read_manifest(path)


def test_restart_adopts_committed_and_collects_leftovers(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    first: Catalog = make_catalog()
    save(first, "run", "step-1", {"a": b"a" * 5000, ".metadata": b"m"})
    save(first, "run", "step-2", {"a": b"b" * 5000, ".metadata": b"m"})
    first.begin("run", "step-3", 0)  # a save in progress when the daemon is killed
    first.reserve("run", "step-3", 0, 100)
    first.open_file("run", "step-3", "a", 0)
    first.delete("run", "step-1")  # leaves warm pool segments
    first.tier.close()  # kill -9 releases the flock

    second: Catalog = make_catalog()
    views = second.list_checkpoints("run", include_uncommitted=True)
    assert [(v.checkpoint_id, v.sequence) for v in views] == [("step-2", 2)]
    # The unfinished save is kept until the peers' manifests are pulled (its coordinator
    # may have committed it), then collected: no peer knows it.
    assert second.tier.data_dir("run", "step-3").exists()
    second.salvage_orphans(final=True)
    assert not second.tier.data_dir("run", "step-3").exists()
    assert second.status().pool_bytes == 5001
    assert second.verify("run", "step-2").ok
    second.begin("run", "step-4", 0)
    second.reserve("run", "step-4", 0, 10)
    assert second.commit("run", "step-4", []).sequence == 3


def test_corrupt_checkpoint_is_not_served(make_catalog, save, caplog) -> None:  # type: ignore[no-untyped-def]
    first: Catalog = make_catalog()
    save(first, "run", "step-1", {"a": b"a" * 5000})
    save(first, "run", "step-2", {"a": b"b" * 5000})
    path = first.tier.file_path("run", "step-2", "a")
    os.chmod(path, 0o640)
    with open(path, "r+b") as f:
        f.write(b"X")
    first.tier.close()

    second: Catalog = make_catalog()
    assert [v.checkpoint_id for v in second.list_checkpoints("run")] == ["step-1"]
    assert second.get("run").checkpoint_id == "step-1"
    manifest = second.tier.manifest_path("run", "step-2")
    assert not manifest.exists()
    assert manifest.with_name("step-2.json.corrupt").exists()
    assert path.exists()  # kept for inspection
    assert "not serving run/step-2" in caplog.text
    budget = second._budget  # quarantined bytes still count, beside step-1's pages
    assert budget.quarantined == 5000
    assert second.status().used_bytes == 5000 + budget._held_total + budget._manifest_total


def test_missing_file_is_not_adopted(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    first: Catalog = make_catalog()
    save(first, "run", "step-1", {"a": b"a", "b": b"b"})
    first.tier.file_path("run", "step-1", "b").unlink()
    first.tier.close()
    second: Catalog = make_catalog()
    assert second.list_checkpoints() == []


def test_pool_over_budget_is_dropped_on_adoption(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    first: Catalog = make_catalog(budget=1 << 20)
    save(first, "run", "s", {"a": b"a" * 600_000})
    first.delete("run", "s")
    first.tier.close()
    second: Catalog = make_catalog(budget=500_000)
    assert second.status().pool_bytes == 0


def _enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full filesystem at the os.write boundary (the tmpfs variant is in
    tests/integration/test_local_attacks.py)."""

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manifest_module.os, "write", full)


def test_enospc_is_resource_exhausted_and_leaves_no_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.json"
    atomic_write(path, b"old")
    _enospc(monkeypatch)
    with pytest.raises(MemoryBudgetExceeded, match="memory tier: the filesystem of .* is full"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_tmp_file_is_unpredictable_and_links_are_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    # The old predictable temp name, planted as a link: never opened, never truncated.
    (tmp_path / f".m.json.tmp-{os.getpid()}").symlink_to(victim)
    write_manifest(tmp_path / "m.json", _record())
    assert victim.read_bytes() == b"keep"
    link = tmp_path / "linked.json"
    link.symlink_to(victim)
    with pytest.raises(ManifestError, match="cannot read manifest linked.json"):
        read_manifest(link)


def test_pin_and_commit_are_persisted_before_they_change_memory(
    make_catalog, save, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    catalog: Catalog = make_catalog()
    save(catalog, "run", "step-1", {"a": b"a"})
    catalog.begin("run", "step-2", 0)
    catalog.reserve("run", "step-2", 0, 10)
    path, _ = catalog.open_file("run", "step-2", "a", 0)
    Path(path).write_bytes(b"b")
    cs = checksum_bytes(b"b")
    catalog.commit_file(
        "run",
        "step-2",
        "a",
        0,
        1,
        algorithm=cs.algorithm,
        block_size=cs.block_size,
        digests=cs.digests,
    )
    with monkeypatch.context() as m:
        _enospc(m)
        with pytest.raises(MemoryBudgetExceeded):
            catalog.apply_pin("run", "step-1", True)
        with pytest.raises(MemoryBudgetExceeded):
            catalog.commit("run", "step-2", ["a"])
    # Audit M3: the refused pin is not in memory either, so a retry really writes it.
    assert not catalog.get("run", "step-1").pinned
    assert '"pinned": false' in catalog.tier.manifest_path("run", "step-1").read_text()
    views = catalog.list_checkpoints("run", include_uncommitted=True)
    assert [(v.checkpoint_id, v.state) for v in views] == [
        ("step-1", State.COMMITTED),
        ("step-2", State.WRITING),
    ]
    assert sorted(p.name for p in catalog.tier.manifest_path("run", "x").parent.iterdir()) == [
        "step-1.json"
    ]
    pinned = catalog.apply_pin("run", "step-1", True)
    assert pinned is not None and pinned.pinned
    assert catalog.commit("run", "step-2", ["a"]).sequence == 2
    catalog.tier.close()
    again: Catalog = make_catalog()
    assert [(v.checkpoint_id, v.pinned) for v in again.list_checkpoints("run")] == [
        ("step-1", True),
        ("step-2", False),
    ]


def test_keep_persistent_only_writes_the_manifest_before_releasing(
    make_catalog, save, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # Audit L3: a failure (or crash) between the two must not lose the files of a
    # manifest that still lists them as held.
    catalog: Catalog = make_catalog(memory_keep_last=1, drain_every=1)
    save(catalog, "run", "step-1", {"a": b"a" * 100})
    save(catalog, "run", "step-2", {"a": b"b" * 100})
    with monkeypatch.context() as m:
        _enospc(m)
        with pytest.raises(MemoryBudgetExceeded):
            catalog.mark_durable("run", "step-1")
    assert catalog.tier.file_path("run", "step-1", "a").exists()
    assert read_manifest(catalog.tier.manifest_path("run", "step-1")).files["a"].held
    catalog.forget_persistent("run", "step-1")
    assert catalog.mark_durable("run", "step-1")
    assert not catalog.tier.file_path("run", "step-1", "a").exists()
    assert not read_manifest(catalog.tier.manifest_path("run", "step-1")).files["a"].held


def test_adoption_never_follows_planted_links(make_catalog, save, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Audit H2, restart-time damage: links planted in the layout are removed, their
    # targets untouched.
    first: Catalog = make_catalog()
    save(first, "run", "step-1", {"a": b"a" * 100})
    save(first, "run", "step-2", {"a": b"b" * 100})
    target = tmp_path / "target"
    target.mkdir()
    (target / "notes.txt").write_text("notes")
    (target / "app.json").write_text("{}")
    target2 = tmp_path / "target2"
    (target2 / "keepme").mkdir(parents=True)
    (target2 / "keepme" / "x").write_text("x")
    secret = tmp_path / "secret"
    secret.write_bytes(b"b" * 100)
    secret.chmod(0o600)
    tier = first.tier
    (tier.manifest_root / "evil").symlink_to(target)
    (tier.data_root / "evil2").symlink_to(target2)
    (tier.data_root / "run" / "evil3").symlink_to(target2)
    data = tier.file_path("run", "step-2", "a")
    data.unlink()
    data.symlink_to(secret)
    tier.close()

    second: Catalog = make_catalog()
    assert sorted(p.name for p in target.iterdir()) == ["app.json", "notes.txt"]
    assert (target2 / "keepme" / "x").read_text() == "x"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    for link in ("manifests/evil", "data/evil2", "data/run/evil3"):
        assert not os.path.lexists(second.tier.root / link)
    # The checkpoint whose file became a link is not served (quarantined), step-1 is.
    assert [v.checkpoint_id for v in second.list_checkpoints("run")] == ["step-1"]
    assert not os.path.lexists(data)


def test_adopt_returns_plain_records_without_a_catalog(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    first: Catalog = make_catalog()
    save(first, "run", "good", {"a": b"a" * 3000})
    save(first, "run", "bad", {"a": b"b" * 2000})
    tier = first.tier
    with open(tier.file_path("run", "bad", "a"), "r+b") as f:
        os.fchmod(f.fileno(), 0o640)
        f.write(b"X")
    unfinished = tier.file_path("run", "half", "__0_0.distcp")
    tier.create_file(unfinished)
    unfinished.write_bytes(b"z" * 100)
    adopted = adopt(tier)
    assert list(adopted.records) == [("run", "good")]
    assert adopted.records[("run", "good")].state is State.COMMITTED
    assert adopted.quarantined_bytes == 2000  # kept for inspection, so it counts
    # An unfinished save is kept for the catalog to salvage or collect, and counted.
    assert adopted.orphans == {("run", "half"): {"__0_0.distcp": 100}}
    assert unfinished.exists() and adopted.orphan_bytes == 100
    assert tier.manifest_path("run", "bad").with_name("bad.json.corrupt").exists()
