"""local_isolation = "uid": sessions, the login socket, the ownership policy and the
directory ACLs that back it, on a real catalog and memory tier (the caller uids are just
numbers here; tests/integration/test_uid_isolation.py runs real processes as them)."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.endpoint import login, login_path
from tierckpt.errors import InvalidName, MemoryBudgetExceeded, PermissionDenied
from tierckptd.catalog import Catalog
from tierckptd.rpc.health import Health
from tierckptd.rpc.local_access import (
    LocalAccess,
    Unauthenticated,
    open_local_access,
    release_isolation,
)
from tierckptd.rpc.local_login import LoginServer, Sessions
from tierckptd.rpc.servers import start_servers

from tests.support.daemon_parts import daemon_service
from tests.unit.tierckptd.conftest import FakeClock, MakeCatalog, Save

A, B = 1001, 1002
ACL = "system.posix_acl_access"


def _access(catalog: Catalog, **kwargs: object) -> LocalAccess:
    access = LocalAccess(
        catalog.tier,
        lambda ns: bool(catalog.list_checkpoints(ns, include_uncommitted=True)),
        node_id="node-a",
        operators={0},
        **kwargs,  # type: ignore[arg-type]
    )
    access.prepare()
    return access


def _acl_users(path: Path) -> set[int]:
    """Named-user entries of a directory's access ACL (tag 2)."""
    try:
        raw = os.getxattr(path, ACL)
    except OSError:
        return set()
    entries = [struct.unpack_from("<HHI", raw, 4 + 8 * i) for i in range((len(raw) - 4) // 8)]
    return {ident for tag, _, ident in entries if tag == 0x02}


# ---- sessions ---------------------------------------------------------------------------
def test_sessions_expire_after_ttl() -> None:
    clock = FakeClock()
    sessions = Sessions(ttl=10.0, clock=clock)
    token = sessions.issue(A)
    assert len(token) >= 40 and sessions.uid_of(token) == A
    assert sessions.uid_of("forged") is None
    clock.now += 9.9
    assert sessions.uid_of(token) == A
    clock.now += 0.2
    assert sessions.uid_of(token) is None and len(sessions) == 0


def test_sessions_bounded_lru_and_per_uid() -> None:
    sessions = Sessions(max_sessions=4, max_per_uid=2)
    a1, a2 = sessions.issue(A), sessions.issue(A)
    b1 = sessions.issue(B)
    a3 = sessions.issue(A)  # A's bound: A's least recently used goes, never B's
    assert sessions.uid_of(a1) is None and sessions.uid_of(b1) == B
    assert sessions.uid_of(a2) == A and sessions.uid_of(a3) == A
    c1, c2 = sessions.issue(7), sessions.issue(7)  # global bound: the LRU of all goes
    assert len(sessions) == 4
    assert sessions.uid_of(b1) is None  # b1 was least recently used
    assert {sessions.uid_of(t) for t in (a2, a3, c1, c2)} == {A, 7}


def test_login_socket_issues_a_token_for_the_callers_uid(tmp_path: Path) -> None:
    sessions = Sessions()
    server = LoginServer(tmp_path / "d.sock.login", sessions)
    server.start()
    try:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o660
        token = login(str(server.path))
        assert token is not None and sessions.uid_of(token) == os.geteuid()
        assert login(str(server.path)) not in (None, token)
    finally:
        server.stop()
    assert not server.path.exists()
    assert login(str(server.path)) is None  # nothing to log in to: no token, no error


# ---- the policy -------------------------------------------------------------------------
def test_begin_claims_a_fresh_namespace_for_its_uid(catalog: Catalog, save: Save) -> None:
    access = _access(catalog)
    access.authorize(A, "jobA", "BeginCheckpoint", begin=True)
    save(catalog, "jobA", "s1", {".metadata": b"m", "d": b"x" * 100})
    assert access.owner("jobA") == A
    access.authorize(A, "jobA", "GetCheckpoint")
    for method, begin in [("GetCheckpoint", False), ("DeleteCheckpoint", False)] + [
        ("BeginCheckpoint", True)
    ]:
        with pytest.raises(PermissionDenied, match=r"uid 1002 .*'jobA'.* uid 1001"):
            access.authorize(B, "jobA", method, begin=begin)
    access.authorize(0, "jobA", "DeleteCheckpoint")  # operators act on every namespace
    assert access.visible(B, ["jobA", "jobB"]) == set()
    assert access.visible(A, ["jobA", "jobB"]) == {"jobA"}
    assert access.visible(0, ["jobA", "jobB"]) == {"jobA", "jobB"}
    # A namespace nothing is in: lookups pass (the catalog says NOT_FOUND), no claim.
    access.authorize(B, "nothing", "GetCheckpoint")
    assert access.owner("nothing") is None
    with pytest.raises(InvalidName):
        access.authorize(B, "../x", "BeginCheckpoint", begin=True)


def test_unowned_namespace_with_checkpoints_is_for_operators(catalog: Catalog, save: Save) -> None:
    save(catalog, "adopted", "s1", {".metadata": b"m"})  # e.g. pulled from a peer
    access = _access(catalog)
    for uid in (A, B):
        with pytest.raises(PermissionDenied, match="no owner"):
            access.authorize(uid, "adopted", "BeginCheckpoint", begin=True)
        with pytest.raises(PermissionDenied, match="no owner"):
            access.authorize(uid, "adopted", "GetCheckpoint")
    access.authorize(0, "adopted", "GetCheckpoint")
    assert _acl_users(catalog.tier.data_root / "adopted") == set()
    # An operator assigns it by writing owners/<namespace>.
    (catalog.tier.root / "owners" / "adopted").write_text(f"{A}\n")
    access.authorize(A, "adopted", "GetCheckpoint")
    assert _acl_users(catalog.tier.data_root / "adopted") == {A}
    # A broken owner file is no owner: operators only.
    (catalog.tier.root / "owners" / "adopted").write_text("root\n")
    with pytest.raises(PermissionDenied, match="no owner"):
        access.authorize(A, "adopted", "GetCheckpoint")


def test_ownership_and_acls_survive_a_restart(make_catalog: MakeCatalog, save: Save) -> None:
    catalog = make_catalog()
    access = _access(catalog)
    access.authorize(A, "jobA", "BeginCheckpoint", begin=True)
    save(catalog, "jobA", "s1", {".metadata": b"m"})
    ns_dir = catalog.tier.data_root / "jobA"
    assert _acl_users(ns_dir) == {A}
    assert stat.S_IMODE(os.stat(ns_dir).st_mode) == 0o2750  # the mask; group entry is ---
    owners = catalog.tier.root / "owners" / "jobA"
    # The uid and the node of the claim (the claim travels with manifests: issue 22).
    assert owners.read_text() == f"{A} node-a\n" and stat.S_IMODE(owners.stat().st_mode) == 0o600
    catalog.tier.close()

    again = make_catalog()  # a restarted daemon on the same memory dir
    access = _access(again)
    assert access.owner("jobA") == A
    with pytest.raises(PermissionDenied):
        access.authorize(B, "jobA", "GetCheckpoint")
    assert _acl_users(again.tier.data_root / "jobA") == {A}
    # The next save's new checkpoint dir sits under the restricted namespace dir.
    access.authorize(A, "jobA", "BeginCheckpoint", begin=True)
    save(again, "jobA", "s2", {".metadata": b"m"})
    assert _acl_users(again.tier.data_root / "jobA") == {A}


def test_namespace_dir_recreated_after_delete_is_restricted_again(
    catalog: Catalog, save: Save
) -> None:
    access = _access(catalog)
    access.authorize(A, "jobA", "BeginCheckpoint", begin=True)
    save(catalog, "jobA", "s1", {".metadata": b"m"})
    catalog.delete("jobA", "s1")
    assert not (catalog.tier.data_root / "jobA").exists()
    save(catalog, "jobA", "s2", {".metadata": b"m"})
    assert _acl_users(catalog.tier.data_root / "jobA") == {A}
    # A namespace created by an operator (no owner) grants no tenant anything.
    save(catalog, "ops", "s1", {".metadata": b"m"})
    assert _acl_users(catalog.tier.data_root / "ops") == set()
    raw = os.getxattr(catalog.tier.data_root / "ops", ACL)
    assert struct.unpack_from("<HHI", raw, 4 + 8)[:2] == (0x04, 0)  # group::---


def test_each_uid_owns_a_bounded_number_of_namespaces(catalog: Catalog, save: Save) -> None:
    access = _access(catalog, max_namespaces_per_uid=2)
    for ns in ("n1", "n2"):
        access.authorize(A, ns, "BeginCheckpoint", begin=True)
        save(catalog, ns, "s1", {".metadata": b"m"})
    with pytest.raises(MemoryBudgetExceeded, match="uid 1001 owns 2 namespaces"):
        access.authorize(A, "n3", "BeginCheckpoint", begin=True)
    access.authorize(B, "n3", "BeginCheckpoint", begin=True)  # another uid is not affected
    catalog.delete("n1", "s1")  # an emptied namespace is released at the bound
    access.authorize(A, "n4", "BeginCheckpoint", begin=True)
    assert access.owner("n1") is None and access.owner("n4") == A


def test_caller_needs_a_live_session(catalog: Catalog) -> None:
    access = _access(catalog)
    with pytest.raises(Unauthenticated, match="carries no x-tierckpt-session"):
        access.caller([], "GetStatus")
    with pytest.raises(Unauthenticated, match="unknown or expired"):
        access.caller([("x-tierckpt-session", "forged")], "GetStatus")
    token = access.sessions.issue(A)
    assert access.caller([("other", "x"), ("x-tierckpt-session", token)], "GetStatus") == A


def test_turning_isolation_off_gives_the_group_its_access_back(
    catalog: Catalog, save: Save
) -> None:
    access = _access(catalog)
    access.authorize(A, "jobA", "BeginCheckpoint", begin=True)
    save(catalog, "jobA", "s1", {".metadata": b"m"})
    tier = catalog.tier
    assert _acl_users(tier.data_root / "jobA") == {A}
    assert open_local_access("", catalog, "node-a") is None
    for d in (tier.data_root, tier.manifest_root, tier.pool_dir, tier.data_root / "jobA"):
        with pytest.raises(OSError):
            os.getxattr(d, ACL)
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o2750
    release_isolation(tier)  # idempotent


# ---- the wire: login socket, interceptor and DaemonService ------------------------------
def test_login_path_only_for_unix_addresses() -> None:
    assert login_path("unix:///run/t/d.sock") == "/run/t/d.sock.login"
    assert login_path("unix:/run/t/d.sock") == "/run/t/d.sock.login"
    assert login_path("127.0.0.1:7000") is None


def test_client_logs_in_and_again_after_the_daemon_forgot_it(
    catalog: Catalog, tmp_path: Path
) -> None:
    access = _access(catalog)
    servers = start_servers(
        daemon_service(catalog, access=access), Health(), f"unix://{tmp_path}/d.sock", "", workers=4
    )
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "d.sock.login").st_mode) == 0o660
        client = DaemonClient(f"unix://{tmp_path}/d.sock", timeout_s=10)
        client.begin_checkpoint("jobR", "s1", 0)  # root: an operator, claims nothing
        assert access.owner("jobR") is None and len(access.sessions) == 1
        access.sessions._tokens.clear()  # what a restart does to every session
        access.sessions._by_uid.clear()
        assert client.status().namespaces == ("jobR",)  # logged in again, unasked
        assert len(access.sessions) == 1
        client.close()
    finally:
        servers.stop(0)
    assert not (tmp_path / "d.sock.login").exists()
