"""Healing: the pure `plan_heal`, table-driven, and the `Healer`/`Cluster` with a fake
PeerClient (no gRPC)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import CheckpointIncomplete
from tierckptd.catalog import Catalog
from tierckptd.config import PeerConfig
from tierckptd.jobs import Heal, Repair
from tierckptd.model import CheckpointRecord, CheckpointView, FileRecord, State
from tierckptd.peers import commit
from tierckptd.peers.client import Holdings, Manifests
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.commit import claims
from tierckptd.peers.healer import FilePush, HealPlan, plan_heal, responsible
from tierckptd.peers.placement import Member, file_key, neighbourhood, preference
from tierckptd.peers.trim import plan_trim
from tierckptd.restore import Restorer, no_sources

from tests.support.daemon_parts import coordinator
from tests.support.fake_peer_client import FakePeers

from .conftest import Save, write_file


def _file(name: str, owner: str, replicas: Iterable[str] = ()) -> FileRecord:
    return FileRecord(
        name=name,
        rank=0,
        size=4,
        checksums=checksum_bytes(b"data", block_size=1024),
        owner_node=owner,
        replica_nodes=list(replicas),
    )


def _view(*files: FileRecord, state: State = State.COMMITTED) -> CheckpointView:
    return CheckpointView(
        namespace="run",
        checkpoint_id="s1",
        state=state,
        size_bytes=4 * len(files),
        created_unix=1.0,
        committed_unix=2.0,
        sequence=1,
        pinned=False,
        files=files,
        local_paths={},
    )


def _held(*names: str, known: bool = True) -> Holdings:
    return Holdings(known, frozenset(names))


MEMBERS = [Member("a", "r1"), Member("b", "r2"), Member("c", "r3"), Member("d", "r1")]


def _targets(name: str, owner: str, exclude: set[str]) -> tuple[str, ...]:
    order = dict.fromkeys([owner, *preference(file_key("run", "s1", name), owner, MEMBERS)])
    return tuple(n for n in order if n not in exclude)


@dataclass(frozen=True)
class Case:
    id: str
    files: tuple[FileRecord, ...]
    holdings: dict[str, Holdings]
    k: int
    me: str
    expect: HealPlan


# Holdings list this node first, then the reachable peers (the Healer's order).
CASES = [
    Case(
        "owner pushes to its best buddies",
        (_file("f", "a"),),
        {"a": _held("f"), "b": _held(), "c": _held(), "d": _held()},
        2,
        "a",
        HealPlan(pushes=(FilePush("f", _targets("f", "a", {"a"}), 2),), under=()),
    ),
    Case(
        "healthy: nothing to do",
        (_file("f", "a", ["b"]),),
        {"a": _held("f"), "b": _held("f")},
        1,
        "a",
        HealPlan(),
    ),
    Case(
        "not responsible: the owner holds it and pushes",
        (_file("f", "a", ["b"]),),
        {"b": _held("f"), "a": _held("f"), "c": _held()},
        2,
        "b",
        HealPlan(),
    ),
    Case(
        "owner lost it: the first replica in order is responsible",
        (_file("f", "a", ["c", "b"]),),
        {"b": _held("f"), "a": _held(), "c": _held("f")},
        2,
        "c",
        HealPlan(
            pushes=(FilePush("f", ("a",), 1),),  # d is unreachable
            replicas={"f": sorted(["b", "c"], key=_targets("f", "a", set()).index)},
            under=("f",),
        ),
    ),
    Case(
        "owner lost it, another replica is responsible: not me",
        (_file("f", "a", ["c", "b"]),),
        {"b": _held("f"), "a": _held(), "c": _held("f")},
        2,
        "b",
        HealPlan(under=("f",)),
    ),
    Case(
        "nobody reachable holds it, a claimed holder is down: under-replicated (it may return)",
        (_file("f", "a", ["b"]), _file("g", "a")),
        {"a": _held("g"), "c": _held()},
        1,
        "a",
        HealPlan(pushes=(FilePush("g", ("c",), 1),), under=("f",)),
    ),
    Case(
        "every claimed holder answered without it: lost",
        (_file("f", "a", ["b"]), _file("g", "a")),
        {"a": _held("g"), "b": _held(), "c": _held()},
        1,
        "a",
        HealPlan(pushes=(FilePush("g", _targets("g", "a", {"a", "d"}), 1),), lost=("f",)),
    ),
    Case(
        "a claimed holder that no longer knows the checkpoint holds none of it: lost",
        (_file("f", "b"),),
        {"a": _held(), "b": _held(known=False)},
        1,
        "a",
        HealPlan(lost=("f",)),
    ),
    Case(
        "an unclaimed node that holds it (its replica list not told yet) keeps it alive",
        (_file("f", "b"),),
        {"a": _held(), "b": _held(), "c": _held("f")},
        1,
        "a",
        HealPlan(under=("f",)),
    ),
    Case(
        "an unreachable claimed holder: under-replicated, no target",
        (_file("f", "a", ["b"]),),
        {"a": _held("f")},
        1,
        "a",
        HealPlan(replicas={"f": []}, under=()),
    ),
    Case(
        "unreachable nodes are never targets",
        (_file("f", "a"),),
        {"a": _held("f"), "c": _held(known=False)},
        2,
        "a",
        HealPlan(pushes=(FilePush("f", ("c",), 2),)),
    ),
    Case(
        "k = 0: no pushes",
        (_file("f", "a"),),
        {"a": _held("f"), "b": _held()},
        0,
        "a",
        HealPlan(),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_heal(case: Case) -> None:
    plan = plan_heal(_view(*case.files), case.holdings, MEMBERS, case.k, case.me)
    assert plan.pushes == case.expect.pushes
    assert dict(plan.replicas) == dict(case.expect.replicas)
    assert plan.lost == case.expect.lost
    assert plan.under == case.expect.under
    assert plan.label == case.expect.label


def test_a_durable_checkpoint_is_never_lost() -> None:
    view = _view(_file("f", "a", ["b"]), state=State.DURABLE)
    plan = plan_heal(view, {"a": _held(), "b": _held()}, MEMBERS, 1, "a")
    assert plan.lost == () and plan.under == ("f",) and plan.label == "under-replicated"
    lost = plan_heal(
        _view(*view.files, state=State.LOST), {"a": _held(), "b": _held()}, MEMBERS, 1, "a"
    )
    assert lost.lost == ("f",)  # LOST stays LOST while nobody holds it


def test_a_file_no_node_claims_is_not_lost() -> None:
    # A manifest from a peer that let the checkpoint go to the persistent tier (no owner,
    # no replicas), before this node learnt it is durable: nothing to heal, not lost.
    view = _view(_file("f", ""), _file("g", "a", ["b"]))
    plan = plan_heal(view, {"a": _held("g"), "b": _held("g")}, MEMBERS, 1, "a")
    assert plan.lost == () and plan.under == () and plan.label == ""


def test_plan_heal_is_pure() -> None:
    f = _file("f", "a", ["b"])
    holdings = {"a": _held("f"), "c": _held()}
    plan_heal(_view(f), holdings, MEMBERS, 2, "a")
    assert f.replica_nodes == ["b"] and holdings == {"a": _held("f"), "c": _held()}


def test_cluster_marks() -> None:
    assert HealPlan(lost=("f",), under=("g",)).label == "lost"
    assert HealPlan(under=("g",)).label == "under-replicated"
    assert HealPlan().label == ""


def test_responsible() -> None:
    f = _file("f", "a", ["c", "b"])
    assert responsible(f, ["a", "b"], "a")
    assert not responsible(f, ["a", "b"], "b")
    assert responsible(f, ["b", "c"], "c")  # replica order, not ids
    assert responsible(_file("f", "a"), ["d", "b"], "b")  # then by id


def test_claims_refuse_conflicts_and_invalid_answers() -> None:
    f_b = _file("x", "anyone")
    f_c = FileRecord("x", 0, 5, checksums=checksum_bytes(b"other", block_size=1024))
    held = {"b": Holdings(True, frozenset({"x"}), (f_b,))}
    remote = claims("run", "s1", held, {"x"})
    assert remote["x"].owner_node == "b"  # the node that answered, whatever it says
    held["c"] = Holdings(True, frozenset({"x"}), (f_c,))
    with pytest.raises(CheckpointIncomplete, match="different contents"):
        claims("run", "s1", held, {"x"})
    bad = {"b": Holdings(True, frozenset({"x"}), None, "bad checksums")}
    assert claims("run", "s1", bad, {"x"}) == {}


def test_a_resave_commit_takes_no_replica_of_another_owner_as_a_claim() -> None:
    """A re-save's commit (the coordinator holds the id committed): a buddy's copy naming
    the writer may be the replaced generation's bytes, so it is no claim even when the
    writer did not answer; the writer's own answer is."""

    def buddy() -> Holdings:  # b's copy of the writer w's file (claims rewrites records)
        return Holdings(True, frozenset({"x"}), (_file("x", "w"),))

    assert claims("run", "s1", {"b": buddy()}, {"x"}, replacing=True) == {}
    assert "x" in claims("run", "s1", {"b": buddy()}, {"x"})  # not a re-save: as before
    new = FileRecord("x", 0, 5, checksums=checksum_bytes(b"fresh", block_size=1024))
    held = {"b": buddy(), "w": Holdings(True, frozenset({"x"}), (new,))}
    remote = claims("run", "s1", held, {"x"}, replacing=True)
    assert remote["x"].owner_node == "w" and remote["x"].checksums == new.checksums


# ---- the Healer and Cluster with a fake PeerClient ---------------------------------------


PEERS = {"b": "r2", "c": "r3"}


def _cluster(catalog: Catalog, fake: FakePeers) -> Cluster:
    return Cluster(catalog, Restorer(catalog, no_sources), client=fake, heal_interval=0)


def test_a_commit_publishes_and_heal_pushes_each_file_to_k_buddies(
    catalog: Catalog, save: Save
) -> None:
    fake = FakePeers("node-a", PEERS)
    fake.membership.configure([PeerConfig(n, "x:1", d) for n, d in PEERS.items()], 2)
    cluster = _cluster(catalog, fake)
    assert catalog.peer_marks.replica_target == 2
    save(catalog, "run", "s1", {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 3000})
    cluster.heal("run", "s1")
    assert sorted(fake.pushed) == sorted(
        (n, f) for n in ("b", "c") for f in (".metadata", "__0_0.distcp")
    )
    assert fake.held["b"]["__0_0.distcp"] == b"x" * 3000
    assert sorted(fake.published) == ["b", "c"]  # once per node, not once per file
    view = catalog.get("run", "s1")
    assert all(sorted(f.replica_nodes) == ["b", "c"] for f in view.files)
    assert view.state is State.REPLICATED
    assert cluster.healer.label("run", "s1") == ""
    # Every file's new replica list was told to every peer.
    assert {(n, name) for n, name, _ in fake.replicas} == {
        (n, f) for n in ("b", "c") for f in (".metadata", "__0_0.distcp")
    }
    fake.pushed.clear()
    cluster.heal("run", "s1")
    assert fake.pushed == []  # healthy: nothing to push


def test_an_unreachable_peer_leaves_it_under_replicated_until_it_is_back(
    catalog: Catalog, save: Save
) -> None:
    fake = FakePeers("node-a", {"b": "r2"})
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    fake.down.add("b")
    cluster.heal("run", "s1")
    assert fake.pushed == []
    assert cluster.healer.label("run", "s1") == ""  # no claimed holder missing: k capped
    fake.down.clear()
    cluster.heal("run", "s1")
    assert fake.pushed == [("b", "__0_0.distcp")]
    catalog_view = catalog.get("run", "s1")
    assert catalog_view.files[0].replica_nodes == ["b"]
    fake.down.add("b")
    cluster.heal("run", "s1")
    # Waited for (`replace_after`): still recorded, listed under-replicated meanwhile.
    assert catalog.get("run", "s1").files[0].replica_nodes == ["b"]
    assert cluster.healer.label("run", "s1") == "under-replicated"
    assert catalog.get("run", "s1").state is State.COMMITTED
    cluster.healer.replace_after = 0.0
    cluster.heal("run", "s1")
    # Replaced: the owner records the copies it can see, none now (shown, not marked:
    # the only other node is down, so no push could help).
    assert catalog.get("run", "s1").files[0].replica_nodes == []
    assert cluster.healer.label("run", "s1") == ""


def test_plan_heal_waits_for_an_unreachable_holder_before_replacing_it() -> None:
    f = _file("f", "a", ["b"])
    holdings = {"a": _held("f"), "c": _held()}
    waited = plan_heal(_view(f), holdings, MEMBERS, 1, "a", frozenset({"b"}))
    assert waited.pushes == () and dict(waited.replicas) == {}  # b stays recorded
    assert waited.label == "under-replicated"  # never REPLICATED on b's name alone
    replaced = plan_heal(_view(f), holdings, MEMBERS, 1, "a")
    assert replaced.pushes == (FilePush("f", ("c",), 1),)
    # An owner that stopped answering is waited for by the replica that pushes for it.
    g = _file("g", "b", ["a"])
    owner_waited = plan_heal(
        _view(g), {"a": _held("g"), "c": _held()}, MEMBERS, 1, "a", frozenset({"b"})
    )
    assert owner_waited.pushes == () and owner_waited.label == "under-replicated"
    # A holder that answers without its copy (it came back empty) is replaced at once.
    empty = plan_heal(_view(f), {"a": _held("f"), "b": _held(), "c": _held()}, MEMBERS, 1, "a")
    assert empty.pushes and empty.pushes[0].need == 1


def test_a_holder_unreachable_past_replace_after_is_replaced(catalog: Catalog, save: Save) -> None:
    fake = FakePeers("node-a", PEERS)
    cluster = _cluster(catalog, fake)
    cluster.healer.replace_after = 0.3
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    cluster.heal("run", "s1")
    (first,) = catalog.get("run", "s1").files[0].replica_nodes
    other = next(n for n in PEERS if n != first)
    fake.pushed.clear()
    fake.down.add(first)
    cluster.heal("run", "s1")
    assert fake.pushed == []  # a short outage: no push, so no trim when it is back
    assert cluster.healer.label("run", "s1") == "under-replicated"
    time.sleep(0.4)
    cluster.heal("run", "s1")
    assert fake.pushed == [(other, "__0_0.distcp")]
    assert catalog.get("run", "s1").files[0].replica_nodes == [other]
    assert cluster.healer.label("run", "s1") == ""


def test_a_file_whose_owner_lost_it_is_marked_under_replicated(catalog: Catalog) -> None:
    fake = FakePeers("node-a", {"b": "r2", "c": "r3"})
    cluster = _cluster(catalog, fake)
    f = _file("__1_0.distcp", "b", ["node-a"])
    f.held = False
    rec = CheckpointRecord("run", "s2", State.COMMITTED, 1.0, "", 2.0, 5)
    meta = _file(".metadata", "b")
    meta.held = False
    rec.files = {f.name: f, meta.name: meta}
    assert catalog.publish(rec)
    fake.knows["b"] = True
    fake.held["b"] = {".metadata": b"data"}
    cluster.heal("run", "s2")
    assert cluster.healer.label("run", "s2") == "lost"  # nobody reachable holds __1_0
    assert "lost" in catalog.get("run", "s2").tiers
    fake.held["b"]["__1_0.distcp"] = b"data"
    fake.down.add("b")
    fake.held["c"] = {"__1_0.distcp": b"data", ".metadata": b"data"}
    cluster.heal("run", "s2")
    assert cluster.healer.label("run", "s2") == "under-replicated"  # owner b unreachable
    assert "under-replicated" in catalog.get("run", "s2").tiers
    fake.down.clear()
    cluster.heal("run", "s2")
    assert cluster.healer.label("run", "s2") == ""


def test_a_push_refused_as_corrupt_drops_our_copy_only_if_it_is(
    catalog: Catalog, save: Save
) -> None:
    fake = FakePeers("node-a", {"b": "r2"})
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    fake.corrupt_on.add("b")
    cluster.heal("run", "s1")  # the receiver said DATA_LOSS, but our copy verifies
    assert catalog.get("run", "s1").local_paths["__0_0.distcp"]
    path = catalog.get("run", "s1").local_paths["__0_0.distcp"]
    with open(path, "r+b") as fh:
        fh.write(b"y")
    cluster.heal("run", "s1")
    assert not catalog.get("run", "s1").local_paths["__0_0.distcp"]  # dropped
    assert cluster.jobs.pending() == [Repair("run", "s1", "__0_0.distcp")]


def test_commit_collects_peer_files_and_queues_a_heal(catalog: Catalog, save: Save) -> None:
    fake = FakePeers("node-a", {"b": "r2", "c": "r3"})
    cluster = _cluster(catalog, fake)
    remote = _file("__1_0.distcp", "b")
    fake.held["b"]["__1_0.distcp"] = b"data"

    def holdings(node: str, namespace: str, checkpoint_id: str) -> Holdings:
        fake._up(node, "Holdings")
        files = (remote,) if node == "b" else ()
        return Holdings(False, frozenset(f.name for f in files), files)

    fake.holdings = holdings  # type: ignore[method-assign]
    fake.down.add("c")
    catalog.begin("run", "s1", 0)
    catalog.reserve("run", "s1", 0, 1)
    write_file(catalog, "run", "s1", ".metadata", b"m")
    view = coordinator(catalog, cluster).commit("run", "s1", [".metadata", "__1_0.distcp"])
    assert view.state is State.COMMITTED
    owners = {f.name: f.owner_node for f in view.files}
    assert owners == {".metadata": "node-a", "__1_0.distcp": "b"}
    assert fake.published == ["b"]  # c is down: logged, the commit still succeeds
    assert cluster.jobs.pending() == [Heal("run", "s1")]


def test_repair_jobs_go_through_the_restorer(catalog: Catalog, save: Save) -> None:
    asked: list[tuple[str, str, str, bool]] = []

    class Recording(Restorer):
        def ensure_local(
            self, namespace: str, checkpoint_id: str, name: str, repair: bool = False
        ) -> tuple[FileRecord, str]:
            asked.append((namespace, checkpoint_id, name, repair))
            return super().ensure_local(namespace, checkpoint_id, name, repair)

    fake = FakePeers("node-a", {"b": "r2"})
    cluster = Cluster(catalog, Recording(catalog, no_sources), client=fake, heal_interval=0)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    cluster.corrupt("run", "s1", "__0_0.distcp", "test", where="served")
    assert cluster.jobs.pending() == [Repair("run", "s1", "__0_0.distcp")]
    cluster.corrupt("run", "s1", "__0_0.distcp", "again", where="served")  # already dropped
    assert cluster.jobs.run_due() == 1
    assert asked == [("run", "s1", "__0_0.distcp", False)]  # failed NOT_FOUND: logged only


def test_pull_manifests_skips_unreachable_peers(catalog: Catalog) -> None:
    fake = FakePeers("node-a", {"b": "r2", "c": "r3"})
    fake.down.add("b")
    rec = CheckpointRecord("run", "s9", State.COMMITTED, 1.0, "", 2.0, 5)
    meta = _file(".metadata", "c")
    meta.held = False
    rec.files = {meta.name: meta}

    asked: list[tuple[str, bool]] = []
    announced = threading.Event()

    def manifests(
        node: str, namespace: str = "", *, wait_for_ready: bool = True, starting: bool = False
    ) -> Manifests:
        asked.append((node, starting))
        if starting and node == "c":
            announced.set()
        fake._up(node, "ListManifests")
        return Manifests([rec], ["a refused one"])

    fake.list_manifests = manifests  # type: ignore[method-assign]
    cluster = _cluster(catalog, fake)
    assert cluster.pull_manifests() == 1
    assert catalog.get("run", "s9").files[0].owner_node == "c"
    assert cluster.jobs.pending() == [Heal("run", "s9")]  # it heals what it adopted
    # Then, in the background (after the restore prewarm), the peers are told it
    # started: they heal what it held at once.
    assert announced.wait(10.0)
    assert asked[:2] == [("b", False), ("c", False)] and ("c", True) in asked


def test_a_peer_not_reached_by_the_start_announce_is_told_again_until_it_answers(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer cut off when this node came back empty would go on listing this node's
    # former copies REPLICATED: the announce goes on until it is heard.
    monkeypatch.setattr(commit, "ANNOUNCE_RETRY", 0.05)
    fake = FakePeers("node-a", {"b": "r2", "c": "r3"})
    fake.down.add("b")
    told: list[str] = []
    heard = threading.Event()

    def manifests(
        node: str, namespace: str = "", *, wait_for_ready: bool = True, starting: bool = False
    ) -> Manifests:
        fake._up(node, "ListManifests")
        if starting:
            told.append(node)
            if node == "b":
                heard.set()
        return Manifests([], [])

    fake.list_manifests = manifests  # type: ignore[method-assign]
    cluster = _cluster(catalog, fake)
    announcing = threading.Thread(target=cluster.committer.announce, daemon=True)
    announcing.start()
    deadline = time.monotonic() + 10.0
    while "c" not in told and time.monotonic() < deadline:
        time.sleep(0.01)
    assert told == ["c"] and not heard.is_set()  # b is down: not told yet
    time.sleep(0.2)
    assert "b" not in told  # retried, still down
    fake.down.discard("b")
    assert heard.wait(10.0)
    announcing.join(10.0)
    assert not announcing.is_alive() and told.count("c") == 1  # a peer told is not told again


def test_a_peer_that_knows_it_durable_keeps_it_from_being_lost() -> None:
    # This node has not learnt yet that the checkpoint is in the persistent tier; its
    # holders let their copies go there and answer without them, saying DURABLE.
    view = _view(_file("f", "a", ["b"]))
    durable = Holdings(True, frozenset(), (), durable=True)
    plan = plan_heal(view, {"c": _held(), "a": durable, "b": durable}, MEMBERS, 1, "c")
    assert plan.lost == () and plan.under == ("f",)


def test_a_restarted_holder_is_unconfirmed_even_where_no_file_involves_this_node(
    catalog: Catalog,
) -> None:
    """Issue 28: a peer that restarts may have come back empty. A node outside every
    file's neighbourhood never heals the checkpoint, so it used to list it REPLICATED on
    the restarted holder's name alone; now it lists it under-replicated from the
    announce (`manifests(started=...)`) until a heal finds the copies again."""
    peers = {"b": "r2", "c": "r3", "d": "r4", "e": "r5"}
    members = [Member(n, d) for n, d in {"node-a": "r1", **peers}.items()]

    def outside(name: str, owner: str, replica: str) -> bool:
        near = neighbourhood(file_key("run", "s3", name), owner, [replica], members, 1)
        return "node-a" not in near

    owner, replica = next(
        (o, r) for o in peers for r in peers if o != r and outside(".metadata", o, r)
    )
    name = next(n for n in (f"__0_{i}.distcp" for i in range(200)) if outside(n, owner, replica))
    fake = FakePeers("node-a", peers)
    cluster = _cluster(catalog, fake)
    rec = CheckpointRecord("run", "s3", State.COMMITTED, 1.0, "", 2.0, 5)
    for n in (name, ".metadata"):
        f = _file(n, owner, [replica])
        f.held = False
        rec.files[n] = f
    assert catalog.publish(rec)
    for node in (owner, replica):
        fake.knows[node] = True
        fake.held[node] = {name: b"data", ".metadata": b"data"}
    assert catalog.get("run", "s3").state is State.REPLICATED
    assert cluster.healer.heal("run", "s3") is None  # no file involves this node

    cluster.manifests("run", started=replica)  # the replica holder restarted
    view = catalog.get("run", "s3")
    assert view.state is State.COMMITTED and "under-replicated" in view.tiers
    fake.held[replica] = {}  # it came back empty; nobody pushed yet
    assert (
        cluster.healer.heal("run", "s3") is not None
    )  # every file healed, though none involves it
    assert catalog.get("run", "s3").state is State.COMMITTED
    fake.held[replica] = {name: b"data", ".metadata": b"data"}  # the copies are back
    cluster.heal("run", "s3")
    assert catalog.get("run", "s3").state is State.REPLICATED
    assert cluster.healer.label("run", "s3") == ""


def test_a_list_naming_a_holder_that_may_not_hold_it_is_doubted(catalog: Catalog) -> None:
    """Issue 28 (two dishonest listings of the network chaos run): a replica list that
    names a peer which restarted since (sent before it came back empty, arriving after
    its announce), and a manifest adopted from a peer that names this node for a file it
    does not hold, are listed under-replicated until a heal confirms the copies."""
    fake = FakePeers("node-a", PEERS)
    cluster = _cluster(catalog, fake)
    cluster.manifests("run", started="c")  # c announces its restart; nothing names it yet
    rec = CheckpointRecord("run", "s4", State.COMMITTED, 1.0, "", 2.0, 5)
    f = _file(".metadata", "b", ["node-a"])  # names this node, which holds nothing of it
    f.held = False
    rec.files[f.name] = f
    assert catalog.publish(rec)
    # This node knows it lacks the copy: never REPLICATED on its own name (views.copies).
    assert catalog.get("run", "s4").state is State.COMMITTED
    assert cluster.healer.doubt("run", "s4")
    assert catalog.get("run", "s4").state is State.COMMITTED
    # A late replica list naming the restarted peer c: doubted as it arrives.
    rec5 = CheckpointRecord("run", "s5", State.COMMITTED, 1.0, "", 2.0, 6)
    g = _file(".metadata", "b")
    g.held = False
    rec5.files[g.name] = g
    assert catalog.publish(rec5)
    cluster.set_replicas("run", "s5", ".metadata", ["c"])
    view = catalog.get("run", "s5")
    assert view.state is State.COMMITTED and "under-replicated" in view.tiers
    # Confirmed by a heal: both hold it, the label goes.
    for node in ("b", "c"):
        fake.knows[node] = True
        fake.held[node] = {".metadata": b"data"}
    cluster.healer.heal("run", "s5", full=True)
    assert catalog.get("run", "s5").state is State.REPLICATED
    # Outside the window a list naming c is taken as it is.
    cluster.healer._restarted["c"] -= 10_000.0
    assert not cluster.healer.doubt("run", "s5")


def test_a_peer_that_says_durable_makes_the_drain_ask_the_persistent_tier_now(
    catalog: Catalog, save: Save
) -> None:
    """Issue 28 (network chaos, stop 33): peers let a durable checkpoint's copies go while
    this node, its drain in back-off, still listed it REPLICATED on their names. A peer's
    answer that it is durable is a hint to the drain (never proof), once per
    DURABLE_ELSEWHERE_EVERY seconds."""
    hints: list[tuple[str, str]] = []
    catalog.events.durable_elsewhere.add(lambda ns, c: hints.append((ns, c)))
    fake = FakePeers("node-a", PEERS)
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    cluster.heal("run", "s1")
    assert hints == []  # nobody says durable
    fake.durable.add("b")
    cluster.heal("run", "s1")
    cluster.heal("run", "s1")
    assert hints == [("run", "s1")]  # once, not every heal round
    assert catalog.get("run", "s1").state is not State.DURABLE  # a hint, not taken as proof


def test_a_confirmed_checkpoint_is_not_doubted_again_for_the_same_restart(
    catalog: Catalog, save: Save
) -> None:
    fake = FakePeers("node-a", PEERS)
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 10})
    cluster.heal("run", "s1")
    (holder,) = catalog.get("run", "s1").files[0].replica_nodes
    cluster.manifests("run", started=holder)
    assert cluster.healer.label("run", "s1") == "under-replicated"
    cluster.heal("run", "s1")  # the holder still has it: confirmed
    assert cluster.healer.label("run", "s1") == ""
    assert not cluster.healer.doubt("run", "s1")  # the same restart: no flapping label
    assert cluster.healer.doubt("run", "s1", fresh=True)  # a list arriving now is doubted


class _Relaying(FakePeers):
    """Peers whose ListManifests answers are `answers[node]` (records it lists)."""

    def __init__(self, me: str, peers: dict[str, str]) -> None:
        super().__init__(me, peers)
        self.answers: dict[str, list[CheckpointRecord]] = {n: [] for n in peers}

    def list_manifests(
        self, node: str, namespace: str = "", *, wait_for_ready: bool = True, starting: bool = False
    ) -> Manifests:
        self._up(node, "ListManifests")
        return Manifests([r for r in self.answers[node] if namespace in ("", r.namespace)], [])


def test_a_manifest_its_restarting_coordinator_confirms_later_is_adopted_then(
    catalog: Catalog,
) -> None:
    """Issue 28 (stop 34): a node that starts while the checkpoint's coordinator restarts
    empty too hears the manifest relayed by a peer before the coordinator re-adopted it.
    It asks the coordinator again (`CONFIRM_RETRIES`) and adopts what it confirms; gossip
    declines such a manifest for `DECLINE_FOR` only, never for good (it was: the node then
    never listed that checkpoint, and a load through it said "not found")."""
    fake = _Relaying("node-a", PEERS)
    cluster = _cluster(catalog, fake)
    rec = CheckpointRecord("run", "s7", State.COMMITTED, 1.0, "", 2.0, 9)
    meta = _file(".metadata", "b")  # b coordinates it
    meta.held = False
    rec.files[meta.name] = meta
    fake.answers["c"] = [rec]  # c relays it; b, restarting empty, does not know it yet
    pending = {rec.key: ("c", rec)}
    assert cluster.committer._confirm_later(pending, pauses=(0.0,)) == 0
    assert rec.key in pending
    fake.answers["b"] = [rec]  # b re-adopted it
    assert cluster.committer._confirm_later(pending, pauses=(0.0,)) == 1
    assert not pending and catalog.get("run", "s7").state is State.COMMITTED
    # Gossip: declined while b does not confirm, asked again after DECLINE_FOR.
    rec8 = CheckpointRecord("run", "s8", State.COMMITTED, 1.0, "", 2.0, 10)
    rec8.files[meta.name] = meta
    fake.answers = {"b": [rec], "c": [rec, rec8]}
    assert cluster.committer.gossip(fanout=2) == 0
    fake.answers["b"] = [rec, rec8]
    assert cluster.committer.gossip(fanout=2) == 0  # declined for now
    cluster.committer._declined[rec8.key] -= commit.DECLINE_FOR
    assert cluster.committer.gossip(fanout=2) == 1
    assert catalog.get("run", "s8").checkpoint_id == "s8"


def test_a_heal_that_asked_before_a_holder_restarted_confirms_nothing(
    catalog: Catalog, save: Save
) -> None:
    """Issue 28 (stop 34): a heal gathered its holdings, then a holder announced it had
    restarted (maybe empty). Its finding predates the restart: the checkpoint stays
    under-replicated (it was listed REPLICATED on the empty node's name, and the doubt the
    announce raised was cleared), and the heal the announce queues decides."""
    fake = FakePeers("node-a", PEERS)
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s9", {"__0_0.distcp": b"x" * 10})
    cluster.heal("run", "s9")
    assert catalog.get("run", "s9").state is State.REPLICATED
    holder = catalog.get("run", "s9").files[0].replica_nodes[0]
    asked = FakePeers.holdings

    def then_restarted(self: FakePeers, node: str, namespace: str, checkpoint_id: str) -> Holdings:
        answer = asked(self, node, namespace, checkpoint_id)
        cluster.healer.restarted(holder)  # announced while this heal asks
        return answer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FakePeers, "holdings", then_restarted)
        cluster.heal("run", "s9")
    view = catalog.get("run", "s9")
    assert view.state is State.COMMITTED and "under-replicated" in view.tiers
    cluster.heal("run", "s9")  # the announce's heal: the holder answers with its copy
    assert catalog.get("run", "s9").state is State.REPLICATED


def test_a_list_that_drops_a_name_is_told_to_every_peer(catalog: Catalog, save: Save) -> None:
    """A copy added is told to the file's neighbourhood and coordinator (gossip spreads an
    added name: replica lists merge as unions); a name dropped (a holder found without
    its copy) is told to every peer, or a node outside the neighbourhood would list the
    dropped holder for good (the network chaos run's `step-00100553`)."""
    peers = {n: f"r{i}" for i, n in enumerate("bcdefgh", start=2)}
    fake = FakePeers("node-a", peers)
    fake.membership.configure([PeerConfig(n, "x:1", d) for n, d in peers.items()], 1)
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"__0_0.distcp": b"x" * 100})
    cluster.heal("run", "s1")
    (holder,) = catalog.get("run", "s1").files[0].replica_nodes
    added = {n for n, name, _ in fake.replicas if name == "__0_0.distcp"}
    assert holder in added and added < set(peers), added  # the neighbourhood only
    fake.replicas.clear()
    fake.held[holder] = {}  # answers without its copy, and takes none: replaced
    fake.refuse[holder] = "RESOURCE_EXHAUSTED"
    cluster.heal("run", "s1")
    (now,) = catalog.get("run", "s1").files[0].replica_nodes
    assert now != holder
    told = {n for n, name, replicas in fake.replicas if replicas == [now]}
    assert told == set(peers), told


def test_copies_in_one_failure_domain_are_spread_to_another_then_the_extra_is_trimmed() -> None:
    """A replica placed in the owner's failure domain while the others were out of reach
    (the network chaos run's `step-00100044`: the owner's rack then lost both copies'
    nodes at once, one cut, one replaced empty) is not enough: the file is listed
    under-replicated, and once another domain answers its owner pushes a copy there;
    the copy that then ranks last, in the domain already covered, is trimmed."""
    f = _file("f", "a", ["d"])  # a and d: both in r1
    view = _view(f)
    # The other domains out of reach: nothing to push, but honest about it.
    plan = plan_heal(view, {"a": _held("f"), "d": _held("f")}, MEMBERS, 1, "a")
    assert plan.pushes == () and plan.under == ("f",)
    # Back in reach: one copy to the best node of another domain.
    holdings = {"a": _held("f"), "d": _held("f"), "b": _held(), "c": _held()}
    plan = plan_heal(view, holdings, MEMBERS, 1, "a")
    best = _targets("f", "a", {"a", "d"})
    assert plan.pushes == (FilePush("f", best, 1),) and plan.under == ("f",)
    # Pushed: two domains hold it, and d's copy is the surplus.
    holdings[best[0]] = _held("f")
    assert plan_heal(view, holdings, MEMBERS, 1, "a").under == ()
    assert plan_heal(view, holdings, MEMBERS, 1, "a").pushes == ()
    assert plan_trim(view, holdings, MEMBERS, 1, "d") == {"f": [best[0]]}
    assert plan_trim(view, holdings, MEMBERS, 1, best[0]) == {}
    # A cluster of one failure domain asks for nothing more.
    one = [Member(m.id, "r1") for m in MEMBERS]
    plan = plan_heal(view, {"a": _held("f"), "d": _held("f"), "b": _held()}, one, 1, "a")
    assert plan.pushes == () and plan.under == ()
