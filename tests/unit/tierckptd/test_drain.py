"""Drainer on one node: a real catalog holding real DCP checkpoints (stock
FileSystemWriter output), drained to a `file://` persistent tier; no daemon, no gRPC.
The S3 (moto) paths are covered by tests/integration/test_persistent.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch
from tierckptd.catalog import Catalog
from tierckptd.config import PersistentConfig
from tierckptd.drain import Drainer
from tierckptd.persistent import PersistentTier, RetryPolicy

from tests.support.dcp_files import (
    SavedCheckpoint,
    assert_state_equal,
    load_target,
    make_state,
    save_checkpoint,
)

from .conftest import MakeCatalog, Save

NS = "run9"
FAST = RetryPolicy(max_attempts=2, deadline=None, base=0.01, cap=0.02)


def _commit(save: Save, catalog: Catalog, checkpoint_id: str, saved: SavedCheckpoint) -> None:
    """Put a stock DCP checkpoint into the memory tier the way one rank's save does."""
    names = [*saved.data_names, ".metadata"]
    save(catalog, NS, checkpoint_id, {n: (saved.directory / n).read_bytes() for n in names})


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    config = PersistentConfig(url=f"file://{tmp_path / 'store'}", compression="zstd", level=3)
    return PersistentTier.from_config(config, retry=FAST)


@pytest.fixture
def node(make_catalog: MakeCatalog) -> Catalog:
    catalog = make_catalog(budget=64 << 20, memory_keep_last=10)
    catalog.drain_every = 1
    return catalog


def test_drain_makes_a_checkpoint_durable_and_stock_dcp_loads_it(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    saved = save_checkpoint(tmp_path / "hot", thread_count=2)
    _commit(save, node, "step-000001", saved)
    drainer = Drainer(node, store)
    assert drainer.resume() == 1 and drainer.pending() == [(NS, "step-000001")]
    assert drainer.drain(NS, "step-000001")
    assert node.is_durable(NS, "step-000001") and store.is_durable(NS, "step-000001")
    target = load_target(saved.state)
    dcp.load(target, checkpoint_id=store.checkpoint_url(NS, "step-000001"))
    assert_state_equal(saved.state, target)
    # Durable is remembered: a second attempt uploads nothing and says done.
    assert drainer.drain(NS, "step-000001")
    assert node.due_not_durable() == []


def test_a_restart_probes_the_store_instead_of_uploading_again(
    node: Catalog, save: Save, make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    _commit(save, node, "step-000002", saved)
    Drainer(node, store).drain(NS, "step-000002")
    metadata = tmp_path / "store" / NS / "step-000002" / ".metadata"
    before = metadata.stat().st_mtime_ns
    node.tier.close()  # the daemon restarts: a new catalog adopts the same memory dir
    restarted = make_catalog(budget=64 << 20, memory_keep_last=10)
    restarted.drain_every = 1
    assert restarted.due_not_durable() == [(NS, "step-000002")]
    assert Drainer(restarted, store).drain(NS, "step-000002")
    assert restarted.is_durable(NS, "step-000002")
    assert metadata.stat().st_mtime_ns == before


def test_restore_file_gives_back_the_original_bytes_verified(
    node: Catalog, save: Save, make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    saved = save_checkpoint(tmp_path / "hot", state=make_state(seed=3))
    _commit(save, node, "step-000003", saved)
    Drainer(node, store).drain(NS, "step-000003")
    # Every memory tier is gone: a fresh node learns the checkpoint from the store.
    for name in [*saved.data_names, ".metadata"]:
        assert node.drop_local_copy(NS, "step-000003", name)
    drainer = Drainer(node, store)
    for name in [*saved.data_names, ".metadata"]:
        assert drainer.restore_file(NS, "step-000003", name) > 0
        path = node.file_view(NS, "step-000003", name)[1]
        assert Path(path).read_bytes() == (saved.directory / name).read_bytes()
    with pytest.raises(CheckpointNotFound):
        drainer.restore_file(NS, "step-000003", "__9_0.distcp")


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_corrupted_object_is_refused_on_restore(
    node: Catalog, save: Save, tmp_path: Path, compression: str
) -> None:
    config = PersistentConfig(url=f"file://{tmp_path / 'store'}", compression=compression)
    store = PersistentTier.from_config(config, retry=FAST)
    saved = save_checkpoint(tmp_path / "hot")
    _commit(save, node, "step-000004", saved)
    drainer = Drainer(node, store)
    drainer.drain(NS, "step-000004")
    name = saved.data_names[0]
    assert node.drop_local_copy(NS, "step-000004", name)
    stored = tmp_path / "store" / NS / "step-000004" / name
    raw = bytearray(stored.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    stored.write_bytes(bytes(raw))
    # zstd's frame checksum or our block checksums: either way DATA_LOSS, not installed.
    with pytest.raises(ChecksumMismatch):
        drainer.restore_file(NS, "step-000004", name)
    assert node.file_view(NS, "step-000004", name)[1] == ""


def test_persistent_retention_after_each_drain(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    drainer = Drainer(node, store, keep_last=2, keep_every=3)
    for step in range(1, 7):
        saved = save_checkpoint(tmp_path / f"hot{step}", state=make_state(seed=step))
        _commit(save, node, f"step-{step:06d}", saved)
        assert drainer.drain(NS, f"step-{step:06d}")
    assert store.list_durable(NS) == ["step-000003", "step-000005", "step-000006"]


def test_the_worker_retries_until_durable(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    _commit(save, node, "step-000007", saved)
    drainer = Drainer(node, store, poll=0.01, max_backoff=0.05)
    drainer.enqueue(NS, "step-000007")
    drainer.start()
    try:
        deadline = time.monotonic() + 30
        while not node.is_durable(NS, "step-000007"):
            assert time.monotonic() < deadline, "the worker never drained the checkpoint"
            time.sleep(0.02)
    finally:
        drainer.stop()
    assert drainer.pending() == []


def test_emergency_drains_the_newest_within_the_deadline(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    for step in (8, 9):
        _commit(save, node, f"step-{step:06d}", save_checkpoint(tmp_path / f"hot{step}"))
    assert Drainer(node, store).emergency(deadline=30.0)
    assert store.list_durable(NS) == ["step-000009"]
    assert Drainer(node, store).emergency(deadline=30.0)  # nothing left to do
