"""A namespace's own memory window (`Catalog.set_memory_keep_last`, the SageMaker API's
`steps_retained`): the memory tier keeps min(namespace window, `[retention]
memory_keep_last`) of the namespace's newest by commit order, with every rule of
memory retention, and the window travels with the manifest (disk, peers) so a node that
never saw the setting applies it too."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierckpt.errors import InvalidArgument
from tierckptd.catalog import Catalog
from tierckptd.catalog.retention import effective_window
from tierckptd.memory.manifest import ManifestError, from_json, to_json
from tierckptd.memory.tier import MemoryTier
from tierckptd.model import MAX_NAMESPACE_KEEP_LAST
from tierckptd.wire import record_from_info, to_info

from tests.support.clock import FakeClock

from .conftest import MakeCatalog, Save, write_file

NS = "job"


def _ids(catalog: Catalog, namespace: str = NS) -> list[str]:
    return [v.checkpoint_id for v in catalog.list_checkpoints(namespace)]


def _save_for_peers(catalog: Catalog, checkpoint_id: str) -> None:
    """A one-file save whose block size a peer takes (`wire.check_checksums`)."""
    catalog.begin(NS, checkpoint_id, 0)
    catalog.reserve(NS, checkpoint_id, 0, 1)
    write_file(catalog, NS, checkpoint_id, "__0_0.distcp", b"x", block_size=64 << 10)
    catalog.commit(NS, checkpoint_id, ["__0_0.distcp"])


def test_the_stricter_window_wins_and_none_never_widens() -> None:
    assert effective_window(0, 0) == 0  # unlimited, no namespace window
    assert effective_window(0, 2) == 2
    assert effective_window(5, 2) == 2
    assert effective_window(2, 5) == 2  # a namespace cannot keep more than [retention]
    assert effective_window(3, 0) == 3


def test_window_by_commit_order_beside_an_unlimited_retention(
    make_catalog: MakeCatalog, save: Save
) -> None:
    """Commit order, not the step's name nor wall time: the wall clock runs backwards
    here and the names sort the other way, and the two newest commits stay."""
    wall = FakeClock(start=5_000.0)
    catalog = make_catalog(memory_keep_last=0, wall_clock=wall)
    catalog.set_memory_keep_last(NS, 2)
    for name in ("step-9", "step-8", "step-7", "step-10", "step-11"):
        save(catalog, NS, name, {"a": b"x"})
        wall.now -= 60.0  # an NTP step back between commits orders nothing
    assert _ids(catalog) == ["step-10", "step-11"]
    assert not catalog.tier.data_dir(NS, "step-7").exists()
    assert catalog.get(NS).checkpoint_id == "step-11"
    # Another namespace has no window: [retention] (unlimited here) alone.
    for i in range(4):
        save(catalog, "other", f"s{i}", {"a": b"x"})
    assert len(_ids(catalog, "other")) == 4


def test_retention_stays_the_bound_and_pins_are_honoured(
    make_catalog: MakeCatalog, save: Save
) -> None:
    catalog = make_catalog(memory_keep_last=1)
    catalog.set_memory_keep_last(NS, 3)  # wider than [retention]: [retention] wins
    save(catalog, NS, "s1", {"a": b"x"})
    catalog.apply_pin(NS, "s1", True)
    for i in range(2, 5):
        save(catalog, NS, f"s{i}", {"a": b"x"})
    assert _ids(catalog) == ["s1", "s4"]  # the pin stays, outside the window


def test_a_due_step_stays_until_durable_then_leaves_memory_only(
    make_catalog: MakeCatalog, save: Save
) -> None:
    """Invariant 6: a step due for the persistent tier is not evicted before it drains;
    once durable it leaves memory and stays listed from the persistent tier (memory
    eviction never deletes from it)."""
    catalog = make_catalog(memory_keep_last=0, drain_every=1)
    catalog.set_memory_keep_last(NS, 2)
    for i in range(1, 6):
        save(catalog, NS, f"s{i}", {"a": b"x"})
    assert _ids(catalog) == [f"s{i}" for i in range(1, 6)]  # none durable yet: all held
    for i in range(1, 6):
        catalog.mark_durable(NS, f"s{i}")
    views = {v.checkpoint_id: v for v in catalog.list_checkpoints(NS)}
    assert sorted(views) == [f"s{i}" for i in range(1, 6)]
    in_memory = sorted(i for i, v in views.items() if "memory" in v.tiers)
    assert in_memory == ["s4", "s5"]
    assert all(views[i].tiers == ("persistent",) for i in ("s1", "s2", "s3"))
    assert not catalog.tier.data_dir(NS, "s1").exists()


def test_the_window_travels_with_the_manifest_to_a_node_that_never_saw_it(
    make_catalog: MakeCatalog, tmp_path: Path
) -> None:
    coordinator = make_catalog(memory_keep_last=0)
    coordinator.set_memory_keep_last(NS, 2)
    tier = MemoryTier(tmp_path / "replacement")
    tier.open_layout()
    replacement = Catalog(
        tier, node_id="node-b", failure_domain="rack-2", budget=1 << 20, memory_keep_last=0
    )
    replacement.adopt()
    try:
        for i in range(1, 6):
            _save_for_peers(coordinator, f"s{i}")
            view = coordinator.get(NS, f"s{i}")
            assert view.memory_keep_last == 2
            replacement.publish(record_from_info(to_info(view, local_paths=False)))
        assert _ids(replacement) == ["s4", "s5"]
        # A restart reads it back from the manifest on disk.
        doc = coordinator.manifest_document(NS, "s5")
        assert doc["memory_keep_last"] == 2 and from_json(doc).memory_keep_last == 2
    finally:
        tier.close()


def test_the_window_is_validated_where_it_enters(make_catalog: MakeCatalog) -> None:
    catalog = make_catalog()
    for bad in (-1, MAX_NAMESPACE_KEEP_LAST + 1):
        with pytest.raises(InvalidArgument, match="keep_last"):
            catalog.set_memory_keep_last(NS, bad)
    _save_for_peers(catalog, "s1")
    doc = catalog.manifest_document(NS, "s1")
    assert doc["memory_keep_last"] == 0  # no window set: none recorded
    del doc["memory_keep_last"]  # a manifest from before the field: no window
    assert from_json(doc).memory_keep_last == 0
    for bad_value in (-1, True, 2.0, "2", MAX_NAMESPACE_KEEP_LAST + 1):
        with pytest.raises(ManifestError, match="memory_keep_last"):
            from_json({**to_json(from_json(doc)), "memory_keep_last": bad_value})
    info = to_info(catalog.get(NS, "s1"), local_paths=False)
    info.memory_keep_last = MAX_NAMESPACE_KEEP_LAST + 1
    with pytest.raises(InvalidArgument, match="memory_keep_last"):
        record_from_info(info)
