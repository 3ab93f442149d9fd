"""The one restore chain with fake sources: fall-through order, landing, and the final
error (NOT_FOUND / UNAVAILABLE naming the tier / DATA_LOSS only when every copy is
corrupt)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierckpt.checksum import BytesLike
from tierckpt.errors import (
    CHECKPOINT_LOST_PREFIX,
    TIER_UNAVAILABLE_PREFIX,
    CheckpointLost,
    CheckpointNotFound,
    ChecksumMismatch,
    TierUnavailable,
    status_of,
)
from tierckptd.catalog import Catalog
from tierckptd.errors import SourceUnavailable
from tierckptd.model import FileRecord
from tierckptd.restore import Attempt, FileSource, Outcome, Restorer, final_error, no_sources

from .conftest import Save

DATA = bytes(range(256)) * 12  # 3 KiB: three 1 KiB checksum blocks


class Fake:
    """A source that has the file, lacks it, is down, or hands out damaged bytes."""

    def __init__(self, name: str, behaviour: str, data: bytes = DATA) -> None:
        self._name = name
        self.behaviour = behaviour
        self.data = data
        self.asked = 0
        self.landed_calls: list[str] = []

    @property
    def name(self) -> str:
        return self._name

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        self.asked += 1
        if self.behaviour == "missing":
            raise CheckpointNotFound(f"{self._name} has no {f.name}")
        if self.behaviour == "down":
            raise SourceUnavailable(self._name, "connection refused")
        if self.behaviour == "corrupt-known":
            raise ChecksumMismatch(f"{self._name}'s copy failed verification")
        data = self.data
        if self.behaviour == "flips":
            data = bytes([data[0] ^ 1]) + data[1:]
        if self.behaviour == "short":
            data = data[:1500]
        for off in range(0, len(data), 1000):
            yield off, data[off : off + 1000]

    def landed(self, namespace: str, checkpoint_id: str, f: FileRecord) -> None:
        self.landed_calls.append(f.name)


@pytest.fixture
def remote(catalog: Catalog, save: Save) -> Catalog:
    """A committed checkpoint whose data file this node does not hold (a peer's)."""
    save(catalog, "run", "s1", {".metadata": b"m", "__0_0.distcp": DATA})
    catalog.drop_local_copy("run", "s1", "__0_0.distcp")
    return catalog


def _restorer(catalog: Catalog, *sources: FileSource) -> Restorer:
    return Restorer(catalog, lambda ns, cid, f: list(sources))


def test_a_held_file_is_returned_without_asking_anyone(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": DATA})
    src = Fake("peer b", "ok")
    f, path = _restorer(catalog, src).ensure_local("run", "s1", "__0_0.distcp")
    assert path and src.asked == 0


def test_falls_through_to_the_first_source_with_a_valid_copy(remote: Catalog) -> None:
    sources = [Fake("peer b", "missing"), Fake("peer c", "down"), Fake("peer d", "flips")]
    good = Fake("persistent s3://b/p", "ok")
    f, path = _restorer(remote, *sources, good).ensure_local("run", "s1", "__0_0.distcp")
    assert Path(path).read_bytes() == DATA
    assert [s.asked for s in sources] == [1, 1, 1] and good.asked == 1
    assert good.landed_calls == ["__0_0.distcp"]  # told it landed; the others not
    assert all(not s.landed_calls for s in sources)
    assert remote.get("run", "s1").local_paths["__0_0.distcp"] == path


def test_nobody_has_it_is_not_found_naming_every_source(remote: Catalog) -> None:
    restorer = _restorer(remote, Fake("peer b", "missing"), Fake("persistent s3://x", "missing"))
    with pytest.raises(CheckpointNotFound) as e:
        restorer.ensure_local("run", "s1", "__0_0.distcp")
    assert "peer b: missing" in str(e.value) and "persistent s3://x: missing" in str(e.value)
    assert "memory: missing" in str(e.value)


def test_no_sources_at_all_is_not_found(remote: Catalog) -> None:
    with pytest.raises(CheckpointNotFound):
        Restorer(remote, no_sources).ensure_local("run", "s1", "__0_0.distcp")


@pytest.mark.parametrize(
    "behaviours",
    [("down",), ("missing", "down"), ("down", "flips"), ("corrupt-known", "down", "missing")],
)
def test_an_unreachable_tier_is_unavailable_naming_it(
    remote: Catalog, behaviours: tuple[str, ...]
) -> None:
    sources = [Fake(f"peer n{i}", b) for i, b in enumerate(behaviours)]
    with pytest.raises(TierUnavailable) as e:
        _restorer(remote, *sources).ensure_local("run", "s1", "__0_0.distcp")
    down = [s.name for s in sources if s.behaviour == "down"]
    message = str(e.value)
    assert message.startswith(TIER_UNAVAILABLE_PREFIX)
    assert all(f"{d}: unavailable (connection refused)" in message for d in down)
    assert status_of(e.value).name == "UNAVAILABLE"


@pytest.mark.parametrize(
    "behaviours",
    [("flips",), ("corrupt-known",), ("short",), ("flips", "missing", "corrupt-known")],
)
def test_data_loss_only_when_every_copy_found_is_corrupt(
    remote: Catalog, behaviours: tuple[str, ...]
) -> None:
    sources = [Fake(f"peer n{i}", b) for i, b in enumerate(behaviours)]
    with pytest.raises(ChecksumMismatch) as e:
        _restorer(remote, *sources).ensure_local("run", "s1", "__0_0.distcp")
    assert "every copy" in str(e.value)
    assert status_of(e.value).name == "DATA_LOSS"
    # Nothing half-written stays behind: the file is still not held.
    assert remote.get("run", "s1").local_paths["__0_0.distcp"] == ""


def test_repair_of_a_corrupt_local_copy_with_no_other_copy_is_data_loss(
    catalog: Catalog, save: Save
) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": DATA})
    path = catalog.get("run", "s1").local_paths["__0_0.distcp"]
    with open(path, "r+b") as fh:
        fh.write(b"\xff")
    seen: list[str] = []
    restorer = Restorer(
        catalog, no_sources, on_corrupt_local=lambda ns, cid, name, why: seen.append(name)
    )
    with pytest.raises(ChecksumMismatch) as e:
        restorer.ensure_local("run", "s1", "__0_0.distcp", repair=True)
    assert "memory: corrupt" in str(e.value)
    assert seen == ["__0_0.distcp"]
    assert catalog.get("run", "s1").local_paths["__0_0.distcp"] == ""  # dropped


def test_repair_of_a_corrupt_local_copy_restores_it(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": DATA})
    path = catalog.get("run", "s1").local_paths["__0_0.distcp"]
    with open(path, "r+b") as fh:
        fh.write(b"\xff")
    _, path = _restorer(catalog, Fake("peer b", "ok")).ensure_local(
        "run", "s1", "__0_0.distcp", repair=True
    )
    assert Path(path).read_bytes() == DATA


def test_repair_of_a_valid_copy_keeps_it(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s1", {"__0_0.distcp": DATA})
    src = Fake("peer b", "ok")
    _restorer(catalog, src).ensure_local("run", "s1", "__0_0.distcp", repair=True)
    assert src.asked == 0


def test_one_restore_per_file_at_a_time(remote: Catalog) -> None:
    gate = threading.Event()
    entered = threading.Event()

    class Slow(Fake):
        def chunks(
            self, namespace: str, checkpoint_id: str, f: FileRecord
        ) -> Iterator[tuple[int, BytesLike]]:
            entered.set()
            gate.wait(5)
            yield from super().chunks(namespace, checkpoint_id, f)

    src = Slow("peer b", "ok")
    restorer = _restorer(remote, src)
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(restorer.ensure_local("run", "s1", "__0_0.distcp")[1])
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    assert entered.wait(5)
    gate.set()
    for t in threads:
        t.join(5)
    assert src.asked == 1  # the others found it held once the first landed it
    assert len(set(results)) == 1 and len(results) == 3
    assert restorer.file_locks_in_use() == 0


def test_final_error_precedence() -> None:
    a_missing = Attempt("memory", Outcome.MISSING, "not held")
    a_down = Attempt("persistent s3://b", Outcome.UNAVAILABLE, "503")
    a_corrupt = Attempt("peer b", Outcome.CORRUPT, "block 0")
    lost = final_error("x", [a_missing])
    # Every source answered without it: lost (DATA_LOSS), not a checksum error, and
    # still a CheckpointNotFound to callers that only ask whether it can be had.
    assert isinstance(lost, CheckpointLost) and isinstance(lost, CheckpointNotFound)
    assert status_of(lost).name == "DATA_LOSS"
    assert str(lost).startswith(CHECKPOINT_LOST_PREFIX) and "memory: missing" in str(lost)
    assert isinstance(final_error("x", [a_missing, a_corrupt]), ChecksumMismatch)
    e = final_error("x", [a_missing, a_corrupt, a_down])
    assert isinstance(e, TierUnavailable) and "persistent s3://b" in str(e)
    assert isinstance(final_error("x", []), CheckpointLost)
