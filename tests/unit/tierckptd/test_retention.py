from __future__ import annotations

from tierckpt.names import METADATA_FILE
from tierckptd.catalog.retention import Candidate, evictions_by_coordinator, memory_evictions
from tierckptd.model import CheckpointRecord, FileRecord, State


def test_keep_last() -> None:
    cands = [Candidate(f"s{i}", i) for i in range(1, 6)]
    assert sorted(memory_evictions(cands, 2)) == ["s1", "s2", "s3"]
    assert memory_evictions(cands, 0) == []
    assert memory_evictions(cands, 10) == []


def test_never_newest_nor_pinned() -> None:
    cands = [Candidate("old", 1, pinned=True), Candidate("mid", 2), Candidate("new", 3)]
    assert memory_evictions(cands, 1) == ["mid"]
    assert memory_evictions([Candidate("only", 1)], 1) == []


def _committed(checkpoint_id: str, sequence: int, coordinator: str) -> CheckpointRecord:
    rec = CheckpointRecord("run", checkpoint_id, State.COMMITTED, 0.0, "a", float(sequence))
    rec.sequence = sequence
    rec.files = {METADATA_FILE: FileRecord(METADATA_FILE, 0, owner_node=coordinator)}
    return rec


def test_evictions_are_per_coordinator() -> None:
    recs = [_committed(f"a{i}", i, "node-a") for i in (1, 3, 5)]
    recs += [_committed(f"b{i}", i, "node-b") for i in (2, 4)]
    # The window applies to each coordinator's checkpoints on its own (invariant 10).
    assert sorted(evictions_by_coordinator(recs, 1, lambda r: False)) == ["a1", "a3", "b2"]
    assert evictions_by_coordinator(recs, 0, lambda r: False) == []


def test_held_checkpoints_are_never_evicted() -> None:
    """Invariant 6: due and not durable (the catalog's hold) is kept whatever keep_last."""
    recs = [_committed(f"s{i}", i, "node-a") for i in range(1, 5)]
    held = {"s1", "s3"}
    assert evictions_by_coordinator(recs, 1, lambda r: r.checkpoint_id in held) == ["s2"]


def test_a_lost_checkpoint_never_takes_a_complete_ones_place() -> None:
    # 5 newest, LOST; keep_last = 2 keeps 4 and 3 (complete) and 5 (newer than them).
    lost5 = [Candidate("c1", 1), Candidate("c2", 2), Candidate("c3", 3), Candidate("c4", 4)]
    lost5.append(Candidate("c5", 5, lost=True))
    assert sorted(memory_evictions(lost5, keep_last=2)) == ["c1", "c2"]
    # A LOST one older than the kept window goes; with too few complete ones it stays.
    mid = [Candidate("c1", 1), Candidate("c2", 2, lost=True), Candidate("c3", 3)]
    assert memory_evictions(mid, keep_last=1) == ["c2", "c1"]
    assert memory_evictions(mid, keep_last=3) == []
    # Pinned wins over LOST.
    pinned = [Candidate("c1", 1, pinned=True, lost=True), Candidate("c2", 2), Candidate("c3", 3)]
    assert memory_evictions(pinned, keep_last=1) == ["c2"]
