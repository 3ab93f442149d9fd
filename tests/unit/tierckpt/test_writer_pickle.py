"""The DCP writer/reader pickle without a daemon (AsyncCheckpointerType.PROCESS), keep
their configuration, validate names; an unreachable daemon fails fast and says so."""

from __future__ import annotations

import gc
import pickle
import socket
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import torch.utils.serialization as serialization
from tierckpt.daemon_client import DaemonClient
from tierckpt.endpoint import DAEMON_ENV
from tierckpt.errors import (
    TIER_UNAVAILABLE_PREFIX,
    CheckpointNotFound,
    DaemonTimeout,
    DaemonUnavailable,
    InvalidName,
    TierckptError,
    TierUnavailable,
)
from tierckpt.memory_tier_file import SaveTarget, crc32_disabled
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.storage_writer import (
    TieredStorageWriter,
    _MemoryTierFileSystem,
)

ADDRESS = "unix:///tmp/x.sock"


def test_writer_pickles_without_a_daemon() -> None:
    writer = TieredStorageWriter("ns", daemon=ADDRESS)
    copy = pickle.loads(pickle.dumps(writer))
    assert type(copy) is TieredStorageWriter
    assert copy.namespace == "ns"
    assert copy.client.address == ADDRESS
    assert copy.thread_count == 2
    # the file system shares the writer's client and save target after the round trip
    assert copy.fs.client is copy.client
    copy.reset("step-1")
    assert copy.fs.target("step-1") == SaveTarget("ns", "step-1", 0)


def test_a_dropped_writer_is_freed_at_once_with_its_daemon_channel() -> None:
    """A rank that makes a writer per save must not pile up daemon sockets until the
    cyclic GC runs: the writer and its file system form no reference cycle."""
    gc.disable()
    try:
        writer = TieredStorageWriter("ns", daemon=ADDRESS)
        gone = weakref.ref(writer)
        client = weakref.ref(writer.client)
        del writer
        assert gone() is None and client() is None
    finally:
        gc.enable()


def test_writer_pickle_keeps_the_checkpoint_id_and_drops_the_staging_cache() -> None:
    writer = TieredStorageWriter("job-7", daemon="/tmp/d.sock", thread_count=3)
    writer.reset("step-000100")
    writer.state_dict_cache = {"w": torch.zeros(4)}
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.checkpoint_id == "step-000100"
    assert copy.client.address == "unix:///tmp/d.sock"
    assert copy.thread_count == 3
    assert copy.state_dict_cache is None
    assert writer.state_dict_cache is not None  # the original keeps its buffers


def test_writer_pickles_after_its_channel_was_opened() -> None:
    writer = TieredStorageWriter("ns", daemon=ADDRESS)
    writer.client._service()  # opens a (lazy) channel, which itself cannot pickle
    try:
        copy = pickle.loads(pickle.dumps(writer))
    finally:
        writer.client.close()
    assert copy.client.address == ADDRESS
    assert copy.client._channel is None


def test_writer_uses_the_env_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DAEMON_ENV, "/tmp/env.sock")
    assert TieredStorageWriter("ns").client.address == "unix:///tmp/env.sock"
    assert TieredStorageReader("ns").client.address == "unix:///tmp/env.sock"


def test_writer_needs_a_checkpoint_id() -> None:
    writer = TieredStorageWriter("ns", daemon=ADDRESS)
    # DCP's PROCESS executor probes `checkpoint_id` with getattr(..., None): no raise here,
    # but the first storage call of a save without an id names the fix.
    assert writer.checkpoint_id is None
    with pytest.raises(ValueError, match="checkpoint_id="):
        writer.set_up_storage_writer(True, rank=0)
    writer.reset("step-5")
    writer.reset(None)  # a later reset without an id keeps the current one
    assert writer.checkpoint_id == "step-5"
    with pytest.raises(InvalidName):
        writer.reset("../x")


@pytest.mark.parametrize("cls", [TieredStorageWriter, _MemoryTierFileSystem])
def test_validate_checkpoint_id(cls: type) -> None:
    assert cls.validate_checkpoint_id("step-000100") is True
    assert cls.validate_checkpoint_id(Path("step-000100")) is True
    assert cls.validate_checkpoint_id("run1/step-10") is True  # a folder path
    for bad in ["../x", "a/..", "a//b", "/a", "", ".", "..", "x" * 129, "s3://bucket/ckpt"]:
        assert cls.validate_checkpoint_id(bad) is False, bad


@pytest.mark.parametrize("cls", [TieredStorageWriter, TieredStorageReader])
@pytest.mark.parametrize("namespace", ["../x", "", "a/b", ".."])
def test_invalid_namespace_raises(cls: type, namespace: str) -> None:
    with pytest.raises(InvalidName, match="namespace"):
        cls(namespace, daemon=ADDRESS)


def test_reader_pickles_without_a_daemon() -> None:
    reader = TieredStorageReader("ns", daemon=ADDRESS, io_threads=5)
    copy = pickle.loads(pickle.dumps(reader))
    assert type(copy) is TieredStorageReader
    assert copy.namespace == "ns"
    assert copy.client.address == ADDRESS
    assert copy.io_threads == 5


def test_crc32_disabled_restores_the_setting_on_error() -> None:
    config = serialization.config.save
    before = config.compute_crc32
    with pytest.raises(RuntimeError), crc32_disabled():
        assert config.compute_crc32 is False
        raise RuntimeError("save failed")
    assert config.compute_crc32 == before


# --- an unreachable daemon ------------------------------------------------------------------
@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # short path: unix socket paths are limited to ~107 bytes
    with tempfile.TemporaryDirectory(prefix="tck") as d:
        yield Path(d)


def _assert_unavailable(client: DaemonClient, address: str) -> None:
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable) as info:
        client.status()
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert address in message
    assert "tierckptd" in message
    assert "TIERCKPT_DAEMON" in message
    assert isinstance(info.value, ConnectionError)


@pytest.mark.timeout(60)
def test_missing_socket_raises_daemon_unavailable(socket_dir: Path) -> None:
    address = f"unix://{socket_dir}/nothing.sock"
    client = DaemonClient(address)
    try:
        _assert_unavailable(client, address)
        # the writer's fail-fast path too
        with pytest.raises(DaemonUnavailable, match=address):
            client.begin_checkpoint("ns", "step-1", 0)
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_socket_nobody_accepts_on_raises_daemon_unavailable(socket_dir: Path) -> None:
    path = socket_dir / "dead.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))  # bound, never listening: connections are refused
    client = DaemonClient(str(path))
    try:
        _assert_unavailable(client, f"unix://{path}")
    finally:
        client.close()
        sock.close()


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


def _fail_with(code: grpc.StatusCode, details: str | None = "why"):
    def method(request: object, *, timeout: float) -> object:
        raise _FakeRpcError(code, details)

    return method


def test_call_translates_status_codes() -> None:
    client = DaemonClient("/tmp/t.sock", timeout_s=12)
    with pytest.raises(CheckpointNotFound, match="no such checkpoint"):
        client._call(_fail_with(grpc.StatusCode.NOT_FOUND, "no such checkpoint"), None)
    with pytest.raises(DaemonTimeout, match=r"unix:///tmp/t.sock.*12 s"):
        client._call(_fail_with(grpc.StatusCode.DEADLINE_EXCEEDED), None)
    with pytest.raises(DaemonUnavailable, match="unix:///tmp/t.sock"):
        client._call(_fail_with(grpc.StatusCode.UNAVAILABLE, None), None)
    with pytest.raises(TierckptError) as info:
        client._call(_fail_with(grpc.StatusCode.INTERNAL, "oops"), None)
    assert type(info.value) is TierckptError
    # the gRPC error is kept as the cause; a pickled copy carries the message only
    assert isinstance(info.value.__cause__, _FakeRpcError)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is TierckptError and str(copy) == "oops" and copy.__cause__ is None


def test_a_tier_down_behind_the_daemon_is_not_the_daemon_down() -> None:
    client = DaemonClient("/tmp/t.sock")
    details = f"{TIER_UNAVAILABLE_PREFIX}persistent (s3://b: connection refused): no valid copy"
    with pytest.raises(TierUnavailable) as info:
        client._call(_fail_with(grpc.StatusCode.UNAVAILABLE, details), None)
    assert not isinstance(info.value, DaemonUnavailable)
    assert str(info.value) == details and "tierckptd is not reachable" not in str(info.value)
    assert isinstance(info.value, ConnectionError)  # still caught as a connection problem
    # the same code without the prefix: the daemon itself is unreachable
    with pytest.raises(DaemonUnavailable):
        client._call(_fail_with(grpc.StatusCode.UNAVAILABLE, "connection refused"), None)


def test_call_passes_the_timeout() -> None:
    client = DaemonClient("/tmp/t.sock", timeout_s=7.5)
    seen = {}

    def method(request: object, *, timeout: float) -> str:
        seen["timeout"] = timeout
        return "ok"

    assert client._call(method, "req") == "ok"
    assert seen == {"timeout": 7.5}


def test_daemon_client_pickles_its_configuration() -> None:
    client = DaemonClient("/tmp/t.sock", timeout_s=3)
    copy = pickle.loads(pickle.dumps(client))
    assert (copy.address, copy.timeout_s) == ("unix:///tmp/t.sock", 3)
