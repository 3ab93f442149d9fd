"""A save whose commit never reached this node is kept until the peers say what became of
it (`peers.unfinished.UnfinishedSaves`, over `Catalog.idle_saves`, `abort_idle` and
`salvage_orphans`), and a reader's restored copy is not evicted under it.

Files of a multi-node save may be the only copies of a checkpoint its coordinator
committed: the sweep asks the peers before aborting such a save, and after a restart the
files left without a manifest (orphans) are installed once a coordinator's manifest
names them and they verify, or collected once their fate is known.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tierckpt.checksum import checksum_bytes
from tierckptd.catalog import SURPLUS_GRACE, UNFINISHED_PATIENCE, Catalog, Resolution
from tierckptd.catalog.budget import PAGE, pages
from tierckptd.memory.incoming import install_copy
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.peers.unfinished import UnfinishedSaves

from .conftest import FakeClock, MakeCatalog, Save, write_file

NS = "run"
MINE = "__1_0.distcp"
THEIRS = "__0_0.distcp"
ABANDON = 10.0


def _peer_side_save(catalog: Catalog, ckpt: str, data: bytes) -> FileRecord:
    """Rank 1's file, written and committed on this node (node-b); the save stays
    WRITING here until the coordinator (node-a) publishes its manifest."""
    catalog.begin(NS, ckpt, 1)
    catalog.reserve(NS, ckpt, 1, len(data))
    write_file(catalog, NS, ckpt, MINE, data, rank=1)
    return catalog.holdings(NS, ckpt)[1][0]


def _manifest(ckpt: str, mine: FileRecord, theirs: bytes) -> CheckpointRecord:
    """The coordinator's cluster manifest: its own file and node-b's."""
    files = {
        MINE: dataclasses.replace(mine, owner_node="node-b", held=False),
        THEIRS: FileRecord(
            name=THEIRS,
            rank=0,
            size=len(theirs),
            checksums=checksum_bytes(theirs, block_size=1024),
            owner_node="node-a",
            held=False,
        ),
    }
    return CheckpointRecord(NS, ckpt, State.COMMITTED, 1.0, "node-a", 2.0, 5, files=files)


def _node_b(make_catalog: MakeCatalog) -> Catalog:
    return make_catalog(node_id="node-b", budget=1 << 20, abandon_after=ABANDON)


def test_the_sweep_adopts_the_coordinators_manifest_instead_of_aborting(
    make_catalog: MakeCatalog, clock: FakeClock
) -> None:
    node = _node_b(make_catalog)
    data = os.urandom(3000)
    mine = _peer_side_save(node, "s1", data)
    asked: list[tuple[str, str]] = []

    def resolve(namespace: str, checkpoint_id: str) -> Resolution:
        asked.append((namespace, checkpoint_id))
        node.publish(_manifest(checkpoint_id, mine, b"t" * 100))
        return "published"

    unfinished = UnfinishedSaves(node, resolve)
    clock.now += ABANDON + 1
    assert unfinished.sweep() == []
    assert asked == [(NS, "s1")]
    view = node.get(NS, "s1")
    assert view.state is State.COMMITTED
    assert Path(view.local_paths[MINE]).read_bytes() == data


def test_an_unanswered_question_keeps_the_save_until_the_patience_is_spent(
    make_catalog: MakeCatalog, clock: FakeClock
) -> None:
    node = _node_b(make_catalog)
    _peer_side_save(node, "s1", os.urandom(2000))
    answers: list[Resolution] = ["unknown"]
    unfinished = UnfinishedSaves(node, lambda ns, cid: answers[0])
    clock.now += ABANDON + 1
    assert unfinished.sweep() == []  # the coordinator may be restarting
    assert node.holdings(NS, "s1")[1]
    clock.now += UNFINISHED_PATIENCE * ABANDON
    assert unfinished.sweep() == [(NS, "s1")]
    assert node.holdings(NS, "s1")[1] == [] and node.used_bytes() == 0


def test_every_peer_answering_without_it_aborts_the_save_at_once(
    make_catalog: MakeCatalog, clock: FakeClock
) -> None:
    node = _node_b(make_catalog)
    _peer_side_save(node, "s1", os.urandom(2000))
    unfinished = UnfinishedSaves(node, lambda ns, cid: "absent")
    clock.now += ABANDON + 1
    assert unfinished.sweep() == [(NS, "s1")]


def test_a_save_without_committed_files_is_aborted_without_asking(
    make_catalog: MakeCatalog, clock: FakeClock
) -> None:
    node = _node_b(make_catalog)
    node.begin(NS, "s1", 1)
    unfinished = UnfinishedSaves(
        node, lambda ns, cid: (_ for _ in ()).throw(AssertionError("asked"))
    )
    clock.now += ABANDON + 1
    assert unfinished.sweep() == [(NS, "s1")]


def test_after_a_restart_orphan_files_are_installed_when_a_manifest_names_them(
    make_catalog: MakeCatalog,
) -> None:
    node = _node_b(make_catalog)
    data = os.urandom(5000)
    mine = _peer_side_save(node, "s1", data)
    _peer_side_save(node, "s2", os.urandom(700))  # its coordinator never committed it
    # Restart: a new daemon adopts the memory dir; no manifest, so both are orphans.
    node.tier.close()
    node = _node_b(make_catalog)
    assert node.used_bytes() == 5000 + 700  # on disk: counted until settled
    assert node.publish(_manifest("s1", mine, b"t" * 100))
    assert node.salvage_orphans() == 5000
    view = node.get(NS, "s1")
    assert Path(view.local_paths[MINE]).read_bytes() == data
    # s2 is kept (nothing known of it yet) until the patience is spent.
    s2_dir = node.tier.data_dir(NS, "s2")
    assert s2_dir.exists()
    node.salvage_orphans(final=True)
    assert not s2_dir.exists()
    assert node.used_bytes() == pages(5000) + PAGE + node._budget._manifest_total


def test_an_orphan_that_does_not_match_the_manifest_is_collected_not_installed(
    make_catalog: MakeCatalog,
) -> None:
    node = _node_b(make_catalog)
    mine = _peer_side_save(node, "s1", os.urandom(3000))
    node.tier.close()
    node = _node_b(make_catalog)
    path = node.tier.file_path(NS, "s1", MINE)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.write(b"\xff")  # a flipped byte
    assert node.publish(_manifest("s1", mine, b"t" * 100))
    assert node.salvage_orphans() == 0
    assert not node.get(NS, "s1").local_paths[MINE]
    assert not path.exists()
    assert node.used_bytes() == node._budget._manifest_total


def _restored_for_a_reader(node: Catalog, data: bytes) -> None:
    """A reader restores s1's file from another tier: the local copy goes, and a copy
    arrives as the restorer installs one."""
    with node._lock:
        node._records[(NS, "s1")].files[THEIRS].held = False
    node.tier.remove_file(node.tier.file_path(NS, "s1", THEIRS))
    f, _ = node.file_view(NS, "s1", THEIRS)
    assert install_copy(node, NS, "s1", f, [(0, data)], what=THEIRS, restored=True)


def test_a_readers_restored_copy_is_not_evicted_under_it(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    node = make_catalog(budget=1 << 20, memory_keep_last=1)
    save(node, NS, "s1", {THEIRS: b"a" * 100})
    _restored_for_a_reader(node, b"a" * 100)
    save(node, NS, "s2", {THEIRS: b"b" * 100})  # keep_last = 1 would evict s1 now
    assert node.get(NS, "s1").local_paths[THEIRS]
    clock.now += 4
    node.sweep()  # the grace is over: the sweeper applies retention again
    assert {v.checkpoint_id for v in node.list_checkpoints(NS)} == {"s2"}


def test_an_orphan_every_peer_answers_without_is_collected_at_once(
    make_catalog: MakeCatalog,
) -> None:
    node = _node_b(make_catalog)
    _peer_side_save(node, "s1", os.urandom(900))
    node.tier.close()
    node = _node_b(make_catalog)
    answers: list[Resolution] = ["unknown"]
    unfinished = UnfinishedSaves(node, lambda ns, cid: answers[0])
    unfinished.salvage_orphans()
    assert node.tier.data_dir(NS, "s1").exists() and node.used_bytes() == 900
    answers[0] = "absent"
    unfinished.salvage_orphans()
    assert not node.tier.data_dir(NS, "s1").exists() and node.used_bytes() == 0


def test_a_readers_restored_copy_is_not_trimmed_as_surplus_under_it(
    make_catalog: MakeCatalog, save: Save, clock: FakeClock
) -> None:
    node = make_catalog(budget=1 << 20)
    save(node, NS, "s1", {THEIRS: b"a" * 100})
    _restored_for_a_reader(node, b"a" * 100)
    assert not node.drop_local_copy(NS, "s1", THEIRS, surplus=True)
    clock.now += 4  # the reader's grace is over; any copy that just landed is kept longer
    assert not node.drop_local_copy(NS, "s1", THEIRS, surplus=True)
    clock.now += SURPLUS_GRACE
    assert node.drop_local_copy(NS, "s1", THEIRS, surplus=True)
