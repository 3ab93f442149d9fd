"""The audit's attacks on the local edge, re-run against a real daemon: they all fail.

H2 (symlinks planted in the memory dir are never followed, at commit, abort or restart),
H1's filesystem part (directories not group-writable, sealed files not writable by other
uids, pool segments never cross namespaces), M2 (budget and disk truth, on a real 4 MiB
tmpfs), M3 (a refused pin or commit is not half-applied), M5/L1 (bounded, fixed error
messages) and issue item 6 (a malformed-message flood keeps RSS flat).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.daemon_client import DaemonClient
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tests.support.raw_rpc import raw_save

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MiB = 1 << 20
OTHER_UID = 1001  # a training user of the daemon's group who is not the daemon
Stub = daemon_pb2_grpc.DaemonServiceStub


def _stub(daemon: Any) -> Stub:
    return Stub(grpc.insecure_channel(daemon.address))


def _ref(ns: str, cid: str) -> common_pb2.CheckpointRef:
    return common_pb2.CheckpointRef(namespace=ns, checkpoint_id=cid)


def _cs(data: bytes) -> common_pb2.BlockChecksums:
    cs = checksum_bytes(data)
    return common_pb2.BlockChecksums(
        algorithm=cs.algorithm, block_size=cs.block_size, block_digests=cs.digests
    )


def _error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def _open(stub: Stub, ns: str, cid: str, name: str, reserve: int) -> str:
    ref = _ref(ns, cid)
    stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref))
    if reserve:
        stub.ReserveSpace(daemon_pb2.ReserveSpaceRequest(ref=ref, bytes=reserve))
    return str(stub.OpenFile(daemon_pb2.OpenFileRequest(ref=ref, file_name=name)).path)


def _commit_file(stub: Stub, ns: str, cid: str, name: str, data: bytes) -> None:
    stub.CommitFile(
        daemon_pb2.CommitFileRequest(
            ref=_ref(ns, cid), file_name=name, size=len(data), checksums=_cs(data)
        )
    )


def _save(daemon: Any, ns: str, cid: str, data: bytes) -> str:
    """A one-file save (`raw_save`, the way a rank does it); the committed file's path."""
    client = DaemonClient(daemon.address)
    try:
        raw_save(client, ns, cid, {".metadata": data})
        [entry] = client.get_checkpoint(ns, cid).files
        return entry.local_path
    finally:
        client.close()


def _attempts(**calls: Callable[[], object]) -> dict[str, str]:
    """Run each call; "ok" or the errno name it failed with."""
    result = {}
    for name, call in calls.items():
        try:
            call()
            result[name] = "ok"
        except OSError as e:
            result[name] = errno.errorcode[e.errno or 0]
    return result


def _as_other_uid(base: Path, **calls: Callable[[], object]) -> dict[str, str]:
    """`_attempts(**calls)` in a forked child running as OTHER_UID in the daemon's group
    (the memory dir's gid), like a training user; the base dir opens for traversal."""
    os.chmod(base, 0o711)
    gid = os.stat(base / "mem").st_gid
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only os calls, then _exit
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(OTHER_UID)
            os.write(write_end, json.dumps(_attempts(**calls)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result: dict[str, str] = json.loads(raw)
    return result


# ---- H2: symlinks ---------------------------------------------------------------------
def test_data_file_replaced_by_a_symlink_is_never_followed(daemon: Any) -> None:
    secret = daemon.base_dir / "token"
    secret.write_bytes(b"t" * 30)
    secret.chmod(0o600)
    stub = _stub(daemon)
    path = Path(_open(stub, "job", "step-1", "__0_0.distcp", 4096))
    path.unlink()
    path.symlink_to(secret)
    cs = checksum_bytes(b"t" * 30)
    for size in (0, 30):
        err = _error(
            lambda size=size: stub.CommitFile(
                daemon_pb2.CommitFileRequest(
                    ref=_ref("job", "step-1"),
                    file_name="__0_0.distcp",
                    size=size,
                    checksums=_cs(b"t" * size)
                    if size
                    else common_pb2.BlockChecksums(
                        algorithm=cs.algorithm, block_size=cs.block_size
                    ),
                )
            )
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "symbolic link" in err.details() and "30" not in err.details()  # no size leak
    stub.AbortCheckpoint(_ref("job", "step-1"))
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_bytes() == b"t" * 30
    pool = daemon.memory_dir / "pool"
    assert all(stat.S_ISREG(p.lstat().st_mode) for p in pool.iterdir())
    # The next save gets a fresh file, never the link.
    path = Path(_open(stub, "job", "step-2", "__0_0.distcp", 4096))
    assert stat.S_ISREG(path.lstat().st_mode) and secret.read_bytes() == b"t" * 30


def test_restart_never_follows_planted_links(daemon: Any) -> None:
    _save(daemon, "app", "step-1", b"weights")
    target = Path(tempfile.mkdtemp(prefix="tgt", dir=daemon.base_dir))
    (target / "notes.txt").write_text("notes")
    (target / "app.json").write_text("{}")
    target2 = Path(tempfile.mkdtemp(prefix="tgt2", dir=daemon.base_dir))
    (target2 / "keepme").mkdir()
    (target2 / "keepme" / "x").write_text("x")
    mem = daemon.memory_dir
    (mem / "manifests" / "evil").symlink_to(target)
    (mem / "data" / "evil2").symlink_to(target2)
    (mem / "pool" / "seg-99@app").symlink_to(target2 / "keepme" / "x")
    daemon.kill9()
    daemon.start()
    assert sorted(p.name for p in target.iterdir()) == ["app.json", "notes.txt"]
    assert (target2 / "keepme" / "x").read_text() == "x"
    for link in ("manifests/evil", "data/evil2", "pool/seg-99@app"):
        assert not os.path.lexists(mem / link)
    assert _stub(daemon).GetCheckpoint(_ref("app", "")).ref.checkpoint_id == "step-1"


# ---- H1 (filesystem) and M2 "writes after commit" ---------------------------------------
def test_other_uids_cannot_change_the_memory_dir_or_committed_files(daemon: Any) -> None:
    path = _save(daemon, "job", "step-1", b"committed")
    for d in [daemon.memory_dir, *(p for p in daemon.memory_dir.rglob("*") if p.is_dir())]:
        assert not d.stat().st_mode & 0o022, d
    result = _as_other_uid(
        daemon.base_dir,
        read=lambda: os.close(os.open(path, os.O_RDONLY)),
        write=lambda: os.close(os.open(path, os.O_WRONLY)),
        unlink=lambda: os.unlink(path),
        replace=lambda: os.rename(path, path + ".x"),
        plant=lambda: os.symlink("/etc", os.path.join(os.path.dirname(path), "evil")),
        chmod=lambda: os.chmod(path, 0o666),
    )
    assert result == {
        "read": "ok",  # the group loads checkpoints
        "write": "EACCES",
        "unlink": "EACCES",
        "replace": "EACCES",
        "plant": "EACCES",
        "chmod": "EPERM",
    }
    assert Path(path).read_bytes() == b"committed"


def test_a_rank_that_keeps_its_fd_open_cannot_commit(daemon: Any) -> None:
    stub = _stub(daemon)
    path = _open(stub, "job", "step-1", ".metadata", 4096)
    data = b"m" * 100
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
        err = _error(lambda: _commit_file(stub, "job", "step-1", ".metadata", data))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "close the file before CommitFile" in err.details()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660  # still the rank's to finish
    finally:
        os.close(fd)
    _commit_file(stub, "job", "step-1", ".metadata", data)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o440
    result = _as_other_uid(daemon.base_dir, write=lambda: os.open(path, os.O_WRONLY))
    assert result == {"write": "EACCES"}


def test_pool_segments_never_carry_bytes_across_namespaces(daemon: Any) -> None:
    stub = _stub(daemon)
    _save(daemon, "victim", "step-1", b"SECRET-WEIGHTS" * 4096)
    stub.DeleteCheckpoint(_ref("victim", "step-1"))
    assert daemon.memory_dir.joinpath("pool").iterdir()
    ref = _ref("thief", "step-1")
    stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref))
    stub.ReserveSpace(daemon_pb2.ReserveSpaceRequest(ref=ref, bytes=1 * MiB))
    opened = stub.OpenFile(daemon_pb2.OpenFileRequest(ref=ref, file_name=".metadata"))
    assert opened.preallocated_bytes == 0
    assert Path(opened.path).read_bytes() == b""


# ---- M2: budget truth -------------------------------------------------------------------
def test_a_rank_cannot_commit_more_than_it_reserved(daemon: Any) -> None:
    stub = _stub(daemon)
    path = _open(stub, "job", "step-1", ".metadata", 1 * MiB)
    data = b"x" * (3 * MiB)
    Path(path).write_bytes(data)
    err = _error(lambda: _commit_file(stub, "job", "step-1", ".metadata", data))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rank 0's reservation has only 1.0 MiB left" in err.details()
    status = stub.GetStatus(daemon_pb2.GetStatusRequest())
    assert status.used_bytes == 0 and status.reserved_bytes == 1 * MiB


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A real 4 MiB tmpfs (the audit's ENOSPC setup); needs CAP_SYS_ADMIN. Without it the
    ENOSPC paths are still covered by tests/unit/tierckptd/test_manifest.py."""
    mount = Path(tempfile.mkdtemp(prefix="tcfs"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()


def _fill(path: Path) -> None:
    """Write `path` until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * 4096
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass


def test_budget_and_disk_truth_on_a_full_tmpfs(small_tmpfs: Path, daemon_factory: Any) -> None:
    daemon = daemon_factory({"memory": {"dir": str(small_tmpfs / "mem"), "budget": "64MiB"}})
    assert "is larger than the filesystem of the memory dir" in daemon.log_path.read_text()
    (small_tmpfs / "filler").write_bytes(b"\0" * (MiB // 2))
    stub = _stub(daemon)
    # Over-commit: two 2.5 MiB reservations on 3.5 MiB free cannot both pass.
    a, b = _ref("a", "step-1"), _ref("b", "step-1")
    for ref in (a, b):
        stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref))
    stub.ReserveSpace(daemon_pb2.ReserveSpaceRequest(ref=a, bytes=5 * MiB // 2))
    err = _error(
        lambda: stub.ReserveSpace(daemon_pb2.ReserveSpaceRequest(ref=b, bytes=5 * MiB // 2))
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "promised to reservations not written yet" in err.details()
    stub.AbortCheckpoint(b)
    # ENOSPC at the manifest: RESOURCE_EXHAUSTED naming the memory tier, no temp file, the
    # save still WRITING and committable once there is room.
    data = b"w" * (2 * MiB)
    path = stub.OpenFile(daemon_pb2.OpenFileRequest(ref=a, file_name=".metadata")).path
    Path(path).write_bytes(data)
    _commit_file(stub, "a", "step-1", ".metadata", data)
    _fill(small_tmpfs / "filler2")
    commit = daemon_pb2.CommitCheckpointRequest(ref=a, required_files=[".metadata"])
    err = _error(lambda: stub.CommitCheckpoint(commit))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "memory tier: the filesystem of" in err.details() and "is full" in err.details()
    manifests = daemon.memory_dir / "manifests" / "a"
    assert not manifests.exists() or list(manifests.iterdir()) == []
    listed = stub.ListCheckpoints(daemon_pb2.ListCheckpointsRequest(include_uncommitted=True))
    assert [c.state for c in listed.checkpoints] == [common_pb2.WRITING]
    (small_tmpfs / "filler2").unlink()
    assert stub.CommitCheckpoint(commit).state == common_pb2.COMMITTED
    # M3: a pin refused for ENOSPC is not applied in memory either.
    _fill(small_tmpfs / "filler2")
    pin = daemon_pb2.PinCheckpointRequest(ref=a, pinned=True)
    assert _error(lambda: stub.PinCheckpoint(pin)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not stub.GetCheckpoint(a).pinned
    assert [p.name for p in manifests.iterdir()] == ["step-1.json"]
    (small_tmpfs / "filler2").unlink()
    assert stub.PinCheckpoint(pin).pinned
    daemon.kill9()
    daemon.start()
    assert _stub(daemon).GetCheckpoint(a).pinned


# ---- M5 / L1 / issue item 6: the RPC edge ---------------------------------------------
def test_commit_with_200k_required_names_is_a_bounded_invalid_argument(daemon: Any) -> None:
    stub = _stub(daemon)
    ref = _ref("job", "step-1")
    stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref))
    log_before = daemon.log_path.stat().st_size
    names = [f"__{i}_0.distcp" for i in range(200_000)]
    err = _error(
        lambda: stub.CommitCheckpoint(
            daemon_pb2.CommitCheckpointRequest(ref=ref, required_files=names)
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == (
        "CommitCheckpoint: 200,000 required files, at most 100,000 per checkpoint"
    )
    err = _error(
        lambda: stub.CommitCheckpoint(
            daemon_pb2.CommitCheckpointRequest(ref=ref, required_files=names[:99_000])
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert len(err.details()) < 500 and "and 98,995 more" in err.details()
    assert daemon.log_path.stat().st_size - log_before < 10_000


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_malformed_flood_is_invalid_argument_and_keeps_rss_flat(daemon: Any) -> None:
    methods = [m.name for m in daemon_pb2.DESCRIPTOR.services_by_name["DaemonService"].methods]
    payloads = [b"\x0f", b"\x08", b"\x0a\x05ab", b"\xff" * 11]
    codes: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(daemon.address) as channel:
        calls = [channel.unary_unary(f"/tierckpt.v1.DaemonService/{m}") for m in methods]

        def flood(count: int) -> None:
            for start in range(0, count, 256):
                futures: list[Future[Any]] = [
                    calls[i % len(calls)].future(payloads[i % len(payloads)], timeout=30)
                    for i in range(start, min(start + 256, count))
                ]
                for f in futures:
                    code = f.exception().code()  # type: ignore[union-attr]
                    codes[code] = codes.get(code, 0) + 1

        flood(2_000)  # warm the daemon's allocator and thread pool first
        before = _rss(daemon.pid)
        flood(20_000)
        after = _rss(daemon.pid)
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT: 22_000}
    # grpcio's own deserializer leaked 15-19 KB per refused request: 300+ MiB here.
    assert after - before < 30 * MiB, f"RSS grew by {(after - before) / MiB:.1f} MiB"
    assert "Traceback" not in daemon.log_path.read_text()
