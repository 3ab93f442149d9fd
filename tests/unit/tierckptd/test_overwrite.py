"""Re-saving a committed id (overwrite): a new generation that replaces the old one
atomically at its commit; until then the old one is listed and loadable as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierckpt.errors import CheckpointExists, CheckpointIncomplete
from tierckpt.names import next_generation_id
from tierckptd.catalog import Catalog
from tierckptd.memory.manifest import from_json
from tierckptd.model import State

from tests.support.catalog_files import write_file

KiB = 1024
FILES = ["__0_0.distcp", ".metadata"]


def _resave(catalog: Catalog, data: bytes, meta: bytes = b"m2") -> None:
    catalog.begin("run", "step-1", 0, overwrite=True)
    catalog.reserve("run", "step-1", 0, 8 * KiB)
    write_file(catalog, "run", "step-1", "__0_0.distcp", data)
    write_file(catalog, "run", "step-1", ".metadata", meta)


def _bytes(catalog: Catalog) -> dict[str, bytes]:
    view = catalog.get("run", "step-1")
    return {name: Path(path).read_bytes() for name, path in view.local_paths.items()}


def test_the_old_generation_stays_until_the_new_one_commits(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "step-1", {"__0_0.distcp": b"old" * 100, ".metadata": b"m1"})
    old = catalog.get("run", "step-1")
    _resave(catalog, b"new" * 200)
    # Written beside it: the old one is what every query answers, bit-exact.
    assert catalog.get("run", "step-1").sequence == old.sequence
    assert _bytes(catalog) == {"__0_0.distcp": b"old" * 100, ".metadata": b"m1"}
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["step-1"]
    shown = catalog.list_checkpoints("run", include_uncommitted=True)
    assert [(v.checkpoint_id, v.state) for v in shown] == [
        ("step-1", State.COMMITTED),
        ("step-1", State.WRITING),  # the re-save in progress, under the id it replaces
    ]
    assert catalog.get("run").checkpoint_id == "step-1"
    view = catalog.commit("run", "step-1", FILES)
    assert view.sequence > old.sequence and view.state is State.COMMITTED
    assert _bytes(catalog) == {"__0_0.distcp": b"new" * 200, ".metadata": b"m2"}
    assert [v.sequence for v in catalog.list_checkpoints("run", include_uncommitted=True)] == [
        view.sequence
    ]
    # Nothing of either generation is left beside it: one dir, one manifest.
    ns_dir = catalog.tier.data_root / "run"
    assert sorted(p.name for p in ns_dir.iterdir()) == ["step-1"]
    assert sorted(p.name for p in (catalog.tier.manifest_root / "run").iterdir()) == ["step-1.json"]
    assert catalog.status().reserved_bytes == 0


def test_an_aborted_resave_leaves_the_old_one(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "step-1", {"__0_0.distcp": b"old", ".metadata": b"m1"})
    _resave(catalog, b"new")
    catalog.abort("run", "step-1")
    assert _bytes(catalog) == {"__0_0.distcp": b"old", ".metadata": b"m1"}
    assert not catalog.tier.data_dir("run", next_generation_id("step-1")).exists()
    # A committed id can still not be aborted.
    with pytest.raises(CheckpointIncomplete, match="cannot be aborted"):
        catalog.abort("run", "step-1")


def test_a_restart_before_the_commit_keeps_the_old_one(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    catalog = make_catalog()
    save(catalog, "run", "step-1", {"__0_0.distcp": b"old", ".metadata": b"m1"})
    _resave(catalog, b"new")
    catalog.tier.close()
    again = make_catalog()  # the daemon died before the commit: a restart adopts
    assert _bytes(again) == {"__0_0.distcp": b"old", ".metadata": b"m1"}
    assert not again.tier.data_dir("run", next_generation_id("step-1")).exists()
    _resave(again, b"newer")  # and it can be re-saved again
    again.commit("run", "step-1", FILES)
    assert _bytes(again)["__0_0.distcp"] == b"newer"


def test_the_committed_generation_survives_a_restart(make_catalog, save) -> None:  # type: ignore[no-untyped-def]
    catalog = make_catalog()
    save(catalog, "run", "step-1", {"__0_0.distcp": b"old", ".metadata": b"m1"})
    _resave(catalog, b"new")
    catalog.commit("run", "step-1", FILES)
    catalog.tier.close()
    again = make_catalog()
    assert _bytes(again) == {"__0_0.distcp": b"new", ".metadata": b"m2"}


def test_immutability_is_still_an_option(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "step-1", {".metadata": b"x"})
    with pytest.raises(CheckpointExists, match="does not overwrite"):
        catalog.begin("run", "step-1", 0)


def test_a_stale_publish_of_the_old_generation_is_refused(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    save(catalog, "run", "step-1", {"__0_0.distcp": b"old", ".metadata": b"m1"})
    stale = from_json(catalog.manifest_document("run", "step-1"))
    _resave(catalog, b"new")
    catalog.commit("run", "step-1", FILES)
    assert catalog.publish(stale) is False
    assert _bytes(catalog)["__0_0.distcp"] == b"new"
