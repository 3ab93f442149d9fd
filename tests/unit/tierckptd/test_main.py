"""The installed entry point end to end: start, health SERVING, SIGTERM -> exit 0."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckptd.main import main
from tierckptd.malloc_tuning import tune_malloc


def test_bad_config_exits_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.toml"
    path.write_text("[memory]\nbudgett = 1\n")
    assert main(["--config", str(path)]) == 2
    assert "valid keys of [memory]" in capsys.readouterr().err


def test_daemon_lifecycle(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        f'[node]\nid = "n1"\n[listen]\nlocal = "unix://{tmp_path}/d.sock"\npeer = "127.0.0.1:0"\n'
        f'[memory]\ndir = "{tmp_path}/mem"\nbudget = "1GiB"\nprewarm = "1MiB"\n'
    )
    notify = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(15)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierckptd", "--config", str(config)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = sock.recv(4096).decode()
        assert ready.startswith("READY=1")
        channel = grpc.insecure_channel(f"unix:{tmp_path}/d.sock")
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
        config.write_text(config.read_text().replace('"1GiB"', '"2GiB"'))
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert sock.recv(4096) == b"STOPPING=1"
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    assert proc.returncode == 0, err
    assert "[n1]" in err and "memory.budget: 1073741824 -> 2147483648" in err
    assert "received SIGTERM" in err
    assert not (tmp_path / "d.sock").exists()


def test_tune_malloc_applies_on_glibc_and_defers_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert tune_malloc() is (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert tune_malloc() is False
