"""Cluster-wide marks (rm, pin, unpin, verified, bad) and the journal that keeps them
across restarts.

A mark says what a user asked one node to do to a checkpoint everywhere. Each node keeps
per checkpoint the newest delete mark, the newest pin-or-unpin mark and the newest
verified-or-bad (trust) mark (newest stamp wins, ties broken by origin node id): a delete
removes every copy committed at or before its stamp, so a later pin cannot undo it and a
re-save after it is not removed; a trust mark older than the checkpoint's delete mark
said something of the deleted checkpoint, never of a re-save under its id (`trust`).

The journal is one JSON file under `memory.dir`, replaced atomically after every change
and validated entry by entry on load (it is in a directory ranks can read). It is
bounded: marks older than `MAX_AGE` and, beyond `MAX_MARKS` checkpoints, the oldest are
dropped. It is what a node serves in ListManifests, so a node that was down learns every
mark on return, and what a restarted node re-applies to its own adopted checkpoints.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierckpt.errors import InvalidArgument, TierckptError
from tierckpt.names import check_checkpoint_id, check_namespace
from tierckpt.trust import Trust as TrustState
from tierckpt.trust import check_reason

from tierckptd.memory.manifest import atomic_write
from tierckptd.model import CLOCK_SKEW, Key, TrustMark

__all__ = ["MAX_AGE", "MAX_MARKS", "Mark", "MarkJournal", "MarkKind", "check_mark"]

TRUST_KINDS: dict[str, TrustState] = {"verified": TrustState.VERIFIED, "bad": TrustState.BAD}

logger = logging.getLogger(__name__)

MAX_MARKS = 16_384  # checkpoints with a mark in the journal (and in a ListManifests answer)
MAX_AGE = 30 * 86_400.0  # a node down longer than this does not learn the mark
MAX_JOURNAL_BYTES = 16 << 20
JOURNAL_NAME = "marks.json"
_VERSION = 1


class MarkKind(enum.Enum):
    """What a mark does (names match peer.proto MarkKind)."""

    DELETED = "deleted"
    PINNED = "pinned"
    UNPINNED = "unpinned"
    VERIFIED = "verified"
    BAD = "bad"

    @property
    def slot(self) -> str:
        """Which newest mark of a checkpoint this kind competes with: "deleted", "pin"
        (pinned, unpinned) or "trust" (verified, bad)."""
        if self is MarkKind.DELETED:
            return "deleted"
        return "trust" if self.value in TRUST_KINDS else "pin"


@dataclass(frozen=True)
class Mark:
    """One cluster operation on a checkpoint, as the origin node applied it."""

    namespace: str
    checkpoint_id: str
    kind: MarkKind
    stamp: float  # the origin's wall clock when it applied it
    origin: str  # the node a user asked
    # The uid that asked, under `[security] local_isolation = "uid"` when it is no
    # operator (None otherwise): peers apply it only to that uid's checkpoints.
    uid: int | None = None
    # The stamp as this node applies it (audit 3 H6): the origin's, or this node's clock
    # when it first learnt a mark stamped ahead of it (0: the stamp itself). Kept in the
    # journal, so re-learning or replaying the mark never moves it later: a save of the
    # id after that time here is a re-save, whatever the origin's clock said.
    applied: float = 0.0
    reason: str = ""  # a trust mark's why (`tierckpt mark ... --reason`), shown in `ls`

    @property
    def key(self) -> Key:
        return self.namespace, self.checkpoint_id

    @property
    def applied_stamp(self) -> float:
        """The stamp a delete tombstones up to here (`applied`)."""
        return self.applied or self.stamp

    def order(self) -> tuple[float, str]:
        """Newer sorts higher: the stamp, then the origin node id (ties)."""
        return self.stamp, self.origin

    def __str__(self) -> str:
        return f"{self.kind.value} {self.namespace}/{self.checkpoint_id} by {self.origin}"


def check_mark(
    namespace: str,
    checkpoint_id: str,
    kind: MarkKind,
    stamp: float,
    origin: str,
    *,
    now: float,
) -> Mark:
    """A validated mark: names checked, a finite stamp after the epoch (InvalidName /
    InvalidArgument). A stamp ahead of `now` (the origin's clock is ahead) is taken, not
    refused (audit 3 H6: an rm there answered ok while its peers kept the checkpoint):
    order between marks stays the stamps', and it is applied at `now` (`Mark.applied`)."""
    check_namespace(namespace)
    check_checkpoint_id(checkpoint_id)
    try:
        check_namespace(origin)
    except InvalidArgument:
        raise InvalidArgument(f"invalid origin node id {origin[:64]!r} of a mark") from None
    if not isinstance(stamp, float | int) or not math.isfinite(stamp) or stamp <= 0:
        raise InvalidArgument(f"the stamp of a mark on {namespace}/{checkpoint_id} is not a time")
    if stamp > now + CLOCK_SKEW:
        logger.warning(
            "the mark on %s/%s from %s is stamped %.0f s ahead of this node's clock: "
            "applied at this node's time; fix the node clocks (NTP)",
            namespace,
            checkpoint_id,
            origin[:64],
            stamp - now,
        )
    applied = float(now) if stamp > now else 0.0
    return Mark(namespace, checkpoint_id, kind, float(stamp), origin, applied=applied)


@dataclass
class _Entry:
    deleted: Mark | None = None
    pin: Mark | None = None
    trust: Mark | None = None
    url: str | None = None  # a delete from the persistent tier this node still owes

    def all(self) -> list[Mark]:
        return [m for m in (self.deleted, self.pin, self.trust) if m is not None]

    def get(self, slot: str) -> Mark | None:
        mark: Mark | None = getattr(self, slot)
        return mark

    def newest(self) -> float:
        return max(m.stamp for m in self.all())

    def live_trust(self) -> Mark | None:
        """The trust mark, unless a delete came after it (it spoke of what was deleted;
        a re-save under the id is unmarked)."""
        t = self.trust
        if t is None or (self.deleted is not None and self.deleted.order() >= t.order()):
            return None
        return t


class MarkJournal:
    """The marks this node knows, persisted under `directory` (thread-safe; its lock is
    taken under the catalog lock, never the other way round)."""

    def __init__(
        self,
        directory: Path,
        *,
        wall_clock: Callable[[], float] = time.time,
        max_marks: int = MAX_MARKS,
        max_age: float = MAX_AGE,
    ) -> None:
        self.path = directory / JOURNAL_NAME
        self._wall = wall_clock
        self.max_marks = max_marks
        self.max_age = max_age
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._unsaved = False  # a change kept in memory that the file does not have yet
        self._load()

    # ---- queries ----------------------------------------------------------------------
    def marks(self, namespace: str = "") -> list[Mark]:
        """Every mark (of `namespace`, or all), oldest first."""
        with self._lock:
            found = [
                m
                for key, e in self._entries.items()
                if not namespace or key[0] == namespace
                for m in e.all()
            ]
        return sorted(found, key=Mark.order)

    def deleted(self, namespace: str, checkpoint_id: str) -> Mark | None:
        with self._lock:
            e = self._entries.get((namespace, checkpoint_id))
            return e.deleted if e is not None else None

    def pins(self, namespace: str) -> dict[str, bool]:
        """checkpoint id -> pinned, per the newest pin or unpin mark of each."""
        with self._lock:
            return {
                key[1]: e.pin.kind is MarkKind.PINNED
                for key, e in self._entries.items()
                if key[0] == namespace and e.pin is not None
            }

    def trust(self, namespace: str) -> dict[str, Mark]:
        """checkpoint id -> its trust mark (verified or bad), per the newest trust mark
        of each that no delete mark followed."""
        with self._lock:
            found = {
                key[1]: e.live_trust() for key, e in self._entries.items() if key[0] == namespace
            }
        return {cid: m for cid, m in found.items() if m is not None}

    def trust_states(self, namespace: str) -> dict[str, TrustMark]:
        """`CatalogEvents.trust_marks`: checkpoint id -> its live trust mark (`trust`)."""
        return {
            cid: TrustMark(TRUST_KINDS[m.kind.value], m.reason, m.stamp, m.origin)
            for cid, m in self.trust(namespace).items()
        }

    def owed(self) -> dict[Key, str]:
        """Checkpoints this node still has to delete from the persistent tier (its URL)."""
        with self._lock:
            return {k: e.url for k, e in self._entries.items() if e.url is not None}

    def is_new(self, mark: Mark) -> bool:
        """Whether `merge(mark)` would change anything (no newer mark of its kind)."""
        with self._lock:
            e = self._entries.get(mark.key)
            if e is None:
                return True
            known = e.get(mark.kind.slot)
            return known is None or known.order() < mark.order()

    @property
    def unsaved(self) -> bool:
        """A change is only in memory: the last write of the journal failed (`flush`)."""
        with self._lock:
            return self._unsaved

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # ---- changes ----------------------------------------------------------------------
    def merge(self, mark: Mark, *, keep_unsaved: bool = False) -> bool:
        """Keep `mark` if it is newer than what is known of its kind (persisted before
        this returns); True when it changed anything.

        When the journal cannot be written (a full tmpfs: MemoryBudgetExceeded, an
        OSError), the change is undone and the error raised, unless `keep_unsaved`: then
        the mark is kept in memory, `unsaved` is set and the caller retries `flush`
        (a peer's mark: this node must not refuse what its peers already did, and it
        learns the mark again from them if it stops before the write succeeds)."""
        with self._lock:
            before = self._entries.get(mark.key)
            e = dataclasses.replace(before) if before is not None else _Entry()
            known = e.get(mark.kind.slot)
            if known is not None and known.order() >= mark.order():
                return False
            setattr(e, mark.kind.slot, mark)
            entries = dict(self._entries)
            self._entries[mark.key] = e
            self._bound()
            try:
                self._save()
            except (TierckptError, OSError) as err:
                if not keep_unsaved:
                    self._entries = entries
                    raise
                self._unsaved = True
                logger.error(
                    "cannot write the marks journal %s (%.200s): %s is kept in memory and "
                    "the write is retried",
                    self.path,
                    err,
                    mark,
                )
            return mark.key in self._entries

    def flush(self) -> bool:
        """Write a change `merge(keep_unsaved=True)` or `owe` could not write; True when
        there was one. Raises what the write raises (retry later)."""
        with self._lock:
            if not self._unsaved:
                return False
            self._save()
            self._unsaved = False
            return True

    def owe(self, key: Key, url: str | None, *, keep_unsaved: bool = False) -> None:
        """Record (a URL) or clear (None) a persistent-tier delete this node owes
        (`keep_unsaved`: as in `merge`)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.url == url:
                return
            before, e.url = e.url, url
            try:
                self._save()
            except (TierckptError, OSError):
                if not keep_unsaved:
                    e.url = before
                    raise
                self._unsaved = True

    def _bound(self) -> None:
        """Drop marks older than `max_age`, then the oldest beyond `max_marks` (call
        with the lock held)."""
        horizon = self._wall() - self.max_age
        for key in [k for k, e in self._entries.items() if e.newest() < horizon]:
            del self._entries[key]
        excess = len(self._entries) - self.max_marks
        if excess > 0:
            oldest = sorted(self._entries, key=lambda k: self._entries[k].newest())[:excess]
            for key in oldest:
                del self._entries[key]

    # ---- persistence ------------------------------------------------------------------
    def _save(self) -> None:
        entries = []
        for e in self._entries.values():
            for m in e.all():
                row: dict[str, object] = {
                    "namespace": m.namespace,
                    "checkpoint_id": m.checkpoint_id,
                    "kind": m.kind.value,
                    "stamp": m.stamp,
                    "origin": m.origin,
                }
                if m.applied:
                    row["applied"] = m.applied
                if m.uid is not None:
                    row["uid"] = m.uid
                if m.reason:
                    row["reason"] = m.reason
                if m.kind is MarkKind.DELETED and e.url is not None:
                    row["owed_url"] = e.url
                entries.append(row)
        data = json.dumps({"version": _VERSION, "marks": entries}).encode()
        atomic_write(self.path, data, mode=0o600)

    def _load(self) -> None:
        raw = self._read()
        if raw is None:
            return
        try:
            doc = json.loads(raw)
            rows = (
                doc["marks"] if isinstance(doc, dict) and doc.get("version") == _VERSION else None
            )
            if not isinstance(rows, list):
                raise ValueError("not a marks journal of this version")
        except (ValueError, KeyError) as e:
            logger.error(
                "the marks journal %s is unreadable (%s): cluster rm/pin marks made while "
                "this node was down are learnt again from its peers",
                self.path,
                str(e)[:200],
            )
            return
        now = self._wall()
        skipped = 0
        for row in rows[: 2 * self.max_marks]:
            try:
                mark, url = _row(row, now)
            except (InvalidArgument, ValueError, TypeError, KeyError):
                skipped += 1
                continue
            entry = self._entries.setdefault(mark.key, _Entry())
            setattr(entry, mark.kind.slot, mark)
            if mark.kind is MarkKind.DELETED:
                entry.url = url
        if skipped:
            logger.warning("skipped %d invalid entries of the marks journal %s", skipped, self.path)
        self._bound()

    def _read(self) -> bytes | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.error("cannot open the marks journal %s: %s", self.path, e)
            return None
        try:
            size = os.fstat(fd).st_size
            if size > MAX_JOURNAL_BYTES:
                logger.error("the marks journal %s is %d bytes: ignored", self.path, size)
                return None
            return os.read(fd, MAX_JOURNAL_BYTES + 1)
        finally:
            os.close(fd)


def _row(row: object, now: float) -> tuple[Mark, str | None]:
    if not isinstance(row, dict):
        raise ValueError("not an object")
    url = row.get("owed_url")
    if url is not None and not isinstance(url, str):
        raise ValueError("owed_url")
    mark = check_mark(
        str(row["namespace"]),
        str(row["checkpoint_id"]),
        MarkKind(row["kind"]),
        row["stamp"],
        str(row["origin"]),
        now=now,
    )
    applied = row.get("applied")
    if applied is not None:  # when this node first applied it (never later than that)
        if type(applied) is not float or not 0 < applied <= mark.stamp:
            raise ValueError("applied")
        mark = dataclasses.replace(mark, applied=applied)
    uid = row.get("uid")
    if uid is not None:
        if type(uid) is not int or not 0 <= uid < 0xFFFFFFFF:
            raise ValueError("uid")
        mark = dataclasses.replace(mark, uid=uid)
    reason = row.get("reason")
    if reason is not None:
        if not isinstance(reason, str):
            raise ValueError("reason")
        mark = dataclasses.replace(mark, reason=check_reason(reason))
    return mark, url if mark.kind is MarkKind.DELETED else None
