"""Daemon address resolution: explicit > $TIERCKPT_DAEMON > default unix socket."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.endpoint import (
    DAEMON_ENV,
    DEFAULT_DAEMON_ADDRESS,
    open_channel,
    resolve_daemon_address,
)


def test_constants() -> None:
    assert DAEMON_ENV == "TIERCKPT_DAEMON"
    assert DEFAULT_DAEMON_ADDRESS.startswith("unix:///")


def test_default_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DAEMON_ENV, raising=False)
    assert resolve_daemon_address() == DEFAULT_DAEMON_ADDRESS
    assert resolve_daemon_address(None) == DEFAULT_DAEMON_ADDRESS
    assert resolve_daemon_address("") == DEFAULT_DAEMON_ADDRESS


def test_empty_env_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DAEMON_ENV, "")
    assert resolve_daemon_address() == DEFAULT_DAEMON_ADDRESS


def test_env_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DAEMON_ENV, "unix:///tmp/env.sock")
    assert resolve_daemon_address() == "unix:///tmp/env.sock"
    assert resolve_daemon_address(None) == "unix:///tmp/env.sock"


def test_explicit_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DAEMON_ENV, "unix:///tmp/env.sock")
    assert resolve_daemon_address("127.0.0.1:7000") == "127.0.0.1:7000"
    assert resolve_daemon_address("/tmp/explicit.sock") == "unix:///tmp/explicit.sock"


@pytest.mark.parametrize(
    ("given", "resolved"),
    [
        ("/run/x/d.sock", "unix:///run/x/d.sock"),
        ("unix:///run/x/d.sock", "unix:///run/x/d.sock"),
        ("unix:/run/x/d.sock", "unix:/run/x/d.sock"),
        ("localhost:5000", "localhost:5000"),
        ("dns:///node3:5000", "dns:///node3:5000"),
    ],
)
def test_bare_absolute_path_becomes_unix(
    monkeypatch: pytest.MonkeyPatch, given: str, resolved: str
) -> None:
    monkeypatch.delenv(DAEMON_ENV, raising=False)
    assert resolve_daemon_address(given) == resolved
    monkeypatch.setenv(DAEMON_ENV, given)
    assert resolve_daemon_address() == resolved


def test_client_resolves_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DAEMON_ENV, "/tmp/a.sock")
    client = DaemonClient()
    monkeypatch.setenv(DAEMON_ENV, "/tmp/b.sock")
    assert client.address == "unix:///tmp/a.sock"
    assert DaemonClient("/tmp/c.sock").address == "unix:///tmp/c.sock"
    monkeypatch.delenv(DAEMON_ENV)
    assert DaemonClient().address == DEFAULT_DAEMON_ADDRESS


@pytest.mark.parametrize(
    ("code", "attempts"),
    [(grpc.StatusCode.UNAVAILABLE, 4), (grpc.StatusCode.NOT_FOUND, 1)],
)
def test_open_channel_retries_only_unavailable(
    tmp_path: Path, code: grpc.StatusCode, attempts: int
) -> None:
    """A daemon restarting answers UNAVAILABLE for a moment: the channel retries that (4
    attempts in all), and nothing else. Opened before anything listens: it connects when
    first used."""
    address = f"unix:{tmp_path}/d.sock"
    channel = open_channel(address)
    calls = []

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        calls.append(1)
        context.abort(code, "no")
        return b""  # pragma: no cover

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(answer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tierckpt.v1.DaemonService", {"GetStatus": handler}),)
    )
    server.add_insecure_port(address)
    server.start()
    try:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/tierckpt.v1.DaemonService/GetStatus")(b"", timeout=10)
    finally:
        channel.close()
        server.stop(0)
    assert info.value.code() == code
    assert len(calls) == attempts
