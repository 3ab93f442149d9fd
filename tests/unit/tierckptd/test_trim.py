"""Surplus copies (`peers/trim.py`), the healer's pushes that recover or stop quietly
(`peers/push.py`) and DURABLE checkpoints an owner let go (`healer.let_go`), with the
fake PeerClient of tests/support (no gRPC)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable

import pytest
from prometheus_client import REGISTRY
from tierckpt.checksum import BytesLike
from tierckptd.catalog import SURPLUS_GRACE, Catalog
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.peers.client import Holdings, PeerCallError
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.healer import let_go
from tierckptd.peers.placement import Member, file_key, preference
from tierckptd.peers.push import Pusher
from tierckptd.peers.trim import plan_trim, ranked_holders, settled_replicas

from tests.support.fake_peer_client import FakePeers

from .conftest import FakeClock, Save
from .test_healer import _cluster, _file, _view

MEMBERS = [Member("a", "r1"), Member("b", "r2"), Member("c", "r3"), Member("d", "r1")]


def _h(*names: str, valid: bool = True) -> Holdings:
    return Holdings(True, frozenset(names), () if valid else None, "" if valid else "bad")


def _rank(owner: str) -> list[str]:
    return [owner, *preference(file_key("run", "s1", "f"), owner, MEMBERS)]


# ---- plan_trim (pure) --------------------------------------------------------------------
def test_the_copies_farthest_in_preference_are_the_surplus() -> None:
    view = _view(_file("f", "a", ["b", "c"]))
    holdings = {n: _h("f") for n in "abcd"}
    best = _rank("a")
    for me in "bcd":
        trims = plan_trim(view, holdings, MEMBERS, 1, me)
        if me == best[1]:
            assert trims == {}  # the best buddy keeps its copy
        else:
            assert trims == {"f": [best[1]]}  # the owner and the best buddy keep theirs
    assert plan_trim(view, holdings, MEMBERS, 1, "a") == {}  # the owner never trims
    assert plan_trim(view, holdings, MEMBERS, 3, best[3]) == {}  # k + 1 copies: none surplus


def test_an_owner_that_holds_no_copy_is_not_counted() -> None:
    view = _view(_file("f", "a", ["b"]))
    holdings = {"a": _h(), "b": _h("f"), "c": _h("f"), "d": _h("f")}
    kept = [n for n in _rank("a") if n != "a"][:2]
    (surplus,) = set("bcd") - set(kept)
    assert plan_trim(view, holdings, MEMBERS, 1, surplus) == {"f": kept}


def test_only_confirmed_copies_count() -> None:
    view = _view(_file("f", "a", ["b", "c"]))
    worst = _rank("a")[-1]
    # A node whose answer did not validate confirms nothing; an unreachable one is absent.
    others = [n for n in "bcd" if n != worst]
    holdings = {"a": _h("f"), worst: _h("f"), others[0]: _h("f", valid=False)}
    assert plan_trim(view, holdings, MEMBERS, 1, worst) == {}
    holdings[others[1]] = _h("f")
    assert plan_trim(view, holdings, MEMBERS, 1, worst) == {"f": [others[1]]}


def test_a_holder_that_left_the_cluster_ranks_last() -> None:
    f = _file("f", "a")
    view = _view(f)
    assert ranked_holders(view, f, ["zz", "b", "a"], MEMBERS)[0] == "a"
    assert ranked_holders(view, f, ["zz", "b", "a"], MEMBERS)[-1] == "zz"


def test_plan_trim_is_pure() -> None:
    f = _file("f", "a", ["b"])
    holdings = {n: _h("f") for n in "abcd"}
    plan_trim(_view(f), holdings, MEMBERS, 1, "d")
    assert f.replica_nodes == ["b"] and holdings == {n: _h("f") for n in "abcd"}


def test_a_stale_replica_list_settles_once_every_node_it_names_answered() -> None:
    best = [n for n in _rank("a") if n != "a"]
    # d dropped its copy, but a crossing broadcast left it on this node's list.
    view = _view(_file("f", "a", [best[0], "d"]), _file("g", "a", [best[0]]))
    holdings = {"a": _h("f", "g"), best[0]: _h("f", "g"), "d": _h()}
    assert settled_replicas(view, holdings, MEMBERS) == {"f": [best[0]]}
    del holdings["d"]  # it did not answer: it may still hold its copy
    assert settled_replicas(view, holdings, MEMBERS) == {}
    nobody = {"a": _h(), best[0]: _h(), "d": _h()}
    assert settled_replicas(view, nobody, MEMBERS) == {}  # no holder: left as it was


# ---- the Healer trims this node's copy ---------------------------------------------------
def _replica_here(catalog: Catalog, cluster: Cluster) -> None:
    """run/s2: `__1_0.distcp` owned by b, with a verified copy on this node."""
    rec = CheckpointRecord("run", "s2", State.COMMITTED, 1.0, "", 2.0, 5)
    data = _file("__1_0.distcp", "b", ["c"])
    meta = _file(".metadata", "b", ["c"])
    data.held = meta.held = False
    rec.files = {data.name: data, meta.name: meta}
    assert catalog.publish(rec)
    assert cluster.receive("run", "s2", data.name, [(0, b"data")]) == 4


def _trimmed() -> float:
    return REGISTRY.get_sample_value("tierckpt_trimmed_copies_total") or 0.0


def test_a_surplus_copy_here_is_dropped_and_the_kept_holders_told(
    catalog: Catalog, clock: FakeClock
) -> None:
    # b (the owner) and node-a share a failure domain: c is the better buddy.
    fake = FakePeers("node-a", {"b": "r1", "c": "r3"})
    cluster = _cluster(catalog, fake)
    _replica_here(catalog, cluster)
    fake.knows.update(b=True, c=True)
    fake.held["b"] = {"__1_0.distcp": b"data", ".metadata": b"data"}
    fake.held["c"] = {"__1_0.distcp": b"data", ".metadata": b"data"}
    before = _trimmed()
    # Landed moments ago: kept for SURPLUS_GRACE, whatever this node's view (the node
    # that pushed it may not reach c, and would push it again at once).
    cluster.heal("run", "s2")
    assert catalog.get("run", "s2").local_paths["__1_0.distcp"] and _trimmed() == before
    clock.now += SURPLUS_GRACE + 1
    cluster.heal("run", "s2")
    view = catalog.get("run", "s2")
    f = next(f for f in view.files if f.name == "__1_0.distcp")
    assert not view.local_paths[f.name] and f.replica_nodes == ["c"]
    assert ("b", f.name, ["c"]) in fake.replicas and ("c", f.name, ["c"]) in fake.replicas
    assert _trimmed() == before + 1
    assert fake.pushed == []
    cluster.heal("run", "s2")  # idempotent: nothing left to drop, nothing pushed
    assert _trimmed() == before + 1 and fake.pushed == []
    catalog.set_replicas("run", "s2", f.name, ["c", "node-a"])  # a stale broadcast lands
    cluster.heal("run", "s2")
    assert next(
        f for f in catalog.get("run", "s2").files if f.name == "__1_0.distcp"
    ).replica_nodes == ["c"]


def test_a_copy_is_kept_while_a_kept_holder_does_not_answer(catalog: Catalog) -> None:
    fake = FakePeers("node-a", {"b": "r1", "c": "r3"})
    cluster = _cluster(catalog, fake)
    _replica_here(catalog, cluster)
    fake.knows.update(b=True, c=True)
    fake.held["b"] = {"__1_0.distcp": b"data"}
    fake.held["c"] = {"__1_0.distcp": b"data"}
    fake.down.add("c")
    cluster.heal("run", "s2")
    assert catalog.get("run", "s2").local_paths["__1_0.distcp"]


def test_the_better_buddy_keeps_its_copy(catalog: Catalog) -> None:
    fake = FakePeers("node-a", {"b": "r2", "c": "r2"})  # node-a: the only other domain
    cluster = _cluster(catalog, fake)
    _replica_here(catalog, cluster)
    fake.knows.update(b=True, c=True)
    fake.held["b"] = {"__1_0.distcp": b"data"}
    fake.held["c"] = {"__1_0.distcp": b"data"}
    cluster.heal("run", "s2")
    assert catalog.get("run", "s2").local_paths["__1_0.distcp"]


# ---- pushes -----------------------------------------------------------------------------
def _refusing(code: str) -> FakePeers:
    """b answers Holdings as knowing the checkpoint, but refuses pushes with `code`."""
    fake = FakePeers("node-a", {"b": "r2"})
    fake.knows["b"] = True
    fake.refuse["b"] = code
    return fake


def test_a_push_refused_for_want_of_the_manifest_publishes_and_pushes_again(
    catalog: Catalog, save: Save
) -> None:
    fake = _refusing("NOT_FOUND")
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    cluster.heal("run", "s1")
    assert fake.published == ["b"] and fake.pushed == [("b", "__0_0.distcp")]
    assert catalog.get("run", "s1").files[0].replica_nodes == ["b"]


def test_a_refusing_peer_is_not_asked_again_and_logged_once(
    catalog: Catalog, save: Save, caplog: pytest.LogCaptureFixture
) -> None:
    fake = _refusing("PERMISSION_DENIED")
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            cluster.heal("run", "s1")
    assert fake.push_attempts == 1
    assert caplog.text.count("refuses a copy") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "push" in r.message]


def _pusher(catalog: Catalog, fake: FakePeers, corrupt: list[str]) -> Pusher:
    return Pusher(catalog, fake, lambda ns, cid, name, reason, where: corrupt.append(name))


def test_a_file_evicted_before_or_during_its_push_ends_it_quietly(
    catalog: Catalog, save: Save, caplog: pytest.LogCaptureFixture
) -> None:
    corrupt: list[str] = []
    fake = FakePeers("node-a", {"b": "r2"})
    fake.knows["b"] = True
    pusher = _pusher(catalog, fake, corrupt)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 3000})
    view = catalog.get("run", "s1")
    f = view.files[0]
    path = view.local_paths[f.name]
    gone = dataclasses.replace(view, local_paths={f.name: path + ".gone"})
    with caplog.at_level(logging.DEBUG):
        assert not pusher.push("b", gone, f, True)  # evicted before: never opened
        os.chmod(path, 0o600)
        os.truncate(path, 1500)  # shorter under the push (a recycled segment)

        def short(
            node: str, ns: str, cid: str, f: FileRecord, pieces: Iterable[tuple[int, BytesLike]]
        ) -> None:
            got = sum(len(d) for _, d in pieces)
            raise PeerCallError(node, "PushFile", "INVALID_ARGUMENT", f"stream ended at {got}")

        fake.push = short  # type: ignore[method-assign]
        assert not pusher.push("b", view, f, True)
    assert corrupt == [] and fake.pushed == []
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_read_error_ends_the_stream_instead_of_raising_into_grpc(
    catalog: Catalog, save: Save
) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 3000})
    f = catalog.get("run", "s1").files[0]
    unread: list[OSError] = []
    pusher = _pusher(catalog, FakePeers("node-a", {"b": "r2"}), [])
    assert list(pusher._read(-1, f, unread)) == []  # EBADF: gRPC's request thread sees an end
    assert len(unread) == 1


def test_data_loss_for_a_copy_no_longer_held_is_not_corruption(
    catalog: Catalog, save: Save
) -> None:
    corrupt: list[str] = []
    fake = FakePeers("node-a", {"b": "r2"})
    pusher = _pusher(catalog, fake, corrupt)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    view = catalog.get("run", "s1")

    def evicted_meanwhile(
        node: str, ns: str, cid: str, f: FileRecord, pieces: Iterable[tuple[int, BytesLike]]
    ) -> None:
        list(pieces)
        catalog.delete("run", "s1")
        raise PeerCallError(node, "PushFile", "DATA_LOSS", "block 0 mismatch")

    fake.push = evicted_meanwhile  # type: ignore[method-assign]
    assert not pusher.push("b", view, view.files[0], True)
    assert corrupt == []


# ---- DURABLE checkpoints an owner let go ------------------------------------------------
def test_files_of_a_durable_checkpoint_its_owner_let_go_are_left_to_the_persistent_tier() -> None:
    view = dataclasses.replace(
        _view(_file("f", "b", ["a"]), _file("g", "a", ["b"])), state=State.DURABLE
    )
    holdings = {"a": _h("f", "g"), "b": _h()}  # b knows it, holds none of it
    assert [f.name for f in let_go(view, holdings, "a").files] == ["g"]
    committed = dataclasses.replace(view, state=State.COMMITTED)
    assert let_go(committed, holdings, "a") == committed  # not durable: b lost it, heal
    unknown = {"a": _h("f", "g"), "b": Holdings(False, frozenset())}
    assert let_go(view, unknown, "a") == view  # b does not know it: a wiped node


def test_no_push_nor_mark_for_a_durable_checkpoint_its_owner_evicted(catalog: Catalog) -> None:
    fake = FakePeers("node-a", {"b": "r2", "c": "r3"})
    cluster = _cluster(catalog, fake)
    _replica_here(catalog, cluster)
    assert catalog.mark_durable("run", "s2")  # drained; b's retention let it go since
    assert catalog.get("run", "s2").local_paths["__1_0.distcp"]  # still held here
    fake.knows.update(b=True, c=True)
    cluster.heal("run", "s2")
    assert fake.pushed == [] and fake.published == []
    assert cluster.healer.label("run", "s2") == ""
