"""Errors of tierckpt and the one table that maps them to and from gRPC status codes.

Every error derives from a builtin so callers can catch it generically
(`FileNotFoundError`, `MemoryError`, ...), and pickles with its message, because DCP
gathers per-rank exceptions across processes.

A subtype that shares its status code with another (`TierUnavailable` and
`DaemonUnavailable` are both UNAVAILABLE) has a `reason`, which the daemon sends in the
trailing metadata `REASON_METADATA`; its message also starts with the subtype's prefix,
which is all a daemon that predates the reason sends, and what a client falls back on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import grpc

__all__ = [
    "CheckpointExists",
    "CheckpointIncomplete",
    "CheckpointLost",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "DaemonTimeout",
    "DaemonUnavailable",
    "InvalidArgument",
    "InvalidName",
    "MemoryBudgetExceeded",
    "NoPersistentTier",
    "NotAJobNode",
    "PermissionDenied",
    "TierTimeout",
    "TierUnavailable",
    "TierckptError",
    "UnsafeMetadata",
    "error_from_status",
    "reason_in",
    "status_of",
]

# Trailing metadata carrying a subtype's `reason` (set by the daemon's status mapping).
REASON_METADATA = "x-tierckpt-reason"


class TierckptError(Exception):
    """Base class of every tierckpt error; `code` is the gRPC status it travels as, and
    `reason` ("" unless the code is shared) tells it apart from others of that code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = ""


class InvalidArgument(TierckptError, ValueError):
    """A request the daemon cannot accept as sent (wrong size, malformed checksums, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidName(InvalidArgument):
    """A namespace, checkpoint id or file name outside the allowed grammar."""


class UnsafeMetadata(InvalidArgument):
    """A `.metadata` that is not plain DCP metadata (a class outside the allow-list, or
    the wrong shape): it is refused, never executed."""


class PermissionDenied(TierckptError, PermissionError):
    """The caller may not do this: another uid's namespace, or a peer asking for what it
    does not coordinate or hold."""

    code = grpc.StatusCode.PERMISSION_DENIED


class CheckpointExists(TierckptError, FileExistsError):
    """Raised when a save would change what is already there: a `BeginCheckpoint` of an
    id already committed on the node by a save that does not overwrite
    (`TieredStorageWriter(overwrite=False)`), or a file opened or committed twice in one
    save. Save under a new `checkpoint_id`, save with overwrite (the default: an atomic
    replace), or remove the old one first with `tierckpt rm`."""

    code = grpc.StatusCode.ALREADY_EXISTS


class CheckpointNotFound(TierckptError, FileNotFoundError):
    """Raised when the namespace, checkpoint or file asked for is not known to the
    daemon or to any tier it asked (never saved, removed, or evicted from memory with no
    copy elsewhere). List what there is (`tierckpt ls`, `list_checkpoints`) or load with
    ``checkpoint_id=None`` for the newest complete one. `CheckpointLost` is the subtype
    for a committed checkpoint whose file has no copy left."""

    code = grpc.StatusCode.NOT_FOUND


class CheckpointLost(CheckpointNotFound):
    """A committed checkpoint some file of which has no copy left on any tier: every node
    that held one answered without it and the persistent tier does not hold it (it is
    listed LOST). Not a checksum error: no copy was found at all. Load an older one
    (`checkpoint_id=None` picks the newest complete one). Travels as DATA_LOSS with a
    message starting with `CHECKPOINT_LOST_PREFIX`; a `CheckpointNotFound` to callers
    that only ask whether it can be had."""

    code = grpc.StatusCode.DATA_LOSS
    reason = "checkpoint-lost"


CHECKPOINT_LOST_PREFIX = "checkpoint lost: "


class MemoryBudgetExceeded(TierckptError, MemoryError):
    """Raised when the memory tier cannot admit what a save or restore needs: its budget
    (``[memory] budget``) is held by checkpoints it may not evict yet (pinned, not yet
    durable, being read), or a count limit such as ``max_namespaces`` is reached. The
    message names the limit. Retry after a drain makes older checkpoints durable, unpin
    or remove some (`tierckpt rm`), or raise the budget."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class CheckpointIncomplete(TierckptError, RuntimeError):
    """Raised when a call comes out of order for the checkpoint's state: a commit while
    files are missing or still open, a write to a checkpoint that is not WRITING (never
    begun, committed, or aborted after ``[memory] abandon_after`` idle seconds), an abort
    of a committed one. The message says which; a save that hit it is best restarted
    under a new `checkpoint_id`."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ChecksumMismatch(TierckptError, OSError):
    """Raised when bytes do not match their recorded block checksums (or a stored copy is
    damaged: a zstd frame that does not decode, an object shorter than recorded) and no
    valid copy could be found on any tier. Nothing damaged is installed or returned.
    Load an older checkpoint, or restore this one after a good copy is back (a peer that
    holds one rejoining)."""

    code = grpc.StatusCode.DATA_LOSS


class DaemonUnavailable(TierckptError, ConnectionError):
    """Raised by the client when tierckptd cannot be reached at its address (not
    started, crashed, or a wrong ``TIERCKPT_DAEMON`` / ``daemon=``). Start it or point
    the client at the running one; the call may be retried as it is. Not to be confused
    with `TierUnavailable`: there the daemon answered and a tier behind it is down."""

    code = grpc.StatusCode.UNAVAILABLE


class TierUnavailable(TierckptError, ConnectionError):
    """The daemon answered, but a tier it needed could not be reached (a peer down, an S3
    outage or refusal): the copy may exist there. Retry once the named tier is back.
    Travels as UNAVAILABLE with a message starting with `TIER_UNAVAILABLE_PREFIX`."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "tier-unavailable"


TIER_UNAVAILABLE_PREFIX = "tier unavailable: "


class NoPersistentTier(TierckptError, RuntimeError):
    """A request needs the persistent tier (e.g. a commit with the durable hint) and the
    daemon has none (`[persistent] url` unset). Travels as FAILED_PRECONDITION with a
    message starting with `NO_PERSISTENT_TIER_PREFIX`."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "no-persistent-tier"


NO_PERSISTENT_TIER_PREFIX = "no persistent tier: "


class NotAJobNode(TierckptError, RuntimeError):
    """A cluster rm/pin/unpin asked of a node that neither coordinates the checkpoint nor
    wrote one of its files (its peers take marks only from such nodes); the message names
    the nodes to ask. Travels as FAILED_PRECONDITION with a message starting with
    `NOT_A_JOB_NODE_PREFIX`."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "not-a-job-node"


NOT_A_JOB_NODE_PREFIX = "not a node of the checkpoint: "


class DaemonTimeout(TierckptError, TimeoutError):
    """Raised by the client when tierckptd did not answer within the client's timeout
    (``timeout_s``): the daemon is overloaded or stuck. What the call asked may or may
    not have happened, so a retry may meet its effect (`CheckpointExists` for a file
    already opened); queries can simply be retried, with a longer timeout if the work is
    large."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TierTimeout(TierckptError, TimeoutError):
    """A wait for a checkpoint to reach a tier (`tierckpt.wait_for`, `tierckpt wait`)
    ran out of time: `tier` ("memory", "replicated", "durable") names the tier, the
    message what was still missing. Nothing is wrong with the checkpoint by itself: it
    may reach the tier later (a drain that is not due yet, a buddy that is down); do not
    advance "latest" or run retention on the strength of it. Raised by the client; shares
    DEADLINE_EXCEEDED with `DaemonTimeout`, its message starts with `TIER_TIMEOUT_PREFIX`."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "tier-timeout"

    def __init__(self, message: str = "", *, tier: str = "") -> None:
        super().__init__(message)
        self.tier = tier  # in __dict__: pickled with the message


TIER_TIMEOUT_PREFIX = "tier timeout: "


_BY_CODE: dict[grpc.StatusCode, type[TierckptError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        CheckpointExists,
        CheckpointNotFound,
        MemoryBudgetExceeded,
        CheckpointIncomplete,
        ChecksumMismatch,
        DaemonUnavailable,
        DaemonTimeout,
        PermissionDenied,
    )
}


def status_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status a server aborts with for `error`."""
    return error.code if isinstance(error, TierckptError) else grpc.StatusCode.INTERNAL


# The subtypes that share a code, and the prefix of their messages (older daemons' only mark).
_PREFIXES: dict[type[TierckptError], str] = {
    TierUnavailable: TIER_UNAVAILABLE_PREFIX,
    NoPersistentTier: NO_PERSISTENT_TIER_PREFIX,
    NotAJobNode: NOT_A_JOB_NODE_PREFIX,
    CheckpointLost: CHECKPOINT_LOST_PREFIX,
    TierTimeout: TIER_TIMEOUT_PREFIX,
}
_BY_REASON: dict[str, type[TierckptError]] = {cls.reason: cls for cls in _PREFIXES}


def reason_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The `REASON_METADATA` value in a call's trailing metadata ("" when there is none)."""
    for key, value in metadata or ():
        if key == REASON_METADATA:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return ""


def error_from_status(code: grpc.StatusCode, message: str, reason: str = "") -> TierckptError:
    """The client-side exception for a failed RPC; unknown codes become TierckptError.

    `reason` is the answer's `REASON_METADATA` (`reason_in`); without one that this
    client knows for `code` (an older daemon), the message's prefix decides.
    """
    known = _BY_REASON.get(reason)
    if known is not None and known.code == code:
        return known(message)
    for cls, prefix in _PREFIXES.items():
        if code == cls.code and message.startswith(prefix):
            return cls(message)
    return _BY_CODE.get(code, TierckptError)(message)
