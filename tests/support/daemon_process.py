"""Run a real `tierckptd` as a subprocess for a test.

`DaemonProcess` writes a TOML config into a short temp dir (AF_UNIX paths are limited to
107 bytes, and pytest's tmp_path is long), starts `python -m tierckptd --config PATH`,
logs to a file there, and waits until the standard `grpc.health.v1` service on the local
socket reports SERVING. It can be killed with SIGKILL and started again on the same
memory dir, which is how tests check re-adoption.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.names import flat_checkpoint_id

__all__ = ["DaemonProcess", "DaemonStartError", "kill_all_daemons", "toml_document"]

READY_TIMEOUT = 30.0
# The readiness probe's first connect is refused (no socket yet); gRPC's default reconnect
# backoff (1 s, then 1.6x) would then hold every later probe until the next attempt, so a
# daemon ready after 0.8 s was seen after 1 s or 2.6 s. Retry connecting every 50-100 ms.
_PROBE_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
]
_STARTED: list[DaemonProcess] = []


def kill_all_daemons() -> None:
    """SIGKILL every daemon this process started that is still running (session safety net)."""
    for daemon in _STARTED:
        daemon.kill9()


class DaemonStartError(AssertionError):
    pass


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (e.g. [persistent] storage_options)
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def toml_document(config: dict[str, Any]) -> str:
    """A TOML text for a config of tables of scalars; a list of tables (`peers`) becomes
    an array of tables (`[[peers]]`)."""
    lines: list[str] = []
    for table, keys in config.items():
        if isinstance(keys, list):
            for entry in keys:
                lines.append(f"[[{table}]]")
                lines.extend(f"{key} = {_toml_value(value)}" for key, value in entry.items())
                lines.append("")
            continue
        lines.append(f"[{table}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in keys.items())
        lines.append("")
    return "\n".join(lines)


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> None:
    for table, keys in overrides.items():
        if isinstance(keys, list):
            base[table] = list(keys)
        else:
            base.setdefault(table, {}).update(keys)


class DaemonProcess:
    """One tierckptd with its own short temp dir, socket and memory dir.

    Args:
        config_overrides: `{table: {key: value}}` merged over the test defaults
            (node id, local socket, no peer listener, memory dir, budget, keep all).
        name: node id and a prefix for the temp dir.
    """

    def __init__(
        self,
        config_overrides: dict[str, Any] | None = None,
        *,
        name: str = "n0",
        start: bool = True,
    ) -> None:
        self.name = name
        self.base_dir = Path(tempfile.mkdtemp(prefix="tc", dir=tempfile.gettempdir()))
        self.socket_path = self.base_dir / "d.sock"
        self.address = f"unix://{self.socket_path}"
        self.memory_dir = self.base_dir / "mem"
        self.config_path = self.base_dir / "tierckptd.toml"
        self.log_path = self.base_dir / "tierckptd.log"
        self.config: dict[str, Any] = {
            "node": {"id": name},
            "listen": {"local": self.address, "peer": ""},
            "memory": {"dir": str(self.memory_dir), "budget": "2GiB"},
            "retention": {"memory_keep_last": 0},
            # Drain retries of an outage or a lost owner at most 2 s apart, not 10: the
            # tests wait for the next attempt, and backoff itself is unit-tested.
            "persistent": {"retry_max": 2.0},
        }
        _merge(self.config, config_overrides or {})
        self.memory_dir = Path(self.config["memory"]["dir"])
        self.config_path.write_text(toml_document(self.config))
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self.starts = 0
        _STARTED.append(self)
        if start:
            self.start()

    # -- lifecycle -----------------------------------------------------------------
    def start(self, timeout: float = READY_TIMEOUT) -> DaemonProcess:
        """Start (or restart, on the same memory dir) and wait for health SERVING."""
        assert self.proc is None or self.proc.poll() is not None, "daemon already running"
        if self.socket_path.exists() and self.proc is not None:
            # A SIGKILLed daemon leaves its socket behind; the restart must cope, but a
            # stale file must not make the readiness probe below pass early.
            pass
        self.starts += 1
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self._log_file.write(f"\n===== start #{self.starts} =====\n".encode())
        self._log_file.flush()
        env = dict(os.environ)
        env.pop("TIERCKPT_DAEMON", None)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            self.command([sys.executable, "-m", "tierckptd", "--config", str(self.config_path)]),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            self.wait_serving(timeout)
        except BaseException:
            self.kill9()
            raise
        return self

    def command(self, argv: list[str]) -> list[str]:
        """The daemon's command line as started (a subclass may wrap it, e.g. in a netns)."""
        return argv

    def wait_serving(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        with grpc.insecure_channel(self.address, options=_PROBE_CHANNEL_OPTIONS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise DaemonStartError(
                        f"tierckptd exited with {self.proc.returncode} before SERVING\n{self.log_tail()}"
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last_error = f"health status {reply.status}"
                except grpc.RpcError as exc:
                    last_error = f"{exc.code()}: {exc.details()}"
                time.sleep(0.1)
        raise DaemonStartError(
            f"tierckptd not SERVING on {self.address} after {timeout}s ({last_error})\n{self.log_tail()}"
        )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        """SIGKILL the daemon (no cleanup of any kind) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self._reap(10.0)

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit code (a timeout fails the test, after a kill)."""
        assert self.proc is not None, "never started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise DaemonStartError(
                f"tierckptd did not exit within {timeout}s of SIGTERM\n{self.log_tail()}"
            ) from None
        self._reap(1.0)
        return code

    def _reap(self, timeout: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def cleanup(self) -> None:
        self.kill9()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- diagnostics ---------------------------------------------------------------
    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"----- tail of {self.log_path} -----\n{tail}\n-----"

    # -- memory layout -------------------------------------------------------------
    def data_dir(self, namespace: str, checkpoint_id: str | None = None) -> Path:
        path = self.memory_dir / "data" / namespace
        return path / flat_checkpoint_id(checkpoint_id) if checkpoint_id else path

    def manifest_path(self, namespace: str, checkpoint_id: str) -> Path:
        flat = flat_checkpoint_id(checkpoint_id)
        return self.memory_dir / "manifests" / namespace / f"{flat}.json"

    def __repr__(self) -> str:
        return f"DaemonProcess({self.name}, {self.address}, running={self.running})"
