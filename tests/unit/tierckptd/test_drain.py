"""Drainer on one node: a real catalog holding real DCP checkpoints (stock
FileSystemWriter output), drained to a `file://` persistent tier; no daemon, no gRPC.
The S3 (moto) paths are covered by tests/integration/test_persistent.py."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pickle
import shlex
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
import zstandard
from prometheus_client import REGISTRY
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, UnsafeMetadata
from tierckptd.catalog import Catalog
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.source import PersistentSource
from tierckptd.persistent.store import PersistentTier, RetryPolicy
from tierckptd.restore import Restorer

from tests.support.dcp_files import (
    SavedCheckpoint,
    assert_state_equal,
    load_target,
    make_state,
    save_checkpoint,
)
from tests.support.persistent_store import FAST, file_store
from tests.support.waiting import wait_until

from .conftest import MakeCatalog, Save

NS = "run9"


def _restore(catalog: Catalog, store: PersistentTier, checkpoint_id: str, name: str) -> int:
    """The restore chain with the persistent tier as its only remote source."""
    source = PersistentSource(store)
    f, path = Restorer(catalog, lambda *_: [source]).ensure_local(NS, checkpoint_id, name)
    assert path
    return f.size


def _commit(save: Save, catalog: Catalog, checkpoint_id: str, saved: SavedCheckpoint) -> None:
    """Put a stock DCP checkpoint into the memory tier the way one rank's save does."""
    names = [*saved.data_names, ".metadata"]
    save(catalog, NS, checkpoint_id, {n: (saved.directory / n).read_bytes() for n in names})


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return file_store(tmp_path / "store")


@pytest.fixture
def node(make_catalog: MakeCatalog) -> Catalog:
    catalog = make_catalog(budget=64 << 20, memory_keep_last=10, drain_every=1)
    return catalog


def test_drain_makes_a_checkpoint_durable_and_stock_dcp_loads_it(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    saved = save_checkpoint(tmp_path / "hot", thread_count=2)
    _commit(save, node, "step-000001", saved)
    drainer = Drainer(node, store)
    assert drainer.resume() == 1 and drainer.pending() == [(NS, "step-000001")]
    assert drainer.drain(NS, "step-000001")
    assert node.durability.is_durable(NS, "step-000001") and store.is_durable(NS, "step-000001")
    target = load_target(saved.state)
    dcp.load(target, checkpoint_id=store.checkpoint_url(NS, "step-000001"))
    assert_state_equal(actual=target, expected=saved.state)
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
    restarted = make_catalog(budget=64 << 20, memory_keep_last=10, drain_every=1)
    assert restarted.due_not_durable() == [(NS, "step-000002")]
    assert Drainer(restarted, store).drain(NS, "step-000002")
    assert restarted.durability.is_durable(NS, "step-000002")
    assert metadata.stat().st_mtime_ns == before


def test_the_persistent_source_gives_back_the_original_bytes_verified(
    node: Catalog, save: Save, make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    saved = save_checkpoint(tmp_path / "hot", state=make_state(seed=3))
    _commit(save, node, "step-000003", saved)
    Drainer(node, store).drain(NS, "step-000003")
    # Every memory tier is gone: a fresh node learns the checkpoint from the store.
    for name in [*saved.data_names, ".metadata"]:
        assert node.drop_local_copy(NS, "step-000003", name)
    for name in [*saved.data_names, ".metadata"]:
        assert _restore(node, store, "step-000003", name) > 0
        path = node.file_view(NS, "step-000003", name)[1]
        assert Path(path).read_bytes() == (saved.directory / name).read_bytes()
    with pytest.raises(CheckpointNotFound):
        _restore(node, store, "step-000003", "__9_0.distcp")


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_corrupted_object_is_refused_on_restore(
    node: Catalog, save: Save, tmp_path: Path, compression: str
) -> None:
    store = file_store(tmp_path / "store", compression)
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
        _restore(node, store, "step-000004", name)
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
        wait_until(
            "the worker draining step-000007",
            lambda: node.durability.is_durable(NS, "step-000007"),
            30,
        )
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


# ---- untrusted .metadata (audit C1) ---------------------------------------------------------


class _Shell:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def _refused_count() -> float:
    value = REGISTRY.get_sample_value("tierckpt_refused_metadata_total", {"where": "drain"})
    return value or 0.0


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_hostile_metadata_is_refused_not_run_and_not_pinned(
    make_catalog: MakeCatalog, save: Save, tmp_path: Path, compression: str
) -> None:
    store = file_store(tmp_path / "store", compression)
    node = make_catalog(budget=64 << 20, memory_keep_last=1, drain_every=1)
    marker = tmp_path / "MARKER"
    payload = pickle.dumps(_Shell(f"touch {shlex.quote(str(marker))}"))
    save(node, NS, "step-000001", {"__0_0.distcp": b"x" * 100, ".metadata": payload})
    drainer = Drainer(node, store)
    before = _refused_count()
    with pytest.raises(UnsafeMetadata, match=r"step-000001/\.metadata.*posix\.system"):
        drainer.drain(NS, "step-000001")
    assert not marker.exists()
    assert _refused_count() == before + 1
    assert "drain-failed" in node.get(NS, "step-000001").tiers
    assert node.durability.drain_failed() == {(NS, "step-000001"): True}
    assert not store.is_durable(NS, "step-000001") and store.list_durable(NS) == []
    # No longer due: not queued again at restart, and no longer pinned in memory.
    assert node.due_not_durable() == []  # not durable, so no longer due (is_due is gone)
    with pytest.raises(UnsafeMetadata, match="was refused"):  # not decoded again
        drainer.drain(NS, "step-000001")
    assert _refused_count() == before + 1
    saved = save_checkpoint(tmp_path / "hot")
    _commit(save, node, "step-000002", saved)
    assert [v.checkpoint_id for v in node.list_checkpoints(NS)] == ["step-000002"]
    assert drainer.drain(NS, "step-000002")  # the next good one drains as usual
    assert not marker.exists()


def test_a_checkpoint_without_metadata_is_refused(
    node: Catalog, save: Save, store: PersistentTier
) -> None:
    save(node, NS, "step-000001", {"__0_0.distcp": b"x" * 10})
    with pytest.raises(UnsafeMetadata, match="no .metadata"):
        Drainer(node, store).drain(NS, "step-000001")
    assert "drain-failed" in node.get(NS, "step-000001").tiers


def test_the_worker_never_retries_a_refused_one_until_the_operator_asks(
    node: Catalog, save: Save, store: PersistentTier
) -> None:
    save(node, NS, "step-000001", {"__0_0.distcp": b"x", ".metadata": b"not a pickle"})
    drainer = Drainer(node, store, poll=0.01, max_backoff=0.02)
    before = _refused_count()
    drainer.enqueue(NS, "step-000001")
    drainer.start()
    try:
        _wait_for(lambda: _refused_count() == before + 1)
        time.sleep(0.3)
        assert _refused_count() == before + 1 and drainer.pending() == []
        assert drainer.retry_failed() == 1  # SIGHUP: decoded again, refused again
        _wait_for(lambda: _refused_count() == before + 2)
        assert "drain-failed" in node.get(NS, "step-000001").tiers
    finally:
        drainer.stop()


# ---- giving up and backing off (audit M7) -------------------------------------------------------


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    wait_until("the drain worker", condition, timeout, interval=0.01)


class CountingTier(PersistentTier):
    """A real file:// tier that counts durability probes (the S3 requests of M7)."""

    probes: list[float]

    def is_durable(self, namespace: str, checkpoint_id: str) -> bool:
        self.probes.append(time.monotonic())
        return super().is_durable(namespace, checkpoint_id)


def test_failures_back_off_then_drain_failed_then_recover(
    node: Catalog, save: Save, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    root.write_bytes(b"")  # a file where the tier's directory should be: every write fails
    tier = CountingTier(f"file://{root}", retry=FAST)
    tier.probes = []
    saved = save_checkpoint(tmp_path / "hot")
    _commit(save, node, "step-000001", saved)
    drainer = Drainer(node, tier, poll=0.01, max_backoff=0.08, max_failures=4, failed_retry=0.6)
    drainer.enqueue(NS, "step-000001")
    drainer.start()
    try:
        _wait_for(lambda: "drain-failed" in node.get(NS, "step-000001").tiers)
        assert len(tier.probes) == 4
        gaps = [b - a for a, b in itertools.pairwise(tier.probes)]
        assert gaps == sorted(gaps) and gaps[-1] >= 0.04  # exponential, not a fixed pace
        assert node.durability.drain_failed() == {(NS, "step-000001"): False}
        assert node.due_not_durable() == [(NS, "step-000001")]  # still pinned: may drain
        time.sleep(0.5)
        assert len(tier.probes) == 4  # drain-failed: rare retries only
        root.unlink()  # the outage ends: the next rare retry succeeds by itself
        _wait_for(lambda: node.durability.is_durable(NS, "step-000001"))
        assert "drain-failed" not in node.get(NS, "step-000001").tiers
        assert node.durability.drain_failed() == {}
    finally:
        drainer.stop()


def test_a_non_committer_polls_with_backoff_and_gives_up_waiting(
    node: Catalog, tmp_path: Path
) -> None:
    """A checkpoint whose .metadata another node commits (or a peer merely published):
    this node's probes slow down, and after max_wait it is drain-failed."""
    tier = CountingTier(f"file://{tmp_path / 'store'}", retry=FAST)
    tier.probes = []
    cs = checksum_bytes(b"m")
    published = CheckpointRecord(
        namespace=NS,
        checkpoint_id="step-000005",
        state=State.COMMITTED,
        created_unix=time.time(),
        node_id="node-b",
        committed_unix=time.time(),
        sequence=5,
        files={".metadata": FileRecord(".metadata", 0, 1, cs, owner_node="node-b", held=False)},
    )
    assert node.publish(published)
    drainer = Drainer(node, tier, poll=0.01, max_backoff=0.16, max_wait=1.0, failed_retry=60.0)
    drainer.enqueue(NS, "step-000005")
    drainer.start()
    try:
        _wait_for(lambda: "drain-failed" in node.get(NS, "step-000005").tiers)
        count = len(tier.probes)
        assert 6 <= count <= 16, count  # 1 s at 10/s..., never 2 per poll interval
        gaps = [b - a for a, b in itertools.pairwise(tier.probes)]
        assert max(gaps) >= 0.15
        time.sleep(0.4)
        assert len(tier.probes) == count
        assert drainer.retry_failed() == 1  # the operator override: probe now
        _wait_for(lambda: len(tier.probes) > count)
        assert "drain-failed" not in node.get(NS, "step-000005").tiers
    finally:
        drainer.stop()


# ---- shutdown deadline (audit M9) -----------------------------------------------------------------


def test_emergency_honours_the_deadline_with_s3_hanging(
    node: Catalog, save: Save, tmp_path: Path
) -> None:
    """An endpoint that accepts connections and never answers: each botocore call would
    wait 60 s per try; the deadline still holds, with the worker busy at the same time."""
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)
        port = blackhole.getsockname()[1]
        tier = PersistentTier(
            f"s3://bucket-{port}/ckpts",
            {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"},
            retry=RetryPolicy(max_attempts=4, deadline=15.0, cap=4.0),  # the daemon's
        )
        saved = save_checkpoint(tmp_path / "hot")
        _commit(save, node, "step-000001", saved)
        drainer = Drainer(node, tier)
        drainer.enqueue(NS, "step-000001")
        drainer.start()
        time.sleep(0.5)  # the worker is now inside a hanging call
        started = time.monotonic()
        assert not drainer.emergency(deadline=2.0)
        took = time.monotonic() - started
        drainer.stop()
        assert took < 3.0, took
        assert not node.durability.is_durable(NS, "step-000001")


# ---- adoption of an untrusted bucket (audit M8, L6) -------------------------------------------


def _drained(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path, ids: list[str]
) -> None:
    for i, cid in enumerate(ids):
        _commit(save, node, cid, save_checkpoint(tmp_path / f"hot-{cid}", make_state(seed=i)))
        assert Drainer(node, store).drain(NS, cid)


def test_adoption_skips_bad_keys_and_bad_manifests(
    node: Catalog, save: Save, make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    _drained(node, save, store, tmp_path, ["step-000001", "step-000002", "step-000003"])
    root = tmp_path / "store"
    book = root / ".tierckpt" / NS
    # A key that is no checkpoint id, and a namespace that is no namespace.
    (root / NS / "bad 0").mkdir()
    (root / NS / "bad 0" / ".metadata").write_bytes(b"x")
    (root / "bad ns" / "step-1").mkdir(parents=True)
    (root / "bad ns" / "step-1" / ".metadata").write_bytes(b"x")
    # Manifests whose numbers are poison: a NaN timestamp, a sequence past 2**63.
    for cid, field, value in [
        ("step-000002", "committed_unix", float("nan")),
        ("step-000003", "sequence", 2**64 - 1),
    ]:
        path = book / cid / "manifest.json"
        doc = json.loads(path.read_bytes())
        doc[field] = value
        path.write_text(json.dumps(doc))
    node.tier.close()
    shutil.rmtree(tmp_path / "mem")  # a replacement node: its memory tier is gone
    fresh = make_catalog(budget=64 << 20, memory_keep_last=10, drain_every=1)
    assert Drainer(fresh, store).adopt_durable() == 1
    assert [v.checkpoint_id for v in fresh.list_checkpoints(NS)] == ["step-000001"]
    assert store.list_namespaces() == [NS]
    assert store.list_durable(NS) == ["step-000001", "step-000002", "step-000003"]


def test_a_zstd_bomb_in_the_bucket_is_refused_on_restore(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    _drained(node, save, store, tmp_path, ["step-000001"])
    name = "__0_0.distcp"
    marker = store.uploaded(NS, "step-000001")[name]
    assert marker.index is not None
    first = min(marker.index)
    original = node.file_view(NS, "step-000001", name)[0].size
    bombs = {
        "declares": zstandard.ZstdCompressor().compress(bytes(64 << 20)),
        "declares -1": zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 10),
    }
    assert node.drop_local_copy(NS, "step-000001", name)
    for why, bomb in bombs.items():
        stored = tmp_path / "store" / NS / "step-000001" / name
        stored.write_bytes(bomb)
        index = {first: (0, len(bomb))}
        tampered = dataclasses.replace(marker, size=len(bomb), index=index)
        (
            tmp_path / "store" / ".tierckpt" / NS / "step-000001" / "files" / f"{name}.json"
        ).write_bytes(tampered.to_json())
        with pytest.raises(ChecksumMismatch, match=why):
            _restore(node, store, "step-000001", name)
        assert node.file_view(NS, "step-000001", name)[1] == ""
    assert original > 0


def test_a_metadata_not_held_here_comes_through_the_injected_restore(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    _commit(save, node, "step-000008", saved)
    assert node.drop_local_copy(NS, "step-000008", ".metadata")
    with pytest.raises(CheckpointNotFound):
        Drainer(node, store).drain(NS, "step-000008")  # no restore chain: cannot drain
    asked: list[tuple[str, str, str]] = []

    def restore(namespace: str, checkpoint_id: str, name: str) -> tuple[FileRecord, str]:
        asked.append((namespace, checkpoint_id, name))
        f, _ = node.file_view(namespace, checkpoint_id, name)
        return f, str(saved.directory / name)  # what a peer or S3 would have landed

    assert Drainer(node, store, restore=restore).drain(NS, "step-000008")
    assert asked == [(NS, "step-000008", ".metadata")]
    assert store.is_durable(NS, "step-000008")


def test_check_now_runs_the_next_attempt_of_a_due_checkpoint_only(
    node: Catalog, save: Save, store: PersistentTier, tmp_path: Path
) -> None:
    """A peer says a checkpoint is durable (`CatalogEvents.durable_elsewhere`): a due one
    is queued now (its attempt asks the store first); one already durable is not."""
    saved = save_checkpoint(tmp_path / "hot")
    _commit(save, node, "step-000007", saved)
    drainer = Drainer(node, store)
    drainer.check_now(NS, "step-000007")
    assert drainer.pending() == [(NS, "step-000007")]
    assert drainer.drain(NS, "step-000007")
    other = Drainer(node, store)
    other.check_now(NS, "step-000007")  # durable here now: nothing to ask
    other.check_now(NS, "no-such-checkpoint")
    assert other.pending() == []
