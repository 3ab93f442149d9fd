"""The memory budget counts what tmpfs charges (audit 3, M6): whole pages per file, a
page per data directory, every manifest (this node's own too), and a bounded number of
namespaces, on a real catalog over a real memory dir."""

from __future__ import annotations

import os

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import MemoryBudgetExceeded
from tierckptd.catalog import Catalog
from tierckptd.catalog.budget import PAGE, held_charge, pages
from tierckptd.model import CheckpointRecord, FileRecord, State

from tests.unit.tierckptd.conftest import MakeCatalog, Save


def _file_blocks(catalog: Catalog) -> int:
    """Bytes the data files and manifests under the memory dir take (st_blocks)."""
    total = 0
    for top in (catalog.tier.data_root, catalog.tier.manifest_root):
        for root, _dirs, files in os.walk(top):
            total += sum(os.lstat(os.path.join(root, name)).st_blocks * 512 for name in files)
    return total


def test_pages_round_up() -> None:
    assert (pages(0), pages(1), pages(PAGE), pages(PAGE + 1)) == (0, PAGE, PAGE, 2 * PAGE)


def test_one_byte_checkpoints_are_charged_what_they_hold(
    make_catalog: MakeCatalog, save: Save
) -> None:
    """The audit's flood: 1-byte checkpoints, one per namespace. Counting bytes said 1 B
    each while tmpfs held 8 KiB each; the budget now charges at least what tmpfs holds."""
    catalog = make_catalog(budget=64 << 20, memory_keep_last=100)
    n = 40
    for i in range(n):
        save(catalog, f"flood-{i}", "s", {".metadata": b"x"})
    used = catalog.used_bytes()
    # A file page, its data dir and its manifest: three pages each, not one byte.
    assert used == n * 3 * PAGE
    assert used >= _file_blocks(catalog) >= n * 2 * PAGE  # what the filesystem holds
    assert catalog._budget._manifest_total == n * PAGE  # own manifests are charged


def test_own_manifest_is_charged_and_given_back(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s1", {"a": b"y" * (PAGE + 1)})
    manifest = catalog.tier.manifest_path("run", "s1").stat().st_size
    assert catalog.used_bytes() == 2 * PAGE + PAGE + pages(manifest)
    catalog.delete("run", "s1")
    assert catalog.used_bytes() == 0


def test_the_budget_refuses_what_pages_do_not_fit(make_catalog: MakeCatalog, save: Save) -> None:
    """A budget of 16 pages takes four 1-byte saves (3 pages each), not 16 x 4096 of them."""
    catalog = make_catalog(budget=16 * PAGE, memory_keep_last=100)
    for i in range(5):
        save(catalog, "run", f"s{i}", {"a": b"z"})
    assert catalog.used_bytes() == 15 * PAGE
    catalog.begin("run", "s9", 0)
    with pytest.raises(MemoryBudgetExceeded, match="memory budget exceeded"):
        catalog.reserve("run", "s9", 0, 2 * PAGE)


def test_restart_charges_the_same(make_catalog: MakeCatalog, save: Save) -> None:
    first = make_catalog()
    save(first, "run", "s1", {"a": b"q" * 10, ".metadata": b"m"})
    used = first.used_bytes()
    first.tier.close()
    second = make_catalog()
    assert second.used_bytes() == used
    rec = second._records[("run", "s1")]
    assert held_charge(rec) == 3 * PAGE


def _published(namespace: str, checkpoint_id: str = "s1") -> CheckpointRecord:
    data = b"p" * 100
    f = FileRecord(
        name=".metadata",
        rank=0,
        size=len(data),
        checksums=checksum_bytes(data, block_size=1024),
        owner_node="node-z",
        held=False,
    )
    return CheckpointRecord(
        namespace, checkpoint_id, State.COMMITTED, 1.0, "node-z", 2.0, 5, files={".metadata": f}
    )


def test_namespaces_per_node_are_bounded(make_catalog: MakeCatalog, save: Save) -> None:
    """`[memory] max_namespaces`: a save or a peer's manifest in one more namespace is
    RESOURCE_EXHAUSTED; namespaces already held keep working."""
    catalog = make_catalog(budget=64 << 20, memory_keep_last=100, max_namespaces=3)
    for i in range(3):
        save(catalog, f"ns-{i}", "s1", {"a": b"1"})
    with pytest.raises(MemoryBudgetExceeded, match=r"max_namespaces = 3") as e:
        catalog.begin("ns-3", "s1", 0)
    assert "tierckpt rm" in str(e.value) and "node-a" in str(e.value)
    with pytest.raises(MemoryBudgetExceeded, match="the manifest of ns-4/s1"):
        catalog.publish(_published("ns-4"))
    save(catalog, "ns-0", "s2", {"a": b"2"})  # a namespace it holds: fine
    catalog.delete("ns-2", "s1")
    save(catalog, "ns-3", "s1", {"a": b"3"})  # room again
    assert catalog.publish(_published("ns-3", "s7"))  # held namespace: the manifest is taken
    assert {v.namespace for v in catalog.list_checkpoints()} == {"ns-0", "ns-1", "ns-3"}
