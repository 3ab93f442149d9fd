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
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.memory_files import ChecksummingWriter

from tests.support.cluster import LocalCluster

pytestmark = pytest.mark.integration

NS = "unfinished"
ABANDON = 3.0  # node1's abandon_after: its sweeper (every 5 s) asks soon; kept 4x as long


class Pair(LocalCluster):
    def __init__(self, stack: ExitStack) -> None:
        super().__init__(
            stack,
            2,
            namespace=NS,
            copies=1,
            heal_interval=1.0,
            id_prefix="u",
            overrides={"memory": {"abandon_after": ABANDON}},
        )
        self.stack = stack

    def client(self, i: int) -> DaemonClient:
        c = DaemonClient(self.nodes[i].address, timeout_s=30)
        self.stack.callback(c.close)
        return c

    def restart_with_fault(self, i: int, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.nodes[i].terminate()
        with monkeypatch.context() as m:
            m.setenv("TIERCKPT_FAULT", fault)
            self.nodes[i].start()

    def write(self, i: int, checkpoint_id: str, name: str, data: bytes) -> None:
        c = self.client(i)
        c.begin_checkpoint(NS, checkpoint_id, i)
        c.reserve_space(NS, checkpoint_id, i, len(data))
        opened = c.open_file(NS, checkpoint_id, name, i)
        fd = os.open(opened.path, os.O_WRONLY)
        try:
            writer = ChecksummingWriter(fd)
            writer.write(data)
            size, checksums = writer.finish()
        finally:
            os.close(fd)
        c.commit_file(NS, checkpoint_id, name, i, size, checksums)

    def node1_copy(self, checkpoint_id: str) -> bytes | None:
        """node1's bytes of its file when it lists the checkpoint committed."""
        try:
            info = self.client(1).get_checkpoint(NS, checkpoint_id)
        except Exception:
            return None
        if info.state not in ("COMMITTED", "REPLICATED"):
            return None
        path = {f.name: f.local_path for f in info.files}.get("__1_0.distcp", "")
        return open(path, "rb").read() if path else None

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                logs = "\n".join(d.log_tail(40) for d in self.nodes)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.3)


@pytest.fixture
def pair() -> Iterator[Pair]:
    with ExitStack() as stack:
        yield Pair(stack)


def _save_files(pair: Pair, checkpoint_id: str) -> tuple[bytes, bytes]:
    mine, theirs = os.urandom(300_000), os.urandom(200_000)
    pair.write(0, checkpoint_id, "__0_0.distcp", theirs)
    pair.write(1, checkpoint_id, "__1_0.distcp", mine)
    pair.write(0, checkpoint_id, ".metadata", b"m" * 100)
    return mine, theirs


REQUIRED = ["__0_0.distcp", "__1_0.distcp", ".metadata"]


def test_a_publish_that_never_arrives_is_pulled_by_the_sweep(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.restart_with_fault(0, "peer.publish:error", monkeypatch)
    mine, _ = _save_files(pair, "s1")
    assert pair.client(0).commit_checkpoint(NS, "s1", REQUIRED).state == "COMMITTED"
    pair.wait("node1 adopting s1 from node0", lambda: pair.node1_copy("s1") is not None)
    assert pair.node1_copy("s1") == mine
    assert "adopted the manifest from u0" in pair.nodes[1].log_tail(200)


def test_a_coordinator_killed_before_its_publish_publishes_on_restart(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.restart_with_fault(0, "commit.before_publish:kill", monkeypatch)
    mine, _ = _save_files(pair, "s1")
    with pytest.raises(Exception):  # noqa: B017 - the daemon dies mid-call
        pair.client(0).commit_checkpoint(NS, "s1", REQUIRED)
    pair.nodes[0].kill9()  # reap it
    time.sleep(ABANDON + 5)  # node1's sweeper asked while node0 was down: kept
    kept = pair.nodes[1].data_dir(NS, "s1") / "__1_0.distcp"
    assert kept.exists() and kept.read_bytes() == mine, pair.nodes[1].log_tail(60)
    pair.nodes[0].start()
    pair.wait("node1 holding s1 after node0's restart", lambda: pair.node1_copy("s1") is not None)
    assert pair.node1_copy("s1") == mine
    try:
        state = pair.client(0).get_checkpoint(NS, "s1").state
    except Exception as e:
        raise AssertionError(pair.nodes[0].log_tail(80)) from e
    assert state in ("COMMITTED", "REPLICATED")


def test_a_restart_keeps_an_unfinished_saves_file_its_coordinator_committed(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.restart_with_fault(0, "peer.publish:error", monkeypatch)
    mine, _ = _save_files(pair, "s1")
    assert pair.client(0).commit_checkpoint(NS, "s1", REQUIRED).state == "COMMITTED"
    pair.nodes[1].kill9()  # idle for less than abandon_after: its sweeper has not asked
    pair.nodes[1].start()  # same memory dir: the file is an orphan until node0 is asked
    pair.wait("node1 installing its orphan of s1", lambda: pair.node1_copy("s1") is not None)
    assert pair.node1_copy("s1") == mine
    assert "kept the file an unfinished save left here" in pair.nodes[1].log_tail(200)
