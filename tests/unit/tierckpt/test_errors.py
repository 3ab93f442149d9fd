"""Errors pickle with type and message (DCP gathers them across processes) and map
one-to-one to gRPC status codes."""

from __future__ import annotations

import pickle

import grpc
import pytest
import tierckpt
from tierckpt import errors
from tierckpt.errors import TierckptError, error_from_status, status_of

ALL_ERRORS = [getattr(errors, name) for name in errors.__all__ if name[0].isupper()]
# One class per status code; refinements (InvalidName is an InvalidArgument) travel as their base.
REFINEMENTS = {
    errors.InvalidName: errors.InvalidArgument,
    errors.UnsafeMetadata: errors.InvalidArgument,
}
MAPPED = [cls for cls in ALL_ERRORS if cls is not TierckptError and cls not in REFINEMENTS]
# Errors that share a status code and are told apart by the message's prefix.
PREFIXED = {
    errors.TierUnavailable: errors.TIER_UNAVAILABLE_PREFIX,
    errors.NoPersistentTier: errors.NO_PERSISTENT_TIER_PREFIX,
    errors.NotAJobNode: errors.NOT_A_JOB_NODE_PREFIX,
    errors.CheckpointLost: errors.CHECKPOINT_LOST_PREFIX,
    errors.TierTimeout: errors.TIER_TIMEOUT_PREFIX,
}


def _subclasses(cls: type) -> set[type]:
    """Every subclass of `cls` that tierckpt.errors defines (the daemon refines some)."""
    found = {s for sub in cls.__subclasses__() for s in {sub, *_subclasses(sub)}}
    return {s for s in found if s.__module__ == errors.__name__}


def test_error_list_is_complete() -> None:
    # A new subclass must be exported (and therefore covered by the tests below).
    assert _subclasses(TierckptError) - set(REFINEMENTS) == set(MAPPED)
    assert len(MAPPED) == 14
    for refined, base in REFINEMENTS.items():
        assert issubclass(refined, base) and refined.code == base.code
    for cls in ALL_ERRORS:
        assert getattr(tierckpt, cls.__name__) is cls


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_error_pickles_with_type_and_message(cls: type[TierckptError], protocol: int) -> None:
    message = f"{cls.__name__}: step-000100 of ns went wrong"
    try:
        raise cls(message)
    except TierckptError as raised:  # carries a traceback, like a gathered exception
        copy = pickle.loads(pickle.dumps(raised, protocol=protocol))
    assert type(copy) is cls
    assert str(copy) == message
    assert copy.args == (message,)
    assert copy.code == cls.code
    for base in cls.__mro__:
        assert isinstance(copy, base)


def test_errors_pickle_inside_a_dcp_checkpoint_exception() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    failures = {rank: cls(f"rank {rank} failed") for rank, cls in enumerate(MAPPED)}
    copy = pickle.loads(pickle.dumps(CheckpointException("save failed", failures)))
    for rank, cls in enumerate(MAPPED):
        got = copy.failures[rank]
        assert type(got) is cls
        assert str(got) == f"rank {rank} failed"


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.InvalidName, ValueError),
        (errors.InvalidArgument, ValueError),
        (errors.CheckpointExists, FileExistsError),
        (errors.CheckpointNotFound, FileNotFoundError),
        (errors.CheckpointLost, FileNotFoundError),
        (errors.MemoryBudgetExceeded, MemoryError),
        (errors.CheckpointIncomplete, RuntimeError),
        (errors.ChecksumMismatch, OSError),
        (errors.DaemonUnavailable, ConnectionError),
        (errors.TierUnavailable, ConnectionError),
        (errors.NoPersistentTier, RuntimeError),
        (errors.DaemonTimeout, TimeoutError),
        (errors.TierTimeout, TimeoutError),
        (errors.PermissionDenied, PermissionError),
        (errors.UnsafeMetadata, ValueError),
    ],
)
def test_errors_derive_from_their_builtin(cls: type[TierckptError], builtin: type) -> None:
    assert issubclass(cls, builtin)
    with pytest.raises(builtin):
        raise cls("x")


def test_codes_are_distinct() -> None:
    codes = [cls.code for cls in MAPPED if cls not in PREFIXED]
    assert len(set(codes)) == len(codes)
    assert {cls.code for cls in PREFIXED} <= set(codes)  # each shares a code, by prefix
    assert grpc.StatusCode.INTERNAL not in codes
    assert grpc.StatusCode.OK not in codes


@pytest.mark.parametrize("cls", MAPPED, ids=lambda c: c.__name__)
def test_status_round_trip(cls: type[TierckptError]) -> None:
    message = PREFIXED.get(cls, "") + "boom"
    code = status_of(cls(message))
    assert code == cls.code
    back = error_from_status(code, message)
    assert type(back) is cls
    assert str(back) == message


def test_unavailable_without_the_prefix_is_the_daemon() -> None:
    back = error_from_status(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert type(back) is errors.DaemonUnavailable
    back = error_from_status(grpc.StatusCode.UNAVAILABLE, "x " + errors.TIER_UNAVAILABLE_PREFIX)
    assert type(back) is errors.DaemonUnavailable  # a prefix, not anywhere in the message


def test_data_loss_without_the_prefix_is_a_checksum_mismatch() -> None:
    back = error_from_status(grpc.StatusCode.DATA_LOSS, "every copy of x found is corrupt")
    assert type(back) is errors.ChecksumMismatch
    back = error_from_status(grpc.StatusCode.DATA_LOSS, errors.CHECKPOINT_LOST_PREFIX + "run/s2")
    assert type(back) is errors.CheckpointLost and isinstance(back, errors.CheckpointNotFound)


def test_failed_precondition_without_the_prefix_is_an_incomplete_checkpoint() -> None:
    back = error_from_status(grpc.StatusCode.FAILED_PRECONDITION, "missing files: x")
    assert type(back) is errors.CheckpointIncomplete
    back = error_from_status(
        grpc.StatusCode.FAILED_PRECONDITION, errors.NO_PERSISTENT_TIER_PREFIX + "durable=true"
    )
    assert type(back) is errors.NoPersistentTier


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.CANCELLED,
    ],
)
def test_unknown_code_becomes_base_error(code: grpc.StatusCode) -> None:
    err = error_from_status(code, "details")
    assert type(err) is TierckptError
    assert str(err) == "details"


def test_status_of_foreign_and_base_errors_is_internal() -> None:
    assert status_of(ValueError("x")) == grpc.StatusCode.INTERNAL
    assert status_of(KeyError("x")) == grpc.StatusCode.INTERNAL
    assert status_of(TierckptError("x")) == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("cls", list(PREFIXED), ids=lambda c: c.__name__)
def test_the_reason_decides_without_the_prefix(cls: type[TierckptError]) -> None:
    """A daemon that sends the reason may word its message freely."""
    assert cls.reason
    back = error_from_status(cls.code, "reworded", cls.reason)
    assert type(back) is cls and str(back) == "reworded"
    # the reason of another code is not trusted: the code and the prefix decide
    other = next(c for c in PREFIXED if c.code != cls.code)
    assert type(error_from_status(cls.code, "x", other.reason)) is not other


def test_an_unknown_reason_falls_back_to_the_prefix() -> None:
    message = errors.TIER_UNAVAILABLE_PREFIX + "s3 down"
    back = error_from_status(grpc.StatusCode.UNAVAILABLE, message, "from-a-newer-daemon")
    assert type(back) is errors.TierUnavailable
    back = error_from_status(grpc.StatusCode.UNAVAILABLE, "s3 down", "from-a-newer-daemon")
    assert type(back) is errors.DaemonUnavailable


def test_reason_in_reads_the_trailing_metadata() -> None:
    assert errors.reason_in(None) == ""
    assert errors.reason_in([("grpc-retry-pushback-ms", "-1")]) == ""
    pairs = [("a", "b"), (errors.REASON_METADATA, b"checkpoint-lost")]
    assert errors.reason_in(pairs) == "checkpoint-lost"
