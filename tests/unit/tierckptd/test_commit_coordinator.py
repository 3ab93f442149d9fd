"""The commit coordinator (tierckptd/commit.py): holders asked and listeners told only
while the node has peers; the catalog committed in between."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tierckpt.errors import CheckpointIncomplete
from tierckptd.catalog import Catalog
from tierckptd.commit import CommitCoordinator
from tierckptd.model import CheckpointView, FileRecord, State

from tests.support.catalog_files import write_file


class PeerTier:
    """Records what the coordinator asks and tells (the peer tier's two roles)."""

    def __init__(self) -> None:
        self.asked: list[set[str]] = []
        self.told: list[str] = []

    def remote_files(
        self, namespace: str, checkpoint_id: str, missing: set[str], hinted: Sequence[str]
    ) -> dict[str, FileRecord]:
        self.asked.append(set(missing))
        return {}

    def committed(self, view: CheckpointView) -> None:
        self.told.append(view.checkpoint_id)


def _write_metadata(catalog: Catalog, checkpoint_id: str) -> None:
    """Rank 0's .metadata written and committed; the checkpoint left to the coordinator."""
    catalog.begin("run", checkpoint_id, 0)
    catalog.reserve("run", checkpoint_id, 0, 10)
    write_file(catalog, "run", checkpoint_id, ".metadata", b"m" * 10)


def test_a_node_without_peers_commits_the_catalog_only(catalog: Catalog) -> None:
    peers = PeerTier()
    commits = CommitCoordinator(catalog, peers, [peers], peers=0)
    _write_metadata(catalog, "s1")
    assert commits.commit("run", "s1", [".metadata"]).state is State.COMMITTED
    with pytest.raises(CheckpointIncomplete, match="__1_0.distcp"):
        _write_metadata(catalog, "s2")
        commits.commit("run", "s2", [".metadata", "__1_0.distcp"])
    assert peers.asked == [] and peers.told == []


def test_with_peers_the_holders_are_asked_and_the_listeners_told(catalog: Catalog) -> None:
    peers = PeerTier()
    commits = CommitCoordinator(catalog, peers, [peers], peers=0)
    commits.peers_changed(2)  # a SIGHUP added [[peers]]
    _write_metadata(catalog, "s1")
    with pytest.raises(CheckpointIncomplete, match="__1_0.distcp"):  # nobody holds it
        commits.commit("run", "s1", [".metadata", "__1_0.distcp"])
    assert peers.asked == [{"__1_0.distcp"}] and peers.told == []
    assert commits.commit("run", "s1", [".metadata"]).state is State.COMMITTED
    assert peers.told == ["s1"]
