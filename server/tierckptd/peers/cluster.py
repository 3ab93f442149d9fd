"""The peer tier: cluster commit, replication to buddies, restore from peers, healing.

One `Cluster` per daemon. It owns the membership (`[[peers]]`, `[replication] copies`,
reloaded on SIGHUP), one gRPC channel per peer, and one background worker thread that
does every push (replication after a commit, healing, repair of a corrupt copy) so that
nothing here ever blocks a save. A healer thread enqueues every committed checkpoint each
`heal_interval` seconds.

No consensus: the DCP coordinator's daemon decides a commit and publishes the cluster
manifest; each file records its owner and replica nodes, and the node responsible for a
file (its owner, or the first reachable holder when the owner lost it) keeps k copies.
Deletions are local to a node (`tierckpt rm`, retention); a node that deleted a
checkpoint refuses pushes and publishes of it until it restarts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from tierckpt.checksum import BlockChecksums
from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    ChecksumMismatch,
    InvalidArgument,
    TierckptError,
)
from tierckpt.memory_files import VerifiedFile
from tierckpt.names import check_checkpoint_id, check_file_name, check_namespace
from tierckpt.v1 import common_pb2, peer_pb2

from tierckptd.catalog import Catalog
from tierckptd.config import PeerConfig, format_size
from tierckptd.memory.incoming import install_copy, restore_plan
from tierckptd.model import CheckpointRecord, CheckpointView, FileRecord, State
from tierckptd.ops import metrics
from tierckptd.peers.chunk_wire import Chunk, PeerStub, encode_data_chunk
from tierckptd.peers.placement import Member, file_key, preference, replica_count
from tierckptd.peers.security import node_client_interceptor
from tierckptd.wire import (
    bounded,
    file_entry,
    file_from_entry,
    record_from_info,
    ref,
    state_of,
    to_info,
)

__all__ = ["PEER_CHANNEL_OPTIONS", "Cluster"]

logger = logging.getLogger(__name__)

Key = tuple[str, str]
ChannelFactory = Callable[[str], grpc.Channel]

CONTROL_TIMEOUT = 2.0
TRANSFER_TIMEOUT = 600.0
PEER_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    # A peer that restarts must be reachable again within a second, not after gRPC's
    # default reconnect backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# Checksum blocks per FetchFile message: fewer, larger messages halve gRPC's per-message
# cost; each is still verified block by block on both ends.
CHUNK_BLOCKS = 4
# Longest a file push, in total, steps aside for saves on this node.
SAVE_YIELD_MAX = 30.0
# A push stepping aside sends an empty chunk this often, so the receiver's watchdog
# (peer_service.STALL_TIMEOUT) sees a live stream.
HEARTBEAT = 2.0


def _unreachable(e: grpc.RpcError) -> bool:
    return e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Cluster:
    """Membership, peer channels and every peer-tier action of one daemon."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        peers: Iterable[PeerConfig] = (),
        copies: int = 1,
        channel_factory: ChannelFactory,
        heal_interval: float = 5.0,
    ) -> None:
        self.catalog = catalog
        self.node_id = catalog.node_id
        self.heal_interval = heal_interval
        self._factory = channel_factory
        self._lock = threading.Lock()
        self._peers: dict[str, PeerConfig] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._members: list[Member] = []
        self._copies = copies
        # One lock per file being fetched or received, with the number of its users:
        # removed when the last one is done, so the dict only holds files in flight.
        self._file_locks: dict[tuple[str, str, str], tuple[threading.Lock, int]] = {}
        # Set by `servers.start_servers` from [security] tls_ca: a PeerService caller is
        # then the node its client cert names, not the node it claims to be.
        self.mutual_tls = False
        self._queue: queue.Queue[tuple[str, tuple[str, ...]] | None] = queue.Queue()
        self._queued: set[tuple[str, tuple[str, ...]]] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The persistent tier's restore of one file (Drainer.restore_file), the last
        # resort of `ensure_local` after local memory and peers; None without one.
        self.persistent_restore: Callable[[str, str, str], int] | None = None
        self.configure(peers, copies)

    # ---- membership -------------------------------------------------------------------
    def configure(self, peers: Iterable[PeerConfig], copies: int) -> None:
        """Apply a (re)loaded peer list and copy count; channels to changed peers reopen."""
        peers = [p for p in peers if p.id != self.node_id]
        with self._lock:
            new = {p.id: p for p in peers}
            for node, old in self._peers.items():
                if node not in new or new[node].address != old.address:
                    channel = self._channels.pop(node, None)
                    if channel is not None:
                        channel.close()
            self._peers = new
            self._copies = copies
            self._members = [
                Member(self.node_id, self.catalog.failure_domain),
                *(Member(p.id, p.failure_domain) for p in peers),
            ]
            k = replica_count(copies, self._members)
            self.catalog.replica_target = k
        logger.info(
            "membership: %d peers (%s), %d extra copies per file",
            len(new),
            ", ".join(sorted(new)) or "none",
            k,
        )

    @property
    def peer_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def _stub(self, node: str) -> PeerStub | None:
        with self._lock:
            peer = self._peers.get(node)
            if peer is None:
                return None
            channel = self._channels.get(node)
            if channel is None:
                channel = self._channels[node] = grpc.intercept_channel(
                    self._factory(peer.address), node_client_interceptor(self.node_id)
                )
            return PeerStub(channel)

    def _holdings(
        self, node: str, namespace: str, checkpoint_id: str, why: str, level: int
    ) -> peer_pb2.HoldingsResponse | None:
        """A peer's holdings of a checkpoint, or None (logged at `level`) if unreachable."""
        stub = self._stub(node)
        if stub is None:
            return None
        try:
            resp: peer_pb2.HoldingsResponse = stub.Holdings(
                ref(namespace, checkpoint_id), timeout=CONTROL_TIMEOUT, wait_for_ready=True
            )
        except grpc.RpcError as e:
            logger.log(
                level,
                "%s %s/%s: no holdings from %s: %s",
                why,
                namespace,
                checkpoint_id,
                node,
                e.code(),
            )
            return None
        return resp

    @contextmanager
    def _file_lock(self, namespace: str, checkpoint_id: str, name: str) -> Iterator[None]:
        """Hold the lock of one file (validated names only); the entry goes with its
        last user, so names asked about once do not stay in memory (audit M6)."""
        key = (
            check_namespace(namespace),
            check_checkpoint_id(checkpoint_id),
            check_file_name(name),
        )
        with self._lock:
            lock, users = self._file_locks.get(key, (threading.Lock(), 0))
            self._file_locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._file_locks[key]
                if users > 1:
                    self._file_locks[key] = (lock, users - 1)
                else:
                    del self._file_locks[key]

    def file_locks_in_use(self) -> int:
        with self._lock:
            return len(self._file_locks)

    @property
    def members(self) -> set[str]:
        """Node ids of the cluster: this node and its configured peers."""
        with self._lock:
            return {self.node_id, *self._peers}

    # ---- threads ----------------------------------------------------------------------
    def start(self) -> None:
        worker = threading.Thread(target=self._work, name="tierckptd-replicator", daemon=True)
        self._threads.append(worker)
        worker.start()
        if self.heal_interval > 0:
            healer = threading.Thread(target=self._heal_loop, name="tierckptd-healer", daemon=True)
            self._threads.append(healer)
            healer.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def enqueue(self, job: str, *args: str) -> None:
        item = (job, tuple(args))
        with self._lock:
            if item in self._queued:
                return
            self._queued.add(item)
        self._queue.put(item)

    def _work(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            with self._lock:
                self._queued.discard(item)
            job, args = item
            try:
                if job == "heal":
                    self.heal(args[0], args[1])
                elif job == "repair":
                    self.ensure_local(args[0], args[1], args[2])
            except CheckpointNotFound:
                pass  # deleted or evicted meanwhile
            except Exception:
                logger.exception("peer job %s %s failed", job, "/".join(args))

    def _heal_loop(self) -> None:
        while not self._stop.wait(self.heal_interval):
            if not self.peer_ids:
                continue
            for namespace, checkpoint_id in self.catalog.committed_keys():
                self.enqueue("heal", namespace, checkpoint_id)

    # ---- start-up ---------------------------------------------------------------------
    def pull_manifests(self) -> int:
        """Adopt committed checkpoints peers know and this node does not (a replacement
        node that came back empty); returns how many were new."""
        known = set(self.catalog.committed_keys())
        adopted: list[CheckpointRecord] = []
        for node in self.peer_ids:
            stub = self._stub(node)
            if stub is None:
                continue
            try:
                resp = stub.ListManifests(
                    peer_pb2.ListManifestsRequest(), timeout=CONTROL_TIMEOUT, wait_for_ready=True
                )
            except grpc.RpcError as e:
                logger.info("no manifests from %s: %s", node, e.code())
                continue
            refused = 0
            for info in resp.checkpoints:
                try:
                    rec = record_from_info(info)
                    if self.catalog.publish(rec) and rec.key not in known:
                        known.add(rec.key)
                        adopted.append(rec)
                except TierckptError as e:
                    refused += 1
                    if refused == 1:
                        logger.warning("a manifest from %s is refused: %s", node, bounded(str(e)))
            if refused:
                metrics.PEER_REFUSED.labels(reason="manifest").inc(refused)
                logger.warning("refused %d of %s's manifests", refused, node)
        if adopted:
            logger.info(
                "adopted %d checkpoints from peers' manifests (no local files)", len(adopted)
            )
            plan = restore_plan(self.node_id, adopted)
            if plan and self.catalog.recycle:
                threading.Thread(
                    target=self.catalog.prewarm_segments,
                    args=(plan, "for the files this node will restore"),
                    name="tierckptd-restore-prewarm",
                    daemon=True,
                ).start()
        return len(adopted)

    # ---- commit -----------------------------------------------------------------------
    def commit(self, namespace: str, checkpoint_id: str, required: list[str]) -> CheckpointView:
        """The DCP coordinator's commit: find remote files, commit, publish, replicate."""
        peers = self.peer_ids
        local = self.catalog.local_committed_files(namespace, checkpoint_id)
        missing = {r for r in required if r not in local}
        remote: dict[str, FileRecord] = {}
        if missing and peers:
            for node in peers:
                resp = self._holdings(node, namespace, checkpoint_id, "commit", logging.WARNING)
                if resp is not None:
                    self._claims(node, namespace, checkpoint_id, resp, missing, remote)
        view = self.catalog.commit(namespace, checkpoint_id, required, remote)
        if peers:
            info = to_info(view, local_paths=False)
            for node in peers:
                stub = self._stub(node)
                if stub is None:
                    continue
                try:
                    stub.PublishCheckpoint(info, timeout=CONTROL_TIMEOUT, wait_for_ready=True)
                except grpc.RpcError as e:
                    logger.warning(
                        "commit %s/%s: cannot publish to %s (%s); it adopts the manifest "
                        "when it restarts or when a healer pushes to it",
                        namespace,
                        checkpoint_id,
                        node,
                        e.code(),
                    )
            self.enqueue("heal", namespace, checkpoint_id)
        return view

    def _claims(
        self,
        node: str,
        namespace: str,
        checkpoint_id: str,
        resp: peer_pb2.HoldingsResponse,
        missing: set[str],
        remote: dict[str, FileRecord],
    ) -> None:
        """Take `node`'s claims on missing files into `remote`: a node claims only files it
        owns (the owner is the node that answered, whatever it says), and two nodes
        claiming one file with different bytes refuse the commit; nothing is "first
        wins" (audit H3)."""
        for e_ in resp.files:
            if e_.name not in missing:
                continue
            try:
                f = file_from_entry(e_)
            except TierckptError as e:
                metrics.PEER_REFUSED.labels(reason="invalid").inc()
                logger.warning(
                    "commit %s/%s: %s's holdings are refused: %s",
                    namespace,
                    checkpoint_id,
                    node,
                    bounded(str(e)),
                )
                return
            f.owner_node, f.replica_nodes = node, []
            other = remote.get(f.name)
            if other is None:
                remote[f.name] = f
            elif (other.size, other.checksums) != (f.size, f.checksums):
                metrics.PEER_REFUSED.labels(reason="conflict").inc()
                raise CheckpointIncomplete(
                    f"cannot commit {namespace}/{checkpoint_id}: nodes {other.owner_node} and "
                    f"{node} both hold {f.name} with different contents ({other.size} and "
                    f"{f.size} bytes); a rank wrote it twice, or a node is misbehaving: "
                    "save under a new checkpoint_id"
                )

    def published(self, rec: CheckpointRecord) -> bool:
        """PeerService.PublishCheckpoint (the caller authorized): adopt, then replicate
        the files we own."""
        if not self.catalog.publish(rec):
            return False
        self.enqueue("heal", rec.namespace, rec.checkpoint_id)
        return True

    def manifest_from(self, node: str, namespace: str, checkpoint_id: str) -> CheckpointRecord:
        """The manifest `node` keeps of a checkpoint, validated (a publish by a node that
        does not coordinate the checkpoint is taken as a hint to ask its coordinator)."""
        stub = self._stub(node)
        if stub is None:
            raise CheckpointNotFound(f"node {node} is not a configured peer")
        try:
            resp = stub.ListManifests(
                peer_pb2.ListManifestsRequest(namespace=namespace), timeout=CONTROL_TIMEOUT
            )
        except grpc.RpcError as e:
            raise CheckpointNotFound(
                f"node {node} did not answer for {namespace}/{checkpoint_id}: {e.code().name}"
            ) from None
        for info in resp.checkpoints:
            if info.ref.checkpoint_id == checkpoint_id and info.ref.namespace == namespace:
                return record_from_info(info)
        raise CheckpointNotFound(f"node {node} does not know {namespace}/{checkpoint_id}")

    # ---- receiving copies -------------------------------------------------------------
    def receive(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        chunks: Iterator[Chunk],
        checksums: BlockChecksums | None = None,
    ) -> int:
        """Store a copy arriving as chunks, verified block by block; returns bytes taken
        (0 when the file was already held here)."""
        with self._file_lock(namespace, checkpoint_id, name):
            f, path = self.catalog.file_view(namespace, checkpoint_id, name)
            assert f.checksums is not None
            if checksums is not None and checksums != f.checksums:
                raise InvalidArgument(
                    f"{namespace}/{checkpoint_id}/{name}: the pushed checksums differ from "
                    "this node's manifest"
                )
            if path:
                return 0
            return self._receive_unlocked(namespace, checkpoint_id, name, chunks)

    # ---- serving copies ---------------------------------------------------------------
    def serve_chunks(
        self, namespace: str, checkpoint_id: str, name: str, offset: int, length: int
    ) -> Iterator[bytes | peer_pb2.FileChunk]:
        """Verified chunks of a held file (CHUNK_BLOCKS blocks each); a corrupt copy raises
        ChecksumMismatch (DATA_LOSS for the fetcher) and is dropped and repaired here."""
        f, path = self.catalog.file_view(namespace, checkpoint_id, name)
        if not path:
            raise CheckpointNotFound(
                f"node {self.node_id} holds no copy of {namespace}/{checkpoint_id}/{name}"
            )
        assert f.checksums is not None
        end = f.size if length == 0 else offset + length
        if offset > f.size or end > f.size:
            raise InvalidArgument(f"range {offset}..{end} outside {name}'s {f.size} bytes")
        yield peer_pb2.FileChunk(
            header=peer_pb2.FileHeader(ref=ref(namespace, checkpoint_id), file=file_entry(f))
        )
        step = f.checksums.block_size
        what = f"{namespace}/{checkpoint_id}/{name} on node {self.node_id}"
        try:
            with VerifiedFile(path, f.size, f.checksums, what=what) as vf:
                pos = offset
                while pos < end:
                    n = min((pos // step + CHUNK_BLOCKS) * step, end) - pos
                    yield encode_data_chunk(pos, vf.read_blocks_bytes(pos, n))
                    pos += n
        except ChecksumMismatch as e:
            self.corrupt(namespace, checkpoint_id, name, str(e), where="served")
            raise
        except FileNotFoundError:
            raise CheckpointNotFound(f"{what}: the copy vanished (evicted)") from None

    def holdings(self, namespace: str, checkpoint_id: str) -> peer_pb2.HoldingsResponse:
        state, files = self.catalog.holdings(namespace, checkpoint_id)
        return peer_pb2.HoldingsResponse(
            state=state_of(state), files=[file_entry(f) for f in files]
        )

    # ---- corruption -------------------------------------------------------------------
    def corrupt(
        self, namespace: str, checkpoint_id: str, name: str, reason: str, where: str
    ) -> None:
        """A local copy failed verification: never serve it, count it, replace it."""
        metrics.CORRUPT_COPIES.labels(where=where).inc()
        dropped = self.catalog.drop_local_copy(namespace, checkpoint_id, name)
        logger.error(
            "corrupt copy of %s/%s/%s on node %s (%s): %s; fetching a verified copy from a peer",
            namespace,
            checkpoint_id,
            name,
            self.node_id,
            where,
            reason,
        )
        if dropped and where != "local":
            self.enqueue("repair", namespace, checkpoint_id, name)

    # ---- restore ----------------------------------------------------------------------
    def ensure_local(
        self, namespace: str, checkpoint_id: str, name: str, repair: bool = False
    ) -> tuple[FileRecord, str]:
        """A verified local copy of one file: (its record, its local path)."""
        what = f"{namespace}/{checkpoint_id}/{name}"
        with self._file_lock(namespace, checkpoint_id, name):
            f, path = self.catalog.file_view(namespace, checkpoint_id, name)
            assert f.checksums is not None
            if path and not repair:
                return f, path
            if path:
                ok, reason = self.catalog.tier.verify_file(Path(path), f.size, f.checksums)
                if ok:
                    logger.info("repair of %s asked, but the local copy verifies", what)
                    return f, path
                self.corrupt(namespace, checkpoint_id, name, reason, where="local")
            peers = self.peer_ids
            if not peers:
                restored = self._from_persistent(namespace, checkpoint_id, name)
                if restored is not None:
                    return restored
                if repair:
                    raise ChecksumMismatch(
                        f"{what}: the local copy on node {self.node_id} is corrupt and there "
                        "is no peer to fetch a valid copy from (configure [[peers]])"
                    )
                raise CheckpointNotFound(
                    f"{what}: no valid copy on this node and no peer to fetch it from "
                    "(configure [[peers]])"
                )
            order = [f.owner_node, *f.replica_nodes, *peers]
            tried: list[str] = []
            for node in dict.fromkeys(n for n in order if n and n != self.node_id):
                stub = self._stub(node)
                if stub is None:
                    continue
                tried.append(node)
                try:
                    # Ask first (waits for a restarting peer's channel, skips non-holders).
                    held = stub.Holdings(
                        ref(namespace, checkpoint_id),
                        timeout=CONTROL_TIMEOUT,
                        wait_for_ready=True,
                    )
                    if name not in {e_.name for e_ in held.files}:
                        continue
                    chunks = stub.FetchFile(
                        peer_pb2.FetchFileRequest(
                            ref=ref(namespace, checkpoint_id), file_name=name
                        ),
                        timeout=TRANSFER_TIMEOUT,
                    )
                    got = self._receive_unlocked(namespace, checkpoint_id, name, chunks)
                except grpc.RpcError as e:
                    logger.warning("fetch of %s from %s failed: %s", what, node, e.code())
                    continue
                except ChecksumMismatch as e:
                    logger.error("fetch of %s from %s: %s", what, node, e)
                    continue
                metrics.FETCHED_BYTES.inc(got)
                f, path = self.catalog.file_view(namespace, checkpoint_id, name)
                logger.info("fetched %s from %s (%s)", what, node, format_size(f.size))
                if f.owner_node != self.node_id:
                    self._broadcast_replicas(namespace, checkpoint_id, name, f.replica_nodes)
                return f, path
            restored = self._from_persistent(namespace, checkpoint_id, name)
            if restored is not None:
                return restored
            raise ChecksumMismatch(
                f"no valid copy of {what} on any reachable node (tried "
                f"{', '.join(tried) or 'none'}); the file is lost unless a peer comes back"
            )

    def _from_persistent(
        self, namespace: str, checkpoint_id: str, name: str
    ) -> tuple[FileRecord, str] | None:
        """The persistent tier's copy, installed locally; None without a tier or copy."""
        if self.persistent_restore is None:
            return None
        what = f"{namespace}/{checkpoint_id}/{name}"
        try:
            got = self.persistent_restore(namespace, checkpoint_id, name)
        except Exception as e:
            logger.error("restore of %s from the persistent tier failed: %s", what, e)
            return None
        metrics.FETCHED_BYTES.inc(got)
        return self.catalog.file_view(namespace, checkpoint_id, name)

    def _receive_unlocked(
        self, namespace: str, checkpoint_id: str, name: str, chunks: Iterator[Chunk]
    ) -> int:
        pieces = ((c.offset, c.data) for c in chunks if c.data)
        what = f"{namespace}/{checkpoint_id}/{name}"
        return install_copy(self.catalog, namespace, checkpoint_id, name, pieces, what=what)

    def _broadcast_replicas(
        self, namespace: str, checkpoint_id: str, name: str, replicas: list[str]
    ) -> None:
        req = peer_pb2.UpdateReplicasRequest(
            ref=ref(namespace, checkpoint_id), file_name=name, replica_nodes=replicas
        )
        for node in self.peer_ids:
            stub = self._stub(node)
            if stub is None:
                continue
            try:
                stub.UpdateReplicas(req, timeout=CONTROL_TIMEOUT, wait_for_ready=True)
            except grpc.RpcError as e:
                logger.debug("UpdateReplicas to %s: %s", node, e.code())

    # ---- replication and healing ------------------------------------------------------
    def _push(self, node: str, view: CheckpointView, f: FileRecord, knows: bool) -> bool:
        stub = self._stub(node)
        if stub is None:
            return False
        what = f"{view.namespace}/{view.checkpoint_id}/{f.name}"
        try:
            if not knows:
                stub.PublishCheckpoint(
                    to_info(view, local_paths=False), timeout=CONTROL_TIMEOUT, wait_for_ready=True
                )
        except grpc.RpcError as e:
            logger.warning(
                "cannot publish %s/%s to %s: %s",
                view.namespace,
                view.checkpoint_id,
                node,
                e.details(),
            )
            return False
        path = view.local_paths.get(f.name, "")
        if not path:
            return False
        assert f.checksums is not None
        step = f.checksums.block_size
        header = peer_pb2.FileHeader(
            ref=ref(view.namespace, view.checkpoint_id), file=file_entry(f)
        )

        patience = time.monotonic() + SAVE_YIELD_MAX

        def chunks() -> Iterator[bytes | peer_pb2.FileChunk]:
            yield peer_pb2.FileChunk(header=header)
            with open(path, "rb", buffering=0) as fh:
                pos = 0
                while pos < f.size:
                    # Between chunks: a save may start mid-file.
                    while self._yield_to_saves(patience, HEARTBEAT):
                        yield encode_data_chunk(pos, b"")  # still here
                    data = fh.read(min(step, f.size - pos))
                    if not data:
                        return
                    yield encode_data_chunk(pos, data)
                    pos += len(data)

        try:
            stub.PushFile(chunks(), timeout=TRANSFER_TIMEOUT)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DATA_LOSS:
                ok, reason = self.catalog.tier.verify_file(Path(path), f.size, f.checksums)
                if not ok:
                    self.corrupt(view.namespace, view.checkpoint_id, f.name, reason, where="pushed")
            logger.warning("push of %s to %s failed: %s: %s", what, node, e.code(), e.details())
            return False
        except FileNotFoundError:
            return False
        metrics.REPLICATED_BYTES.inc(f.size)
        logger.info("replicated %s to %s (%s)", what, node, format_size(f.size))
        return True

    def _yield_to_saves(self, until: float, beat: float) -> bool:
        """Replication steps aside while a save is writing on this node, so it does not
        compete with training for CPU and memory bandwidth; each push waits at most
        SAVE_YIELD_MAX in total, so back-to-back saves cannot starve it. Returns True
        when it waited `beat` seconds and the save still runs (send a heartbeat)."""
        beat_at = time.monotonic() + beat
        while self.catalog.saving() and time.monotonic() < until and not self._stop.is_set():
            if time.monotonic() >= beat_at:
                return True
            time.sleep(0.05)
        return False

    def _responsible(self, f: FileRecord, holders: list[str]) -> bool:
        if f.owner_node in holders:
            return f.owner_node == self.node_id
        order = [*f.replica_nodes, *sorted(holders)]
        return next(n for n in order if n in holders) == self.node_id

    def heal(self, namespace: str, checkpoint_id: str) -> None:
        """Give every file of a checkpoint k verified extra copies on reachable nodes.

        Pushes only the files this node is responsible for; records what it finds
        ("under-replicated", "lost") so `ls` shows it on this node.
        """
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return
        if view.state not in (State.COMMITTED, State.REPLICATED, State.DURABLE):
            return
        with self._lock:
            members = list(self._members)
        k = self.catalog.replica_target
        holdings: dict[str, set[str]] = {self.node_id: {f.name for f in view.files if f.held}}
        knows: dict[str, bool] = {}
        for node in self.peer_ids:
            resp = self._holdings(node, namespace, checkpoint_id, "heal", logging.DEBUG)
            if resp is None:
                continue
            holdings[node] = {e_.name for e_ in resp.files}
            knows[node] = resp.state != common_pb2.CHECKPOINT_STATE_UNSPECIFIED
        reachable = list(holdings)
        lost: list[str] = []
        under: list[str] = []
        for f in view.files:
            holders = [n for n in reachable if f.name in holdings[n]]
            if not holders:
                lost.append(f.name)
                continue
            replicas = list(f.replica_nodes)
            if self.node_id in holders and self._responsible(f, holders):
                copies = list(holders)
                key = file_key(namespace, checkpoint_id, f.name)
                candidates = [f.owner_node, *preference(key, f.owner_node, members)]
                for node in dict.fromkeys(candidates):
                    if len(copies) >= k + 1:
                        break
                    if node in copies or node not in knows:
                        continue
                    if self._push(node, view, f, knows[node]):
                        copies.append(node)
                        knows[node] = True
                rank = {n: i for i, n in enumerate(candidates)}
                replicas = sorted(
                    (n for n in copies if n != f.owner_node), key=lambda n: rank.get(n, 1 << 30)
                )
                if replicas != f.replica_nodes:
                    self.catalog.set_replicas(namespace, checkpoint_id, f.name, replicas)
                    self._broadcast_replicas(namespace, checkpoint_id, f.name, replicas)
                holders = copies
            claimed = {f.owner_node, *replicas}
            if len(holders) < k + 1 and not claimed <= set(holders):
                under.append(f.name)
        mark = "lost" if lost else "under-replicated" if under else ""
        before = {v.checkpoint_id: v for v in self.catalog.list_checkpoints(namespace)}
        had = before.get(checkpoint_id)
        previous = ""
        if had is not None:
            previous = next((t for t in had.tiers if t in ("lost", "under-replicated")), "")
        self.catalog.set_health(namespace, checkpoint_id, mark)
        if mark != previous:
            if lost:
                logger.error(
                    "%s/%s: no reachable node holds a valid copy of %s; these files cannot "
                    "be restored until a holder comes back",
                    namespace,
                    checkpoint_id,
                    ", ".join(lost),
                )
            elif under:
                logger.warning(
                    "%s/%s is under-replicated: %s have fewer than %d extra copies on "
                    "reachable nodes",
                    namespace,
                    checkpoint_id,
                    ", ".join(under),
                    k,
                )
            else:
                logger.info(
                    "%s/%s: every file has %d extra copies again", namespace, checkpoint_id, k
                )
        metrics.UNDER_REPLICATED.set(self.catalog.unhealthy_count())
