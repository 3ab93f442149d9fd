"""The background scrubber (`memory/scrubber.py`): its pace with a fake clock, and
passes over a real catalog on a tmp dir (flipped bytes, copies evicted or repaired
under it, a stop)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from tierckpt.errors import CheckpointNotFound
from tierckptd.catalog import Catalog
from tierckptd.jobs import Repair
from tierckptd.memory.scrubber import READ_CHUNK, Scrubber, Throttle
from tierckptd.model import CheckpointView, FileRecord

from .conftest import MakeCatalog, Save
from .test_healer import FakePeers, _cluster

Found = list[tuple[str, str, str, str, str]]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False


def test_the_throttle_paces_to_the_rate_without_catching_up() -> None:
    clock = Clock()
    throttle = Throttle(1000, clock=clock, wait=clock.wait)
    assert not throttle.take(500)
    assert clock.waits == [0.5]
    clock.now += 0.2  # hashing took time: only the rest is waited
    throttle.take(500)
    assert clock.waits[-1] == pytest.approx(0.3)
    clock.now += 60.0  # a long pause (a save) paid for the next chunk, no more
    waits = len(clock.waits)
    throttle.take(1000)
    assert len(clock.waits) == waits
    throttle.take(1000)
    assert clock.waits[-1] == pytest.approx(1.0)


def test_a_throttle_wait_that_reports_a_stop_stops() -> None:
    clock = Clock()
    throttle = Throttle(10, clock=clock, wait=lambda s: True)
    assert throttle.take(5)


def _flip(path: str, at: int) -> None:
    os.chmod(path, 0o600)
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))


def _scrubber(catalog: object, tier_of: Catalog, found: Found, **kw: object) -> Scrubber:
    return Scrubber(
        catalog,  # type: ignore[arg-type]
        tier_of.tier,
        rate=1 << 40,
        interval=0.0,
        on_corrupt=lambda *a: found.append(a),
        **kw,  # type: ignore[arg-type]
    )


def _bytes(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_a_pass_re_hashes_every_held_copy_and_reports_a_flipped_byte(
    catalog: Catalog, save: Save
) -> None:
    save(catalog, "run", "s1", {"a": b"a" * 5000, "b": b"b" * 100})
    save(catalog, "run", "s2", {"c": b"c" * 3000})
    found: Found = []
    scrubber = _scrubber(catalog, catalog, found)
    before = _bytes("tierckpt_scrubbed_bytes_total")
    result = scrubber.run_pass()
    assert (result.files, result.nbytes, result.corrupt) == (3, 8100, 0)
    assert _bytes("tierckpt_scrubbed_bytes_total") == before + 8100
    assert _bytes("tierckpt_scrub_last_pass_unix") > 0
    _flip(catalog.get("run", "s1").local_paths["a"], 4000)
    result = scrubber.run_pass()
    assert result.corrupt == 1
    assert found == [("run", "s1", "a", "checksum mismatch in block 3", "scrubbed")]


def test_a_changed_size_is_found_too(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s1", {"a": b"a" * 5000})
    path = catalog.get("run", "s1").local_paths["a"]
    os.chmod(path, 0o600)
    os.truncate(path, 4096)
    found: Found = []
    _scrubber(catalog, catalog, found).run_pass()
    assert found == [("run", "s1", "a", "size is 4096 bytes, manifest says 5000", "scrubbed")]


class Stale:
    """The catalog as it was when a pass listed it; `file_view` answers as of now."""

    def __init__(self, catalog: Catalog, views: list[CheckpointView]) -> None:
        self.catalog = catalog
        self.views = views
        self.gone = False

    def list_checkpoints(
        self, namespace: str = "", include_uncommitted: bool = False
    ) -> list[CheckpointView]:
        return self.views

    def file_view(self, namespace: str, checkpoint_id: str, name: str) -> tuple[FileRecord, str]:
        if self.gone:
            raise CheckpointNotFound(f"{namespace}/{checkpoint_id} was evicted")
        return self.catalog.file_view(namespace, checkpoint_id, name)


def test_copies_evicted_or_replaced_since_the_listing_are_not_reported(
    catalog: Catalog, save: Save
) -> None:
    save(catalog, "run", "s1", {"a": b"a" * 5000})
    found: Found = []
    stale = Stale(catalog, catalog.list_checkpoints())
    _flip(catalog.get("run", "s1").local_paths["a"], 10)
    stale.gone = True  # evicted after the scrub read the bad bytes
    assert _scrubber(stale, catalog, found).run_pass().corrupt == 0
    catalog.delete("run", "s1")  # and now the file itself is gone
    assert _scrubber(stale, catalog, found).run_pass().files == 1
    assert found == []


def test_a_stop_ends_the_pass_and_the_thread(catalog: Catalog, save: Save) -> None:
    save(catalog, "run", "s1", {"a": b"a" * 5000})
    found: Found = []
    reading = threading.Event()

    def step_aside(stop: threading.Event) -> object:
        stop.set()  # the daemon stops while this file is read
        reading.set()
        return lambda: None

    scrubber = _scrubber(catalog, catalog, found, step_aside=step_aside)
    scrubber.start()
    assert reading.wait(10)
    scrubber.stop(timeout=10)
    assert scrubber._thread is not None and not scrubber._thread.is_alive()
    assert scrubber.passes == 0 and found == []
    assert scrubber.run_pass().stopped


def test_reading_steps_aside_before_every_chunk_of_a_file(
    make_catalog: MakeCatalog, save: Save
) -> None:
    catalog = make_catalog(budget=8 * READ_CHUNK)
    save(catalog, "run", "s1", {"a": b"a" * (2 * READ_CHUNK + 5), "b": b"b" * 10})
    files: list[list[int]] = []

    def step_aside(stop: threading.Event) -> object:
        files.append([])
        return lambda: files[-1].append(1)

    found: Found = []
    _scrubber(catalog, catalog, found, step_aside=step_aside).run_pass()
    assert sorted(len(calls) for calls in files) == [1, 3] and found == []


def test_a_scrubbed_corrupt_copy_is_dropped_and_repaired_through_the_peer_tier(
    catalog: Catalog, save: Save
) -> None:
    cluster = _cluster(catalog, FakePeers("node-a", {"b": "r2"}))
    save(catalog, "run", "s1", {"a": b"a" * 5000})
    path = catalog.get("run", "s1").local_paths["a"]
    _flip(path, 0)
    scrubber = Scrubber(catalog, catalog.tier, rate=1 << 40, interval=0, on_corrupt=cluster.corrupt)
    assert scrubber.run_pass().corrupt == 1
    assert not catalog.get("run", "s1").local_paths["a"] and not Path(path).exists()
    assert cluster.jobs.pending() == [Repair("run", "s1", "a")]
    assert REGISTRY.get_sample_value("tierckpt_corrupt_copies_total", {"where": "scrubbed"})


def test_a_rate_of_zero_is_refused(catalog: Catalog) -> None:
    with pytest.raises(ValueError, match="0 means no scrubber"):
        Scrubber(catalog, catalog.tier, rate=0, interval=1.0, on_corrupt=lambda *a: None)
