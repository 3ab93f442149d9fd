"""The `tierckpt` console script end to end against a real daemon."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt import CheckpointNotFound, ChecksumMismatch
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tests.support import jobs
from tests.support.backends import Directory, Tiered
from tests.support.cli import cli, cli_json, ls_ids, ls_json
from tests.support.dist_job import run_job
from tests.support.errors import assert_error, capture
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = pytest.mark.integration

NS = "clins"
GiB = 1 << 30


def _on_disk(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}


def _save_plain(daemon: Any, ids: list[str], nbytes: int = 128 << 10) -> dict[str, Any]:
    backend = Tiered(NS, daemon.address)
    expected = {}
    for seed, cid in enumerate(ids, start=1):
        state = plain_tensor_state(seed, nbytes)
        expected[cid] = snapshot(state)
        backend.save(state, cid)
    return expected


def test_ls_json_lists_committed_checkpoints_with_their_fields(daemon: Any) -> None:
    started = time.time()
    _save_plain(daemon, ["step-000001", "step-000002"])
    rows = ls_json(daemon.address, NS)
    assert sorted(r["id"] for r in rows) == ["step-000001", "step-000002"]
    for row in rows:
        assert row["state"] == "COMMITTED", row
        on_disk = _on_disk(daemon.data_dir(NS, row["id"]))
        assert row["files"] == len(on_disk) and ".metadata" in on_disk, (row, on_disk)
        assert row["bytes"] == sum(on_disk.values()), (row, on_disk)
        assert started - 5 <= float(row["created"]) <= time.time() + 5, row
    # The human listing names the same checkpoints.
    text = cli(daemon.address, "ls", NS).stdout
    assert "step-000001" in text and "step-000002" in text
    assert ls_json(daemon.address, "no-such-ns") == []


def test_rm_removes_the_checkpoint_and_its_files(daemon: Any) -> None:
    expected = _save_plain(daemon, ["step-000001", "step-000002"])
    cli(daemon.address, "rm", NS, "step-000001")
    assert ls_ids(daemon.address, NS) == ["step-000002"]
    assert ls_ids(daemon.address, NS, include_all=True) == ["step-000002"]
    assert not daemon.data_dir(NS, "step-000001").exists()
    assert not daemon.manifest_path(NS, "step-000001").exists()

    backend = Tiered(NS, daemon.address)
    exc = capture(lambda: backend.load(plain_tensor_state(9, 128 << 10), "step-000001"), within=30)
    assert_error(exc, CheckpointNotFound, "step-000001", load=True)
    # The other checkpoint is untouched.
    target = plain_tensor_state(9, 128 << 10)
    backend.load(target, "step-000002")
    assert_state_equal(actual=target, expected=expected["step-000002"], what="survivor of rm")
    # Removing it again is an error with a message, not a crash.
    again = cli(daemon.address, "rm", NS, "step-000001", check=False)
    assert again.returncode == 1, again
    assert "step-000001" in again.stderr and "Traceback" not in again.stderr, again.stderr


def test_rm_after_restart_removes_readopted_checkpoint(daemon: Any) -> None:
    _save_plain(daemon, ["step-000001"])
    daemon.kill9()
    daemon.start()
    cli(daemon.address, "rm", NS, "step-000001")
    assert ls_ids(daemon.address, NS, include_all=True) == []
    daemon.kill9()
    daemon.start()
    assert ls_ids(daemon.address, NS, include_all=True) == [], "rm did not survive a restart"


def _flip_a_byte(daemon: Any, checkpoint_id: str) -> Path:
    data_file = next(
        p for p in sorted(daemon.data_dir(NS, checkpoint_id).iterdir()) if p.suffix == ".distcp"
    )
    with open(data_file, "r+b") as f:
        f.seek(data_file.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return data_file


def test_verify_ok_then_detects_a_flipped_byte(daemon: Any) -> None:
    _save_plain(daemon, ["step-000001"])
    (row,) = ls_json(daemon.address, NS)
    report = cli_json(daemon.address, "verify", NS, "step-000001")
    assert report["ok"] is True, report
    assert report["verified_bytes"] == row["bytes"], report
    assert report["corrupt_files"] == []

    data_file = _flip_a_byte(daemon, "step-000001")
    bad = cli(daemon.address, "verify", NS, "step-000001", "--json", check=False)
    assert bad.returncode == 1, bad
    report = json.loads(bad.stdout)
    assert report["ok"] is False and report["corrupt_files"] == [data_file.name], report


def test_load_of_a_flipped_byte_fails_instead_of_returning_wrong_data(daemon: Any) -> None:
    # DESIGN invariant 2: every byte is verified when read; with a single copy the load
    # must fail with a checksum error naming the file.
    _save_plain(daemon, ["step-000001"], nbytes=1 << 20)
    data_file = _flip_a_byte(daemon, "step-000001")
    backend = Tiered(NS, daemon.address)
    exc = capture(lambda: backend.load(plain_tensor_state(9, 1 << 20), "step-000001"), within=30)
    assert_error(exc, ChecksumMismatch, re.escape(data_file.name))


def test_status_json_reports_node_budget_and_usage(daemon: Any) -> None:
    _save_plain(daemon, ["step-000001", "step-000002"])
    status = cli_json(daemon.address, "status")
    assert status["node"] == daemon.name
    assert status["budget_bytes"] == 2 * GiB
    assert Path(status["memory_dir"]) == daemon.memory_dir
    assert status["checkpoints"] == 2
    assert NS in status["namespaces"]
    committed = sum(r["bytes"] for r in ls_json(daemon.address, NS))
    assert status["used_bytes"] >= committed, (status, committed)
    assert status["reserved_bytes"] == 0, status


def test_cli_without_daemon_fails_fast_with_a_message(tmp_path: Path) -> None:
    address = f"unix://{tmp_path / 'nobody.sock'}"
    started = time.monotonic()
    proc = cli(address, "ls", NS, check=False, timeout=30)
    assert time.monotonic() - started < 20
    assert proc.returncode == 1, proc
    assert "nobody.sock" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_pull_output_loads_with_stock_filesystem_reader(daemon: Any, tmp_path: Path) -> None:
    backend = Tiered(NS, daemon.address)
    expected = tmp_path / "exp"
    run_job(jobs.save_only, 2, backend, ["step-000100"], str(expected), 101, timeout=90)
    dest = tmp_path / "pulled" / "step-000100"
    cli(daemon.address, "pull", NS, "step-000100", str(dest))
    # "One format everywhere": the pulled files are the memory tier's files, byte for byte.
    source = daemon.data_dir(NS, "step-000100")
    assert _on_disk(dest) == _on_disk(source)
    for name in _on_disk(source):
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name
    # Stock DCP reads it, at the saved world size and resharded into one process.
    run_job(
        jobs.load_and_verify,
        2,
        Directory(str(tmp_path / "pulled")),
        "step-000100",
        str(expected / "step-000100"),
        timeout=90,
    )
    run_job(
        jobs.load_plain_no_pg,
        1,
        Directory(str(tmp_path / "pulled")),
        "step-000100",
        str(expected / "step-000100"),
        use_pg=False,
        timeout=90,
    )


def test_pin_exempts_from_retention_until_unpinned(daemon_factory: Any) -> None:
    daemon = daemon_factory({"retention": {"memory_keep_last": 1}})
    _save_plain(daemon, ["step-000001"])
    row = cli_json(daemon.address, "pin", NS, "step-000001")
    assert row["id"] == "step-000001" and row["pinned"] is True
    _save_plain(daemon, ["step-000002"])
    assert ls_ids(daemon.address, NS) == ["step-000001", "step-000002"]
    daemon.kill9()  # the pin is in the manifest: it survives a crash
    daemon.start()
    _save_plain(daemon, ["step-000003"])
    assert ls_ids(daemon.address, NS) == ["step-000001", "step-000003"]
    assert cli_json(daemon.address, "unpin", NS, "step-000001")["pinned"] is False
    _save_plain(daemon, ["step-000004"])
    assert ls_ids(daemon.address, NS) == ["step-000004"]


# Timestamps a peer could publish before the daemon bounded them (audit L2): `ls` used to
# die with an OverflowError traceback on 1e308.
HOSTILE_TIMES = {
    "step-huge": 1e308,
    "step-inf": math.inf,
    "step-nan": math.nan,
    "step-neg": -1e12,
    "step-minus1": -1.0,
    "step-year-10000": 253402300800.0,
}


class _HostileDaemon(daemon_pb2_grpc.DaemonServiceServicer):
    """A real gRPC DaemonService that lists checkpoints with out-of-range timestamps."""

    def ListCheckpoints(self, request: Any, context: Any) -> Any:
        return daemon_pb2.ListCheckpointsResponse(
            checkpoints=[
                common_pb2.CheckpointInfo(
                    ref=common_pb2.CheckpointRef(namespace=request.namespace, checkpoint_id=cid),
                    state=common_pb2.COMMITTED,
                    size_bytes=1,
                    file_count=1,
                    created_unix=ts,
                    committed_unix=ts,
                    tiers=["memory"],
                )
                for cid, ts in HOSTILE_TIMES.items()
            ]
        )


@pytest.fixture
def hostile_daemon(tmp_path: Path) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    daemon_pb2_grpc.add_DaemonServiceServicer_to_server(_HostileDaemon(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_ls_survives_out_of_range_timestamps(hostile_daemon: str) -> None:
    proc = cli(hostile_daemon, "ls", NS, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert set(rows) == set(HOSTILE_TIMES), proc.stdout
    for cid in HOSTILE_TIMES:
        assert " invalid " in rows[cid], rows[cid]
    # --json stays strict JSON (no NaN/Infinity tokens): non-finite times become null.
    proc = cli(hostile_daemon, "ls", NS, "--json", check=False)
    assert proc.returncode == 0, proc
    parsed = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    created = {r["id"]: r["created"] for r in parsed}
    assert created["step-nan"] is None and created["step-inf"] is None
    assert created["step-huge"] == 1e308 and created["step-neg"] == -1e12


def test_folder_ids_work_in_every_command(daemon: Any, tmp_path: Path) -> None:
    expected = _save_plain(daemon, ["run1/step-10", "run1/step-20", "run2/step-10"])
    assert sorted(ls_ids(daemon.address, NS)) == ["run1/step-10", "run1/step-20", "run2/step-10"]
    for target in ([f"{NS}/run1"], [NS, "run1/"], [f"tierckpt://{NS}/run1/"]):
        rows = cli_json(daemon.address, "ls", *target)
        assert sorted(r["id"] for r in rows) == ["run1/step-10", "run1/step-20"], target
    assert "run1/step-20" in cli(daemon.address, "ls", NS, "run1").stdout
    info = cli(daemon.address, "info", f"tierckpt://{NS}/run1/step-20").stdout
    assert f"{NS}/run1/step-20: COMMITTED" in info, info
    assert f"{NS}/run1/step-20: COMMITTED" in cli(daemon.address, "info", NS, "run1/step-20").stdout

    dest = tmp_path / "pulled"
    cli(daemon.address, "pull", NS, "run1/step-20", str(dest))
    target = plain_tensor_state(9, 128 << 10)
    Directory(str(tmp_path)).load(target, "pulled")
    assert_state_equal(actual=target, expected=expected["run1/step-20"], what="pulled run1/step-20")

    cli(daemon.address, "rm", NS, "run1/step-10")
    assert sorted(ls_ids(daemon.address, NS)) == ["run1/step-20", "run2/step-10"]
    assert not daemon.data_dir(NS, "run1/step-10").exists()
    bad = cli(daemon.address, "rm", NS, "run1/../run2/step-10", check=False)
    assert bad.returncode != 0 and "checkpoint id" in bad.stderr, bad.stderr
    assert sorted(ls_ids(daemon.address, NS)) == ["run1/step-20", "run2/step-10"]
