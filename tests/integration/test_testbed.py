"""The multi-host testbed (issue 28 point 1) with real daemons: three tierckptd nodes, each
in its own network namespace with its own address on one bridge, ranks in their node's
namespace. With `copies = 1` a save's replica reaches its buddy over the bridge; with the
owner's cable pulled, a restore on another node is served by the buddy, bit-exact; a link
shaped by a token bucket makes replication take at least size / rate; and a testbed,
closed or killed with SIGKILL, leaves no namespace, link or bridge behind.

Skipped (with the reason) where network namespaces cannot be made: not root, no
iproute2. `TIERCKPT_REQUIRE_TESTBED=1` turns that skip into a failure (for CI).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.support import jobs
from tests.support.backends import Nodes
from tests.support.cli import ls_json
from tests.support.netns_cluster import NetnsCluster
from tests.support.netns_job import run_ranks
from tests.support.peer_nodes import payload
from tests.support.testbed import (
    TbfShape,
    Testbed,
    TestbedUnavailable,
    leftovers,
    sweep_stale,
    unavailable_reason,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

NS = "netbed"
REQUIRE_ENV = "TIERCKPT_REQUIRE_TESTBED"
ROOT = Path(__file__).resolve().parents[2]


def _unavailable(reason: str) -> None:
    message = f"multi-host testbed unavailable: {reason}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    reason = unavailable_reason()
    if reason is not None:
        _unavailable(reason)
    try:
        testbed = Testbed(3)
    except TestbedUnavailable as exc:
        _unavailable(str(exc))
    try:
        yield testbed
    finally:
        testbed.close()
    assert leftovers(testbed.run) == [], "the testbed left namespaces or links behind"


@pytest.fixture(scope="module")
def cluster(bed: Testbed) -> Iterator[NetnsCluster]:
    with ExitStack() as stack:
        yield NetnsCluster(stack, bed, namespace=NS, copies=1)


def test_replica_crosses_the_bridge_and_serves_a_restore_while_the_owner_is_cut(
    bed: Testbed, cluster: NetnsCluster, tmp_path: Path
) -> None:
    n0, n1, _ = bed.nodes
    sent_before, _ = bed.port_bytes(n0)
    # Two gloo ranks, one in n0's namespace and one in n1's, collectives over the bridge.
    save = Nodes(NS, (cluster.nodes[0].address, cluster.nodes[1].address), 1)
    run_ranks(jobs.save_only, [n0, n1], save, ["step-1"], str(tmp_path), 11, timeout=90)
    cluster.wait_state("step-1", "REPLICATED", timeout=30)
    for daemon in cluster.nodes:  # what an operator sees, on every node
        rows = {r["id"]: r["state"] for r in ls_json(daemon.address, NS)}
        assert rows == {"step-1": "REPLICATED"}, f"{daemon.name}: {rows}"

    holders = cluster.holders("step-1")
    owned = sorted(name for name, (owner, *_) in holders.items() if owner == "n0")
    assert owned, f"n0 owns no file of step-1: {holders}"
    buddies = {name: holders[name][1:] for name in owned}
    assert all(len(b) == 1 and b[0] != "n0" for b in buddies.values()), buddies
    buddy = int(buddies[owned[0]][0][1:])
    n0_files = cluster.clients[0].get_checkpoint(NS, "step-1")
    buddy_files = cluster.clients[buddy].get_checkpoint(NS, "step-1")
    owned_bytes = 0
    for name in owned:
        assert buddies[name] == (f"n{buddy}",), f"{name} is on {buddies[name]}, not n{buddy}"
        local = buddy_files.file(name).local_path
        assert local, f"n{buddy} lists {name} as its replica but holds no copy"
        assert Path(local).read_bytes() == Path(n0_files.file(name).local_path).read_bytes()
        owned_bytes += buddy_files.file(name).size
    sent_after, _ = bed.port_bytes(n0)
    assert sent_after - sent_before >= owned_bytes, (
        f"n0 sent {sent_after - sent_before} bytes through its bridge port, less than the "
        f"{owned_bytes} bytes of its replicas"
    )

    # n0's cable is pulled: its daemon lives on, unreachable. Rank 0 restores on the node
    # that is neither n0 nor the buddy, so n0's files must come over the bridge from the buddy.
    other = bed.nodes[({1, 2} - {buddy}).pop()]
    buddy_sent_before, _ = bed.port_bytes(bed.nodes[buddy])
    load = Nodes(NS, (cluster.nodes[other.index].address, cluster.nodes[1].address), 1)
    with bed.cut_node(n0):
        started = time.monotonic()
        results = run_ranks(
            jobs.load_and_verify, [other, n1], load, "step-1", str(tmp_path / "step-1"),
            timeout=90,
        )  # fmt: skip
        elapsed = time.monotonic() - started
    assert [r["world"] for r in results] == [2, 2]
    buddy_sent, _ = bed.port_bytes(bed.nodes[buddy])
    assert buddy_sent - buddy_sent_before >= owned_bytes, "the buddy did not serve n0's files"
    print(
        f"restore with the owner cut: {elapsed:.1f} s (n0's files from n{buddy} on n{other.index})"
    )


def test_a_slow_link_bounds_replication_by_its_rate(bed: Testbed, cluster: NetnsCluster) -> None:
    n0 = bed.nodes[0]
    size = 12 << 20
    shape = TbfShape(rate=50_000_000 // 8)  # 50 Mbit/s
    timings = {}
    for label, checkpoint_id in (("veth", "fast-1"), ("tbf 50mbit", "slow-1")):
        files = {"__0_0.distcp": payload(len(label), size), ".metadata": b"meta-" + label.encode()}
        sent_before, _ = bed.port_bytes(n0)
        with ExitStack() as stack:
            if label != "veth":
                stack.enter_context(bed.slow_link(n0, shape))
            started = time.monotonic()
            cluster.raw_save(0, checkpoint_id, files)
            wait_until(
                f"{checkpoint_id} REPLICATED on n0",
                lambda c=checkpoint_id: _state(cluster, c) == "REPLICATED",
                60,
                interval=0.02,
            )
            timings[label] = time.monotonic() - started
        sent, _ = bed.port_bytes(n0)
        assert sent - sent_before >= size, f"{label}: the replica did not leave n0 by its port"
    print(f"replication of {size >> 20} MiB: {timings}")
    assert timings["tbf 50mbit"] >= shape.min_seconds(size), timings
    # n0's metrics, served on its bridge address and read from inside its namespace.
    pushed = [
        float(line.split()[1])
        for line in cluster.metrics(0).splitlines()
        if line.startswith("tierckpt_replicated_bytes_total ")
    ]
    assert pushed and pushed[0] >= 2 * size, pushed


def _state(cluster: NetnsCluster, checkpoint_id: str) -> str | None:
    """The checkpoint's state on n0 (through its client: polled often, unlike the CLI)."""
    rows = cluster.clients[0].list_checkpoints(NS)
    return next((r.state for r in rows if r.checkpoint_id == checkpoint_id), None)


# A probe agent per node: a TCP server answering "pong" to every connection, and a UDP
# port whose datagrams it appends to a file (one-way reachability, which TCP cannot show).
_AGENT = """
import socket, sys, threading
address, log = sys.argv[1], sys.argv[2]
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((address, 9501))
    while True:
        data, _ = s.recvfrom(64)
        with open(log, "ab") as f:
            f.write(data + b"\\n")
threading.Thread(target=udp, daemon=True).start()
server = socket.create_server((address, 9500))
while True:
    conn, _ = server.accept()
    conn.sendall(b"pong")
    conn.close()
"""
_PING = """
import socket, sys, threading
answers = {}
def ping(address):
    try:
        with socket.create_connection((address, 9500), timeout=0.5) as s:
            s.settimeout(0.5)
            answers[address] = "ok" if s.recv(4) == b"pong" else "bad"
    except OSError as exc:
        answers[address] = type(exc).__name__
threads = [threading.Thread(target=ping, args=(a,)) for a in sys.argv[1:]]
[t.start() for t in threads]
[t.join() for t in threads]
print(" ".join(answers[a] for a in sys.argv[1:]))
"""
_PY = [sys.executable, "-I", "-S"]  # probes need only the stdlib: start them fast
_SEND = """
import socket, sys
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(sys.argv[2].encode(), (sys.argv[1], 9501))
"""


def test_each_fault_cuts_what_it_says_and_heals(bed: Testbed, tmp_path: Path) -> None:
    n0, n1, n2 = bed.nodes
    agents = [
        subprocess.Popen(
            n.exec_argv([*_PY, "-c", _AGENT, n.address, str(tmp_path / f"udp{n.index}")]),
            start_new_session=True,
        )
        for n in bed.nodes
    ]
    try:

        def pings(src: int, dsts: list[int]) -> list[str]:
            """What node `src` gets from each agent of `dsts`: "ok", or the error's name."""
            argv = [*_PY, "-c", _PING, *(bed.nodes[d].address for d in dsts)]
            return bed.run_in(bed.nodes[src], argv).stdout.split()

        def ping(src: int, dst: int) -> str:
            return pings(src, [dst])[0]

        def reach() -> dict[tuple[int, int], bool]:
            """For every ordered pair of nodes, whether a TCP exchange between them works."""
            out = {}
            for a in range(3):
                others = [b for b in range(3) if b != a]
                out.update(
                    {(a, b): r == "ok" for b, r in zip(others, pings(a, others), strict=True)}
                )
            return out

        everywhere = dict.fromkeys(reach(), True)
        wait_until("every agent answers", lambda: reach() == everywhere, 15)

        with bed.cut_node(n1):
            assert reach() == {
                **everywhere,
                (0, 1): False,
                (1, 0): False,
                (1, 2): False,
                (2, 1): False,
            }
        assert reach() == everywhere

        with bed.cut_between([n0], [n1]):  # n2 still reaches both sides
            assert reach() == {**everywhere, (0, 1): False, (1, 0): False}
        assert reach() == everywhere

        with bed.cut_one_way([n0], [n1]):  # n0's packets to n1 are lost, n1's arrive
            for src, dst in ((0, 1), (1, 0)):
                bed.run_in(
                    bed.nodes[src],
                    [*_PY, "-c", _SEND, bed.nodes[dst].address, f"from{src}"],
                )
            wait_until("n1's datagram reaches n0", lambda: b"from1" in _read(tmp_path / "udp0"), 5)
            assert b"from0" not in _read(tmp_path / "udp1")
            # TCP needs both ways: no exchange between them, every other pair unharmed.
            assert reach() == {**everywhere, (0, 1): False, (1, 0): False}
        assert reach() == everywhere

        with bed.freeze(agents[2].pid):  # connects are accepted, nothing is answered
            assert ping(0, 2) == "TimeoutError"
        assert ping(0, 2) == "ok"

        flap = bed.flap(n2, 0.2, 0.2)
        wait_until("two flaps", lambda: flap.cycles >= 2, 10)
        flap.heal()
        assert Path("/sys/class/net", n2.port, "operstate").read_text().strip() == "up"
        assert ping(0, 2) == "ok"  # healed means carrying traffic, ARP included
        assert bed.faults == []
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def test_a_killed_testbed_is_swept_and_a_closed_one_leaves_nothing() -> None:
    reason = unavailable_reason()
    if reason is not None:
        _unavailable(reason)
    # A testbed whose owner is SIGKILLed, with a process still running in its namespace.
    code = (
        "import subprocess, sys, time\n"
        "from tests.support.testbed import Testbed\n"
        "bed = Testbed(2)\n"
        "sleeper = subprocess.Popen(bed.nodes[0].exec_argv(['sleep', '600']))\n"
        "print(bed.run, sleeper.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        run, sleeper = owner.stdout.readline().split()
    finally:
        owner.kill()
        owner.wait()
    stale = leftovers(run)
    assert len(stale) == 5, stale  # two namespaces, two bridge ports, the bridge
    assert _alive(int(sleeper))
    assert set(stale) <= set(sweep_stale())
    assert leftovers(run) == []
    wait_until("the sleeper in the stale namespace is killed", lambda: not _alive(int(sleeper)), 10)

    # Closed with faults in force: everything healed and removed.
    with Testbed(2, racks=["a", "b"]) as bed:
        frozen = subprocess.Popen(bed.nodes[1].exec_argv(["sleep", "600"]), start_new_session=True)
        bed.cut_node(bed.nodes[0])
        bed.cut_rack("a", "b")
        bed.freeze(frozen.pid)
        bed.slow_link(bed.nodes[1], TbfShape(rate=1 << 20))
        assert len(bed.faults) == 4
    assert leftovers(bed.run) == []
    frozen.wait(timeout=10)
    assert frozen.returncode == -signal.SIGKILL


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_without_iproute2_the_testbed_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `ip`, no `tc`
    expected = "need root" if os.geteuid() != 0 else "`ip` (iproute2) is not on PATH"
    assert expected in (unavailable_reason() or "")
    with pytest.raises(TestbedUnavailable, match=re.escape(expected)):
        Testbed(1)
