"""Cluster marks (rm / pin / unpin): the journal (newest wins, persisted, validated,
bounded), the catalog's side (a delete mark tombstones by stamp, a pin mark waits for a
manifest that arrives later) and the ApplyMark edge's authorization on a real peer port."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import (
    TIER_UNAVAILABLE_PREFIX,
    CheckpointNotFound,
    InvalidArgument,
    InvalidName,
    TierUnavailable,
)
from tierckpt.v1 import common_pb2, peer_pb2
from tierckptd.catalog import Catalog
from tierckptd.config import PeerConfig
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.peers import operations
from tierckptd.peers.client import mark_from_wire, mark_to_wire
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.cluster_marks import JOURNAL_NAME, Mark, MarkJournal, MarkKind, check_mark
from tierckptd.restore import Restorer, no_sources

from .conftest import Save
from .test_peer_tier import PeerPort, peer_port  # noqa: F401 - the fixture

NOW = 1_700_000_000.0


def _mark(cid: str, kind: MarkKind, stamp: float = NOW, origin: str = "node-a") -> Mark:
    return Mark("run", cid, kind, stamp, origin)


def _journal(tmp_path: Path, **kwargs: object) -> MarkJournal:
    return MarkJournal(tmp_path, wall_clock=lambda: NOW + 10, **kwargs)  # type: ignore[arg-type]


def test_newest_mark_of_each_kind_wins_and_survives_a_restart(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    assert journal.merge(_mark("s1", MarkKind.PINNED, NOW))
    assert journal.merge(_mark("s1", MarkKind.UNPINNED, NOW + 1))
    assert not journal.merge(_mark("s1", MarkKind.PINNED, NOW))  # older: ignored
    assert not journal.merge(_mark("s1", MarkKind.UNPINNED, NOW + 1))  # the same: idempotent
    # A tie breaks by origin node id, so every node settles on the same mark.
    assert journal.merge(_mark("s1", MarkKind.PINNED, NOW + 1, origin="node-b"))
    # A delete is kept beside the pin: a later pin does not undo it.
    assert journal.merge(_mark("s1", MarkKind.DELETED, NOW - 5))
    journal.owe(("run", "s1"), "")
    again = _journal(tmp_path)
    assert again.pins("run") == {"s1": True}
    deleted = again.deleted("run", "s1")
    assert deleted is not None and deleted.stamp == NOW - 5
    assert again.owed() == {("run", "s1"): ""}
    assert [m.kind for m in again.marks("run")] == [MarkKind.DELETED, MarkKind.PINNED]
    assert again.marks("other") == []


def test_the_journal_is_bounded_by_count_and_age(tmp_path: Path) -> None:
    journal = _journal(tmp_path, max_marks=3, max_age=100.0)
    assert not journal.merge(_mark("ancient", MarkKind.DELETED, NOW - 200))
    for i in range(5):
        journal.merge(_mark(f"s{i}", MarkKind.DELETED, NOW + i))
    assert [m.checkpoint_id for m in journal.marks()] == ["s2", "s3", "s4"]
    assert len(_journal(tmp_path, max_marks=3, max_age=100.0)) == 3


def test_a_damaged_journal_is_read_entry_by_entry(tmp_path: Path) -> None:
    good = {"namespace": "run", "checkpoint_id": "s1", "kind": "pinned"}
    rows = [
        {**good, "stamp": NOW, "origin": "node-a"},
        {**good, "checkpoint_id": "../x", "stamp": NOW, "origin": "node-a"},
        {**good, "stamp": "soon", "origin": "node-a"},
        {**good, "kind": "explode", "stamp": NOW, "origin": "node-a"},
        {**good, "stamp": NOW + 10_000, "origin": "node-a"},
        "not an object",
    ]
    (tmp_path / JOURNAL_NAME).write_text(json.dumps({"version": 1, "marks": rows}))
    assert [str(m) for m in _journal(tmp_path).marks()] == ["pinned run/s1 by node-a"]
    (tmp_path / JOURNAL_NAME).write_text("{not json")
    assert len(_journal(tmp_path)) == 0
    os.unlink(tmp_path / JOURNAL_NAME)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 1, "marks": rows[:1]}))
    os.symlink(target, tmp_path / JOURNAL_NAME)
    assert len(_journal(tmp_path)) == 0  # a planted link is not followed


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"namespace": "../etc"}, InvalidName),
        ({"checkpoint_id": ""}, InvalidName),
        ({"origin": "a b"}, InvalidArgument),
        ({"stamp": math.nan}, InvalidArgument),
        ({"stamp": math.inf}, InvalidArgument),
        ({"stamp": -1.0}, InvalidArgument),
    ],
)
def test_check_mark_refuses_bad_names_and_stamps(
    fields: dict[str, object], error: type[Exception]
) -> None:
    args: dict[str, object] = {
        "namespace": "run",
        "checkpoint_id": "s1",
        "kind": MarkKind.DELETED,
        "stamp": NOW,
        "origin": "node-a",
        **fields,
    }
    with pytest.raises(error):
        check_mark(now=NOW, **args)  # type: ignore[arg-type]


def test_a_future_stamp_is_taken_and_applied_at_the_receivers_clock(tmp_path: Path) -> None:
    """Audit 3 H6(b): a mark from a node whose clock is ahead is not refused; it keeps
    its stamp (order between marks) and is applied at this node's time, which the
    journal keeps, so learning it again later never moves its tombstone."""
    mark = check_mark("run", "s1", MarkKind.DELETED, NOW + 600, "node-a", now=NOW)
    assert (mark.stamp, mark.applied, mark.applied_stamp) == (NOW + 600, NOW, NOW)
    again = check_mark("run", "s1", MarkKind.DELETED, NOW + 600, "node-a", now=NOW + 300)
    journal = _journal(tmp_path)
    assert journal.merge(mark)
    assert not journal.merge(again)  # the same mark: not new, its first time kept
    reloaded = _journal(tmp_path).deleted("run", "s1")
    assert reloaded is not None and reloaded.applied_stamp == NOW
    # A stamp not ahead is applied as it is.
    assert check_mark("run", "s2", MarkKind.PINNED, NOW, "node-a", now=NOW).applied_stamp == NOW


def test_marks_round_trip_the_wire_and_unknown_kinds_are_refused() -> None:
    mark = _mark("s1", MarkKind.UNPINNED)
    assert mark_from_wire(mark_to_wire(mark), now=NOW) == mark
    bad = mark_to_wire(mark)
    bad.kind = 0
    with pytest.raises(InvalidArgument, match="unknown mark kind"):
        mark_from_wire(bad, now=NOW)


# ---- the catalog's side -----------------------------------------------------------------


def _published(cid: str, committed: float) -> CheckpointRecord:
    return CheckpointRecord("run", cid, State.COMMITTED, committed, "node-x", committed, 1)


def _coordinated_by(node: str, cid: str) -> CheckpointRecord:
    """A peer's manifest of a checkpoint `node` coordinates (it owns `.metadata`)."""
    rec = CheckpointRecord("run", cid, State.COMMITTED, time.time(), node, time.time(), 1)
    meta = b"meta-" + cid.encode()
    rec.files = {
        ".metadata": FileRecord(
            ".metadata", 0, len(meta), checksum_bytes(meta), owner_node=node, held=False
        )
    }
    return rec


def test_a_delete_mark_removes_what_was_committed_before_it_and_refuses_it_back(
    catalog: Catalog, save: Save
) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": b"q" * 10})
    removed = catalog.remove_marked("run", "s1", time.time())
    assert removed is not None and removed[0] == 10
    assert not catalog.knows("run", "s1")
    assert not catalog.publish(_published("s1", time.time() - 60))  # a late publish
    assert catalog.remove_marked("run", "s1", time.time()) is None  # idempotent
    # A checkpoint no node here had is tombstoned too (a mark for a node that missed it).
    catalog.remove_marked("run", "never-seen", time.time())
    assert not catalog.publish(_published("never-seen", time.time() - 60))
    # The deleted one again, from a node whose clock is an hour ahead: still refused
    # (its sequence, not its time, says it is the deleted one).
    assert not catalog.publish(_published("s1", time.time() + 3600))
    # Saved again with the same id after the rm (a later sequence): taken.
    resaved = _published("s1", time.time())
    resaved.sequence = 2
    assert catalog.publish(resaved)


def test_a_delete_mark_leaves_a_save_writing_here(catalog: Catalog) -> None:
    catalog.begin("run", "s2", 0)
    assert catalog.remove_marked("run", "s2", time.time()) is None
    assert catalog.knows("run", "s2")


def test_a_pin_mark_applies_now_or_when_the_manifest_arrives(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": b"q" * 10})
    view = catalog.apply_pin("run", "s1", True)
    assert view is not None and view.pinned
    assert catalog.apply_pin("run", "later", True) is None  # not here yet
    catalog.events.pin_marks.answer_with(
        lambda ns: {"later": True, "s1": False} if ns == "run" else {}
    )
    assert catalog.publish(_published("later", time.time()))
    assert catalog.get("run", "later").pinned
    # Persistent retention keeps what a node pinned and what a mark pins; an unpin
    # mark wins over a stale local pin.
    assert catalog.pinned_ids("run") == {"later"}


# ---- ApplyMark on a real peer port ------------------------------------------------------


def _send(port: PeerPort, mark: peer_pb2.CheckpointMark, node: str | None = "node-m") -> None:
    port.stub(node).ApplyMark(mark, timeout=10)


def _wire(cid: str, kind: int, origin: str = "node-m", stamp: float | None = None) -> Any:
    return peer_pb2.CheckpointMark(
        ref=common_pb2.CheckpointRef(namespace="run", checkpoint_id=cid),
        kind=kind,
        stamp_unix=time.time() if stamp is None else stamp,
        origin_node=origin,
    )


def test_apply_mark_from_a_member_is_applied_and_served_back(
    peer_port: PeerPort,  # noqa: F811
    save: Save,
) -> None:
    save(peer_port.catalog, "run", "s1", {"__0_0.distcp": b"q" * 10})
    # node-m neither coordinates s1 nor wrote a file of it: its marks are refused (audit
    # 3 H3), also once it listed itself as a replica holder (any member may).
    peer_port.catalog.set_replicas("run", "s1", "__0_0.distcp", ["node-m"])
    for kind in (peer_pb2.MARK_PINNED, peer_pb2.MARK_DELETED):
        with pytest.raises(grpc.RpcError) as refused:
            _send(peer_port, _wire("s1", kind))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert peer_port.catalog.knows("run", "s1") and peer_port.cluster.marks() == []
    with pytest.raises(grpc.RpcError) as unknown:
        _send(peer_port, _wire("never-saved", peer_pb2.MARK_DELETED))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    # Its own checkpoint: taken.
    assert peer_port.catalog.publish(_coordinated_by("node-m", "m1"))
    _send(peer_port, _wire("m1", peer_pb2.MARK_PINNED))
    assert peer_port.catalog.get("run", "m1").pinned
    _send(peer_port, _wire("m1", peer_pb2.MARK_DELETED))
    assert not peer_port.catalog.knows("run", "m1")
    listed = peer_port.stub().ListManifests(peer_pb2.ListManifestsRequest(), timeout=10)
    assert {(m.ref.checkpoint_id, m.kind) for m in listed.marks} == {
        ("m1", peer_pb2.MARK_PINNED),
        ("m1", peer_pb2.MARK_DELETED),
    }


@pytest.mark.parametrize(
    ("mark", "caller", "code"),
    [
        (_wire("s1", peer_pb2.MARK_DELETED), "mallory", grpc.StatusCode.PERMISSION_DENIED),
        (_wire("s1", peer_pb2.MARK_DELETED, origin="node-a"), "node-m", None),
        (_wire("../x", peer_pb2.MARK_DELETED), "node-m", grpc.StatusCode.INVALID_ARGUMENT),
        (_wire("s1", 9), "node-m", grpc.StatusCode.INVALID_ARGUMENT),
        (_wire("s1", peer_pb2.MARK_PINNED, stamp=math.nan), "node-m", None),
    ],
    ids=["non-member", "forged-origin", "bad-name", "bad-kind", "nan-stamp"],
)
def test_apply_mark_refuses_strangers_forgeries_and_bad_fields(
    peer_port: PeerPort,  # noqa: F811
    save: Save,
    mark: peer_pb2.CheckpointMark,
    caller: str,
    code: grpc.StatusCode | None,
) -> None:
    save(peer_port.catalog, "run", "s1", {"__0_0.distcp": b"q" * 10})
    expected = code or (
        grpc.StatusCode.PERMISSION_DENIED
        if mark.origin_node != caller
        else grpc.StatusCode.INVALID_ARGUMENT
    )
    with pytest.raises(grpc.RpcError) as raised:
        _send(peer_port, mark, caller)
    assert raised.value.code() == expected, raised.value.details()
    view = peer_port.catalog.get("run", "s1")  # untouched
    assert not view.pinned
    assert peer_port.cluster.marks() == []


# ---- the origin's persistent delete -----------------------------------------------------


def test_an_rm_owes_the_persistent_delete_until_done_and_repeats_it_after_a_racing_drain(
    catalog: Catalog, save: Save, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(operations, "RETRY_FIRST", 0.0)
    cluster = Cluster(catalog, Restorer(catalog, no_sources))
    calls: list[tuple[str, str, str]] = []

    def unstore(namespace: str, checkpoint_id: str, url: str) -> bool:
        calls.append((namespace, checkpoint_id, url))
        if len(calls) == 1:
            raise TierUnavailable(f"{TIER_UNAVAILABLE_PREFIX}persistent s3://b: refused")
        return len(calls) < 4

    cluster.ops.unstore = unstore
    save(catalog, "run", "s1", {"__0_0.distcp": b"q" * 10})
    with pytest.raises(TierUnavailable, match="not yet from the persistent tier"):
        cluster.remove("run", "s1")
    assert not catalog.knows("run", "s1")  # memory copies went first
    assert cluster.ops.journal.owed() == {("run", "s1"): ""}
    cluster.ops.jobs.run_due()  # the background retry
    assert len(calls) == 2 and cluster.ops.journal.owed() == {}
    # A drain that was uploading when the rm came commits .metadata afterwards: deleted again.
    assert not catalog.mark_durable("run", "s1")
    cluster.ops.jobs.run_due()
    assert len(calls) == 3
    # Nothing left anywhere: NOT_FOUND naming the earlier rm.
    with pytest.raises(CheckpointNotFound, match="removed from every tier by `tierckpt rm`"):
        cluster.remove("run", "s1")
    with pytest.raises(CheckpointNotFound, match="not found on node node-a"):
        cluster.remove("run", "never-saved")


def test_marks_learnt_before_a_crash_are_applied_to_the_adopted_checkpoints(
    catalog: Catalog, save: Save
) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": b"q" * 10})
    save(catalog, "run", "s2", {"__0_0.distcp": b"r" * 10})
    journal = MarkJournal(catalog.tier.root)
    journal.merge(Mark("run", "s1", MarkKind.DELETED, time.time(), "node-b"))
    journal.merge(Mark("run", "s2", MarkKind.PINNED, time.time(), "node-b"))
    Cluster(catalog, Restorer(catalog, no_sources))  # replays the journal
    assert not catalog.knows("run", "s1")
    assert catalog.get("run", "s2").pinned


def test_marks_in_a_peers_listing_are_taken_from_members_only(catalog: Catalog, save: Save) -> None:
    cluster = Cluster(
        catalog,
        Restorer(catalog, no_sources),
        peers=[PeerConfig("node-m", "127.0.0.1:1")],
        channel_factory=grpc.insecure_channel,
    )
    save(catalog, "run", "s1", {"__0_0.distcp": b"q" * 10})
    stranger = Mark("run", "s1", MarkKind.DELETED, time.time(), "mallory")
    cluster.ops.learn("node-m", [stranger])  # relayed by a member, made by a stranger
    assert catalog.knows("run", "s1") and cluster.marks() == []
    # This node's own mark relayed back is not taken (a peer cannot speak for it), nor
    # is a mark of node-m, which is not a node of s1's job.
    own = Mark("run", "s1", MarkKind.PINNED, time.time(), "node-a")
    cluster.ops.learn("node-m", [own, Mark("run", "s1", MarkKind.PINNED, time.time(), "node-m")])
    assert not catalog.get("run", "s1").pinned and cluster.marks() == []
    # On a checkpoint node-m coordinates, the mark it states itself is taken.
    assert catalog.publish(_coordinated_by("node-m", "m1"))
    cluster.ops.learn("node-m", [Mark("run", "m1", MarkKind.PINNED, time.time(), "node-m")])
    assert catalog.get("run", "m1").pinned
    cluster.stop()
