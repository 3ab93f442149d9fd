"""PeerService servicer: daemon <-> daemon on the peer listener (never the local socket).

Wire <-> domain translation and per-call authorization; every action lives in
`peers.Cluster` (its parts: `peers/serve.py`, `peers/commit.py`), which answers in
domain types. A domain error becomes its gRPC status through the one table in
`tierckpt.errors` (a corrupt copy is DATA_LOSS, so a fetcher falls through to the next
holder); anything else is INTERNAL with a fixed message (the details stay in this node's
log, bounded). Every request was decoded by `chunk_wire.register_peer_service` after
`guard` admitted the call, and every name and number in it is validated here
(`tierckptd.wire`) before it is used.

Authorization (DESIGN.md invariant 10). The caller is the configured peer its verified
client cert names (mutual TLS), or the one it claims to be (`auth.caller_names`); a
caller that is no configured peer is refused every call (PERMISSION_DENIED). Then:

- PublishCheckpoint: only by the checkpoint's coordinator (the owner of its `.metadata`,
  `placement.coordinator_of`). A publish by another member is taken as a hint: the
  manifest adopted is the one the coordinator itself answers with.
- PushFile, OfferFile: only by the file's owner or a listed holder of a copy. An offer
  is taken by fetching the copy from the caller (its bulk stream, granted by the
  caller like any fetch) and verifying it as it lands: no byte is taken on its word.
- UpdateReplicas: by the file's owner or a listed holder, naming configured members
  only; any other member may only add itself (it fetched a copy).
- ApplyMark (a cluster rm, pin or unpin): any member, for a mark it made itself (its
  origin_node is the caller); names, kind and stamp are validated.
- Holdings, FetchFile, GrantFetch, ListManifests: any member. A grant (GrantFetch) is
  bound to the caller, its address (without mutual TLS), the file and the range
  (`peers/bulk_server.py`).
- ReportCorrupt (bytes this node sent over its bulk stream failed the caller's
  checksum): any member; never acted on by its word: this node re-hashes its own copy
  (bounded, `peers/recheck.py`) and drops it only when that hash fails.
- Hello (who answers here: node id and failure domain): any caller the token / TLS
  admitted (a Hello may prove the token by challenge-response instead of sending it,
  and is answered with this node's proof, `security.HelloChallenge`), member or not; a
  non-member's Hello makes discovery look again soon (rate-limited per claimed id and in
  all, `membership.Membership.stranger`).

Admission slots (MAX_PER_PEER) count per caller: with mutual TLS the node its verified
certificate names, without it the node id it claims (a connection would be no better a
key: gRPC shares one among every channel a process opens to an address, and opening
one costs no more than making up a claim); all Hellos share one set, so strangers never
take the members' slots.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import grpc
from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    InvalidArgument,
    InvalidName,
    PermissionDenied,
)
from tierckpt.names import check_file_name, check_namespace
from tierckpt.v1 import common_pb2, peer_pb2

from tierckptd.model import FileRecord, State
from tierckptd.ops import metrics
from tierckptd.ops.faults import fault
from tierckptd.peers.bulk_server import BulkServer
from tierckptd.peers.chunk_wire import Chunk, encode_data_chunk, register_peer_service
from tierckptd.peers.client import TRANSFER_TIMEOUT, mark_from_wire, mark_to_wire
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.placement import coordinator_of
from tierckptd.peers.security import caller_names, hello_answer
from tierckptd.rpc.errors import StatusTranslator
from tierckptd.rpc.peer_guard import Admission, Ticket, Watchdog
from tierckptd.wire import (
    MAX_REPLICAS,
    bounded,
    check_node_id,
    check_ref,
    file_entry,
    file_from_entry,
    record_from_info,
    ref,
    state_of,
    to_info,
)

__all__ = [
    "MAX_IN_FLIGHT",
    "MAX_PER_PEER",
    "STALL_TIMEOUT",
    "WORKERS",
    "PeerService",
    "add_peer_service",
]

logger = logging.getLogger(__name__)

# PeerService calls in flight, in total and per calling node; the peer server runs
# WORKERS threads, so HEALTH_THREADS are always free for grpc.health.v1 (liveness probes
# call it on the peer port). A restore fetches a file per rank at a time, a push one file.
MAX_IN_FLIGHT = 24
MAX_PER_PEER = 12
HEALTH_THREADS = 8
WORKERS = MAX_IN_FLIGHT + HEALTH_THREADS
# A call with no message in or out for this long is cancelled (a push stepping aside
# for a save sends a heartbeat every peers.healer.HEARTBEAT seconds).
STALL_TIMEOUT = 20.0

# The admission key every Hello shares (the caller of a Hello need not be a member).
_HELLO_CALLER = "\0hello"

_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.PERMISSION_DENIED: "permission",
    grpc.StatusCode.FAILED_PRECONDITION: "conflict",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "budget",
}


class _LogBudget:
    """At most `burst` log lines per `window` seconds (a flood of refusals must not
    flood the log); the count of the ones left out is logged with the next one."""

    def __init__(self, burst: int = 20, window: float = 10.0) -> None:
        self.burst, self.window = burst, window
        self._lock = threading.Lock()
        self._start, self._used, self._dropped = 0.0, 0, 0

    def take(self) -> tuple[bool, int]:
        """(may log now, lines left out before this one)."""
        now = time.monotonic()
        with self._lock:
            if now - self._start > self.window:
                self._start, self._used = now, 0
            if self._used >= self.burst:
                self._dropped += 1
                return False, 0
            self._used += 1
            dropped, self._dropped = self._dropped, 0
            return True, dropped


class PeerService:
    """The PeerService methods (registered by `chunk_wire.register_peer_service`)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        stall_timeout: float = STALL_TIMEOUT,
        call_limit: float = TRANSFER_TIMEOUT,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_per_peer: int = MAX_PER_PEER,
        mutual_tls: bool = False,
        bulk: BulkServer | None = None,
    ) -> None:
        """`mutual_tls` (`[security] tls_ca`): a caller is the node its client cert
        names, not the node it claims to be. `bulk`: this node's bulk listener, whose
        grants GrantFetch hands out (None: GrantFetch is UNIMPLEMENTED)."""
        self.cluster = cluster
        self.bulk = bulk
        self.mutual_tls = mutual_tls
        self.stall_timeout = stall_timeout
        self.call_limit = call_limit
        self.admission = Admission(max_in_flight, max_per_peer)
        self.watchdog = Watchdog()
        self._log = _LogBudget()
        # Every error of a method answered through the one table (rpc/errors.py): nothing
        # raises out of a method (audit M1).
        self.errors = StatusTranslator(self._internal, log=self._log_line, refused=self._refused)

    # ---- who calls, and may it --------------------------------------------------------
    def caller(self, context: Any) -> str:
        """The configured peer making this call; PermissionDenied for anyone else."""
        mutual_tls = self.mutual_tls
        names = list(dict.fromkeys(caller_names(context, mutual_tls=mutual_tls)))
        members = self.cluster.members
        matched = [n for n in names if n in members]
        if len(matched) == 1 and matched[0] != self.cluster.node_id:
            return matched[0]
        shown = bounded(", ".join(n[:64] for n in names[:4]) or "none", 300)
        if matched:
            raise PermissionDenied(
                f"the caller names {'several nodes' if len(matched) > 1 else 'this node'} "
                f"({shown}) on node {self.cluster.node_id}: each node needs its own "
                "certificate, naming only its node id"
            )
        if mutual_tls:
            raise PermissionDenied(
                f"node {self.cluster.node_id} refuses a peer whose certificate names no "
                f"configured peer (names: {shown}): its subjectAltName must be a node id "
                "listed in [[peers]]"
            )
        raise PermissionDenied(
            f"node {self.cluster.node_id} refuses a peer call from a node that is not in its "
            f"[[peers]] (claimed: {shown}); peers send their [node] id in x-tierckpt-node"
        )

    @contextmanager
    def guard(self, method: str, context: Any) -> Iterator[Ticket]:
        """Before any request byte is read: identify the caller, admit the call within
        the per-peer and total limits, and watch it for stalls (peer_guard)."""
        try:
            # Hello is how a joining node learns who answers at an address, before it is
            # a member anywhere: the token / TLS admitted it; its callers share one slot set.
            caller = _HELLO_CALLER if method == "Hello" else self.caller(context)
        except PermissionDenied as e:
            self._refuse(context, method, "unknown-peer", grpc.StatusCode.PERMISSION_DENIED, e)
        if not self.admission.enter(caller):
            self._refuse(
                context,
                method,
                "busy",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"node {self.cluster.node_id} is serving its limit of peer calls "
                f"({self.admission.per_peer} per peer, {self.admission.total} in all); retry later",
            )
        key = self.watchdog.watch(
            context.cancel, f"peer {method} from {caller}", self.stall_timeout, self.call_limit
        )
        try:
            yield self.watchdog.ticket(key)
        finally:
            self.watchdog.done(key)
            self.admission.leave(caller)

    def _refuse(
        self,
        context: Any,
        method: str,
        reason: str,
        code: grpc.StatusCode,
        why: BaseException | str,
    ) -> NoReturn:
        message = bounded(str(why))
        metrics.PEER_REFUSED.labels(reason=reason).inc()
        self._note(logging.INFO, "peer %s refused: %s", method, message)
        context.abort(code, message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    def _note(self, level: int, fmt: str, *args: object, exc: BaseException | None = None) -> None:
        ok, dropped = self._log.take()
        if ok:
            if dropped:
                logger.log(level, "(%d similar peer log lines left out)", dropped)
            logger.log(level, fmt, *args, exc_info=exc)

    def _internal(self, method: str) -> str:
        return f"{method} failed on node {self.cluster.node_id} (an internal error; see its log)"

    def _log_line(
        self, level: int, fmt: str, args: tuple[object, ...], exc: BaseException | None
    ) -> None:
        self._note(level, "peer " + fmt, *args, exc=exc)

    def _refused(self, method: str, code: grpc.StatusCode, message: str) -> None:
        """A domain error answered (rpc/errors.StatusTranslator): counted by reason when
        it is the caller's doing, logged within the log budget."""
        if code in _REASONS:
            metrics.PEER_REFUSED.labels(reason=_REASONS[code]).inc()
            self._note(logging.INFO, "peer %s refused: %s", method, message)
        else:
            self._note(logging.INFO, "peer %s: %s", method, message)

    def _file(self, namespace: str, checkpoint_id: str, name: str) -> FileRecord:
        return self.cluster.file_record(namespace, checkpoint_id, name)

    # ---- methods ----------------------------------------------------------------------
    def Holdings(
        self, request: common_pb2.CheckpointRef, context: Any
    ) -> peer_pb2.HoldingsResponse:
        def holdings() -> peer_pb2.HoldingsResponse:
            namespace, checkpoint_id = check_ref(request)
            state, files = self.cluster.holdings(namespace, checkpoint_id)  # DURABLE too
            return peer_pb2.HoldingsResponse(
                state=state_of(state), files=[file_entry(f) for f in files]
            )

        return self.errors.call(context, "Holdings", holdings)

    def PublishCheckpoint(
        self, request: common_pb2.CheckpointInfo, context: Any
    ) -> peer_pb2.PublishCheckpointResponse:
        def publish() -> peer_pb2.PublishCheckpointResponse:
            caller = self.caller(context)
            rec = record_from_info(request)
            self._members_only(rec.files.values())
            coordinator = coordinator_of(rec.files)
            what = f"{rec.namespace}/{rec.checkpoint_id}"
            if coordinator == self.cluster.node_id:
                raise PermissionDenied(
                    f"{what} is coordinated by node {self.cluster.node_id} itself (it owns the "
                    f".metadata); node {caller} cannot publish it here"
                )
            if caller != coordinator:
                if self.cluster.state_of(rec.namespace, rec.checkpoint_id) is State.COMMITTED:
                    return peer_pb2.PublishCheckpointResponse()  # known: nothing to take
                if coordinator not in self.cluster.peer_ids:
                    raise PermissionDenied(
                        f"node {caller} does not coordinate {what} (its .metadata belongs to "
                        f"{coordinator[:64] or 'no node'}, which is not a configured peer)"
                    )
                try:
                    rec = self.cluster.manifest_from(coordinator, rec.namespace, rec.checkpoint_id)
                except CheckpointNotFound as e:
                    raise PermissionDenied(
                        f"node {caller} does not coordinate {what}, and its coordinator "
                        f"{coordinator} does not confirm it: {e}"
                    ) from None
                if coordinator_of(rec.files) != coordinator:
                    raise PermissionDenied(f"{coordinator}'s own manifest of {what} disagrees")
                self._members_only(rec.files.values())
            if not self.cluster.published(rec):
                raise CheckpointIncomplete(
                    f"{what} was deleted on node {self.cluster.node_id}; it does not take it back"
                )
            return peer_pb2.PublishCheckpointResponse()

        return self.errors.call(context, "PublishCheckpoint", publish)

    def _members_only(self, files: Any) -> None:
        """Replica lists name configured members only (others are dropped: a node that
        left holds nothing we could fetch)."""
        members = self.cluster.members
        for f in files:
            f.replica_nodes = [n for n in f.replica_nodes if n in members]

    def _copy_to_take(
        self, caller: str, header: peer_pb2.FileHeader, verb: str
    ) -> tuple[str, str, FileRecord]:
        """A copy `caller` may `verb` to this node (PushFile, OfferFile): of a checkpoint this
        node knows (else "publish it first"), of a file whose owner or listed holder
        `caller` is. Returns (namespace, checkpoint id, the file as the header says)."""
        namespace, checkpoint_id = check_ref(header.ref)
        entry = file_from_entry(header.file)
        what = f"{namespace}/{checkpoint_id}/{entry.name}"
        if self.cluster.state_of(namespace, checkpoint_id) is None:
            raise CheckpointIncomplete(
                f"node {self.cluster.node_id} does not know {namespace}/{checkpoint_id}: "
                "publish it first"
            )
        f = self._file(namespace, checkpoint_id, entry.name)
        if caller != f.owner_node and caller not in f.replica_nodes:
            raise PermissionDenied(
                f"node {caller} may not {verb} {what}: only its owner "
                f"({f.owner_node or 'none'}) or a node holding a copy may"
            )
        return namespace, checkpoint_id, entry

    def PushFile(
        self, request_iterator: Iterator[Chunk], context: Any
    ) -> peer_pb2.PushFileResponse:
        def push() -> peer_pb2.PushFileResponse:
            caller = self.caller(context)
            first = next(request_iterator, None)
            if first is None or first.header is None:
                raise InvalidArgument("PushFile: the first message must carry the header")
            namespace, checkpoint_id, entry = self._copy_to_take(caller, first.header, "push")
            pieces = ((c.offset, c.data) for c in request_iterator if c.data)
            received = self.cluster.receive(
                namespace, checkpoint_id, entry.name, pieces, entry.checksums
            )
            return peer_pb2.PushFileResponse(received_bytes=received)

        return self.errors.call(context, "PushFile", push)

    def OfferFile(self, request: peer_pb2.FileHeader, context: Any) -> peer_pb2.PushFileResponse:
        def offer() -> peer_pb2.PushFileResponse:
            caller = self.caller(context)
            namespace, checkpoint_id, entry = self._copy_to_take(caller, request, "offer")
            received = self.cluster.take_offer(
                caller, namespace, checkpoint_id, entry.name, entry.checksums
            )
            return peer_pb2.PushFileResponse(received_bytes=received)

        return self.errors.call(context, "OfferFile", offer)

    def FetchFile(
        self, request: peer_pb2.FetchFileRequest, context: Any
    ) -> Iterator[bytes | peer_pb2.FileChunk]:
        try:
            namespace, checkpoint_id = check_ref(request.ref)
            name = check_file_name(request.file_name)
            served = self.cluster.serve(
                namespace, checkpoint_id, name, request.offset, request.length
            )
            yield peer_pb2.FileChunk(
                header=peer_pb2.FileHeader(
                    ref=ref(namespace, checkpoint_id), file=file_entry(served.file)
                )
            )
            for offset, data in served.pieces:
                fault("peer.serve.chunk")
                yield encode_data_chunk(offset, data)
                metrics.PEER_SENT_BYTES.labels(path="grpc").inc(len(data))
        except Exception as e:
            self.errors.abort(context, "FetchFile", e)

    def GrantFetch(self, request: peer_pb2.FetchFileRequest, context: Any) -> peer_pb2.BulkGrant:
        bulk = self.bulk
        if bulk is None:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"node {self.cluster.node_id} has no bulk listener: use FetchFile",
            )
            raise AssertionError("context.abort returned")  # pragma: no cover

        def grant() -> peer_pb2.BulkGrant:
            caller = self.caller(context)
            namespace, checkpoint_id = check_ref(request.ref)
            name = check_file_name(request.file_name)
            f, length = self.cluster.serving.grantable(
                namespace, checkpoint_id, name, request.offset, request.length
            )
            address = "" if self.mutual_tls else _peer_host(context.peer())
            token = bulk.grants.issue(
                caller,
                address,
                namespace,
                checkpoint_id,
                name,
                request.offset,
                length,
                request.background,
            )
            return peer_pb2.BulkGrant(
                grant=token,
                port=bulk.port,
                file=file_entry(f),
                offset=request.offset,
                length=length,
                expires_in=bulk.grants.ttl,
            )

        return self.errors.call(context, "GrantFetch", grant)

    def ReportCorrupt(
        self, request: peer_pb2.ReportCorruptRequest, context: Any
    ) -> peer_pb2.ReportCorruptResponse:
        def report() -> peer_pb2.ReportCorruptResponse:
            caller = self.caller(context)
            namespace, checkpoint_id = check_ref(request.ref)
            name = check_file_name(request.file_name)
            started = self.cluster.recheck.report(namespace, checkpoint_id, name, caller)
            return peer_pb2.ReportCorruptResponse(rechecking=started)

        return self.errors.call(context, "ReportCorrupt", report)

    def UpdateReplicas(
        self, request: peer_pb2.UpdateReplicasRequest, context: Any
    ) -> peer_pb2.UpdateReplicasResponse:
        def update() -> peer_pb2.UpdateReplicasResponse:
            caller = self.caller(context)
            namespace, checkpoint_id = check_ref(request.ref)
            name = check_file_name(request.file_name)
            what = f"{namespace}/{checkpoint_id}/{name}"
            nodes = list(dict.fromkeys(request.replica_nodes))
            if len(nodes) > MAX_REPLICAS:
                raise InvalidArgument(
                    f"{what}: {len(nodes):,} replica nodes, at most {MAX_REPLICAS}"
                )
            nodes = [check_node_id(n, f"replica node of {what}") for n in nodes]
            strangers = [n for n in nodes if n not in self.cluster.members]
            if strangers:
                raise PermissionDenied(
                    f"{what}: {', '.join(strangers[:4])} are not members of node "
                    f"{self.cluster.node_id}'s cluster; replicas live on configured nodes only"
                )
            f = self._file(namespace, checkpoint_id, name)
            if caller != f.owner_node and caller not in f.replica_nodes:
                # Any member may say it now holds a copy (it fetched one), nothing more.
                if set(nodes) - set(f.replica_nodes) - {caller}:
                    raise PermissionDenied(
                        f"node {caller} may not change the holders of {what}: only its owner "
                        f"({f.owner_node or 'none'}) or a node holding a copy may; another "
                        "node may only add itself"
                    )
                nodes = list(dict.fromkeys([*f.replica_nodes, *(n for n in nodes if n == caller)]))
            self.cluster.set_replicas(namespace, checkpoint_id, name, nodes)
            return peer_pb2.UpdateReplicasResponse()

        return self.errors.call(context, "UpdateReplicas", update)

    def ListManifests(
        self, request: peer_pb2.ListManifestsRequest, context: Any
    ) -> peer_pb2.ListManifestsResponse:
        def manifests() -> peer_pb2.ListManifestsResponse:
            namespace = check_namespace(request.namespace) if request.namespace else ""
            started = self.caller(context) if request.starting else ""
            views = self.cluster.manifests(namespace, started)
            owner = self.cluster.namespace_owner(namespace) if namespace else None
            return peer_pb2.ListManifestsResponse(
                checkpoints=[to_info(v, local_paths=False) for v in views],
                marks=[mark_to_wire(m) for m in self.cluster.marks(namespace)],
                namespace_owner_uid=owner[0] if owner is not None else None,
                namespace_owner_node=owner[1] if owner is not None else "",
                writers=[
                    peer_pb2.NamespaceWriters(namespace=ns, nodes=sorted(nodes), vouched=weak)
                    for ns, (nodes, weak) in sorted(self.cluster.stated_writers(namespace).items())
                ],
            )

        return self.errors.call(context, "ListManifests", manifests)

    def ApplyMark(
        self, request: peer_pb2.CheckpointMark, context: Any
    ) -> peer_pb2.ApplyMarkResponse:
        def apply() -> peer_pb2.ApplyMarkResponse:
            caller = self.caller(context)
            mark = mark_from_wire(request, now=time.time())
            if mark.origin != caller:
                raise PermissionDenied(
                    f"node {caller} may not send a mark made by {mark.origin[:64]}: a node "
                    "sends only the rm/pin/unpin marks it made (others travel in ListManifests)"
                )
            self.cluster.apply_mark(mark)
            return peer_pb2.ApplyMarkResponse()

        return self.errors.call(context, "ApplyMark", apply)

    def Hello(self, request: peer_pb2.HelloRequest, context: Any) -> peer_pb2.HelloResponse:
        def hello() -> peer_pb2.HelloResponse:
            membership = self.cluster.membership
            claimed = request.node_id if len(request.node_id) <= 128 else ""
            try:
                claimed = check_node_id(claimed, "Hello caller") if claimed else ""
            except InvalidName:
                claimed = ""  # only a hint to look again; the answer is the same
            knows = bool(claimed) and claimed in membership.members
            if claimed and not knows:
                membership.stranger(claimed)  # rate-limited (membership.STRANGER_GAP)
            proof = hello_answer(
                membership.hello_key, context.invocation_metadata(), self.cluster.node_id
            )
            if proof:
                context.set_trailing_metadata(proof)
            return peer_pb2.HelloResponse(
                node_id=self.cluster.node_id,
                failure_domain=membership.failure_domain,
                knows_caller=knows,
            )

        return self.errors.call(context, "Hello", hello)


def _peer_host(peer: str) -> str:
    """The IP address of a gRPC peer string ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000")."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rpartition(":")[0].strip("[]")


def add_peer_service(cluster: Cluster, server: Any, **limits: Any) -> PeerService:
    """Register PeerService for `cluster` on the peer server (`limits`: PeerService's
    keyword arguments, e.g. a short stall_timeout in tests)."""
    servicer = PeerService(cluster, **limits)
    register_peer_service(servicer, server)
    return servicer
