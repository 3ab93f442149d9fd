"""The per-checkpoint "make this one durable" hint (CommitCheckpointRequest.durable):
a real catalog holding real DCP checkpoints, drained to a `file://` persistent tier whose
`every` would not pick them; the hint survives a restart (the manifest), travels in the
published manifest, and is refused without a persistent tier. The S3 (moto) path over a
real daemon is tests/integration/test_durable_hint.py."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from tierckpt.checksum import DEFAULT_BLOCK_SIZE
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import NoPersistentTier, error_from_status
from tierckptd.catalog import Catalog
from tierckptd.config import PersistentConfig
from tierckptd.memory.manifest import ManifestError, from_json, read_manifest, to_json
from tierckptd.model import State
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.store import PersistentTier, RetryPolicy
from tierckptd.rpc.health import Health
from tierckptd.rpc.servers import start_servers
from tierckptd.wire import record_from_info, to_info

from tests.support.catalog_files import write_file
from tests.support.daemon_parts import daemon_service
from tests.support.dcp_files import SavedCheckpoint, save_checkpoint

from .conftest import MakeCatalog

NS = "run8"
FAST = RetryPolicy(max_attempts=2, deadline=None, base=0.01, cap=0.02)


def _write(catalog: Catalog, checkpoint_id: str, name: str, data: bytes) -> None:
    """One file as rank 0 writes it (the client's default block size)."""
    write_file(catalog, NS, checkpoint_id, name, data, block_size=DEFAULT_BLOCK_SIZE)


def _save(
    catalog: Catalog, checkpoint_id: str, saved: SavedCheckpoint, *, durable: bool = False
) -> None:
    """One rank's whole save of a stock DCP checkpoint, committed with or without the hint."""
    files = {n: (saved.directory / n).read_bytes() for n in [*saved.data_names, ".metadata"]}
    catalog.begin(NS, checkpoint_id, 0)
    catalog.reserve(NS, checkpoint_id, 0, sum(len(d) for d in files.values()))
    for name, data in files.items():
        _write(catalog, checkpoint_id, name, data)
    catalog.commit(NS, checkpoint_id, list(files), durable=durable)


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return PersistentTier.from_config(
        PersistentConfig(url=f"file://{tmp_path / 'store'}"), retry=FAST
    )


@pytest.fixture
def saved(tmp_path: Path) -> SavedCheckpoint:
    return save_checkpoint(tmp_path / "hot")


def _node(make_catalog: MakeCatalog, every: int, keep_last: int = 1) -> Catalog:
    """A 64 MiB node draining every `every`-th checkpoint, keeping `keep_last` in memory."""
    return make_catalog(budget=64 << 20, memory_keep_last=keep_last, drain_every=every)


def test_a_durable_commit_drains_despite_every_and_stays_until_durable(
    make_catalog: MakeCatalog, store: PersistentTier, saved: SavedCheckpoint
) -> None:
    node = _node(make_catalog, every=10)
    queued: list[tuple[str, str]] = []
    node.events.committed.add(lambda ns, cid: queued.append((ns, cid)))
    _save(node, "step-1", saved, durable=True)
    _save(node, "step-2", saved)
    _save(node, "step-3", saved)
    # Only the hinted one is due (sequences 1-3, every = 10) and queued for the drain.
    assert queued == [(NS, "step-1")] and node.due_not_durable() == [(NS, "step-1")]
    assert node.get(NS, "step-1").durable_requested
    assert not node.get(NS, "step-3").durable_requested
    # memory_keep_last = 1 evicted step-2, but not step-1: not durable yet (invariant 6).
    kept = {v.checkpoint_id for v in node.list_checkpoints(NS) if "memory" in v.tiers}
    assert kept == {"step-1", "step-3"}
    assert Drainer(node, store).drain(NS, "step-1")
    assert node.durability.is_durable(NS, "step-1") and store.is_durable(NS, "step-1")
    assert not store.is_durable(NS, "step-3")
    assert node.due_not_durable() == []
    _save(node, "step-4", saved)  # durable now: retention may let it go from memory
    kept = {v.checkpoint_id for v in node.list_checkpoints(NS) if "memory" in v.tiers}
    assert kept == {"step-4"}


def test_the_hint_survives_a_restart(
    make_catalog: MakeCatalog, store: PersistentTier, saved: SavedCheckpoint
) -> None:
    node = _node(make_catalog, every=10)
    _save(node, "step-1", saved, durable=True)
    _save(node, "step-2", saved)
    node.tier.close()  # the daemon restarts: a new catalog adopts the same memory dir
    restarted = _node(make_catalog, every=10)
    assert restarted.get(NS, "step-1").durable_requested
    assert restarted.due_not_durable() == [(NS, "step-1")]
    drainer = Drainer(restarted, store)
    assert drainer.resume() == 1 and drainer.pending() == [(NS, "step-1")]
    assert drainer.drain(NS, "step-1") and store.is_durable(NS, "step-1")


def test_durable_without_a_persistent_tier_is_refused_not_ignored(
    make_catalog: MakeCatalog, saved: SavedCheckpoint
) -> None:
    node = _node(make_catalog, every=0)  # no [persistent] url
    with pytest.raises(NoPersistentTier, match=r"\[persistent\] url") as raised:
        _save(node, "step-1", saved, durable=True)
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # Nothing changed: the save is still open and commits without the hint.
    (open_save,) = node.list_checkpoints(NS, include_uncommitted=True)
    assert open_save.state is State.WRITING
    node.commit(NS, "step-1", [*saved.data_names, ".metadata"])
    assert not node.get(NS, "step-1").durable_requested


def test_the_manifest_keeps_the_hint_and_validates_it(
    make_catalog: MakeCatalog, saved: SavedCheckpoint
) -> None:
    node = _node(make_catalog, every=10)
    _save(node, "step-1", saved, durable=True)
    path = node.tier.manifest_path(NS, "step-1")
    doc = to_json(read_manifest(path))
    assert doc["durable_requested"] is True
    older = {k: v for k, v in doc.items() if k != "durable_requested"}  # before the field
    assert from_json(older).durable_requested is False
    for bad in ("yes", 1, None):
        with pytest.raises(ManifestError, match="durable_requested is not a boolean"):
            from_json({**doc, "durable_requested": bad})
    assert json.loads(path.read_bytes())["durable_requested"] is True


def test_the_hint_travels_with_the_published_manifest(
    make_catalog: MakeCatalog, saved: SavedCheckpoint
) -> None:
    """Peers drain the files they own of a checkpoint: the coordinator's hint reaches
    them in the manifest it publishes (CheckpointInfo.durable_requested)."""
    node = _node(make_catalog, every=10)
    _save(node, "step-1", saved, durable=True)
    _save(node, "step-2", saved)
    for cid, hinted in (("step-1", True), ("step-2", False)):
        info = to_info(node.get(NS, cid), local_paths=False)
        assert info.durable_requested is hinted
        assert record_from_info(info).durable_requested is hinted


def test_the_rpc_refuses_durable_without_a_persistent_tier(
    make_catalog: MakeCatalog, saved: SavedCheckpoint, tmp_path: Path
) -> None:
    node = _node(make_catalog, every=0)
    health = Health()
    servers = start_servers(
        daemon_service(node), health, f"unix://{tmp_path}/d.sock", "127.0.0.1:0"
    )
    health.serving()
    try:
        client = DaemonClient(f"unix://{tmp_path}/d.sock")
        files = {n: (saved.directory / n).read_bytes() for n in [*saved.data_names, ".metadata"]}
        node.begin(NS, "step-1", 0)
        node.reserve(NS, "step-1", 0, sum(len(d) for d in files.values()))
        for name, data in files.items():
            _write(node, "step-1", name, data)
        with pytest.raises(NoPersistentTier, match=r"\[persistent\] url"):
            client.commit_checkpoint(NS, "step-1", files, durable=True)
        info = client.commit_checkpoint(NS, "step-1", files)
        assert info.state == "COMMITTED" and not info.durable_requested
    finally:
        servers.stop(0)
    other = error_from_status(grpc.StatusCode.FAILED_PRECONDITION, "missing files: x")
    assert not isinstance(other, NoPersistentTier)  # only the prefixed message maps to it
