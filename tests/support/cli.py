"""Run the `tierckpt` CLI as a subprocess, the way an operator or a script would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["cli", "cli_json", "ls_json", "tierckpt_command"]

CLI_TIMEOUT = 60.0


def tierckpt_command() -> list[str]:
    """The installed console script beside this interpreter, else `python -m tierckpt`."""
    script = Path(sys.executable).with_name("tierckpt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tierckpt"]


def cli(
    address: str, *args: str, check: bool = True, timeout: float = CLI_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """`tierckpt --daemon ADDRESS ARGS...`; with `check`, a non-zero exit fails with its output."""
    command = [*tierckpt_command(), "--daemon", address, *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def cli_json(address: str, *args: str) -> Any:
    proc = cli(address, *args, "--json")
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"tierckpt {' '.join(args)} --json printed no JSON:\n{proc.stdout}"
        ) from exc


def ls_json(address: str, namespace: str, *, include_all: bool = False) -> list[dict[str, Any]]:
    args = ["ls", namespace] + (["--all"] if include_all else [])
    rows = cli_json(address, *args)
    assert isinstance(rows, list), f"ls --json gave {type(rows).__name__}, not a list: {rows!r}"
    return rows


def ls_ids(address: str, namespace: str, *, include_all: bool = False) -> list[str]:
    return [row["id"] for row in ls_json(address, namespace, include_all=include_all)]
