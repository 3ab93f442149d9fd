"""view_of: the derived states and tiers of a checkpoint, without files."""

from __future__ import annotations

from tierckpt.checksum import checksum_bytes
from tierckptd.catalog.views import view_of
from tierckptd.model import CheckpointRecord, FileRecord, State


def _file(
    name: str, owner: str, replicas: list[str] | None = None, held: bool = True
) -> FileRecord:
    return FileRecord(
        name,
        0,
        size=3,
        checksums=checksum_bytes(b"abc", block_size=1024),
        owner_node=owner,
        replica_nodes=replicas or [],
        held=held,
    )


def _rec(*files: FileRecord, state: State = State.COMMITTED) -> CheckpointRecord:
    rec = CheckpointRecord("run", "s1", state, 1.0, "a", 2.0, 7)
    rec.files = {f.name: f for f in files}
    return rec


def test_committed_held_here() -> None:
    rec = _rec(_file("b", "a"), _file("a", "a"))
    view = view_of(rec, node_id="a", paths={"a": "/m/a", "b": "/m/b"})
    assert view.state is State.COMMITTED and view.tiers == ("memory",)
    assert [f.name for f in view.files] == ["a", "b"]  # sorted by name
    assert view.local_paths == {"a": "/m/a", "b": "/m/b"}
    assert (view.size_bytes, view.sequence, view.committed_unix) == (6, 7, 2.0)
    # A copy: changing the view never changes the record.
    view.files[0].replica_nodes.append("x")
    assert rec.files["a"].replica_nodes == []


def test_replicated_needs_k_copies_of_every_file_and_no_mark() -> None:
    rec = _rec(_file("a", "a", ["b", "c"]), _file("m", "a", ["b"]))
    assert view_of(rec, node_id="a", replica_target=1).state is State.REPLICATED
    assert view_of(rec, node_id="a", replica_target=2).state is State.COMMITTED
    assert view_of(rec, node_id="a", replica_target=0).state is State.COMMITTED
    marked = view_of(rec, node_id="a", replica_target=1, label="under-replicated")
    assert marked.state is State.COMMITTED
    assert marked.tiers == ("memory", "peer", "under-replicated")


def test_a_list_naming_this_node_for_a_copy_it_lacks_is_not_replicated() -> None:
    """A replica list adopted or merged from a peer may name this node for a copy it
    lost when it came back empty (the network chaos run of stop 34): this node knows
    its own disk, so it never lists REPLICATED on its own missing copy."""
    owner_lacks = _rec(_file("a", "a", ["b"]), _file("m", "a", ["b"], held=False))
    assert view_of(owner_lacks, node_id="a", replica_target=1).state is State.COMMITTED
    assert view_of(owner_lacks, node_id="c", replica_target=1).state is State.REPLICATED
    replica_here = _rec(_file("a", "a", ["b"], held=False))
    assert view_of(replica_here, node_id="b", replica_target=1).state is State.COMMITTED
    assert view_of(replica_here, node_id="c", replica_target=1).state is State.REPLICATED
    held = _rec(_file("a", "a", ["b"], held=True))
    assert view_of(held, node_id="b", replica_target=1).state is State.REPLICATED


def test_durable_wins_and_lists_persistent() -> None:
    rec = _rec(_file("a", "a", ["b"]))
    view = view_of(rec, node_id="a", replica_target=1, durable=True, drain_failed=True)
    assert view.state is State.DURABLE
    assert view.tiers == ("memory", "peer", "persistent", "drain-failed")


def test_held_elsewhere_and_persistent_only() -> None:
    remote = _rec(_file("a", "b", held=False), _file("m", "a"))
    view = view_of(remote, node_id="a", paths={"a": "/m/a", "m": "/m/m"})
    assert view.tiers == ("peer",)
    assert view.local_paths == {"a": "", "m": "/m/m"}  # never a path for a file not held
    gone = _rec(_file("a", "", held=False))
    assert view_of(gone, node_id="a", durable=True).tiers == ("persistent",)


def test_writing_has_no_derived_state_nor_tiers() -> None:
    rec = _rec(_file("a", "a", ["b"]), state=State.WRITING)
    view = view_of(rec, node_id="a", replica_target=1, durable=True, label="lost")
    assert view.state is State.WRITING and view.tiers == ()
