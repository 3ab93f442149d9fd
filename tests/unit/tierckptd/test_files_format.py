"""Format-neutral ("files") checkpoints in the persistent tier: drained verbatim in the
layout a local filesystem would have, committed by a bookkeeping marker written last,
adopted by another cluster only when that marker matches the manifest, restored byte for
byte, deleted marker first. A `.metadata` among its files is data: never decoded (bytes
DCP's allow-list refuses drain like any other). The daemon-level run with peers and moto
S3: tests/integration/test_files_format.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierckptd.catalog import Catalog
from tierckptd.memory.tier import MemoryTier
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.files_commit import FILES_COMMIT_OBJECT
from tierckptd.persistent.listing import Discovery
from tierckptd.persistent.source import PersistentSource
from tierckptd.persistent.store import PersistentTier
from tierckptd.restore import Restorer

from tests.support.catalog_files import write_file
from tests.support.persistent_store import file_store

from .conftest import MakeCatalog

NS = "run9"
FILES = {
    ".metadata": b"\x80\x04cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.",
    "metadata.pkl": b"not even a pickle",
    "model_0.pt": os.urandom(200_000),
}


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return file_store(tmp_path / "store")


@pytest.fixture
def other(tmp_path: Path) -> Iterator[Catalog]:
    """Another cluster's node: its own memory tier, the same persistent tier."""
    tier = MemoryTier(tmp_path / "other-mem")
    tier.open_layout()
    catalog = Catalog(tier, node_id="node-z", failure_domain="rack-9", budget=64 << 20)
    catalog.adopt()
    yield catalog
    tier.close()


def _drain_files(other: Catalog, store: PersistentTier, cid: str) -> None:
    other.begin(NS, cid, 0)
    other.reserve(NS, cid, 0, sum(len(d) for d in FILES.values()))
    for name, data in FILES.items():
        write_file(other, NS, cid, name, data, 0)
    view = other.commit(NS, cid, list(FILES), checkpoint_format="files")
    assert view.checkpoint_format == "files"
    assert Drainer(other, store).drain(NS, cid)


def test_drained_verbatim_committed_last_adopted_and_restored(
    make_catalog: MakeCatalog, other: Catalog, store: PersistentTier, tmp_path: Path
) -> None:
    _drain_files(other, store, "step-1")
    ckpt = tmp_path / "store" / NS / "step-1"
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == FILES  # plain, uncompressed
    marker = json.loads(
        (tmp_path / "store" / ".tierckpt" / NS / "step-1" / FILES_COMMIT_OBJECT).read_text()
    )
    assert {f["name"]: f["size"] for f in marker["files"]} == {n: len(d) for n, d in FILES.items()}
    assert store.is_durable(NS, "step-1") and store.list_durable(NS) == ["step-1"]

    node = make_catalog(budget=64 << 20)
    assert Discovery(store, node).probe(NS, "step-1")
    view = node.get(NS, "step-1")
    assert view.checkpoint_format == "files" and not any(f.held for f in view.files)
    restorer = Restorer(node, lambda *_: [PersistentSource(store)])
    for name, data in FILES.items():
        _, path = restorer.ensure_local(NS, "step-1", name)
        assert Path(path).read_bytes() == data

    store.delete(NS, "step-1")
    assert not store.is_durable(NS, "step-1") and store.list_durable(NS) == []


def test_a_marker_that_does_not_match_the_manifest_is_not_adopted(
    make_catalog: MakeCatalog, other: Catalog, store: PersistentTier, tmp_path: Path
) -> None:
    _drain_files(other, store, "step-2")
    path = tmp_path / "store" / ".tierckpt" / NS / "step-2" / FILES_COMMIT_OBJECT
    doc = json.loads(path.read_text())
    doc["files"][0]["size"] += 1  # a tampered bucket
    path.write_text(json.dumps(doc))
    node = make_catalog(budget=64 << 20)
    assert not Discovery(store, node).probe(NS, "step-2")
    # No marker at all: not durable as a files checkpoint, and its `.metadata` object
    # (data) does not make it one: adoption reads the format and wants the marker.
    path.unlink()
    assert not store.is_durable(NS, "step-2", "files")
    assert not Discovery(store, node).probe(NS, "step-2")
