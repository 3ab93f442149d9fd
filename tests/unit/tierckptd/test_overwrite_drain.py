"""The drain of a re-saved checkpoint (overwrite): the replaced generation's `.metadata`
leaves the persistent tier before the new one drains, `.metadata` last; a re-save that
commits while a drain attempt runs keeps that attempt's `.metadata` out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from tierckptd.catalog import Catalog
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.store import PersistentTier

from tests.support.catalog_files import write_file
from tests.support.dcp_files import (
    SavedCheckpoint,
    assert_state_equal,
    load_target,
    make_state,
    save_checkpoint,
)
from tests.support.persistent_store import file_store

from .conftest import MakeCatalog

NS = "run9"
ID = "step-000001"


@pytest.fixture
def node(make_catalog: MakeCatalog) -> Catalog:
    return make_catalog(budget=64 << 20, memory_keep_last=10, drain_every=1)


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return file_store(tmp_path / "store")


def _save(catalog: Catalog, saved: SavedCheckpoint) -> None:
    """One rank's save of a stock DCP checkpoint into ID, replacing it if committed."""
    names = [*saved.data_names, ".metadata"]
    catalog.begin(NS, ID, 0, overwrite=True)
    catalog.reserve(NS, ID, 0, sum((saved.directory / n).stat().st_size for n in names))
    for n in names:
        write_file(catalog, NS, ID, n, (saved.directory / n).read_bytes())
    catalog.commit(NS, ID, names)


def _loads(store: PersistentTier, state: dict[str, Any]) -> None:
    target = load_target(state)
    dcp.load(target, checkpoint_id=store.checkpoint_url(NS, ID))  # stock DCP, no tierckpt
    assert_state_equal(actual=target, expected=state)


def test_a_resave_drains_as_a_new_generation(
    node: Catalog, store: PersistentTier, tmp_path: Path
) -> None:
    first = save_checkpoint(tmp_path / "a", make_state(1))
    _save(node, first)
    drainer = Drainer(node, store)
    assert drainer.drain(NS, ID)
    _loads(store, first.state)

    second = save_checkpoint(tmp_path / "b", make_state(2))
    _save(node, second)
    assert not node.durability.is_durable(NS, ID)  # the new generation is not drained yet
    assert node.due_not_durable() == [(NS, ID)]
    assert drainer.drain(NS, ID)
    _loads(store, second.state)


def test_a_resave_during_a_drain_attempt_keeps_its_metadata_out(
    node: Catalog, store: PersistentTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = save_checkpoint(tmp_path / "a", make_state(1))
    _save(node, first)
    drainer = Drainer(node, store)
    assert drainer.drain(NS, ID)
    second = save_checkpoint(tmp_path / "b", make_state(2))
    third = save_checkpoint(tmp_path / "c", make_state(3))
    _save(node, second)
    upload = drainer._upload

    def upload_then_resave(*args: Any, **kwargs: Any) -> None:
        upload(*args, **kwargs)  # the second generation's data files are up ...
        _save(node, third)  # ... when a third one commits

    monkeypatch.setattr(drainer, "_upload", upload_then_resave)
    assert not drainer.drain(NS, ID)
    assert not store.is_durable(NS, ID)  # neither the first's nor the second's .metadata
    monkeypatch.undo()
    assert drainer.drain(NS, ID)
    _loads(store, third.state)
