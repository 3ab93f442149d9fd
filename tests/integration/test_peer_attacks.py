"""The security audit's attacks on the peer port, re-run against a real daemon.

One victim daemon ("victim") peers with two configured nodes, "mallory" and "buddy",
both small in-process PeerServices that answer everything (so the victim's own calls to
its peers return at once). The attacker speaks PeerService to the victim as "mallory":
a configured peer without mutual TLS, whose identity is only what it claims, the
strongest position the audit's attacks assume. Each test reproduces an attack (C2, H3,
H4, M1, L1, L5) and asserts the property that defeats it; tests use distinct namespaces
on the one daemon.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.daemon_client import DaemonClient
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.config import SecurityConfig
from tierckptd.peers.chunk_wire import PeerStub, encode_data_chunk
from tierckptd.peers.security import node_client_interceptor, peer_channel_factory

from tests.support.certs import make_certs
from tests.support.daemon_process import DaemonProcess
from tests.support.fake_peer import FakePeer, code_of
from tests.support.ports import free_ports
from tests.support.raw_rpc import file_entry, raw_save, write_files
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

MIB = 1 << 20
CODE = grpc.StatusCode


# ---- the victim's two configured peers ---------------------------------------------------


@dataclass
class Victim:
    daemon: DaemonProcess
    client: DaemonClient
    peer_address: str
    metrics_url: str
    fakes: dict[str, FakePeer]
    stack: ExitStack

    def channel(self, node: str | None) -> grpc.Channel:
        """A channel to the victim's peer port claiming to be `node` (None: no claim)."""
        channel = grpc.insecure_channel(self.peer_address)
        self.stack.callback(channel.close)
        if node is None:
            return channel
        return grpc.intercept_channel(channel, node_client_interceptor(node))

    def stub(self, node: str | None = "mallory") -> PeerStub:
        return PeerStub(self.channel(node))

    def metric(self, sample: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            body = r.read().decode()
        m = re.search(rf"^{re.escape(sample)} (\S+)$", body, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def victim() -> Iterator[Victim]:
    with ExitStack() as stack:
        fakes = {"mallory": FakePeer(), "buddy": FakePeer()}
        addresses = {}
        for node, fake in fakes.items():
            server = grpc.server(futures.ThreadPoolExecutor(4))
            peer_pb2_grpc.add_PeerServiceServicer_to_server(fake, server)
            addresses[node] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            server.start()
            stack.callback(server.stop, 0)
        port, metrics_port = free_ports(2)
        daemon = DaemonProcess(
            {
                "node": {"id": "victim"},
                "listen": {"peer": f"127.0.0.1:{port}"},
                "memory": {"budget": "48MiB"},
                "retention": {"memory_keep_last": 2},
                "replication": {"copies": 1, "heal_interval": 3600.0},
                "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
                "peers": [{"id": n, "address": a} for n, a in addresses.items()],
            },
            name="victim",
        )
        stack.callback(daemon.cleanup)
        client = DaemonClient(daemon.address, timeout_s=30)
        stack.callback(client.close)
        yield Victim(
            daemon,
            client,
            f"127.0.0.1:{port}",
            f"http://127.0.0.1:{metrics_port}/metrics",
            fakes,
            stack,
        )


# ---- helpers ---------------------------------------------------------------------------


def manifest(
    ns: str,
    cid: str,
    files: list[common_pb2.FileEntry] | None = None,
    *,
    committed: float | None = None,
    sequence: int = 1,
    owner: str = "mallory",
) -> common_pb2.CheckpointInfo:
    """A manifest coordinated by `owner` (it owns the .metadata)."""
    now = time.time() if committed is None else committed
    return common_pb2.CheckpointInfo(
        ref=common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid),
        state=common_pb2.COMMITTED,
        created_unix=min(now, time.time()),
        committed_unix=now,
        sequence=sequence,
        files=files if files is not None else [file_entry(".metadata", b"fake-meta", owner)],
        pinned=True,
    )


def publish(v: Victim, info: common_pb2.CheckpointInfo, node: str = "mallory") -> grpc.StatusCode:
    return code_of(lambda: v.stub(node).PublishCheckpoint(info, timeout=30))


def save(v: Victim, ns: str, cid: str) -> None:
    """A real one-rank save of `cid` on the victim, with its own .metadata."""
    raw_save(
        v.client, ns, cid, {".metadata": b"meta-" + cid.encode(), "__0_0.distcp": os.urandom(3000)}
    )


def ids(v: Victim, ns: str) -> list[str]:
    return [c.checkpoint_id for c in v.client.list_checkpoints(ns)]


def tree(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mode for p in sorted(root.rglob("*"))}


# ---- C2: names from peers --------------------------------------------------------------


def test_traversal_names_write_and_delete_nothing_outside_the_memory_dir(
    victim: Victim, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"secret")
    (outside / "secret.bin").chmod(0o644)
    # The audit's e3 target: "../.." from the data root is the daemon's own base dir.
    target = victim.daemon.base_dir / "audit-victim"
    target.mkdir()
    (target / "secret.bin").write_bytes(b"keep me")
    before = tree(tmp_path), tree(target)
    refs = [
        (f"../../../..{outside}", "trav-id"),
        (str(outside / "absns"), "pub-abs"),
        ("..", "x"),
        ("a/b", "x"),
        ("ok", "../x"),
        ("ok", str(outside / "y")),
        ("ok", "a\x00b"),
        ("x" * 129, "y"),
        *[("../..", cid) for cid in ("audit-victim", "audit-z1", "audit-z2")],  # e3
    ]
    for ns, cid in refs:
        assert publish(victim, manifest(ns, cid)) == CODE.INVALID_ARGUMENT, (ns, cid)
    for name in ("../../x", str(outside / "f"), "..", "a/b"):
        info = manifest(
            "trav",
            "step-1",
            [file_entry(".metadata", b"m", "mallory"), file_entry(name, b"d", "mallory")],
        )
        assert publish(victim, info) == CODE.INVALID_ARGUMENT, name
    for node in ("../x", "a/b"):
        info = manifest("trav", "step-2", [file_entry(".metadata", b"m", "mallory", (node,))])
        assert publish(victim, info) == CODE.INVALID_ARGUMENT, node
    assert (tree(tmp_path), tree(target)) == before
    assert (target / "secret.bin").read_bytes() == b"keep me"
    assert "trav" not in victim.client.status().namespaces


# ---- H3: what a peer says cannot destroy or poison state ---------------------------------


FAKES = ("fake-1", "fake-2", "fake-3")


def test_far_future_manifests_do_not_evict_real_checkpoints(victim: Victim) -> None:
    ns = "jobR"
    save(victim, ns, "step-1")
    save(victim, ns, "step-2")
    real = {cid: victim.daemon.data_dir(ns, cid) for cid in ("step-1", "step-2")}
    # The audit's 6a: committed_unix=4e9 made two fakes "newest" and evicted the real ones.
    # Time orders nothing now (audit 3, H6): a fake is taken whatever its time, dated when
    # it arrived, never the newest of a namespace its coordinator does not write (audit 3,
    # H2), and only ever competes with its own coordinator's checkpoints for
    # memory_keep_last.
    for cid in FAKES:
        assert publish(victim, manifest(ns, cid, committed=4e9, sequence=10**9)) == CODE.OK
    assert victim.client.get_checkpoint(ns).checkpoint_id == "step-2"
    # The fakes compete only with each other (mallory coordinates them): fake-1 leaves the
    # window, unless the healer found it LOST first (the fake peer holds no copy), and a
    # LOST checkpoint waits until `memory_keep_last` complete ones are newer; either is
    # right, the healer's timing picks.
    listed = set(ids(victim, ns))
    assert {"step-1", "step-2", "fake-2", "fake-3"} <= listed <= {"step-1", "step-2", *FAKES}
    assert victim.client.get_checkpoint(ns, "fake-3").committed_unix <= time.time() + 1
    assert all(p.is_dir() and any(p.iterdir()) for p in real.values())
    assert not victim.client.get_checkpoint(ns, "fake-3").pinned  # a peer cannot pin here
    save(victim, ns, "step-3")
    assert victim.client.get_checkpoint(ns).checkpoint_id == "step-3"
    listed = set(ids(victim, ns))
    assert {"step-2", "step-3", "fake-2", "fake-3"} <= listed <= {"step-2", "step-3", *FAKES}


def test_a_publish_never_loses_a_save(victim: Victim) -> None:
    ns, cid = "job6b", "step-1"
    files = {".metadata": b"real-meta", "__0_0.distcp": os.urandom(5000)}
    write_files(victim.client, ns, cid, files)
    on_disk = victim.daemon.data_dir(ns, cid) / "__0_0.distcp"
    # The audit's 6b: the same id with other checksums made publish unlink the files.
    other = manifest(
        ns,
        cid,
        [
            file_entry(".metadata", b"evil-meta", "mallory"),
            file_entry("__0_0.distcp", b"x" * 5000, "victim"),
        ],
    )
    assert publish(victim, other) == CODE.FAILED_PRECONDITION
    # Matching data checksums, but the .metadata committed here: this node commits it.
    same = manifest(
        ns,
        cid,
        [
            file_entry(".metadata", b"evil-meta", "mallory"),
            file_entry("__0_0.distcp", files["__0_0.distcp"], "victim"),
        ],
    )
    assert publish(victim, same) == CODE.FAILED_PRECONDITION
    assert on_disk.read_bytes() == files["__0_0.distcp"]
    info = victim.client.commit_checkpoint(ns, cid, list(files))
    assert info.state == "COMMITTED" and all(f.local_path for f in info.files)
    # Committed here by the victim: mallory is not its coordinator (audit 3, M2).
    assert publish(victim, other) == CODE.PERMISSION_DENIED
    for name, data in files.items():
        assert Path(victim.client.ensure_local(ns, cid, name).local_path).read_bytes() == data


def test_fake_replica_claims_are_refused(victim: Victim) -> None:
    ns, cid = "job6c", "step-1"
    save(victim, ns, cid)
    stub = victim.stub("mallory")

    def update(nodes: list[str], node: str = "mallory") -> grpc.StatusCode:
        req = peer_pb2.UpdateReplicasRequest(
            ref=common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid),
            file_name="__0_0.distcp",
            replica_nodes=nodes,
        )
        return code_of(lambda: victim.stub(node).UpdateReplicas(req, timeout=10))

    assert update(["x", "y", "z"]) == CODE.PERMISSION_DENIED  # the audit's 6c
    assert update(["buddy"]) == CODE.PERMISSION_DENIED  # not the owner, holds no copy
    assert update(["x" * 65] * 1) == CODE.PERMISSION_DENIED
    assert update([f"n{i}" for i in range(100)]) == CODE.INVALID_ARGUMENT
    info = victim.client.get_checkpoint(ns, cid)
    assert info.state == "COMMITTED"
    assert all(f.replica_nodes == () for f in info.files)
    # Mallory may push nothing it neither owns nor holds.
    header = peer_pb2.FileHeader(
        ref=common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid),
        file=info_entry(info.file("__0_0.distcp")),
    )
    pushed = iter([peer_pb2.FileChunk(header=header), encode_data_chunk(0, b"x")])
    assert code_of(lambda: stub.PushFile(pushed, timeout=10)) == CODE.PERMISSION_DENIED


def test_an_offer_is_taken_from_a_holder_only_and_as_verified_bytes_only(
    victim: Victim,
) -> None:
    """OfferFile (a push by pull): the victim takes a copy only from the file's owner
    or a listed holder, of a checkpoint it knows, by fetching it from that node and
    verifying every block against its own manifest: forged bytes or forged checksums
    install nothing."""
    ns, cid, name = "job-offer", "step-1", "__0_0.distcp"
    good = os.urandom(5000)
    entry = file_entry(name, good, "mallory")
    meta = file_entry(".metadata", b"meta-offer", "mallory")
    assert publish(victim, manifest(ns, cid, [meta, entry])) == CODE.OK

    def offer(node: str | None, header: peer_pb2.FileHeader) -> grpc.StatusCode:
        return code_of(lambda: victim.stub(node).OfferFile(header, timeout=30))

    def header(checkpoint_id: str, f: common_pb2.FileEntry) -> peer_pb2.FileHeader:
        ref = common_pb2.CheckpointRef(namespace=ns, checkpoint_id=checkpoint_id)
        return peer_pb2.FileHeader(ref=ref, file=f)

    def local_path() -> str:
        return str(victim.client.get_checkpoint(ns, cid).file(name).local_path or "")

    mallory = victim.fakes["mallory"]
    mallory.holdings[cid] = [entry]
    mallory.served[name] = good
    assert offer("buddy", header(cid, entry)) == CODE.PERMISSION_DENIED  # neither owner nor holder
    assert offer(None, header(cid, entry)) in (CODE.UNAUTHENTICATED, CODE.PERMISSION_DENIED)
    assert offer("mallory", header("step-unknown", entry)) == CODE.FAILED_PRECONDITION
    # Checksums other than the manifest's: refused before a byte is fetched.
    other = file_entry(name, b"y" * len(good), "mallory")
    assert offer("mallory", header(cid, other)) == CODE.INVALID_ARGUMENT
    # Forged bytes under the true checksums: they fail where they land.
    mallory.served[name] = b"x" * len(good)
    assert offer("mallory", header(cid, entry)) == CODE.DATA_LOSS
    assert not local_path()
    # The true bytes: taken, bit-exact; offered again, nothing is taken twice.
    mallory.served[name] = good
    answer = victim.stub("mallory").OfferFile(header(cid, entry), timeout=30)
    assert answer.received_bytes == len(good)
    assert Path(local_path()).read_bytes() == good
    assert victim.stub("mallory").OfferFile(header(cid, entry), timeout=30).received_bytes == 0


def info_entry(f: Any) -> common_pb2.FileEntry:
    return common_pb2.FileEntry(
        name=f.name,
        size=f.size,
        checksums=common_pb2.BlockChecksums(
            algorithm=f.checksums.algorithm,
            block_size=f.checksums.block_size,
            block_digests=f.checksums.digests,
        ),
        owner_node=f.owner_node,
    )


def test_commit_time_holdings_are_claims_on_own_files_only(victim: Victim) -> None:
    ns = "jobHold"
    theirs = b"rank-1-bytes" * 100
    victim.fakes["buddy"].holdings["step-1"] = [file_entry("__1_0.distcp", theirs, "mallory")]
    write_files(victim.client, ns, "step-1", {".metadata": b"m1", "__0_0.distcp": b"a" * 100})
    info = victim.client.commit_checkpoint(
        ns, "step-1", [".metadata", "__0_0.distcp", "__1_0.distcp"]
    )
    assert info.file("__1_0.distcp").owner_node == "buddy"  # whatever it said
    # Two peers claiming one file with different bytes: refused, never "first wins".
    victim.fakes["buddy"].holdings["step-2"] = [file_entry("__1_0.distcp", theirs, "buddy")]
    victim.fakes["mallory"].holdings["step-2"] = [
        file_entry("__1_0.distcp", b"evil" * 300, "mallory")
    ]
    write_files(victim.client, ns, "step-2", {".metadata": b"m2", "__0_0.distcp": b"b" * 100})
    with pytest.raises(Exception, match="different contents") as e:
        victim.client.commit_checkpoint(ns, "step-2", [".metadata", "__0_0.distcp", "__1_0.distcp"])
    assert type(e.value).__name__ == "CheckpointIncomplete"
    # L1: what the victim told its peers carries no local path.
    published = [i for i in victim.fakes["buddy"].published if i.ref.namespace == ns]
    assert published and all(not f.local_path for i in published for f in i.files)


# ---- M1 and bounds -----------------------------------------------------------------------


def test_a_poisoned_sequence_is_refused_and_listing_still_works(victim: Victim) -> None:
    ns = "jobM1"
    for sequence in (2**64 - 1, 2**63):
        assert publish(victim, manifest(ns, "poison", sequence=sequence)) == CODE.INVALID_ARGUMENT
    assert publish(victim, manifest(ns, "edge", sequence=2**63 - 1)) == CODE.OK
    save(victim, ns, "step-1")
    assert victim.client.get_checkpoint(ns, "step-1").sequence <= 2**63 - 1
    assert {"edge", "step-1"} <= set(ids(victim, ns))
    assert victim.client.list_checkpoints("")  # every namespace still lists
    listed = victim.stub("buddy").ListManifests(peer_pb2.ListManifestsRequest(), timeout=10)
    assert listed.checkpoints
    # L1: a peer gets no local paths (ListManifests, Holdings).
    assert all(not f.local_path for c in listed.checkpoints for f in c.files)
    held = victim.stub("buddy").Holdings(
        common_pb2.CheckpointRef(namespace=ns, checkpoint_id="step-1"), timeout=10
    )
    assert held.files and all(not f.local_path for f in held.files)


def test_oversized_and_malformed_manifests_are_refused(victim: Victim) -> None:
    ns = "jobBig"
    used = victim.client.status().used_bytes
    meta = file_entry(".metadata", b"m", "mallory")
    tiny_blocks = common_pb2.FileEntry(
        name="__0_0.distcp",
        size=4 * MIB // 16,
        checksums=common_pb2.BlockChecksums(
            algorithm="xxh3-128", block_size=1, block_digests=os.urandom(4 * MIB)
        ),
        owner_node="mallory",
    )
    assert publish(victim, manifest(ns, "s1", [meta, tiny_blocks])) == CODE.INVALID_ARGUMENT
    bad_digests = file_entry("__0_0.distcp", b"z" * 3000, "mallory")
    bad_digests.checksums.block_digests += b"\0" * 16
    assert publish(victim, manifest(ns, "s2", [meta, bad_digests])) == CODE.INVALID_ARGUMENT
    bad_algorithm = file_entry("__0_0.distcp", b"z" * 3000, "mallory")
    bad_algorithm.checksums.algorithm = "md5"
    assert publish(victim, manifest(ns, "s3", [meta, bad_algorithm])) == CODE.INVALID_ARGUMENT
    many = [meta] + [file_entry(f"__{i}_0.distcp", b"", "mallory") for i in range(100_000)]
    assert publish(victim, manifest(ns, "s4", many)) == CODE.INVALID_ARGUMENT
    for when in (float("nan"), float("inf"), -1.0):
        assert publish(victim, manifest(ns, "s5", committed=when)) == CODE.INVALID_ARGUMENT
    # Valid, but 32 MiB of digests (a 2 TiB file): its manifest does not fit the budget.
    huge = common_pb2.FileEntry(
        name="__0_0.distcp",
        size=2 << 40,
        checksums=common_pb2.BlockChecksums(
            algorithm="xxh3-128", block_size=MIB, block_digests=os.urandom(32 * MIB)
        ),
        owner_node="mallory",
    )
    assert publish(victim, manifest(ns, "s6", [meta, huge])) == CODE.RESOURCE_EXHAUSTED
    assert victim.client.status().used_bytes == used
    assert not victim.daemon.manifest_path(ns, "s6").exists()
    assert ids(victim, ns) == []


# ---- identity and per-call authorization ------------------------------------------------


def every_call(stub: PeerStub, ref: common_pb2.CheckpointRef) -> list[grpc.StatusCode]:
    """The status of one call of each PeerService method."""
    info = manifest(ref.namespace, "step-9")
    calls: list[Callable[[], Any]] = [
        lambda: stub.Holdings(ref, timeout=10),
        lambda: stub.ListManifests(peer_pb2.ListManifestsRequest(), timeout=10),
        lambda: stub.PublishCheckpoint(info, timeout=10),
        lambda: stub.FetchFile(
            peer_pb2.FetchFileRequest(ref=ref, file_name=".metadata"), timeout=10
        ),
        lambda: stub.PushFile(iter([peer_pb2.FileChunk()]), timeout=10),
        lambda: stub.UpdateReplicas(peer_pb2.UpdateReplicasRequest(ref=ref), timeout=10),
    ]
    return [code_of(c) for c in calls]


def test_unknown_peers_and_non_coordinators_are_refused(victim: Victim) -> None:
    ns = "jobAuth"
    save(victim, ns, "step-1")
    ref = common_pb2.CheckpointRef(namespace=ns, checkpoint_id="step-1")
    refused_before = victim.metric('tierckpt_peer_refused_total{reason="unknown-peer"}')
    for node in (None, "eve", "victim", "x" * 300):
        assert every_call(victim.stub(node), ref) == [CODE.PERMISSION_DENIED] * 6, node
    assert (
        victim.metric('tierckpt_peer_refused_total{reason="unknown-peer"}') >= refused_before + 24
    )
    # A configured peer may publish only what it coordinates: buddy's checkpoint (buddy
    # does not confirm it) or one the victim itself coordinates are refused.
    assert publish(victim, manifest(ns, "step-7", owner="buddy")) == CODE.PERMISSION_DENIED
    assert publish(victim, manifest(ns, "step-8", owner="victim")) == CODE.PERMISSION_DENIED
    assert ids(victim, ns) == ["step-1"]
    assert victim.stub("buddy").Holdings(ref, timeout=10).files  # a member reads


def test_certificates_bind_to_node_ids(tmp_path: Path) -> None:
    certs = make_certs(tmp_path, ("node0", "node1"))
    port, unused = free_ports(2)
    security = {"tls_cert": certs.node_a.cert, "tls_key": certs.node_a.key, "tls_ca": certs.ca}
    with ExitStack() as stack:
        daemon = DaemonProcess(
            {
                "node": {"id": "node0"},
                "listen": {"peer": f"127.0.0.1:{port}"},
                "security": security,
                "peers": [{"id": "node1", "address": f"127.0.0.1:{unused}"}],
            },
            name="node0",
        )
        stack.callback(daemon.cleanup)

        def code(pair: Any, claim: str | None = None) -> grpc.StatusCode:
            cfg = SecurityConfig(tls_cert=pair.cert, tls_key=pair.key, tls_ca=certs.ca)
            channel = peer_channel_factory(cfg)(f"127.0.0.1:{port}")
            stack.callback(channel.close)
            metadata = (("x-tierckpt-node", claim),) if claim else None
            stub = peer_pb2_grpc.PeerServiceStub(channel)
            return code_of(
                lambda: stub.ListManifests(
                    peer_pb2.ListManifestsRequest(), metadata=metadata, timeout=10
                )
            )

        assert code(certs.node_b) == CODE.OK  # SAN DNS:node1, a configured peer
        assert code(certs.stranger) == CODE.PERMISSION_DENIED  # right CA, unknown node
        assert code(certs.stranger, claim="node1") == CODE.PERMISSION_DENIED  # a claim is no cert
        assert code(certs.twin) == CODE.PERMISSION_DENIED  # one cert, two nodes
        assert code(certs.node_a) == CODE.PERMISSION_DENIED  # node0 is the victim itself


# ---- H4 and the malformed-message flood ----------------------------------------------------


def test_stalled_streams_leave_health_and_peers_served(victim: Victim) -> None:
    release = threading.Event()

    def stalled() -> Iterator[bytes]:
        release.wait(60)
        return
        yield b""  # pragma: no cover

    health = health_pb2_grpc.HealthStub(victim.channel(None))
    ref = common_pb2.CheckpointRef(namespace="jobH4", checkpoint_id="step-1")
    stub = victim.stub("mallory")
    # The audit's e7: 16 PushFile streams that never send a message held all 16 threads.
    calls = [stub.PushFile.future(stalled(), timeout=60) for _ in range(16)]
    try:
        # Over mallory's limit (12 calls at a time): refused at once, not queued (a queued
        # call would end only when released, or at its 60 s timeout).
        def refused() -> list[Any]:
            return [c for c in calls if c.done() and c.code() == CODE.RESOURCE_EXHAUSTED]

        wait_until("4 of the 16 stalled pushes refused", lambda: len(refused()) >= 16 - 12, 10)
        assert len(refused()) == 16 - 12
        started = time.monotonic()
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started < 1.5
        held = victim.stub("buddy").Holdings(ref, timeout=3)  # another peer is served
        assert held.state == common_pb2.CHECKPOINT_STATE_UNSPECIFIED
        assert time.monotonic() - started < 3
        assert code_of(lambda: stub.Holdings(ref, timeout=3)) == CODE.RESOURCE_EXHAUSTED
        assert time.monotonic() - started < 4.5
    finally:
        release.set()
    for call in calls:
        assert call.exception(timeout=30) is not None  # ended (no header: refused)
    # The slots came back: mallory is served again.
    assert stub.Holdings(ref, timeout=3).state == common_pb2.CHECKPOINT_STATE_UNSPECIFIED


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_flood_of_malformed_messages_costs_no_memory(victim: Victim) -> None:
    channel = victim.channel("mallory")
    base = "/tierckpt.v1.PeerService/"
    unary = [
        channel.unary_unary(base + m)
        for m in ("Holdings", "PublishCheckpoint", "UpdateReplicas", "ListManifests")
    ]
    fetch = channel.unary_stream(base + "FetchFile")
    push = channel.stream_unary(base + "PushFile")
    junk = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\xff" * 11, b"\x1f"]

    def flood(n: int) -> dict[grpc.StatusCode, int]:
        """`n` calls, 8 in flight (under mallory's 12 calls at a time)."""
        codes: dict[grpc.StatusCode, int] = {}
        window: deque[Any] = deque()
        for i in range(n + 8):
            if len(window) == 8 or i >= n:
                if not window:
                    break
                code = window.popleft().code()
                codes[code] = codes.get(code, 0) + 1
            if i < n:
                window.append(unary[i % 4].future(junk[i % len(junk)], timeout=30))
        return codes

    flood(1000)  # warm up: threads, arenas
    before = _rss_mib(victim.daemon.pid)
    codes: dict[grpc.StatusCode, int] = {}
    for _ in range(20):
        for code, n in flood(1000).items():
            codes[code] = codes.get(code, 0) + n
    for raw in junk:
        assert code_of(partial(fetch, raw, timeout=10)) == CODE.INVALID_ARGUMENT
        assert code_of(partial(push, iter([raw]), timeout=10)) == CODE.INVALID_ARGUMENT
    grown = _rss_mib(victim.daemon.pid) - before
    assert set(codes) == {CODE.INVALID_ARGUMENT}, codes
    assert grown < 30, f"the daemon grew {grown:.1f} MiB over 20,000 malformed requests"
    assert victim.client.status().node_id == "victim"
