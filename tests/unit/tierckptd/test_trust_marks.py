"""Trust marks (verified, bad): the journal's order (newest stamp wins between verified and
bad, a delete ends a trust mark so a re-save is unmarked), the wire, the catalog's side
("newest" skips BAD, asks for VERIFIED on request, and retention, memory and the ids
persistent retention keeps, never evicts the newest VERIFIED checkpoint) and the copy
stored in the bucket (validated when read back)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from tierckpt.errors import CheckpointNotFound, InvalidArgument
from tierckpt.trust import Trust, parse_trust
from tierckptd.catalog import Catalog
from tierckptd.model import TrustMark
from tierckptd.peers.client import mark_from_wire, mark_to_wire
from tierckptd.peers.cluster_marks import Mark, MarkJournal, MarkKind
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.trust_marker import decode, encode, read_trust

from tests.support.dcp_files import save_checkpoint
from tests.support.persistent_store import file_store

from .conftest import MakeCatalog, Save

NOW = 1_700_000_000.0


def _mark(cid: str, kind: MarkKind, stamp: float, origin: str = "node-a", reason: str = "") -> Mark:
    return Mark("run", cid, kind, stamp, origin, reason=reason)


def _states(journal: MarkJournal) -> dict[str, tuple[Trust, str]]:
    return {cid: (m.trust, m.reason) for cid, m in journal.trust_states("run").items()}


def _journal(tmp_path: Path) -> MarkJournal:
    return MarkJournal(tmp_path, wall_clock=lambda: NOW + 10)


def test_the_newest_trust_mark_wins_whichever_state(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    assert journal.merge(_mark("s1", MarkKind.VERIFIED, NOW))
    assert journal.merge(_mark("s1", MarkKind.BAD, NOW + 1, reason="NaN in layer 3"))
    assert _states(journal) == {"s1": (Trust.BAD, "NaN in layer 3")}
    assert not journal.merge(_mark("s1", MarkKind.VERIFIED, NOW + 0.5))  # older: ignored
    assert journal.merge(_mark("s1", MarkKind.VERIFIED, NOW + 2))  # a newer verdict
    assert _states(journal) == {"s1": (Trust.VERIFIED, "")}
    # A tie breaks by origin node id, as for every mark.
    assert journal.merge(_mark("s1", MarkKind.BAD, NOW + 2, origin="node-b"))
    # Trust and pin are separate: a pin does not displace a trust mark.
    assert journal.merge(_mark("s1", MarkKind.PINNED, NOW + 3))
    again = _journal(tmp_path)  # a restart: the journal keeps both, reason included
    assert _states(again) == {"s1": (Trust.BAD, "")}
    assert again.pins("run") == {"s1": True}
    assert again.trust_states("other") == {}


def test_a_trust_mark_ends_with_a_delete_so_a_resave_is_unmarked(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.merge(_mark("s1", MarkKind.BAD, NOW, reason="SDC"))
    journal.merge(_mark("s1", MarkKind.DELETED, NOW + 1))  # rm; then s1 is saved again
    assert journal.trust_states("run") == {}
    assert _journal(tmp_path).trust_states("run") == {}  # after a restart too
    # A bad mark learnt late (stamped before the rm) still says nothing of the re-save.
    assert not journal.merge(_mark("s1", MarkKind.BAD, NOW))
    journal.merge(_mark("s1", MarkKind.VERIFIED, NOW - 1, origin="node-z"))
    assert journal.trust_states("run") == {}
    # A mark made after the rm is of the re-saved checkpoint.
    assert journal.merge(_mark("s1", MarkKind.VERIFIED, NOW + 2))
    assert _states(journal) == {"s1": (Trust.VERIFIED, "")}


def test_trust_marks_round_trip_the_wire_and_bad_reasons_are_refused() -> None:
    mark = _mark("s1", MarkKind.BAD, NOW, reason="loss spiked to NaN at step 1201")
    assert mark_from_wire(mark_to_wire(mark), now=NOW) == mark
    verified = _mark("s1", MarkKind.VERIFIED, NOW)
    assert mark_from_wire(mark_to_wire(verified), now=NOW) == verified
    forged = mark_to_wire(mark)
    forged.reason = "line\nbreak"
    with pytest.raises(InvalidArgument, match="control character"):
        mark_from_wire(forged, now=NOW)
    forged.reason = "x" * 257
    with pytest.raises(InvalidArgument, match="at most 256"):
        mark_from_wire(forged, now=NOW)


def test_parse_trust_names_the_valid_states() -> None:
    assert parse_trust("Verified") is Trust.VERIFIED
    assert parse_trust(Trust.BAD) is Trust.BAD
    with pytest.raises(InvalidArgument, match="expected one of verified, bad"):
        parse_trust("good")


# ---- the catalog's side -----------------------------------------------------------------


def _wired(catalog: Catalog, tmp_path: Path) -> MarkJournal:
    journal = MarkJournal(tmp_path / "journal")
    catalog.events.trust_marks.answer_with(journal.trust_states)
    return journal


def _now_mark(cid: str, kind: MarkKind, reason: str = "") -> Mark:
    return Mark("run", cid, kind, time.time(), "node-a", reason=reason)


def test_newest_skips_bad_and_verified_is_asked_for(
    make_catalog: MakeCatalog, save: Save, tmp_path: Path
) -> None:
    (tmp_path / "journal").mkdir()
    catalog = make_catalog(memory_keep_last=0)
    journal = _wired(catalog, tmp_path)
    for cid in ("s1", "s2", "s3"):
        save(catalog, "run", cid, {"__0_0.distcp": cid.encode()})
    assert catalog.get("run").checkpoint_id == "s3"
    with pytest.raises(CheckpointNotFound, match="no checkpoint of run is marked verified"):
        catalog.get("run", verified=True)
    journal.merge(_now_mark("s1", MarkKind.VERIFIED))
    journal.merge(_now_mark("s3", MarkKind.BAD, "NaN"))
    assert catalog.get("run").checkpoint_id == "s2"  # s3 is bad: never the newest
    assert catalog.get("run", verified=True).checkpoint_id == "s1"
    bad = catalog.get("run", "s3")  # named, a bad one still loads (to inspect it)
    assert (bad.trust, bad.trust_reason) == (Trust.BAD, "NaN")
    listed = {v.checkpoint_id: v.trust for v in catalog.list_checkpoints("run")}
    assert listed == {"s1": Trust.VERIFIED, "s2": None, "s3": Trust.BAD}
    journal.merge(_now_mark("s2", MarkKind.BAD))
    journal.merge(_now_mark("s1", MarkKind.BAD))
    with pytest.raises(CheckpointNotFound, match=r"not marked bad \(bad: s1, s2, s3\)"):
        catalog.get("run")  # every one is bad


def test_retention_never_evicts_the_newest_verified(
    make_catalog: MakeCatalog, save: Save, tmp_path: Path
) -> None:
    (tmp_path / "journal").mkdir()
    catalog = make_catalog(memory_keep_last=2)
    journal = _wired(catalog, tmp_path)
    save(catalog, "run", "s1", {"__0_0.distcp": b"1"})
    journal.merge(_now_mark("s1", MarkKind.VERIFIED))
    catalog.trust_changed("run")
    for i in range(2, 6):
        save(catalog, "run", f"s{i}", {"__0_0.distcp": b"x"})
    ids = [v.checkpoint_id for v in catalog.list_checkpoints("run")]
    assert ids == ["s1", "s4", "s5"]  # s2, s3 evicted while newer ones came; s1 held
    assert catalog.tier.data_dir("run", "s1").exists()
    assert "s1" in catalog.pinned_ids("run")  # persistent retention keeps it too
    # A newer verified one takes over: the older is no longer held.
    journal.merge(_now_mark("s5", MarkKind.VERIFIED))
    catalog.trust_changed("run")
    assert [v.checkpoint_id for v in catalog.list_checkpoints("run")] == ["s4", "s5"]
    assert catalog.pinned_ids("run") == {"s5"}
    # A bad mark on it hands the hold back to no one older (s1 is gone): nothing pinned.
    journal.merge(_now_mark("s5", MarkKind.BAD))
    assert catalog.pinned_ids("run") == set()


# ---- the bucket's copy ------------------------------------------------------------------


def test_a_stored_trust_marker_round_trips_and_a_tampered_one_is_refused() -> None:
    mark = TrustMark(Trust.BAD, "SDC check failed", NOW, "node-a")
    assert decode(encode(mark)) == mark
    good = json.loads(encode(mark))
    for tampered in (
        {**good, "trust": "trusted"},
        {**good, "stamp": "soon"},
        {**good, "stamp": -1.0},
        {**good, "origin": "../x"},
        {**good, "reason": "a\x00b"},
        {**good, "reason": "x" * 300},
        {k: v for k, v in good.items() if k != "origin"},
        [1, 2],
    ):
        with pytest.raises(ValueError, match="not a valid trust marker"):
            decode(json.dumps(tampered).encode())
    with pytest.raises(ValueError, match="not a valid trust marker"):
        decode(b"\xff{")


def test_the_drain_stores_a_mark_made_before_it_and_adoption_finds_it(
    make_catalog: MakeCatalog, save: Save, tmp_path: Path
) -> None:
    store = file_store(tmp_path / "store")
    (tmp_path / "journal").mkdir()
    node = make_catalog(budget=64 << 20, memory_keep_last=10, drain_every=1)
    journal = _wired(node, tmp_path)
    saved = save_checkpoint(tmp_path / "hot")
    names = [*saved.data_names, ".metadata"]
    for cid in ("step-1", "step-2"):
        save(node, "run", cid, {n: (saved.directory / n).read_bytes() for n in names})
    journal.merge(_now_mark("step-1", MarkKind.BAD, "NaN"))  # before it drained
    drainer = Drainer(node, store)
    assert drainer.drain("run", "step-1") and drainer.drain("run", "step-2")
    stored = read_trust(store, ("run", "step-1"))
    assert stored is not None and (stored.trust, stored.reason) == (Trust.BAD, "NaN")
    assert read_trust(store, ("run", "step-2")) is None  # unmarked: nothing stored
    # A replacement node (memory tier and journal gone) adopts it with its mark.
    node.tier.close()
    shutil.rmtree(tmp_path / "mem")
    fresh = make_catalog(budget=64 << 20, memory_keep_last=10, drain_every=1)
    found: list[tuple[str, str, TrustMark]] = []
    fresh.events.trust_found.add(lambda ns, cid, m: found.append((ns, cid, m)))
    assert Drainer(fresh, store).adopt_durable() == 2
    assert found == [("run", "step-1", stored)]
