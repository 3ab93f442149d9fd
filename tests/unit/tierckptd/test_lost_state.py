"""LOST: a committed checkpoint some file of which has no copy left on any tier.

The healer's finding becomes a state of the catalog's views (never the newest, never
loaded, DURABLE wins), travels on the wire with its lost files, maps back to
`CheckpointLost` on the client, heals back when a copy reappears, and a starting peer's
ListManifests makes this node heal what that peer held at once.
"""

from __future__ import annotations

import pickle

import grpc
import pytest
from tierckpt.errors import (
    CHECKPOINT_LOST_PREFIX,
    CheckpointLost,
    CheckpointNotFound,
    ChecksumMismatch,
    error_from_status,
    status_of,
)
from tierckpt.v1 import common_pb2, peer_pb2
from tierckptd.catalog import Catalog
from tierckptd.jobs import Heal
from tierckptd.model import CheckpointRecord, State
from tierckptd.wire import to_info

from .conftest import Save
from .test_healer import FakePeers, _cluster, _file
from .test_peer_tier import PeerPort, _receive, _remote, peer_port  # noqa: F401 - the fixture

NS = "run"


def _two(catalog: Catalog, save: Save) -> None:
    save(catalog, NS, "s1", {"__0_0.distcp": b"a" * 100})
    save(catalog, NS, "s2", {"__0_0.distcp": b"b" * 100})


def _lose(catalog: Catalog, checkpoint_id: str) -> None:
    """This node's copy goes (a node holding a copy never finds its file lost)."""
    assert catalog.drop_local_copy(NS, checkpoint_id, "__0_0.distcp")


def test_a_lost_mark_makes_it_lost_never_the_newest_and_heals_back(
    catalog: Catalog, save: Save
) -> None:
    _two(catalog, save)
    _lose(catalog, "s2")
    catalog.set_health(NS, "s2", "lost", ["__0_0.distcp"])
    view = catalog.get(NS, "s2")
    assert view.state is State.LOST and view.lost_files == ("__0_0.distcp",)
    assert "lost" in view.tiers
    assert catalog.get(NS, "").checkpoint_id == "s1"  # the newest complete one
    assert [(v.checkpoint_id, v.state) for v in catalog.list_checkpoints(NS)] == [
        ("s1", State.COMMITTED),
        ("s2", State.LOST),
    ]
    info = to_info(view)
    assert info.state == common_pb2.LOST and list(info.lost_files) == ["__0_0.distcp"]
    catalog.set_health(NS, "s2", "")  # a copy came back
    assert catalog.get(NS, "s2").state is State.COMMITTED
    assert catalog.get(NS, "s2").lost_files == ()
    assert catalog.get(NS, "").checkpoint_id == "s2"


def test_durable_wins_over_lost_and_other_marks_are_not_lost(catalog: Catalog, save: Save) -> None:
    _two(catalog, save)
    catalog.set_health(NS, "s2", "under-replicated")
    assert catalog.get(NS, "s2").state is State.COMMITTED
    catalog.set_health(NS, "s2", "lost", ["__0_0.distcp"])
    assert catalog.mark_durable(NS, "s2")
    view = catalog.get(NS, "s2")
    assert view.state is State.DURABLE and view.lost_files == ()  # restorable from there
    assert "lost" not in view.tiers and "persistent" in view.tiers
    assert catalog.get(NS, "").checkpoint_id == "s2"


def test_a_finding_older_than_a_copy_here_does_not_mark_it_lost(
    catalog: Catalog, save: Save
) -> None:
    # A heal asked the holdings, a copy of the file landed here, then the heal recorded
    # "no copy anywhere": stale for that file, which this node holds.
    _two(catalog, save)
    catalog.set_health(NS, "s2", "lost", ["__0_0.distcp"])
    view = catalog.get(NS, "s2")
    assert view.state is State.COMMITTED and view.lost_files == ()
    assert "under-replicated" in view.tiers  # until the next heal says more
    assert catalog.get(NS, "").checkpoint_id == "s2"


def test_a_copy_arriving_here_clears_that_file_at_once(catalog: Catalog) -> None:
    # A replica pushed (or restored) after the heal that found no copy anywhere: this
    # node holds one now, so the checkpoint is not lost, without waiting for a heal.
    a, b = b"a" * 3000, b"b" * 2000
    rec = CheckpointRecord(NS, "s3", State.COMMITTED, 1.0, "", 2.0, 5)
    rec.files = {"__1_0.distcp": _remote("__1_0.distcp", a, "n1")}
    rec.files["__2_0.distcp"] = _remote("__2_0.distcp", b, "n2")
    assert catalog.publish(rec)
    catalog.set_health(NS, "s3", "lost", ["__1_0.distcp", "__2_0.distcp"])
    _receive(catalog, NS, "s3", "__1_0.distcp", a)
    view = catalog.get(NS, "s3")
    assert view.state is State.LOST and view.lost_files == ("__2_0.distcp",)
    _receive(catalog, NS, "s3", "__2_0.distcp", b)
    view = catalog.get(NS, "s3")
    assert view.state is State.COMMITTED and "under-replicated" in view.tiers


def test_newest_when_every_checkpoint_is_lost_says_so(catalog: Catalog, save: Save) -> None:
    _two(catalog, save)
    for cid in ("s1", "s2"):
        _lose(catalog, cid)
        catalog.set_health(NS, cid, "lost", ["__0_0.distcp"])
    with pytest.raises(CheckpointLost) as e:
        catalog.get(NS, "")
    assert str(e.value).startswith(CHECKPOINT_LOST_PREFIX)
    assert "s2, s1" in str(e.value) and status_of(e.value) == grpc.StatusCode.DATA_LOSS
    with pytest.raises(CheckpointNotFound) as nf:
        catalog.get(NS, "s9")
    assert not isinstance(nf.value, CheckpointLost)


def test_the_client_maps_data_loss_with_the_prefix_to_checkpoint_lost() -> None:
    e = error_from_status(grpc.StatusCode.DATA_LOSS, f"{CHECKPOINT_LOST_PREFIX}run/s2/x")
    assert type(e) is CheckpointLost and isinstance(e, FileNotFoundError)
    assert type(error_from_status(grpc.StatusCode.DATA_LOSS, "block 3 mismatch")) is (
        ChecksumMismatch
    )
    again = pickle.loads(pickle.dumps(e))  # DCP gathers rank errors across processes
    assert type(again) is CheckpointLost and str(again) == str(e)


def test_the_healer_lists_it_lost_on_this_node_and_back_when_a_copy_returns(
    catalog: Catalog,
) -> None:
    # node-a knows s2 from node b's manifest; b owned __1_0 and came back without it.
    fake = FakePeers("node-a", {"b": "r2", "c": "r3"})
    cluster = _cluster(catalog, fake)
    rec = CheckpointRecord(NS, "s2", State.COMMITTED, 1.0, "", 2.0, 5)
    lost, meta = _file("__1_0.distcp", "b"), _file(".metadata", "c")
    lost.held = meta.held = False
    rec.files = {lost.name: lost, meta.name: meta}
    assert catalog.publish(rec)
    fake.knows.update(b=True, c=True)
    fake.held["c"] = {".metadata": b"data"}
    fake.down.add("b")
    cluster.heal(NS, "s2")
    assert catalog.get(NS, "s2").state is State.COMMITTED  # b may come back with it
    fake.down.clear()
    cluster.heal(NS, "s2")
    view = catalog.get(NS, "s2")
    assert view.state is State.LOST and view.lost_files == ("__1_0.distcp",)
    with pytest.raises(CheckpointNotFound):
        catalog.get(NS, "")
    fake.held["b"]["__1_0.distcp"] = b"data"  # e.g. its memory dir put back
    cluster.heal(NS, "s2")
    assert catalog.get(NS, "s2").state is State.COMMITTED
    assert catalog.get(NS, "").checkpoint_id == "s2"


def test_a_starting_peer_makes_this_node_heal_what_it_held_at_once(
    peer_port: PeerPort,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    catalog = peer_port.catalog
    for cid, owner, replicas in (
        ("s1", "node-m", []),
        ("s2", "node-x", ["node-m"]),
        ("s3", "node-x", []),
    ):
        rec = CheckpointRecord(NS, cid, State.COMMITTED, 1.0, "", 2.0, 5)
        f = _file(".metadata", owner, replicas)
        f.held = False
        rec.files = {f.name: f}
        assert catalog.publish(rec)
    queued: list[Heal] = []
    monkeypatch.setattr(
        peer_port.cluster.jobs, "put", lambda job, delay=0.0: queued.append(job) or True
    )
    stub = peer_port.stub("node-m")
    got = stub.ListManifests(peer_pb2.ListManifestsRequest(), timeout=5)
    assert len(got.checkpoints) == 3 and queued == []  # a plain listing heals nothing
    stub.ListManifests(peer_pb2.ListManifestsRequest(starting=True), timeout=5)
    assert sorted(queued, key=lambda h: h.checkpoint_id) == [Heal(NS, "s1"), Heal(NS, "s2")]
    queued.clear()
    with pytest.raises(grpc.RpcError) as e:  # not a member: nothing healed
        peer_port.stub("node-z").ListManifests(
            peer_pb2.ListManifestsRequest(starting=True), timeout=5
        )
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and queued == []
