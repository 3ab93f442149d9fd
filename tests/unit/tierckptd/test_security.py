"""Peer security on a real peer listener (127.0.0.1:0): shared token, TLS, mutual TLS.

A recording PeerService stands in for the real one, so each test can tell that a refused
call never reached a servicer ("nothing changes"), for unary and streaming methods alike.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.catalog import Catalog
from tierckptd.config import ConfigError, SecurityConfig
from tierckptd.peers.security import (
    TOKEN_METADATA,
    UNAUTHENTICATED_MESSAGE,
    peer_channel_factory,
    peer_server_security,
    read_token,
)
from tierckptd.rpc.health import Health
from tierckptd.rpc.servers import start_servers

from tests.support.certs import Certs, Pair, make_certs
from tests.support.daemon_parts import daemon_service

TOKEN = "c2VjcmV0LXRva2VuLWZvci10ZXN0cw=="


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _mtls(pair: Pair, certs: Certs, token_file: str = "") -> SecurityConfig:
    return SecurityConfig(
        token_file=token_file, tls_cert=pair.cert, tls_key=pair.key, tls_ca=certs.ca
    )


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    path.chmod(0o600)
    return str(path)


# --- a peer listener with a recording PeerService -------------------------------------------


class RecordingPeer(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    """Answers three PeerService methods (one of each shape) and records each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def Holdings(self, request: common_pb2.CheckpointRef, context: Any) -> Any:
        self.calls.append("Holdings")
        return peer_pb2.HoldingsResponse()

    def PushFile(self, requests: Iterator[peer_pb2.FileChunk], context: Any) -> Any:
        self.calls.append("PushFile")
        return peer_pb2.PushFileResponse(received_bytes=sum(len(c.data) for c in requests))

    def FetchFile(self, request: peer_pb2.FetchFileRequest, context: Any) -> Iterator[Any]:
        self.calls.append("FetchFile")
        yield peer_pb2.FileChunk(offset=0, data=b"abc")
        yield peer_pb2.FileChunk(offset=3, data=b"def")


@dataclass
class Listener:
    address: str
    peer: RecordingPeer


StartListener = Callable[[SecurityConfig], Listener]


@pytest.fixture
def start_listener(catalog: Catalog, tmp_path: Path) -> Iterator[StartListener]:
    running: list[Any] = []

    def start(security: SecurityConfig) -> Listener:
        peer = RecordingPeer()
        health = Health()
        servers = start_servers(
            daemon_service(catalog),
            health,
            f"unix://{tmp_path}/d{len(running)}.sock",
            "127.0.0.1:0",
            register_peer=lambda server: peer_pb2_grpc.add_PeerServiceServicer_to_server(
                peer, server
            ),
            peer_security=peer_server_security(security),
        )
        health.serving()
        running.append(servers)
        return Listener(f"127.0.0.1:{servers.peer_port}", peer)

    yield start
    for servers in running:
        servers.stop(0)


@pytest.fixture
def channels() -> Iterator[list[grpc.Channel]]:
    opened: list[grpc.Channel] = []
    yield opened
    for channel in opened:
        channel.close()


def _open(
    channels: list[grpc.Channel],
    security: SecurityConfig,
    address: str,
    options: tuple[tuple[str, Any], ...] = (),
) -> grpc.Channel:
    channel = peer_channel_factory(security, options)(address)
    channels.append(channel)
    return channel


def _exercise(channel: grpc.Channel) -> None:
    """One call of each shape; raises grpc.RpcError from the first that fails."""
    stub = peer_pb2_grpc.PeerServiceStub(channel)
    stub.Holdings(common_pb2.CheckpointRef(namespace="run", checkpoint_id="s1"), timeout=10)
    pushed = stub.PushFile(
        iter([peer_pb2.FileChunk(data=b"xy"), peer_pb2.FileChunk(data=b"z")]), timeout=10
    )
    assert pushed.received_bytes == 3
    fetched = stub.FetchFile(peer_pb2.FetchFileRequest(file_name="f"), timeout=10)
    assert b"".join(c.data for c in fetched) == b"abcdef"


def _refused(channel: grpc.Channel) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        _exercise(channel)
    return e.value.code(), e.value.details()


def _each_shape_refused(channel: grpc.Channel) -> list[grpc.StatusCode]:
    stub = peer_pb2_grpc.PeerServiceStub(channel)
    calls: list[Callable[[], Any]] = [
        lambda: stub.Holdings(common_pb2.CheckpointRef(), timeout=10),
        lambda: stub.PushFile(iter([peer_pb2.FileChunk(data=b"x")]), timeout=10),
        lambda: list(stub.FetchFile(peer_pb2.FetchFileRequest(), timeout=10)),
    ]
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.details() == UNAUTHENTICATED_MESSAGE
        codes.append(e.value.code())
    return codes


def _health(channel: grpc.Channel) -> int:
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(check.status)


# --- plaintext ----------------------------------------------------------------------------


def test_empty_security_is_plaintext_without_token(
    start_listener: StartListener, channels: list[grpc.Channel]
) -> None:
    assert peer_server_security(SecurityConfig()).credentials is None
    assert not peer_server_security(SecurityConfig()).interceptors
    listener = start_listener(SecurityConfig())
    _exercise(_open(channels, SecurityConfig(), listener.address))
    assert listener.peer.calls == ["Holdings", "PushFile", "FetchFile"]


# --- token --------------------------------------------------------------------------------


def test_token_right_one_works(
    start_listener: StartListener, channels: list[grpc.Channel], token_file: str
) -> None:
    security = SecurityConfig(token_file=token_file)
    listener = start_listener(security)
    _exercise(_open(channels, security, listener.address))
    assert listener.peer.calls == ["Holdings", "PushFile", "FetchFile"]


def test_token_missing_or_wrong_is_refused_before_the_servicer(
    start_listener: StartListener,
    channels: list[grpc.Channel],
    token_file: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    listener = start_listener(SecurityConfig(token_file=token_file))
    wrong = tmp_path / "wrong"
    wrong.write_text(TOKEN + "x")
    wrong.chmod(0o600)
    caplog.set_level(logging.DEBUG, logger="tierckptd.peers.security")
    for client in (SecurityConfig(), SecurityConfig(token_file=str(wrong))):
        channel = _open(channels, client, listener.address)
        assert _each_shape_refused(channel) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    # A token in some other header, or a prefix of the right one, is no better.
    stub = peer_pb2_grpc.PeerServiceStub(_open(channels, SecurityConfig(), listener.address))
    for metadata in ((("x-other", TOKEN),), ((TOKEN_METADATA, TOKEN[:-1]),)):
        with pytest.raises(grpc.RpcError) as e:
            stub.Holdings(common_pb2.CheckpointRef(), metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert listener.peer.calls == []
    # Warned once for the host, then quietly.
    rejected = [r for r in caplog.records if r.getMessage().startswith("rejected a peer call")]
    assert [r.levelno for r in rejected] == [logging.WARNING] + [logging.DEBUG] * 7
    assert "127.0.0.1" in rejected[0].getMessage()


def test_health_needs_no_token(
    start_listener: StartListener, channels: list[grpc.Channel], token_file: str
) -> None:
    listener = start_listener(SecurityConfig(token_file=token_file))
    channel = _open(channels, SecurityConfig(), listener.address)
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_token_file_is_read_once_and_stripped(token_file: str) -> None:
    assert read_token(token_file) == TOKEN.encode()
    open_channel = peer_channel_factory(SecurityConfig(token_file=token_file))
    os.unlink(token_file)  # read at start: a later channel does not need the file
    open_channel("127.0.0.1:1").close()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "is empty"),
        (" \n\t", "is empty"),
        ("two words", "printable ASCII"),
        ("tökén", "printable ASCII"),
    ],
)
def test_bad_token_files_are_refused(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "token"
    path.write_text(content, encoding="utf-8")
    path.chmod(0o600)
    for make in (peer_server_security, peer_channel_factory):
        with pytest.raises(ConfigError, match=expected) as e:
            make(SecurityConfig(token_file=str(path)))
        assert "[security] token_file" in str(e.value) and str(path) in str(e.value)


def test_world_or_group_readable_token_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    caplog.set_level(logging.WARNING, logger="tierckptd.peers.security")
    # The daemon's group holds every training user (audit M4): 0640 is no secret either.
    for mode, expected in ((0o644, "readable by every user"), (0o640, "readable by its group")):
        path.chmod(mode)
        caplog.clear()
        assert read_token(str(path)) == TOKEN.encode()
        assert any(expected in r.getMessage() for r in caplog.records), oct(mode)
    path.chmod(0o600)
    caplog.clear()
    read_token(str(path))
    assert not caplog.records


# --- TLS configuration errors ---------------------------------------------------------------


def test_partial_or_unreadable_tls_config_names_the_key(certs: Certs, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    cases = [
        (SecurityConfig(tls_cert=certs.node_a.cert), "tls_key is missing"),
        (SecurityConfig(tls_key=certs.node_a.key), "tls_cert is missing"),
        (SecurityConfig(tls_ca=certs.ca), "tls_cert is missing: TLS needs both"),
        (SecurityConfig(tls_cert=certs.node_a.cert, tls_key=str(token)), "is not a PEM file"),
        (
            SecurityConfig(tls_cert=str(tmp_path / "nope.crt"), tls_key=certs.node_a.key),
            f"tls_cert {tmp_path / 'nope.crt'}: cannot read",
        ),
        (
            SecurityConfig(tls_cert=certs.node_a.cert, tls_key=str(tmp_path / "nope.key")),
            f"tls_key {tmp_path / 'nope.key'}: cannot read",
        ),
        (replace(_mtls(certs.node_a, certs), tls_ca=str(tmp_path)), f"tls_ca {tmp_path}"),
        (SecurityConfig(token_file=str(tmp_path / "none")), "token_file"),
    ]
    for security, message in cases:
        for make in (peer_server_security, peer_channel_factory):
            with pytest.raises(ConfigError) as e:
                make(security)
            assert "[security]" in str(e.value) and message in str(e.value), str(e.value)


# --- TLS and mutual TLS ---------------------------------------------------------------------


def test_mutual_tls_accepts_a_peer_of_the_same_ca(
    certs: Certs, start_listener: StartListener, channels: list[grpc.Channel]
) -> None:
    listener = start_listener(_mtls(certs.node_a, certs))
    _exercise(_open(channels, _mtls(certs.node_b, certs), listener.address))
    # Also by name, and with the server's own cert (one cert per node does both roles).
    port = listener.address.rsplit(":", 1)[1]
    _exercise(_open(channels, _mtls(certs.node_a, certs), f"localhost:{port}"))
    assert listener.peer.calls == ["Holdings", "PushFile", "FetchFile"] * 2


def test_mutual_tls_refuses_clients_without_the_clusters_cert(
    certs: Certs, start_listener: StartListener, channels: list[grpc.Channel]
) -> None:
    listener = start_listener(_mtls(certs.node_a, certs))
    ca = Path(certs.ca).read_bytes()
    rogue_key, rogue_cert = Path(certs.rogue.key).read_bytes(), Path(certs.rogue.cert).read_bytes()
    clients = [
        # TLS that trusts the server but shows no client cert.
        grpc.secure_channel(listener.address, grpc.ssl_channel_credentials(ca)),
        # A cert from another CA (with the right names).
        grpc.secure_channel(
            listener.address, grpc.ssl_channel_credentials(ca, rogue_key, rogue_cert)
        ),
        # Plaintext.
        grpc.insecure_channel(listener.address),
    ]
    channels.extend(clients)
    for channel in clients:
        code, _ = _refused(channel)
        assert code == grpc.StatusCode.UNAVAILABLE
    assert listener.peer.calls == []


def test_client_refuses_a_server_of_another_ca_or_plaintext(
    certs: Certs, start_listener: StartListener, channels: list[grpc.Channel]
) -> None:
    rogue_server = start_listener(
        SecurityConfig(tls_cert=certs.rogue.cert, tls_key=certs.rogue.key)
    )
    plain_server = start_listener(SecurityConfig())
    for listener in (rogue_server, plain_server):
        code, _ = _refused(_open(channels, _mtls(certs.node_b, certs), listener.address))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert listener.peer.calls == []


def test_tls_without_ca_asks_no_client_cert(
    certs: Certs, start_listener: StartListener, channels: list[grpc.Channel]
) -> None:
    listener = start_listener(SecurityConfig(tls_cert=certs.node_a.cert, tls_key=certs.node_a.key))
    ca = Path(certs.ca).read_bytes()
    channel = grpc.secure_channel(listener.address, grpc.ssl_channel_credentials(ca))
    channels.append(channel)
    _exercise(channel)
    assert listener.peer.calls == ["Holdings", "PushFile", "FetchFile"]


def test_target_name_override_for_a_cert_naming_only_localhost(
    certs: Certs, start_listener: StartListener, channels: list[grpc.Channel]
) -> None:
    listener = start_listener(_mtls(certs.localhost_only, certs))
    client = _mtls(certs.node_b, certs)
    code, _ = _refused(_open(channels, client, listener.address))
    assert code == grpc.StatusCode.UNAVAILABLE
    override = (("grpc.ssl_target_name_override", "localhost"),)
    _exercise(_open(channels, client, listener.address, override))
    assert listener.peer.calls == ["Holdings", "PushFile", "FetchFile"]


def test_mutual_tls_and_token_together(
    certs: Certs,
    start_listener: StartListener,
    channels: list[grpc.Channel],
    token_file: str,
) -> None:
    listener = start_listener(_mtls(certs.node_a, certs, token_file))
    # The right cert without the token: authenticated by TLS, still refused.
    no_token = _open(channels, _mtls(certs.node_b, certs), listener.address)
    assert _each_shape_refused(no_token) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert _health(no_token) == health_pb2.HealthCheckResponse.SERVING
    # The token without a cert: refused in the handshake.
    ca = Path(certs.ca).read_bytes()
    no_cert = grpc.secure_channel(listener.address, grpc.ssl_channel_credentials(ca))
    channels.append(no_cert)
    stub = peer_pb2_grpc.PeerServiceStub(no_cert)
    with pytest.raises(grpc.RpcError) as e:
        stub.Holdings(common_pb2.CheckpointRef(), metadata=((TOKEN_METADATA, TOKEN),), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert listener.peer.calls == []
    _exercise(_open(channels, _mtls(certs.node_b, certs, token_file), listener.address))
    assert listener.peer.calls == ["Holdings", "PushFile", "FetchFile"]
