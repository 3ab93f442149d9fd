"""The shipped deploy files: systemd units that `systemd-analyze verify` accepts, and a
DaemonSet that is secure as shipped (audit M10, C3): non-root, token and TLS from a
Secret, metrics off 0.0.0.0, probes that do not need the TLS peer port."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from tierckptd.config import exposure_warnings, load_config, parse_config

DEPLOY = Path(__file__).parents[3] / "deploy"
SERVICE = DEPLOY / "systemd" / "tierckptd.service"
MOUNT = DEPLOY / "systemd" / "dev-shm-tierckpt.mount"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yaml"
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


def _daemonset() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert "Secret" not in kinds, "never ship a Secret's content: create it (see the comments)"
    return kinds["ConfigMap"], kinds["DaemonSet"]


def _embedded_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    config_map, _ = _daemonset()
    monkeypatch.setenv("POD_IP", "10.20.30.40")  # the downward API's status.podIP
    return parse_config(tomllib.loads(config_map["data"]["tierckptd.toml"]))


def test_daemonset_config_is_valid_and_passes_the_insecure_peer_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _embedded_config(monkeypatch)
    assert config.listen.peer == "0.0.0.0:7070"  # legitimate: token and TLS below
    assert config.security.token_file and config.security.tls_cert and config.security.tls_key
    assert config.security.tls_ca and not config.security.allow_insecure_peers
    assert exposure_warnings(config) == []
    assert config.metrics.listen == "10.20.30.40:9464"  # the pod IP, not 0.0.0.0
    assert config.persistent.storage_options == {}  # no credentials in a ConfigMap


def test_daemonset_mounts_the_token_secret_where_the_config_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _embedded_config(monkeypatch)
    _, daemonset = _daemonset()
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert secrets, "no Secret volume"
    for name, secret in secrets.items():
        assert secret["defaultMode"] == 0o400, (name, secret)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    secret_dirs = [mounts[name]["mountPath"] for name in secrets]
    for name in secrets:
        assert mounts[name].get("readOnly") is True
    for key in ("token_file", "tls_cert", "tls_key", "tls_ca"):
        path = getattr(config.security, key)
        assert os.path.dirname(path) in secret_dirs, (key, path, secret_dirs)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_daemonset_runs_non_root_without_privileges() -> None:
    _, daemonset = _daemonset()
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ctx = container["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0 and ctx["runAsGroup"] != 0
    assert ctx.get("privileged", False) is False
    assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
    assert pod["securityContext"]["fsGroup"] == ctx["runAsGroup"]  # reads the 0400 Secret
    # The root init container may only chown/chmod the hostPath dirs to the daemon's ids.
    (init,) = pod["initContainers"]
    init_ctx = init["securityContext"]
    assert init_ctx.get("privileged", False) is False
    assert init_ctx["allowPrivilegeEscalation"] is False
    assert init_ctx["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    script = " ".join(init["command"])
    assert f"{ctx['runAsUser']}:{ctx['runAsGroup']}" in script and "chmod 2750" in script


def test_daemonset_probes_do_not_use_the_tls_peer_port() -> None:
    _, daemonset = _daemonset()
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container[probe]
        assert "grpc" not in spec and "tcpSocket" not in spec, (probe, spec)
        assert spec["exec"]["command"][-1] == "--probe", (probe, spec)
        assert spec["timeoutSeconds"] >= 2, (probe, spec)


def test_example_toml_parses_and_is_safe() -> None:
    config = load_config(DEPLOY / "tierckptd.example.toml")
    assert config.listen.peer.startswith("127.0.0.1:")
    assert exposure_warnings(config) == []
