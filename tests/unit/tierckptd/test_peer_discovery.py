"""Membership from the platform: hostfile parsing (hostile lines included), DNS through an
injected resolver, the discoverer's precedence, dedupe, bounds and last-good answers,
and where [node] id and failure domain come from. The same paths with real daemons
are in tests/integration/test_membership.py."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.v1 import common_pb2, peer_pb2
from tierckptd.config import ConfigError, PeerConfig, parse_config
from tierckptd.config_checks import ENV_FAILURE_DOMAIN, ENV_NODE_ID, peer_port
from tierckptd.peers.chunk_wire import PeerStub
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.peer_discovery import (
    MAX_HOSTFILE_BYTES,
    MAX_LINE,
    MAX_MEMBERS,
    Discoverer,
    SourceError,
    check_address,
    parse_hostfile,
    read_hostfile,
    resolve_dns,
)
from tierckptd.peers.security import node_client_interceptor
from tierckptd.restore import Restorer, no_sources
from tierckptd.rpc.health import Health
from tierckptd.rpc.peer_service import add_peer_service
from tierckptd.rpc.servers import start_servers

from tests.support.daemon_parts import daemon_service

from .conftest import MakeCatalog

# --- hostfile -----------------------------------------------------------------------------


def test_hostfile_lines_and_comments() -> None:
    text = """
# the cluster
10.0.0.1:7070
node-b 10.0.0.2:7070            # named, so no Hello is needed
node-c NODE-C.example:7070 rack-2
  [fd00::1]:7070
"""
    entries, problems = parse_hostfile(text)
    assert problems == []
    assert [(e.address, e.node_id, e.failure_domain) for e in entries] == [
        ("10.0.0.1:7070", "", ""),
        ("10.0.0.2:7070", "node-b", ""),
        ("node-c.example:7070", "node-c", "rack-2"),
        ("[fd00::1]:7070", "", ""),
    ]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("10.0.0.1", "port"),
        ("10.0.0.1:0", "port"),
        ("10.0.0.1:70000", "port"),
        ("10.0.0.1:http", "port"),
        ("host:", "port"),
        ("[fd00::1:7070", "neither an IP nor a host name"),
        ("[not-v6]:7070", "not an IPv6"),
        ("bad_host!:7070", "neither an IP nor a host name"),
        ("ünïcode.example:7070", "neither an IP nor a host name"),
        ("-lead.example:7070", "neither an IP nor a host name"),
        ("../etc 10.0.0.1:7070", "node id"),
        ("a 10.0.0.1:7070 b c", "expected"),
        ("node 10.0.0.1:7070 r\x00ck", "failure domain"),
        ("x" * 200 + " 10.0.0.1:7070", "node id"),
        ("n " + "a" * (MAX_LINE + 1) + ":1", "longer than"),
    ],
)
def test_a_hostile_line_is_skipped_naming_its_number(line: str, why: str) -> None:
    entries, problems = parse_hostfile(f"10.0.0.9:1\n{line}\n10.0.0.8:1\n", "hf")
    assert [e.address for e in entries] == ["10.0.0.9:1", "10.0.0.8:1"]
    assert len(problems) == 1
    assert problems[0].startswith("hf line 2:") and why in problems[0]


def test_hostfile_keeps_at_most_max_members() -> None:
    text = "\n".join(
        f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7070" for i in range(MAX_MEMBERS + 5)
    )
    entries, problems = parse_hostfile(text)
    assert len(entries) == MAX_MEMBERS
    assert any(f"more than {MAX_MEMBERS}" in p for p in problems)


def test_unreadable_oversized_or_binary_hostfile_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="hostfile .*missing"):
        read_hostfile(str(tmp_path / "missing"))
    big = tmp_path / "big"
    big.write_bytes(b"#" * (MAX_HOSTFILE_BYTES + 1))
    with pytest.raises(SourceError, match="larger than"):
        read_hostfile(str(big))
    bad = tmp_path / "bad"
    bad.write_text("10.0.0.1:7070\nnonsense\n")
    assert read_hostfile(str(bad))[0][0].address == "10.0.0.1:7070"
    binary = tmp_path / "bin"
    binary.write_bytes(b"10.0.0.1:7070\n\xff\xfe\n")
    with pytest.raises(SourceError, match="not UTF-8"):
        read_hostfile(str(binary))


def test_check_address_normalizes() -> None:
    assert check_address(" Host.Example:07070 ") == "host.example:7070"
    assert check_address("[FD00:0::1]:1") == "[fd00::1]:1"
    with pytest.raises(ValueError, match="too long"):
        check_address("a" * 300 + ":1")


# --- DNS ----------------------------------------------------------------------------------


def _resolver(answers: list[tuple[Any, ...]]) -> Any:
    def resolve(name: str, port: int, **kwargs: Any) -> list[tuple[Any, ...]]:
        assert kwargs == {"type": socket.SOCK_STREAM}
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", sockaddr) for sockaddr in answers]

    return resolve


def test_dns_records_become_addresses_deduplicated_and_validated() -> None:
    resolver = _resolver(
        [
            ("10.0.0.2", 7070),
            ("10.0.0.1", 7070),
            ("10.0.0.2", 7070),
            ("fe80::1%eth0", 7070, 0, 2),
            ("not-an-ip", 7070),
            (),
        ]
    )
    assert resolve_dns("svc.example", 7070, resolver) == [
        "10.0.0.1:7070",
        "10.0.0.2:7070",
        "[fe80::1]:7070",
    ]


def test_dns_answer_is_bounded() -> None:
    many = [(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 1) for i in range(MAX_MEMBERS + 3)]
    assert len(resolve_dns("svc.example", 1, _resolver(many))) == MAX_MEMBERS


def test_dns_failure_is_a_source_error() -> None:
    def fail(*args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(SourceError, match="svc.example"):
        resolve_dns("svc.example", 1, fail)


# --- the discoverer -----------------------------------------------------------------------


class World:
    """The sources and the daemons answering Hello, as a test changes them."""

    def __init__(self, tmp_path: Path) -> None:
        self.hostfile = tmp_path / "hosts"
        self.hostfile.write_text("")
        self.dns: list[str] | None = []  # None: the resolver fails
        self.identity: dict[str, tuple[str, str]] = {}  # address -> Hello answer
        self.strangers: set[str] = set()  # addresses whose daemon does not know "me" yet
        self.admitted = 0
        self.applied: list[list[PeerConfig]] = []
        self.hellos: list[tuple[str, str]] = []

    def resolve(self, name: str, port: int, **kwargs: Any) -> list[tuple[Any, ...]]:
        if self.dns is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, 1, 6, "", (ip, port)) for ip in self.dns]

    def hello(self, address: str, known: str) -> tuple[str, str, bool]:
        self.hellos.append((address, known))
        if address not in self.identity:
            raise ConnectionRefusedError(f"nobody at {address}")
        return (*self.identity[address], address not in self.strangers)

    def on_admitted(self) -> None:
        self.admitted += 1

    def discoverer(self, **kwargs: Any) -> Discoverer:
        return Discoverer(
            "me",
            hostfile=str(self.hostfile),
            dns="svc.example",
            port=7070,
            hello=self.hello,
            apply=self.applied.append,
            on_admitted=self.on_admitted,
            resolver=self.resolve,
            **kwargs,
        )


def _ids(peers: list[PeerConfig]) -> list[tuple[str, str, str]]:
    return [(p.id, p.address, p.failure_domain) for p in peers]


def test_ids_come_from_hello_self_is_skipped_and_static_comes_first(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.hostfile.write_text("named 10.0.0.5:7070 rack-5\n10.0.0.3:7070\nbare 10.0.0.6:7070\n")
    w.dns = ["10.0.0.1", "10.0.0.2", "10.0.0.9"]
    w.identity = {
        "10.0.0.1:7070": ("me", "rack-0"),  # this node's own record
        "10.0.0.2:7070": ("b", "rack-2"),
        "10.0.0.3:7070": ("c", ""),  # no domain: its id
        "10.0.0.5:7070": ("named", "r"),  # proves the id its line names
    }
    static = [PeerConfig("s", "10.0.0.7:7070", "rack-7")]
    d = w.discoverer(static=static)
    peers = d.refresh()
    assert _ids(peers) == [
        ("s", "10.0.0.7:7070", "rack-7"),
        ("named", "10.0.0.5:7070", "rack-5"),  # as the line says
        ("c", "10.0.0.3:7070", "c"),
        ("b", "10.0.0.2:7070", "rack-2"),
    ]  # "bare" has not answered Hello: a line naming an id is no proof of it
    assert ("10.0.0.5:7070", "") in w.hellos  # named, asked all the same
    assert w.applied == [peers]
    w.identity["10.0.0.6:7070"] = ("bare", "")
    assert ("bare", "10.0.0.6:7070", "bare") in _ids(d.refresh())  # no domain: its id


def test_a_named_line_that_another_node_answers_at_takes_the_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = World(tmp_path)
    w.hostfile.write_text("old-name 10.0.0.1:7070 r1\n")
    w.identity = {"10.0.0.1:7070": ("new-name", "r2")}
    assert _ids(w.discoverer().refresh()) == [("new-name", "10.0.0.1:7070", "r2")]
    assert "names old-name at 10.0.0.1:7070, but node new-name answers there" in caplog.text


def test_an_id_claimed_twice_keeps_the_first_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = World(tmp_path)
    w.dns = ["10.0.0.1", "10.0.0.2"]
    w.identity = {"10.0.0.1:7070": ("twin", "r"), "10.0.0.2:7070": ("twin", "r")}
    static = [PeerConfig("twin", "10.0.0.7:7070", "r")]
    d = w.discoverer(static=static)
    assert _ids(d.refresh()) == [("twin", "10.0.0.7:7070", "r")]
    assert "node id twin is claimed at 10.0.0.7:7070 and 10.0.0.1:7070" in caplog.text
    caplog.clear()
    d.refresh()
    assert "claimed" not in caplog.text  # once per address


@pytest.mark.parametrize(
    "answer", [("../x", "r"), ("", "r"), ("a" * 129, "r"), ("ok", "bad domain"), ("ok", "\x00")]
)
def test_an_invalid_hello_answer_is_no_member(tmp_path: Path, answer: tuple[str, str]) -> None:
    w = World(tmp_path)
    w.dns = ["10.0.0.1"]
    w.identity = {"10.0.0.1:7070": answer}
    assert w.discoverer().refresh() == []


def test_joins_and_leaves_apply_only_changes(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.dns = ["10.0.0.1"]
    w.identity = {"10.0.0.1:7070": ("a", "ra"), "10.0.0.2:7070": ("b", "rb")}
    d = w.discoverer()
    d.refresh()
    d.refresh()
    assert [_ids(p) for p in w.applied] == [[("a", "10.0.0.1:7070", "ra")]]
    w.hostfile.write_text("10.0.0.2:7070\n")  # a join through the hostfile
    assert [p.id for p in d.refresh()] == ["b", "a"]
    w.dns = []  # a leave: its record is gone
    assert [p.id for p in d.refresh()] == ["b"]
    assert len(w.applied) == 3
    d.refresh(force=True)  # SIGHUP: applied again though unchanged
    assert len(w.applied) == 4


def test_a_failed_source_keeps_its_last_good_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = World(tmp_path)
    w.dns = ["10.0.0.1"]
    w.hostfile.write_text("h 10.0.0.2:7070\n")
    w.identity = {"10.0.0.1:7070": ("a", "ra")}
    d = w.discoverer()
    before = d.refresh()
    w.dns = None
    w.hostfile.unlink()
    assert d.refresh() == before
    assert "keeping the last 1 addresses" in caplog.text
    assert "keeping the last 1 entries" in caplog.text
    caplog.clear()
    d.refresh()
    assert "keeping" not in caplog.text  # an outage is logged when it starts, once
    w.hostfile.write_text("h 10.0.0.2:7070\n!bad line\n")
    d.refresh()
    d.refresh()
    assert caplog.text.count("line 2:") == 1  # a bad line once, not every round


def test_a_silent_member_stays_until_its_address_leaves(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.dns = ["10.0.0.1", "10.0.0.2"]
    w.identity = {"10.0.0.1:7070": ("a", "ra"), "10.0.0.2:7070": ("b", "rb")}
    d = w.discoverer()
    d.refresh()
    del w.identity["10.0.0.1:7070"]  # restarting: no Hello
    assert {p.id for p in d.refresh()} == {"a", "b"}
    assert ("10.0.0.1:7070", "a") in w.hellos  # asked over its member channel
    # Another address claims it: the member is not displaced while its address is listed
    # (an impostor must not eclipse a restarting node)...
    w.dns = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    w.identity["10.0.0.3:7070"] = ("a", "ra")
    assert ("a", "10.0.0.1:7070", "ra") in _ids(d.refresh())
    # ... and once its old address leaves the sources, it is found at the new one.
    w.dns = ["10.0.0.2", "10.0.0.3"]
    assert ("a", "10.0.0.3:7070", "ra") in _ids(d.refresh())
    assert ("a", "10.0.0.1:7070", "ra") not in _ids(d.refresh())
    # Never answered at all: never a member.
    w.dns.append("10.0.0.4")
    assert "10.0.0.4:7070" not in {p.address for p in d.refresh()}


def test_a_joining_node_pulls_once_a_peer_admits_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tierckptd.peers.peer_discovery")
    w = World(tmp_path)
    w.dns = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    w.identity = {"10.0.0.1:7070": ("a", "ra"), "10.0.0.2:7070": ("b", "rb")}
    w.strangers = {"10.0.0.1:7070", "10.0.0.2:7070"}  # they have not learnt "me" yet
    d = w.discoverer()
    d.refresh()
    d.refresh()
    assert w.admitted == 0
    w.strangers.discard("10.0.0.1:7070")
    d.refresh()
    assert w.admitted == 1
    d.refresh()
    assert w.admitted == 1  # once per admission
    assert caplog.text.count("no Hello from 10.0.0.3:7070") == 1  # silent: logged once


def test_members_are_bounded(tmp_path: Path) -> None:
    w = World(tmp_path)
    named = {
        f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7070": f"n{i}" for i in range(MAX_MEMBERS)
    }
    w.hostfile.write_text("\n".join(f"{node} {address}" for address, node in named.items()))
    w.dns = ["192.168.0.1"]
    w.identity = {address: (node, "r") for address, node in named.items()}
    w.identity["192.168.0.1:7070"] = ("extra", "r")
    peers = w.discoverer(static=[PeerConfig("s", "10.255.0.1:1", "r")]).refresh()
    assert len(peers) == MAX_MEMBERS
    assert peers[0].id == "s" and "extra" not in {p.id for p in peers}


def test_wake_runs_a_round_in_the_background(tmp_path: Path) -> None:
    w = World(tmp_path)
    d = w.discoverer(refresh=3600.0)
    d.refresh()
    joined = threading.Event()
    d._apply = lambda peers: joined.set()
    d.start()
    try:
        w.dns = ["10.0.0.1"]
        w.identity = {"10.0.0.1:7070": ("a", "ra")}
        d.wake()  # a stranger said Hello
        assert joined.wait(30.0)
    finally:
        d.stop()


# --- config: [node] from the environment, [membership] checks -----------------------------


def test_node_identity_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_NODE_ID, "ip-10-0-0-1.ec2.internal")
    monkeypatch.setenv(ENV_FAILURE_DOMAIN, "us-east-1a")
    node = parse_config({}).node
    assert (node.id, node.failure_domain) == ("ip-10-0-0-1.ec2.internal", "us-east-1a")
    node = parse_config({"node": {"id": "given", "failure_domain": "rack"}}).node
    assert (node.id, node.failure_domain) == ("given", "rack")
    monkeypatch.delenv(ENV_FAILURE_DOMAIN)
    assert parse_config({}).node.failure_domain == "ip-10-0-0-1.ec2.internal"
    monkeypatch.delenv(ENV_NODE_ID)
    assert parse_config({}).node.id == socket.gethostname()


@pytest.mark.parametrize(("var", "value"), [(ENV_NODE_ID, "a/b"), (ENV_FAILURE_DOMAIN, "z" * 200)])
def test_a_bad_environment_name_is_refused(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"environment {var}.*not a usable node name"):
        parse_config({})


SECURE = {"security": {"token_file": "/t"}, "listen": {"peer": "0.0.0.0:7070"}}


@pytest.mark.parametrize(
    ("membership", "listen", "match"),
    [
        ({"dns": "bad_name!"}, {}, "is not a DNS name"),
        ({"dns": "a." * 130}, {}, "is not a DNS name"),
        ({"hostfile": "/h", "refresh": 0.0}, {}, "refresh"),
        ({"hostfile": "/h", "refresh": float("inf")}, {}, "refresh"),
        ({"port": 70000}, {}, "1-65535"),
        ({"hostfile": "/h"}, {"peer": ""}, "needs a peer listener"),
        ({"dns": "svc.example"}, {"peer": "0.0.0.0:0"}, "without a port"),
    ],
)
def test_membership_checks(membership: dict[str, Any], listen: dict[str, Any], match: str) -> None:
    doc: dict[str, Any] = {**SECURE, "membership": membership}
    doc["listen"] = {**SECURE["listen"], **listen}
    with pytest.raises(ConfigError, match=match):
        parse_config(doc)


def test_peer_port_defaults_to_the_listeners() -> None:
    doc: dict[str, Any] = {**SECURE, "membership": {"dns": "svc.example."}}
    assert peer_port(parse_config(doc)) == 7070
    doc["listen"] = {"peer": "[::]:7071"}
    assert peer_port(parse_config(doc)) == 7071
    doc["membership"] = {"dns": "svc.example", "port": 9000}
    assert peer_port(parse_config(doc)) == 9000


# --- Hello on a real peer port ------------------------------------------------------------


def test_hello_answers_strangers_and_only_hello(make_catalog: MakeCatalog, tmp_path: Path) -> None:
    """A joining node is no member yet: Hello answers it (and makes discovery look again),
    every other method still refuses it; a hostile claim is only ignored."""
    catalog = make_catalog(budget=64 << 20)
    cluster = Cluster(
        catalog, Restorer(catalog, no_sources), peers=[PeerConfig("node-m", "127.0.0.1:1", "r")]
    )
    strangers: list[str] = []
    cluster.membership.strangers.add(strangers.append)
    servers = start_servers(
        daemon_service(catalog, cluster=cluster),
        Health(),
        f"unix://{tmp_path}/d.sock",
        "127.0.0.1:0",
        register_peer=lambda server: add_peer_service(cluster, server),
    )
    address = f"127.0.0.1:{servers.peer_port}"
    try:

        def hello(claim: str) -> peer_pb2.HelloResponse:
            channel = grpc.intercept_channel(
                grpc.insecure_channel(address), node_client_interceptor(claim or "x")
            )
            with channel:
                reply: peer_pb2.HelloResponse = PeerStub(channel).Hello(
                    peer_pb2.HelloRequest(node_id=claim), timeout=10
                )
                return reply

        got = hello("node-new")
        assert (got.node_id, got.failure_domain, got.knows_caller) == (
            cluster.node_id,
            cluster.membership.failure_domain,
            False,
        )
        assert strangers == ["node-new"]
        assert hello("node-m").knows_caller and strangers == ["node-new"]
        for hostile in ("../../x", "n" * 5000, ""):
            assert not hello(hostile).knows_caller
        assert strangers == ["node-new"]
        with grpc.insecure_channel(address) as channel:  # Holdings: members only
            stub = PeerStub(grpc.intercept_channel(channel, node_client_interceptor("node-new")))
            with pytest.raises(grpc.RpcError) as e:
                stub.Holdings(
                    common_pb2.CheckpointRef(namespace="a", checkpoint_id="b"), timeout=10
                )
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The client side: an address no member is at, over a short-lived channel.
        assert cluster.client.hello(address) == (
            cluster.node_id,
            cluster.membership.failure_domain,
            True,  # its own id: this node's own record in DNS, skipped by the discoverer
        )
    finally:
        servers.stop(0)
        cluster.stop()
