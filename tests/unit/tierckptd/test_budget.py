"""Budget: running totals of C, R and P, and the one admission check (no catalog)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierckpt.errors import MemoryBudgetExceeded
from tierckptd.catalog.budget import PAGE, Budget
from tierckptd.memory.pool import Segment, WarmPool
from tierckptd.memory.tier import MemoryTier
from tierckptd.ops import metrics

KiB = 1024


def _budget(tmp_path: Path, limit: int = 100 * KiB, segments: tuple[int, ...] = ()) -> Budget:
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    pool = WarmPool(tier)
    for i, size in enumerate(segments):
        path = tier.pool_dir / f"seg-{i}@run"
        path.write_bytes(b"\0" * size)
        pool.segments.append(Segment(path, size, None, "run"))
    return Budget(limit, pool, node_id="node-a")


def _rejected(reason: str) -> float:
    return float(metrics.REJECTED_SAVES.labels(reason=reason)._value.get())


def test_running_totals_follow_track_and_forget(tmp_path: Path) -> None:
    b = _budget(tmp_path, segments=(3 * KiB,))
    b.track(("run", "s1"), 10 * KiB, 5 * KiB)
    b.track(("run", "s2"), 0, 7 * KiB)
    b.track(("run", "s1"), 12 * KiB, 0)  # the reservation became held bytes
    b.charge_manifest(("peer", "s9"), 2 * KiB)  # charged in whole pages (audit 3 M6)
    b.start_incoming(("run", "s3", "f"), 4 * KiB)
    b.pool.pending = 1 * KiB
    b.quarantined = 1 * KiB
    assert (b.used, b.reserved, b.pooled) == (13 * KiB + PAGE, 12 * KiB, 3 * KiB)
    assert b.checkpoints == 2
    b.finish_incoming(("run", "s3", "f"))
    b.forget(("run", "s1"))
    b.charge_manifest(("peer", "s9"), 0)
    assert (b.used, b.reserved, b.checkpoints) == (1 * KiB, 8 * KiB, 1)
    b.reset(quarantined=0)
    assert (b.used, b.reserved, b.checkpoints) == (0, 1 * KiB, 0)  # pending is the pool's


def test_admit_refuses_a_save_over_budget_naming_the_fix(tmp_path: Path) -> None:
    b = _budget(tmp_path)
    b.track(("run", "s1"), 60 * KiB, 0)
    before = _rejected("budget")
    with pytest.raises(MemoryBudgetExceeded) as e:
        b.admit(50 * KiB, what="this save", reason="budget")
    assert str(e.value) == (
        "memory budget exceeded: this save needs 50.0 KiB but 60.0 KiB of "
        "memory.budget=100.0 KiB are in use by 1 checkpoint on node node-a; raise [memory] "
        "budget, lower [retention] memory_keep_last, or remove checkpoints with `tierckpt rm`"
    )
    assert _rejected("budget") == before + 1
    b.admit(40 * KiB, what="this save", reason="budget")  # exactly fits


def test_admit_other_requests_says_no_room(tmp_path: Path) -> None:
    b = _budget(tmp_path)
    b.track(("run", "s1"), 0, 90 * KiB)
    with pytest.raises(
        MemoryBudgetExceeded, match=r"^no room for a copy of run/s1/f \(20\.0 KiB\)"
    ):
        b.admit(20 * KiB, what="a copy of run/s1/f", reason="replica")
    with pytest.raises(MemoryBudgetExceeded, match="90.0 KiB of memory.budget=100.0 KiB in use"):
        b.admit(20 * KiB, what="the manifest of run/s1", reason="manifest")


def test_admit_within_a_reservation(tmp_path: Path) -> None:
    b = _budget(tmp_path, limit=1)  # the budget plays no part: the bytes are reserved
    b.admit(4 * KiB, what="file f of run/s1", reason="reservation", within=4 * KiB)
    with pytest.raises(MemoryBudgetExceeded, match="rank 0's reservation has only 1.0 KiB left"):
        b.admit(2 * KiB, what="file f of run/s1", reason="reservation", within=KiB, holder="rank 0")


def test_admit_trims_the_pool_largest_first_but_a_refusal_keeps_it(tmp_path: Path) -> None:
    b = _budget(tmp_path, segments=(10 * KiB, 30 * KiB, 20 * KiB))
    b.track(("run", "s1"), 40 * KiB, 0)
    with pytest.raises(MemoryBudgetExceeded):
        b.admit(61 * KiB, what="this save", reason="budget")
    assert b.pooled == 60 * KiB  # refused: the warm pages stay
    b.admit(25 * KiB, what="this save", reason="budget")
    assert sorted(s.size for s in b.pool.segments) == [10 * KiB, 20 * KiB]
    assert b.used + b.reserved + b.pooled + 25 * KiB <= b.limit


def test_fits_never_counts_the_pool_as_room(tmp_path: Path) -> None:
    b = _budget(tmp_path, segments=(50 * KiB,))
    assert b.fits(50 * KiB) and not b.fits(50 * KiB + 1)
    assert b.pooled == 50 * KiB


def test_admit_checks_the_filesystem_for_unwritten_reservations(tmp_path: Path) -> None:
    b = _budget(tmp_path, limit=1 << 62)
    free = b.pool.tier.free_bytes()
    before = _rejected("filesystem")
    with pytest.raises(MemoryBudgetExceeded, match=r"promised to reservations not written yet"):
        b.admit(KiB, what="this save", reason="budget", unwritten=lambda: free)
    assert _rejected("filesystem") == before + 1
    b.admit(KiB, what="this save", reason="budget", unwritten=lambda: 0)
