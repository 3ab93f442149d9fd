"""Membership from the platform with real daemons (issue 13): nodes given only addresses
(a hostfile, or DNS through the system resolver) learn each other's ids by Hello over
the token-guarded peer port; a node added to the file joins and is replicated to at once
(heal_interval is an hour: only the join's heal can do it), one removed leaves, a daemon
with the wrong token never becomes a member, and a replacement under a new name learns
and restores the checkpoints; no SIGHUP anywhere.

Replication is checked in the owner's view (it pushes and records the copies); another
node's replica lists settle at its next heal round."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from tierckpt.daemon_client import DaemonClient

from tests.support.daemon_process import DaemonProcess, toml_document
from tests.support.peer_nodes import payload
from tests.support.ports import free_ports
from tests.support.raw_rpc import save_ranks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

NS = "member"
TOKEN = "c2hhcmVkLWNsdXN0ZXItdG9rZW4tZm9yLXRlc3Rz"


class Fleet:
    """Daemons m0..m{n-1} on loopback whose only peer source is one hostfile."""

    def __init__(self, stack: ExitStack, tmp_path: Path, n: int, copies: int = 3) -> None:
        self.hostfile = tmp_path / "hosts"
        self.ports = free_ports(n)
        token = tmp_path / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        wrong = tmp_path / "wrong-token"
        wrong.write_text(TOKEN[::-1])
        wrong.chmod(0o600)
        self.nodes: list[DaemonProcess] = []
        for i, port in enumerate(self.ports):
            config: dict[str, Any] = {
                "node": {"id": f"m{i}", "failure_domain": f"rack{i}"},
                "listen": {"peer": f"127.0.0.1:{port}"},
                "memory": {"budget": "128MiB"},
                "membership": {"hostfile": str(self.hostfile), "refresh": 0.3},
                "replication": {"copies": copies, "heal_interval": 3600.0},
                "security": {"token_file": str(token)},
            }
            daemon = DaemonProcess(config, name=f"m{i}", start=False)
            stack.callback(daemon.cleanup)
            self.nodes.append(daemon)
        self.wrong_token = str(wrong)
        self.clients: dict[int, DaemonClient] = {}
        stack.callback(lambda: [c.close() for c in self.clients.values()])

    def write_hostfile(self, members: list[int]) -> None:
        lines = ["# tierckpt peers, one address per line", "not a line::", "../evil 1.2.3.4:1"]
        lines += [f"127.0.0.1:{self.ports[i]}" for i in members]
        tmp = self.hostfile.with_suffix(".new")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.hostfile)  # readers see the old file or the new one

    def start(self, *indices: int) -> None:
        with futures.ThreadPoolExecutor(len(indices)) as pool:
            list(pool.map(lambda i: self.nodes[i].start(timeout=120.0), indices))
        for i in indices:
            self.clients[i] = DaemonClient(self.nodes[i].address, timeout_s=30)

    def save(self, checkpoint_id: str, files: dict[int, dict[str, bytes]]) -> None:
        """Node i's rank i writes files[i]; m0 coordinates."""
        save_ranks(self.clients, NS, checkpoint_id, files)

    def state(self, i: int, checkpoint_id: str) -> str:
        rows = {r.checkpoint_id: r.state for r in self.clients[i].list_checkpoints(NS)}
        return rows.get(checkpoint_id, "-")

    def wait(self, what: str, check: Any, timeout: float = 90.0) -> None:
        wait_until(what, check, timeout, details=self.log_tails)

    def log_tails(self) -> str:
        return "\n".join(self.nodes[i].log_tail(30) for i in self.clients)

    def wait_replicated(self, checkpoint_id: str, on: list[int]) -> None:
        seen: dict[int, str] = {}

        def replicated() -> bool:
            seen.update({i: self.state(i, checkpoint_id) for i in on})
            return all(s == "REPLICATED" for s in seen.values())

        try:
            self.wait(f"{checkpoint_id} REPLICATED on {on}", replicated)
        except AssertionError as e:
            files = {i: self.clients[i].get_checkpoint(NS, checkpoint_id).files for i in on}
            shown = {
                i: [(f.name, f.owner_node, f.replica_nodes) for f in fs] for i, fs in files.items()
            }
            raise AssertionError(f"states {seen}, files {shown}\n{e}") from None

    def wait_log(self, i: int, text: str) -> None:
        self.wait(f"{text!r} in m{i}'s log", lambda: text in self.nodes[i].log_path.read_text())


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture
def fleet(stack: ExitStack, tmp_path: Path) -> Fleet:
    return Fleet(stack, tmp_path, 5)


def test_hostfile_members_join_replicate_and_leave_without_sighup(fleet: Fleet) -> None:
    # m4 is listed from the start but holds the wrong token: Hello fails both ways.
    fleet.nodes[4].config["security"]["token_file"] = fleet.wrong_token
    fleet.nodes[4].config_path.write_text(toml_document(fleet.nodes[4].config))
    fleet.write_hostfile([0, 1, 2, 4])
    fleet.start(0, 1, 2, 4)
    for i in (0, 1, 2):
        others = ", ".join(f"m{j}" for j in (0, 1, 2) if j != i)
        fleet.wait_log(i, f"membership: 2 peers ({others}), 2 extra copies per file")
    fleet.save("step-1", {0: {"__0_0.distcp": payload(1, 300_000), ".metadata": b"m" * 99}})
    fleet.wait_replicated("step-1", [0])  # the owner's view: it pushes and records
    assert fleet.state(4, "step-1") == "-"  # never a member: nothing published to it

    # A join: m3's address is added to the file, m3 starts. It takes the third extra
    # copy of step-1 (copies = 3 now fits), with no heal round due for an hour.
    fleet.write_hostfile([0, 1, 2, 3, 4])
    fleet.start(3)
    fleet.wait_log(0, "peers joined: m3; healing every checkpoint now")
    fleet.wait(
        "m0 recording a copy of every step-1 file on m3",
        lambda: all(
            "m3" in f.replica_nodes for f in fleet.clients[0].get_checkpoint(NS, "step-1").files
        ),
    )
    for f in fleet.clients[3].get_checkpoint(NS, "step-1").files:
        assert f.local_path, f"m3 holds no copy of {f.name}"
    # m3 is a member of m0's cluster: a save with a rank on m3 commits and replicates.
    fleet.save("step-2", {0: {".metadata": b"n" * 50}, 3: {"__1_0.distcp": payload(2, 9000)}})
    fleet.wait_replicated("step-2", [0])

    # A leave: m2's line goes (m2 keeps running); the others stop publishing to it.
    fleet.write_hostfile([0, 1, 3, 4])
    fleet.wait_log(0, "membership: 2 peers (m1, m3), 2 extra copies per file")
    fleet.save("step-3", {0: {"__0_0.distcp": payload(3, 5000), ".metadata": b"o" * 9}})
    fleet.wait_replicated("step-3", [0])
    assert fleet.state(2, "step-3") == "-"
    assert "m4" not in _membership_lines(fleet.nodes[0])


def _membership_lines(daemon: DaemonProcess) -> str:
    return "\n".join(
        line for line in daemon.log_path.read_text().splitlines() if "membership: " in line
    )


def test_a_replacement_with_a_new_id_learns_the_checkpoints_and_restores_them(
    stack: ExitStack, tmp_path: Path
) -> None:
    """A replacement node comes up under a new name (a new Kubernetes node): its peers
    refuse it until they have learnt it from the hostfile; once they answer Hello as
    knowing it, it pulls their manifests, lists the checkpoint it holds no copy of and
    restores a file of it from a peer."""
    fleet = Fleet(stack, tmp_path, 3, copies=1)
    fleet.write_hostfile([0, 1])
    fleet.start(0, 1)
    data = payload(4, 200_000)
    fleet.save("step-1", {0: {"__0_0.distcp": data, ".metadata": b"m" * 40}})
    fleet.wait_replicated("step-1", [0])
    fleet.write_hostfile([0, 1, 2])
    fleet.start(2)
    fleet.wait("m2 lists step-1", lambda: fleet.state(2, "step-1") != "-")
    restored = fleet.clients[2].ensure_local(NS, "step-1", "__0_0.distcp")
    assert Path(restored.local_path).read_bytes() == data


def test_dns_discovery_through_the_system_resolver(stack: ExitStack, tmp_path: Path) -> None:
    """`[membership] dns` resolved by getaddrinfo for real: each of two daemons finds the
    other as "localhost" at the other's port (an AAAA answer no one listens on is
    skipped), learns its id by Hello, and a save replicates between them."""
    fleet = Fleet(stack, tmp_path, 2, copies=1)
    for i, daemon in enumerate(fleet.nodes):
        daemon.config["membership"] = {"dns": "localhost", "port": fleet.ports[1 - i]}
        daemon.config_path.write_text(toml_document(daemon.config))
    fleet.start(0, 1)
    fleet.wait_log(0, "membership: 1 peers (m1), 1 extra copies per file")
    fleet.save("step-1", {0: {"__0_0.distcp": payload(5, 70_000), ".metadata": b"d" * 30}})
    fleet.wait_replicated("step-1", [0])
    assert all(f.local_path for f in fleet.clients[1].get_checkpoint(NS, "step-1").files)
