"""`PeerSource.landed` hands the news on and returns: it never calls a peer itself.

Telling every peer in the restore's thread cost the reader one call per peer per restored
file, and a whole deadline (2 s) for each peer that was down. The daemon passes a callback
that queues the telling (`Cluster.copy_landed`, `Healer.tell_landed`).
"""

from __future__ import annotations

from typing import Any

from tierckptd.model import FileRecord
from tierckptd.peers.breaker import Breaker
from tierckptd.peers.source import PeerSource, peer_sources


class _NoCalls:
    """A PeerClient stand-in that fails the test on any peer call."""

    node_id = "n1"
    peer_ids = ["n0", "n2", "n3"]
    breaker = Breaker()  # which peers back off: state, not a call

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"PeerSource.landed called the peers ({name})")


def _file(owner: str) -> FileRecord:
    return FileRecord(name="__0_0.distcp", rank=0, size=10, owner_node=owner, replica_nodes=["n2"])


def test_landed_calls_back_once_and_calls_no_peer() -> None:
    told: list[tuple[str, str, str]] = []
    source = PeerSource(_NoCalls(), "n0", lambda ns, cid, name: told.append((ns, cid, name)))  # type: ignore[arg-type]
    source.landed("run7", "step-1", _file("n0"))
    assert told == [("run7", "step-1", "__0_0.distcp")]


def test_the_owners_own_copy_coming_back_is_no_news() -> None:
    told: list[tuple[str, str, str]] = []
    source = PeerSource(_NoCalls(), "n0", lambda ns, cid, name: told.append((ns, cid, name)))  # type: ignore[arg-type]
    source.landed("run7", "step-1", _file("n1"))  # n1 restores a file it owns
    assert told == []


def test_every_peer_source_of_a_file_carries_the_callback() -> None:
    told: list[tuple[str, str, str]] = []
    sources = peer_sources(
        _NoCalls(), _file("n0"), lambda ns, cid, name: told.append((ns, cid, name))
    )  # type: ignore[arg-type]
    assert [s.node for s in sources] == ["n0", "n2", "n3"]  # owner, replica, the rest
    for s in sources:
        s.landed("run7", "step-1", _file("n0"))
    assert told == [("run7", "step-1", "__0_0.distcp")] * 3
    PeerSource(_NoCalls(), "n0").landed("run7", "step-1", _file("n0"))  # type: ignore[arg-type]
