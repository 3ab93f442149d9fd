from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from tierckptd.memory_tier import MemoryTier, MemoryTierLocked, Segment


def test_layout_modes_and_exclusive_lock(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    for d in (tier.root, tier.data_root, tier.manifest_root, tier.pool_dir):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o2770
    other = MemoryTier(tmp_path / "mem")
    with pytest.raises(
        MemoryTierLocked, match=rf"in use by another tierckptd \(pid {os.getpid()}\)"
    ):
        other.open_layout()
    tier.close()
    other.open_layout()
    other.close()


def test_create_file_is_exclusive_and_group_writable(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path)
    path = tier.file_path("run", "s", "f")
    tier.create_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    with pytest.raises(FileExistsError):
        tier.create_file(path)


def test_pick_segment_rules(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path)
    tier.segments = [
        Segment(tmp_path / "s0", 120, "__0_0.distcp"),
        Segment(tmp_path / "s1", 90, None),
        Segment(tmp_path / "s2", 60, None),
        Segment(tmp_path / "s3", 500, ".metadata"),
    ]
    same = tier.pick_segment("__0_0.distcp", 100)
    assert same is not None and same.size == 120  # same name, within 1.25x
    best = tier.pick_segment("__1_0.distcp", 100)
    assert best is not None and best.size == 90  # largest that fits
    assert tier.pick_segment("__0_0.distcp", 50) is None
    assert tier.pick_segment(".metadata", 100) is not None
    assert tier.pick_segment(".metadata", 100).size == 90  # type: ignore[union-attr]
