"""`[security] local_isolation = "uid"` against a real daemon, with real clients running
as two unprivileged uids (audit H1): uid 1001 saves into jobA; uid 1002, in the same
group and so able to connect to the socket, can neither call anything on jobA nor see it
nor open its files by path; root (the CLI) can; a call without a session token is
UNAUTHENTICATED; ownership survives a restart and clients log in again by themselves.

The tests run as root: each client is a subprocess started with setgroups/setgid/setuid
(subprocess's user=/group=/extra_groups=), which is what a training job of another user
on the same node is. Its interpreter must be one those uids may run (a venv on a
Python under /root is not): the system Python of the same version with this venv's
site-packages added, when sys.executable is out of their reach.
"""

from __future__ import annotations

import functools
import json
import os
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.daemon_client import DaemonClient
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tests.support.cli import cli_json
from tests.support.daemon_process import DaemonProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other uids: needs root"),
]

A, B, GID = 1001, 1002, 4242
DATA = b"weights of job A " * 4096

# A client process: runs (op, *args) steps through the real DaemonClient and prints one
# JSON result per step: {"ok": value} | {"error": exception class} | {"errno": name}.
_CLIENT = r"""
import errno, json, os, sys
from tierckpt.checksum import checksum_bytes
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import TierckptError
from tests.support.raw_rpc import raw_save

address, steps = sys.argv[1], json.loads(sys.argv[2])
client = DaemonClient(address, timeout_s=20)
ZERO = checksum_bytes(b"")


def read(path):
    with open(path, "rb") as f:
        return len(f.read())


OPS = {
    "save": lambda ns, cid, text: raw_save(client, ns, cid, {"__0_0.distcp": text.encode() * 4096}),
    "get": lambda ns: [f.local_path for f in client.get_checkpoint(ns).files],
    "load": lambda ns: sum(read(f.local_path) for f in client.get_checkpoint(ns).files),
    "list": lambda ns: [[c.namespace, c.checkpoint_id] for c in client.list_checkpoints(ns)],
    "status": lambda: sorted(client.status().namespaces),
    "begin": lambda ns, cid: client.begin_checkpoint(ns, cid, 0),
    "reserve": lambda ns, cid: client.reserve_space(ns, cid, 0, 1),
    "open": lambda ns, cid: client.open_file(ns, cid, "x", 0).path,
    "commit_file": lambda ns, cid: client.commit_file(ns, cid, "x", 0, 0, ZERO),
    "commit": lambda ns, cid: client.commit_checkpoint(ns, cid, []).checkpoint_id,
    "abort": lambda ns, cid: client.abort_checkpoint(ns, cid),
    "delete": lambda ns, cid: client.delete_checkpoint(ns, cid),
    "pin": lambda ns, cid: client.pin_checkpoint(ns, cid).pinned,
    "verify": lambda ns, cid: client.verify_checkpoint(ns, cid)[0],
    "ensure_local": lambda ns, cid: client.ensure_local(ns, cid, "__0_0.distcp").local_path,
    "read": read,
    "listdir": lambda path: sorted(os.listdir(path)),
}
out = []
for op, *args in steps:
    try:
        out.append({"ok": OPS[op](*args)})
    except TierckptError as e:
        out.append({"error": type(e).__name__, "message": str(e)[:400]})
    except OSError as e:
        out.append({"errno": errno.errorcode.get(e.errno, str(e.errno))})
print(json.dumps(out))
"""


_SITE = "import site, sys; [site.addsitedir(d) for d in sys.argv.pop(1).split(os.pathsep)]\n"
# The checkout's root, so that a client imports `tests.support` (its save is `raw_save`).
_ROOT = str(Path(__file__).resolve().parents[2])


def _run_as(uid: int, python: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            python,
            "-s",
            "-c",
            "import os\n" + _SITE + code,
            os.pathsep.join([*site.getsitepackages(), _ROOT]),
            *args,
        ],
        user=uid,
        group=GID,
        extra_groups=[GID],
        cwd="/",
        env={"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@functools.cache
def client_python() -> str:
    """An interpreter uid 1001 can run that imports this checkout's tierckpt."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        try:
            if _run_as(A, python, "import grpc, tierckpt").returncode == 0:
                return python
        except OSError:  # not there, or not executable by uid A
            continue
    pytest.skip(f"no {version} that uid {A} may run imports tierckpt (the venv's is private)")


def as_uid(uid: int, daemon: DaemonProcess, *steps: list[Any]) -> list[dict[str, Any]]:
    """Run `steps` in a client process with uid `uid`, in the daemon's group."""
    proc = _run_as(uid, client_python(), _CLIENT, daemon.address, json.dumps(steps))
    assert proc.returncode == 0, f"client as uid {uid} failed:\n{proc.stderr}"
    results: list[dict[str, Any]] = json.loads(proc.stdout)
    return results


def share_sockets(daemon: DaemonProcess) -> None:
    """The daemon (root) made its sockets root:root 0660; the tenants' group gets them,
    as systemd's Group= does in a deployment."""
    for path in (daemon.socket_path, Path(f"{daemon.socket_path}.login")):
        os.chown(path, 0, GID)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """An isolating daemon whose socket and memory dir the group GID may use, with jobA
    saved by uid 1001."""
    proc = DaemonProcess(
        # root (the CLI below) is an operator only because it is listed (audit 3 L3).
        {"security": {"local_isolation": "uid", "operators": [0]}},
        name="iso",
        start=False,
    )
    try:
        for d in (proc.base_dir, proc.memory_dir):
            d.mkdir(exist_ok=True)
            os.chown(d, 0, GID)
            os.chmod(d, 0o2750)
        proc.start()
        share_sockets(proc)
        [saved] = as_uid(A, proc, ["save", "jobA", "step-1", "weights of job A "])
        assert saved == {"ok": "step-1"}, saved
        yield proc
    finally:
        proc.cleanup()


def test_other_uid_is_refused_every_call_on_a_namespace_it_does_not_own(
    daemon: DaemonProcess,
) -> None:
    refused = [
        ["get", "jobA"],
        ["load", "jobA"],
        ["list", "jobA"],
        ["begin", "jobA", "step-2"],
        ["reserve", "jobA", "step-1"],
        ["open", "jobA", "step-1"],
        ["commit_file", "jobA", "step-1"],
        ["commit", "jobA", "step-1"],
        ["abort", "jobA", "step-1"],
        ["delete", "jobA", "step-1"],
        ["pin", "jobA", "step-1"],
        ["verify", "jobA", "step-1"],
        ["ensure_local", "jobA", "step-1"],
    ]
    [a_paths] = as_uid(A, daemon, ["get", "jobA"])
    path = a_paths["ok"][0]
    results = as_uid(
        B,
        daemon,
        *refused,
        ["list", ""],
        ["status"],
        ["read", path],
        ["listdir", str(daemon.memory_dir / "data")],
        ["listdir", str(daemon.memory_dir / "data" / "jobA")],
        ["listdir", str(daemon.memory_dir / "manifests")],
        ["listdir", str(daemon.memory_dir / "pool")],
        ["save", "jobB", "step-1", "weights of job B "],
        ["list", ""],
    )
    for step, result in zip(refused, results, strict=False):
        assert result.get("error") == "PermissionDenied", (step, result)
        assert "uid 1002" in result["message"] and "uid 1001" in result["message"], result
        assert "'jobA'" in result["message"]
    listed, status, read, *listdirs, saved, listed_after = results[len(refused) :]
    assert listed == {"ok": []} and status == {"ok": []}
    assert read == {"errno": "EACCES"}, "uid 1002 opened jobA's file by path"
    assert listdirs == [{"errno": "EACCES"}] * 4
    assert saved == {"ok": "step-1"}  # its own namespace works as before
    assert listed_after == {"ok": [["jobB", "step-1"]]}

    # The owner: everything on jobA, and nothing of jobB.
    own = as_uid(
        A, daemon, ["load", "jobA"], ["read", path], ["list", ""], ["status"], ["get", "jobB"]
    )
    assert own[:4] == [
        {"ok": len(DATA)},
        {"ok": len(DATA)},
        {"ok": [["jobA", "step-1"]]},
        {"ok": ["jobA"]},
    ]
    assert own[4]["error"] == "PermissionDenied"

    # root is an operator: the CLI sees and may act on every namespace.
    assert [c["id"] for c in cli_json(daemon.address, "ls", "jobA")] == ["step-1"]
    assert cli_json(daemon.address, "status")["namespaces"] == ["jobA", "jobB"]


def test_a_call_without_a_session_is_unauthenticated(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket_path}") as channel:
        stub = daemon_pb2_grpc.DaemonServiceStub(channel)
        for call in (
            lambda: stub.GetStatus(daemon_pb2.GetStatusRequest(), timeout=10),
            lambda: stub.GetCheckpoint(common_pb2.CheckpointRef(namespace="jobA"), timeout=10),
            lambda: stub.GetStatus(
                daemon_pb2.GetStatusRequest(),
                timeout=10,
                metadata=[("x-tierckpt-session", "forged-token")],
            ),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "session" in e.value.details() and "log" in e.value.details()
        # Health stays open: probes carry no session.
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_ownership_survives_a_restart_and_clients_log_in_again(daemon: DaemonProcess) -> None:
    client = DaemonClient(daemon.address, timeout_s=20)  # root: an operator
    assert "jobA" in client.status().namespaces
    daemon.terminate()
    daemon.start()
    share_sockets(daemon)
    # The restarted daemon forgot every session: the same client logs in again unasked.
    assert "jobA" in client.status().namespaces
    client.close()
    b, a = as_uid(B, daemon, ["get", "jobA"]), as_uid(A, daemon, ["load", "jobA"])
    assert b[0].get("error") == "PermissionDenied", b
    assert a == [{"ok": len(DATA)}]
