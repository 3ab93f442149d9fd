from __future__ import annotations

from tierckptd.persistent.retention import persistent_evictions


def saves(*steps: int) -> list[tuple[str, int]]:
    return [(f"step-{s:06d}", seq) for seq, s in enumerate(steps)]


def test_keep_last_and_keep_every() -> None:
    durable = saves(*range(100, 1001, 100))
    evicted = persistent_evictions(durable, keep_last=3, keep_every=500)
    survivors = sorted({c for c, _ in durable} - set(evicted))
    assert survivors == ["step-000500", "step-000800", "step-000900", "step-001000"]
    assert evicted == [f"step-{s:06d}" for s in (100, 200, 300, 400, 600, 700)]  # oldest first


def test_keep_every_five_saves() -> None:
    """keep_every counts steps: with steps 100..1000, keep_every=5 keeps all of them."""
    durable = saves(*range(100, 1001, 100))
    assert persistent_evictions(durable, keep_last=3, keep_every=5) == []
    durable = saves(*range(1, 11))
    evicted = persistent_evictions(durable, keep_last=3, keep_every=5)
    assert evicted == [f"step-{s:06d}" for s in (1, 2, 3, 4, 6, 7)]


def test_zero_means_keep_everything() -> None:
    durable = saves(1, 2, 3)
    assert persistent_evictions(durable, keep_last=0, keep_every=0) == []
    assert persistent_evictions(durable, keep_last=0, keep_every=2) == []
    assert persistent_evictions(durable, keep_last=1, keep_every=0) == [
        "step-000001",
        "step-000002",
    ]


def test_never_newest_nor_pinned() -> None:
    durable = [("old", 1), ("mid", 2), ("new", 3)]
    assert persistent_evictions(durable, keep_last=1, keep_every=0, pinned={"old"}) == ["mid"]
    assert persistent_evictions([("only", 7)], keep_last=1, keep_every=0) == []


def test_order_is_sequence_not_input_order_and_ids_without_step() -> None:
    durable = [("final", 9), ("warmup", 1), ("step-000010", 5)]
    assert persistent_evictions(durable, keep_last=1, keep_every=10) == ["warmup"]
