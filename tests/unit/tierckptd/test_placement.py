from __future__ import annotations

from tierckptd.peers.placement import Member, buddies, file_key, preference, replica_count

NODES = [
    Member("a1", "rack-a"),
    Member("a2", "rack-a"),
    Member("a3", "rack-a"),
    Member("b1", "rack-b"),
    Member("b2", "rack-b"),
    Member("c1", "rack-c"),
]
KEYS = [file_key("run", f"step-{i:06d}", f"__{r}_0.distcp") for i in range(20) for r in range(8)]


def test_deterministic_and_order_independent() -> None:
    for key in KEYS[:20]:
        first = buddies(key, "a1", NODES, 2)
        assert first == buddies(key, "a1", list(reversed(NODES)), 2)
        assert first == buddies(key, "a1", NODES, 2)


def test_never_the_owner() -> None:
    for key in KEYS:
        for owner in NODES:
            assert owner.id not in preference(key, owner.id, NODES)
            assert owner.id not in buddies(key, owner.id, NODES, 5)


def test_other_failure_domains_first() -> None:
    for key in KEYS:
        chosen = buddies(key, "a1", NODES, 3)
        assert {n[0] for n in chosen} <= {"b", "c"}
        full = preference(key, "a1", NODES)
        assert [n[0] for n in full[-2:]] == ["a", "a"]  # same-domain nodes only at the end


def test_spreads_over_buddies() -> None:
    chosen = {buddies(key, "a1", NODES, 1)[0] for key in KEYS}
    assert chosen == {"b1", "b2", "c1"}


def test_stable_when_an_unrelated_node_joins() -> None:
    grown = [*NODES, Member("d1", "rack-d")]
    moved = 0
    for key in KEYS:
        before = buddies(key, "a1", NODES, 2)
        after = buddies(key, "a1", grown, 2)
        if before != after:
            moved += 1
            assert "d1" in after  # only the new node can displace a buddy
            assert set(before) - set(after) and len(set(before) & set(after)) >= 1
    assert 0 < moved < len(KEYS) * 0.75


def test_k_capped_by_membership() -> None:
    two = [Member("x", "r1"), Member("y", "r2")]
    assert replica_count(3, two) == 1
    assert buddies("ns/id/f", "x", two, 3) == ["y"]
    assert replica_count(1, [Member("x")]) == 0
    assert buddies("ns/id/f", "x", [Member("x")], 1) == []
    assert replica_count(0, NODES) == 0
    assert len(buddies("k", "a1", NODES, 10)) == 5


def test_owner_outside_membership_still_gets_buddies() -> None:
    # A manifest may name an owner that left the peer list.
    assert len(buddies("ns/id/f", "gone", NODES, 2)) == 2
