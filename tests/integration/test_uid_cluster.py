"""`[security] local_isolation = "uid"` across nodes (audit 3, H4 and L3): two isolating
daemons peering on 127.0.0.1, clients running as two unprivileged uids (setuid child
processes, as in test_uid_isolation.py).

- A namespace's owner travels with its manifests: uid 1002 can neither list, read, pin
  nor rm on node b what uid 1001 saved on node a, while 1001 uses its replica on b.
- A claim on a node that has not seen the namespace asks the peers: uid 1002 claiming on
  b a namespace uid 1001 claimed on a is refused, and the other way round (1002 first).
- A tenant's SetNamespace URL must lie under `[security] tenant_urls` for its own uid.
- uid 0 is no operator unless `[security] operators` lists it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import PermissionDenied

from tests.integration.test_uid_isolation import GID, _run_as, client_python, share_sockets
from tests.support import moto_s3
from tests.support.daemon_process import DaemonProcess
from tests.support.dcp_files import save_checkpoint
from tests.support.ports import free_ports

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other uids: needs root"),
]

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

A, B = 1001, 1002

# One client process: (op, *args) steps through the real DaemonClient, one JSON result
# per step: {"ok": value} | {"error": exception class, "message": text} | {"errno": name}.
_CLIENT = r"""
import errno, json, os, sys
from tierckpt.checksum import checksum_bytes
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import TierckptError

address, steps = sys.argv[1], json.loads(sys.argv[2])
client = DaemonClient(address, timeout_s=30)


def save(ns, cid, text):
    data = text.encode() * 4096
    client.begin_checkpoint(ns, cid, 0)
    client.reserve_space(ns, cid, 0, len(data))
    path = client.open_file(ns, cid, ".metadata", 0).path
    fd = os.open(path, os.O_WRONLY)
    os.write(fd, data)
    os.ftruncate(fd, len(data))
    os.close(fd)
    client.commit_file(ns, cid, ".metadata", 0, len(data), checksum_bytes(data))
    return client.commit_checkpoint(ns, cid, [".metadata"]).checkpoint_id


def save_dir(ns, cid, directory):
    # the files of a stock DCP checkpoint directory, saved as one rank would
    names = sorted(os.listdir(directory))
    client.begin_checkpoint(ns, cid, 0)
    client.reserve_space(ns, cid, 0, sum(os.path.getsize(os.path.join(directory, n)) for n in names))
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        path = client.open_file(ns, cid, name, 0).path
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, data)
        os.ftruncate(fd, len(data))
        os.close(fd)
        client.commit_file(ns, cid, name, 0, len(data), checksum_bytes(data))
    return client.commit_checkpoint(ns, cid, names).checkpoint_id


def load(ns, cid):
    info = client.get_checkpoint(ns, cid)
    out = b""
    for f in info.files:
        path = f.local_path or client.ensure_local(ns, cid, f.name).local_path
        with open(path, "rb") as fh:
            out += fh.read()
    return out[:23].decode()


OPS = {
    "save": save,
    "save_dir": save_dir,
    "load": load,
    "list": lambda ns: [c.checkpoint_id for c in client.list_checkpoints(ns)],
    "list_all": lambda: sorted({c.namespace for c in client.list_checkpoints("")}),
    "begin": lambda ns, cid: client.begin_checkpoint(ns, cid, 0) and "begun",
    "abort": lambda ns, cid: client.abort_checkpoint(ns, cid) or "aborted",
    "delete": lambda ns, cid: client.delete_checkpoint(ns, cid),
    "pin": lambda ns, cid: client.pin_checkpoint(ns, cid).pinned,
    "set_url": lambda ns, url: client.set_namespace(ns, persistent_url=url),
}
out = []
for op, *args in steps:
    try:
        value = OPS[op](*args)
        out.append({"ok": value if isinstance(value, (str, int, list, bool)) else str(value)})
    except TierckptError as e:
        out.append({"error": type(e).__name__, "message": str(e)[:600]})
    except OSError as e:
        out.append({"errno": errno.errorcode.get(e.errno, str(e.errno))})
print(json.dumps(out))
"""


def as_uid(uid: int, daemon: DaemonProcess, *steps: list[Any]) -> list[dict[str, Any]]:
    proc = _run_as(uid, client_python(), _CLIENT, daemon.address, json.dumps(steps))
    assert proc.returncode == 0, f"client as uid {uid} failed:\n{proc.stderr}"
    results: list[dict[str, Any]] = json.loads(proc.stdout)
    return results


def _isolating(name: str, config: dict[str, Any]) -> DaemonProcess:
    """A daemon with uid isolation whose sockets and dirs the tenants' group may use."""
    proc = DaemonProcess({"security": {"local_isolation": "uid"}, **config}, name=name, start=False)
    for d in (proc.base_dir, proc.memory_dir):
        d.mkdir(exist_ok=True)
        os.chown(d, 0, GID)
        os.chmod(d, 0o2750)
    return proc


def _start(*daemons: DaemonProcess) -> None:
    for d in daemons:
        d.start()
        share_sockets(d)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """Nodes a and b, peers of each other with one extra copy of every file; a lists
    root as an operator, b lists none (L3: root is then just another uid there)."""
    ports = free_ports(2)
    nodes = []
    for i, (name, operators) in enumerate((("a", [0]), ("b", []))):
        other = 1 - i
        nodes.append(
            _isolating(
                name,
                {
                    "node": {"id": name, "failure_domain": f"rack-{name}"},
                    "listen": {"peer": f"127.0.0.1:{ports[i]}"},
                    # Heal rounds re-push a copy a commit could not (b started after a).
                    "replication": {"copies": 1, "heal_interval": 1.0},
                    "retention": {"memory_keep_last": 8},
                    "security": {"local_isolation": "uid", "operators": operators},
                    "peers": [
                        {
                            "id": "ab"[other],
                            "address": f"127.0.0.1:{ports[other]}",
                            "failure_domain": f"rack-{'ab'[other]}",
                        }
                    ],
                },
            )
        )
    a, b = nodes
    try:
        _start(a, b)
        yield a, b
    finally:
        a.cleanup()
        b.cleanup()


def _wait_for(path: Path, *daemons: DaemonProcess, timeout: float = 60.0) -> None:
    """Until `path` exists (a manifest a peer published there), bounded."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        logs = "\n".join(d.log_tail(40) for d in daemons)
        assert time.monotonic() < deadline, f"{path} never appeared:\n{logs}"
        time.sleep(0.2)


def _denied(result: dict[str, Any], *words: str) -> None:
    assert result.get("error") == "PermissionDenied", result
    for word in words:
        assert word in result["message"], (word, result)


def test_the_owner_travels_with_the_manifest_to_every_node(
    pair: tuple[DaemonProcess, DaemonProcess],
) -> None:
    """uid 1001 saves on a; its replica on b is 1001's there too: 1002 can neither list,
    read, pin, rm nor claim it on b, and 1001 loads it on b (before: b knew no owner)."""
    a, b = pair
    assert as_uid(A, a, ["save", "teamjob", "step-1", "SECRET-WEIGHTS-OF-1001 "]) == [
        {"ok": "step-1"}
    ]
    _wait_for(b.memory_dir / "manifests" / "teamjob" / "step-1.json", a, b)  # the replica
    b_results = as_uid(
        B,
        b,
        ["list", "teamjob"],
        ["load", "teamjob", "step-1"],
        ["pin", "teamjob", "step-1"],
        ["delete", "teamjob", "step-1"],
        ["begin", "teamjob", "step-2"],
        ["list_all"],
    )
    for result in b_results[:5]:
        _denied(result, "uid 1002", "uid 1001", "'teamjob'")
    assert b_results[5] == {"ok": []}
    # The owner is the owner on b as well: its replica is its own to load there.
    assert as_uid(A, b, ["load", "teamjob", "step-1"], ["list", "teamjob"]) == [
        {"ok": "SECRET-WEIGHTS-OF-1001 "},
        {"ok": ["step-1"]},
    ]
    owner_on_b = (b.memory_dir / "owners" / "teamjob").read_text().split()
    assert owner_on_b == [str(A), "a"]  # uid, and the node where it was claimed
    # Nothing was removed anywhere.
    assert as_uid(A, a, ["list", "teamjob"]) == [{"ok": ["step-1"]}]


def test_a_claim_on_a_node_that_has_not_seen_the_namespace_asks_its_peers(
    pair: tuple[DaemonProcess, DaemonProcess],
) -> None:
    """The audit's e03 in both orders, before anything of the namespace was replicated:
    the first claim anywhere in the cluster wins, the second is refused."""
    a, b = pair
    # 1001 claims `claimed-on-a` on a (a Begin: no manifest exists anywhere yet).
    assert as_uid(A, a, ["begin", "claimed-on-a", "step-1"]) == [{"ok": "begun"}]
    assert not (b.memory_dir / "owners" / "claimed-on-a").exists()  # b has not seen it
    [refused] = as_uid(B, b, ["begin", "claimed-on-a", "step-1"])
    _denied(refused, "uid 1002", "uid 1001", "claimed on node a")
    # e03's order: 1002 squats `victimjob` on b first (begin, abort) ...
    assert as_uid(B, b, ["begin", "victimjob", "s0"], ["abort", "victimjob", "s0"]) == [
        {"ok": "begun"},
        {"ok": "aborted"},
    ]
    # ... then 1001 on a is refused there (the namespace is 1002's), so no checkpoint of
    # 1001 ever lands in a namespace 1002 owns on some node.
    [refused] = as_uid(A, a, ["save", "victimjob", "step-1", "SECRET-WEIGHTS-OF-1001 "])
    _denied(refused, "uid 1001", "uid 1002", "claimed on node b")
    assert as_uid(B, b, ["list", "victimjob"]) == [{"ok": []}]


def test_uid_0_is_an_operator_only_where_listed(
    pair: tuple[DaemonProcess, DaemonProcess],
) -> None:
    """L3: containers commonly run as root; uid 0 bypasses isolation only on a node whose
    `[security] operators` lists it (a), not by default (b)."""
    a, b = pair
    assert as_uid(A, a, ["save", "rootjob", "step-1", "weights of 1001 "]) == [{"ok": "step-1"}]
    _wait_for(b.memory_dir / "manifests" / "rootjob" / "step-1.json", a, b)
    root_a, root_b = DaemonClient(a.address), DaemonClient(b.address)
    try:
        assert [c.checkpoint_id for c in root_a.list_checkpoints("rootjob")] == ["step-1"]
        with pytest.raises(PermissionDenied, match="uid 0 may not.*uid 1001"):
            root_b.list_checkpoints("rootjob")
        with pytest.raises(PermissionDenied, match="uid 0 may not"):
            root_b.delete_checkpoint("rootjob", "step-1")
        assert "rootjob" not in root_b.status().namespaces
    finally:
        root_a.close()
        root_b.close()


def test_a_tenant_cannot_point_its_namespace_at_another_prefix(
    s3: moto_s3.S3Bucket,
) -> None:
    """e16: with `allowed_urls = [".../jobs"]`, uid 1001 pointed its namespace at teamB's
    prefix and listed, restored and rm'd teamB's checkpoints. Now a tenant's URL must lie
    under `tenant_urls` with its own uid; operators may still set any allowed URL."""
    daemon = _isolating(
        "iso-s3",
        {
            "persistent": {
                "url": s3.url("cluster"),
                "allowed_urls": [s3.url("jobs")],
                "storage_options": dict(s3.storage_options),
                "every": 100,
            },
            "security": {
                "local_isolation": "uid",
                "operators": [0],
                "tenant_urls": [s3.url("jobs", "{uid}")],
            },
        },
    )
    try:
        _start(daemon)
        results = as_uid(
            A,
            daemon,
            ["set_url", "llama", s3.url("jobs", "teamB")],
            ["set_url", "llama", s3.url("jobs", str(B))],
            ["set_url", "llama", s3.url("jobs", str(A), "llama")],
            ["set_url", "llama", ""],
        )
        _denied(results[0], "uid 1001", "tenant_urls", "teamB")
        _denied(results[1], "uid 1001", "tenant_urls")
        assert results[2:] == [{"ok": s3.url("jobs", str(A), "llama")}, {"ok": ""}]
        root = DaemonClient(daemon.address)  # an operator
        team_b = s3.url("jobs", "teamB")
        assert root.set_namespace("llama", persistent_url=team_b) == team_b
        root.close()
    finally:
        daemon.cleanup()


def test_a_namespace_is_not_adopted_from_a_bucket_that_names_another_owner(
    s3: moto_s3.S3Bucket,
) -> None:
    """e16's other half: cluster 1 drains uid 1002's `llama` into `jobs/teamB`; on cluster 2
    `llama` belongs to uid 1001, and even with its URL pointed at teamB's prefix (by an
    operator here) the stored manifest names uid 1002: the checkpoint is never adopted,
    so 1001 cannot list, restore or rm it, and teamB's objects stay in the bucket."""
    team_b = s3.url("jobs", "teamB")
    common = {
        "allowed_urls": [s3.url("jobs")],
        "storage_options": dict(s3.storage_options),
    }
    first = _isolating(
        "c1",
        {
            "persistent": {"url": team_b, "every": 1, **common},
            "security": {"local_isolation": "uid", "operators": [0]},
        },
    )
    second = _isolating(
        "c2",
        {
            "persistent": {
                "url": s3.url("cluster2"),
                "every": 100,
                "relist_interval": 0.0,
                **common,
            },
            "security": {"local_isolation": "uid", "operators": [0]},
        },
    )
    shared = Path(tempfile.mkdtemp(prefix="tc-dcp"))  # a stock DCP save the tenants can read
    try:
        save_checkpoint(shared)
        for path in (shared, *shared.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        _start(first)
        assert as_uid(B, first, ["save_dir", "llama", "step-1", str(shared)]) == [{"ok": "step-1"}]
        metadata = f"{s3.name}/jobs/teamB/llama/step-1/.metadata"
        fs = s3.fs()
        deadline = time.monotonic() + 60
        while not fs.exists(metadata):
            assert time.monotonic() < deadline, first.log_tail(40)
            time.sleep(0.3)
            fs.invalidate_cache()
        _start(second)
        assert as_uid(A, second, ["begin", "llama", "s0"], ["abort", "llama", "s0"]) == [
            {"ok": "begun"},
            {"ok": "aborted"},
        ]
        root = DaemonClient(second.address)
        assert root.set_namespace("llama", persistent_url=team_b) == team_b
        root.close()
        listed, loaded, removed = as_uid(
            A,
            second,
            ["list", "llama"],
            ["load", "llama", "step-1"],
            ["delete", "llama", "step-1"],
        )
        assert listed == {"ok": []}, listed
        assert loaded.get("error") in ("CheckpointNotFound", "PermissionDenied"), loaded
        assert removed.get("error") in ("CheckpointNotFound", "PermissionDenied"), removed
        assert "names uid 1002" in second.log_path.read_text()  # refused, and said why
        fs.invalidate_cache()
        assert fs.exists(metadata)  # teamB's checkpoint is untouched
    finally:
        first.cleanup()
        second.cleanup()
        shutil.rmtree(shared, ignore_errors=True)
