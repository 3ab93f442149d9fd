"""The catalog remembers deleted checkpoints (so a peer's late publish cannot bring one
back), but only the newest `MAX_GONE`: one key per deletion, retention's included, must
not grow for the daemon's whole life (found by bench/soak.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierckptd.catalog import peer_marks

from tests.support.dcp_files import save_checkpoint

from .conftest import MakeCatalog
from .test_durable_hint import NS, _save


def test_deleted_keys_are_bounded_and_the_newest_are_kept(
    make_catalog: MakeCatalog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_marks, "MAX_GONE", 3)
    saved = save_checkpoint(tmp_path / "hot")
    catalog = make_catalog(budget=64 << 20, memory_keep_last=0)
    for i in range(6):
        _save(catalog, f"step-{i}", saved)
        catalog.delete(NS, f"step-{i}")
    assert catalog.peer_marks.tombstones() == [(NS, "step-3"), (NS, "step-4"), (NS, "step-5")]
