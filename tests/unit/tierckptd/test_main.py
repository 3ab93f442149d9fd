"""The installed entry point end to end: start, health SERVING, probe, SIGTERM -> exit 0;
logging that keeps secrets out, and a control socket that is never world-connectable."""

from __future__ import annotations

import logging
import os
import platform
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckptd.main import main
from tierckptd.ops.logs import _QuietBelowInfo, set_log_level
from tierckptd.ops.malloc_tuning import tune_malloc
from tierckptd.persistent.errors import QUIET_LOGGERS
from tierckptd.rpc import servers


def test_bad_config_exits_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.toml"
    path.write_text("[memory]\nbudgett = 1\n")
    assert main(["--config", str(path)]) == 2
    assert "valid keys of [memory]" in capsys.readouterr().err


def test_network_peer_without_token_exits_2_naming_both_fixes(  # type: ignore[no-untyped-def]
    tmp_path: Path, capsys
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[listen]\npeer = "0.0.0.0:7070"\n')
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "[security] token_file" in err and "allow_insecure_peers = true" in err, err


@pytest.mark.parametrize(
    ("security", "message"),
    [
        (
            'token_file = "{d}/missing-token"',
            "[security] token_file {d}/missing-token: cannot read",
        ),
        ('token_file = "{d}/empty"', "[security] token_file {d}/empty is empty"),
        (
            'tls_cert = "{d}/not.pem"\ntls_key = "{d}/not.pem"',
            "[security] tls_cert {d}/not.pem is not a PEM file",
        ),
    ],
    ids=["missing-token", "empty-token", "cert-not-pem"],
)
def test_bad_security_file_exits_2_before_touching_the_memory_tier(
    tmp_path: Path, security: str, message: str
) -> None:
    for name, text in (("empty", ""), ("not.pem", "not a certificate\n")):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o600)  # else a warning about the mode comes first
    config = tmp_path / "c.toml"
    config.write_text(
        f'[node]\nid = "n1"\n[listen]\nlocal = "unix://{tmp_path}/d.sock"\n'
        f'peer = "127.0.0.1:0"\n[memory]\ndir = "{tmp_path}/mem"\nbudget = "64MiB"\n'
        f"[security]\n{security.format(d=tmp_path)}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tierckptd", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    # one clear line, like a bad TOML key, and no traceback
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"tierckptd: {message.format(d=tmp_path)}"), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "mem").exists()  # failed before adopting (or creating) it
    assert not (tmp_path / "d.sock").exists()


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
        assert main(["--config", str(config), "--probe"]) == 0  # the DaemonSet's exec probe
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
    assert main(["--config", str(config), "--probe"]) == 1  # nobody serving: probe fails


def test_tune_malloc_applies_on_glibc_and_defers_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert tune_malloc() is (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert tune_malloc() is False


@pytest.fixture
def restore_logging() -> Any:
    root = logging.getLogger()
    saved = {name: logging.getLogger(name).level for name in ("", *QUIET_LOGGERS)}
    yield
    for name, level in saved.items():
        (root if name == "" else logging.getLogger(name)).setLevel(level)


@pytest.mark.usefixtures("restore_logging")
def test_debug_level_keeps_s3_client_loggers_at_info() -> None:
    # botocore's DEBUG output carries X-Amz-Security-Token and the access key id (audit M4).
    set_log_level("DEBUG", QUIET_LOGGERS)
    assert logging.getLogger().getEffectiveLevel() == logging.DEBUG
    for name in (*QUIET_LOGGERS, "botocore.endpoint", "botocore.auth", "s3fs.core"):
        assert logging.getLogger(name).getEffectiveLevel() == logging.INFO, name
        assert not logging.getLogger(name).isEnabledFor(logging.DEBUG), name
    set_log_level("WARNING", QUIET_LOGGERS)
    assert logging.getLogger("botocore").getEffectiveLevel() == logging.WARNING


def test_handler_filter_drops_debug_of_s3_clients_even_if_they_lower_their_level() -> None:
    quiet = _QuietBelowInfo(QUIET_LOGGERS)

    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "headers %s", ("x",), None)

    assert not quiet.filter(record("botocore.endpoint", logging.DEBUG))
    assert not quiet.filter(record("urllib3.connectionpool", logging.DEBUG))
    assert quiet.filter(record("botocore.endpoint", logging.WARNING))
    assert quiet.filter(record("tierckptd.persistent.drain", logging.DEBUG))
    assert quiet.filter(record("botocorex", logging.DEBUG))  # only those packages


class _ModeAtBind:
    """A real grpc server that records the socket's mode the moment it is bound."""

    def __init__(self, path: Path) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        self.path = path
        self.mode_at_bind = -1

    def add_insecure_port(self, address: str) -> int:
        port = int(self.server.add_insecure_port(address))
        self.mode_at_bind = stat.S_IMODE(os.stat(self.path).st_mode)
        return port


def test_control_socket_is_never_world_connectable_even_under_umask_0(tmp_path: Path) -> None:
    # Audit L4: grpc creates the socket file at bind; under umask 0 it used to be 0777
    # until the chmod after start().
    path = tmp_path / "d.sock"
    recorder = _ModeAtBind(path)
    old = os.umask(0)
    try:
        servers._bind_unix(recorder, f"unix:{path}", path)
        assert os.umask(0) == 0  # the process umask is restored
    finally:
        os.umask(old)
    try:
        assert recorder.mode_at_bind & 0o077 == 0, oct(recorder.mode_at_bind)
        assert stat.S_IMODE(path.stat().st_mode) == servers.SOCKET_MODE
    finally:
        recorder.server.stop(None)
