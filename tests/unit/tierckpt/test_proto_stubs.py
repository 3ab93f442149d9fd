"""The checked-in gRPC stubs are fresh and need no grpcio newer than we declare."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
STUBS = ROOT / "client" / "tierckpt" / "v1"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "proto/gen_stubs.py", "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_layout() -> None:
    assert (ROOT / "pyproject.toml").is_file()
    assert (ROOT / "proto" / "gen_stubs.py").is_file()
    assert sorted(STUBS.glob("*_pb2_grpc.py"))


def test_checked_in_stubs_are_fresh() -> None:
    result = _run_check(ROOT)
    assert result.returncode == 0, (
        f"proto/gen_stubs.py --check failed (fix: run `python proto/gen_stubs.py` and commit "
        f"client/tierckpt/v1):\n{result.stdout}\n{result.stderr}"
    )


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    (tmp_path / "client" / "tierckpt").mkdir(parents=True)
    shutil.copytree(ROOT / "proto", tmp_path / "proto", ignore=shutil.ignore_patterns("__py*"))
    shutil.copytree(
        STUBS, tmp_path / "client" / "tierckpt" / "v1", ignore=shutil.ignore_patterns("__py*")
    )
    return tmp_path


def test_check_detects_an_edited_stub(repo_copy: Path) -> None:
    assert _run_check(repo_copy).returncode == 0
    stub = repo_copy / "client" / "tierckpt" / "v1" / "daemon_pb2.py"
    stub.write_text(stub.read_text() + "\n# hand edit\n")
    result = _run_check(repo_copy)
    assert result.returncode == 1
    assert "daemon_pb2.py" in result.stderr
    assert "run `python proto/gen_stubs.py`" in result.stderr


def test_check_detects_an_extra_or_missing_stub(repo_copy: Path) -> None:
    v1 = repo_copy / "client" / "tierckpt" / "v1"
    (v1 / "stale_pb2.py").write_text("")
    result = _run_check(repo_copy)
    assert result.returncode == 1
    assert "stale_pb2.py" in result.stderr
    (v1 / "stale_pb2.py").unlink()
    (v1 / "common_pb2_grpc.pyi").unlink()
    result = _run_check(repo_copy)
    assert result.returncode == 1
    assert "common_pb2_grpc.pyi" in result.stderr


def _grpcio_floor() -> tuple[int, ...]:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    floors = []
    for dep in deps:
        match = re.fullmatch(r"\s*grpcio\s*>=\s*([0-9.]+)\s*(?:,.*)?", dep)
        if match:
            floors.append(_version(match.group(1)))
    assert len(floors) == 1, f"expected one 'grpcio>=X.Y.Z' in dependencies, got {deps}"
    return floors[0]


def _generated_versions() -> dict[str, str]:
    versions = {}
    for path in sorted(STUBS.glob("*_pb2_grpc.py")):
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and any(
                    isinstance(t, ast.Name) and t.id == "GRPC_GENERATED_VERSION"
                    for t in node.targets
                )
                and isinstance(node.value, ast.Constant)
            ):
                versions[path.name] = node.value.value
        assert path.name in versions, f"{path.name} declares no GRPC_GENERATED_VERSION"
    return versions


def test_generated_version_is_within_the_declared_grpcio_floor() -> None:
    floor = _grpcio_floor()
    versions = _generated_versions()
    assert versions
    for name, version in versions.items():
        assert _version(version) <= floor, (
            f"{name} needs grpcio>={version} at import, but pyproject.toml only requires "
            f"grpcio>={'.'.join(map(str, floor))}: raise the floor or regenerate with an "
            "older grpcio-tools"
        )


def test_dev_grpcio_tools_pin_matches_the_floor() -> None:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        dev = tomllib.load(fh)["project"]["optional-dependencies"]["dev"]
    pins = [d for d in dev if re.match(r"grpcio-tools\s*==", d)]
    assert len(pins) == 1
    assert _version(pins[0].split("==")[1].strip()) <= _grpcio_floor()
