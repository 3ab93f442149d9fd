"""Checkpoint ids that are folder paths (``run1/step-10``) in both tiers' layouts.

The memory tier spells them flat (one directory per checkpoint, read back validated at
adoption); the persistent tier nests the data as a local folder would and keeps the
bookkeeping and the durable index flat. Nothing built from an id leaves its root, a
checkpoint that is also a folder is deleted without its nested checkpoints, and what a
listing reads back is validated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tierckpt.errors import InvalidName
from tierckptd.memory.tier import MemoryTier
from tierckptd.persistent.listing import durable_ids, write_index_entry
from tierckptd.persistent.store import PersistentTier

from tests.support.persistent_store import file_store

from .conftest import MakeCatalog, Save

NS = "team"
BAD_IDS = ["run1/..", "../x", "run1/./x", "run1//x", "/abs", "run1/.tierckpt", "a\\b"]


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return file_store(tmp_path / "store")


def _put_checkpoint(store: PersistentTier, root: Path, checkpoint_id: str) -> None:
    """A drained-looking checkpoint: data, `.metadata` and a bookkeeping object."""
    folder = root / NS / checkpoint_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__0_0.distcp").write_bytes(b"d")
    (folder / ".metadata").write_bytes(b"m")
    store.put_bookkeeping(NS, checkpoint_id, "manifest.json", b"{}")


def test_persistent_paths_nest_the_data_and_keep_bookkeeping_flat(
    store: PersistentTier, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    assert store.checkpoint_path(NS, "run1/step-10") == f"{store.root}/{NS}/run1/step-10"
    assert store.checkpoint_url(NS, "run1/step-10").endswith(f"/{NS}/run1/step-10")
    store.put_bookkeeping(NS, "run1/step-10", "manifest.json", b"{}")
    assert (root / ".tierckpt" / NS / "run1+step-10" / "manifest.json").read_bytes() == b"{}"
    write_index_entry(store, NS, "run1/step-10")
    assert (root / NS / ".tierckpt" / "durable" / "run1+step-10").exists()
    for bad in BAD_IDS:
        with pytest.raises(InvalidName):
            store.checkpoint_path(NS, bad)
        with pytest.raises(InvalidName):
            store.put_bookkeeping(NS, bad, "manifest.json", b"{}")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        f".tierckpt/{NS}/run1+step-10/manifest.json",
        f"{NS}/.tierckpt/durable/run1+step-10",
    ]


def test_discovery_finds_nested_checkpoints_and_validates_what_it_reads(
    store: PersistentTier, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    for checkpoint_id in ("step-5", "run1/step-10", "run1/step-20", "a/b/c/d/e/f/g/h"):
        _put_checkpoint(store, root, checkpoint_id)
    # Junk a shared bucket may hold: a hidden folder, too deep, a bad segment, no .metadata.
    for junk in ("run1/.hidden/x", "/".join("abcdefghi"), "run1/bad name", "run2/step-1"):
        (root / NS / junk).mkdir(parents=True, exist_ok=True)
        if junk != "run2/step-1":
            (root / NS / junk / ".metadata").write_bytes(b"m")
    (root / NS / "run2/step-1/__0_0.distcp").write_bytes(b"d")
    found = {"step-5", "run1/step-10", "run1/step-20", "a/b/c/d/e/f/g/h"}
    assert set(store.list_durable(NS)) == found
    assert durable_ids(store, NS, scan=True) == found
    assert store.bookkept_ids(NS) == found
    # A bookkeeping directory whose flat name is no id is skipped.
    (root / ".tierckpt" / NS / "run1+..").mkdir()
    (root / ".tierckpt" / NS / "+x").mkdir()
    assert store.bookkept_ids(NS) == found
    for checkpoint_id in ("run1/step-10", "a/b/c/d/e/f/g/h"):
        write_index_entry(store, NS, checkpoint_id)
    (root / NS / ".tierckpt" / "durable" / "x++y").write_bytes(b"")
    assert durable_ids(store, NS) == {"run1/step-10", "a/b/c/d/e/f/g/h"}


def test_deleting_a_checkpoint_that_is_also_a_folder_keeps_the_nested_ones(
    store: PersistentTier, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    for checkpoint_id in ("run1", "run1/step-10"):
        _put_checkpoint(store, root, checkpoint_id)
    store.delete(NS, "run1")
    assert sorted(store.list_durable(NS)) == ["run1/step-10"]
    assert not (root / NS / "run1" / ".metadata").exists()
    assert (root / NS / "run1" / "step-10" / "__0_0.distcp").exists()
    assert (root / ".tierckpt" / NS / "run1+step-10" / "manifest.json").exists()
    store.delete(NS, "run1/step-10")
    assert store.list_durable(NS) == [] and not (root / NS / "run1" / "step-10").exists()


def test_memory_adoption_reads_folder_ids_back_and_removes_bad_names(
    make_catalog: MakeCatalog, save: Save, tmp_path: Path
) -> None:
    catalog = make_catalog()
    save(catalog, NS, "run1/step-10", {".metadata": b"m" * 10, "__0_0.distcp": b"d" * 100})
    tier: MemoryTier = catalog.tier
    assert (tier.data_root / NS / "run1+step-10" / "__0_0.distcp").exists()
    assert (tier.manifest_root / NS / "run1+step-10.json").exists()
    tier.close()
    # Names no id spells, planted while the daemon was down: removed unfollowed.
    for bad in ("run1+..", "+x", "a++b"):
        (tier.data_root / NS / bad).mkdir()
        (tier.manifest_root / NS / f"{bad}.json").write_bytes(b"{}")
    again = make_catalog()
    assert [c.checkpoint_id for c in again.list_checkpoints(NS)] == ["run1/step-10"]
    assert sorted(p.name for p in (tier.data_root / NS).iterdir()) == ["run1+step-10"]
    assert sorted(p.name for p in (tier.manifest_root / NS).iterdir()) == ["run1+step-10.json"]
