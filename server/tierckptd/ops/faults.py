"""Named fault points: compiled in, inert unless `TIERCKPT_FAULT` names one.

Chaos testing needs to stop the daemon at exact moments (after a manifest is written,
between a data upload and its marker, in the middle of a replica's chunks), not only at
random ones. Each such moment calls `fault("name")`, a single dictionary check when
nothing is armed. The environment is read once, at import::

    TIERCKPT_FAULT=commit.after_manifest:kill           SIGKILL this process there
    TIERCKPT_FAULT=drain.marker:delay=2.5               sleep 2.5 s there, every time
    TIERCKPT_FAULT=peer.push.chunk:error@3              fail the 3rd time only
    TIERCKPT_FAULT=save.begin:error,drain.upload:kill@2 several points, comma-separated

`error` raises what a real failure of that step raises (by default `InjectedFault`, an
`OSError` with EIO; a call site may pass its own, e.g. a `PeerCallError`), so the
caller's ordinary error path runs. Without `@N` an action fires at every hit; with it,
at the Nth hit only. A name that is not in `POINTS` (a typo) stops the daemon at start
with a message listing the known names, rather than arming nothing silently.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "ENV",
    "POINTS",
    "FaultSpec",
    "FaultSpecError",
    "InjectedFault",
    "armed",
    "fault",
    "parse",
]

logger = logging.getLogger(__name__)

ENV = "TIERCKPT_FAULT"

# Every point, with where it sits. A test checks that each one is called in server/ and
# that every call names one of these.
POINTS: Mapping[str, str] = MappingProxyType(
    {
        "save.begin": "Catalog.begin, before the save is recorded",
        "save.reserve": "Catalog.reserve, before the budget admits the reservation",
        "save.open_file": "Catalog.open_file, before the file is created or recycled",
        "save.commit_file": "Catalog.commit_file, before the file is checked and sealed",
        "save.commit_file.sealed": "Catalog.commit_file, sealed on disk, not yet recorded",
        "commit.before_manifest": "Catalog.commit, before the manifest is written",
        "commit.after_manifest": "Catalog.commit, manifest on disk, record not yet committed",
        "commit.before_publish": "CommitCoordinator.commit, committed here, listeners not told yet",
        "peer.holdings": "PeerClient.holdings, asking a peer what it holds",
        "peer.publish": "PeerClient.publish, giving one peer the manifest",
        "peer.apply_mark": "PeerClient.apply_mark, telling one peer of a cluster rm/pin",
        "peer.push.chunk": "PeerClient.push, each chunk of a replica sent",
        "peer.receive.chunk": "PushFile handler, each chunk of a replica received",
        "peer.offer": "Pusher, before a replica is offered to a peer (OfferFile)",
        "peer.receive.offered": "OfferFile handler, each piece of an offered replica landed",
        "peer.fetch.chunk": "PeerClient.fetch, each chunk of a file fetched",
        "peer.serve.chunk": "PeerService.FetchFile, each chunk of a file served",
        "peer.grant": "PeerClient.grant, asking a peer for a bulk transfer",
        "peer.bulk.chunk": "PeerClient.fetch_bulk, each piece of a bulk stream received",
        "peer.bulk.send": "BulkServer, a granted range accepted, before its bytes are sent",
        "drain.retire_metadata": "Drainer._drain of a re-saved id, the replaced generation's "
        ".metadata removed from the persistent tier, no byte of the new one up yet",
        "drain.upload": "Drainer._upload, before each data file goes up",
        "drain.marker": "PersistentTier.upload_file, data file up, its marker not yet",
        "drain.metadata": "Drainer._commit, every data file up, .metadata not yet",
        "drain.after_metadata": "Drainer._commit, .metadata up, not yet marked durable here",
        "retention.evict": "Catalog._apply_retention, before each eviction",
        "pool.recycle": "WarmPool.to_pool, before a file is renamed into the pool",
        "pool.reuse": "WarmPool.take_segment, before a segment becomes a data file",
        "adopt.checkpoint": "adoption at start, before each manifest's files are verified",
    }
)


class FaultSpecError(ValueError):
    """`TIERCKPT_FAULT` does not parse, or names an unknown point."""


class InjectedFault(OSError):
    """The default failure of an `error` fault: an I/O error, handled as a real one."""

    def __init__(self, point: str) -> None:
        super().__init__(errno.EIO, f"injected fault at {point} ({ENV})")
        self.point = point


@dataclass
class FaultSpec:
    """One armed point: `action` is "kill", "error" or "delay"; `at` the hit it fires
    on (0: every hit); `hits` counts the hits so far."""

    point: str
    action: str
    seconds: float = 0.0
    at: int = 0
    hits: int = 0


def _known() -> str:
    return ", ".join(sorted(POINTS))


def _one(item: str) -> FaultSpec:
    point, sep, action = item.partition(":")
    point, action = point.strip(), action.strip()
    if not sep or not point or not action:
        raise FaultSpecError(
            f"{ENV}: {item!r} is not POINT:ACTION (ACTION: kill, error or delay=SECONDS, "
            "optionally @N for the Nth hit only)"
        )
    if point not in POINTS:
        raise FaultSpecError(f"{ENV}: unknown fault point {point!r}; known points: {_known()}")
    at = 0
    if "@" in action:
        action, _, count = action.partition("@")
        if not count.isdigit() or int(count) < 1:
            raise FaultSpecError(f"{ENV}: {item!r}: @N needs a whole number N >= 1")
        at = int(count)
    seconds = 0.0
    if action.startswith("delay="):
        try:
            seconds = float(action[len("delay=") :])
        except ValueError:
            seconds = -1.0
        if not seconds >= 0.0 or seconds == float("inf"):
            raise FaultSpecError(f"{ENV}: {item!r}: delay=SECONDS needs a finite number >= 0")
        action = "delay"
    if action not in ("kill", "error", "delay"):
        raise FaultSpecError(
            f"{ENV}: {item!r}: unknown action {action!r}; use kill, error or delay=SECONDS"
        )
    return FaultSpec(point, action, seconds, at)


def parse(text: str) -> dict[str, FaultSpec]:
    """The armed points of a `TIERCKPT_FAULT` value (empty: none)."""
    armed: dict[str, FaultSpec] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        spec = _one(item)
        if spec.point in armed:
            raise FaultSpecError(f"{ENV}: fault point {spec.point!r} is named twice")
        armed[spec.point] = spec
    return armed


def _from_environment() -> dict[str, FaultSpec]:
    try:
        return parse(os.environ.get(ENV, ""))
    except FaultSpecError as e:
        # At import, i.e. daemon start: refuse to run with a fault that would never fire.
        raise SystemExit(f"tierckptd: {e}") from None


_ARMED = _from_environment()
_LOCK = threading.Lock()


def armed() -> dict[str, FaultSpec]:
    """The points armed in this process (a copy)."""
    return dict(_ARMED)


def fault(point: str, error: Callable[[], BaseException] | None = None) -> None:
    """The fault point `point`: nothing unless `TIERCKPT_FAULT` armed it.

    Args:
        error: builds the exception an `error` fault raises here (default: InjectedFault).
    """
    if not _ARMED:
        return
    spec = _ARMED.get(point)
    if spec is None:
        return
    with _LOCK:
        spec.hits += 1
        if spec.at and spec.hits != spec.at:
            return
    logger.warning("fault %s fires: %s (hit %d, %s)", point, spec.action, spec.hits, ENV)
    if spec.action == "kill":
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.action == "delay":
        time.sleep(spec.seconds)
    else:
        raise error() if error is not None else InjectedFault(point)
