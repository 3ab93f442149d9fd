from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tierckpt.checksum import checksum_bytes
from tierckptd.catalog import Catalog
from tierckptd.manifest import ManifestError, atomic_write, read_manifest, write_manifest
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
    assert second.status().used_bytes == 10000  # quarantined bytes still count


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
