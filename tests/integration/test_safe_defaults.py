"""Safe by default (DESIGN invariant 11, audit C3/M4/L4) with the real `tierckptd`:

- a network peer listener without token or TLS refuses to start, naming both fixes;
  with `[security] allow_insecure_peers = true` it starts and says so in a WARNING;
- a config without `[listen] peer` listens on loopback only;
- neither SIGHUP diffs nor botocore's DEBUG output put S3 credentials in the log, and a
  group-readable config file with credentials is warned about.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import moto_s3
from tests.support.backends import Tiered
from tests.support.cli import ls_json
from tests.support.daemon_process import DaemonProcess, toml_document
from tests.support.state_dicts import plain_tensor_state

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "safe"
DEFAULT_PEER_PORT = 7070


def _listening_tcp(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket the process listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(bytes.fromhex(hex_ip[i : i + 8])[::-1] for i in range(0, len(hex_ip), 8))
            ip = ipaddress.ip_address(raw)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped  # grpc binds dual-stack sockets: ::ffff:127.0.0.1
            found.append((ip, int(hex_port, 16)))
    return found


def _exits(daemon: DaemonProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierckptd", "--config", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("peer", ["0.0.0.0:0", "[::]:0"])
def test_network_peer_without_token_or_tls_refuses_to_start(peer: str) -> None:
    daemon = DaemonProcess({"listen": {"peer": peer}}, start=False)
    try:
        proc = _exits(daemon)
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        assert "[security] token_file" in proc.stderr, proc.stderr
        assert "tls_cert" in proc.stderr and "allow_insecure_peers = true" in proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert not daemon.memory_dir.exists() and not daemon.socket_path.exists()
    finally:
        daemon.cleanup()


def test_allow_insecure_peers_starts_and_warns() -> None:
    daemon = DaemonProcess(
        {"listen": {"peer": "0.0.0.0:0"}, "security": {"allow_insecure_peers": True}}
    )
    try:
        warnings = [
            line
            for line in daemon.log_path.read_text().splitlines()
            if " WARNING " in line and "allow_insecure_peers = true" in line
        ]
        assert warnings, daemon.log_tail()
        assert "token_file" in warnings[0]
        listening = _listening_tcp(daemon.pid)
        assert any(ip.is_unspecified for ip, _ in listening), listening  # it did what it said
    finally:
        daemon.cleanup()


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def test_config_without_peer_key_listens_on_loopback_only() -> None:
    if not _port_is_free(DEFAULT_PEER_PORT):
        pytest.skip(f"port {DEFAULT_PEER_PORT} (the default [listen] peer) is in use here")
    daemon = DaemonProcess(start=False)
    try:
        del daemon.config["listen"]["peer"]  # the default applies
        daemon.config_path.write_text(toml_document(daemon.config))
        daemon.start()
        listening = _listening_tcp(daemon.pid)
        assert (ipaddress.ip_address("127.0.0.1"), DEFAULT_PEER_PORT) in listening, listening
        assert all(ip.is_loopback for ip, _ in listening), listening
        # The control socket: the daemon's group may connect, nobody else (L4).
        assert stat.S_IMODE(daemon.socket_path.stat().st_mode) == 0o660
        assert " WARNING " not in daemon.log_path.read_text(), daemon.log_tail()
    finally:
        daemon.cleanup()


OLD = {"key": "AKIATIERCKPTOLD00001", "secret": "old-secret-0001", "token": "OLD-STS-0001"}
NEW = {"key": "AKIATIERCKPTNEW00002", "secret": "NEW-secret-0002", "token": "NEW-STS-0002"}


def _wait_durable(daemon: DaemonProcess, checkpoint_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = {r["id"]: r for r in ls_json(daemon.address, NS)}
        if "persistent" in rows.get(checkpoint_id, {}).get("tiers", []):
            return
        time.sleep(0.3)
    raise AssertionError(f"{checkpoint_id} not durable within {timeout} s\n{daemon.log_tail()}")


def _wait_log(daemon: DaemonProcess, needle: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = daemon.log_path.read_text(errors="replace")
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not logged within {timeout} s\n{daemon.log_tail()}")


def test_debug_drain_and_sighup_never_log_s3_credentials(s3: moto_s3.S3Bucket) -> None:
    def persistent(secrets: dict[str, str]) -> dict[str, Any]:
        options = {**s3.storage_options, **secrets}
        return {"url": s3.url(), "storage_options": options}

    daemon = DaemonProcess(
        {"log": {"level": "DEBUG"}, "persistent": persistent(OLD)}, name="sec", start=False
    )
    try:
        daemon.config_path.chmod(0o644)  # the old install note's mode
        daemon.start()
        Tiered(NS, daemon.address).save(plain_tensor_state(1, 64 << 10), "step-000001")
        _wait_durable(daemon, "step-000001")  # botocore signed real requests with OLD
        daemon.config["persistent"] = persistent(NEW)
        daemon.config_path.write_text(toml_document(daemon.config))
        os.kill(daemon.pid, signal.SIGHUP)
        log = _wait_log(daemon, "SIGHUP: persistent.storage_options.token")
    finally:
        daemon.cleanup()
    assert " DEBUG " in log, "the daemon did not log at DEBUG: the test proves nothing"
    assert "persistent.storage_options.secret: <redacted> -> <redacted>" in log, log[-3000:]
    assert "chmod 600" in log and "readable by every user" in log, log[-3000:]
    lowered = log.lower()
    assert "x-amz-security-token" not in lowered and "credential=akia" not in lowered
    for secret in (*OLD.values(), *NEW.values()):
        assert secret not in log, f"{secret} leaked into the log"
