"""What the node can actually hold, next to what `[memory] budget` promises.

The budget is a promise to training jobs ("your save fits or is refused up front"), so a
budget larger than the tmpfs under `memory.dir` turns into ENOSPC mid-save, and one larger
than half the node's RAM lets checkpoints push training processes into the OOM killer
(seen in our own bench: the 64 GiB default on a 23 GiB machine). The daemon says so at
start, naming the fix, instead of finding out under load.
"""

from __future__ import annotations

import os
from pathlib import Path

from tierckpt.units import format_size

__all__ = ["budget_warnings", "physical_memory_bytes"]

# Above this share of RAM the memory tier competes with training for memory.
RAM_SHARE = 0.5


def physical_memory_bytes() -> int | None:
    """Total RAM of this node (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def budget_warnings(budget: int, root: Path, ram: int | None = None) -> list[str]:
    """Warnings for a budget the filesystem under `root` or the node's RAM cannot back."""
    warnings = []
    st = os.statvfs(root)
    fs_size = st.f_blocks * st.f_frsize
    if fs_size and budget > fs_size:
        warnings.append(
            f"[memory] budget {format_size(budget)} is larger than the filesystem under "
            f"[memory] dir ({format_size(fs_size)}): saves will fail for lack of space "
            f"before the budget refuses them; set budget to at most {format_size(fs_size)} "
            "or give the memory tier a larger tmpfs"
        )
    ram = physical_memory_bytes() if ram is None else ram
    if ram and budget > RAM_SHARE * ram:
        warnings.append(
            f"[memory] budget {format_size(budget)} is more than half of this node's RAM "
            f"({format_size(ram)}): held checkpoints can push training processes into the "
            "OOM killer; set budget to what the node can spare, e.g. "
            f'budget = "{max(1, (ram // 4) >> 30)}GiB"'
        )
    return warnings
