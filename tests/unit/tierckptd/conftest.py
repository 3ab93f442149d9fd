"""Fixtures for the daemon's unit tests: a catalog on a tmp dir with a fake clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tierckptd.catalog import Catalog
from tierckptd.catalog.budget import held_charge
from tierckptd.memory.tier import MemoryTier

from tests.support.catalog_files import write_file

__all__ = ["FakeClock", "MakeCatalog", "Save", "write_file"]


class FakeClock:
    """Monotonic clock the tests advance by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


MakeCatalog = Callable[..., Catalog]
Save = Callable[..., None]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_catalog(tmp_path: Path, clock: FakeClock) -> Iterator[MakeCatalog]:
    tiers: list[MemoryTier] = []

    catalogs: list[Catalog] = []

    def make(**kwargs: object) -> Catalog:
        tier = MemoryTier(tmp_path / "mem")
        tier.open_layout()
        tiers.append(tier)
        options: dict[str, object] = {
            "node_id": "node-a",
            "failure_domain": "rack-1",
            "budget": 1 << 20,
            "clock": clock,
        }
        options.update(kwargs)
        catalog = Catalog(tier, **options)  # type: ignore[arg-type]
        catalog.adopt()
        catalogs.append(catalog)
        return catalog

    yield make
    for catalog in catalogs:
        assert_budget_consistent(catalog)
    for tier in tiers:
        tier.close()


def assert_budget_consistent(catalog: Catalog) -> None:
    """The budget's running totals agree with a fresh sum over the records."""
    budget, records = catalog._budget, catalog._records
    with catalog._lock:
        assert set(budget._held) == set(records)
        assert budget._held_total == sum(held_charge(r) for r in records.values())
        assert budget._reserved_total == sum(sum(r.reservations.values()) for r in records.values())
        assert budget._incoming_total == sum(budget.incoming.values())
        assert budget._manifest_total == sum(budget._manifests.values())


@pytest.fixture
def catalog(make_catalog: MakeCatalog) -> Catalog:
    return make_catalog()


@pytest.fixture
def save() -> Save:
    """save(catalog, ns, ckpt, {name: bytes}) runs a whole one-rank save and commit."""

    def run(catalog: Catalog, ns: str, ckpt: str, files: dict[str, bytes], rank: int = 0) -> None:
        catalog.begin(ns, ckpt, rank)
        catalog.reserve(ns, ckpt, rank, sum(len(d) for d in files.values()))
        for name, data in files.items():
            write_file(catalog, ns, ckpt, name, data, rank)
        catalog.commit(ns, ckpt, list(files))

    return run
