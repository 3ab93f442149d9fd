"""Per-tier completion: how far a checkpoint has got, and waiting until it gets further.

Why: a framework advances "latest" and runs its retention as soon as an async save
returns, before the checkpoint has a copy that survives a node (replicated) or every
memory tier (durable); a crash in that window can leave nothing loadable. The daemon
knows each tier's state (GetCheckpoint: the checkpoint's state and, per file, the node
that took it and the nodes holding copies); this module reads it for any way a caller
names a save and polls it with a backoff until the tier asked for is reached.

A checkpoint *reaches* a level once, and the levels are read from the daemon's answer:

- ``memory``: committed in the memory tier (state COMMITTED, REPLICATED or DURABLE);
- ``replicated``: every file is held by at least ``copies`` nodes (the node that took it
  plus the buddies listed as holding a verified copy);
- ``durable``: the persistent tier holds it, ``.metadata`` included (state DURABLE).

A save is named by a ``tierckpt://NAMESPACE/CHECKPOINT_ID`` URL (or ``NAMESPACE/ID``), a
`TieredStorageWriter` (its latest save), or what ``dcp.async_save`` returned (its
``Future`` or ``AsyncSaveResponse``: the save's `.metadata` names the checkpoint).
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import (
    TIER_TIMEOUT_PREFIX,
    CheckpointLost,
    CheckpointNotFound,
    InvalidArgument,
    TierTimeout,
)
from tierckpt.names import LATEST, METADATA_FILE, check_checkpoint_id, check_namespace
from tierckpt.records import CheckpointInfo

__all__ = [
    "CheckpointRef",
    "Tier",
    "TierState",
    "checkpoint_ref",
    "note_writer",
    "tier_state",
    "wait_for",
]

PROTOCOL_PREFIX = "tierckpt://"
DEFAULT_COPIES = 2  # the node that took each file and one buddy: survives losing a node
FIRST_POLL_S = 0.05
MAX_POLL_S = 2.0
DEFAULT_RPC_TIMEOUT_S = 30.0
_COMMITTED = ("COMMITTED", "REPLICATED", "DURABLE")

# (namespace, checkpoint id or "") -> the daemon this process's TieredStorageWriter saves
# it through (`note_writer`): a future's `.metadata` names the checkpoint, not the daemon.
_WRITERS: OrderedDict[tuple[str, str], str] = OrderedDict()
_WRITERS_MAX = 4096
_WRITERS_LOCK = threading.Lock()


class Tier(enum.StrEnum):
    """The protection levels a caller waits for, weakest first."""

    MEMORY = "memory"
    REPLICATED = "replicated"
    DURABLE = "durable"


@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint and the daemon to ask about it (None: ``$TIERCKPT_DAEMON`` or the
    default socket)."""

    namespace: str
    checkpoint_id: str
    daemon: str | None = None

    @property
    def url(self) -> str:
        return f"{PROTOCOL_PREFIX}{self.namespace}/{self.checkpoint_id}"


@dataclass(frozen=True)
class TierState:
    """How far one checkpoint has got, as its daemon answered.

    `copies` is the fewest nodes holding any one of its files (0 when it lists none): the
    node that took the file plus the nodes the daemon lists as holding a verified copy
    (the replica lists travel in the checkpoint's manifests, so a node other than the
    owner counts a buddy's copy once that manifest reached it). `fewest_copies_file` names
    the file with the fewest, which a replicated wait's timeout reports."""

    namespace: str
    checkpoint_id: str
    state: str
    in_memory: bool
    copies: int
    durable: bool
    fewest_copies_file: str = ""

    @classmethod
    def of(cls, info: CheckpointInfo) -> TierState:
        holders = {
            f.name: len({n for n in (f.owner_node, *f.replica_nodes) if n}) for f in info.files
        }
        fewest = min(holders, key=lambda n: (holders[n], n)) if holders else ""
        return cls(
            namespace=info.namespace,
            checkpoint_id=info.checkpoint_id,
            state=info.state,
            in_memory=info.state in _COMMITTED,
            copies=holders[fewest] if fewest else 0,
            durable=info.state == "DURABLE",
            fewest_copies_file=fewest,
        )

    def reached(self, tier: Tier | str, copies: int = DEFAULT_COPIES) -> bool:
        """Whether `tier` is reached (`copies`: the holders each file needs, for
        REPLICATED)."""
        tier = Tier(tier)
        if tier is Tier.MEMORY:
            return self.in_memory
        if tier is Tier.REPLICATED:
            return self.in_memory and self.copies >= copies
        return self.durable

    def levels(self) -> dict[str, Any]:
        """{"memory": bool, "replicated": copies, "durable": bool}: the `tierckpt ls/info
        --json` and fsspec `info()` shape."""
        return {
            Tier.MEMORY.value: self.in_memory,
            Tier.REPLICATED.value: self.copies if self.in_memory else 0,
            Tier.DURABLE.value: self.durable,
        }


@runtime_checkable
class _TieredWriter(Protocol):
    namespace: str
    client: DaemonClient

    @property
    def checkpoint_id(self) -> str | None: ...


def _parse(text: str, daemon: str | None) -> CheckpointRef:
    """``tierckpt://NS/ID`` or ``NS/ID`` (names validated); the id may be a folder path
    (``team/run1/step-10``: namespace ``team``, id ``run1/step-10``)."""
    body = text[len(PROTOCOL_PREFIX) :] if text.startswith(PROTOCOL_PREFIX) else text
    namespace, _, checkpoint_id = body.strip("/").partition("/")
    if not checkpoint_id:
        raise InvalidArgument(
            f"{text[:160]!r} does not name one checkpoint: use tierckpt://NAMESPACE/CHECKPOINT_ID "
            "or NAMESPACE/CHECKPOINT_ID"
        )
    return CheckpointRef(check_namespace(namespace), check_checkpoint_id(checkpoint_id), daemon)


def note_writer(namespace: str, daemon: str, checkpoint_id: str = "") -> None:
    """Remember the daemon a TieredStorageWriter of this process saves `namespace`
    (`checkpoint_id`: that save; "": any, when the writer is made) through, so a wait on
    a future of its saves asks that daemon. The writer calls it when made (in the process
    that calls ``dcp.async_save``) and when a save begins (the saving process)."""
    with _WRITERS_LOCK:
        _WRITERS[(namespace, checkpoint_id)] = daemon
        _WRITERS.move_to_end((namespace, checkpoint_id))
        while len(_WRITERS) > _WRITERS_MAX:
            _WRITERS.popitem(last=False)


def _saved_through(ref: CheckpointRef) -> CheckpointRef:
    """`ref` on the daemon this process's writer saved it (else its latest writer of the
    namespace) through, unless a daemon was named; no writer: the default daemon, which
    the fsspec route uses."""
    if ref.daemon is not None:
        return ref
    with _WRITERS_LOCK:
        daemon = _WRITERS.get((ref.namespace, ref.checkpoint_id)) or _WRITERS.get(
            (ref.namespace, "")
        )
    return CheckpointRef(ref.namespace, ref.checkpoint_id, daemon)


def _from_metadata(metadata: Any, daemon: str | None) -> CheckpointRef:
    """The checkpoint a DCP save's returned `Metadata` names (its ``storage_meta``)."""
    meta = getattr(metadata, "storage_meta", None)
    named = str(getattr(meta, "checkpoint_id", "") or "")
    if not named.startswith(PROTOCOL_PREFIX):
        raise InvalidArgument(
            f"the save's metadata names {named[:160]!r}, not a tierckpt:// checkpoint: wait on "
            "a save made with TieredStorageWriter or a tierckpt:// checkpoint_id"
        )
    return _saved_through(_parse(named, daemon))


def _future_of(target: Any) -> concurrent.futures.Future[Any] | None:
    """The upload future of what ``dcp.async_save`` returned (a Future, or an
    AsyncSaveResponse's ``upload_completion``); None for anything else."""
    upload = getattr(target, "upload_completion", None)
    if isinstance(upload, concurrent.futures.Future):
        return upload
    return target if isinstance(target, concurrent.futures.Future) else None


def checkpoint_ref(
    target: Any, *, daemon: str | None = None, timeout: float | None = None
) -> CheckpointRef:
    """The checkpoint `target` names: a `CheckpointRef`, a ``tierckpt://NS/ID`` or
    ``NS/ID`` string, a TieredStorageWriter (its latest save, on its daemon), or an
    async_save future (waited for up to `timeout` s, None: until done; its result names
    the checkpoint, asked of the daemon this process's writer saved it through; a failed
    save raises its error here).

    Raises:
        TierTimeout: the future did not finish within `timeout` (tier "memory").
        InvalidArgument / InvalidName: `target` names no tierckpt checkpoint.
    """
    if isinstance(target, CheckpointRef):
        return target
    if isinstance(target, str):
        return _parse(target, daemon)
    future = _future_of(target)
    if future is not None:
        try:
            metadata = future.result(timeout=None if timeout is None else max(timeout, 0.0))
        except concurrent.futures.TimeoutError:
            raise TierTimeout(
                f"{TIER_TIMEOUT_PREFIX}memory tier: the async save did not finish within "
                f"{timeout or 0.0:.1f} s "
                "(nothing is committed yet)",
                tier=Tier.MEMORY.value,
            ) from None
        return _from_metadata(metadata, daemon)
    if isinstance(target, _TieredWriter):
        checkpoint_id = target.checkpoint_id
        if not checkpoint_id:
            raise InvalidArgument("the TieredStorageWriter has not saved yet: no checkpoint id")
        return CheckpointRef(
            check_namespace(target.namespace),
            check_checkpoint_id(checkpoint_id),
            daemon or target.client.address,
        )
    path = str(getattr(target, "path", "") or "")  # DCP's fsspec writer of a tierckpt:// URL
    if path.startswith(PROTOCOL_PREFIX):
        return _parse(path, daemon)
    raise InvalidArgument(
        f"cannot tell which checkpoint {type(target).__name__} names: pass a tierckpt:// id, "
        "a TieredStorageWriter or what dcp.async_save returned"
    )


def _resolved(ref: CheckpointRef, client: DaemonClient) -> CheckpointRef:
    if ref.checkpoint_id != LATEST:
        return ref
    newest = client.get_checkpoint(ref.namespace, None).checkpoint_id
    return CheckpointRef(ref.namespace, newest, ref.daemon)


def _state(client: DaemonClient, ref: CheckpointRef) -> TierState:
    info = client.get_checkpoint(ref.namespace, ref.checkpoint_id)
    return TierState.of(info)


def tier_state(target: Any, *, daemon: str | None = None) -> TierState:
    """Where `target` (see `checkpoint_ref`) is now; an async_save future is waited for.

    Raises:
        CheckpointNotFound: it is not committed (yet) or was removed.
    """
    ref = checkpoint_ref(target, daemon=daemon)
    client = DaemonClient(ref.daemon)
    try:
        return _state(client, _resolved(ref, client))
    finally:
        client.close()


def _shortfall(tier: Tier, copies: int, seen: TierState | None, ref: CheckpointRef) -> str:
    """What is still missing, for the timeout's message."""
    if seen is None or not seen.in_memory:
        return f"{ref.url} is not committed on the daemon asked"
    if tier is Tier.REPLICATED:
        return (
            f"{seen.fewest_copies_file or 'a file'} of {ref.url} is held by {seen.copies} "
            f"node(s), {copies} wanted (a cluster of at least {copies} nodes with "
            f"[replication] copies >= {copies - 1} replicates it)"
        )
    if tier is Tier.DURABLE:
        return (
            f"the persistent tier does not hold {ref.url}'s commit marker yet ({METADATA_FILE}, "
            f"or for a format-neutral checkpoint its bookkeeping marker; state "
            f"{seen.state}; is [persistent] url set, and is the drain due or the save "
            "made with durable=True?)"
        )
    return f"{ref.url} is {seen.state}"


def wait_for(
    target: Any,
    tier: Tier | str = Tier.MEMORY,
    *,
    copies: int = DEFAULT_COPIES,
    timeout: float = 600.0,
    daemon: str | None = None,
) -> TierState:
    """Block until `target` (see `checkpoint_ref`) reaches `tier`; its state then.

    Polls the daemon with a backoff (first after 50 ms, at most every 2 s), so a reached
    tier ends the wait quickly. `copies` (REPLICATED only) counts the nodes that must hold
    every file, the node that took it included. A checkpoint not committed yet is waited
    for (the id of an async save that is still writing).

    Raises:
        TierTimeout: `tier` not reached within `timeout` s; the message names the tier
            and what is missing (``err.tier``).
        CheckpointLost: a file of it has no copy left on any tier: it never will be.
        InvalidArgument: `copies` < 1, or `target` names no tierckpt checkpoint.
    """
    tier = Tier(tier)
    if copies < 1:
        raise InvalidArgument(f"copies must be at least 1, not {copies}")
    deadline = time.monotonic() + timeout
    ref = checkpoint_ref(target, daemon=daemon, timeout=timeout)
    # One query never outlasts the wait by much (a stuck daemon: DaemonTimeout).
    client = DaemonClient(ref.daemon, timeout_s=min(DEFAULT_RPC_TIMEOUT_S, max(timeout, 1.0)))
    seen: TierState | None = None
    pause = FIRST_POLL_S
    try:
        while True:
            try:
                ref = _resolved(ref, client)
                seen = _state(client, ref)
            except CheckpointLost:
                raise
            except CheckpointNotFound:
                seen = None  # not committed yet (or removed): keep asking until the deadline
            if seen is not None:
                if seen.state == "LOST":
                    raise CheckpointLost(
                        f"{ref.url} is LOST (a file has no copy left on any tier): it cannot "
                        f"reach the {tier.value} tier"
                    )
                if seen.reached(tier, copies):
                    return seen
            left = deadline - time.monotonic()
            if left <= 0:
                raise TierTimeout(
                    f"{TIER_TIMEOUT_PREFIX}{tier.value} tier not reached within {timeout:.1f} s: "
                    + _shortfall(tier, copies, seen, ref),
                    tier=tier.value,
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, MAX_POLL_S)
    finally:
        client.close()
