"""Pushing one copy of a file to a peer, for the healer.

A copy goes as an *offer* (OfferFile): the target fetches the file from this node the way
a restore does, over this node's bulk stream (`sendfile` from the memory tier here, one
receive copy there, every block verified as it lands), so replication moves no byte
through per-chunk RPC messages. A target that takes no offers (an older node,
UNIMPLEMENTED) is pushed to over PushFile, chunk by chunk, for `REFUSAL_BACKOFF` seconds
before it is offered to again. Either way nothing starts while a save writes here.

What can go wrong on the way is ordinary and handled here, quietly where it is nobody's
fault:

- the target does not know the checkpoint as committed (it missed the publish, or
  answered Holdings for a save it still sees unfinished): the push is refused NOT_FOUND
  or "publish it first"; the manifest is published and the push tried once more;
- the target refuses the copy for good (PERMISSION_DENIED: it let the checkpoint go to
  the persistent tier only, or deleted it): it is not asked again for that checkpoint
  for `REFUSAL_BACKOFF` seconds, and that is logged once, not every heal round. The
  checkpoint's own coordinator is the exception: it refuses a peer's publish of its own
  checkpoint (audit 3) while it has just restarted empty, and adopts the manifest from
  its peers' listings moments later; it is pushed to again at the next heal;
- the file is evicted or recycled before or during the push: the file is opened before
  the call, a read error ends the stream (the receiver refuses the short copy), and a
  DATA_LOSS answer for a copy this node no longer holds is not taken for corruption.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tierckpt.errors import CheckpointNotFound
from tierckpt.units import format_size

from tierckptd.catalog import Catalog
from tierckptd.jobs import StepAside
from tierckptd.memory.tier import UnsafePath
from tierckptd.model import CheckpointView, FileRecord, Key
from tierckptd.ops import logs, metrics
from tierckptd.ops.faults import fault
from tierckptd.peers.client import PeerCallError, PeerClient
from tierckptd.peers.placement import coordinator_of
from tierckptd.peers.serve import MESSAGE_BYTES

__all__ = ["HEARTBEAT", "REFUSAL_BACKOFF", "OnCorrupt", "Pusher"]

# The healer's log: "replicated ...", "push of ... failed" read as healing, wherever the code is.
logger = logging.getLogger("tierckptd.peers.healer")

# A push stepping aside sends an empty chunk this often, so the receiver's watchdog
# (peer_service.STALL_TIMEOUT) sees a live stream.
HEARTBEAT = 2.0
# A peer that refused a checkpoint's copy is not pushed to again for this long.
REFUSAL_BACKOFF = 300.0
MAX_REFUSALS = 10_000

OnCorrupt = Callable[[str, str, str, str, str], None]


def _unpublished(e: PeerCallError) -> bool:
    """The target does not have the checkpoint committed: publishing it may help."""
    return e.code == "NOT_FOUND" or (
        e.code == "FAILED_PRECONDITION" and "publish it first" in e.details
    )


class Pusher:
    """Pushes copies of this node's files to peers (see the module docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        client: PeerClient,
        on_corrupt: OnCorrupt,
        *,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.catalog = catalog
        self.client = client
        self._on_corrupt = on_corrupt
        self._stop = stop
        self._clock = clock
        self._lock = threading.Lock()
        self._refused: dict[tuple[Key, str], float] = {}
        self._no_offers: dict[str, float] = {}  # peer -> until: it answered UNIMPLEMENTED

    def refusing(self, key: Key, node: str) -> bool:
        """Whether `node` refused a copy of checkpoint `key` less than REFUSAL_BACKOFF ago."""
        with self._lock:
            until = self._refused.get((key, node))
            if until is None:
                return False
            if until <= self._clock():
                del self._refused[(key, node)]
                return False
            return True

    def _refuse(self, key: Key, node: str, e: PeerCallError) -> None:
        now = self._clock()
        with self._lock:
            if len(self._refused) >= MAX_REFUSALS:
                self._refused = {k: t for k, t in self._refused.items() if t > now}
                while len(self._refused) >= MAX_REFUSALS:
                    del self._refused[next(iter(self._refused))]
            self._refused[(key, node)] = now + REFUSAL_BACKOFF
        logger.info(
            "%s/%s: node %s refuses a copy (%s); not pushing it there for %.0f s",
            *key,
            node,
            e.cause,
            REFUSAL_BACKOFF,
        )

    def _publish(self, node: str, view: CheckpointView) -> bool:
        try:
            self.client.publish(node, view)
        except PeerCallError as e:
            coordinator = coordinator_of({f.name: f for f in view.files})
            if e.code in ("PERMISSION_DENIED", "FAILED_PRECONDITION") and node != coordinator:
                self._refuse((view.namespace, view.checkpoint_id), node, e)
            else:
                logger.warning(
                    "cannot publish %s/%s to %s: %s",
                    view.namespace,
                    view.checkpoint_id,
                    node,
                    e.cause,
                )
            return False
        return True

    def push(self, node: str, view: CheckpointView, f: FileRecord, knows: bool) -> bool:
        """Push this node's copy of `f` to `node` (publishing the manifest first when it
        does not know the checkpoint); True when `node` now holds a verified copy."""
        key = (view.namespace, view.checkpoint_id)
        what = f"{view.namespace}/{view.checkpoint_id}/{f.name}"
        if not knows and not self._publish(node, view):
            return False
        path = view.local_paths.get(f.name, "")
        if not path or f.checksums is None:
            return False
        try:
            fd, _ = self.catalog.tier.open_regular(Path(path))
        except (FileNotFoundError, UnsafePath) as e:
            logger.info("%s is no longer here to push to %s: %s", what, node, e)
            return False
        published = not knows
        started = time.monotonic()
        try:
            while True:
                unread: list[OSError] = []
                try:
                    if not self._offered(node, key, f):
                        self.client.push(node, *key, f, self._read(fd, f, unread))
                    break
                except PeerCallError as e:
                    if _unpublished(e) and not published and not unread:
                        published = True
                        if self._publish(node, view):
                            continue  # it knows the checkpoint now: push again
                        return False
                    self._failed(node, view, f, path, e, unread)
                    return False
        finally:
            os.close(fd)
        metrics.REPLICATED_BYTES.inc(f.size)
        metrics.REPLICATE_DURATION.observe(time.monotonic() - started)
        logger.info(
            "replicated %s to %s (%s)",
            what,
            node,
            format_size(f.size),
            extra=logs.context(*key, f.rank),
        )
        return True

    def _offered(self, node: str, key: Key, f: FileRecord) -> bool:
        """Hand `node` the copy as an offer (it fetches the file over this node's bulk
        stream: `sendfile` here, no per-chunk RPC messages), once no save writes here;
        False when `node` takes no offers (an older node): then it is pushed."""
        with self._lock:
            if self._no_offers.get(node, 0.0) > self._clock():
                return False
        StepAside(self.catalog.saving, stop=self._stop).wait()
        fault("peer.offer")
        if self.client.offer(node, *key, f):
            return True
        with self._lock:
            self._no_offers[node] = self._clock() + REFUSAL_BACKOFF
        return False

    def _failed(
        self,
        node: str,
        view: CheckpointView,
        f: FileRecord,
        path: str,
        e: PeerCallError,
        unread: list[OSError],
    ) -> None:
        key = (view.namespace, view.checkpoint_id)
        what = f"{view.namespace}/{view.checkpoint_id}/{f.name}"
        if unread or not self._still_held(key, f.name, path):
            logger.info("push of %s to %s ended: the copy here went away meanwhile", what, node)
            return
        if e.code == "PERMISSION_DENIED":
            self._refuse(key, node, e)
            return
        if e.code == "DATA_LOSS":
            assert f.checksums is not None
            ok, reason = self.catalog.tier.verify_file(Path(path), f.size, f.checksums)
            if not ok and self._still_held(key, f.name, path):
                self._on_corrupt(view.namespace, view.checkpoint_id, f.name, reason, "pushed")
        logger.warning("push of %s to %s failed: %s", what, node, e.cause)

    def _still_held(self, key: Key, name: str, path: str) -> bool:
        try:
            return self.catalog.file_view(*key, name)[1] == path
        except CheckpointNotFound:
            return False

    def _read(self, fd: int, f: FileRecord, unread: list[OSError]) -> Iterator[tuple[int, bytes]]:
        """The file's bytes in messages of one checksum block, at most MESSAGE_BYTES (a
        slow link still shows progress within the receiver's stall window), unverified
        (the receiver verifies); stepping aside between messages while a save writes,
        with heartbeats. A read error ends the stream (recorded in `unread`): the
        receiver refuses the short copy, and no exception reaches gRPC's request
        thread."""
        assert f.checksums is not None
        step = min(f.checksums.block_size, MESSAGE_BYTES)
        aside = StepAside(self.catalog.saving, stop=self._stop)
        pos = 0
        while pos < f.size:
            # Between blocks: a save may start mid-file.
            while aside.wait(HEARTBEAT):
                yield pos, b""  # still here
            try:
                data = os.pread(fd, min(step, f.size - pos), pos)
            except OSError as e:
                unread.append(e)
                return
            if not data:
                unread.append(OSError(f"{f.name} ends at {pos} of {f.size} bytes"))
                return
            yield pos, data
            pos += len(data)
