"""Membership authenticates before it trusts (audit 3, H5), with real daemons.

A hostfile (or DNS) names addresses, not nodes: whoever answers `Hello` at one claims a
node id. node0's hostfile lists an impostor before the real node1:

- token only: the impostor is a bare gRPC server (it records every call and its
  metadata) that answers Hello as node1 without knowing the token. Hello proves the token
  by challenge-response, so the impostor never receives it; it cannot prove node1, so it
  is no member, and the real node1 gets the replica.
- mutual TLS (and the token, which an insider holds too): the insider is a real daemon
  configured as node1 whose CA-signed certificate names another node. node0 checks the
  server certificate against the id a Hello answers with, so the insider is no member and
  receives nothing; the real node1 gets the replica.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.v1 import peer_pb2, peer_pb2_grpc

from tests.support.certs import make_certs
from tests.support.daemon_process import DaemonProcess
from tests.support.peer_nodes import payload
from tests.support.ports import free_ports
from tests.support.raw_rpc import raw_save

pytestmark = pytest.mark.integration

NS = "identity"
TOKEN = "aWRlbnRpdHktdGVzdC10b2tlbi1ub3QtYS1zZWNyZXQ="


class Recorder(grpc.ServerInterceptor):  # type: ignore[misc]
    """Records the method and metadata of every call the fake server receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, str]]]] = []
        self.lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        metadata = [
            (k, v.decode("latin-1") if isinstance(v, bytes) else v)
            for k, v in details.invocation_metadata or ()
        ]
        with self.lock:
            self.calls.append((details.method, metadata))
        return continuation(details)

    def methods(self) -> list[str]:
        with self.lock:
            return [m.rsplit("/", 1)[-1] for m, _ in self.calls]

    def metadata(self) -> list[tuple[str, str]]:
        with self.lock:
            return [kv for _, md in self.calls for kv in md]


class Impostor(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    """Answers Hello as `claim` (and knows everyone); anything else is UNIMPLEMENTED."""

    def __init__(self, claim: str) -> None:
        self.claim = claim

    def Hello(self, request: peer_pb2.HelloRequest, context: Any) -> peer_pb2.HelloResponse:
        return peer_pb2.HelloResponse(node_id=self.claim, failure_domain="rack1", knows_caller=True)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _token(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return str(path)


def _daemon(
    stack: ExitStack,
    name: str,
    port: int,
    hostfile: Path | None,
    security: dict[str, str],
    **more: Any,
) -> DaemonProcess:
    config: dict[str, Any] = {
        "node": {"id": name, "failure_domain": f"rack-{name}"},
        "listen": {"peer": f"127.0.0.1:{port}"},
        "memory": {"budget": "128MiB"},
        "replication": {"copies": 2, "heal_interval": 1.0},
        "security": security,
        **more,
    }
    if hostfile is not None:
        config["membership"] = {"hostfile": str(hostfile), "refresh": 0.3}
    daemon = DaemonProcess(config, name=name, start=False)
    stack.callback(daemon.cleanup)
    return daemon


def _save_and_wait(daemon: DaemonProcess, checkpoint_id: str) -> list[str]:
    """Save one file on `daemon` and wait until it is REPLICATED; its replica nodes."""
    client = DaemonClient(daemon.address, timeout_s=30)
    try:
        raw_save(client, NS, checkpoint_id, {"__0_0.distcp": payload(7, 256 << 10)})
        deadline = time.monotonic() + 90.0
        state = "-"
        while time.monotonic() < deadline:
            rows = {r.checkpoint_id: r.state for r in client.list_checkpoints(NS)}
            state = rows.get(checkpoint_id, "-")
            if state == "REPLICATED":
                files = client.get_checkpoint(NS, checkpoint_id).files
                return sorted({n for f in files for n in f.replica_nodes})
            time.sleep(0.2)
        raise AssertionError(f"{checkpoint_id} is {state}\n{daemon.log_tail(40)}")
    finally:
        client.close()


def _wait_log(daemon: DaemonProcess, *texts: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = daemon.log_path.read_text()
        for line in log.splitlines():
            if all(t in line for t in texts):
                return line
        time.sleep(0.2)
    raise AssertionError(f"no log line with {texts}\n{daemon.log_tail(40)}")


def test_an_impostor_without_the_token_gets_no_token_and_no_node_id(
    stack: ExitStack, tmp_path: Path
) -> None:
    token = _token(tmp_path)
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[recorder])
    peer_pb2_grpc.add_PeerServiceServicer_to_server(Impostor("node1"), server)
    impostor = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    stack.callback(server.stop, 0)

    port0, port1 = free_ports(2)
    hosts0, hosts1 = tmp_path / "hosts0", tmp_path / "hosts1"
    hosts0.write_text(f"{impostor}\n127.0.0.1:{port1}\n")  # the impostor first
    hosts1.write_text(f"127.0.0.1:{port0}\n")
    node0 = _daemon(stack, "node0", port0, hosts0, {"token_file": token})
    node1 = _daemon(stack, "node1", port1, hosts1, {"token_file": token})
    for d in (node1, node0):
        d.start(timeout=120.0)

    # node0 said Hello to the impostor before it was ready: no token went with it.
    assert "Hello" in recorder.methods()
    assert "x-tierckpt-token" not in {k for k, _ in recorder.metadata()}
    assert _save_and_wait(node0, "step-1") == ["node1"]
    assert (node1.data_dir(NS, "step-1") / "__0_0.distcp").exists()  # the real node1
    line = _wait_log(node0, "WARNING", impostor, "node1")
    assert "not a member" in line and "token" in line
    # The impostor was asked who it is, and given nothing: no token, no call but Hello.
    sent = recorder.metadata()
    assert set(recorder.methods()) == {"Hello"}
    assert "x-tierckpt-token" not in {k for k, _ in sent}
    assert all(TOKEN not in v for _, v in sent)


def test_an_insider_cert_for_another_node_cannot_answer_as_node1(
    stack: ExitStack, tmp_path: Path
) -> None:
    certs = make_certs(tmp_path, ("node0", "node1"))
    token = _token(tmp_path)

    def security(pair: Any) -> dict[str, str]:
        return {"tls_cert": pair.cert, "tls_key": pair.key, "tls_ca": certs.ca, "token_file": token}

    port0, port1, port_insider = free_ports(3)
    hosts0, hosts1 = tmp_path / "hosts0", tmp_path / "hosts1"
    hosts0.write_text(f"127.0.0.1:{port_insider}\n127.0.0.1:{port1}\n")  # the insider first
    hosts1.write_text(f"127.0.0.1:{port0}\n")
    node0 = _daemon(stack, "node0", port0, hosts0, security(certs.node_a))
    node1 = _daemon(stack, "node1", port1, hosts1, security(certs.node_b))
    # A CA-signed cert naming "node-stranger", on a daemon that says it is node1 and
    # would take node0's pushes (node0 is its static peer).
    insider = _daemon(
        stack,
        "node1",
        port_insider,
        None,
        security(certs.stranger),
        peers=[{"id": "node0", "address": f"127.0.0.1:{port0}"}],
    )
    for d in (insider, node1, node0):
        d.start(timeout=120.0)

    assert _save_and_wait(node0, "step-1") == ["node1"]
    assert not insider.data_dir(NS).exists()  # no manifest, no replica
    assert (node1.data_dir(NS, "step-1") / "__0_0.distcp").exists()  # the real node1
    line = _wait_log(node0, "WARNING", f"127.0.0.1:{port_insider}", "node1")
    assert "not a member" in line and "certificate" in line


# ---- the rules, without daemons ------------------------------------------------------------


class Answers:
    """Hello answers by address, as a test changes them (an exception: no answer)."""

    def __init__(self) -> None:
        self.at: dict[str, tuple[str, str, bool] | Exception] = {}

    def hello(self, address: str, known: str) -> tuple[str, str, bool]:
        got = self.at.get(address, ConnectionRefusedError(f"nobody at {address}"))
        if isinstance(got, Exception):
            raise got
        return got


def _discoverer(tmp_path: Path, answers: Answers, lines: list[str]) -> Any:
    from tierckptd.peers.peer_discovery import Discoverer

    hostfile = tmp_path / "hosts"
    hostfile.write_text("\n".join(lines) + "\n")
    return Discoverer("me", hostfile=str(hostfile), hello=answers.hello, apply=lambda peers: None)


def _members(peers: list[Any]) -> dict[str, str]:
    return {p.id: p.address for p in peers}


def test_a_second_claimant_never_displaces_a_member_and_two_new_ones_take_neither(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tierckptd.peers.client import PeerCallError

    answers = Answers()
    d = _discoverer(tmp_path, answers, ["10.0.0.2:7070", "10.0.0.1:7070"])
    answers.at["10.0.0.1:7070"] = ("node1", "r1", True)
    assert _members(d.refresh()) == {"node1": "10.0.0.1:7070"}
    # A second address claims node1 (listed first): the member stays.
    answers.at["10.0.0.2:7070"] = ("node1", "r1", True)
    assert _members(d.refresh()) == {"node1": "10.0.0.1:7070"}
    assert "node id node1 is claimed at 10.0.0.1:7070 and 10.0.0.2:7070" in caplog.text
    # Two new claimants of an id no address holds yet: neither is taken.
    answers.at["10.0.0.3:7070"] = ("node2", "r2", True)
    answers.at["10.0.0.4:7070"] = ("node2", "r2", True)
    d.hostfile = str(tmp_path / "hosts2")
    (tmp_path / "hosts2").write_text("10.0.0.1:7070\n10.0.0.3:7070\n10.0.0.4:7070\n")
    assert _members(d.refresh()) == {"node1": "10.0.0.1:7070"}
    assert "keeping none of them" in caplog.text
    # The member's address stops proving its id: it loses what it proved before.
    answers.at["10.0.0.1:7070"] = PeerCallError("10.0.0.1:7070", "Hello", "NOT_PROVEN", "no")
    assert _members(d.refresh()) == {}
    assert "the daemon at 10.0.0.1:7070 is not a member" in caplog.text


def test_stranger_hellos_wake_discovery_within_the_rate_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierckptd.config import PeerConfig
    from tierckptd.peers import membership as m

    now = [1000.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    members = m.Membership("me", peers=[PeerConfig("peer", "127.0.0.1:1", "r")])
    woken: list[str] = []
    members.strangers.add(woken.append)
    members.stranger("peer")  # a member: no round
    members.stranger("me")
    for i in range(100):  # a flood within one second
        members.stranger(f"s{i % 3}")
    assert woken == ["s0"]
    now[0] += m.STRANGER_GAP
    members.stranger("s0")  # its back-off (10 s) has not passed
    members.stranger("s1")
    assert woken == ["s0", "s1"]
    now[0] += m.STRANGER_BACKOFF
    members.stranger("s0")
    assert woken == ["s0", "s1", "s0"]
    now[0] += m.STRANGER_GAP
    members.stranger("s0")  # back-off doubled to 20 s
    assert woken == ["s0", "s1", "s0"]
