"""Audit 3, H1 against a real daemon: a rank commits a decoder bomb as `.metadata` (the
170-byte memoized tuple, hashed as a frozenset element) with a persistent tier (moto).

The daemon answers Health all along, the drain refuses the file with a clear error, the
reader refuses it too, and after a restart the same `.metadata` is not decoded again:
the refusal is remembered in the memory dir (``where="drain-remembered"``), and a real
checkpoint saved after the restart drains while the decode counter stays at zero.

A memory bomb (16 MB of empty lists, 2 GiB for the old in-process decoder) is decoded in
the daemon's decoding child: the daemon's peak RSS hardly moves and it keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import UnsafeMetadata
from tierckpt.storage_reader import TieredStorageReader
from tierckptd.persistent.refusals import FILE_NAME, RefusedMetadata

from tests.integration.test_untrusted_metadata import metric
from tests.support import moto_s3
from tests.support.cli import ls_json
from tests.support.daemon_process import DaemonProcess
from tests.support.dcp_files import save_checkpoint
from tests.support.ports import free_ports
from tests.support.raw_rpc import raw_save
from tests.unit.tierckpt.test_metadata_bounds import bombs, list_bomb

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

REFUSED = 'tierckpt_refused_metadata_total{where="drain"}'
REMEMBERED = 'tierckpt_refused_metadata_total{where="drain-remembered"}'


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def node(s3: moto_s3.S3Bucket) -> Iterator[tuple[DaemonProcess, str]]:
    (metrics_port,) = free_ports(1)
    daemon = DaemonProcess(
        {
            "persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options)},
            "retention": {"memory_keep_last": 3},
            "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
        },
        name="bombed",
    )
    try:
        yield daemon, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        daemon.cleanup()


def healthy(daemon: DaemonProcess) -> None:
    """One Health call with a short deadline (the audit saw DEADLINE_EXCEEDED)."""
    with grpc.insecure_channel(daemon.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5.0
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def tiers(daemon: DaemonProcess, ns: str, cid: str) -> list[str]:
    rows = {row["id"]: row for row in ls_json(daemon.address, ns)}
    return list(rows[cid]["tiers"]) if cid in rows else []


def test_a_bomb_metadata_is_refused_once_and_stays_refused_across_a_restart(
    node: tuple[DaemonProcess, str], s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    daemon, metrics_url = node
    bomb = bombs()["frozenset"]
    assert len(bomb) < 170
    client = DaemonClient(daemon.address, timeout_s=30)
    try:
        raw_save(client, "bombed", "step-1", {"__0_0.distcp": b"d" * 4096, ".metadata": bomb})

        def refused_while_healthy() -> bool:
            healthy(daemon)  # every poll: the daemon answers while the drain decodes
            return "drain-failed" in client.get_checkpoint("bombed", "step-1").tiers

        wait_for(refused_while_healthy, "the drain's refusal")
        healthy(daemon)
        assert metric(metrics_url, REFUSED) == 1
        log = daemon.log_path.read_text()
        assert "bombed/step-1/.metadata: refused" in log and "expands to more than" in log
        fs = s3.fs()
        assert not fs.exists(f"{s3.name}/bombed/step-1/.metadata")

        # The reader uses the same bounded decoder: a clear error, at once.
        reader = TieredStorageReader("bombed", daemon=daemon.address)
        reader.reset("step-1")
        with pytest.raises(UnsafeMetadata, match=r"bombed/step-1/\.metadata.*expands to more"):
            reader.read_metadata()
        healthy(daemon)
    finally:
        client.close()

    assert daemon.terminate() == 0
    daemon.start()
    client = DaemonClient(daemon.address, timeout_s=30)
    try:
        wait_for(
            lambda: "refused before and has not changed" in daemon.log_path.read_text(),
            "the remembered refusal after the restart",
        )
        healthy(daemon)
        assert "drain-failed" in tiers(daemon, "bombed", "step-1")
        assert metric(metrics_url, REMEMBERED) == 1
        # A real checkpoint drains after the restart; the bomb was never decoded again.
        good = save_checkpoint(tmp_path / "good")
        names = [*good.data_names, ".metadata"]
        raw_save(client, "bombed", "step-2", {n: (good.directory / n).read_bytes() for n in names})
        wait_for(
            lambda: "persistent" in client.get_checkpoint("bombed", "step-2").tiers,
            "the good checkpoint to drain",
        )
        assert metric(metrics_url, REFUSED) == 0  # this process decoded no refused file
        assert metric(metrics_url, REMEMBERED) == 1
        assert "drain-failed" in tiers(daemon, "bombed", "step-1")
        restarted = daemon.log_path.read_text().split("===== start #2 =====")[1]
        lines = [line for line in restarted.splitlines() if "expands to more than" in line]
        assert lines and all("not decoded again" in line for line in lines), lines
        healthy(daemon)
    finally:
        client.close()


def test_the_refusal_record_holds_for_the_same_bytes_only(tmp_path: Path) -> None:
    """The record a restart reads: the refused bytes' fingerprint must match (a new save
    under the same id is decoded), entries of checkpoints gone are dropped, and a damaged
    record is set aside (refused files are then decoded again, still bounded)."""
    path = tmp_path / FILE_NAME
    alive = {("ns", "step-1"), ("ns", "step-2")}
    record = RefusedMetadata(path, alive.__contains__)
    record.remember(("ns", "step-1"), "xxh3:aaa", "ns/step-1/.metadata: refused (bomb)")
    record.remember(("ns", "step-2"), "xxh3:bbb", "ns/step-2/.metadata: refused (bomb)")
    again = RefusedMetadata(path, alive.__contains__)
    assert again.why(("ns", "step-1"), "xxh3:aaa") == "ns/step-1/.metadata: refused (bomb)"
    assert again.why(("ns", "step-1"), "xxh3:other") is None  # re-saved: decoded again
    alive.discard(("ns", "step-2"))  # deleted: its entry goes at the next write
    again.forget([("ns", "step-1")])  # SIGHUP's retry
    assert RefusedMetadata(path, alive.__contains__).keys() == []
    path.write_text('{"format": 1, "refused": [{"namespace": "../x"}]}')
    assert RefusedMetadata(path, alive.__contains__).keys() == []
    assert path.with_name(FILE_NAME + ".corrupt").exists()


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


def test_a_memory_bomb_metadata_leaves_the_daemon_small_and_serving(
    node: tuple[DaemonProcess, str], s3: moto_s3.S3Bucket
) -> None:
    daemon, metrics_url = node
    bomb = list_bomb(16_000_000)
    client = DaemonClient(daemon.address, timeout_s=60)
    try:
        healthy(daemon)
        before = peak_rss_kib(daemon.pid)
        raw_save(client, "lists", "step-1", {"__0_0.distcp": b"d" * 4096, ".metadata": bomb})

        def refused_while_healthy() -> bool:
            healthy(daemon)
            return "drain-failed" in client.get_checkpoint("lists", "step-1").tiers

        wait_for(refused_while_healthy, "the drain's refusal", timeout=180)
        healthy(daemon)
        grown = peak_rss_kib(daemon.pid) - before
        # The file's bytes pass through the daemon a few times (the write, the verified
        # read, the child's stdin); the 16M lists never do (the old decoder: 2 GiB).
        assert grown < 160 * 1024, f"the daemon's peak RSS grew by {grown} KiB"
        assert metric(metrics_url, REFUSED) == 1
        log = daemon.log_path.read_text()
        assert "lists/step-1/.metadata: refused" in log, daemon.log_tail()
        assert "containers and objects, the memory bound for its size" in log
        assert not s3.fs().exists(f"{s3.name}/lists/step-1/.metadata")
    finally:
        client.close()
