"""`PeerClient`: every call this node makes to a peer, where protobuf stops.

Each method does one PeerService RPC with its timeout and `wait_for_ready`, and returns
domain types (`Holdings`, `CheckpointRecord`, (offset, bytes) pieces). A failed call
raises `PeerCallError` (a `SourceUnavailable` naming the peer, with the gRPC status
name in `code`), so the rest of the peer tier never touches `grpc.RpcError` or a
generated message, and can be tested with a fake client.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from tierckpt.checksum import BytesLike
from tierckpt.errors import InvalidArgument, InvalidName, TierckptError
from tierckpt.names import check_namespace
from tierckpt.trust import check_reason
from tierckpt.v1 import common_pb2, peer_pb2

from tierckptd.errors import SourceUnavailable
from tierckptd.model import CheckpointRecord, CheckpointView, FileRecord, Key
from tierckptd.ops import metrics
from tierckptd.ops.events import Listeners
from tierckptd.ops.faults import fault
from tierckptd.peers.breaker import MISSED_CODES, Breaker
from tierckptd.peers.bulk_client import BulkError, BulkFetcher, BulkTicket
from tierckptd.peers.chunk_wire import PeerStub, encode_data_chunk
from tierckptd.peers.cluster_marks import MAX_MARKS, Mark, MarkKind, check_mark
from tierckptd.peers.membership import Membership
from tierckptd.peers.security import HelloChallenge
from tierckptd.wire import (
    bounded,
    check_node_id,
    file_entry,
    file_from_entry,
    record_from_info,
    ref,
    to_info,
)

__all__ = [
    "CONTROL_TIMEOUT",
    "FETCH_STALL",
    "TRANSFER_TIMEOUT",
    "Holdings",
    "Manifests",
    "PeerCallError",
    "PeerClient",
    "mark_from_wire",
    "mark_to_wire",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

CONTROL_TIMEOUT = 2.0
TRANSFER_TIMEOUT = 600.0
# A FetchFile that brings no message for this long is cancelled (a frozen peer must not
# hold a restore, and its file lock, for TRANSFER_TIMEOUT); the serving side reads from
# memory and sends at most 1 MiB per message (peers/serve.py), so a link still has to
# carry only 1 MiB within this window: about 0.9 Mbit/s.
FETCH_STALL = 10.0
# A test hook, inert unless set: the fetch stall window in seconds (tests of slow links).
FETCH_STALL_ENV = "TIERCKPTD_TEST_FETCH_STALL"
# Concurrent calls of one parallel `each` (a commit's holdings and publishes).
FANOUT_THREADS = 16


# What a probe of a backing-off peer asks the holdings of (any answer will do).
PROBE_NAMESPACE = "tierckpt-probe"
PROBE_CHECKPOINT = "probe"


def _fetch_stall() -> float:
    raw = os.environ.get(FETCH_STALL_ENV, "")
    try:
        value = float(raw) if raw else FETCH_STALL
    except ValueError:
        value = FETCH_STALL
    return value if 0 < value <= FETCH_STALL else FETCH_STALL


class PeerCallError(SourceUnavailable):
    """A call to a peer failed: `code` is the gRPC status name ("UNAVAILABLE",
    "NOT_FOUND", "DATA_LOSS", ... or "NOT_A_PEER"), `details` its message."""

    def __init__(self, node: str, method: str, code: str, details: str = "") -> None:
        cause = f"{method}: {code}" + (f": {bounded(details, 300)}" if details else "")
        super().__init__(f"peer {node}", cause)
        self.node = node
        self.method = method
        self.code = code
        self.details = details

    def __reduce__(self) -> tuple[object, ...]:
        return (PeerCallError, (self.node, self.method, self.code, self.details))


@dataclass(frozen=True)
class Holdings:
    """What a peer holds of one checkpoint.

    `known`: it knows the checkpoint (has its manifest); `names`: the files it holds a
    verified copy of; `files`: their records (with the peer as owner), or None when the
    peer's answer did not validate (`refused` says why).
    """

    known: bool
    names: frozenset[str]
    files: tuple[FileRecord, ...] | None = ()
    refused: str = ""
    durable: bool = False  # the peer knows the checkpoint is in the persistent tier


@dataclass(frozen=True)
class Manifests:
    """A peer's committed checkpoints: the ones that validated, and why others did not."""

    records: list[CheckpointRecord]
    refused: list[str]
    # Checkpoints the peer lists LOST: a hint to heal them in full here, never adopted.
    lost: list[Key] = field(default_factory=list)
    # The peer's own binding per namespace (the coordinators it has PROVEN): its vote on
    # a namespace's writers for a node with no binding of its own (`commit.quorum`).
    writers: dict[str, frozenset[str]] = field(default_factory=dict)
    # The namespaces of `writers` the peer only vouches for (it proved no writer of them).
    vouched: frozenset[str] = frozenset()


# A peer's stated binding (`Manifests.writers`): namespaces read from one answer, and
# writers per namespace (a job's coordinators over its life: a handful).
MAX_BINDINGS = 65_536
MAX_WRITERS = 64


def _writers_from_wire(
    wire: Sequence[peer_pb2.NamespaceWriters], refused: list[str]
) -> dict[str, frozenset[str]]:
    """A peer's stated binding, bounded (MAX_BINDINGS namespaces, MAX_WRITERS nodes
    each) and validated; an invalid entry is refused (said in `refused`), never half read."""
    writers: dict[str, frozenset[str]] = {}
    for entry in wire[:MAX_BINDINGS]:
        try:
            namespace = check_namespace(entry.namespace)
            if len(entry.nodes) > MAX_WRITERS:
                raise InvalidName(
                    f"{len(entry.nodes)} writers stated for {namespace} (at most {MAX_WRITERS})"
                )
            nodes = frozenset(check_node_id(n, "a stated writer") for n in entry.nodes)
        except TierckptError as e:
            refused.append(bounded(str(e)))
            continue
        writers[namespace] = writers.get(namespace, frozenset()) | nodes
    return writers


def _vouched_from_wire(wire: Sequence[peer_pb2.NamespaceWriters]) -> frozenset[str]:
    """The namespaces a peer's statement only vouches for (read with `_writers_from_wire`,
    which validates them)."""
    return frozenset(e.namespace for e in wire[:MAX_BINDINGS] if e.vouched)


def _error(node: str, method: str, e: grpc.RpcError) -> PeerCallError:
    code = e.code()
    details = e.details() if hasattr(e, "details") else ""
    name = code.name if code is not None else "UNKNOWN"
    metrics.peer_answered(node, name)  # tierckpt_peer_up: 0 when it was not reached
    return PeerCallError(node, method, name, details or "")


class StallWatch:
    """Calls `cancel` once when `touch` was not called for `stall` seconds (one thread,
    until `stop`)."""

    def __init__(self, cancel: Callable[[], object], stall: float, poll: float = 0.5) -> None:
        self._cancel = cancel
        self._stall = stall
        self._poll = min(poll, stall)
        self._last = time.monotonic()
        self._done = threading.Event()
        self.fired = False
        self._thread = threading.Thread(
            target=self._watch, name="tierckptd-fetch-watch", daemon=True
        )
        self._thread.start()

    def touch(self) -> None:
        self._last = time.monotonic()

    @property
    def idle(self) -> float:
        """Seconds since the last `touch`."""
        return time.monotonic() - self._last

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(self._poll):
            if time.monotonic() - self._last > self._stall:
                self.fired = True
                self._cancel()
                return


_KINDS = {
    MarkKind.DELETED: peer_pb2.MARK_DELETED,
    MarkKind.PINNED: peer_pb2.MARK_PINNED,
    MarkKind.UNPINNED: peer_pb2.MARK_UNPINNED,
    MarkKind.VERIFIED: peer_pb2.MARK_VERIFIED,
    MarkKind.BAD: peer_pb2.MARK_BAD,
}
_FROM_WIRE = {wire: kind for kind, wire in _KINDS.items()}


def mark_to_wire(mark: Mark) -> peer_pb2.CheckpointMark:
    return peer_pb2.CheckpointMark(
        ref=ref(mark.namespace, mark.checkpoint_id),
        kind=_KINDS[mark.kind],
        stamp_unix=mark.stamp,
        origin_node=mark.origin,
        caller_uid=mark.uid,
        reason=mark.reason,
    )


def mark_from_wire(m: peer_pb2.CheckpointMark, *, now: float) -> Mark:
    """A peer's mark, validated (`marks.check_mark`): InvalidName / InvalidArgument."""
    kind = _FROM_WIRE.get(m.kind)
    if kind is None:
        raise InvalidArgument(
            f"unknown mark kind {int(m.kind)}: expected rm, pin, unpin, verified or bad"
        )
    mark = check_mark(
        m.ref.namespace, m.ref.checkpoint_id, kind, m.stamp_unix, m.origin_node, now=now
    )
    if m.HasField("caller_uid"):  # uid isolation at the origin: the uid that asked
        if m.caller_uid >= 0xFFFFFFFF:
            raise InvalidArgument(f"caller_uid {m.caller_uid} of a mark is not a uid")
        mark = dataclasses.replace(mark, uid=m.caller_uid)
    if m.reason:
        mark = dataclasses.replace(mark, reason=check_reason(m.reason))
    return mark


class PeerClient:
    """Every RPC to the peers of one `Membership` (see the module docstring).

    Args:
        fetch_stall: seconds without data after which a FetchFile (or a bulk stream) is
            cancelled.
        bulk: how to open bulk streams (`bulk_client`); None: every fetch goes over
            FetchFile.
    """

    def __init__(
        self,
        membership: Membership,
        *,
        fetch_stall: float | None = None,
        bulk: BulkFetcher | None = None,
    ) -> None:
        self.membership = membership
        self.node_id = membership.node_id
        self.fetch_stall = _fetch_stall() if fetch_stall is None else fetch_stall
        self.bulk = bulk
        # Peers that did not answer their last call: skipped by `each` for a back-off.
        self.breaker = Breaker()
        # Cluster marks a peer's ListManifests answer carried (validated), by node: told
        # to `operations.ClusterOps.learn` (it subscribes when it is built).
        self.marks_learnt: Listeners[[str, list[Mark]]] = Listeners()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def peer_ids(self) -> list[str]:
        return self.membership.peer_ids

    def _stub(self, node: str, method: str) -> PeerStub:
        channel = self.membership.channel(node)
        if channel is None:
            raise PeerCallError(node, method, "NOT_A_PEER", "not a configured peer")
        return PeerStub(channel)

    def each(
        self,
        fn: Callable[[str], T],
        *,
        nodes: Iterable[str] | None = None,
        on_error: Callable[[str, PeerCallError], None] | None = None,
        parallel: bool = False,
        backed_off: bool = False,
    ) -> dict[str, T]:
        """`fn(node)` for every peer (or `nodes`), one after another (`parallel`: up to
        FANOUT_THREADS at a time; `fn` must then be thread-safe): the results of the
        calls that did not raise `PeerCallError`; a failed one goes to `on_error`
        (default: logged at DEBUG), in this thread.

        A peer that did not answer its last call is not called while it backs off
        (`breaker`): it fails at once, UNAVAILABLE, and is probed in the background;
        `backed_off` calls it all the same (a caller that cannot do without it)."""
        skipped: list[str] = []
        targets: list[str] = []
        for node in self.peer_ids if nodes is None else nodes:
            skip, probe = self.breaker.skip(node)
            skip = skip and not backed_off
            (skipped if skip else targets).append(node)
            if probe:
                self._fanout_pool().submit(self.probe, node)
        calls: dict[str, Callable[[], T]]
        if parallel and len(targets) > 1:
            pool = self._fanout_pool()
            futures = {node: pool.submit(fn, node) for node in targets}
            calls = {node: fut.result for node, fut in futures.items()}
        else:
            calls = {node: functools.partial(fn, node) for node in targets}
        results: dict[str, T] = {}
        failed: list[tuple[str, PeerCallError]] = []
        for node, call in calls.items():
            try:
                results[node] = call()
                self.breaker.answered(node)
            except PeerCallError as err:
                self.breaker.missed(node, err.code)
                failed.append((node, err))
        for node in skipped:
            left = self.breaker.left(node)
            details = "skipped: it did not answer its last call" + (
                f"; asked again in {left:.0f} s" if left >= 1 else "; being probed"
            )
            failed.append((node, PeerCallError(node, "call", "UNAVAILABLE", details)))
        for node, error in failed:
            if on_error is None:
                logger.debug("%s", error)
            else:
                on_error(node, error)
        return results

    def probe_backed_off(self) -> None:
        """Start a probe (in the fan-out pool) of every peer whose back-off is over, so
        that one that answers again is used at once, whether or not a fan-out asked for
        it meanwhile (the heal loop calls this each round)."""
        for node, left in self.breaker.backing_off().items():
            if left <= 0 and self.breaker.skip(node)[1]:
                self._fanout_pool().submit(self.probe, node)

    def probe(self, node: str) -> bool:
        """Whether `node` answers a cheap call now (Holdings of a checkpoint nobody has);
        the breaker learns the outcome."""
        try:
            self.holdings(node, PROBE_NAMESPACE, PROBE_CHECKPOINT)
        except PeerCallError as e:
            self.breaker.missed(node, e.code)
            return e.code not in MISSED_CODES
        self.breaker.answered(node)
        return True

    def _fanout_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(FANOUT_THREADS, "tierckptd-fanout")
            return self._pool

    # ---- control calls ----------------------------------------------------------------
    def holdings(self, node: str, namespace: str, checkpoint_id: str) -> Holdings:
        """What `node` holds of a checkpoint (waits for a restarting peer's channel)."""
        fault("peer.holdings", lambda: PeerCallError(node, "Holdings", "INJECTED"))
        stub = self._stub(node, "Holdings")
        try:
            resp: peer_pb2.HoldingsResponse = stub.Holdings(
                ref(namespace, checkpoint_id), timeout=CONTROL_TIMEOUT, wait_for_ready=True
            )
        except grpc.RpcError as e:
            raise _error(node, "Holdings", e) from None
        metrics.peer_answered(node)
        known = resp.state != common_pb2.CHECKPOINT_STATE_UNSPECIFIED
        durable = resp.state == common_pb2.DURABLE
        names = frozenset(e_.name for e_ in resp.files)
        try:
            files = tuple(file_from_entry(e_) for e_ in resp.files)
        except TierckptError as e:
            return Holdings(known, names, None, bounded(str(e)), durable)
        return Holdings(known, names, files, durable=durable)

    def publish(self, node: str, view: CheckpointView) -> None:
        """PublishCheckpoint: give `node` the manifest of a committed checkpoint."""
        fault("peer.publish", lambda: PeerCallError(node, "PublishCheckpoint", "INJECTED"))
        stub = self._stub(node, "PublishCheckpoint")
        try:
            stub.PublishCheckpoint(
                to_info(view, local_paths=False), timeout=CONTROL_TIMEOUT, wait_for_ready=True
            )
        except grpc.RpcError as e:
            raise _error(node, "PublishCheckpoint", e) from None
        metrics.peer_answered(node)

    def update_replicas(
        self, node: str, namespace: str, checkpoint_id: str, name: str, replicas: list[str]
    ) -> None:
        stub = self._stub(node, "UpdateReplicas")
        req = peer_pb2.UpdateReplicasRequest(
            ref=ref(namespace, checkpoint_id), file_name=name, replica_nodes=replicas
        )
        try:
            stub.UpdateReplicas(req, timeout=CONTROL_TIMEOUT, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _error(node, "UpdateReplicas", e) from None

    def report_corrupt(self, node: str, namespace: str, checkpoint_id: str, name: str) -> bool:
        """ReportCorrupt: bytes of a file `node` sent over its bulk stream failed
        verification here; whether it started re-checking its copy (it acts only on its
        own hash, `peers.recheck`)."""
        stub = self._stub(node, "ReportCorrupt")
        req = peer_pb2.ReportCorruptRequest(ref=ref(namespace, checkpoint_id), file_name=name)
        try:
            resp: peer_pb2.ReportCorruptResponse = stub.ReportCorrupt(
                req, timeout=CONTROL_TIMEOUT, wait_for_ready=True
            )
        except grpc.RpcError as e:
            raise _error(node, "ReportCorrupt", e) from None
        return resp.rechecking

    def list_manifests(
        self,
        node: str,
        namespace: str = "",
        *,
        wait_for_ready: bool = True,
        starting: bool = False,
    ) -> Manifests:
        """The committed checkpoints `node` knows (of `namespace`, or all), validated one
        by one; `starting`: this node has just started (the peer heals at once). The
        cluster marks in the answer go to `marks_learnt` before this returns, so a deleted
        checkpoint is refused before any record is adopted."""
        stub = self._stub(node, "ListManifests")
        try:
            resp = stub.ListManifests(
                peer_pb2.ListManifestsRequest(namespace=namespace, starting=starting),
                timeout=CONTROL_TIMEOUT,
                wait_for_ready=wait_for_ready,
            )
        except grpc.RpcError as e:
            raise _error(node, "ListManifests", e) from None
        metrics.peer_answered(node)
        records: list[CheckpointRecord] = []
        refused: list[str] = []
        marks: list[Mark] = []
        for m in resp.marks[:MAX_MARKS]:
            try:
                marks.append(mark_from_wire(m, now=time.time()))
            except TierckptError as e:
                refused.append(bounded(str(e)))
        if marks:
            self.marks_learnt(node, marks)
        lost: list[Key] = []
        for info in resp.checkpoints:
            try:
                records.append(record_from_info(info))
            except TierckptError as e:
                refused.append(bounded(str(e)))
                continue
            if info.state == common_pb2.LOST:
                lost.append(records[-1].key)
        writers = _writers_from_wire(resp.writers, refused)
        vouched = _vouched_from_wire(resp.writers) & writers.keys()
        return Manifests(records, refused, lost, writers, frozenset(vouched))

    def namespace_owner(self, node: str, namespace: str) -> tuple[int, str] | None:
        """Who owns `namespace` per `node` (uid isolation): the owner it recorded, else
        the one its newest manifest of the namespace names; None when it knows none.
        Asked before a claim, so a peer that is down costs one deadline, no waiting."""
        stub = self._stub(node, "ListManifests")
        try:
            resp = stub.ListManifests(
                peer_pb2.ListManifestsRequest(namespace=namespace),
                timeout=CONTROL_TIMEOUT,
                wait_for_ready=False,
            )
        except grpc.RpcError as e:
            raise _error(node, "ListManifests", e) from None
        metrics.peer_answered(node)
        if resp.HasField("namespace_owner_uid") and resp.namespace_owner_uid < 0xFFFFFFFF:
            return resp.namespace_owner_uid, resp.namespace_owner_node[:128] or node
        owned = [
            i for i in resp.checkpoints if i.HasField("owner_uid") and i.owner_uid < 0xFFFFFFFF
        ]
        if owned:
            newest = max(owned, key=lambda i: i.sequence)
            return newest.owner_uid, newest.owner_claim_node[:128] or node
        return None

    def marks_of(self, node: str, namespace: str) -> list[Mark]:
        """The marks `node` states for `namespace` (its ListManifests answer's marks,
        validated one by one, not handed to `on_marks`): how a relayed mark is confirmed
        with its origin (`ClusterOps.learn`). Fails fast when `node` is down."""
        stub = self._stub(node, "ListManifests")
        try:
            resp = stub.ListManifests(
                peer_pb2.ListManifestsRequest(namespace=namespace), timeout=CONTROL_TIMEOUT
            )
        except grpc.RpcError as e:
            raise _error(node, "ListManifests", e) from None
        marks: list[Mark] = []
        for m in resp.marks[:MAX_MARKS]:
            try:
                marks.append(mark_from_wire(m, now=time.time()))
            except TierckptError:
                continue
        return marks

    def apply_mark(self, node: str, mark: Mark) -> None:
        """ApplyMark: tell `node` of a cluster rm, pin or unpin this node made (a peer
        down for CONTROL_TIMEOUT is retried later by the caller)."""
        fault("peer.apply_mark", lambda: PeerCallError(node, "ApplyMark", "INJECTED"))
        stub = self._stub(node, "ApplyMark")
        try:
            stub.ApplyMark(mark_to_wire(mark), timeout=CONTROL_TIMEOUT, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _error(node, "ApplyMark", e) from None

    def hello(self, address: str, node: str = "") -> tuple[str, str, bool]:
        """Hello: (node id, failure domain, whether it knows this node as a member) of the
        daemon answering at `address`, proven before it is believed; no token goes with
        it (a stranger may answer there). Over `node`'s Hello channel when `node` is the
        member there, else a short-lived one.

        Proof: with a token, the answer must carry the daemon's proof of the token for
        this call's nonce and the id it answers with (`security.HelloChallenge`); with
        mutual TLS, the server's certificate must name that id (a second Hello checks it
        when the address was not already `node`'s). A daemon that answers without proof
        is a PeerCallError with code "NOT_PROVEN"; the names are not validated here."""
        membership = self.membership
        if node and membership.address_of(node) == address:
            channel = membership.hello_channel(node)
            if channel is not None:
                try:
                    got = self._hello(channel, address)
                    if got[0] == node or not membership.verifies_names:
                        return got  # with mutual TLS, the handshake proved `node`
                except PeerCallError as e:
                    if e.code == "NOT_PROVEN" or not membership.verifies_names:
                        raise
                    # Its certificate may not name `node` any more: ask who answers now.
        got = self._hello_once(address)
        if membership.verifies_names and got[0] != self.node_id:
            try:
                again = self._hello_once(address, server_name=got[0])
            except PeerCallError as e:
                raise PeerCallError(
                    address,
                    "Hello",
                    "NOT_PROVEN",
                    f"it answers as node {got[0][:64]!r}, but its certificate does not name "
                    f"{got[0][:64]!r} (a subjectAltName DNS:{got[0][:64]} from the cluster's "
                    f"CA): {bounded(e.details, 200)}",
                ) from None
            if again[0] != got[0]:
                raise PeerCallError(
                    address,
                    "Hello",
                    "NOT_PROVEN",
                    f"it answered as node {got[0][:64]!r}, then as {again[0][:64]!r}",
                )
        return got

    def _hello_once(self, address: str, server_name: str = "") -> tuple[str, str, bool]:
        channel = self.membership.open_channel(address, server_name)
        try:
            return self._hello(channel, address)
        finally:
            channel.close()

    def _hello(self, channel: grpc.Channel, address: str) -> tuple[str, str, bool]:
        key = self.membership.hello_key
        challenge = HelloChallenge(key, self.node_id) if key is not None else None
        try:
            resp, call = PeerStub(channel).Hello.with_call(
                peer_pb2.HelloRequest(node_id=self.node_id),
                timeout=CONTROL_TIMEOUT,
                metadata=challenge.metadata() if challenge is not None else None,
            )
        except grpc.RpcError as e:
            raise _error(address, "Hello", e) from None
        if challenge is not None and not challenge.proven(call.trailing_metadata(), resp.node_id):
            raise PeerCallError(
                address,
                "Hello",
                "NOT_PROVEN",
                f"it answers as node {resp.node_id[:64]!r} without proving it holds the "
                "cluster token ([security] token_file)",
            )
        return resp.node_id, resp.failure_domain, resp.knows_caller

    # ---- transfers --------------------------------------------------------------------
    def grant(
        self,
        node: str,
        namespace: str,
        checkpoint_id: str,
        name: str,
        offset: int,
        length: int,
        background: bool = False,
    ) -> BulkTicket | None:
        """GrantFetch: a one-use grant to fetch `length` bytes of a file `node` holds
        from `offset` over its bulk stream; None when this node has no bulk fetcher or
        `node` offers no bulk stream (UNIMPLEMENTED: an older node, or one without a
        bulk listener), so the caller fetches over FetchFile. NOT_FOUND when it holds no
        copy, RESOURCE_EXHAUSTED when it runs its limit of sends (busy). `background`:
        a replication copy, which `node` sends at background priority."""
        if self.bulk is None:
            return None
        fault("peer.grant", lambda: PeerCallError(node, "GrantFetch", "INJECTED"))
        stub = self._stub(node, "GrantFetch")
        request = peer_pb2.FetchFileRequest(
            ref=ref(namespace, checkpoint_id),
            file_name=name,
            offset=offset,
            length=length,
            background=background,
        )
        resp: peer_pb2.BulkGrant | None = self._unless_unimplemented(
            node,
            "GrantFetch",
            lambda: stub.GrantFetch(request, timeout=CONTROL_TIMEOUT, wait_for_ready=True),
        )
        if resp is None:
            return None
        address = self.membership.address_of(node) or ""
        host = address.rpartition(":")[0].strip("[]")
        if not host or not 0 < resp.port < 65536 or len(resp.grant) > 64:
            raise PeerCallError(node, "GrantFetch", "INVALID_ARGUMENT", "a malformed grant")
        if resp.offset != offset or (length and resp.length != length):
            raise PeerCallError(
                node,
                "GrantFetch",
                "INVALID_ARGUMENT",
                f"granted bytes {resp.offset}+{resp.length}, asked {offset}+{length}",
            )
        return BulkTicket(
            resp.grant, host, resp.port, namespace, checkpoint_id, name, resp.offset, resp.length
        )

    def fetch_bulk(self, node: str, ticket: BulkTicket) -> Iterator[tuple[int, memoryview]]:
        """The range a grant names, over `node`'s bulk stream: (offset, view) pieces, each
        valid until the next is asked for (`bulk_client`); a failure is a PeerCallError."""
        assert self.bulk is not None
        try:
            for piece in self.bulk.fetch(node, ticket, self.fetch_stall):
                fault("peer.bulk.chunk", lambda: PeerCallError(node, "BulkFetch", "INJECTED"))
                yield piece
        except BulkError as e:
            if e.code not in ("NOT_FOUND", "PERMISSION_DENIED", "INVALID_ARGUMENT"):
                metrics.peer_answered(node, e.code)
            raise PeerCallError(node, "BulkFetch", e.code, e.details) from None

    def fetch(
        self,
        node: str,
        namespace: str,
        checkpoint_id: str,
        name: str,
        offset: int = 0,
        length: int = 0,
    ) -> Iterator[tuple[int, memoryview]]:
        """FetchFile: the data of a file `node` holds, as (offset, bytes) pieces (views
        into the received messages); a failure, at any point, is a `PeerCallError`.

        Progress is any message received (the peer sends at most 1 MiB in one, its
        header first): a fetch that receives none for `fetch_stall` seconds is cancelled
        (code "STALLED"), saying "no answer" when the peer never answered the call
        (frozen, gray), else "too slow" with the bytes received and the seconds they took
        (a slow or congested link, or a peer that froze mid-file)."""
        stub = self._stub(node, "FetchFile")
        request = peer_pb2.FetchFileRequest(
            ref=ref(namespace, checkpoint_id), file_name=name, offset=offset, length=length
        )
        call = stub.FetchFile(request, timeout=TRANSFER_TIMEOUT)
        watch = StallWatch(call.cancel, self.fetch_stall)
        started = time.monotonic()
        messages = received = 0
        try:
            for chunk in call:
                watch.touch()
                messages += 1
                received += chunk.data.nbytes
                fault("peer.fetch.chunk", lambda: PeerCallError(node, "FetchFile", "INJECTED"))
                if chunk.data:
                    yield chunk.offset, chunk.data
        except grpc.RpcError as e:
            if watch.fired:
                took = time.monotonic() - started
                if messages:
                    raise PeerCallError(
                        node,
                        "FetchFile",
                        "STALLED",
                        f"too slow ({received:,} bytes in {took:.1f} s; no message for "
                        f"{self.fetch_stall:g} s): the link is slow or congested, or the peer froze",
                    ) from None
                raise PeerCallError(
                    node,
                    "FetchFile",
                    "STALLED",
                    f"no answer for {self.fetch_stall:g} s: it accepted the call but sent "
                    "nothing (frozen or overloaded)",
                ) from None
            raise _error(node, "FetchFile", e) from None
        finally:
            watch.stop()
            call.cancel()  # a no-op when it completed; frees the peer when we stop early

    def offer(self, node: str, namespace: str, checkpoint_id: str, f: FileRecord) -> bool:
        """OfferFile: ask `node` to take a copy of `f` from this node (it fetches it over
        this node's bulk stream and verifies it as it lands); False when `node` does not
        take offers (UNIMPLEMENTED: an older node), so the caller pushes over PushFile."""
        stub = self._stub(node, "OfferFile")
        header = peer_pb2.FileHeader(ref=ref(namespace, checkpoint_id), file=file_entry(f))
        answer = self._unless_unimplemented(
            node, "OfferFile", lambda: stub.OfferFile(header, timeout=TRANSFER_TIMEOUT)
        )
        return answer is not None

    @staticmethod
    def _unless_unimplemented(node: str, method: str, call: Callable[[], T]) -> T | None:
        """`call()`, a call of `method` on `node`; None when `node` does not implement it
        (an older node: it answered, so it counts as up). Any other failure is a
        `PeerCallError`."""
        try:
            answer = call()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _error(node, method, e) from None
            answer = None
        metrics.peer_answered(node)
        return answer

    def push(
        self,
        node: str,
        namespace: str,
        checkpoint_id: str,
        f: FileRecord,
        pieces: Iterable[tuple[int, BytesLike]],
    ) -> None:
        """PushFile: send a copy of `f`; `pieces` are (offset, data) at increasing
        offsets, an empty `data` being a heartbeat (the receiver's stall watchdog)."""
        stub = self._stub(node, "PushFile")
        header = peer_pb2.FileHeader(ref=ref(namespace, checkpoint_id), file=file_entry(f))

        def messages() -> Iterator[bytes | peer_pb2.FileChunk]:
            yield peer_pb2.FileChunk(header=header)
            for offset, data in pieces:
                fault("peer.push.chunk")
                yield encode_data_chunk(offset, bytes(data) if data else b"")

        try:
            stub.PushFile(messages(), timeout=TRANSFER_TIMEOUT)
        except grpc.RpcError as e:
            raise _error(node, "PushFile", e) from None
