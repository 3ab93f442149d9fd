"""A checkpoint that memory retention let go to the persistent tier only is not healed.

Found by bench/soak.py: every node's healer marked each such DURABLE checkpoint "lost"
(an ERROR per checkpoint, `lost` in `tierckpt ls`) and kept pushing its files back
into nodes that had evicted it, every heal interval.
"""

from __future__ import annotations

import dataclasses

from tierckptd.catalog import Catalog
from tierckptd.model import CheckpointRecord, State

from .conftest import MakeCatalog, Save
from .test_healer import PEERS, FakePeers, _cluster


def test_a_persistent_only_checkpoint_is_neither_lost_nor_pushed(
    make_catalog: MakeCatalog, save: Save
) -> None:
    catalog: Catalog = make_catalog(memory_keep_last=1, drain_every=1)
    fake = FakePeers("node-a", PEERS)
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 300})
    save(catalog, "run", "s2", {".metadata": b"n" * 10, "__0_0.distcp": b"y" * 300})
    assert catalog.mark_durable("run", "s1")  # retention now evicts it: persistent only
    view = catalog.get("run", "s1")
    assert view.state is State.DURABLE and not any(f.held for f in view.files)
    fake.held["b"] = {".metadata": b"m" * 10}  # a peer that has not evicted it yet
    fake.knows["b"] = True

    assert cluster.healer.heal("run", "s1") is None
    assert cluster.healer.label("run", "s1") == ""
    assert catalog.get("run", "s1").tiers == ("persistent",)
    assert fake.pushed == []


def test_a_peer_cannot_list_itself_as_holder_of_a_persistent_only_checkpoint(
    make_catalog: MakeCatalog, save: Save
) -> None:
    """A peer that has not evicted it yet says "I hold a copy" (UpdateReplicas): taken,
    the record was a memory one again, accepted that peer's pushes and was never evicted
    nor forgotten when the persistent tier's retention deleted it (found by the soak)."""
    catalog: Catalog = make_catalog(memory_keep_last=1, drain_every=1)
    save(catalog, "run", "s1", {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 300})
    save(catalog, "run", "s2", {".metadata": b"n" * 10, "__0_0.distcp": b"y" * 300})
    assert catalog.mark_durable("run", "s1")

    assert not catalog.set_replicas("run", "s1", ".metadata", ["b"])
    assert catalog.get("run", "s1").tiers == ("persistent",)
    catalog.forget_persistent("run", "s1")  # the persistent tier's retention deleted it
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["s2"]


def test_a_manifest_published_again_does_not_bring_a_persistent_only_one_back(
    make_catalog: MakeCatalog, save: Save
) -> None:
    """The same through a publish of the known manifest (gossip merges the coordinator's
    replica lists every heal round): found by the soak smoke, nodes kept a durable
    checkpoint in memory past `memory_keep_last`."""
    catalog: Catalog = make_catalog(memory_keep_last=1, drain_every=1)
    save(catalog, "run", "s1", {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 300})
    view = catalog.get("run", "s1")
    save(catalog, "run", "s2", {".metadata": b"n" * 10, "__0_0.distcp": b"y" * 300})
    assert catalog.mark_durable("run", "s1")
    assert catalog.get("run", "s1").tiers == ("persistent",)

    # The coordinator's manifest, with replica lists from before the eviction here.
    again = CheckpointRecord(
        "run", "s1", State.COMMITTED, view.created_unix, "", view.committed_unix, view.sequence
    )
    again.files = {
        f.name: dataclasses.replace(f, held=False, replica_nodes=["b"]) for f in view.files
    }
    catalog.publish(again)
    assert catalog.get("run", "s1").tiers == ("persistent",)
    assert not any(f.replica_nodes for f in catalog.get("run", "s1").files)
