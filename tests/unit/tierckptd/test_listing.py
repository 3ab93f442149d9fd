"""The persistent tier as a live source: checkpoints another cluster drained into the same
`file://` tier are learnt when asked for (probe of an explicit id, re-list after an
interval), through the per-namespace index or a flat prefix scan; no daemon, no gRPC.
The S3 paths (moto over HTTP, real daemons) are in tests/integration/test_persistent_live.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tierckpt.errors import CheckpointNotFound, InvalidName, TierUnavailable
from tierckptd.catalog import Catalog
from tierckptd.config import PersistentConfig, parse_config
from tierckptd.memory.tier import MemoryTier
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.listing import (
    INDEX_DIR,
    Discovery,
    adopt_all,
    durable_ids,
    repair_index,
)
from tierckptd.persistent.source import PersistentSource
from tierckptd.persistent.store import PersistentTier
from tierckptd.restore import Restorer

from tests.support.clock import FakeClock
from tests.support.dcp_files import make_state, save_checkpoint
from tests.support.persistent_store import FAST, file_store

from .conftest import MakeCatalog, Save

NS = "run9"


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return file_store(tmp_path / "store")


@pytest.fixture
def other(tmp_path: Path) -> Iterator[Catalog]:
    """Another cluster's node: its own memory tier, the same persistent tier."""
    tier = MemoryTier(tmp_path / "other-mem")
    tier.open_layout()
    catalog = Catalog(
        tier, node_id="node-z", failure_domain="rack-9", budget=64 << 20, drain_every=1
    )
    catalog.adopt()
    yield catalog
    tier.close()


@pytest.fixture
def node(make_catalog: MakeCatalog) -> Catalog:
    return make_catalog(budget=64 << 20, memory_keep_last=10)


def _drain_elsewhere(
    other: Catalog, save: Save, store: PersistentTier, tmp_path: Path, cid: str, seed: int = 0
) -> Path:
    saved = save_checkpoint(tmp_path / f"hot-{cid}", make_state(seed=seed))
    names = [*saved.data_names, ".metadata"]
    save(other, NS, cid, {n: (saved.directory / n).read_bytes() for n in names})
    assert Drainer(other, store).drain(NS, cid)
    return saved.directory


def test_probe_adopts_a_checkpoint_another_cluster_drained(
    node: Catalog, other: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    hot = _drain_elsewhere(other, save, store, tmp_path, "step-000007", seed=7)
    assert (tmp_path / "store" / NS / INDEX_DIR / "step-000007").exists()
    discovery = Discovery(store, node)
    with pytest.raises(CheckpointNotFound):
        node.get(NS, "step-000007")
    assert discovery.probe(NS, "step-000007")
    view = node.get(NS, "step-000007")
    assert "persistent" in view.tiers and not any(f.held for f in view.files)
    source = PersistentSource(store)
    restorer = Restorer(node, lambda *_: [source])
    for f in view.files:
        _, path = restorer.ensure_local(NS, "step-000007", f.name)
        assert Path(path).read_bytes() == (hot / f.name).read_bytes()
    assert discovery.probe(NS, "step-000007")  # known: still True, nothing adopted again


def test_a_missing_id_is_remembered_for_a_short_while(
    node: Catalog, other: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    clock = FakeClock()
    discovery = Discovery(store, node, negative_ttl=5.0, max_negative=2, clock=clock)
    for _ in range(10):
        assert not discovery.probe(NS, "step-000001")
    assert discovery.probes == 1  # a loop of bad ids does not hammer the tier
    with pytest.raises(InvalidName):
        discovery.probe(NS, "../../etc")
    assert discovery.probes == 1
    _drain_elsewhere(other, save, store, tmp_path, "step-000001")
    assert not discovery.probe(NS, "step-000001")  # still cached
    clock.now += 6.0
    assert discovery.probe(NS, "step-000001")
    assert discovery.probes == 2
    for i in range(2, 6):  # the cache is bounded
        discovery.probe(NS, f"step-00000{i}")
    assert len(discovery._negative) == 2


def test_refresh_lists_again_only_after_the_interval(
    node: Catalog, other: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    clock = FakeClock()
    discovery = Discovery(store, node, relist_interval=30.0, clock=clock)
    discovery.mark_listed()
    _drain_elsewhere(other, save, store, tmp_path, "step-000003")
    assert discovery.refresh(NS) == 0  # fresh view: not listed
    clock.now += 31.0
    assert discovery.refresh(NS) == 1
    assert node.get(NS).checkpoint_id == "step-000003"
    _drain_elsewhere(other, save, store, tmp_path, "step-000004", seed=1)
    assert discovery.refresh("", max_age=0.0) == 1  # every namespace
    assert [v.checkpoint_id for v in node.list_checkpoints(NS)] == ["step-000003", "step-000004"]


def test_the_index_is_flat_validated_and_has_a_scan_fallback(
    other: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    _drain_elsewhere(other, save, store, tmp_path, "step-000001")
    _drain_elsewhere(other, save, store, tmp_path, "step-000002", seed=1)
    index = tmp_path / "store" / NS / INDEX_DIR
    (index / "not an id").write_bytes(b"")
    assert durable_ids(store, NS) == {"step-000001", "step-000002"}
    for entry in index.iterdir():
        entry.unlink()  # drained before the index existed: the flat scan finds them
    assert durable_ids(store, NS) == {"step-000001", "step-000002"}


def test_retention_removes_the_index_entry(
    other: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    for i in range(1, 4):
        cid = f"step-00000{i}"
        saved = save_checkpoint(tmp_path / f"hot-{cid}", make_state(seed=i))
        names = [*saved.data_names, ".metadata"]
        save(other, NS, cid, {n: (saved.directory / n).read_bytes() for n in names})
        assert Drainer(other, store, keep_last=2).drain(NS, cid)
    assert durable_ids(store, NS) == {"step-000002", "step-000003"}
    assert sorted(p.name for p in (tmp_path / "store" / NS / INDEX_DIR).iterdir()) == [
        "step-000002",
        "step-000003",
    ]


def test_an_outage_during_a_probe_is_unavailable_naming_the_tier(
    node: Catalog, tmp_path: Path
) -> None:
    root = tmp_path / "blocked"
    root.write_bytes(b"")  # every path under it fails with NotADirectoryError (transient)
    tier = PersistentTier(f"file://{root}", retry=FAST)
    discovery = Discovery(tier, node)
    with pytest.raises(TierUnavailable, match="persistent file store "):
        discovery.probe(NS, "step-000001")
    assert discovery.refresh(NS) == 0  # logged, not raised: the memory tier answers


def test_relist_interval_is_a_persistent_key() -> None:
    assert PersistentConfig().relist_interval == 30.0
    assert parse_config({"persistent": {"relist_interval": 2}}).persistent.relist_interval == 2.0


def test_an_index_entry_without_its_metadata_is_not_trusted(
    node: Catalog, other: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    _drain_elsewhere(other, save, store, tmp_path, "step-000001")
    (tmp_path / "store" / NS / "step-000001" / ".metadata").unlink()  # deleted by hand
    assert durable_ids(store, NS) == {"step-000001"}  # the entry is still listed
    discovery = Discovery(store, node, relist_interval=0.0)
    assert discovery.refresh(NS) == 0
    with pytest.raises(CheckpointNotFound):
        node.get(NS, "step-000001")
    # The cluster that drained it: listed, known, but not durable any more.
    other_view = Discovery(store, other, relist_interval=0.0)
    other.forget_persistent(NS, "step-000001")
    assert other_view.refresh(NS) == 0 and not other.durability.is_durable(NS, "step-000001")


def test_a_start_writes_the_index_entries_a_cut_off_drain_left_out(
    other: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    # Three durable checkpoints; the entry of the newest is missing (a kill -9 between its
    # `.metadata` and its entry): a listing of the index would hide it from every other
    # cluster. A daemon's start (adopt_all: a full scan) writes it, and only it.
    for i in range(1, 4):
        _drain_elsewhere(other, save, store, tmp_path, f"step-00000{i}", seed=i)
    index = tmp_path / "store" / NS / INDEX_DIR
    (index / "step-000003").unlink()
    assert durable_ids(store, NS) == {"step-000001", "step-000002"}
    before = {p.name: p.stat().st_mtime_ns for p in index.iterdir()}
    assert repair_index(store, NS, durable_ids(store, NS, scan=True)) == 1
    assert durable_ids(store, NS) == {"step-000001", "step-000002", "step-000003"}
    assert {p.name: p.stat().st_mtime_ns for p in index.iterdir() if p.name in before} == before
    assert repair_index(store, NS, durable_ids(store, NS, scan=True)) == 0
    # Through a start: the catalog of a node that knew nothing adopts all three.
    (index / "step-000002").unlink()
    fresh = MemoryTier(tmp_path / "fresh-mem")
    fresh.open_layout()
    catalog = Catalog(fresh, node_id="node-f", failure_domain="rack-f", budget=64 << 20)
    catalog.adopt()
    try:
        assert adopt_all(store, catalog) == 3
        assert (index / "step-000002").exists()
    finally:
        fresh.close()
