"""Order without clocks (audit 3, H6), through real daemons whose wall clock a test steps.

Each daemon runs with tests/support/skewed_clock on its PYTHONPATH: its `time.time()`
adds the seconds a file holds (re-read as it runs), as an NTP step or a resumed VM
shifts a node's clock. `time.monotonic()` is untouched.

- A clock stepped back an hour after two saves (`memory_keep_last = 2`): the next saves
  stay, and the newest is the newest save, not the one with the latest time (the audit
  saw each new save evicted right after COMMITTED, and "newest" go back to step-2).
- A node 10 minutes ahead: its checkpoints still reach its peer and replicate (the
  audit saw every publish refused, silently), and the peer reports the skew.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from tierckpt.daemon_client import DaemonClient

from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_ports
from tests.support.raw_rpc import raw_save

pytestmark = pytest.mark.integration

SKEWED_CLOCK = Path(__file__).resolve().parents[1] / "support" / "skewed_clock"
NS = "clockjob"


def _files(cid: str) -> dict[str, bytes]:
    return {".metadata": b"meta-" + cid.encode(), "__0_0.distcp": os.urandom(4096)}


def _skewable(monkeypatch: pytest.MonkeyPatch, offset: Path) -> None:
    """The next daemon started gets a wall clock `offset` steps (0 until written)."""
    offset.write_text("0")
    monkeypatch.setenv("TIERCKPT_TEST_CLOCK_FILE", str(offset))
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv(
        "PYTHONPATH", f"{SKEWED_CLOCK}{os.pathsep}{path}" if path else str(SKEWED_CLOCK)
    )


def _step(offset: Path, seconds: float) -> None:
    offset.write_text(repr(seconds))
    time.sleep(0.1)  # the daemon re-reads the offset at most every 20 ms


def _wait(what: str, check: Callable[[], bool], timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


@pytest.mark.timeout(120)
def test_a_clock_stepped_back_keeps_new_saves_and_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack
) -> None:
    offset = tmp_path / "offset"
    _skewable(monkeypatch, offset)
    daemon = DaemonProcess(
        {"memory": {"budget": "64MiB"}, "retention": {"memory_keep_last": 2}}, name="clock"
    )
    stack.callback(daemon.cleanup)
    client = DaemonClient(daemon.address, timeout_s=30)
    stack.callback(client.close)
    for cid in ("step-1", "step-2"):
        raw_save(client, NS, cid, _files(cid))
    before = client.get_checkpoint(NS, "step-2").committed_unix
    _step(offset, -3600.0)  # an NTP correction
    for cid in ("step-3", "step-4"):
        raw_save(client, NS, cid, _files(cid))
        listed = [c.checkpoint_id for c in client.list_checkpoints(NS)]
        assert cid in listed, (cid, listed, daemon.log_tail(20))
        assert client.get_checkpoint(NS).checkpoint_id == cid
        assert (daemon.data_dir(NS, cid) / "__0_0.distcp").is_file()
    # Retention kept the two newest by commit order: the saves after the step.
    assert [c.checkpoint_id for c in client.list_checkpoints(NS)] == ["step-3", "step-4"]
    # The clock did go back: time is shown as the node's clock says, never trusted.
    assert client.get_checkpoint(NS, "step-4").committed_unix < before
    # A restart keeps the order (sequences are in the manifests).
    daemon.terminate()
    daemon.start()
    client.close()
    client = DaemonClient(daemon.address, timeout_s=30)
    stack.callback(client.close)
    assert client.get_checkpoint(NS).checkpoint_id == "step-4"
    raw_save(client, NS, "step-5", _files("step-5"))
    assert [c.checkpoint_id for c in client.list_checkpoints(NS)] == ["step-4", "step-5"]


def _metric(url: str, sample: str) -> float | None:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    m = re.search(rf"^{re.escape(sample)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else None


def config(me: str, port: int, other: str, other_port: int) -> dict[str, object]:
    """One of two peered daemons (one extra copy, no background heal rounds)."""
    return {
        "node": {"id": me, "failure_domain": f"rack-{me}"},
        "listen": {"peer": f"127.0.0.1:{port}"},
        "memory": {"budget": "64MiB"},
        "replication": {"copies": 1, "heal_interval": 3600.0},
        "peers": [{"id": other, "address": f"127.0.0.1:{other_port}", "failure_domain": "r"}],
    }


@pytest.mark.timeout(150)
def test_a_node_ten_minutes_ahead_still_replicates_and_its_skew_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack
) -> None:
    port_a, port_b, metrics_a = free_ports(3)

    a_config = config("a", port_a, "b", port_b)
    a_config["metrics"] = {"listen": f"127.0.0.1:{metrics_a}"}
    a = DaemonProcess(a_config, name="a")
    stack.callback(a.cleanup)
    offset = tmp_path / "offset-b"
    _skewable(monkeypatch, offset)
    b = DaemonProcess(config("b", port_b, "a", port_a), name="b")
    stack.callback(b.cleanup)
    _step(offset, 600.0)  # b is 10 minutes ahead
    client_a = DaemonClient(a.address, timeout_s=30)
    stack.callback(client_a.close)
    client_b = DaemonClient(b.address, timeout_s=30)
    stack.callback(client_b.close)

    raw_save(client_b, NS, "step-1", _files("step-1"))
    assert client_b.get_checkpoint(NS, "step-1").committed_unix > time.time() + 500

    def on_a() -> bool:
        return any(c.checkpoint_id == "step-1" for c in client_a.list_checkpoints(NS))

    _wait("a listing b's step-1", on_a)
    info = client_a.get_checkpoint(NS)
    assert info.checkpoint_id == "step-1"
    assert info.committed_unix <= time.time() + 1  # shown at a's clock, not b's
    # Replicated: a holds a verified copy of every file b owns.
    _wait(
        "step-1 REPLICATED on b",
        lambda: client_b.get_checkpoint(NS, "step-1").state == "REPLICATED",
    )
    assert all(f.local_path for f in client_a.get_checkpoint(NS, "step-1").files)
    # The skew is measured and reported, loudly.
    skew = _metric(
        f"http://127.0.0.1:{metrics_a}/metrics", 'tierckpt_peer_clock_skew_seconds{peer="b"}'
    )
    assert skew is not None and 500 < skew < 700, skew
    assert "clock is" in a.log_tail(200) and "ahead of this node's" in a.log_tail(200)
    assert 500 < client_a.status().peer_clocks["b"] < 700  # and in `tierckpt status`
    # b's next save is the newest on both nodes (order is the sequence, not time).
    raw_save(client_a, NS + "-a", "x-1", _files("x-1"))  # a's own counter moves on
    raw_save(client_b, NS, "step-2", _files("step-2"))
    _wait(
        "a listing b's step-2",
        lambda: any(c.checkpoint_id == "step-2" for c in client_a.list_checkpoints(NS)),
    )
    assert client_a.get_checkpoint(NS).checkpoint_id == "step-2"
    assert client_b.get_checkpoint(NS).checkpoint_id == "step-2"


@pytest.mark.timeout(150)
def test_rm_on_a_node_ten_minutes_ahead_reaches_its_peer_and_a_resave_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack
) -> None:
    """Audit 3 H6(b): `rm` on a node 10 minutes ahead answered ok while its peer kept
    listing the checkpoint (the peer refused the mark's future stamp). The peer applies
    it, at its own clock: a save of the same id a little later (by the peer's clock,
    past `DELETE_SKEW`, long before the origin's stamp) is kept, also after a restart
    that re-applies the journal and learns the mark again (its clock corrected by then:
    the helper's offset is set only while the daemon runs)."""
    port_a, port_b = free_ports(2)

    offset_a, offset_b = tmp_path / "offset-a", tmp_path / "offset-b"
    _skewable(monkeypatch, offset_a)
    a = DaemonProcess(config("a", port_a, "b", port_b), name="a")
    stack.callback(a.cleanup)
    monkeypatch.setenv("TIERCKPT_TEST_CLOCK_FILE", str(offset_b))
    offset_b.write_text("0")
    b = DaemonProcess(config("b", port_b, "a", port_a), name="b")
    stack.callback(b.cleanup)
    _step(offset_b, 600.0)  # b is 10 minutes ahead
    client_a = DaemonClient(a.address, timeout_s=30)
    stack.callback(client_a.close)
    client_b = DaemonClient(b.address, timeout_s=30)
    stack.callback(client_b.close)

    def on_a() -> set[str]:
        return {c.checkpoint_id for c in client_a.list_checkpoints(NS)}

    raw_save(client_b, NS, "step-1", _files("step-1"))
    _wait("a listing b's step-1", lambda: "step-1" in on_a())
    client_b.delete_checkpoint(NS, "step-1")  # answers ok on b
    _wait("a applying b's rm of step-1", lambda: "step-1" not in on_a(), timeout=20)
    # A minute and a half later by a's clock (b is still 10 minutes ahead), the job saves
    # step-1 again: a takes it and keeps it, also across a restart.
    _step(offset_a, 90.0)
    _step(offset_b, 690.0)
    raw_save(client_b, NS, "step-1", _files("step-1"))
    _wait("a listing the re-saved step-1", lambda: "step-1" in on_a())
    # a restarts with its clock corrected (NTP): the tombstone stays where a first put it.
    monkeypatch.setenv("TIERCKPT_TEST_CLOCK_FILE", str(offset_a))
    a.terminate()
    offset_a.write_text("0")
    a.start()
    client_a.close()
    client_a = DaemonClient(a.address, timeout_s=30)
    stack.callback(client_a.close)
    # The journal's replay and the start-up pull (b's marks again) ran before "ready".
    assert "step-1" in on_a()
    assert client_a.get_checkpoint(NS).checkpoint_id == "step-1"
