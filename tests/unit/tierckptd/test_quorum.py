"""The writers a node with no binding of a namespace takes from its peers (audit 3 H2):
`commit.quorum` over what each peer states as its own binding."""

from __future__ import annotations

from tierckptd.peers.commit import quorum


def _s(**stated: str) -> dict[str, frozenset[str]]:
    return {node: frozenset(w.split(",")) for node, w in stated.items()}


def test_the_honest_binding_wins_two_to_one() -> None:
    assert quorum(_s(a="a", b="a", m="m")) == {"a"}


def test_a_member_never_wins_by_vouching_for_itself_against_another() -> None:
    # The only peer stating any writer is taken (a job one node coordinates: its
    # replacement partner must find the newest); docs/security.md names that limit.
    assert quorum(_s(m="m")) == {"m"}
    assert quorum(_s(a="a", m="m")) == set()  # no majority: no writer
    assert quorum(_s(a="a", b="a", m="m")) == {"a"}
    assert quorum(_s(a="a,m", b="a", m="a,m")) == {"a", "m"}  # m named by a, not alone


def test_a_lost_coordinator_is_a_writer_per_the_nodes_that_took_part() -> None:
    assert quorum(_s(node1="node0")) == {"node0"}
    assert quorum({}) == set()
