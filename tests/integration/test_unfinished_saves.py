"""A node whose copy of a commit never arrived keeps the files it wrote (found by the
chaos runner: they were the only copies, and the coordinator listed a checkpoint no node
could load).

Real daemons, node0 coordinating a 2-node save (rank i writes on node i), copies = 1:
- node0 cannot publish (`peer.publish:error`): node1's save stays unfinished; after
  abandon_after its sweeper asks the peers, adopts node0's manifest and keeps its file;
- node0 dies between its commit and the publish (`commit.before_publish:kill`): node1
  waits while node0 does not answer, and node0's restart publishes again;
- node1 restarts while its save is unfinished: the file is kept as an orphan and
  installed once node0's manifest is pulled and the bytes verify.
Every time node1's copy is bit-exact and the checkpoint listed committed on both nodes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from tierckpt.daemon_client import DaemonClient

from tests.support.peer_nodes import NS, Nodes

pytestmark = pytest.mark.integration

ABANDON = 3.0  # node1's abandon_after: its sweeper (every 5 s) asks soon; kept 4x as long
MINE = "__1_0.distcp"  # node 1's file of the save


class Pair(Nodes):
    """Two nodes, node 0 coordinating, node 1 with a short abandon_after."""

    def __init__(self, stack: ExitStack) -> None:
        super().__init__(
            stack, 2, heal_interval=1.0, overrides={"memory": {"abandon_after": ABANDON}}
        )

    def restart_with_fault(self, i: int, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.nodes[i].terminate()
        with monkeypatch.context() as m:
            m.setenv("TIERCKPT_FAULT", fault)
            self.nodes[i].start()

    def save_s1(self) -> bytes:
        """Rank i writes its file on node i, node 0 commits; node 1's bytes."""
        mine = os.urandom(300_000)
        files = {0: {"__0_0.distcp": os.urandom(200_000), ".metadata": b"m" * 100}}
        self.save("s1", {**files, 1: {MINE: mine}})
        return mine

    def node1_copy(self) -> bytes | None:
        """node1's bytes of its file of s1 when it lists s1 committed."""
        try:
            info = self.clients[1].get_checkpoint(NS, "s1")
        except Exception:
            return None
        if info.state not in ("COMMITTED", "REPLICATED"):
            return None
        path = {f.name: f.local_path for f in info.files}.get(MINE, "")
        return open(path, "rb").read() if path else None


@pytest.fixture
def pair() -> Iterator[Pair]:
    with ExitStack() as stack:
        yield Pair(stack)


def test_a_publish_that_never_arrives_is_pulled_by_the_sweep_or_gossip(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.restart_with_fault(0, "peer.publish:error", monkeypatch)
    mine = pair.save_s1()  # committed on node 0, never published to node 1
    pair.wait("node1 adopting s1 from node0", lambda: pair.node1_copy() is not None, 60)
    assert pair.node1_copy() == mine
    # Whichever comes first: the sweep of unfinished saves, or the heal round's gossip.
    log = pair.nodes[1].log_tail(200)
    assert "adopted the manifest from n0" in log or "adopted 1 checkpoints by gossip" in log


def test_a_coordinator_killed_before_its_publish_publishes_on_restart(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.restart_with_fault(0, "commit.before_publish:kill", monkeypatch)
    with pytest.raises(Exception):  # noqa: B017 - the daemon dies mid-call
        pair.save_s1()
    mine = (pair.nodes[1].data_dir(NS, "s1") / MINE).read_bytes()
    pair.nodes[0].kill9()  # reap it
    # node1's sweeper asks about s1 once it is idle past ABANDON; node0 cannot answer.
    asked = f"did not say whether it knows {NS}/s1"
    pair.wait(
        "node1's sweeper asking node0 about s1",
        lambda: asked in pair.nodes[1].log_path.read_text(errors="replace"),
        60,
    )
    kept = pair.nodes[1].data_dir(NS, "s1") / MINE
    assert kept.exists() and kept.read_bytes() == mine, pair.nodes[1].log_tail(60)
    pair.nodes[0].start()
    pair.wait("node1 holding s1 after node0's restart", lambda: pair.node1_copy() is not None, 60)
    assert pair.node1_copy() == mine
    fresh = DaemonClient(pair.nodes[0].address, timeout_s=30)  # the old channel saw it die
    try:
        state = fresh.get_checkpoint(NS, "s1").state
    except Exception as e:
        raise AssertionError(pair.nodes[0].log_tail(80)) from e
    finally:
        fresh.close()
    assert state in ("COMMITTED", "REPLICATED")


def test_a_restart_keeps_an_unfinished_saves_file_its_coordinator_committed(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.restart_with_fault(0, "peer.publish:error", monkeypatch)
    mine = pair.save_s1()
    pair.nodes[1].kill9()  # idle for less than abandon_after: its sweeper has not asked
    pair.nodes[1].start()  # same memory dir: the file is an orphan until node0 is asked
    pair.wait("node1 installing its orphan of s1", lambda: pair.node1_copy() is not None, 60)
    assert pair.node1_copy() == mine
    assert "kept the file an unfinished save left here" in pair.nodes[1].log_tail(200)
