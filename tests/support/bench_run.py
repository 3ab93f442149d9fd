"""Run a bench script's quick mode as CI does: a separate interpreter, from the repository
root, output captured, bounded in time (the smokes in tests/integration)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_bench", "tail"]

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python bench/<script> <args...>`; the caller asserts on the exit, stdout and files."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tail(proc: subprocess.CompletedProcess[str], chars: int = 4000) -> str:
    """The end of both streams, for an assertion message."""
    return f"(exit {proc.returncode})\n{proc.stdout[-chars:]}{proc.stderr[-chars:]}"
