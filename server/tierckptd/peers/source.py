"""`PeerSource`: one peer as a `restore.FileSource` (ask its holdings, then fetch).

A peer that does not answer, or refuses, is *unavailable* (`SourceUnavailable("peer
<node>", cause)`); one that answers without the file is *missing*
(`CheckpointNotFound`); one whose copy fails its own verification while it serves it
is *corrupt* (DATA_LOSS -> `ChecksumMismatch`). Bytes are verified where they land
(`memory.incoming.install_copy`), never trusted here. The bulk sender does not hash what
it sends, so when bytes it sent fail there (`rejected`), the peer is told
(`ReportCorrupt`, queued off the restore): it re-checks its copy on its own hash.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator

from tierckpt.checksum import BytesLike
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch

from tierckptd.model import FileRecord
from tierckptd.peers.bulk_client import CANNOT_CONNECT
from tierckptd.peers.client import PeerCallError, PeerClient
from tierckptd.restore import SourceBusy

__all__ = ["OnLanded", "OnRejected", "PeerSource", "PeerSources", "peer_sources"]

logger = logging.getLogger(__name__)

OnLanded = Callable[[str, str, str], None]
"""Called with (namespace, checkpoint id, file name) once a peer's copy is installed here."""
OnRejected = Callable[[str, str, str, str], None]
"""Called with (node, namespace, checkpoint id, file name) when bytes `node` sent over its
bulk stream failed verification here; it must not block the restore."""


class PeerSource:
    """A peer node's copy of a committed file (see the module docstring).

    `on_landed`: what to do once its copy is installed here, so that the peers learn this
    node holds one; it must not block the restore (the daemon queues a job that tells the
    file's neighbourhood and the coordinator, with retries, in the background).
    `on_rejected`: what to do when bytes it sent over the bulk stream failed verification
    here (the daemon queues a `ReportCorrupt` to it).
    `background`: a replication copy, not a restore; the holder sends it at background
    CPU priority (`ops/priority.py`).
    """

    def __init__(
        self,
        client: PeerClient,
        node: str,
        on_landed: OnLanded | None = None,
        on_rejected: OnRejected | None = None,
        *,
        background: bool = False,
    ) -> None:
        self.client = client
        self.node = node
        self.background = background
        self._on_landed = on_landed
        self._on_rejected = on_rejected
        # The last transfer's bytes came over the bulk stream (unverified by the sender),
        # and it did not fail on its own: a mismatch where they landed is the copy's.
        self._via_bulk = False

    @property
    def name(self) -> str:
        return f"peer {self.node}"

    def __repr__(self) -> str:
        return f"PeerSource({self.node!r})"

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        return self.range_chunks(namespace, checkpoint_id, f, 0, f.size)

    def range_chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord, offset: int, length: int
    ) -> Iterator[tuple[int, BytesLike]]:
        """Bytes `offset`..`offset+length` of `f` (`restore.RangeSource`): over the
        peer's bulk stream when it grants one (a piece is then valid until the next is
        asked for), else over FetchFile. A peer at its limit of sends is busy
        (`restore.SourceBusy`): the restore asks another holder."""
        what = f"{namespace}/{checkpoint_id}/{f.name}"
        self._via_bulk = False
        try:
            ticket = self.client.grant(
                self.node, namespace, checkpoint_id, f.name, offset, length, self.background
            )
            if ticket is not None:
                try:
                    self._via_bulk = True
                    yield from self.client.fetch_bulk(self.node, ticket)
                    return
                except PeerCallError as e:
                    self._via_bulk = False
                    if e.code != CANNOT_CONNECT:
                        raise
                    # Its bulk port is not reachable from here (a firewall): FetchFile.
                    logger.warning("%s; fetching %s over gRPC instead", e, what)
            # No bulk stream there: ask first (waits for a restarting peer's channel,
            # skips a non-holder), then FetchFile.
            held = self.client.holdings(self.node, namespace, checkpoint_id)
            if f.name not in held.names:
                raise CheckpointNotFound(f"node {self.node} holds no copy of {what}")
            whole = offset == 0 and length == f.size
            yield from self.client.fetch(
                self.node, namespace, checkpoint_id, f.name, offset, 0 if whole else length
            )
        except PeerCallError as e:
            if e.code == "NOT_FOUND":
                raise CheckpointNotFound(
                    f"node {self.node} holds no copy of {what}: {e.details}"
                ) from None
            if e.code == "DATA_LOSS":
                raise ChecksumMismatch(f"node {self.node}'s copy of {what}: {e.details}") from None
            if e.code == "RESOURCE_EXHAUSTED":
                raise SourceBusy(self.name, e.cause) from None
            raise

    def rejected(self, namespace: str, checkpoint_id: str, f: FileRecord) -> None:
        """Bytes this source gave failed verification where they landed: when they came
        over the peer's bulk stream (which the sender does not hash), tell the peer
        (`on_rejected`); it re-checks its copy on its own hash (`peers.recheck`). A copy
        the peer found corrupt itself (DATA_LOSS) or a FetchFile (verified as sent) needs
        no report."""
        if self._via_bulk and self._on_rejected is not None:
            self._via_bulk = False
            self._on_rejected(self.node, namespace, checkpoint_id, f.name)

    def holds(self, namespace: str, checkpoint_id: str, f: FileRecord) -> bool:
        """Whether the peer says it holds a verified copy of `f` (False when it does not
        answer)."""
        try:
            return f.name in self.client.holdings(self.node, namespace, checkpoint_id).names
        except PeerCallError:
            return False

    def landed(self, namespace: str, checkpoint_id: str, f: FileRecord) -> None:
        """The copy is installed here: have the peers learn that this node holds one
        (unless it is the owner's own copy coming back). Not here and not now: telling
        every peer in the restore's thread cost the reader one call per peer per file,
        and a full deadline for each peer that is down."""
        if f.owner_node != self.client.node_id and self._on_landed is not None:
            self._on_landed(namespace, checkpoint_id, f.name)


def peer_sources(
    client: PeerClient,
    f: FileRecord,
    on_landed: OnLanded | None = None,
    on_rejected: OnRejected | None = None,
) -> list[PeerSource]:
    """The peers to ask for `f`, in order: its owner, each replica holder (which include
    the nodes that told this one they landed a copy), then every other configured peer
    in random order (each once, never this node: one of them may have landed a copy in
    this restore wave); a peer that did not answer its last call (backing off,
    `PeerClient.breaker`) is asked last, not skipped: it may be the only holder, and a
    restore may wait for it.

    Fan-out: a holder at its limit of bulk sends answers busy, and the restore asks the
    next; so when many nodes restore the same file at once (every rank of a data-parallel
    job reads the files rank 0 wrote), they spill from the owner to the replica holders
    and, in random order, to the nodes that landed it earlier in the wave
    (docs/peer-bulk.md)."""
    me = client.node_id
    peers = client.peer_ids
    holders = [n for n in dict.fromkeys([f.owner_node, *f.replica_nodes]) if n in peers]
    others = [n for n in peers if n not in holders]
    random.shuffle(others)
    nodes = [n for n in dict.fromkeys([*holders, *others]) if n and n != me]
    backing_off = client.breaker.backing_off()
    nodes.sort(key=lambda n: n in backing_off)  # stable: the order above otherwise
    return [PeerSource(client, node, on_landed, on_rejected) for node in nodes]


class PeerSources:
    """The peer tier's part of the restore chain (`restore.PeerCopies`): the peers to ask
    for a file, in `peer_sources` order; `on_landed` and `on_rejected` as `PeerSource`'s."""

    def __init__(
        self,
        client: PeerClient,
        on_landed: OnLanded | None = None,
        on_rejected: OnRejected | None = None,
    ) -> None:
        self.client = client
        self._on_landed = on_landed
        self._on_rejected = on_rejected

    def __call__(self, f: FileRecord) -> list[PeerSource]:
        return peer_sources(self.client, f, self._on_landed, self._on_rejected)
