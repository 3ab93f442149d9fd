from __future__ import annotations

from tierckptd.catalog.retention import Candidate, memory_evictions


def test_keep_last() -> None:
    cands = [Candidate(f"s{i}", i) for i in range(1, 6)]
    assert sorted(memory_evictions(cands, 2)) == ["s1", "s2", "s3"]
    assert memory_evictions(cands, 0) == []
    assert memory_evictions(cands, 10) == []


def test_never_newest_nor_pinned() -> None:
    cands = [Candidate("old", 1, pinned=True), Candidate("mid", 2), Candidate("new", 3)]
    assert memory_evictions(cands, 1) == ["mid"]
    assert memory_evictions([Candidate("only", 1)], 1) == []
