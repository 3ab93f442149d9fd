"""The client package never imports the daemon package (the dependency goes one way)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CLIENT = ROOT / "client" / "tierckpt"
FORBIDDEN = "tierckptd"


def _forbidden_imports(source: str, filename: str = "<src>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    modules = [arg.value]
        found += [f"{filename}:{node.lineno}: {m}" for m in modules if m.split(".")[0] == FORBIDDEN]
    return found


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("import tierckptd", True),
        ("import os, tierckptd.catalog as c", True),
        ("from tierckptd import config", True),
        ("from tierckptd.memory.tier import MemoryTier", True),
        ("def f():\n    import tierckptd.rpc.servers\n", True),
        ("import importlib\nimportlib.import_module('tierckptd.main')", True),
        ("__import__('tierckptd')", True),
        ("import tierckpt", False),
        ("from tierckpt.errors import InvalidName", False),
        ("import tierckptd_helpers", False),
        ("from . import names", False),
        ("x = 'tierckptd'", False),
    ],
)
def test_detector(source: str, bad: bool) -> None:
    assert bool(_forbidden_imports(source)) is bad


def test_client_package_never_imports_the_daemon() -> None:
    files = sorted(CLIENT.rglob("*.py"))
    assert len(files) >= 10  # the walk found the package
    offenders = []
    for path in files:
        offenders += _forbidden_imports(path.read_text(), str(path.relative_to(ROOT)))
    assert not offenders, "client/tierckpt imports the daemon package:\n" + "\n".join(offenders)
