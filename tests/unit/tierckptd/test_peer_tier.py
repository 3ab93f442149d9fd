"""Catalog side of the peer tier and the verified receiver, without gRPC."""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.checksum import BlockChecksums, checksum_bytes
from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    ChecksumMismatch,
    InvalidArgument,
    InvalidName,
    MemoryBudgetExceeded,
)
from tierckpt.v1 import common_pb2, peer_pb2
from tierckptd.catalog import Catalog
from tierckptd.catalog.budget import PAGE, pages
from tierckptd.config import PeerConfig
from tierckptd.memory.incoming import IncomingFile, install_copy, restore_plan
from tierckptd.memory.manifest import read_manifest
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.peers.chunk_wire import PeerStub, encode_data_chunk
from tierckptd.peers.client import PeerCallError, PeerClient
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.membership import Membership
from tierckptd.peers.security import node_client_interceptor
from tierckptd.restore import Restorer, no_sources
from tierckptd.rpc.health import Health
from tierckptd.rpc.peer_service import PeerService, add_peer_service
from tierckptd.rpc.servers import start_servers
from tierckptd.wire import record_from_info

from tests.support.daemon_parts import daemon_service
from tests.support.raw_rpc import file_entry

from .conftest import MakeCatalog, Save


def _remote(name: str, data: bytes, owner: str) -> FileRecord:
    return FileRecord(
        name=name,
        rank=1,
        size=len(data),
        checksums=checksum_bytes(data, block_size=1024),
        owner_node=owner,
        held=False,
    )


def _receive(catalog: Catalog, ns: str, ckpt: str, name: str, data: bytes) -> None:
    f, _ = catalog.file_view(ns, ckpt, name)
    pieces = ((off, data[off : off + 1024]) for off in range(0, len(data), 1024))
    assert install_copy(catalog, ns, ckpt, f, pieces, what=name) is not None


def test_commit_with_remote_files_then_replicated(catalog: Catalog, save: Save) -> None:
    catalog.peer_marks.set_replica_target(1)
    catalog.begin("run", "s1", 0)
    remote = {"__1_0.distcp": _remote("__1_0.distcp", b"b" * 3000, "node-b")}
    catalog.reserve("run", "s1", 0, 10)
    from .conftest import write_file

    write_file(catalog, "run", "s1", "__0_0.distcp", b"a" * 10)
    view = catalog.commit("run", "s1", ["__0_0.distcp", "__1_0.distcp"], remote)
    assert view.state is State.COMMITTED and view.tiers == ("peer",)
    assert view.local_paths["__1_0.distcp"] == ""
    # Only held files count (in pages, with their data dir), and the manifest.
    assert catalog.used_bytes() == 2 * PAGE + catalog._budget._manifest_total
    catalog.set_replicas("run", "s1", "__0_0.distcp", ["node-b"])
    catalog.set_replicas("run", "s1", "__1_0.distcp", ["node-c"])
    assert catalog.get("run", "s1").state is State.REPLICATED


def test_publish_adopts_our_writing_files_and_a_receiver_verifies(
    make_catalog: MakeCatalog, save: Save, tmp_path: Path
) -> None:
    catalog = make_catalog(node_id="node-b", budget=1 << 20)
    data = os.urandom(5000)
    catalog.begin("run", "s2", 1)
    catalog.reserve("run", "s2", 1, 100)
    from .conftest import write_file

    write_file(catalog, "run", "s2", "__1_0.distcp", b"m" * 100, rank=1)
    record = catalog.holdings("run", "s2")[1][0]
    published = {
        "__1_0.distcp": dataclasses.replace(record, held=False),
        "__0_0.distcp": _remote("__0_0.distcp", data, "node-a"),
    }
    rec = CheckpointRecord("run", "s2", State.COMMITTED, 1.0, "node-a", 2.0, 7, files=published)
    assert catalog.publish(rec)
    # Node a coordinates it: its manifest counts against this node's budget too.
    charged = catalog.used_bytes() - pages(100) - PAGE  # the held file and its dir
    assert charged == PAGE  # the manifest, in whole pages
    view = catalog.get("run", "s2")
    assert view.sequence == 7 and view.local_paths["__1_0.distcp"]
    assert not view.local_paths["__0_0.distcp"]
    # A corrupt block is refused before the copy is installed.
    f, _ = catalog.file_view("run", "s2", "__0_0.distcp")
    with pytest.raises(ChecksumMismatch):
        install_copy(catalog, "run", "s2", f, [(0, b"\0" * 1024)], what="copy")
    tmp = catalog.tier.incoming_path("run", "s2", "__0_0.distcp")
    assert not tmp.exists() and catalog.reserved_bytes() == 0
    assert not catalog.file_view("run", "s2", "__0_0.distcp")[0].held
    with pytest.raises(InvalidArgument):
        install_copy(catalog, "run", "s2", f, [(5, b"x")], what="c")
    assert not tmp.exists() and catalog.reserved_bytes() == 0
    _receive(catalog, "run", "s2", "__0_0.distcp", data)
    view = catalog.get("run", "s2")
    assert Path(view.local_paths["__0_0.distcp"]).read_bytes() == data
    assert catalog.used_bytes() == pages(5000) + pages(100) + PAGE + charged
    manifest = read_manifest(catalog.tier.manifest_path("run", "s2"))
    assert manifest.files["__0_0.distcp"].held
    assert manifest.files["__0_0.distcp"].replica_nodes == ["node-b"]
    # Dropping a corrupt copy gives the bytes back and stops serving it.
    assert catalog.drop_local_copy("run", "s2", "__0_0.distcp")
    assert catalog.used_bytes() == pages(100) + PAGE + charged
    assert catalog.file_view("run", "s2", "__0_0.distcp")[1] == ""


def test_incoming_copy_respects_the_budget(make_catalog: MakeCatalog) -> None:
    catalog = make_catalog(budget=4096)
    big = _remote("__0_0.distcp", b"z" * 8192, "node-x")
    rec = CheckpointRecord(
        "run", "s3", State.COMMITTED, 1.0, "node-x", 2.0, 1, files={big.name: big}
    )
    assert catalog.publish(rec)
    written: list[int] = []

    def pieces() -> Iterator[tuple[int, bytes]]:
        written.append(0)
        yield 0, b"z" * 8192

    with pytest.raises(MemoryBudgetExceeded, match="memory.budget"):
        install_copy(catalog, "run", "s3", big, pieces(), what="big")
    assert written == [], "refused before its first byte"
    assert catalog.reserved_bytes() == 0


def test_deleted_checkpoint_is_not_taken_back(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s4", {"__0_0.distcp": b"q" * 10})
    catalog.delete("run", "s4")
    rec = CheckpointRecord("run", "s4", State.COMMITTED, 1.0, "node-x", 2.0, 1)
    assert not catalog.publish(rec)


def test_an_evicted_checkpoint_made_durable_elsewhere_is_listed_again(
    make_catalog: MakeCatalog, save: Save
) -> None:
    # Chaos finding: retention evicted a checkpoint this node did not yet know durable;
    # another node's drain then made it durable, and this node's persistent discovery
    # could not list it again, so loads through this node said NOT_FOUND.
    catalog = make_catalog(memory_keep_last=1)
    save(catalog, "run", "s1", {"__0_0.distcp": b"1" * 10})
    published = copy.deepcopy(catalog._records[("run", "s1")])
    save(catalog, "run", "s2", {"__0_0.distcp": b"2" * 10})
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["s2"]
    for f in published.files.values():
        f.held, f.owner_node, f.replica_nodes = False, "", []
    assert not catalog.publish(dataclasses.replace(published))  # a peer: evicted again
    assert catalog.publish(dataclasses.replace(published), durable=True)
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["s1", "s2"]
    assert catalog.durability.is_durable("run", "s1")
    save(catalog, "run", "s3", {"__0_0.distcp": b"3" * 10})
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["s1", "s3"]
    # An rm is final: not even the persistent tier's copy lists it again here.
    catalog.delete("run", "s1")
    assert not catalog.publish(dataclasses.replace(published), durable=True)


def _record(ckpt: str, committed: float, files: list[FileRecord]) -> CheckpointRecord:
    return CheckpointRecord(
        "run",
        ckpt,
        State.COMMITTED,
        committed,
        "node-x",
        committed,
        1,
        files={f.name: f for f in files},
    )


def test_restore_plan_covers_the_newest_checkpoint_owned_files_first() -> None:
    owned = dataclasses.replace(_remote("__0_0.distcp", b"a" * 300, "me"), rank=0)
    kept = _remote("__2_0.distcp", b"b" * 200, "node-y")
    kept.replica_nodes = ["me"]
    other = _remote("__4_0.distcp", b"c" * 100, "node-y")
    old = _record("s1", 1.0, [_remote("__0_0.distcp", b"o" * 999, "me")])
    new = _record("s2", 2.0, [kept, other, owned])
    assert restore_plan("me", [new, old]) == [(300, "__0_0.distcp"), (200, "__2_0.distcp")]
    assert restore_plan("me", [old, new]) == restore_plan("me", [new, old])
    assert restore_plan("nobody", [new]) == []


def test_named_prewarm_segment_is_taken_by_that_files_copy(catalog: Catalog) -> None:
    data = os.urandom(5000)
    remote = _remote("__0_0.distcp", data, "node-x")
    assert catalog.publish(_record("s5", 3.0, [remote]))
    # Unnamed segments are left for saves: the copy takes the one named for it, though
    # another fits it more closely.
    plan: list[tuple[int, str | None]] = [(8192, None), (4900, None), (5500, "__0_0.distcp")]
    assert catalog.prewarm_segments(plan, "test") == 18592
    assert catalog.pool_bytes() == 18592
    _receive(catalog, "run", "s5", "__0_0.distcp", data)
    assert catalog.pool_bytes() == 8192 + 4900
    view = catalog.get("run", "s5")
    assert Path(view.local_paths["__0_0.distcp"]).read_bytes() == data


def test_prewarm_stops_at_the_budget(make_catalog: MakeCatalog) -> None:
    catalog = make_catalog(budget=10_000)
    assert catalog.prewarm_segments([(6000, "a"), (6000, "b"), (3000, "c")], "test") == 6000
    assert catalog.pool_bytes() == 6000


def test_prewarm_skips_a_file_whose_copy_is_already_arriving(catalog: Catalog) -> None:
    remote = _remote("__0_0.distcp", b"r" * 5000, "node-x")
    assert catalog.publish(_record("s6", 4.0, [remote]))
    prewarmed: list[int] = []

    def pieces() -> Iterator[tuple[int, bytes]]:
        # The copy is arriving (staged, its bytes reserved) while the prewarm runs.
        prewarmed.append(catalog.prewarm_segments([(5000, "__0_0.distcp"), (3000, "x")], "test"))
        yield 0, b"r" * 5000

    assert install_copy(catalog, "run", "s6", remote, pieces(), what="copy") is not None
    assert prewarmed == [3000]


def test_incoming_copy_waits_for_the_segment_being_preallocated_for_it(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(5000)
    assert catalog.publish(_record("s7", 5.0, [_remote("__0_0.distcp", data, "node-x")]))
    release = threading.Event()
    allocating = threading.Event()
    preallocate = catalog.pool.preallocate

    def slow_preallocate(tmp: Path, size: int, stop: Callable[[], bool] | None = None) -> int:
        allocating.set()
        release.wait(10)
        return preallocate(tmp, size, stop)

    monkeypatch.setattr(catalog.pool, "preallocate", slow_preallocate)
    prewarm = threading.Thread(
        target=catalog.prewarm_segments, args=([(5000, "__0_0.distcp")], "test")
    )
    prewarm.start()
    assert allocating.wait(10)
    receiver = threading.Thread(target=_receive, args=(catalog, "run", "s7", "__0_0.distcp", data))
    receiver.start()
    receiver.join(0.3)
    assert receiver.is_alive(), "the copy should wait for its segment"
    release.set()
    receiver.join(10)
    prewarm.join(10)
    # It took the preallocated segment: nothing left in the pool, the file is whole.
    assert catalog.pool_bytes() == 0
    assert Path(catalog.get("run", "s7").local_paths["__0_0.distcp"]).read_bytes() == data


def test_a_corrupt_last_short_block_is_caught_at_finish(tmp_path: Path) -> None:
    data = os.urandom(2500)  # blocks of 1024: two whole, one short
    checksums = checksum_bytes(data, block_size=1024)
    path = tmp_path / "incoming"
    path.touch()
    incoming = IncomingFile(path, len(data), checksums, "copy")
    try:
        incoming.write(0, data[:2048])
        incoming.write(2048, data[2048:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(ChecksumMismatch, match="block 2"):
            incoming.finish()
    finally:
        incoming.close()


# ---- names, bounds and locks at the peer edge (audit C2, M1, M6) ---------------------------


def _entry(name: str, data: bytes, owner: str = "node-x") -> common_pb2.FileEntry:
    return file_entry(name, data, owner)


def _info(**fields: object) -> common_pb2.CheckpointInfo:
    info = common_pb2.CheckpointInfo(
        ref=common_pb2.CheckpointRef(namespace="run", checkpoint_id="s1"),
        created_unix=time.time(),
        committed_unix=time.time(),
        sequence=3,
        files=[_entry(".metadata", b"meta")],
    )
    for key, value in fields.items():
        if key in ("namespace", "checkpoint_id"):
            setattr(info.ref, key, value)
        else:
            setattr(info, key, value)
    return info


def _with_file(**fields: object) -> common_pb2.CheckpointInfo:
    info = _info()
    e = info.files.add()
    e.CopyFrom(_entry("__0_0.distcp", b"d" * 3000))
    for key, value in fields.items():
        if key in ("algorithm", "block_size", "block_digests"):
            setattr(e.checksums, key, value)
        elif key == "replica_nodes":
            e.replica_nodes.extend(list(value))  # type: ignore[call-overload]
        else:
            setattr(e, key, value)
    return info


@pytest.mark.parametrize(
    ("info", "message"),
    [
        (_info(namespace="../../tmp"), "invalid namespace"),
        (_info(namespace="/tmp/abs"), "invalid namespace"),
        (_info(checkpoint_id=".."), "invalid checkpoint id"),
        (_info(sequence=2**64 - 1), "sequence"),
        (_info(committed_unix=float("inf")), "committed_unix"),  # 4e9 is taken, clamped
        (_info(created_unix=float("nan")), "created_unix"),
        (_info(committed_unix=-1.0), "committed_unix"),
        (_with_file(name="../x"), "invalid file name"),
        (_with_file(owner_node="a/b"), "invalid owner"),
        (_with_file(replica_nodes=["ok", "../x"]), "invalid replica node"),
        (_with_file(replica_nodes=[f"n{i}" for i in range(65)]), "replica nodes"),
        (_with_file(algorithm="md5"), "not supported"),
        (_with_file(block_size=1), "block_size"),
        (_with_file(block_size=64 << 20), "block_size"),
        (_with_file(block_digests=b"\0" * 48), "digest bytes"),
        (_with_file(block_digests=b"\0" * 15), "digest bytes"),
        (_with_file(size=2**62), "larger than"),
        (_with_file(rank=-1), "negative"),
    ],
)
def test_a_peers_manifest_is_validated_field_by_field(
    info: common_pb2.CheckpointInfo, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message) as e:
        record_from_info(info)
    assert len(str(e.value)) < 600


def test_a_valid_manifest_is_taken_without_its_pin() -> None:
    rec = record_from_info(_with_file())
    assert rec.key == ("run", "s1") and set(rec.files) == {".metadata", "__0_0.distcp"}
    assert not rec.pinned and not any(f.held for f in rec.files.values())
    assert record_from_info(_info(sequence=2**63 - 1)).sequence == 2**63 - 1


def test_file_locks_do_not_outlive_their_calls(catalog: Catalog, save: Save) -> None:
    restorer = Restorer(catalog, no_sources)
    cluster = Cluster(catalog, restorer)
    for i in range(1000):
        with pytest.raises(CheckpointNotFound):
            restorer.ensure_local("run", f"s{i}", f"__{i}_0.distcp")
    for bad in ("../x", "a/b", "x" * 5000, ""):
        with pytest.raises(InvalidName):
            restorer.ensure_local("run", "s1", bad)
        with pytest.raises(InvalidName):
            cluster.receive("run", "s1", bad, iter(()))
    save(catalog, "run", "kept", {"__0_0.distcp": b"k" * 100})
    assert restorer.ensure_local("run", "kept", "__0_0.distcp")[1]
    assert cluster.receive("run", "kept", "__0_0.distcp", iter(())) == 0  # held: nothing taken
    assert restorer.file_locks_in_use() == 0


def test_a_publish_keeps_committed_files_and_counts_its_manifest(
    make_catalog: MakeCatalog,
) -> None:
    from .conftest import write_file

    catalog = make_catalog(node_id="node-b", budget=1 << 20)
    catalog.begin("run", "s1", 1)
    catalog.reserve("run", "s1", 1, 200)
    write_file(catalog, "run", "s1", "__1_0.distcp", b"m" * 100, rank=1)
    write_file(catalog, "run", "s1", "__1_1.distcp", b"n" * 100, rank=1)
    meta = _remote(".metadata", b"meta", "node-a")
    other = _remote("__1_0.distcp", b"X" * 100, "node-b")  # other bytes than ours
    rec = CheckpointRecord("run", "s1", State.COMMITTED, 1.0, "", 9e9, 5)
    rec.files = {meta.name: meta, other.name: other}
    with pytest.raises(CheckpointIncomplete, match="the local file is kept"):
        catalog.publish(rec)
    # Same bytes, but __1_1 is not in the manifest: it stays, held (never unlinked).
    mine = catalog.holdings("run", "s1")[1][0]
    rec.files = {meta.name: meta, mine.name: dataclasses.replace(mine, owner_node="node-x")}
    used = catalog.used_bytes()
    assert catalog.publish(rec)
    view = catalog.get("run", "s1")
    assert {f.name for f in view.files if f.held} == {"__1_0.distcp", "__1_1.distcp"}
    assert view.files[1].owner_node == "node-b"  # a file committed here is ours
    assert catalog.used_bytes() > used  # node-a's manifest costs budget here
    # A far-future commit time is dated when it arrived (clamped to this node's clock).
    assert view.committed_unix <= time.time()


def test_a_manifest_over_the_budget_is_refused(make_catalog: MakeCatalog) -> None:
    catalog = make_catalog(budget=64 << 10)
    big = FileRecord(
        "__0_0.distcp", 0, 4 << 30, BlockChecksums(1 << 20, b"\0" * (4096 * 16)), "node-x"
    )
    meta = _remote(".metadata", b"m", "node-x")
    rec = CheckpointRecord("run", "s1", State.COMMITTED, 1.0, "", 2.0, 5)
    rec.files = {big.name: big, meta.name: meta}
    with pytest.raises(MemoryBudgetExceeded, match="manifest"):
        catalog.publish(rec)
    assert catalog.list_checkpoints("run") == [] and catalog.used_bytes() == 0


def test_retention_never_lets_one_coordinators_checkpoints_push_out_anothers(
    make_catalog: MakeCatalog, save: Save
) -> None:
    catalog = make_catalog(memory_keep_last=1)
    save(catalog, "run", "mine-1", {".metadata": b"a", "__0_0.distcp": b"x" * 10})
    for i in (1, 2, 3):
        meta = _remote(".metadata", b"f", "node-x")
        rec = CheckpointRecord("run", f"fake-{i}", State.COMMITTED, 1.0, "", 9e9, 99)
        rec.files = {meta.name: meta}
        assert catalog.publish(rec)
    assert {v.checkpoint_id for v in catalog.list_checkpoints("run")} == {"mine-1", "fake-3"}
    save(catalog, "run", "mine-2", {".metadata": b"b", "__0_0.distcp": b"y" * 10})
    assert catalog.get("run").checkpoint_id == "mine-2"
    assert {v.checkpoint_id for v in catalog.list_checkpoints("run")} == {"mine-2", "fake-3"}


# ---- the PeerService edge on a real server ------------------------------------------------


@dataclass
class PeerPort:
    address: str
    service: PeerService
    cluster: Cluster
    catalog: Catalog

    def stub(self, node: str | None = "node-m") -> PeerStub:
        channel = grpc.insecure_channel(self.address)
        if node is not None:
            channel = grpc.intercept_channel(channel, node_client_interceptor(node))
        return PeerStub(channel)


@pytest.fixture
def peer_port(make_catalog: MakeCatalog, tmp_path: Path) -> Iterator[PeerPort]:
    catalog = make_catalog(budget=256 << 20)
    cluster = Cluster(
        catalog,
        Restorer(catalog, no_sources),
        peers=[PeerConfig("node-m", "127.0.0.1:1")],
        channel_factory=grpc.insecure_channel,
    )
    services: list[PeerService] = []

    def register(server: Any) -> None:
        services.append(add_peer_service(cluster, server, stall_timeout=1.0, max_per_peer=3))

    servers = start_servers(
        daemon_service(catalog, cluster=cluster),
        Health(),
        f"unix://{tmp_path}/d.sock",
        "127.0.0.1:0",
        register_peer=register,
    )
    yield PeerPort(f"127.0.0.1:{servers.peer_port}", services[0], cluster, catalog)
    servers.stop(0)


def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_stalled_streams_are_cancelled_and_their_slots_come_back(peer_port: PeerPort) -> None:
    release = threading.Event()

    def stalled() -> Iterator[bytes]:
        release.wait(30)
        return
        yield b""  # pragma: no cover

    stub = peer_port.stub()
    calls = [stub.PushFile.future(stalled(), timeout=30) for _ in range(4)]
    try:
        started = time.monotonic()
        codes = sorted(str(c.exception(timeout=10).code()) for c in calls)
        # One over the limit at once; the three admitted cancelled after ~1 s of silence.
        assert codes == sorted(["StatusCode.CANCELLED"] * 3 + ["StatusCode.RESOURCE_EXHAUSTED"])
        assert time.monotonic() - started < 4
    finally:
        release.set()
    _until(lambda: peer_port.service.admission.in_flight() == 0)
    assert peer_port.service.watchdog.watched() == 0
    held = stub.Holdings(common_pb2.CheckpointRef(namespace="run", checkpoint_id="s1"), timeout=5)
    assert held.state == common_pb2.CHECKPOINT_STATE_UNSPECIFIED


def test_a_fetcher_that_stops_reading_is_cancelled(peer_port: PeerPort, save: Save) -> None:
    # More than gRPC buffers for a reader that does not read: the server's send blocks.
    save(peer_port.catalog, "run", "big", {"__0_0.distcp": os.urandom(64 << 20)})
    ref = common_pb2.CheckpointRef(namespace="run", checkpoint_id="big")
    chunks = peer_port.stub().FetchFile(
        peer_pb2.FetchFileRequest(ref=ref, file_name="__0_0.distcp"), timeout=30
    )
    assert next(chunks).header is not None
    _until(lambda: peer_port.service.admission.in_flight() == 0, timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        list(chunks)
    assert e.value.code() == grpc.StatusCode.CANCELLED


def test_malformed_and_unexpected_errors_get_fixed_statuses(
    peer_port: PeerPort, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = peer_port.catalog
    stub = peer_port.stub()
    raw = grpc.intercept_channel(
        grpc.insecure_channel(peer_port.address), node_client_interceptor("node-m")
    )
    with pytest.raises(grpc.RpcError) as e:
        raw.unary_unary("/tierckpt.v1.PeerService/Holdings")(b"\xff\xff", timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = _with_file(algorithm="md5")  # a checksum error is the caller's: not INTERNAL
    with pytest.raises(grpc.RpcError) as e:
        stub.PublishCheckpoint(bad, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"boom at {catalog.tier.root}/secret")

    monkeypatch.setattr(catalog, "list_checkpoints", broken)
    with pytest.raises(grpc.RpcError) as e:
        stub.ListManifests(peer_pb2.ListManifestsRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in e.value.details() and "internal error" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        peer_port.stub("node-z").ListManifests(peer_pb2.ListManifestsRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_health_on_the_peer_port_decodes_its_requests_and_stays_non_blocking(
    peer_port: PeerPort,
) -> None:
    channel = grpc.insecure_channel(peer_port.address)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        for junk in (b"\xff\xff", b"\x0a\x05ab"):
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary("/grpc.health.v1.Health/Check")(junk, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # More watchers than the server has threads: Watch still holds none.
        watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(40)]
        assert {next(w).status for w in watches} == {health_pb2.HealthCheckResponse.NOT_SERVING}
        check = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        for w in watches:
            w.cancel()
    finally:
        channel.close()


def test_a_peer_that_freezes_mid_fetch_is_given_up_on(tmp_path: Path) -> None:
    """A FetchFile bringing no data for `fetch_stall` seconds is cancelled: a frozen peer
    must not hold a restore (and its file lock) for TRANSFER_TIMEOUT."""
    release = threading.Event()

    def frozen(request: bytes, context: Any) -> Iterator[bytes]:
        yield encode_data_chunk(0, b"x" * 10)
        release.wait(30)  # SIGSTOPped, as far as the fetcher can tell

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_stream_rpc_method_handler(frozen)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tierckpt.v1.PeerService", {"FetchFile": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = PeerClient(
            Membership("node-a", peers=[PeerConfig("node-z", f"127.0.0.1:{port}")]),
            fetch_stall=0.5,
        )
        got: list[int] = []
        started = time.monotonic()
        with pytest.raises(PeerCallError) as e:
            for _offset, data in client.fetch("node-z", "run", "s1", "__0_0.distcp"):
                got.append(len(data))
        assert got == [10] and e.value.code == "STALLED"
        assert e.value.source == "peer node-z"  # a SourceUnavailable: the restore falls through
        assert time.monotonic() - started < 5
        client.membership.close()
    finally:
        release.set()
        server.stop(0)
