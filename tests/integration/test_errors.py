"""Bad input and unavailable daemons surface as prompt, precise exceptions, never hangs.

Single-process cases run in the test process without a process group (DCP forces
`no_dist`), where errors may arrive raw or inside `CheckpointException`; multi-rank cases
check that every rank raises. Loads may see DCP re-raise a metadata error as an
`AssertionError` carrying the message (see tests/support/errors.py).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from tierckpt import (
    CheckpointExists,
    CheckpointNotFound,
    DaemonUnavailable,
    InvalidArgument,
    InvalidName,
    MemoryBudgetExceeded,
)
from tierckpt.daemon_client import DaemonClient

from tests.support import jobs
from tests.support.backends import Tiered
from tests.support.cli import cli_json, ls_ids, ls_json
from tests.support.dist_job import run_job
from tests.support.errors import assert_error, capture
from tests.support.raw_rpc import write_files
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

NS = "errs"
BUDGET_PATTERN = r"memory[ ._]budget"


def _all_paths(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_invalid_namespace_is_refused_and_writes_nothing(daemon: Any) -> None:
    before = _all_paths(daemon.base_dir)
    state = plain_tensor_state(1, 4096)
    exc = capture(lambda: Tiered("../evil", daemon.address).save(state, "step-1"), within=30)
    assert_error(exc, InvalidName, r"namespace.*\.\./evil")
    exc = capture(lambda: Tiered("../evil", daemon.address).load(state, "step-1"), within=30)
    assert_error(exc, InvalidName, r"namespace.*\.\./evil", load=True)
    # Nothing escaped the memory dir, and nothing new was written inside it.
    assert not (daemon.base_dir / "evil").exists()
    assert not (daemon.memory_dir.parent / "evil").exists()
    created = set(_all_paths(daemon.base_dir)) - set(before)
    assert not [p for p in created if "evil" in p], created


@pytest.mark.parametrize("bad_id", ["../step-1", "step 1", "..", "a//b", "a/../b", "/a"])
def test_invalid_checkpoint_id_is_refused(daemon: Any, bad_id: str) -> None:
    backend = Tiered(NS, daemon.address)
    state = plain_tensor_state(1, 4096)
    exc = capture(lambda: backend.save(state, bad_id), within=30)
    assert_error(exc, InvalidName, "checkpoint id")
    exc = capture(lambda: backend.load(state, bad_id), within=30)
    assert_error(exc, InvalidName, "checkpoint id", load=True)
    assert ls_json(daemon.address, NS, include_all=True) == []


def test_latest_is_refused_as_a_new_checkpoint_id_by_the_daemon(daemon: Any) -> None:
    """`tierckpt://<namespace>/latest` means the newest checkpoint, so the daemon refuses
    to create one under that id, whatever the client (the check is at BeginCheckpoint)."""
    backend = Tiered(NS, daemon.address)
    state = plain_tensor_state(1, 4096)
    exc = capture(lambda: backend.save(state, "latest"), within=30)
    assert_error(exc, InvalidName, r"'latest' is reserved")  # the writer checks first
    client = DaemonClient(daemon.address)
    with pytest.raises(InvalidArgument, match=r"'latest' is reserved"):  # any other client
        write_files(client, NS, "latest", {"__0_0.distcp": b"x" * 10})
    client.close()
    assert ls_json(daemon.address, NS, include_all=True) == []
    backend.save(state, "latest-000001")  # only the exact id is taken
    assert ls_ids(daemon.address, NS) == ["latest-000001"]


def test_reusing_a_committed_id_without_overwrite_fails_on_every_rank_and_keeps_the_first(
    daemon: Any, tmp_path: Path
) -> None:
    backend = Tiered(NS, daemon.address, overwrite=False)  # immutable ids, as asked
    first = str(tmp_path / "exp" / "first")
    results = run_job(
        jobs.run_steps,
        2,
        backend,
        [
            ("save", "step-000100", first, 81),
            ("save_fails", "step-000100", 82, "CheckpointExists", "step-000100"),
            ("load", "step-000100", first),
        ],
        timeout=90,
    )
    for rank_result in results:
        failure = rank_result[1]
        assert failure["outer"] in ("CheckpointException", "CheckpointExists"), failure
    assert ls_ids(daemon.address, NS) == ["step-000100"]


def test_reusing_a_committed_id_without_overwrite_without_pg(daemon: Any) -> None:
    backend = Tiered(NS, daemon.address, overwrite=False)
    state = plain_tensor_state(1, 64 << 10)
    expected = snapshot(state)
    backend.save(state, "step-1")
    exc = capture(lambda: backend.save(plain_tensor_state(2, 64 << 10), "step-1"), within=30)
    assert_error(exc, CheckpointExists, "step-1")
    target = plain_tensor_state(3, 64 << 10)
    backend.load(target, "step-1")
    assert_state_equal(actual=target, expected=expected, what="first step-1 after a refused reuse")


def _usage(address: str) -> int:
    status = cli_json(address, "status")
    return int(status["used_bytes"]) + int(status["reserved_bytes"])


def _wait_usage(address: str, expected: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (usage := _usage(address)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return usage


def test_save_over_budget_fails_naming_the_budget(daemon_factory: Any) -> None:
    daemon = daemon_factory({"memory": {"budget": "4MiB"}})
    backend = Tiered(NS, daemon.address)
    small = plain_tensor_state(1, 1 << 20)
    expected = snapshot(small)
    backend.save(small, "step-000001")
    usage_before = _usage(daemon.address)

    big = plain_tensor_state(2, 8 << 20)
    exc = capture(lambda: backend.save(big, "step-000002"), within=30)
    assert_error(exc, MemoryBudgetExceeded, BUDGET_PATTERN)

    assert ls_ids(daemon.address, NS) == ["step-000001"]
    # `ls --all` may still show the refused save as an uncommitted entry until it is
    # collected; it must never be COMMITTED.
    states = {r["id"]: r["state"] for r in ls_json(daemon.address, NS, include_all=True)}
    assert states.get("step-000002") != "COMMITTED", states
    failed_dir = daemon.data_dir(NS, "step-000002")
    leftover = (
        sum(p.stat().st_size for p in failed_dir.rglob("*") if p.is_file())
        if failed_dir.exists()
        else 0
    )
    assert leftover == 0, f"{leftover} bytes of the refused save in {failed_dir}"
    assert _wait_usage(daemon.address, usage_before) == usage_before, "reservation leaked"

    target = plain_tensor_state(3, 1 << 20)
    backend.load(target, "step-000001")
    assert_state_equal(actual=target, expected=expected, what="checkpoint before the refused save")
    exc = capture(lambda: backend.load(plain_tensor_state(4, 1 << 20), "step-000002"), within=30)
    assert_error(exc, CheckpointNotFound, "step-000002", load=True)


def test_save_over_budget_fails_on_every_rank(daemon_factory: Any) -> None:
    # The FSDP2 state (about 6 MiB) does not fit a 4 MiB budget: every rank must raise,
    # promptly, and the daemon must hold nothing of it afterwards.
    daemon = daemon_factory({"memory": {"budget": "4MiB"}})
    backend = Tiered(NS, daemon.address)
    run_job(
        jobs.run_steps,
        2,
        backend,
        [("save_fails", "step-000001", 91, "MemoryBudgetExceeded", BUDGET_PATTERN)],
        timeout=90,
    )
    assert ls_ids(daemon.address, NS) == []
    assert _wait_usage(daemon.address, 0) == 0, "memory still accounted to the refused save"


def test_unknown_id_is_not_found_and_names_the_newest(daemon: Any) -> None:
    backend = Tiered(NS, daemon.address)
    for seed, cid in [(1, "step-000100"), (2, "step-000200")]:
        backend.save(plain_tensor_state(seed, 4096), cid)
    exc = capture(lambda: backend.load(plain_tensor_state(3, 4096), "step-000150"), within=30)
    found = assert_error(exc, CheckpointNotFound, "step-000150", load=True)
    assert all("step-000200" in str(e) for e in found), found


def _unavailable_pattern(address: str) -> str:
    # The message must say what is wrong: the address, or that the daemon is unreachable.
    return rf"{re.escape(address.removeprefix('unix://'))}|unavailable|not reachable"


def test_daemon_not_running_is_unavailable_quickly(tmp_path: Path) -> None:
    address = f"unix://{tmp_path / 'nobody.sock'}"
    backend = Tiered(NS, address)
    state = plain_tensor_state(1, 4096)
    exc = capture(lambda: backend.save(state, "step-1"), within=15)
    assert_error(exc, DaemonUnavailable, _unavailable_pattern(address))
    exc = capture(lambda: backend.load(state, "step-1"), within=15)
    assert_error(exc, DaemonUnavailable, _unavailable_pattern(address), load=True)


def test_daemon_not_running_fails_every_rank_quickly(tmp_path: Path) -> None:
    address = f"unix://{tmp_path / 'nobody.sock'}"
    started = time.monotonic()
    run_job(
        jobs.run_steps,
        2,
        Tiered(NS, address),
        [("save_fails", "step-1", 1, "DaemonUnavailable", _unavailable_pattern(address))],
        timeout=60,
    )
    assert time.monotonic() - started < 45


def test_daemon_killed_is_unavailable_quickly(daemon: Any) -> None:
    backend = Tiered(NS, daemon.address)
    state = plain_tensor_state(1, 4096)
    backend.save(state, "step-1")
    daemon.kill9()
    pattern = _unavailable_pattern(daemon.address)
    exc = capture(lambda: backend.load(plain_tensor_state(2, 4096), "step-1"), within=15)
    assert_error(exc, DaemonUnavailable, pattern, load=True)
    exc = capture(lambda: backend.save(state, "step-2"), within=15)
    assert_error(exc, DaemonUnavailable, pattern)
