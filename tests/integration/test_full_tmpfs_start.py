"""Audit 3 M5: a daemon starts on a full tmpfs (degraded, serving) instead of exiting.

node1's memory dir is on an 8 MiB tmpfs of its own. node0 coordinates step-1 and node1
holds a copy. While node1 is down, step-1 is removed on node0 (the mark is pending for
node1), and another process fills node1's tmpfs (as DataLoader workers or NCCL fill a
shared /dev/shm). node1 restarts: pulling node0's manifests brings the delete mark,
whose journal write fails with ENOSPC. It used to exit with a traceback; now the mark is
kept in memory and applied (which frees space), node1 serves, and the journal write is
retried until the mark is on disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierckpt.daemon_client import DaemonClient

from tests.support.cli import cli_json, ls_ids
from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_ports
from tests.support.raw_rpc import raw_save

pytestmark = pytest.mark.integration

NS = "full-tmpfs"


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test (root only), unmounted afterwards."""
    where = Path(tempfile.mkdtemp(prefix="tcfull"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(where)


def _fill(directory: Path) -> int:
    """Write a file until the filesystem is full; its size."""
    written = 0
    chunk = b"\0" * (64 << 10)
    with open(directory / "filler", "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
        with contextlib.suppress(OSError):
            while True:  # the last partial pages
                written += f.write(b"\0" * 512)
    return written


def test_a_daemon_starts_on_a_full_tmpfs_and_takes_the_marks_it_missed(
    small_tmpfs: Path,
) -> None:
    ports = free_ports(2)
    ids = ["node0", "node1"]
    daemons: list[DaemonProcess] = []
    try:
        for i in range(2):
            config: dict[str, object] = {
                "node": {"id": ids[i], "failure_domain": f"rack{i}"},
                "listen": {"peer": f"127.0.0.1:{ports[i]}"},
                "replication": {"copies": 1, "heal_interval": 2.0},  # heals retry a push
                "memory": {"budget": "4MiB"},
                "peers": [
                    {
                        "id": ids[1 - i],
                        "address": f"127.0.0.1:{ports[1 - i]}",
                        "failure_domain": f"rack{1 - i}",
                    },
                ],
            }
            if i == 1:
                config["memory"] = {"budget": "4MiB", "dir": str(small_tmpfs / "mem")}
            daemons.append(DaemonProcess(config, name=ids[i], start=False))
        for d in daemons:
            d.start(timeout=120.0)
        node0, node1 = daemons
        client = DaemonClient(node0.address, timeout_s=60)
        try:
            raw_save(client, NS, "step-1", {".metadata": b"m" * 100, "__0_0.distcp": b"d" * 65536})
        finally:
            client.close()
        deadline = time.monotonic() + 60
        while not (node1.data_dir(NS, "step-1") / "__0_0.distcp").exists():
            assert time.monotonic() < deadline, node1.log_tail(40)
            time.sleep(0.2)

        node1.kill9()
        removed = cli_json(node0.address, "rm", NS, "step-1")
        assert removed["peers_pending"] == ["node1"], removed
        _fill(small_tmpfs)
        node1.start(timeout=120.0)  # used to exit: "...full (writing the manifest marks.json)"

        assert "step-1" not in ls_ids(node1.address, NS)
        assert not node1.data_dir(NS, "step-1").exists()
        journal = node1.memory_dir / "marks.json"
        deadline = time.monotonic() + 60
        while not (journal.exists() and "step-1" in journal.read_text()):
            assert time.monotonic() < deadline, node1.log_tail(40)
            time.sleep(0.2)
        assert "cannot write the marks journal" in node1.log_path.read_text()
    finally:
        for d in daemons:
            d.cleanup()
