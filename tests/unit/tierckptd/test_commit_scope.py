"""A commit, a heal and a replica update involve only the nodes near the checkpoint's files,
so their RPCs do not grow with the cluster; other nodes learn manifests by gossip, and a
checkpoint a peer lists LOST is healed in full (issue 13, point 2). Fake PeerClient, no gRPC."""

from __future__ import annotations

from collections import Counter

import pytest
from tierckptd.catalog import Catalog
from tierckptd.config import PeerConfig
from tierckptd.jobs import Heal, Tell
from tierckptd.model import CheckpointRecord, CheckpointView, State
from tierckptd.peers.client import Holdings, Manifests, PeerCallError
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.placement import Member, interested, neighbourhood, spare_width
from tierckptd.restore import Restorer, no_sources

from tests.support.daemon_parts import coordinator

from .conftest import Save, write_file
from .test_healer import FakePeers, _file


class CountingPeers(FakePeers):
    """FakePeers that count every call by (method, node)."""

    def __init__(self, me: str, peers: dict[str, str]) -> None:
        super().__init__(me, peers)
        self.calls: Counter[tuple[str, str]] = Counter()
        self.gossiped: dict[str, Manifests] = {}
        self.published_files: list[set[str]] = []

    def holdings(self, node: str, namespace: str, checkpoint_id: str) -> Holdings:
        self.calls["Holdings", node] += 1
        return super().holdings(node, namespace, checkpoint_id)

    def publish(self, node: str, view: CheckpointView) -> None:
        self.calls["Publish", node] += 1
        self.published_files.append({f.name for f in view.files})
        super().publish(node, view)

    def update_replicas(
        self, node: str, namespace: str, checkpoint_id: str, name: str, replicas: list[str]
    ) -> None:
        self.calls["UpdateReplicas", node] += 1
        super().update_replicas(node, namespace, checkpoint_id, name, replicas)

    def list_manifests(
        self, node: str, namespace: str = "", *, wait_for_ready: bool = True, starting: bool = False
    ) -> Manifests:
        self.calls["ListManifests", node] += 1
        self._up(node, "ListManifests")
        got = self.gossiped.get(node, Manifests([], []))
        if namespace:
            return Manifests([r for r in got.records if r.namespace == namespace], [], got.lost)
        return got

    def per(self, method: str) -> int:
        return sum(n for (m, _), n in self.calls.items() if m == method)


def _peers(n: int) -> dict[str, str]:
    return {f"p{i:03d}": f"rack-{i % 4}" for i in range(n)}


def _cluster(catalog: Catalog, fake: FakePeers) -> Cluster:
    return Cluster(catalog, Restorer(catalog, no_sources), client=fake, heal_interval=0)


@pytest.mark.parametrize("n", [4, 16, 64, 256])
def test_a_files_neighbourhood_does_not_grow_with_the_cluster(n: int) -> None:
    members = [Member("a", "r0"), *(Member(i, d) for i, d in _peers(n).items())]
    for k in (0, 1, 2):
        for name in ("f", "g", ".metadata"):
            near = neighbourhood(f"run/s1/{name}", "a", [], members, k)
            assert "a" in near and len(near) == 1 + min(spare_width(k), n)
    files = [_file(f"__{r}_0.distcp", f"p{r:03d}") for r in range(3)]
    assert len(interested("run", "s1", files, members, 1)) <= 3 * (1 + spare_width(1))


def _remote_commit(
    catalog: Catalog, fake: CountingPeers, holders: list[str], owner: str = "p007"
) -> CheckpointView:
    """A two-rank save: .metadata here, __1_0.distcp on `owner`."""
    remote = _file("__1_0.distcp", owner)
    fake.held[owner]["__1_0.distcp"] = b"data"

    def holdings(node: str, namespace: str, checkpoint_id: str) -> Holdings:
        fake.calls["Holdings", node] += 1
        files = (remote,) if node == owner else ()
        return Holdings(False, frozenset(f.name for f in files), files)

    fake.holdings = holdings  # type: ignore[method-assign]
    cluster = _cluster(catalog, fake)
    catalog.begin("run", "s1", 0)
    catalog.reserve("run", "s1", 0, 1)
    write_file(catalog, "run", "s1", ".metadata", b"m")
    commits = coordinator(catalog, cluster)
    view = commits.commit("run", "s1", [".metadata", "__1_0.distcp"], holders=holders)
    assert {f.name: f.owner_node for f in view.files} == {
        ".metadata": "node-a",
        "__1_0.distcp": owner,
    }
    assert cluster.jobs.pending() == [Heal("run", "s1")]
    return view


def test_a_hinted_commit_asks_the_ranks_nodes_and_publishes_to_the_files_neighbours(
    catalog: Catalog,
) -> None:
    fake = CountingPeers("node-a", _peers(40))
    view = _remote_commit(catalog, fake, ["p007", "node-a"])
    # The hint only orders: every peer is asked once, so no hinted node's claim goes
    # unchecked against the others (audit 3, M2).
    assert fake.per("Holdings") == 40 and fake.calls["Holdings", "p007"] == 1
    published = {node for (m, node), _ in fake.calls.items() if m == "Publish"}
    members = fake.membership.member_list()
    k = fake.membership.replica_target
    expected = interested("run", "s1", view.files, members, k) - {"node-a"}
    assert published == expected and "p007" in published
    assert len(published) <= 2 * (1 + spare_width(k))  # not the 40 peers


def test_a_wrong_or_missing_hint_falls_back_to_every_peer(catalog: Catalog) -> None:
    fake = CountingPeers("node-a", _peers(12))
    _remote_commit(catalog, fake, ["p001"])  # the rank wrote to p007, not p001
    assert fake.calls["Holdings", "p001"] == 1 and fake.per("Holdings") == 12


def test_a_heal_asks_only_the_neighbourhoods_of_the_files_it_is_involved_in(
    catalog: Catalog, save: Save
) -> None:
    for n in (12, 48, 96):
        fake = CountingPeers("node-a", _peers(n))
        cluster = _cluster(catalog, fake)
        ckpt = f"s{n}"
        save(catalog, "run", ckpt, {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 300})
        cluster.heal("run", ckpt)
        assert catalog.get("run", ckpt).state is State.REPLICATED
        # Two files, each with its spare_width(1) candidates: the same bound at any N.
        asked = {node for (m, node), _ in fake.calls.items() if m == "Holdings"}
        assert 0 < len(asked) <= 2 * spare_width(1), (n, asked)
        # Replica lists go to each file's neighbourhood (and the coordinator), not to all.
        told = {node for (m, node), _ in fake.calls.items() if m == "UpdateReplicas"}
        assert 0 < len(told) <= 2 * (1 + spare_width(1)), (n, told)


def test_a_node_no_file_involves_makes_no_call_unless_a_peer_lists_it_lost(
    catalog: Catalog,
) -> None:
    peers = _peers(30)
    fake = CountingPeers("node-a", peers)
    cluster = _cluster(catalog, fake)
    members = fake.membership.member_list()
    k = fake.membership.replica_target
    # Files owned by peers whose neighbourhoods leave node-a out.
    owners = [
        n
        for n in peers
        if "node-a" not in neighbourhood("run/s5/.metadata", n, [], members, k)
        and "node-a" not in neighbourhood("run/s5/__1_0.distcp", n, [], members, k)
    ][:1]
    rec = CheckpointRecord("run", "s5", State.COMMITTED, 1.0, "", 2.0, 5)
    meta, data = _file(".metadata", owners[0]), _file("__1_0.distcp", owners[0])
    meta.held = data.held = False
    rec.files = {meta.name: meta, data.name: data}
    assert catalog.publish(rec)
    assert cluster.healer.heal("run", "s5") is None
    assert not fake.calls
    # A peer lists it LOST: gossip queues a full heal, which asks every peer.
    fake.gossiped["p000"] = Manifests([], [], [("run", "s5")])
    fake.gossiped["p001"] = Manifests([], [], [("run", "s5")])
    cluster.committer.gossip(fanout=len(peers))
    assert Heal("run", "s5", full=True) in cluster.jobs.pending()
    fake.calls.clear()
    cluster.healer.heal("run", "s5", full=True)
    assert fake.per("Holdings") == len(peers)
    assert cluster.healer.label("run", "s5") == "lost"  # every holder answered without it


def test_gossip_adopts_a_coordinators_manifest_and_confirms_a_relayed_one(
    catalog: Catalog,
) -> None:
    fake = CountingPeers("node-a", _peers(6))
    cluster = _cluster(catalog, fake)

    def record(ckpt: str, coordinator: str) -> CheckpointRecord:
        rec = CheckpointRecord("run", ckpt, State.COMMITTED, 1.0, "", 2.0, 5)
        meta = _file(".metadata", coordinator)
        meta.held = False
        rec.files = {meta.name: meta}
        return rec

    own, relayed, forged = record("s1", "p000"), record("s2", "p003"), record("s3", "p004")
    fake.gossiped["p000"] = Manifests([own, relayed, forged], [])
    fake.gossiped["p003"] = Manifests([relayed], [])  # p003 confirms its own
    fake.gossiped["p004"] = Manifests([], [])  # p004 never committed s3
    adopted = cluster.committer.gossip(fanout=6)
    assert adopted == 2
    keys = set(catalog.committed_keys())
    assert ("run", "s1") in keys and ("run", "s2") in keys and ("run", "s3") not in keys
    assert fake.calls["ListManifests", "p003"] >= 1 and fake.calls["ListManifests", "p004"] >= 1
    fake.calls.clear()
    assert cluster.committer.gossip(fanout=6) == 0  # nothing new; s3 not asked again
    assert fake.per("ListManifests") == 6


def test_gossip_asks_a_bounded_number_of_peers(catalog: Catalog) -> None:
    fake = CountingPeers("node-a", _peers(50))
    cluster = _cluster(catalog, fake)
    cluster.committer.gossip()
    assert fake.per("ListManifests") == 2
    fake.membership.configure([PeerConfig(n, "x:1", d) for n, d in _peers(200).items()], 1)
    fake.calls.clear()
    cluster.committer.gossip()
    assert fake.per("ListManifests") == 2


def test_a_heal_of_some_files_publishes_the_whole_manifest(catalog: Catalog) -> None:
    # The coordinator is involved only in its .metadata here; a buddy that missed the
    # commit's publish gets the manifest from the push, with every file of the checkpoint.
    peers = _peers(40)
    fake = CountingPeers("node-a", peers)
    members = fake.membership.member_list()
    k = fake.membership.replica_target
    far = next(
        n for n in peers if "node-a" not in neighbourhood("run/s1/__1_0.distcp", n, [], members, k)
    )
    _remote_commit(catalog, fake, [far], owner=far)
    cluster = _cluster(catalog, fake)
    fake.published_files.clear()
    fake.knows = dict.fromkeys(peers, False)  # every publish of the commit was lost
    cluster.heal("run", "s1")
    assert fake.pushed and all(name == ".metadata" for _, name in fake.pushed)
    assert fake.published_files and all(
        names == {".metadata", "__1_0.distcp"} for names in fake.published_files
    )


def test_a_heal_never_overwrites_a_replica_list_that_arrived_while_it_asked(
    catalog: Catalog,
) -> None:
    # node-a is not responsible for b's file: its finding (only c holds a copy yet) must
    # not replace the newer list b's UpdateReplicas brought while node-a asked d.
    domains = {"b": "r2", "c": "r3", "d": "r4"}
    fake = CountingPeers("node-a", domains)
    fake.membership.configure([PeerConfig(n, "x:1", d) for n, d in domains.items()], 2)
    cluster = _cluster(catalog, fake)
    rec = CheckpointRecord("run", "s7", State.COMMITTED, 1.0, "", 2.0, 5)
    data = _file("__1_0.distcp", "b")
    data.held = False
    rec.files = {data.name: data}
    assert catalog.publish(rec)
    for node in ("b", "c", "d"):
        fake.knows[node] = True
    fake.held["b"] = {"__1_0.distcp": b"data"}
    fake.held["c"] = {"__1_0.distcp": b"data"}
    asked = fake.holdings

    def holdings(node: str, namespace: str, checkpoint_id: str) -> Holdings:
        got = asked(node, namespace, checkpoint_id)
        if node == "d":  # b finished its pushes: its UpdateReplicas lands here now
            catalog.set_replicas("run", "s7", "__1_0.distcp", ["c", "d"])
        return got

    fake.holdings = holdings  # type: ignore[method-assign]
    cluster.heal("run", "s7")
    assert catalog.get("run", "s7").files[0].replica_nodes == ["c", "d"]
    # Without a newer list, the finding is recorded.
    catalog.set_replicas("run", "s7", "__1_0.distcp", ["d"])
    fake.holdings = asked  # type: ignore[method-assign]
    cluster.heal("run", "s7")
    assert catalog.get("run", "s7").files[0].replica_nodes == ["c"]


def test_a_busy_peer_is_told_the_replica_list_again(catalog: Catalog, save: Save) -> None:
    # Every owner of a large job tells the coordinator at once: a peer at its call limit
    # answers RESOURCE_EXHAUSTED, and a queued job sends the list again after a pause,
    # never the heal inline (a gray peer must not hold it; audit 3 M1).
    fake = CountingPeers("node-a", {"b": "r2", "c": "r3"})
    cluster = _cluster(catalog, fake)
    save(catalog, "run", "s1", {"f": b"x" * 10})
    catalog.set_replicas("run", "s1", "f", ["b"])
    refusals = {"c": 2}
    sent = fake.update_replicas

    def update_replicas(
        node: str, namespace: str, checkpoint_id: str, name: str, replicas: list[str]
    ) -> None:
        if refusals.get(node, 0) > 0:
            refusals[node] -= 1
            raise PeerCallError(node, "UpdateReplicas", "RESOURCE_EXHAUSTED", "busy")
        sent(node, namespace, checkpoint_id, name, replicas)

    fake.update_replicas = update_replicas  # type: ignore[method-assign]
    cluster.healer.broadcast_replicas("run", "s1", "f", ["b"], ["b", "c"])
    assert fake.calls["UpdateReplicas", "b"] == 1  # told once, not again
    assert refusals["c"] == 1  # refused once, not retried inline
    assert cluster.jobs.pending() == [Tell("run", "s1", "f", "c", 1)]
    cluster.healer.tell("run", "s1", "f", "c", 1)  # the job runs: busy again, queued again
    assert Tell("run", "s1", "f", "c", 2) in cluster.jobs.pending()
    cluster.healer.tell("run", "s1", "f", "c", 2)  # taken: the list the catalog records
    assert fake.calls["UpdateReplicas", "c"] == 1 and refusals["c"] == 0
    assert ("c", "f", ["b"]) in fake.replicas


def test_a_gossiped_list_that_names_a_restarted_node_again_is_doubted(
    catalog: Catalog,
) -> None:
    """Issue 28 (the stop-33 run of record): replica lists merged from the coordinator's
    gossiped manifest are a union, so a list made before a node came back empty names it
    again after a heal here dropped it; the names a merge adds are doubted."""
    peers = {"b": "r2", "c": "r3"}
    fake = CountingPeers("node-a", peers)
    cluster = _cluster(catalog, fake)
    rec = CheckpointRecord("run", "s6", State.COMMITTED, 1.0, "", 2.0, 5)
    meta = _file(".metadata", "b")
    meta.held = False
    rec.files = {meta.name: meta}
    assert catalog.publish(rec)  # known here, no replica yet
    cluster.manifests("run", started="c")  # c came back empty
    stale = CheckpointRecord("run", "s6", State.COMMITTED, 1.0, "", 2.0, 5)
    old = _file(".metadata", "b", ["c"])  # the coordinator's list from before c's restart
    old.held = False
    stale.files = {old.name: old}
    fake.gossiped["b"] = Manifests([stale], [])
    cluster.committer.gossip(fanout=2)
    view = catalog.get("run", "s6")
    assert view.files[0].replica_nodes == ["c"]  # merged
    assert view.state is State.COMMITTED and "under-replicated" in view.tiers  # doubted
    assert Heal("run", "s6") in cluster.jobs.pending()
