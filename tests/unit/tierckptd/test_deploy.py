"""The shipped deploy files: systemd units that `systemd-analyze verify` accepts, and an
example config that is safe as shipped. The Kubernetes manifests (rendered with
kubectl kustomize, secure as shipped: audit M10, C3) are tested in tests/deploy/."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tierckptd.config import exposure_warnings, load_config

DEPLOY = Path(__file__).parents[3] / "deploy"
SERVICE = DEPLOY / "systemd" / "tierckptd.service"
MOUNT = DEPLOY / "systemd" / "dev-shm-tierckpt.mount"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _unit(text: str, section: str) -> dict[str, list[str]]:
    """Key -> values of one section of a unit file (a key may repeat)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def _verify(tmp_path: Path, service_text: str) -> None:
    """`systemd-analyze verify` on a copy whose ExecStart is an executable that exists
    (verify refuses a missing binary); any warning about our units fails the test."""
    assert SYSTEMD_ANALYZE is not None
    binary = tmp_path / "tierckptd"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    service_text = service_text.replace("/usr/local/bin/tierckptd", str(binary))
    assert str(binary) in service_text
    (tmp_path / SERVICE.name).write_text(service_text)
    shutil.copy(MOUNT, tmp_path / MOUNT.name)  # the name must match Where= (verify checks)
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", SERVICE.name, MOUNT.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = proc.stdout + proc.stderr
    ours = [
        line
        for line in output.splitlines()
        if str(tmp_path) in line or SERVICE.name in line or MOUNT.name in line
    ]
    assert proc.returncode == 0 and not ours, output


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path: Path) -> None:
    _verify(tmp_path, SERVICE.read_text())


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_unit_with_the_load_credential_example_enabled_verifies(tmp_path: Path) -> None:
    text = re.sub(r"^#(LoadCredential=|Environment=)", r"\1", SERVICE.read_text(), flags=re.M)
    assert len(_unit(text, "Service")["LoadCredential"]) >= 4
    _verify(tmp_path, text)


def test_service_unit_settings() -> None:
    service = _unit(SERVICE.read_text(), "Service")
    # "-": a memory dir that does not exist yet is skipped, not a 226/NAMESPACE failure.
    assert service["ReadWritePaths"] == ["-/dev/shm/tierckpt"]
    assert service["User"] == ["tierckpt"] and service["NoNewPrivileges"] == ["true"]
    text = SERVICE.read_text()
    assert "install -m 0644" not in text  # the config may hold credentials
    assert "chmod 0600" in text and "/run/credentials/tierckptd.service/token" in text


def test_mount_unit_belongs_to_the_daemon_user_and_is_not_group_writable() -> None:
    mount = _unit(MOUNT.read_text(), "Mount")
    options = dict(o.split("=", 1) if "=" in o else (o, "") for o in mount["Options"][0].split(","))
    assert options["uid"].isdigit() and options["gid"].isdigit(), options  # tmpfs: numbers
    assert options["mode"] == "2750", options
    assert {"nosuid", "nodev"} <= set(options)
    assert "id -u tierckpt" in MOUNT.read_text()  # tells the operator what to substitute


def test_example_toml_parses_and_is_safe() -> None:
    config = load_config(DEPLOY / "tierckptd.example.toml")
    assert config.listen.peer.startswith("127.0.0.1:")
    assert exposure_warnings(config) == []
