"""Persistent retention seen from the nodes that do not run it (found by bench/soak.py).

Only the committer of a checkpoint applies `persistent_keep_last` and deletes from the
persistent tier. The other nodes must not (1) hold a checkpoint in memory forever because
it was deleted before they probed it durable (invariant 6 would pin it: due, never
durable), nor (2) keep listing a checkpoint that was deleted as restorable from there.
A real catalog and a `file://` tier; the peer's manifest comes through the wire types.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tierckpt.errors import CheckpointNotFound
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.listing import Discovery, remove_index_entry
from tierckptd.persistent.store import PersistentTier
from tierckptd.wire import record_from_info, to_info

from tests.support.dcp_files import SavedCheckpoint, save_checkpoint

from .conftest import MakeCatalog
from .test_durable_hint import FAST, NS, _node, _save


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return PersistentTier(f"file://{tmp_path / 'store'}", retry=FAST)


@pytest.fixture
def saved(tmp_path: Path) -> SavedCheckpoint:
    return save_checkpoint(tmp_path / "hot")


def test_a_peer_checkpoint_deleted_before_this_node_saw_it_durable_is_retired(
    make_catalog: MakeCatalog,
    store: PersistentTier,
    saved: SavedCheckpoint,
) -> None:
    node = _node(make_catalog, every=1, keep_last=4)
    drainer = Drainer(node, store, keep_last=1)
    _save(node, "step-3", saved)
    assert drainer.drain(NS, "step-3")  # this node committed step-3: durable
    # step-2, coordinated by node-x (its .metadata and data there): due here, never
    # durable in the tier, since node-x drained it and deleted it for step-3.
    info = to_info(node.get(NS, "step-3"), local_paths=False)
    info.ref.checkpoint_id = "step-2"
    for entry in info.files:
        entry.owner_node = "node-x"
    peer = record_from_info(info)
    assert node.publish(dataclasses.replace(peer, sequence=1))
    assert (NS, "step-2") in node.due_not_durable()
    assert drainer.drain(NS, "step-2")  # done with it, not "try again later"
    assert node.due_not_durable() == []
    assert not store.is_durable(NS, "step-2")  # and nothing was written for it


def test_the_committer_is_not_retired_and_the_newest_never_is(
    make_catalog: MakeCatalog,
    store: PersistentTier,
    saved: SavedCheckpoint,
) -> None:
    node = _node(make_catalog, every=1, keep_last=4)
    drainer = Drainer(node, store, keep_last=1)
    _save(node, "step-1", saved)
    _save(node, "step-2", saved)
    assert drainer.drain(NS, "step-2")
    # step-1 is this node's own: it drains (and its own retention then deletes it).
    assert drainer.drain(NS, "step-1")
    assert node.due_not_durable() == []


def test_a_listing_forgets_what_another_node_deleted_from_the_tier(
    make_catalog: MakeCatalog,
    store: PersistentTier,
    saved: SavedCheckpoint,
) -> None:
    node = _node(make_catalog, every=1, keep_last=1)
    drainer = Drainer(node, store)
    for cid in ("step-1", "step-2"):
        _save(node, cid, saved)
        assert drainer.drain(NS, cid)
    # memory_keep_last = 1: step-1 is held only in the tier now, listed as restorable.
    assert node.get(NS, "step-1").tiers == ("persistent",)
    remove_index_entry(store, NS, "step-1")  # another node's persistent retention
    store.delete(NS, "step-1")
    discovery = Discovery(store, node, relist_interval=0)
    discovery.refresh(NS)
    with pytest.raises(CheckpointNotFound):
        node.get(NS, "step-1")
    assert node.get(NS, "step-2").checkpoint_id == "step-2"  # still listed: still there
