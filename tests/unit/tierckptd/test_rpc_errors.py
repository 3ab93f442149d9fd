"""rpc.errors: the one domain-error -> status translation both servicers use, through a
real grpc server in-process and the client's own channel (with its retry policy)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import (
    REASON_METADATA,
    TIER_UNAVAILABLE_PREFIX,
    CheckpointLost,
    CheckpointNotFound,
    DaemonUnavailable,
    TierckptError,
    TierUnavailable,
)
from tierckpt.v1 import common_pb2, daemon_pb2
from tierckptd.rpc.errors import MAX_DETAILS, StatusTranslator, bounded, rpc_method

SERVICE = "tierckpt.v1.DaemonService"


class _Servicer:
    """Two DaemonService methods whose behaviour a test sets: `raise_` is raised."""

    def __init__(self) -> None:
        self.errors = StatusTranslator(lambda m: f"{m} failed (internal)")
        self.raise_: BaseException | None = None
        self.calls = 0

    @rpc_method
    def GetCheckpoint(self, request: common_pb2.CheckpointRef, context: Any) -> Any:
        self.calls += 1
        if self.raise_ is not None:
            raise self.raise_
        return common_pb2.CheckpointInfo(ref=request)

    @rpc_method
    def Stream(self, request: Any, context: Any) -> Iterator[bytes]:
        yield b"first"
        raise CheckpointNotFound("gone mid-stream")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[_Servicer, str]]:
    servicer = _Servicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handlers = {
        "GetCheckpoint": grpc.unary_unary_rpc_method_handler(
            servicer.GetCheckpoint,
            request_deserializer=common_pb2.CheckpointRef.FromString,
            response_serializer=common_pb2.CheckpointInfo.SerializeToString,
        ),
        "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    address = f"unix:{tmp_path}/s.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        yield servicer, address
    finally:
        server.stop(0)


def _get(address: str) -> Any:
    client = DaemonClient(address, timeout_s=10)
    try:
        return client.get_checkpoint("ns", "step-1")
    finally:
        client.close()


def test_domain_error_keeps_its_status_and_message(served: tuple[_Servicer, str]) -> None:
    servicer, address = served
    servicer.raise_ = CheckpointNotFound("ns/step-1 is not on node n1")
    with pytest.raises(CheckpointNotFound, match="ns/step-1 is not on node n1") as info:
        _get(address)
    assert isinstance(info.value.__cause__, grpc.RpcError)  # the gRPC error kept as cause


def test_a_tier_down_is_answered_once_and_is_not_the_daemon_down(
    served: tuple[_Servicer, str],
) -> None:
    # The client channel retries UNAVAILABLE (a restarting daemon); a tier outage behind
    # the daemon must not be retried 4 times, each waiting out the tier's own retries.
    servicer, address = served
    message = f"{TIER_UNAVAILABLE_PREFIX}persistent (s3://bucket: connection refused)"
    servicer.raise_ = TierUnavailable(message)
    with pytest.raises(TierUnavailable) as info:
        _get(address)
    assert not isinstance(info.value, DaemonUnavailable)
    assert str(info.value) == message
    assert servicer.calls == 1


@pytest.mark.parametrize("cls", [TierUnavailable, CheckpointLost], ids=lambda c: c.__name__)
def test_a_subtype_travels_by_its_reason_not_its_wording(
    served: tuple[_Servicer, str], cls: type[TierckptError]
) -> None:
    """The reason rides in the trailing metadata: a message without the subtype's prefix
    still comes back as the subtype, and the base error of its code sends none."""
    servicer, address = served
    servicer.raise_ = cls("worded without the prefix")
    with pytest.raises(cls, match="worded without the prefix"):
        _get(address)
    servicer.raise_ = CheckpointNotFound("plain")
    with grpc.insecure_channel(address) as channel:
        get = channel.unary_unary(
            f"/{SERVICE}/GetCheckpoint",
            request_serializer=common_pb2.CheckpointRef.SerializeToString,
        )
        with pytest.raises(grpc.RpcError) as info:
            get(common_pb2.CheckpointRef(namespace="ns", checkpoint_id="s"), timeout=10)
    assert REASON_METADATA not in dict(info.value.trailing_metadata() or ())


def test_a_bug_is_internal_with_a_fixed_message_and_one_traceback(
    served: tuple[_Servicer, str], caplog: pytest.LogCaptureFixture
) -> None:
    servicer, address = served
    servicer.raise_ = KeyError("/secret/path/in/the/daemon")
    with caplog.at_level(logging.INFO, logger="tierckptd.rpc.errors"):
        for _ in range(2):
            with pytest.raises(TierckptError) as info:
                _get(address)
            assert type(info.value) is TierckptError
            assert str(info.value) == "GetCheckpoint failed (internal)"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "secret/path" in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[1].exc_info is None


def test_a_stream_error_after_the_first_message_gets_its_status(
    served: tuple[_Servicer, str],
) -> None:
    _, address = served
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=10)
        assert next(call) == b"first"
        with pytest.raises(grpc.RpcError) as info:
            next(call)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "gone mid-stream"


def test_long_messages_are_bounded(served: tuple[_Servicer, str]) -> None:
    servicer, address = served
    servicer.raise_ = CheckpointNotFound("x" * 100_000)
    with pytest.raises(CheckpointNotFound) as info:
        _get(address)
    assert len(str(info.value)) <= MAX_DETAILS and "more characters)" in str(info.value)
    assert bounded("short") == "short"


def test_refused_hook_sees_every_refusal(served: tuple[_Servicer, str]) -> None:
    servicer, address = served
    seen: list[tuple[str, grpc.StatusCode, str]] = []
    servicer.errors = StatusTranslator(lambda m: "internal", refused=lambda *a: seen.append(a))
    servicer.raise_ = CheckpointNotFound("nope")
    with pytest.raises(CheckpointNotFound):
        _get(address)
    assert seen == [("GetCheckpoint", grpc.StatusCode.NOT_FOUND, "nope")]


def test_daemon_service_uses_the_shared_translator() -> None:
    from tierckptd.rpc.daemon_service import DaemonService

    for name in ("GetCheckpoint", "EnsureLocal", "CommitCheckpoint", "GetStatus"):
        assert getattr(DaemonService, name).__wrapped__ is not None, name  # @rpc_method
    assert daemon_pb2.EnsureLocalRequest  # the request type the client sends exists
