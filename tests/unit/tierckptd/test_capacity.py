"""The daemon warns at start about a budget its tmpfs or RAM cannot back."""

from __future__ import annotations

import os
from pathlib import Path

from tierckptd.memory.capacity import budget_warnings, physical_memory_bytes

GiB = 1 << 30


def _fs_size(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def test_a_budget_the_node_can_back_gives_no_warning(tmp_path: Path) -> None:
    assert budget_warnings(GiB, tmp_path, ram=64 * GiB) == []


def test_a_budget_larger_than_the_filesystem_names_its_size_and_the_fix(tmp_path: Path) -> None:
    too_big = _fs_size(tmp_path) + GiB
    (warning,) = budget_warnings(too_big, tmp_path, ram=too_big * 4)
    assert "larger than the filesystem under [memory] dir" in warning
    assert "set budget to at most" in warning


def test_a_budget_over_half_the_ram_warns_of_the_oom_killer(tmp_path: Path) -> None:
    warnings = budget_warnings(3 * GiB, tmp_path, ram=4 * GiB)
    assert len(warnings) == 1
    assert "OOM killer" in warnings[0]
    assert 'budget = "1GiB"' in warnings[0]


def test_this_node_reports_its_ram() -> None:
    ram = physical_memory_bytes()
    assert ram is not None and ram > 0
