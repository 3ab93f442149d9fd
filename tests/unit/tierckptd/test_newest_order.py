"""Order without clocks and newest by ownership, on the catalog alone (audit 3, H6, H2, M2).

The integration tests (test_clock_order.py, test_newest_ownership.py) run the attacks
through real daemons; these pin the catalog's rules: the sequence orders, a namespace's
writers (`model.Trust`) decide which checkpoint may be the newest, the binding survives a
restart, and a re-publish never changes a checkpoint's coordinator.
"""

from __future__ import annotations

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import PermissionDenied
from tierckptd.catalog import Catalog
from tierckptd.model import CheckpointRecord, FileRecord, State, Trust

from .conftest import FakeClock, MakeCatalog, Save


class Wall:
    """A wall clock a test steps."""

    def __init__(self) -> None:
        self.now = 1.8e9

    def __call__(self) -> float:
        return self.now


def _file(name: str, data: bytes, owner: str) -> FileRecord:
    return FileRecord(
        name=name,
        rank=0,
        size=len(data),
        checksums=checksum_bytes(data, block_size=1024),
        owner_node=owner,
        held=False,
    )


def _peers(ns: str, cid: str, coordinator: str, *, sequence: int, at: float) -> CheckpointRecord:
    """A checkpoint `coordinator` publishes (it owns the .metadata)."""
    files = [_file(".metadata", b"m-" + cid.encode(), coordinator)]
    return CheckpointRecord(
        ns, cid, State.COMMITTED, at, "", at, sequence, files={f.name: f for f in files}
    )


def test_a_clock_stepped_back_neither_evicts_new_saves_nor_moves_the_newest(
    make_catalog: MakeCatalog, save: Save
) -> None:
    wall = Wall()
    catalog = make_catalog(wall_clock=wall, memory_keep_last=2)
    for cid in ("s1", "s2"):
        save(catalog, "run", cid, {".metadata": b"m", "__0_0.distcp": b"d" * 10})
    wall.now -= 3600.0
    for cid in ("s3", "s4"):
        save(catalog, "run", cid, {".metadata": b"m", "__0_0.distcp": b"d" * 10})
        assert catalog.get("run").checkpoint_id == cid
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["s3", "s4"]


def test_a_save_begun_later_is_not_superseded_by_a_clock_step(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    wall = Wall()
    catalog = make_catalog(wall_clock=wall)
    catalog.begin("run", "s1", 0)
    clock.now += 1.0
    wall.now -= 3600.0
    catalog.begin("run", "s2", 0)  # begun after s1, with an earlier wall time
    save(catalog, "run", "s1", {".metadata": b"m"})
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run", True)] == ["s1", "s2"]


def _mine(catalog: Catalog, save: Save, cid: str) -> None:
    save(catalog, "job", cid, {".metadata": b"m-" + cid.encode(), "__0_0.distcp": b"d" * 10})


def test_a_peer_outside_the_writers_is_listed_never_newest_and_moves_no_sequence(
    make_catalog: MakeCatalog, save: Save
) -> None:
    wall = Wall()
    catalog = make_catalog(wall_clock=wall)
    _mine(catalog, save, "step-1")
    forged = _peers("job", "step-9", "mallory", sequence=10**12, at=4e9)
    assert catalog.publish(forged)
    assert catalog.get("job").checkpoint_id == "step-1"
    (view,) = [v for v in catalog.list_checkpoints("job") if v.checkpoint_id == "step-9"]
    assert "foreign" in view.tiers and view.committed_unix == wall.now  # clamped
    _mine(catalog, save, "step-2")
    assert catalog.get("job", "step-2").sequence == 2  # not above mallory's
    # The binding is in the manifests: a restart keeps it.
    catalog.tier.close()
    again = make_catalog(wall_clock=wall)
    assert again.get("job").checkpoint_id == "step-2"
    assert again._records[("job", "step-9")].trust is Trust.FOREIGN
    _mine(again, save, "step-3")
    assert again.get("job", "step-3").sequence == 3


def test_the_first_coordinator_of_an_unknown_namespace_is_its_writer(
    catalog: Catalog, save: Save
) -> None:
    assert catalog.publish(_peers("run", "a-1", "node-b", sequence=5, at=1.0))
    assert catalog.publish(_peers("run", "m-1", "mallory", sequence=99, at=2.0))
    assert catalog.get("run").checkpoint_id == "a-1"
    assert catalog.publish(_peers("run", "a-2", "node-b", sequence=6, at=3.0))
    assert catalog.get("run").checkpoint_id == "a-2"
    # A save this node takes part in binds the namespace to its own coordinator.
    _mine(catalog, save, "step-1")  # in "job": another namespace, its own writers
    assert catalog.get("job").checkpoint_id == "step-1"
    assert catalog.get("run").checkpoint_id == "a-2"


def test_a_republish_naming_another_coordinator_is_refused(catalog: Catalog, save: Save) -> None:
    _mine(catalog, save, "step-1")
    view = catalog.get("job", "step-1")
    files = {f.name: FileRecord(**{**f.__dict__, "held": False}) for f in view.files}
    files[".metadata"].owner_node = "mallory"
    files["__0_0.distcp"].replica_nodes = ["mallory"]
    claim = CheckpointRecord(
        "job", "step-1", State.COMMITTED, 1.0, "", 1.0, view.sequence, files=files
    )
    with pytest.raises(PermissionDenied, match="coordinated by node node-a"):
        catalog.publish(claim)
    assert all(not f.replica_nodes for f in catalog.get("job", "step-1").files)


def test_a_deleted_checkpoint_stays_deleted_whatever_its_time(catalog: Catalog) -> None:
    published = _peers("run", "s1", "node-b", sequence=7, at=1.0)
    assert catalog.publish(published)
    catalog.delete("run", "s1")
    late = _peers("run", "s1", "node-b", sequence=7, at=4e9)  # a clock far ahead
    assert not catalog.publish(late)
    assert catalog.publish(_peers("run", "s1", "node-b", sequence=8, at=2.0))  # saved again
