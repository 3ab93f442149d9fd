"""The light client: a training process installs and imports only what the client needs.

pyproject's base `dependencies` are the client's; the daemon's libraries (S3 through s3fs,
zstandard, prometheus-client, grpc health) are the `daemon` extra. Checked three ways:
- the lists themselves, against every third-party import of each package (AST walk, so a
  lazy import inside a function counts);
- a real interpreter where the daemon's libraries are absent (blocked in `sys.modules`)
  imports every client module and resolves `tierckpt://` through fsspec's entry point, as
  every fsspec process does;
- `tierckptd` without its extra exits with the install line to run, not a traceback.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client" / "tierckpt"
DAEMON = ROOT / "server" / "tierckptd"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The daemon's libraries, by top-level module, and the distribution that provides each.
DAEMON_ONLY = {
    "s3fs": "s3fs",
    "zstandard": "zstandard",
    "prometheus_client": "prometheus-client",
    "grpc_health": "grpcio-health-checking",
}
# Third-party modules the packages import, and the distribution of each (a new import
# must be added here and to pyproject: the test below refuses an unlisted one).
DISTRIBUTIONS = {
    "torch": "torch",
    "grpc": "grpcio",
    "google": "protobuf",
    "fsspec": "fsspec",
    "xxhash": "xxhash",
    **DAEMON_ONLY,
}
# The frameworks a client module may plug into: its users have the framework already, so
# the module may import it (the daemon's libraries never).
FRAMEWORKS = {
    "amzn_sagemaker_checkpointing",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "torchtitan",
    "torch_checkpointing",
}


def _names(requirements: list[str]) -> set[str]:
    """Distribution names of PEP 508 requirement strings, normalized."""
    found = set()
    for req in requirements:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        assert m, req
        found.add(re.sub(r"[-_.]+", "-", m.group(1)).lower())
    return found


def _third_party_imports(package: Path) -> dict[str, list[str]]:
    """Top-level module -> the files importing it, for every module outside the stdlib
    and the project's own packages (lazy imports and importlib calls included)."""
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if "v1" in path.relative_to(package).parts[:1]:
            continue  # generated gRPC stubs: grpc and protobuf, both base dependencies
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                arg = node.args[0]
                if name in ("import_module", "__import__", "find_spec") and (
                    isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                ):
                    names = [arg.value]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("tierckpt", "tierckptd", "__future__"):
                    continue
                found.setdefault(top, []).append(str(path.relative_to(package.parent)))
    return found


# --- pyproject ---------------------------------------------------------------------------
def test_base_dependencies_exclude_the_daemons_libraries() -> None:
    base = _names(PYPROJECT["project"]["dependencies"])
    daemon = _names(PYPROJECT["project"]["optional-dependencies"]["daemon"])
    assert not base & set(DAEMON_ONLY.values()), base
    assert daemon == set(DAEMON_ONLY.values())


def test_the_console_script_checks_the_same_extra() -> None:
    from tierckptd.__main__ import DAEMON_EXTRA, INSTALL_HINT

    assert DAEMON_EXTRA == DAEMON_ONLY
    assert INSTALL_HINT == "pip install 'tierckpt[daemon]'"
    assert PYPROJECT["project"]["scripts"]["tierckptd"] == "tierckptd.__main__:main"


def test_dev_installs_the_daemon_and_the_frameworks() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "tierckpt[daemon,frameworks]" in extras["dev"]
    assert "torchtitan==0.3.0" in extras["frameworks"]


def test_client_imports_only_base_dependencies() -> None:
    base = _names(PYPROJECT["project"]["dependencies"])
    imports = _third_party_imports(CLIENT)
    unknown = sorted(set(imports) - set(DISTRIBUTIONS) - FRAMEWORKS)
    assert not unknown, {m: imports[m] for m in unknown}
    outside = {
        m: files for m, files in imports.items() if DISTRIBUTIONS.get(m, "") in DAEMON_ONLY.values()
    }
    assert not outside, f"the client imports the daemon's libraries: {outside}"
    assert {DISTRIBUTIONS[m] for m in imports if m in DISTRIBUTIONS} <= base


def test_daemon_imports_only_base_and_daemon_dependencies() -> None:
    declared = _names(PYPROJECT["project"]["dependencies"]) | _names(
        PYPROJECT["project"]["optional-dependencies"]["daemon"]
    )
    imports = _third_party_imports(DAEMON)
    unknown = sorted(set(imports) - set(DISTRIBUTIONS))
    assert not unknown, {m: imports[m] for m in unknown}
    assert {DISTRIBUTIONS[m] for m in imports} <= declared


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import s3fs", {"s3fs"}),
        ("def f():\n    from zstandard import ZstdCompressor", {"zstandard"}),
        (
            "import importlib\nimportlib.import_module('prometheus_client.core')",
            {"prometheus_client"},
        ),
        ("import os, json\nfrom . import x\nfrom tierckpt import errors", set()),
    ],
)
def test_the_import_walk_can_fail(tmp_path: Path, source: str, found: set[str]) -> None:
    (tmp_path / "m.py").write_text(source)
    assert set(_third_party_imports(tmp_path)) == found


# --- a real interpreter without the daemon's libraries ------------------------------------
# Run first in the child: the daemon's libraries are absent the way pip leaves a venv with
# only `pip install tierckpt` (`import` raises ModuleNotFoundError, `find_spec` is None:
# torch's DCP probes for zstandard that way and must see nothing).
_ABSENT = """
import sys
REFUSED = {refused!r}
for name in REFUSED:
    sys.modules[name] = None
"""

_IMPORT_THE_CLIENT = """
import importlib, pkgutil, fsspec, tierckpt
failed = []
for m in pkgutil.walk_packages(tierckpt.__path__, "tierckpt."):
    if m.name.rsplit(".", 1)[-1] == "__main__":
        continue  # runs the CLI
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed.append(f"{m.name}: {e!r}")
# What every fsspec process does for a tierckpt:// id: the entry point, no tierckpt import.
cls = fsspec.get_filesystem_class("tierckpt")
fs, path = fsspec.core.url_to_fs("tierckpt://run7/step-1", daemon="unix:/nonexistent.sock")
print("modules", len([n for n in sys.modules if n.startswith("tierckpt.")]))
print("class", cls.__module__, cls.__name__, type(fs).__name__)
print("failed", failed)
print("loaded", sorted(n for n in sys.modules if n.split(".")[0] in REFUSED and sys.modules[n]))
"""


def _child(code: str, refused: set[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "client"), str(ROOT / "server"), env.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, "-c", _ABSENT.format(refused=sorted(refused)) + code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_every_client_module_imports_without_the_daemons_libraries() -> None:
    proc = _child(_IMPORT_THE_CLIENT, set(DAEMON_ONLY))
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert int(lines["modules"]) >= 20  # the walk found the package
    assert lines["class"] == "tierckpt.fsspec_fs TierckptFileSystem TierckptFileSystem"
    assert lines["failed"] == "[]", lines["failed"]
    assert lines["loaded"] == "[]"


def test_the_absent_libraries_are_absent() -> None:
    """The check above can fail: a client module importing one of them would not load."""
    code = (
        "import importlib.util\nprint(importlib.util.find_spec('zstandard'))\n"
        "try:\n    import zstandard\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
    )
    proc = _child(code, {"zstandard"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "zstandard"]


@pytest.mark.parametrize("entry", ["-m tierckptd", "console script"])
def test_the_daemon_without_its_extra_names_the_install_line(entry: str) -> None:
    """Missing libraries as pip leaves them (sys.modules None: import and find_spec both
    see nothing), through `python -m tierckptd` and the console script's function."""
    run = (
        "import runpy; sys.argv = ['tierckptd', '--help']; runpy.run_module('tierckptd', run_name='__main__')"
        if entry == "-m tierckptd"
        else "from tierckptd.__main__ import main; sys.exit(main(['--help']))"
    )
    proc = _child(run, {"prometheus_client", "s3fs"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "tierckptd: the daemon's libraries are not installed (prometheus-client, s3fs): run "
        "`pip install 'tierckpt[daemon]'` (a training process needs only `pip install tierckpt`)"
    )
    assert "usage" not in proc.stdout  # refused before the daemon's modules load
